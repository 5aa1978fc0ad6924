"""The GEMM family's configuration: constants, the autotune config lists and their pruning,
the typed launch configs of each kernel (:class:`TmaConfig`, :class:`PtrConfig`,
:class:`SplitKConfig`, :class:`GroupedConfig`, each built per shape class by its ``for_shape``
heuristic and turned into launch keywords by ``launch_kwargs()``), the scoped overrides
(:func:`matmul_config`) and :func:`plan`, which picks the kernel a call runs and says why.
Plain Python, no kernel.

The TMA and pointer kernels take the fixed per-shape-class configs by default. With
``TKIT_AUTOTUNE=1`` (tkit's one switch for call-time tuning, read once by ``tkit._env``) they
go through their autotuned versions instead, tuned per (M, N, K) over the pruned lists below
and the winners written to the tuning cache: every constexpr combination (dtype, layout,
epilogue flags) x every config is a compile (~2 s each for a 128x256 tile), and every new M a
tuning pass, which a serving loop with varying batch sizes cannot afford. docs/NOTES.md has
both measured, so that the fixed table follows the tuner."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from tkit import _env
from tkit.kernels import _common as C
from tkit.kernels import _device as D

ACTIVATIONS = (None, "silu", "gelu", "gelu_tanh", "relu")
FP8 = torch.float8_e4m3fn
_SKINNY_M = 64  # at or below this M the GEMM is weight-streaming (memory-bound): split-K path
#: up to this M, the split-K path also where its 64-row tiles of 128 columns fit in one wave
#: (H200, M = 128: 1.17-1.46x the TMA kernel on Llama-3-8B's qkv / o / down, within 3% of it
#: on 70B's o / down; wider weights keep the TMA / Gluon kernels: docs/NOTES.md)
_SPLITK_MAX_M = 128
#: from this K a 64 < M <= 256 GEMM may take 128 x 256 tiles in K splits (SplitKConfig.long_k):
#: measured ahead at K = 14336 and 28672, behind at K = 8192
_LONG_K = 14336
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
    # triton.autotune passes the positional arguments as ``named_args`` and the keywords
    # apart; tkit launches with keywords only (and _tuning passes both)
    args = {**named_args, **kwargs}
    M, N = args["M"], args["N"]
    elem = args["a_ptr"].element_size()
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
# Typed launch configs, one per kernel
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TmaConfig:
    """Launch parameters of the persistent TMA kernel (``_matmul_tma_kernel``, and of the
    block-scaled fp8 one with ``block_k`` fixed at 128). ``epi_subtile``: the epilogue in two
    half-tiles; ``flatten``: the tile loop flattened into the K loop (next tile's loads issued
    during this one's epilogue); ``programs_per_sm``: persistent programs launched per SM
    (read by the block-scaled fp8 kernel only, whose one-warpgroup tiles can run two programs
    an SM, each one's promotion overlapping the other's MMAs; matmul's kernel launches one)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: Optional[int] = None  # noqa: UP045  (None: Triton's default)
    group_m: int = 8
    epi_subtile: bool = True
    flatten: bool = True
    programs_per_sm: int = 1

    @classmethod
    def for_shape(cls, M: int, N: int, K: int, elem_size: int = 2,
                  num_sms: int = 132) -> TmaConfig:
        """The fixed TMA config for a shape (without autotuning, the default).

        The persistent kernel runs ceil(tiles / SMs) waves of tiles, so the time of a tile
        shape is about waves x (BLOCK_M x BLOCK_N) / efficiency: 128x256 tiles (85 FLOP/byte,
        the fastest per FLOP) win whenever they make whole waves (4096^3, 8192^3: 0.97-1.12x
        cuBLAS measured), while a problem with fewer tiles than SMs (M=256, N=4096: 32 tiles
        of 128x256) is better cut into 64x128 tiles that occupy every SM. BLOCK_K is 128 bytes
        of K for 16-bit (64) and fp32 (32); fp8 takes 256 (its promotion interval, see
        ``_TMA_TILES_FP8``)."""
        if _env.INTERPRET:
            return cls(**_INTERPRETER_TILE)
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
        return cls(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)

    def launch_kwargs(self) -> dict:
        kw = dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k,
                  GROUP_M=self.group_m, EPI_SUBTILE=self.epi_subtile, FLATTEN=self.flatten,
                  num_warps=self.num_warps)
        if self.num_stages is not None:
            kw["num_stages"] = self.num_stages
        return kw


#: dynamic shared memory one block may use on sm_90 (the opt-in 227 KB): a launch that asks
#: for more fails with OutOfResources
SMEM_BYTES = 232448


def pipeline_bytes(block_m: int, block_n: int, block_k: int, elem_size: int,
                   buffers: int) -> int:
    """Shared memory of a GEMM pipeline's ``buffers`` pairs of A (block_m x block_k) and B
    (block_k x block_n) tiles: what the TMA, split-K and grouped configs are fitted by."""
    return max(1, buffers) * (block_m + block_n) * block_k * elem_size


def tma_shared_bytes(cfg: TmaConfig, in_size: int, out_size: int, res_size: int = 0) -> int:
    """Shared memory of ``_matmul_tma_kernel`` with ``cfg``: the pipeline's stages of A and B
    tiles, the epilogue's staging buffer (half a tile with ``epi_subtile``) in the output's
    element size and, with a residual, a buffer of the same shape in its element size
    (``res_size``: the TMA residual's staging, or the pointer residual's layout conversion),
    plus the barriers. Within 64 bytes of tkit.ir's figure on every build measured (bf16,
    fp16, fp32 and fp8 operands; 16- and 32-bit outputs; both residual paths; whole and half
    epilogues)."""
    stages = cfg.num_stages or 3
    cols = cfg.block_n // (2 if cfg.epi_subtile else 1)
    return (pipeline_bytes(cfg.block_m, cfg.block_n, cfg.block_k, in_size, stages)
            + cfg.block_m * cols * (out_size + res_size) + 64)


