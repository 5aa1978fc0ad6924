"""The losses family's configuration: :class:`LossConfig` with its ``for_device`` and the scoped
overrides (:func:`loss_config`). Plain Python, no kernel."""

from __future__ import annotations

from dataclasses import dataclass

from tkit import _env
from tkit.kernels import _common as C


@dataclass(frozen=True)
class LossConfig:
    """Launch parameters of ``_ce_kernel`` (a persistent grid of programs walking rows, two
    passes over each row).

    block_v: logits a chunk of the row (a power of 2); num_warps.
    programs_per_sm: the grid is this many programs an SM (at most one a row).
    fused_chunk_rows: rows of hidden states a chunk of ``fused_linear_cross_entropy`` (0: the
        rule in :func:`tkit.kernels.losses.chunk_rows`).
    Swept on the H200 (N8192 V128256 bf16, the training step; figures in docs/NOTES.md): what
    counts is 32 warps an SM (8 x 4, 16 x 2, 32 x 1 within 4% of each other; 16 warps an SM
    10-20% slower, 8 warps 60-110% slower); one program a row at 8 warps is within 4% of the
    default, so the rows in flight do not decide it. 8192-wide chunks, 16 warps, two programs
    an SM.
    """

    block_v: int = 8192
    num_warps: int = 16
    programs_per_sm: int = 2
    fused_chunk_rows: int = 0

    @classmethod
    def for_device(cls) -> LossConfig:
        if _env.INTERPRET:  # the interpreter pays per chunk: wide chunks
            return cls(block_v=8192, num_warps=4)
        return cls()


_OVERRIDES = C.ConfigOverrides(LossConfig)


def loss_config(**overrides):
    """Override fields of :class:`LossConfig` for the calls made inside (this thread only); an
    unknown field is a TypeError naming it. For experiments and tests; calls never tune."""
    return _OVERRIDES.scope(**overrides)


def current_config() -> LossConfig:
    return _OVERRIDES.apply(LossConfig.for_device())
