"""Launchers for the CUDA GEMMs in csrc/: the SGEMM ladder, mma.sync (sm_80) and wgmma (sm_90a).

Cost of every GEMM here: 2*M*N*K flops; (M*K + K*N) * in_itemsize + M*N * out_itemsize bytes
at the least. At 4096^3 bf16 that is 137 GFLOP over 100 MB: 1365 flop/byte, far above the
H200's ridge point (~165 flop/byte: 700 TFLOP/s over 4.25 TB/s), so these kernels are judged by
TFLOP/s against cuBLAS; fp32 on CUDA cores (67 TFLOP/s peak on the H200) is judged the same way.

Each launcher validates every tensor (dtype, device, shape, strides, 16-byte alignment) before
anything is compiled or launched, allocates the output through ``tkit.kernels._common.empty``
(so tests can poison it) and launches on torch's current stream.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from tkit.cuda_ext import _loader
from tkit.kernels import _common

# name -> (kernel, block, tile (BM, BN), needs divisible M, N by tile and K by 8)
SGEMM_STEPS = {
    "naive": ("sgemm_naive", (32, 8), (8, 32), False),
    "smem": ("sgemm_smem", (32, 32), (32, 32), False),
    "1d_blocking": ("sgemm_1d_blocking", (512,), (64, 64), False),
    "2d_blocking": ("sgemm_2d_blocking", (256,), (128, 128), False),
    "vectorized": ("sgemm_vectorized", (256,), (128, 128), True),
    "cp_async": ("sgemm_cp_async", (256,), (128, 128), True),
}

MMA_SM80 = dict(source="gemm_mma_sm80.cu", bm=128, bn=128, bk=32, stages=4, threads=256)
WGMMA_SM90 = dict(source="gemm_wgmma_sm90.cu", bm=128, bn=256, bk=64, stages=4, threads=384)
WGMMA_SM90["smem"] = WGMMA_SM90["stages"] * (
    WGMMA_SM90["bm"] * WGMMA_SM90["bk"] * 2 + WGMMA_SM90["bk"] * WGMMA_SM90["bn"] * 2
) + 1024 + 256  # stages + alignment slack + barriers
MMA_SM80["smem"] = MMA_SM80["stages"] * (MMA_SM80["bm"] + MMA_SM80["bn"]) * MMA_SM80["bk"] * 2


# ---- validation ------------------------------------------------------------------------------
def check_gemm_operands(a, b, dtypes, *, need_multiple_of_8: bool = True) -> tuple[int, int, int]:
    """Validate ``a`` [M, K] and ``b`` [K, N] for the CUDA GEMMs; errors name the argument."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in dtypes:
            names = ", ".join(_common.dtype_name(d) for d in dtypes)
            raise TypeError(f"{name} has dtype {_common.dtype_name(t.dtype)}; the CUDA path "
                            f"takes {names}")
        if t.ndim != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"a is {_common.dtype_name(a.dtype)} but b is "
                        f"{_common.dtype_name(b.dtype)}")
    if a.device != b.device:
        raise ValueError(f"b is on {b.device} but a is on {a.device}")
    M, K = a.shape
    K2, N = b.shape
    if K2 != K:
        raise ValueError(f"a is {M}x{K} but b is {K2}x{N}: inner dimensions differ")
    for name, t in (("a", a), ("b", b)):
        if t.numel() and (t.stride(1) != 1 or t.stride(0) != t.shape[1]):
            raise ValueError(f"{name} must be row-major contiguous (strides ({t.shape[1]}, 1)), "
                             f"got strides {t.stride()}; call .contiguous() first")
        if t.numel() and t.data_ptr() % 16:
            raise ValueError(f"{name} must start on a 16-byte boundary (data_ptr % 16 == "
                             f"{t.data_ptr() % 16})")
    if need_multiple_of_8:
        if K % 8:
            raise ValueError(f"K = {K} (a.shape[1]) must be a multiple of 8: rows of a must be "
                             "16-byte aligned for cp.async / TMA")
        if N % 8:
            raise ValueError(f"N = {N} (b.shape[1]) must be a multiple of 8: rows of b must be "
                             "16-byte aligned for cp.async / TMA")
    for name, t in (("a", a), ("b", b)):
        if t.device.type != "cuda":
            raise ValueError(f"{name} is on {t.device}; the CUDA path needs a CUDA tensor")
    return M, N, K


def _i32(*xs):
    return tuple(np.int32(x) for x in xs)


def _trivial(M, N, K, dtype, device):
    """Outputs that need no kernel: empty, or K == 0 (all zeros)."""
    if M == 0 or N == 0:
        return _common.empty((M, N), dtype, device)
    if K == 0:
        return torch.zeros((M, N), dtype=dtype, device=device)
    return None


