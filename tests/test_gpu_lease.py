"""GPU leases via flock: distinct devices for concurrent jobs, release on kill -9, CLI exec."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dflash_pipeline import gpu_lease

# Child: lease N GPUs, print the ids, optionally log start/end to LOG, then hold them for HOLD s.
CHILD = textwrap.dedent("""
    import os, sys, time
    from dflash_pipeline.gpu_lease import lease_gpus
    n, timeout, hold, log = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    ids = lease_gpus(n, timeout=timeout, poll=0.02)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, ids))
    print(",".join(map(str, ids)), flush=True)
    def note(what):
        if log:
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.write(fd, f"{ids[0]} {what} {time.monotonic()!r} {os.getpid()}\\n".encode())
            os.close(fd)
    note("start")
    time.sleep(hold)
    note("end")
    """)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # recorded so monkeypatch restores it
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("DFLASH_GPU_LOCK_DIR", str(tmp_path / "locks"))
    yield
    gpu_lease.release_all()


def child_env(tmp_path, count):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(
        DFLASH_GPU_COUNT=str(count),
        DFLASH_GPU_LOCK_DIR=str(tmp_path / "locks"),
        OMP_NUM_THREADS="1",
    )
    return env


def spawn(tmp_path, count, n=1, timeout=20.0, hold=60.0, log=""):
    args = [sys.executable, "-c", CHILD, str(n), str(timeout), str(hold), log]
    return subprocess.Popen(
        args, env=child_env(tmp_path, count), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def leased(proc):
    line = proc.stdout.readline().strip()
    assert line, proc.stderr.read()
    return [int(x) for x in line.split(",")]


def kill_all(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        p.stdout.close()
        p.stderr.close()


def test_concurrent_jobs_get_distinct_gpus(tmp_path):
    holders = [spawn(tmp_path, 4) for _ in range(4)]
    try:
        ids = sorted(i for p in holders for i in leased(p))
        assert ids == [0, 1, 2, 3]
        fifth = spawn(tmp_path, 4, timeout=0.3)
        _, err = fifth.communicate(timeout=20)
        assert fifth.returncode != 0 and "TimeoutError" in err
        locks = sorted(os.listdir(tmp_path / "locks"))
        assert locks == [f"gpu{i}.lock" for i in range(4)]
        pids = {int((tmp_path / "locks" / f).read_text()) for f in locks}
        assert pids == {p.pid for p in holders}
    finally:
        kill_all(holders)


def test_lease_is_free_after_kill_9(tmp_path):
    holder = spawn(tmp_path, 2, n=2)
    try:
        assert leased(holder) == [0, 1]
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        t0 = time.monotonic()
        nxt = spawn(tmp_path, 2, timeout=0.0, hold=0.0)
        out, err = nxt.communicate(timeout=20)
        assert nxt.returncode == 0, err
        assert out.strip() == "0"
        assert time.monotonic() - t0 < 10
    finally:
        kill_all([holder])


def test_lease_two_in_process(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_GPU_COUNT", "3")
    assert gpu_lease.device_count() == 3
    assert gpu_lease.lease_gpus(2, lock_dir=str(tmp_path / "locks")) == [0, 1]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    other = spawn(tmp_path, 3, n=1, hold=0.0)  # only device 2 is left
    out, err = other.communicate(timeout=20)
    assert other.returncode == 0 and out.strip() == "2", err
    other = spawn(tmp_path, 3, n=2, timeout=0.2, hold=0.0)
    _, err = other.communicate(timeout=20)
    assert other.returncode != 0 and "TimeoutError" in err
    gpu_lease.release_all()
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    with pytest.raises(ValueError, match="cannot lease 4"):
        gpu_lease.lease_gpus(4)


def test_scheduler_assignment_respected(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_GPU_COUNT", "8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert gpu_lease.lease_gpus(1, lock_dir=str(tmp_path / "locks")) == [3, 5]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu_lease.lease_gpus(1, lock_dir=str(tmp_path / "locks")) == []
    assert not (tmp_path / "locks").exists()
    assert gpu_lease._held_fds == []
    gpu_lease.release_all()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""  # not ours to remove


def test_no_gpus_means_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_GPU_COUNT", "0")
    assert gpu_lease.device_count() == 0
    assert gpu_lease.lease_gpus(1, lock_dir=str(tmp_path / "locks")) == []
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert not (tmp_path / "locks").exists()


def test_cli_execs_command_holding_the_lock(tmp_path):
    script = (
        "import os, time; print(os.environ['CUDA_VISIBLE_DEVICES'], flush=True); time.sleep(60)"
    )
    cli = [sys.executable, "-m", "dflash_pipeline.gpu_lease", "--n", "1", "--"]
    proc = subprocess.Popen(
        [*cli, sys.executable, "-c", script], env=child_env(tmp_path, 1),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "0"
        # Same pid after exec, and the lock is still held by the exec'd command.
        assert int((tmp_path / "locks" / "gpu0.lock").read_text()) == proc.pid
        other = spawn(tmp_path, 1, timeout=0.3, hold=0.0)
        _, err = other.communicate(timeout=20)
        assert other.returncode != 0 and "TimeoutError" in err
    finally:
        kill_all([proc])
    other = spawn(tmp_path, 1, timeout=0.0, hold=0.0)
    out, err = other.communicate(timeout=20)
    assert other.returncode == 0 and out.strip() == "0", err


def test_stress_no_overlapping_holders(tmp_path):
    rng = random.Random(1234)
    log = tmp_path / "holders.log"
    killed_at: dict[int, float] = {}  # pid -> time SIGKILL was sent
    exit_codes: dict[int, int] = {}
    for _ in range(3):
        procs = [spawn(tmp_path, 3, timeout=30.0, hold=0.2, log=str(log)) for _ in range(6)]
        try:
            for v in rng.sample(procs, 2):  # kill two of them at random times while leased
                v.stdout.readline()
                time.sleep(rng.uniform(0.0, 0.25))
                killed_at[v.pid] = time.monotonic()
                v.kill()
            for p in procs:
                p.wait(timeout=60)
                exit_codes[p.pid] = p.returncode
        finally:
            kill_all(procs)

    spans: dict[int, dict[str, float]] = {}
    device: dict[int, int] = {}
    for line in log.read_text().splitlines():
        dev, what, t, pid = line.split()
        spans.setdefault(int(pid), {})[what] = float(t)
        device[int(pid)] = int(dev)
    for pid, code in exit_codes.items():
        if pid not in killed_at or code == 0:  # survivors (and victims that finished first)
            assert code == 0 and spans[pid].keys() == {"start", "end"}
    assert len(spans) >= 3 * 4  # at least the 4 survivors of each round

    # A logged span lies inside the true lock-holding span; a killed holder released its lock
    # no earlier than the SIGKILL, so [start, end or kill time] is a safe (inner) bound.
    intervals: dict[int, list[tuple[float, float, int]]] = {}
    for pid, s in spans.items():
        end = s.get("end", killed_at.get(pid))
        assert end is not None and end >= s["start"]
        intervals.setdefault(device[pid], []).append((s["start"], end, pid))
    for dev, ivs in intervals.items():
        ivs.sort()
        for (s0, e0, p0), (s1, e1, p1) in zip(ivs, ivs[1:]):
            assert e0 <= s1, f"GPU {dev}: pid {p0} [{s0}, {e0}] overlaps pid {p1} [{s1}, {e1}]"
