"""Launcher of the CuTe mma.sync GEMM (csrc/gemm_cute_sm80.cu): bf16 ``a @ b`` on sm_80+.

The same algorithm as :func:`tkit.cuda_ext.gemm.matmul_mma` (mma.sync m16n8k16 + ldmatrix +
cp.async multi-stage pipeline, fragments double-buffered across k16 blocks), written with CuTe's
sm80 atoms and swizzled shared-memory layouts instead of by hand: a second, independent
implementation, written to tell whether the hand-written kernel's ~0.6x cuBLAS on the H200 is
the ceiling of mma.sync there or of that one kernel (0.8x cuBLAS was the aim).
Cost: 2*M*N*K flops, as every GEMM of :mod:`tkit.cuda_ext.gemm`.

Operands follow :func:`~tkit.cuda_ext.gemm.matmul_mma`: ``a`` [M, K] and ``b`` [K, N], both bf16,
row-major contiguous, 16-byte aligned, on one CUDA device (checked by
:func:`~tkit.cuda_ext.gemm.check_gemm_operands`). The kernel has no edge predication, so each
build also needs M, N and K to be multiples of its tile (BM, BN, BK); the error names the
argument that is not. Every build is compiled by nvcc (CuTe headers from the ``nvidia-cutlass``
wheel) for the device's own arch and cached like the other nvcc builds.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import torch

from tkit.cuda_ext import _loader
from tkit.cuda_ext.gemm import (
    _defines,
    _i32,
    _max_smem_optin,
    _trivial,
    _variant_config,
    check_gemm_operands,
)
from tkit.kernels import _common

SOURCE = "gemm_cute_sm80.cu"
C_PAD = 8  # bf16 elements of padding per staged C row, as in the source

#: the source's macro defaults: the build with no -D options (variant 128x256k32s4)
CUTE_DEFAULTS = dict(bm=128, bn=256, bk=32, warps_m=2, warps_n=4, stages=4, group_m=8,
                     epi_smem=1, min_blocks=0)


def _cute(bm, bn, bk, stages, warps_m, warps_n, epi=1, min_blocks=0):
    return dict(bm=bm, bn=bn, bk=bk, stages=stages, warps_m=warps_m, warps_n=warps_n,
                epi_smem=epi, min_blocks=min_blocks)


# Compile-time builds for the sweep (h200-2026-11-30-i-cute-sm80.json); each spells out its tile.
# Warp tiles: 64 x 64 (4 x 8 mma per k16 block for 8 ldmatrix.x4) except *_w2x4 on 128 x 128
# (64 x 32). The 128-thread builds ask for two blocks per SM (their 64 / 96 KiB of shared memory
# and <= 255 registers fit twice), so one block's barrier and epilogue overlap the other's mma
# work. 256x128k64s3 is the tile of the hand-written kernel's default, for a like-for-like
# comparison; 128x256k32s4_direct drops the staged epilogue (4-byte stores from registers).
CUTE_VARIANTS: dict[str, dict] = {
    "128x256k32s4": _cute(128, 256, 32, 4, 2, 4),
    "128x256k64s3": _cute(128, 256, 64, 3, 2, 4),
    "128x256k32s4_direct": _cute(128, 256, 32, 4, 2, 4, epi=0),
    "256x128k64s3": _cute(256, 128, 64, 3, 4, 2),
    "128x128k32s4_w2x4": _cute(128, 128, 32, 4, 2, 4),
    "128x128k32s4_2cta": _cute(128, 128, 32, 4, 2, 2, min_blocks=2),
    "128x128k64s3_2cta": _cute(128, 128, 64, 3, 2, 2, min_blocks=2),
}
CUTE_DEFAULT_VARIANT = "128x256k32s4"
#: where the default's 96 KiB of shared memory do not fit a block (none of sm_80 / sm_86 /
#: sm_89 / sm_90 today; kept so a small part has a build)
CUTE_SMALL_VARIANT = "128x128k32s4_2cta"


def cute_config(variant: str | None = None, **overrides) -> dict:
    """Tile parameters of one CuTe build: :data:`CUTE_DEFAULTS`, then the variant (None or
    "default": :data:`CUTE_DEFAULT_VARIANT`), then overrides (None keeps what is there). Keys:
    bm, bn, bk, warps_m, warps_n, stages, group_m, epi_smem, min_blocks; plus the derived
    threads, smem (bytes of dynamic shared memory) and options (the -D flags)."""
    cfg = _variant_config(variant, CUTE_DEFAULT_VARIANT, CUTE_VARIANTS, CUTE_DEFAULTS,
                          overrides)
    pipe = cfg["stages"] * (cfg["bm"] + cfg["bn"]) * cfg["bk"] * 2
    epi = cfg["bm"] * (cfg["bn"] + C_PAD) * 2 if cfg["epi_smem"] else 0
    cfg["threads"] = 32 * cfg["warps_m"] * cfg["warps_n"]
    cfg["smem"] = max(pipe, epi)
    # only what differs from the source's defaults goes on the command line: the default build
    # has no options
    cfg["options"] = _defines(**{k: v for k, v in cfg.items()
                                 if k in CUTE_DEFAULTS and v != CUTE_DEFAULTS[k]})
    return cfg


def check_cute_tiles(cfg: dict, M: int, N: int, K: int) -> None:
    """ValueError naming the argument whose size is not a multiple of the build's tile (the
    kernel does not predicate edges)."""
    for dim, size, tile, where in (("M", M, cfg["bm"], "a.shape[0]"),
                                   ("N", N, cfg["bn"], "b.shape[1]"),
                                   ("K", K, cfg["bk"], "a.shape[1]")):
        if size % tile:
            raise ValueError(
                f"{dim} = {size} ({where}) must be a multiple of {tile} for the CuTe GEMM "
                f"build {cfg['variant']!r}: it has no edge predication (M % {cfg['bm']}, "
                f"N % {cfg['bn']} and K % {cfg['bk']} must all be 0); use matmul_mma for "
                "other shapes")


def default_cute_variant(device: int | None = None) -> str:
    """The build :func:`matmul_cute_sm80` runs without ``variant``: the default where its
    shared memory fits a block, else :data:`CUTE_SMALL_VARIANT`."""
    if device is None:
        device = torch.cuda.current_device()
    if cute_config(CUTE_DEFAULT_VARIANT)["smem"] <= _max_smem_optin(device):
        return CUTE_DEFAULT_VARIANT
    return CUTE_SMALL_VARIANT


def load_cute_module(variant: str | None = None, *, arch: str | None = None,
                     device: int | None = None):
    """The compiled module of one build (nvcc, cached), as :func:`matmul_cute_sm80` loads it;
    a sweep calls it from several threads to compile the builds side by side."""
    cfg = cute_config(variant)
    return _loader.load_module(SOURCE, backend="nvcc", arch=arch, options=cfg["options"],
                               device=device)


def compile_cute(variant: str | None = None, arch: str = "90a", *,
                 cache_dir: str | Path | None = None) -> Path:
    """``nvcc -cubin`` one build for one arch, no GPU needed (cached on disk); the runtime path
    builds the same way for the device's arch."""
    return _loader.compile_cubin(SOURCE, arch, cute_config(variant)["options"],
                                 cache_dir=cache_dir, cute=True)


