"""Atomic replacement of output files and directories."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    if path.is_dir():
        for root, _, files in os.walk(path):
            for name in files:
                _fsync(Path(root) / name)
            _fsync(Path(root))
    elif path.exists():
        _fsync(path)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield ``<path>.tmp`` (in the same directory) for the body to write a file or directory to.

    On success the tmp result is fsynced and renamed onto ``path`` with ``os.replace`` (an existing
    destination directory is removed right before the rename); on any exception the tmp file or
    directory is removed and the exception re-raised, so ``path`` is never left half-written.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(final.name + ".tmp")
    _remove(tmp)  # leftover of an earlier crash
    try:
        yield tmp
        if not tmp.exists():
            raise FileNotFoundError(f"atomic_path: the body did not create {tmp}")
        _fsync_tree(tmp)
        if tmp.is_dir() and final.is_dir() and not final.is_symlink():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(final.parent)
    except BaseException:
        _remove(tmp)
        raise
