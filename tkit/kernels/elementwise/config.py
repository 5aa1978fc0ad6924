"""The elementwise family's configuration: the ops and activations it knows, the fp8 range, and
the autotune configs of the flat kernel. Plain Python, no kernel."""

from __future__ import annotations

import triton

from tkit.kernels import _common as C

# Ops and their arity. "cast" is the identity before the store's conversion.
BINARY_OPS = ("add", "sub", "mul")
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")
FP8_MAX = 448.0  # largest finite float8_e4m3fn


# --------------------------------------------------------------------------------------------
# Autotune configs
# --------------------------------------------------------------------------------------------
def _flat_configs():
    # A block of 1024..8192 elements per program: at 16-byte accesses, 4 to 16 vectors per thread
    # with 4 or 8 warps, enough loads in flight to cover HBM latency. Smaller blocks only add
    # programs; larger ones spill registers on the 3-operand ops.
    # On the H200 every config from 1024 to 8192 elements with 4-16 warps lands within 1% of
    # torch.compile at 16384 x 8192 bf16, and an "evict_first" hint on the loads cost 4-5% in
    # every config, so there is none (docs/NOTES.md, first measurements). The first config is
    # the default when autotuning is off (it was among the fastest for add, silu_mul and the
    # fp8 cast).
    configs = [triton.Config({"BLOCK": 2048}, num_warps=4)] + [
        triton.Config({"BLOCK": block}, num_warps=warps)
        for block, warps in ((1024, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 4), (8192, 16))
    ]
    # the interpreter pays per program, not per element: one large block
    return C.interpreter_configs(configs, triton.Config({"BLOCK": 4096}, num_warps=4))


