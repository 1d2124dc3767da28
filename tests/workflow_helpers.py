"""Running the workflow from tests: ``snakemake`` on a temp workdir with its own ``config.yaml``.

Shared by tests/test_workflow.py (SmolLM2), tests/test_hybrid_workflow.py (a tiny hybrid target) and the tests
that kill a job mid-run (``kill_job_when``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def snakemake_command(workdir: Path, *args: str) -> list[str]:
    """The command line the tests run: this repository's Snakefile on ``workdir`` with its config.yaml,
    2 cores and 2 (fake, leased) GPUs."""
    return [sys.executable, "-m", "snakemake", *args, "--snakefile", str(REPO / "Snakefile"), "--directory",
            str(workdir), "--configfile", str(workdir / "config.yaml"), "--cores", "2", "--resources", "gpu=2"]


def snakemake_env(workdir: Path) -> dict[str, str]:
    """The environment of a test's snakemake: one thread per job, and its workdir leases its fake GPUs from a lock
    directory of its own, so that workflows of tests running at once (pytest -n 2) never wait for each other's."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_GPU_LOCK_DIR": str(Path(workdir) / "gpu-locks")}


def snakemake(workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(snakemake_command(workdir, *args), cwd=workdir, capture_output=True, text=True,
                            env=snakemake_env(workdir))
    if check and result.returncode:
        raise AssertionError(f"snakemake failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def start_snakemake(workdir: Path, *args: str) -> subprocess.Popen:
    """The same command in the background, its output dropped (for a test that kills one of its jobs)."""
    return subprocess.Popen(snakemake_command(workdir, *args), cwd=workdir, env=snakemake_env(workdir),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def scheduled_jobs(workdir: Path, target: str = "store") -> dict[str, int]:
    """The job counts a dry run of the same command would execute."""
    result = snakemake(workdir, "-n", target)
    out = result.stdout + result.stderr
    table = out.split("Job stats:")[1].split("total")[0] if "Job stats:" in out else ""
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M) if m[1] != "job"}


def default_config() -> dict:
    """The embedded default config (config/config.yaml), to be changed by a test and written to its workdir."""
    return yaml.safe_load((REPO / "config" / "config.yaml").read_text())


def example_config(name: str) -> dict:
    """config/examples/``name`` merged over the default config (as ``--configfile`` does), validated by the schema."""
    from snakemake.utils import update_config, validate

    config = default_config()
    update_config(config, yaml.safe_load((REPO / "config" / "examples" / name).read_text()))
    validate(config, str(REPO / "config" / "schema.yaml"))
    return config


def write_config(workdir: Path, config: dict) -> Path:
    path = Path(workdir) / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def job_pids(workdir: Path, rule: str) -> list[int]:
    """Processes running a script job of ``rule`` for this workdir (Snakemake runs it as
    ``<workdir>/.snakemake/scripts/tmpXXXX.<rule>.py``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if f"{workdir}/.snakemake/scripts/" in cmdline and f".{rule}.py" in cmdline:
                pids.append(int(entry.name))
    return pids


def kill_job_when(run: subprocess.Popen, workdir: Path, rule: str, ready) -> list[int]:
    """SIGKILL the job process(es) of ``rule`` as soon as ``ready()`` holds (within 300 s, while ``run`` lasts).
    The job's processes are found before ``ready()`` is polled: a short writing window is not lost to the scan."""
    deadline, pids, killed = time.time() + 300, [], []
    while time.time() < deadline and not killed and run.poll() is None:
        pids = pids or job_pids(workdir, rule)
        if pids and ready():
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:  # it had ended: the window was missed
                    pass
            if not killed:
                break
        time.sleep(0.01 if pids else 0.05)
    return killed
