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

# The tile parameters of each default build (the macros' defaults in csrc/): the fastest build
# of the tile/stage/epilogue sweep run on the H200 (docs/NOTES.md, tutorial 06b section 7).
MMA_DEFAULTS = dict(bm=256, bn=128, bk=64, warps_m=4, warps_n=2, stages=3, frag_pipe=1,
                    epi_smem=1)
WGMMA_DEFAULTS = dict(stages=3, group_m=16, inflight=False, epi_tma=True, epi_split=1,
                      cluster_m=1)
MMA_SM80 = dict(source="gemm_mma_sm80.cu", threads=256,
                **{k: MMA_DEFAULTS[k] for k in ("bm", "bn", "bk", "stages")})
MMA_SM80["smem"] = MMA_SM80["stages"] * (MMA_SM80["bm"] + MMA_SM80["bn"]) * MMA_SM80["bk"] * 2
WGMMA_SM90 = dict(source="gemm_wgmma_sm90.cu", bm=128, bn=256, bk=64,
                  stages=WGMMA_DEFAULTS["stages"], threads=384)
WGMMA_SM90["smem"] = WGMMA_SM90["stages"] * (
    WGMMA_SM90["bm"] * WGMMA_SM90["bk"] * 2 + WGMMA_SM90["bk"] * WGMMA_SM90["bn"] * 2
) + 2 * 64 * WGMMA_SM90["bn"] * 2 + 1024 + 256  # stages + C staging + alignment + barriers


def _mma(bm, bn, bk, stages, warps_m, warps_n, pipe, epi, **extra):
    return dict(bm=bm, bn=bn, bk=bk, stages=stages, warps_m=warps_m, warps_n=warps_n,
                frag_pipe=pipe, epi_smem=epi, **extra)


# Compile-time variants of the mma.sync kernel (macros of csrc/gemm_mma_sm80.cu), for sweeps
# (tutorial 06b, section 7); each spells out its whole tile. MMA_DEFAULT_VARIANT is the
# build with no -D options. The big tiles give each warp 64 x 64 (8 ldmatrix.x4 for 32 mma per
# k16 step instead of 6 for 16: the 64 x 32 warp tile asks ~128 B/clk of shared memory, the SM's
# whole bandwidth); frag_pipe double-buffers fragments across k16 steps, epi_smem stages the bf16
# tile for 16-byte stores. H200, ratio to cuBLAS at 4096^3 / 8192^3 (first sweep):
#   128x128k32s4 0.43/0.46 (the original kernel), 128x256k32s4_epi 0.59/0.61,
#   256x128k64s3_epi 0.59/0.64 (the default).
# The *_2cta builds: 128 x 128 tiles of 4 warps (64 x 64 each), two blocks per SM (96 / 64 KiB
# of shared memory, <= 255 registers at 128 threads), so one block's barrier and epilogue
# overlap the other's mma work (not measured yet).
MMA_VARIANTS: dict[str, dict] = {
    "128x128k32s4": _mma(128, 128, 32, 4, 2, 4, 0, 0),
    "128x128k32s4_pipe_epi": _mma(128, 128, 32, 4, 2, 4, 1, 1),
    "128x256k32s4": _mma(128, 256, 32, 4, 2, 4, 1, 0),
    "128x256k32s4_epi": _mma(128, 256, 32, 4, 2, 4, 1, 1),
    "128x256k32s3_epi": _mma(128, 256, 32, 3, 2, 4, 1, 1),
    "128x256k64s3_epi": _mma(128, 256, 64, 3, 2, 4, 1, 1),
    "128x256k64s4_epi": _mma(128, 256, 64, 4, 2, 4, 1, 1),
    "256x128k32s4_epi": _mma(256, 128, 32, 4, 4, 2, 1, 1),
    "256x128k64s3_epi": _mma(256, 128, 64, 3, 4, 2, 1, 1),
    "128x128k64s3_2cta": _mma(128, 128, 64, 3, 2, 2, 1, 1, min_blocks=2),
    "128x128k32s4_2cta": _mma(128, 128, 32, 4, 2, 2, 1, 1, min_blocks=2),
}
MMA_DEFAULT_VARIANT = "256x128k64s3_epi"
# where the default's 144 KiB of shared memory do not fit (sm_86 / sm_89: 99 KiB a block)
MMA_SMALL_VARIANT = "128x256k32s3_epi"


