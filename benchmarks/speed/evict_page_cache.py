"""Drop a directory's files from the page cache (posix_fadvise DONTNEED on each; no privileges needed), so that the
next reads of them come from the disk: a streamed training run measured as a store larger than RAM would read.

    python benchmarks/speed/evict_page_cache.py results/store.zarr
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    files = size = 0
    for root, _, names in os.walk(sys.argv[1]):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)  # dirty pages stay cached: written back first
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                size += os.fstat(fd).st_size
                files += 1
            finally:
                os.close(fd)
    print(f"{sys.argv[1]}: {files} files, {size / 2**30:.1f} GiB dropped from the page cache")


if __name__ == "__main__":
    main()
