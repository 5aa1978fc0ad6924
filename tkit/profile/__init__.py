"""``tkit profile``: a registered op's benchmark case under Nsight Compute, each kernel's
metrics parsed, and a diagnosis (the decision tree of :mod:`tkit.profile.diagnose`).

    tkit profile rms_norm            # the first benchmark case; every kernel of one call
    tkit profile matmul --case 2 --kernel gemm

From Python: ``kernels = tkit.profile.profile("rms_norm")`` then
``print(tkit.profile.report(kernels[0]))``. ncu runs the op in a child process
(``python -m tkit.profile.child``) and profiles only the call inside its NVTX range, after the
warm-up calls that compile. Without ncu (no CUDA toolkit, or a machine whose runtime hides the
counters) the command says so; :func:`diagnose` also takes metrics gathered some other way.
"""

from __future__ import annotations

from tkit.profile.diagnose import Finding, diagnose, report
from tkit.profile.metrics import METRICS, STALLS, parse_raw_csv
from tkit.profile.runner import find_ncu, ncu_command, profile

__all__ = ["METRICS", "STALLS", "Finding", "diagnose", "find_ncu", "ncu_command",
           "parse_raw_csv", "profile", "report"]
