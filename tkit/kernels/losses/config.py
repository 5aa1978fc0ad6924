"""The losses family's configuration: :class:`LossConfig` with its ``for_device`` and the scoped
overrides (:func:`loss_config`). Plain Python, no kernel."""

from __future__ import annotations

from dataclasses import dataclass

from tkit import _env
from tkit.kernels import _common as C


@dataclass(frozen=True)
class LossConfig:
    """Launch parameters of ``_ce_kernel`` (one row a program, two passes over the row).

    block_v: logits a chunk of the row (a power of 2); num_warps.
    fused_chunk_rows: rows of hidden states a chunk of ``fused_linear_cross_entropy`` (0: the
        rule in :func:`tkit.kernels.losses.chunk_rows`).
    Not swept on a GPU yet: 4096-wide chunks and 8 warps (16 values a thread, 16-byte
    accesses) for vocabularies of 32K to 256K, as Liger-Kernel's cross-entropy takes.
    """

    block_v: int = 4096
    num_warps: int = 8
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
