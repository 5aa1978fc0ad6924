"""Triton's version key, kept on disk so that a new process does not rehash Triton.

Every compile and every compile-cache lookup starts from ``triton.runtime.cache.triton_key()``:
the SHA-256 of Triton's compiler, backends and language sources and of ``libtriton.so``
(hundreds of MB). It is computed once per process, on the first kernel launched, and took
0.74 s on the development CPU: the whole of a warm-cache first call's budget (50 ms), paid by
whichever tkit op a process calls first.

:func:`install` replaces the function with one that reads the key from
``$TKIT_CACHE_DIR/triton-key/<fingerprint>``, where the fingerprint is the SHA-256 of the path,
size and modification time of every file under Triton's package directory: installing,
upgrading or editing Triton changes it, and the key is then computed by Triton's own function
and stored anew. Triton does the same swap in its own compile-warmup workers. A failure to read
or write the cache falls back to Triton's function.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from pathlib import Path

from tkit import _env

_original = None


def fingerprint(root: str) -> str:
    """SHA-256 of (relative path, size, mtime_ns) of every file under ``root``, sorted."""
    h = hashlib.sha256()
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            path = os.path.join(dirpath, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            entries.append(f"{os.path.relpath(path, root)}\0{st.st_size}\0{st.st_mtime_ns}")
    for e in sorted(entries):
        h.update(e.encode())
        h.update(b"\n")
    return h.hexdigest()


def cache_path(root: str) -> Path:
    return _env.CACHE_DIR / "triton-key" / fingerprint(root)


def _cached_key() -> str:
    import triton

    root = os.path.dirname(os.path.abspath(triton.__file__))
    try:
        path = cache_path(root)
        if path.is_file():
            key = path.read_text()
            if key.startswith(triton.__version__):
                return key
    except OSError:
        return _original()
    key = _original()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent)
        with os.fdopen(fd, "w") as fh:
            fh.write(key)
        os.replace(tmp, path)  # atomic: a concurrent process reads the old file or the new
    except OSError:
        pass
    return key


def install() -> bool:
    """Serve ``triton.runtime.cache.triton_key`` from the disk cache (once per process).
    False when this Triton has no such function (then nothing is changed)."""
    global _original
    if _original is not None:
        return True
    try:
        from triton.runtime import cache
    except ImportError:
        return False
    fn = getattr(cache, "triton_key", None)
    if fn is None:
        return False
    _original = fn
    cache.triton_key = functools.lru_cache(maxsize=None)(_cached_key)
    return True
