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

    block_t: int = 1
    block_h: int = 8
    num_warps: int = 4

    def __post_init__(self):
        C.check_power_of_2_fields(self, ("block_t", "block_h", "num_warps"))

    @classmethod
    def for_device(cls, rotary_dim: int, max_heads: int, append: bool = False) -> RopeConfig:
        """One token a program, 4 warps, and head tiles of ~512 rotated pairs (8 heads at
        rotary dim 128; 8 heads whatever the rotary dim with the cache write, as measured):
        measured on the H200 at 16384 tokens x (32 + 8) x 128 bf16 (docs/NOTES.md). In
        place 1.009x and 1.010x the two tokens x 16 heads it replaced, in two sweeps (16
        programs a SM at 32 registers, against 9); with the cache write 1.29x tiles of 4096
        pairs. Every other tile or grid tried (more tokens or heads a tile, 2 or 8 warps, a
        token's heads all at once, persistent grids pipelining the next token's loads) was
        level or slower. The interpreter pays per program: few, large ones."""
        half = C.next_power_of_2(max(1, rotary_dim // 2))
        heads = C.next_power_of_2(max(1, max_heads))
        if _env.INTERPRET:
            return cls(block_t=16, block_h=min(heads, 64), num_warps=4)
        if append:
            return cls(block_t=1, block_h=min(heads, 8), num_warps=4)
        return cls(block_t=1, block_h=max(1, min(heads, 512 // half)), num_warps=4)


_OVERRIDES = C.ConfigOverrides(RopeConfig)


def rope_config(**overrides):
    """Override fields of :class:`RopeConfig` for the calls made inside (this thread only);
    an unknown field is a TypeError naming it. For experiments and tests; calls never tune."""
    return _OVERRIDES.scope(**overrides)


def current_config(rotary_dim: int, max_heads: int, append: bool = False) -> RopeConfig:
    cfg = RopeConfig.for_device(rotary_dim, max_heads, append)
    return _OVERRIDES.apply(cfg)


