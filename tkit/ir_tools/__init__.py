"""tkit.ir: see what the compiler did, with or without a GPU.

    tkit.ir.show(tkit.add, stage="ptx", arch="sm_90")         # one stage, printed and returned
    tkit.ir.summary("rms_norm", arch="sm_80")                  # layouts, stages, regs, histograms
    tkit.ir.summary(my_kernel, a, b, c, n, BLOCK=1024, num_warps=4)   # any @triton.jit kernel
    tkit.ir.diff(tkit.ir.compile(k, *args, num_stages=2), tkit.ir.compile(k, *args, num_stages=4))
    tkit.ir.source_map(ir, "tl.dot")                           # PTX/SASS of one Python line
    tkit.ir.butterfly_asymmetries(ir.asm["ptx"])               # lanes left with unequal copies

``target`` is a tkit op (function or registry name) or a Triton kernel; arguments may be real
tensors, meta tensors or ``(shape, dtype)`` pairs; with none, an op uses its first benchmark
case. Compilation is ahead of time (``triton.compile`` for ``GPUTarget("cuda", cap, 32)``), so
everything works on a machine without a GPU; SASS comes from the cuobjdump/nvdisasm that the
Triton wheel carries. See ``tkit/ir_tools/aot.py`` for how launches are captured and
specialized.
"""

from __future__ import annotations

import sys

from tkit.ir_tools.aot import STAGES, CompiledIR, IRError, parse_arch
from tkit.ir_tools.aot import compile as _compile
from tkit.ir_tools.lanes import butterfly_asymmetries
from tkit.ir_tools.layouts import Layout, describe, parse_layout, parse_layouts
from tkit.ir_tools.summary import (
    Diff,
    Summary,
    diff_compiled,
    occupancy,
    ptx_histogram,
    sass_histogram,
    summarize,
)
from tkit.ir_tools.summary import source_map as _source_map

__all__ = ["compile", "show", "summary", "diff", "source_map", "layouts", "IRError",
           "CompiledIR", "Summary", "Diff", "Layout", "STAGES", "parse_arch", "parse_layout",
           "parse_layouts", "describe", "occupancy", "ptx_histogram", "sass_histogram",
           "butterfly_asymmetries"]


def compile(target, *args, arch=None, config=None, **kwargs) -> CompiledIR:
    """Compile ``target`` for ``arch`` and return a :class:`CompiledIR` holding every stage.

    Keyword arguments beyond ``arch``/``config``: ``launch`` (which kernel of an op that
    launches several), ``case`` (which benchmark case of an op when no arguments are given),
    ``shapes`` (``[(shape, dtype or None), ...]`` replacing the op's tensor arguments in order);
    the rest go to the op or, for a kernel, are its launch arguments (constexprs,
    ``num_warps``, ``num_stages``).
    """
    if isinstance(target, CompiledIR):
        return target
    return _compile(target, *args, arch=arch, config=config, **kwargs)


def show(target, *args, stage: str = "ttgir", arch=None, config=None, locs: bool = False,
         file=None, **kwargs) -> str:
    """Print and return one stage (``ttir``, ``ttgir``, ``llir``, ``ptx``, ``sass``,
    ``source``) of the compiled kernel. ``locs=True`` keeps MLIR location annotations."""
    if stage not in STAGES:
        CompiledIR.stage(None, stage)  # raises IRError with a suggestion
    ir = compile(target, *args, arch=arch, config=config, **kwargs)
    text = ir.stage(stage, locs=locs)
    print(text, file=file or sys.stdout)
    return text


def summary(target, *args, arch=None, config=None, echo: bool = True, file=None,
            **kwargs) -> Summary:
    """A structured report of what the compiler decided (printed readably unless
    ``echo=False``): layouts in words, num_warps/num_stages and the evidence of pipelining,
    registers/spills/stack/shared memory and the occupancy they allow, PTX and SASS
    histograms, and the main loop (the longest backward branch of the SASS): its instruction
    count and histogram (barriers, shared and local memory, MMAs) with the TTGIR's layout
    conversions inside loops, the per-iteration costs a whole-kernel count hides."""
    ir = compile(target, *args, arch=arch, config=config, **kwargs)
    s = summarize(ir)
    if echo:
        print(s, file=file or sys.stdout)
    return s


def diff(a, b, stage: str = "ttgir", echo: bool = True, file=None) -> Diff:
    """Two compiles side by side (configs, arches or kernels): summary differences first,
    then a unified diff of ``stage``. ``a`` and ``b`` are :class:`CompiledIR` (from
    :func:`compile`)."""
    for x, n in ((a, "a"), (b, "b")):
        if not isinstance(x, CompiledIR):
            raise IRError(f"diff: {n} must be a tkit.ir.compile(...) result, "
                          f"got {type(x).__name__}")
    d = diff_compiled(a, b, stage)
    if echo:
        print(d, file=file or sys.stdout)
    return d


def source_map(target, line, *args, arch=None, config=None, echo: bool = True, file=None,
               **kwargs) -> dict:
    """PTX and SASS that one Python line of the kernel produced. ``line`` is an absolute line
    number in the kernel's file or a piece of the line's text (``"tl.dot"``); ``target`` is a
    :class:`CompiledIR` or anything :func:`compile` accepts (with its arguments)."""
    ir = compile(target, *args, arch=arch, config=config, **kwargs)
    m = _source_map(ir, line)
    if echo:
        out = file or sys.stdout
        print(f"line {m['line']}: {m['text']}", file=out)
        print(f"-- PTX ({len(m['ptx'])} instructions)", file=out)
        print("\n".join(m["ptx"]), file=out)
        print(f"-- SASS ({len(m['sass'])} instructions)", file=out)
        print("\n".join(m["sass"]), file=out)
    return m


def layouts(target, *args, arch=None, config=None, **kwargs) -> list[Layout]:
    """The layouts of the compiled TTGIR, parsed and described in words."""
    ir = compile(target, *args, arch=arch, config=config, **kwargs)
    return parse_layouts(ir.asm["ttgir"])