def _variant_config(variant, default: str, variants: dict, base: dict, overrides: dict) -> dict:
    """A named build (None or "default": ``default``) over ``base``, then the overrides that are
    not None; ValueError naming the choices for an unknown name."""
    if variant in (None, "default"):
        variant = default
    if variant not in variants:
        raise ValueError(f"variant must be one of {', '.join(variants)}, got {variant!r}")
    cfg = dict(base)
    cfg.update(variants[variant])
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    cfg["variant"] = variant
    return cfg


def mma_config(variant: str | None = None, **overrides) -> dict:
    """Tile parameters of one mma.sync build: defaults (:data:`MMA_DEFAULTS`), then the variant
    (None or "default": :data:`MMA_DEFAULT_VARIANT`), then overrides (None keeps what is
    there). Keys: bm, bn, bk, warps_m, warps_n, stages, group_m, frag_pipe, epi_smem,
    min_blocks; plus the derived threads, smem (bytes) and the -D options."""
    cfg = _variant_config(variant, MMA_DEFAULT_VARIANT, MMA_VARIANTS,
                          dict(MMA_DEFAULTS, group_m=None, min_blocks=None), overrides)
    pipe = cfg["stages"] * (cfg["bm"] + cfg["bn"]) * cfg["bk"] * 2
    epi = cfg["bm"] * (cfg["bn"] + 8) * 2 if cfg["epi_smem"] else 0
    cfg["threads"] = 32 * cfg["warps_m"] * cfg["warps_n"]
    cfg["smem"] = max(pipe, epi)
    # only what differs from the source's defaults goes on the command line, so the default
    # build has no options (the build the dispatcher compiles and the compile tests check)
    cfg["options"] = _defines(**{k: v for k, v in cfg.items()
                                 if k in MMA_DEFAULTS and v != MMA_DEFAULTS[k]},
                              group_m=cfg["group_m"], min_blocks=cfg["min_blocks"])
    return cfg


@functools.cache
def _max_smem_optin(device: int) -> int:
    """Shared memory a block may opt in to on this device (227 KiB on sm_90, 163 on sm_80,
    99 on sm_86 / sm_89)."""
    props = torch.cuda.get_device_properties(device)
    n = getattr(props, "shared_memory_per_block_optin", None)
    if n:
        return int(n)
    major, minor = props.major, props.minor
    return {(8, 0): 163, (8, 7): 163, (9, 0): 227}.get((major, minor), 99) * 1024


def default_mma_variant(device: int | None = None) -> str:
    """The mma.sync build :func:`matmul_mma` runs without ``variant``: the default where its
    shared memory fits, else :data:`MMA_SMALL_VARIANT`."""
    if device is None:
        device = torch.cuda.current_device()
    if mma_config(MMA_DEFAULT_VARIANT)["smem"] <= _max_smem_optin(device):
        return MMA_DEFAULT_VARIANT
    return MMA_SMALL_VARIANT


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
    grid = (_common.cdiv(N, bn), _common.cdiv(M, bm))
    _loader.launch(func, grid, block, (a, b, c, *_i32(M, N, K)))
    return c


# ---- mma.sync (sm_80 path) -------------------------------------------------------------------
def _defines(**kw) -> tuple[str, ...]:
    """Compile-time overrides (``-DSTAGES=3``); None keeps the source's default."""
    return tuple(f"-D{k.upper()}={int(v)}" for k, v in kw.items() if v is not None)


def matmul_mma(a: torch.Tensor, b: torch.Tensor, out_dtype=None, *, stages: int | None = None,
               group_m: int | None = None, variant: str | None = None) -> torch.Tensor:
    """bf16 ``a @ b`` with mma.sync + ldmatrix + cp.async (csrc/gemm_mma_sm80.cu).

    ``variant`` names a build of :data:`MMA_VARIANTS` (None: :func:`default_mma_variant`, the
    256x128x64 one where it fits); ``stages`` / ``group_m`` override its pipeline depth and
    raster grouping (each build compiles its own module; for tuning sweeps)."""
    M, N, K = check_gemm_operands(a, b, (torch.bfloat16,))
    out_dtype = out_dtype or torch.bfloat16
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    triv = _trivial(M, N, K, out_dtype, a.device)
    if triv is not None:
        return triv
    if variant is None:
        variant = default_mma_variant(a.device.index)
    cfg = mma_config(variant, stages=stages, group_m=group_m)
    limit = _max_smem_optin(a.device.index if a.device.index is not None else
                            torch.cuda.current_device())
    if cfg["smem"] > limit:
        raise ValueError(f"mma variant {variant!r} needs {cfg['smem']} bytes of shared memory, "
                         f"more than the {limit} a block can have on this GPU")
    c = _common.empty((M, N), out_dtype, a.device)
    name = "gemm_mma_bf16" if out_dtype == torch.bfloat16 else "gemm_mma_bf16_f32out"
    func = _loader.get_kernel(_loader.load_module(MMA_SM80["source"], options=cfg["options"]),
                              name)
    grid = (_common.cdiv(M, cfg["bm"]) * _common.cdiv(N, cfg["bn"]),)
    _loader.launch(func, grid, (cfg["threads"],), (a, b, c, *_i32(M, N, K)), smem=cfg["smem"])
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


