"""Forward-only FlashAttention sweep on the H200 (issue #6): every candidate config launched
directly (no autotuner), SDPA flash and cuDNN interleaved as baselines.

    python scripts/gpu_attention_sweep.py            # OUT=./out by default; ~2 minutes
    python scripts/gpu_attention_sweep.py --autotuned  # also the registered op, autotuned
    python scripts/gpu_attention_sweep.py --dry      # CPU plumbing check (interpreter)
    python scripts/gpu_attention_sweep.py --focus [--rounds 3]  # ~2 minutes: see below

Main shape: B=4 H=16 S=4096 D=128 bf16, non-causal and causal. Then, while the time budget
(SWEEP_BUDGET_S, default 135 s) lasts, D=64 and D=256 with a few configs.

Per variant: median / p20 / p80 of ``triton.testing.do_bench`` (L2 flushed between calls),
TFLOP/s = 4*B*H*S*S*D (/2 causal) / time, and the max abs error of the output against SDPA's
flash backend on the same inputs (SDPA cuDNN's own error against flash is printed as the
yardstick; a variant more than 4x that, and over 1e-2, is flagged WRONG). A variant that fails
to compile (Triton 3.6's ptxas crashes with -11 on two-stage TMA configs) is recorded with its
error and the sweep goes on. SDPA flash/cuDNN are re-timed after every few variants; the
summary uses the median of their timings.

Variant names: ``BMxBN sS wW tma|ptr [hgN]``; ``hg`` is the forward's HEAD_GROUP (tile order:
(batch, head) pairs per L2 section; ``hg=all`` is the order before sections existed, every
head of a query block before the next block; no ``hg``: the default, ``fwd_head_group``).
Rows go to $OUT/attention_sweep.json.

``--focus``: a short list (FOCUS, the contenders of the first run) timed in ROUNDS interleaved
rounds (``--rounds N``, default 3): per causal setting, each round times SDPA flash/cuDNN and
then every variant once, plus the registered op through its autotuner (tuned once before the
rounds); then D=256 and D=64 with a few tiles (fewer rounds if the budget runs short). The
summary gives every provider's median TFLOP/s over its timings with the spread (min-max,
% of the median), and its median per-round ratio to the same round's cuDNN/flash timings.
Rows carry their round; output goes to $OUT/attention_focus.json.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback

DRY = "--dry" in sys.argv
FOCUS_MODE = "--focus" in sys.argv
ROUNDS = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

from tkit.kernels import attention as A  # noqa: E402

DEV = "cpu" if DRY else "cuda"
DT = torch.float16 if DRY else torch.bfloat16  # the interpreter's bf16 dot is garbage
T0 = time.time()
# --focus: the main shape's rounds stop at BUDGET_S (default 110 s), the other head dims' at
# BUDGET_S + 40 (the first round of each always runs)
BUDGET_S = float(os.environ.get("SWEEP_BUDGET_S", 110 if FOCUS_MODE else 135))
TARGETS = {False: 485.0, True: 425.0}  # issue #6, TFLOP/s at the main shape
ALL = 1 << 30  # HEAD_GROUP >= batch * heads: the plain order


def V(bm, bn, s, w, tma, hg=None, ws=False):
    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_stages=s, num_warps=w, USE_TMA=tma, WARP_SPEC=ws)
    if hg is not None:
        cfg["HEAD_GROUP"] = hg
    name = f"{bm}x{bn} s{s} w{w} {'tma' if tma else 'ptr'}"
    if ws:
        name += " ws"
    if hg is not None:
        name += f" hg{'all' if hg >= ALL else hg}"
    return name, cfg


# Most informative first (the budget may cut the tail). Compiled for sm_90 on CPU (Triton
# 3.6, D=128, non-causal): 128x64 w8 ptr 182 regs, TMA 159; 128x128 s3 w8 TMA 199 regs and
# 225 KB shared (causal 247 regs), ptr 255; 64x64 s3/s2 w4 ptr 2 blocks/SM; 64x64 s3 w4 TMA
# 1 block/SM (113 KB shared); s2 + TMA crashes ptxas.
MAIN = [
    V(128, 64, 3, 8, False, ALL),   # the autotuner's pick before sections (430.8 / 393.1)
    V(128, 64, 3, 8, False),        # same, sectioned tile order (default HEAD_GROUP)
    V(64, 64, 3, 4, True, ALL),     # the best causal config measured before (431)
    V(64, 64, 3, 4, True),
    V(128, 64, 3, 8, False, 1),     # one head at a time
    V(128, 64, 3, 8, False, 4),
    V(128, 64, 4, 8, False),
    V(128, 64, 3, 8, True),
    V(128, 64, 4, 8, True),
    V(128, 128, 3, 8, True),
    V(128, 128, 2, 8, False),
    V(64, 64, 3, 4, False),         # 2 CTAs/SM: two programs interleave MMA and softmax
    V(64, 64, 2, 4, False),
    V(64, 128, 3, 4, True),
    V(64, 64, 2, 4, True),          # expected to crash ptxas (recorded, not fatal)
]
HEAD_DIMS = {
    64: [V(128, 64, 3, 8, False), V(128, 128, 3, 8, True), V(64, 64, 3, 4, True)],
    256: [V(64, 32, 3, 4, True), V(64, 64, 2, 4, False), V(128, 64, 2, 8, False)],
}
BASELINE_EVERY = 4
# --focus: the first run's contenders (its TFLOP/s, non-causal / causal, in the comments),
# the same list for both causal settings
FOCUS = [
    V(128, 64, 3, 8, False, 1),     # 492.3 / 407.3
    V(128, 64, 3, 8, False, 4),     # 490.3 / 430.3
    V(128, 64, 3, 8, False),        # 443.7 / 409.8 (default: hg16 at the main shape)
    V(128, 64, 3, 8, False, ALL),   # 478.1 / 419.3
    V(128, 64, 4, 8, False, 4),     # (default order: 482.5 / 417.2)
    V(64, 64, 3, 4, False, 1),
    V(64, 64, 3, 4, False, 4),
    V(64, 64, 3, 4, False),         # 451.7 / 445.8
    V(64, 64, 3, 4, False, ALL),
    V(64, 64, 3, 4, True, 4),
    V(64, 64, 3, 4, True, ALL),     # 396.3 / 434.1
    V(128, 128, 3, 8, True),        # 468.5 / 419.8
]
FOCUS_HEAD_DIMS = {
    256: [V(128, 64, 2, 8, False), V(64, 32, 3, 4, True)],
    64: [V(128, 64, 3, 8, False), V(64, 64, 3, 4, True), V(64, 64, 3, 4, False)],
}
if DRY:
    MAIN = [V(16, 16, 1, 4, False, ALL), V(16, 16, 1, 4, False), V(16, 16, 1, 4, True, 1),
            V(16, 16, 1, 4, False, 3)]
    HEAD_DIMS = {64: MAIN[:1]}
    BASELINE_EVERY = 2
    FOCUS = MAIN[:3]
    FOCUS_HEAD_DIMS = {64: MAIN[:2]}

ROWS: list[dict] = []


def left(extra: float = 0.0) -> float:
    return BUDGET_S + extra - (time.time() - T0)


def bench(fn):
    if DRY:
        t = time.time()
        fn()
        ms = (time.time() - t) * 1e3
        return ms, ms, ms
    return tuple(triton.testing.do_bench(fn, warmup=10, rep=40, quantiles=[0.5, 0.2, 0.8]))


def flops(b, h, s, d, causal):
    return 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)


def git_sha() -> str:
    from tkit.bench.runner import git_sha as sha

    return sha()


def sdpa(backend_name):
    if DRY:
        def run(qt, kt, vt, causal):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt,
                                                                    is_causal=causal)
        return run
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[
        backend_name]

    def run(qt, kt, vt, causal):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt,
                                                                    is_causal=causal)
    return run


def record(shape, d, causal, provider, cfg, times, fl, err=None, failure=None, note="",
           rnd=None):
    med, p20, p80 = times if times else (None, None, None)
    tf = fl / (med * 1e-3) / 1e12 if med else None
    row = dict(op="flash_attention_fwd", shape=shape, head_dim=d, dtype=str(DT).split(".")[-1],
               causal=causal, provider=provider, config=cfg, median_ms=med, p20_ms=p20,
               p80_ms=p80, tflops=tf, max_abs_err_vs_sdpa_flash=err, failure=failure,
               note=note, round=rnd, t_s=round(time.time() - T0, 1))
    ROWS.append(row)
    mask = "causal" if causal else "full  "
    if failure:
        print(f"  {shape:20s} {mask} {provider:30s} FAILED: {failure[:150]}", flush=True)
    else:
        e = f"  err {err:.2e}" if err is not None else ""
        print(f"  {shape:20s} {mask} {provider:30s} {med:8.3f} ms {tf:7.1f} TFLOP/s{e}"
              f"{'  ' + note if note else ''}", flush=True)
    return row


def inputs(b, s, h, d):
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device=DEV, dtype=DT, generator=g) for _ in range(3))
    return q, k, v, tuple(t.transpose(1, 2) for t in (q, k, v))  # SDPA's (B, H, S, D) views


def reference(qt, kt, vt, causal):
    """SDPA flash's output (B, S, H, D), the baselines' errors against it (None: backend
    unavailable) and the tolerance for tkit's error."""
    ref = sdpa("flash")(qt, kt, vt, causal).transpose(1, 2)
    base_err = {}
    for name in ("flash", "cudnn"):
        try:
            out = sdpa(name)(qt, kt, vt, causal).transpose(1, 2)
            base_err[name] = (out.float() - ref.float()).abs().max().item()
            del out
        except Exception as e:
            base_err[name] = None
            print(f"  sdpa_{name}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
    yard = base_err.get("cudnn")
    tol = max(4 * yard, 1e-2) if yard is not None else 5e-2
    return ref, base_err, tol


def time_baselines(shape, d, causal, fl, qkv_t, base_err, tag="", rnd=None):
    for name in ("flash", "cudnn"):
        if base_err.get(name) is None:
            continue
        fn = sdpa(name)
        record(shape, d, causal, f"sdpa_{name}", None,
               bench(lambda fn=fn, c=causal: fn(*qkv_t, c)), fl, err=base_err[name],
               note=tag, rnd=rnd)


def time_variant(shape, d, causal, fl, qkv, ref, tol, name, cfg, rnd=None):
    """Check and time one config launched directly; a failure is recorded, not raised."""
    q, k, v = qkv
    s = q.shape[1]
    fn = lambda cfg=cfg, c=causal: A._fwd_impl(  # noqa: E731
        q, k, v, None, None, s, s, c, d ** -0.5, -1, -1, 0.0, config=cfg)
    try:
        out, _ = fn()
        err = (out.float() - ref.float()).abs().max().item()
        del out
        note = "WRONG" if not err <= tol else ""
        r = record(shape, d, causal, "tkit " + name, cfg, bench(fn), fl, err=err, note=note,
                   rnd=rnd)
        t = TARGETS.get(causal) if d == 128 and s == 4096 else None
        if t and r["tflops"] >= t and not note:
            r["note"] = "meets issue target"
    except Exception as e:
        msg = f"{type(e).__name__}: {' '.join(str(e).split())}"[:400]
        record(shape, d, causal, "tkit " + name, cfg, None, fl, failure=msg, rnd=rnd)


def autotuned_fn(qkv, causal):
    import tkit
    q, k, v = qkv
    return lambda c=causal: tkit.flash_attention(q, k, v, causal=c)


def run_shape(b, s, h, d, variants, causals, autotuned=False):
    shape = f"B{b} S{s} H{h} D{d}"
    q, k, v, qkv_t = inputs(b, s, h, d)
    for causal in causals:
        if left() < 0:
            print(f"  (budget spent: skipping {shape} {'causal' if causal else 'full'})")
            return
        fl = flops(b, h, s, d, causal)
        ref, base_err, tol = reference(*qkv_t, causal)
        time_baselines(shape, d, causal, fl, qkv_t, base_err, "(before)")
        for i, (name, cfg) in enumerate(variants):
            if left() < 0:
                print(f"  (budget spent: {len(variants) - i} variants skipped)")
                break
            time_variant(shape, d, causal, fl, (q, k, v), ref, tol, name, cfg)
            if (i + 1) % BASELINE_EVERY == 0 and i + 1 < len(variants):
                time_baselines(shape, d, causal, fl, qkv_t, base_err, f"(after {i + 1})")
        time_baselines(shape, d, causal, fl, qkv_t, base_err, "(after)")
        if autotuned and left() > 0:
            fn = autotuned_fn((q, k, v), causal)
            try:
                err = (fn().float() - ref.float()).abs().max().item()
                r = record(shape, d, causal, "tkit autotuned", None, bench(fn), fl, err=err)
                best = getattr(A._attn_fwd_autotuned, "best_config", None)
                r["note"] = f"chose {best}"
                print(f"    autotuner chose {best}")
            except Exception:
                traceback.print_exc()
        del ref


def run_focus(b, s, h, d, variants, causals, rounds, autotuned=False, extra=0.0):
    """``rounds`` interleaved rounds per causal setting: baselines, every variant once, then
    the autotuned op (tuned, and its error checked, before the first round). A round starts
    only while the budget lasts (the first always runs)."""
    shape = f"B{b} S{s} H{h} D{d}"
    q, k, v, qkv_t = inputs(b, s, h, d)
    for causal in causals:
        fl = flops(b, h, s, d, causal)
        ref, base_err, tol = reference(*qkv_t, causal)
        auto = None
        if autotuned:
            fn = autotuned_fn((q, k, v), causal)
            try:
                t = time.time()
                err = (fn().float() - ref.float()).abs().max().item()
                best = getattr(A._attn_fwd_autotuned, "best_config", None)
                print(f"    autotuner chose {best} ({time.time() - t:.0f} s to tune)")
                auto = (fn, err, f"chose {best}" + ("  WRONG" if not err <= tol else ""))
            except Exception:
                traceback.print_exc()
        for rnd in range(rounds):
            if rnd and left(extra) < 0:
                print(f"  (budget spent: {shape} {'causal' if causal else 'full'} stops "
                      f"after {rnd} rounds)")
                break
            print(f"  -- round {rnd + 1}/{rounds}", flush=True)
            time_baselines(shape, d, causal, fl, qkv_t, base_err, rnd=rnd)
            for name, cfg in variants:
                time_variant(shape, d, causal, fl, (q, k, v), ref, tol, name, cfg, rnd=rnd)
            if auto is not None:
                fn, err, note = auto
                record(shape, d, causal, "tkit autotuned", None, bench(fn), fl, err=err,
                       note=note, rnd=rnd)
        time_baselines(shape, d, causal, fl, qkv_t, base_err, "(after)", rnd=None)
        del ref


def summarize():
    """Per (shape, causal): every provider's median TFLOP/s over its timings, with the spread
    (min-max as % of the median, n timings); x<baseline>: the ratio of medians, and with
    rounds, the median over rounds of the ratio to the same round's baseline."""
    print("\n== summary (TFLOP/s: median over timings [min-max spread, n]; baselines: all "
          "their timings in this run)")
    groups = {}
    for r in ROWS:
        groups.setdefault((r["shape"], r["causal"]), []).append(r)
    for (shape, causal), rows in groups.items():
        by = {}
        for r in rows:
            by.setdefault(r["provider"], []).append(r)
        stats = {}
        for prov, rs in by.items():
            tf = [r["tflops"] for r in rs if r["tflops"]]
            if tf:
                m = statistics.median(tf)
                stats[prov] = (m, 100 * (max(tf) - min(tf)) / m, len(tf))
        base = {k[5:]: v[0] for k, v in stats.items() if k.startswith("sdpa")}
        base_round = {}  # (baseline, round) -> TFLOP/s
        for r in rows:
            if r["provider"].startswith("sdpa") and r["tflops"] and r["round"] is not None:
                base_round[(r["provider"][5:], r["round"])] = r["tflops"]
        t = TARGETS.get(causal) if shape == "B4 S4096 H16 D128" else None
        print(f"-- {shape} {'causal' if causal else 'non-causal'}"
              + "".join(f"  {k} {v:.1f} [{stats['sdpa_' + k][1]:.0f}%]"
                        for k, v in base.items())
              + (f"  (target {t:.0f})" if t else ""))
        tk = [p for p in by if p.startswith("tkit")]
        for prov in sorted(tk, key=lambda p: -stats.get(p, (0,))[0]):
            rs = by[prov]
            if prov not in stats:
                print(f"   {prov:30s}   compile/run failure: {(rs[0]['failure'] or '')[:80]}")
                continue
            m, spread, n = stats[prov]
            x = []
            for k, v in base.items():
                rr = [r["tflops"] / base_round[(k, r["round"])] for r in rs
                      if r["tflops"] and (k, r["round"]) in base_round]
                per_round = f" (per round {statistics.median(rr):.3f})" if rr else ""
                x.append(f"x{k} {m / v:.3f}" + per_round)
            errs = [r["max_abs_err_vs_sdpa_flash"] for r in rs
                    if r["max_abs_err_vs_sdpa_flash"] is not None]
            notes = sorted({r["note"] for r in rs if r["note"]})
            print(f"   {prov:30s} {m:7.1f} [{spread:4.1f}%, {n}]  {'  '.join(x)}"
                  f"  err {max(errs) if errs else float('nan'):.1e}"
                  f"{'  ' + '; '.join(notes) if notes else ''}")


def main():
    autotuned = "--autotuned" in sys.argv or FOCUS_MODE
    device = torch.cuda.get_device_name() if not DRY else "cpu (dry run)"
    print(f"torch {torch.__version__}, triton {triton.__version__}, {device}; "
          f"budget {BUDGET_S:.0f} s" + (f", focus: {ROUNDS} rounds" if FOCUS_MODE else ""),
          flush=True)
    if FOCUS_MODE:
        b, s, h, d = (1, 40, 2, 32) if DRY else (4, 4096, 16, 128)
        print(f"== B={b} S={s} H={h} D={d} (fwd), focus")
        run_focus(b, s, h, d, FOCUS, (False, True), ROUNDS, autotuned=True)
        for d, variants in FOCUS_HEAD_DIMS.items():
            b, s, h = (1, 33, 2) if DRY else (4, 4096, 16)
            print(f"== B={b} S={s} H={h} D={d} (fwd), focus")
            run_focus(b, s, h, d, variants, (False, True), ROUNDS, extra=40.0)
    elif DRY:
        run_shape(1, 40, 2, 32, MAIN, (False, True), autotuned=autotuned)
        for d, variants in HEAD_DIMS.items():
            run_shape(1, 33, 2, d, variants, (True,))
    else:
        print("== B=4 H=16 S=4096 D=128 (fwd)")
        run_shape(4, 4096, 16, 128, MAIN, (False, True), autotuned=autotuned)
        for d, variants in HEAD_DIMS.items():
            if left() > 0:
                print(f"== B=4 H=16 S=4096 D={d} (fwd)")
                run_shape(4, 4096, 16, d, variants, (False, True))
    summarize()
    out = os.environ.get("OUT", "./out")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "attention_focus.json" if FOCUS_MODE else "attention_sweep.json")
    meta = dict(device=torch.cuda.get_device_name() if not DRY else "cpu (dry run)",
                torch=torch.__version__, triton=triton.__version__, git_sha=git_sha(),
                seconds=round(time.time() - T0, 1), budget_s=BUDGET_S,
                mode="focus" if FOCUS_MODE else "sweep", rounds=ROUNDS if FOCUS_MODE else 1,
                default_head_group_main=A.fwd_head_group(4096, 128, 2, 1))
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=ROWS), f, indent=1, default=str)
    print(f"wrote {path} ({len(ROWS)} rows) in {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
