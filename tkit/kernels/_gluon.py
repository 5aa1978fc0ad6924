"""Names of Gluon's Hopper API that moved between the Triton versions tkit supports (pyproject's
range), resolved once for every Gluon kernel module. 3.9 renamed the TMA copies to
``async_load`` / ``async_store`` (the old names are stubs that raise) and replaced
``gl.thread_barrier()`` by ``gl.barrier()`` (the same CTA-wide barrier op); 3.6 has only the
old names. Kernels call these aliases, never the moved names directly."""

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

if hasattr(tma, "async_load"):
    tma_load, tma_store = tma.async_load, tma.async_store
else:
    tma_load, tma_store = tma.async_copy_global_to_shared, tma.async_copy_shared_to_global
cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier


def compile_sm90(kernel, signature: dict, constexprs: dict, num_warps: int, maxnreg=None):
    """Compile a Gluon kernel for sm_90 ahead of time (no GPU needed): ``signature`` names
    every argument's type in order ("constexpr" for the compile-time ones), ``constexprs``
    their values by name. Returns Triton's compiled kernel (``.asm`` holds ``ttgir``, ``ptx``,
    ``cubin``; ``.metadata.shared`` the shared memory in bytes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from tkit import _hooks
    from tkit._compat import compile_options

    names = list(signature)
    src = GluonASTSource(kernel, signature,
                         {(names.index(k),): v for k, v in constexprs.items()})
    options = compile_options(dict(num_warps=num_warps))
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    # under TRITON_INTERPRET=1 the combine functions of gl.max/gl.sum (triton.language's own
    # @jit helpers) are interpreter objects: tkit.ir_tools.aot's context compiles against the
    # real language
    with _hooks.compile_context(kernel):
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
