"""Spec of the INT4 weight-only GEMM (tkit/kernels/matmul/int4.py).

Bench cases: group 128 at K=4096, N=14336 (Llama-3-8B's gate/up half) and
K=N=8192 for M in 1 and 16, and an M sweep 1..4096 at K=4096, N=14336 that shows where INT4
stops winning against cuBLAS bf16. Baselines: cuBLAS bf16 ``F.linear`` on the dequantized
weight (dequantized once per weight, outside the timing), torch's own int4 kernel
(``aten._weight_int4pack_mm``, tinygemm) where this torch build has it for the device, and
gemlite where it is installed (each factory returns None when its probe fails).
"""

from __future__ import annotations

import torch

import tkit
from tkit.kernels.matmul import int4 as I4
from tkit.registry import Case, OpSpec, lazy_composite, optional_module
from tkit.testing import tensors as T
from tkit.testing.tensors import make_tensor

st = optional_module("hypothesis.strategies")
S = optional_module("tkit.testing.strategies")

BF16 = torch.bfloat16
#: (K, N) of the issue's cases
INT4_SHAPES = ((4096, 14336), (8192, 8192))
INT4_SWEEP_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


# ---- reference and cost ------------------------------------------------------------------------
def ref_matmul_int4(a, qweight, scales, zeros=None, group_size=128, bias=None):
    """Dequantize in a's dtype (float64 for the reference), then ``a @ w.T + bias``."""
    w = I4.dequantize_int4(qweight, scales, zeros, group_size=group_size, dtype=a.dtype)
    y = a @ w.T
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y


def cost_matmul_int4(a, qweight, scales, zeros=None, group_size=128, bias=None):
    return I4.cost(a, qweight, scales, zeros, group_size=group_size, bias=bias)


