"""Reduction family on the GPU: correctness at benchmark sizes, then timings against baselines.

    python scripts/gpu_reductions.py            # everything, stops adding cases at 110 s
    python scripts/gpu_reductions.py --ns 8192,32768,65536,262144,long   # the decisive sweep Ns
    OUT=/some/dir python scripts/gpu_reductions.py --sections sweep --sweep-ops softmax

torch.compile's cold compiles (one per shape and op) dominate the run time; cases the budget
cuts are recorded as skipped and printed, so a second call with ``--sections`` can finish them.

Sections (in this order, each skipped with a note once the time budget is spent):
  1. copy ceiling measured in this run (1 GiB bf16 clone: bytes read + written)
  2. correctness at benchmark sizes (bf16; error against a float32 reference vs. torch's bf16
     error, the DESIGN rule on the GPU without moving 256 MiB tensors to the host)
  3. forward at M=16384 x N=8192 bf16: tkit (heuristic config and neighbour configs), torch
     eager, torch.compile, Liger-Kernel when importable
  4. backward at N=8192 (rms_norm, layer_norm, softmax): tkit kernels alone vs. autograd of
     torch eager / torch.compile / Liger
  5. the N sweep, 1024..262144 at 256 MiB (+ softmax at 1M columns): tkit vs. torch.compile and
     Liger, with tkit's long-row variants (split/loop thresholds, L2 batching) side by side
Output: a table on stdout, all rows as JSON in $OUT/gpu_reductions.json (default ./out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tkit  # noqa: E402
from tkit import registry  # noqa: E402
from tkit.kernels import norm as nk  # noqa: E402
from tkit.kernels import softmax as sk  # noqa: E402

REF_COPY_TBS = 4.25  # FACTS.md, same device
ROWS: list[dict] = []
T0 = time.time()


def elapsed():
    return time.time() - T0


@contextlib.contextmanager
def override(**kw):
    old = dict(sk.OVERRIDE)
    sk.OVERRIDE.update(kw)
    try:
        yield
    finally:
        sk.OVERRIDE.clear()
        sk.OVERRIDE.update(old)


def bench(fn, rep=40):
    try:
        fn()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(fn, warmup=10, rep=rep, quantiles=[0.5, 0.2, 0.8])
        return [float(m) for m in ms]
    except Exception as e:  # a baseline that fails to compile must not stop the run
        return f"{type(e).__name__}: {str(e)[:160]}"


def record(section, op, case, provider, ms, nbytes, ceiling, **extra):
    row = dict(section=section, op=op, case=case, provider=provider, **extra)
    if isinstance(ms, str):
        row["error"] = ms
    else:
        tbs = nbytes / (ms[0] * 1e-3) / 1e12
        row.update(median_ms=ms[0], p20_ms=ms[1], p80_ms=ms[2], bytes=nbytes, tbs=tbs,
                   pct_ceiling=100 * tbs / ceiling)
    ROWS.append(row)
    return row


# ---- 1. ceiling -------------------------------------------------------------------------------
def copy_ceiling():
    x = torch.empty(2**29, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    ms = bench(lambda x=x, y=y: y.copy_(x), rep=100)
    x = y = None
    tbs = 2 * 2**30 / (ms[0] * 1e-3) / 1e12
    ROWS.append(dict(section="ceiling", op="copy", case="1 GiB bf16", provider="torch",
                     median_ms=ms[0], tbs=tbs))
    return tbs


# ---- helpers ------------------------------------------------------------------------------------
def _call(fn, args, kwargs):
    return lambda: fn(*args, **kwargs)


def fwd_fns(name, args, kwargs):
    spec = registry.get(name)
    fns = {"tkit": _call(spec.fn, args, kwargs)}
    for prov, fn in spec.available_baselines().items():
        fns[prov] = _call(fn, args, kwargs)
    return fns


def fwd_bytes(name, args, kwargs):
    return registry.get(name).cost(*args, **kwargs).bytes


def check(name, args, kwargs, label):
    """bf16 output vs. float32 reference, against torch's own bf16 error (factor 2 + 1 ulp)."""
    spec = registry.get(name)
    with torch.no_grad():
        out = spec.fn(*args, **kwargs)
        ref = spec.reference(*[a.float() if torch.is_tensor(a) else a for a in args], **kwargs)
        peer = spec.reference(*args, **kwargs)
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    peers = peer if isinstance(peer, tuple) else (peer,)
    ok = True
    worst = []
    for o, r, p in zip(outs, refs, peers):
        fin = torch.isfinite(r)
        err = (o.float() - r).abs()[fin].max().item()
        perr = (p.float() - r).abs()[fin].max().item()
        bound = 2 * perr + 2**-7 * r[fin].abs().max().item()
        nan_bad = bool((~torch.isfinite(o) & fin).any())
        ok &= err <= bound and not nan_bad
        worst.append((err, perr))
    ROWS.append(dict(section="check", op=name, case=label, ok=ok, errors=worst))
    return ok


