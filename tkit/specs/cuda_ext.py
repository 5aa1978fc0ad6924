"""Specs of the CUDA escape hatches (tkit/cuda_ext): the SGEMM ladder and the bf16 GEMMs.

These kernels run only on a CUDA GPU (no interpreter for raw CUDA), so ``check_cases`` is empty
on machines without one; the compile-only checks of tests/cuda_ext cover those machines.
"""

from __future__ import annotations

import functools

import torch

from tkit import cuda_ext
from tkit.registry import Case, Cost, OpSpec, eager_baseline, optional_module
from tkit.testing.tensors import make_tensor

# hypothesis is a test dependency: imported when a fuzz recipe is first used
st = optional_module("hypothesis.strategies")
S = optional_module("tkit.testing.strategies")

BF16 = torch.bfloat16


def ref_matmul(a, b):
    return torch.matmul(a, b)


def cost_gemm(a, b, *args, **kwargs):
    M, K = a.shape[-2], a.shape[-1]
    N = b.shape[-1]
    out_size = a.element_size() if a.dtype != torch.float64 else 8
    return Cost(bytes=(M * K + K * N) * a.element_size() + M * N * out_size,
                flops=2.0 * M * N * K)


def _gemm_case(M, N, K, dtype, seed=0):
    def make(device):
        a = make_tensor((M, K), dtype, seed=seed + 1, device=device)
        b = make_tensor((K, N), dtype, seed=seed + 2, device=device)
        return (a, b), {}

    return Case(f"{M}x{N}x{K} {str(dtype).replace('torch.', '')}", make, "square" if
                M == N == K else "rectangular", meta=dict(M=M, N=N, K=K))


GPU_ONLY = "raw CUDA, no interpreter: checked on a GPU; tests/cuda_ext compiles it on a CPU"


def _gpu_only(cases):
    return cases if torch.cuda.is_available() else []


def _fuzz(dtype, multiple: int):
    """(M, K), (K, N) pairs; K and N drawn as multiples of ``multiple`` where the kernel
    needs it (16-byte rows), M free."""
    def pair(m, k, n):
        return ((m, k), (k, n))

    dim = S.dim_sizes(tile=128, max_size=300, allow_zero=False)
    mult = st.integers(1, 40).map(lambda x: x * multiple)
    return dict(shapes=st.builds(pair, dim, mult, mult), dtypes=(dtype,),
                layouts=("contiguous",))


def _fuzz_sgemm(strict: bool):
    if not strict:
        return _fuzz(torch.float32, 1)
    tiles = st.integers(1, 3).map(lambda x: 128 * x)  # M, N multiples of the 128 tile
    ks = st.integers(1, 40).map(lambda x: 8 * x)
    return dict(shapes=st.builds(lambda m, k, n: ((m, k), (k, n)), tiles, ks, tiles),
                dtypes=(torch.float32,), layouts=("contiguous",))


def _triton_matmul():
    try:
        import tkit

        fn = tkit.matmul
    except Exception:
        return None
    return lambda a, b: fn(a, b, backend="triton")


def _cublas():
    return torch.matmul if torch.cuda.is_available() else None


_LADDER_DOC = {
    "naive": "one thread per output",
    "smem": "32x32 shared-memory tiles",
    "1d_blocking": "8 outputs a thread down a column",
    "2d_blocking": "8x8 outputs a thread, outer products in registers",
    "vectorized": "float4 loads, transposed A, bank-conflict-free shared reads",
    "cp_async": "double buffering, B through cp.async",
}


def _sgemm_spec(step):
    strict = cuda_ext.SGEMM_STEPS[step][3]
    check = [_gemm_case(256, 384, 136, torch.float32)]
    if not strict:
        check.append(_gemm_case(127, 129, 65, torch.float32))
    return OpSpec(
        name=f"cuda_sgemm_{step}", family="cuda_ext",
        fn=functools.partial(cuda_ext.sgemm, step=step), reference=ref_matmul, cost=cost_gemm,
        bench_cases=lambda: [_gemm_case(4096, 4096, 4096, torch.float32)],
        check_cases=lambda: _gpu_only(check),
        fuzz=functools.partial(_fuzz_sgemm, strict),
        baselines={"cuBLAS fp32": _cublas}, bound="compute", no_check_reason=GPU_ONLY,
        doc=f"SGEMM ladder step '{step}': {_LADDER_DOC[step]} (tutorials/05)")


def _bf16_cases(big: bool):
    if big:
        return [_gemm_case(4096, 4096, 4096, BF16), _gemm_case(8192, 8192, 8192, BF16),
                _gemm_case(4096, 14336, 4096, BF16), _gemm_case(1000, 4104, 1032, BF16)]
    return [_gemm_case(129, 264, 200, BF16), _gemm_case(256, 512, 1024, BF16)]


def _bf16_spec(name, fn, doc):
    return OpSpec(
        name=name, family="cuda_ext", fn=fn, reference=ref_matmul, cost=cost_gemm,
        bench_cases=lambda: _bf16_cases(True), check_cases=lambda: _gpu_only(_bf16_cases(False)),
        fuzz=lambda: _fuzz(BF16, 8),
        baselines={"cuBLAS": _cublas, "triton": _triton_matmul,
                   "torch (reference)": eager_baseline(ref_matmul)},
        bound="compute", doc=doc, no_check_reason=GPU_ONLY)


SPECS = [_sgemm_spec(step) for step in cuda_ext.SGEMM_STEPS] + [
    _bf16_spec("cuda_matmul_mma", cuda_ext.matmul_mma,
               "bf16 GEMM, mma.sync + ldmatrix + 3-stage cp.async, 256x128x64 (sm_80 path)"),
    _bf16_spec("cuda_matmul_wgmma", cuda_ext.matmul_wgmma,
               "bf16 GEMM, TMA + mbarrier + wgmma, warp-specialized, persistent (sm_90a path)"),
    _bf16_spec("cuda_matmul", cuda_ext.matmul,
               "bf16 GEMM through the compute-capability dispatch table"),
]