# CUtensorMapDataType of the element types the kernels here read and write (fp8 as bytes)
_CU_TENSOR_MAP_DATA_TYPE = {torch.bfloat16: 9, torch.float16: 6, torch.float8_e4m3fn: 0,
                            torch.uint8: 0, torch.int32: 3, torch.float32: 7}
_CU_TENSOR_MAP_SWIZZLE_NONE = 0
_CU_TENSOR_MAP_SWIZZLE_128B = 3
_CU_TENSOR_MAP_L2_PROMOTION_256B = 3


def tensor_map_2d(t: torch.Tensor, box_cols: int, box_rows: int, *, swizzle: bool = True
                  ) -> bytes:
    """A 128-byte ``CUtensorMap`` for a row-major matrix (bf16, fp16, fp8, int32 or fp32),
    boxes of ``box_rows`` x ``box_cols``: 128-byte swizzled (``box_cols`` elements must be
    128 bytes), or with ``swizzle=False`` dense (rows of a multiple of 16 bytes). Built with
    the driver's ``cuTensorMapEncodeTiled`` through ctypes; passed to the kernel by value."""
    rows, cols = t.shape
    return tensor_map(t, (cols, rows), (t.stride(0),), (box_cols, box_rows), swizzle=swizzle)


_MAPS: dict = {}


def tensor_map(t: torch.Tensor, dims: tuple[int, ...], strides: tuple[int, ...],
               box: tuple[int, ...], *, swizzle: bool = True) -> _loader.TensorMap:
    """A ``CUtensorMap`` over ``t``'s memory seen as a tensor of ``dims`` (innermost first,
    dimension 0 contiguous) with element ``strides`` for dimensions 1.. (any order: a view
    the tensor's own strides do not give, such as 32-column slabs of a matrix as a third
    dimension), boxes of ``box`` elements, 128-byte swizzled (``box[0]`` elements must be 128
    bytes) or dense. Every box element outside ``dims`` reads as 0; the caller makes sure
    ``dims`` stay within the tensor's memory. Kept per (address, dtype, dims, strides, box,
    swizzle), everything the descriptor encodes: a layer's weights give the same ones every
    call, and the caching allocator hands activations and outputs the same addresses call
    after call, where each new one costs a driver call."""
    key = (t.data_ptr(), t.dtype, tuple(dims), tuple(strides), tuple(box), swizzle)
    m = _MAPS.get(key)
    if m is None:
        if len(_MAPS) >= 4096:
            _MAPS.clear()
        m = _MAPS[key] = _encode(t, dims, strides, box, swizzle)
    return m


def _encode(t, dims, strides, box, swizzle) -> bytes:
    es = t.element_size()
    row_bytes = box[0] * es
    if swizzle and row_bytes != 128:
        raise ValueError(f"a 128-byte swizzled box needs 128-byte rows, got {box[0]} "
                         f"elements of {es} bytes")
    if row_bytes % 16:
        raise ValueError(f"a box's rows must be a multiple of 16 bytes, got {row_bytes}")
    n = len(dims)
    spec = (_CU_TENSOR_MAP_DATA_TYPE[t.dtype], tuple(int(d) for d in dims),
            tuple(int(st) * es for st in strides[:n - 1]), tuple(int(b) for b in box),
            _CU_TENSOR_MAP_SWIZZLE_128B if swizzle else _CU_TENSOR_MAP_SWIZZLE_NONE, 0,
            _CU_TENSOR_MAP_L2_PROMOTION_256B)
    buf = (ctypes.c_ubyte * 128)()
    cdims = (ctypes.c_uint64 * n)(*spec[1])
    cstrides = (ctypes.c_uint64 * max(n - 1, 1))(*spec[2])
    cbox = (ctypes.c_uint32 * n)(*spec[3])
    estr = (ctypes.c_uint32 * n)(*([1] * n))
    err = _libcuda().cuTensorMapEncodeTiled(
        ctypes.addressof(buf), spec[0], n, ctypes.c_void_p(t.data_ptr()), cdims, cstrides,
        cbox, estr, 0, spec[4], spec[6], spec[5])
    if err != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {err} for a tensor of "
                           f"shape {tuple(t.shape)}, strides {t.stride()} seen as dims {dims}, "
                           f"strides {strides}, box {box}")
    m = _loader.TensorMap(bytes(buf))
    m.ptr, m.spec = t.data_ptr(), spec
    return m


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
for M, N, K in ((129, 264, 200), (300, 520, 136), (1024, 1024, 1024)):
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

    opts = {k: v for k, v in sorted(kw.items()) if v is not None}
    # keyed by the build (its -D options), so equal builds asked for differently share it
    return build_selftest("wgmma", WGMMA_SM90["source"], _SELFTEST_CODE, opts,
                          json.dumps(wgmma_config(**opts)["options"]))


