"""Run Nsight Compute (``ncu``) over one benchmark case of a registered op and parse what it
measured: :func:`ncu_command` builds the command, :func:`profile` runs and parses it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tkit.profile.child import RANGE
from tkit.profile.metrics import all_metrics, parse_raw_csv


def find_ncu(path: str | None = None) -> str:
    """``path``, ``$TKIT_NCU``, ``ncu`` on the PATH, or the CUDA toolkit's; a RuntimeError
    saying where it looked otherwise."""
    for cand in (path, os.environ.get("TKIT_NCU"), shutil.which("ncu"),
                 "/usr/local/cuda/bin/ncu"):
        if cand and os.path.exists(cand):
            return cand
    raise RuntimeError("Nsight Compute (ncu) not found: pass --ncu PATH, set TKIT_NCU, or put "
                       "ncu on the PATH (it ships with the CUDA toolkit)")


def ncu_command(ncu: str, op: str, case: int = 0, kernel: str | None = None,
                metrics: list[str] | None = None) -> list[str]:
    """The command: the op's case under ncu, the kernels in the child's NVTX range only, the
    clocks left as they are (``--clock-control none``: the machine's measured ceilings hold),
    ``metrics`` (default :func:`tkit.profile.metrics.all_metrics`) as a raw CSV in base
    units."""
    metrics = all_metrics() if metrics is None else metrics
    cmd = [ncu, "--csv", "--page", "raw", "--print-units", "base", "--clock-control", "none",
           "--nvtx", "--nvtx-include", f"{RANGE}/", "--metrics", ",".join(metrics)]
    if kernel:
        cmd += ["--kernel-name", f"regex:{kernel}"]
    return cmd + [sys.executable, "-m", "tkit.profile.child", op, str(case)]


def profile(op: str, case: int = 0, kernel: str | None = None, ncu: str | None = None,
            timeout: float = 600.0) -> list[dict]:
    """The kernels one call of ``op``'s benchmark case ``case`` launches, each a dict of
    metrics (:func:`tkit.profile.metrics.parse_raw_csv`)."""
    from tkit import registry

    registry.get(op)  # an unknown op fails here, before ncu starts
    exe, metrics = find_ncu(ncu), all_metrics()
    for _ in range(4):
        done = subprocess.run(ncu_command(exe, op, case, kernel, metrics), capture_output=True,
                              text=True, timeout=timeout)
        if done.returncode == 0:
            return parse_raw_csv(done.stdout)
        # ncu refuses the whole run over a metric this chip or version does not know: drop
        # the ones its message names and ask again
        said = done.stderr + done.stdout
        unknown = [m for m in metrics if m in said]
        if not unknown or len(unknown) == len(metrics):
            break
        metrics = [m for m in metrics if m not in unknown]
    raise RuntimeError(f"ncu exited {done.returncode}: {(done.stderr or done.stdout)[-2000:]}")
