"""What a GPU test of tests/cuda_ext is told when part of the ``cuda`` extra is missing (the
conftest skips it with this reason instead of failing), and how csrc/ headers reach the
compiler."""

import hashlib
import os

from tkit.cuda_ext import _loader


def test_missing_names_what_to_install(monkeypatch):
    monkeypatch.setattr(_loader, "import_cupy", lambda: (None, "cupy is not importable (x)"))
    assert "pip install 'tkit[cuda]'" in _loader.missing()
    monkeypatch.setattr(_loader, "import_cupy", lambda: (object(), None))
    monkeypatch.setattr(_loader, "nvcc_path", lambda: "/usr/bin/nvcc")
    monkeypatch.setattr(_loader, "cutlass_include", lambda: None)
    assert _loader.missing() is None and _loader.missing(nvcc=True) is None
    assert "pip install nvidia-cutlass" in _loader.missing(cute=True)
    monkeypatch.setattr(_loader, "nvcc_path", lambda: None)
    assert "nvcc is not on the PATH" in _loader.missing(cute=True)


def test_local_headers_are_inlined_and_hashed(tmp_path, monkeypatch):
    """A source's ``#include "name.cuh"`` of a csrc/ header is inlined by read_source (so the
    copy nvcc compiles from the cache folder is self-contained, with #line directives naming
    both files), and editing the header alone changes the source's hash (module caches and
    self-tests are keyed on it)."""
    monkeypatch.setattr(_loader, "CSRC", tmp_path)
    (tmp_path / "common.cuh").write_text("#pragma once\n__device__ int one() { return 1; }\n")
    (tmp_path / "k.cu").write_text('// k\n#include "common.cuh"\nint x;\n')
    text = _loader.read_source("k.cu")
    assert "__device__ int one()" in text and '#include "common.cuh"' not in text
    assert f'#line 1 "{tmp_path / "common.cuh"}"' in text
    assert f'#line 3 "{tmp_path / "k.cu"}"' in text  # back in k.cu at the line after
    before = _loader.source_hash("k.cu")
    (tmp_path / "common.cuh").write_text("#pragma once\n__device__ int one() { return 2; }\n")
    st = (tmp_path / "common.cuh").stat()
    os.utime(tmp_path / "common.cuh", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert _loader.source_hash("k.cu") != before
    (tmp_path / "plain.cu").write_bytes(b"int y;\n")
    assert _loader.source_hash("plain.cu") == hashlib.sha256(b"int y;\n").hexdigest()[:16]
