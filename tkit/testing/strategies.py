"""Hypothesis strategies for kernel inputs: sizes that break tiling, dtypes, memory layouts."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from tkit.testing.tensors import LAYOUTS

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def dim_sizes(*, tile: int = 128, max_size: int = 300,
              allow_zero: bool = True) -> st.SearchStrategy:
    """One dimension's size, biased to the values that break kernels: 0, 1, small odd numbers,
    tile - 1 / tile / tile + 1, non-powers of two, and anything up to ``max_size``."""
    special = [1, 2, 3, 5, 7, 17, 33, 65, 100, 127, tile - 1, tile, tile + 1]
    special = sorted({s for s in special if 1 <= s <= max(max_size, 1)})
    nonzero = st.one_of(st.sampled_from(special), st.integers(1, max(max_size, 1)))
    if not allow_zero:
        return nonzero
    # an empty dimension in about one draw in twenty: enough to test it, not to waste examples
    return st.integers(0, 19).flatmap(lambda k: st.just(0) if k == 0 else nonzero)


#: draw GPU-sized shapes (see :func:`shapes`); set it False for interpreter-sized ones where
#: edge sizes matter and large ones only cost time (runs under compute-sanitizer)
GPU_SIZES: bool = torch.cuda.is_available()
#: the GPU-sized bounds of :func:`shapes` (a campaign that runs thousands of examples lowers
#: the element count: inputs are drawn on the host, and 32-bit offsets are checked apart)
GPU_MAX_SIZE: int = 3000
GPU_MAX_NUMEL: int = 1 << 20


@st.composite
def shapes(draw, *, min_dims: int = 1, max_dims: int = 4, tile: int = 128,
           max_size: int | None = None, max_numel: int | None = None, allow_zero: bool = True):
    """A shape whose dims come from :func:`dim_sizes`, kept under ``max_numel`` elements.
    Defaults: interpreter-sized on CPU (300 per dim, 16K elements), larger on a GPU (3000 per
    dim, 1M elements)."""
    max_size = max_size or (GPU_MAX_SIZE if GPU_SIZES else 300)
    max_numel = max_numel or (GPU_MAX_NUMEL if GPU_SIZES else 1 << 14)
    nd = draw(st.integers(min_dims, max_dims))
    dims = []
    for _ in range(nd):
        numel = 1
        for d in dims:
            numel *= max(d, 1)
        cap = max(1, min(max_size, max_numel // numel))
        dims.append(draw(dim_sizes(tile=tile, max_size=cap, allow_zero=allow_zero)))
    return tuple(dims)


@st.composite
def broadcast_shapes(draw, shape):
    """A shape that broadcasts to ``shape``: some dims set to 1, some leading dims dropped."""
    drop = draw(st.integers(0, len(shape)))
    out = list(shape[drop:])
    for i in range(len(out)):
        if draw(st.booleans()) and draw(st.booleans()):
            out[i] = 1
    return tuple(out)


@st.composite
def binary_shapes(draw, **shape_kwargs):
    """(shape_a, shape_b) that broadcast together, either way round."""
    full = draw(shapes(**shape_kwargs))
    other = draw(st.one_of(st.just(full), broadcast_shapes(full)))
    return (full, other) if draw(st.booleans()) else (other, full)


def dtypes(choices=FLOAT_DTYPES) -> st.SearchStrategy:
    return st.sampled_from(tuple(choices))


def layouts(choices=LAYOUTS) -> st.SearchStrategy:
    return st.sampled_from(tuple(choices))


def seeds() -> st.SearchStrategy:
    return st.integers(0, 2**31 - 1)


def gpu_dtypes() -> tuple:
    """bfloat16 is left out of interpreter runs for kernels that do arithmetic on bf16 values
    (the interpreter computes bf16 as raw integers); elementwise kernels upcast first, so they
    can take all three."""
    return FLOAT_DTYPES if torch.cuda.is_available() else (torch.float32, torch.float16)
