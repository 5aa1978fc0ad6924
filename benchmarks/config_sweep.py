"""Sweep the typed launch configs of an op family at its headline bench cases, on the GPU.

    python benchmarks/config_sweep.py [quant rope sample matmul_fp8 ...]   # rows to $OUT

Each family's config is overridden through its scoped context (``quant_config``,
``rope_config``, ``sample_config``; for the fp8 GEMM a ``TmaConfig`` given to the launcher),
every variant is checked against the default's output (the same values, or the reference rule
for the GEMM), and timed with ``tkit.bench.timing.time_fn`` (median, L2 flushed) interleaved with
the default in rounds. The winners go into the families' ``for_device`` tables; the figures into
docs/NOTES.md. Output: a table on stdout and long-form rows in ``$OUT/config-sweep.jsonl``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tkit import registry  # noqa: E402
from tkit.bench.runner import environment  # noqa: E402
from tkit.bench.timing import time_fn  # noqa: E402

OUT = Path(os.environ.get("OUT", "out"))
ROUNDS = 2


def _headline(name, index=0):
    spec = registry.get(name)
    case = list(spec.bench_cases())[index]
    args, kwargs = case.make("cuda")
    return spec, case, args, kwargs


def _bytes(spec, args, kwargs):
    return spec.cost(*args, **kwargs).bytes


def _same(a, b):
    ta = a if isinstance(a, (tuple, list)) else (a,)
    tb = b if isinstance(b, (tuple, list)) else (b,)
    return all(torch.equal(x.view(torch.uint8) if x.dtype.itemsize == 1 else x,
                           y.view(torch.uint8) if y.dtype.itemsize == 1 else y)
               for x, y in zip(ta, tb) if isinstance(x, torch.Tensor))


def _close(a, b):
    """Within bf16 rounding of the default's output (a variant that splits K sums in another
    order)."""
    return all(torch.allclose(x.float(), y.float(), rtol=2e-2, atol=2e-2 * float(y.abs().max()))
               for x, y in zip(a if isinstance(a, (tuple, list)) else (a,),
                               b if isinstance(b, (tuple, list)) else (b,)))


def sweep(label, ctx, variants, name, index=0, rows=None, exact=True):
    spec, case, args, kwargs = _headline(name, index)
    nbytes = _bytes(spec, args, kwargs)
    want = spec.fn(*args, **kwargs)
    times = {}
    for r in range(ROUNDS):
        for v in [{}] + variants:
            with ctx(**v):
                got = spec.fn(*args, **kwargs)
                if r == 0 and v and not (_same if exact else _close)(got, want):
                    times[json.dumps(v)] = None
                    continue
                if times.get(json.dumps(v), 0) is None:
                    continue
                t = time_fn(lambda: spec.fn(*args, **kwargs), rep_ms=60).median_ms
            times.setdefault(json.dumps(v), []).append(t)
    base = min(times["{}"])
    for v, ts in times.items():
        if ts is None:
            print(f"{label:12s} {case.label:44s} {v:60s} DIFFERENT OUTPUT")
            continue
        t = min(ts)
        print(f"{label:12s} {case.label:44s} {v:60s} {t * 1e3:8.1f} us "
              f"{nbytes / t / 1e9:6.2f} TB/s {base / t:5.3f}x default")
        rows.append(dict(family=label, op=name, case=case.label, config=json.loads(v),
                         median_ms=t, tbps=nbytes / t / 1e9, vs_default=base / t))


def sweep_quant(rows):
    from tkit.kernels import quant as Q

    grid = [dict(tile=t, num_warps=w) for t, w in ((2048, 4), (4096, 4), (4096, 16),
                                                   (8192, 8), (8192, 16), (16384, 16))]
    grid += [dict(sub_group=512), dict(max_tile=8192)]
    for name, idx in (("quantize_fp8", 0), ("silu_mul_quant", 0)):
        sweep("quant", Q.quant_config, grid, name, idx, rows)


def sweep_rope(rows):
    from tkit.kernels import rope as RP

    grid = [dict(block_t=t, block_h=h, num_warps=w)
            for t, h, w in ((1, 8, 4), (2, 8, 4), (8, 8, 4), (4, 16, 4), (4, 8, 8), (4, 4, 2),
                            (8, 16, 8), (2, 16, 4))]
    sweep("rope", RP.rope_config, grid, "rope", 0, rows)
    sweep("rope", RP.rope_config, grid, "rope_append_kv", 0, rows)


def sweep_sample(rows):
    from tkit.kernels import sampling as SK

    grid = [dict(block=b, num_warps=w) for b, w in ((2048, 8), (4096, 8), (8192, 16),
                                                    (8192, 32), (16384, 32))]
    grid += [dict(pivots=p) for p in (2, 8)] + [dict(cap=128)]
    # the sampled ids depend on no config (the same seeds, the same token): compared exactly
    sweep("sample", SK.sample_config, grid, "sample", 0, rows)


def sweep_matmul_fp8(rows):
    from tkit.kernels.matmul import ops as MM
    from tkit.kernels.matmul.config import TmaConfig
    from tkit.testing.compare import assert_close_to_reference

    # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): BLOCK_K is also the interval at which the
    # fp8 MMA sums are promoted into the float32 accumulator (each promotion drains the MMAs)
    tiles = [(128, 256, 128, 8, 3), (128, 256, 256, 8, 2), (128, 128, 256, 8, 3),
             (128, 128, 256, 8, 4), (256, 128, 256, 8, 2), (128, 128, 128, 8, 4)]
    for n in (4096, 8192):
        g = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(n, n, device="cuda", generator=g).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device="cuda", generator=g).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")
        ref = a.float() @ b.float()
        peer = torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
        out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
        flops = 2 * n ** 3
        def peer_call(a=a, b=b, one=one):
            return torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
        t_peer = min(time_fn(peer_call).median_ms for _ in range(ROUNDS))
        print(f"matmul_fp8 {n}^3 torch._scaled_mm {t_peer * 1e3:8.1f} us "
              f"{flops / t_peer / 1e9:7.1f} TFLOP/s")
        rows.append(dict(family="matmul_fp8", case=f"{n}^3", config="torch._scaled_mm",
                         median_ms=t_peer, tflops=flops / t_peer / 1e9))
        for bm, bn, bk, w, s in tiles:
            cfg = TmaConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s)

            def run(a=a, b=b, out=out, one=one, cfg=cfg):
                MM._matmul_into(a, b, out, None, one, one, None, None, False, "tma", cfg)
            try:
                run()
                assert_close_to_reference(out, ref, peer, name="fp8 out")
                ok = "ok"
            except Exception as e:  # a config that does not fit or is wrong: say which
                print(f"matmul_fp8 {n}^3 {cfg} FAILED {type(e).__name__}: {str(e)[:120]}")
                continue
            t = min(time_fn(run).median_ms for _ in range(ROUNDS))
            print(f"matmul_fp8 {n}^3 {bm}x{bn}x{bk} w{w} s{s} {t * 1e3:8.1f} us "
                  f"{flops / t / 1e9:7.1f} TFLOP/s {t_peer / t:5.3f}x _scaled_mm {ok}")
            rows.append(dict(family="matmul_fp8", case=f"{n}^3",
                             config=dataclasses.asdict(cfg), median_ms=t,
                             tflops=flops / t / 1e9, vs_scaled_mm=t_peer / t))


def sweep_int4(rows):
    """matmul_int4 at the registry's 'decode' cases (M = 1 and 16 at K=4096, N=14336 and at
    K=N=8192): the GEMV kernel (CUDA cores) against the tensor-core tile kernel at both M,
    every field given (a variant does not inherit the other path's default)."""
    from tkit.kernels.matmul import int4 as I4

    def gemv(bn, bk, split, warps, fused=False):
        return dict(path="gemv", block_n=bn, block_k=bk, split_k=split, num_warps=warps,
                    num_stages=1, fused_reduce=fused)

    def tile(bn, split, warps, stages, bm=16):
        return dict(path="tile", block_m=bm, block_n=bn, block_k=128, split_k=split,
                    num_warps=warps, num_stages=stages)

    # GEMV: columns a program (128 x warps: 4 a thread, 256 x warps: 8), K step, K split,
    # the split's partials summed by the last program (one launch) or a second kernel
    gemvs = [gemv(256, 64, 16, 1), gemv(256, 64, 16, 1, True), gemv(256, 64, 8, 1, True),
             gemv(256, 64, 32, 1, True), gemv(128, 64, 16, 1, True), gemv(256, 32, 32, 1, True),
             gemv(256, 32, 16, 1, True), gemv(128, 32, 32, 1, True)]
    tiles = [tile(64, 2, 4, 3), tile(64, 4, 4, 3), tile(64, 2, 4, 4), tile(128, 2, 4, 3),
             tile(64, 8, 4, 3)]
    for idx in (0, 2):  # M = 1
        sweep("int4", I4.int4_config, gemvs + tiles[:1], "matmul_int4", idx, rows, exact=False)
    for idx in (1, 3):  # M = 16
        sweep("int4", I4.int4_config, tiles + [gemv(128, 16, 16, 1, True)],
              "matmul_int4", idx, rows, exact=False)


SWEEPS = {"int4": sweep_int4, "quant": sweep_quant, "rope": sweep_rope, "sample": sweep_sample,
          "matmul_fp8": sweep_matmul_fp8}


def main(argv):
    names = argv or list(SWEEPS)
    env = environment()
    rows: list[dict] = []
    for n in names:
        try:
            SWEEPS[n](rows)
        except Exception as e:  # one family's failure must not lose the others' rows
            print(f"{n}: {type(e).__name__}: {e}")
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "config-sweep.jsonl", "a") as f:
        for r in rows:
            f.write(json.dumps({**r, **env}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