# ---- inputs --------------------------------------------------------------------------------------
def _codes(K: int, N: int, device, seed: int) -> torch.Tensor:
    """Random packed codes int32 (K // 8, N); uninitialized under ``without_values``."""
    if getattr(T._state, "no_values", False) or torch.device(device).type == "meta":
        return torch.empty((K // 8, N), dtype=torch.int32, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(-2 ** 31, 2 ** 31 - 1, (K // 8, N), generator=gen, dtype=torch.int32,
                         device=device)


def _int4_case(M, N, K, group_size=128, dtype=BF16, *, zeros=True, bias=False, group="int4",
               label=None):
    def make(device):
        a = make_tensor((M, K), dtype, seed=1, device=device)
        q = _codes(K, N, device, seed=2)
        s = (make_tensor((K // group_size, N), torch.float32, seed=3, device=device).abs()
             * 0.01 + 0.001).to(dtype)
        z = (make_tensor((K // group_size, N), torch.float32, seed=4, device=device).abs()
             * 3).round().clamp(0, 15).to(dtype) if zeros else None
        kw = dict(group_size=group_size)
        if bias:
            kw["bias"] = make_tensor((N,), dtype, seed=5, device=device)
        return (a, q, s, z), kw

    lab = label or f"M={M} K={K} N={N} g{group_size}"
    return Case(lab, make, group, meta=dict(M=M, N=N, K=K, group_size=group_size))


def _bench_int4():
    cases = [_int4_case(M, N, K, group="decode") for K, N in INT4_SHAPES for M in (1, 16)]
    cases += [_int4_case(M, 14336, 4096, group="M sweep", label=f"sweep M={M} K=4096 N=14336")
              for M in INT4_SWEEP_M]
    return cases


def _quantized_case(M, N, K, group_size, dtype, *, symmetric=False, bias=False, label):
    def make(device):
        a = make_tensor((M, K), dtype, seed=1, device=device)
        w = make_tensor((N, K), torch.float32, seed=2, device=device)
        q, s, z = tkit.quantize_int4(w.to(dtype), group_size, symmetric=symmetric)
        kw = dict(group_size=group_size)
        if bias:
            kw["bias"] = make_tensor((N,), dtype, seed=5, device=device)
        return (a, q, s, z), kw

    return Case(label, make, "int4", meta=dict(M=M, N=N, K=K, group_size=group_size))


def _check_int4():
    f16 = torch.float16
    return [
        _quantized_case(1, 100, 256, 128, f16, label="M=1 N=100 K=256 g128"),
        _quantized_case(37, 70, 96, 32, f16, bias=True, label="37x70x96 g32 + bias"),
        _quantized_case(5, 48, 64, 16, BF16, symmetric=True, label="bf16 symmetric g16"),
        _quantized_case(2, 20, 512, 16, f16, label="M=2 split-K (8 splits in the interpreter)"),
        _quantized_case(80, 33, 64, 64, f16, label="M=80 compute tile"),
    ]


# ---- fuzz -------------------------------------------------------------------------------------
@lazy_composite
def int4_shapes(draw):
    """((M, K), (N, K)) with K a multiple of a drawn group size."""
    G = draw(st.sampled_from([16, 32, 64, 128]))
    K = G * draw(st.integers(1, max(1, 256 // G)))
    M = draw(S.dim_sizes(tile=16, max_size=80))
    N = draw(S.dim_sizes(tile=64, max_size=150, allow_zero=False))
    return (M, K), (N, K)


def _fuzz_quantize(w, K):
    G = 16
    for g in (128, 64, 32):
        if K % g == 0:
            G = g
            break
    return G


#: the kernels a fuzz example may force (``path``) beside the plan's choice by M (None): the
#: recipe's M (up to 80) never reaches the dequantize-then-GEMM path (M >= 256) otherwise
FORCED_PATHS = ("gemv", "tc", "tile", "dequant")


def _fuzz_bias(w, dtype, with_bias):
    if not with_bias:
        return None
    return make_tensor((w.shape[0],), torch.float32, seed=13, device=w.device).to(dtype)


def fuzz_int4_fn(a, w, symmetric=False, with_bias=False, path=None):
    """Quantize ``w`` (from its float32 values: the same codes whatever its dtype), then
    tkit.matmul_int4 (with a bias from a fixed seed); the reference dequantizes the same
    codes. ``path``: a kernel of :data:`FORCED_PATHS` forced through ``int4_config`` ("gemv"
    only where M <= 16, its limit), or None (the plan's)."""
    G = _fuzz_quantize(w, w.shape[1])
    q, s, z = tkit.quantize_int4(w.float(), G, symmetric=symmetric)
    bias = _fuzz_bias(w, a.dtype, with_bias)
    if path == "gemv" and a.shape[0] > 16:
        path = None
    with I4.int4_config(**({"path": path} if path else {})):
        return tkit.matmul_int4(a, q, s.to(a.dtype), None if z is None else z.to(a.dtype),
                                group_size=G, bias=bias)


def fuzz_int4_ref(a, w, symmetric=False, with_bias=False, path=None):
    G = _fuzz_quantize(w, w.shape[1])
    q, s, z = tkit.quantize_int4(w.float(), G, symmetric=symmetric)
    dt = a.dtype
    bias = _fuzz_bias(w, torch.float32 if dt == torch.float64 else dt, with_bias)
    if dt != torch.float64:  # the peer: scales as the kernel reads them, in a's dtype
        s = s.to(dt)
        z = None if z is None else z.to(dt)
    return ref_matmul_int4(a, q, s, z, G, bias)


def _fuzz_int4():
    return dict(fn=fuzz_int4_fn, reference=fuzz_int4_ref, shapes=int4_shapes(),
                dtypes=(torch.float16, BF16), layouts=("contiguous", "transposed", "sliced"),
                kwargs=st.fixed_dictionaries({
                    "symmetric": st.booleans(), "with_bias": st.booleans(),
                    "path": st.sampled_from((None, None) + FORCED_PATHS)}))


# ---- opcheck ----------------------------------------------------------------------------------
def _opcheck_int4():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    w = make_tensor((24, 64), torch.float16, seed=2, device=dev)
    q, s, z = tkit.quantize_int4(w, 32)
    a = make_tensor((3, 64), torch.float16, seed=1, device=dev)
    bias = make_tensor((24,), torch.float16, seed=3, device=dev)
    return torch.ops.tkit.matmul_int4.default, (a, q, s, z, 32, bias), {}


# ---- baselines ----------------------------------------------------------------------------------
_DEQUANT_CACHE: dict = {}


def _dequantized(qweight, scales, zeros, group_size, dtype):
    """The bf16 weight a baseline multiplies by, built once per packed weight (not timed)."""
    key = (qweight.data_ptr(), tuple(qweight.shape), scales.data_ptr(), group_size, dtype)
    w = _DEQUANT_CACHE.get(key)
    if w is None:
        if len(_DEQUANT_CACHE) > 4:
            _DEQUANT_CACHE.clear()
        w = I4.dequantize_int4(qweight, scales, zeros, group_size=group_size,
                               dtype=torch.float32).to(dtype)
        _DEQUANT_CACHE[key] = w
    return w


def _cublas_dequantized():
    def fn(a, qweight, scales, zeros=None, group_size=128, bias=None):
        w = _dequantized(qweight, scales, zeros, group_size, a.dtype)
        return torch.nn.functional.linear(a, w, bias)

    return fn


def to_tinygemm(qweight, scales, zeros, group_size, inner_k_tiles=8):
    """tkit's INT4 weight as torch's ``_weight_int4pack_mm`` operands: the packed weight of
    ``aten._convert_weight_to_int4pack`` (from (N, K // 2) uint8, even k in the high nibble)
    and scales_and_zeros (K // G, N, 2) bf16, where torch dequantizes ``(q - 8) * s + zero``:
    ours is ``(q - z) * s``, so zero = (8 - z) * s."""
    q = I4.unpack_int4(qweight).to(torch.int32)  # (N, K)
    # contiguous: unpack_int4 returns the (N, K) codes as a transposed view, and torch's
    # converter refuses a strided input
    packed = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous()
    wq = torch.ops.aten._convert_weight_to_int4pack(packed, inner_k_tiles)
    s = scales.float()
    z = zeros.float() if zeros is not None else torch.full_like(s, float(I4.SYM_ZERO))
    sz = torch.stack([s, (8.0 - z) * s], dim=-1).to(BF16).contiguous()
    return wq, sz


def _torch_int4():
    """torch's tinygemm int4 kernel, or None where this torch build or device lacks it."""
    if not torch.cuda.is_available():
        return None
    try:
        w = torch.randn(64, 256, device="cuda")
        q, s, z = tkit.quantize_int4(w, 128)
        wq, sz = to_tinygemm(q, s, z, 128)
        x = torch.randn(2, 256, device="cuda", dtype=BF16)
        y = torch.ops.aten._weight_int4pack_mm(x, wq, 128, sz)
        # the conversion above is written from torch's docs: a wrong one must not be timed
        if not torch.allclose(y.float(), ref_matmul_int4(x.float(), q, s, z, 128),
                              rtol=3e-2, atol=3e-1):
            return None
    except Exception:  # noqa: BLE001 (any failure means: not available here)
        return None
    cache: dict = {}

    def fn(a, qweight, scales, zeros=None, group_size=128, bias=None):
        key = (qweight.data_ptr(), scales.data_ptr(), group_size)
        if key not in cache:
            cache.clear()
            cache[key] = to_tinygemm(qweight, scales, zeros, group_size)
        wq, sz = cache[key]
        y = torch.ops.aten._weight_int4pack_mm(a.to(BF16), wq, group_size, sz)
        return y + bias if bias is not None else y

    return fn


def _gemlite_linear(q, s, z, group_size, dtype):
    """A gemlite W4A16 layer holding tkit's weight (codes (N, K), scales and zeros (N, K / G);
    gemlite dequantizes ``(q - z) * s`` as tkit does)."""
    import gemlite
    from gemlite.core import DType

    cls = getattr(gemlite.core, "GemLiteLinearTriton", None) or gemlite.GemLiteLinear
    K, N = q.shape[0] * 8, q.shape[1]
    dt = DType.BF16 if dtype == BF16 else DType.FP16
    layer = cls(4, group_size=group_size, in_features=K, out_features=N, input_dtype=dt,
                output_dtype=dt)
    zeros = z if z is not None else torch.full_like(s, float(I4.SYM_ZERO))
    layer.pack(I4.unpack_int4(q).contiguous(), s.t().contiguous().to(dtype),
               zeros.t().contiguous().to(dtype), None)
    return layer


def _gemlite():
    """gemlite (pip, a pure-Triton W4A16 library), or None where it is not installed or its
    API does not give tkit's numbers on a probe (the pure-Triton peer to stand beside)."""
    if not torch.cuda.is_available():
        return None
    try:
        w = torch.randn(256, 512, device="cuda")
        q, s, z = tkit.quantize_int4(w.to(torch.float16), 128)
        x = torch.randn(4, 512, device="cuda", dtype=torch.float16)
        y = _gemlite_linear(q, s, z, 128, torch.float16)(x)
        ref = ref_matmul_int4(x.float(), q, s.float(), z.float(), 128)
        if not torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-1):
            return None
    except Exception:  # noqa: BLE001 (not installed, or another API: not available here)
        return None
    cache: dict = {}

    def fn(a, qweight, scales, zeros=None, group_size=128, bias=None):
        key = (qweight.data_ptr(), scales.data_ptr(), group_size, a.dtype)
        if key not in cache:
            cache.clear()
            cache[key] = _gemlite_linear(qweight, scales, zeros, group_size, a.dtype)
        y = cache[key](a)
        return y + bias if bias is not None else y

    return fn


SPECS = [
    OpSpec(name="matmul_int4", family="matmul", fn=tkit.matmul_int4, reference=ref_matmul_int4,
           cost=cost_matmul_int4, bench_cases=_bench_int4, check_cases=_check_int4,
           fuzz=_fuzz_int4,
           baselines={"cuBLAS bf16 (F.linear, dequantized)": _cublas_dequantized,
                      "torch int4 (_weight_int4pack_mm)": _torch_int4,
                      "gemlite": _gemlite},
           opcheck=_opcheck_int4, bound="memory",
           doc="INT4 weight-only GEMM (W4A16), per-group scales and zeros"),
]
