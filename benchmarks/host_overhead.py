"""tkit's own host time per eager call at decode sizes, on a machine without a GPU.

Only the last step of a launch is replaced: the compiled kernel's launcher (``CompiledKernel.run``,
Triton's C launcher on a GPU) is a no-op that counts its calls. Everything else runs for real on
CPU tensors: the public function, its checks, the eager plan lookup, ``torch.empty``, the binder
and key of :mod:`tkit.kernels._launch`, config choice, and (in the ``registered`` column) the
torch.library custom-op dispatch. Figures are microseconds a call, the best of 40 bursts of 200
calls in thread CPU time (the minimum keeps other processes' load on a shared machine out).

* ``eager``: the public function as a user calls it (plans on, where the op has them).
* ``no plan``: the same with eager plans off: every call validates and plans afresh and goes
  through the launch layer's cached-kernel path (the state before plans).
* ``registered``: the registered torch.library op called as a torch.compile graph (and the
  autograd path) calls it, ``torch.ops.tkit.<op>(...)`` with the arguments the public function
  passes it, plans on: the custom-op dispatch plus the op's implementation, served by a plan
  where it has one.
* ``reg. py``: the registered call with the ops' C++ kernels removed (their Python autograd
  kernel, the implementation and ``serve_op`` serve the plan), measured beside ``registered``.
* ``reg. no plan``: the same call with plans off (the implementation's full Python path; what
  TKIT_NO_DIRECT=1 costs on top of the public function's checks).
* ``floor``: ``torch.empty`` of the call's outputs (and scratch) plus the launcher call with the
  recorded arguments: what no Python layer can avoid. ``eager - floor`` is what tkit adds.
* ``calls``: Python function calls a call (cProfile), eager / no plan.

matmul picks its kernel as on an sm_90 with 132 SMs (split-K and a reduce launch at M=1).

    python benchmarks/host_overhead.py [--cplan] [--json FILE] [--out DIR]
                                       [--profile OP [--registered]]

(without TRITON_INTERPRET)

``--json FILE`` appends the rows (with device, versions and git sha from ``tkit.bench``) as JSON
lines; ``--out DIR`` also appends them to DIR's long-form file (``cpu.jsonl``: op, case, provider
= eager / no plan / registered / registered no plan / floor, ``median_ms`` = the best burst's
time a call) under the run id ``<date>-host-overhead``. ``--profile OP`` prints a cProfile of
the public call of the first case named OP...; with ``--registered``, of its registered op's.

``--cplan``: plans are the C++ executor's, as on a GPU (the stand-in kernels dressed as Triton's
compiled kernels; the executor drops their launches), instead of the generated Python plans
that stand-in launchers otherwise get.

Run it without TRITON_INTERPRET (kernels must be ``JITFunction`` objects); CPU tensors stand in
for CUDA ones. It also runs on an older checkout (columns it cannot fill print "-").
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import tkit  # noqa: E402
from tkit import _env  # noqa: E402
from tkit.bench import report  # noqa: E402
from tkit.bench.runner import environment  # noqa: E402
from tkit.kernels import _launch  # noqa: E402

try:
    from tkit.kernels import _plan  # noqa: E402
except ImportError:  # a checkout from before eager plans
    _plan = None


class _NoopCompiled(_launch.CompiledKernel):
    """Stands in for a compiled kernel: what ``run`` is handed is counted, nothing launches."""

    run = None

    def __init__(self):
        self.module = None  # Triton 3.9's __del__ unloads a module when one is set
        self.function = 1
        self.packed_metadata = None
        self.calls = 0
        self.run = self._run

    def _run(self, *args):
        self.calls += 1


def _fake_jit_run(self, *args, grid, warmup, **kwargs):
    if callable(grid):
        grid(kwargs)
    return _NoopCompiled()


def _dress_for_cplan() -> None:
    """``--cplan``: each stand-in compiled kernel gets what the C++ executor reads from Triton's
    (an int function handle, launch metadata, a signature from its first recorded launch, the
    host descriptors' metadata as for 16-bit tiles with 128-byte swizzling), and the executor
    drops the launches: plans take the form they have on a GPU."""
    from types import SimpleNamespace

    from tkit.kernels import _cplan
    from tkit.testing._standins import launch_signature

    mod = _cplan.module()
    if mod is None:
        raise SystemExit(f"--cplan: no C++ executor here: {_cplan.status()}")
    orig = _launch._record

    def record(item):
        if item is not None and not hasattr(item[0], "src"):
            ck, args = item[0], item[2]
            sig, descs = launch_signature(args)
            ck.src = SimpleNamespace(signature=sig)
            ck.metadata = SimpleNamespace(
                num_ctas=1, global_scratch_size=0, profile_scratch_size=0, num_warps=4,
                shared=0, launch_cooperative_grid=False, launch_pdl=False,
                tensordesc_meta=descs)
        orig(item)

    _launch._record = record
    _plan._cplan_test = True
    mod.set_discard(True)


def _torch_glu(x, w_gu):
    gu = torch.nn.functional.linear(x, w_gu)
    return torch.nn.functional.silu(gu[:, :14336]) * gu[:, 14336:]


def cases(device="cpu", torch_calls=False):
    """name -> (the public call, the registered op's call that a compiled graph makes for it);
    with ``torch_calls``, name -> torch's own call of the same computation instead."""
    bf = torch.bfloat16
    r = lambda *s: torch.randn(*s, dtype=bf, device=device)  # noqa: E731
    a, b = r(1, 4096), r(1, 4096)
    w = r(4096)
    g, u = r(1, 14336), r(1, 14336)
    x1 = r(1, 4096)
    W = r(4096, 4096)
    q = r(1, 1, 32, 128)
    k = r(1, 4096, 8, 128)
    v = r(1, 4096, 8, 128)
    qp, kp, vp = r(1, 512, 32, 128), r(1, 512, 8, 128), r(1, 512, 8, 128)
    # the 512-token layer's o-projection (the Gluon GEMM on sm_90: host TMA descriptors)
    xm, wm, rm = r(512, 4096), r(4096, 4096), r(512, 4096)
    # the layer's gate/up projection with SwiGLU at 512 tokens (matmul_glu's Gluon build)
    wgu = r(2 * 14336, 4096)
    # a decode step's INT4 gate/up-sized projection (the CUDA GEMV on sm_90)
    qi, si, zi = tkit.quantize_int4(r(14336, 4096), 128)
    wi = r(14336, 4096)
    ops = torch.ops.tkit
    if torch_calls:
        F = torch.nn.functional
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return {
            "add (1,4096)": lambda: torch.add(a, b),
            "rms_norm (1,4096)": lambda: F.rms_norm(a, (4096,), w, 1e-6),
            "rms_norm+residual (1,4096)": lambda: F.rms_norm(a + b, (4096,), w, 1e-6),
            "silu_mul (1,14336)": lambda: F.silu(g) * u,
            "softmax (1,4096)": lambda: torch.softmax(a, -1),
            "matmul M=1 4096x4096": lambda: torch.matmul(x1, W),
            "matmul M=512 4096x4096 + residual": lambda: torch.addmm(rm, xm, wm.t()),
            "matmul_glu M=512 gate_up 14336": lambda: _torch_glu(xm, wgu),
            "matmul_int4 M=1 4096x14336": lambda: F.linear(x1, wi),
            "flash_attention decode 4096 GQA4": lambda: F.scaled_dot_product_attention(
                qt, kt, vt, enable_gqa=True),
            "flash_attention prefill 512 causal": lambda: F.scaled_dot_product_attention(
                qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2), is_causal=True,
                enable_gqa=True),
        }
    return {
        "add (1,4096)": (lambda: tkit.add(a, b), lambda: ops.binary(a, b, "add", None)),
        "rms_norm (1,4096)": (lambda: tkit.rms_norm(a, w),
                              lambda: ops.rms_norm(a, w, 1e-6, False)),
        "rms_norm+residual (1,4096)": (lambda: tkit.rms_norm(a, w, residual=b),
                                       lambda: ops.rms_norm_residual(a, b, w, 1e-6, False)),
        "silu_mul (1,14336)": (lambda: tkit.silu_mul(g, u), lambda: ops.act_mul(g, u, "silu")),
        "softmax (1,4096)": (lambda: tkit.softmax(a), lambda: ops.softmax(a, 1, False)),
        "matmul M=1 4096x4096": (lambda: tkit.matmul(x1, W), lambda: ops.matmul(
            x1, W, None, None, None, None, "", None, True, "auto")),
        "matmul M=512 4096x4096 + residual": (
            lambda: tkit.matmul(xm, wm.t(), residual=rm),
            lambda: ops.matmul(xm, wm.t(), None, rm, None, None, "", None, True, "auto")),
        "matmul_glu M=512 gate_up 14336": (
            lambda: tkit.matmul_glu(xm, wgu.t()),
            lambda: ops.matmul_glu(xm, wgu.t(), None, "silu", None, True)),
        "matmul_int4 M=1 4096x14336": (
            lambda: tkit.matmul_int4(x1, qi, si, zi, group_size=128),
            lambda: ops.matmul_int4(x1, qi, si, zi, 128, None)),
        "flash_attention decode 4096 GQA4": (lambda: tkit.flash_attention(q, k, v), lambda: (
            ops.flash_attn_fwd(q, k, v, None, None, 1, 4096, False, 128 ** -0.5, -1, -1, 0.0))),
        "flash_attention prefill 512 causal": (
            lambda: tkit.flash_attention(qp, kp, vp, causal=True), lambda: (
                ops.flash_attn_fwd(qp, kp, vp, None, None, 512, 512, True, 128 ** -0.5, -1, 0,
                                   0.0))),
    }


def per_call_us(fn, n=200, rounds=40) -> float:
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time() - t0) / n * 1e6)
    return best


