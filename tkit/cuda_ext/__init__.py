"""CUDA escape hatches: raw CUDA (and CuTe) kernels loaded at run time through cupy.

Triton cannot express everything (wgmma issued by hand, register reallocation between warp
groups, TMA multicast...). Kernels that need it live in ``csrc/*.cu``, are compiled and launched
by :mod:`tkit.cuda_ext._loader`, and are chosen by compute capability from one table,
:data:`DISPATCH`. Anything the table does not cover, or that cannot run here (no cupy, no GPU,
no compiler, a compile error), falls back to the Triton kernel; :func:`status` says which path
each op takes on this machine and why the others are off.

Public entry points:

* :func:`matmul` ``(a, b, out_dtype=None)``: bf16 GEMM through the best CUDA path for this GPU
  (raises :class:`CudaPathUnavailable`, naming the reason, when there is none). ``tkit.matmul``
  calls it for ``backend="cuda"``.
* :func:`sgemm` ``(a, b, step)``: the fp32 SGEMM ladder of tutorial chapter 05.
* :func:`matmul_mma`, :func:`matmul_wgmma`: one path each, for benchmarks and tests.
* :mod:`tkit.cuda_ext.gemm_fp8_block`: the block-scaled fp8 GEMM (DeepSeek-V3's 1x128 /
  128x128 scales) on 128 x 256 tiles, which ``tkit.matmul_fp8``'s block mode dispatches to
  on sm_90 (``tkit.kernels.matmul.fp8_block.backend`` says which kernel a call gets).
* :mod:`tkit.cuda_ext.gemm_int4`: the INT4 weight-only GEMV and GEMM at decode sizes (the
  GEMV for 1..16 rows of a: the codes straight into a register ring, a 32-column slab a CTA;
  the GEMM for up to 32: a TMA ring of the codes, stream-K over the SMs; both mma.sync on
  registers dequantized in two instructions a pair), which ``tkit.matmul_int4`` dispatches
  to on sm_90 (``tkit.kernels.matmul.int4.backend`` says which kernel a call gets).
* :func:`status`: a dict (printed readably) of every op's path; ``tkit info`` prints it.
* :func:`cute_layouts`: the CuTe printout of the tiled-MMA layouts (host program; tutorial 06b).
* :func:`compile_cubin`, :func:`sass`, :func:`resource_usage`: nvcc ahead of time, no GPU
  needed: ``sass(compile_cubin("gemm_wgmma_sm90.cu", "90a"))``.

A repeated eager call of a public op that reaches these kernels is served by its plan
(:mod:`tkit.kernels._plan`) like a Triton launch: the loader records each launch (tensors,
typed scalars, tensor maps with what encoded them), and the C++ executor replays it with the
call's pointers and maps encoded over the call's tensors, without the launcher's Python.
"""

from __future__ import annotations

import functools
import subprocess

import torch

from tkit.cuda_ext import _loader
from tkit.cuda_ext._loader import compile_cubin, resource_usage, sass
from tkit.cuda_ext.gemm import (
    SGEMM_STEPS,
    check_gemm_operands,
    matmul_mma,
    matmul_wgmma,
    sgemm,
    wgmma_selftest,
)

__all__ = [
    "DISPATCH",
    "SGEMM_STEPS",
    "CudaPathUnavailable",
    "compile_cubin",
    "cute_layouts",
    "dispatch",
    "matmul",
    "matmul_mma",
    "matmul_wgmma",
    "resource_usage",
    "sass",
    "select_matmul_path",
    "sgemm",
    "status",
    "unavailable_reason",
    "wgmma_selftest",
]


class CudaPathUnavailable(RuntimeError):
    """No CUDA path can run this call here; the message says why."""


#: compute-capability major -> (path name, launcher, how it is compiled). Order inside a
#: major: first that works wins (sm_90 falls back to the sm_80 kernel, which runs there too).
DISPATCH = {
    9: [("sm90a_wgmma", matmul_wgmma, dict(source="gemm_wgmma_sm90.cu", backend="nvcc",
                                           arch="90a")),
        ("sm80_mma", matmul_mma, dict(source="gemm_mma_sm80.cu", backend="nvrtc"))],
    8: [("sm80_mma", matmul_mma, dict(source="gemm_mma_sm80.cu", backend="nvrtc"))],
}

_compile_failures: dict[tuple, str] = {}


def _environment_reason(device: int | None = None) -> str | None:
    """Why no CUDA path can run at all here, or None."""
    cupy, why = _loader.import_cupy()
    if cupy is None:
        return why
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    return None


