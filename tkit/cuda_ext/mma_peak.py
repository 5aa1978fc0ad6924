"""Peak throughput of ``mma.sync.aligned.m16n8k16`` on this GPU (csrc/mma_peak.cu).

An instruction-throughput microbenchmark: every warp issues only mma.sync from registers in a
loop (ILP independent accumulator chains, no memory traffic inside the loop), so the rate it
measures is an upper bound for any GEMM built on mma.sync on this GPU (a GEMM also has to feed
the fragments from shared memory, wait on barriers and write C). On Hopper that bound is what
to compare with cuBLAS, which uses wgmma there (measured: 0.666 mma per SM per clock, 2/3 of
wgmma's rate, docs/NOTES.md).

Accounting: one m16n8k16 mma is 2 * 16 * 8 * 16 = 4096 flops per warp. A launch runs
``blocks_per_sm * SMs`` blocks of ``warps_per_block`` warps; each warp issues ``ilp * iters``
mma (``iters`` dependent mma per accumulator chain). TFLOP/s = that many flops over the median
of ``reps`` launches timed by CUDA events on torch's current stream, after ``warmup`` launches.
A configuration whose blocks do not all fit on the SMs at once (registers, warps) is refused
(``ValueError``) rather than timed in waves, so ``blocks_per_sm`` is always what ran.

Public entry points:

* :func:`mma_sync_peak` ``(dtype="bf16", ilp=4, warps_per_block=8, blocks_per_sm=2, ...)``:
  one configuration, a dict (TFLOP/s, ms, iters, SM clock under load, mma per SM per clock...).
* :func:`sweep`: warps_per_block x blocks_per_sm x ilp; the best row and all rows.
* :func:`reference_output`: what the kernel's output must be, computed on the host in float64
  (exact for ``data="exact"`` and fp32 accumulators at small ``iters``).

Kernel names, compile options and fragment layouts: see csrc/mma_peak.cu.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

import numpy as np
import torch

from tkit.cuda_ext import _loader

SOURCE = "mma_peak.cu"
#: mma rounds per loop iteration (MMA_UNROLL in the source): the loop body holds ILP * UNROLL
#: mma.sync; ``iters`` must be a multiple of it
UNROLL = 8
ILPS = (1, 2, 4, 8)
FLOPS_PER_MMA = 2 * 16 * 8 * 16
#: dtype -> (kernel prefix, PTX instruction, input mantissa bits, fp32 accumulators)
DTYPES = {
    "bf16": ("mma_peak_bf16_f32", "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", 7,
             True),
    "f16": ("mma_peak_f16_f32", "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", 10, True),
    "f16_f16acc": ("mma_peak_f16_f16", "mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16", 10,
                   False),
}
#: ``data="exact"`` keeps this many mantissa bits: inputs are +-[0.25, 0.5) in steps of 1/16,
#: products multiples of 1/256 below 1/4, so with fp32 accumulators every partial sum the
#: kernel forms (and the final per-thread sum of <= 32 elements) is exact while iters <= 256:
#: out equals reference_output bit for bit. ``data="random"`` keeps all the mantissa bits
#: (full-toggle operands, as on randn inputs)
EXACT_MANT_BITS = 2
DATA = ("random", "exact")
DEFAULT_SEED = 0x5EED
_ITERS_CAP = UNROLL * (2**31 - 1)  # trips is an int32


# ---- validation ------------------------------------------------------------------------------
def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_int(name: str, x, lo: int, hi: int) -> int:
    if not _is_int(x) or not lo <= x <= hi:
        raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {x!r}")
    return int(x)


def check_args(dtype, ilp, warps_per_block, blocks_per_sm, iters, data, reps, warmup,
               target_ms) -> None:
    """ValueError naming the first bad argument of :func:`mma_sync_peak`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(map(repr, DTYPES))}, got {dtype!r}")
    if not _is_int(ilp) or ilp not in ILPS:
        raise ValueError(f"ilp must be one of {', '.join(map(str, ILPS))}, got {ilp!r}")
    _check_int("warps_per_block", warps_per_block, 1, 32)
    _check_int("blocks_per_sm", blocks_per_sm, 1, 32)
    if iters is not None:
        _check_int("iters", iters, UNROLL, _ITERS_CAP)
        if iters % UNROLL:
            raise ValueError(f"iters must be a multiple of {UNROLL} (mma rounds per loop "
                             f"iteration), got {iters}")
    if data not in DATA:
        raise ValueError(f"data must be one of {', '.join(map(repr, DATA))}, got {data!r}")
    _check_int("reps", reps, 1, 10_000)
    _check_int("warmup", warmup, 0, 10_000)
    if not isinstance(target_ms, (int, float)) or isinstance(target_ms, bool) or not (
            0.01 <= target_ms <= 1000):
        raise ValueError(f"target_ms must be a number in [0.01, 1000], got {target_ms!r}")


