"""What the layers above the kernels plug into them (arrows point down: tkit.kernels never
imports tkit.cuda_ext or tkit.ir_tools). ``tkit/__init__`` sets both on import, before any
kernel module can be imported; tests may replace them.

cuda_matmul          () -> callable(a, b): the GEMM of tkit.cuda_ext, for
                     ``tkit.matmul(..., backend="cuda")``; raises ImportError or AttributeError
                     when tkit.cuda_ext cannot give one.
cuda_fp8_block       () -> tkit.cuda_ext.gemm_fp8_block (its ``unavailable(out_dtype)`` and
                     ``matmul_fp8_block``): the block-scaled fp8 GEMM in CUDA that
                     ``tkit.kernels.matmul.fp8_block`` dispatches to; raises ImportError when
                     tkit.cuda_ext cannot give it.
cuda_int4            () -> tkit.cuda_ext.gemm_int4 (its ``supported``, ``unavailable`` and
                     ``matmul_int4_cuda``; ``gemv_supported``, ``gemv_config``,
                     ``gemv_unavailable`` and ``matmul_int4_gemv_cuda``): the INT4 decode
                     GEMM and GEMV in CUDA that ``tkit.kernels.matmul.int4`` dispatches to;
                     raises ImportError when tkit.cuda_ext cannot give it.
aot_compile_context  (jit function) -> context manager under which an ahead-of-time compile
                     (``tkit.kernels.attention.hopper.compile_sm90``) sees the real
                     triton.language even under TRITON_INTERPRET=1 (tkit.ir_tools.aot's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

cuda_matmul: Callable[[], Callable] | None = None
cuda_fp8_block: Callable[[], Any] | None = None
cuda_int4: Callable[[], Any] | None = None
aot_compile_context: Callable[[Any], contextlib.AbstractContextManager] | None = None


def compile_context(jit) -> contextlib.AbstractContextManager:
    """The registered :data:`aot_compile_context` for ``jit``, a no-op when none is set."""
    return contextlib.nullcontext() if aot_compile_context is None else aot_compile_context(jit)
