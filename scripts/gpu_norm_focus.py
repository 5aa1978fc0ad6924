"""Decide close calls of the reduction sweep: interleaved rounds, medians, and what
torch.compile's kernels are.

    python scripts/gpu_norm_focus.py --cases rms_norm:8192,layer_norm:16384 --rounds 5

For each (op, N) of the 256 MiB sweep (``registry`` bench cases "sweep N=..."): tkit's default,
torch.compile, Liger-Kernel (when importable) and tkit variants (config overrides) are timed in
``--rounds`` rounds, the provider order rotated every round, and the median of the round
medians is reported. torch.compile's generated Triton kernels for the case are saved under
$OUT/inductor/ with the config its autotuner chose (XBLOCK, R0_BLOCK, num_warps, ...), so a gap
can be read off the kernel rather than guessed.

Output: a table on stdout and $OUT/gpu_norm_focus.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_reductions  # noqa: E402
from gpu_reductions import check, copy_ceiling, fwd_bytes, fwd_fns, make_case, override  # noqa: E402

from tkit import registry  # noqa: E402
from tkit.bench.runner import git_sha  # noqa: E402

LOOP = dict(norm_fwd_single_bytes=0)  # force the chunked loop path of the norm forward

# the forward's loop path (chunk, warps): two walks over the row, the second from L2
LOOP_SHAPES = [(2048, 8), (2048, 16), (4096, 8), (4096, 16), (8192, 16), (8192, 32),
               (16384, 16), (16384, 32), (32768, 32)]
# rows a program x warps of the single-tile path, for short rows
ROW_SHAPES = [(1, 1), (1, 2), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8)]


def _variants(name: str, n: int) -> dict[str, dict]:
    out = {}
    if name in ("rms_norm", "layer_norm", "rms_norm_residual"):
        for chunk, warps in LOOP_SHAPES:
            if chunk <= max(n, 2048) and chunk // warps >= 128:
                out[f"loop c{chunk // 1024}k w{warps}"] = dict(LOOP, norm_chunk=chunk,
                                                              norm_loop_warps=warps)
    if name == "layer_norm":
        # the lane combine (two sums / one Chan reduce), the second walk's order, and the
        # second walk unrolled at compile time ("s2") or a run-time loop
        for chunk, warps in ((2048, 16), (4096, 16), (8192, 16), (8192, 32), (16384, 32)):
            if chunk > n or chunk // warps < 128:
                continue
            for chan, rev2, static2 in ((True, False, True), (True, True, True),
                                        (False, False, True), (False, True, True),
                                        (True, False, False), (False, False, False)):
                out[f"c{chunk // 1024}k w{warps} {'chan' if chan else 'sum2'} "
                    f"{'rev' if rev2 else 'fwd'}{' s2' if static2 else ''}"] = dict(
                    LOOP, norm_chunk=chunk, norm_loop_warps=warps, norm_chan=chan,
                    norm_rev2=rev2, norm_static2=static2)
    if name in ("rms_norm", "rms_norm_residual"):
        out["s2"] = dict(norm_static2=True)
        out["fwd s2"] = dict(norm_static2=True, norm_rev2=False)
        out["fwd"] = dict(norm_rev2=False)
        out["rev loop"] = dict(norm_static2=False, norm_rev2=True)
    if n <= 2048:
        for rows, warps in ROW_SHAPES:
            out[f"rows{rows} w{warps}"] = dict(rows=rows, num_warps=warps)
    return out


def inductor_kernels():
    """{module name: [(kernel name, [config dicts])]} of every inductor module loaded so far."""
    from torch._inductor.codecache import PyCodeCache

    mods = getattr(PyCodeCache, "modules", None)
    if mods is None:
        mods = list(getattr(PyCodeCache, "cache", {}).values())
    out = {}
    for mod in list(mods):
        found = []
        for name, obj in vars(mod).items():
            launchers = getattr(obj, "launchers", None)
            if launchers is None or not hasattr(obj, "fn"):
                continue
            cfgs = []
            for ln in launchers:
                c = getattr(ln, "config", None)
                if c is not None:
                    cfgs.append(dict(kwargs=dict(c.kwargs), num_warps=c.num_warps,
                                     num_stages=c.num_stages))
            found.append((name, cfgs, getattr(obj, "configs", None) and len(obj.configs)))
        if found:
            out[getattr(mod, "__file__", str(id(mod)))] = found
    return out


def bench(fn, rep):
    """Median ms of ``fn`` (gpu_reductions.bench: do_bench, L2 flushed), or the error text of a
    provider that fails (it must not stop the run)."""
    ms = gpu_reductions.bench(fn, rep=rep)
    return ms if isinstance(ms, str) else ms[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="rms_norm:8192,rms_norm:32768,layer_norm:16384")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep", type=int, default=30, help="do_bench rep (ms) per measurement")
    ap.add_argument("--budget", type=float, default=400.0)
    ap.add_argument("--variants", default="all", help="'all', 'none' or comma-separated names")
    ap.add_argument("--placement", default="", help="rms_norm Ns at which to time tkit writing "
                    "its output at three fixed addresses")
    opts = ap.parse_args()
    opts.placement = [int(v) for v in opts.placement.split(",") if v.strip()]
    out_dir = Path(os.environ.get("OUT", "./out"))
    (out_dir / "inductor").mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    torch.manual_seed(0)
    ceiling = copy_ceiling()
    print(f"copy ceiling this run: {ceiling:.2f} TB/s", flush=True)
    results = []
    for item in opts.cases.split(","):
        name, n = item.split(":")
        n = int(n)
        if time.time() - t0 > opts.budget:
            results.append(dict(op=name, N=n, skipped="budget"))
            continue
        args, kwargs = make_case(name, f"sweep N={n}")
        nbytes = fwd_bytes(name, args, kwargs)
        ok = check(name, args, kwargs, f"N={n}")
        try:
            before = set(inductor_kernels())
        except Exception as e:  # introspection of torch internals must not stop the run
            print(f"inductor introspection failed: {e!r}", flush=True)
            before = None
        provs = dict(fwd_fns(name, args, kwargs))
        provs.pop("torch", None)  # eager is far behind at every N; not a decision
        spec_fn = registry.get(name).fn
        for vname, ov in _variants(name, n).items():
            if opts.variants == "none" or (opts.variants != "all"
                                           and vname not in opts.variants.split(",")):
                continue

            def run(ov=ov, f=spec_fn, a=args, kw=kwargs):
                with override(**ov):
                    f(*a, **kw)
            provs["tkit " + vname] = run
        if name == "rms_norm" and n in opts.placement:
            # the output written at fixed, different addresses: does placement alone move the
            # time? (tkit allocates y with C.empty; these variants hand it a preallocated one)
            from tkit.kernels import _common as C

            bufs = [torch.empty_like(args[0]) for _ in range(3)]
            for i, buf in enumerate(bufs):
                def placed(buf=buf, f=spec_fn, a=args, kw=kwargs):
                    orig = C.empty
                    C.empty = lambda *_a, **_k: buf
                    try:
                        return f(*a, **kw)
                    finally:
                        C.empty = orig
                provs[f"tkit y@{i}"] = placed
        ptrs = {}
        for p, fn in provs.items():  # warm up: compiles and autotuning outside the rounds
            bench(fn, 5)
            try:
                out = fn()
            except Exception:  # a provider that refuses the shape (recorded by bench below)
                continue
            out = out[0] if isinstance(out, (tuple, list)) else out
            if torch.is_tensor(out):
                ptrs[p] = hex(out.data_ptr())
        ptrs["x"] = hex(args[0].data_ptr())
        out = None
        try:
            after = inductor_kernels() if before is not None else {}
        except Exception as e:
            print(f"inductor introspection failed: {e!r}", flush=True)
            after = {}
        ind = {k: v for k, v in after.items() if k not in (before or ())}
        for path in ind:
            try:
                src = Path(path).read_text()
                (out_dir / "inductor" / f"{name}_{n}_{Path(path).stem[:12]}.py").write_text(src)
            except OSError:
                pass
        times = {p: [] for p in provs}
        names = list(provs)
        for r in range(opts.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for p in order:
                ms = bench(provs[p], opts.rep)
                times[p].append(ms)
        graphs = {}  # the same calls replayed from a CUDA graph: kernel time, no host time
        for p in ("tkit", "torch.compile", "liger"):
            if p in provs:
                try:
                    graphs[p] = float(triton.testing.do_bench_cudagraph(
                        provs[p], rep=opts.rep, return_mode="median"))
                except Exception as e:
                    graphs[p] = f"{type(e).__name__}: {str(e)[:120]}"
        row = dict(op=name, N=n, bytes=nbytes, check_ok=ok, data_ptrs=ptrs,
                   graph={p: (dict(median_ms=v, tbs=nbytes / (v * 1e-3) / 1e12)
                              if isinstance(v, float) else dict(error=v))
                          for p, v in graphs.items()},
                   inductor=[k for v in ind.values() for k in v], providers={})
        for p, ts in times.items():
            good = [t for t in ts if isinstance(t, float)]
            if not good:
                row["providers"][p] = dict(error=ts[0])
                continue
            med = statistics.median(good)
            row["providers"][p] = dict(median_ms=med, rounds_ms=good,
                                       tbs=nbytes / (med * 1e-3) / 1e12)
        base = max([row["providers"].get(b, {}).get("tbs", 0) for b in ("torch.compile",
                                                                          "liger")])
        row["best_base_tbs"] = base
        results.append(row)
        line = f"{name:18} N={n:<7} check={'ok' if ok else 'FAIL'} "
        line += " ".join(f"{p}={v.get('tbs', float('nan')):.3f}"
                         for p, v in row["providers"].items())
        print(line, flush=True)
        print("   cuda graph: " + " ".join(f"{p}={v.get('tbs', float('nan')):.3f}"
                                           for p, v in row["graph"].items()), flush=True)
        print(f"   data_ptrs: {ptrs}", flush=True)
        for k in row["inductor"]:
            print(f"   inductor {k[0]}: chosen {k[1]} of {k[2]} configs", flush=True)
        args = provs = None
        torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, git_sha=git_sha(), copy_ceiling_tbs=ceiling,
                rounds=opts.rounds, seconds=time.time() - t0)
    (out_dir / "gpu_norm_focus.json").write_text(json.dumps(dict(meta=meta, rows=results),
                                                            indent=1, default=str))
    print("\nmedian of rounds, TB/s; ratio = provider / max(torch.compile, liger)")
    for row in results:
        if "providers" not in row:
            print(f"{row['op']:18} N={row['N']:<7} skipped ({row.get('skipped')})")
            continue
        base = row["best_base_tbs"] or float("nan")
        best = max(((p, v["tbs"]) for p, v in row["providers"].items() if "tbs" in v
                    and p.startswith("tkit")), key=lambda kv: kv[1])
        t = row["providers"].get("tkit", {}).get("tbs", float("nan"))
        print(f"{row['op']:18} N={row['N']:<7} tkit {t:.3f} ({t / base:.3f}x)  best tkit "
              f"{best[0]!r} {best[1]:.3f} ({best[1] / base:.3f}x)  compile "
              f"{row['providers'].get('torch.compile', {}).get('tbs', float('nan')):.3f}  "
              f"liger {row['providers'].get('liger', {}).get('tbs', float('nan')):.3f}")
    print(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
