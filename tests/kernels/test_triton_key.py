"""tkit.kernels._triton_key: Triton's version key served from disk, equal to Triton's own,
recomputed when Triton's files change."""

from __future__ import annotations

import os
import time

import pytest
import triton
from triton.runtime import cache

from tkit import _env
from tkit.kernels import _triton_key as TK


@pytest.fixture
def key_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(_env, "CACHE_DIR", tmp_path)
    return tmp_path / "triton-key"


def test_installed_and_equal_to_tritons_key(key_dir):
    assert TK.install()
    assert cache.triton_key is not TK._original
    assert TK._cached_key() == TK._original()
    files = list(key_dir.iterdir())
    assert len(files) == 1 and files[0].read_text() == TK._original()


def test_a_stored_key_is_read_back(key_dir):
    TK.install()
    TK._cached_key()
    (path,) = key_dir.iterdir()
    planted = triton.__version__ + "-planted"
    path.write_text(planted)
    assert TK._cached_key() == planted  # read, not recomputed


def test_a_foreign_file_is_replaced(key_dir):
    TK.install()
    root = os.path.dirname(os.path.abspath(triton.__file__))
    path = TK.cache_path(root)
    path.parent.mkdir(parents=True)
    path.write_text("not a key of this triton")
    assert TK._cached_key() == TK._original()
    assert path.read_text() == TK._original()


def test_fingerprint_follows_every_file(tmp_path):
    root = tmp_path / "pkg"
    (root / "_C").mkdir(parents=True)
    (root / "language").mkdir()
    lib = root / "_C" / "libtriton.so"
    lib.write_bytes(b"\0" * 64)
    (root / "language" / "core.py").write_text("x = 1\n")
    (root / "__pycache__").mkdir()
    before = TK.fingerprint(str(root))
    (root / "__pycache__" / "core.cpython.pyc").write_bytes(b"cached")
    assert TK.fingerprint(str(root)) == before  # bytecode caches do not count
    st = lib.stat()
    os.utime(lib, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    after_touch = TK.fingerprint(str(root))
    assert after_touch != before
    (root / "language" / "core.py").write_text("x = 22\n")
    assert TK.fingerprint(str(root)) != after_touch
    (root / "language" / "new.py").write_text("")
    assert len({before, after_touch, TK.fingerprint(str(root))}) == 3


def test_compile_cache_keys_use_it(key_dir, monkeypatch):
    TK.install()
    calls = []
    monkeypatch.setattr(cache, "triton_key", lambda: calls.append(time.time()) or "k")

    class _H:
        def hash(self):
            return "h"

    key = cache.get_cache_key(_H(), _H(), _H(), {})
    assert calls and key.startswith("k-")  # Triton's compile key reads the module attribute
