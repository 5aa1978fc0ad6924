"""RoPE's configuration: dtypes, :class:`RopeConfig` with its ``for_device`` and the scoped
overrides (:func:`rope_config`). Plain Python, no kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tkit import _env
from tkit.kernels import _common as C

POS_DTYPES = (torch.int32, torch.int64)
CS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RopeConfig:
    """Launch parameters of ``_rope_kernel``.

    block_t: tokens a program (their positions and cos/sin rows are loaded once).
    block_h: heads a tile (a power of 2); the program walks q's, k's (and v's) heads in tiles.
    num_warps: warps a program.
    """

    block_t: int = 4
    block_h: int = 8
    num_warps: int = 4

    @classmethod
    def for_device(cls, rotary_dim: int, max_heads: int, append: bool = False) -> RopeConfig:
        """With the cache write (``append``): one token a program, 8 heads a tile, 4 warps,
        measured on the H200 at 16384 tokens x (32 + 8) x 128 into a page-16 bf16 cache at
        1.29x the shape below (docs/NOTES.md). Without it, the reasoning: a tile of
        block_t x block_h x R/2 pairs is ~4096 elements (8 KiB of bf16 in, 8 out: 16 values,
        two 16-byte vectors a thread per half with 4 warps) and a program walks 10-20 such
        tiles at the bench shape (16384 tokens x (32 + 8) heads x 128): 4096 programs, ~31 a
        SM, few registers (cos/sin and one tile), so many programs share an SM and hide each
        other's latency. The interpreter pays per program: few, large ones."""
        half = C.next_power_of_2(max(1, rotary_dim // 2))
        heads = C.next_power_of_2(max(1, max_heads))
        if _env.INTERPRET:
            return cls(block_t=16, block_h=min(heads, 64), num_warps=4)
        if append:
            return cls(block_t=1, block_h=min(heads, 8), num_warps=4)
        block_h = max(1, min(heads, 16, 2048 // half))
        block_t = max(1, min(16, 2048 // (half * block_h)))
        return cls(block_t=block_t, block_h=block_h, num_warps=4)


_OVERRIDES = C.ConfigOverrides(RopeConfig)


def rope_config(**overrides):
    """Override fields of :class:`RopeConfig` for the calls made inside (this thread only);
    an unknown field is a TypeError naming it. For experiments and tests; calls never tune."""
    return _OVERRIDES.scope(**overrides)


def current_config(rotary_dim: int, max_heads: int, append: bool = False) -> RopeConfig:
    cfg = RopeConfig.for_device(rotary_dim, max_heads, append)
    return _OVERRIDES.apply(cfg)


