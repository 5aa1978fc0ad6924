"""A mini fusion compiler: a PyTorch function of elementwise ops and last-dim reductions
traced, cut into groups, each group generated as one Triton kernel, and launched.

    f = tkit.fuse.fuse(lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w)
    y = f(x, w)                      # one launch; traced and compiled on the first call
    print(tkit.fuse.explain(f, x, w))  # the groups and the generated source

The stages, each a function of :mod:`tkit.fuse.compiler`:

1. **Trace** (``torch.fx.experimental.proxy_tensor.make_fx`` on the first call's tensors): the
   function as ATen ops with concrete shapes and dtypes.
2. **Group**: walking the ops in order, an op joins the open group when it is one the code
   generator knows (pointwise math, casts, comparisons, ``where``, ``masked_fill``; sum /
   mean / amax / amin and softmax / log_softmax over the last dim; views that only move a
   per-row value between its (..., 1) and (...) shapes) and its result has the group's
   shape, or that shape with a last dim of 1 or without it (a per-row value: a reduction's
   result and what is computed from it). Any other op (a matmul, any other view, a
   reduction over another dim) closes the group and runs in torch. A group with a reduction
   holds whole rows in registers (up to :data:`compiler.MAX_ROW` elements); a group without
   one walks its rows in blocks.
3. **Generate**: each group becomes one ``@triton.jit`` kernel, a program a row (and a block
   of columns without reductions), every input read through its own strides with broadcasting
   (0 strides, up to four dims), everything computed in float32 and rounded once at the
   group's stores (as Inductor does; an explicit cast to a 16-bit dtype in the function is
   rounded where it stands), without FMA contraction (each multiply and add rounds as
   torch's do: contracted, ``v - v.amax(-1, keepdim=True)`` with ``v = x * y`` is the
   product's rounding error at the max instead of 0). Only values read outside the group,
   or returned, are stored.
4. **Launch** through ``tkit.kernels._common.launch`` (the one launch point: Triton's
   interpreter on CPU, ``capture_launches`` for inspection), with the warps and column
   blocks of :class:`FuseConfig` (``with tkit.fuse.fuse_config(values_per_thread=16): ...``
   overrides them for the calls inside).

The compiled plan is cached per signature of the inputs (shapes, dtypes, devices). Calls are
for inference: a tensor that needs a gradient is refused (a ValueError) rather than silently
detached. What torch.compile does with the same graph, at much larger scale, is the reference
design: Inductor's pointwise and reduction templates, its fusion of a reduction with its
producers and consumers. This one is small enough to read in a sitting.
"""

from __future__ import annotations

from tkit.fuse.compiler import Fused, explain, fuse
from tkit.fuse.config import FuseConfig, fuse_config

__all__ = ["FuseConfig", "Fused", "explain", "fuse", "fuse_config"]
