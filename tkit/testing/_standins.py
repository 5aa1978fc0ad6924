"""Stand-ins for Triton's compiled kernels where the C++ launch executor reads them (its CPU
tests in tests/kernels/test_plan.py and ``benchmarks/host_overhead.py --cplan``): the signature
and the host descriptors' metadata that Triton's compile would give a launch's arguments."""

from __future__ import annotations

import torch

from tkit.kernels._plan import _is_descriptor


def signature_type(v) -> str:
    """The signature type Triton gives a launch argument (every tensor a ``*bf16`` pointer: the
    executor reads only that it is a pointer)."""
    if isinstance(v, torch.Tensor):
        return "*bf16"
    if type(v) is bool:
        return "i1"
    if type(v) is int:
        return "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
    if type(v) is float:
        return "fp32"
    if _is_descriptor(v):
        return f"tensordesc<bf16[{', '.join(str(b) for b in v.block_shape)}]>"
    return "constexpr"  # None, strings, dtypes


def tensordesc_meta(v) -> dict:
    """The descriptor metadata Triton's compile gives a 16-bit tensor's host descriptor with
    128-byte swizzling (the box's inner dimension cut to 128 bytes), as for the Gluon GEMM."""
    es = v.base.element_size()
    return dict(swizzle=3, elem_size=es, elem_type=10, fp4_padded=False,
                block_size=[*v.block_shape[:-1], min(v.block_shape[-1], 128 // es)])


def launch_signature(args) -> tuple[dict, list | None]:
    """(signature by argument index, the host descriptors' metadata or None) of a launch."""
    sig = {i: signature_type(v) for i, v in enumerate(args)}
    meta = [tensordesc_meta(v) for i, v in enumerate(args) if sig[i].startswith("tensordesc")]
    return sig, meta or None
