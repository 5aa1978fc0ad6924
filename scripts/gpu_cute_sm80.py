"""Issue #7: the CuTe mma.sync GEMM builds (tkit.cuda_ext.gemm_cute) against cuBLAS, bf16.

    PYTHONPATH=. python scripts/gpu_cute_sm80.py                  # every build, 4096^3 + 8192^3
    PYTHONPATH=. python scripts/gpu_cute_sm80.py --variants 128x256k32s4,256x128k64s3 --sizes 4096

A second, independent mma.sync + ldmatrix + cp.async GEMM (CuTe atoms and swizzled layouts
instead of hand-written PTX) beside tkit's own (tkit.cuda_ext.gemm.matmul_mma): if it also stops
near 0.6x cuBLAS on the H200, that is the chip's mma.sync ceiling, not one kernel's.

1. Compile every build with nvcc in parallel threads (tkit's disk cache, for the device's arch,
   exactly as matmul_cute_sm80 asks for it) and record each kernel's registers / stack / local
   memory (cuobjdump -res-usage); meanwhile the main thread builds tkit's mma.sync default
   (NVRTC, cupy's disk cache).
2. Correctness in a child process (a faulting build would poison this process's CUDA context):
   per shape, fresh random inputs, the float64 reference and torch's bf16 product computed once,
   then every build with its output NaN-poisoned, judged by the DESIGN rule
   (tkit.testing.assert_close_to_reference: error <= 2x torch's bf16 error). Shapes: 4096^3 and
   an odd-but-supported one (11 x 5 x 37 tiles of the largest tile sizes: 2816 x 1280 x 2368 for
   the default builds). A child that dies is restarted on the builds it had not reached.
3. Timing in this process, builds that passed only: per size, ROUNDS rounds of cuBLAS
   (torch.matmul), every CuTe build and tkit's matmul_mma default, interleaved; each a
   triton.testing.do_bench median (do_bench zeroes a 256 MB buffer before every run: L2 flushed).
   The figure is the median over rounds; the ratio is to cuBLAS's median of the same size.
$OUT/cute_sm80.json (default ./out) is rewritten after every step; a table is printed at the end.
Needs nvcc and the CuTe headers of the nvidia-cutlass wheel (a py3-none-any wheel; installed
with --no-deps it is enough for the headers).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

from tkit.bench.isolate import child_loop, supervise  # noqa: E402

START = time.time()
CUBLAS = "cuBLAS"
MMA = "mma:default"  # tkit.cuda_ext.gemm.matmul_mma, its default build


def log(msg):
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def provider_fn(name):
    """fn(a, b) for 'cute:<variant>' or 'mma:<variant>' ('mma:default': matmul_mma's own
    choice)."""
    from tkit.cuda_ext.gemm import matmul_mma
    from tkit.cuda_ext.gemm_cute import matmul_cute_sm80

    kind, v = name.split(":", 1)
    if kind == "mma":
        return functools.partial(matmul_mma, variant=None if v == "default" else v)
    if kind != "cute":
        raise ValueError(f"unknown provider {name!r}")
    return functools.partial(matmul_cute_sm80, variant=v)


def fresh(shape, seed):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)


def odd_shape(variants):
    """Whole tiles of every build, otherwise uneven: 11 x 5 x 37 tiles of the largest
    (M, N, K) tile sizes (a partial raster group of 3 tile-rows after the full one of 8)."""
    from tkit.cuda_ext.gemm_cute import cute_config

    cfgs = [cute_config(v) for v in variants] or [cute_config()]
    lcm = lambda key: functools.reduce(math.lcm, (c[key] for c in cfgs))
    return (11 * lcm("bm"), 5 * lcm("bn"), 37 * lcm("bk"))


# ---- step 1: compile -------------------------------------------------------------------------
def compile_all(variants, arch):
    """{variant: why} for the builds that failed; {variant: resources} for the others."""
    from tkit.cuda_ext.gemm_cute import compile_cute, cubin_resources

    def one(v):
        t0 = time.time()
        try:
            path = compile_cute(v, arch)
            try:
                res = cubin_resources(path)
            except Exception as e:  # no cuobjdump: the build still counts
                res = {"error": f"{type(e).__name__}: {e}"}
            return v, None, dict(res, compile_s=round(time.time() - t0, 1))
        except Exception as e:
            return v, f"{type(e).__name__}: {str(e)[-600:]}", None

    failed, resources = {}, {}
    with ThreadPoolExecutor(max_workers=max(1, min(len(variants), os.cpu_count() or 4))) as ex:
        futures = [ex.submit(one, v) for v in variants]
        try:  # the mma.sync default (NVRTC) while nvcc runs
            from tkit.cuda_ext import _loader
            from tkit.cuda_ext.gemm import MMA_SM80, default_mma_variant, mma_config

            _loader.load_module(MMA_SM80["source"],
                                options=mma_config(default_mma_variant())["options"])
        except Exception as e:
            log(f"mma.sync default build: {type(e).__name__}: {e}")
        for f in futures:
            v, why, res = f.result()
            if why:
                failed[v] = why
                log(f"compile {v:24s} FAILED {why[-300:]}")
            else:
                resources[v] = res
                log(f"compile {v:24s} {res.get('compile_s')} s  " + ", ".join(
                    f"{k}: {r['reg']} regs, stack {r['stack']}, local {r['local']}"
                    for k, r in res.items() if isinstance(r, dict)))
    return failed, resources


# ---- step 2: correctness in a child process ---------------------------------------------------
def child_check(names, shapes):
    import torch

    from tkit.testing import assert_close_to_reference, poisoned_outputs

    refs = []
    for i, (M, N, K) in enumerate(shapes):
        a, b = fresh((M, K), 2 * i + 11), fresh((K, N), 2 * i + 12)
        refs.append((a, b, (a.double() @ b.double()), a @ b))

    def check_one(name):
        fn = provider_fn(name)
        errs = []
        for a, b, ref, peer in refs:
            with poisoned_outputs():
                out = fn(a, b)
            torch.cuda.synchronize()
            errs.append(assert_close_to_reference(
                out, ref, peer, name=f"{name} {tuple(a.shape)}x{tuple(b.shape)}"))
        return errs

    child_loop(names, check_one)


def check_all(names, shapes, deadline=60.0, total=100.0):
    """{name: ('ok', errors) or (why, None)}; a child that dies or hangs is replaced."""
    shape_arg = ";".join(",".join(map(str, s)) for s in shapes)
    return supervise(
        lambda todo: [sys.executable, __file__, "--child-check", ",".join(todo),
                      "--shapes", shape_arg],
        names, deadline=deadline, total=total, log=log)


# ---- step 3: timing --------------------------------------------------------------------------
def time_size(names, size, rounds, rep_ms, rows, save):
    import torch
    from triton.testing import do_bench

    a, b = fresh((size, size), 101), fresh((size, size), 102)
    flops = 2.0 * size**3
    providers = [(CUBLAS, torch.matmul)] + [(n, provider_fn(n)) for n in names]
    samples = {p: [] for p, _ in providers}
    errors = {}
    for r in range(rounds):
        for p, fn in providers:
            if p in errors:
                continue
            try:
                samples[p].append(do_bench(functools.partial(fn, a, b), warmup=10, rep=rep_ms,
                                           return_mode="median"))
            except Exception as e:
                errors[p] = f"{type(e).__name__}: {str(e)[:300]}"
                log(f"time {p} {size}^3: {errors[p]}")
        log(f"{size}^3 round {r + 1}/{rounds}: " + ", ".join(
            f"{p.split(':')[-1]} {flops / samples[p][-1] / 1e9:.0f}"
            for p, _ in providers if samples[p]) + " TFLOP/s")
    base = statistics.median(samples[CUBLAS]) if samples[CUBLAS] else float("nan")
    for p, _ in providers:
        row = dict(kind="time", provider=p, M=size, N=size, K=size, dtype="bfloat16")
        if p in errors:
            row["error"] = errors[p]
        if samples[p]:
            ms = statistics.median(samples[p])
            row.update(ms=ms, ms_rounds=samples[p], tflops=flops / ms / 1e9,
                       ratio_cublas=base / ms)
        rows.append(row)
    save()
    del a, b
    torch.cuda.empty_cache()


# ---- main ------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4096,8192")
    ap.add_argument("--variants", default="",
                    help="comma-separated names of CUTE_VARIANTS (default: all)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep-ms", type=int, default=40)
    ap.add_argument("--child-check", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--shapes", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_check is not None:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";") if s]
        return child_check([n for n in args.child_check.split(",") if n], shapes)

    import torch

    from tkit.cuda_ext import _loader
    from tkit.cuda_ext.gemm import default_mma_variant
    from tkit.cuda_ext.gemm_cute import CUTE_DEFAULT_VARIANT, CUTE_VARIANTS, cute_config

    out_dir = Path(os.environ.get("OUT", "./out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "cute_sm80.json"
    sizes = [int(s) for s in args.sizes.split(",") if s]
    variants = [v for v in args.variants.split(",") if v] or list(CUTE_VARIANTS)
    unknown = [v for v in variants if v not in CUTE_VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(CUTE_VARIANTS)}")
    arch = _loader.device_arch()
    meta = dict(device=torch.cuda.get_device_name(), arch=arch, torch=torch.__version__,
                nvcc=_loader.nvcc_version(), sizes=sizes, variants=variants,
                default_variant=CUTE_DEFAULT_VARIANT, mma_default=default_mma_variant(),
                rounds=args.rounds, rep_ms=args.rep_ms)
    import triton

    from tkit.bench.runner import git_sha

    meta["triton"] = triton.__version__
    meta["git"] = git_sha()  # TKIT_GIT_SHA, else git rev-parse; "?" when neither answers
    rows: list[dict] = []

    def save():
        meta["elapsed_s"] = round(time.time() - START, 1)
        path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1, default=str))

    names = [f"cute:{v}" for v in variants]
    for v in variants:
        cfg = cute_config(v)
        rows.append(dict(kind="config", provider=f"cute:{v}", options=list(cfg["options"]),
                         smem=cfg["smem"], threads=cfg["threads"],
                         tile=[cfg["bm"], cfg["bn"], cfg["bk"]], stages=cfg["stages"],
                         warps=[cfg["warps_m"], cfg["warps_n"]], min_blocks=cfg["min_blocks"],
                         epi_smem=cfg["epi_smem"]))
    save()

    meta["cute_include"] = _loader.cutlass_include()
    if meta["cute_include"] is None:  # every build would fail the same way
        log("CuTe headers not found: the nvidia-cutlass wheel (pure Python + headers, no "
            "dependencies needed for the headers) must be installed or carried, e.g. "
            "pip install --no-deps --target /tmp/site nvidia_cutlass-*.whl and /tmp/site on "
            "PYTHONPATH")
    failed, resources = compile_all(variants, arch)
    for v in variants:
        rows.append(dict(kind="compile", provider=f"cute:{v}", ok=v not in failed,
                         error=failed.get(v), resources=resources.get(v)))
    save()

    odd = odd_shape([v for v in variants if v not in failed])
    shapes = [odd, (4096, 4096, 4096)]
    meta["check_shapes"] = shapes
    to_check = [f"cute:{v}" for v in variants if v not in failed] + [MMA]
    status = check_all(to_check, shapes) if to_check else {}
    status.update({f"cute:{v}": (f"compile: {why}", None) for v, why in failed.items()})
    for n in names + [MMA]:
        st, errs = status.get(n, ("not checked", None))
        rows.append(dict(kind="check", provider=n, ok=st == "ok",
                         error=None if st == "ok" else st, errors=errs))
    save()

    good = [n for n in names if status.get(n, ("",))[0] == "ok"]
    if status.get(MMA, ("",))[0] == "ok":
        good.append(MMA)
    for size in sizes:
        try:
            time_size(good, size, args.rounds, args.rep_ms, rows, save)
        except Exception:
            traceback.print_exc()
    save()

    print("\n==== builds (registers per kernel from the cubin; dynamic shared memory)")
    for v in variants:
        res = resources.get(v) or {}
        regs = ", ".join(f"{k.replace('gemm_cute_', '')} {r['reg']} regs stack {r['stack']} "
                         f"local {r['local']}" for k, r in res.items() if isinstance(r, dict))
        cfg = cute_config(v)
        print(f"  {v:24s} {cfg['threads']:3d} thr  {cfg['smem'] // 1024:3d} KiB  "
              f"{regs or failed.get(v, '')[:200]}")
    print("\n==== correctness (" + "; ".join("x".join(map(str, s)) for s in shapes) + ")")
    for n in names + [MMA]:
        print(f"  {n:32s} {status.get(n, ('not checked',))[0][:200]}")
    print("\n==== timings (median over rounds of do_bench medians, L2 flushed; ratio to cuBLAS of "
          "the same size; * = CuTe default build)")
    print(f"  {'provider':34s} {'size':>5s} {'ms':>8s} {'TFLOP/s':>8s} {'x cuBLAS':>8s}")
    for r in rows:
        if r["kind"] != "time":
            continue
        star = " *" if r["provider"] == f"cute:{CUTE_DEFAULT_VARIANT}" else ""
        if "tflops" in r:
            print(f"  {r['provider'] + star:34s} {r['M']:5d} {r['ms']:8.3f} {r['tflops']:8.1f} "
                  f"{r['ratio_cublas']:8.3f}")
        else:
            print(f"  {r['provider'] + star:34s} {r['M']:5d}   {r.get('error')}")
    print(f"\nwrote {path} in {time.time() - START:.0f} s")
    return 0 if all(status.get(n, ("",))[0] == "ok" for n in names) else 1


if __name__ == "__main__":
    sys.exit(main())