def kernel_name(dtype: str, ilp: int) -> str:
    return f"{DTYPES[dtype][0]}_ilp{ilp}"


def mant_bits(dtype: str, data: str) -> int:
    return DTYPES[dtype][2] if data == "random" else EXACT_MANT_BITS


# ---- host emulation (numpy; no GPU) ----------------------------------------------------------
def _hash32(x: np.ndarray) -> np.ndarray:
    """lowbias32, as hash32 in csrc/mma_peak.cu (uint32 wrap-around)."""
    x = x.astype(np.uint32)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def fragment_values(dtype: str, ilp: int, n_threads: int, *, seed: int = DEFAULT_SEED,
                    data: str = "random") -> np.ndarray:
    """[n_threads, 8 + 4 * ilp] float64: each thread's operand elements, slot by slot (A: slots
    0..7, element 2r + h in the h-th half of register r; B of set s: slots 8 + 4s ..), exactly
    the values elem_bits gives in the kernel."""
    bf16 = dtype == "bf16"
    mbits = mant_bits(dtype, data)
    m = 7 if bf16 else 10
    gtid = np.arange(n_threads, dtype=np.uint32)[:, None]
    slots = np.arange(8 + 4 * ilp, dtype=np.uint32)[None, :]
    h = _hash32(np.uint32(seed & 0xFFFFFFFF) ^ _hash32(gtid * np.uint32(64) + slots))
    mask = np.uint32(((1 << mbits) - 1) << (m - mbits))
    exponent = np.uint32(125 << 7) if bf16 else np.uint32(13 << 10)
    bits = ((h >> np.uint32(31)) << np.uint32(15)) | exponent | (h & mask)
    if bf16:
        return (bits << np.uint32(16)).view(np.float32).astype(np.float64)
    return bits.astype(np.uint16).view(np.float16).astype(np.float64)


def reference_output(dtype: str, ilp: int, n_threads: int, iters: int, *,
                     seed: int = DEFAULT_SEED, data: str = "random") -> np.ndarray:
    """What ``out`` must hold, in float64: thread i's sum over its ILP sets of its four
    accumulator elements, each ``0.5 * s + iters * (A @ B_s)[row, col]`` with the m16n8k16
    fragment layouts (A row-major: a_r holds rows g + 8 (r & 1), columns 2t + 8 (r >> 1) + {0, 1};
    B col-major: b_r holds k = 2t + 8r + {0, 1}, column g; C: rows g, g + 8, columns 2t + {0, 1};
    g = lane / 4, t = lane % 4; CuTe's SM80_16x8x16 traits). The kernel matches it exactly for
    fp32 accumulators with ``data="exact"`` and ``iters <= 256`` (see :data:`EXACT_MANT_BITS`)."""
    if n_threads % 32:
        raise ValueError(f"n_threads must be a multiple of 32, got {n_threads}")
    vals = fragment_values(dtype, ilp, n_threads, seed=seed, data=data)
    w = n_threads // 32
    v = vals.reshape(w, 32, -1)
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    a = np.zeros((w, 16, 16))
    for e in range(8):
        r, h = divmod(e, 2)
        a[:, g + 8 * (r & 1), 2 * t + 8 * (r >> 1) + h] = v[:, :, e]
    out = np.zeros((w, 32))
    for s in range(ilp):
        b = np.zeros((w, 16, 8))
        for e in range(4):
            r, h = divmod(e, 2)
            b[:, 2 * t + 8 * r + h, g] = v[:, :, 8 + 4 * s + e]
        d = a @ b
        lane_sum = d[:, g, 2 * t] + d[:, g, 2 * t + 1] + d[:, g + 8, 2 * t] + d[:, g + 8, 2 * t + 1]
        out += 4 * 0.5 * s + iters * lane_sum
    return out.reshape(n_threads)


# ---- the GPU side ----------------------------------------------------------------------------
_CU_FUNC_ATTRIBUTE_NUM_REGS = 4


