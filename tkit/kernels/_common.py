"""What every kernel module shares: input validation, output allocation, launching.

Validation happens here, before anything launches, and every error names the argument.
All launches go through :func:`launch`, which lets :mod:`tkit.ir` capture a kernel's arguments
instead of running it (that is how the IR of any tkit op is compiled on a machine without a GPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tkit import _env
from tkit.kernels import _launch, _plan, _tuning
from tkit.kernels import _register as R

# tuned configs cleared from disk: forget the eager plans built on them
_tuning.on_clear(_plan.clear)

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn,)

# Capture and poisoning are process-wide while their context is active: autograd runs the
# backward pass of CUDA tensors on a thread of its own, whose launches and outputs must be
# recorded and poisoned like the forward's (a thread-local switch missed them on a GPU).
_capture: list | None = None
_poison = 0


def torch_tf32() -> bool:
    """Whether torch's own float32 matmuls may take tf32 tensor cores
    (``torch.set_float32_matmul_precision``): the composite ops and models built from tkit's
    GEMMs (MoE, the fused loss, tkit.models) follow it, so that in float32 they round as the
    same computation in torch does (tkit.matmul alone keeps its documented default)."""
    return torch.backends.cuda.matmul.allow_tf32


def _capturing() -> list | None:
    return _capture


def _poisoning() -> bool:
    return _env.POISON or _poison > 0


@contextlib.contextmanager
def poisoned_outputs(enabled: bool = True):
    """Fill every output tkit allocates with NaN (or the dtype's max for integers), in every
    thread of the process while active (autograd's backward threads included)."""
    global _poison
    if not enabled:
        yield
        return
    with _plan.off("poison"):
        _poison += 1
        try:
            yield
        finally:
            _poison -= 1


@dataclass
class KernelLaunch:
    """One launch as tkit would make it: the kernel, its grid and its keyword arguments."""

    kernel: Any
    grid: Any
    kwargs: dict


@contextlib.contextmanager
def capture_launches():
    """Record launches instead of running them (meta tensors allowed), from every thread of
    the process while active (autograd's backward threads included). Yields the list."""
    global _capture
    old, _capture = _capture, []
    try:
        with _plan.off("capture"):  # a plan would launch instead of recording
            yield _capture
    finally:
        _capture = old


def launch(kernel, grid, **kwargs) -> None:
    """Launch ``kernel[grid](**kwargs)``, or record it while :func:`capture_launches` is active.

    The launch goes through :func:`tkit.kernels._launch.run`: an autotuned kernel runs the
    config chosen without timing, and the compiled kernel is launched directly from a cache
    keyed by Triton's specialization of the arguments; it refuses a grid whose second or
    third axis passes CUDA's 65535 (the driver's own error is "invalid argument"), and so does
    a recorded launch whose grid is given as a tuple."""
    cap = _capture
    if cap is not None:
        if type(grid) is tuple and len(grid) > 1 and max(grid[1:]) > _launch.GRID_YZ_MAX:
            raise ValueError(_launch.grid_error(kernel, grid))
        cap.append(KernelLaunch(kernel, grid, kwargs))
        return
    _launch.run(kernel, grid, kwargs)


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocate an output; NaN-filled when outputs are being poisoned."""
    return _poisoned(torch.empty(tuple(shape), dtype=dtype, device=device))


def _poisoned(out: torch.Tensor) -> torch.Tensor:
    if _poisoning() and out.numel() and out.device.type != "meta":
        if out.dtype.is_floating_point:
            out.fill_(float("nan"))
        else:
            out.fill_(torch.iinfo(out.dtype).max)
    return out


def dense(t: torch.Tensor) -> bool:
    """``t``'s elements fill its span without gaps or overlaps in some order of its dimensions
    (a permutation of a contiguous tensor, e.g. a transpose): what ``torch.empty_like`` keeps
    the strides of."""
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def dense_like_strides(x: torch.Tensor) -> tuple[int, ...] | None:
    """The strides an elementwise output of ``x``'s shape takes: ``x``'s own when ``x`` is
    :func:`dense` but not contiguous (as torch's ``preserve_format``: a transposed input gives
    a transposed output, and both are then one contiguous run for the kernel), else None
    (contiguous). The fakes use the same rule, so that compiled graphs see the real strides."""
    if x.is_contiguous() or not dense(x):
        return None
    return tuple(x.stride())


def empty_like_dense(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An output shaped like ``x`` with :func:`dense_like_strides` (poisoned as :func:`empty`)."""
    strides = dense_like_strides(x)
    if strides is None:
        return empty(x.shape, dtype, x.device)
    return _poisoned(torch.empty_strided(tuple(x.shape), strides, dtype=dtype, device=x.device))


def scratch(shape: Sequence[int], dtype: torch.dtype, device: torch.device,
            zero: bool = False) -> torch.Tensor:
    """Allocate a temporary that the launches write in full before they read it (split-K
    partials), or with ``zero`` one that starts at zero (counters): an eager plan allocates
    it afresh per call, zeroed where asked (never poisoned: not an output)."""
    t = (torch.zeros if zero else torch.empty)(tuple(shape), dtype=dtype, device=device)
    if _launch._recorders:
        _launch.record_scratch(t, zero)
    return t


def check_tensor(
    t: Any,
    name: str,
    dtypes: Iterable[torch.dtype] = FLOAT_DTYPES,
    *,
    ndim: int | None = None,
    min_ndim: int | None = None,
) -> torch.Tensor:
    """Type, dtype, rank and device checks for one tensor argument."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if type(dtypes) is not tuple:
        dtypes = tuple(dtypes)
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {dtype_name(t.dtype)}; supported: {names}")
    if ndim is not None and t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions, got {tuple(t.shape)}")
    if not t.is_cuda:  # is_cuda is a flag; t.device builds a torch.device each call
        check_device(t, name)
    return t


def check_device(t: torch.Tensor, name: str) -> None:
    if t.is_cuda:
        return
    dev = t.device.type
    if dev == "cuda":
        return
    if dev == "meta" and _capturing() is not None:
        return
    if dev == "cpu" and _env.INTERPRET:
        return
    if dev == "cpu":
        raise ValueError(
            f"{name} is on the CPU; tkit kernels need a CUDA tensor "
            "(or TRITON_INTERPRET=1 set before importing tkit, to run them in Triton's interpreter)"
        )
    raise ValueError(f"{name} is on device {t.device}; tkit kernels need a CUDA tensor")


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    if first.is_cuda:  # the common case without building a torch.device per tensor
        idx = first.get_device()
        if all(t.is_cuda and t.get_device() == idx for _, t in items):
            return first.device
    for n, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{n} is on {t.device} but {first_name} is on {first.device}")
    return first.device


def needs_int64(*tensors: torch.Tensor) -> bool:
    """True when some element offset in these tensors can reach 2**31: index math goes 64-bit.

    The exact span walk runs only for tensors near the limit: the span, sum((size - 1) *
    |stride|) + offset, is at most numel * max|stride| + offset, and that bound takes three
    calls into torch (this runs on every eager launch of several ops)."""
    for t in tensors:
        if t is None:
            continue
        st = t.stride()
        big = max(max(st, default=1), -min(st, default=0), 1)
        if t.numel() * big + t.storage_offset() < 2**31 - 1:
            continue
        if span_needs_int64(t.shape, st, t.storage_offset()):
            return True
    return False


def span_needs_int64(shape, stride, storage_offset: int = 0) -> bool:
    """:func:`needs_int64` for one tensor given as (shape, stride, storage offset)."""
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:
        return False
    span = sum((s - 1) * abs(st) for s, st in zip(shape, stride)) + storage_offset
    return span >= 2**31 - 1 or numel >= 2**31 - 1


def use_direct_path(*tensors: torch.Tensor | None) -> bool:
    """Eager calls skip the torch.library dispatcher (a few microseconds a call) when nothing
    needs it: not tracing under torch.compile, no autograd, not capturing launches."""
    if _env.NO_DIRECT or torch.compiler.is_compiling():
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return False
    return True


def eager_autograd() -> bool:
    """Whether an op that needs autograd may take its eager ``torch.autograd.Function`` (no
    dispatcher) rather than the registered op: not while torch.compile traces, not with
    TKIT_NO_DIRECT."""
    return not (_env.NO_DIRECT or torch.compiler.is_compiling())


def broadcast_shapes(*shapes) -> tuple[int, ...]:
    """torch.broadcast_shapes for concrete shapes in plain Python (torch's costs tens of
    microseconds a call, a visible part of a small op's eager latency); ValueError when they do
    not broadcast. Fake-tensor (torch.compile) paths keep torch's, which handles symbolic sizes."""
    # plain loops: torch.compile traces this (validation runs in the traced public function)
    n = 0
    for s in shapes:
        n = max(n, len(s))
    out = [1] * n
    for s in shapes:
        lead = n - len(s)
        for i in range(len(s)):
            x = s[i]
            if x != 1:
                if out[lead + i] != 1 and out[lead + i] != x:
                    raise ValueError(f"shapes {[tuple(t) for t in shapes]} do not broadcast")
                out[lead + i] = x
    return tuple(out)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids. ``triton.cdiv`` is a jit function: called from host code
    it costs a few microseconds of argument handling, and a GEMM launch made eight such calls.
    Written for non-negative operands without negation: a grid function may receive Triton
    ``constexpr`` values (an argument equal to 1 is specialized), whose ``//`` truncates."""
    return (a + b - 1) // b


def check_power_of_2_fields(cfg, names) -> None:
    """ValueError naming ``type(cfg).name.field`` unless each of ``names`` is an int (not a
    bool) that is a power of 2: the tile fields of the families' config dataclasses."""
    for name in names:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
            raise ValueError(f"{type(cfg).__name__}.{name} must be a power of 2, got {v!r}")


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1), in plain Python: ``triton.next_power_of_2``
    is a ConstexprFunction whose host-side call costs microseconds."""
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def interpreter_configs(configs: list, small: Any) -> list:
    """The configs to autotune over on this backend. Under the interpreter autotuning cannot
    time anything: one config, ``small`` (few large programs: the interpreter pays per
    program). With TKIT_NO_AUTOTUNE=1, the first config, which is therefore the default."""
    if _env.INTERPRET:
        return [small]
    return configs[:1] if _env.NO_AUTOTUNE else configs


def size_class(n: int) -> int:
    """log2 bucket of a size: an autotune key that retunes per order of magnitude, not per
    shape (an elementwise op sees a new size at nearly every call in a server)."""
    return max(int(n), 1).bit_length()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class ConfigOverrides:
    """Scoped, validated overrides of a frozen config dataclass's fields, per thread: the
    one mechanism behind ``decode_config(...)``, ``rope_config(...)`` and the other families'
    override contexts. ``scope(**fields)`` is the context manager (an unknown field is a
    TypeError naming it), ``apply(cfg)`` returns the config with the active overrides,
    ``active()`` whether any is set (an eager plan must not serve an overridden call; an
    eager path reads ``state.value``, falsy without overrides, and saves the call)."""

    class _State(threading.local):
        value: dict = {}  # the overrides in force in this thread

    def __init__(self, cls):
        self._cls, self.state = cls, self._State()
        self._fields = tuple(f.name for f in dataclasses.fields(cls))
        R.OVERRIDE_SCOPES.append(self)  # a backward restores the forward's (capture_overrides)

    @contextlib.contextmanager
    def scope(self, **overrides):
        unknown = [k for k in overrides if k not in self._fields]
        if unknown:
            raise TypeError(f"unknown {self._cls.__name__} field(s) {unknown}; "
                            f"known: {list(self._fields)}")
        old = self.state.value
        self.state.value = {**old, **overrides}
        try:
            # the registered ops' C++ kernels serve plans without reading overrides
            with R.fast_ops_held() if overrides else contextlib.nullcontext():
                yield
        finally:
            self.state.value = old

    def active(self) -> bool:
        return bool(self.state.value)

    def apply(self, cfg):
        over = self.state.value
        return dataclasses.replace(cfg, **over) if over else cfg


def check_attention_options(window_size, softcap, softmax_scale) -> None:
    """The options prefill and decode attention share: a clear ValueError naming each."""
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(int(w) != w or w < -1 for w in window_size)):
        raise ValueError(f"window_size must be a pair (left, right) of ints >= -1, "
                         f"got {window_size!r}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 turns it off), got {softcap}")
    if softmax_scale is not None and not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be positive, got {softmax_scale}")