def fit_shared(cfg: TmaConfig, in_size: int, out_size: int, res_size: int = 0) -> TmaConfig:
    """``cfg``, or the nearest config that fits in :data:`SMEM_BYTES`: fewer stages (down to
    2), then the half-tile epilogue. A float32 GEMM's 4 stages of 128x256x32 beside a float32
    half-tile buffer (262 KB), or a 16-bit GEMM with a float32 output and a TMA residual at 3
    stages (240 KB), would not launch. Returned unchanged when nothing fits (the launch then
    says by how much)."""
    if tma_shared_bytes(cfg, in_size, out_size, res_size) <= SMEM_BYTES:
        return cfg
    stages = cfg.num_stages or 3
    for subtile in dict.fromkeys((cfg.epi_subtile, True)):
        for st in range(stages, 1, -1):
            fit = dataclasses.replace(cfg, num_stages=st, epi_subtile=subtile)
            if tma_shared_bytes(fit, in_size, out_size, res_size) <= SMEM_BYTES:
                return fit
    return cfg


@dataclass(frozen=True)
class PtrConfig:
    """Launch parameters of the pointer kernel (``_matmul_kernel``; the block-scaled fp8 one
    with ``block_k`` fixed at 128). ``num_stages`` None: Triton's default (the interpreter's
    tile, where stages mean nothing)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: Optional[int] = None  # noqa: UP045
    group_m: int = 8

    @classmethod
    def for_shape(cls, M: int, N: int, K: int, elem_size: int = 2) -> PtrConfig:
        """The fixed config per shape class (the sm_80 path, and strided operands on sm_90).
        Classes follow the tile-intensity argument of the package docstring: 128x256 (85
        FLOP/byte) when there are >= 2 waves of such tiles on 132 SMs, 128x128 when M >= 128,
        64x128 below (a 128-row tile would be mostly padding)."""
        if _env.INTERPRET:
            return cls(**_INTERPRETER_TILE)
        bk = {1: 128, 2: 64, 4: 32}[elem_size]
        if C.cdiv(M, 128) * C.cdiv(N, 256) >= 2 * 132:
            return cls(block_m=128, block_n=256, block_k=bk, num_warps=8, num_stages=3)
        if M >= 128:
            return cls(block_m=128, block_n=128, block_k=bk, num_warps=8, num_stages=3)
        return cls(block_m=64, block_n=128, block_k=bk, num_warps=4, num_stages=4)

    def launch_kwargs(self) -> dict:
        kw = dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k,
                  GROUP_M=self.group_m, num_warps=self.num_warps)
        if self.num_stages is not None:
            kw["num_stages"] = self.num_stages
        return kw


@dataclass(frozen=True)
class SplitKConfig:
    """Launch parameters of the split-K kernels (M <= 128). ``split_k`` 1 runs the pointer
    kernel with this tile (epilogue included, no reduce); ``fused_reduce`` (opt-in) sums the
    partials in the last program of each tile instead of a second launch."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_stages: int = 4
    num_warps: int = 4
    fused_reduce: bool = False
    #: the K-slices' tiles through host TMA descriptors (``_matmul_splitk_tma_kernel``;
    #: 16-bit, a row-major and both operands TMA-describable, else the pointer kernel)
    tma: bool = False

    @classmethod
    def for_shape(cls, M: int, N: int, K: int, num_sms: int) -> SplitKConfig:
        """The split-K heuristic (M <= 128: :func:`plan`'s split-K path).

        The work is streaming K*N weight bytes; a program streams one BLOCK_N-wide slab of
        BLOCK_K-deep steps with NUM_STAGES - 1 loads in flight: at BLOCK_N=BLOCK_K=128 and 4
        stages that is ~100 KB per program, more than HBM latency needs (Little's law: 4.8
        TB/s x ~1 us ~ 5 MB in flight, ~38 KB per SM). So one program per SM is enough, and
        each one beyond that adds partial sums (SPLIT*M*N*4 bytes written and read back), a
        reduce launch and a second wave. The rule: as many programs as fit in one wave of
        ``num_sms``, never more.

        - BLOCK_M < 64 (M <= 32): 128-column slabs, split by the largest power of 2 that
          keeps the programs within one wave.
        - BLOCK_M = 64 (M > 32; tiles of 64 rows, two at M = 128): 128-column slabs, else
          64-column ones, else those in 2 or 4 splits: the last of these that fits one wave
          (narrower slabs before splits: a 64-row tile has enough MMA work a load at 64
          columns, and no partials to sum).

        Either way at least 1, and each split keeps >= 4 K-steps.

        H200, CUDA-graph replays, L2 flushed, Llama-3 8B / 70B projections (docs/NOTES.md,
        "twentieth session"): the rule's choice was the fastest of the six slab widths and
        splits (and of the TMA / Gluon kernel the plan took before), or within 4% of it, at
        all 32 cases of M = 1 / 16 / 64 / 128. Against the rule it replaced (the power of 2
        nearest to SMs / slabs, which could make a second wave, and 128 columns always): at
        M = 64 up to 1.33x (70B qkv 46.2 against 61.4 us; 8B qkv / o / down 1.14 / 1.20 /
        1.05x); at M = 1 / 16 it differs only at 70B qkv (48.9 / 44.9 against 52.6 / 51.8
        us). At BLOCK_M = 16 the kernel takes 108 KB of shared memory at 4 stages, so 2
        programs fit per SM.
        """
        block_m = max(16, min(64, C.next_power_of_2(M)))
        bn0 = 128 if N >= 128 else max(16, C.next_power_of_2(N))
        block_k = 128 if K >= 128 else max(16, C.next_power_of_2(K))
        rows = C.cdiv(M, block_m)

        def programs(bn, split):
            return rows * C.cdiv(N, bn) * split

        if block_m < 64:
            steps = [(bn0, 1 << i) for i in range(8)]  # 1 .. 128 splits
        else:
            narrow = [(64, 1), (64, 2), (64, 4)] if bn0 == 128 else [(bn0, 2), (bn0, 4)]
            steps = [(bn0, 1)] + narrow
        block_n, want = steps[0]
        for bn, split in steps[1:]:
            if programs(bn, split) > num_sms:
                break
            block_n, want = bn, split
        k_steps = C.cdiv(K, block_k)
        while want > 1 and k_steps // want < 4:
            want //= 2
        return cls(block_m=block_m, block_n=block_n, block_k=block_k, split_k=want)

    @classmethod
    def long_k(cls, M: int, N: int, K: int, num_sms: int) -> SplitKConfig | None:
        """The TMA split-K config for 64 < M <= 256 with a long K (>= :data:`_LONG_K`), or
        None: 128 x 256 tiles in the largest power of 2 of K splits that fits one wave, where
        that is at least 4. H200 (docs/NOTES.md, "twenty-first session", graph replays):
        Llama-3 8B down at M = 128 / 256 46.4 / 62.2 us against 49.2 / 75.6 for the plan
        before (x0.82 / 0.79 cuBLAS against 0.77 / 0.65), 70B down at M = 128 134.0 against
        161.6 (x0.92 against 0.76); with 2 splits (70B down at M = 256) it lost to the Gluon
        kernel (181.0 against 172.1), and at K = 8192 (70B o, M = 128) to the plan's tiles
        (53.2 against 51.9). 16-bit operands without fp8 scales (:func:`plan`)."""
        if not (_SKINNY_M < M <= 256 and K >= _LONG_K):
            return None
        tiles = C.cdiv(M, 128) * C.cdiv(N, 256)
        split = 1
        while tiles * split * 2 <= num_sms and C.cdiv(K, 64) // (split * 2) >= 4:
            split *= 2
        if split < 4:
            return None
        return cls(block_m=128, block_n=256, block_k=64, split_k=split, num_stages=4,
                   num_warps=8, tma=True)

    def shared_bytes(self, elem_size: int) -> int:
        """Shared memory of this config's kernel: its pipeline's a and b tiles, in
        ``num_stages - 1`` buffers for the split kernel and ``num_stages`` for the pointer
        kernel that runs split 1 (what Triton 3.6 allocates for sm_90: 245,760 B for the
        split kernel's 32 x 128 x 128 float32 tiles at 4 stages, 294,912 B for the pointer
        kernel's 64 x 128 x 128 at 3). The epilogue's layout conversion reuses that memory."""
        buffers = self.num_stages if self.split_k == 1 else self.num_stages - 1
        return max(pipeline_bytes(self.block_m, self.block_n, self.block_k, elem_size, buffers),
                   self.block_m * self.block_n * 4)

    def fit_shared(self, elem_size: int) -> SplitKConfig:
        """This config, or the nearest one that fits :data:`SMEM_BYTES`: stages down to 3,
        then the K step down to 32, then 2 stages. The 16-bit tiles of :meth:`for_shape` fit as
        they are; float32 operands did not (refused at launch) before this fit."""
        cfg = self
        while cfg.shared_bytes(elem_size) > SMEM_BYTES:
            if cfg.num_stages > 3:
                cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
            elif cfg.block_k > 32:
                cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
            elif cfg.num_stages > 2:
                cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
            else:
                break
        return cfg

    def launch_kwargs(self) -> dict:
        """The split kernel's keywords (``fused_reduce`` picks the kernel, it is no keyword)."""
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k,
                    SPLIT_K=self.split_k, NUM_STAGES=self.num_stages, num_warps=self.num_warps)

    def unsplit(self) -> PtrConfig:
        """The pointer kernel's config with this tile (``split_k`` 1: nothing to reduce)."""
        return PtrConfig(block_m=self.block_m, block_n=self.block_n, block_k=self.block_k,
                         num_warps=self.num_warps, num_stages=self.num_stages, group_m=1)


