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
