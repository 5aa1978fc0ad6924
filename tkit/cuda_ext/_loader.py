"""Compile, cache and launch the CUDA sources in ``tkit/cuda_ext/csrc``.

Two ways in:

* :func:`load_module` compiles a source for the GPU in this process and returns a
  ``cupy.RawModule``. ``backend="nvrtc"`` (the default) hands the source to NVRTC through cupy;
  cupy picks ``-arch=sm_XY`` from the device. ``backend="nvcc"`` runs ``nvcc -cubin`` (the CuTe
  headers of the ``nvidia-cutlass`` wheel on the include path) and loads the cubin: it is the way
  to an arch-specific target such as ``sm_90a`` (wgmma, setmaxnreg), which cupy's NVRTC path
  cannot ask for (it appends its own ``-arch``).
* :func:`compile_cubin` runs nvcc alone, no GPU and no cupy needed: the compile-only tests and
  ``tkit.ir``-style reading of SASS (:func:`sass`) use it on CPU machines.

Every source gets ``#line 1 "<path>"`` prepended so compiler errors name the real file. Compiled
modules are cached in memory by (source hash, options, arch, toolchain version, backend), and
cubins on disk under ``$TKIT_CACHE_DIR/cuda_ext`` by the same key (NVRTC builds go to cupy's own
disk cache, which keys on the same things).

Launches go through the driver (``cuLaunchKernel``) on torch's current stream, with every
argument typed: tensors as their ``data_ptr()`` (64-bit), ``np.int32`` / ``np.float32`` scalars,
and ``bytes`` for by-value structs such as a 128-byte ``CUtensorMap``. Untyped Python numbers are
refused, so the C signature and the Python call cannot drift apart silently.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np
import torch

from tkit import _env
from tkit.kernels import _launch

CSRC = Path(__file__).resolve().parent / "csrc"
_lock = threading.Lock()
_modules: dict[tuple, object] = {}
#: source -> how it was built when that differs from what was asked (status() reports it)
notes: dict[str, str] = {}


class CompileError(RuntimeError):
    """A CUDA source failed to compile; the message carries the compiler's log."""


# ---- toolchain discovery (all cheap, none needs a GPU) ---------------------------------------
def import_cupy():
    """``(cupy, None)`` or ``(None, reason)``."""
    try:
        import cupy  # noqa: F401
        from cupy_backends.cuda.api import driver  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return None, f"cupy is not importable ({type(e).__name__}: {e})"
    return cupy, None


@functools.cache
def nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").exists():
            return str(Path(root) / "bin" / "nvcc")
    return None


@functools.cache
def nvcc_version() -> str | None:
    nvcc = nvcc_path()
    if nvcc is None:
        return None
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    last = [line for line in out.splitlines() if line.strip()]
    return last[-1].strip() if last else "unknown"


@functools.cache
def cutlass_include() -> str | None:
    """CuTe/CUTLASS headers shipped by the ``nvidia-cutlass`` wheel, if installed."""
    try:
        import cutlass_library
    except Exception:
        return None
    inc = Path(cutlass_library.__file__).resolve().parent / "source" / "include"
    return str(inc) if (inc / "cute").is_dir() else None


def missing(*, nvcc: bool = False, cute: bool = False) -> str | None:
    """Why a CUDA path cannot be built here, naming what to install (None when it can): every
    path needs cupy; the nvcc backend needs nvcc; the CuTe GEMM also the CuTe headers."""
    _, why = import_cupy()
    if why is not None:
        return f"{why}: pip install 'tkit[cuda]'"
    if (nvcc or cute) and nvcc_path() is None:
        return "nvcc is not on the PATH (nor under CUDA_HOME/CUDA_PATH)"
    if cute and cutlass_include() is None:
        return "CuTe headers not found: pip install nvidia-cutlass (or 'tkit[cuda]')"
    return None


@functools.cache
def cuda_binutil(name: str) -> str | None:
    """``cuobjdump`` / ``nvdisasm``: from the CUDA install or else from the Triton wheel."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import triton
    except Exception:
        return None
    p = Path(triton.__file__).resolve().parent / "backends" / "nvidia" / "bin" / name
    return str(p) if p.exists() else None


def _nvrtc_version() -> str:
    try:
        from cupy_backends.cuda.libs import nvrtc

        major, minor = nvrtc.getVersion()
        return f"nvrtc {major}.{minor}"
    except Exception as e:
        return f"nvrtc unknown ({type(e).__name__})"


# ---- sources ---------------------------------------------------------------------------------
def source_path(name: str) -> Path:
    path = CSRC / name
    if not path.exists():
        known = ", ".join(sorted(p.name for p in CSRC.glob("*.cu")))
        raise FileNotFoundError(f"no CUDA source {name!r} in {CSRC} (have: {known})")
    return path


_LOCAL_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_]+\.cuh)"[ \t]*$', re.M)


def _included(path: Path) -> list[Path]:
    """The csrc/ headers ``path`` includes with ``#include "name.cuh"`` (one level)."""
    return [source_path(m.group(1)) for m in _LOCAL_INCLUDE.finditer(path.read_text())]