# ---- the SGEMM ladder ------------------------------------------------------------------------
def sgemm(a: torch.Tensor, b: torch.Tensor, step: str = "cp_async") -> torch.Tensor:
    """fp32 ``a @ b`` on CUDA cores with one step of the SGEMM ladder (see csrc/sgemm.cu).

    ``step`` is one of ``naive``, ``smem``, ``1d_blocking``, ``2d_blocking``, ``vectorized``,
    ``cp_async``; the last two need M and N multiples of 128 and K a multiple of 8.
    """
    if step not in SGEMM_STEPS:
        raise ValueError(f"step must be one of {', '.join(SGEMM_STEPS)}, got {step!r}")
    kernel, block, (bm, bn), strict = SGEMM_STEPS[step]
    M, N, K = check_gemm_operands(a, b, (torch.float32,), need_multiple_of_8=False)
    if strict and (M % bm or N % bn or K % 8):
        raise ValueError(f"sgemm step {step!r} needs M % {bm} == 0, N % {bn} == 0 and "
                         f"K % 8 == 0; got M={M}, N={N}, K={K} (use step='2d_blocking')")
    triv = _trivial(M, N, K, torch.float32, a.device)
    if triv is not None:
        return triv
    c = _common.empty((M, N), torch.float32, a.device)
    func = _loader.get_kernel(_loader.load_module("sgemm.cu"), kernel)
    grid = (triton_cdiv(N, bn), triton_cdiv(M, bm))
    _loader.launch(func, grid, block, (a, b, c, *_i32(M, N, K)))
    return c


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- mma.sync (sm_80 path) -------------------------------------------------------------------
def _defines(**kw) -> tuple[str, ...]:
    """Compile-time overrides (``-DSTAGES=3``); None keeps the source's default."""
    return tuple(f"-D{k.upper()}={int(v)}" for k, v in kw.items() if v is not None)


def matmul_mma(a: torch.Tensor, b: torch.Tensor, out_dtype=None, *, stages: int | None = None,
               group_m: int | None = None) -> torch.Tensor:
    """bf16 ``a @ b`` with mma.sync + ldmatrix + cp.async (csrc/gemm_mma_sm80.cu).

    ``stages`` / ``group_m`` override the source's pipeline depth and raster grouping (each
    value compiles its own module; for tuning sweeps)."""
    M, N, K = check_gemm_operands(a, b, (torch.bfloat16,))
    out_dtype = out_dtype or torch.bfloat16
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    triv = _trivial(M, N, K, out_dtype, a.device)
    if triv is not None:
        return triv
    c = _common.empty((M, N), out_dtype, a.device)
    name = "gemm_mma_bf16" if out_dtype == torch.bfloat16 else "gemm_mma_bf16_f32out"
    cfg = MMA_SM80
    opts = _defines(stages=stages, group_m=group_m)
    func = _loader.get_kernel(_loader.load_module(cfg["source"], options=opts), name)
    grid = (triton_cdiv(M, cfg["bm"]) * triton_cdiv(N, cfg["bn"]),)
    smem = (stages or cfg["stages"]) * (cfg["bm"] + cfg["bn"]) * cfg["bk"] * 2
    _loader.launch(func, grid, (cfg["threads"],), (a, b, c, *_i32(M, N, K)), smem=smem)
    return c


# ---- wgmma (sm_90a path) ---------------------------------------------------------------------
@functools.cache
def _libcuda():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                   ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                   ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return lib


_CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 = 9
_CU_TENSOR_MAP_SWIZZLE_128B = 3
_CU_TENSOR_MAP_L2_PROMOTION_256B = 3


def tensor_map_2d(t: torch.Tensor, box_cols: int, box_rows: int) -> bytes:
    """A 128-byte ``CUtensorMap`` for a row-major bf16 matrix, 128-byte swizzled boxes of
    ``box_rows`` x ``box_cols`` (``box_cols * 2`` must be 128). Built with the driver's
    ``cuTensorMapEncodeTiled`` through ctypes; passed to the kernel by value."""
    rows, cols = t.shape
    buf = (ctypes.c_ubyte * 128)()
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(t.stride(0) * t.element_size())
    box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
    estr = (ctypes.c_uint32 * 2)(1, 1)
    err = _libcuda().cuTensorMapEncodeTiled(
        ctypes.addressof(buf), _CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, ctypes.c_void_p(
            t.data_ptr()), dims, strides, box, estr, 0, _CU_TENSOR_MAP_SWIZZLE_128B,
        _CU_TENSOR_MAP_L2_PROMOTION_256B, 0)
    if err != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {err} for a tensor of "
                           f"shape {tuple(t.shape)}, strides {t.stride()}")
    return bytes(buf)


