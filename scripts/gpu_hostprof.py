"""Host time per eager call of tkit ops against torch, on the GPU machine, with a profile of
where tkit's host time goes. Small shapes, so the GPU is never the bottleneck: the wall time of
a burst of calls divided by the calls is the host cost.

    python scripts/gpu_hostprof.py            # table + top functions; $OUT/hostprof.json
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tkit  # noqa: E402


def per_call_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def main():
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    dev = "cuda"
    bf = torch.bfloat16
    a = torch.randn(4096, device=dev, dtype=bf)
    b = torch.randn(4096, device=dev, dtype=bf)
    x = torch.randn(4, 4096, device=dev, dtype=bf)
    w = torch.randn(4096, device=dev, dtype=bf)
    v1 = torch.randn(1, 4096, device=dev, dtype=bf)
    W = torch.randn(4096, 14336, device=dev, dtype=bf)
    A = torch.randn(64, 64, device=dev, dtype=bf)
    q = torch.randn(1, 128, 4, 64, device=dev, dtype=bf)
    cases = {
        "add 4096": (lambda: tkit.add(a, b), lambda: torch.add(a, b)),
        "silu_mul 4096": (lambda: tkit.silu_mul(a, b), lambda: F.silu(a) * b),
        "rms_norm 4x4096": (lambda: tkit.rms_norm(x, w), lambda: F.rms_norm(x, (4096,), w)),
        "softmax 4x4096": (lambda: tkit.softmax(x), lambda: torch.softmax(x, -1)),
        "matmul 64^3": (lambda: tkit.matmul(A, A), lambda: A @ A),
        "matmul M=1 K4096 N14336": (lambda: tkit.matmul(v1, W), lambda: v1 @ W),
        "flash_attention 1x128x4x64": (
            lambda: tkit.flash_attention(q, q, q, causal=True),
            lambda: F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, q, q)),
                                                   is_causal=True)),
    }
    rows = []
    for name, (tk, ref) in cases.items():
        t_tk, t_ref = per_call_us(tk), per_call_us(ref)
        rows.append(dict(case=name, tkit_us=t_tk, torch_us=t_ref))
        print(f"{name:30s} tkit {t_tk:8.1f} us   torch {t_ref:8.1f} us")
    profiles = {}
    for name in ("add 4096", "matmul M=1 K4096 N14336", "rms_norm 4x4096",
                 "flash_attention 1x128x4x64"):
        fn = cases[name][0]
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
        profiles[name] = s.getvalue()
        print(f"---- profile: {name} (200 calls)\n" + "\n".join(s.getvalue().splitlines()[:40]))
    # GPU time of the same calls: is a slow eager call host- or device-bound?
    from torch.profiler import ProfilerActivity, profile
    kernels = {}
    for name in ("matmul M=1 K4096 N14336", "matmul 64^3", "add 4096"):
        fn = cases[name][0]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
        kernels[name] = table
        print(f"---- torch.profiler: {name} (50 calls)\n{table}")
    WT = W.t().contiguous().t()  # the nn.Linear weight layout: (N, K) storage, used as W^T
    for label, b_ in (("row-major W", W), ("nn.Linear layout", WT)):
        g0, g1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(5):
            tkit.matmul(v1, b_)
        g0.record()
        for _ in range(100):
            tkit.matmul(v1, b_)
        g1.record()
        torch.cuda.synchronize()
        print(f"matmul M=1 {label}: {g0.elapsed_time(g1) / 100 * 1e3:.1f} us per call (events, "
              f"back to back)")
    data = dict(rows=rows, profiles=profiles, kernels=kernels)
    (out / "hostprof.json").write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
