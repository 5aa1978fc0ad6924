"""Reliability campaign: every registered op under compute-sanitizer, and fuzzed on the GPU.

    python benchmarks/reliability.py --out "$OUT/reliability.jsonl"   # the whole campaign
    python benchmarks/reliability.py --ops add rms_norm --examples 200 --fuzz-only
    TRITON_INTERPRET=1 python benchmarks/reliability.py --ops add --examples 3 --fuzz-only
    python benchmarks/reliability.py --count-variants --max-variants 48   # CPU, no interpreter

On the H200 machine (16 cores, one GPU) the whole campaign is one command of at most 10
minutes: ``--budget`` (default 500 s) covers both parts, and every op stops cleanly at its
slice, so the run ends at the budget whatever the compile times turn out to be. It needs
hypothesis and compute-sanitizer (found on PATH or in /usr/local/cuda/bin).

Two parts, each op in child processes so that a crash or a lost CUDA context costs one op, not
the campaign:

1. sanitizer: each op under ``compute-sanitizer --tool memcheck`` (and ``--tool racecheck``
   for the families whose kernels use shared memory: GEMMs, attention, the row reductions of
   softmax, the norms, the quantizers and the samplers) on its check cases and on
   derandomized fuzz examples drawn at interpreter sizes (sizes 0, 1, odd and tile +/- 1 come
   first; large ones would only cost time under the instrumentation); plus, under memcheck,
   one elementwise op and one reduction on more than 2**31 elements (32-bit offsets overflow
   there). ``TKIT_NO_AUTOTUNE=1`` keeps every launch to one compile, and
   ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` gives every tensor its own allocation, so that
   memcheck sees an access past a tensor's end. The longest runs (racecheck of the GEMMs and
   attention) start first. It gets ``--sanitizer-share`` of the budget (default 0.3); what it
   leaves passes to the fuzzing.
2. fuzz: each op's ``fuzz`` recipe from the registry under the reference rule, up to
   ``--examples`` (default 1000) examples, derandomized. ``--jobs`` lanes (default one a
   core), each one long-lived child that takes the next op from one shared queue, heaviest
   families first; an op's slice is worked out when it starts (an equal share of the
   lane-seconds left among it, the ops waiting and the ops running), so an op that reaches its
   examples early gives its time to the ones after it. Examples run in the lane's process
   (``fuzz(isolate=False)``: the lane is the isolation; a lost context ends that child and a
   fresh one takes the next op). ``llama_layer`` is left out (``FUZZ_EXCLUDED`` says why; its
   row says so).

Where an example's time goes on a GPU. Everything but compiles is milliseconds: hypothesis
draws the example (about 1 ms), ``make_tensor`` draws the inputs on the host and copies them
over (the GPU-sized strategies are capped at ``--max-numel``, default 2**18 elements, about
1 ms an input), the op launches (tens of microseconds, outputs poisoned), the float64
reference and the same-precision peer run on the GPU next to the inputs, and so does the
comparison (a few small reductions read back in one transfer an output: every wait for the
device costs more when 16 processes share it). The previous campaign's raw-CUDA ops, which
compile nothing, ran 1000 examples in 39 s under 16 lanes. The cost is Triton's JIT: a new
compile (about a second; several for attention) for every new specialization key, and shapes
drawn at random change the key often (each integer argument is specialized on == 1 and
% 16, each pointer on 16-byte alignment, block sizes follow the next power of two), so the
last campaign fuzzed only 55-240 examples an op in its 50-100 s slices. The fuzz part therefore
bounds the variety (``tkit.testing.variants``): the recipe's examples run until compiles have
taken ``--compile-share`` of the op's slice (default 0.45) and an example would compile a new
variant; that one is rejected in Triton's compile hook, before anything compiles, and a second
hypothesis run takes the examples left: three in four re-run an example that passed (its dtype,
layouts and options) on new values and with some sizes moved within their compile class (within
their power of two, keeping their remainder modulo 16 above 32 and their divisibility by 16
below; 0, 1 and 2 kept; equal sizes kept equal), one in four is a fresh draw of the recipe, and
either is rejected when it would compile a new variant. So the examples keep coming on compiled
kernels, checked by the same rule. A failure lifts the bound so that shrinking compiles what it
needs. With 42 ops on 16 lanes in about 350 s of fuzzing, an op gets about 130 s: up to about
60 s of compiles and 1000 examples at 20-40 ms (plus the rejected ones, a few ms each: the
inputs are built and the op runs up to its launch).

``--count-variants`` estimates that variety without a GPU: each op's recipe at GPU sizes, its
launches recorded on meta tensors instead of run, each launch's specialization key worked
out on the host and passed through Triton's compile hooks as a compile would be (forward
launches only, and the paths meta tensors take). Unbounded it gives the variants 1000
examples would compile (add 300, rms_norm about 260); with ``--max-variants`` it shows
that the bounded run still reaches its examples.

Output: long-form JSON lines (one row per op and part, then a summary), appended to
``--out`` (default the device's ``benchmarks/results/<device>-checks.jsonl``), each row stamped
with device, versions and git sha. A fuzz row has ``status`` (pass / fail / crash / timeout /
excluded / not run), ``examples`` (run to the end; rejected ones not counted), ``mismatches``,
``seconds`` and ``budget_s`` (its slice), and where the time went: ``make_s``, ``fn_s``
(launches and their compiles), ``reference_s`` (float64 copies and both references),
``compare_s`` (one read of the results an output: on a GPU the device's work lands here),
``compiles`` / ``variants`` / ``compile_s`` (Triton compiles, counted by its
JIT hooks; 0 in the interpreter), ``compile_budget_s``, ``rejected_new_variant``,
``replayed`` and ``replay_invalid`` (replays the op refused as inputs), ``distinct_shapes``,
``reference_device`` and ``gpu_max_memory_gb``. The summary has the totals, the ops that
failed, fell short of ``--examples`` or did not run, and ``expected_op_budget_s`` (the slice
an op gets when the sanitizer uses its whole share), also printed at the end under a table
of the fuzz rows.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: families whose kernels stage data in shared memory: racecheck runs on them
RACECHECK_FAMILIES = ("reductions", "matmul", "attention", "cuda_ext", "inference",
                      "sampling")
#: cuda_ext kernels that use no shared memory
NO_SHARED = ("cuda_sgemm_naive",)
#: ops run on more than 2**31 elements under memcheck
HUGE_OPS = ("add", "rms_norm")
#: ops the fuzz part leaves out, and why (the row says so)
FUZZ_EXCLUDED = {
    "llama_layer": "a model spec: a composition of registered ops that are fuzzed one by one "
                   "(its recipe draws only the token count, 1..40, so it adds no new inputs "
                   "to any kernel), and each example runs a whole layer's launches and "
                   "compiles; check cases and the sanitizer still run it",
}
#: heavier families first, so that lanes share them out
FAMILY_WEIGHT = {"model": 0, "attention": 0, "matmul": 1, "moe": 1, "losses": 2, "inference": 2,
                 "sampling": 2, "cuda_ext": 3, "reductions": 3, "fuse": 3, "elementwise": 4}


# ---- compute-sanitizer's output --------------------------------------------------------------
_ERRORS = re.compile(r"ERROR SUMMARY: (\d+) errors?")
_RACES = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, "
                    r"(\d+) warnings?\)")


def parse_sanitizer(text: str) -> dict:
    """Counts from compute-sanitizer's summary lines (None where a line is missing: the run
    was cut short) and the first reports, for the row."""
    out = {"errors": None, "hazards": None, "race_errors": None, "race_warnings": None}
    m = _ERRORS.search(text)
    if m:
        out["errors"] = int(m.group(1))
    m = _RACES.search(text)
    if m:
        out["hazards"], out["race_errors"], out["race_warnings"] = map(int, m.groups())
    reports = [ln.strip("= ").strip() for ln in text.splitlines()
               if ln.startswith("=========") and re.search(
                   r"Invalid|Error|Race|out of bounds|misaligned|Program hit", ln)
               and "SUMMARY" not in ln]
    out["first_reports"] = reports[:5]
    return out


# a report's source location, "at 0x1a0 in /path/file.py:12" or (the H200's compute-sanitizer
# of 2026-12-03) "at _kernel+0x120 in file.py:12": the file without its directory
_WHERE = re.compile(r"at (?:\S+ )?in \S*?([\w.]+\.py):(\d+)")


def ws_lowering_lines() -> set[tuple[str, int]]:
    """(file, line) of each warp-specialized Gluon kernel's first line and its
    ``gl.warp_specialize`` call (the attention forward, the GEMM, the block-scaled fp8 GEMM;
    their file names differ): where racecheck misreports the lowering's capture protocol
    (tests/kernels/test_attention_ws_race.py and docs/NOTES.md say why)."""
    import inspect

    from tkit.kernels.attention import hopper as H
    from tkit.kernels.matmul import _fp8_block_hopper_kernels as FB
    from tkit.kernels.matmul import _gemm_hopper_kernels as GH

    lines = set()
    for kernel in (H._attn_fwd_hopper_ws_kernel, GH._gemm_ws_kernel, FB._fp8_block_ws_kernel):
        src, first = inspect.getsourcelines(kernel.fn)
        ws = first + next(i for i, ln in enumerate(src) if "gl.warp_specialize(" in ln)
        dl = first + next(i for i, ln in enumerate(src) if ln.lstrip().startswith("def "))
        name = Path(inspect.getsourcefile(kernel.fn)).name
        lines |= {(name, dl), (name, ws)}
    return lines


def explained_hazards(text: str, hazards: int | None, known: set[tuple[str, int]]) -> int:
    """The hazards of a racecheck run that are the known misreport: all of them when every
    location the reports name is one of ``known`` (0 otherwise, or when nothing is named)."""
    where = {(f, int(n)) for f, n in _WHERE.findall(text)}
    return (hazards or 0) if where and where <= known else 0


def find_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for base in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        path = Path(base) / "bin" / "compute-sanitizer"
        if base and path.exists():
            return str(path)
    return None


# ---- child side ------------------------------------------------------------------------------
def _load_profile(examples: int) -> None:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "reliability", max_examples=max(1, examples), derandomize=True, database=None,
        deadline=None, print_blob=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.filter_too_much, HealthCheck.differing_executors])
    settings.load_profile("reliability")


def _fuzz_op(name: str, examples: int, budget_s: float, compile_share: float = 0.0) -> dict:
    """Fuzz one op in this process; the counts, also when it fails. ``compile_share``: the
    part of ``budget_s`` that Triton compiles may take before examples that need a new
    kernel variant are refused (0: no bound)."""
    import torch

    from tkit import registry
    from tkit.testing import FuzzStats, fuzz
    from tkit.testing.tensors import default_device

    spec = registry.get(name)
    recipe = dict(spec.fuzz())
    fn, ref = recipe.pop("fn", spec.fn), recipe.pop("reference", spec.reference)
    recipe.pop("max_examples", None)  # the campaign's count and time slice decide
    stats = FuzzStats()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    compile_budget = round(compile_share * budget_s, 1) if compile_share > 0 else None
    row = {"max_examples": examples, "budget_s": round(budget_s, 1),
           "compile_budget_s": compile_budget,
           # where the float64 reference and the comparison run: the inputs' device
           "reference_device": default_device()}
    try:
        fuzz(fn, ref, **recipe, max_examples=examples, budget_s=budget_s, stats=stats,
             isolate=False, compile_budget_s=compile_budget)
        row["status"] = "pass"
    except Exception as e:
        from tkit.bench.isolate import context_lost

        if context_lost(f"{type(e).__name__}: {e}"):
            raise  # child_loop ends this child; a fresh one takes the remaining ops
        row["status"] = "crash" if stats.crashed else "fail"
        row["error"] = f"{type(e).__name__}: {e}"[:3000]
    row.update(stats.as_row())
    row["mismatches"] = stats.failed - stats.crashed
    if torch.cuda.is_available():
        row["gpu_max_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return row


def child_fuzz(examples: int, max_numel: int | None) -> None:
    """A fuzz lane's child: ops asked one at a time on stdin (``op {"budget_s": ...,
    "compile_share": ...}``), one row each on stdout (the protocol of tkit.bench.isolate)."""
    from tkit.bench.isolate import child_loop, stdin_requests
    from tkit.testing import strategies

    if max_numel:
        strategies.GPU_MAX_NUMEL = max_numel
    _load_profile(examples)
    bodies: dict[str, str] = {}

    def check_one(name):
        req = json.loads(bodies.pop(name))
        # the slice counts from now (this child's start-up came out of it), never past the
        # campaign's deadline, and at least a second (an op always runs some examples)
        budget = req["budget_s"]
        if "until" in req:
            budget = min(budget, req["until"] - time.time())
        return _fuzz_op(name, examples, max(1.0, budget), req.get("compile_share", 0.0))

    child_loop(stdin_requests(bodies), check_one)


# ---- compile variety counted on a CPU (--count-variants) --------------------------------------
class _Compiled:
    """What Triton's compile hooks are told of a stand-in compile: the kernel's name."""

    def __init__(self, name):
        self.name = name


def _launch_key(launch) -> tuple:
    """Triton's specialization key of one recorded launch, as far as the host can tell it:
    the kernel, each constexpr by value, each tensor's dtype and 16-byte alignment (its
    storage offset: a meta tensor has no address), each other argument's class (== 1, % 16,
    int range) unless the kernel does not specialize it."""
    import torch

    from tkit.kernels import _launch as L

    fn, kw = L.resolve(launch.kernel, dict(launch.kwargs))
    if fn is None:  # tuned by timing: one compile per config, counted once here
        return ("autotuned", repr(launch.kernel))
    const = {p.name for p in fn.params if p.is_constexpr}
    plain = {p.name for p in fn.params
             if p.num in set(getattr(fn, "do_not_specialize", ()) or ())}
    items = []
    for k, v in sorted(kw.items()):
        if k in const:
            items.append((k, repr(v)))
        elif isinstance(v, torch.Tensor):
            items.append((k, v.dtype, (v.storage_offset() * v.element_size()) % 16 == 0))
        elif k in plain:
            items.append((k, type(v).__name__))
        else:
            try:
                items.append((k, L._spec(v)))
            except Exception:
                items.append((k, type(v).__name__))
    return (getattr(fn, "__name__", repr(fn)), tuple(items))


def _stand_in(fn, compiled: set):
    """``fn`` run on meta copies of its arguments with its launches recorded, not run; each
    launch whose key is new goes through Triton's compile hooks as a compile would (so that
    fuzz's bound counts and refuses it). Returns a constant: the comparison is not the point."""
    import torch
    from triton import knobs

    from tkit.ir_tools.aot import to_meta
    from tkit.kernels import _common

    def run(*args, **kwargs):
        args = [to_meta(a) for a in args]
        kwargs = {k: to_meta(v) for k, v in kwargs.items()}
        with _common.capture_launches() as launches:
            fn(*args, **kwargs)
        rt = knobs.runtime
        for launch in launches:
            key = _launch_key(launch)
            if key in compiled:
                continue
            if rt.jit_cache_hook is not None:
                rt.jit_cache_hook(key=key, fn=_Compiled(key[0]))
            compiled.add(key)
            if rt.jit_post_compile_hook is not None:
                rt.jit_post_compile_hook(key=key, fn=_Compiled(key[0]))
        return torch.zeros(1)

    return run


