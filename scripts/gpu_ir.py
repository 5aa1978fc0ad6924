"""tkit.ir on the H200: does the ahead-of-time compile match what actually runs, and what do the
tutorial-07 matmul variants cost? Writes $OUT/gpu_ir.json; about a minute.

1. Agreement: for the tutorial matmul variants and for tkit ops at benchmark sizes, run the
   kernel through Triton's JIT, then compile the same launch with ``tkit.ir`` (no arch given:
   the local GPU; no config given: the tuned one). The two must be the *same* kernel (equal
   Triton hash), and the registers/spills tkit.ir reads from cuobjdump must equal what the driver
   reports for the loaded kernel (``CompiledKernel.n_regs`` / ``n_spills``).
2. Timing: the tutorial matmul at 4096^3 fp16 for each BLOCK/num_warps/num_stages variant, with
   TFLOP/s, percent of the cuBLAS bf16 ceiling (720 TFLOP/s), the ratio to cuBLAS fp16 measured
   in the same run, and the summary facts (mma shape, buffers, regs, occupancy) side by side.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tkit.ir_tools as ir  # noqa: E402
from tkit import registry  # noqa: E402
from tkit.ir_tools.aot import unwrap  # noqa: E402
from tkit.kernels import _common  # noqa: E402

OUT = Path(os.environ.get("OUT", "out"))
OUT.mkdir(parents=True, exist_ok=True)
CEILING_TFLOPS = 720.0  # cuBLAS bf16 4096^3 on this H200 (FACTS.md)
T0 = time.time()
BUDGET_S = 100


def _tutorial():
    path = ROOT / "tutorials" / "07_reading_the_compiler.py"
    spec = importlib.util.spec_from_file_location("tutorial07", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _jit_kernels(jit):
    dev = torch.cuda.current_device()
    cache = jit.device_caches[dev][0]
    out = {}
    for k in cache.values():
        k = k.result() if hasattr(k, "result") else k
        if hasattr(k, "_init_handles"):
            k._init_handles()
        out[k.metadata.hash] = k
    return out


def agreement(name, jit, compiled) -> dict:
    """Compare tkit.ir's compile with the kernels the JIT built for the same function."""
    kernels = _jit_kernels(jit)
    row = dict(name=name, kernel=compiled.name, arch=compiled.arch, config=compiled.config,
               note=compiled.note, jit_variants=len(kernels))
    match = kernels.get(compiled.metadata.hash)
    row["same_hash"] = match is not None
    row["aot_regs"], row["aot_spills"] = compiled.n_regs, compiled.n_spills
    row["aot_shared"] = compiled.shared
    if match is not None:
        row["jit_regs"], row["jit_spills"] = match.n_regs, match.n_spills
        row["jit_shared"] = match.metadata.shared
        row["agree"] = (match.n_regs == compiled.n_regs and match.n_spills == compiled.n_spills
                        and match.metadata.shared == compiled.shared)
    else:
        row["agree"] = False
    return row


def op_agreement(spec) -> dict:
    case = spec.bench_cases()[0]
    args, kwargs = case.make("cuda")
    spec.fn(*args, **kwargs)  # autotunes and compiles through the JIT
    torch.cuda.synchronize()
    with _common.capture_launches() as launches:
        spec.fn(*args, **kwargs)
    compiled = ir.compile(spec.name, *args, **kwargs)  # local arch, tuned config
    jit = unwrap(launches[0].kernel)[2]
    row = agreement(spec.name, jit, compiled)
    row["case"] = case.label
    del args, kwargs
    torch.cuda.empty_cache()
    return row


