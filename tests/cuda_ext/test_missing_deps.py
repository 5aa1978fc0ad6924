"""What a GPU test of tests/cuda_ext is told when part of the ``cuda`` extra is missing (the
conftest skips it with this reason instead of failing)."""

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