def cubin_resources(cubin: str | Path) -> dict[str, dict[str, int]]:
    """{kernel: {"reg", "stack", "shared", "local"}} of a cubin, from ``cuobjdump -res-usage``
    (registers per thread; stack, static shared and local bytes; on sm_90 the 1 KiB of shared
    memory the system reserves per block shows as static shared)."""
    tool = _loader.cuda_binutil("cuobjdump")
    if tool is None:
        raise FileNotFoundError("cuobjdump not found (CUDA install or the Triton wheel)")
    proc = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"cuobjdump failed on {cubin}: {proc.stderr.strip()}")
    found = re.findall(r"Function (\w+):\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)",
                       proc.stdout)
    return {name: dict(reg=int(r), stack=int(st), shared=int(sh), local=int(lo))
            for name, r, st, sh, lo in found}


def matmul_cute_sm80(a: torch.Tensor, b: torch.Tensor, out_dtype=None, *,
                     variant: str | None = None) -> torch.Tensor:
    """bf16 ``a @ b`` [M, K] x [K, N] with the CuTe mma.sync kernel (csrc/gemm_cute_sm80.cu).

    Parameters
    ----------
    a, b : torch.Tensor
        bf16, row-major contiguous, 16-byte aligned, on the same CUDA device. M, N and K must
        be multiples of the build's tile (BM, BN, BK: 128 / 256 / 32 for the default).
    out_dtype : torch.dtype, optional
        bfloat16 (default) or float32; the accumulation is fp32 either way.
    variant : str, optional
        A build of :data:`CUTE_VARIANTS` (None: :func:`default_cute_variant`).

    Returns
    -------
    torch.Tensor
        [M, N] in ``out_dtype``.
    """
    M, N, K = check_gemm_operands(a, b, (torch.bfloat16,))
    out_dtype = out_dtype or torch.bfloat16
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    dev = a.device.index if a.device.index is not None else torch.cuda.current_device()
    if variant is None:
        variant = default_cute_variant(dev)
    cfg = cute_config(variant)
    check_cute_tiles(cfg, M, N, K)
    major, _minor = torch.cuda.get_device_capability(dev)
    if major < 8:
        raise RuntimeError(f"the CuTe mma.sync GEMM needs sm_80 or newer; device {dev} is "
                           f"sm_{major}{_minor}")
    limit = _max_smem_optin(dev)
    if cfg["smem"] > limit:
        raise ValueError(f"CuTe variant {variant!r} needs {cfg['smem']} bytes of shared "
                         f"memory, more than the {limit} a block can have on this GPU")
    triv = _trivial(M, N, K, out_dtype, a.device)
    if triv is not None:
        return triv
    c = _common.empty((M, N), out_dtype, a.device)
    name = "gemm_cute_bf16" if out_dtype == torch.bfloat16 else "gemm_cute_bf16_f32out"
    func = _loader.get_kernel(load_cute_module(variant, device=dev), name)
    grid = ((M // cfg["bm"]) * (N // cfg["bn"]),)
    with torch.cuda.device(dev):
        _loader.launch(func, grid, (cfg["threads"],), (a, b, c, *_i32(M, N, K)),
                       smem=cfg["smem"])
    return c