def _try_compile(source: str, backend: str, arch: str | None) -> str | None:
    """Compile (and cache) one module; return the failure reason or None."""
    dev = torch.cuda.current_device()
    key = (source, backend, arch, dev)
    if key in _compile_failures:
        return _compile_failures[key]
    if backend == "nvcc" and _loader.nvcc_path() is None:
        return "nvcc not found (the sm_90a build needs nvcc: cupy's NVRTC path adds its own arch)"
    try:
        _loader.load_module(source, backend=backend, arch=arch if backend == "nvcc" else None)
    except Exception as e:  # keep the log: status() reports it
        msg = f"compile error: {type(e).__name__}: {str(e).strip()[:400]}"
        _compile_failures[key] = msg
        return msg
    return None


_CANDIDATES: dict = {}


def _candidates(device: int | None = None):
    """[(path, launcher, reason-or-None)] for this device's compute capability, worked out once
    a device and dispatch table: every call asked again (two source-file hashes, a module-cache
    lookup and the self-test's key), which cost more host time than a 4096^3 wgmma GEMM runs,
    so the dispatched matmul measured at mma.sync's speed or below (H200, 2026-12-01)."""
    why = _environment_reason()
    if why is not None:
        return [], why
    dev = torch.cuda.current_device() if device is None else device
    major, minor = torch.cuda.get_device_capability(dev)
    table = DISPATCH.get(major)
    key = (dev, major, minor, None if table is None else tuple(map(id, table)))
    if key not in _CANDIDATES:
        _CANDIDATES[key] = _find_candidates(major, minor, table)
    return _CANDIDATES[key]


def _find_candidates(major, minor, table):
    if table is None:
        return [], (f"compute capability {major}.{minor} has no CUDA path (table covers "
                    f"{', '.join(f'{k}.x' for k in sorted(DISPATCH))}); Triton runs")
    out = []
    for name, fn, how in table:
        if name == "sm90a_wgmma" and minor != 0:
            out.append((name, fn, f"sm_90a code needs compute capability 9.0, got {major}.{minor}"))
            continue
        why = _try_compile(how["source"], how["backend"], how.get("arch"))
        if why is None and name == "sm90a_wgmma":
            why = wgmma_selftest()  # once per machine: a hang is caught in a subprocess
        out.append((name, fn, why))
    return out, None


def select_matmul_path(device: int | None = None) -> tuple[str | None, str]:
    """(path name or None, explanation) for bf16 matmul on this machine."""
    cands, why = _candidates(device)
    if why is not None:
        return None, why
    reasons = []
    for name, _fn, reason in cands:
        if reason is None:
            return name, "; ".join(reasons) if reasons else "preferred path for this GPU"
        reasons.append(f"{name}: {reason}")
    return None, "; ".join(reasons)


def unavailable_reason(a, b, out_dtype=None) -> str | None:
    """Why :func:`matmul` cannot take this call (None when it can): checks the environment and
    the operands without launching anything, so callers can fall back without an exception."""
    why = _environment_reason()
    if why is not None:
        return why
    try:
        check_gemm_operands(a, b, (torch.bfloat16,))
    except (TypeError, ValueError) as e:
        return str(e)
    if out_dtype not in (None, torch.bfloat16, torch.float32):
        return f"out_dtype {out_dtype} is not supported (bfloat16 or float32)"
    path, why = select_matmul_path(a.device.index)
    if path is None:
        return why
    return None


def matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None, *,
           path: str | None = None) -> torch.Tensor:
    """bf16 ``a @ b`` (fp32 accumulation) through the CUDA path chosen by :data:`DISPATCH`.

    Parameters
    ----------
    a, b : Tensor
        bf16, 2-D, row-major contiguous, 16-byte aligned, on a CUDA device; ``a`` is M x K,
        ``b`` is K x N with K and N multiples of 8. M is free.
    out_dtype : dtype, optional
        bfloat16 (default) or float32 (float32 goes through the sm_80 kernel).
    path : str, optional
        Force ``"sm90a_wgmma"`` or ``"sm80_mma"`` instead of the table's choice.

    Raises
    ------
    CudaPathUnavailable
        When no CUDA path can run here (no cupy, no GPU, wrong arch, compile error): the message
        says which. ``TypeError`` / ``ValueError`` name the offending argument.
    """
    why = _environment_reason()
    if why is not None:
        raise CudaPathUnavailable(f"no CUDA matmul path: {why}")
    check_gemm_operands(a, b, (torch.bfloat16,))
    with torch.cuda.device(a.device):
        cands, why = _candidates(a.device.index)
        if why is not None:
            raise CudaPathUnavailable(f"no CUDA matmul path: {why}")
        if out_dtype == torch.float32:  # only the sm_80 kernel writes fp32
            cands = [c for c in cands if c[0] == "sm80_mma"]
        if path is not None:
            known = [c[0] for c in cands]
            cands = [c for c in cands if c[0] == path]
            if not cands:
                raise CudaPathUnavailable(f"path {path!r} is not in this GPU's table "
                                          f"(available: {', '.join(known) or 'none'})")
        reasons = []
        for name, fn, reason in cands:
            if reason is None:
                return fn(a, b, out_dtype)
            reasons.append(f"{name}: {reason}")
        raise CudaPathUnavailable("no CUDA matmul path: " + ("; ".join(reasons) or "none"))