@dataclass(frozen=True)
class GroupedConfig:
    """Launch parameters of ``_grouped_matmul_kernel`` (``num_stages`` None: Triton's
    default)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: Optional[int] = None  # noqa: UP045

    @classmethod
    def for_shape(cls, T: int, N: int, G: int, device: torch.device,
                  elem_size: int = 2) -> GroupedConfig:
        if device.type == "cpu":
            return cls(block_m=32, block_n=64, block_k=32, num_warps=4)
        # MoE groups hold T*topk/G rows each, often a few hundred: 64-row tiles waste less at
        # the group edges than 128-row ones
        avg = T // max(G, 1)
        bm = 64 if avg <= 512 else 128
        # Triton keeps num_stages a and b tiles: float32 128 x 128 x 64 at 4 stages is
        # 262,144 B, past the SM's shared memory (the launch is refused), so fewer stages
        stages = 4
        while stages > 2 and pipeline_bytes(bm, 128, 64, elem_size, stages) > SMEM_BYTES:
            stages -= 1
        return cls(block_m=bm, block_n=128, block_k=64, num_warps=4 if bm == 64 else 8,
                   num_stages=stages)

    def launch_kwargs(self) -> dict:
        kw = dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k,
                  num_warps=self.num_warps)
        if self.num_stages is not None:
            kw["num_stages"] = self.num_stages
        return kw


@dataclass(frozen=True)
class GroupedTmaConfig:
    """Launch parameters of ``_grouped_matmul_tma_kernel`` (the persistent TMA grouped GEMM on
    sm_90+, 16-bit operands): the tile, its K step and stages, ``group_m`` the grouped
    order's section height over all groups' row tiles, ``flatten`` the tile loop flattened
    into the K loop (the next tile's loads issued during this one's epilogue)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 3
    group_m: int = 8
    flatten: bool = True
    #: a tile inside its group stored by TMA (the output row-major with 16-byte rows; else
    #: every tile through masked pointer stores). Not with ``flatten``: Triton 3.6's loop
    #: fusion fails on the epilogue's two store paths
    tma_store: bool = False

    def __post_init__(self):
        if self.tma_store and self.flatten:
            raise ValueError("GroupedTmaConfig: tma_store=True needs flatten=False (Triton "
                             "cannot fuse the tile loop around the two store paths)")

    @classmethod
    def for_shape(cls, T: int, N: int, G: int, num_sms: int = 132) -> GroupedTmaConfig:
        """The TMA wave model (:meth:`TmaConfig.for_shape`) on the expected row tiles: a
        group of ``T / G`` rows takes ``cdiv(T / G, BLOCK_M)`` of them, so small groups
        (MoE's many experts) prefer 64-row tiles. Groups of at least 4 row tiles store their
        whole tiles by TMA (without the flattened loop); smaller ones keep the flattened loop
        and pointer stores, since most of their tiles end a group. H200 sweep
        (``config_sweep.py grouped``, docs/NOTES.md): TMA stores 1.5-3% faster at G=8 with
        16 tiles a group, 1-7% slower at G=64 / 256 with one or two; 64 x 256 tiles fastest
        at G=128 with 32 rows a group (197.6 us against 208.8 for 64 x 128 and 211.8 for
        128 x 256)."""
        if _env.INTERPRET:
            return cls(block_m=32, block_n=64, block_k=32, num_warps=4, num_stages=2,
                       group_m=4)
        avg = max(1, T // max(G, 1))
        best = None
        for bm, bn, warps, stages, eff in _GROUPED_TILES:
            tiles = max(G, 1) * C.cdiv(avg, bm) * C.cdiv(N, bn)
            t = C.cdiv(tiles, num_sms) * bm * bn / eff
            if best is None or t < best[0] * 0.999:
                best = (t, bm, bn, warps, stages)
        _, bm, bn, warps, stages = best
        whole = avg >= 4 * bm
        return cls(block_m=bm, block_n=bn, block_k=64, num_warps=warps, num_stages=stages,
                   flatten=not whole, tma_store=whole)

    def launch_kwargs(self) -> dict:
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k,
                    GROUP_M=self.group_m, FLATTEN=self.flatten, TMA_STORE=self.tma_store,
                    num_warps=self.num_warps, num_stages=self.num_stages)


