"""Eager plans executed in C++ (``_cplan.cpp``): a planned call's allocations and launches in
one call from Python.

Why: a plan (:mod:`tkit.kernels._plan`) leaves a small eager call with two Python-to-C
crossings that each cost as much as torch's whole call of a small op on the H200's host:
``torch.empty_like`` (argument parsing, the dispatcher) and Triton's C launcher (parsing a
dozen or more arguments and the packed metadata), plus a ``data_ptr()`` call a tensor. Here
the plan's outputs come from ``at::empty`` and its kernels from ``cuLaunchKernel`` with the
parameter values packed once when the plan is built, and only the pointer slots patched per
call (docs/NOTES.md, "sixth session", has the host profile before and after).

The extension is compiled once per machine (torch version, Python, compiler and this source
hashed) into ``$TKIT_CACHE_DIR/cplan/`` with the C++ compiler (``$CXX`` or ``c++``) against
torch's headers; a process that finds it there only loads it. Where it cannot be built or
loaded (no compiler, ``TKIT_NO_CPLAN=1``, a Triton whose compiled kernels lack what a launch
needs), plans stay in Python and :func:`status` says why.

A launch qualifies when Triton's own launcher would do nothing but pass its arguments: no
global or profile scratch, no cooperative or PDL launch, one CTA a cluster, and parameters
that are pointers, integer and float32/64 scalars, or host TMA descriptors of the call's
tensors (no tuples). A descriptor is what Triton's launcher makes of it per call (a
CUtensorMap encoded from the kernel's descriptor metadata, then the shape and strides): the
executor encodes the map with the call's base pointer (reusing its last encoding when the
pointer is the same) and passes the shape and strides as recorded (the signature's).
Descriptors through Triton's launcher cost 3-4 host microseconds each on the H200 (the
Gluon GEMM takes 3-7 a call), and the Python plan that rebuilt them ~20 us a GEMM.

The extension also holds the registered ops' kernels for the dispatcher (``FastOp``, registered
by :func:`tkit.kernels._plan.register_ops` at each plan op's AutogradCUDA and CUDA keys): a
call of plain tensors needing no gradient is keyed from the dispatcher's arguments and served
by the op's plan (the GIL taken for the lookup); every other call goes where the op's Python
kernels would send it (the autograd path, or the Python implementation, which records plans).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from tkit import _env

SOURCE = Path(__file__).with_name("_cplan.cpp")

#: plans built from now on may use the executor (tests and benchmarks switch it; plans
#: already built keep their form until ``tkit.kernels._plan.clear()``)
ON = not _env.NO_CPLAN

_lock = threading.Lock()
_module = None
_reason = "not built yet"
_tried = False

# parameter types Triton's launcher passes: struct format of one 8-byte slot
_INT_FORMATS = {"i1": "<b", "i8": "<b", "i16": "<h", "i32": "<i", "i64": "<q", "u1": "<B",
                "u8": "<B", "u16": "<H", "u32": "<I", "u64": "<Q"}
_FLOAT_FORMATS = {"fp32": "<f", "f32": "<f", "fp64": "<d"}


def status() -> str:
    """'ready', or why plans run in Python."""
    return "ready" if _module is not None else _reason


def module():
    """The loaded extension, building it on first use; None where it is unavailable."""
    global _module, _reason, _tried
    if _module is not None or _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        _tried = True
        if _env.NO_CPLAN:
            _reason = "TKIT_NO_CPLAN=1"
            return None
        try:
            _module = _load(_build())
            _reason = "ready"
        except Exception as e:  # noqa: BLE001 - any failure leaves plans in Python, reported
            _reason = f"{type(e).__name__}: {e}"[:2000]
            _module = None
    return _module


def fast_functions(device_stream):
    """(serve, make_key) of the executor for :func:`tkit.kernels._plan.serve_fast`, or None
    where it is unavailable. ``device_stream() -> (device, stream)`` is the source of the
    current device and stream where torch has no CUDA libraries to read them from natively
    (the native getters are checked against it once)."""
    mod = module()
    if mod is None:
        return None
    mod.set_device_stream(device_stream)
    if torch.cuda.is_available():
        lib = Path(torch.__file__).parent / "lib"
        if mod.init_cuda(str(lib / "libc10_cuda.so"), str(lib / "libtorch_cuda.so")):
            try:
                same = mod.native_device_stream() == tuple(device_stream())
            except Exception:  # noqa: BLE001 - no device to compare on: keep Python's source
                same = False
            if not same:
                mod.init_cuda("", "")  # not found: the Python source serves
    return mod.serve, mod.make_key


def _key() -> str:
    h = hashlib.sha256(SOURCE.read_bytes())
    for part in (torch.__version__, sys.version, _compiler(), torch.__file__):
        h.update(part.encode())
    return h.hexdigest()[:16]


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def _build() -> Path:
    """The compiled extension's path: found in the cache, or compiled there (into a temporary
    file renamed into place, so concurrent processes never load a partial file)."""
    out_dir = _env.CACHE_DIR / "cplan"
    so = out_dir / f"_tkit_cplan-{_key()}.so"
    if so.exists():
        return so
    out_dir.mkdir(parents=True, exist_ok=True)
    import sysconfig

    from torch.utils import cpp_extension

    lib_dirs = cpp_extension.library_paths()
    cmd = [_compiler(), "-O2", "-std=c++17", "-shared", "-fPIC", "-w", str(SOURCE)]
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    cmd += [f"-I{sysconfig.get_paths()['include']}"]
    cmd += [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    cmd += [f"-L{p}" for p in lib_dirs] + [f"-Wl,-rpath,{p}" for p in lib_dirs]
    cmd += ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", "-ldl"]
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        res = subprocess.run(cmd + ["-o", tmp], capture_output=True, text=True, timeout=600)
        if res.returncode:
            raise RuntimeError(f"compiling {SOURCE.name} failed:\n{res.stderr[-1500:]}")
        os.replace(tmp, so)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return so


def _load(path: Path):
    loader = importlib.machinery.ExtensionFileLoader("_tkit_cplan", str(path))
    spec = importlib.util.spec_from_file_location("_tkit_cplan", str(path), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def launch_spec(compiled, grid, values):
    """(function, grid, threads, shared, slots, pattern, tmas) for one recorded launch of a
    compiled kernel, or None when the launch does not qualify. ``values``: the launch's
    arguments as :func:`tkit.kernels._plan.build` matched them: ``("slot", i)`` for a tensor
    of the call (its pointer patched per call), ``("const", v)``, or ``("desc", (i, shape,
    strides, padding, plain))`` for a host TMA descriptor over call tensor i (encoded per call;
    ``plain``: a tiled map of the tensor's own type, the only form taken here)."""
    md = getattr(compiled, "metadata", None)
    src = getattr(compiled, "src", None)
    sig = getattr(src, "signature", None)
    fn = getattr(compiled, "function", None)
    if md is None or not isinstance(sig, dict) or type(fn) is not int:
        return None
    if (getattr(md, "num_ctas", 1) != 1 or getattr(md, "global_scratch_size", 0)
            or getattr(md, "profile_scratch_size", 0) or getattr(md, "launch_cooperative_grid",
                                                                  False)
            or getattr(md, "launch_pdl", False)):
        return None
    types = list(sig.values())
    if len(types) != len(values):
        return None
    metas = list(getattr(md, "tensordesc_meta", None) or [])
    n_desc = sum(1 for ty in types if isinstance(ty, str) and ty.startswith("tensordesc"))
    if n_desc and len(metas) != n_desc:
        return None  # descriptors lowered to pointers (no metadata): Triton's launcher
    slots, patches, tmas = [], [], []
    for ty, (kind, v) in zip(types, values):
        if not isinstance(ty, str):
            return None  # a tuple argument
        if ty.startswith("tensordesc"):
            tma = _tma_spec(metas.pop(0), kind, v, len(slots))
            if tma is None:
                return None
            tmas.append(tma)
            slots.append(0)  # the map's parameter (the executor points it at the encoding)
            _, shape, strides, _, _ = v
            slots += [int.from_bytes(struct.pack("<i", n), "little") for n in shape]
            slots += [int.from_bytes(struct.pack("<q", n), "little") for n in strides]
            continue
        if kind == "desc":
            return None
        if ty == "constexpr":
            continue
        if ty.startswith("*"):
            if kind == "slot":
                patches.append((len(slots), v))
                slots.append(0)
            elif v is None:
                slots.append(0)
            else:
                return None
            continue
        if kind != "const" or isinstance(v, (str, type(None))):
            return None
        fmt = _INT_FORMATS.get(ty) or _FLOAT_FORMATS.get(ty)
        if fmt is None:
            return None  # 16-bit float scalars, descriptors: Triton's launcher packs them
        try:
            raw = struct.pack(fmt, float(v) if ty in _FLOAT_FORMATS else int(v))
        except (struct.error, TypeError, ValueError, OverflowError):
            return None
        slots.append(int.from_bytes(raw.ljust(8, b"\0"), "little"))
    slots += [0, 0]  # global and profile scratch: none
    if len(slots) > 128:
        return None
    gx, gy, gz = (int(g) for g in grid)
    return (fn, (gx, gy, gz), 32 * int(md.num_warps), int(md.shared), tuple(slots),
            tuple(patches), tuple(tmas))


# Triton's device-side TMA data type codes to the driver's CUtensorMapDataType (they differ
# for three types; Triton's driver keeps the same table)
_TMA_DTYPE_TO_HOST = {**{i: i for i in range(16)}, 8: 10, 9: 8, 10: 9}


def _tma_spec(meta, kind, value, slot):
    """(slot, tensor index, CUtensorMapDataType, dims, byte strides, box, swizzle, fill) of
    one host descriptor parameter, dimensions innermost first (cuTensorMapEncodeTiled's
    order, as Triton's ``fill_tma_descriptor`` passes them), or None when the executor cannot
    make it (a descriptor of no call tensor, fp4 padding, an unexpected rank)."""
    if (kind != "desc" or not isinstance(meta, dict) or meta.get("fp4_padded")
            or meta.get("is_im2col") or not value[4]):
        return None
    tensor, shape, strides, padding, _ = value
    rank = len(shape)
    block = [int(b) for b in meta["block_size"]]
    if not 1 <= rank <= 5 or len(strides) != rank or len(block) != rank or strides[-1] != 1:
        return None
    es = int(meta["elem_size"])
    dims = tuple(reversed(shape))
    byte_strides = tuple(es * int(s) for s in reversed(strides[:-1]))
    try:
        dtype = _TMA_DTYPE_TO_HOST[int(meta["elem_type"])]
    except KeyError:
        return None
    return (slot, tensor, dtype, dims, byte_strides, tuple(reversed(block)),
            int(meta["swizzle"]), 1 if padding == "nan" else 0)