def calls_per_call(fn, n=200) -> float:
    fn()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    return pstats.Stats(pr).total_calls / n


def _maybe(measure, *args):
    """``measure(*args)``, or None where the call fails (an op an older checkout lacks)."""
    try:
        return measure(*args)
    except Exception:  # noqa: BLE001
        return None


def _set_plans(on: bool) -> None:
    if _plan is not None:
        _plan.ON = on


def floor_fn(fn):
    """``torch.empty`` of fn's outputs + each recorded launch's launcher call, or None (also
    for calls with a CUDA-hatch launch, whose launcher this floor does not model)."""
    if _plan is None:
        return None
    on = _plan.ON
    _plan.ON = False  # the ordinary path, whose launches are recorded
    try:
        with _launch.recording() as rec:
            out = fn()
    finally:
        _plan.ON = on
    if not rec or any(r is None or isinstance(r, _launch.RawLaunch) for r in rec):
        return None
    outs = out if isinstance(out, tuple) else (out,)
    specs = [(tuple(o.shape), o.dtype, o.device) for o in outs + tuple(rec.scratch)]
    launches = [(ck.run, g, ck.function, ck.packed_metadata, args) for ck, g, args in rec]
    empty = torch.empty

    def floor():
        for s, d, v in specs:
            empty(s, dtype=d, device=v)
        for run, g, f, md, args in launches:
            run(g[0], g[1], g[2], 0, f, md, None, None, None, *args)
    return floor