#: the Gluon GEMM's fixed tile height (two consumer warpgroups of 64 rows) and K step
GLUON_BLOCK_M = 128
GLUON_BLOCK_K = 64
GLUON_BLOCK_NS = (128, 192, 256)
GLUON_MAX_STAGES = 8


def gluon_shared_bytes(block_n: int, stages: int, out_size: int = 2, in_size: int = 2,
                       out_cols: int | None = None) -> int:
    """Shared memory of the Gluon GEMM (``_gemm_hopper_kernels``): the ring (a and b tiles of
    one K step a slot), one [64, out_cols] output staging tile a consumer warpgroup
    (``out_cols`` block_n, or half of it for a gated tile), the mbarriers (two a slot, one a
    consumer) and what the warp-specialized region hands its partitions (up to 256 bytes, as
    the block-scaled kernel)."""
    ring = stages * (GLUON_BLOCK_M + block_n) * GLUON_BLOCK_K * in_size
    staging = (block_n if out_cols is None else out_cols) * 64
    return ring + 2 * staging * out_size + 8 * (2 * stages + 2) + 256


@dataclass(frozen=True)
class GluonConfig:
    """Launch config of the warp-specialized Gluon GEMM (``gemm_hopper.py``, sm_90, 16-bit
    operands): tiles 128 x ``block_n`` x 64, a ring of ``num_stages`` K steps (0: as many as
    shared memory holds), ``group_m`` the tile order's section height. One persistent CTA an
    SM (three warpgroups: two consumers, one producer warp)."""

    block_n: int = 256
    num_stages: int = 0
    group_m: int = 8
    #: issue the next tile's first K step before this tile's output stores (their shared-memory
    #: writes and the TMA store then run under its wgmma); ``matmul_glu``'s tiles (128
    #: computed only) issue it earlier still, before the gated epilogue's math
    overlap: bool = False
    #: ``matmul_glu``'s tiles (``block_n`` wide computed, half of it stored): the gate and up
    #: sums in two accumulators, two wgmmas a K step, instead of the two halves of one
    glu_parts: bool = False

    def __post_init__(self):
        for name in ("overlap", "glu_parts"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.block_n not in GLUON_BLOCK_NS:
            raise ValueError(f"block_n must be one of {GLUON_BLOCK_NS} for the Gluon GEMM, "
                             f"got {self.block_n}")
        if not 0 <= self.num_stages <= GLUON_MAX_STAGES or self.num_stages == 1:
            raise ValueError(f"num_stages must be 0 (as many as fit) or 2..{GLUON_MAX_STAGES} "
                             f"for the Gluon GEMM, got {self.num_stages}")
        if self.group_m < 1:
            raise ValueError(f"group_m must be >= 1, got {self.group_m}")

    @classmethod
    def for_shape(cls, M: int, N: int, K: int, num_sms: int = 132,
                  has_res: bool = False) -> GluonConfig:
        """The tile width from the wave count: each of the persistent CTAs runs
        ceil(tiles / SMs) tiles, so a width costs about waves x block_n / efficiency. At
        M = 512 that gives 192 for N = 6144 (128 tiles: one wave, where 256 leaves 36 SMs
        idle and 128 makes 1.45 waves) and 128 for N = 4096 (128 tiles); 256 wherever the
        waves come out even (M = 4096). 256-wide tiles of a call without a residual issue
        the next tile's first K step under the stores (``overlap``, _GLUON_OVERLAP)."""
        best = None
        for bn, eff in _GLUON_TILES:
            waves = C.cdiv(C.cdiv(M, GLUON_BLOCK_M) * C.cdiv(N, bn), num_sms)
            t = waves * bn / eff
            if best is None or t < best[0] * 0.999:
                best = (t, bn)
        bn = best[1]
        return cls(block_n=bn, overlap=bn in _GLUON_OVERLAP and not has_res)

    @classmethod
    def for_glu(cls, M: int, N: int, K: int, num_sms: int = 132) -> GluonConfig:
        """``matmul_glu``'s tile (N the output width): ``block_n`` 128 or 256 computed, 64 or
        128 output columns, chosen by the wave count as :meth:`for_shape` does (tiles =
        cdiv(M, 128) * cdiv(N, block_n / 2)), with the accumulator form and order measured
        best at that width (_GLUON_GLU_TILES): at 128 one accumulator split in the epilogue
        and the next tile's first step issued before the epilogue's math; at 256 (where two
        tiles' sums do not fit the registers at once) two accumulators, no overlap."""
        best = None
        for bn, eff, parts, overlap in _GLUON_GLU_TILES:
            waves = C.cdiv(C.cdiv(M, GLUON_BLOCK_M) * C.cdiv(N, bn // 2), num_sms)
            t = waves * bn / eff
            if best is None or t < best[0] * 0.999:
                best = (t, bn, parts, overlap)
        _, bn, parts, overlap = best
        return cls(block_n=bn, glu_parts=parts, overlap=overlap)

    def stages(self, out_size: int = 2, gated: bool = False) -> int:
        """``num_stages``, or (0) the most ring slots that fit the sm_90 shared memory beside
        a whole staging tile a consumer (half the tile's width when ``gated``)."""
        if self.num_stages:
            return self.num_stages
        cols = self.block_n // 2 if gated else self.block_n
        s = GLUON_MAX_STAGES
        while s > 2 and gluon_shared_bytes(self.block_n, s, out_size, out_cols=cols) \
                > SMEM_BYTES:
            s -= 1
        return s


#: from this K on, with two or more waves of the Gluon kernel's tiles, the Triton kernel
#: keeps the call: at Llama-3-8B's down-projection with M = 4096 (K = 14336, 4 waves of 128 x
#: 256) it matched or beat the Gluon kernel in two H200 runs with the residual and in one of
#: two without (docs/NOTES.md); at M = 512 (one wave) the Gluon kernel was ahead in both
GLUON_LONG_K = 8192

#: Gluon tile widths and their relative efficiency per column (a wider tile reads less
#: operand data a FLOP: 128 x 256 is 85 FLOP/byte, 128 x 128 64). With these the table chose
#: the fastest width, or one within 0.5% of it, at each of Llama-3-8B's projections at
#: M = 512 and 4096 on the H200 (docs/NOTES.md).
_GLUON_TILES = ((256, 1.0), (192, 0.97), (128, 0.92))

#: ``matmul_glu``'s computed tile widths (gate + up): (block_n, efficiency as in
#: _GLUON_TILES, glu_parts, overlap). Llama-3-8B's MLP on the H200 (docs/NOTES.md): at
#: M = 512 (128 wide by the wave count) the split accumulator with the early issue was the
#: fastest form; at M = 4096 (256 wide) two accumulators without overlap, and every form that
#: overlapped two tiles lost there
GLUON_GLU_BLOCK_NS = (128, 256)
_GLUON_GLU_TILES = ((256, 1.0, True, False), (128, 0.92, False, True))

#: tile widths whose calls without a residual take ``overlap``: measured ahead or level at
#: M = 4096 (256 wide; down mixed), not at M = 512 (128 / 192 wide: a large loss at gate_up
#: in one of two runs), and behind with the residual (docs/NOTES.md)
_GLUON_OVERLAP = (256,)

#: any of the GEMM family's launch configs
MatmulConfig = (TmaConfig | PtrConfig | SplitKConfig | GroupedConfig | GroupedTmaConfig
                | GluonConfig)

_INTERPRETER_TILE = dict(block_m=64, block_n=64, block_k=32, group_m=4, num_warps=4,
                         num_stages=None)

#: TMA tile candidates (BLOCK_M, BLOCK_N, num_warps, bf16 stages, relative per-tile efficiency).
#: Efficiencies from the H200 run at 4096^3: 128x256 757 TFLOP/s, 128x128 684 (0.90); 64x128
#: (one warpgroup, m64n128 wgmma) is put at 0.70.
_TMA_TILES = ((128, 256, 8, 3, 1.0), (128, 128, 8, 4, 0.90), (64, 128, 4, 4, 0.70))
#: the grouped TMA kernel's candidates: the TMA tiles and 64 x 256 on one warpgroup, put at
#: 0.8 (it led at MoE's small groups in the H200 grouped sweep)
_GROUPED_TILES = _TMA_TILES + ((64, 256, 4, 3, 0.8),)
#: fp8 tiles: BLOCK_K is also the interval at which the MMA sums are promoted into the float32
#: accumulator, and each promotion drains the MMAs in flight. 256 halves the drains of 128;
#: 128x128x256 in 3 stages (64 KB a stage) measured 1047 / 1072 TFLOP/s at 4096^3 / 8192^3
#: against 933 / 927 for 128x256x128 (0.82-0.84x torch._scaled_mm against 0.73x; 128x256x256
#: in 2 stages 787, 256x128x256 750); the reference rule holds at K = 8192 (docs/NOTES.md)
_TMA_TILES_FP8 = ((128, 128, 8, 3, 1.0), (64, 128, 4, 4, 0.70))


# --------------------------------------------------------------------------------------------
# Overrides: one scoped, validated context for every kernel's config
# --------------------------------------------------------------------------------------------
_OVERRIDES = {cls: C.ConfigOverrides(cls)
              for cls in (TmaConfig, PtrConfig, SplitKConfig, GroupedConfig, GroupedTmaConfig,
                        GluonConfig)}
#: every field some matmul config has, in a stable order
_FIELDS = tuple(dict.fromkeys(f.name for cls in _OVERRIDES for f in dataclasses.fields(cls)))


class _Depth(threading.local):
    n = 0  # matmul_config blocks open in this thread (one attribute read on the eager path)


_DEPTH = _Depth()


@contextlib.contextmanager
def matmul_config(**overrides):
    """Override fields of the GEMM configs for the calls made inside (this thread only), e.g.
    ``with matmul_config(block_k=128, num_stages=4): tkit.matmul_fp8(...)``. A field applies to
    every kernel whose config has it (:class:`TmaConfig`, :class:`PtrConfig`,
    :class:`SplitKConfig`, :class:`GroupedConfig`, :class:`GroupedTmaConfig`) and is left out
    of the others; a name that no config has is a TypeError naming it. The block-scaled fp8
    kernels take ``block_k`` as a whole number of scale groups (128 or 256 on the TMA kernel,
    128 on the pointer kernel; other values are taken as 128). Calls inside skip the eager
    plans. For experiments (the config sweeps) and tests; calls never tune."""
    unknown = [k for k in overrides if k not in _FIELDS]
    if unknown:
        raise TypeError(f"unknown matmul config field(s) {unknown}; known: {list(_FIELDS)}")
    with contextlib.ExitStack() as stack:
        for cls, ov in _OVERRIDES.items():
            names = {f.name for f in dataclasses.fields(cls)}
            mine = {k: v for k, v in overrides.items() if k in names}
            if mine:
                stack.enter_context(ov.scope(**mine))
        _DEPTH.n += 1 if overrides else 0
        try:
            yield
        finally:
            _DEPTH.n -= 1 if overrides else 0


def overridden() -> bool:
    """Whether a :func:`matmul_config` override is in force in this thread."""
    return _DEPTH.n > 0


def current(cfg):
    """``cfg`` with the active :func:`matmul_config` overrides applied."""
    return _OVERRIDES[type(cfg)].apply(cfg)


def autotuned() -> bool:
    """TKIT_AUTOTUNE=1 (and not TKIT_NO_AUTOTUNE): the TMA and pointer kernels go through
    Triton's autotuner instead of the fixed configs."""
    return _env.AUTOTUNE and not _env.NO_AUTOTUNE


# --------------------------------------------------------------------------------------------
# Planning: which kernel runs, and why
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MatmulPlan:
    """The kernel a call will launch (``path``: "gluon", "tma", "ptr", "splitk", "empty"), the
    reason, and the config it launches with (None: nothing to launch, or the autotuner
    chooses under TKIT_AUTOTUNE)."""

    path: str
    reason: str
    config: Optional[MatmulConfig] = None  # noqa: UP045


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


def _path_config(path: str, M: int, N: int, K: int, elem_size: int, sms: int,
                 out_size: int | None = None, has_res: bool = False):
    """The config ``path`` launches with for an (M, K) @ (K, N) problem, overrides applied
    (a TMA config then fitted to shared memory, without a residual: the launcher fits it
    again with one; ``has_res`` only picks the Gluon config)."""
    if path == "splitk":
        return current(SplitKConfig.for_shape(M, N, K, sms)).fit_shared(elem_size)
    if autotuned():
        return None
    if path == "tma":
        return fit_shared(current(TmaConfig.for_shape(M, N, K, elem_size, sms)), elem_size,
                          out_size or elem_size)
    if path == "ptr":
        return current(PtrConfig.for_shape(M, N, K, elem_size))
    if path == "gluon":
        return current(GluonConfig.for_shape(M, N, K, sms, has_res))
    return None


GLUON_DTYPES = (torch.bfloat16, torch.float16)


def gluon_supported(a, b, out_dtype, bias=None, residual=None, activation=None,
                    scaled=False) -> str | None:
    """None when the Gluon GEMM (``gemm_hopper.py``) takes these operands, else why not (the
    checks that need no GPU first, the device last, so every reason shows on a machine
    without one). ``residual``: the call's, already expanded to the (M, N) output."""
    if a.dtype not in GLUON_DTYPES or b.dtype != a.dtype:
        return "operands are not bf16/fp16"
    if out_dtype != a.dtype:
        return f"output dtype {out_dtype} is not the operands' {a.dtype}"
    if scaled:
        return "scales are the Triton kernel's epilogue"
    if activation:
        return f"activation {activation!r} is the Triton kernel's epilogue"
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0 or K == 0:
        return "an empty dimension"
    ok_a, a_trans = _tma_ok(a)
    ok_b, b_trans = _tma_ok(b)
    if not ok_a or a_trans:
        return "a is not row-major with 16-byte aligned rows (TMA)"
    if not ok_b or not b_trans:
        return "b is not K-major with 16-byte aligned columns (the .t() of an (N, K) weight)"
    if (N * a.element_size()) % 16:
        return f"output rows of {N * a.element_size()} bytes are not a multiple of 16 (TMA)"
    if residual is not None and (residual.dtype != out_dtype or residual.stride(0) == 0
                                 or _tma_ok(residual) != (True, False)):
        return ("the residual is not a row-major (M, N) tensor of the output's dtype with "
                "16-byte aligned rows (read by TMA)")
    for name, t in (("a", a), ("b", b), ("bias", bias), ("residual", residual)):
        if t is not None and t.device.type != "cuda":
            return f"{name} is not on a CUDA device"
    cap = D.capability(a.device)
    if tuple(cap) != (9, 0):
        return f"compute capability {tuple(cap)} is not (9, 0)"
    return None


def _gluon_reason(a, b, out_dtype, bias, residual, activation, scaled) -> str | None:
    """None when the Gluon GEMM takes this call, else why not (a broadcast residual is
    expanded to the output first, as the launch sees it)."""
    M, N = a.shape[0], b.shape[1]
    if residual is not None and tuple(residual.shape) != (M, N):
        residual = residual.expand(M, N)
    return gluon_supported(a, b, out_dtype, bias, residual, activation, scaled)


def _skinny(M: int, N: int, K: int, sms: int, wide: bool) -> bool:
    """Whether ``matmul`` takes the split-K path: a weight of at least
    :data:`_SKINNY_MIN_WEIGHT` elements, and M <= :data:`_SKINNY_M`, or (``wide``: 16-bit
    operands without fp8 scales, where it was measured; the block-scaled fp8 mode reads this
    plan for its own kernels) M <= :data:`_SPLITK_MAX_M` with its 64-row tiles of 128 columns
    within one wave."""
    if K * N < _SKINNY_MIN_WEIGHT:
        return False
    return M <= _SKINNY_M or (wide and M <= _SPLITK_MAX_M
                              and C.cdiv(M, 64) * C.cdiv(N, 128) <= sms)


def plan(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None, *,
         path: str | None = None, bias: torch.Tensor | None = None,
         residual: torch.Tensor | None = None, activation: str | None = None,
         scaled: bool = False) -> MatmulPlan:
    """Which kernel ``matmul(a, b)`` runs for 2-D operands (after batch folding), why, and
    with which config. The epilogue (``bias``, ``residual``, ``activation``, ``scaled``: fp8
    scales) decides whether the Gluon GEMM can take the call on sm_90."""
    M, K = a.shape
    N = b.shape[1]
    out_dtype = out_dtype or _default_out_dtype(a.dtype)
    major, sms = D.capability(a.device)[0], D.sm_count(a.device)
    es = a.element_size()
    if M == 0 or N == 0:
        return MatmulPlan("empty", "empty output: nothing to launch")
    if path == "gluon":
        why = _gluon_reason(a, b, out_dtype, bias, residual, activation, scaled)
        if why is not None:
            raise ValueError(f"the Gluon GEMM does not apply to this call: {why}")
    if path is not None:
        return MatmulPlan(path, "forced",
                          _path_config(path, M, N, K, es, sms, out_dtype.itemsize,
                                       residual is not None))
    if K == 0:
        return MatmulPlan("ptr", "K = 0: the output is the epilogue of zeros",
                          _path_config("ptr", M, N, K, es, sms))
    long_k = SplitKConfig.long_k(M, N, K, sms) if es == 2 and not scaled else None
    if (long_k is not None and major >= 9 and _tma_ok(a) == (True, False) and _tma_ok(b)[0]
            and not C.needs_int64(a, b)):
        long_k = current(long_k)
        return MatmulPlan("splitk", f"M={M} with K={K}: {long_k.block_m} x {long_k.block_n} "
                          f"tiles in {long_k.split_k} K splits through TMA fill one wave",
                          long_k)
    if _skinny(M, N, K, sms, es == 2 and not scaled) and not C.needs_int64(a, b):
        # (the split-K kernel's index math is 32-bit; a weight past 2**31 elements takes the
        # pointer kernel's 64-bit path)
        return MatmulPlan("splitk", f"M={M} with a {K}x{N} weight: memory-bound, split-K "
                          "streams the weight",
                          _path_config("splitk", M, N, K, es, sms))
    ptr = None
    if major >= 9:
        out_es = out_dtype.itemsize
        if not (_tma_ok(a)[0] and _tma_ok(b)[0]):
            ptr = "an operand's strides or alignment are not TMA-compatible"
        elif (N * out_es) % 16:
            ptr = f"output rows of {N * out_es} bytes are not a multiple of 16 (TMA store)"
        else:
            tma = _path_config("tma", M, N, K, es, sms, out_es)
            why = ("TKIT_AUTOTUNE" if autotuned()
                   else _gluon_reason(a, b, out_dtype, bias, residual, activation, scaled))
            if why is None and tma.block_m < GLUON_BLOCK_M:
                # few 128-row tiles (M=256 with N=4096: 64 of 128 x 128 for 132 SMs): the
                # wave model's 64-row tiles fill the GPU, the Gluon kernel's would not
                why = f"the wave model takes {tma.block_m}-row tiles at M={M}"
            cfg = None
            if why is None:
                try:
                    cfg = _path_config("gluon", M, N, K, es, sms,
                                       has_res=residual is not None)
                except ValueError as e:  # a matmul_config field no Gluon config takes
                    why = f"matmul_config override: {e}"
            if why is None:
                waves = C.cdiv(C.cdiv(M, GLUON_BLOCK_M) * C.cdiv(N, cfg.block_n), sms)
                if K >= GLUON_LONG_K and waves >= 2:
                    why = (f"K={K} over {waves} waves of tiles: the Triton kernel measured as "
                           "fast or faster there")
            if why is None:
                return MatmulPlan("gluon", f"sm_{major}0, 16-bit operands, a row-major, b "
                                  "K-major: warp-specialized Gluon kernel", cfg)
            return MatmulPlan("tma", f"sm_{major}0 and TMA-compatible strides: persistent TMA "
                              f"kernel (not the Gluon one: {why})", tma)
    elif major == 0:
        ptr = "Triton interpreter: portable kernel"
    else:
        ptr = f"sm_{major}x: cp.async-pipelined pointer kernel"
    return MatmulPlan("ptr", ptr, _path_config("ptr", M, N, K, es, sms))


def _default_out_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if dtype in C.FP8_DTYPES else dtype


# --------------------------------------------------------------------------------------------
# matmul_glu: which kernel runs, and why
# --------------------------------------------------------------------------------------------
GLU_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def glu_ptr_config(M: int, N: int, K: int, elem_size: int = 2) -> PtrConfig:
    """The pointer GLU kernel's tile (``block_n``: output columns, each computed twice, gate
    and up): the plain pointer kernel's tile for the (M, 2N) product, half as wide."""
    cfg = PtrConfig.for_shape(M, 2 * N, K, elem_size)
    return dataclasses.replace(cfg, block_n=max(16, cfg.block_n // 2))


def glu_config_error(cfg: GluonConfig) -> str | None:
    """Why the Gluon kernel's gated build cannot take ``cfg`` (None: it can)."""
    if cfg.block_n not in GLUON_GLU_BLOCK_NS:
        return (f"block_n must be one of {GLUON_GLU_BLOCK_NS} for matmul_glu's Gluon kernel "
                f"(gate + up columns a tile), got {cfg.block_n}")
    if cfg.overlap and cfg.block_n != 128:
        return ("overlap needs block_n 128 for matmul_glu's Gluon kernel (two tiles' sums "
                f"live at once), got {cfg.block_n}")
    return None


def glu_gluon_reason(a, b, out_dtype, N: int) -> str | None:
    """None when the Gluon kernel's gated build takes ``matmul_glu(a, b)`` (2-D, b (K, 2N)),
    else why not."""
    why = gluon_supported(a, b, out_dtype)
    if why is None and (N * a.element_size()) % 16:
        why = f"output rows of {N * a.element_size()} bytes are not a multiple of 16 (TMA)"
    return why


def glu_plan(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None, *,
             path: str | None = None) -> MatmulPlan:
    """Which kernel ``matmul_glu(a, b)`` runs for a 2-D ``a`` (leading dims folded) and ``b``
    (K, 2N), why, and with which config (overrides applied). Paths: "gluon" (sm_90, the
    GEMM's Gluon kernel with the gated epilogue), "splitk" (M <= 64: the split-K GEMM over
    (K, 2N), the gated epilogue in the reduce; split 1 is the pointer kernel with the split
    tile), "ptr" (the pointer kernel with two accumulators), "empty"."""
    M, K = a.shape
    N = b.shape[1] // 2
    out_dtype = out_dtype or a.dtype
    major, sms = D.capability(a.device)[0], D.sm_count(a.device)
    es = a.element_size()
    if M == 0 or N == 0:
        return MatmulPlan("empty", "empty output: nothing to launch")
    if path == "gluon":
        why = glu_gluon_reason(a, b, out_dtype, N)
        if why is not None:
            raise ValueError(f"the Gluon GEMM does not apply to this call: {why}")
    if path is None and K == 0:
        path, reason = "ptr", "K = 0: the output is the epilogue of zeros"
    elif path is None and M <= _SKINNY_M and K * 2 * N >= _SKINNY_MIN_WEIGHT \
            and not C.needs_int64(a, b):
        path, reason = "splitk", (f"M={M} <= {_SKINNY_M} with a {K}x{2 * N} weight: "
                                  "memory-bound, split-K streams the weight")
    elif path is None and major >= 9:
        why = "TKIT_AUTOTUNE" if autotuned() else glu_gluon_reason(a, b, out_dtype, N)
        if why is None:
            try:
                cfg = current(GluonConfig.for_glu(M, N, K, sms))
                bad = glu_config_error(cfg)
                if bad is not None:
                    raise ValueError(bad)
            except ValueError as e:  # a matmul_config field no gated Gluon config takes
                why = f"matmul_config override: {e}"
        if why is None:
            return MatmulPlan("gluon", f"sm_{major}0, 16-bit operands, a row-major, b K-major: "
                              "warp-specialized Gluon kernel, gated epilogue", cfg)
        path, reason = "ptr", f"pointer kernel (not the Gluon one: {why})"
    elif path is None:
        path = "ptr"
        reason = ("Triton interpreter: portable kernel" if major == 0
                  else f"sm_{major}x: pointer kernel")
    else:
        reason = "forced"
    if path == "splitk":
        cfg = current(SplitKConfig.for_shape(M, 2 * N, K, sms)).fit_shared(es)
    elif path == "gluon":
        cfg = current(GluonConfig.for_glu(M, N, K, sms))
    elif path == "ptr":
        cfg = current(glu_ptr_config(M, N, K, es))
    else:
        raise ValueError(f"unknown matmul_glu path {path!r}")
    return MatmulPlan(path, reason, cfg)


#: the grouped TMA kernel's segment table (G + 2 entries, padded to a power of 2, held in
#: every program's registers): the largest size timed (G = 256, DeepSeek-V3's experts). More
#: groups take the pointer kernel (at 2048 entries the kernel compiles to 255 registers)
GROUPED_MAX_SEGMENTS = 512


def grouped_b_view(b: torch.Tensor) -> tuple[bool, int] | None:
    """(B_TRANS, row stride) of the 2-D matrix the grouped TMA kernel reads the (G, K, N)
    weights ``b`` as: (G N, K) when each b[g] is K-contiguous (an nn.Linear stack passed as
    ``w.transpose(1, 2)``), (G K, N) when N-contiguous; None where the groups are not one
    evenly strided matrix or TMA cannot describe its rows (16-byte row strides and base)."""
    G, K, N = b.shape
    es = b.element_size()
    for trans, inner, lead, rows in ((True, 1, 2, N), (False, 2, 1, K)):
        # the contiguous dimension must be one of more than one element (a K of 1 with N > 1
        # is read N-contiguous); a size-1 leading dimension's stride is its row length
        if b.stride(inner) != 1 or (inner == 1 and K == 1 and N > 1):
            continue
        stride = b.stride(lead) if (N if trans else K) > 1 else (K if trans else N)
        if G > 1 and b.stride(0) != rows * stride:
            continue
        if (stride * es) % 16 == 0 and D.aligned16(b):
            return trans, stride
    return None


def grouped_tma_reason(a: torch.Tensor, b: torch.Tensor, cfg: GroupedTmaConfig) -> str | None:
    """Why the grouped TMA kernel with ``cfg`` cannot take ``a`` (T, K) and ``b`` (G, K, N),
    or None where it can."""
    T, K = a.shape
    G, _, N = b.shape
    if a.dtype not in (torch.float16, torch.bfloat16):
        return f"{C.dtype_name(a.dtype)} operands (the TMA kernel takes 16-bit ones)"
    if K == 0 or N == 0:
        return "an empty K or N (no TMA box over it)"
    if G + 2 > GROUPED_MAX_SEGMENTS:
        return (f"G={G} groups (each program holds a table of G + 2 row segments, at most "
                f"{GROUPED_MAX_SEGMENTS})")
    if _tma_ok(a) != (True, False):
        return "a is not row-major with 16-byte aligned rows"
    view = grouped_b_view(b)
    if view is None:
        return "b's groups are not one TMA-describable matrix"
    if max(T, G * max(N, K)) >= 2**31:
        return "a dimension past TMA's 32-bit coordinates"
    if not view[0] and K % cfg.block_k:
        return f"K={K} is not a multiple of BLOCK_K={cfg.block_k} with N-contiguous b"
    return None


def grouped_plan(a: torch.Tensor, b: torch.Tensor, path: str | None = None) -> MatmulPlan:
    """Which kernel ``grouped_matmul(a, b, offsets)`` runs (the offsets play no part), why,
    and with which config: "grouped_tma" (the persistent TMA kernel: sm_90+, 16-bit
    operands, a row-major and the weights one TMA-describable matrix, :func:`grouped_b_view`)
    or "grouped" (the pointer kernel: any device, dtype and strides). ``path`` forces one
    (the TMA kernel's requirements still hold: a ValueError says which one fails)."""
    T, K = a.shape
    G, _, N = b.shape
    major, sms = D.capability(a.device)[0], D.sm_count(a.device)
    tma_cfg = current(GroupedTmaConfig.for_shape(T, N, G, sms))
    why = grouped_tma_reason(a, b, tma_cfg)
    if path == "grouped_tma":
        if why is not None:
            raise ValueError(f"the grouped TMA kernel does not apply to this call: {why}")
        return MatmulPlan("grouped_tma", "forced", tma_cfg)
    if path is None and why is None and major >= 9:
        return MatmulPlan("grouped_tma", f"sm_{major}0, 16-bit operands: persistent TMA "
                          "grouped kernel", tma_cfg)
    if path not in (None, "grouped"):
        raise ValueError(f"unknown grouped_matmul path {path!r}; known: grouped, grouped_tma")
    reason = ("forced" if path == "grouped" else
              "Triton interpreter: portable kernel" if major == 0 else
              f"sm_{major}x: pointer kernel" if major < 9 else f"pointer kernel (not TMA: {why})")
    return MatmulPlan("grouped", reason, current(GroupedConfig.for_shape(
        T, N, G, a.device, a.element_size())))
