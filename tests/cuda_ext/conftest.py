"""GPU tests of the CUDA escape hatches need the ``cuda`` extra: cupy for every path, and nvcc
with the CuTe headers (nvidia-cutlass) for tests marked ``cute``. Where one is missing, a GPU
test skips and names it instead of failing with an ImportError or FileNotFoundError."""

import pytest
import torch

from tkit.cuda_ext import _loader


def pytest_configure(config):
    config.addinivalue_line("markers", "cute: builds the CuTe GEMM (needs nvcc, nvidia-cutlass)")


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is None or not torch.cuda.is_available():
        return
    why = _loader.missing(cute=item.get_closest_marker("cute") is not None)
    if why is not None:
        pytest.skip(why)
