"""Every family's default builds compile to the SASS recorded before the package refactor
(issue #19; baselines recorded at a4e17a5). Minutes of ahead-of-time compiles per family:
marked slow; the same check runs as ``python tests/ir_tools/sass_identity.py check FAMILY``.
A deliberate change of a kernel re-records its family's baseline with ``record``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
FAMILIES = [
    "matmul", "attention", "attention_bwd", "decode", "rope", "quant", "sampling", "elementwise"]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_default_builds_have_the_recorded_sass(family):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = f"{HERE.parents[1]}{os.pathsep}{env.get('PYTHONPATH', '')}"
    out = subprocess.run([sys.executable, str(HERE / "sass_identity.py"), "check", family],
                         capture_output=True, text=True, env=env, timeout=3600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
