"""Compile any tkit op or Triton kernel ahead of time, for any NVIDIA target, without a GPU.

How a kernel becomes IR here:

1. ``resolve``: a tkit op (its function or registry name) is called on meta tensors inside
   ``tkit.kernels._common.capture_launches()``, which records the kernel, grid and keyword
   arguments of every launch instead of running it. A user's ``@triton.jit`` / autotuned
   kernel is taken with the launch arguments given.
2. ``specialize``: the arguments become an ``ASTSource`` signature the way Triton's launcher
   specializes them (``JITFunction.run`` -> ``native_specialize_impl``): tensors become
   ``*bf16``-style pointers, divisible by 16 when 16-byte aligned; integers equal to 1 become
   constexprs, multiples of 16 carry ``tt.divisibility``; ``tl.constexpr`` parameters and the
   chosen autotune config are constants. So the kernel compiled here is the one that would run.
3. ``triton.compile`` for ``GPUTarget("cuda", cap, 32)``; results are cached in-process.

Kernels created while ``TRITON_INTERPRET=1`` is set are ``InterpretedFunction`` objects; they
are rebuilt as ``JITFunction`` (with their callees) for compilation, so IR works under the
interpreter too. Under the interpreter, tkit's autotuned kernels carry only their interpreter
config (``_common.interpreter_configs``); pass ``config=`` to pick other block sizes.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import triton

from tkit._compat import compile_options

__all__ = ["IRError", "CompiledIR", "compile", "parse_arch", "STAGES", "ptxas_path"]

STAGES = ("source", "ttir", "ttgir", "llir", "ptx", "sass")
# NVIDIA targets that tkit.ir compiles for (Triton 3.x supports compute capability >= 8.0 here)
SUPPORTED_CAPS = (80, 86, 87, 89, 90, 100, 103, 120)
_OPTION_NAMES = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion",
                 "launch_pdl")


class IRError(ValueError):
    """Bad input to tkit.ir: unknown op, unsupported arch, arguments that do not fit the kernel."""


# --------------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------------
def parse_arch(arch: str | int | None) -> int:
    """``"sm_90"``, ``"sm_90a"``, ``"90"``, ``90``, ``(9, 0)`` -> 90; None -> the local GPU
    (sm_90 without one)."""
    if arch is None:
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return major * 10 + minor
        return 90
    if isinstance(arch, tuple):
        arch = arch[0] * 10 + arch[1]
    text = str(arch).strip().lower()
    m = re.fullmatch(r"(?:sm_?|compute_?)?(\d{2,3})a?", text)
    if not m:
        if text.startswith("gfx"):
            raise IRError(f"arch {arch!r} is an AMD target; tkit.ir compiles for NVIDIA targets "
                          f"only ({_arch_list()})")
        raise IRError(f"arch {arch!r} not understood; use e.g. 'sm_80' or 'sm_90' "
                      f"({_arch_list()})")
    cap = int(m.group(1))
    if cap not in SUPPORTED_CAPS:
        raise IRError(f"arch {arch!r}: Triton {triton.__version__} cannot target sm_{cap} here; "
                      f"supported: {_arch_list()}")
    return cap


def _arch_list() -> str:
    return ", ".join(f"sm_{c}" for c in SUPPORTED_CAPS)


# --------------------------------------------------------------------------------------------
# Kernels: unwrap autotuners/heuristics, rebuild interpreter kernels as JITFunctions
# --------------------------------------------------------------------------------------------
def _interpreted_type():
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except Exception:  # pragma: no cover
        return ()
    return InterpretedFunction


# keyed by the InterpretedFunction itself (not its id: ids of collected objects are reused)
_JIT_MEMO: dict[Any, Any] = {}


def as_jit(fn):
    """The ``JITFunction`` for ``fn`` (rebuilt from an ``InterpretedFunction``, with every
    interpreted callee in its globals rebuilt too)."""
    from triton.runtime.jit import JITFunction

    if isinstance(fn, JITFunction):
        return fn
    interp = _interpreted_type()
    if not (interp and isinstance(fn, interp)):
        raise IRError(f"{fn!r} is not a Triton kernel (@triton.jit)")
    if fn in _JIT_MEMO:
        return _JIT_MEMO[fn]
    jit = JITFunction(fn.fn, **fn.kwargs)
    _JIT_MEMO[fn] = jit
    import triton.language as tl

    from tkit.kernels import _numerics

    scope = dict(fn.fn.__globals__)
    for name, value in list(scope.items()):
        if isinstance(value, interp):
            scope[name] = as_jit(value)
        elif value is _numerics.INTERPRET:
            # the kernels' ``if INTERPRET:`` workarounds are for the interpreter's own
            # arithmetic: the GPU build compiled here must not carry them
            scope[name] = tl.constexpr(False)
    jit.__globals__ = scope
    return jit


def _lang_objects() -> list:
    import triton.language as tl

    objs = [m for name, m in list(sys.modules.items())
            if m is not None and name.startswith("triton.language")]
    return objs + [tl.tensor, tl.dtype, tl.core.tensor_descriptor_base]


def _from_interpreter(value) -> bool:
    fn = value.func if isinstance(value, functools.partial) else value
    code = getattr(fn, "__code__", None)
    return bool(code and code.co_filename.endswith(os.path.join("runtime", "interpreter.py")))


def _unpatched(value):
    """The original of an interpreter wrapper ``lambda *a, member=member, **kw``."""
    while _from_interpreter(value) and "member" in (getattr(value, "__kwdefaults__", None) or {}):
        value = value.__kwdefaults__["member"]
    return value


def _snapshot_language() -> dict:
    snap = {}
    for obj in _lang_objects():
        for name, value in list(vars(obj).items()):
            snap[(id(obj), name)] = (obj, name, _unpatched(value))
    return snap


# Triton's interpreter patches triton.language while it runs a kernel, and a device-function
# call (``InterpretedFunction.__call__``) leaves some of its patches in place (triton 3.6).
# The code generator must see the real language, so compilation puts these originals back for
# its duration. Taken at import, i.e. before tests run any kernel.
_LANGUAGE = _snapshot_language()


@contextlib.contextmanager
def _real_language():
    changed = []
    for obj, name, original in _LANGUAGE.values():
        current = vars(obj).get(name, original)
        if current is not original and _from_interpreter(current):
            changed.append((obj, name, current))
            setattr(obj, name, original)
    for obj in _lang_objects():  # wrappers from patches made before the snapshot
        for name, value in list(vars(obj).items()):
            if _from_interpreter(value) and _unpatched(value) is not value:
                changed.append((obj, name, value))
                setattr(obj, name, _unpatched(value))
    try:
        yield
    finally:
        for obj, name, value in reversed(changed):
            setattr(obj, name, value)


@contextlib.contextmanager
def _jit_language(jit):
    """While compiling under the interpreter, swap every ``InterpretedFunction`` attribute of
    the triton.language modules (``tl.cdiv``, ``tl.sum`` are ``@jit`` functions there) and of
    the modules the kernel's globals name for its JITFunction, so that the code generator never
    calls into the interpreter."""
    interp = _interpreted_type()
    if not interp:
        yield
        return
    modules = [m for name, m in list(sys.modules.items())
               if m is not None and name.startswith("triton.language")]
    modules += [v for v in jit.__globals__.values() if isinstance(v, types.ModuleType)]
    swapped = []
    for mod in dict.fromkeys(modules):
        for name, value in list(vars(mod).items()):
            if isinstance(value, interp):
                swapped.append((mod, name, value))
                setattr(mod, name, as_jit(value))
    try:
        yield
    finally:
        for mod, name, value in reversed(swapped):
            setattr(mod, name, value)


def unwrap(kernel):
    """(autotuner or None, [heuristics], jit function) for a launchable Triton object."""
    from triton.runtime.autotuner import Autotuner, Heuristics

    tuner, heuristics = None, []
    obj = kernel
    while True:
        if isinstance(obj, Autotuner):
            tuner = tuner or obj
            obj = obj.fn
        elif isinstance(obj, Heuristics):
            heuristics.append(obj)
            obj = obj.fn
        else:
            break
    return tuner, heuristics, as_jit(obj)


def is_kernel(obj) -> bool:
    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.jit import JITFunction

    interp = _interpreted_type()
    return isinstance(obj, (JITFunction, Autotuner, Heuristics)) or bool(
        interp and isinstance(obj, interp))


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "f16": torch.float16,
           "fp32": torch.float32, "f32": torch.float32, "fp8": torch.float8_e4m3fn,
           "fp8e4m3": torch.float8_e4m3fn, "fp8e5m2": torch.float8_e5m2,
           "int32": torch.int32, "i32": torch.int32, "int64": torch.int64,
           "int8": torch.int8, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float32": torch.float32}


def parse_dtype(text: str | torch.dtype) -> torch.dtype:
    if isinstance(text, torch.dtype):
        return text
    key = text.strip().lower().replace("torch.", "")
    if key not in _DTYPES:
        raise IRError(f"dtype {text!r} not understood; use one of {', '.join(_DTYPES)}")
    return _DTYPES[key]


def parse_shape(text: str) -> tuple[tuple[int, ...], torch.dtype | None]:
    """``"4096x4096:bf16"`` -> ((4096, 4096), torch.bfloat16); the dtype part is optional."""
    shape_part, _, dtype_part = text.partition(":")
    try:
        shape = tuple(int(s) for s in re.split(r"[x,]", shape_part.strip()) if s)
    except ValueError:
        raise IRError(f"shape {text!r} not understood; write e.g. 4096x4096:bf16") from None
    return shape, (parse_dtype(dtype_part) if dtype_part else None)


def to_meta(x):
    """A meta tensor with x's shape, strides, storage offset and dtype; ``(shape, dtype)``
    specs become contiguous meta tensors; anything else is returned unchanged."""
    if isinstance(x, torch.Tensor):
        if x.device.type == "meta":
            return x
        base = torch.empty(x.untyped_storage().nbytes() // x.element_size() or 1,
                           dtype=x.dtype, device="meta")
        return base.as_strided(x.shape, x.stride(), x.storage_offset())
    if (isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.dtype)
            and isinstance(x[0], (tuple, list, torch.Size))):
        return torch.empty(tuple(x[0]), dtype=x[1], device="meta")
    return x


def _tensor_aligned(t: torch.Tensor) -> bool:
    if t.device.type == "meta":  # allocations are 256-byte aligned; views shift by the offset
        return (t.storage_offset() * t.element_size()) % 16 == 0
    return t.data_ptr() % 16 == 0


def _ptr_type(t: torch.Tensor) -> str:
    from triton.runtime.jit import mangle_type

    if t.device.type == "meta":
        return {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
                torch.float64: "*fp64", torch.float8_e4m3fn: "*fp8e4nv",
                torch.float8_e5m2: "*fp8e5", torch.int8: "*i8", torch.uint8: "*u8",
                torch.int16: "*i16", torch.int32: "*i32", torch.int64: "*i64",
                torch.bool: "*i1"}[t.dtype]
    return mangle_type(t)


@dataclass
class Signature:
    signature: dict[str, str]
    constexprs: dict[tuple, Any]
    attrs: dict[tuple, list]
    options: dict[str, Any]

    def key(self):
        return (tuple(self.signature.items()), tuple(sorted((k, repr(v)) for k, v in
                                                            self.constexprs.items())),
                tuple(sorted((k, repr(v)) for k, v in self.attrs.items())),
                tuple(sorted(self.options.items())))


def specialize(jit, args: dict[str, Any], options: dict[str, Any], backend) -> Signature:
    """The signature, constants and attributes Triton's launcher would derive from ``args``."""
    from triton._C.libtriton import native_specialize_impl

    names = [p.name for p in jit.params]
    missing = [p.name for p in jit.params if p.name not in args
               and p._param.default is inspect.Parameter.empty]
    unknown = [k for k in args if k not in names]
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing)}")
        if unknown:
            parts.append(f"unexpected {', '.join(unknown)}")
        raise IRError(f"arguments do not match kernel {jit.fn.__name__}"
                      f"({', '.join(names)}): {'; '.join(parts)}")
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(jit.params):
        value = args[p.name] if p.name in args else p._param.default
        if isinstance(value, tuple) and not p.is_constexpr:
            raise IRError(f"argument {p.name}: tuple arguments are not supported by tkit.ir")
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            consts[(i,)] = value
            continue
        if isinstance(value, torch.Tensor):
            sig[p.name] = _ptr_type(value)
            if not p.do_not_specialize_on_alignment and _tensor_aligned(value):
                attrs[(i,)] = backend.parse_attr("D")
            continue
        # a host TMA descriptor (triton.tools / Gluon) specializes to its tensordesc type
        descriptor = hasattr(value, "block_shape") and isinstance(getattr(value, "base", None),
                                                                  torch.Tensor)
        if value is not None and not descriptor and not isinstance(value, (int, float, bool)):
            raise IRError(f"argument {p.name} of kernel {jit.fn.__name__}: cannot pass a "
                          f"{type(value).__name__} (tensors, host tensor descriptors, numbers, "
                          "None or constexprs)")
        ty, attr = native_specialize_impl(type(backend), value, False,
                                          not p.do_not_specialize, True)
        if p.annotation_type and isinstance(p.annotation_type, str):
            ty = p.annotation_type
        sig[p.name] = ty
        if ty == "constexpr":
            consts[(i,)] = value
        elif attr:
            attrs[(i,)] = backend.parse_attr(attr)
    return Signature(sig, consts, attrs, dict(options))


