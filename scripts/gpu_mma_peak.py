"""Peak rate of mma.sync.aligned.m16n8k16 on this GPU, next to cuBLAS bf16 in the same run.

    OUT=./out python scripts/gpu_mma_peak.py            # bf16, f16, f16 with f16 accumulators
    OUT=./out python scripts/gpu_mma_peak.py --dtypes bf16

What it measures (tkit.cuda_ext.mma_peak, csrc/mma_peak.cu): every warp issues only mma.sync
from registers (ILP independent accumulator chains, no memory traffic in the loop), for
warps_per_block in {4, 8, 16} x blocks_per_sm in {1, 2, 4} x ILP in {1, 2, 4, 8}; configurations
whose blocks do not all fit on an SM at once are skipped, not timed in waves. iters is
calibrated so that each launch takes ~2 ms; the time is the median of 10 launches (CUDA events)
after 3 warm-up launches. Operands are full-mantissa values (as on randn inputs).

The best bf16 rate is an upper bound for any mma.sync GEMM here (a GEMM also loads fragments,
waits on barriers and writes C). It is divided by cuBLAS bf16 (torch.matmul, do_bench median
with L2 flushed) at 4096^3 and 8192^3, timed before and after the sweep: "mma.sync peak /
cuBLAS" is the most an mma.sync GEMM could reach relative to cuBLAS on this GPU; the
conservative ratio uses the slower cuBLAS timing.

Checks in the same run, on the best bf16 configuration: (1) 256 iters with exact data (2-bit
mantissas): the output equals a float64 emulation of every mma bit for bit; (2) the timed run
again (30 launches, random data) with its output against the emulation: relative error within
the fp32 accumulation drift (~iters * 2^-25), so the launch did all its loop trips; (3) the
timed run with 2-bit mantissas (fewer toggling bits: power and clocks). Each row carries the SM
clock under load (clock64 cycles of the loop / elapsed time) and mma per SM per clock.

Writes $OUT/gpu_mma_peak.json (default ./out): device, properties, nvidia-smi clocks before and
after, git sha, every row; prints a table. About 10-20 s on an H200 (plus NVRTC compile).
"""

from __future__ import annotations

import argparse
import json
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

START = time.time()
#: datasheet dense bf16 tensor rate of Hopper (H100 / H200 SXM): 989.4 TFLOP/s at 1830 MHz
#: over 132 SMs = 4096 flops per SM per clock (what wgmma can reach; for context only)
HOPPER_DENSE_FLOPS_PER_SM_CLK = 4096


def log(msg):
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def nvidia_smi(fields: str) -> dict | str:
    """{field: value} of GPU 0 (or of CUDA_VISIBLE_DEVICES' first), or why not."""
    try:
        proc = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv"],
                              capture_output=True, text=True, timeout=20)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    if proc.returncode != 0:
        return (proc.stdout + proc.stderr).strip()[:300]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if len(lines) < 2:
        return proc.stdout.strip()[:300]
    return dict(zip([h.strip() for h in lines[0].split(",")],
                    [v.strip() for v in lines[1].split(",")]))


def gpu_state() -> dict:
    return dict(clocks=nvidia_smi("clocks.sm,clocks.max.sm"),
                extra=nvidia_smi("power.draw,power.limit,temperature.gpu,clocks.mem"))


def device_meta() -> dict:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    meta = dict(device=torch.cuda.get_device_name(), capability=list(
        torch.cuda.get_device_capability()), torch=torch.__version__)
    for attr in ("multi_processor_count", "total_memory", "clock_rate", "memory_clock_rate",
                 "regs_per_multiprocessor", "max_threads_per_multi_processor",
                 "shared_memory_per_block_optin", "L2_cache_size"):
        if hasattr(props, attr):
            meta[attr] = getattr(props, attr)
    try:
        import triton

        meta["triton"] = triton.__version__
    except Exception:
        pass
    try:
        from tkit.bench.runner import git_sha

        meta["git"] = git_sha()
    except Exception as e:
        meta["git"] = f"? ({type(e).__name__})"
    return meta