def _as_row_major(t: torch.Tensor) -> torch.Tensor:
    ok = t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] and t.data_ptr() % 16 == 0
    return t if ok else t.contiguous()


def _matmul_general(a: torch.Tensor, b: torch.Tensor, out_dtype=None) -> torch.Tensor:
    """``a @ b`` for any layout and leading batch dims: copies to row-major where needed and
    loops over the batch (each GEMM is large enough for one launch to fill the GPU)."""
    if a.dtype == torch.float32 and b.dtype == torch.float32 and out_dtype in (None,
                                                                               torch.float32):
        fn = _sgemm_best
    elif a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16:
        fn = functools.partial(matmul, out_dtype=out_dtype)
    else:
        raise CudaPathUnavailable(
            f"no CUDA kernel for {a.dtype} x {b.dtype} (bf16 tensor-core GEMMs, fp32 SGEMM)")
    why = _environment_reason()
    if why is not None:
        raise CudaPathUnavailable(f"no CUDA matmul path: {why}")
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"a and b need at least 2 dims, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    K, N = b.shape[-2], b.shape[-1]
    if a.dtype == torch.bfloat16 and (K % 8 or N % 8):
        raise CudaPathUnavailable(f"K = {K} and N = {N} must be multiples of 8 for the CUDA "
                                  "GEMMs (16-byte rows for cp.async / TMA)")
    if a.ndim == 2 and b.ndim == 2:
        return fn(_as_row_major(a), _as_row_major(b))
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    outs = [fn(_as_row_major(x), _as_row_major(y)) for x, y in zip(a3, b3)]
    return torch.stack(outs).reshape(*batch, a.shape[-2], N)


