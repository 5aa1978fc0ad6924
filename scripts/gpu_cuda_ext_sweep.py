"""Issue #7 sweep: compile-time variants of the two CUDA GEMMs against cuBLAS, bf16.

    python scripts/gpu_cuda_ext_sweep.py --focus             # ~11 providers, 4096^3 + 8192^3
    python scripts/gpu_cuda_ext_sweep.py                     # every variant, ~2 min
    python scripts/gpu_cuda_ext_sweep.py --sizes 4096 --variants mma:default,wgmma:epi_tma

--focus times cuBLAS, the wgmma default + the 2 best others of the first sweep + the new
builds, the mma.sync default + the 2 best others + the new builds, and the Triton references.

1. Compile every variant in parallel threads: the nvcc builds of the wgmma kernel, the NVRTC
   builds of the mma.sync kernel (into cupy's disk cache, which the child of step 2 reads), and,
   in one more thread, the Triton reference's configs under DISABLE_MMA_V3=1 (JIT warmup).
2. Correctness, in a child process (a wgmma protocol bug hangs the GPU; the child is killed
   after a per-variant deadline and restarted on the next variant): for each variant, fresh
   random inputs at odd shapes and at each timed size, output NaN-poisoned before the launch,
   compared with the DESIGN rule (tkit.testing.check_against_reference: error against a
   float64 reference <= 2x torch's bf16 error). A compile or launch failure is recorded and the
   next variant runs.
3. Triton references, in this process (scripts/triton_mma_ref.py): a plain tl.dot kernel
   autotuned with DISABLE_MMA_V3=1 (Triton 3.6 then lowers tl.dot to mma.sync, not wgmma; the
   PTX is checked for mma.sync / no wgmma before and after timing): what a compiler gets out of
   mma.sync on this chip; and tkit.matmul(backend="triton"), the library's own (wgmma) path,
   for context. The switch is set only while those kernels compile.
4. Timing, this process, variants that passed only: per size, ROUNDS rounds, each round
   cuBLAS (torch.matmul), every variant and the Triton references, each a do_bench median (L2
   flushed); the figure is the median over rounds, the ratio is to the cuBLAS median of the same
   size in the same process.
Rows go to $OUT/cuda_ext_sweep.json (default ./out); a table is printed at the end.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
# the child process below checks every wgmma build; the library's own first-use self-test
# (one more subprocess per build) would only repeat it
os.environ.setdefault("TKIT_WGMMA_SELFTEST", "0")

from tkit.bench.isolate import child_loop, supervise  # noqa: E402

START = time.time()
ODD_SHAPES = [(129, 264, 200), (300, 520, 136), (1000, 1032, 1032)]


def log(msg):
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def all_variants():
    from tkit.cuda_ext.gemm import MMA_VARIANTS, WGMMA_VARIANTS

    return [f"mma:{v}" for v in MMA_VARIANTS] + [f"wgmma:{v}" for v in WGMMA_VARIANTS]


def focus_variants():
    """The defaults first, then the best others of the first H200 sweep, then the new builds."""
    from tkit.cuda_ext.gemm import MMA_DEFAULT_VARIANT, WGMMA_DEFAULT_VARIANT

    return [f"wgmma:{WGMMA_DEFAULT_VARIANT}", "wgmma:cluster2_epi_tma", "wgmma:epi_tma",
            "wgmma:cluster2_epi_tma_s3",
            f"mma:{MMA_DEFAULT_VARIANT}", "mma:256x128k32s4_epi", "mma:128x256k32s4_epi",
            "mma:128x128k64s3_2cta", "mma:128x128k32s4_2cta"]


def canonical(name):
    """'mma:default' -> 'mma:<the default variant>'."""
    from tkit.cuda_ext.gemm import MMA_DEFAULT_VARIANT, WGMMA_DEFAULT_VARIANT

    kind, v = name.split(":", 1)
    if v == "default":
        v = MMA_DEFAULT_VARIANT if kind == "mma" else WGMMA_DEFAULT_VARIANT
    return f"{kind}:{v}"


def label(name):
    from tkit.cuda_ext.gemm import MMA_DEFAULT_VARIANT, WGMMA_DEFAULT_VARIANT

    return name + (" *" if name in (f"mma:{MMA_DEFAULT_VARIANT}",
                                    f"wgmma:{WGMMA_DEFAULT_VARIANT}") else "")


def runner(name):
    """fn(a, b) for 'mma:<variant>' or 'wgmma:<variant>'."""
    from tkit.cuda_ext.gemm import matmul_mma, matmul_wgmma

    kind, v = name.split(":", 1)
    if kind == "mma":
        return lambda a, b: matmul_mma(a, b, variant=v)
    if kind == "wgmma":
        return lambda a, b: matmul_wgmma(a, b, variant=v)
    raise ValueError(f"unknown variant {name!r}")


def fresh(shape, seed):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)


# ---- step 1: compile the builds in parallel ------------------------------------------------
def precompile(names):
    """{name: why} for the builds that failed. wgmma: nvcc cubins (tkit's disk cache); mma:
    NVRTC through cupy exactly as _loader.load_module asks for it (cupy's disk cache)."""
    from tkit.cuda_ext import _loader
    from tkit.cuda_ext.gemm import MMA_SM80, WGMMA_SM90, mma_config, wgmma_config

    def one(name):
        kind, v = name.split(":", 1)
        try:
            if kind == "wgmma":
                _loader.compile_cubin(WGMMA_SM90["source"], "90a", wgmma_config(v)["options"])
            else:
                import cupy

                with cupy.cuda.Device(0):
                    cupy.RawModule(code=_loader.read_source(MMA_SM80["source"]),
                                   options=tuple(mma_config(v)["options"]),
                                   backend="nvrtc").compile()
            return name, None
        except Exception as e:
            return name, f"{type(e).__name__}: {str(e)[-400:]}"

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as ex:
        return {n: why for n, why in ex.map(one, names) if why}


def triton_warmup(refs, sizes, out):
    """Compile every config of the Triton references for every size (no launch), each under its
    own DISABLE_MMA_V3 setting; run in a thread while the CUDA builds compile and the check
    child runs, so the autotuning later only benchmarks."""
    import torch
    from triton_mma_ref import mma_v3_disabled

    try:
        dummy = torch.empty(64, device="cuda", dtype=torch.bfloat16)
        for ref in refs:
            with mma_v3_disabled(ref.mma_sync):
                for size in sizes:
                    for cfg in ref.kernel.configs:
                        ref.kernel.fn.warmup(dummy, dummy, dummy, size, size, size,
                                             **cfg.all_kwargs(), grid=(1,))
        out["ok"] = True
    except Exception as e:  # the autotuner compiles what is missing later
        out["error"] = f"{type(e).__name__}: {str(e)[:300]}"


# ---- step 2: correctness in a child process ---------------------------------------------------
def child_check(names, sizes):
    import torch

    from tkit.testing import check_against_reference

    def check_one(name):
        fn = runner(name)
        for i, (M, N, K) in enumerate(ODD_SHAPES + [(s, s, s) for s in sizes]):
            a, b = fresh((M, K), 2 * i + 1), fresh((K, N), 2 * i + 2)
            check_against_reference(fn, torch.matmul, [a, b])
        torch.cuda.synchronize()

    child_loop(names, check_one)


def check_variants(names, sizes, first_deadline=75.0, deadline=40.0, total=90.0):
    """{name: 'ok' or why not}; a child that stops answering is killed and restarted (the
    first launch of each build compiles it: NVRTC / module load)."""
    status = supervise(
        lambda todo: [sys.executable, __file__, "--child-check", ",".join(todo),
                      "--sizes", ",".join(map(str, sizes))],
        names, deadline=deadline, total=total, first_deadline=first_deadline,
        hang_hint=" (hang: an mbarrier phase never completed?)", log=log)
    return {n: st for n, (st, _) in status.items()}


# ---- step 3: timing ------------------------------------------------------------------------
def time_all(names, sizes, rounds, rep_ms, rows, extra=()):
    """extra: [(provider, fn(a, b))] timed in the same rounds (the Triton references)."""
    import torch
    from triton.testing import do_bench

    for size in sizes:
        a, b = fresh((size, size), 101), fresh((size, size), 102)
        flops = 2.0 * size**3
        providers = [("cuBLAS", torch.matmul)] + [(n, runner(n)) for n in names] + list(extra)
        samples = {p: [] for p, _ in providers}
        errors = {}
        for _ in range(rounds):
            for p, fn in providers:
                if p in errors:
                    continue
                try:
                    samples[p].append(do_bench(functools.partial(fn, a, b), warmup=10,
                                               rep=rep_ms, return_mode="median"))
                except Exception as e:
                    errors[p] = f"{type(e).__name__}: {str(e)[:300]}"
        base = statistics.median(samples["cuBLAS"]) if samples["cuBLAS"] else float("nan")
        for p, _ in providers:
            row = dict(kind="time", provider=p, M=size, N=size, K=size, dtype="bfloat16")
            if p in errors:
                row["error"] = errors[p]
            if samples[p]:
                ms = statistics.median(samples[p])
                row.update(ms=ms, ms_rounds=samples[p], tflops=flops / ms / 1e9,
                           ratio_cublas=base / ms)
            rows.append(row)
            log(f"time {label(p):40s} {size}^3 " + (
                f"{row['tflops']:7.1f} TFLOP/s  {row['ratio_cublas']:.3f}x cuBLAS"
                if "tflops" in row else row.get("error", "")))
        torch.cuda.empty_cache()


# ---- step 3: the Triton references -------------------------------------------------------------
TRITON_MMA = "triton tl.dot mma.sync (DISABLE_MMA_V3=1)"
TRITON_WGMMA = "triton tl.dot wgmma"
TKIT_TRITON = "tkit.matmul triton (wgmma)"


def prepare_triton(refs, sizes, rows):
    """Autotune the references at every size (compiled under their switch) and warm
    tkit.matmul's Triton path with the switch off; [(provider, fn)] for the timing rounds."""
    import torch
    from triton_mma_ref import mma_v3_disabled

    import tkit

    extra = []
    for label_, ref in refs:
        ok = True
        for size in sizes:
            a, b = fresh((size, size), 201), fresh((size, size), 202)
            try:
                info = ref.prepare(a, b)
                bad = (not info["ptx_seen"] or info["ptx_wgmma"] == ref.mma_sync
                       or info["ptx_mma_sync"] != ref.mma_sync or info["rel_err"] > 2e-2)
                if bad:
                    info["error"] = "wrong instruction in the PTX or wrong result"
                    ok = False
            except Exception as e:
                info, ok = dict(error=f"{type(e).__name__}: {str(e)[:400]}"), False
            rows.append(dict(kind="triton_ref", provider=label_, size=size, **info))
            log(f"{label_} {size}^3: " + ", ".join(f"{k}={v}" for k, v in info.items()))
        if ok:
            extra.append((label_, ref))

    def tkit_triton(a, b):
        return tkit.matmul(a, b, backend="triton")

    try:
        with mma_v3_disabled(False):
            t0 = time.time()
            for size in sizes:
                a, b = fresh((size, size), 201), fresh((size, size), 202)
                c = tkit_triton(a, b)
                err = ((c.float() - a.float() @ b.float()).abs().max()
                       / (a.float() @ b.float()).abs().max()).item()
                rows.append(dict(kind="triton_ref", provider=TKIT_TRITON, size=size,
                                 rel_err=err, warm_s=time.time() - t0))
            torch.cuda.synchronize()
        extra.append((TKIT_TRITON, tkit_triton))
        log(f"{TKIT_TRITON}: warm in {time.time() - t0:.1f} s")
    except Exception as e:
        rows.append(dict(kind="triton_ref", provider=TKIT_TRITON,
                         error=f"{type(e).__name__}: {str(e)[:400]}"))
        log(f"{TKIT_TRITON}: {e}")
    return extra


# ---- main ------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4096,8192")
    ap.add_argument("--variants", default="", help="comma-separated, e.g. mma:default,wgmma:"
                    "epi_tma (default: every entry of MMA_VARIANTS and WGMMA_VARIANTS)")
    ap.add_argument("--focus", action="store_true",
                    help="only the defaults, the best others of the first sweep and the new "
                    "builds (plus --variants), with the Triton references")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep-ms", type=int, default=40)
    ap.add_argument("--no-triton-ref", action="store_true")
    ap.add_argument("--triton-wgmma-ref", action="store_true",
                    help="also the same Triton kernel without DISABLE_MMA_V3 (wgmma)")
    ap.add_argument("--child-check", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.child_check is not None:
        return child_check([n for n in args.child_check.split(",") if n], sizes)

    import torch

    out_dir = Path(os.environ.get("OUT", "./out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "cuda_ext_sweep.json"
    names = [n for n in args.variants.split(",") if n]
    if args.focus:
        names = focus_variants() + names
    names = list(dict.fromkeys(canonical(n) for n in (names or all_variants())))
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        names = [n for n in names if not n.startswith("wgmma:")]
    meta = dict(device=torch.cuda.get_device_name(), capability=cap, torch=torch.__version__,
                sizes=sizes, variants=names, rounds=args.rounds, rep_ms=args.rep_ms,
                focus=args.focus)
    import triton

    from tkit.bench.runner import git_sha

    meta["triton"] = triton.__version__
    meta["git"] = git_sha()  # TKIT_GIT_SHA, else git rev-parse; "?" when neither answers
    rows: list[dict] = []

    def save():
        meta["elapsed_s"] = time.time() - START
        path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1, default=str))

    from tkit.cuda_ext.gemm import (
        MMA_DEFAULT_VARIANT,
        WGMMA_DEFAULT_VARIANT,
        mma_config,
        wgmma_config,
    )

    meta["defaults"] = dict(mma=MMA_DEFAULT_VARIANT, wgmma=WGMMA_DEFAULT_VARIANT)
    for n in names:
        kind, v = n.split(":", 1)
        cfg = mma_config(v) if kind == "mma" else wgmma_config(v)
        rows.append(dict(kind="config", provider=n, options=list(cfg["options"]),
                         smem=cfg["smem"]))

    refs = []
    warm: dict = {}
    warm_thread = None
    if not args.no_triton_ref:
        sys.path.insert(0, str(ROOT / "scripts"))
        from triton_mma_ref import TritonGemm

        refs = [(TRITON_MMA, TritonGemm(mma_sync=True))]
        if args.triton_wgmma_ref:
            refs.append((TRITON_WGMMA, TritonGemm(mma_sync=False)))
        warm_thread = threading.Thread(target=triton_warmup, args=([r for _, r in refs], sizes,
                                                                   warm), daemon=True)
        warm_thread.start()
    failed = precompile(names)
    log(f"compiled {len(names)} builds, {len(failed)} failed")
    status = {n: f"compile: {why}" for n, why in failed.items()}
    status.update(check_variants([n for n in names if n not in failed], sizes))
    for n in names:
        rows.append(dict(kind="check", provider=n, ok=status.get(n) == "ok",
                         error=None if status.get(n) == "ok" else status.get(n)))
    save()
    good = [n for n in names if status.get(n) == "ok"]
    extra = []
    if refs:
        warm_thread.join(timeout=300)
        meta["triton_warmup"] = warm or "still running"
        log(f"triton warmup: {warm or 'still running'}")
        if warm_thread.is_alive():  # it toggles DISABLE_MMA_V3: nothing else compiles now
            rows.append(dict(kind="triton_ref", provider=TRITON_MMA, error="warmup hangs"))
        else:
            try:
                extra = prepare_triton(refs, sizes, rows)
            except Exception:
                traceback.print_exc()
        save()
    try:
        time_all(good, sizes, args.rounds, args.rep_ms, rows, extra)
    except Exception:
        traceback.print_exc()
    for label_, ref in extra:  # still the kernels compiled under the switch?
        if label_ in (TRITON_MMA, TRITON_WGMMA):
            for size in sizes:
                a, b = fresh((size, size), 201), fresh((size, size), 202)
                try:
                    v = ref.verify(a, b)
                except Exception as e:
                    v = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
                rows.append(dict(kind="triton_ref_after", provider=label_, size=size, **v))
                if v.get("ptx_mma_sync") != ref.mma_sync:
                    log(f"WARNING {label_} {size}^3 after timing: {v}")
    save()

    print("\n==== correctness")
    for n in names:
        print(f"  {label(n):40s} {status.get(n)}")
    print("\n==== timings (median over rounds of do_bench medians; ratio to cuBLAS same size; "
          "* = default build)")
    print(f"  {'provider':44s} {'size':>5s} {'ms':>8s} {'TFLOP/s':>8s} {'x cuBLAS':>8s}")
    for r in rows:
        if r["kind"] == "time":
            if "tflops" in r:
                print(f"  {label(r['provider']):44s} {r['M']:5d} {r['ms']:8.3f} "
                      f"{r['tflops']:8.1f} {r['ratio_cublas']:8.3f}")
            else:
                print(f"  {label(r['provider']):44s} {r['M']:5d}   {r.get('error')}")
    for r in rows:
        if r["kind"] == "triton_ref" and "best" in r:
            print(f"  {r['provider']} {r['size']}^3: best {r['best']}, mma.sync in PTX "
                  f"{r['ptx_mma_sync']}, wgmma {r['ptx_wgmma']}, rel_err {r['rel_err']:.1e}")
        elif r["kind"] == "triton_ref" and "error" in r:
            print(f"  {r['provider']} {r.get('size', '')}: {r['error']}")
    print(f"\nwrote {path} in {time.time() - START:.0f} s")
    return 0 if all(status.get(n) == "ok" for n in names) else 1


if __name__ == "__main__":
    sys.exit(main())
