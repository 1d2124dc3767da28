"""What every workflow job does first: send its output to the rule's log and set its thread count."""

from __future__ import annotations

import logging
import os
import sys


def start_job(log_path: str | None, threads: int) -> None:
    """Redirect stdout and stderr (Python and C level) to ``log_path`` and cap CPU threads.

    Without an explicit cap, torch starts one thread per core in every job, and parallel jobs on a
    small machine slow each other down many times over.
    """
    began = seconds_since_process_start()
    if log_path:
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[name] = str(threads)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr, force=True
    )
    import torch  # imported here so the thread variables above are seen when torch starts

    torch.set_num_threads(threads)
    logging.getLogger(__name__).info("job: its code started %.1f s after the process (interpreter, Snakemake's script "
                                     "preamble); torch imported in %.1f s", began,
                                     seconds_since_process_start() - began)


def seconds_since_process_start() -> float:
    """Wall seconds since this process started (Linux: /proc), e.g. to time a job's launch and imports."""
    ticks = os.sysconf("SC_CLK_TCK")
    with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
        started = int(stat.read().rsplit(")", 1)[1].split()[19]) / ticks
        return float(uptime.read().split()[0]) - started