def _zero(*args, **kwargs):
    import torch

    return torch.zeros(1)


def count_variants(name: str, examples: int, max_variants: int | None,
                   max_numel: int) -> dict:
    """The op's fuzz recipe at GPU sizes on a CPU, its launches recorded on meta tensors
    instead of run: how many kernel variants its examples would compile, and with
    ``max_variants``, how many examples the bounded run reaches (rejected, replayed). Forward
    launches only (no gradients); the paths a CPU's meta tensors take (no Hopper kernels)."""
    from tkit import registry
    from tkit.testing import FuzzStats, fuzz, strategies

    strategies.GPU_SIZES = True
    strategies.GPU_MAX_NUMEL = max_numel
    spec = registry.get(name)
    recipe = dict(spec.fuzz())
    fn = recipe.pop("fn", spec.fn)
    for k in ("reference", "max_examples", "grad", "factor", "floor", "scale"):
        recipe.pop(k, None)
    stats = FuzzStats()
    row = {"part": "variants", "op": name, "max_examples": examples,
           "max_variants": max_variants}
    t0 = time.time()
    try:
        fuzz(_stand_in(fn, set()), _zero, **recipe, max_examples=examples, isolate=False,
             stats=stats, max_variants=max_variants, device="cpu")
        row["status"] = "pass"
    except Exception as e:
        # a recipe that reads input values on the host cannot run on meta tensors
        row["status"] = "not countable" if "meta tensor" in str(e) else "error"
        row["error"] = f"{type(e).__name__}: {e}"[:500]
    out = stats.as_row()
    row.update({k: out[k] for k in ("examples", "variants", "rejected_new_variant", "replayed",
                                    "replay_invalid", "distinct_shapes")})
    row["seconds"] = round(time.time() - t0, 1)
    return row