def build_selftest(tag: str, source: str, code: str, opts: dict, build: str) -> str | None:
    """None when the build ``build`` (its -D options) of ``source`` has run ``code`` correctly
    on this machine (it prints "SELFTEST OK"), else why not. ``code`` runs once per machine,
    source version and build in a subprocess with a timeout (an mbarrier protocol bug hangs
    rather than raises) with ``opts`` as its JSON argument; success is recorded on disk.
    TKIT_WGMMA_SELFTEST=0 skips every such check."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tkit import _env

    if not _env.WGMMA_SELFTEST:
        return None
    key = (_loader.source_hash(source), build, torch.cuda.get_device_name(),
           _loader.nvcc_version())
    if key in _selftest_results:
        return _selftest_results[key]
    marker = _env.CACHE_DIR / "cuda_ext" / f"{tag}-selftest-{_loader._key_digest(*key)}.ok"
    if marker.exists():
        _selftest_results[key] = None
        return None
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "TKIT_WGMMA_SELFTEST": "0", "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(opts)],
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


# Compile-time variants of the wgmma kernel (macros of csrc/gemm_wgmma_sm90.cu), for sweeps
# (tutorial 06b, section 7); WGMMA_DEFAULT_VARIANT is the build with no -D options.
# epi_tma: epilogue through shared memory + TMA stores, overlapped with the next tile's
# mainloop (epi_split parts a consumer); cluster_m=2: 2x1 clusters with the B tile multicast.
# H200, ratio to cuBLAS at 4096^3 / 8192^3 (first sweep): direct_s4 (the original kernel)
# 0.951/0.998, epi_tma 0.994/1.003, epi_tma_s3 0.996/1.036 (the default), cluster2_epi_tma
# 0.987/1.024; cluster2_epi_tma_s3 (the two best at 8192^3 together) not measured yet.
WGMMA_VARIANTS: dict[str, dict] = {
    "epi_tma_s3": {},
    "direct_s4": dict(stages=4, epi_tma=False, epi_split=2),
    "epi_tma": dict(stages=4, epi_split=2),
    "cluster2": dict(stages=4, epi_tma=False, epi_split=2, cluster_m=2),
    "cluster2_epi_tma": dict(stages=4, epi_split=2, cluster_m=2),
    "cluster2_epi_tma_g8": dict(stages=4, epi_split=2, cluster_m=2, group_m=8),
    "cluster2_epi_tma_inflight": dict(stages=4, epi_split=2, cluster_m=2, inflight=True),
    "cluster2_epi_tma_s3": dict(cluster_m=2),
}
WGMMA_DEFAULT_VARIANT = "epi_tma_s3"
_WGMMA_BUILD_KEYS = tuple(WGMMA_DEFAULTS)  # the keys that select a compiled build


def wgmma_config(variant: str | None = None, **overrides) -> dict:
    """One wgmma build: defaults (:data:`WGMMA_DEFAULTS`), then the variant (None or "default":
    :data:`WGMMA_DEFAULT_VARIANT`), then overrides (None keeps what is there). Keys: stages,
    group_m, inflight, epi_tma, epi_split, cluster_m, persistent, ctas (grid size of the
    persistent launch; None: one CTA per SM); derived: smem (bytes), options (-D...: only
    what differs from the source's defaults)."""
    cfg = _variant_config(variant, WGMMA_DEFAULT_VARIANT, WGMMA_VARIANTS,
                          dict(WGMMA_DEFAULTS, persistent=True, ctas=None), overrides)
    if cfg["cluster_m"] not in (1, 2):
        raise ValueError(f"cluster_m must be 1 or 2, got {cfg['cluster_m']}")
    cfg["inflight"], cfg["epi_tma"] = bool(cfg["inflight"]), bool(cfg["epi_tma"])
    st, split = cfg["stages"], cfg["epi_split"]
    c_bytes = 2 * 64 * (WGMMA_SM90["bn"] // split) * 2 if cfg["epi_tma"] else 0
    cfg["smem"] = st * (WGMMA_SM90["bm"] + WGMMA_SM90["bn"]) * WGMMA_SM90["bk"] * 2 + c_bytes \
        + 1024 + 256
    diff = {k: cfg[k] for k in _WGMMA_BUILD_KEYS if cfg[k] != WGMMA_DEFAULTS[k]}
    cfg["options"] = _defines(
        stages=diff.get("stages"), group_m=diff.get("group_m"),
        wgmma_inflight=diff.get("inflight"), epi_tma=diff.get("epi_tma"),
        epi_split=diff.get("epi_split"), cluster_m=diff.get("cluster_m"))
    return cfg


def matmul_wgmma(a: torch.Tensor, b: torch.Tensor, out_dtype=None, *,
                 stages: int | None = None, group_m: int | None = None,
                 inflight: bool | None = None, persistent: bool | None = None,
                 variant: str | None = None, epi_tma: bool | None = None,
                 epi_split: int | None = None, cluster_m: int | None = None,
                 ctas: int | None = None) -> torch.Tensor:
    """bf16 ``a @ b`` with TMA + wgmma, warp-specialized and persistent
    (csrc/gemm_wgmma_sm90.cu, sm_90a).

    ``variant`` names a build of :data:`WGMMA_VARIANTS` (None: :data:`WGMMA_DEFAULT_VARIANT`,
    3 stages and the TMA epilogue in one part). Tuning knobs on top (each build compiles its own
    module): ``stages`` (3 or 4: 48 KiB a stage; 4 needs ``epi_split=2`` or ``epi_tma=False``),
    ``group_m`` (raster grouping), ``inflight`` (keep one wgmma group in flight across k-steps),
    ``epi_tma`` / ``epi_split`` (epilogue through shared memory and TMA stores, in that many
    parts per consumer), ``cluster_m`` (2: clusters of 2 CTAs sharing B by TMA multicast);
    ``persistent=False`` launches one CTA per tile instead of one per SM, ``ctas`` sets the
    persistent grid's size."""
    M, N, K = check_gemm_operands(a, b, (torch.bfloat16,))
    out_dtype = out_dtype or torch.bfloat16
    if out_dtype != torch.bfloat16:
        raise TypeError(f"the wgmma path writes bfloat16; out_dtype {out_dtype} is not supported")
    cfg = wgmma_config(variant, stages=stages, group_m=group_m, inflight=inflight,
                       persistent=persistent, epi_tma=epi_tma, epi_split=epi_split,
                       cluster_m=cluster_m, ctas=ctas)
    if cfg["smem"] > 227 * 1024:
        raise ValueError(f"this wgmma build needs {cfg['smem']} bytes of shared memory, more "
                         "than the 227 KiB of a block")
    triv = _trivial(M, N, K, out_dtype, a.device)
    if triv is not None:
        return triv
    c = _common.empty((M, N), out_dtype, a.device)
    # the self-test is keyed by the compiled build (its -D options), not by launch knobs
    why = wgmma_selftest(**_selftest_kw(cfg))
    if why is not None:
        raise RuntimeError(f"the wgmma kernel is off on this machine: {why}")
    mod = _loader.load_module(WGMMA_SM90["source"], backend="nvcc", arch="90a",
                              options=cfg["options"])
    func = _loader.get_kernel(mod, "gemm_wgmma_bf16")
    bm, bn = WGMMA_SM90["bm"], WGMMA_SM90["bn"]
    maps = [tensor_map_2d(a, 64, bm), tensor_map_2d(b, 64, WGMMA_SM90["bk"])]
    if cfg["epi_tma"]:
        maps.append(tensor_map_2d(c, 64, 64))
    cm = cfg["cluster_m"] or 1
    units = _common.cdiv(_common.cdiv(M, bm), cm) * _common.cdiv(N, bn)  # clusters' tiles
    if cfg["persistent"]:
        n = cfg["ctas"] or _num_sms(a.device.index or 0)
        grid = (max(1, min(units, n // cm)) * cm,)
    else:
        grid = (units * cm,)
    _loader.launch(func, grid, (WGMMA_SM90["threads"],), (*maps, c, *_i32(M, N, K)),
                   smem=cfg["smem"])
    return c


def _selftest_kw(cfg: dict) -> dict:
    """The keyword arguments that select a compiled build (those that differ from the defaults),
    as the self-test passes them on."""
    return {k: cfg[k] for k in _WGMMA_BUILD_KEYS if cfg[k] != WGMMA_DEFAULTS[k]}
