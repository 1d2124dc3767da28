"""The overlapped device -> host -> Zarr path: real-token rows gathered, encoded and counted on the device, copied
by a side CUDA stream into a ring of pinned host buffers, written by a thread (module docstring of ``extract``)."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..store import ShardWriter, StoreError
from ..store.writer import fold_stats



@dataclass
class _Item:
    rows: dict[str, np.ndarray]  # codec array name -> encoded rows
    event: object = None  # torch.cuda.Event: the copy into the pinned slot is done
    release: object = None  # returns the pinned slot


class _Writer:
    """A thread that writes encoded rows to the shard in order, fed through a bounded queue. Its first
    error is kept; later items are dropped (their slots still returned) and ``check`` raises it."""

    def __init__(self, shard: ShardWriter, depth: int):
        self.shard, self.error, self.abort, self.busy = shard, None, False, 0.0
        self.queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self.thread = threading.Thread(target=self._run, name="extract-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            try:
                if self.error is None and not self.abort:
                    started = time.perf_counter()
                    if item.event is not None:
                        item.event.synchronize()
                    self.shard.write_encoded(item.rows)
                    self.busy += time.perf_counter() - started
            except BaseException as error:  # noqa: BLE001 - handed to the main thread
                self.error = error
            finally:
                if item.release is not None:
                    item.release()

    def check(self) -> None:
        if self.error is not None:
            raise StoreError(f"the shard writer thread failed: {self.error!r}") from self.error

    def put(self, item) -> None:
        while True:
            self.check()
            if not self.thread.is_alive():
                raise StoreError("the shard writer thread stopped")
            try:
                self.queue.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def finish(self) -> None:
        self.put(None)
        self.thread.join()
        self.check()

    def stop(self) -> None:
        self.abort = True
        while self.thread.is_alive():
            try:
                self.queue.put(None, timeout=0.05)
            except queue.Full:
                continue
            self.thread.join()


class _PinnedRing:
    """Pinned host buffers for the copies of ``slots`` batches in flight (CUDA only), shaped like ``like``'s
    encoded arrays with ``rows`` rows."""

    def __init__(self, slots: int, rows: int, like: dict[str, torch.Tensor]):
        self.free: queue.Queue = queue.Queue()
        for _ in range(slots):
            self.free.put({name: torch.empty((rows, *t.shape[1:]), dtype=t.dtype, pin_memory=True)
                           for name, t in like.items()})

    def take(self, writer: _Writer):
        while True:
            writer.check()
            try:
                return self.free.get(timeout=0.05)
            except queue.Empty:
                continue


class Pipeline:
    """Gathers real-token rows, encodes and counts them on the device and hands them to the writer."""

    def __init__(self, shard: ShardWriter, device: torch.device, *, max_rows: int, depth: int):
        self.shard, self.device, self.cuda = shard, device, device.type == "cuda"
        self.totals = None
        self.waited = 0.0
        self.writer = _Writer(shard, depth)
        self.max_rows, self.depth, self.ring = max_rows, depth, None
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.cuda:
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device)

    def submit(self, outputs: list[torch.Tensor], lengths: np.ndarray) -> None:
        """``outputs``: the captured layers' [B, W, D] outputs of one right-padded batch."""
        batch, width, hidden = outputs[0].shape
        rows = int(lengths.sum())
        if rows == batch * width:
            flat = torch.stack([o.reshape(rows, hidden) for o in outputs], dim=1)
        else:
            index = self.to_device(np.flatnonzero(np.arange(width)[None, :] < lengths[:, None]))
            flat = torch.stack([o.reshape(batch * width, hidden).index_select(0, index) for o in outputs], dim=1)
        encoded, stats = self.shard.codec.encode(flat)
        del flat
        self._add(stats)
        if self.cuda:
            if self.ring is None:  # pinned once, in the element types the codec stores (fp32 / uint16 / uint8)
                self.ring = _PinnedRing(self.depth + 1, self.max_rows, encoded)
            started = time.perf_counter()
            slot = self.ring.take(self.writer)
            self.waited += time.perf_counter() - started
            ready = torch.cuda.Event()
            ready.record()
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(ready)
                for name, values in encoded.items():
                    slot[name][:rows].copy_(values, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            for values in encoded.values():
                values.record_stream(self.copy_stream)
            item = _Item({name: buffer[:rows].numpy() for name, buffer in slot.items()}, done,
                         lambda: self.ring.free.put(slot))
        else:
            item = _Item({name: values.cpu().numpy() for name, values in encoded.items()})
        started = time.perf_counter()
        self.writer.put(item)
        self.waited += time.perf_counter() - started

    def _add(self, stats: dict) -> None:
        self.totals = fold_stats(self.totals or {}, {k: v for k, v in stats.items() if k != "token_absmax"})

    def finish(self) -> None:
        self.writer.finish()
        if self.totals is not None:
            self.shard.add_stats({k: v.cpu() for k, v in self.totals.items()})