def _huge(name: str) -> dict:
    """One launch on more than 2**31 elements; its output checked where an int32 offset would
    have wrapped (the last rows) and at the start."""
    import torch

    import tkit
    from tkit.testing.compare import max_error

    gen = torch.Generator(device="cuda").manual_seed(0)
    if name == "add":
        n = 2**31 + 1025
        a = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = tkit.add(a, b)
        wrong = 0
        for sl in (slice(0, 1 << 20), slice(n - (1 << 20), n)):
            wrong += int((out[sl] != (a[sl] + b[sl])).sum())  # both round one fp32 sum
        return {"case": f"add {n} bf16", "elements": n, "wrong_elements_checked": wrong}
    if name == "rms_norm":
        N = 4096
        M = 2**31 // N + 3
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = 1 + 0.1 * torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = tkit.rms_norm(x, w)
        errs = []
        for rows in (slice(0, 4), slice(M - 4, M)):
            xr = x[rows].double()
            ref = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
            errs.append(max_error(out[rows], ref))
        return {"case": f"rms_norm {M}x{N} bf16", "elements": M * N,
                "max_error_checked": max(errs), "ok": max(errs) < 0.05}
    raise ValueError(f"no huge case for {name}")


def child_sanitize(op: str, examples: int, budget_s: float, huge: bool) -> None:
    """The program compute-sanitizer runs: the op's check cases and fuzz examples (or its huge
    case); prints one RESULT line."""
    from tkit.testing import strategies

    # edge sizes are what the sanitizer is for; GPU-sized draws (up to 1M elements) would only
    # cost time under its instrumentation (racecheck especially)
    strategies.GPU_SIZES = False
    t0 = time.time()
    result: dict = {"op": op}
    if huge:
        result.update(_huge(op))
    else:
        from tkit import registry
        from tkit.testing import check_against_reference

        spec = registry.get(op)
        failed, cases = [], spec.check_cases()
        device = "cuda"
        import torch

        if not torch.cuda.is_available():
            device = "cpu"
        for case in cases:
            args, kwargs = case.make(device)
            try:
                check_against_reference(spec.fn, spec.reference, args, kwargs)
            except Exception as e:
                failed.append(f"{case.label}: {type(e).__name__}: {str(e)[:200]}")
        _load_profile(examples)
        result["check_cases"] = len(cases)
        result["check_failures"] = failed
        result["fuzz"] = _fuzz_op(op, examples, max(1.0, budget_s - (time.time() - t0)))
    result["seconds"] = round(time.time() - t0, 1)
    print("RESULT " + json.dumps(result, default=str), flush=True)


