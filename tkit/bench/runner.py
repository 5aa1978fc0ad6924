"""Run specs: time tkit and its baselines interleaved (GPU), or check them (interpreter, CPU).

Interleaving: for every case, each round times every provider once, in order; the reported
median is the median of the rounds' medians (and likewise for p20/p80). Drift in clocks or
temperature then touches every provider alike instead of whichever ran last.
"""

from __future__ import annotations

import platform
import statistics
import subprocess
import time
import traceback
from pathlib import Path

import torch

from tkit import _env
from tkit.bench.ceilings import Ceilings
from tkit.bench.progress import Progress
from tkit.bench.timing import time_fn
from tkit.registry import OpSpec


def environment() -> dict:
    """Device, versions and git sha, stamped on every row."""
    import triton

    env = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "git_sha": git_sha(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["sm"] = f"sm_{p.major}{p.minor}"
        env["sms"] = p.multi_processor_count
    return env


def git_sha() -> str:
    """The commit a measurement ran: TKIT_GIT_SHA when set (the GPU machine's copy of the tree
    may carry a stale .git), else ``git rev-parse`` here (+dirty for uncommitted changes)."""
    if _env.GIT_SHA:  # set by the callers of scripts/gpu_*.sh: no .git on the GPU machine
        return _env.GIT_SHA
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                             capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "?"
    except Exception:
        return "?"


_git_sha = git_sha


def plan_cases(specs: list[OpSpec], groups: list[str] | None = None, quick: bool = False):
    """(spec, case) pairs to run: the cases of the chosen groups; with ``quick``, each op's
    first such case (its headline shape), so that a whole-toolkit run takes minutes."""
    plan = []
    for spec in specs:
        cases = [c for c in spec.bench_cases() if not groups or c.group in groups]
        plan += [(spec, c) for c in (cases[:1] if quick else cases)]
    return plan


def _verify(spec: OpSpec, args, kwargs) -> tuple[bool, str]:
    """The reference rule at benchmark size, with a float32 reference (float64 would take
    minutes on the GPU for the large GEMM and attention cases)."""
    from tkit.testing import check_against_reference

    try:
        check_against_reference(spec.fn, spec.reference, args, kwargs, ref_dtype=torch.float32)
        return True, ""
    except AssertionError as e:
        return False, str(e).splitlines()[0][:200]


def bench_specs(
    specs: list[OpSpec],
    ceilings: Ceilings,
    *,
    rounds: int = 3,
    rep_ms: int = 100,
    baselines: bool = True,
    groups: list[str] | None = None,
    cuda_graph: bool = False,
    verify: bool = True,
    progress: bool | None = None,
    quick: bool = False,
) -> list[dict]:
    """Time every bench case of every spec; one row per (case, provider)."""
    env = environment()
    plan = plan_cases(specs, groups, quick)
    bar = Progress(len(plan), "bench", progress)
    rows: list[dict] = []
    compiled: dict[str, dict] = {}
    for spec, case in plan:
        bar.step(f"{spec.name} {case.label}")
        if spec.name not in compiled:
            compiled[spec.name] = spec.available_baselines() if baselines else {}
        rows += _bench_case(spec, case, compiled[spec.name], ceilings, env, rounds=rounds,
                            rep_ms=rep_ms, cuda_graph=cuda_graph, verify=verify)
        torch.cuda.empty_cache()
    bar.close()
    return rows


def _bench_case(spec, case, baselines, ceilings, env, *, rounds, rep_ms, cuda_graph, verify):
    try:
        args, kwargs = case.make("cuda")
    except torch.OutOfMemoryError:
        return [_row(spec, case, "tkit", None, None, ceilings, env, ok=False,
                     note="out of memory building inputs")]
    cost = spec.cost(*args, **kwargs)
    ok, note = _verify(spec, args, kwargs) if verify else (True, "not verified")
    providers = {"tkit": spec.fn, **baselines}
    samples: dict[str, list] = {p: [] for p in providers}
    failed: dict[str, str] = {}
    for _ in range(rounds):
        for name, fn in providers.items():
            if name in failed:
                continue
            try:
                samples[name].append(time_fn(lambda fn=fn: fn(*args, **kwargs),
                                             rep_ms=rep_ms, cuda_graph=cuda_graph))
            except Exception as e:  # a baseline that cannot run this case
                failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                if name == "tkit":
                    traceback.print_exc()
    rows = []
    for name in providers:
        ts = samples[name]
        if not ts:
            rows.append(_row(spec, case, name, cost, None, ceilings, env, ok=False,
                             note=failed.get(name, "")))
            continue
        med = statistics.median(t.median_ms for t in ts)
        p20 = statistics.median(t.p20_ms for t in ts)
        p80 = statistics.median(t.p80_ms for t in ts)
        rows.append(_row(spec, case, name, cost, (med, p20, p80), ceilings, env,
                         ok=ok if name == "tkit" else True, note=note if name == "tkit" else ""))
    return rows


def _row(spec, case, provider, cost, times, ceilings, env, ok=True, note=""):
    row = {
        "op": spec.name, "family": spec.family, "case": case.label, "group": case.group,
        "provider": provider, "bound": spec.bound, "ok": ok, "note": note,
        "bytes": cost.bytes if cost else None, "flops": cost.flops if cost else None,
        "median_ms": None, "p20_ms": None, "p80_ms": None,
        "tbps": None, "tflops": None, "pct_of_roofline": None,
        "copy_tbps_ceiling": ceilings.copy_tbps if ceilings else None,
        "bf16_tflops_ceiling": ceilings.bf16_tflops if ceilings else None,
        **case.meta, **env,
    }
    if times is not None and cost is not None:
        med, p20, p80 = times
        row.update(median_ms=med, p20_ms=p20, p80_ms=p80,
                   tbps=cost.bytes / (med * 1e-3) / 1e12,
                   tflops=cost.flops / (med * 1e-3) / 1e12 if cost.flops else 0.0)
        if ceilings:
            row["pct_of_roofline"] = 100.0 * ceilings.floor_ms(cost.bytes, cost.flops) / med
    return row


def check_specs(specs: list[OpSpec], progress: bool | None = None) -> list[dict]:
    """Check every op against its reference at interpreter sizes (machines without a GPU)."""
    from tkit.testing import check_against_reference
    from tkit.testing.compare import ReferenceMismatch

    env = environment()
    plan = [(s, c) for s in specs for c in s.check_cases()]
    bar = Progress(len(plan), "check", progress)
    rows = []
    for spec, case in plan:
        bar.step(f"{spec.name} {case.label}")
        t0 = time.time()
        args, kwargs = case.make("cpu")
        try:
            check_against_reference(spec.fn, spec.reference, args, kwargs)
            ok, note = True, ""
        except ReferenceMismatch as e:
            ok, note = False, str(e).splitlines()[0][:160]
        except Exception as e:
            ok, note = False, f"{type(e).__name__}: {str(e).splitlines()[0][:140]}"
        rows.append({"op": spec.name, "family": spec.family, "case": case.label,
                     "group": case.group, "ok": ok, "note": note,
                     "seconds": round(time.time() - t0, 2), **env})
    bar.close()
    return rows
