"""The reductions family's default builds compile to the SASS recorded before its refactor
(issue #19). Minutes of ahead-of-time compiles (363 builds): marked slow; the same check runs
as ``python tests/ir_tools/reductions_sass.py check tests/ir_tools/reductions_sass_baseline.json``.
A deliberate change of a kernel re-records the baseline with ``record``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_default_builds_have_the_recorded_sass():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = f"{HERE.parents[1]}{os.pathsep}{env.get('PYTHONPATH', '')}"
    out = subprocess.run([sys.executable, str(HERE / "reductions_sass.py"), "check",
                          str(HERE / "reductions_sass_baseline.json")],
                         capture_output=True, text=True, env=env, timeout=3600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert len(json.loads((HERE / "reductions_sass_baseline.json").read_text())) > 300
