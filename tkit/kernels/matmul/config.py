"""The GEMM family's configuration: constants, the autotune config lists and their pruning,
the fixed per-shape-class tiles (:func:`ptr_config`, :func:`tma_config`, :func:`splitk_config`)
and :func:`plan`, which picks the kernel a call runs and says why. Plain Python, no kernel."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton

from tkit import _env
from tkit.kernels import _common as C
from tkit.kernels import _device as D

ACTIVATIONS = (None, "silu", "gelu", "gelu_tanh", "relu")
#: Autotune the TMA and pointer kernels per (M, N, K) instead of taking the fixed per-shape-class
#: configs of :func:`tma_config` / :func:`ptr_config`. Off by default: every constexpr
#: combination (dtype, layout, epilogue flags) x every config is a compile (~2 s each for a
#: 128x256 tile), and every new M a tuning pass, which a serving loop with varying batch sizes
#: cannot afford. docs/NOTES.md has both measured, so that the fixed table follows the tuner.
AUTOTUNE = False
FP8 = torch.float8_e4m3fn
_SKINNY_M = 64  # at or below this M the GEMM is weight-streaming (memory-bound): split-K path
_SKINNY_MIN_WEIGHT = 1 << 20  # K*N below this fits in L2 many times over: not worth splitting


# --------------------------------------------------------------------------------------------
# Autotune configs
# --------------------------------------------------------------------------------------------
def _ptr_configs():
    # The sm_80 set of Triton's matmul tutorial: 128x256 and 256x128 tiles (85 FLOP/byte per
    # tile) at 3 stages for large problems, 64-wide tiles with more stages for small ones.
    c = triton.Config
    configs = [
        c({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=8),
        c({"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=8),
        c({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
        c({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
        c({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
        c({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=5, num_warps=4),
        c({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=5, num_warps=2),
    ]
    # the interpreter pays per program: few large tiles
    return C.interpreter_configs(
        configs, c({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 4}, num_warps=4))


def _tma_configs():
    # Hopper: 128x256x64 with 8 warps (two warpgroups of wgmma m64n256) at 3-4 stages is the
    # usual best for bf16 (a 128x256 tile is 85 FLOP/byte; 4 stages of (128+256)x64 bf16 are
    # 192 KB of the 228 KB shared memory). 128x128 tiles cover shapes with few 128x256 tiles.
    c = triton.Config
    configs = []
    for bm, bn, bk, stages, warps in [
        (128, 256, 64, 3, 8), (128, 256, 64, 4, 8), (128, 128, 64, 4, 8), (128, 128, 64, 3, 4),
        (128, 128, 128, 3, 8), (64, 256, 64, 4, 4), (64, 128, 64, 4, 4),
    ]:
        for subtile in (True, False):
            configs.append(c({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8,
                              "EPI_SUBTILE": subtile, "FLATTEN": True},
                             num_stages=stages, num_warps=warps))
    small = c({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 4, "EPI_SUBTILE": True,
               "FLATTEN": True}, num_warps=4)
    return C.interpreter_configs(configs, small)


def _prune(configs, named_args, **kwargs):
    """Per-shape-class pruning: a tile much taller (wider) than M (N) only wastes the tensor
    cores; fp32 operands take twice the shared memory, so BLOCK_K is halved; fp8 takes BK=128
    (a wgmma k-step is 32 bytes: 16 fp16 or 32 fp8 elements)."""
    if _env.INTERPRET:
        return configs
    M, N = named_args["M"], named_args["N"]
    elem = named_args["a_ptr"].element_size()
    out = []
    for cfg in configs:
        kw = dict(cfg.kwargs)
        if kw["BLOCK_M"] > 2 * max(C.next_power_of_2(M), 64) and kw["BLOCK_M"] > 64:
            continue
        if kw["BLOCK_N"] > 2 * max(C.next_power_of_2(N), 64) and kw["BLOCK_N"] > 64:
            continue
        if elem == 4:
            kw["BLOCK_K"] = max(16, kw["BLOCK_K"] // 2)
        elif elem == 1:
            kw["BLOCK_K"] = 128
        out.append(triton.Config(kw, num_stages=cfg.num_stages, num_warps=cfg.num_warps))
    # deduplicate (the fp8/fp32 rewrites can collide)
    seen, uniq = set(), []
    for cfg in out:
        key = (tuple(sorted(cfg.kwargs.items())), cfg.num_stages, cfg.num_warps)
        if key not in seen:
            seen.add(key)
            uniq.append(cfg)
    return uniq or configs[:1]


# --------------------------------------------------------------------------------------------
# Planning: which kernel runs, and why
# --------------------------------------------------------------------------------------------
@dataclass
class MatmulPlan:
    """The kernel a call will launch (``path``: "tma", "ptr", "splitk", "empty"), the reason,
    and for split-K the configuration the heuristic picked."""

    path: str
    reason: str
    config: dict = field(default_factory=dict)


def _tma_ok(t: torch.Tensor) -> tuple[bool, bool]:
    """(ok, transposed): TMA takes a 2-D view whose last stride is 1 and whose other stride and
    base address are multiples of 16 bytes; a column-major view is described as its transpose."""
    es = t.element_size()
    s0, s1 = t.stride()
    rows, cols = t.shape
    if s1 == 1 or cols == 1:
        ok, trans, lead = True, False, s0 if rows > 1 else cols
    elif s0 == 1 or rows == 1:
        ok, trans, lead = True, True, s1 if cols > 1 else rows
    else:
        return False, False
    return ok and (lead * es) % 16 == 0 and D.aligned16(t), trans


def _lead_stride(t: torch.Tensor, trans: bool) -> int:
    rows, cols = t.shape
    if trans:
        return t.stride(1) if cols > 1 else rows
    return t.stride(0) if rows > 1 else cols


def splitk_config(M: int, N: int, K: int, num_sms: int) -> dict:
    """The split-K heuristic for M <= 64.

    Derivation: the work is streaming K*N weight bytes; a program streams one BLOCK_N-wide slab
    of BLOCK_K-deep steps with NUM_STAGES - 1 loads in flight: at BLOCK_N=BLOCK_K=128 and 4
    stages that is ~100 KB per program, more than HBM latency needs (Little's law: 4.8 TB/s x
    ~1 us ~ 5 MB in flight, ~38 KB per SM). So about one program per SM is enough, and every
    program beyond that adds partial-sum traffic (SPLIT*M*N*4 bytes written and read back), a
    reduce launch, a longer tail and waves that do not fit at once. Measured on the H200, M=1
    and 16, K=4096, N=14336 (112 slabs of 128 columns), CUDA-graph replay, median of 3
    interleaved rounds (2026-11-30): split 1 (112 programs, no reduce kernel) with 4 stages
    3.63 / 3.85 TB/s of weight (cuBLAS 3.80 / 3.81), 3 stages 3.38 / 3.74; split 2 with 4
    stages 3.47 / 3.43; BLOCK_N=64 split 1 3.19 / 3.80. An earlier run (2026-11-29) ordered
    split 2 > 4 > 8 > 16 at M=1, 16 and 64 (split 2: 3.53 / 3.48 / 2.81 TB/s, 8: 3.27 / 2.99
    / 1.74). So the split is the power of 2 nearest to SMs / slabs (about one program per SM),
    at least 1 (split 1 is the pointer kernel with this tile, epilogue included), at most 4
    when BLOCK_M is 64, and clamped so that each split keeps >= 4 K-steps. Occupancy (ptxas
    via tkit.ir, sm_90): at BLOCK_M=16 the kernel takes 108 KB of shared memory at 4 stages, so
    2 programs fit per SM. docs/NOTES.md has the timings of the neighbours of this choice.
    """
    block_m = max(16, min(64, C.next_power_of_2(M)))
    block_n = 128 if N >= 128 else max(16, C.next_power_of_2(N))
    block_k = 128 if K >= 128 else max(16, C.next_power_of_2(K))
    tiles = C.cdiv(N, block_n) * C.cdiv(M, block_m)
    ratio = num_sms / tiles
    want = 1
    while want * 2 <= ratio * 1.41:  # nearest power of 2 on a log scale
        want *= 2
    if block_m >= 64:
        want = min(want, 4)
    k_steps = C.cdiv(K, block_k)
    while want > 1 and k_steps // want < 4:
        want //= 2
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=want,
                NUM_STAGES=4, num_warps=4)


_INTERPRETER_TILE = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=4, num_warps=4)


def ptr_config(M: int, N: int, K: int, elem_size: int = 2) -> dict:
    """The pointer kernel's fixed config per shape class (the sm_80 path, and strided operands
    on sm_90). Classes follow the tile-intensity argument of the module docstring: 128x256
    (85 FLOP/byte) when there are >= 2 waves of such tiles on 132 SMs, 128x128 when M >= 128,
    64x128 below (a 128-row tile would be mostly padding)."""
    if _env.INTERPRET:
        return dict(_INTERPRETER_TILE)
    bk = {1: 128, 2: 64, 4: 32}[elem_size]
    if C.cdiv(M, 128) * C.cdiv(N, 256) >= 2 * 132:
        return dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=bk, GROUP_M=8, num_warps=8, num_stages=3)
    if M >= 128:
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=bk, GROUP_M=8, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=bk, GROUP_M=8, num_warps=4, num_stages=4)


#: TMA tile candidates (BLOCK_M, BLOCK_N, num_warps, bf16 stages, relative per-tile efficiency).
#: Efficiencies from the H200 run at 4096^3: 128x256 757 TFLOP/s, 128x128 684 (0.90); 64x128
#: (one warpgroup, m64n128 wgmma) is put at 0.70.
_TMA_TILES = ((128, 256, 8, 3, 1.0), (128, 128, 8, 4, 0.90), (64, 128, 4, 4, 0.70))
#: fp8 tiles: BLOCK_K is also the interval at which the MMA sums are promoted into the float32
#: accumulator, and each promotion drains the MMAs in flight. 256 halves the drains of 128;
#: 128x128x256 in 3 stages (64 KB a stage) measured 1047 / 1072 TFLOP/s at 4096^3 / 8192^3
#: against 933 / 927 for 128x256x128 (0.82-0.84x torch._scaled_mm against 0.73x; 128x256x256
#: in 2 stages 787, 256x128x256 750); the reference rule holds at K = 8192 (docs/NOTES.md)
_TMA_TILES_FP8 = ((128, 128, 8, 3, 1.0), (64, 128, 4, 4, 0.70))


def tma_config(M: int, N: int, K: int, elem_size: int = 2, num_sms: int = 132) -> dict:
    """A fixed TMA config for a shape, without autotuning (the default; see ``AUTOTUNE``).

    The persistent kernel runs ceil(tiles / SMs) waves of tiles, so the time of a tile shape is
    about waves x (BLOCK_M x BLOCK_N) / efficiency: 128x256 tiles (85 FLOP/byte, the fastest per
    FLOP) win whenever they make whole waves (4096^3, 8192^3: 0.97-1.12x cuBLAS measured), while
    a problem with fewer tiles than SMs (M=256, N=4096: 32 tiles of 128x256) is better cut into
    64x128 tiles that occupy every SM. BLOCK_K is 128 bytes of K for 16-bit (64) and fp32 (32);
    fp8 takes 256 (its promotion interval, see ``_TMA_TILES_FP8``)."""
    if _env.INTERPRET:
        return dict(_INTERPRETER_TILE, EPI_SUBTILE=True, FLATTEN=True)
    bk = {1: 256, 2: 64, 4: 32}[elem_size]
    best = None
    for bm, bn, warps, stages, eff in (_TMA_TILES_FP8 if elem_size == 1 else _TMA_TILES):
        waves = C.cdiv(C.cdiv(M, bm) * C.cdiv(N, bn), num_sms)
        t = waves * bm * bn / eff
        if best is None or t < best[0] * 0.999:
            best = (t, bm, bn, warps, stages)
    _, bm, bn, warps, stages = best
    if elem_size == 4 and bn == 256:
        stages = 4  # fp32: BLOCK_K=32, 4 stages fit (fp8 at 3 stages measured 1.031x vs 1.023x)
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, EPI_SUBTILE=True,
                FLATTEN=True, num_warps=warps, num_stages=stages)


def plan(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None, *,
         path: str | None = None) -> MatmulPlan:
    """Which kernel ``matmul(a, b)`` runs for 2-D operands (after batch folding), and why."""
    M, K = a.shape
    N = b.shape[1]
    out_dtype = out_dtype or _default_out_dtype(a.dtype)
    major, sms = D.capability(a.device)[0], D.sm_count(a.device)
    if M == 0 or N == 0:
        return MatmulPlan("empty", "empty output: nothing to launch")
    if path is not None:
        cfg = splitk_config(M, N, K, sms) if path == "splitk" else {}
        return MatmulPlan(path, "forced", cfg)
    if K == 0:
        return MatmulPlan("ptr", "K = 0: the output is the epilogue of zeros")
    if M <= _SKINNY_M and K * N >= _SKINNY_MIN_WEIGHT and not C.needs_int64(a, b):
        # (the split-K kernel's index math is 32-bit; a weight past 2**31 elements takes the
        # pointer kernel's 64-bit path)
        return MatmulPlan("splitk", f"M={M} <= {_SKINNY_M} with a {K}x{N} weight: "
                          "memory-bound, split-K streams the weight", splitk_config(M, N, K, sms))
    if major >= 9:
        out_es = out_dtype.itemsize
        if not (_tma_ok(a)[0] and _tma_ok(b)[0]):
            return MatmulPlan("ptr", "an operand's strides or alignment are not TMA-compatible")
        if (N * out_es) % 16:
            return MatmulPlan("ptr", f"output rows of {N * out_es} bytes are not a multiple of "
                              "16 (TMA store)")
        return MatmulPlan("tma", f"sm_{major}0 and TMA-compatible strides: persistent TMA kernel")
    if major == 0:
        return MatmulPlan("ptr", "Triton interpreter: portable kernel")
    return MatmulPlan("ptr", f"sm_{major}x: cp.async-pipelined pointer kernel")


def _default_out_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if dtype in C.FP8_DTYPES else dtype


def _grouped_config(T, N, G, device) -> dict:
    if device.type == "cpu":
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=4)
    # MoE groups hold T*topk/G rows each, often a few hundred: 64-row tiles waste less at the
    # group edges than 128-row ones
    avg = T // max(G, 1)
    bm = 64 if avg <= 512 else 128
    return dict(BLOCK_M=bm, BLOCK_N=128, BLOCK_K=64, num_warps=4 if bm == 64 else 8,
                num_stages=4)


# --------------------------------------------------------------------------------------------
# torch.library registration (custom op + fake + autograd)