def make_case(name, label):
    for case in registry.get(name).bench_cases():
        if case.label == label:
            return case.make("cuda")
    raise KeyError(label)


# ---- 3. forward at the target shape -------------------------------------------------------------
FWD_VARIANTS = {
    # neighbours of the heuristic (N=8192 bf16: 16 warps; layer_norm 8, rms_norm_residual 32)
    "tkit w8": dict(num_warps=8), "tkit w16": dict(num_warps=16), "tkit w32": dict(num_warps=32),
    # the norms' persistent forward (next row tile prefetched): forced on / off / 2 programs an SM
    "tkit persist": dict(norm_fwd_persist=True), "tkit no persist": dict(norm_fwd_persist=False),
    "tkit persist 2xSM": dict(norm_fwd_persist=True, norm_fwd_programs=264),
    "tkit evict_first": dict(softmax_evict="evict_first"),
}


def forward_target(ceiling):
    for name in ("rms_norm", "rms_norm_residual", "layer_norm", "softmax", "log_softmax"):
        args, kwargs = make_case(name, "16384x8192 bf16")
        nbytes = fwd_bytes(name, args, kwargs)
        for prov, fn in fwd_fns(name, args, kwargs).items():
            record("forward", name, "16384x8192", prov, bench(fn), nbytes, ceiling)
        for vname, ov in FWD_VARIANTS.items():
            with override(**ov):
                record("forward", name, "16384x8192", vname,
                       bench(_call(registry.get(name).fn, args, kwargs)), nbytes, ceiling)
        args = None
        torch.cuda.empty_cache()


# ---- 4. backward -------------------------------------------------------------------------------
def backward_target(ceiling, shape=(16384, 8192)):
    M, N = shape
    dev = "cuda"
    bf = torch.bfloat16
    x = torch.randn(shape, device=dev, dtype=bf)
    w = (1 + 0.1 * torch.randn(N, device=dev)).to(bf)
    b = (0.1 * torch.randn(N, device=dev)).to(bf)
    dy = torch.randn(shape, device=dev, dtype=bf)
    nbytes = 3 * M * N * 2 + 2 * N * 2
    y_sm = tkit.softmax(x)

    # the (mean, rstd) rows that the forward saves when autograd will need them
    st_rms = nk._norm_fwd_impl(x, w, None, None, 1e-6, True, True)[2]
    st_ln = nk._norm_fwd_impl(x, w, b, None, 1e-5, False, True)[2]
    tk = {
        "rms_norm": lambda: nk._norm_bwd_impl(x, w, dy, None, 1e-6, True, False, st_rms),
        "layer_norm": lambda: nk._norm_bwd_impl(x, w, dy, None, 1e-5, False, True, st_ln),
        "softmax": lambda: sk._softmax_bwd_impl(y_sm, dy, 1, False),
    }
    variants = {  # the default is 16 warps for all three (the norms had 32 before)
        "rms_norm": {"tkit recompute stats": dict(norm_bwd_fstats=False),
                     "tkit w32": dict(norm_bwd_warps=32)},
        "layer_norm": {"tkit recompute stats": dict(norm_bwd_fstats=False),
                       "tkit w32": dict(norm_bwd_warps=32)},
        "softmax": {"tkit w8": dict(num_warps=8)},
    }
    for name, fn in tk.items():
        # correctness of the tkit backward at this size against float32 autograd
        spec = registry.get(name)
        xs = [x.float().requires_grad_(), w.float().requires_grad_(), b.float().requires_grad_()]
        inputs = {"rms_norm": xs[:2], "layer_norm": xs, "softmax": xs[:1]}[name]
        ref_out = spec.reference(*inputs)
        ref_grads = torch.autograd.grad(ref_out, inputs, dy.float())
        got = fn()
        got = got if isinstance(got, tuple) else (got,)
        errs = [((g.float() - r).abs().max().item(), r.abs().max().item())
                for g, r in zip(got, ref_grads)]
        ROWS.append(dict(section="check", op=name + " backward", case="16384x8192", errors=errs,
                         ok=all(e <= 0.05 * max(s, 1e-3) for e, s in errs)))
        del ref_out, ref_grads, xs, inputs
        record("backward", name, "16384x8192", "tkit", bench(fn), nbytes, ceiling)
        for vname, ov in variants[name].items():
            with override(**ov):
                record("backward", name, "16384x8192", vname, bench(fn), nbytes, ceiling)
        # baselines: autograd.grad through their forward graph (backward kernels only)
        for prov, f in spec.available_baselines().items():
            try:
                xi = x.detach().requires_grad_()
                wi = w.detach().requires_grad_()
                bi = b.detach().requires_grad_()
                ins = {"rms_norm": (xi, wi), "layer_norm": (xi, wi, bi), "softmax": (xi,)}[name]
                out = f(*ins)
                ms = bench(lambda out=out, ins=ins: torch.autograd.grad(out, ins, dy,
                                                                        retain_graph=True))
            except Exception as e:
                ms = f"{type(e).__name__}: {str(e)[:160]}"
            record("backward", name, "16384x8192", prov, ms, nbytes, ceiling)
            out = None
        torch.cuda.empty_cache()


