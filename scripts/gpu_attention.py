"""FlashAttention on the H200: correctness at benchmark sizes, kernel variants side by side,
SDPA's flash and cuDNN backends as baselines. Finishes in about two minutes.

    python scripts/gpu_attention.py            # all sections; OUT=./out by default
    python scripts/gpu_attention.py quick      # the main shape only, through the registered
                                               # op (autotuned), beside SDPA: about a minute
    python scripts/gpu_attention.py main sweep # only some sections (quick, main, head_dims,
                                               # extras, sweep, varlen)
    python scripts/gpu_attention.py --dry      # CPU plumbing check under the interpreter

Sections stop starting once ATTN_BUDGET_S (default 105 s) is spent; most of the time is
compilation (about 1.5 s a forward variant, 4 s a backward one), so a second call with the
sections that were skipped (e.g. ``sweep varlen``) completes the picture.

Sections:
  quick      B=4 H=16 S=4096 D=128 bf16 through ``tkit.flash_attention`` (the autotuner picks,
             as a user gets it): forward non-causal and causal, backward causal through
             autograd; SDPA flash / cuDNN beside it; every config each autotuner timed; errors
             against a float32 reference. Not part of the default run (``main`` covers it).
  main       B=4 H=16 S=4096 D=128 bf16: forward variants (TMA vs pointer loads, warp
             specialization on/off, BLOCK_N 64/128, 2..4 stages) non-causal and causal, the
             autotuned choice, backward configs (causal and not), SDPA flash / cuDNN, errors
             against a float32 reference.
  head_dims  D=64 and D=256, causal, forward and backward.
  extras     packed qkv views, sliding window (1024, 0), softcap, GQA 32/8 (with SDPA), causal.
  sweep      seqlen 512..16384 at 16K tokens a batch, causal, forward and backward.
  varlen     a mixed-length batch of 16K tokens (causal), against SDPA on the padded batch.

FLOPs: 4*B*H*Sq*Sk*D forward (half when causal), backward 2.5x the forward. The ceiling is a
bf16 cuBLAS GEMM at 4096^3 measured in the same run. Full rows go to $OUT/gpu_attention.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

DRY = "--dry" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

import tkit  # noqa: E402
from tkit.kernels import attention as A  # noqa: E402
from tkit.specs.attention import ref_attention  # noqa: E402

DEV = "cpu" if DRY else "cuda"
DT = torch.float16 if DRY else torch.bfloat16
T0 = time.time()
BUDGET_S = float(os.environ.get("ATTN_BUDGET_S", 105))
ROWS: list[dict] = []
ISSUE_TARGETS = {("fwd", False): 485, ("fwd", True): 425, ("bwd", True): 305}

# variants of the forward at the main shape: (BLOCK_M, BLOCK_N, stages, warps, TMA, warp spec)
# (two stages through TMA descriptors crash Triton 3.6's ptxas with error -11: not listed)
FWD_VARIANTS = [
    (128, 64, 3, 8, False, True),
    (128, 64, 3, 8, True, True),
    (128, 64, 3, 8, False, False),
    (128, 64, 4, 8, False, True),
    (128, 128, 2, 8, False, True),
    (64, 64, 3, 4, True, False),
    (64, 64, 3, 4, False, False),
]
BWD_VARIANTS = [(64, 64, 3, 4), (64, 128, 2, 8), (128, 64, 2, 8)]
if DRY:
    FWD_VARIANTS = [(16, 16, 1, 4, True, False), (16, 16, 1, 4, False, False)]
    BWD_VARIANTS = [(16, 16, 1, 4)]


def left() -> float:
    return BUDGET_S - (time.time() - T0)


def bench(fn) -> tuple[float, float, float]:
    if DRY:
        t = time.time()
        fn()
        ms = (time.time() - t) * 1e3
        return ms, ms, ms
    q = triton.testing.do_bench(fn, warmup=10, rep=40, quantiles=[0.5, 0.2, 0.8])
    return tuple(q)


def fwd_cfg(v):
    bm, bn, s, w, tma, ws = v
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_stages=s, num_warps=w, USE_TMA=tma, WARP_SPEC=ws)


def bwd_cfg(v):
    bm, bn, s, w = v
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_stages=s, num_warps=w)


def vname(v) -> str:
    if len(v) == 6:
        bm, bn, s, w, tma, ws = v
        return f"{bm}x{bn} s{s} w{w} {'tma' if tma else 'ptr'}{' ws' if ws else ''}"
    bm, bn, s, w = v
    return f"{bm}x{bn} s{s} w{w}"


def flops(b, h, sq, sk, d, causal, direction):
    f = 4.0 * b * h * sq * sk * d * (0.5 if causal else 1.0)
    return f * (2.5 if direction == "bwd" else 1.0)


def record(section, shape, direction, causal, provider, times, fl, ceiling, note="", err=None):
    med, p20, p80 = times
    tf = fl / (med * 1e-3) / 1e12
    row = dict(section=section, shape=shape, direction=direction, causal=causal,
               provider=provider, median_ms=med, p20_ms=p20, p80_ms=p80, tflops=tf,
               pct_of_gemm=100.0 * tf / ceiling if ceiling else None, note=note, error=err)
    ROWS.append(row)
    print(f"  {section:9s} {shape:24s} {direction} {'causal' if causal else 'full  '} "
          f"{provider:38s} {med:8.3f} ms {tf:7.1f} TFLOP/s"
          + (f"  err {err:.2e}" if err is not None else "") + (f"  {note}" if note else ""),
          flush=True)
    return row


def make_qkv(b, sq, sk, h, hk, d, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, sq, h, d, device=DEV, dtype=DT, generator=g)
    k = torch.randn(b, sk, hk, d, device=DEV, dtype=DT, generator=g)
    v = torch.randn(b, sk, hk, d, device=DEV, dtype=DT, generator=g)
    return q, k, v


def sdpa_fns():
    if DRY:
        return {}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def make(backend):
        def run(qt, kt, vt, causal):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, is_causal=causal, enable_gqa=qt.shape[1] != kt.shape[1])
        return run

    return {"sdpa_flash": make(SDPBackend.FLASH_ATTENTION),
            "sdpa_cudnn": make(SDPBackend.CUDNN_ATTENTION)}


def gemm_ceiling() -> float:
    if DRY:
        return 0.0
    a = torch.randn(4096, 4096, device=DEV, dtype=DT)
    b = torch.randn(4096, 4096, device=DEV, dtype=DT)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=10, rep=50, return_mode="median")
    return 2 * 4096**3 / (ms * 1e-3) / 1e12


def time_baselines(section, shape, q, k, v, causal, ceiling, directions=("fwd", "bwd"),
                   out_ref=None):
    """SDPA flash / cuDNN on (B, H, S, D) views; returns {provider: {dir: tflops}}."""
    b, sq, h, d = q.shape
    sk = k.shape[1]
    res = {}
    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    for name, fn in sdpa_fns().items():
        res[name] = {}
        try:
            out = fn(qt, kt, vt, causal)
            err = None
            if out_ref is not None:
                err = (out.transpose(1, 2).float() - out_ref).abs().max().item()
            if "fwd" in directions:
                r = record(section, shape, "fwd", causal, name,
                           bench(lambda fn=fn: fn(qt, kt, vt, causal)),
                           flops(b, h, sq, sk, d, causal, "fwd"), ceiling, err=err)
                res[name]["fwd"] = r["tflops"]
            if "bwd" in directions:
                do = torch.randn_like(out)
                r = record(section, shape, "bwd", causal, name,
                           bench(lambda out=out, do=do: torch.autograd.grad(
                               out, (qt, kt, vt), do, retain_graph=True)),
                           flops(b, h, sq, sk, d, causal, "bwd"), ceiling)
                res[name]["bwd"] = r["tflops"]
        except Exception as e:  # a backend that cannot run this shape
            print(f"  {name}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
    return res


def tkit_fwd(q, k, v, causal, cfg):
    sq, sk, d = q.shape[1], k.shape[1], q.shape[-1]
    return A._fwd_impl(q, k, v, None, None, sq, sk, causal, d ** -0.5, -1, -1, 0.0, config=cfg)


def tkit_bwd(do, q, k, v, out, lse, causal, cfg):
    sq, sk, d = q.shape[1], k.shape[1], q.shape[-1]
    return A._bwd_impl(do, q, k, v, out, lse, None, None, None, sq, sk, causal, d ** -0.5,
                       -1, -1, 0.0, config=cfg)


def run_shape(section, b, s, h, d, ceiling, fwd_variants, bwd_variants, causals=(False, True),
              bwd_causals=(True,), autotuned=False, check=False):
    """Time forward/backward variants and the SDPA baselines at one shape."""
    shape = f"B{b} S{s} H{h} D{d}"
    q, k, v = make_qkv(b, s, s, h, h, d)
    best = {}
    for causal in causals:
        if left() < 0:
            print(f"  (time budget spent: skipping {shape})")
            return best
        out_ref = None
        if check:  # float32 reference at benchmark size
            out_ref = ref_attention(q.float(), k.float(), v.float(), causal=causal)
        time_baselines(section, shape, q, k, v, causal, ceiling, out_ref=out_ref,
                              directions=("fwd", "bwd") if causal in bwd_causals else ("fwd",))
        results = []
        for var in fwd_variants:
            cfg = fwd_cfg(var)
            try:
                out, lse = tkit_fwd(q, k, v, causal, cfg)
                err = (out.float() - out_ref).abs().max().item() if out_ref is not None else None
                r = record(section, shape, "fwd", causal, "tkit " + vname(var),
                           bench(lambda c=causal, cfg=cfg: tkit_fwd(q, k, v, c, cfg)),
                           flops(b, h, s, s, d, causal, "fwd"), ceiling, err=err)
                results.append((r["tflops"], var))
            except Exception as e:
                print(f"  tkit {vname(var)}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        if autotuned:
            try:
                fn = lambda c=causal: tkit.flash_attention(q, k, v, causal=c)  # noqa: E731
                fn()
                r = record(section, shape, "fwd", causal, "tkit autotuned", bench(fn),
                           flops(b, h, s, s, d, causal, "fwd"), ceiling,
                           note=_target("fwd", causal, None))
                ROWS[-1]["chosen"] = _chosen(A._attn_fwd_autotuned)
                print(f"    autotuner chose {ROWS[-1]['chosen']}")
            except Exception:
                traceback.print_exc()
        if results:
            tf, var = max(results)
            best[("fwd", causal)] = var
            print(f"    best forward {'causal' if causal else 'full'}: {vname(var)} {tf:.1f} "
                  f"TFLOP/s{_target('fwd', causal, tf)}")
        if causal not in bwd_causals or not bwd_variants or left() < 0:
            continue
        var = best.get(("fwd", causal), fwd_variants[0])
        out, lse = tkit_fwd(q, k, v, causal, fwd_cfg(var))
        do = torch.randn_like(out)
        if check:
            qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
            ref = ref_attention(qr, kr, vr, causal=causal)
            grads_ref = torch.autograd.grad(ref, (qr, kr, vr), do.float())
            del ref
        bres = []
        # the causal backward is the target: other masks reuse its best configuration
        if not causal and ("bwd", True) in best:
            bwd_variants = [best[("bwd", True)]]
        for bvar in bwd_variants:
            cfg = bwd_cfg(bvar)
            try:
                grads = tkit_bwd(do, q, k, v, out, lse, causal, cfg)
                err = None
                if check:
                    err = max((g.float() - r).abs().max().item()
                              for g, r in zip(grads, grads_ref))
                r = record(section, shape, "bwd", causal, "tkit " + vname(bvar),
                           bench(lambda a=(do, q, k, v, out, lse, causal, cfg): tkit_bwd(*a)),
                           flops(b, h, s, s, d, causal, "bwd"), ceiling, err=err)
                bres.append((r["tflops"], bvar))
            except Exception as e:
                print(f"  tkit bwd {vname(bvar)}: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:120]}")
        if check:
            del grads_ref
        if bres:
            tf, bvar = max(bres)
            best[("bwd", causal)] = bvar
            print(f"    best backward {'causal' if causal else 'full'}: {vname(bvar)} {tf:.1f} "
                  f"TFLOP/s{_target('bwd', causal, tf)}")
    return best


def _target(direction, causal, tf) -> str:
    t = ISSUE_TARGETS.get((direction, causal))
    if t is None or tf is None:
        return ""
    return f" (issue target {t}: {'met' if tf >= t else 'NOT met'})"


def _chosen(tuner) -> str:
    cfg = getattr(tuner, "best_config", None)
    return str(cfg) if cfg is not None else "?"


def finish_ratios():
    """Add the ratio of every tkit row to each baseline row of the same shape and direction."""
    key = lambda r: (r["section"], r["shape"], r["direction"], r["causal"])  # noqa: E731
    base = {}
    for r in ROWS:
        if r["provider"].startswith("sdpa"):
            base.setdefault(key(r), {})[r["provider"]] = r["tflops"]
    for r in ROWS:
        for name, tf in base.get(key(r), {}).items():
            r[f"x_{name}"] = r["tflops"] / tf if tf else None


def _tuner_report(tuner, label, fl):
    """Print every config the autotuner timed at its last new key, best first (with TFLOP/s
    when ``fl`` is the FLOPs of one call)."""
    timings = getattr(tuner, "configs_timings", None) or {}
    if timings:
        print(f"    {label}s: {len(timings)} timed in {getattr(tuner, 'bench_time', 0):.1f} s "
              f"(compiles included); {time.time() - T0:.0f} s into the run", flush=True)
    rows = []
    for cfg, t in timings.items():
        ms = t[0] if isinstance(t, (list, tuple)) else t
        rows.append((ms, cfg))
    for ms, cfg in sorted(rows, key=lambda r: r[0]):
        tf = ""
        if fl and ms and ms != float("inf"):
            tf = f"{fl / (ms * 1e-3) / 1e12:7.1f} TFLOP/s"
        print(f"      {label} {ms:8.3f} ms {tf}  {cfg}", flush=True)


def quick_section(ceiling):
    """The main shape through the registered op (autotuner picks), beside SDPA flash and cuDNN:
    forward non-causal and causal, backward causal; every config the autotuners timed."""
    b, s, h, d = (1, 40, 2, 32) if DRY else (4, 4096, 16, 128)
    shape = f"B{b} S{s} H{h} D{d}"
    q, k, v = make_qkv(b, s, s, h, h, d)
    for causal in (False, True):
        out_ref = ref_attention(q.float(), k.float(), v.float(), causal=causal)
        time_baselines("quick", shape, q, k, v, causal, ceiling, out_ref=out_ref,
                       directions=("fwd", "bwd") if causal else ("fwd",))
        fl = flops(b, h, s, s, d, causal, "fwd")
        fn = lambda c=causal: tkit.flash_attention(q, k, v, causal=c)  # noqa: E731
        err = (fn().float() - out_ref).abs().max().item()
        del out_ref
        backend = A.fwd_backend(q, k, v, causal)
        if backend.startswith("triton"):
            _tuner_report(A._attn_fwd_autotuned, "fwd config", fl)
        r = record("quick", shape, "fwd", causal, "tkit (registered op, autotuned)", bench(fn),
                   fl, ceiling, err=err)
        r["chosen"] = (_chosen(A._attn_fwd_autotuned) if backend.startswith("triton")
                       else backend)
        print(f"    autotuner chose {r['chosen']}{_target('fwd', causal, r['tflops'])}")
    causal = True
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    out = tkit.flash_attention(qg, kg, vg, causal=causal)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)
    fl = flops(b, h, s, s, d, causal, "bwd")
    # (one kernel's time each: dK/dV does four of the backward's seven matmuls, dQ three)
    _tuner_report(A._attn_bwd_dkdv_autotuned, "bwd dK/dV config", None)
    _tuner_report(A._attn_bwd_dq_autotuned, "bwd dQ config", None)
    qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
    ref = ref_attention(qr, kr, vr, causal=causal)
    grads_ref = torch.autograd.grad(ref, (qr, kr, vr), do.float())
    err = max((g.float() - r).abs().max().item() for g, r in zip(grads, grads_ref))
    del ref, grads_ref, grads
    r = record("quick", shape, "bwd", causal, "tkit (registered op, autotuned)",
               bench(lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)),
               fl, ceiling, err=err, note="autograd through the op, as SDPA's row")
    r["chosen"] = (f"dkdv {_chosen(A._attn_bwd_dkdv_autotuned)}; "
                   f"dq {_chosen(A._attn_bwd_dq_autotuned)}")
    print(f"    autotuner chose {r['chosen']}{_target('bwd', causal, r['tflops'])}")


def varlen_section(ceiling, fwd_var, bwd_var):
    lengths = [4000, 3000, 2048, 2048, 1500, 1024, 777, 512, 512, 300, 200, 200, 100, 60, 7, 1]
    lengths.append(16384 - sum(lengths))  # 95: every length positive, 16K tokens in all
    h, d = 16, 128
    if DRY:
        lengths, h, d = [40, 7, 1, 20], 2, 32
    total = sum(lengths)
    g = torch.Generator(device=DEV).manual_seed(3)
    q = torch.randn(total, h, d, device=DEV, dtype=DT, generator=g)
    k = torch.randn(total, h, d, device=DEV, dtype=DT, generator=g)
    v = torch.randn(total, h, d, device=DEV, dtype=DT, generator=g)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                      device=DEV)
    m = max(lengths)
    fl = sum(4.0 * h * d * n * n * 0.5 for n in lengths)
    shape = f"{len(lengths)} seqs {min(lengths)}..{m}"
    scale = d ** -0.5

    def fn():
        return A._fwd_impl(q, k, v, cu, cu, m, m, True, scale, -1, -1, 0.0,
                           config=fwd_cfg(fwd_var))

    out, lse = fn()
    # correctness: each sequence against SDPA's math (float32) on that slice
    err = 0.0
    for i in range(len(lengths)):
        a, bnd = cu[i].item(), cu[i + 1].item()
        ref = ref_attention(q[None, a:bnd].float(), k[None, a:bnd].float(),
                            v[None, a:bnd].float(), causal=True)[0]
        err = max(err, (out[a:bnd].float() - ref).abs().max().item())
    record("varlen", shape, "fwd", True, "tkit " + vname(fwd_var), bench(fn), fl, ceiling,
           err=err)
    do = torch.randn_like(out)
    record("varlen", shape, "bwd", True, "tkit " + vname(bwd_var),
           bench(lambda: A._bwd_impl(do, q, k, v, out, lse, None, cu, cu, m, m, True, scale,
                                     -1, -1, 0.0, config=bwd_cfg(bwd_var))),
           2.5 * fl, ceiling)
    # baseline: SDPA on the same tokens padded to the longest sequence (what varlen avoids)
    if not DRY:
        n = len(lengths)
        qp = torch.zeros(n, h, m, d, device=DEV, dtype=DT)
        for i in range(n):
            a, bnd = cu[i].item(), cu[i + 1].item()
            qp[i, :, : bnd - a] = q[a:bnd].transpose(0, 1)
        for name, f in sdpa_fns().items():
            try:
                record("varlen", shape, "fwd", True, name + " (padded)",
                       bench(lambda f=f: f(qp, qp, qp, True)), fl, ceiling,
                       note="padded to the longest sequence")
            except Exception as e:
                print(f"  {name}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")


def extras_section(ceiling, fwd_var, bwd_var):
    """Packed qkv views, a sliding window and GQA at the main shape, with the best configs."""
    b, s, h, d = (1, 48, 2, 32) if DRY else (4, 4096, 16, 128)
    g = torch.Generator(device=DEV).manual_seed(5)
    qkv = torch.randn(b, s, 3, h, d, device=DEV, dtype=DT, generator=g)
    q, k, v = qkv.unbind(2)
    scale = d ** -0.5
    shape = f"B{b} S{s} H{h} D{d}"
    full = flops(b, h, s, s, d, True, "fwd")
    cfg = fwd_cfg(fwd_var)
    record("extras", shape, "fwd", True, "tkit packed qkv " + vname(fwd_var),
           bench(lambda: A._fwd_impl(q, k, v, None, None, s, s, True, scale, -1, -1, 0.0,
                                     config=cfg)), full, ceiling)
    w = 1024 if not DRY else 8
    # causal with a 1024-key window: each row sees min(i + 1, w + 1) keys
    pairs = sum(min(i + 1, w + 1) for i in range(s))
    record("extras", shape, "fwd", True, f"tkit window ({w}, 0) " + vname(fwd_var),
           bench(lambda: A._fwd_impl(q, k, v, None, None, s, s, True, scale, w, 0, 0.0,
                                     config=cfg)),
           4.0 * b * h * pairs * d, ceiling, note="FLOPs of the visible pairs")
    record("extras", shape, "fwd", True, "tkit softcap 30 " + vname(fwd_var),
           bench(lambda: A._fwd_impl(q, k, v, None, None, s, s, True, scale, -1, -1, 30.0,
                                     config=cfg)), full, ceiling)
    hk = max(1, h // 4)
    q, k, v = make_qkv(b, s, s, 2 * h, hk, d)
    gshape = f"B{b} S{s} H{2 * h}/{hk} D{d}"
    out, lse = tkit_fwd(q, k, v, True, cfg)
    record("extras", gshape, "fwd", True, "tkit GQA " + vname(fwd_var),
           bench(lambda: tkit_fwd(q, k, v, True, cfg)),
           flops(b, 2 * h, s, s, d, True, "fwd"), ceiling)
    do = torch.randn_like(out)
    record("extras", gshape, "bwd", True, "tkit GQA " + vname(bwd_var),
           bench(lambda: tkit_bwd(do, q, k, v, out, lse, True, bwd_cfg(bwd_var))),
           flops(b, 2 * h, s, s, d, True, "bwd"), ceiling)
    time_baselines("extras", gshape, q, k, v, True, ceiling)


def print_table(ceiling):
    print("\n== summary (TFLOP/s; x = ratio to the baseline; % of the bf16 GEMM ceiling "
          f"{ceiling:.0f} TFLOP/s)")
    hdr = (f"{'section':9s} {'shape':24s} {'dir':3s} {'mask':6s} {'provider':38s} "
           f"{'ms':>8s} {'TF/s':>7s} {'%gemm':>6s} {'x flash':>7s} {'x cudnn':>7s}")
    print(hdr)
    for r in ROWS:
        pct = f"{r['pct_of_gemm']:.0f}" if r.get("pct_of_gemm") else "-"
        xf = f"{r['x_sdpa_flash']:.2f}" if r.get("x_sdpa_flash") else "-"
        xc = f"{r['x_sdpa_cudnn']:.2f}" if r.get("x_sdpa_cudnn") else "-"
        print(f"{r['section']:9s} {r['shape']:24s} {r['direction']:3s} "
              f"{'causal' if r['causal'] else 'full':6s} {r['provider'][:38]:38s} "
              f"{r['median_ms']:8.3f} {r['tflops']:7.1f} {pct:>6s} {xf:>7s} {xc:>7s}")


def _git_sha() -> str:
    from tkit.bench.runner import git_sha

    return git_sha()


def main():
    sections = [a for a in sys.argv[1:] if not a.startswith("-")] or [
        "main", "head_dims", "extras", "sweep", "varlen"]
    ceiling = gemm_ceiling()
    print(f"bf16 GEMM 4096^3: {ceiling:.0f} TFLOP/s; torch {torch.__version__}, "
          f"triton {triton.__version__}", flush=True)
    best = {}
    if "quick" in sections:
        # QUICK_ROUNDS > 1 repeats the section (baselines and tkit interleaved), for medians
        for rnd in range(int(os.environ.get("QUICK_ROUNDS", "1"))):
            print(f"== quick (round {rnd + 1}): B=4 H=16 S=4096 D=128, as a user calls it, "
                  "beside SDPA")
            quick_section(ceiling)
    if "main" in sections:
        print("== main: B=4 H=16 S=4096 D=128")
        if DRY:
            best = run_shape("main", 1, 40, 2, 32, ceiling, FWD_VARIANTS, BWD_VARIANTS,
                             bwd_causals=(False, True), autotuned=True, check=True)
        else:
            best = run_shape("main", 4, 4096, 16, 128, ceiling, FWD_VARIANTS, BWD_VARIANTS,
                             causals=(True, False), bwd_causals=(False, True), autotuned=True,
                             check=True)
    fwd_best = best.get(("fwd", True), FWD_VARIANTS[0])
    bwd_best = best.get(("bwd", True), BWD_VARIANTS[0])
    if "head_dims" in sections and left() > 0:
        print("== head dims 64 and 256, causal")
        if DRY:
            run_shape("head_dims", 1, 33, 2, 64, ceiling, FWD_VARIANTS[:1], BWD_VARIANTS,
                      causals=(True,))
        else:
            run_shape("head_dims", 4, 4096, 16, 64, ceiling,
                      [fwd_best, (128, 64, 3, 8, False, True)], [bwd_best], causals=(True,))
            run_shape("head_dims", 4, 4096, 16, 256, ceiling,
                      [(64, 64, 2, 4, False, False), (64, 32, 3, 4, True, False)],
                      [(32, 64, 2, 4), (64, 64, 1, 8)], causals=(True,))
    if "sweep" in sections and left() > 0:
        print("== seqlen sweep at 16K tokens a batch, D=128, causal")
        lens = (16, 48) if DRY else (512, 1024, 2048, 8192, 16384)
        for s in lens:
            b = max(1, 16384 // s) if not DRY else 1
            run_shape("sweep", b, s, 16 if not DRY else 2, 128 if not DRY else 32, ceiling,
                      [fwd_best], [bwd_best], causals=(True,))
    if "extras" in sections and left() > 0:
        print("== packed qkv, window, softcap, GQA (causal)")
        try:
            extras_section(ceiling, fwd_best, bwd_best)
        except Exception:
            traceback.print_exc()
    if "varlen" in sections and left() > 0:
        print("== varlen")
        try:
            varlen_section(ceiling, fwd_best, bwd_best)
        except Exception:
            traceback.print_exc()
    finish_ratios()
    print_table(ceiling)
    out = os.environ.get("OUT", "./out")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "gpu_attention.json")
    meta = dict(device=torch.cuda.get_device_name() if not DRY else "cpu (dry run)",
                torch=torch.__version__, triton=triton.__version__, gemm_ceiling=ceiling,
                seconds=time.time() - T0, git_sha=_git_sha())
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=ROWS), f, indent=1, default=str)
    print(f"wrote {path} ({len(ROWS)} rows) in {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
