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
    heads_at_once: a program's tile is all of q's heads (and all of k's) of its block_t tokens
    (block_h is then unused): every load of the block (q, k, v) is issued before the first
    store and before the cos/sin rows, whose address needs the positions, arrive.
    programs: 0, a program per token block; n > 0, a persistent grid of n programs per SM
    (at most one per block), each looping over token blocks (needs heads_at_once).
    stages: the persistent loop's software pipeline: the loads of stages - 1 blocks ahead
    in flight (through shared memory) while a block is rotated and stored; 1, none.
    prefetch: the persistent loop pipelined by hand instead: the next block's loads issued
    into registers before the current block's stores (needs programs; not with stages).
    """

    block_t: int = 4
    block_h: int = 8
    num_warps: int = 4
    heads_at_once: bool = False
    programs: int = 0
    stages: int = 1
    prefetch: bool = False

    def __post_init__(self):
        for name in ("block_t", "block_h", "num_warps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"RopeConfig.{name} must be a power of 2, got {v!r}")
        for name, lo in (("programs", 0), ("stages", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"RopeConfig.{name} must be an int >= {lo}, got {v!r}")
        if self.programs and not self.heads_at_once:
            raise ValueError("RopeConfig.programs (a persistent grid) needs heads_at_once=True")
        if self.prefetch and (not self.programs or self.stages > 1):
            raise ValueError("RopeConfig.prefetch pipelines the persistent loop by hand: it "
                             "needs programs > 0 and stages = 1")
        if self.stages > 1 and not self.programs:
            raise ValueError("RopeConfig.stages > 1 pipelines the persistent loop: it needs "
                             "programs > 0")

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


