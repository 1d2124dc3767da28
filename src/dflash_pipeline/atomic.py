"""Atomic replacement of output files and directories."""

from __future__ import annotations

import contextlib
import errno
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


def _disk_full(error: BaseException | None) -> bool:
    """Whether ``error`` or an exception it was raised from is "no space left" (or a disk quota)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        error = error.__cause__ or error.__context__
    return False


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield ``<path>.tmp`` (in the same directory) for the body to write a file or directory to.

    On success the tmp result is fsynced and renamed onto ``path`` with ``os.replace`` (an existing
    destination directory is removed right before the rename); on any exception the tmp file or
    directory is removed and the exception re-raised, so ``path`` is never left half-written. A full disk
    is re-raised as an ``OSError(ENOSPC)`` that names ``path`` and the space left once the tmp is removed.
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
    except BaseException as error:
        _remove(tmp)
        if _disk_full(error):
            free = shutil.disk_usage(final.parent).free / 2**20
            raise OSError(errno.ENOSPC, f"No space left on device while writing {final} ({free:.1f} MiB free on "
                                        f"its filesystem once the partial {tmp.name} was removed); free space and "
                                        "run the same command again") from error
        raise
