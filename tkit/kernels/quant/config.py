"""Dynamic quantization's configuration: the fp8/int8 ranges, :class:`QuantConfig` with its
``for_device`` and the scoped overrides (:func:`quant_config`). Plain Python, no kernel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tkit import _env
from tkit.kernels import _common as C

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0
#: the smallest fp8 scale (vLLM's ``min_scaling_factor``): an all-zero row stays finite
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantConfig:
    """Launch parameters of ``_quant_kernel``.

    max_tile: the most elements of one row a tile holds (a longer row is walked in chunks).
    tile: elements a program's tile should reach (short rows are packed ROWS to a program).
    sub_group: the width G of a tile's groups for per-token scales (a power of 2).
    num_warps: None = tile elements / 512 (16 values of each input a thread), 4 to 16.
    """

    max_tile: int = 16384
    tile: int = 4096
    sub_group: int = 128
    num_warps: Optional[int] = None  # noqa: UP045

    @classmethod
    def for_device(cls) -> QuantConfig:
        """The shape follows the norm kernels' measured rule
        (``tkit.kernels.reductions.config.row_config``): ~4 KiB of input a program, 16 values
        of an input a thread, rows of up to 32 KiB of bf16 held in registers. H200 sweep
        (docs/NOTES.md, "quant and append_kv"): at this default quantize_fp8 reads and writes
        4.0-4.3 TB/s at 16384 x 4096 / 14336 and silu_mul_quant 4.0-4.1 at 16384 x 14336;
        8 warps gained 4-7% on some of those cases and lost 3% on others, so the rule stays.
        rms_norm_quant's bits depend on the warps (its sum of squares). The interpreter pays
        per program: large tiles."""
        if _env.INTERPRET:
            return cls(max_tile=16384, tile=8192, sub_group=128, num_warps=4)
        return cls()


_OVERRIDES = C.ConfigOverrides(QuantConfig)


def quant_config(**overrides):
    """Override fields of :class:`QuantConfig` for the calls made inside (this thread only);
    an unknown field is a TypeError naming it. For experiments and tests; calls never tune."""
    return _OVERRIDES.scope(**overrides)


def current_config() -> QuantConfig:
    cfg = QuantConfig.for_device()
    return _OVERRIDES.apply(cfg)