@functools.cache
def _num_sms(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# ---- first-use self-test of the wgmma kernel ---------------------------------------------------
# The Hopper kernel synchronizes through mbarriers; a protocol bug would not raise, it would
# hang the GPU and the process with it. Until a build of it has run correctly on this machine,
# each process runs it once in a subprocess with a timeout, and records success on disk
# (keyed by source hash, compile options, device and toolchain), so the cost (~10 s) is paid
# once per machine and source version. TKIT_WGMMA_SELFTEST=0 skips the check.
_SELFTEST_CODE = """
import json, math, sys, torch
from tkit.cuda_ext.gemm import matmul_wgmma
kw = json.loads(sys.argv[1])
for M, N, K in ((129, 264, 200), (1024, 1024, 1024)):
    g = torch.Generator(device="cuda").manual_seed(M)
    a = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    b = torch.randn(K, N, device="cuda", generator=g).bfloat16()
    c = matmul_wgmma(a, b, **kw)
    torch.cuda.synchronize()
    err = (c.float() - a.float() @ b.float()).abs().max().item()
    assert err < 0.05 * math.sqrt(K), f"{M}x{N}x{K}: max error {err}"
print("SELFTEST OK")
"""
_selftest_results: dict[tuple, str | None] = {}


def wgmma_selftest(**kw) -> str | None:
    """None when this build of the wgmma kernel has run correctly here, else why not."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tkit import _env

    if not _env.WGMMA_SELFTEST:
        return None
    opts = {k: v for k, v in sorted(kw.items()) if v is not None}
    key = (_loader.source_hash(WGMMA_SM90["source"]), json.dumps(opts),
           torch.cuda.get_device_name(), _loader.nvcc_version())
    if key in _selftest_results:
        return _selftest_results[key]
    marker = _env.CACHE_DIR / "cuda_ext" / f"wgmma-selftest-{_loader._key_digest(*key)}.ok"
    if marker.exists():
        _selftest_results[key] = None
        return None
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "TKIT_WGMMA_SELFTEST": "0", "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        proc = subprocess.run([sys.executable, "-c", _SELFTEST_CODE, json.dumps(opts)],
                              capture_output=True, text=True, timeout=120, env=env)
        why = None if "SELFTEST OK" in proc.stdout else (
            "self-test failed: " + (proc.stdout + proc.stderr).strip()[-600:])
    except subprocess.TimeoutExpired:
        why = "self-test timed out after 120 s (the kernel hangs: an mbarrier never completed)"
    if why is None:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("ok\n")
    _selftest_results[key] = why
    return why


def matmul_wgmma(a: torch.Tensor, b: torch.Tensor, out_dtype=None, *,
                 stages: int | None = None, group_m: int | None = None,
                 inflight: bool | None = None, persistent: bool = True) -> torch.Tensor:
    """bf16 ``a @ b`` with TMA + wgmma, warp-specialized and persistent
    (csrc/gemm_wgmma_sm90.cu, sm_90a).

    Tuning knobs (each compiles its own module): ``stages`` (3 or 4: 48 KiB a stage),
    ``group_m`` (raster grouping), ``inflight`` (keep one wgmma group in flight across k-steps),
    ``persistent=False`` launches one CTA per tile instead of one per SM."""
    M, N, K = check_gemm_operands(a, b, (torch.bfloat16,))
    out_dtype = out_dtype or torch.bfloat16
    if out_dtype != torch.bfloat16:
        raise TypeError(f"the wgmma path writes bfloat16; out_dtype {out_dtype} is not supported")
    triv = _trivial(M, N, K, out_dtype, a.device)
    if triv is not None:
        return triv
    c = _common.empty((M, N), out_dtype, a.device)
    cfg = WGMMA_SM90
    why = wgmma_selftest(stages=stages, group_m=group_m, inflight=inflight)
    if why is not None:
        raise RuntimeError(f"the wgmma kernel is off on this machine: {why}")
    st = stages or cfg["stages"]
    if st * (cfg["bm"] + cfg["bn"]) * cfg["bk"] * 2 + 1280 > 227 * 1024:
        raise ValueError(f"stages={st} needs more than the 227 KiB of shared memory per block")
    opts = _defines(stages=stages, group_m=group_m,
                    wgmma_inflight=None if inflight is None else int(inflight))
    mod = _loader.load_module(cfg["source"], backend="nvcc", arch="90a", options=opts)
    func = _loader.get_kernel(mod, "gemm_wgmma_bf16")
    map_a = tensor_map_2d(a, 64, cfg["bm"])
    map_b = tensor_map_2d(b, 64, cfg["bk"])
    tiles = triton_cdiv(M, cfg["bm"]) * triton_cdiv(N, cfg["bn"])
    grid = (min(tiles, _num_sms(a.device.index or 0)) if persistent else tiles,)
    smem = st * (cfg["bm"] + cfg["bn"]) * cfg["bk"] * 2 + 1024 + 256
    _loader.launch(func, grid, (cfg["threads"],), (map_a, map_b, c, *_i32(M, N, K)),
                   smem=smem)
    return c
