"""The supported Triton range and the Triton/numpy pairs whose interpreter breaks."""

import re
from pathlib import Path

import pytest
import triton

from tkit import _compat

ROOT = Path(__file__).resolve().parents[1]


def _pyproject():
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_installed_triton_is_in_the_declared_range():
    deps = _pyproject()["project"]["dependencies"]
    spec = next(d for d in deps if d.startswith("triton"))
    low = re.search(r">=\s*([\d.]+)", spec).group(1)
    high = re.search(r"<\s*([\d.]+)", spec).group(1)
    assert (_compat.version_tuple(low), _compat.version_tuple(high)) == _compat.TRITON_RANGE
    lo, hi = _compat.TRITON_RANGE
    assert lo <= _compat.version_tuple(triton.__version__) < hi, triton.__version__


def test_test_extra_does_not_cap_numpy():
    # a cap would downgrade numpy on machines with triton 3.9, and cannot be met on the GPU
    # machine (no registry there); the one bad pair is refused at import instead
    test = _pyproject()["project"]["optional-dependencies"]["test"]
    assert not [d for d in test if d.startswith("numpy")], test


@pytest.mark.parametrize("tv, nv, interpret, bad", [
    ("3.6.0", "2.4.0", True, True),
    ("3.6.0", "2.5.2", True, True),
    ("3.8.1", "2.4.1", True, True),      # untested between the ends: treated as 3.6
    ("3.6.0", "2.3.5", True, False),
    ("3.6.0", "2.4.0", False, False),    # compiled for a GPU: numpy is not in the way
    ("3.9.0", "2.4.6", True, False),
    ("3.9.0+git5ad3f", "2.4.0rc1", True, False),
])
def test_interpreter_numpy_pairs(tv, nv, interpret, bad):
    problem = _compat.interpreter_problem(tv, nv, interpret)
    assert bool(problem) == bad
    if bad:
        assert f"numpy {nv}" in problem and "pip install 'numpy<2.4'" in problem


def test_kernels_refuse_a_bad_pair_at_import():
    """The wiring: importing tkit.kernels under the interpreter with triton 3.6 and numpy 2.4
    (version strings faked: the pair itself is not installed here) stops with the advice,
    before any kernel is defined."""
    import os
    import subprocess
    import sys

    code = ("import numpy, triton; numpy.__version__ = '2.4.0'; triton.__version__ = '3.6.0'\n"
            "import tkit.kernels.elementwise")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=120)
    assert out.returncode != 0
    assert "ImportError: Triton 3.6.0's interpreter" in out.stderr
    assert "pip install 'numpy<2.4'" in out.stderr
