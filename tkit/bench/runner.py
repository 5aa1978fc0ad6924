"""Run specs: time tkit and its baselines interleaved (GPU), or check them (interpreter, CPU).

Interleaving: for every case, each round times every provider once, in an order rotated from
round to round (:func:`tkit.bench.timing.round_order`); the reported median is the median of the
rounds' medians (and likewise for p20/p80). Drift in clocks or temperature then touches every
provider alike instead of whichever ran last, and so does the position in a round.
"""

from __future__ import annotations

import platform
import statistics
import subprocess
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tkit import _env
from tkit.bench.ceilings import Ceilings
from tkit.bench.timing import round_order, time_fn
from tkit.registry import Case, OpSpec


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
    if _env.GIT_SHA:  # set by scripts/gpu_run.sh's callers: no .git on the GPU machine
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


@dataclass(frozen=True)
class Planned:
    """One case to run: ``id`` (``op/index`` into the op's bench cases) names it to a child."""

    spec: OpSpec
    index: int
    case: Case

    @property
    def id(self) -> str:
        return f"{self.spec.name}/{self.index}"


def plan(specs: list[OpSpec], groups: list[str] | None = None,
         quick: bool = False) -> list[Planned]:
    """The cases to run: those of the chosen groups; with ``quick``, each op's first such case
    (its headline shape), so that a whole-toolkit run takes minutes."""
    out = []
    for spec in specs:
        cases = [Planned(spec, i, c) for i, c in enumerate(spec.bench_cases())
                 if not groups or c.group in groups]
        out += cases[:1] if quick else cases
    return out


def plan_cases(specs: list[OpSpec], groups: list[str] | None = None, quick: bool = False):
    """(spec, case) pairs of :func:`plan`."""
    return [(p.spec, p.case) for p in plan(specs, groups, quick)]


def _verify(spec: OpSpec, args, kwargs) -> tuple[bool, str]:
    """The reference rule at benchmark size, with a float32 reference (float64 would take
    minutes on the GPU for the large GEMM and attention cases)."""
    from tkit.testing import check_against_reference

    try:
        check_against_reference(spec.fn, spec.reference, args, kwargs, ref_dtype=torch.float32,
                                ulps=spec.ulps)
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
    l2: str = "read",
    timer: str = "events",
    verify: bool = True,
    progress: bool | None = None,
    quick: bool = False,
    isolate: bool = False,
    case_timeout: float = 900.0,
    child_command: list[str] | None = None,
    device: str = "cuda",
    reporter=None,
    warm_jobs: int = 0,
) -> list[dict]:
    """Time every bench case of every spec; one row per (case, provider).

    A case that raises is reported as failed (a row for tkit with the error as its note) and the
    rest run. With ``isolate`` the cases run in a child process (``python -m tkit.bench.child``,
    or ``child_command``) under :func:`tkit.bench.isolate.supervise`: a case that faults (an
    illegal address leaves the CUDA context unusable), hangs past ``case_timeout`` seconds or
    kills the child costs that case only; a new child takes the rest. In-process (the default
    here, and ``tkit bench --in-process``) is for debugging: a fault there fails every later
    case too. ``reporter`` (:class:`tkit.bench.progress.Reporter`) hears of each case."""
    from tkit.bench.progress import Reporter

    todo = plan(specs, groups, quick)
    opts = dict(rounds=rounds, rep_ms=rep_ms, baselines=baselines, cuda_graph=cuda_graph,
                l2=l2, timer=timer, verify=verify, device=device)
    reporter = reporter or Reporter(len(todo), "bench", bar=progress)
    env = environment()
    warmed: dict[str, tuple] = {}
    if isolate and warm_jobs > 0 and todo:
        warmed = warm_cases(todo, opts, warm_jobs, case_timeout, child_command)
    if isolate:
        rows = _bench_isolated(todo, ceilings, env, opts, reporter, case_timeout, child_command)
    else:
        rows = []
        cache: dict[str, dict] = {}
        for p in todo:
            reporter.begin(f"{p.spec.name} {p.case.label}")
            t0 = time.time()
            try:
                case_rows = bench_case(p.spec, p.case, ceilings, env, cache, **opts)
            except Exception as e:
                case_rows = failed_rows(p.spec, p.case, f"{type(e).__name__}: {e}", ceilings,
                                        env)
            _stamp(case_rows, time.time() - t0)
            reporter.done(case_rows)
            rows += case_rows
    reporter.close()
    ids = {(p.spec.name, p.case.label): p.id for p in todo}
    for r in rows:  # the warm-up's share of a case, for the next run's estimate
        how, payload = warmed.get(ids.get((r["op"], r["case"]), ""), (None, None))
        if how == "ok" and payload:
            r["warm_seconds"] = payload.get("seconds")
    return rows