def time_cublas(size: int, label: str) -> dict:
    from triton.testing import do_bench

    g = torch.Generator(device="cuda").manual_seed(size)
    a = torch.randn(size, size, device="cuda", generator=g).bfloat16()
    b = torch.randn(size, size, device="cuda", generator=g).bfloat16()
    p50, p20, p80 = do_bench(lambda: torch.matmul(a, b), warmup=25, rep=100,
                             quantiles=[0.5, 0.2, 0.8])
    tf = 2 * size**3 / (p50 * 1e-3) / 1e12
    log(f"cuBLAS bf16 {size}^3 ({label}): {tf:7.1f} TFLOP/s ({p50:.3f} ms, p20 {p20:.3f}, "
        f"p80 {p80:.3f})")
    return dict(kind="cublas", label=label, size=size, ms=p50, p20=p20, p80=p80, tflops=tf)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="bf16,f16,f16_f16acc",
                    help="comma-separated: bf16, f16, f16_f16acc (the first is the GEMM's)")
    ap.add_argument("--target-ms", type=float, default=2.0, help="length of one launch")
    ap.add_argument("--reps", type=int, default=10, help="timed launches per configuration")
    args = ap.parse_args()

    from tkit.cuda_ext import mma_peak as mp

    dtypes = [d for d in args.dtypes.split(",") if d]
    for d in dtypes:
        if d not in mp.DTYPES:
            ap.error(f"--dtypes: unknown {d!r} (have {', '.join(mp.DTYPES)})")
    if not torch.cuda.is_available():
        print("no CUDA GPU visible to torch", file=sys.stderr)
        return 2
    out_dir = Path(os.environ.get("OUT", "./out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_mma_peak.json"
    meta = device_meta()
    meta["gpu_state_before"] = gpu_state()
    result = dict(meta=meta, sweeps={}, checks=[], cublas=[], ratios=[])

    def save():
        meta["elapsed_s"] = time.time() - START
        path.write_text(json.dumps(result, indent=1, default=str))

    log(f"{meta['device']} sm_{''.join(map(str, meta['capability']))}, "
        f"{meta.get('multi_processor_count')} SMs, git {meta['git']}, "
        f"nvidia-smi {meta['gpu_state_before']['clocks']}")
    save()
    status = 0

    def stage(what, fn):
        """Run one stage; a failure is printed and recorded, and the next stages still run."""
        nonlocal status
        try:
            fn()
        except Exception as e:
            traceback.print_exc()
            result.setdefault("errors", []).append(f"{what}: {type(e).__name__}: {e}"[:500])
            status = 1
        save()

    def cublas(label):
        for size in (4096, 8192):
            result["cublas"].append(time_cublas(size, label))

    def sweep(d):
        log(f"sweep {d} ({mp.DTYPES[d][1]})")
        result["sweeps"][d] = mp.sweep(d, target_ms=args.target_ms, reps=args.reps,
                                       log=lambda s: log("  " + s))

    def checks():
        nonlocal status
        best = result["sweeps"].get("bf16", {}).get("best")
        if best is None:
            return
        cfg = dict(ilp=best["ilp"], warps_per_block=best["warps_per_block"],
                   blocks_per_sm=best["blocks_per_sm"])
        # 1. correctness of this configuration, bit for bit (exact data, iters <= 256)
        exact = mp.mma_sync_peak("bf16", data="exact", check=True, iters=256, reps=3, **cfg)
        exact["label"] = "best bf16 config, exact data, 256 iters: bit for bit"
        exact["check_ok"] = ok = exact["check_max_abs_err"] == 0
        status |= 0 if ok else 1
        log(f"check (exact, 256 iters): max abs err {exact['check_max_abs_err']:.3g} "
            f"({'ok' if ok else 'FAILED'})")
        # 2. the timed configuration again, its output against the emulation: fp32 rounding
        #    (truncating on tensor cores) drifts by up to ~iters * 2^-25 relative, a launch that
        #    skipped loop trips would be off by their fraction
        again = mp.mma_sync_peak("bf16", data="random", check=True, iters=best["iters"],
                                 reps=max(args.reps, 30), **cfg)
        again["label"] = "best bf16 config again, random data, 30 launches, output checked"
        drift = best["iters"] * 2.0**-25
        again["check_ok"] = ok = again["check_rel_err"] < max(0.02, 4 * drift)
        status |= 0 if ok else 1
        log(f"again: {mp.format_row(again)}  rel err {again['check_rel_err']:.2e} (expected "
            f"drift <~ {drift:.1e}: {'ok' if ok else 'FAILED'})")
        # 3. the same with 2-bit mantissas (fewer toggling bits: power, hence clocks)
        low = mp.mma_sync_peak("bf16", data="exact", iters=best["iters"], reps=args.reps, **cfg)
        low["label"] = "best bf16 config, 2-bit mantissas (low-toggle data)"
        log(f"low-toggle data: {mp.format_row(low)}")
        result["checks"] += [exact, again, low]

    stage("cuBLAS before", lambda: cublas("before the sweep"))
    for d in dtypes:
        stage(f"sweep {d}", lambda d=d: sweep(d))
    stage("checks", checks)
    stage("cuBLAS after", lambda: cublas("after the sweep"))
    meta["gpu_state_after"] = gpu_state()

    # ---- report
    print("\n==== mma.sync m16n8k16 peak (median of launches; skipped: blocks that do not fit)")
    for d, sw in result["sweeps"].items():
        print(f"-- {d}: {mp.DTYPES[d][1]}")
        for r in sorted(sw["rows"], key=lambda r: -r.get("tflops", -1)):
            print("  " + mp.format_row(r))
    print("\n==== best per dtype")
    for d, sw in result["sweeps"].items():
        b = sw["best"]
        if b is None:
            print(f"  {d:10s} no configuration ran")
            continue
        # the rate per clock comes from one block's loop cycles, which are the SM's only when
        # that block is alone on its SM: with several blocks an SM, blocks that do not overlap
        # fully make the clock read low and the rate high, so take it from 1-block rows
        solo = [r for r in sw["rows"] if r.get("blocks_per_sm") == 1
                and "flops_per_sm_per_clk" in r]
        per_clk = max(solo, key=lambda r: r["flops_per_sm_per_clk"]) if solo else None
        line = (f"  {d:10s} {b['tflops']:7.1f} TFLOP/s (max launch {b['tflops_max']:.1f}) "
                f"ilp {b['ilp']} warps/block {b['warps_per_block']} blocks/SM "
                f"{b['blocks_per_sm']}")
        if per_clk is not None:
            line += (f"; one block an SM: {per_clk['flops_per_sm_per_clk']:.0f} flop/SM/clk at "
                     f"~{per_clk['sm_clock_mhz']:.0f} MHz")
            sw["flops_per_sm_per_clk_one_block"] = per_clk["flops_per_sm_per_clk"]
            if meta["capability"] == [9, 0]:
                frac = per_clk["flops_per_sm_per_clk"] / HOPPER_DENSE_FLOPS_PER_SM_CLK
                b["hopper_dense_peak_fraction"] = frac
                line += f" = {frac:.2f} of Hopper's dense 4096 flop/SM/clk"
        print(line)
    best = result["sweeps"].get("bf16", {}).get("best")
    if best is not None and result["cublas"]:
        print("\n==== mma.sync bf16 peak / cuBLAS bf16 (same run)")
        for size in (4096, 8192):
            cb = [c for c in result["cublas"] if c["size"] == size]
            if not cb:
                continue
            ratios = {c["label"]: best["tflops"] / c["tflops"] for c in cb}
            slowest = min(c["tflops"] for c in cb)
            cons = best["tflops"] / slowest
            result["ratios"].append(dict(size=size, mma_peak_tflops=best["tflops"],
                                         cublas_tflops=[c["tflops"] for c in cb],
                                         ratio_by_cublas_run=ratios, conservative_ratio=cons))
            cb_s = ", ".join(f"{c['tflops']:.1f}" for c in cb)
            ratio_s = ", ".join(f"{v:.3f}" for v in ratios.values())
            print(f"  {size}^3: cuBLAS {cb_s} TFLOP/s (before, after the sweep); mma.sync peak "
                  f"{best['tflops']:.1f}: ratio {ratio_s} (conservative, vs the slower cuBLAS "
                  f"run: {cons:.3f})")
        print("  (an mma.sync GEMM can reach at most these ratios, less its own overheads)")
    for c in result["checks"]:
        err = (f", rel err {c['check_rel_err']:.2e} ({'ok' if c['check_ok'] else 'FAILED'})"
               if "check_rel_err" in c else "")
        print(f"  [{c['label']}]: {c['tflops']:.1f} TFLOP/s at ~{c.get('sm_clock_mhz', 0):.0f} "
              f"MHz{err}")
    print(f"\nnvidia-smi before: {meta['gpu_state_before']}\nnvidia-smi after:  "
          f"{meta['gpu_state_after']}")
    save()
    print(f"wrote {path} in {time.time() - START:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
