"""Where a run's time goes: the loop's clock (steps, data waits, validations, checkpoints, the GPU's gaps between
steps), the progress line with the time left, and ``timing.json``, which the train job writes for benchmarks to
read (its keys are listed in config/README.md, "What the train job measures")."""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import torch

from ..atomic import atomic_path
from ..jobs import seconds_since_process_start

log = logging.getLogger(__name__)


class DataGaps:
    """On CUDA, the GPU's time from the end of one step's kernels to the start of the next step's (CUDA events):
    the data's gathers and copies plus any wait for the host to launch them, i.e. what the data costs the GPU. The
    host's own wait for the next step over-counts it when the host runs ahead of the GPU and blocks in a launch.
    Read when the host syncs anyway."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.last_end, self.pending, self.gaps = None, [], []

    def _event(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def step_ends(self) -> None:
        self.last_end = self._event() if self.cuda else None

    def data_ready(self) -> None:
        if self.last_end is not None:
            self.pending.append((self.last_end, self._event()))

    def pause(self) -> None:
        """Between epochs: the validation is not the data's."""
        self.last_end = None

    def read(self) -> float:
        self.gaps += [end.elapsed_time(start) / 1000 for end, start in self.pending]
        self.pending = []
        return self.seconds

    @property
    def seconds(self) -> float:
        return sum(self.gaps)

    def spread(self, long_s: float = 0.005) -> str:
        """How the gaps are spread: uniform small ones (the data's own kernels) or a few long ones (host stalls)."""
        if not self.gaps:
            return ""
        long = sum(g for g in self.gaps if g > long_s)
        longest = sorted(int(i) + 2 for i in np.argsort(self.gaps)[-5:])  # gap i (from 0) comes before step i + 2
        return (f" (median {1e3 * float(np.median(self.gaps)):.2f} ms, max {1e3 * max(self.gaps):.1f} ms, "
                f"{100 * long / max(self.seconds, 1e-12):.0f} % of it in gaps over {1e3 * long_s:.0f} ms; the longest "
                f"five before the loop's steps {', '.join(map(str, longest))})")


def clock_time(seconds: float) -> str:
    """Seconds as h:mm:ss."""
    seconds = max(0, round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class LoopClock:
    """The training loop's timings. Created when the loop asks for its first batches; ``start`` when it starts.
    Per step: ``waiting`` (the host starts waiting for the next packs), ``data_ready``, ``launched`` (after
    ``train_step`` returns: the host's time launching it), ``step_ends``; ``pause`` before a validation."""

    def __init__(self, device, step: int, tokens: int):
        self.device, self.first, self.tokens_before = device, step, tokens
        self.began = self.started = self.mark = time.perf_counter()
        self.gaps = DataGaps(device)
        self.data_wait = self.launching = self.validation = self.checkpoint = 0.0
        self.first_step: float | None = None  # seconds from ``began`` to the first step's return
        self.first_done = self.began  # when the first step returned (``perf_counter``)
        self.first_step_at: float | None = None  # seconds from the process start to it

    def start(self) -> None:
        self.started = time.perf_counter()

    def waiting(self) -> None:
        self.mark = time.perf_counter()

    def data_ready(self) -> None:
        self.data_wait += time.perf_counter() - self.mark
        self.gaps.data_ready()

    def launched(self, since: float) -> None:
        """``train_step`` returned; it was called at ``since``. The first step's time includes compilation."""
        now = time.perf_counter()
        if self.first_step is not None:  # the host's time in train_step: ~ the step time when the host sets the pace
            self.launching += now - since
            return
        self.first_done, self.first_step, self.first_step_at = now, now - self.began, seconds_since_process_start()
        log.info("first step done: %.1f s after the loop started (compilation included), %.1f s from the process "
                 "start", self.first_step, self.first_step_at)

    def step_ends(self) -> None:
        self.gaps.step_ends()
        self.mark = time.perf_counter()

    def pause(self) -> None:
        self.gaps.pause()

    def progress(self, step: int, total: int) -> str:
        """``s/step`` since the loop started (validations and checkpoints included) and the time left at that pace."""
        per_step = (time.perf_counter() - self.started) / max(1, step - self.first)
        return f"{per_step:.3f} s/step, {clock_time(per_step * (total - step))} left"

    def finish(self, step: int, tokens: int, rank: int) -> dict:
        """The loop's timings (empty when it ran no step), logged."""
        if step <= self.first:
            return {}
        seconds = time.perf_counter() - self.started
        steps = step - self.first
        in_steps = seconds - self.validation - self.checkpoint
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else 0.0
        timing = {"first_step_s": self.first_step, "first_step_since_process_start_s": self.first_step_at,
                  "loop_s": seconds, "validation_s": self.validation,
                  "checkpoint_s": self.checkpoint, "steps_s": in_steps, "data_wait_s": self.data_wait,
                  "data_gaps_s": self.gaps.read(), "launch_s": self.launching, "steps": steps,
                  # after the first step, counted from ``start`` as ``in_steps`` is (the loader's start before
                  # it is in ``first_step_s`` only)
                  "step_s": (in_steps - max(0.0, self.first_done - self.started)) / max(1, steps - 1),
                  "tokens_per_s": (tokens - self.tokens_before) / seconds, "peak_gpu_gib": peak}
        log.info("training speed (rank %d): %.0f tokens/s over %d steps (%.0f s: %.0f s validating, %.0f s in "
                 "checkpoints), data wait %.1f %% of the time (the host's)%s, %.3f s per step after the first "
                 "(%.3f s of it the host's in train_step), peak GPU memory %.1f GiB", rank, timing["tokens_per_s"],
                 steps, seconds, self.validation, self.checkpoint, 100 * self.data_wait / seconds,
                 f", the GPU's gaps between steps {100 * self.gaps.seconds / seconds:.1f} %{self.gaps.spread()}"
                 if self.gaps.cuda else "", timing["step_s"], self.launching / max(1, steps - 1), peak)
        return timing


def write_timing(path, timing: dict) -> None:
    """``timing.json``: the run's timings (seconds unless the key says otherwise), atomically."""
    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            json.dump(timing, f, indent=2, sort_keys=True)
            f.write("\n")
