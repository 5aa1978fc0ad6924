"""Elementwise variants on the H200: block size, warps, masking, against torch eager and
torch.compile, interleaved. Writes $OUT/gpu_elementwise.json. (An "evict_first" load hint was
measured here too and cost 4-5% everywhere: benchmarks/results/h200-2026-11-29-a-*.)"""

import json
import os
import statistics

import torch
import triton

from tkit.bench import time_fn
from tkit.kernels import elementwise as ew

OUT = os.environ.get("OUT", "out")
os.makedirs(OUT, exist_ok=True)
BF16 = torch.bfloat16


def variants_for(op, a, b, out, scale=None):
    n = out.numel()
    res = {}
    for block in (1024, 2048, 4096, 8192, 16384):
        for warps in (4, 8, 16):
            if block // (warps * 32) < 2:
                continue
            for even in (True, False):
                if even and n % block:
                    continue
                name = f"B{block} w{warps} {'nomask' if even else 'mask'}"

                def run(block=block, warps=warps, even=even):
                    ew._ew_flat_kernel[(triton.cdiv(n, block),)](
                        a_ptr=a, b_ptr=b if b is not None else a, out_ptr=out,
                        scale_ptr=scale if scale is not None else a, n_elements=n,
                        size_class=0, OP=op, HAS_B=b is not None,
                        HAS_SCALE=scale is not None, INT64=False, BLOCK=block, EVEN=even,
                        num_warps=warps)

                res[name] = run
    return res


def main():
    results = []
    M, N = 16384, 8192
    a = torch.randn(M, N, device="cuda", dtype=BF16)
    b = torch.randn(M, N, device="cuda", dtype=BF16)
    out = torch.empty_like(a)
    s = torch.tensor([0.02], device="cuda")
    out8 = torch.empty(M, N, device="cuda", dtype=torch.float8_e4m3fn)
    cases = {
        "add": (lambda: torch.add(a, b), "add", a, b, out, None, 3 * a.numel() * 2),
        "silu_mul": (lambda: torch.nn.functional.silu(a) * b, "silu_mul", a, b, out, None,
                     3 * a.numel() * 2),
        "cast_fp8": (lambda: (a.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn),
                     "cast_fp8", a, None, out8, s, a.numel() * 3),
    }
    torch._dynamo.config.recompile_limit = 1024
    for cname, (ref, op, x, y, o, sc, nbytes) in cases.items():
        providers = {"torch": ref, "torch.compile": torch.compile(ref),
                     "tkit (autotuned)": {"add": lambda: ew.add(a, b),
                                          "silu_mul": lambda: ew.silu_mul(a, b),
                                          "cast_fp8": lambda: ew.cast(a, torch.float8_e4m3fn, s)}
                     [cname]}
        providers.update(variants_for(op, x, y, o, sc))
        times = {k: [] for k in providers}
        for _ in range(3):
            for k, fn in providers.items():
                times[k].append(time_fn(fn, rep_ms=60).median_ms)
        med = {k: statistics.median(v) for k, v in times.items()}
        comp = med["torch.compile"]
        print(f"\n== {cname} 16384x8192 bf16: torch.compile {comp * 1e3:.1f} us "
              f"({nbytes / comp / 1e9:.2f} TB/s)")
        for k, t in sorted(med.items(), key=lambda kv: kv[1])[:12]:
            print(f"  {k:<32} {t * 1e3:8.1f} us  {nbytes / t / 1e9:5.2f} TB/s  "
                  f"x compile {comp / t:5.3f}")
        results.append({"case": cname, "median_ms": med, "bytes": nbytes})
    # Eager dispatch overhead on a small input: the direct path against the torch.library op.
    import time

    x = torch.randn(4096, device="cuda", dtype=BF16)
    calls = {"direct path": lambda: ew.add(x, x),
             "torch.ops.tkit.binary": lambda: torch.ops.tkit.binary(x, x, "add", None),
             "torch add": lambda: x + x}
    host_us = {}
    for _ in range(2):
        for k, fn in calls.items():
            for _ in range(200):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(2000):
                fn()
            torch.cuda.synchronize()
            host_us[k] = (time.perf_counter() - t0) / 2000 * 1e6
    print("\n== per-call time, 4096-element add, eager (host-bound):")
    for k, v in host_us.items():
        print(f"  {k:<24} {v:6.1f} us")
    results.append({"case": "dispatch overhead", "host_us": host_us})
    cfg = ew._ew_flat_autotuned.best_config
    print("autotuner's pick (last case):", cfg)
    with open(os.path.join(OUT, "gpu_elementwise.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
