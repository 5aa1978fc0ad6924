"""The MoE family's configuration: :class:`MoeConfig` with its ``for_device`` and the scoped
overrides (:func:`moe_config`). Plain Python, no kernel."""

from __future__ import annotations

from dataclasses import dataclass

from tkit import _env
from tkit.kernels import _common as C

#: the most experts the router kernel holds in a row (a tile of BLOCK_T x next_pow2(E))
MAX_EXPERTS = 1024
#: the most experts a token may take
MAX_TOP_K = 32
SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoeConfig:
    """Launch parameters of the MoE kernels.

    route_elems: logits a router program holds (BLOCK_T = route_elems // next_pow2(E),
        at least 1 token); route_warps: its warps.
    combine_t, combine_h: the combine's tile (tokens x hidden columns); combine_warps.
    Not swept on a GPU yet: the router reads T x E logits (0.5 MB at 4096 tokens x 64
    experts in bf16), the combine T x k x H expert outputs, both memory-bound; tiles of
    ~4 K elements and 4 warps follow the elementwise kernels' rule (16-byte accesses, a few
    per thread).
    """

    route_elems: int = 2048
    route_warps: int = 4
    combine_t: int = 4
    combine_h: int = 1024
    combine_warps: int = 4

    @classmethod
    def for_device(cls) -> MoeConfig:
        if _env.INTERPRET:  # the interpreter pays per program: large tiles
            return cls(route_elems=8192, combine_t=16, combine_h=1024)
        return cls()


_OVERRIDES = C.ConfigOverrides(MoeConfig)


def moe_config(**overrides):
    """Override fields of :class:`MoeConfig` for the calls made inside (this thread only); an
    unknown field is a TypeError naming it. For experiments and tests; calls never tune."""
    return _OVERRIDES.scope(**overrides)


def current_config() -> MoeConfig:
    return _OVERRIDES.apply(MoeConfig.for_device())
