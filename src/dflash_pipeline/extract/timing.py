"""Where an extract job's time goes, as ``train/timing.py``'s ``LoopClock`` says it for training: the setup before the
first forward, the forwards, the hand-overs to the writer thread, the wait for it to drain, the shard's close and
its fsync and rename; with the writer's own busy time and the main thread's waits for it. ``extract_shard`` logs
it and returns it as its result's ``timing``; benchmarks/speed/extract_speed.py reads it there."""

from __future__ import annotations

import contextlib
import time


class ExtractClock:
    def __init__(self):
        self.started = time.perf_counter()
        self.first_forward: float | None = None
        self.closed: float | None = None
        self.seconds = {"forward_call_s": 0.0, "submit_s": 0.0, "drain_s": 0.0, "close_s": 0.0}

    @contextlib.contextmanager
    def timing(self, key: str):
        """Add the time of the ``with`` body to ``key`` (the first forward's start and the close's end are marks
        too)."""
        began = time.perf_counter()
        if key == "forward_call_s" and self.first_forward is None:
            self.first_forward = began
        try:
            yield
        finally:
            ended = time.perf_counter()
            self.seconds[key] += ended - began
            self.closed = ended if key == "close_s" else self.closed

    def finish(self, *, real_tokens: int, real_token_share: float, batches: int, pipeline, writer) -> dict:
        """The breakdown, once the shard is in place: ``seconds`` in all, ``fsync_rename_s`` after the close."""
        seconds = time.perf_counter() - self.started
        setup = (self.first_forward or self.started) - self.started
        parts = list(writer.row_writers.values())
        return {"seconds": seconds, "real_tokens": real_tokens,
                "padded_tokens": int(round(real_tokens / real_token_share)) if real_tokens else 0,
                "real_token_share": real_token_share, "batches": batches, "setup_s": setup, **self.seconds,
                "writer_busy_s": pipeline.writer.busy, "main_waited_s": pipeline.waited,
                "fsync_rename_s": seconds - ((self.closed or self.started) - self.started),
                "early_fsync_s": writer.flusher.seconds if writer.flusher else 0.0,
                **{f"{key}_s": sum(part.seconds[key] for part in parts) for key in (parts[0].seconds if parts else ())}}