# ---- 5. sweep ----------------------------------------------------------------------------------
SWEEP_VARIANTS = {
    # long-row knobs, compared at N >= 16384 only (they do nothing on shorter rows), and
    # row/warp/eviction knobs at every N
    "softmax": {
        "tkit split": dict(softmax_long="split"),
        "tkit loop chunk8k": dict(loop_chunk=8192),
        "tkit fused<=64KiB": dict(fused_max_bytes=64 * 1024),
        "tkit evict_first": dict(softmax_evict="evict_first"),
    },
    "rms_norm": {
        "tkit loop chunk8k": dict(norm_chunk=8192),
        "tkit w16": dict(num_warps=16),
        "tkit 1 row w8": dict(rows=1, num_warps=8),
    },
    "layer_norm": {"tkit loop from 32KiB": dict(norm_fwd_single_bytes=16 * 1024),
                   "tkit loop from 32KiB chunk8k": dict(norm_fwd_single_bytes=16 * 1024,
                                                        norm_chunk=8192),
                   "tkit w32": dict(num_warps=32)},
    "rms_norm_residual": {"tkit loop from 32KiB": dict(norm_fwd_single_bytes=16 * 1024),
                          "tkit loop from 32KiB chunk8k": dict(
                              norm_fwd_single_bytes=16 * 1024, norm_chunk=8192)},
}


def _selected(case):
    if case.group == "long":
        return "long" in NS_GROUPS
    return any(case.label == f"sweep N={n}" for n in NS)


def sweep(ceiling, budget, ops):
    for name in ops:
        cases = [c for c in registry.get(name).bench_cases() if c.group in ("sweep", "long")]
        for case in cases:
            if elapsed() > budget:
                ROWS.append(dict(section="sweep", op=name, case=case.label, skipped="budget"))
                continue
            if (NS or NS_GROUPS) and not _selected(case):
                continue
            args, kwargs = case.make("cuda")
            nbytes = fwd_bytes(name, args, kwargs)
            check(name, args, kwargs, case.label)
            fns = fwd_fns(name, args, kwargs)
            for prov, fn in fns.items():
                record("sweep", name, case.label, prov, bench(fn), nbytes, ceiling,
                       N=args[0].shape[-1])
            n = args[0].shape[-1]
            for vname, ov in SWEEP_VARIANTS.get(name, {}).items():
                if n < 16384 and not {"softmax_evict", "num_warps", "rows"} & ov.keys():
                    continue  # the long-row knobs do nothing on short rows
                with override(**ov):
                    record("sweep", name, case.label, vname,
                           bench(_call(registry.get(name).fn, args, kwargs)), nbytes,
                           ceiling, N=n)
            args = fns = None
            torch.cuda.empty_cache()


# ---- host overhead ----------------------------------------------------------------------------
def overhead(ceiling):
    """Tiny inputs: the time is the host's launch cost (the split paths launch 2 kernels per row
    batch, so this says how many batches the GPU time can hide)."""
    cases = {
        "rms_norm 1x1024 (1 launch)": (tkit.rms_norm, (torch.randn(1, 1024, device="cuda"),
                                                        torch.ones(1024, device="cuda"))),
        "softmax 1x1024 (1 launch)": (tkit.softmax, (torch.randn(1, 1024, device="cuda"),)),
        "softmax 1x65536 (2 launches)": (tkit.softmax, (torch.randn(1, 65536,
                                                                    device="cuda"),)),
        "torch.softmax 1x1024": (torch.softmax, (torch.randn(1, 1024, device="cuda"), -1)),
    }
    for label, (fn, args) in cases.items():
        record("overhead", label.split()[0], label, "tkit" if "torch" not in label else "torch",
               bench(_call(fn, args, {})), 1, ceiling)