def _time_launches(launch: Callable[[], None], reps: int, warmup: int) -> list[float]:
    """Milliseconds of each of ``reps`` launches (CUDA events on the current stream), after
    ``warmup`` untimed ones."""
    for _ in range(warmup):
        launch()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        start.record()
        launch()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def mma_sync_peak(dtype: str = "bf16", *, ilp: int = 4, warps_per_block: int = 8,
                  blocks_per_sm: int = 2, iters: int | None = None, data: str = "random",
                  reps: int = 10, warmup: int = 3, target_ms: float = 2.0,
                  seed: int = DEFAULT_SEED, backend: str = "nvrtc",
                  check: bool = False, device: int | None = None) -> dict:
    """Time one configuration of the mma.sync peak kernel; a dict of the result.

    Parameters
    ----------
    dtype : "bf16" (bf16 inputs, fp32 accumulators: the GEMM's instruction), "f16" (fp16 inputs,
        fp32 accumulators) or "f16_f16acc" (fp16 inputs and accumulators).
    ilp : independent accumulator chains per warp (1, 2, 4 or 8).
    warps_per_block, blocks_per_sm : the launch is ``blocks_per_sm * SMs`` blocks of
        ``32 * warps_per_block`` threads; refused (ValueError) when they do not all fit at once.
    iters : dependent mma per chain, a multiple of :data:`UNROLL`; None: calibrated so that one
        launch takes about ``target_ms``.
    data : "random" (full-mantissa operands) or "exact" (2 mantissa bits: exact fp32 results).
    reps, warmup : timed and untimed launches; the result is the median.
    check : compare ``out`` with :func:`reference_output` (``check_rel_err``: norm-wise
        relative error; 0 for fp32 accumulators, ``data="exact"`` and small ``iters``; at
        large ``iters`` fp32 rounding drifts by up to ~iters * 2^-24; for ``f16_f16acc`` it is
        large once the accumulators stop growing).

    Returns a dict: the arguments, ``kernel``, ``instruction``, ``sms``, ``grid``, ``threads``,
    ``registers``, ``resident_blocks_per_sm``, ``iters``, ``mma`` (all warps), ``flops``,
    ``ms`` (median), ``ms_min``, ``ms_max``, ``tflops`` (at the median), ``tflops_max`` (at the
    fastest launch), ``cycles`` (median over blocks of warp 0's clock64 cycles in the loop),
    ``sm_clock_mhz`` (cycles / median time: the SM clock under this load, a slight
    underestimate since the launch has ramp-up), ``mma_per_sm_per_clk`` and
    ``flops_per_sm_per_clk`` (from ``cycles``), and ``check_rel_err`` when ``check``. The
    three cycle-based figures hold when ``blocks_per_sm`` is 1: with several blocks an SM,
    blocks that do not overlap for the whole launch make one block's cycles shorter than the
    SM's (on the H200 the clock then read ~1.1-1.4 GHz against ~1.8 with one block).
    """
    check_args(dtype, ilp, warps_per_block, blocks_per_sm, iters, data, reps, warmup, target_ms)
    if backend not in ("nvrtc", "nvcc"):
        raise ValueError(f"backend must be 'nvrtc' or 'nvcc', got {backend!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("mma_sync_peak needs a CUDA GPU visible to torch")
    dev = torch.cuda.current_device() if device is None else int(device)
    major, minor = torch.cuda.get_device_capability(dev)
    if major < 8:
        raise RuntimeError(f"mma.sync m16n8k16 with bf16 needs sm_80+, this GPU is sm_"
                           f"{major}{minor}")
    from cupy_backends.cuda.api import driver

    with torch.cuda.device(dev):
        props = torch.cuda.get_device_properties(dev)
        sms = props.multi_processor_count
        mod = _loader.load_module(SOURCE, backend=backend,
                                  arch=f"{major}{minor}" if backend == "nvcc" else None)
        name = kernel_name(dtype, ilp)
        func = _loader.get_kernel(mod, name)
        threads = 32 * warps_per_block
        regs = driver.funcGetAttribute(_CU_FUNC_ATTRIBUTE_NUM_REGS, func)
        resident = driver.occupancyMaxActiveBlocksPerMultiprocessor(func, threads, 0)
        if resident < blocks_per_sm:
            raise ValueError(
                f"blocks_per_sm = {blocks_per_sm} does not fit: {name} uses {regs} registers a "
                f"thread, so only {resident} blocks of {threads} threads are resident per SM "
                f"(the launch would run in waves)")
        grid = sms * blocks_per_sm
        out = torch.empty(grid * threads, dtype=torch.float32, device="cuda")
        cycles = torch.empty(grid, dtype=torch.int64, device="cuda")
        mbits = np.int32(mant_bits(dtype, data))
        seed32 = np.int32(np.uint32(seed & 0xFFFFFFFF).view(np.int32))

        def launch_with(n_iters: int) -> Callable[[], None]:
            args = (out, cycles, np.int32(n_iters // UNROLL), seed32, mbits)
            return lambda: _loader.launch(func, (grid,), (threads,), args)

        calibrated = iters is None
        if calibrated:  # grow until a launch is long enough to time, then scale to target_ms
            n = UNROLL * 128
            while True:
                t = statistics.median(_time_launches(launch_with(n), 3, 1))
                if t >= 0.2 or n >= _ITERS_CAP // 16:
                    break
                n *= 8
            iters = int(min(_ITERS_CAP, max(UNROLL, round(n * target_ms / t / UNROLL) * UNROLL)))
        times = _time_launches(launch_with(iters), reps, warmup)
        cyc = cycles.cpu().numpy()

    ms = statistics.median(times)
    mma = grid * warps_per_block * ilp * iters
    flops = mma * FLOPS_PER_MMA
    cyc_med = float(np.median(cyc))
    row = dict(
        dtype=dtype, instruction=DTYPES[dtype][1], kernel=name, ilp=ilp,
        warps_per_block=warps_per_block, blocks_per_sm=blocks_per_sm, data=data,
        backend=backend, sms=sms, grid=grid, threads=threads, registers=int(regs),
        resident_blocks_per_sm=int(resident), warps_per_sm=warps_per_block * blocks_per_sm,
        iters=int(iters), iters_calibrated=calibrated, reps=reps, mma=mma, flops=flops,
        ms=ms, ms_min=min(times), ms_max=max(times),
        tflops=flops / (ms * 1e-3) / 1e12, tflops_max=flops / (min(times) * 1e-3) / 1e12,
        cycles=cyc_med, cycles_spread=float(cyc.max() - cyc.min()) / max(cyc_med, 1.0),
    )
    if cyc_med > 0:
        row["sm_clock_mhz"] = cyc_med / (ms * 1e3)
        row["mma_per_sm_per_clk"] = mma / sms / cyc_med
        row["flops_per_sm_per_clk"] = flops / sms / cyc_med
    if check:
        ref = reference_output(dtype, ilp, grid * threads, iters, seed=seed, data=data)
        got = out.cpu().double().numpy()
        denom = float(np.linalg.norm(ref)) or 1.0
        row["check_rel_err"] = (float(np.linalg.norm(got - ref)) / denom
                                if np.isfinite(got).all() else math.inf)
        row["check_max_abs_err"] = float(np.abs(got - ref).max())
    return row


def sweep(dtype: str = "bf16", *, warps: Sequence[int] = (4, 8, 16),
          blocks: Sequence[int] = (1, 2, 4), ilps: Sequence[int] = ILPS,
          iters: int | None = None, data: str = "random", reps: int = 10, warmup: int = 3,
          target_ms: float = 2.0, backend: str = "nvrtc",
          log: Callable[[str], None] | None = None) -> dict:
    """:func:`mma_sync_peak` over warps_per_block x blocks_per_sm x ilp. Configurations whose
    blocks do not all fit on an SM at once are kept as rows with ``skipped`` (the reason).
    Returns ``{"dtype", "best": the row of highest median TFLOP/s, "rows": every row}``."""
    for name, seq in (("warps", warps), ("blocks", blocks), ("ilps", ilps)):
        if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence) or not seq:
            raise ValueError(f"{name} must be a non-empty sequence of ints, got {seq!r}")
    for w in warps:
        for b in blocks:
            for i in ilps:  # every value checked before the first launch
                check_args(dtype, i, w, b, iters, data, reps, warmup, target_ms)
    rows = []
    for w in warps:
        for b in blocks:
            for i in ilps:
                try:
                    row = mma_sync_peak(dtype, ilp=i, warps_per_block=w, blocks_per_sm=b,
                                        iters=iters, data=data, reps=reps, warmup=warmup,
                                        target_ms=target_ms, backend=backend)
                except ValueError as e:  # does not fit (check_args passed above)
                    row = dict(dtype=dtype, ilp=i, warps_per_block=w, blocks_per_sm=b,
                               data=data, skipped=str(e))
                rows.append(row)
                if log is not None:
                    log(format_row(row))
    timed = [r for r in rows if "tflops" in r]
    best = max(timed, key=lambda r: r["tflops"]) if timed else None
    return dict(dtype=dtype, best=best, rows=rows)


def format_row(r: dict) -> str:
    head = (f"{r['dtype']:10s} ilp {r['ilp']} warps/block {r['warps_per_block']:2d} "
            f"blocks/SM {r['blocks_per_sm']}")
    if "tflops" not in r:
        return f"{head}  skipped: {r.get('skipped', '?')}"
    clk = r.get("sm_clock_mhz", float("nan"))
    per = r.get("mma_per_sm_per_clk", float("nan"))
    return (f"{head}  {r['tflops']:7.1f} TFLOP/s  {r['ms']:6.3f} ms  iters {r['iters']:7d}  "
            f"{per:5.3f} mma/SM/clk  ~{clk:5.0f} MHz  {r['registers']} regs")