def _long_rows(rows):
    """One long-form row a (call, column): op and case from the call's name, the column as the
    provider, the best burst's time a call as ``median_ms`` (a minimum, see the docstring)."""
    out = []
    for r in rows:
        op, _, case = r["op"].partition(" ")
        for provider, key in (("eager", "eager_us"), ("no plan", "no_plan_us"),
                              ("registered", "registered_us"),
                              ("registered py", "registered_py_us"),
                              ("registered no plan", "registered_no_plan_us"),
                              ("floor", "floor_us")):
            us = r[key]
            out.append({"op": op, "case": case, "group": "host overhead", "provider": provider,
                        "median_ms": us / 1e3 if us is not None else None, "p20_ms": None,
                        "p80_ms": None, "statistic": "best of bursts, thread CPU time",
                        "calls": r["calls"] if provider == "eager" else
                        r["calls_no_plan"] if provider == "no plan" else None})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default=None, help="cProfile this case (a name prefix)")
    ap.add_argument("--registered", action="store_true",
                    help="--profile the registered op's call instead of the public function")
    ap.add_argument("--json", default=None, help="write the rows here (JSON lines)")
    ap.add_argument("--out", default=None,
                    help="append the rows to this results folder's long-form file too")
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--cplan", action="store_true",
                    help="plans in the C++ executor's form, as on a GPU (launches dropped)")
    ap.add_argument("--cuda", action="store_true",
                    help="on a GPU: real launches on CUDA tensors, beside torch's own calls")
    args = ap.parse_args()
    if args.cuda:
        return main_cuda(args)
    # CPU tensors pass tkit's device check as under the interpreter; kernels stay JIT functions
    _env.INTERPRET = True
    _launch._enabled = True
    _launch._device_stream = lambda: (0, 0)
    if _plan is not None:
        _plan.CPU_OK = True
    _launch.JITFunction.run = _fake_jit_run
    torch.set_grad_enabled(False)  # inference, as a decode step runs
    # the kernels plan as on the H200 (sm_90, 132 SMs): matmul takes split-K with a reduce at
    # M=1 (before issue #19 only matmul was patched; decode's split count now sees 132 SMs too)
    from tkit.kernels import _device

    _device.capability = lambda device=None: (9, 0)
    _device.sm_count = lambda device: 132
    # the registered ops' C++ kernels, for CPU tensors (as for CUDA tensors on a GPU)
    if args.cplan:
        _dress_for_cplan()
    fast_ops = _plan is not None and hasattr(_plan, "register_ops") and _plan.register_ops(
        "cpu")
    rows = []
    env = environment()
    print(f"{env['device']}, torch {env['torch']}, triton {env['triton']}, git {env['git_sha']}")
    fmt = lambda v, w=6: f"{v:{w}.1f}" if v is not None else " " * (w - 1) + "-"  # noqa: E731
    print(f"{'us a call':34s} {'eager':>6s} {'no plan':>7s} {'registered':>10s} {'reg. py':>7s}"
          f" {'reg. no plan':>12s} {'floor':>6s} {'eager-floor':>11s}  calls (eager / no plan)")
    for name, (fn, op) in cases().items():
        try:
            _set_plans(True)
            eager = per_call_us(fn, args.n)
            ncalls = calls_per_call(fn)
            fl = floor_fn(fn)
            floor = per_call_us(fl, args.n) if fl is not None else None
            registered = _maybe(per_call_us, op, args.n)
            registered_py = None
            if fast_ops:
                _plan.unregister_ops("cpu")
                registered_py = _maybe(per_call_us, op, args.n)
                _plan.register_ops("cpu")
            _set_plans(False)
            noplan = per_call_us(fn, args.n)
            ncalls_noplan = calls_per_call(fn)
            registered_noplan = _maybe(per_call_us, op, args.n)
            _set_plans(True)
        except Exception as e:  # noqa: BLE001 - report and go on (a CUDA-only step on CPU)
            print(f"{name:34s} skipped: {type(e).__name__}: {str(e)[:80]}")
            continue
        row = dict(op=name, eager_us=eager, no_plan_us=noplan, registered_us=registered,
                   registered_py_us=registered_py, registered_no_plan_us=registered_noplan,
                   floor_us=floor, calls=ncalls, calls_no_plan=ncalls_noplan, **env)
        rows.append(row)
        over = eager - floor if floor is not None else None
        print(f"{name:34s} {fmt(eager)} {fmt(noplan, 7)} {fmt(registered, 10)} "
              f"{fmt(registered_py, 7)} "
              f"{fmt(registered_noplan, 12)} {fmt(floor)} {fmt(over, 11)}  "
              f"{ncalls:.0f} / {ncalls_noplan:.0f}")
    print("launch path counters:", _launch.stats)
    if args.json:
        with open(args.json, "a") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")
    if args.out and rows:
        path = report.append_long_form(_long_rows(rows), args.out, env,
                                       run=f"{env['date']}-host-overhead",
                                       source="benchmarks/host_overhead.py")
        print(f"appended {len(rows) * 6} rows to {path}")
    if args.profile:
        fn = next(fo[args.registered] for n, fo in cases().items()
                  if n.startswith(args.profile))
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.n):
            fn()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(20)


