"""Norm kernels at M=16384 x N=8192 bf16 on the GPU: the forward's config neighbours and the
backward's variants (prefetch, warps, programs), each checked against the default's output and
timed with the copy ceiling in the same run. Rows as JSON in $OUT/norm_sweep.json.

    python scripts/gpu_norm_sweep.py
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.gpu_reductions import copy_ceiling, override  # noqa: E402
from tkit.kernels import norm as nk  # noqa: E402

ROWS = []


def bench(fn):
    try:
        fn()
        torch.cuda.synchronize()
        return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:200]}"


def main():
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    ceiling = copy_ceiling()
    print(f"copy ceiling {ceiling:.3f} TB/s")
    M, N = 16384, 8192
    bf = torch.bfloat16
    x = torch.randn(M, N, device="cuda", dtype=bf)
    r = torch.randn(M, N, device="cuda", dtype=bf)
    w = (1 + 0.1 * torch.randn(N, device="cuda")).to(bf)
    b = (0.1 * torch.randn(N, device="cuda")).to(bf)
    dy = torch.randn(M, N, device="cuda", dtype=bf)
    e = 2 * M * N
    fwd = {
        "rms_norm": (lambda: nk._norm_fwd_impl(x, w, None, None, 1e-6, True), 2 * e),
        "rms_norm_residual": (lambda: nk._norm_fwd_impl(x, w, None, r, 1e-6, True), 4 * e),
        "layer_norm": (lambda: nk._norm_fwd_impl(x, w, b, None, 1e-5, False), 2 * e),
    }
    for name, (fn, nbytes) in fwd.items():
        ref = fn()[0].float()
        for evict, warps, rows in itertools.product(("evict_first", ""), (4, 8, 16, 32),
                                                    (1, 2)):
            with override(norm_evict=evict, num_warps=warps, rows=rows):
                got = fn()[0].float()
                err = (got - ref).abs().max().item()
                ms = bench(fn)
            row = dict(op=name, dir="fwd", evict=evict, warps=warps, rows=rows, err=err)
            if isinstance(ms, str):
                row["error"] = ms
            else:
                row.update(ms=ms, tbs=nbytes / ms / 1e9, pct=100 * nbytes / ms / 1e9 / ceiling)
            ROWS.append(row)
            print(json.dumps(row))
    st_rms = nk._norm_fwd_impl(x, w, None, None, 1e-6, True, True)[2]
    st_ln = nk._norm_fwd_impl(x, w, b, None, 1e-5, False, True)[2]
    bwd = {
        "rms_norm": lambda: nk._norm_bwd_impl(x, w, dy, None, 1e-6, True, False, st_rms),
        "layer_norm": lambda: nk._norm_bwd_impl(x, w, dy, None, 1e-5, False, True, st_ln),
    }
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, fn in bwd.items():
        ref = [t.float() for t in fn()]
        for pf, warps, G in itertools.product((False, True), (16, 32), (sms, 2 * sms)):
            with override(norm_bwd_prefetch=pf, norm_bwd_warps=warps, norm_bwd_programs=G):
                got = fn()
                err = max((g.float() - t).abs().max().item() / max(t.abs().max().item(), 1e-6)
                          for g, t in zip(got, ref) if t.numel())
                ms = bench(fn)
            row = dict(op=name, dir="bwd", prefetch=pf, warps=warps, programs=G, rel_err=err)
            if isinstance(ms, str):
                row["error"] = ms
            else:
                nbytes = 3 * e
                row.update(ms=ms, tbs=nbytes / ms / 1e9, pct=100 * nbytes / ms / 1e9 / ceiling)
            ROWS.append(row)
            print(json.dumps(row))
    (out / "norm_sweep.json").write_text(json.dumps(dict(ceiling=ceiling, rows=ROWS), indent=1))


if __name__ == "__main__":
    main()