# ---- parent side -----------------------------------------------------------------------------
class Rows:
    """Long-form rows appended to the results file as they come (a cut-short run keeps what
    it measured)."""

    def __init__(self, path: Path, env: dict):
        self.path, self.env, self.rows = path, env, []
        self.lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, row: dict) -> None:
        row = {**row, **self.env}
        with self.lock:
            self.rows.append(row)
            with open(self.path, "a") as f:
                f.write(json.dumps(row, default=str) + "\n")


def _child_env() -> dict:
    env = dict(os.environ)
    env["TKIT_NO_AUTOTUNE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "")
                                                       .split(os.pathsep) if p])
    return env


def _sanitizer_tasks(specs, tools) -> list[tuple[str, str, bool]]:
    tasks = [(op, "memcheck", True) for op in HUGE_OPS
             if "memcheck" in tools and op in {s.name for s in specs}]
    if "memcheck" in tools:
        tasks += [(s.name, "memcheck", False) for s in specs]
    if "racecheck" in tools:
        tasks += [(s.name, "racecheck", False) for s in specs
                  if s.family in RACECHECK_FAMILIES and s.name not in NO_SHARED]
    return tasks


def run_sanitizer(specs, args, rows: Rows, deadline: float, sanitizer: str,
                  huge: bool = True) -> None:
    env = _child_env()
    env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    known = ws_lowering_lines()

    def one(task):
        op, tool, huge = task
        left = deadline - time.time()
        row = {"part": "sanitizer", "op": op, "tool": tool, "case": "huge" if huge else "edge"}
        if left < 20:
            rows.add({**row, "status": "not run: time budget"})
            return
        timeout = min(args.task_timeout, left)
        argv = [sanitizer, "--tool", tool, "--print-limit", "10", sys.executable,
                str(Path(__file__).resolve()), "--child", "sanitize", "--op", op,
                "--examples", str(args.sanitizer_examples),
                "--child-budget", str(max(5.0, timeout - 30.0))]  # sanitizer start and exit
        if huge:
            argv.append("--huge")
        t0 = time.time()
        try:
            p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
            text, status = p.stdout + p.stderr, f"exit {p.returncode}"
        except subprocess.TimeoutExpired as e:
            text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) \
                else (e.stdout or "")
            status = f"timeout after {timeout:.0f} s"
        parsed = parse_sanitizer(text)
        if tool == "racecheck":
            parsed["hazards_explained"] = explained_hazards(text, parsed["hazards"], known)
        result = next((json.loads(ln[7:]) for ln in text.splitlines()
                       if ln.startswith("RESULT ")), None)
        row.update(parsed, status=status, seconds=round(time.time() - t0, 1), result=result)
        if result is None:
            row["output_tail"] = text[-1500:]
        rows.add(row)
        n = parsed["errors"] if tool == "memcheck" else parsed["hazards"]
        print(f"sanitizer {tool:9s} {op:28s} {row['case']:5s} "
              f"{'?' if n is None else n} {'errors' if tool == 'memcheck' else 'hazards'} "
              f"({status}, {row['seconds']} s)", flush=True)

    tasks = [t for t in _sanitizer_tasks(specs, args.tools.split(",")) if huge or not t[2]]
    # the longest first (racecheck of the GEMMs and attention: up to a minute each), so that
    # the short ones fill the lanes at the end instead of one long one running alone
    family = {s.name: s.family for s in specs}
    tasks.sort(key=lambda t: (FAMILY_WEIGHT.get(family.get(t[0]), 5), t[1] != "racecheck"))
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(one, tasks))


