"""Lease physical GPUs for one process with ``flock`` on per-device lock files.

Snakemake's ``resources: gpu=N`` caps how many GPU jobs run at once but never says *which*
device a job may use. Each GPU job therefore calls :func:`lease_gpus` before CUDA initialises:
it takes an exclusive lock on ``<lock_dir>/gpu<i>.lock`` for the lowest free devices and sets
``CUDA_VISIBLE_DEVICES``. The lock file descriptors stay open for the life of the process, so
the kernel drops the locks on any exit, ``kill -9`` included; there is no stale state to clean.

Shell rules use the CLI, which leases and then ``exec``s the command with the lock inherited::

    python -m dflash_pipeline.gpu_lease --n 1 -- torchrun --nproc-per-node 1 train.py
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import shutil
import subprocess
import sys
import time

log = logging.getLogger(__name__)

_held_fds: list[int] = []  # open, locked lock files; closing them releases the devices
_env_set_by_us = False


def device_count() -> int:
    """``$DFLASH_GPU_COUNT`` if set, else the GPUs listed by ``nvidia-smi -L``, else 0."""
    if (value := os.environ.get("DFLASH_GPU_COUNT")) is not None:
        return int(value)
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if out.returncode != 0:
        return 0
    # MIG instances are listed as indented lines under their GPU; count the GPUs only.
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def set_device_count(count: int | None) -> None:
    """The node's GPU count from the config (``gpu.count``) for this process and the ones it starts, unless
    ``$DFLASH_GPU_COUNT`` already gives it; None: ``nvidia-smi`` decides."""
    if count is not None:
        os.environ.setdefault("DFLASH_GPU_COUNT", str(count))


def default_lock_dir() -> str:
    return os.environ.get("DFLASH_GPU_LOCK_DIR") or f"/tmp/dflash-gpu-locks-{os.getuid()}"


def _try_lock(path: str) -> int | None:
    """Return an fd holding an exclusive lock on ``path``, or None if another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())  # informational only
    return fd


def lease_gpus(
    n: int = 1, *, count: int | None = None, lock_dir: str | None = None, timeout: float | None = None,
    poll: float = 0.2,
) -> list[int]:
    """Lease ``n`` GPUs for this process, set ``CUDA_VISIBLE_DEVICES`` and return their ids.

    A ``CUDA_VISIBLE_DEVICES`` already in the environment (set by a scheduler) is respected and
    no lock is taken; without GPUs this returns ``[]``. Waits ``timeout`` seconds at most
    (None: forever) for ``n`` devices to be free, then raises ``TimeoutError``. ``count``: the node's GPU
    count from the config (``set_device_count``).
    """
    global _env_set_by_us
    set_device_count(count)
    if (visible := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
        tokens = [t.strip() for t in visible.split(",") if t.strip()]
        log.info("CUDA_VISIBLE_DEVICES=%r already set; using the scheduler's assignment", visible)
        if all(t.isdigit() for t in tokens):
            return [int(t) for t in tokens]
        return list(range(len(tokens)))  # UUIDs / MIG names: CUDA's ordinals for them
    count = device_count()
    if count == 0:
        log.info("no GPUs found; running on CPU")
        return []
    if not 1 <= n <= count:
        raise ValueError(f"cannot lease {n} GPU(s): {count} device(s) available")
    lock_dir = lock_dir or default_lock_dir()
    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        taken: list[tuple[int, int]] = []  # (device id, fd)
        for i in range(count):
            if (fd := _try_lock(os.path.join(lock_dir, f"gpu{i}.lock"))) is not None:
                taken.append((i, fd))
                if len(taken) == n:
                    break
        if len(taken) == n:
            break
        for _, fd in taken:
            os.close(fd)
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(
                f"no {n} free GPU(s) of {count} within {timeout} s (locks in {lock_dir})"
            )
        time.sleep(poll)
    ids = [i for i, _ in taken]
    _held_fds.extend(fd for _, fd in taken)
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, ids))
    _env_set_by_us = True
    log.info("leased GPU(s) %s (locks in %s)", ids, lock_dir)
    return ids


def release_all() -> None:
    """Release every lease held by this process (normally the process exit does this)."""
    global _env_set_by_us
    while _held_fds:
        os.close(_held_fds.pop())
    if _env_set_by_us:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        _env_set_by_us = False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dflash_pipeline.gpu_lease",
        description="Lease GPUs, then exec CMD with CUDA_VISIBLE_DEVICES set and the locks held.",
    )
    parser.add_argument("--n", type=int, default=1, help="number of GPUs to lease")
    parser.add_argument("--timeout", type=float, default=None, help="seconds (default: forever)")
    parser.add_argument("--lock-dir", default=None, help="default: $DFLASH_GPU_LOCK_DIR or /tmp")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("missing command after --")
    logging.basicConfig(level=logging.INFO, format="gpu_lease: %(message)s")
    lease_gpus(args.n, lock_dir=args.lock_dir, timeout=args.timeout)
    for fd in _held_fds:
        os.set_inheritable(fd, True)  # the exec'd command keeps holding the locks
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()