def main():
    assert torch.cuda.is_available(), "needs the GPU"
    t7 = _tutorial()
    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, agreement=[], matmul=[])
    # ---- timing + agreement on the tutorial matmul --------------------------------------------
    S = t7.SIZE
    a = torch.randn(S, S, device="cuda", dtype=torch.float16)
    b = torch.randn(S, S, device="cuda", dtype=torch.float16)
    flops = 2 * S**3
    ref = torch.matmul(a, b)
    cublas_ms = triton.testing.do_bench(lambda: torch.matmul(a, b), return_mode="median")
    results["cublas_fp16_ms"] = cublas_ms
    for v in t7.VARIANTS:
        out = t7.matmul(a, b, **v)
        err = (out.float() - ref.float()).abs().max().item()
        q = triton.testing.do_bench(lambda v=v: t7.matmul(a, b, **v), quantiles=[0.5, 0.2, 0.8])
        compiled = t7.compile_mm(arch=None, **v)
        f = t7.facts(ir.summary(compiled, echo=False))
        agree = agreement(f"tutorial matmul {v or 'default'}", t7.matmul_kernel, compiled)
        results["agreement"].append(agree)
        results["matmul"].append(dict(
            variant=v or {"default": True}, median_ms=q[0], p20_ms=q[1], p80_ms=q[2],
            tflops=flops / q[0] / 1e9, pct_ceiling=100 * flops / q[0] / 1e9 / CEILING_TFLOPS,
            vs_cublas=cublas_ms / q[0], max_abs_err=err, **{k: f[k] for k in (
                "mma", "warps_per_cta", "buffers", "regs", "spills", "shared_kb",
                "blocks_per_sm")}))
    a = b = ref = out = None  # free before the ops run
    torch.cuda.empty_cache()
    # ---- agreement on tkit ops (as many as the budget allows) ---------------------------------
    specs = [s for s in registry.all_specs() if s.family != "cuda_ext"]
    first = {}
    for s in specs:  # one op of each family first, then the rest, while the budget lasts
        first.setdefault(s.family, s)
    order = list(first.values()) + [s for s in specs if s not in first.values()]
    for spec in order:
        if time.time() - T0 > BUDGET_S:
            results["agreement"].append(dict(name=spec.name, skipped="time budget"))
            continue
        try:
            results["agreement"].append(op_agreement(spec))
        except Exception as e:  # report and keep going
            results["agreement"].append(dict(name=spec.name, error=f"{type(e).__name__}: {e}"))
    results["seconds"] = time.time() - T0
    (OUT / "gpu_ir.json").write_text(json.dumps(results, indent=1, default=str))

    print(f"\ncuBLAS fp16 {S}^3: {cublas_ms:.3f} ms = {flops / cublas_ms / 1e9:.0f} TFLOP/s")
    print(f"{'variant':34} {'ms':>7} {'TFLOP/s':>8} {'%ceil':>6} {'xcuBLAS':>7} {'mma':>11} "
          f"{'buf':>5} {'regs':>4} {'spill':>5} {'smemKB':>6} {'blk/SM':>6}")
    for r in results["matmul"]:
        print(f"{json.dumps(r['variant']):34} {r['median_ms']:7.3f} {r['tflops']:8.0f} "
              f"{r['pct_ceiling']:6.1f} {r['vs_cublas']:7.2f} {','.join(r['mma']):>11} "
              f"{str(r['buffers'][:1]):>5} {r['regs']:4d} {r['spills']:5d} "
              f"{r['shared_kb']:6.0f} {r['blocks_per_sm']:6d}")
    print(f"\n{'AOT vs JIT':40} {'hash':>5} {'regs aot/jit':>13} {'spills':>7} {'agree':>6}")
    for r in results["agreement"]:
        if "error" in r or "skipped" in r:
            print(f"{r['name']:40} {r.get('error', r.get('skipped'))[:80]}")
            continue
        print(f"{r['name'][:40]:40} {str(r['same_hash']):>5} "
              f"{r['aot_regs']:>6}/{r.get('jit_regs', '-')!s:<6} "
              f"{r['aot_spills']:>3}/{r.get('jit_spills', '-')!s:<3} {str(r['agree']):>6}")
    print(f"\n{time.time() - T0:.0f} s; full results in {OUT / 'gpu_ir.json'}")


if __name__ == "__main__":
    main()
