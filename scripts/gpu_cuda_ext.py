"""CUDA escape hatches on the GPU: correctness at many shapes, then every GEMM side by side.

    python scripts/gpu_cuda_ext.py                 # full run (< 120 s on the H200)
    python scripts/gpu_cuda_ext.py --quick         # correctness + 4096^3 only
    python scripts/gpu_cuda_ext.py --sanitize      # small shapes, no timing: run it under
        compute-sanitizer --tool memcheck  python scripts/gpu_cuda_ext.py --sanitize
        compute-sanitizer --tool racecheck python scripts/gpu_cuda_ext.py --sanitize

1. status(): which path each op takes here.
2. Correctness: every kernel (6 SGEMM steps, mma.sync, wgmma and its variants) against torch
   at shapes that break tiles, fresh random data each time, outputs NaN-poisoned
   (tkit.testing.check_against_reference: error <= 2x torch's same-precision error + 1 ulp).
   The wgmma kernel is first probed in a subprocess with a timeout, so a hang (an mbarrier
   phase bug) costs 60 s and a line in the report instead of the whole run.
3. Timings, do_bench medians (L2 flushed) with p20/p80: the SGEMM ladder at 4096^3 fp32 against
   cuBLAS fp32 and the fp32 CUDA-core peak; bf16 at 4096^3 and 8192^3: cuBLAS, mma.sync
   (stages 3/4/5), wgmma (default, 3 stages, one group in flight, non-persistent, GROUP_M 8),
   Triton (tkit.matmul backend="triton") when importable. TFLOP/s, % of cuBLAS in the same run,
   % of the anchors measured earlier (720 / 679 TFLOP/s).
Full results go to $OUT/gpu_cuda_ext.json (default ./out); a table is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from anywhere without installing tkit
    sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])  # for the probe subprocess
# the probe below tests every wgmma variant in a subprocess; the library's own first-use
# self-test (one more subprocess per variant) would only repeat it
os.environ.setdefault("TKIT_WGMMA_SELFTEST", "0")

START = time.time()
ANCHOR_CUBLAS = {4096: 720.0, 8192: 679.0}  # FACTS.md, bf16 TFLOP/s
FP32_PEAK = 132 * 128 * 2 * 1.98e9 / 1e12  # SMs x FP32 lanes x FMA x boost clock: ~66.9


def log(msg):
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def fresh(shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", generator=g, dtype=torch.float32).to(dtype)


def fp32_floor(a, b):
    K = a.shape[1]
    return 2.0**-23 * K * (a.abs().max() * b.abs().max()).item()


# ---- the kernels under test --------------------------------------------------------------
def kernels(cx, include_wgmma: bool):
    """name -> (fn(a, b), dtype, shape filter)."""
    out = {}
    for step, (_k, _b, _t, strict) in cx.SGEMM_STEPS.items():
        ok = (lambda M, N, K: M % 128 == 0 and N % 128 == 0 and K % 8 == 0) if strict else (
            lambda M, N, K: True)
        out[f"sgemm_{step}"] = ((lambda s: lambda a, b: cx.sgemm(a, b, s))(step),
                                torch.float32, ok)
    bf16_ok = lambda M, N, K: K % 8 == 0 and N % 8 == 0  # noqa: E731
    for st in (2, 3, 4):  # the default mma build: 256x128x64, 3 stages (48 KiB a stage)
        out[f"mma_s{st}"] = ((lambda s: lambda a, b: cx.matmul_mma(a, b, stages=s))(st),
                             torch.bfloat16, bf16_ok)
    out["mma_f32out"] = (lambda a, b: cx.matmul_mma(a, b, torch.float32), torch.bfloat16,
                         bf16_ok)
    if include_wgmma:
        for name, kw in WGMMA_VARIANTS.items():
            out[name] = ((lambda k: lambda a, b: cx.matmul_wgmma(a, b, **k))(kw),
                         torch.bfloat16, bf16_ok)
    return out


WGMMA_VARIANTS = {
    "wgmma": {},
    "wgmma_direct_s4": {"variant": "direct_s4"},  # the default is 3 stages, TMA epilogue
    "wgmma_inflight": {"inflight": True},
    "wgmma_nonpersistent": {"persistent": False},
    "wgmma_group8": {"group_m": 8},
}

DEFAULTS = {"sgemm_naive", "sgemm_smem", "sgemm_1d_blocking", "sgemm_2d_blocking",
            "sgemm_vectorized", "sgemm_cp_async", "mma_s3", "mma_f32out", "wgmma"}
SHAPES = [(1, 8, 8), (16, 16, 16), (127, 136, 72), (128, 128, 64), (129, 264, 200),
          (256, 384, 136), (300, 1000, 520), (512, 512, 512), (1000, 4104, 1032),
          (2048, 2048, 2048), (4096, 4096, 4096)]
SANITIZE_SHAPES = [(16, 16, 16), (129, 264, 200), (256, 384, 136)]


def check_all(cx, ks, shapes, results):
    from tkit.testing import check_against_reference

    for name, (fn, dtype, ok) in ks.items():
        for i, (M, N, K) in enumerate(shapes):
            if not ok(M, N, K):
                continue
            if name == "sgemm_naive" and M * N * K > 2**30:
                continue  # seconds per call; smaller shapes cover it
            if name not in DEFAULTS and M * N * K > 2**33:
                continue  # tuning variants: the big shapes only for the default configs
            a, b = fresh((M, K), dtype, 2 * i + 1), fresh((K, N), dtype, 2 * i + 2)
            row = dict(kind="check", kernel=name, M=M, N=N, K=K)
            try:
                floor = fp32_floor(a, b) if dtype == torch.float32 else None
                check_against_reference(fn, torch.matmul, [a, b], floor=floor)
                row["ok"] = True
            except Exception as e:
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            results.append(row)
        bad = [r for r in results if r["kind"] == "check" and r["kernel"] == name
               and not r["ok"]]
        log(f"check {name:22s} " + ("ok" if not bad else
                                     f"FAILED {len(bad)}: {bad[0]['error'][:160]} "
                                     f"(at {bad[0]['M']}x{bad[0]['N']}x{bad[0]['K']})"))


def probe_wgmma(timeout=100) -> dict[str, str]:
    """Run every wgmma variant once in a subprocess (a hang kills only the subprocess).
    Returns {variant: "ok" or why not}."""
    out = ""
    try:
        proc = subprocess.run([sys.executable, __file__, "--probe"], capture_output=True,
                              text=True, timeout=timeout)
        out, tail = proc.stdout, (proc.stdout + proc.stderr)[-600:]
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        tail = f"timed out after {timeout} s (hang: an mbarrier phase never completed?)"
    status = {}
    for name in WGMMA_VARIANTS:
        if f"VARIANT {name} OK" in out:
            status[name] = "ok"
        elif f"VARIANT {name} BAD" in out:
            status[name] = out.split(f"VARIANT {name} BAD", 1)[1].splitlines()[0].strip()
        else:
            status[name] = f"not reached: {tail}"
    return status


def probe():
    import tkit.cuda_ext as cx

    for name, kw in WGMMA_VARIANTS.items():
        shapes = ((129, 264, 200), (4096, 4096, 4096)) if name == "wgmma" else ((129, 264, 200),)
        worst = 0.0
        try:
            for M, N, K in shapes:
                a, b = fresh((M, K), torch.bfloat16, 1), fresh((K, N), torch.bfloat16, 2)
                c = cx.matmul_wgmma(a, b, **kw)
                torch.cuda.synchronize()
                ref = a.float() @ b.float()
                err = (c.float() - ref).abs().max().item()
                worst = max(worst, err / math.sqrt(K))
                if not err < 0.05 * math.sqrt(K):  # NaN fails too
                    raise AssertionError(f"{M}x{N}x{K}: max error {err:.3g}")
            print(f"VARIANT {name} OK (max err / sqrt(K) {worst:.3g})", flush=True)
        except Exception as e:
            print(f"VARIANT {name} BAD {type(e).__name__}: {str(e)[:300]}", flush=True)
            if "CUDA" in str(e) or "illegal" in str(e):
                break  # the context is gone: later variants would fail for this reason


# ---- timing ------------------------------------------------------------------------------
def bench(fn, *, rep=60):
    from triton.testing import do_bench

    p50, p20, p80 = do_bench(fn, warmup=10, rep=rep, quantiles=[0.5, 0.2, 0.8])
    return p50, p20, p80


def time_gemms(cx, ks, sizes, results, budget_s):
    import tkit

    rows = []

    def triton_matmul(a, b):
        return tkit.matmul(a, b, backend="triton")

    def record(provider, size, dtype, fn, args, rep=60):
        if time.time() - START > budget_s:
            rows.append(dict(kind="time", provider=provider, size=size, skipped="time budget"))
            return
        M = N = K = size
        row = dict(kind="time", provider=provider, size=size, dtype=str(dtype))
        try:
            p50, p20, p80 = bench(lambda: fn(*args), rep=rep)
            tf = 2 * M * N * K / (p50 * 1e-3) / 1e12
            row.update(ms=p50, p20=p20, p80=p80, tflops=tf)
        except Exception as e:
            row.update(error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
        log(f"time {provider:26s} {size}^3 " + (f"{row['tflops']:7.1f} TFLOP/s ({row['ms']:.3f}"
                                                 " ms)" if "tflops" in row else
                                                 row.get("error", "")))

    # fp32 ladder at 4096^3 against cuBLAS fp32 (no TF32)
    size = 4096
    a, b = fresh((size, size), torch.float32, 11), fresh((size, size), torch.float32, 12)
    torch.backends.cuda.matmul.allow_tf32 = False
    record("cuBLAS fp32", size, torch.float32, torch.matmul, (a, b))
    for name, (fn, dtype, _ok) in ks.items():
        if dtype == torch.float32:
            record(name, size, dtype, fn, (a, b),
                   rep=30 if name in ("sgemm_naive", "sgemm_smem") else 60)
    del a, b
    # bf16 GEMMs
    for size in sizes:
        a, b = fresh((size, size), torch.bfloat16, 13), fresh((size, size), torch.bfloat16, 14)
        record("cuBLAS bf16", size, torch.bfloat16, torch.matmul, (a, b))
        for name, (fn, dtype, _ok) in ks.items():
            if dtype == torch.bfloat16 and name != "mma_f32out":
                record(name, size, dtype, fn, (a, b))
        record("cuBLAS bf16 (again)", size, torch.bfloat16, torch.matmul, (a, b))
        try:
            tkit.matmul(a[:256, :256].contiguous(), b[:256, :256].contiguous(),
                        backend="triton")
            record("triton (tkit.matmul)", size, torch.bfloat16, triton_matmul, (a, b))
        except Exception as e:
            rows.append(dict(kind="time", provider="triton (tkit.matmul)", size=size,
                             error=f"{type(e).__name__}: {str(e)[:200]}"))
        del a, b
    results.extend(rows)
    return rows


def table(rows):
    base = {}
    for r in rows:
        if r.get("provider", "").startswith("cuBLAS") and "tflops" in r:
            key = (r["size"], "fp32" if "fp32" in r["provider"] else "bf16")
            base[key] = max(base.get(key, 0), r["tflops"])
    lines = [f"{'provider':26s} {'size':>6s} {'ms':>9s} {'TFLOP/s':>8s} {'%cuBLAS':>8s} "
             f"{'%anchor/peak':>12s}"]
    for r in rows:
        if "tflops" not in r:
            lines.append(f"{r['provider']:26s} {r['size']:6d}   {r.get('error', r.get('skipped'))}")
            continue
        fp32 = "float32" in r["dtype"]
        ref = base.get((r["size"], "fp32" if fp32 else "bf16"))
        pct = 100 * r["tflops"] / ref if ref else float("nan")
        ceil = FP32_PEAK if fp32 else ANCHOR_CUBLAS.get(r["size"], float("nan"))
        lines.append(f"{r['provider']:26s} {r['size']:6d} {r['ms']:9.3f} {r['tflops']:8.1f} "
                     f"{pct:7.1f}% {100 * r['tflops'] / ceil:11.1f}%")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sanitize", action="store_true")
    ap.add_argument("--probe", action="store_true")
    ap.add_argument("--no-probe", action="store_true", help="trust wgmma without the probe")
    ap.add_argument("--kernels", default="", help="comma-separated subset, e.g. mma_s3,wgmma")
    args = ap.parse_args()
    if args.probe:
        return probe()

    import tkit.cuda_ext as cx

    out_dir = Path(os.environ.get("OUT", "./out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                status=json.loads(json.dumps(dict(cx.status()), default=str)))
    try:
        from tkit.bench.runner import git_sha

        meta["git"] = git_sha()
    except Exception:
        pass
    print(cx.status())

    wgmma_ok = torch.cuda.get_device_capability() == (9, 0)
    ks = kernels(cx, wgmma_ok)
    if wgmma_ok and not (args.no_probe or args.sanitize):
        probe_status = probe_wgmma()
        meta["wgmma_probe"] = probe_status
        for name, st in probe_status.items():
            log(f"wgmma probe {name:20s} {st[:300]}")
            if st != "ok":
                ks.pop(name, None)
                results.append(dict(kind="check", kernel=name, M=0, N=0, K=0, ok=False,
                                    error=f"probe: {st[:300]}"))
    if args.kernels:
        ks = {k: v for k, v in ks.items() if k in args.kernels.split(",")}
    if args.sanitize:
        ks = {k: v for k, v in ks.items() if k in ("sgemm_naive", "sgemm_smem",
                                                   "sgemm_1d_blocking", "sgemm_2d_blocking",
                                                   "sgemm_vectorized", "sgemm_cp_async",
                                                   "mma_s3", "wgmma")
              or k in args.kernels.split(",")}
        check_all(cx, ks, SANITIZE_SHAPES, results)
        bad = [r for r in results if not r["ok"]]
        print(f"sanitize run: {len(results) - len(bad)} ok, {len(bad)} failed")
        return 1 if bad else 0

    shapes = SHAPES if not args.quick else SHAPES[:-2]
    try:
        check_all(cx, ks, shapes, results)
    except Exception:
        traceback.print_exc()
    path = out_dir / "gpu_cuda_ext.json"
    path.write_text(json.dumps(dict(meta=meta, results=results), indent=1, default=str))
    rows = []
    try:
        rows = time_gemms(cx, ks, (4096,) if args.quick else (4096, 8192), results,
                          budget_s=105)
    except Exception:
        traceback.print_exc()
    meta["elapsed_s"] = time.time() - START
    path.write_text(json.dumps(dict(meta=meta, results=results), indent=1, default=str))
    fails = [r for r in results if r["kind"] == "check" and not r["ok"]]
    n_checks = sum(r["kind"] == "check" for r in results)
    print("\n==== correctness: " + (f"{len(fails)} FAILED of {n_checks}" if fails
                                    else f"all {n_checks} checks ok"))
    for r in fails[:20]:
        print(f"  {r['kernel']} {r['M']}x{r['N']}x{r['K']}: {r['error'][:200]}")
    print("\n==== timings (do_bench median, L2 flushed; %anchor: bf16 vs 720/679 TFLOP/s, "
          f"fp32 vs {FP32_PEAK:.1f} TFLOP/s peak)")
    print(table(rows))
    print(f"\nwrote {path} in {time.time() - START:.0f} s")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
