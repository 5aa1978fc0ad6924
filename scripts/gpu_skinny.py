"""Decode-shape GEMM (issue #5): split-K configs at M=1/16/64, K=4096, N=14336 (weight as
W^T, the nn.Linear layout), in interleaved rounds with cuBLAS, CUDA-graph replay (these
kernels last ~30 us, less than an eager Python launch), median over rounds of do_bench medians.
Also the eager public call (host time included) and its CUDA-graph replay.

    python scripts/gpu_skinny.py [--rounds 3]      # $OUT/skinny.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tkit  # noqa: E402
from tkit.kernels import matmul as mm  # noqa: E402

CANDIDATES = {
    "A BN128 BK128 split2 s4 w4": dict(BLOCK_N=128, BLOCK_K=128, SPLIT_K=2, NUM_STAGES=4,
                                        num_warps=4),
    "B BN256 BK64 split2 s4 w8": dict(BLOCK_N=256, BLOCK_K=64, SPLIT_K=2, NUM_STAGES=4,
                                       num_warps=8),
    "C BN128 BK128 split1 s3 w4": dict(BLOCK_N=128, BLOCK_K=128, SPLIT_K=1, NUM_STAGES=3,
                                        num_warps=4),
    "D BN64 BK128 split1 s4 w4": dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, NUM_STAGES=4,
                                       num_warps=4),
    "E BN128 BK64 split2 s4 w4": dict(BLOCK_N=128, BLOCK_K=64, SPLIT_K=2, NUM_STAGES=4,
                                       num_warps=4),
    "F BN64 BK256 split1 s3 w4": dict(BLOCK_N=64, BLOCK_K=256, SPLIT_K=1, NUM_STAGES=3,
                                       num_warps=4),
    "G BN256 BK128 split2 s3 w8": dict(BLOCK_N=256, BLOCK_K=128, SPLIT_K=2, NUM_STAGES=3,
                                        num_warps=8),
    "H BN64 BK128 split2 s4 w4": dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=2, NUM_STAGES=4,
                                       num_warps=4),
    "I BN128 BK128 split1 s4 w4": dict(BLOCK_N=128, BLOCK_K=128, SPLIT_K=1, NUM_STAGES=4,
                                        num_warps=4),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    K, N = 4096, 14336
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
    b = w.t()
    nbytes = K * N * 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for M in (1, 16, 64):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        ref = (x.float() @ b.float())
        heur = mm.splitk_config(M, N, K, sms)
        fns = {"cuBLAS": lambda x=x: torch.matmul(x, b),
               "default (heuristic)": lambda x=x: mm._matmul_impl(x, b, path="splitk")}
        for name, cfg in CANDIDATES.items():
            cfg = dict(cfg, BLOCK_M=max(16, min(64, 1 << (M - 1).bit_length())))
            fns[name] = lambda x=x, cfg=cfg: mm._matmul_impl(x, b, path="splitk", config=cfg)
        fns["tkit.matmul public (graph)"] = lambda x=x: tkit.matmul(x, b)
        errs = {}
        for name, fn in list(fns.items()):
            try:
                got = fn().float()
            except Exception as e:  # e.g. a 64-row tile that does not fit shared memory
                print(f"  {name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                del fns[name]
                continue
            errs[name] = ((got - ref).abs().max() / ref.abs().max()).item()
        times = {n: [] for n in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                times[name].append(float(do_bench_cudagraph(fn, rep=20, quantiles=[0.5])))
        eager = float(do_bench(lambda x=x: tkit.matmul(x, b), warmup=5, rep=25,
                               quantiles=[0.5]))
        cub = statistics.median(times["cuBLAS"])
        print(f"== M={M} K={K} N={N} W^T (heuristic: {heur})")
        for name, ts in times.items():
            ms = statistics.median(ts)
            row = dict(M=M, K=K, N=N, provider=name, ms=ms, rounds=ts, tbs=nbytes / ms / 1e9,
                       vs_cublas=cub / ms, rel_err=errs[name])
            rows.append(row)
            print(f"  {name:34s} {ms * 1e3:7.1f} us  {row['tbs']:5.2f} TB/s  "
                  f"x{row['vs_cublas']:.3f} cuBLAS  spread {min(ts) * 1e3:.1f}-"
                  f"{max(ts) * 1e3:.1f}  err {errs[name]:.1e}")
        rows.append(dict(M=M, K=K, N=N, provider="tkit.matmul eager (host included)", ms=eager,
                         tbs=nbytes / eager / 1e9, vs_cublas=cub / eager))
        print(f"  {'tkit.matmul eager (host incl.)':34s} {eager * 1e3:7.1f} us  "
              f"{nbytes / eager / 1e9:5.2f} TB/s")
    (out / "skinny.json").write_text(json.dumps(dict(rows=rows), indent=1))


if __name__ == "__main__":
    main()
