"""Issue #7 sweep: every compile-time variant of the two CUDA GEMMs against cuBLAS, bf16.

    python scripts/gpu_cuda_ext_sweep.py                     # 4096^3 and 8192^3, ~2 min
    python scripts/gpu_cuda_ext_sweep.py --sizes 4096 --variants mma:base,wgmma:epi_tma

1. Compile every variant (nvcc builds of the wgmma kernel in parallel threads; the mma.sync
   kernel goes through NVRTC at first use, in step 2).
2. Correctness, in a child process (a wgmma protocol bug hangs the GPU; the child is killed
   after a per-variant deadline and restarted on the next variant): for each variant, fresh
   random inputs at odd shapes and at each timed size, output NaN-poisoned before the launch,
   compared with the DESIGN rule (tkit.testing.check_against_reference: error against a
   float64 reference <= 2x torch's bf16 error). A compile or launch failure is recorded and the
   next variant runs.
3. Timing, this process, variants that passed only: per size, ROUNDS rounds, each round
   cuBLAS (torch.matmul) then every variant, each a do_bench median (L2 flushed); the figure is
   the median over rounds, the ratio is to the cuBLAS median of the same size.
4. Reference for mma.sync on this chip: a plain Triton tl.dot matmul (and tkit.matmul's Triton
   path) in a child process with DISABLE_MMA_V3=1 (Triton 3.6 then lowers tl.dot to mma.sync,
   not wgmma; a fresh TRITON_CACHE_DIR, and the PTX is checked for mma.sync / no wgmma), with
   cuBLAS timed in the same child.
Rows go to $OUT/cuda_ext_sweep.json (default ./out); a table is printed at the end.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import queue
import subprocess
import sys
import tempfile
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

START = time.time()
ODD_SHAPES = [(129, 264, 200), (300, 520, 136), (1000, 1032, 1032)]


def log(msg):
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def all_variants():
    from tkit.cuda_ext.gemm import MMA_VARIANTS, WGMMA_VARIANTS

    return [f"mma:{v}" for v in MMA_VARIANTS] + [f"wgmma:{v}" for v in WGMMA_VARIANTS]


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


# ---- step 1: compile the nvcc builds in parallel (no GPU needed) ----------------------------
def precompile(names):
    from tkit.cuda_ext import _loader
    from tkit.cuda_ext.gemm import WGMMA_SM90, wgmma_config

    def one(name):
        kind, v = name.split(":", 1)
        if kind != "wgmma":
            return name, None
        try:
            _loader.compile_cubin(WGMMA_SM90["source"], "90a", wgmma_config(v)["options"])
            return name, None
        except Exception as e:
            return name, f"{type(e).__name__}: {str(e)[-400:]}"

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as ex:
        return {n: why for n, why in ex.map(one, names) if why}


# ---- step 2: correctness in a child process ---------------------------------------------------
def child_check(names, sizes):
    import torch

    from tkit.testing import check_against_reference

    for name in names:
        print(f"BEGIN {name}", flush=True)
        t0 = time.time()
        try:
            fn = runner(name)
            for i, (M, N, K) in enumerate(ODD_SHAPES + [(s, s, s) for s in sizes]):
                a, b = fresh((M, K), 2 * i + 1), fresh((K, N), 2 * i + 2)
                check_against_reference(fn, torch.matmul, [a, b])
            torch.cuda.synchronize()
            print(f"OK {name} {time.time() - t0:.1f}", flush=True)
        except Exception as e:
            msg = f"{type(e).__name__}: {str(e)}".replace("\n", " ")[:400]
            print(f"BAD {name} {msg}", flush=True)
            if "illegal" in msg or "CUDA_ERROR" in msg or "launch failure" in msg:
                print("CONTEXT_LOST", flush=True)
                return


def _pump(stream, q):
    for line in stream:
        q.put(line)
    q.put(None)


def check_variants(names, sizes, first_deadline=75.0, deadline=40.0, total=90.0):
    """{name: 'ok' or why not}; a child that stops answering is killed and restarted."""
    status: dict[str, str] = {}
    todo = list(names)
    t_end = time.time() + total
    while todo and time.time() < t_end:
        cmd = [sys.executable, __file__, "--child-check", ",".join(todo),
               "--sizes", ",".join(map(str, sizes))]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        current, limit, tail = None, time.time() + first_deadline, []
        while True:
            try:
                line = lines.get(timeout=max(0.1, min(limit, t_end) - time.time()))
            except queue.Empty:
                line = "TIMEOUT"
            if line is None:  # the child ended
                if current is not None:
                    status[current] = "child died: " + " | ".join(tail[-5:])[-400:]
                    todo.remove(current)
                break
            line = line.rstrip("\n")
            if line == "TIMEOUT":
                os.killpg(proc.pid, 9)
                proc.wait()
                if current is not None:
                    status[current] = (f"no answer within {deadline:.0f} s (hang: an mbarrier "
                                       "phase never completed?)")
                    todo.remove(current)
                break
            if line.startswith("BEGIN "):
                current, limit, tail = line.split()[1], time.time() + deadline, []
                # the first launch of each build compiles it (NVRTC / module load)
            elif line.startswith(("OK ", "BAD ")):
                name = line.split()[1]
                status[name] = "ok" if line.startswith("OK ") else line.split(" ", 2)[2]
                log(f"check {name:32s} {status[name][:200]}")
                if name in todo:
                    todo.remove(name)
                current = None
            elif line == "CONTEXT_LOST":
                proc.wait()
                break
            else:
                tail.append(line)
        if proc.poll() is None:
            proc.wait()
    for name in todo:
        status.setdefault(name, "not checked: time budget")
    return status


# ---- step 3: timing ------------------------------------------------------------------------
def time_all(names, sizes, rounds, rep_ms, rows):
    import torch
    from triton.testing import do_bench

    for size in sizes:
        a, b = fresh((size, size), 101), fresh((size, size), 102)
        flops = 2.0 * size**3
        providers = [("cuBLAS", torch.matmul)] + [(n, runner(n)) for n in names]
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
        base = median(samples["cuBLAS"]) if samples["cuBLAS"] else float("nan")
        for p, _ in providers:
            row = dict(kind="time", provider=p, M=size, N=size, K=size, dtype="bfloat16")
            if p in errors:
                row["error"] = errors[p]
            if samples[p]:
                ms = median(samples[p])
                row.update(ms=ms, ms_rounds=samples[p], tflops=flops / ms / 1e9,
                           ratio_cublas=base / ms)
            rows.append(row)
            log(f"time {p:34s} {size}^3 " + (
                f"{row['tflops']:7.1f} TFLOP/s  {row['ratio_cublas']:.3f}x cuBLAS"
                if "tflops" in row else row.get("error", "")))
        torch.cuda.empty_cache()


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


# ---- step 4: what Triton reaches with mma.sync (DISABLE_MMA_V3=1) ------------------------------
TRITON_REF = r'''
import json, sys, time
import torch, triton, triton.language as tl
from triton.testing import do_bench

configs = [triton.Config(dict(BM=bm, BN=bn, BK=bk, GROUP_M=8), num_warps=w, num_stages=s)
           for bm, bn, bk, w, s in ((128, 256, 32, 8, 3), (256, 128, 32, 8, 3),
                                    (128, 256, 64, 8, 3), (128, 128, 32, 4, 4),
                                    (128, 128, 64, 8, 4), (128, 256, 32, 8, 4))]

@triton.autotune(configs, key=["M", "N", "K"])
@triton.jit
def mm(a, b, c, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
       GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    npm, npn = tl.cdiv(M, BM), tl.cdiv(N, BN)
    width = GROUP_M * npn
    g = pid // width
    first = g * GROUP_M
    gs = min(npm - first, GROUP_M)
    pm = first + (pid % width) % gs
    pn = (pid % width) // gs
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        x = tl.load(a + rm[:, None] * K + (k * BK + rk)[None, :])
        y = tl.load(b + (k * BK + rk)[:, None] * N + rn[None, :])
        acc = tl.dot(x, y, acc)
    tl.store(c + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16))

out = dict(disable_mma_v3=__import__("os").environ.get("DISABLE_MMA_V3"), rows=[])
for size in [int(s) for s in sys.argv[1].split(",")]:
    g = torch.Generator(device="cuda").manual_seed(size)
    a = torch.randn(size, size, device="cuda", generator=g).bfloat16()
    b = torch.randn(size, size, device="cuda", generator=g).bfloat16()
    c = torch.empty(size, size, device="cuda", dtype=torch.bfloat16)
    grid = lambda m: (triton.cdiv(size, m["BM"]) * triton.cdiv(size, m["BN"]),)
    t0 = time.time()
    k = mm[grid](a, b, c, size, size, size)
    torch.cuda.synchronize()
    ref = a.float() @ b.float()
    err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
    ptx = ""
    try:
        ptx = k.asm["ptx"]
    except Exception:
        pass
    row = dict(size=size, tune_s=time.time() - t0, best=str(mm.best_config), rel_err=err,
               ptx_mma_sync="mma.sync" in ptx, ptx_wgmma="wgmma" in ptx, ptx_seen=bool(ptx))
    f = 2.0 * size**3
    for name, fn in (("cuBLAS", lambda: torch.matmul(a, b)),
                     ("triton tl.dot", lambda: mm[grid](a, b, c, size, size, size))):
        ms = sorted(do_bench(fn, warmup=10, rep=100, return_mode="median") for _ in range(3))[1]
        row[name] = dict(ms=ms, tflops=f / ms / 1e9)
    out["rows"].append(row)
    print("ROW " + json.dumps(row), flush=True)
# tkit.matmul's own Triton path under the same switch, after every plain row is in (its
# autotuner may take long)
for row in out["rows"]:
    size = row["size"]
    g = torch.Generator(device="cuda").manual_seed(size)
    a = torch.randn(size, size, device="cuda", generator=g).bfloat16()
    b = torch.randn(size, size, device="cuda", generator=g).bfloat16()
    try:
        import tkit
        tkit.matmul(a, b, backend="triton")
        ms = do_bench(lambda: tkit.matmul(a, b, backend="triton"), warmup=10, rep=100,
                      return_mode="median")
        row["tkit.matmul triton"] = dict(ms=ms, tflops=2.0 * size**3 / ms / 1e9)
    except Exception as e:
        row["tkit.matmul triton"] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
    print("TKIT " + json.dumps(row), flush=True)
print("RESULT " + json.dumps(out), flush=True)
'''


def triton_reference(sizes, disable_v3: bool, timeout: float):
    env = dict(os.environ)
    if disable_v3:
        env["DISABLE_MMA_V3"] = "1"
    else:
        env.pop("DISABLE_MMA_V3", None)
    env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="tkit-sweep-triton-")
    try:
        proc = subprocess.run([sys.executable, "-c", TRITON_REF, ",".join(map(str, sizes))],
                              capture_output=True, text=True, timeout=timeout, env=env)
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        return dict(error=(proc.stdout + proc.stderr)[-800:])
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rows = {}
        for x in out.splitlines():  # the latest line of each size
            if x.startswith(("ROW ", "TKIT ")):
                r = json.loads(x.split(" ", 1)[1])
                rows[r["size"]] = r
        return dict(error=f"timed out after {timeout:.0f} s", rows=list(rows.values()))


# ---- main ------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4096,8192")
    ap.add_argument("--variants", default="", help="comma-separated, e.g. mma:base,wgmma:base "
                    "(default: every entry of MMA_VARIANTS and WGMMA_VARIANTS)")
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
    names = [n for n in args.variants.split(",") if n] or all_variants()
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        names = [n for n in names if not n.startswith("wgmma:")]
    meta = dict(device=torch.cuda.get_device_name(), capability=cap, torch=torch.__version__,
                sizes=sizes, variants=names, rounds=args.rounds, rep_ms=args.rep_ms)
    try:
        import triton

        meta["triton"] = triton.__version__
        meta["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                     capture_output=True, text=True).stdout.strip()
    except Exception:
        pass
    rows: list[dict] = []

    def save():
        meta["elapsed_s"] = time.time() - START
        path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1, default=str))

    from tkit.cuda_ext.gemm import mma_config, wgmma_config

    for n in names:
        kind, v = n.split(":", 1)
        cfg = mma_config(v) if kind == "mma" else wgmma_config(v)
        rows.append(dict(kind="config", provider=n, options=list(cfg["options"]),
                         smem=cfg["smem"]))
    failed = precompile(names)
    log(f"compiled {len(names)} builds, {len(failed)} failed")
    status = {n: f"compile: {why}" for n, why in failed.items()}
    status.update(check_variants([n for n in names if n not in failed], sizes))
    for n in names:
        rows.append(dict(kind="check", provider=n, ok=status.get(n) == "ok",
                         error=None if status.get(n) == "ok" else status.get(n)))
    save()
    good = [n for n in names if status.get(n) == "ok"]
    try:
        time_all(good, sizes, args.rounds, args.rep_ms, rows)
    except Exception:
        traceback.print_exc()
    save()
    if not args.no_triton_ref:
        refs = [(True, "triton mma.sync (DISABLE_MMA_V3=1)")]
        if args.triton_wgmma_ref:
            refs.append((False, "triton wgmma"))
        for disable, label in refs:
            left = 145 - (time.time() - START)
            if left < 20:
                rows.append(dict(kind="triton_ref", provider=label, error="time budget"))
                continue
            res = triton_reference(sizes, disable, timeout=min(75.0, left - 5))
            rows.append(dict(kind="triton_ref", provider=label, **res))
            for r in res.get("rows", []):
                for k in ("triton tl.dot", "tkit.matmul triton", "cuBLAS"):
                    v = r.get(k, {})
                    log(f"{label}: {k:20s} {r['size']}^3 " + (
                        f"{v['tflops']:7.1f} TFLOP/s" if "tflops" in v else str(v)[:200]))
                log(f"  best {r['best']} ptx mma.sync={r['ptx_mma_sync']} "
                    f"wgmma={r['ptx_wgmma']} rel_err={r['rel_err']:.2e}")
            if "error" in res:
                log(f"{label}: {res['error'][-300:]}")
        save()

    print("\n==== correctness")
    for n in names:
        print(f"  {n:34s} {status.get(n)}")
    print("\n==== timings (median over rounds of do_bench medians; ratio to cuBLAS same size)")
    print(f"  {'provider':34s} {'size':>5s} {'ms':>8s} {'TFLOP/s':>8s} {'x cuBLAS':>8s}")
    for r in rows:
        if r["kind"] == "time":
            if "tflops" in r:
                print(f"  {r['provider']:34s} {r['M']:5d} {r['ms']:8.3f} {r['tflops']:8.1f} "
                      f"{r['ratio_cublas']:8.3f}")
            else:
                print(f"  {r['provider']:34s} {r['M']:5d}   {r.get('error')}")
    for r in rows:
        if r["kind"] == "triton_ref":
            for x in r.get("rows", []):
                cub = x.get("cuBLAS", {}).get("tflops", math.nan)
                for k in ("triton tl.dot", "tkit.matmul triton"):
                    if "tflops" in x.get(k, {}):
                        print(f"  {r['provider'] + ': ' + k:60s} {x['size']:5d} "
                              f"{x[k]['tflops']:8.1f} {x[k]['tflops'] / cub:8.3f}x (child's "
                              "cuBLAS)")
    print(f"\nwrote {path} in {time.time() - START:.0f} s")
    return 0 if all(status.get(n) == "ok" for n in names) else 1


if __name__ == "__main__":
    sys.exit(main())