def read_source(name: str) -> str:
    """The source with a ``#line`` directive, so diagnostics name the file in csrc/, and its
    ``#include "name.cuh"`` lines replaced by those csrc/ headers (each between ``#line``
    directives): one self-contained text for nvcc from the cache folder and for NVRTC."""
    path = source_path(name)
    lines = path.read_text().split("\n")
    out = [f'#line 1 "{path}"']
    for i, line in enumerate(lines):
        m = _LOCAL_INCLUDE.match(line)
        if m is None:
            out.append(line)
            continue
        header = source_path(m.group(1))
        out += [f'#line 1 "{header}"', header.read_text().rstrip("\n"),
                f'#line {i + 2} "{path}"']
    return "\n".join(out)


_HASHES: dict = {}


def source_hash(name: str) -> str:
    """The content hash of the source and its csrc/ headers (their bytes alone: the same in
    every checkout), kept per (path, mtime, size) of each file: launchers key their modules
    and self-tests on it every call, and reading and hashing the files each time cost tens
    of microseconds a launch."""
    path = source_path(name)
    st = path.stat()
    key = (str(path), st.st_mtime_ns, st.st_size)
    entry = _HASHES.get(key)
    if entry is not None:
        digest, headers = entry
        if all(_stamp(h) == s for h, s in headers):
            return digest
    headers = tuple((h, _stamp(h)) for h in _included(path))
    content = path.read_bytes() + b"".join(h.read_bytes() for h, _ in headers)
    digest = hashlib.sha256(content).hexdigest()[:16]
    _HASHES[key] = (digest, headers)
    return digest


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_mtime_ns, st.st_size


def _key_digest(*parts) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def gencode(arch: str) -> str:
    """``"90a"`` -> ``-gencode=arch=compute_90a,code=sm_90a``."""
    return f"-gencode=arch=compute_{arch},code=sm_{arch}"


# ---- nvcc: compile-only, and the arch-specific runtime path ----------------------------------
def compile_cubin(
    name: str,
    arch: str,
    options: tuple[str, ...] = (),
    *,
    cache_dir: str | Path | None = None,
    cute: bool = False,
) -> Path:
    """``nvcc -cubin`` one source for one arch; cached on disk by (source, options, arch, nvcc).

    Raises :class:`CompileError` with the compiler log, or ``FileNotFoundError`` without nvcc.
    """
    nvcc = nvcc_path()
    if nvcc is None:
        raise FileNotFoundError("nvcc is not on the PATH (nor under CUDA_HOME/CUDA_PATH)")
    opts = list(options)
    if cute:
        inc = cutlass_include()
        if inc is None:
            raise FileNotFoundError("CuTe headers not found: pip install nvidia-cutlass")
        opts += ["-std=c++17", f"-I{inc}"]
    cache = Path(cache_dir) if cache_dir is not None else _env.CACHE_DIR / "cuda_ext"
    cache.mkdir(parents=True, exist_ok=True)
    key = _key_digest(source_hash(name), tuple(opts), arch, nvcc_version(), "nvcc")
    out = cache / f"{Path(name).stem}-{arch}-{key}.cubin"
    if out.exists():
        return out
    src = cache / f"{Path(name).stem}-{key}.cu"
    src.write_text(read_source(name))
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [nvcc, "-cubin", gencode(arch), "-O3", "-lineinfo", *opts, "-o", str(tmp), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise CompileError(f"nvcc failed on {name} for sm_{arch}:\n{' '.join(cmd)}\n"
                           f"{proc.stderr.strip()}")
    os.replace(tmp, out)
    return out


def compile_executable(name: str, *, cache_dir: str | Path | None = None) -> Path:
    """Build a host program (the CuTe layout printer) with nvcc; cached like cubins."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise FileNotFoundError("nvcc is not on the PATH")
    inc = cutlass_include()
    if inc is None:
        raise FileNotFoundError("CuTe headers not found: pip install nvidia-cutlass")
    cache = Path(cache_dir) if cache_dir is not None else _env.CACHE_DIR / "cuda_ext"
    cache.mkdir(parents=True, exist_ok=True)
    key = _key_digest(source_hash(name), nvcc_version(), inc, "exe")
    out = cache / f"{Path(name).stem}-{key}"
    if out.exists():
        return out
    src = cache / f"{Path(name).stem}-{key}.cu"
    src.write_text(read_source(name))
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [nvcc, "-std=c++17", f"-I{inc}", "-o", str(tmp), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise CompileError(f"nvcc failed on {name}:\n{proc.stderr.strip()}")
    os.replace(tmp, out)
    return out


def sass(cubin: str | Path) -> str:
    """SASS of a cubin (``cuobjdump -sass``)."""
    tool = cuda_binutil("cuobjdump")
    if tool is None:
        raise FileNotFoundError("cuobjdump not found (CUDA install or the Triton wheel)")
    proc = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"cuobjdump failed on {cubin}: {proc.stderr.strip()}")
    return proc.stdout


def sass_by_function(cubin: str | Path) -> dict[str, str]:
    """{kernel name: its SASS} for every function of a cubin."""
    out: dict[str, str] = {}
    name = None
    for line in sass(cubin).splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            out[name] = ""
        elif name:
            out[name] += line + "\n"
    return out


def resource_usage(name: str, arch: str, options: tuple[str, ...] = ()) -> str:
    """ptxas's register / spill / shared-memory report for every kernel of a source."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise FileNotFoundError("nvcc is not on the PATH")
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / Path(name).name
        src.write_text(read_source(name))
        proc = subprocess.run([nvcc, "-cubin", gencode(arch), "-O3", "-Xptxas", "-v", *options,
                               "-o", str(Path(d) / "k.cubin"), str(src)],
                              capture_output=True, text=True)
    if proc.returncode != 0:
        raise CompileError(proc.stderr.strip())
    return proc.stderr


# ---- runtime: load through cupy ----------------------------------------------------------------
def device_arch(device: torch.device | int | None = None) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}"