def _sgemm_best(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    M, K = a.shape
    N = b.shape[1]
    step = "cp_async" if (M % 128 == 0 and N % 128 == 0 and K % 8 == 0) else "2d_blocking"
    return sgemm(a, b, step)


#: op name -> callable, for :func:`dispatch`
OPS = {"matmul": _matmul_general, "sgemm": sgemm}


def dispatch(op: str, *args, **kwargs):
    """Run ``op`` through its CUDA path: ``dispatch("matmul", a, b, out_dtype=None)`` takes any
    layout and batch dims (bf16 -> tensor-core GEMM of this GPU's table, fp32 -> the best SGEMM
    step); raises :class:`CudaPathUnavailable` naming the reason when there is no CUDA path."""
    if op not in OPS:
        raise KeyError(f"no CUDA op {op!r} (have: {', '.join(OPS)})")
    return OPS[op](*args, **kwargs)


class Status(dict):
    """``status()``'s dict, printed as a short report."""

    def __str__(self) -> str:
        lines = ["CUDA escape hatches (tkit.cuda_ext):"]
        for k in ("cupy", "gpu", "nvcc", "cute_headers"):
            lines.append(f"  {k:16s} {self[k]}")
        for op, info in self["ops"].items():
            lines.append(f"  {op:16s} -> {info['path']}: {info['why']}")
        return "\n".join(lines)

    __repr__ = __str__


def status(compile: bool = True) -> Status:
    """Which path each op takes on this machine, and why the others are off.

    With ``compile=False`` nothing is compiled: the report then says what would be tried.
    """
    cupy, cupy_why = _loader.import_cupy()
    gpu = "none visible to torch"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        gpu = f"{torch.cuda.get_device_name()} (sm_{major}{minor})"
    info = Status(
        cupy=cupy.__version__ if cupy is not None else f"off: {cupy_why}",
        gpu=gpu,
        nvcc=_loader.nvcc_version() or "not found",
        cute_headers=_loader.cutlass_include() or "not found (pip install nvidia-cutlass)",
        ops={},
    )
    env_why = _environment_reason()
    if env_why is not None:
        for op in ("matmul", "sgemm", "matmul_fp8_block", "matmul_int4"):
            info["ops"][op] = {"path": "unavailable" if op == "sgemm" else "triton",
                               "why": f"CUDA paths off: {env_why}"}
        return info
    fp8_block = "gemm_fp8_block_sm90.cu"
    if not compile:
        major, _ = torch.cuda.get_device_capability()
        names = [n for n, _f, _h in DISPATCH.get(major, [])]
        info["ops"]["matmul"] = {"path": names[0] if names else "triton",
                                 "why": "not compiled yet (status(compile=True) checks)"}
        info["ops"]["sgemm"] = {"path": "sgemm.cu via NVRTC", "why": "not compiled yet"}
        info["ops"]["matmul_fp8_block"] = {"path": fp8_block, "why": "not compiled yet"}
        info["ops"]["matmul_int4"] = {"path": "gemm_int4_sm90.cu", "why": "not compiled yet"}
        return info
    path, why = select_matmul_path()
    info["ops"]["matmul"] = {"path": path or "triton", "why": why}
    err = _try_compile("sgemm.cu", "nvrtc", None)
    info["ops"]["sgemm"] = {"path": "unavailable" if err else "sgemm.cu via NVRTC",
                            "why": err or f"steps: {', '.join(SGEMM_STEPS)}"}
    info["ops"]["matmul_fp8_block"] = _fp8_block_status(fp8_block)
    info["ops"]["matmul_int4"] = _int4_status()
    return info


def _int4_status() -> dict:
    """The INT4 decode kernels in CUDA here: the GEMV's sm_90a build (one row of a, bf16
    activations, fp16 scales, groups of 128) and the stream-K GEMM's (16 rows) with its
    self-test, and which calls they take (``tkit.kernels.matmul.int4.cuda_gemv_reason`` and
    ``cuda_reason`` have the rules)."""
    if torch.cuda.get_device_capability() != (9, 0):
        return {"path": "triton", "why": "sm_90a code needs compute capability 9.0"}
    from tkit.cuda_ext.gemm_int4 import gemv_config, gemv_unavailable, unavailable

    dev = torch.cuda.current_device()
    cfg = gemv_config(1, 4096, 4096, torch.bfloat16, torch.float16, 128,
                      torch.cuda.get_device_properties(dev).multi_processor_count)
    why_gemv = gemv_unavailable(cfg["options"], dev)
    why = unavailable(16, torch.bfloat16, torch.float16, 128)
    if why_gemv is not None and why is not None:
        return {"path": "triton", "why": f"GEMV: {why_gemv}; GEMM: {why}"}
    parts = []
    if why_gemv is None:
        parts.append("gemv_int4.cu: unforced calls with 1..16 rows of a (N a multiple of 32, "
                     "groups of a multiple of 32 dividing K, 16-byte rows)")
    if why is None:
        parts.append("gemm_int4_sm90.cu: the other calls with 2..32 rows whose operands fit "
                     "its TMA boxes (N a multiple of 32, K of 64)")
    return {"path": " + ".join(p.split(":")[0] for p in parts),
            "why": "; ".join(parts) + "; the Triton kernels serve the rest"}


def _fp8_block_status(source: str) -> dict:
    """The block-scaled fp8 GEMM's CUDA kernel here: its sm_90a build and self-test, and
    which calls it takes (``tkit.kernels.matmul.fp8_block._cuda_choice`` has the rule)."""
    if torch.cuda.get_device_capability() != (9, 0):
        return {"path": "gluon/triton", "why": "sm_90a code needs compute capability 9.0"}
    from tkit.cuda_ext.gemm_fp8_block import unavailable

    why = unavailable()
    if why is not None:
        return {"path": "gluon", "why": why}
    return {"path": source, "why": "unforced calls whose 128 x 256 tiles fill the SMs well "
            "enough (fp8_block.cuda_grid_reason), no epilogue and bf16/fp16 outputs (the "
            "Gluon kernel serves the rest)"}


def cute_layouts() -> str:
    """Build and run csrc/cute_tiled_mma_layouts.cu (a host program: no GPU needed) and return
    what CuTe prints: the (thread, value) -> coordinate layouts of the mma.sync and wgmma atoms
    and the 128-byte swizzled shared-memory atoms."""
    exe = _loader.compile_executable("cute_tiled_mma_layouts.cu")
    return subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