# --------------------------------------------------------------------------------------------
# Compiled result
# --------------------------------------------------------------------------------------------
def _bin(tool: str) -> str:
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    if os.path.exists(path):
        return path
    found = shutil.which(tool)
    if not found:
        raise IRError(f"{tool} not found (looked in the Triton wheel and on PATH)")
    return found


def ptxas_path(cap: int) -> str:
    """The ptxas Triton itself runs for sm_{cap}. The wheel carries two (``ptxas`` and
    ``ptxas-blackwell``, of different CUDA releases) and picks one by arch, with a cut-over that
    moved between releases (sm_100 in 3.6, sm_90 in 3.9); the PTX it emits declares the
    ``.version`` of the ptxas it chose, which the other one may reject ("Unsupported .version"),
    so re-assembling Triton's PTX needs the same choice (``TRITON_PTXAS_PATH`` and friends
    included)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:  # pragma: no cover - a Triton without the NVIDIA backend
        return _bin("ptxas")
    return get_ptxas(cap).path


def _run_tool(args: list[str]) -> str:
    res = subprocess.run(args, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{os.path.basename(args[0])} failed: {res.stderr.strip()[:2000]}")
    return res.stdout + res.stderr


def cubin_sass(cubin: bytes) -> str:
    """SASS of a cubin (e.g. ``compiled.asm["cubin"]`` of a Gluon kernel built with
    ``compile_sm90``) from the Triton wheel's cuobjdump."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return _run_tool([_bin("cuobjdump"), "-sass", path])