def load_module(name: str, *, backend: str = "nvrtc", arch: str | None = None,
                options: tuple[str, ...] = (), device: int | None = None):
    """A ``cupy.RawModule`` for ``csrc/<name>`` built for the current device.

    ``backend="nvrtc"``: compiled by NVRTC for the device's own ``sm_XY``.
    ``backend="nvcc"``: compiled by nvcc for ``arch`` (e.g. ``"90a"``) and loaded as a cubin.
    """
    cupy, why = import_cupy()
    if cupy is None:
        raise RuntimeError(why)
    if backend not in ("nvrtc", "nvcc"):
        raise ValueError(f"backend must be 'nvrtc' or 'nvcc', got {backend!r}")
    dev = torch.cuda.current_device() if device is None else device
    arch = arch or device_arch(dev)
    toolchain = _nvrtc_version() if backend == "nvrtc" else nvcc_version()
    key = (source_hash(name), tuple(options), arch, toolchain, backend, dev)
    with _lock:
        mod = _modules.get(key)
        if mod is not None:
            return mod
        with cupy.cuda.Device(dev):
            if backend == "nvrtc":
                mod = cupy.RawModule(code=read_source(name), options=tuple(options),
                                     backend="nvrtc")
                try:
                    mod.compile()
                except Exception as e:
                    if nvcc_path() is None:
                        raise CompileError(f"NVRTC failed on {name}: {e}") from e
                    # the same source through nvcc for the device's own arch; recorded so
                    # status() can say so
                    notes[name] = f"NVRTC failed ({type(e).__name__}), built by nvcc instead"
                    mod = cupy.RawModule(path=str(compile_cubin(name, arch, tuple(options))))
            else:
                cubin = compile_cubin(name, arch, tuple(options),
                                      cute="cute" in name or "-DTKIT_CUTE" in options)
                mod = cupy.RawModule(path=str(cubin))
        _modules[key] = mod
        return mod


def get_kernel(module, kernel_name: str) -> int:
    """The ``CUfunction`` handle of one kernel of a loaded module."""
    return module.get_function(kernel_name).kernel.ptr


@functools.cache
def nvcc_kernel(name: str, kernel_name: str, options: tuple[str, ...], device: int,
                arch: str = "90a") -> int:
    """The ``CUfunction`` of ``kernel_name`` in source ``name`` built by nvcc with
    ``options`` for ``arch``, loaded on ``device`` (once a process per build and device)."""
    mod = load_module(name, backend="nvcc", arch=arch, options=options, device=device)
    return get_kernel(mod, kernel_name)


