"""Where does layer_norm's forward lose to torch.compile's at N=16384? A probe, not a kernel.

    python scripts/gpu_ln_probe.py --n 16384 --rounds 5

One stand-alone LayerNorm forward kernel with switches, launched the same way for every
variant, walks from the structure torch.compile generates for this case (inductor's looped
Welford reduction: run-time loop over 2048-column chunks, a Welford update with a division
per element, one 3-value Chan reduce, a second walk in column order) to the structure of
``tkit.layer_norm`` (unrolled first walk, per-lane Welford with constant 1/k, a two-reduction
exact combine, a second walk last chunk first), one switch at a time, each timed against
torch.compile and tkit.layer_norm in interleaved rounds (do_bench, L2 flushed, medians of
round medians). Registers and spills of every variant are printed, so occupancy can be read
off (65536 registers an SM).

Output: a table on stdout and $OUT/gpu_ln_probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_reductions  # noqa: E402

import tkit  # noqa: E402
from tkit.bench.runner import git_sha  # noqa: E402
from tkit.kernels.norm import _chan_combine  # noqa: E402


@triton.jit
def _lane_step(v, mean, m2, wt, first, k, LANE_DIV: tl.constexpr):
    """Welford's update of each lane with its k-th value v (``first``: k == 1, a compile-time
    or run-time condition): mean += (v - mean) / k by a division by the running count
    (LANE_DIV, as torch.compile does) or a multiplication by 1 / k."""
    if first:
        mean = v
        m2 = tl.zeros(v.shape, tl.float32)
        wt = tl.full(v.shape, 1.0, tl.float32)
    else:
        d = v - mean
        wt = wt + 1.0
        if LANE_DIV:
            mean = mean + d / wt
        else:
            mean = mean + d * (1.0 / k)
        m2 = m2 + d * (v - mean)
    return mean, m2, wt


@triton.jit
def _ln_probe(x_ptr, w_ptr, b_ptr, y_ptr, stats_ptr, N: tl.constexpr, eps,
              BLOCK: tl.constexpr, UNROLL: tl.constexpr, LANE_DIV: tl.constexpr,
              CHAN: tl.constexpr, REV: tl.constexpr, WB_EVICT: tl.constexpr,
              X1_EVICT: tl.constexpr, X2_EVICT: tl.constexpr, STATS: tl.constexpr):
    row = tl.program_id(0)
    base = x_ptr + row * N
    lane = tl.arange(0, BLOCK)
    mean = tl.zeros((BLOCK,), tl.float32)
    m2 = tl.zeros((BLOCK,), tl.float32)
    wt = tl.zeros((BLOCK,), tl.float32)
    NCH: tl.constexpr = N // BLOCK
    if UNROLL:
        for c in tl.static_range(NCH):
            v = tl.load(base + c * BLOCK + lane, eviction_policy=X1_EVICT).to(tl.float32)
            mean, m2, wt = _lane_step(v, mean, m2, wt, c == 0, c + 1, LANE_DIV)
    else:
        for off in range(0, N, BLOCK):
            v = tl.load(base + off + lane, eviction_policy=X1_EVICT).to(tl.float32)
            mean, m2, wt = _lane_step(v, mean, m2, wt, off == 0, off // BLOCK + 1, LANE_DIV)
    if CHAN:
        mu, q, _w = tl.reduce((mean, m2, wt), 0, _chan_combine)
    else:
        mu = tl.sum(mean, axis=0) / BLOCK
        dm = mean - mu
        q = tl.sum(m2 + NCH * dm * dm, axis=0)
    rstd = 1.0 / tl.sqrt(q / N + eps)
    if STATS:
        tl.store(stats_ptr + row * 2, mu)
        tl.store(stats_ptr + row * 2 + 1, rstd)
    tl.debug_barrier()
    for i in range(0, N, BLOCK):
        if REV:
            off = N - BLOCK - i
        else:
            off = i
        cols = off + lane
        v = tl.load(base + cols, eviction_policy=X2_EVICT).to(tl.float32)
        w = tl.load(w_ptr + cols, eviction_policy=WB_EVICT).to(tl.float32)
        b = tl.load(b_ptr + cols, eviction_policy=WB_EVICT).to(tl.float32)
        tl.store(y_ptr + row * N + cols, ((v - mu) * rstd * w + b).to(y_ptr.dtype.element_ty))


# inductor's structure first, then one switch at a time toward tkit's
BASE = dict(BLOCK=2048, num_warps=16, UNROLL=0, LANE_DIV=1, CHAN=1, REV=0, WB_EVICT="evict_last",
            X1_EVICT="evict_last", X2_EVICT="evict_first", STATS=0)
VARIANTS = {
    "ind": {},
    "ind stats": dict(STATS=1),
    "ind mul": dict(LANE_DIV=0),
    "ind exact2": dict(CHAN=0),
    "ind rev": dict(REV=1),
    "ind wb plain": dict(WB_EVICT=""),
    "ind unroll": dict(UNROLL=1),
    "ind unroll mul": dict(UNROLL=1, LANE_DIV=0),
    "ind w8": dict(num_warps=8),
    "ind c4k w16": dict(BLOCK=4096),
    "ind c1k w8": dict(BLOCK=1024, num_warps=8),
    "ind x1 plain": dict(X1_EVICT=""),
    "ind x2 plain": dict(X2_EVICT=""),
    "tk-like": dict(UNROLL=1, LANE_DIV=0, CHAN=0, REV=1, WB_EVICT="", STATS=1),
    "tk-like fwd chan": dict(UNROLL=1, LANE_DIV=0, REV=0, WB_EVICT="", STATS=1),
    "ind mul exact2 stats": dict(LANE_DIV=0, CHAN=0, STATS=1),
}


def launch(x, w, b, y, stats, cfg):
    M, N = x.shape
    kw = dict(BASE, **cfg)
    nw = kw.pop("num_warps")
    return _ln_probe[(M,)](x, w, b, y, stats, N, 1e-5, num_warps=nw, **kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep", type=int, default=30)
    opts = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "./out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    ceiling = gpu_reductions.copy_ceiling()
    N = opts.n
    M = (256 << 20) // (2 * N)
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 3 + 1
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    nbytes = 2 * x.numel() * 2 + 2 * N * 2
    ref = torch.nn.functional.layer_norm(x.float(), (N,), w.float(), b.float(), 1e-5)
    peer = torch.nn.functional.layer_norm(x, (N,), w, b, 1e-5)
    bound = 2 * (peer.float() - ref).abs().max().item() + 2**-7 * ref.abs().max().item()
    comp = torch.compile(lambda x: torch.nn.functional.layer_norm(x, (N,), w, b, 1e-5))
    fns = {"torch.compile": lambda: comp(x),
           "tkit.layer_norm": lambda: tkit.layer_norm(x, w, b, 1e-5)}
    meta = {}
    for name, cfg in VARIANTS.items():
        y = torch.full_like(x, float("nan"))
        stats = torch.empty(M, 2, device="cuda", dtype=torch.float32)
        k = launch(x, w, b, y, stats, cfg)
        err = (y.float() - ref).abs().max().item()
        meta[name] = dict(cfg=cfg, regs=k.n_regs, spills=k.n_spills, err=err, ok=err <= bound)
        fns[name] = (lambda y=y, stats=stats, cfg=cfg: launch(x, w, b, y, stats, cfg))
        print(f"{name:24s} regs={k.n_regs} spills={k.n_spills} err={err:.4g} "
              f"(bound {bound:.4g})", flush=True)
    for name in ("torch.compile", "tkit.layer_norm"):
        err = (fns[name]().float() - ref).abs().max().item()
        meta[name] = dict(err=err, ok=err <= bound)
    rounds = {k: [] for k in fns}
    names = list(fns)
    for r in range(opts.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            ms = gpu_reductions.bench(fns[name], rep=opts.rep)
            rounds[name].append(ms if isinstance(ms, str) else ms[0])
    rows = []
    ref_ms = statistics.median(rounds["torch.compile"])
    print(f"\nlayer_norm M={M} N={N} bf16, copy ceiling {ceiling:.2f} TB/s, "
          f"{opts.rounds} rounds", flush=True)
    for name in names:
        vals = [v for v in rounds[name] if not isinstance(v, str)]
        if not vals:
            print(f"{name:24s} error {rounds[name][0]}")
            continue
        ms = statistics.median(vals)
        tbs = nbytes / (ms * 1e-3) / 1e12
        rows.append(dict(name=name, median_ms=ms, rounds_ms=vals, tbs=tbs,
                         vs_compile=ref_ms / ms, **meta.get(name, {})))
        print(f"{name:24s} {ms * 1e3:8.1f} us {tbs:6.3f} TB/s {100 * tbs / ceiling:5.1f}% "
              f"x{ref_ms / ms:.3f} vs compile  {meta.get(name, {}).get('regs', '')}",
              flush=True)
    (out_dir / "gpu_ln_probe.json").write_text(json.dumps(dict(
        meta=dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, git_sha=git_sha(), copy_ceiling_tbs=ceiling,
                  M=M, N=N, rounds=opts.rounds), rows=rows), indent=1))


if __name__ == "__main__":
    main()