def _stamp(rows: list[dict], seconds: float) -> None:
    # the case's wall time (inputs, verification, compiles, autotuning, every provider's
    # timing): what the next run's estimate of its length is made from
    for r in rows:
        r["case_seconds"] = round(seconds, 1)


def child_env() -> dict:
    """The environment of the bench's children: inductor compiles in the child itself (its
    pool of compile workers would take seconds to start in every child, and eight children
    with a pool of one worker per core each would oversubscribe the host). Warm-up and timing
    children share it, so that inductor's cache keys (which include its config) match."""
    import os

    return {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS":
            os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", "1")}


def warm_cases(todo, opts, jobs, case_timeout, child_command, out=None) -> dict[str, tuple]:
    """Run every case's first calls in ``jobs`` child processes at once; {case id: answer}.
    A case whose warm-up fails is timed (and its failure reported) by the timing pass all the
    same: the warm-up only fills caches. One line when it starts and one when it ends."""
    import concurrent.futures
    import json
    import sys

    from tkit.bench.isolate import supervise

    out = out or sys.stdout
    jobs = max(1, min(jobs, len(todo)))
    # the same op's cases on one lane: its baselines are built once per child
    order = sorted(todo, key=lambda p: p.spec.name)
    lanes = [[p.id for p in order[i::jobs]] for i in range(jobs)]
    child_opts = {**opts, "warm": True}
    cmd = child_command or [sys.executable, "-m", "tkit.bench.child"]
    env = child_env()
    t0 = time.time()
    print(f"warming up {len(todo)} cases in {jobs} processes (compiles and the baselines' "
          f"torch.compile, into the on-disk caches)", file=out, flush=True)

    def lane(ids):
        return supervise(lambda left: cmd + [json.dumps(child_opts), ",".join(left)], ids,
                         deadline=case_timeout, first_deadline=300.0, total=float("inf"),
                         log=lambda msg: None, env=env)

    answers: dict[str, tuple] = {}
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for status in pool.map(lane, lanes):
            answers.update(status)
    bad = sorted(i for i, (why, _) in answers.items() if why != "ok")
    print(f"warmed up in {time.time() - t0:.0f} s" +
          (f"; {len(bad)} cases failed to warm up (timed anyway): {', '.join(bad[:8])}"
           if bad else ""), file=out, flush=True)
    return answers


def warm_case(spec, case, cache=None, *, baselines=True, device="cuda", **_timing) -> dict:
    """A case's first calls, untimed and unchecked: tkit's kernels compile and every baseline
    makes its first call (torch.compile's compile among them). Raises when the CUDA context is
    lost; other errors are left for the timing pass to report."""
    from tkit.bench.isolate import context_lost

    t0 = time.time()
    cache = {} if cache is None else cache
    if spec.name not in cache:
        cache[spec.name] = spec.available_baselines() if baselines else {}
    try:
        args, kwargs = case.make(device)
    except torch.OutOfMemoryError:
        return {"seconds": round(time.time() - t0, 1)}
    for fn in (spec.fn, *cache[spec.name].values()):
        try:
            fn(*args, **kwargs)
        except Exception as e:
            if context_lost(e):
                raise
    del args, kwargs
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return {"seconds": round(time.time() - t0, 1)}


def _bench_isolated(todo, ceilings, env, opts, reporter, case_timeout, child_command):
    import json
    import sys

    from tkit.bench.isolate import supervise

    by_id = {p.id: p for p in todo}
    child_opts = {**opts, "ceilings": asdict(ceilings) if ceilings else None}
    cmd = child_command or [sys.executable, "-m", "tkit.bench.child"]
    answers: dict[str, list[dict]] = {}
    clock = {"t": time.time()}

    def on_begin(case_id):
        p = by_id[case_id]
        reporter.begin(f"{p.spec.name} {p.case.label}")

    def on_answer(case_id, answer):
        p = by_id[case_id]
        why, payload = answer
        if why == "ok" and payload:
            case_rows = payload
        else:
            case_rows = failed_rows(p.spec, p.case, why, ceilings, env)
        # time since the previous answer: child start-ups and restarts count to the case
        now = time.time()
        _stamp(case_rows, now - clock["t"])
        clock["t"] = now
        answers[case_id] = case_rows
        reporter.done(case_rows)

    supervise(lambda ids: cmd + [json.dumps(child_opts), ",".join(ids)],
              [p.id for p in todo], deadline=case_timeout, first_deadline=300.0,
              total=float("inf"), hang_hint=" (hung? --case-timeout sets the limit)",
              log=lambda msg: None, on_begin=on_begin, on_answer=on_answer, env=child_env())
    return [r for p in todo for r in answers.get(p.id, [])]


def failed_rows(spec, case, why: str, ceilings, env) -> list[dict]:
    """The row of a case that could not be measured: tkit's, not ok, the reason as its note."""
    return [_row(spec, case, "tkit", None, None, ceilings, env, ok=False,
                 note=" ".join(why.split())[:500])]


def bench_case(spec, case, ceilings, env, cache=None, *, rounds=3, rep_ms=100, baselines=True,
               cuda_graph=False, l2="read", timer="events", verify=True,
               device="cuda") -> list[dict]:
    """Time one case: tkit and its baselines, interleaved; one row per provider. Raises when
    the case cannot run (its inputs, its verification, tkit itself) or when the CUDA context
    is lost, so that a supervising parent knows to start a new process."""
    from tkit.bench.isolate import context_lost

    cache = {} if cache is None else cache
    if spec.name not in cache:  # torch.compile baselines: built once an op, reused by its cases
        cache[spec.name] = spec.available_baselines() if baselines else {}
    try:
        args, kwargs = case.make(device)
    except torch.OutOfMemoryError:
        return failed_rows(spec, case, "out of memory building inputs", ceilings, env)
    cost = spec.cost(*args, **kwargs)
    ok, note = _verify(spec, args, kwargs) if verify else (True, "not verified")
    providers = {"tkit": spec.fn, **cache[spec.name]}
    samples: dict[str, list] = {p: [] for p in providers}
    failed: dict[str, str] = {}
    for r in range(rounds):
        for name in round_order(list(providers), r, rounds):
            fn = providers[name]
            if name in failed:
                continue
            try:
                samples[name].append(time_fn(lambda fn=fn: fn(*args, **kwargs),
                                             rep_ms=rep_ms, cuda_graph=cuda_graph, l2=l2,
                                             timer=timer))
            except Exception as e:  # a baseline that cannot run this case
                if context_lost(e):
                    raise
                failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                if name == "tkit":
                    traceback.print_exc()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()  # an asynchronous fault is this case's, not the next one's
        torch.cuda.empty_cache()
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
    for r in rows:  # how the L2 was made cold before each timed run, what timed it (time_fn)
        r["l2_flush"] = "none (graph replays)" if cuda_graph else l2
        r["timer"] = timer
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


def check_plan(specs: list[OpSpec], groups: list[str] | None = None,
               quick: bool = False) -> list[tuple[OpSpec, Case]]:
    """(spec, case) pairs to check in the interpreter: the check cases of the chosen groups;
    with ``quick``, each op's first such case."""
    out = []
    for spec in specs:
        cases = [c for c in spec.check_cases() if not groups or c.group in groups]
        out += [(spec, c) for c in (cases[:1] if quick else cases)]
    return out


def check_specs(specs: list[OpSpec], progress: bool | None = None,
                groups: list[str] | None = None, quick: bool = False,
                reporter=None) -> list[dict]:
    """Check ops against their references at interpreter sizes (machines without a GPU)."""
    from tkit.bench.progress import Reporter
    from tkit.testing import check_against_reference
    from tkit.testing.compare import ReferenceMismatch

    env = environment()
    todo = check_plan(specs, groups, quick)
    reporter = reporter or Reporter(len(todo), "check", bar=progress)
    rows = []
    for spec, case in todo:
        reporter.begin(f"{spec.name} {case.label}")
        t0 = time.time()
        try:
            args, kwargs = case.make("cpu")
            check_against_reference(spec.fn, spec.reference, args, kwargs, ulps=spec.ulps)
            ok, note = True, ""
        except ReferenceMismatch as e:
            ok, note = False, str(e).splitlines()[0][:160]
        except Exception as e:
            ok, note = False, f"{type(e).__name__}: {str(e).splitlines()[0][:140]}"
        row = {"op": spec.name, "family": spec.family, "case": case.label,
               "group": case.group, "ok": ok, "note": note,
               "seconds": round(time.time() - t0, 2), **env}
        reporter.done([row], check=True)
        rows.append(row)
    reporter.close()
    return rows
