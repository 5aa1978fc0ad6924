"""tkit: Triton-first GPU kernels for LLM workloads, with CUDA escape hatches.

The public ops are imported lazily, so that ``import tkit`` stays cheap and the CLI can switch on
Triton's interpreter (``TRITON_INTERPRET=1``) on a machine without a GPU before any kernel module
is imported.
"""

from __future__ import annotations

import contextlib
import importlib

from tkit import _hooks

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    # elementwise
    "add": "tkit.kernels.elementwise",
    "sub": "tkit.kernels.elementwise",
    "mul": "tkit.kernels.elementwise",
    "residual_add": "tkit.kernels.elementwise",
    "silu": "tkit.kernels.elementwise",
    "gelu": "tkit.kernels.elementwise",
    "relu": "tkit.kernels.elementwise",
    "act_mul": "tkit.kernels.elementwise",
    "silu_mul": "tkit.kernels.elementwise",
    "gelu_mul": "tkit.kernels.elementwise",
    "cast": "tkit.kernels.elementwise",
    # reductions
    "softmax": "tkit.kernels.reductions",
    "log_softmax": "tkit.kernels.reductions",
    "rms_norm": "tkit.kernels.reductions",
    "layer_norm": "tkit.kernels.reductions",
    # GEMM
    "matmul": "tkit.kernels.matmul",
    "matmul_fp8": "tkit.kernels.matmul",
    "matmul_glu": "tkit.kernels.matmul",
    "grouped_matmul": "tkit.kernels.matmul",
    "matmul_int4": "tkit.kernels.matmul.int4",
    "quantize_int4": "tkit.kernels.matmul.int4",
    "dequantize_int4": "tkit.kernels.matmul.int4",
    "int4_from_awq": "tkit.kernels.matmul.int4",
    "int4_from_gptq": "tkit.kernels.matmul.int4",
    # attention
    "flash_attention": "tkit.kernels.attention",
    "flash_attention_varlen": "tkit.kernels.attention",
    "decode_attention": "tkit.kernels.decode",
    "append_kv": "tkit.kernels.decode",
    "merge_attention_states": "tkit.kernels.decode",
    # rotary embeddings
    "rope": "tkit.kernels.rope",
    "rope_cache": "tkit.kernels.rope",
    "rope_append_kv": "tkit.kernels.rope",
    # dynamic quantization and fused producers of quantized activations
    "quantize_fp8": "tkit.kernels.quant",
    "quantize_int8": "tkit.kernels.quant",
    "rms_norm_quant": "tkit.kernels.quant",
    "silu_mul_quant": "tkit.kernels.quant",
    # mixture of experts
    "moe": "tkit.kernels.moe",
    "moe_route": "tkit.kernels.moe",
    "moe_align": "tkit.kernels.moe",
    "moe_combine": "tkit.kernels.moe",
    # losses
    "cross_entropy": "tkit.kernels.losses",
    "fused_linear_cross_entropy": "tkit.kernels.losses",
    # sampling
    "sample": "tkit.kernels.sampling",
    "speculative_accept": "tkit.kernels.sampling",
}
_SUBMODULES = {"registry", "testing", "bench", "ir", "cuda_ext", "kernels", "models"}
# `tkit.ir` is the public face of tkit.ir_tools
_ALIASES = {"ir": "tkit.ir_tools"}

__all__ = sorted(list(_EXPORTS) + list(_SUBMODULES))


def _cuda_matmul():
    from tkit import cuda_ext

    call = getattr(cuda_ext, "matmul", None)
    if call is None:
        import functools

        call = functools.partial(cuda_ext.dispatch, "matmul")
    return call


def _cuda_fp8_block():
    from tkit.cuda_ext import gemm_fp8_block

    return gemm_fp8_block


def _cuda_int4():
    from tkit.cuda_ext import gemm_int4

    return gemm_int4


@contextlib.contextmanager
def _aot_compile_context(jit):
    from tkit.ir_tools.aot import _jit_language, _real_language

    with _real_language(), _jit_language(jit):
        yield


# the layers above the kernels plug in here (tkit/_hooks.py), so the kernels import none of them
_hooks.cuda_matmul = _cuda_matmul
_hooks.cuda_fp8_block = _cuda_fp8_block
_hooks.cuda_int4 = _cuda_int4
_hooks.aot_compile_context = _aot_compile_context


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(_ALIASES.get(name, f"tkit.{name}"))
    else:
        raise AttributeError(f"module 'tkit' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return __all__