def fuzz_order(specs) -> list[str]:
    """The ops to fuzz, heaviest first (their compiles are the longest: a lane that takes one
    late would run past the others), excluded ones left out."""
    order = sorted(specs, key=lambda s: FAMILY_WEIGHT.get(s.family, 5))
    return [s.name for s in order if s.name not in FUZZ_EXCLUDED]


def op_slice(left_s: float, jobs: int, waiting: int, running: int) -> float:
    """Seconds for the next op: an equal share of the lane-seconds left among it, the ops
    still waiting and the ones running (each of those holds a lane until it ends), and never
    past the deadline. An op that reaches its examples early gives its time back: the next
    op's share is worked out when it starts."""
    share = left_s * jobs / max(1, waiting + running + 1)
    return max(0.0, min(left_s - 2.0, share))


def run_fuzz(specs, args, rows: Rows, deadline: float) -> None:
    """The fuzz part: ``--jobs`` lanes, each one long-lived child that takes the next op from
    one queue (so that lanes share the ops out as they finish, not in fixed lists)."""
    from tkit.bench.isolate import Worker, context_lost

    for s in specs:
        if s.name in FUZZ_EXCLUDED:
            rows.add({"part": "fuzz", "op": s.name, "status": "excluded",
                      "reason": FUZZ_EXCLUDED[s.name], "examples": None})
    todo = fuzz_order(specs)
    if not todo:
        return
    env = _child_env()
    jobs = max(1, min(args.jobs, len(todo)))
    lock = threading.Lock()
    running = [0]
    left0 = deadline - time.time()
    print(f"fuzz: {len(todo)} ops on {jobs} lanes in {left0:.0f} s: about "
          f"{left0 * jobs / len(todo):.0f} s an op ({args.examples} examples, compiles "
          f"bounded to {args.compile_share:.0%} of an op's time)", flush=True)
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "fuzz",
            "--examples", str(args.examples), "--max-numel", str(args.max_numel)]

    def lane(_):
        worker = Worker(argv, deadline=60.0, first_deadline=120.0, env=env,
                        hang_hint=" (killed)")
        try:
            while True:
                with lock:
                    if not todo:
                        return
                    name = todo.pop(0)
                    left = deadline - time.time()
                    budget = op_slice(left, jobs, len(todo), running[0])
                    running[0] += 1
                row = {"part": "fuzz", "op": name}
                try:
                    if left < -30.0:  # far past the deadline (a hung lane came back late)
                        row.update(status="not run: time budget", examples=None)
                        continue
                    # an example past the op's time (a compile, shrinking) is let finish
                    budget = max(1.0, budget)
                    worker.deadline = budget + 90.0
                    worker.first_deadline = budget + 150.0
                    how, payload = worker.ask(name, json.dumps(
                        {"budget_s": budget, "until": deadline,
                         "compile_share": args.compile_share}))
                    if how == "ok":
                        row.update(payload)
                    else:
                        crash = "child died" in how or context_lost(how)
                        row.update(status="crash" if crash else "timeout"
                                   if how.startswith("no answer") else "error",
                                   error=how, examples=None)
                finally:
                    with lock:
                        running[0] -= 1
                    rows.add(row)
                    print(f"fuzz {name:28s} {row.get('status')}: {row.get('examples')} "
                          f"examples in {row.get('seconds')} s (budget {budget:.0f} s, "
                          f"compiles {row.get('compile_s')} s, {row.get('variants')} "
                          f"variants)", flush=True)
        finally:
            worker.close()

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        list(pool.map(lane, range(jobs)))