def main_cuda(args):
    """The same columns on a GPU, launches real (thread CPU time: the host's share of a call,
    the driver's launch included), beside torch's own call of each computation and two parts
    of the floor: ``torch.empty`` of the outputs alone and the launcher calls alone (data
    pointers as ints, as the plans pass them)."""
    torch.set_grad_enabled(False)
    env = environment()
    print(f"{env['device']}, torch {env['torch']}, triton {env['triton']}, git {env['git_sha']}")
    from tkit.kernels import _cplan

    _cplan.module()  # built or loaded here, not inside the first timed call
    print("C++ plan executor:", _cplan.status())
    ref = cases("cuda", torch_calls=True)
    # py plan: the eager call with its plan built in Python (the executor off)
    cols = ("eager", "py plan", "registered", "floor", "empty", "launch", "torch")
    print(f"{'us a call (thread CPU time)':34s}" + "".join(f"{c:>11s}" for c in cols))
    rows = []
    for name, (fn, op) in cases("cuda").items():
        fn()
        torch.cuda.synchronize()
        fl = floor_fn(fn)
        got = dict(eager=per_call_us(fn, args.n), registered=_maybe(per_call_us, op, args.n),
                   torch=per_call_us(ref[name], args.n))
        if _plan is not None and _cplan.module() is not None:
            _cplan.ON = False
            _plan.clear()
            try:
                fn()
                got["py plan"] = per_call_us(fn, args.n)
            finally:
                _cplan.ON = True
                _plan.clear()
                fn()
        if fl is not None:
            got["floor"] = per_call_us(fl, args.n)
            only_empty, only_launch = _floor_parts(fl)
            got["empty"] = per_call_us(only_empty, args.n)
            got["launch"] = per_call_us(only_launch, args.n)
        torch.cuda.synchronize()
        print(f"{name:34s}" + "".join(f"{got[c]:11.1f}" if got.get(c) is not None
                                      else f"{'-':>11s}" for c in cols))
        rows.append(dict(op=name, **{f"{c}_us": got.get(c) for c in cols}, **env))
    if args.json:
        with open(args.json, "a") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")


def _floor_parts(fl):
    """The floor's two halves as calls of their own: the allocations, the launcher calls."""
    cells = dict(zip(fl.__code__.co_freevars, (c.cell_contents for c in fl.__closure__)))
    specs, empty = cells["specs"], torch.empty
    # pointers as ints, as the plans hand them over
    launches = [(run, g, f, md, tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a
                                      for a in args))
                for run, g, f, md, args in cells["launches"]]

    def only_empty():
        for s, d, v in specs:
            empty(s, dtype=d, device=v)

    def only_launch():
        for run, g, f, md, args in launches:
            run(g[0], g[1], g[2], 0, f, md, None, None, None, *args)
    return only_empty, only_launch


if __name__ == "__main__":
    main()
