"""The C heap between bursts of requests. glibc's malloc gives each new thread an arena (up to
8 per core) and keeps what is freed there; a server whose worker and client threads come and go
then grows by fragments wave after wave while the Python heap stays flat
(benchmarks/notes/2026-12-05-hostile-load-run.md). Both calls are no-ops where the C library is
not glibc."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_ARENA_MAX = -8  # glibc's mallopt parameter number (malloc.h)
_libc: list = []


def _glibc():
    if not _libc:
        found = None
        if sys.platform.startswith("linux"):
            try:
                lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                found = lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else None
            except OSError:
                found = None
        _libc.append(found)
    return _libc[0]


def bound_arenas(arenas: int = 2) -> bool:
    """At most `arenas` malloc arenas for threads started from now on; True where applied."""
    lib = _glibc()
    return bool(lib is not None and lib.mallopt(M_ARENA_MAX, int(arenas)) == 1)


def release_free() -> bool:
    """Return the heap's free pages to the system (when a burst ends, not on a request's path)."""
    lib = _glibc()
    return bool(lib is not None and lib.malloc_trim(0) in (0, 1))
