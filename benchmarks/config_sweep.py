"""Sweep the typed launch configs of an op family at its headline bench cases, on the GPU.

    python benchmarks/config_sweep.py [quant append decode_bar decode_fp8 decode_wg rope ...]

Each family's config is overridden through its scoped context (``quant_config``,
``rope_config``, ``sample_config``, ``append_config``, ``decode_config``; for the fp8 GEMM a
``TmaConfig`` given to the launcher), every variant is checked against the default's output
(the same values, or the reference rule for the GEMM), and timed with
``tkit.bench.timing.time_fn`` (median; small kernels replayed from a CUDA graph with the L2
flushed) interleaved with the default in rounds; quant and append by their own device work
instead (:func:`kernel_ms`), which leaves out the override's host path. The winners go
into the families' ``for_device`` tables; the figures into docs/NOTES.md. Output: a table on
stdout and long-form rows in ``$OUT/config-sweep.jsonl``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import tkit  # noqa: E402
from tkit import registry  # noqa: E402
from tkit.bench.runner import environment  # noqa: E402
from tkit.bench.timing import round_order, time_fn  # noqa: E402

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


def kernel_ms(fn):
    """Median device time of ``fn()``'s own work by ``time_fn``'s kernel timer: a spin and
    the read flush ahead of each run, then the span of the call's device records. That
    leaves out the host path (a scoped override's slow path: validation, no eager plan),
    which this machine's launch gaps make longer than kernels of 10-100 us, and the ~3.5 us
    the events add around a run."""
    return time_fn(fn, rep_ms=60, timer="kernels").median_ms


def _first_call(job):
    """One first call (its compiles fill Triton's cache) of a variant, in a child process."""
    ctx_module, ctx_name, name, index, v = job
    import importlib

    try:
        ctx = getattr(importlib.import_module(ctx_module), ctx_name)
        spec, case, args, kwargs = _headline(name, index)
        with ctx(**v):
            spec.fn(*args, **kwargs)
        torch.cuda.synchronize()
    except Exception as e:  # the sweep itself reports it
        return f"{json.dumps(v)}: {type(e).__name__}"
    return None


def warm(ctx, jobs, processes=8):
    """Compile the variants of ``jobs`` ((name, case index, variant) triples) in parallel
    child processes before a sweep times them one by one; ``ctx`` is the family's override
    context (a module-level function)."""
    _in_children(_first_call, [(ctx.__module__, ctx.__name__, n, i, v) for n, i, v in jobs],
                 processes)


def _in_children(first_call, work, processes=8):
    """``first_call(job)`` for every job of ``work`` in parallel spawned child processes (their
    compiles fill Triton's on-disk cache); each returns None or what failed, printed."""
    import concurrent.futures
    import multiprocessing

    mp = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=mp) as pool:
        for err in pool.map(first_call, work):
            if err:
                print(f"warm-up: {err}")


def sweep(label, ctx, variants, name, index=0, rows=None, exact=True, kernels=False,
          check=None, case=None):
    """``kernels``: time the call's device work (:func:`kernel_ms`) instead of the whole
    call replayed from a graph. ``check(v)``: a variant's own check (None when it passes,
    else what to print), instead of comparing its outputs with the default's (which compares
    an in-place op's inputs with themselves). ``case``: a spec ``Case`` to sweep instead of
    the op's bench case ``index``."""
    if case is None:
        spec, case, args, kwargs = _headline(name, index)
    else:
        spec = registry.get(name)
        args, kwargs = case.make("cuda")
    nbytes = _bytes(spec, args, kwargs)
    want = spec.fn(*args, **kwargs)
    times, failed = {}, {}
    for r in range(ROUNDS):
        for v in [{}] + variants:
            with ctx(**v):
                if times.get(json.dumps(v), 0) is None:
                    continue
                try:
                    got = spec.fn(*args, **kwargs)
                except Exception as e:  # a variant that does not compile or fit: say which
                    if not v:
                        raise
                    times[json.dumps(v)] = None
                    failed[json.dumps(v)] = f"FAILED {type(e).__name__}: {str(e)[:120]}"
                    continue
                if r == 0 and v and check is not None:
                    bad = check(v)
                    if bad:
                        times[json.dumps(v)] = None
                        failed[json.dumps(v)] = bad
                        continue
                elif r == 0 and v and not (_same if exact else _close)(got, want):
                    times[json.dumps(v)] = None
                    continue
                if kernels:
                    t = kernel_ms(lambda: spec.fn(*args, **kwargs))
                else:
                    # replayed from a CUDA graph, L2 flushed: the kernels' time (a variant's
                    # call skips the eager plans; its host path would outlast a small kernel)
                    t = time_fn(lambda: spec.fn(*args, **kwargs), rep_ms=60,
                                replay=True).median_ms
            times.setdefault(json.dumps(v), []).append(t)
    base = min(times["{}"])
    for v, ts in times.items():
        if ts is None:
            print(f"{label:12s} {case.label:44s} {v:60s} "
                  f"{failed.get(v, 'DIFFERENT OUTPUT')}")
            continue
        t = min(ts)
        print(f"{label:12s} {case.label:44s} {v:60s} {t * 1e3:8.1f} us "
              f"{nbytes / t / 1e9:6.2f} TB/s {base / t:5.3f}x default")
        rows.append(dict(family=label, op=name, case=case.label, config=json.loads(v),
                         median_ms=t, tbps=nbytes / t / 1e9, vs_default=base / t))


def sweep_quant(rows):
    from tkit.kernels import quant as Q

    # quantize_fp8 at K = 4096: the default is one row a program, 8 warps (16 values a
    # thread); more rows or fewer warps put more bytes in flight per thread and amortize the
    # row's reductions; 1x128 (no row statistic) can also split a row over grid axis 1
    # (max_tile), rows packed per program by tile
    rowish = [dict(num_warps=w) for w in (4, 16)]
    rowish += [dict(tile=t, num_warps=w) for t, w in ((8192, 16), (8192, 8), (16384, 16),
                                                      (16384, 8))]
    split = [dict(max_tile=m, tile=t, num_warps=w) for m, t, w in ((2048, 4096, 4),
                                                                   (2048, 8192, 8),
                                                                   (1024, 4096, 4))]
    for idx in (0, 2):  # 16384 x 4096 / 14336, per token
        sweep("quant", Q.quant_config, rowish, "quantize_fp8", idx, rows, kernels=True)
    for idx in (1, 3):  # 16384 x 4096 / 14336, 1x128
        sweep("quant", Q.quant_config, rowish + split, "quantize_fp8", idx, rows, kernels=True)
    # silu_mul_quant at K = 14336 pads the row to 16384 (128 groups of 128 for 112) in one
    # tile at 16 warps (32 values of each input a thread); 1x128 needs no row pass, and
    # max_tile = 2048 walks 7 unpadded chunks on grid axis 1
    silu_row = [dict(num_warps=8), dict(num_warps=32), dict(sub_group=256),
                dict(sub_group=512, num_warps=8)]
    silu_grp = [dict(max_tile=m, tile=t, num_warps=w)
                for m, t, w in ((2048, 2048, 4), (2048, 4096, 8), (2048, 8192, 8),
                                (2048, 8192, 16), (1024, 4096, 8), (4096, 4096, 8))]
    silu_grp += [dict(num_warps=8)]
    sweep("quant", Q.quant_config, silu_row, "silu_mul_quant", 0, rows, kernels=True)
    for idx in (1, 2):  # 1x128, separate tensors and the chunked [gate | up] views
        sweep("quant", Q.quant_config, silu_grp, "silu_mul_quant", idx, rows, kernels=True)


def sweep_append(rows):
    from tkit.kernels import decode as DK

    # tokens a program x warps; (1, 4) was the kernel before block_t (one token a program)
    grid = [dict(block_t=t, num_warps=w) for t, w in ((1, 4), (2, 4), (4, 2), (4, 8), (8, 4),
                                                      (8, 8), (16, 8), (16, 4), (2, 2))]
    for idx in (0, 1):  # bf16 cache, fp8 cache with per-token scales
        sweep("append", DK.append_config, grid, "append_kv", idx, rows,
              kernels=True)


def sweep_losses(rows):
    """Cross-entropy's training step (loss and gradient) at N8192 V128256 bf16: chunk width,
    warps and programs an SM (the rows in flight between a row's two passes); the fused LM
    head + loss at N8192 H4096 V128256 by rows a chunk."""
    from tkit.kernels import losses as L

    grid = [dict(block_v=b, num_warps=w, programs_per_sm=p)
            for b, w, p in ((4096, 8, 1), (4096, 8, 4), (4096, 8, 64), (4096, 16, 1),
                            (4096, 16, 2), (8192, 16, 1), (8192, 16, 2), (8192, 32, 1),
                            (16384, 32, 1), (2048, 4, 4), (2048, 8, 2), (4096, 4, 2))]
    sweep("losses", L.loss_config, grid, "cross_entropy", 0, rows, exact=False, kernels=True)
    sweep("losses", L.loss_config, [dict(fused_chunk_rows=r) for r in (256, 512, 2048, 4096)],
          "fused_linear_cross_entropy", 0, rows, exact=False, kernels=True)


#: rope at 16384 tokens x (32 + 8) x 128 bf16, in place and with the page-16 cache write:
#: the default (1 token x 8 heads, 4 warps; in place it replaced 2 tokens x 16 heads) against
#: its neighbours
ROPE_VARIANTS = [
    dict(block_t=2, block_h=16),
    dict(block_t=1, block_h=16),
    dict(block_t=1, block_h=4),
    dict(block_t=2, block_h=8),
]


def _fresh(args, kwargs):
    """Copies of a case's tensors (an in-place op's inputs are its outputs)."""
    def c(x):
        return x.clone() if isinstance(x, torch.Tensor) else x
    return [c(a) for a in args], {k: c(v) for k, v in kwargs.items()}


def _rope_checker(ctx, name, index=0):
    """check(v) for :func:`sweep`: the variant's outputs on fresh copies of the inputs against
    the default's, bit for bit (the rotation's roundings are spelled out in the kernel)."""
    spec, _case, args, kwargs = _headline(name, index)

    def run(v):
        a, kw = _fresh(args, kwargs)
        with ctx(**v):
            out = spec.fn(*a, **kw)
        torch.cuda.synchronize()
        return out

    want = run({})

    def check(v):
        try:
            got = run(v)
        except Exception as e:  # the sweep's own call reports it
            return f"FAILED {type(e).__name__}: {str(e)[:120]}"
        if _same(got, want):
            return None
        worst = max(float((x.float() - y.float()).abs().max()) for x, y in zip(got, want)
                    if isinstance(x, torch.Tensor))
        return f"DIFFERENT OUTPUT (max |diff| {worst:.3g})"

    return check


def _rope_ceilings(rows):
    """What the same bytes cost without rope, in the same process: q and k copied out of
    place and negated in place (torch), beside torch.compile of the reference (the bar's
    baseline) and tkit's default; L2 flushed before each run, graph replays but for
    torch.compile (timed as ``tkit bench`` times it)."""
    spec, case, args, kwargs = _headline("rope", 0)
    q, k = args
    qk_bytes = 2 * (q.numel() + k.numel()) * q.element_size()
    q2, k2 = torch.empty_like(q), torch.empty_like(k)
    compiled = spec.baselines["torch.compile"]()
    # the first half of the tokens: 2 * t(half) - t(all) is what a call pays whatever its size
    # (launch, ramp, tail), the rest its steady rate
    n = q.shape[0] // 2
    half = dict(kwargs, positions=kwargs["positions"][:n])
    q_h, k_h, q2_h, k2_h = q[:n], k[:n], q2[:n], k2[:n]
    probes = {"tkit.rope default": (lambda: spec.fn(*args, **kwargs), _bytes(spec, args, kwargs)),
              "torch.compile(reference)": (lambda: compiled(*args, **kwargs),
                                           _bytes(spec, args, kwargs)),
              "copy_ q, k (torch)": (lambda: (q2.copy_(q), k2.copy_(k)), qk_bytes),
              "neg_ q, k in place (torch)": (lambda: (q.neg_(), k.neg_()), qk_bytes),
              "tkit.rope default, half the tokens": (lambda: spec.fn(q_h, k_h, **half),
                                                     _bytes(spec, (q_h, k_h), half)),
              "copy_ q, k, half the tokens": (lambda: (q2_h.copy_(q_h), k2_h.copy_(k_h)),
                                              qk_bytes // 2)}
    times: dict[str, list] = {}
    for _ in range(ROUNDS):
        for name, (fn, _b) in probes.items():
            try:
                # torch.compile's call as `tkit bench` times it (not captured in a graph; the
                # spin ahead of each run hides its host path)
                t = time_fn(fn, rep_ms=60, replay=not name.startswith("torch.compile")).median_ms
            except Exception as e:
                print(f"rope-probe   {name:44s} FAILED {type(e).__name__}: {str(e)[:100]}")
                t = None
            times.setdefault(name, []).append(t)
    base = min(t for t in times["tkit.rope default"] if t)
    for name, ts in times.items():
        ts = [t for t in ts if t]
        if not ts:
            continue
        t, nbytes = min(ts), probes[name][1]
        print(f"rope-probe   {case.label:44s} {name:36s} {t * 1e3:8.1f} us "
              f"{nbytes / t / 1e9:6.2f} TB/s {t / base:5.3f}x tkit's time")
        rows.append(dict(family="rope-probe", op=name, case=case.label, config={},
                         median_ms=t, tbps=nbytes / t / 1e9, vs_default=base / t))
    for full, part in (("tkit.rope default", "tkit.rope default, half the tokens"),
                       ("copy_ q, k (torch)", "copy_ q, k, half the tokens")):
        tf = min(t for t in times[full] if t) if any(times[full]) else None
        th = min(t for t in times[part] if t) if any(times[part]) else None
        if tf and th:
            fixed = 2 * th - tf
            print(f"rope-probe   {full:36s} fixed {fixed * 1e3:6.1f} us, steady "
                  f"{probes[full][1] / (tf - fixed) / 1e9:6.2f} TB/s")


def sweep_rope(rows):
    from tkit.kernels import rope as RP

    warm(RP.rope_config, [(n, 0, v) for n in ("rope", "rope_append_kv") for v in ROPE_VARIANTS])
    _rope_ceilings(rows)
    for name in ("rope", "rope_append_kv"):
        sweep("rope", RP.rope_config, ROPE_VARIANTS, name, 0, rows,
              check=_rope_checker(RP.rope_config, name))


def sweep_fuse(rows):
    from tkit.fuse import fuse_config

    # the generated kernels' warps (values a thread) and column blocks, at the spec's three
    # programs (RMSNorm and the scaled softmax hold rows; the GeGLU gate walks blocks)
    grid = [dict(values_per_thread=v) for v in (4, 16, 32, 64)] + [dict(max_warps=8)]
    grid += [dict(block_cols=b) for b in (2048, 4096)]
    for index in range(3):
        sweep("fuse", fuse_config, grid, "fuse", index, rows, exact=False)


def sweep_sample(rows):
    from tkit.kernels import sampling as SK

    # the split-row path (top_k given: chunk programs, then a merge per row) against the
    # one-program-per-row path, and the split path's chunk, warps, pivots and merge warps
    grid = [dict(split=False)]
    grid += [dict(split_block=b, split_warps=w) for b, w in ((4096, 4), (4096, 8), (8192, 4),
                                                             (8192, 16), (16384, 16))]
    grid += [dict(split_pivots=p) for p in (8, 16)] + [dict(merge_warps=8)]
    grid += [dict(cap=128)]
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


#: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, programs an SM) of the block-scaled fp8 kernel;
#: BLOCK_K 256 is two scale groups a step, the one-warpgroup tiles (4 warps) fit two programs
#: an SM (registers and shared memory), so that one's promotion can overlap the other's MMAs
FP8_BLOCK_TILES = [(128, 128, 256, 8, 3, 1), (128, 128, 128, 8, 4, 1), (128, 128, 128, 8, 3, 1),
                   (64, 128, 128, 4, 4, 2), (64, 128, 128, 4, 3, 2), (64, 128, 256, 4, 2, 2),
                   (128, 64, 128, 4, 4, 2), (64, 128, 128, 4, 4, 1), (128, 256, 128, 8, 3, 1)]


def _block_operands(M, N, K, seed=0):
    """DeepSeek-V3's block-scaled operands: a (M, K) fp8 with per-1x128 scales, b = w.t() of
    an (N, K) fp8 weight with per-128x128 scales."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(M, K, device="cuda", generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(N, K, device="cuda", generator=g).to(torch.float8_e4m3fn).t()
    kb, nb = -(-K // 128), -(-N // 128)
    sa = torch.rand(M, kb, device="cuda", generator=g) + 0.5
    sb = (torch.rand(kb, nb, device="cuda", generator=g) + 0.5) * K ** -0.5
    return a, b, sa, sb


def _block_reference(a, b, sa, sb, rows):
    """float64 reference on the dequantized operands for the given rows of the output, and
    the peer: the same rows in float32 (no TF32) rounded to bfloat16."""
    K = a.shape[1]
    cols = torch.arange(b.shape[1], device="cuda") // 128
    ks = torch.arange(K, device="cuda") // 128
    a_dq = a[rows].double() * sa[rows][:, ks].double()
    b_dq = b.double() * sb.double()[ks][:, cols]
    ref = a_dq @ b_dq
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    peer = (a_dq.float() @ b_dq.float()).to(torch.bfloat16)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    return ref, peer


#: the Gluon Hopper kernel's variants (HopperBlockConfig fields; {} is its default: 5 ring
#: slots, block_n by resolve(), group_m 8). Measured (H200, TFLOP/s at 8192^3 / DeepSeek-V3
#: gate_up M=4096, docs/NOTES.md has the rest): before consumer 1's lead group, 5 slots
#: 1168 / 1170 and 1100 / 1145 in two runs, with it 1155 / 1178; 6 slots 1132 / 1149; 4 slots
#: 1144 / 1184; the final build (third run): 5 slots 1163 / 1170, 4 1144 / 1193, 6 1149 / 1171,
#: group_m 16 1144 / 1189.
FP8_BLOCK_GLUON = [{}, dict(stages=4), dict(stages=6), dict(group_m=16)]
#: DeepSeek-V3's (N, K) of its dense and expert GEMMs (DeepGEMM's test table): q_a + kv_a
#: (2112 x 7168), q_b (24576 x 1536), kv_b (32768 x 512), o_proj (7168 x 16384), expert
#: gate_up (4096 x 7168) and down (7168 x 2048)
DSV3_NK = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168),
           (7168, 2048)]
DSV3_M = [64, 128, 256, 1024, 4096]


def _fp8_block_case(rows, M, N, K, label, variants, peer_rounds=ROUNDS, time_failed=False,
                    rounds=ROUNDS):
    """One shape: torch._scaled_mm per tensor, then each (name, run) variant checked against
    the float64 reference on the dequantized operands (256 rows spread over M, all of N and
    K; the rule's peer the same rows in float32 rounded to bf16) and timed. ``time_failed``:
    a variant outside the rule is timed too (its error and the rule's bound printed), so a
    schedule's speed and its accuracy are both seen."""
    from tkit.testing.compare import ReferenceMismatch, assert_close_to_reference

    a, b, sa, sb = _block_operands(M, N, K)
    one = torch.ones((), device="cuda")
    flops = 2 * M * N * K
    sel = torch.arange(0, M, max(1, M // 256), device="cuda")
    ref, peer = _block_reference(a, b, sa, sb, sel)

    def peer_call(a=a, b=b, one=one):
        return torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
    t_peer = min(time_fn(peer_call).median_ms for _ in range(peer_rounds))
    print(f"matmul_fp8_block {label} torch._scaled_mm (per tensor) {t_peer * 1e3:8.1f} us "
          f"{flops / t_peer / 1e9:7.1f} TFLOP/s")
    rows.append(dict(family="matmul_fp8_block", case=label, config="torch._scaled_mm",
                     median_ms=t_peer, tflops=flops / t_peer / 1e9))
    for name, config, make in variants:
        verdict, stats = "ok", {}
        try:
            run = make(a, b, sa, sb)
            out = run()
            stats = assert_close_to_reference(out[sel], ref, peer, name="fp8 block out")
            verdict = f"ok (err/bound {stats['error'] / stats['bound']:.2f})"
        except ReferenceMismatch as e:
            if not time_failed:
                print(f"matmul_fp8_block {label} {name} FAILED {str(e)[:200]}")
                continue
            verdict = f"RULE FAILED: {str(e)[15:125]}"
        except Exception as e:  # a config that does not fit or is wrong: say which
            print(f"matmul_fp8_block {label} {name} FAILED {type(e).__name__}: "
                  f"{str(e)[:160]}")
            continue
        t = min(time_fn(run).median_ms for _ in range(rounds))
        print(f"matmul_fp8_block {label} {name:34s} {t * 1e3:8.1f} us "
              f"{flops / t / 1e9:7.1f} TFLOP/s {t_peer / t:5.3f}x _scaled_mm {verdict}")
        rows.append(dict(family="matmul_fp8_block", case=label, config=config, median_ms=t,
                         tflops=flops / t / 1e9, vs_scaled_mm=t_peer / t,
                         rule_ok=verdict.startswith("ok"), **stats))


def _fp8_block_triton(cfg):
    """The Triton kernels: ``cfg`` a TmaConfig, or None for the kernel and config that
    matmul's plan picks (the block mode's dispatch before the Gluon kernel)."""
    from tkit.kernels.matmul import config as MC
    from tkit.kernels.matmul import fp8_block as FB

    def make(a, b, sa, sb):
        path = "tma" if cfg is not None else MC.plan(a, b, torch.bfloat16).path
        return lambda: FB._fp8_block_impl(a, b, sa, sb, out_dtype=torch.bfloat16, path=path,
                                          config=cfg)
    return make


def _fp8_block_gluon(fields):
    from tkit.kernels.matmul import fp8_block as FB
    from tkit.kernels.matmul import fp8_block_hopper as FH

    cfg = FH.HopperBlockConfig(**fields)

    def make(a, b, sa, sb):
        return lambda: FB._fp8_block_impl(a, b, sa, sb, out_dtype=torch.bfloat16,
                                          path="gluon", config=cfg)
    return make


def sweep_matmul_fp8_block(rows):
    """The block-scaled fp8 GEMM (1x128 / 128x128 scales) at 8192^3 and DeepSeek-V3's expert
    gate_up at M = 4096: the Gluon Hopper kernel's variants and the Triton TMA kernel's
    tiles, each checked against the float64 reference on the dequantized operands and timed
    against torch._scaled_mm per tensor (torch has no block-scaled one on sm_90) in the same
    run."""
    from tkit.kernels.matmul.config import TmaConfig

    variants = _fp8_block_variants("gluon", FP8_BLOCK_GLUON)
    variants.append(("triton default", "triton default", _fp8_block_triton(None)))
    for bm, bn, bk, w, s, p in FP8_BLOCK_TILES:
        cfg = TmaConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s,
                        programs_per_sm=p)
        variants.append((f"triton {bm}x{bn}x{bk} w{w} s{s} p{p}", dataclasses.asdict(cfg),
                         _fp8_block_triton(cfg)))
    for M, N, K, label in ((8192, 8192, 8192, "8192^3 block"),
                           (4096, 4096, 7168, "DeepSeek-V3 gate_up M=4096")):
        _fp8_block_case(rows, M, N, K, label, variants)


def sweep_matmul_fp8_block_dsv3(rows):
    """DeepSeek-V3's GEMM shapes (DSV3_NK at M in DSV3_M), block-scaled: the Gluon kernel at
    its default (block_n chosen from the tile count), the CUDA kernel (forced, also where its
    tiles do not fill the SMs) and what the dispatch picks, against torch._scaled_mm per
    tensor in the same run (the Gluon kernel's block_n choices and the Triton kernels were
    measured at these shapes before: docs/NOTES.md)."""
    variants = [("gluon default", dict(kernel="gluon"), _fp8_block_gluon({}))]
    variants.append(("cuda (forced)", dict(kernel="cuda"), _fp8_block_cuda({})))
    variants.append(("cuda whole tiles", dict(kernel="cuda", stream_k=False),
                     _fp8_block_cuda(dict(stream_k=False))))
    variants.append(("dispatch", "dispatch", _fp8_block_dispatch))
    for N, K in DSV3_NK:
        for M in DSV3_M:
            _fp8_block_case(rows, M, N, K, f"DeepSeek-V3 M={M} N={N} K={K}", variants)


#: the Gluon kernel at DeepSeek-V3's decode-sized M (H200, x _scaled_mm per tensor;
#: docs/NOTES.md): deeper rings at 64 columns (6 or 8 slots against
#: 5) within the runs' noise but at M=64 N=7168 K=2048 (0.74-0.78 against 0.70-0.72); 128
#: columns at 6 slots ahead at M=64 N=7168 (K=16384: 0.61-0.63 against 0.47; K=2048:
#: 0.77-0.80 against 0.70-0.72) and behind at M=128 N=7168 and every N=4096 / 2112 row;
#: the scales loaded two steps ahead instead of one (a knob, removed): no change; K split in
#: 2-8 parts inside the launch (a workspace, the last part adding them up; removed): slower
#: at every split row (M=64 N=4096 K=7168: 29.9 us against 22.2 unsplit); each tile's K
#: groups started at an offset spread over K (rotate_k; removed): 1-15% slower everywhere;
#: the scales' product taken at the promotion and, at 64 columns, steps two at a time with
#: two scale register sets (removed): 1-8% slower at the 64-column rows.
FP8_BLOCK_SMALL_M = [dict(block_n=64, stages=8), dict(block_n=128, stages=8)]


def sweep_matmul_fp8_block_small_m(rows):
    """DeepSeek-V3's GEMM shapes at M = 64 / 128 / 256, block-scaled: the Gluon kernel's
    default beside deeper rings (FP8_BLOCK_SMALL_M), against torch._scaled_mm per tensor in
    the same run."""
    variants = _fp8_block_variants("gluon", [{}] + FP8_BLOCK_SMALL_M)
    for N, K in DSV3_NK:
        for M in (64, 128, 256):
            _fp8_block_case(rows, M, N, K, f"DeepSeek-V3 M={M} N={N} K={K}", variants)


#: the rescale schedule's variants (HopperBlockConfig fields; opt-in, fast-accumulation
#: numerics: one accumulator across K, rescaled between groups, 128 x 256 tiles; pingpong and
#: group_m 16 are what schedule="rescale" takes by itself) against the default (the promote
#: schedule at 128 columns) in the same run. Measured (H200, TFLOP/s at 8192^3 / DeepSeek-V3
#: gate_up M=4096, _scaled_mm per tensor 1466 / 1422; the default 1162 / 1194): pingpong
#: 1281 / 1315, with group_m 16 1345 / 1314, without pingpong 1272 / 1291, 2 stages
#: 1175 / 1179; 128 columns 1082 / 1096, with pingpong 1128 / 1101 (behind the promote
#: schedule: removed).
FP8_BLOCK_RESCALE = [dict(schedule="rescale"), dict(schedule="rescale", pingpong=False)]


def _fp8_chain_numerics(rows, M=2048, N=2048, K=8192):
    """The rescale schedule's numerics: with unit scales it is one fp8 MMA chain over K, as
    torch._scaled_mm with use_fast_accum=True; max errors of float32 outputs against float64,
    relative to max |ref|, beside the promote schedule's and cuBLAS's without fast accum."""
    from tkit.kernels.matmul import fp8_block as FB
    from tkit.kernels.matmul import fp8_block_hopper as FH

    one = torch.ones((), device="cuda")
    a, b, _, _ = _block_operands(M, N, K, seed=K)
    sa = torch.ones(M, K // 128, device="cuda")
    sb = torch.ones(K // 128, N // 128, device="cuda")
    ref = a.double() @ b.double()
    top = float(ref.abs().max())

    def gluon(**fields):
        return FB._fp8_block_impl(a, b, sa, sb, out_dtype=torch.float32, path="gluon",
                                  config=FH.HopperBlockConfig(**fields))
    outs = {"rescale": gluon(schedule="rescale", block_n=256),
            "_scaled_mm fast accum": torch._scaled_mm(a, b, one, one, out_dtype=torch.float32,
                                                      use_fast_accum=True),
            "promote": gluon(block_n=128),
            "_scaled_mm": torch._scaled_mm(a, b, one, one, out_dtype=torch.float32)}
    errs = {k: float((v.double() - ref).abs().max()) / top for k, v in outs.items()}
    print(f"matmul_fp8_block numerics {M}x{N}x{K} unit scales, float32 out, max error / "
          f"max|ref|: " + ", ".join(f"{k} {e:.2e}" for k, e in errs.items()))
    rows.append(dict(family="matmul_fp8_block", case=f"numerics {M}x{N}x{K}",
                     config="unit scales", **errs))


def sweep_matmul_fp8_block_rescale_shared(rows):
    """The rescale schedule with one output staging tile for both consumers (``shared_out``:
    4 ring slots fit at 256 columns, each TMA store waited for before the tile is handed on)
    against it without (3 slots), at 8192^3 and DeepSeek-V3's expert gate_up at M = 4096."""
    variants = _fp8_block_variants("gluon", [dict(schedule="rescale"),
                                             dict(schedule="rescale", shared_out=True)])
    for M, N, K, label in ((8192, 8192, 8192, "8192^3 block"),
                           (4096, 4096, 7168, "DeepSeek-V3 gate_up M=4096")):
        _fp8_block_case(rows, M, N, K, label, variants, peer_rounds=1, time_failed=True)


def sweep_matmul_fp8_block_rescale(rows):
    """The block-scaled fp8 GEMM's opt-in rescale schedule (FP8_BLOCK_RESCALE) against the
    Gluon kernel's default (the promote schedule) at 8192^3 and DeepSeek-V3's expert gate_up
    at M = 4096, with torch._scaled_mm per tensor in the same run; every variant is timed and
    its error against the reference rule printed (the rescale schedule keeps a running sum
    inside the fp8 MMA over all of K, which the promote schedule avoids:
    :func:`_fp8_chain_numerics` first)."""
    try:
        _fp8_chain_numerics(rows)
    except Exception as e:  # the timings below must not be lost to it
        print(f"matmul_fp8_block numerics FAILED {type(e).__name__}: {str(e)[:200]}")
    variants = _fp8_block_variants("gluon", [{}] + FP8_BLOCK_RESCALE)
    for M, N, K, label in ((8192, 8192, 8192, "8192^3 block"),
                           (4096, 4096, 7168, "DeepSeek-V3 gate_up M=4096")):
        _fp8_block_case(rows, M, N, K, label, variants, time_failed=True)


def _fp8_block_dispatch(a, b, sa, sb):
    """What an unforced tkit.matmul_fp8 call with these block scales launches."""
    return lambda: tkit.matmul_fp8(a, b, sa, sb)


def _fp8_block_variants(kernel, builds):
    """(name, config, make) for each build (a dict of knobs) of the Gluon or CUDA kernel,
    named "<kernel> k=v ..." ("<kernel> default" for {})."""
    make = {"gluon": _fp8_block_gluon, "cuda": _fp8_block_cuda}[kernel]
    return [(f"{kernel} " + (" ".join(f"{k}={v}" for k, v in f.items()) or "default"),
             dict(kernel=kernel, **f), make(f)) for f in builds]


def _fp8_block_cuda(fields):
    """The CUDA kernel (csrc/gemm_fp8_block_sm90.cu) with these build knobs."""
    from tkit.cuda_ext.gemm_fp8_block import matmul_fp8_block

    def make(a, b, sa, sb):
        return lambda: matmul_fp8_block(a, b, sa, sb, torch.bfloat16, **fields)
    return make


#: the CUDA kernel's builds (gemm_fp8_block's knobs; {} is its default: 4 ring slots, the
#: epilogue in two parts, group_m 16). Measured (H200, x _scaled_mm per tensor at 8192^3 /
#: DeepSeek-V3 gate_up M=4096, docs/NOTES.md): the default since its loop was shortened
#: (descriptors made once in uniform registers) 0.869-0.889 / 0.958; before that 0.790-0.819
#: / 0.859-0.876, with 3 slots and one epilogue part 0.781 / 0.866, group_m 8 0.762 / 0.856,
#: 3 slots 0.811 / 0.879; the removed tile shapes, CTA pairs, consumer turns, the 192-column
#: one-sum tile, consumer 1 started a sum or a group behind and the 144-column tile with two
#: sums in flight 0.69-0.81 / 0.69-0.87 (against the longer loop); the group loop unrolled
#: over the ring's slots 0.853-0.878 / 0.952-0.961 against the default's 0.889-0.902 /
#: 0.986-0.988. Launch knob stream_k (a last wave split by groups; the default only where
#: that wave is at most a quarter full), forced on / off in alternating rounds at last waves
#: 18% to 94% full: 0.82 / 0.73 at 18% (M=4096 N=2112 K=7168), even at 52% and 73%, behind
#: at 70% (0.78 / 0.89) and 94% (0.89 / 0.97); in another run 0.90 / 0.92 at 27% (M=4096
#: N=24576 K=1536).
FP8_BLOCK_CUDA = [dict(stream_k=True), dict(stream_k=False)] * 3


def sweep_matmul_fp8_block_cuda(rows):
    """The block-scaled fp8 GEMM in CUDA (128 x 256 tiles, the promote schedule by half
    sums; its builds and launch knobs FP8_BLOCK_CUDA) at shapes whose last wave of tiles is
    18% to 94% full on 132 SMs (8192^3, DeepSeek-V3's M=4096 N=2112 K=7168 and M=1024
    N=7168 K=2048, M=4608 N=8192 K=8192, M=2048 N=4096 K=8192), with torch._scaled_mm per
    tensor in the same run."""
    variants = _fp8_block_variants("cuda", FP8_BLOCK_CUDA)
    for M, N, K, label in ((8192, 8192, 8192, "8192^3 block"),
                           (4096, 2112, 7168, "DeepSeek-V3 M=4096 N=2112 K=7168"),
                           (1024, 7168, 2048, "DeepSeek-V3 M=1024 N=7168 K=2048"),
                           (4608, 8192, 8192, "M=4608 N=8192 K=8192"),
                           (2048, 4096, 8192, "M=2048 N=4096 K=8192")):
        _fp8_block_case(rows, M, N, K, label, variants, time_failed=True)


def _int4_variants():
    def gemv(bn, bk, split, warps, lanes=1, vecs=1):
        return dict(path="gemv", block_m=16, block_n=bn, block_k=bk, split_k=split,
                    num_warps=warps, num_stages=1, fused_reduce=False, k_lanes=lanes,
                    n_vecs=vecs)

    def tc(bn, warps, stages, split, bm=16):
        return dict(path="tc", block_m=bm, block_n=bn, block_k=128, split_k=split,
                    num_warps=warps, num_stages=stages, q_tma=True)

    def tile(bm, split):
        return dict(path="tile", block_m=bm, block_n=64, block_k=128, split_k=split,
                    num_warps=4, num_stages=3)

    return gemv, tc, tile


def sweep_int4(rows):
    """matmul_int4 at the registry's 'decode' cases (M = 1 and 16 at K=4096, N=14336 and at
    K=N=8192). M = 1: the default (the GEMV with K lanes: 32 columns a program, all of K, 4 or
    8 warps by N) against the GEMV without lanes (one warp a program, split 16 + the reduce
    launch, the default before) and the lanes with the other warp count; the CUDA kernel.
    M = 16: the default (the CUDA kernel) against its other ring depths and the tc kernel.
    Every field given (a variant does not inherit the other paths' defaults)."""
    from tkit.kernels.matmul import int4 as I4

    gemv, tc, _ = _int4_variants()
    m1 = [gemv(128, 64, 16, 1), gemv(32, 32, 1, 4, lanes=32, vecs=2),
          gemv(32, 32, 1, 8, lanes=64, vecs=2),
          # more programs an SM: K split 2 merged in the kernel, or 16 columns on 2 warps
          dict(gemv(32, 32, 2, 4, lanes=32, vecs=2), fused_reduce=True),
          gemv(16, 32, 1, 2, lanes=32, vecs=2)]
    # the CUDA kernel (tkit.cuda_ext.gemm_int4) with its ring's slots; and the tc kernel
    cuda = [dict(path="cuda", num_stages=st) for st in (2, 3, 4)]
    m1 = m1 + cuda
    m16 = cuda + [tc(128, 4, 4, 8), tc(128, 4, 3, 4), tc(128, 4, 6, 4)]
    for idx in (0, 2):  # M = 1
        sweep("int4", I4.int4_config, m1, "matmul_int4", idx, rows, exact=False)
    for idx in (1, 3):  # M = 16
        sweep("int4", I4.int4_config, m16, "matmul_int4", idx, rows, exact=False)


def sweep_int4_gemv(rows):
    """The M=1 GEMV's variants at K=4096 N=14336 and K=N=8192 (group 128), by both timers
    (graph replays, L2 read-flushed, min of 3 interleaved rounds' medians): the default (4
    warps, 32-deep chunks; 32 columns a program at N=14336, 16 at N=8192) against the other
    column tile and 32 columns on 8 warps; cuBLAS bf16 beside them. Each variant's output
    checked against a float64 product."""
    import torch.nn.functional as F

    from tkit.kernels.matmul import int4 as I4

    gemv, _, _ = _int4_variants()
    for K, N in ((4096, 14336), (8192, 8192)):
        g = torch.Generator(device="cuda").manual_seed(K + N)
        a = torch.randn(1, K, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * K ** -0.5
        q, s, z = tkit.quantize_int4(w, 128)
        wd = tkit.dequantize_int4(q, s, z, group_size=128, dtype=torch.float64)
        want = a.double() @ wd.t()
        tol = 1e-2 * float(want.abs().max())
        other = 32 if I4.Int4Config.for_shape(1, N, K, 128).block_n == 16 else 16
        variants = {"default": {},
                    f"{other} columns, 4 warps": gemv(other, 32, 1, 4, lanes=32,
                                                      vecs=other // 16),
                    "32 columns, 8 warps": gemv(32, 32, 1, 8, lanes=64, vecs=2)}
        times = {}
        for _ in range(3):
            for name, v in variants.items():
                with I4.int4_config(**v):
                    got = tkit.matmul_int4(a, q, s, z, group_size=128)
                    err = float((got.double() - want).abs().max())
                    for timer in ("events", "kernels"):
                        t = time_fn(lambda a=a, q=q, s=s, z=z: tkit.matmul_int4(
                            a, q, s, z, group_size=128), replay=True, rep_ms=60,
                            timer=timer).median_ms
                        key = (name, timer)
                        times[key] = (min(t, times.get(key, (t, 0))[0]), err)
        for timer in ("events", "kernels"):
            tc = min(time_fn(lambda a=a, w=w: F.linear(a, w), replay=True, rep_ms=60,
                             timer=timer).median_ms for _ in range(3))
            base = times[("default", timer)][0]
            for name in variants:
                t, err = times[(name, timer)]
                bad = "" if err <= tol else f" WRONG (max |err| {err:.3g} > {tol:.3g})"
                print(f"int4_gemv K={K} N={N} {timer:7s} {name:28s} {t * 1e3:7.2f} us "
                      f"{t / base:5.3f}x default's time, {tc / t:5.2f}x cuBLAS bf16{bad}")
                rows.append(dict(family="int4_gemv", op="matmul_int4",
                                 case=f"M=1 K={K} N={N} g128", provider=name, timer=timer,
                                 median_ms=t, vs_cublas_bf16=tc / t, correct=not bad))
            print(f"int4_gemv K={K} N={N} {timer:7s} {'cuBLAS bf16 F.linear':28s} "
                  f"{tc * 1e3:7.2f} us")


def _int4_gemv_rounds(rows, family, Ms, variants_for):
    """Time ``variants_for(M)`` (name -> fn(a, q, s, z)) and cuBLAS bf16 at K=4096 N=14336 and
    K=N=8192 (group 128) for each M in ``Ms``: graph replays, L2 read-flushed, min of 3
    interleaved rounds' medians, by events and by the kernel timer; each output checked
    against a float64 product. The variant named "default" is the ratios' base."""
    import torch.nn.functional as F

    for K, N in ((4096, 14336), (8192, 8192)):
        g = torch.Generator(device="cuda").manual_seed(K + N)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * K ** -0.5
        q, s, z = tkit.quantize_int4(w, 128)
        wd = tkit.dequantize_int4(q, s, z, group_size=128, dtype=torch.float64)
        for M in Ms:
            a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
            want = a.double() @ wd.t()
            tol = 1e-2 * float(want.abs().max())
            variants = variants_for(M)
            times, errs = {}, {}
            for _ in range(3):
                for name, fn in variants.items():
                    got = fn(a, q, s, z)
                    errs[name] = max(errs.get(name, 0.0), float((got.double() - want).abs().max()))
                    for timer in ("events", "kernels"):
                        t = time_fn(lambda fn=fn, a=a, q=q, s=s, z=z: fn(a, q, s, z), replay=True,
                                    rep_ms=60, timer=timer).median_ms
                        times[(name, timer)] = min(t, times.get((name, timer), t))
            for timer in ("events", "kernels"):
                tc = min(time_fn(lambda a=a, w=w: F.linear(a, w), replay=True, rep_ms=60,
                                 timer=timer).median_ms for _ in range(3))
                base = times[("default", timer)]
                for name in variants:
                    t = times[(name, timer)]
                    bad = "" if errs[name] <= tol else f" WRONG (max |err| {errs[name]:.3g})"
                    print(f"{family} M={M} K={K} N={N} {timer:7s} {name:28s} "
                          f"{t * 1e3:7.2f} us {t / base:5.3f}x default's time, "
                          f"{tc / t:5.2f}x cuBLAS bf16{bad}")
                    rows.append(dict(family=family, op="matmul_int4",
                                     case=f"M={M} K={K} N={N} g128", provider=name,
                                     timer=timer, median_ms=t, vs_cublas_bf16=tc / t,
                                     correct=not bad))
                print(f"{family} M={M} K={K} N={N} {timer:7s} {'cuBLAS bf16 F.linear':28s}"
                      f" {tc * 1e3:7.2f} us")
                rows.append(dict(family=family, op="matmul_int4",
                                 case=f"M={M} K={K} N={N} g128", provider="cuBLAS bf16",
                                 timer=timer, median_ms=tc))


def _cuda_gemv(**kw):
    from tkit.cuda_ext import gemm_int4 as G4

    return lambda a, q, s, z: G4.matmul_int4_gemv_cuda(a, q, s, z, 128, **kw)


def _cuda_stream_k(a, q, s, z):
    from tkit.cuda_ext import gemm_int4 as G4

    return G4.matmul_int4_cuda(a, q, s, z, 128, check=False)


def _matmul_int4_default(a, q, s, z):
    return tkit.matmul_int4(a, q, s, z, group_size=128)


def _triton_path(path):
    """matmul_int4 with its Triton ``path`` forced (``int4_config``)."""
    from tkit.kernels.matmul import int4 as I4

    def fn(a, q, s, z):
        with I4.int4_config(path=path):
            return _matmul_int4_default(a, q, s, z)
    return fn


def sweep_int4_gemv_cuda(rows):
    """The CUDA GEMV (``tkit.cuda_ext.gemm_int4.matmul_int4_gemv_cuda``) at M = 1..16: at M=1
    against the Triton GEMV, at M = 2, 4, 8 and 16 against the stream-K CUDA kernel (the
    default there before it); at every M the GEMV with one ring of 4 and the all-ones sums of
    a (the default before two rings and the stacked sums), and the default with its sums in
    the other form (``stacked``); cuBLAS bf16 beside them (:func:`_int4_gemv_rounds`)."""
    def variants_for(M):
        variants = {"default": _matmul_int4_default}
        if M == 1:
            variants["triton gemv"] = _triton_path("gemv")
        else:
            variants["cuda stream-K"] = _cuda_stream_k
        # one ring of 4, and the groups' sums of a in the default's other form (in the
        # default's two rings of 2: at 16 rows the all-ones form's own default is 2 of 1)
        for kw in (dict(rb=1, pf=4, stacked=False), dict(rb=2, pf=2, stacked=M <= 8)):
            variants["cuda gemv " + " ".join(f"{k} {v}" for k, v in kw.items())] = (
                _cuda_gemv(**kw))
        return variants

    _int4_gemv_rounds(rows, "int4_gemv_cuda", (1, 2, 4, 8, 16), variants_for)


def sweep_int4_gemv_rows(rows):
    """The CUDA GEMV past 16 rows (32 rows a CTA, one more CTA a slab for each 32 rows past
    that; the default to 128 rows) at M = 24..128 against the previous defaults (the stream-K
    kernel to 32 rows, the tc kernel to 64, the tile kernel above); at 32, 64 and 128 rows also
    two rings of 2 and half the K lanes; cuBLAS bf16 beside them (:func:`_int4_gemv_rounds`).
    One ring of 8 and two rings of 4 took 1.07-1.29x the default's time (docs/NOTES.md,
    forty-ninth session)."""
    from tkit.cuda_ext import gemm_int4 as G4

    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def variants_for(M):
        kl = {N: G4.gemv_config(M, N, K, torch.bfloat16, torch.bfloat16, 128, sms)["kl"]
              for K, N in ((4096, 14336), (8192, 8192))}

        def half_the_lanes(a, q, s, z):
            return G4.matmul_int4_gemv_cuda(a, q, s, z, 128, lanes=max(1, kl[q.shape[1]] // 2))

        variants = {"default": _matmul_int4_default}
        if M <= 32:  # the previous defaults
            variants["cuda stream-K"] = _cuda_stream_k
        else:
            variants["triton " + ("tc" if M <= 64 else "tile")] = (
                _triton_path("tc" if M <= 64 else "tile"))
        if M in (32, 64, 128):
            variants.update({"cuda gemv rb 2 pf 2": _cuda_gemv(rb=2, pf=2),
                             "cuda gemv lanes /2": half_the_lanes})
        return variants

    _int4_gemv_rounds(rows, "int4_gemv_rows", (24, 32, 48, 64, 96, 128), variants_for)


def _cuda_wgmma(**kw):
    from tkit.cuda_ext import gemm_int4 as G4

    return lambda a, q, s, z: G4.matmul_int4_wgmma(a, q, s, z, 128, **kw)


def sweep_int4_wgmma(rows):
    """The default (the CUDA GEMV to 32 rows, the wgmma GEMM ``tkit.cuda_ext.gemm_int4.
    matmul_int4_wgmma`` at 33..512, dequantize + GEMM above) at M = 16..1024 against the
    paths beside its cuts: the GEMV to 128 rows, dequantize + GEMM from 128, the wgmma GEMM
    with its K split off and from 64 rows half the rows a CTA; cuBLAS bf16 beside them
    (:func:`_int4_gemv_rounds`)."""
    from tkit.cuda_ext import gemm_int4 as G4

    def variants_for(M):
        variants = {"default": _matmul_int4_default, "cuda wgmma": _cuda_wgmma(),
                    "cuda wgmma split 1": _cuda_wgmma(split=1)}
        if M <= 128:
            variants["cuda gemv"] = _cuda_gemv()
        if M >= 64:
            variants["cuda wgmma bt /2"] = _cuda_wgmma(bt=G4._w4_bt(M) // 2)
        if M >= 128:
            variants["triton dequant"] = _triton_path("dequant")
        return variants

    _int4_gemv_rounds(rows, "int4_wgmma", (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768,
                                           1024), variants_for)


def sweep_int4_small_m(rows):
    """matmul_int4 at K=4096 N=14336 (the registry's M sweep) for M = 2..128, the default
    against the tensor-core decode kernel at other row tiles and splits,
    the GEMV and the tile kernel: where each path should start."""
    from tkit.kernels.matmul import int4 as I4

    gemv, tc, tile = _int4_variants()
    spec = registry.get("matmul_int4")
    index = {c.label: i for i, c in enumerate(spec.bench_cases())}

    per_m = {
        2: [tc(128, 4, 3, 4, bm=8), gemv(256, 32, 4, 1)],
        4: [tc(128, 4, 3, 4, bm=8), tc(128, 4, 4, 4)],
        8: [tc(128, 4, 4, 4), tc(128, 4, 3, 8, bm=8)],
        32: [tc(128, 4, 4, 4), tc(128, 4, 4, 2), tc(128, 4, 2, 2, bm=32),
             tc(128, 4, 2, 4, bm=32), tile(32, 4)],
        64: [tc(128, 4, 4, 2), tc(128, 4, 4, 4), tc(128, 4, 2, 2, bm=64),
             tc(128, 4, 2, 2, bm=32), tile(64, 4)],
        128: [tc(128, 4, 4, 2), tc(128, 4, 2, 2, bm=64)],
    }
    for M, variants in per_m.items():
        sweep("int4", I4.int4_config, variants, "matmul_int4",
              index[f"sweep M={M} K=4096 N=14336"], rows, exact=False)


def sweep_int4_8192(rows):
    """matmul_int4 at K=N=8192 (no registry case at these M) for M = 2, 32 and 64: the default
    against the previous defaults' kernels there (the GEMV at M = 2, the tile kernel at 32 and
    64) and the tensor-core kernel at other splits; graph replays, L2 read-flushed, min of
    two rounds, each output checked against the default's."""
    import torch.nn.functional as F

    from tkit.kernels.matmul import int4 as I4
    from tkit.specs import int4 as S

    gemv, tc, tile = _int4_variants()

    per_m = {2: [dict(gemv(256, 32, 32, 1), block_m=2),
                 tc(128, 4, 3, 4, bm=8)],
             32: [tile(32, 4), tc(128, 4, 2, 2, bm=32)],
             64: [tile(64, 4), tc(128, 4, 2, 2, bm=64)]}
    for M, variants in per_m.items():
        case = S._int4_case(M, 8192, 8192)
        (a, q, s, z), kw = case.make("cuda")
        want = tkit.matmul_int4(a, q, s, z, **kw)
        w = torch.randn(8192, 8192, device="cuda", dtype=a.dtype)
        nbytes = sum(t.numel() * t.element_size() for t in (a, q, s, z)) + M * 8192 * 2
        times = {}
        for _ in range(ROUNDS):
            for v in [{}] + variants:
                with I4.int4_config(**v):
                    got = tkit.matmul_int4(a, q, s, z, **kw)
                    ok = _close(got, want)
                    t = time_fn(lambda a=a, q=q, s=s, z=z, kw=kw: tkit.matmul_int4(
                        a, q, s, z, **kw), rep_ms=60, replay=True).median_ms
                times.setdefault(json.dumps(v), []).append((t, ok))
        t_cublas = time_fn(lambda a=a, w=w: F.linear(a, w), rep_ms=60, replay=True).median_ms
        base = min(t for t, _ in times["{}"])
        for v, ts in times.items():
            t = min(x for x, _ in ts)
            ok = all(o for _, o in ts)
            print(f"int4 M={M} K=N=8192 {v:60s} {t * 1e3:7.1f} us {nbytes / t / 1e9:5.2f} TB/s "
                  f"{base / t:5.3f}x default {t_cublas / t:5.2f}x cuBLAS bf16"
                  f"{'' if ok else ' DIFFERENT OUTPUT'}")
            rows.append(dict(family="int4", op="matmul_int4", case=f"M={M} K=8192 N=8192 g128",
                             config=json.loads(v), median_ms=t, tbps=nbytes / t / 1e9,
                             vs_default=base / t, vs_cublas_bf16=t_cublas / t, same=ok))


@triton.jit
def _empty_kernel(x):
    """Nothing: the floor of a timed graph replay (:func:`sweep_int4_floor`)."""
    pass


@triton.jit
def _read_kernel(x, out, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program p sums int32 elements [p CHUNK, (p + 1) CHUNK) of x (below n) into out[p]: a
    contiguous stream a program, BLOCK elements a step (:func:`sweep_int4_floor`)."""
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * CHUNK
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(0, CHUNK, BLOCK):
        offs = base + i + tl.arange(0, BLOCK)
        acc += tl.load(x + offs, mask=offs < n, other=0)
    tl.store(out + pid, tl.sum(acc))


def sweep_int4_floor(rows):
    """What the timing of the INT4 decode cases can show at best: a read of the bytes of
    M=1 K=4096 N=14336 group 128 (codes, scales, zeros: 31.2 MB) by an int32 sum of
    contiguous chunks over 132 to 4224 programs, an empty kernel (the graph replay's own
    floor), torch.sum, cuBLAS bf16 and tkit.matmul_int4 at the same shape; graph replays,
    L2 read-flushed, min of 3 medians, by events and by the kernel timer (the events' ~3.5 us
    around every run sits in the bound the first gave). Issue #16's bar (3.5x cuBLAS) against
    the best read."""
    import torch.nn.functional as F

    a = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16)
    q, s, z = tkit.quantize_int4(w, 128)
    nbytes = sum(t.numel() * t.element_size() for t in (q, s, z))
    n = nbytes // 4
    x = torch.ones(n, dtype=torch.int32, device="cuda")
    out = torch.empty(100000, dtype=torch.int32, device="cuda")

    def t(fn):
        return tuple(min(time_fn(fn, replay=True, rep_ms=60, timer=timer).median_ms
                         for _ in range(3)) for timer in ("events", "kernels"))

    res = {"empty triton kernel": t(lambda: _empty_kernel[(1,)](x)),
           "torch.sum 31 MB": t(lambda: x.sum()),
           "cuBLAS bf16 F.linear M=1": t(lambda: F.linear(a, w)),
           "tkit.matmul_int4 M=1": t(lambda: tkit.matmul_int4(a, q, s, z, group_size=128))}
    for block in (2048, 4096):
        for progs in (132, 264, 528, 1056, 2112, 4224):
            chunk = triton.cdiv(triton.cdiv(n, progs), block) * block
            g = triton.cdiv(n, chunk)
            for warps in (4, 8):
                res[f"triton read BLOCK {block} programs {g} warps {warps}"] = t(
                    lambda chunk=chunk, g=g, warps=warps, block=block: _read_kernel[(g,)](
                        x, out, n, CHUNK=chunk, BLOCK=block, num_warps=warps))
    for k, (ev, kern) in res.items():
        print(f"int4_floor {k:52s} events {ev * 1e3:8.2f} us {nbytes / ev / 1e9:6.2f} TB/s; "
              f"kernels {kern * 1e3:8.2f} us {nbytes / kern / 1e9:6.2f} TB/s")
        for timer, v in (("events", ev), ("kernels", kern)):
            rows.append(dict(family="int4-probe", op="matmul_int4",
                             case="M=1 K=4096 N=14336 g128 bytes (31.2 MB)", provider=k,
                             median_ms=v, tbps=nbytes / v / 1e9, timer=timer))


def sweep_fp8_row_col(rows):
    """Row scales of a with column scales of b (per-token activations, per-channel weights):
    tkit.matmul_fp8's default (the Triton kernel), the CUDA block kernel's ``col_scale`` build
    (per-row scales as block scales, ones for b's blocks, the column scales multiplied in
    before the store) and torch._scaled_mm's rowwise mode, graph replays, L2 read-flushed,
    best of ROUNDS interleaved rounds; outputs checked against each other first."""
    for M, N, K in ((4096, 4096, 4096), (8192, 8192, 8192), (4096, 14336, 4096),
                    (4096, 4096, 14336), (1024, 7168, 2048)):
        _fp8_row_col_case(M, N, K, rows)


def _fp8_row_col_case(M, N, K, rows):
    from tkit.cuda_ext import gemm_fp8_block as GB

    g = torch.Generator(device="cuda").manual_seed(M + N + K)
    a = torch.randn(M, K, device="cuda", generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(N, K, device="cuda", generator=g).to(torch.float8_e4m3fn).t()
    sa = torch.rand(M, 1, device="cuda", generator=g) + 0.5
    sb = (torch.rand(1, N, device="cuda", generator=g) + 0.5) * K ** -0.5
    kb, nb = -(-K // 128), -(-N // 128)
    sa_blk, ones = sa.expand(M, kb), torch.ones(1, 1, device="cuda").expand(kb, nb)
    cs = sb.reshape(-1).contiguous()
    fns = {"tkit.matmul_fp8 (default)": lambda: tkit.matmul_fp8(a, b, sa, sb),
           "cuda block kernel, col_scale build": lambda: GB.matmul_fp8_block(
               a, b, sa_blk, ones, scale_n=cs),
           "torch._scaled_mm rowwise": lambda: torch._scaled_mm(
               a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)}
    want = fns["torch._scaled_mm rowwise"]().float()
    tol = 2e-2 * float(want.abs().max())
    for name, fn in fns.items():
        err = float((fn().float() - want).abs().max())
        if err > tol:
            print(f"fp8_row_col {M}x{N}x{K} {name}: DIFFERENT OUTPUT (max |diff| {err:.3g})")
    times = {}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            t = time_fn(fn, replay=True, rep_ms=60).median_ms
            times[name] = min(t, times.get(name, t))
    flops = 2.0 * M * N * K
    for name, t in times.items():
        ratio = times["torch._scaled_mm rowwise"] / t
        print(f"fp8_row_col {M}x{N}x{K:<6d} {name:36s} {t * 1e3:9.1f} us "
              f"{flops / t / 1e9:7.1f} TFLOP/s x{ratio:.3f} _scaled_mm")
        rows.append(dict(family="fp8_row_col", op="matmul_fp8", case=f"{M}x{N}x{K}",
                         provider=name, median_ms=t, tflops=flops / t / 1e9,
                         vs_scaled_mm=ratio))


def sweep_int4_prefill(rows):
    """matmul_int4 at prefill sizes of the registry's M sweep (K=4096, N=14336; M = 128, 512,
    4096): the default (the tile kernel, converting every code of the weight in each M tile)
    against the weight dequantized once into a's dtype and the 16-bit GEMM (path "dequant")."""
    from tkit.kernels.matmul import int4 as I4

    for idx in (11, 13, 16):  # sweep M=128, 512, 4096
        sweep("int4", I4.int4_config, [dict(path="dequant")], "matmul_int4", idx, rows,
              exact=False)


def sweep_matmul_mid(rows):
    """bf16 GEMM tiles at prefill-chunk M (256, 512) and at M=4096 (the two largest tiles
    there) on Llama-3-8B's projections, beside cuBLAS (F.linear's weight layout: b = W.t());
    the TMA kernel forced with each tile (the config override skips the eager plans, so the
    calls replay from CUDA graphs: :func:`_gemm_variants_case`)."""
    from tkit.kernels.matmul.config import TmaConfig

    tiles = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
             (64, 128, 64, 4, 4), (64, 256, 64, 8, 3), (128, 64, 64, 4, 4), (64, 64, 64, 4, 5)]
    for M in (256, 512, 4096):
        for label, (N, K) in LLAMA_NK.items():
            variants = {}
            for bm, bn, bk, wp, st in (tiles if M < 4096 else tiles[:2]):
                variants[f"{bm}x{bn}x{bk} w{wp} s{st}"] = ("tma", TmaConfig(
                    block_m=bm, block_n=bn, block_k=bk, num_warps=wp, num_stages=st))
            _gemm_variants_case(rows, "matmul_mid", M, N, K, label, variants)


def _gemm_variants_case(rows, family, M, N, K, label, variants):
    """One bf16 GEMM shape (b = W.t(), as the layer calls it) timed from CUDA graphs with the
    L2 flushed, in interleaved rounds: cuBLAS (F.linear), the plan's default and
    ``variants`` ({key: (path, config)}), each variant's output checked against cuBLAS's."""
    from tkit.kernels.matmul import ops as MM

    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", generator=g, dtype=torch.bfloat16) * K ** -0.5
    b = w.t()
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(a, w)
    flops = 2 * M * N * K
    case = f"M={M} {label} N={N} K={K}"
    dflt = MM.plan(a, b, torch.bfloat16)
    runs = {"cuBLAS": lambda: torch.nn.functional.linear(a, w),
            "default": lambda: MM._matmul_into(a, b, out, None, None, None, None, None,
                                               False, None, None)}
    cfgs = {"cuBLAS": "cuBLAS", "default": dict(path=dflt.path, **dataclasses.asdict(dflt.config))}
    for key, (path, cfg) in variants.items():
        runs[key] = (lambda path=path, cfg=cfg: MM._matmul_into(
            a, b, out, None, None, None, None, None, False, path, cfg))
        cfgs[key] = dict(path=path, **dataclasses.asdict(cfg))
    _time_checked(rows, family, case, runs, cfgs, flops, "cuBLAS", "vs_cublas",
                  lambda _: None if _close(out, ref) else "output differs from cuBLAS's",
                  f" {dflt.path} {dflt.config}")


def _time_checked(rows, family, case, runs, cfgs, flops, base, ratio_key, check, note):
    """Run each of ``runs`` ({key: fn}) once and drop those that fail or whose ``check(out)``
    (not asked of ``base``) says what is wrong; time the rest from CUDA graphs with the L2
    flushed in interleaved rounds; print and record each (min of the rounds' medians) with
    its ratio to ``base`` (``note`` printed after the default's line)."""
    times = {}
    for key, fn in runs.items():
        try:
            got = fn()
            bad = None if key == base else check(got)
            if bad:
                raise AssertionError(bad)
        except Exception as e:  # noqa: BLE001
            print(f"{family} {case} {key} FAILED {type(e).__name__}: {str(e)[:160]}")
            continue
        times[key] = []
    for _ in range(ROUNDS):  # interleaved rounds
        for key in times:
            times[key].append(time_fn(runs[key], replay=True).median_ms)
    t_base = min(times[base])
    for key, ts in times.items():
        t = min(ts)
        extra = note if key == "default" else ""
        print(f"{family} {case:34s} {key[:60]:60s} {t * 1e3:7.1f} us "
              f"{flops / t / 1e9:6.1f} TFLOP/s {t_base / t:5.3f}x {base}{extra}")
        rows.append(dict(family=family, case=case, config=cfgs.get(key, key), median_ms=t,
                         tflops=flops / t / 1e9, **{ratio_key: t_base / t}))


#: the TMA split-K sweep's cases: Llama-3 8B's qkv, o and down, 70B's o and down (the gate_ups
#: have a wave of tiles at M = 128 already)
SPLITK_TMA_SHAPES = ("8B qkv", "8B o", "8B down", "70B o", "70B down")


def _splitk_tma_variants(M, N, K, sms=132):
    """Split-K shapes through TMA (and the pointer kernel at the same shape) whose programs
    fit one wave: 128- and 64-row tiles of 128 and 256 columns, 64-deep steps, the largest
    power of 2 of splits that fits (and half of it), each split >= 4 steps."""
    from tkit.kernels.matmul.config import SplitKConfig

    out = {}
    for bm, bn, warps, stages in ((128, 128, 8, 5), (128, 256, 8, 4), (64, 128, 4, 6),
                                  (64, 256, 4, 5)):
        tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
        split = 1
        while tiles * split * 2 <= sms and K // 64 // (split * 2) >= 4:
            split *= 2
        for sp in dict.fromkeys((split, split // 2)):
            if sp < 2:
                continue
            cfg = SplitKConfig(bm, bn, 64, sp, num_stages=stages, num_warps=warps, tma=True)
            out[f"tma {bm}x{bn} split {sp}"] = ("splitk", cfg)
            if sp == split:
                out[f"ptr {bm}x{bn} split {sp}"] = ("splitk", dataclasses.replace(
                    cfg, tma=False, block_k=128, num_stages=4 if bm == 64 else 3))
    return out


def _splitk_tma_first_call(job):
    """Compile one split-K variant (a child process of :func:`sweep_matmul_splitk_tma`)."""
    M, label, key = job
    from tkit.kernels.matmul import ops as MM
    from tkit.specs.matmul import LLAMA_SHAPES

    N, K = LLAMA_SHAPES[label]
    try:
        path, cfg = _splitk_tma_variants(M, N, K)[key]
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        MM._matmul_into(a, w.t(), out, None, None, None, None, None, False, path, cfg)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 (the sweep reports it)
        return f"{M} {label} {key}: {type(e).__name__}: {str(e)[:200]}"
    return None


def sweep_matmul_splitk_tma(rows, ms=(128, 256)):
    """bf16 GEMMs at M = 128 and 256 on Llama-3's projections: the plan's default and cuBLAS
    beside split-K through TMA (128- / 64-row tiles, 128 / 256 columns, one wave of programs)
    and the pointer split-K kernel at the same shapes; CUDA-graph replays, L2 flushed."""
    from tkit.specs.matmul import LLAMA_SHAPES

    _in_children(_splitk_tma_first_call, [(M, label, key) for M in ms
                                          for label in SPLITK_TMA_SHAPES
                                          for key in _splitk_tma_variants(M, *LLAMA_SHAPES[label])])
    for M in ms:
        for label in SPLITK_TMA_SHAPES:
            N, K = LLAMA_SHAPES[label]
            _gemm_variants_case(rows, "splitk_tma", M, N, K, label,
                                _splitk_tma_variants(M, N, K))


def sweep_matmul_long_k(rows, ms=(128, 256)):
    """The plan's default against cuBLAS at M = 128 and 256 on all eight Llama-3 projections
    (CUDA-graph replays, L2 flushed): where ``SplitKConfig.long_k`` applies and where not."""
    from tkit.specs.matmul import LLAMA_SHAPES

    for M in ms:
        for label, (N, K) in LLAMA_SHAPES.items():
            _gemm_variants_case(rows, "long_k", M, N, K, label, {})


#: grouped GEMM cases (G, rows T, N, K): the registry's three MoE cases, Mixtral's down
#: projection, DeepSeek-V3's routed experts' gate/up at 4096 tokens x top-8, and Mixtral's
#: merged gate/up at 16 and 4096 tokens x top-2 (docs/FACTS.md's torch._grouped_mm anchors)
GROUPED_CASES = ((8, 16384, 14336, 4096), (8, 16384, 4096, 14336), (64, 8192, 2048, 4096),
                 (128, 4096, 1536, 2048), (256, 32768, 4096, 7168), (8, 32, 28672, 4096),
                 (8, 8192, 28672, 4096))


def _grouped_operands(G, T, N, K):
    """The registry's MoE operands (tokens split over the groups by a multinomial draw, the
    weights an nn.Linear stack passed transposed)."""
    gen = torch.Generator().manual_seed(0)
    sizes = torch.multinomial(torch.ones(G), T, replacement=True, generator=gen)
    offs = torch.zeros(G + 1, dtype=torch.int32)
    offs[1:] = torch.bincount(sizes, minlength=G).cumsum(0)
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(T, K, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device="cuda", generator=g, dtype=torch.bfloat16) * K ** -0.5
    return a, w.transpose(1, 2), offs.cuda()


def _grouped_variants(G, T, N):
    from tkit.kernels.matmul.config import GroupedConfig, GroupedTmaConfig

    ptr = GroupedConfig.for_shape(T, N, G, torch.device("cuda"))
    out = {"pointer kernel": ptr}
    for bm, bn, warps, stages in ((128, 256, 8, 3), (128, 128, 8, 4), (64, 256, 4, 3),
                                  (64, 128, 4, 4)):
        base = GroupedTmaConfig(bm, bn, 64, warps, stages)
        out[f"tma {bm}x{bn}"] = base
        if bm == 128:
            out[f"tma {bm}x{bn} tma-store"] = dataclasses.replace(base, flatten=False,
                                                                  tma_store=True)
    out["tma 128x256 group_m 4"] = GroupedTmaConfig(128, 256, 64, 8, 3, group_m=4)
    return out


def _grouped_first_call(job):
    """Compile one grouped variant (a child process of :func:`sweep_grouped`'s warm-up)."""
    G, T, N, K, key = job
    from tkit.kernels.matmul import ops as MO

    try:
        a, b, offs = _grouped_operands(G, T, N, K)
        MO._grouped_impl(a, b, offs, config=_grouped_variants(G, T, N)[key])
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 (the sweep reports it)
        return f"{G} {T} {N} {K} {key}: {type(e).__name__}: {str(e)[:200]}"
    return None


def sweep_grouped_default(rows):
    """:func:`sweep_grouped`'s cases with the default and the baselines only."""
    for G, T, N, K in GROUPED_CASES:
        _grouped_case(rows, G, T, N, K, variants=False)


def sweep_grouped_mixtral(rows):
    """:func:`sweep_grouped` at Mixtral's merged gate/up (the last two cases) only."""
    sweep_grouped(rows, GROUPED_CASES[-2:])


def sweep_grouped(rows, cases=GROUPED_CASES):
    """tkit.grouped_matmul (bf16) at MoE shapes: the plan's default, the pointer kernel and the
    persistent TMA kernel's tiles, epilogues and group_m, beside a loop of cuBLAS GEMMs (one
    F.linear a group, captured in the same CUDA graph as every run here, so without its host
    loop) and ``torch._grouped_mm`` (CUTLASS's grouped GEMM) where this torch has it; graph
    replays with the L2 flushed, interleaved rounds, every output checked against the loop's.
    """
    _in_children(_grouped_first_call, [(G, T, N, K, key) for G, T, N, K in cases
                                       for key in _grouped_variants(G, T, N)])
    for G, T, N, K in cases:
        _grouped_case(rows, G, T, N, K)


def _grouped_case(rows, G, T, N, K, variants=True):
    from tkit.kernels.matmul import ops as MO
    from tkit.kernels.matmul.config import grouped_plan

    a, b, offs = _grouped_operands(G, T, N, K)
    w = b.transpose(1, 2)
    bounds = offs.tolist()
    flops = 2.0 * T * N * K
    case = f"G={G} T={T} N={N} K={K}"

    def loop():
        return torch.cat([torch.nn.functional.linear(a[bounds[g]:bounds[g + 1]], w[g])
                          for g in range(G)])

    ref = loop()
    runs = {"cuBLAS loop": loop}
    if hasattr(torch, "_grouped_mm"):
        ends = offs[1:].contiguous()
        runs["torch._grouped_mm"] = lambda: torch._grouped_mm(a, b, offs=ends)
    dflt = grouped_plan(a, b)
    runs["default"] = lambda: MO._grouped_impl(a, b, offs)
    cfgs = {"default": dict(path=dflt.path, **dataclasses.asdict(dflt.config))}
    for key, cfg in (_grouped_variants(G, T, N) if variants else {}).items():
        runs[key] = (lambda cfg=cfg: MO._grouped_impl(a, b, offs, config=cfg))
        cfgs[key] = dataclasses.asdict(cfg)
    _time_checked(rows, "grouped", case, runs, cfgs, flops, "cuBLAS loop", "vs_loop",
                  lambda got: None if _close(got, ref) else "output differs from the loop's",
                  f" {dflt.path} {dflt.config}")


def sweep_matmul_skinny(rows):
    """bf16 GEMMs at M = 1, 16, 64 and 128 on Llama-3-8B's and 70B's projections, beside
    cuBLAS: the plan's default against every split-K shape of 128- or 64-column slabs in 1,
    2 or 4 splits (64-row tiles from M = 64, 2 of them at M = 128), so that a rule picking
    among them by program count can be read off one run (it chose
    ``SplitKConfig.for_shape``'s)."""
    from tkit.kernels.matmul.config import SplitKConfig
    from tkit.specs.matmul import LLAMA_SHAPES

    for M in (1, 16, 64, 128):
        bm = max(16, min(64, triton.next_power_of_2(M)))
        for label, (N, K) in LLAMA_SHAPES.items():
            variants = {}
            for bn in (128, 64):
                for split in (1, 2, 4):
                    programs = triton.cdiv(M, bm) * triton.cdiv(N, bn) * split
                    variants[f"splitk {bm}x{bn} split {split} ({programs} programs)"] = (
                        "splitk", SplitKConfig(block_m=bm, block_n=bn, block_k=128,
                                               split_k=split))
            _gemm_variants_case(rows, "matmul_skinny", M, N, K, label, variants)


#: Gluon GEMM variants timed beside the table's choice, as GluonConfig fields replaced on it
#: (one equal to the table's config is skipped): the next tile's first step under the stores
#: on and off. The table's tile was the fastest or within 0.5% of it at every shape here;
#: measured and dropped (docs/NOTES.md): fewer stages (128 s4, 192 s3); 256 in 4 stages as two
#: 128-wide accumulators, or with its output staged in halves; the last round's tiles split
#: in column halves; tile-order sections of 4, 16 and 32 rows at M = 4096
GLUON_VARIANTS: list[dict] = [dict(overlap=False), dict(overlap=True)]
#: interleaved rounds (single timings at M = 4096 moved by up to 5% between variants)
GLUON_ROUNDS = 3
#: Llama-3-8B's projections (N, K): what the decoder layer runs at 512 and 4096 tokens
LLAMA_NK = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
            "down": (4096, 14336)}


def sweep_matmul_gluon(rows, ms=(512, 4096)):
    """bf16 GEMM on Llama-3-8B's projections at M = 512 and 4096 (``ms``; b = W.t(), F.linear's
    layout): cuBLAS (F.linear), the Triton TMA kernel's default, the Gluon kernel's table
    choice and its tiles / stages, and with the residual the layer adds to o and down (cuBLAS
    then F.linear + add); every variant checked against cuBLAS, all replayed from CUDA graphs
    (L2 flushed) in interleaved rounds."""
    from tkit.kernels.matmul import config as MC
    from tkit.kernels.matmul import ops as MM

    F = torch.nn.functional
    for M in ms:
        for label, (N, K) in LLAMA_NK.items():
            g = torch.Generator(device="cuda").manual_seed(0)
            a = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
            w = torch.randn(N, K, device="cuda", generator=g, dtype=torch.bfloat16) * K ** -0.5
            r = torch.randn(M, N, device="cuda", generator=g, dtype=torch.bfloat16)
            b = w.t()
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(a, w)
            flops = 2 * M * N * K
            case = f"M={M} {label} N={N} K={K}"
            table = MC.GluonConfig.for_shape(M, N, K)
            table_res = MC.GluonConfig.for_shape(M, N, K, has_res=True)

            def gluon(cfg, res=None, a=a, b=b, out=out):
                return lambda: MM._matmul_into(a, b, out, res, None, None, None, None, False,
                                               "gluon", cfg)

            def describe(cfg):
                return f"{cfg.block_n} s{cfg.stages()}" + (" ovl" if cfg.overlap else "")

            def others(base):
                return [c for c in dict.fromkeys(dataclasses.replace(base, **v)
                                                 for v in GLUON_VARIANTS) if c != base]

            variants = [("cuBLAS", lambda a=a, w=w: F.linear(a, w), None),
                        ("triton default",
                         lambda a=a, b=b, out=out: MM._matmul_into(
                             a, b, out, None, None, None, None, None, False, "tma", None), None),
                        (f"gluon table ({describe(table)})", gluon(table), None)]
            variants += [(f"gluon {describe(c)}", gluon(c), None) for c in others(table)]
            if label in ("o", "down"):
                variants += [
                    ("cuBLAS + res", lambda a=a, w=w, r=r: torch.add(F.linear(a, w), r), None),
                    ("triton default + res", lambda a=a, b=b, r=r, out=out: MM._matmul_into(
                        a, b, out, r, None, None, None, None, False, "tma", None), "res"),
                    (f"gluon table ({describe(table_res)}) + res", gluon(table_res, r), "res")]
                variants += [(f"gluon {describe(c)} + res", gluon(c, r), "res")
                             for c in others(table_res)]
                # the plain table kernel again, between the residual ones (drift check)
                variants.append(("gluon table again", gluon(table), None))
            times, ok = {}, {}
            for rnd in range(GLUON_ROUNDS):
                for name, fn, tag in variants:
                    if ok.get(name) is False:
                        continue
                    if rnd == 0:
                        try:
                            got = fn()
                            want = ref + r if tag == "res" or name.endswith("+ res") else ref
                            if not _close(got if got is not None else out, want):
                                raise AssertionError("output differs from cuBLAS's")
                            ok[name] = True
                        except Exception as e:  # noqa: BLE001 - a variant that fails: say why
                            ok[name] = False
                            print(f"matmul_gluon {case:30s} {name:28s} FAILED "
                                  f"{type(e).__name__}: {str(e)[:160]}")
                            continue
                    try:
                        t = time_fn(fn, rep_ms=40, replay=True).median_ms
                    except Exception as e:  # noqa: BLE001 - e.g. a capture that fails
                        ok[name] = False
                        times.pop(name, None)
                        print(f"matmul_gluon {case:30s} {name:28s} FAILED (timing) "
                              f"{type(e).__name__}: {str(e)[:160]}")
                        continue
                    times[name] = min(t, times.get(name, t))
            t_cub = times.get("cuBLAS") or float("nan")
            for name, _, _tag in variants:
                if name not in times:
                    continue
                t = times[name]
                base = times.get("cuBLAS + res", float("nan")) if name.endswith("+ res") \
                    else t_cub
                print(f"matmul_gluon {case:30s} {name:28s} {t * 1e3:8.1f} us "
                      f"{flops / t / 1e9:6.1f} TFLOP/s {base / t:6.3f}x cuBLAS")
                rows.append(dict(family="matmul_gluon", case=case, config=name, median_ms=t,
                                 tflops=flops / t / 1e9, vs_cublas=base / t))


#: matmul_glu's Gluon configs timed beside its table's (the one equal to the table's is
#: skipped): each width's table form, and the other form / order at each width. Measured and
#: dropped (docs/NOTES.md): the plain tiles' overlap order (next step after the epilogue's
#: math) at both widths, two accumulators at 128, a tile-order section of 16 rows
GLU_VARIANTS: list[dict] = [dict(block_n=128, glu_parts=False, overlap=True),
                            dict(block_n=128, glu_parts=False, overlap=False),
                            dict(block_n=256, glu_parts=True, overlap=False),
                            dict(block_n=256, glu_parts=False, overlap=False)]
#: Llama-3-8B's MLP: hidden 4096, intermediate 14336 (gate_up weight (28672, 4096))
GLU_NK = (14336, 4096)


def sweep_matmul_glu(rows, ms=(1, 16, 512, 4096)):
    """bf16 ``matmul_glu`` on Llama-3-8B's gate/up projection (K 4096, N 14336, b = W.t() of
    the merged (2N, K) weight) at M = 1, 16 (decode: the split-K path), 512 and 4096: cuBLAS
    (F.linear) + torch's silu * mul, tkit.matmul + tkit.silu_mul (the layer before
    matmul_glu), tkit.matmul_glu (its plan) and, from M = 512, the Gluon variants of
    GLU_VARIANTS (forced); every tkit output checked against torch's
    composition (bf16 rounding) and each variant against matmul_glu's default; all replayed
    from CUDA graphs (L2 flushed) in interleaved rounds."""
    from tkit.kernels.matmul import config as MC
    from tkit.kernels.matmul import ops as MM

    F = torch.nn.functional
    N, K = GLU_NK
    for M in ms:
        g = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
        w = torch.randn(2 * N, K, device="cuda", generator=g, dtype=torch.bfloat16) * K ** -0.5
        b = w.t()
        flops = 2 * M * 2 * N * K
        nbytes = (M * K + 2 * N * K + M * N) * 2  # a, the weight, the output (matmul_glu's)
        case = f"M={M} gate_up N={N} K={K}"
        gu = F.linear(a, w)
        ref = F.silu(gu[:, :N]) * gu[:, N:]
        plan = MC.glu_plan(a, b)
        table = plan.config if plan.path == "gluon" else MC.GluonConfig.for_glu(M, N, K)

        def describe(cfg):
            return (f"{cfg.block_n} s{cfg.stages(gated=True)}"
                    + (" parts" if cfg.glu_parts else " split")
                    + (" early" if cfg.overlap else "")
                    + (f" g{cfg.group_m}" if cfg.group_m != 8 else ""))

        def gluon(cfg, a=a, b=b):
            return lambda: MM._glu_impl(a, b, None, "silu", None, True, "gluon", cfg)

        def torch_glu(a=a, w=w):
            y = F.linear(a, w)
            return F.silu(y[:, :N]) * y[:, N:]

        def tkit_two(a=a, b=b):
            y = tkit.matmul(a, b)
            return tkit.silu_mul(y[:, :N], y[:, N:])

        label = (f"{plan.path} {describe(table)}" if plan.path == "gluon"
                 else f"{plan.path}, split {plan.config.split_k}" if plan.path == "splitk"
                 else plan.path)
        variants = [("cuBLAS + silu*mul", torch_glu), ("tkit.matmul + silu_mul", tkit_two),
                    (f"matmul_glu ({label})", lambda a=a, b=b: tkit.matmul_glu(a, b))]
        others = [c for c in dict.fromkeys(MC.GluonConfig(**v) for v in GLU_VARIANTS)
                  if c != table]
        if M > 64:
            variants += [(f"gluon {describe(c)}", gluon(c)) for c in others]
            variants.append(("matmul_glu again", lambda a=a, b=b: tkit.matmul_glu(a, b)))
        times, ok = {}, {}
        want = None
        for rnd in range(GLUON_ROUNDS):
            for name, fn in variants:
                if ok.get(name) is False:
                    continue
                if rnd == 0:
                    try:
                        got = fn()
                        if not _close(got, ref):
                            raise AssertionError("output differs from torch's composition")
                        if name.startswith("matmul_glu ("):
                            want = got
                        elif want is not None and name.startswith("gluon") \
                                and not _close(got, want):
                            raise AssertionError("output differs from matmul_glu's default")
                        ok[name] = True
                    except Exception as e:  # noqa: BLE001 - a variant that fails: say why
                        ok[name] = False
                        print(f"matmul_glu {case:28s} {name:34s} FAILED "
                              f"{type(e).__name__}: {str(e)[:160]}")
                        continue
                try:
                    t = time_fn(fn, rep_ms=40, replay=True).median_ms
                except Exception as e:  # noqa: BLE001 - e.g. a capture that fails
                    ok[name] = False
                    times.pop(name, None)
                    print(f"matmul_glu {case:28s} {name:34s} FAILED (timing) "
                          f"{type(e).__name__}: {str(e)[:160]}")
                    continue
                times[name] = min(t, times.get(name, t))
        t_torch = times.get("cuBLAS + silu*mul", float("nan"))
        t_two = times.get("tkit.matmul + silu_mul", float("nan"))
        for name, _ in variants:
            if name not in times:
                continue
            t = times[name]
            print(f"matmul_glu {case:28s} {name:34s} {t * 1e3:8.1f} us "
                  f"{flops / t / 1e9:6.1f} TFLOP/s {nbytes / t / 1e9:5.2f} TB/s "
                  f"{t_torch / t:6.3f}x torch {t_two / t:6.3f}x matmul+silu_mul")
            rows.append(dict(family="matmul_glu", case=case, config=name, median_ms=t,
                             tflops=flops / t / 1e9, tbps=nbytes / t / 1e9,
                             vs_torch=t_torch / t,
                             vs_matmul_silu_mul=t_two / t))


#: (B, S, Hq, Hkv, D, causal): the flash_attention bench's prefill shapes, short and long
ATTENTION_PERSISTENT_CASES = [(32, 512, 16, 16, 128, True), (1, 512, 32, 8, 128, True),
                              (16, 1024, 16, 16, 128, True), (8, 2048, 16, 16, 128, True),
                              (4, 4096, 16, 16, 128, True), (4, 4096, 16, 16, 128, False),
                              (32, 512, 16, 16, 128, False), (16, 1024, 16, 16, 128, False),
                              (8, 2048, 16, 16, 128, False), (4, 4096, 16, 16, 64, True),
                              (32, 512, 16, 16, 64, True)]

#: D=256 (Gemma's head dim): the Gluon forward's configs that fit, each forced
ATTENTION_D256_CASES = [(4, 4096, 16, 16, 256, True), (4, 4096, 16, 16, 256, False),
                        (32, 512, 16, 16, 256, True), (4, 4096, 16, 8, 256, True)]


#: D=64: the Gluon forward's configs at D=64 (the warp-specialized and persistent ones never
#: timed there), each forced
ATTENTION_D64_CASES = [(4, 4096, 16, 16, 64, True), (4, 4096, 16, 16, 64, False),
                       (32, 512, 16, 16, 64, True), (32, 512, 16, 16, 64, False),
                       (8, 2048, 16, 16, 64, True), (4, 4096, 32, 8, 64, True)]


def sweep_attention_d64(rows):
    """The Gluon forward at head dim 64 (every config of ``hopper.configs(64)``, forced)
    beside ``tkit.flash_attention``'s choice and SDPA's cuDNN backend, graph replays."""
    for B, S, hq, hk, d, causal in ATTENTION_D64_CASES:
        _attention_forward_case(rows, B, S, hq, hk, d, causal, every=True)


#: D=64 without a mask, where the Gluon persistent kernel with 128-key blocks led the Triton
#: default at B32 x 512: more lengths, the persistent configs only
ATTENTION_D64_SHORT_CASES = [(64, 256, 16, 16, 64, False), (32, 512, 16, 16, 64, False),
                             (16, 1024, 16, 16, 64, False), (8, 2048, 16, 16, 64, False),
                             (32, 512, 32, 8, 64, False), (2, 4096, 16, 16, 64, False)]


def sweep_attention_d64_short(rows):
    """The persistent Gluon forward at head dim 64, no mask (its configs, forced) beside
    ``tkit.flash_attention``'s choice (the Triton kernel there) and SDPA's cuDNN backend."""
    for B, S, hq, hk, d, causal in ATTENTION_D64_SHORT_CASES:
        _attention_forward_case(rows, B, S, hq, hk, d, causal)


def sweep_attention_d64_2cta(rows):
    """The warp-specialized Gluon forward at D=64 with two CTAs an SM (80-register launch
    cap, consumers at 104 / 112), per tile and persistent, beside the one-CTA configs, the
    defaults and cuDNN, at the D=64 shapes of :data:`ATTENTION_D64_CASES` and
    :data:`ATTENTION_D64_2CTA_MORE`."""
    extra = {n: _named_config(n) for n in (
        "2cta persistent n64 s4", "2cta persistent n32 s4", "2cta ws n64 s2", "2cta ws n64 s3",
        "2cta ws n32 s4")}
    for B, S, hq, hk, d, causal in ATTENTION_D64_CASES + ATTENTION_D64_2CTA_MORE:
        _attention_forward_case(rows, B, S, hq, hk, d, causal, extra=extra)


#: causal tile lengths between the two-CTA kernel's measured win (512 keys) and loss (2048)
ATTENTION_D64_2CTA_MORE = [(64, 256, 16, 16, 64, True), (16, 1024, 16, 16, 64, True)]

#: D=64 causal: the two-CTA defaults' rule across lengths, one wave (B1 x 512) and 8192 keys
ATTENTION_D64_CAUSAL_CASES = [(64, 256, 16, 16, 64, True), (32, 512, 16, 16, 64, True),
                              (16, 1024, 16, 16, 64, True), (11, 1408, 16, 16, 64, True),
                              (8, 2048, 16, 16, 64, True), (4, 4096, 16, 16, 64, True),
                              (4, 4096, 32, 8, 64, True), (1, 512, 16, 16, 64, True),
                              (2, 8192, 16, 16, 64, True)]


def sweep_attention_d64_causal(rows):
    """``tkit.flash_attention`` at D=64 causal (the two-CTA persistent kernel at short tiles,
    the two-CTA per-tile kernel elsewhere) beside the one-partition n64 s4 (the per-tile
    default before them), both two-CTA configs forced, the one-CTA persistent n128 s4 / s3
    (at D=128 the two-stage n128 ring took the long causal tiles once K's slots came back
    early; at D=64 these were last timed before that), the Triton kernel and SDPA's cuDNN
    backend."""
    _sweep_named(rows, ATTENTION_D64_CAUSAL_CASES,
                 ("plain n64 s4", "2cta persistent n64 s4", "2cta ws n64 s3",
                  "persistent n128 s4", "persistent n128 s3"))


#: (B, S, Hq, Hkv, D, causal) and Gluon configs by name, with K's ring slots handed back
#: before V's: two-stage rings at D=128 (persistent n128 s2, which did not fit a useful ring
#: before) and D=64 without a mask (the Triton kernel's shapes)
ATTENTION_RING_CASES = [
    ((32, 512, 16, 16, 128, True), ("persistent n128 s2", "persistent n64 s4")),
    ((16, 1024, 16, 16, 128, True), ("persistent n128 s2", "persistent n64 s4")),
    ((8, 2048, 16, 16, 128, True), ("persistent n128 s2", "persistent n64 s4")),
    ((16, 1024, 16, 16, 128, False), ("persistent n128 s2", "persistent n64 s4")),
    ((8, 2048, 16, 16, 128, False), ("persistent n128 s2", "ws n128 s2", "ws n128 s3")),
    ((32, 512, 16, 16, 128, False), ("persistent n128 s2", "persistent n64 s5")),
    ((4, 4096, 16, 16, 128, False), ("persistent n128 s2", "ws n128 s3")),
    ((4, 4096, 16, 16, 64, False), ("ws n128 s3", "ws n64 s4", "2cta ws n64 s3",
                                    "persistent n128 s4", "plain n64 s4")),
    ((8, 2048, 16, 16, 64, False), ("ws n128 s3", "ws n64 s4", "2cta ws n64 s3",
                                    "persistent n128 s4", "plain n64 s4")),
]


#: (B, S, Hq, Hkv, D, causal): D=128 around the persistent rules' key limits (they stood at
#: causal n64 s5 up to 1088 keys a tile and n128 s2 without a mask up to 2048 when the rotated
#: rounds read n128 s2 ahead at 2048 causal and 4096 non-causal keys)
ATTENTION_D128_RULE_CASES = [(16, 1024, 16, 16, 128, True), (12, 1280, 16, 16, 128, True),
                             (10, 1536, 16, 16, 128, True), (8, 2048, 16, 16, 128, True),
                             (4, 4096, 16, 16, 128, True), (4, 4096, 32, 8, 128, True),
                             (1, 16384, 16, 16, 128, True), (4, 4096, 16, 16, 128, False),
                             (2, 8192, 16, 16, 128, False)]


def sweep_attention_d128_rules(rows):
    """:data:`ATTENTION_D128_RULE_CASES`: the persistent n128 s2 and n64 s5 forced beside
    ``tkit.flash_attention``, the per-tile default, the Triton kernel and cuDNN."""
    _sweep_named(rows, ATTENTION_D128_RULE_CASES, ("persistent n128 s2", "persistent n64 s5"))


def _named_config(name):
    """A Gluon forward config from its sweep name ("[2cta ]plain|ws|persistent nN sS")."""
    from tkit.kernels.attention import hopper as AH

    ctas = 2 if name.startswith("2cta ") else 1
    kind, bn, st = name.removeprefix("2cta ").split()
    return AH.config_dict(int(bn[1:]), int(st[1:]), kind != "plain", kind == "persistent",
                          ctas)


def _sweep_named(rows, cases, names):
    """Each (B, S, Hq, Hkv, D, causal) of ``cases`` with the Gluon configs ``names`` (see
    :func:`_named_config`) forced, beside ``tkit.flash_attention``, the Triton kernel, the
    per-tile default and cuDNN."""
    extra = {n: _named_config(n) for n in names}
    for B, S, hq, hk, d, causal in cases:
        _attention_forward_case(rows, B, S, hq, hk, d, causal, extra=extra, persistent=False)


def sweep_attention_ring(rows):
    """:data:`ATTENTION_RING_CASES`: each named config forced, beside
    ``tkit.flash_attention``, the Triton kernel and cuDNN."""
    for case, names in ATTENTION_RING_CASES:
        _sweep_named(rows, [case], names)


def sweep_attention_d256(rows):
    """The Gluon forward at head dim 256 (every config of ``hopper.configs(256)``, forced)
    beside ``tkit.flash_attention``'s choice and SDPA's cuDNN backend, graph replays."""
    for B, S, hq, hk, d, causal in ATTENTION_D256_CASES:
        _attention_forward_case(rows, B, S, hq, hk, d, causal, every=True)


def sweep_attention_persistent(rows):
    """The Gluon forward's persistent warp-specialized kernel (one CTA an SM taking the tiles
    from a counter) at each persistent config, beside the per-tile kernel's default config,
    tkit.flash_attention's choice and SDPA's cuDNN backend, graph replays; outputs checked
    against SDPA's."""
    for B, S, hq, hk, d, causal in ATTENTION_PERSISTENT_CASES:
        _attention_forward_case(rows, B, S, hq, hk, d, causal)


def _attention_forward_case(rows, B, S, hq, hk, d, causal, every=False, extra=None,
                            persistent=True):
    """One attention shape: ``tkit.flash_attention``, the Triton kernel, the per-tile default,
    every config (``every``) or the persistent ones (``persistent``), the ``extra`` configs
    and cuDNN, interleaved graph replays, each checked against SDPA once."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tkit.kernels import attention as A
    from tkit.kernels.attention import hopper as AH

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, S, h, d, device="cuda", generator=g, dtype=torch.bfloat16)
               for h in (hq, hk, hk))
    flops = 4 * B * hq * d * S * ((S + 1) / 2 if causal else S)
    case = f"B{B} S{S} H{hq}/{hk} D{d}" + (" causal" if causal else "")
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        qt, kt, vt, is_causal=causal, enable_gqa=hq != hk).transpose(1, 2)

    def triton_fwd():
        with A.attention_config(hopper_fwd_cases=frozenset()):
            return tkit.flash_attention(q, k, v, causal=causal)

    calls = {"tkit default": lambda: tkit.flash_attention(q, k, v, causal=causal),
             "triton": triton_fwd,
             "per-tile": lambda: AH.forward(q, k, v, causal=causal,
                                            config=AH.default_config(d))[0]}
    for cfg in AH.configs(d, ws=None if every else True):
        if every or (persistent and cfg.get("PERSISTENT")):
            name = ("persistent" if cfg.get("PERSISTENT") else "ws" if cfg.get("WS")
                    else "plain")
            if cfg.get("CTAS", 1) > 1:  # one name a config
                name = f"{cfg['CTAS']}cta {name}"
            calls[f"{name} n{cfg['BLOCK_N']} s{cfg['STAGES']}"] = (
                lambda cfg=cfg: AH.forward(q, k, v, causal=causal, config=cfg)[0])
    for name, cfg in (extra or {}).items():
        calls[name] = lambda cfg=cfg: AH.forward(q, k, v, causal=causal, config=cfg)[0]

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, is_causal=causal, enable_gqa=hq != hk).transpose(1, 2)
    calls["sdpa cudnn"] = cudnn
    times = {}
    for rnd in range(ROUNDS):  # interleaved rounds, each in a rotated order
        for name in round_order(list(calls), rnd, ROUNDS):
            fn = calls[name]
            try:
                if name not in times and not _close(fn(), ref):
                    raise AssertionError("output differs from SDPA's")
                t = time_fn(fn, replay=True).median_ms
            except Exception as e:  # noqa: BLE001
                print(f"attention {case} {name} FAILED {type(e).__name__}: {str(e)[:100]}")
                times[name] = None
                continue
            if times.get(name, 0) is not None:
                times[name] = min(t, times.get(name, t))
    t_cudnn = times.get("sdpa cudnn") or float("nan")
    for name, t in times.items():
        if t is None:
            continue
        print(f"attention {case:28s} {name:20s} {t * 1e3:8.1f} us "
              f"{flops / t / 1e9:6.1f} TFLOP/s {t_cudnn / t:6.3f}x cuDNN")
        rows.append(dict(family="attention_persistent", case=case, config=name,
                         median_ms=t, tflops=flops / t / 1e9, vs_cudnn=t_cudnn / t))


@contextlib.contextmanager
def _attention_bwd(triton=False, stages=None, gluon=False):
    """The attention backward's override as JSON-able keywords: ``triton`` the Triton kernels,
    ``gluon`` the Gluon kernels for every head dim and mask they cover (D=64 non-causal is not
    dispatched by default), ``stages`` a HopperBwdConfig's fields (dkdv_stages, dq_block_n,
    dq_stages)."""
    from tkit.kernels.attention import attention_config
    from tkit.kernels.attention.hopper_config import HopperBwdConfig

    over = {}
    if triton:
        over["hopper_bwd_cases"] = frozenset()
    if gluon:
        over["hopper_bwd_cases"] = frozenset({(d, c) for d in (64, 128) for c in (False, True)})
    if stages:
        over["hopper_bwd"] = HopperBwdConfig(*stages)
    with attention_config(**over):
        yield


#: the Gluon backward's ring depths and dQ key block around its defaults (D=128: dK/dV 2
#: stages, dQ 64 keys 3 stages; D=64: 3 and 64 x 4), and the Triton backward
ATTENTION_BWD_VARIANTS = {
    128: [dict(triton=True), dict(stages=(3, 64, 3)), dict(stages=(4, 64, 3)),
          dict(stages=(2, 128, 2))],
    64: [dict(triton=True), dict(stages=(6, 64, 4)), dict(stages=(3, 128, 3))],
}


def sweep_attention_bwd(rows):
    """A training step's attention (flash_attention_train's bench cases: the forward, then
    dQ, dK, dV) with the Gluon backward's variants and the Triton backward, then SDPA's flash
    and cuDNN backends on the same tensors (graph replays, L2 flushed). Then D=64 non-causal,
    which the Triton backward serves by default, against the Gluon kernels forced."""
    from tkit.specs.attention import _train_case

    spec = registry.get("flash_attention_train")
    extra = _train_case(4, 4096, 4096, 16, 16, 64)
    for case in spec.bench_cases() + [extra]:
        if case is extra:
            variants = [dict(gluon=True), dict(gluon=True, stages=(2, 64, 3))]
        else:
            variants = ATTENTION_BWD_VARIANTS[case.meta["head_dim"]]
        try:
            sweep("attention_bwd", _attention_bwd, variants, spec.name, rows=rows,
                  exact=False, case=case)
        except Exception as e:  # one case's failure must not lose the others' rows
            print(f"attention_bwd {case.label}: {type(e).__name__}: {str(e)[:200]}")
            continue
        _baselines("attention_bwd", spec, case, *case.make("cuda"), rows)


def sweep_attention_bwd_kernels(rows):
    """Where a training step's attention spends its time: each kernel's mean device time
    (torch.profiler, 10 steps after 3 warm ones) with the Gluon backward and with the Triton
    one, at flash_attention_train's bench cases."""
    from torch.profiler import ProfilerActivity, profile

    spec = registry.get("flash_attention_train")
    for case in spec.bench_cases():
        args, kwargs = case.make("cuda")
        for v in ({}, {"triton": True}):
            with _attention_bwd(**v):
                for _ in range(3):
                    spec.fn(*args, **kwargs)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        spec.fn(*args, **kwargs)
                    torch.cuda.synchronize()
            for ev in prof.key_averages():
                if ev.device_type.name != "CUDA" or ev.count < 10:
                    continue
                us = ev.device_time_total / 10
                print(f"bwd_kernels {case.label:44s} {json.dumps(v):16s} {ev.key[:60]:60s} "
                      f"{us:9.1f} us x{ev.count // 10}")
                rows.append(dict(family="attention_bwd_kernels", op=spec.name, case=case.label,
                                 config=v, kernel=ev.key, us_per_step=us,
                                 calls_per_step=ev.count // 10))


def sweep_decode_splits(rows):
    """decode_attention's split count (issue #15: dense >= 4.3 TB/s, mixed lengths >= 3.5):
    forced splits and the heuristic's slot count (ctas_per_sm) around the default, on the
    dense, page-64 and mixed-length bf16 cases (0, 2, 5)."""
    from tkit.kernels import decode as DA

    grid = [dict(num_splits=s) for s in (1, 2, 3, 4, 6, 8)]
    grid += [dict(ctas_per_sm=c) for c in (3, 4)] + [dict(split_bytes=1 << 20)]
    for index in (0, 2, 5):
        sweep("decode", DA.decode_config, grid, "decode_attention", index, rows, exact=False)


def _baselines(label, spec, case, args, kwargs, rows):
    """The op's baselines on the case's tensors, timed as the sweeps' variants (graph
    replays, L2 flushed), best of ROUNDS; rows beside the variants'."""
    nbytes = _bytes(spec, args, kwargs)
    for name, fn in spec.available_baselines().items():
        try:
            t = min(time_fn(lambda fn=fn, a=args, kw=kwargs: fn(*a, **kw), rep_ms=60,
                            replay=True).median_ms for _ in range(ROUNDS))
        except Exception as e:  # a backend that declines the case
            print(f"{label:12s} {case.label:44s} {name}: {type(e).__name__}")
            continue
        print(f"{label:12s} {case.label:44s} {name:60s} {t * 1e3:8.1f} us "
              f"{nbytes / t / 1e9:6.2f} TB/s")
        rows.append(dict(family=label, op=spec.name, case=case.label,
                         config={"baseline": name}, median_ms=t, tbps=nbytes / t / 1e9))


#: decode at head dims 64 and 256 (bench cases 9 and 10, B32 Hq32/Hkv8 L8192 dense bf16),
#: as overrides of their defaults (K tiles of 16 KB: 128 keys at D=64, 32 at D=256; 4 warps,
#: 3 stages; the split heuristic counting 2 programs an SM).
DECODE_DIM_VARIANTS: dict = {
    9: [dict(num_splits=2), dict(num_splits=3), dict(num_warps=8), dict(num_stages=4),
        dict(num_stages=2), dict(num_stages=2, num_splits=2),
        dict(block_n=256, num_warps=8, num_stages=2), dict(block_n=64, num_stages=5),
        dict(block_n=64, num_stages=5, num_splits=2)],
    10: [dict(num_splits=1), dict(num_splits=2), dict(num_splits=3), dict(num_warps=8),
         dict(num_warps=8, num_splits=1), dict(num_stages=4, num_splits=1),
         dict(block_n=16, num_stages=5), dict(block_n=16, num_stages=5, num_splits=1),
         dict(block_n=64, num_warps=8, num_stages=2, num_splits=1)],
}


def sweep_decode_dims(rows):
    """decode_attention at head dims 64 and 256 (bench cases 9, 10), whose defaults were
    never swept: :data:`DECODE_DIM_VARIANTS` around them, then SDPA's flash and cuDNN
    backends on the same tensors, timed as the variants (graph replays, L2 flushed)."""
    from tkit.kernels import decode as DA

    try:
        warm(DA.decode_config, [("decode_attention", i, v) for i, vs in
                                DECODE_DIM_VARIANTS.items() for v in [{}] + vs])
    except Exception as e:  # the sweep compiles what the warm-up did not
        print(f"decode_dims warm-up: {type(e).__name__}: {str(e)[:200]}")
    for index, variants in DECODE_DIM_VARIANTS.items():
        try:
            sweep("decode_dims", DA.decode_config, variants, "decode_attention", index, rows,
                  exact=False)
        except Exception as e:  # one case's failure must not lose the others' rows
            print(f"decode_dims case {index}: {type(e).__name__}: {str(e)[:200]}")
        spec, case, args, kwargs = _headline("decode_attention", index)
        _baselines("decode_dims", spec, case, args, kwargs, rows)


def sweep_decode_d256(rows):
    """The dense 16-bit D=256 default (up to 8 MB of K and V a split) at shapes other than the
    bench's B32 L8192: against the 2 MB floor the other head dims keep, and one split, with
    SDPA's flash and cuDNN backends on the same tensors (graph replays, L2 flushed)."""
    from tkit.kernels import decode as DA
    from tkit.specs.decode_attention import _decode_case

    variants = [dict(split_bytes=2 << 20), dict(num_splits=1)]
    spec = registry.get("decode_attention")
    for b, length in ((1, 131072), (4, 8192), (8, 32768), (128, 1024)):
        case = _decode_case(b, 32, 8, 256, length, group="head_dim")
        try:
            sweep("decode_d256", DA.decode_config, variants, "decode_attention", rows=rows,
                  exact=False, case=case)
        except Exception as e:  # one case's failure must not lose the others' rows
            print(f"decode_d256 {case.label}: {type(e).__name__}: {str(e)[:200]}")
            continue
        _baselines("decode_d256", spec, case, *case.make("cuda"), rows)


def sweep_decode_bar(rows):
    """decode_attention at issue #15's bars, whole calls (graph replays, L2 flushed): bf16
    page 16 shuffled (case 1: >= 0.95x the dense default's TB/s, case 0) around its default
    (4 warps, 2 stages, 2 splits merged in the split kernel): :data:`DECODE_PAGE16_VARIANTS`;
    fp8 per token page 64 (case 6: <= 0.55x the bf16 page-64 default's time, case 2) around
    its default (the fp8 wgmma scores, 128-key tiles, 4 warps, 5 stages, one split):
    :data:`DECODE_FP8_VARIANTS`; the bf16 page-64 reference
    (:data:`DECODE_PAGE64_VARIANTS`). Ends with the programs an SM of each split-kernel
    build as the driver counts them."""
    from tkit.kernels import decode as DA

    start = len(rows)
    cases = ((0, []), (1, DECODE_PAGE16_VARIANTS), (2, DECODE_PAGE64_VARIANTS),
             (6, DECODE_FP8_VARIANTS))
    try:
        warm(DA.decode_config, [("decode_attention", i, v) for i, vs in cases
                                for v in [{}] + vs])
    except Exception as e:  # the sweep compiles what the warm-up did not
        print(f"decode_bar warm-up: {type(e).__name__}: {str(e)[:200]}")
    for index, variants in cases:
        try:
            sweep("decode_bar", DA.decode_config, variants, "decode_attention", index, rows,
                  exact=False)
        except Exception as e:  # one case's failure must not lose the others' rows
            print(f"decode_bar case {index}: {type(e).__name__}: {str(e)[:200]}")
    new = rows[start:]

    def default(pred):
        return next((r for r in new if pred(r["case"]) and not r["config"]), None)

    dense = default(lambda c: "dense" in c)
    bf16 = default(lambda c: "page64" in c and "fp8" not in c)
    for r in new:
        if "fp8" in r["case"] and bf16:
            r["vs_bf16_page64_default"] = r["median_ms"] / bf16["median_ms"]
            print(f"decode fp8    {json.dumps(r['config']):64s} "
                  f"{r['vs_bf16_page64_default']:5.3f} of the bf16 page-64 default's time "
                  "(issue #15: <= 0.55)")
        elif "page16" in r["case"] and dense:
            r["vs_dense_default"] = r["tbps"] / dense["tbps"]
            print(f"decode page16 {json.dumps(r['config']):64s} {r['tbps']:5.2f} TB/s = "
                  f"{r['vs_dense_default']:5.3f}x dense {dense['tbps']:5.2f} (issue #15: >= 0.95)")
        elif "page64" in r["case"] and bf16:
            print(f"decode page64 {json.dumps(r['config']):64s} {r['tbps']:5.2f} TB/s, "
                  f"{bf16['median_ms'] / r['median_ms']:5.3f}x the default")
    try:
        _split_kernel_occupancy()
    except Exception as e:  # a probe: its failure must not lose the rows
        print(f"decode occupancy probe: {type(e).__name__}: {str(e)[:200]}")


def _split_kernel_occupancy():
    """Resident programs an SM of each decode split-kernel build this process launched, as
    the driver counts them (cuOccupancyMaxActiveBlocksPerMultiprocessor: the ptxas static
    1 KB and the reservation included), beside their shared memory and registers."""
    from cupy_backends.cuda.api import driver

    from tkit.kernels.decode._kernels import _decode_split_kernel as k

    seen = set()
    for caches in k.device_caches.values():
        for ck in caches[0].values():
            md = ck.metadata
            what = (md.num_warps, md.num_stages, md.shared, ck.n_regs)
            if ck.function is None or what in seen:
                continue
            seen.add(what)
            n = driver.occupancyMaxActiveBlocksPerMultiprocessor(ck.function, 32 * md.num_warps,
                                                                 md.shared)
            print(f"decode occupancy: {md.num_warps} warps, {md.num_stages} stages, "
                  f"{md.shared} B shared, {ck.n_regs} registers: {n} an SM")


#: bf16 page-16 variants of :func:`sweep_decode_bar`, as overrides of the default (4 warps,
#: 2 stages, 2 splits merged in the split kernel: combine="fused"). A paged loop keeps one
#: tile in flight below 5 stages, two from 5, three from 7.
DECODE_PAGE16_VARIANTS: list = [
    dict(combine="launch"),  # the combine launch (the default before)
    dict(num_warps=4, num_stages=5, num_splits=1),  # 2 tiles in flight, one split
    dict(num_warps=8, num_stages=5, num_splits=1),
]

#: bf16 page-64 variants (the fp8 bar's reference): one split of 8 warps at 5 stages (2
#: tiles in flight, 85 registers), and the split merge without a launch.
DECODE_PAGE64_VARIANTS: list = [
    dict(num_warps=8, num_stages=5, num_splits=1),
    dict(combine="fused"),
]

#: the fp8 word pipeline (the fp8 default where the wgmma does not apply): 2 warps, 64-key
#: tiles, 5 stages: 216 registers, 4 programs an SM, 2 K/V tiles in flight each, 2 splits
FP8_WORDS = dict(qk="mma", block_n=64, num_warps=2, num_stages=5, ctas_per_sm=4)
#: fp8 variants, as overrides of the default (paged, page >= 64: the fp8 wgmma scores,
#: 128-key tiles, 4 warps, 5 stages, 2 programs an SM, one split at B32)
DECODE_FP8_VARIANTS: list = [
    dict(num_splits=1),  # the default's own build again: the run's noise
    FP8_WORDS,
    dict(FP8_WORDS, num_stages=7),  # 3 tiles in flight (56848 B: 4 an SM)
]



def _decode_inputs(bench_cases, layout):
    """(args, kwargs) of a decode_fp8 run: "bf16" is case 2 (bf16 page 64), the others case 6
    (fp8 page 64, per-token scales) with its scales in another layout: "token" (as given:
    (blocks, page, heads) contiguous, a head's scales 32 bytes apart), "head" (the same values
    stored (blocks, heads, page) and passed as a permuted view: a head's 64 scales of a page
    contiguous), "tensor" (one scale per cache: no per-key scale read), "token_flat" (per
    token, every scale that one value: the per-tensor run's reference). "l2" / "bf16_l2":
    every sequence's table points into the same 128 pages (16 MB of fp8 K and V, 32 MB bf16)
    so that the call reads the L2, not HBM: the same grid and work, the time without the
    HBM stream (what the kernel's instructions and latencies take)."""
    args, kwargs = bench_cases[2 if layout.startswith("bf16") else 6].make("cuda")
    kw = dict(kwargs)
    if layout.endswith("l2"):
        kw["block_table"] = kw["block_table"] % 128
    if layout == "head":
        for n in ("k_scale", "v_scale"):
            kw[n] = kw[n].permute(0, 2, 1).contiguous().permute(0, 2, 1)
    elif layout in ("tensor", "token_flat"):
        for n in ("k_scale", "v_scale"):
            c = kw[n].mean()
            kw[n] = c if layout == "tensor" else torch.full_like(kw[n], float(c))
    return args, kw


#: the inputs whose default output a run on the given inputs is checked against
_DECODE_FP8_REF = {"token": "token", "head": "token", "tensor": "token_flat", "l2": "l2"}


def sweep_decode_fp8(rows, runs=None, label="decode_fp8"):
    """decode_attention over the fp8 page-64 cache with per-token scales (case 6) against
    issue #15's bar (<= 0.55x the bf16 page-64 default's time, case 2), whole calls (graph
    replays, L2 read-flushed, interleaved rounds): the bf16 default, the fp8 default, and
    ``runs`` ((inputs, config overrides) pairs, inputs as :func:`_decode_inputs`;
    :data:`DECODE_FP8_RUNS` when None). Each fp8 output is checked against the fp8
    default's on the same values (:data:`_DECODE_FP8_REF`); times are over the bf16
    default's."""
    from tkit.kernels import decode as DA

    spec = registry.get("decode_attention")
    cases = list(spec.bench_cases())
    runs = [("bf16", {}), ("token", {})] + (DECODE_FP8_RUNS if runs is None else runs)
    inputs = {lay: _decode_inputs(cases, lay) for lay in {lay for lay, _ in runs}}
    want = {}
    for lay in {_DECODE_FP8_REF.get(lay) for lay, _ in runs} - {None}:
        args, kw = inputs.get(lay) or _decode_inputs(cases, lay)
        want[lay] = spec.fn(*args, **kw)
    nbytes = _bytes(spec, *inputs["token"])
    try:  # compile the builds in parallel child processes first
        warm(DA.decode_config, [("decode_attention", 6, v) for _, v in runs if v])
    except Exception as e:
        print(f"{label} warm-up: {type(e).__name__}: {str(e)[:200]}")
    times, notes = {}, {}
    for r in range(ROUNDS):
        for layout, v in runs:
            key = f"{layout:7s} {json.dumps(v)}"
            if times.get(key, 0) is None:
                continue
            args, kw = inputs[layout]
            try:
                with DA.decode_config(**v):
                    got = spec.fn(*args, **kw)
                    ref = _DECODE_FP8_REF.get(layout)
                    if r == 0 and ref and not _close(got, want[ref]):
                        times[key], notes[key] = None, "DIFFERENT OUTPUT"
                        continue
                    t = time_fn(lambda a=args, k=kw: spec.fn(*a, **k), rep_ms=60,
                                replay=True).median_ms
            except Exception as e:  # one build's failure must not lose the others' rows
                times[key], notes[key] = None, f"FAILED {type(e).__name__}: {str(e)[:120]}"
                continue
            times.setdefault(key, []).append(t)
    bf16 = min(times.get(f"{'bf16':7s} {{}}") or [float("nan")])
    for key, ts in times.items():
        if ts is None:
            print(f"{label} {key:72s} {notes[key]}")
            continue
        t = min(ts)
        layout, cfg = key.split(" ", 1)
        print(f"{label} {key:72s} {t * 1e3:7.1f} us {nbytes / t / 1e9:5.2f} TB/s(fp8 bytes)"
              f" {t / bf16:5.3f} of bf16 page 64 (bar <= 0.55)")
        rows.append(dict(family=label, op="decode_attention",
                         case=cases[2 if layout.startswith("bf16") else 6].label,
                         inputs=layout, config=json.loads(cfg), median_ms=t,
                         vs_bf16_page64_default=t / bf16))
    try:
        _split_kernel_occupancy()
    except Exception as e:  # a probe: its failure must not lose the rows
        print(f"decode occupancy probe: {type(e).__name__}: {str(e)[:200]}")


#: (inputs, DecodeConfig overrides) runs of :func:`sweep_decode_fp8` beside the bf16 and
#: fp8 defaults (inputs: :func:`_decode_inputs`). "head": a head's 64 scales of a page in 256
#: contiguous bytes instead of 64 sectors that the other 7 heads' programs read too;
#: "tensor": no per-key scale read; "l2" / "bf16_l2": the same calls on L2-resident pages.
DECODE_FP8_RUNS: list = [
    ("token", dict(num_splits=1)),  # the default's own build again: the run's noise
    ("head", {}),
    ("tensor", {}),
    ("l2", {}),
    ("bf16_l2", {}),
]

#: runs of :func:`sweep_decode_wg`: the fp8 default (paged, page >= 64: the scores by an fp8
#: wgmma, keys as M, 4 warps, the query's hi and lo e4m3 parts as N = 16, the bench case's 4
#: rows a tile of 8, 128-key tiles, 5 stages) against the word pipeline and other tiles and
#: stages of the wgmma; ``ctas_per_sm`` as the build fits (registers, shared memory) so that
#: the split heuristic fills the machine (4: 2 splits, 3: 3, 2: 1).
_WG = dict(qk="wgmma_fp8", num_warps=4)
DECODE_WG_RUNS: list = [
    ("token", dict(num_splits=1)),  # the default's own build again: the run's noise
    ("token", FP8_WORDS),
    ("token", dict(_WG, block_n=128, num_stages=6, ctas_per_sm=2)),
    ("token", dict(_WG, block_n=256, sub_n=128, num_stages=3, ctas_per_sm=2)),  # 105 KB
    ("l2", {}),  # L2-resident pages: the loops' own time, the default and the word pipeline
    ("l2", FP8_WORDS),
]


def sweep_decode_fp8_batch(rows):
    """The fp8 page-64 cache with per-token scales (B x 8192 keys, Hq32/Hkv8, D128, shuffled
    pages) at batches 16 to 64 against the bf16 page-64 default at the same batch: the fp8
    default (the wgmma where its unsplit grid is 80-100% of a wave of 2 programs an SM, else
    the word pipeline), the wgmma unsplit, and the word pipeline (:data:`FP8_WORDS`); whole
    calls, graph replays, L2 read-flushed, min of 2 interleaved rounds."""
    from tkit.kernels import decode as DA
    from tkit.specs import decode_attention as S

    runs = {"fp8 default": {}, "fp8 words": FP8_WORDS,
            "fp8 wgmma 1 split": dict(_WG, block_n=128, num_stages=5, ctas_per_sm=2,
                                      num_splits=1)}
    for B in (16, 24, 32, 40, 48, 64):
        # the bench's fp8 and bf16 page-64 cases (tkit.specs.decode_attention) at batch B
        (q, k8, v8), fkw = S._decode_case(B, 32, 8, 128, 8192, page=64,
                                          fp8="token").make("cuda")
        (qb, kb, vb), bkw = S._decode_case(B, 32, 8, 128, 8192, page=64).make("cuda")
        table = fkw["block_table"]

        def fp8(cfg, q=q, k8=k8, v8=v8, fkw=fkw):
            with DA.decode_config(**cfg):
                return tkit.decode_attention(q, k8, v8, **fkw)

        def bf16(qb=qb, kb=kb, vb=vb, bkw=bkw):
            return tkit.decode_attention(qb, kb, vb, **bkw)

        want = fp8(FP8_WORDS)
        times = {}
        for _ in range(ROUNDS):
            times.setdefault("bf16 default", []).append(
                time_fn(bf16, replay=True, rep_ms=60).median_ms)
            for name, cfg in runs.items():
                if not _close(fp8(cfg), want):
                    raise AssertionError(f"decode_fp8_batch B={B} {name}: DIFFERENT OUTPUT")
                times.setdefault(name, []).append(
                    time_fn(lambda cfg=cfg: fp8(cfg), replay=True, rep_ms=60).median_ms)
        ref = min(times["bf16 default"])
        splits = DA.plan_splits(q, k8, table)[0]
        for name, ts in times.items():
            t = min(ts)
            print(f"decode_fp8_batch B={B:3d} {name:18s} {t * 1e3:7.1f} us {t / ref:5.3f} of bf16"
                  f" page 64" + (f" ({splits} splits)" if name == "fp8 default" else ""))
            rows.append(dict(family="decode_fp8_batch", op="decode_attention",
                             case=f"B{B} Sq1 H32/8 D128 L8192 page64 shuffled fp8/token",
                             provider=name, median_ms=t, vs_bf16_page64_default=t / ref))


def sweep_decode_wg(rows):
    """:func:`sweep_decode_fp8` over :data:`DECODE_WG_RUNS`."""
    sweep_decode_fp8(rows, DECODE_WG_RUNS, "decode_wg")


SWEEPS = {"decode_splits": sweep_decode_splits, "decode_wg": sweep_decode_wg,
          "decode_fp8_batch": sweep_decode_fp8_batch,
          "decode_bar": sweep_decode_bar, "decode_dims": sweep_decode_dims,
          "decode_d256": sweep_decode_d256, "attention_bwd": sweep_attention_bwd,
          "attention_bwd_kernels": sweep_attention_bwd_kernels,
          "decode_fp8": sweep_decode_fp8,
          "int4": sweep_int4, "int4_small_m": sweep_int4_small_m,
          "int4_8192": sweep_int4_8192,
          "int4_prefill": sweep_int4_prefill, "int4_floor": sweep_int4_floor,
          "int4_gemv": sweep_int4_gemv, "int4_gemv_cuda": sweep_int4_gemv_cuda,
          "int4_gemv_rows": sweep_int4_gemv_rows,
          "int4_wgmma": sweep_int4_wgmma,
          "fp8_row_col": sweep_fp8_row_col,
          "quant": sweep_quant,
          "append": sweep_append, "rope": sweep_rope, "fuse": sweep_fuse, "losses": sweep_losses,
          "sample": sweep_sample, "matmul_fp8": sweep_matmul_fp8,
          "matmul_fp8_block": sweep_matmul_fp8_block,
          "matmul_fp8_block_dsv3": sweep_matmul_fp8_block_dsv3,
          "matmul_fp8_block_small_m": sweep_matmul_fp8_block_small_m,
          "matmul_fp8_block_cuda": sweep_matmul_fp8_block_cuda,
          "matmul_fp8_block_rescale": sweep_matmul_fp8_block_rescale,
          "matmul_fp8_block_rescale_shared": sweep_matmul_fp8_block_rescale_shared,
          "matmul_mid": sweep_matmul_mid, "matmul_skinny": sweep_matmul_skinny,
          "grouped": sweep_grouped, "grouped_default": sweep_grouped_default,
          "grouped_mixtral": sweep_grouped_mixtral,
          "matmul_splitk_tma": sweep_matmul_splitk_tma, "matmul_long_k": sweep_matmul_long_k,
          "matmul_gluon": sweep_matmul_gluon,
          # one layer size's GEMMs (issue #14's layer bar is at 4096 tokens)
          "matmul_gluon_4096": lambda rows: sweep_matmul_gluon(rows, ms=(4096,)),
          "matmul_gluon_512": lambda rows: sweep_matmul_gluon(rows, ms=(512,)),
          "matmul_glu": sweep_matmul_glu,
          "attention_persistent": sweep_attention_persistent,
          "attention_d256": sweep_attention_d256, "attention_d64": sweep_attention_d64,
          "attention_d64_short": sweep_attention_d64_short,
          "attention_d64_2cta": sweep_attention_d64_2cta,
          "attention_d64_causal": sweep_attention_d64_causal,
          "attention_ring": sweep_attention_ring,
          "attention_d128_rules": sweep_attention_d128_rules}


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