#: workspaces replaced by larger ones: a CUDA graph captured with one still points at it
_retired: list = []


def per_stream(cache: dict, device: torch.device, make, fits=None):
    """``make()``'s value kept in ``cache`` for this device and its current stream (launches
    on two streams never share one), made again where ``fits(value)`` is false: the
    workspaces that kernels leave as they found them (counters back at 0), so one set
    serves every launch of a stream.

    A replaced value is kept alive (graphs captured with it replay it). Under CUDA-graph
    capture a value is not made for the stream: ``make()``'s zeroing would be a node of this
    graph alone, and a later graph captured on the stream would get the value unzeroed if
    replayed first; the call gets a value of its own, which the graph keeps and zeroes at
    each replay (a stream's value made before the capture serves it as any call)."""
    stream = torch.cuda.current_stream(device).cuda_stream
    key = (device, stream)
    v = cache.get(key)
    if v is None or (fits is not None and not fits(v)):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return make()
        if v is not None:
            _retired.append(v)
        v = cache[key] = make()
    if _launch._recorders:  # an eager plan of this call keeps them and serves this stream
        _launch.record_stream_buffers(stream, [t for t in (v if isinstance(v, tuple) else (v,))
                                               if isinstance(t, torch.Tensor)])
    return v


class TensorMap(bytes):
    """A ``CUtensorMap`` (128 bytes, passed by value) with what encoded it: ``ptr``, the base
    address, and ``spec``, the rest of ``cuTensorMapEncodeTiled``'s arguments (data type
    code, dims innermost first, byte strides of dims 1.., box, swizzle, out-of-bounds fill and
    L2 promotion codes), from which an eager plan encodes the same map over another call's
    tensor."""

    ptr: int
    spec: tuple


def _c_arg(x, i: int):
    if isinstance(x, torch.Tensor):
        return ctypes.c_uint64(x.data_ptr())
    if isinstance(x, np.int32):
        return ctypes.c_int32(int(x))
    if isinstance(x, np.int64):
        return ctypes.c_int64(int(x))
    if isinstance(x, np.float32):
        return ctypes.c_float(float(x))
    if isinstance(x, (bytes, bytearray)):
        return (ctypes.c_ubyte * len(x)).from_buffer_copy(bytes(x))
    raise TypeError(f"kernel argument {i} has type {type(x).__name__}; pass a torch.Tensor, "
                    "np.int32, np.int64, np.float32 or bytes (typed, so the C signature is "
                    "matched exactly)")


_MAX_DYN_SMEM = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_smem_set: dict[tuple[int, int], bool] = {}


def launch(func: int, grid: tuple[int, ...], block: tuple[int, ...], args: tuple,
           *, smem: int = 0, stream: int | None = None) -> None:
    """``cuLaunchKernel`` on torch's current stream with typed arguments."""
    from cupy_backends.cuda.api import driver

    grid = tuple(grid) + (1,) * (3 - len(grid))
    block = tuple(block) + (1,) * (3 - len(block))
    if smem > 48 * 1024 and not _smem_set.get((func, smem)):
        driver.funcSetAttribute(func, _MAX_DYN_SMEM, smem)
        _smem_set[(func, smem)] = True
    cargs = [_c_arg(a, i) for i, a in enumerate(args)]
    params = (ctypes.c_void_p * len(cargs))(*[ctypes.addressof(c) for c in cargs])
    if _launch._recorders:
        _record(func, grid, block, smem, args, stream)
    if stream is None:
        stream = torch.cuda.current_stream().cuda_stream
    driver.launchKernel(func, *grid, *block, smem, stream, ctypes.addressof(params), 0)


_CONST_FORMATS = {np.int32: "<i", np.int64: "<q", np.float32: "<f"}


def _record(func, grid, block, smem, args, stream) -> None:
    """A launch of the eager call being recorded, in the form its plan replays
    (:class:`tkit.kernels._launch.RawLaunch`): tensors, typed scalars and tensor maps; any
    other argument, a 2-d or 3-d block or a stream other than the current one makes the call
    unplannable."""
    out = []
    ok = stream is None and block[1] == block[2] == 1
    for a in args if ok else ():
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif type(a) in _CONST_FORMATS:
            out.append(("const", _CONST_FORMATS[type(a)], a.item()))
        elif isinstance(a, TensorMap):
            out.append(("map", a.ptr, a.spec))
        else:
            ok = False
            break
    _launch.record_raw(int(func), grid, block[0], smem, tuple(out) if ok else None)
