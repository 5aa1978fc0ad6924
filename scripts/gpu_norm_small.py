# ruff: noqa: B023  (each closure is used only within its own loop iteration)
"""Row-config neighbours of the norm/softmax forward at the sweep sizes where tkit trailed
torch.compile (2026-11-30 run c): N=1024, 8192, 16384, 32768 at 256 MiB bf16. Each variant is
checked against the default's output and timed (median of do_bench medians over interleaved
rounds). Rows to $OUT/norm_small.json.

    python scripts/gpu_norm_small.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.gpu_reductions import copy_ceiling, override  # noqa: E402
from tkit.kernels import norm as nk  # noqa: E402
from tkit.kernels import softmax as sk  # noqa: E402


def variants(op, N):
    if N == 1024:
        grid = [dict(rows=r, num_warps=w) for r, w in itertools.product((1, 2, 4, 8, 16),
                                                                          (2, 4, 8))]
    elif N == 8192:
        grid = [dict(rows=r, num_warps=w) for r, w in itertools.product((1, 2, 4), (4, 8, 16))]
    elif N == 16384:
        grid = [dict(rows=r, num_warps=w) for r, w in itertools.product((1, 2), (8, 16, 32))]
    else:  # 32768
        grid = [dict(rows=1, num_warps=w) for w in (8, 16, 32)]
        grid += [dict(norm_fwd_single_bytes=32 * 1024, norm_chunk=c) for c in (8192, 16384)]
        grid += [dict(norm_fwd_single_bytes=32 * 1024, norm_long="split")]
    return [{}] + grid


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    ceiling = copy_ceiling()
    print(f"copy ceiling {ceiling:.3f} TB/s", flush=True)
    rows = []
    plan = [("rms_norm", 1024), ("layer_norm", 1024), ("rms_norm_residual", 1024),
            ("softmax", 1024), ("rms_norm", 8192), ("rms_norm", 16384), ("layer_norm", 16384),
            ("rms_norm", 32768)]
    for op, N in plan:
        M = (128 << 20) // N
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x) if op == "rms_norm_residual" else None
        w = (1 + 0.1 * torch.randn(N, device="cuda")).to(torch.bfloat16)
        b = (0.1 * torch.randn(N, device="cuda")).to(torch.bfloat16)
        fn = {
            "rms_norm": lambda: nk._norm_fwd_impl(x, w, None, None, 1e-6, True)[0],
            "layer_norm": lambda: nk._norm_fwd_impl(x, w, b, None, 1e-5, False)[0],
            "rms_norm_residual": lambda: nk._norm_fwd_impl(x, w, None, r, 1e-6, True)[0],
            "softmax": lambda: sk._softmax_fwd_impl(x, -1, False),
        }[op]
        nbytes = (4 if op == "rms_norm_residual" else 2) * M * N * 2
        ref = fn().float()
        vs = variants(op, N)
        times = {i: [] for i in range(len(vs))}
        errs = {}
        for i, ov in enumerate(vs):
            try:
                with override(**ov):
                    errs[i] = (fn().float() - ref).abs().max().item()
            except Exception as e:
                errs[i] = f"{type(e).__name__}: {str(e)[:120]}"
        for _ in range(args.rounds):
            for i, ov in enumerate(vs):
                if isinstance(errs[i], str):
                    continue
                with override(**ov):
                    times[i].append(float(triton.testing.do_bench(fn, warmup=10, rep=30,
                                                                  return_mode="median")))
        print(f"== {op} N={N} (M={M})")
        for i, ov in enumerate(vs):
            row = dict(op=op, N=N, M=M, variant=ov or "default", err=errs[i])
            if times[i]:
                ms = statistics.median(times[i])
                row.update(ms=ms, rounds=times[i], tbs=nbytes / ms / 1e9,
                           pct=100 * nbytes / ms / 1e9 / ceiling)
                print(f"  {str(ov or 'default'):60s} {row['tbs']:.3f} TB/s  err {errs[i]}")
            else:
                print(f"  {str(ov or 'default'):60s} failed: {errs[i]}")
            rows.append(row)
        x = r = None
        torch.cuda.empty_cache()
    (out / "norm_small.json").write_text(json.dumps(dict(ceiling=ceiling, rows=rows), indent=1,
                                                    default=str))


if __name__ == "__main__":
    main()