@dataclass
class CompiledIR:
    """One kernel compiled ahead of time: every stage's text, Triton's metadata, and what was
    chosen (arch, config, signature)."""

    name: str
    cap: int
    asm: dict
    metadata: Any
    jit: Any
    signature: Signature
    config: dict  # the autotune config's kwargs and options actually used ({} if none)
    configs_available: int = 1
    note: str = ""
    launches: list = field(default_factory=list)  # names of every kernel the op launched
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def arch(self) -> str:
        return f"sm_{self.cap}" + ("a" if self.cap in (90, 100, 103) else "")

    @property
    def num_warps(self) -> int:
        return self.metadata.num_warps

    @property
    def num_stages(self) -> int:
        return self.metadata.num_stages

    @property
    def shared(self) -> int:
        return self.metadata.shared

    def _cubin_path(self) -> str:
        if "cubin_path" not in self._cache:
            fd, path = tempfile.mkstemp(suffix=".cubin", prefix=f"tkit_{self.name}_")
            with os.fdopen(fd, "wb") as f:
                f.write(self.asm["cubin"])
            self._cache["cubin_path"] = path
            weakref.finalize(self, _unlink, path)
        return self._cache["cubin_path"]

    def sass(self, line_info: bool = False) -> str:
        """SASS from the Triton wheel's cuobjdump (nvdisasm with source lines when asked)."""
        key = f"sass{int(line_info)}"
        if key not in self._cache:
            if line_info:
                text = _run_tool([_bin("nvdisasm"), "-g", "-c", self._cubin_path()])
            else:
                text = _run_tool([_bin("cuobjdump"), "-sass", self._cubin_path()])
            self._cache[key] = text
        return self._cache[key]

    def resources(self) -> dict:
        """Registers per thread, spills (local memory / 4, as Triton's driver counts them),
        static shared memory, from ``cuobjdump -res-usage`` on the cubin."""
        if "res" not in self._cache:
            text = _run_tool([_bin("cuobjdump"), "-res-usage", self._cubin_path()])
            m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", text)
            if not m:
                raise RuntimeError(f"cannot read resource usage from cuobjdump:\n{text}")
            reg, stack, shared, local = map(int, m.groups())
            self._cache["res"] = dict(n_regs=reg, n_spills=local // 4, stack=stack,
                                      static_shared=shared, local_bytes=local)
        return self._cache["res"]

    @property
    def n_regs(self) -> int:
        return self.resources()["n_regs"]

    @property
    def n_spills(self) -> int:
        return self.resources()["n_spills"]

    def stage(self, stage: str, locs: bool = False) -> str:
        """The text of one stage. TTIR/TTGIR/LLIR lose their location annotations unless
        ``locs``; ``source`` is the kernel's Python source."""
        if stage not in STAGES:
            close = difflib.get_close_matches(stage, STAGES, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise IRError(f"unknown stage {stage!r}{hint} (stages: {', '.join(STAGES)})")
        if stage == "source":
            return self.jit.src if hasattr(self.jit, "src") else inspect.getsource(self.jit.fn)
        if stage == "sass":
            return self.sass()
        text = self.asm[stage]
        if not locs and stage in ("ttir", "ttgir"):
            text = strip_locs(text)
        if isinstance(text, bytes):
            text = text.decode()
        return text

    def source_file(self) -> str:
        return inspect.getsourcefile(self.jit.fn)

    def first_line(self) -> int:
        return self.jit.starting_line_number


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def strip_locs(text: str) -> str:
    """MLIR text without ``loc(...)`` annotations and ``#locN = ...`` definitions."""
    out = []
    for line in text.splitlines():
        if line.startswith("#loc"):
            continue
        out.append(_strip_loc_calls(line))
    return "\n".join(out) + "\n"


def _strip_loc_calls(line: str) -> str:
    # remove every " loc(...)" with balanced parentheses
    while True:
        i = line.find(" loc(")
        if i < 0:
            return line
        depth, j = 0, i + 4
        while j < len(line):
            if line[j] == "(":
                depth += 1
            elif line[j] == ")":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        line = line[:i] + line[j + 1:]


# --------------------------------------------------------------------------------------------
# Compilation
# --------------------------------------------------------------------------------------------
_COMPILED: dict[tuple, Any] = {}


@functools.cache
def _backend(cap: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    return make_backend(GPUTarget("cuda", cap, 32))


def _compile(jit, sig: Signature, cap: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    key = (id(jit), jit.fn.__qualname__, sig.key(), cap)
    if key not in _COMPILED:
        src = ASTSource(jit, sig.signature, sig.constexprs, sig.attrs)
        try:
            with _real_language(), _jit_language(jit):
                kernel = triton.compile(src, target=GPUTarget("cuda", cap, 32),
                                        options=sig.options)
            _COMPILED[key] = (jit, kernel)  # the jit kept alive: its id is in the key
        except Exception as e:
            raise IRError(f"compiling {jit.fn.__name__} for sm_{cap} failed: "
                          f"{type(e).__name__}: {str(e)[:3000]}") from e
    return _COMPILED[key][1]


def _config_to_dict(cfg) -> dict:
    d = dict(cfg.kwargs)
    d.update(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if getattr(cfg, "num_ctas", 1) != 1:
        d["num_ctas"] = cfg.num_ctas
    if getattr(cfg, "maxnreg", None):
        d["maxnreg"] = cfg.maxnreg
    return d


def parse_config(text: str) -> dict | int:
    """CLI config: ``"2"`` (index) or ``"BLOCK=1024,num_warps=8"``."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, eq, v = part.partition("=")
        if not eq:
            raise IRError(f"config {text!r}: write NAME=VALUE pairs, e.g. BLOCK=1024,num_warps=8")
        try:
            out[k.strip()] = int(v)
        except ValueError:
            out[k.strip()] = {"true": True, "false": False}.get(v.strip().lower(), v.strip())
    return out


def _choose_config(tuner, args: dict, config, cap: int | None = None) -> tuple[dict, str]:
    """The config dict to compile and a note on how it was chosen. A typed tkit config (one
    with ``launch_kwargs()``, e.g. ``tkit.kernels.matmul.TmaConfig``) stands for its launch
    keywords. Untuned, an autotuned kernel compiles the first config its pruner keeps for
    sm_{cap}'s shared memory: the one tkit launches without a tuned table."""
    if hasattr(config, "launch_kwargs"):
        config = config.launch_kwargs()
    if tuner is None:
        if config is None:
            return {}, ""
        if isinstance(config, int):
            raise IRError("config given as an index, but the kernel is not autotuned")
        cfg = config if isinstance(config, dict) else _config_to_dict(config)
        return dict(cfg), "config given"
    configs = list(tuner.configs)
    if config is None:
        # the tuned one if this process has tuned this key, else the first
        key = [args[k] for k in tuner.keys if k in args]
        key += [str(v.dtype) for k, v in args.items()
                if k in tuner.arg_names and hasattr(v, "dtype")]
        tuned = tuner.cache.get(tuple(key))
        if tuned is not None:
            return _config_to_dict(tuned), "the tuned config (autotune cache)"
        first = _first_pruned(tuner, args, cap)
        if first is not None and first is not configs[0]:
            i = next((j for j, c in enumerate(configs) if c is first), None)
            which = f"config {i} of {len(configs)}" if i is not None else "the pruner's fallback"
            return _config_to_dict(first), (f"{which}: the first that fits sm_{cap}'s shared "
                                            "memory (not tuned yet)")
        return _config_to_dict(configs[0]), f"config 0 of {len(configs)} (not tuned yet)"
    if isinstance(config, int):
        if not 0 <= config < len(configs):
            raise IRError(f"config index {config} out of range: the kernel has "
                          f"{len(configs)} autotune configs")
        return _config_to_dict(configs[config]), f"config {config} of {len(configs)}"
    if isinstance(config, triton.Config):
        return _config_to_dict(config), "config given"
    if isinstance(config, dict):
        # a partial dict overrides the first config (e.g. {"num_stages": 2})
        base = _config_to_dict(configs[0])
        base.update(config)
        return base, "config given" + (" (over config 0)" if len(config) < len(base) else "")
    raise IRError(f"config must be an index, a dict or a triton.Config, got {type(config)}")


def _first_pruned(tuner, args: dict, cap: int | None):
    """The first config the autotuner's early pruner keeps for these arguments, with the
    shared memory of sm_{cap} assumed (None where the pruner cannot run on them)."""
    from tkit.ir_tools.summary import TARGET_LIMITS  # (summary imports this module)
    from tkit.kernels import _device, _tuning

    limit = TARGET_LIMITS.get(cap, {}).get("smem_block")
    try:
        with _device.assume_smem_limit(limit):
            return _tuning.pruned_configs(tuner, args)[0]
    except Exception:  # noqa: BLE001 - a pruner that needs what a meta launch lacks
        return None


def compile_launch(kernel, kwargs: dict, cap: int, config=None) -> CompiledIR:
    """Compile one launch (kernel + keyword arguments) for sm_{cap}."""
    tuner, heuristics, jit = unwrap(kernel)
    args = {k: to_meta(v) for k, v in kwargs.items()}
    options = {k: args.pop(k) for k in list(args) if k in _OPTION_NAMES}
    cfg, note = _choose_config(tuner, args, config, cap)
    for k, v in cfg.items():
        if k in _OPTION_NAMES:
            options[k] = v
        else:
            args[k] = v
    for h in reversed(heuristics):
        for name, fn in h.values.items():
            if name not in args:
                args[name] = fn(args)
    backend = _backend(cap)
    sig = specialize(jit, args, compile_options(options), backend)
    k = _compile(jit, sig, cap)
    # every constexpr the kernel was specialized on, then the launch options
    used = {p.name: args.get(p.name, p._param.default) for p in jit.params if p.is_constexpr}
    used.update({k2: v for k2, v in cfg.items() if k2 not in _OPTION_NAMES})
    used.update(num_warps=k.metadata.num_warps, num_stages=k.metadata.num_stages)
    n_cfg = len(tuner.configs) if tuner is not None else 1
    return CompiledIR(name=k.metadata.name, cap=cap, asm=k.asm, metadata=k.metadata, jit=jit,
                      signature=sig, config=used, configs_available=n_cfg, note=note)


# --------------------------------------------------------------------------------------------
# Targets: tkit ops and user kernels
# --------------------------------------------------------------------------------------------
def _spec_for(target):
    from tkit import registry

    try:
        return registry.get(target)
    except KeyError as e:
        msg = str(e.args[0]) if e.args else str(e)
        if isinstance(target, str):
            close = difflib.get_close_matches(target, registry.names(), n=3, cutoff=0.5)
            if close and "did you mean" not in msg:
                msg += f"; did you mean {', '.join(close)}?"
        else:
            msg += _wrapper_hint(target)
        raise IRError(msg) from None


def _wrapper_hint(fn) -> str:
    """For a plain Python function given where an op or a kernel was expected (typically the
    wrapper that launches a ``@triton.jit`` kernel): say to pass the kernel, naming the ones
    the function refers to."""
    scope = dict(getattr(fn, "__globals__", {}))
    code = getattr(fn, "__code__", None)
    names = getattr(code, "co_names", ()) + getattr(code, "co_freevars", ())
    for name, cell in zip(getattr(code, "co_freevars", ()), getattr(fn, "__closure__", ()) or ()):
        with contextlib.suppress(ValueError):  # an empty cell
            scope[name] = cell.cell_contents
    kernels = [n for n in names if n in scope and is_kernel(scope[n])]
    modules = [scope[n] for n in names if isinstance(scope.get(n), types.ModuleType)]
    kernels += [f"{m.__name__}.{n}" for m in modules for n in names
                if is_kernel(getattr(m, n, None))]
    hint = ("; tkit.ir compiles a tkit op (tkit.add or 'add') or a Triton kernel: pass the "
            "@triton.jit function itself with its launch arguments, e.g. "
            "tkit.ir.show(my_kernel, x, y, out, n, BLOCK=1024), not a Python function that "
            "launches it")
    if kernels:
        hint += f" ({getattr(fn, '__name__', 'it')} launches {', '.join(kernels)})"
    return hint


def capture(fn, args, kwargs) -> list:
    """Call a tkit op on meta tensors and return its recorded launches."""
    from tkit.kernels import _common

    margs = tuple(to_meta(a) for a in args)
    mkwargs = {k: to_meta(v) for k, v in kwargs.items()}
    with _common.capture_launches() as launches:
        try:
            fn(*margs, **mkwargs)
        except (TypeError, ValueError, NotImplementedError) as e:
            raise IRError(f"{getattr(fn, '__name__', fn)}: {e}") from e
    return list(launches)


def op_case_args(spec, case=None):
    """Arguments of one of the op's benchmark cases (meta tensors): the first, or the one
    whose label contains ``case`` (or with that index)."""
    cases = spec.bench_cases()
    if not cases:
        raise IRError(f"op {spec.name} has no benchmark cases; pass its arguments")
    if case is None:
        chosen = cases[0]
    elif isinstance(case, int) or (isinstance(case, str) and case.isdigit()):
        i = int(case)
        if not 0 <= i < len(cases):
            raise IRError(f"case {i} out of range: {spec.name} has {len(cases)} cases")
        chosen = cases[i]
    else:
        matches = [c for c in cases if case in c.label]
        if not matches:
            labels = "; ".join(c.label for c in cases)
            raise IRError(f"no case of {spec.name} matches {case!r} (cases: {labels})")
        chosen = matches[0]
    return chosen.label, *_make_meta(chosen)


@contextlib.contextmanager
def _meta_draws():
    """Random float draws go straight to the meta device: cases draw on the CPU and move to
    ``device`` (seconds for a benchmark-sized case), but meta tensors need no values."""
    randn, rand = torch.randn, torch.rand

    def meta(fn):
        def draw(*size, generator=None, device=None, **kw):
            return fn(*size, device="meta", **kw)
        return draw

    torch.randn, torch.rand = meta(randn), meta(rand)
    try:
        yield
    finally:
        torch.randn, torch.rand = randn, rand


def _make_meta(case):
    try:
        with _meta_draws():
            return case.make("meta")
    except Exception:  # a case that reads drawn values on the host: draw them for real
        return case.make("meta")


def _shape_text(t: torch.Tensor) -> str:
    dtype = next((k for k, v in _DTYPES.items() if v == t.dtype), str(t.dtype))
    return "x".join(map(str, t.shape)) + f":{dtype}"


def replace_shapes(args: tuple, shapes: list, op: str = "the op") -> tuple:
    """Replace the tensor arguments, in order, by contiguous meta tensors of ``shapes``
    (``(shape, dtype or None)`` pairs; None keeps the original dtype). One shape per tensor
    argument: replacing some and keeping the others (from a benchmark case of other sizes)
    would mostly give a mismatch the op rejects, so a short list is refused with the full list
    that would do."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if len(shapes) != len(tensors):
        example = ";".join(_shape_text(t) for t in tensors)
        raise IRError(f"{len(shapes)} shape(s) given but {op} takes {len(tensors)} tensor "
                      f"argument(s): give one per tensor, in order, e.g. "
                      f"--shape '{example}' (shapes=[...] in Python)")
    out, i = [], 0
    for a in args:
        if isinstance(a, torch.Tensor):
            shape, dtype = shapes[i]
            out.append(torch.empty(shape, dtype=dtype or a.dtype, device="meta"))
            i += 1
        else:
            out.append(a)
    return tuple(out)


def compile(target, *args, arch=None, config=None, launch=0, case=None, shapes=None,
            **kwargs) -> CompiledIR:
    """Compile ``target`` ahead of time and return every stage.

    target : a tkit op (function or registry name), or a Triton kernel (``@triton.jit``,
        ``triton.autotune``/``triton.heuristics`` wrapped).
    args, kwargs : for an op, its arguments (tensors, meta tensors or ``(shape, dtype)``
        pairs; none: the op's first benchmark case, or ``case``); for a kernel, its launch
        arguments (positional or by name, constexprs and ``num_warps``/``num_stages`` too).
    arch : ``"sm_80"``, ``"sm_90"``/``"sm_90a"``...; default the local GPU, else sm_90.
    config : autotune config: index, dict (partial dicts override config 0), triton.Config or
        a typed tkit config (``launch_kwargs()``); default the tuned one if this process tuned
        it, else the first.
    launch : for an op that launches several kernels, which one (index or kernel name).
    """
    cap = parse_arch(arch)
    arch_note = "" if arch is not None or torch.cuda.is_available() else \
        "no local GPU: arch defaults to sm_90"
    ir = _compile_target(target, args, kwargs, cap, config, launch, case, shapes)
    ir.note = "; ".join(filter(None, [ir.note, arch_note]))
    return ir


def _compile_target(target, args, kwargs, cap, config, launch, case, shapes) -> CompiledIR:
    if is_kernel(target):
        _, _, jit = unwrap(target)
        names = [p.name for p in jit.params]
        if len(args) > len(names):
            raise IRError(f"kernel {jit.fn.__name__} takes {len(names)} arguments "
                          f"({', '.join(names)}), got {len(args)} positional")
        for name, value in zip(names, args):
            if name in kwargs:
                raise IRError(f"argument {name} given twice")
            kwargs[name] = value
        return compile_launch(target, kwargs, cap, config)
    if not (isinstance(target, str) or callable(target)):
        raise IRError(f"cannot compile {target!r}: give a tkit op, its name, or a Triton kernel")
    spec = _spec_for(target)
    if spec.family == "cuda_ext":
        raise IRError(f"op {spec.name} is a CUDA C++ kernel (tkit.cuda_ext), not a Triton "
                      "kernel; tkit.ir compiles Triton kernels (read its SASS with cuobjdump on "
                      "the cubin that tkit.cuda_ext builds)")
    label = ""
    if not args and not kwargs:
        label, args, kwargs = op_case_args(spec, case)
    if shapes:
        args = replace_shapes(tuple(args), shapes, spec.name)
        label = "shapes " + ";".join(_shape_text(a) for a in args
                                     if isinstance(a, torch.Tensor))
    launches = capture(spec.fn, args, kwargs)
    if not launches:
        raise IRError(f"{spec.name} launched no kernel for these arguments (empty input?)")
    names = [unwrap(lc.kernel)[2].fn.__name__ for lc in launches]
    if isinstance(launch, str):
        if launch not in names:
            raise IRError(f"{spec.name} launches {', '.join(names)}; no kernel {launch!r}")
        launch = names.index(launch)
    if not 0 <= launch < len(launches):
        raise IRError(f"launch {launch} out of range: {spec.name} launches {len(launches)} "
                      f"kernel(s): {', '.join(names)}")
    ir = compile_launch(launches[launch].kernel, launches[launch].kwargs, cap, config)
    ir.launches = names
    where = (f", {label}" if label.startswith("shapes ") else f", case '{label}'") if label else ""
    ir.note = "; ".join(filter(None, [f"op {spec.name}" + where,
                                      ir.note]))
    return ir