FUZZ_COLUMNS = ("status", "examples", "seconds", "budget_s", "compile_s", "variants",
                "rejected_new_variant", "replayed", "make_s", "fn_s", "reference_s",
                "compare_s")


def fuzz_table(rows: list[dict]) -> str:
    """One line an op: where its fuzzing time went."""
    fz = [r for r in rows if r.get("part") == "fuzz"]
    if not fz:
        return ""
    lines = [f"{'op':28s} " + " ".join(f"{c[:10]:>10s}" for c in FUZZ_COLUMNS)]
    for r in sorted(fz, key=lambda r: r["op"]):
        cells = []
        for c in FUZZ_COLUMNS:
            v = r.get(c)
            cells.append(f"{'-' if v is None else str(v)[:10]:>10s}")
        lines.append(f"{r['op']:28s} " + " ".join(cells))
    return "\n".join(lines)


def summarize(rows: list[dict]) -> dict:
    fz = [r for r in rows if r.get("part") == "fuzz"]
    sn = [r for r in rows if r.get("part") == "sanitizer"]
    return {
        "part": "summary",
        "fuzz_ops": len(fz),
        "fuzz_examples": sum(r.get("examples") or 0 for r in fz),
        "fuzz_ops_failed": sorted(r["op"] for r in fz if r.get("status") in ("fail", "crash")),
        "fuzz_ops_short": sorted(r["op"] for r in fz if r.get("status") != "excluded"
                                 and (r.get("examples") or 0) < (r.get("max_examples") or 0)),
        "fuzz_ops_not_run": sorted(r["op"] for r in fz if r.get("examples") is None
                                   and r.get("status") != "excluded"),
        "fuzz_ops_excluded": sorted(r["op"] for r in fz if r.get("status") == "excluded"),
        "fuzz_min_examples": min((r["examples"] for r in fz if r.get("examples") is not None),
                                 default=None),
        "fuzz_mismatches": sum(r.get("mismatches") or 0 for r in fz),
        "fuzz_compile_s": round(sum(r.get("compile_s") or 0 for r in fz), 1),
        "fuzz_variants": sum(r.get("variants") or 0 for r in fz),
        "sanitizer_runs": len(sn),
        "memcheck_errors": sum(r.get("errors") or 0 for r in sn if r.get("tool") == "memcheck"),
        # hazards at the warp-specialized forward's lowering lines (partial barrier 0: a
        # racecheck misreport, tests/kernels/test_attention_ws_race.py) counted apart
        "racecheck_hazards": sum((r.get("hazards") or 0) - (r.get("hazards_explained") or 0)
                                 for r in sn if r.get("tool") == "racecheck"),
        "racecheck_hazards_explained": sum(r.get("hazards_explained") or 0 for r in sn
                                           if r.get("tool") == "racecheck"),
        "sanitizer_ops_with_errors": sorted({r["op"] for r in sn if (r.get("errors") or 0)
                                             or (r.get("hazards") or 0)
                                             > (r.get("hazards_explained") or 0)}),
        "sanitizer_incomplete": sorted(f"{r['op']}/{r['tool']}/{r['case']}" for r in sn
                                       if r.get("errors") is None and r.get("hazards") is None),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", nargs="*", help="op or family names (default: every op)")
    ap.add_argument("--examples", type=int, default=1000, help="fuzz examples per op")
    ap.add_argument("--budget", type=float, default=500.0, help="seconds for the whole run")
    ap.add_argument("--sanitizer-share", type=float, default=0.3,
                    help="part of the budget for the sanitizer when both parts run (what it "
                    "leaves passes to the fuzzing)")
    ap.add_argument("--compile-share", type=float, default=0.45,
                    help="part of an op's fuzz time that Triton compiles may take; after it, "
                    "examples that need a new kernel variant are refused and examples re-run "
                    "compiled ones on new sizes of the same compile class (0: unbounded)")
    ap.add_argument("--max-numel", type=int, default=1 << 18,
                    help="largest input the GPU-sized shape strategies draw in the fuzz part "
                    "(inputs are drawn on the host; 32-bit offsets have the huge case)")
    ap.add_argument("--sanitizer-examples", type=int, default=10,
                    help="fuzz examples per op under the sanitizer (after its check cases)")
    ap.add_argument("--task-timeout", type=float, default=150.0,
                    help="seconds one sanitizer run may take")
    ap.add_argument("--tools", default="memcheck,racecheck")
    ap.add_argument("--sanitizer", help="compute-sanitizer to run (default: found on PATH or "
                    "in /usr/local/cuda/bin); given explicitly, it runs without a GPU too (the "
                    "CPU test passes a stand-in)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="child processes at once (default: one a CPU core: a fuzz lane's "
                    "time is mostly Triton compiles, one core each)")
    part = ap.add_mutually_exclusive_group()
    part.add_argument("--sanitizer-only", action="store_true")
    part.add_argument("--fuzz-only", action="store_true")
    ap.add_argument("--out", type=Path, help="JSON lines file to append to")
    ap.add_argument("--count-variants", action="store_true",
                    help="no GPU needed: run each op's recipe at GPU sizes with its launches "
                    "recorded on meta tensors, not run, and count the kernel variants its "
                    "examples would compile (with --max-variants, the bounded run's counts); "
                    "run without TRITON_INTERPRET")
    ap.add_argument("--max-variants", type=int,
                    help="with --count-variants: the bound on compiled variants")
    # child modes (run by this script itself)
    ap.add_argument("--child", choices=("fuzz", "sanitize"), help=argparse.SUPPRESS)
    ap.add_argument("--op", help=argparse.SUPPRESS)
    ap.add_argument("--child-budget", type=float, default=60.0, help=argparse.SUPPRESS)
    ap.add_argument("--huge", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child == "fuzz":
        child_fuzz(args.examples, args.max_numel)
        return 0
    if args.child == "sanitize":
        child_sanitize(args.op, args.examples, args.child_budget, args.huge)
        return 0

    if args.count_variants:
        return main_count_variants(args)
    t_start = time.time()
    deadline = t_start + args.budget
    import torch

    from tkit import registry
    from tkit.bench.runner import environment

    env = environment()
    env["run"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    specs = registry.select(args.ops)
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.ops:
        specs = [s for s in specs if s.family != "cuda_ext"]  # raw CUDA: no interpreter
    from tkit.bench.report import device_slug

    # the device's long-form file of untimed records (benchmarks/results/<device>-checks.jsonl)
    out = args.out or ROOT / "benchmarks" / "results" / f"{device_slug(env['device'])}-checks.jsonl"
    rows = Rows(out, env)
    print(f"reliability: {len(specs)} ops, budget {args.budget:.0f} s, {args.jobs} jobs, "
          f"rows to {out}", flush=True)

    if not args.fuzz_only:
        sanitizer = args.sanitizer or (find_sanitizer() if on_gpu else None)
        if sanitizer is None:
            why = "no GPU" if not on_gpu else "compute-sanitizer not found"
            rows.add({"part": "sanitizer", "op": None, "status": f"not run: {why}"})
            print(f"sanitizer: not run ({why})", flush=True)
        else:
            share = 1.0 if args.sanitizer_only else args.sanitizer_share
            run_sanitizer(specs, args, rows, t_start + share * args.budget, sanitizer,
                          huge=on_gpu)
    if not args.sanitizer_only:
        run_fuzz(specs, args, rows, deadline)
    summary = summarize(rows.rows)
    summary["seconds"] = round(time.time() - t_start, 1)
    n_fuzz = len(fuzz_order(specs))
    if not args.sanitizer_only and n_fuzz:
        # what an op gets when the sanitizer uses its whole share: the figure to size the run by
        fuzz_s = args.budget * (1.0 if args.fuzz_only else 1.0 - args.sanitizer_share)
        summary["expected_op_budget_s"] = round(fuzz_s * min(args.jobs, n_fuzz) / n_fuzz, 1)
    rows.add(summary)
    table = fuzz_table(rows.rows)
    if table:
        print(table, flush=True)
    print(json.dumps(summary, indent=1), flush=True)
    if "expected_op_budget_s" in summary:
        print(f"expected per-op fuzz budget: {summary['expected_op_budget_s']} s "
              f"({n_fuzz} ops, {min(args.jobs, n_fuzz)} lanes, compiles up to "
              f"{args.compile_share:.0%} of it)", flush=True)
    return 0


def main_count_variants(args) -> int:
    """``--count-variants``: one row an op (and a table), each op in this process."""
    from tkit import registry

    if os.environ.get("TRITON_INTERPRET", "").strip() in ("1", "true"):
        print("--count-variants records launches of the compiled kernels: run it without "
              "TRITON_INTERPRET", file=sys.stderr)
        return 2
    _load_profile(args.examples)
    specs = registry.select(args.ops)
    rows = []
    for name in fuzz_order(specs):
        if registry.get(name).family == "cuda_ext":
            continue  # raw CUDA: nothing compiles per call
        row = count_variants(name, args.examples, args.max_variants, args.max_numel)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0 if all(r["status"] in ("pass", "not countable") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