# ---- report ------------------------------------------------------------------------------------
def table():
    lines = []
    by = {}
    for r in ROWS:
        if r.get("section") in ("forward", "backward", "sweep") and "tbs" in r:
            by.setdefault((r["section"], r["op"], r["case"]), {})[r["provider"]] = r["tbs"]
    lines.append(f"{'section':9} {'op':18} {'case':24} {'tkit':>6} {'best var':>16} "
                 f"{'eager':>6} {'compile':>7} {'liger':>6} {'%ceil':>6} {'x best base':>11}")
    for (sec, op, case), p in by.items():
        t = p.get("tkit", float("nan"))
        var = {k: v for k, v in p.items() if k.startswith("tkit ")}
        bv = max(var.items(), key=lambda kv: kv[1]) if var else ("", float("nan"))
        base = max([p.get("torch.compile", 0), p.get("liger", 0)]) or float("nan")
        lines.append(
            f"{sec:9} {op:18} {case:24} {t:6.2f} {bv[0][5:]:>10} {bv[1]:5.2f} "
            f"{p.get('torch', float('nan')):6.2f} {p.get('torch.compile', float('nan')):7.2f} "
            f"{p.get('liger', float('nan')):6.2f} {100 * t / CEIL:6.1f} {t / base:11.2f}")
    return "\n".join(lines)


CEIL = REF_COPY_TBS
NS: list[int] = []  # --ns: sweep only these N (empty: all)
NS_GROUPS: list[str] = []


def main():
    global CEIL
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=110.0,
                    help="seconds after which remaining sweep cases are skipped (recorded)")
    ap.add_argument("--sections", default="forward,sweep1,backward,sweep",
                    help="forward, sweep1 (rms_norm sweep), backward, sweep (the other ops)")
    ap.add_argument("--sweep-ops", default="softmax,layer_norm,rms_norm_residual")
    ap.add_argument("--ns", default="",
                    help="comma-separated sweep N values to run (and 'long' for the 1M-column "
                         "softmax case); default all")
    opts = ap.parse_args()
    global NS, NS_GROUPS
    NS = [int(v) for v in opts.ns.split(",") if v.strip().isdigit()]
    NS_GROUPS = [v for v in opts.ns.split(",") if v.strip() and not v.strip().isdigit()]
    out_dir = Path(os.environ.get("OUT", "./out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    # one torch.compile'd reference serves every shape of the sweep: without this, dynamo stops
    # recompiling after 8 shapes and silently runs the rest eagerly
    for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 512)
    CEIL = copy_ceiling()
    print(f"copy ceiling this run: {CEIL:.2f} TB/s (FACTS.md: {REF_COPY_TBS})", flush=True)
    for name in ("rms_norm", "rms_norm_residual", "layer_norm", "softmax", "log_softmax"):
        args, kwargs = make_case(name, "16384x8192 bf16")
        ok = check(name, args, kwargs, "16384x8192")
        print(f"check {name:18} 16384x8192: {'ok' if ok else 'FAIL'}", flush=True)
        args = None
    sections = opts.sections.split(",")
    overhead(CEIL)
    if "forward" in sections:
        forward_target(CEIL)
        print(f"[{elapsed():.0f}s] forward done", flush=True)
    # the rms_norm sweep before the backward: torch.compile's cold compiles (one per shape)
    # are most of this script's time, and the sweep is what the budget might cut
    if "sweep1" in sections:
        sweep(CEIL, opts.budget, ["rms_norm"])
        print(f"[{elapsed():.0f}s] rms_norm sweep done", flush=True)
    if "backward" in sections:
        backward_target(CEIL)
        print(f"[{elapsed():.0f}s] backward done", flush=True)
    if "sweep" in sections:
        sweep(CEIL, opts.budget, [s for s in opts.sweep_ops.split(",") if s])
        print(f"[{elapsed():.0f}s] sweep done", flush=True)
    try:
        from tkit.bench.runner import git_sha

        sha = git_sha()
    except Exception:
        sha = ""
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, git_sha=sha, copy_ceiling_tbs=CEIL,
                seconds=elapsed())
    (out_dir / "gpu_reductions.json").write_text(json.dumps(dict(meta=meta, rows=ROWS),
                                                            indent=1, default=str))
    fails = [r for r in ROWS if r.get("section") == "check" and not r.get("ok")]
    errors = [r for r in ROWS if "error" in r]
    skipped = [r for r in ROWS if "skipped" in r]
    print("\nTB/s (bytes read + written); %ceil against this run's copy; "
          "'x best base' = tkit / max(torch.compile, liger)")
    print(table())
    for r in ROWS:
        if r.get("section") == "overhead" and "median_ms" in r:
            print(f"host/launch overhead: {r['case']:32} {r['median_ms'] * 1e3:7.1f} us")
    print(f"\nchecks failed: {len(fails)}  " + "; ".join(
        f"{r['op']} {r['case']} {r['errors']}" for r in fails))
    print(f"providers that errored: {len(errors)}  " + "; ".join(
        f"{r['op']} {r['case']} {r['provider']}: {r['error'][:80]}" for r in errors[:8]))
    print(f"skipped for time: {len(skipped)} " + ", ".join(
        f"{r['op']} {r['case']}" for r in skipped) + f"; total {elapsed():.0f}s; "
          f"json: {out_dir / 'gpu_reductions.json'}")


if __name__ == "__main__":
    main()
