"""Sampling's configuration: the dtypes it takes, the Philox stream purposes, :class:`SampleConfig`
with its ``for_device`` and the scoped overrides (:func:`sample_config`). Plain Python, no
kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tkit import _env
from tkit.kernels import _common as C

LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PROB_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SEED_DTYPES = (torch.int64, torch.int32)
#: Philox stream purposes: sample's noise, speculative acceptance tests, speculative resampling
PURPOSE_SAMPLE, PURPOSE_ACCEPT, PURPOSE_RESAMPLE = 0, 1, 2


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SampleConfig:
    """Launch parameters of the sampling kernels (none changes a result).

    block: elements of a row per loop step (a power of 2 >= 16).
    num_warps: of the one-program-per-row kernels.
    pivots: pivots per search pass (a power of 2): more cut passes, cost compares.
    cap: candidates compacted for the exact in-register finish (a power of 2 >= 16).
    cap_chunk: columns of the pairwise [cap, cap_chunk] comparisons.
    span: z below max(z) - span is never kept (see the module docstring).
    max_iters: bound on search passes (the key interval closes within ~32 / log2(pivots+1)).
    split: rows with a scalar top_k <= cap in chunks (``_chunk_kernel`` then
        ``_merge_kernel``, see the module docstring): None = when the row spans more than
        one chunk, True = whenever top_k allows it, False = never (one program per row).
    split_block: columns of a chunk (a power of 2, 16 to 32768), held in registers by one
        program.
    split_warps: num_warps of the chunk programs.
    split_pivots: pivots per in-register search step of a chunk (a power of 2, >= 2).
    merge_warps: num_warps of the merge programs (None: num_warps; they run the passes of
        the one-program-per-row kernel on the rows they hand back).
    """

    block: int = 8192
    num_warps: int = 16
    pivots: int = 4
    cap: int = 256
    cap_chunk: int = 32
    span: float = 40.0
    max_iters: int = 48
    split: bool | None = None
    split_block: int = 4096
    split_warps: int = 4
    split_pivots: int = 8
    merge_warps: int | None = None

    @classmethod
    def for_device(cls, vocab: int) -> SampleConfig:
        """8192-element steps over 16 warps: 1.20x the 4096-element steps at batch 128,
        vocab 128256, temperature + top-k 50 + top-p 0.9 on the H200 (docs/NOTES.md; 32
        warps and 16384-element steps were slower); CAP 256 (top_k = 50 with room for the
        search to stop early). The interpreter pays per program and per step, tests want
        several blocks and both finishes on small vocabularies: 16-element steps, CAP 16.
        Split rows: 32 chunks of 4096 columns a row at vocab 128256, 4096 programs of 4
        warps (128 registers a thread on sm_90, no spills, 4 programs an SM): 141 us against
        152 for 8192-column chunks of 8 warps and 203 for the one-program-per-row path in
        the H200 sweep (8192 x 16 warps 227, 16384 x 16 202, 8 or 16 pivots no better; a
        register cap of 80 spilled and lost; docs/NOTES.md); in the interpreter 32-column
        chunks (several on small vocabularies)."""
        if _env.INTERPRET:
            return cls(block=16, num_warps=4, cap=16, cap_chunk=16, split_block=32,
                       split_warps=4, split_pivots=4)
        return cls()


_OVERRIDES = C.ConfigOverrides(SampleConfig)


def sample_config(**overrides):
    """Override fields of :class:`SampleConfig` for the calls made inside (this thread only);
    an unknown field is a TypeError naming it. For experiments and tests; calls never tune."""
    return _OVERRIDES.scope(**overrides)


def current_config(vocab: int) -> SampleConfig:
    cfg = SampleConfig.for_device(vocab)
    cfg = _OVERRIDES.apply(cfg)
    for name in ("block", "pivots", "cap", "cap_chunk", "split_block", "split_pivots"):
        v = getattr(cfg, name)
        if v < 1 or v & (v - 1):
            raise ValueError(f"SampleConfig.{name} must be a power of 2, got {v}")
    if cfg.block < 4:
        raise ValueError(f"SampleConfig.block must be >= 4, got {cfg.block}")
    if cfg.split_pivots < 2 or not 16 <= cfg.split_block <= 32768:
        raise ValueError(f"SampleConfig.split_pivots must be >= 2 and split_block in "
                         f"[16, 32768], got {cfg.split_pivots} and {cfg.split_block}")
    if cfg.split not in (None, True, False):
        raise TypeError(f"SampleConfig.split must be None, True or False, got {cfg.split!r}")
    return cfg


