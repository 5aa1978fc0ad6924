"""The attention family's configuration, shared by the Triton kernels and the Gluon Hopper
forward (``hopper.py`` with ``hopper_config.py`` and ``_hopper_kernels.py``), which import it
and not each other: constants, the autotune config lists with their shared-memory pruning and
defaults, :class:`AttentionConfig` (which forwards go to the Gluon kernel) with its scoped
overrides (:func:`attention_config`) and :func:`fwd_head_group` (the L2 sections of the tile
order). Plain Python, no kernel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton

from tkit.kernels import _common as C
from tkit.kernels import _device as D

if TYPE_CHECKING:  # the Gluon module imports this one
    from tkit.kernels.attention.hopper_config import HopperBwdConfig

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MAX_HEAD_DIM = 256
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------------------------
# Autotune configs
# --------------------------------------------------------------------------------------------
def _env_interpret() -> bool:
    return C._env.INTERPRET


def _fwd_smem(cfg, block_d: int, itemsize: int) -> int:
    # Q tile resident, K and V tiles multi-buffered over num_stages
    bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
    return (bm * block_d + cfg.num_stages * 2 * bn * block_d) * itemsize


def _bwd_smem(kind: str):
    # the dK/dV kernel keeps K, V resident and streams Q, dO over num_stages; the dQ kernel keeps
    # Q, dO resident and streams K, V; both stage a BLOCK_M x BLOCK_N tile for the dots (these
    # estimates match the compiler's figures for sm_90 within ~20%, on the high side)
    def smem(cfg, block_d: int, itemsize: int) -> int:
        bm, bn, s = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_stages
        if kind == "dkdv":
            tiles = 2 * bn * block_d + s * 2 * bm * block_d
        else:
            tiles = 2 * bm * block_d + s * 2 * bn * block_d
        return (tiles + bm * bn) * itemsize

    return smem


def _prune(smem_fn, tma=None):
    """The autotuner's early pruner: configs whose shared memory fits and, where K/V cannot be
    read through TMA, no TMA configs (``tma`` given: that answer, and ``itemsize`` may stand
    in for Q)."""
    def prune(configs, named_args, **kwargs):
        # the autotuner passes the positional arguments as ``named_args`` and the keyword ones
        # as ``kwargs``; tkit launches with keywords only, so look in both
        args = {**named_args, **kwargs}
        block_d = args["BLOCK_D"]
        itemsize = args["itemsize"] if "itemsize" in args else args["Q"].element_size()
        limit = D.smem_limit()
        use_tma = (tma if tma is not None else D.tma_ok(args["K"], args["V"])) \
            and not _env_interpret()
        padded = args.get("HEAD_DIM", block_d) != block_d
        kept = [c for c in configs if smem_fn(c, block_d, itemsize) <= limit
                and (use_tma or not c.kwargs.get("USE_TMA", False))
                and not (padded and _faults_when_padded(c))]
        if kept:
            return kept
        # never prune everything: fall back to a small tile
        extra = {k: False for k in ("USE_TMA", "WARP_SPEC") if k in configs[0].kwargs}
        return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 32, **extra}, num_stages=2,
                              num_warps=4)]

    return prune


def _faults_when_padded(c) -> bool:
    """128x64 two-stage pointer-load forward at a padded head dim: on the H200 (Triton 3.6,
    2026-11-30) D=192 (BLOCK_D=256) causal stopped with "CUDA error: misaligned address", a
    sticky error that fails everything after it in the process (non-causal passed; D=256 and
    D=128 ran in every sweep). Kept to unpadded head dims until the cause is known."""
    kw = c.kwargs
    return (kw.get("BLOCK_M") == 128 and c.num_stages == 2 and not kw.get("USE_TMA", False)
            and "WARP_SPEC" in kw)


# The forward's tiles (BLOCK_M, BLOCK_N, num_stages, num_warps, USE_TMA, WARP_SPEC), in order
# of preference: under TKIT_NO_AUTOTUNE the first that fits (shared memory, TMA-able inputs) is
# the default (``_fwd_default_config``): on the H200 in 16-bit, 128x64 s3 w8 ptr up to D=128,
# 128x64 s2 w8 ptr at D=256 (64x64 s3 w4 ptr would fit there too, with 224 KB of shared memory),
# and 64x64 s3 w4 ptr at head dims padded to 256 (``_faults_when_padded``).
_FWD_TILES = [
    (128, 64, 3, 8, False, True), (128, 64, 4, 8, False, True),
    (128, 64, 2, 8, False, False), (64, 64, 3, 4, False, False),
    (128, 64, 3, 8, True, True), (64, 64, 3, 4, True, False),
    (64, 32, 3, 4, True, False),
]


def _fwd_configs():
    # Measured on the H200 (B=4 H=16 S=4096 D=128 bf16, triton 3.6): non-causal, 128x64 s3 w8
    # with pointer loads and a warp-specialized unmasked loop is the fastest (468 TFLOP/s,
    # against 439-444 for the same tile through TMA or without warp specialization); causal,
    # 64x64 s3 w4 through TMA (431, against 415 for 128x64 s3 w8 ptr ws): the shorter query
    # tile wastes less work on the diagonal. BLOCK_N=128 (2 stages) lost (358-380), and two
    # stages with TMA descriptors crash Triton 3.6's ptxas (error -11), so neither is listed.
    # A fourth stage is offered to the pointer/warp-specialized tile (with TMA, 4 stages beat 3
    # by 1%). Warp specialization with 4 warps fails to compile (MLIR pass failure, not caught
    # by the autotuner), so only the 8-warp tiles use it.
    # WARP_SPEC is a no-op on sm_90 with Triton 3.6 (checked in the TTGIR: the loop keeps its
    # tt.warp_specialize attribute and no partition is made; the Hopper pass makes none for
    # this loop), so "ws" and plain configs are the same kernel and their measured gaps
    # (468 vs 439 in one run) are run-to-run noise.
    # A sweep with tile orders (H200, 2026-11-30, one timing each, +-8% noise):
    # 64x64 s3 w4 ptr led causal (446); at D=256, 128x64 s2 w8 ptr gave 481 / 489 (non-causal /
    # causal) against 363-388 for 64x32 s3 w4 TMA, the only tile listed there before. Compiled
    # for sm_90 (bf16, causal and not): 128x64 s2 w8 ptr takes 127-139 registers at D=64,
    # 188-224 at D=128, 255 at D=256 with 192 KB shared, no spills; 64x64 s3 w4 ptr 138-157,
    # 174-212, and 255 with 224 KB shared at D=256, no spills.
    configs = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "USE_TMA": tma, "WARP_SPEC": ws},
                      num_stages=s, num_warps=w)
        for bm, bn, s, w, tma, ws in _FWD_TILES
    ]
    if _env_interpret():
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "USE_TMA": False,
                               "WARP_SPEC": False})]
    # TKIT_NO_AUTOTUNE does not go through the autotuner (``_fwd_default_config``)
    return configs


def _first_kept(smem_fn, configs, block_d: int, itemsize: int, tma: bool,
                head_dim: int) -> dict:
    """The first config the autotuner's pruner keeps, as launch keywords (TKIT_NO_AUTOTUNE:
    Triton skips the pruner of an autotuner left with one config, so tkit applies it)."""
    c = _prune(smem_fn, tma=tma)(configs, {"BLOCK_D": block_d, "HEAD_DIM": head_dim},
                                 itemsize=itemsize)[0]
    return dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)


def _fwd_default_config(block_d: int, itemsize: int, tma: bool, head_dim: int) -> dict:
    """The config launched under TKIT_NO_AUTOTUNE: the first of ``_FWD_TILES`` that fits shared
    memory at this head dim (and needs no TMA where the inputs cannot take it)."""
    return _first_kept(_fwd_smem, _fwd_configs(), block_d, itemsize, tma, head_dim)


def _bwd_configs(kind: str):
    # dK/dV ("dkdv"): BLOCK_N keys resident, BLOCK_M queries streamed; dQ ("dq"): BLOCK_M
    # queries resident, BLOCK_N keys streamed. The two kernels are tuned apart: each wants its
    # resident tile large and its streamed tile small. Measured with one config for both (H200,
    # main shape, causal): 64x64 s3 w4 255 TFLOP/s, 64x128 s2 w8 224, 32x128 s3 w4 97. Compiled
    # for sm_90 at D=128: dK/dV 32x128 w4 keeps 976 bytes a thread on the stack (hence its 97)
    # and dQ 128x32 w4 168, so neither is offered; dQ 128x64 w8 s2 fits in 235 registers with
    # no stack. At D=256 only 32x64 s2 w4 and 64x64 s1 w8 fit shared memory (measured there:
    # 82 and 109 TFLOP/s). The first config is the default under TKIT_NO_AUTOTUNE.
    return C.interpreter_configs(_bwd_tiles(kind),
                                 triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}))


def _bwd_tiles(kind: str) -> list:
    if kind == "dkdv":
        tiles = [(64, 64, 3, 4), (64, 128, 2, 8), (64, 128, 3, 8), (64, 64, 1, 8), (32, 64, 2, 4)]
    else:
        tiles = [(64, 64, 3, 4), (128, 64, 2, 8), (128, 64, 3, 8), (64, 64, 1, 8), (32, 64, 2, 4)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_stages=s, num_warps=w)
            for bm, bn, s, w in tiles]


def _bwd_default_config(kind: str, block_d: int, itemsize: int) -> dict:
    """The config launched under TKIT_NO_AUTOTUNE: the first backward tile that fits shared
    memory at this head dim. (Triton skips an autotuner's pruner when one config is left, so
    keeping only the first config would launch 64x64 s3 at D=256: 263 KB of shared memory, an
    OutOfResources error on the H200.)"""
    return _first_kept(_bwd_smem(kind), _bwd_tiles(kind), block_d, itemsize, False, block_d)


_TUNE_KEY = ["seqlen_q", "seqlen_k", "HEAD_DIM", "MASK_LO", "MASK_HI", "SOFTCAP", "VARLEN"]


@dataclass(frozen=True)
class AttentionConfig:
    """The attention family's dispatch choices (the Triton kernels' tiles are the autotune
    lists above).

    hopper_fwd_cases: the forward cases (head_dim, causal) that go to the Gluon kernel of
    :mod:`tkit.kernels.attention.hopper` on sm_90 when it supports the inputs: where it
    measured faster than this module's autotuned Triton kernel (H200, B=4 H=16 S=4096 bf16, 3
    interleaved rounds, 2026-11-30, TFLOP/s Gluon / Triton): D=128, warp-specialized, 580.6 /
    479.1 non-causal and 569.8 / 426.4 causal; D=64 causal 375.2 / 362.4 (two CTAs an SM
    since, 0.87-0.93x cuDNN against the Triton kernel's 0.57-0.78x). D=64 non-causal: only
    where the persistent kernel's rule holds (more than a wave of tiles;
    ``hopper_config.declines``), the Triton kernel in one wave (2026-12-04, graph replays, us,
    Gluon / Triton: B4 x 4096 592.8 / 632.1, B8 x 2048 313.7 / 328.9). D=256 (2026-12-04, us,
    Gluon / Triton): B4 x 4096 causal 847.7 / 1149.8, non-causal 1540.3 / 2249.0, B32 x 512
    causal 209.0 / 291.6, GQA 16/8 causal 839.8 / 1148.0 (docs/NOTES.md).
    ``with attention_config(hopper_fwd_cases=frozenset()): ...`` keeps every forward on the
    Triton kernel."""

    hopper_fwd_cases: frozenset = frozenset({(128, False), (128, True), (64, True),
                                             (64, False), (256, False), (256, True)})
    # the backward cases (head_dim, causal) that go to the Gluon kernels of
    # :mod:`tkit.kernels.attention._hopper_bwd_kernels` on sm_90 when they support the inputs:
    # where whole training steps measured faster than the Triton backward at its tuned configs
    # (docs/NOTES.md); D=64 non-causal tied and keeps the Triton backward.
    hopper_bwd_cases: frozenset = frozenset({(128, False), (128, True), (64, True)})
    # the Gluon backward's launch (a ``hopper_config.HopperBwdConfig``); None: its
    # ``BWD_DEFAULTS`` entry for the head dim
    hopper_bwd: HopperBwdConfig | None = None


_OVERRIDES = C.ConfigOverrides(AttentionConfig)
_DEFAULT = AttentionConfig()


def attention_config(**overrides):
    """Override fields of :class:`AttentionConfig` for the calls made inside (this thread
    only), e.g. ``with attention_config(hopper_fwd_cases=frozenset()): ...``; an unknown field
    is a TypeError naming it. Calls inside skip the eager plans. For experiments and tests."""
    return _OVERRIDES.scope(**overrides)


def current_config() -> AttentionConfig:
    """The :class:`AttentionConfig` in force in this thread (the default, overrides applied)."""
    return _OVERRIDES.apply(_DEFAULT)


def overridden() -> bool:
    return _OVERRIDES.active()


# K and V bytes that the programs in flight should share in L2 (the H200 has 60 MB in two
# halves). FlashAttention-3's tile scheduler uses 32 MB; on the H200 (B4 S4096 H16 D128 bf16,
# 2 MB of K/V a head, median of 3 interleaved rounds, 2026-11-30) sections of 4 heads (8 MB)
# were at least as fast as 16 heads (32 MB) in every config, and both well ahead of no
# sections: 128x64 s3 w8 non-causal 475 / 466 / 446 TFLOP/s (4 / 16 / all heads), causal
# 419 / 414 / 389; 64x64 s3 w4 causal 414 / 412 / 381. One head (2 MB) was erratic (379-492).
_L2_KV_BUDGET = 8 << 20


def fwd_head_group(seqlen_k: int, head_dim: int, itemsize: int, group: int) -> int:
    """(batch, query head) pairs per section of the forward's tile order: as many key/value
    heads as fit ``_L2_KV_BUDGET`` (a power of 2, at least 1), times the GQA group (query heads
    of one key/value head read the same K/V)."""
    kv_bytes = 2 * max(seqlen_k, 1) * head_dim * itemsize
    n = max(1, _L2_KV_BUDGET // kv_bytes)
    return (1 << (n.bit_length() - 1)) * max(group, 1)


