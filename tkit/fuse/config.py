"""The launch configuration of :mod:`tkit.fuse`'s generated kernels: :class:`FuseConfig` with
its ``for_device`` and the scoped overrides (:func:`fuse_config`). Plain Python, no kernel."""

from __future__ import annotations

from dataclasses import dataclass

from tkit.kernels import _common as C


@dataclass(frozen=True)
class FuseConfig:
    """Launch parameters of a generated kernel (a program a row, or a block of a row).

    values_per_thread: elements of the program's block that each thread holds; the warps are
    the block over 32 of them, clamped to 1..``max_warps``. Fewer warps a row mean a shorter
    cross-warp reduction (one barrier round trip each) and more programs an SM.
    max_warps: the most warps a program.
    block_cols: columns a program of a group without a reduction.
    """

    values_per_thread: int = 32
    max_warps: int = 16
    block_cols: int = 1024

    def __post_init__(self):
        C.check_power_of_2_fields(self, ("values_per_thread", "max_warps", "block_cols"))
        if self.max_warps > 32:
            raise ValueError(f"FuseConfig.max_warps must be at most 32, got {self.max_warps}")

    @classmethod
    def for_device(cls) -> FuseConfig:
        """32 values a thread (a 4096-wide row on 4 warps, an 8192-wide one on 8), at most 16
        warps, 1024-column blocks, as swept on the H200 at the ``fuse`` spec's programs
        (docs/NOTES.md): against 8 values a thread, Llama's RMSNorm 8192 x 4096 1.21x, the
        scaled softmax 4096 x 8192 1.07x, the GeGLU gate (no reduction) level (0.995x); 16 and
        64 values a thread, 8 warps at most and wider column blocks were level or slower."""
        return _DEFAULT

    def warps(self, block: int) -> int:
        """The warps of a program over ``block`` elements."""
        return max(1, min(self.max_warps, block // (32 * self.values_per_thread)))


_DEFAULT = FuseConfig()  # made once: every launch asks for it
_OVERRIDES = C.ConfigOverrides(FuseConfig)


def fuse_config(**overrides):
    """Override fields of :class:`FuseConfig` for the launches made inside (this thread
    only); an unknown field is a TypeError naming it. For experiments and tests."""
    return _OVERRIDES.scope(**overrides)


def current_config() -> FuseConfig:
    return _OVERRIDES.apply(FuseConfig.for_device())
