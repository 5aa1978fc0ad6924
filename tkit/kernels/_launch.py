"""The launch fast path: compiled kernels cached per specialization, configs chosen without tuning.

Why: an eager tkit call at decode sizes spent 40-160 us on the host against 6-24 us for torch
(docs/NOTES.md). Triton's ``kernel[grid](**kwargs)`` binds every argument through a generated
function, specializes each one in C++, builds a string cache key, checks the kernel's globals and
builds launch metadata; an ``Autotuner`` and ``Heuristics`` wrapper add dict merges on top, and an
autotuner benchmarks every config the first time it sees a key (seconds for attention).

What runs per call here (``run``):

1. ``resolve``: an ``Autotuner`` is replaced by one config chosen without benchmarking
   (:func:`config_for`: a tuned on-disk cache, the shipped table, else the first config the
   kernel's own pruner keeps); ``Heuristics`` values are computed. The result is a plain
   ``JITFunction`` and the full keyword arguments.
2. A per-kernel generated binder reads the arguments in parameter order and builds a key from
   exactly what Triton specializes on, never less: the value of every constexpr; for a tensor
   its dtype and whether its data pointer is 16-byte aligned; for an int whether it equals 1,
   whether it is divisible by 16 and whether it fits i32 / i64 / u64; floats and bools by type;
   the launch options (num_warps, num_stages, num_ctas, maxnreg); the current device. The key
   may be finer than Triton's (then a signature costs one more slow first call), never coarser
   (then a binary compiled for aligned pointers could run on unaligned ones: a silent wrong
   result). Anything the binder does not know (tuples, tensor descriptors, unknown options,
   launch hooks set by a profiler) goes through ``kernel[grid](**kwargs)`` unchanged.
3. Key hit: ``CompiledKernel.run(grid, stream, function, metadata, None, None, None, *args)``,
   the call Triton itself ends with. Key miss: ``JITFunction.run`` compiles (or finds its own
   cached binary), launches, and returns the ``CompiledKernel``, which is stored under the key.

Above this layer, :mod:`tkit.kernels._plan` records what one whole eager call launched
(:func:`recording`) and replays it per signature, skipping even steps 1-3.

Full autotuning is opt-in (``TKIT_AUTOTUNE=1``): the call goes through Triton's autotuner,
and the winner is written to the on-disk cache (:mod:`tkit.kernels._tuning`), which later
processes read without tuning.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from tkit import _env

try:  # the classes whose objects tkit launches
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.jit import JITFunction
except ImportError:  # pragma: no cover - a Triton without these names: always the slow path
    CompiledKernel = Autotuner = Heuristics = JITFunction = None

#: switched off by TKIT_NO_FAST_LAUNCH=1, or at run time by :func:`set_enabled`
_enabled = not _env.NO_FAST_LAUNCH and not _env.INTERPRET and JITFunction is not None

if not _env.INTERPRET:
    # Triton's C++ argument specializer imports Gluon's layout and descriptor classes the
    # first time a process launches any kernel: ~0.1 s inside the first call of the process
    # (most of it), paid here, with the rest of the import, instead
    try:
        import triton.experimental.gluon.language._layouts  # noqa: F401
        import triton.experimental.gluon.nvidia.hopper  # noqa: F401
    except ImportError:  # pragma: no cover - a Triton without Gluon: nothing to load early
        pass
_lock = threading.Lock()
#: id(JITFunction) -> _KernelState (kernels are module globals and live as long as the process)
_states: dict[int, _KernelState | None] = {}
#: counters for tests and diagnostics: calls served by the cache / through Triton's path
stats = {"fast": 0, "slow": 0, "fallback": 0}

# Options Triton takes next to a kernel's parameters that tkit passes; any other keyword that is
# not a parameter sends the call through Triton's own path (which knows or rejects it).
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
_I32, _I64 = 2**31, 2**63


class _Unsupported(Exception):
    """An argument the binder does not classify: take Triton's path for this call."""


def _spec(v):
    """The specialization class of a non-constexpr argument other than a plain tensor.

    Mirrors ``native_specialize_impl`` (Triton 3.6 and 3.9): ints equal to 1 become constants,
    ints divisible by 16 get the divisibility attribute, and the int type is i32 / i64 / u64 by
    range; floats are fp32 and bools u1 whatever their value; None is a constant."""
    t = type(v)
    if t is int:
        rng = 0 if -_I32 <= v < _I32 else (1 if -_I64 <= v < _I64 else 2)
        return (v == 1, v % 16 == 0, rng)
    if t is bool:
        return "u1"
    if t is float:
        return "fp32"
    if v is None:
        return None
    if isinstance(v, torch.Tensor):  # subclasses (nn.Parameter) land here
        return (v.dtype, v.data_ptr() % 16 == 0)
    if hasattr(v, "block_shape") and hasattr(v, "base"):
        # a host tensor descriptor (triton.tools / Gluon): Triton specializes on its dtype,
        # block shape and (Gluon) shared-memory layout; the launcher encodes the rest per call.
        # Rank and padding are added to be safe; an unhashable layout fails the cache lookup,
        # which sends the call through Triton's path.
        return ("desc", type(v), v.base.dtype, tuple(v.block_shape), getattr(v, "layout", None),
                getattr(v, "padding", None), len(v.shape))
    raise _Unsupported(type(v).__name__)


class _KernelState:
    __slots__ = ("bind", "cache", "fn")

    def __init__(self, fn, bind):
        self.fn = fn
        self.bind = bind
        self.cache: dict = {}


def _make_binder(fn):
    """Generate ``bind(kw, dev) -> (key, args)`` for one kernel: straight-line code per
    parameter (a loop over parameter descriptors costs several times more per call)."""
    import inspect

    params = list(fn.params)
    sig_params = list(fn.signature.parameters.values())
    if len(params) != len(sig_params):
        return None
    lines = ["def bind(kw, dev):"]
    names = []
    ns = {"_spec": _spec, "_T": torch.Tensor, "_U": _Unsupported}
    n_required = 0
    optional = []
    for i, sp in enumerate(sig_params):
        if sp.kind not in (sp.POSITIONAL_OR_KEYWORD, sp.KEYWORD_ONLY):
            return None
        name = f"p{i}"
        names.append(name)
        if sp.default is inspect.Parameter.empty:
            lines.append(f"    {name} = kw[{sp.name!r}]")
            n_required += 1
        else:
            ns[f"d{i}"] = sp.default
            lines.append(f"    {name} = kw.get({sp.name!r}, d{i})")
            optional.append(sp.name)
    key_items = ["dev"]
    for i, kp in enumerate(params):
        name = names[i]
        if kp.is_constexpr:
            # by value, and by type where equal values of two types would collide (True == 1
            # == 1.0, but Triton compiles each apart)
            key_items.append(f"({name} if type({name}) is int or type({name}) is str "
                             f"else (type({name}), {name}))")
        else:
            # the common cases inline: a plain tensor; an int in i32 range (1: Triton makes it
            # a constant; 16: divisible by 16; 0: neither); the rest through _spec, whose
            # answers (tuples of three, strings, None) never equal these
            key_items.append(
                f"(({name}.dtype, {name}.data_ptr() % 16 == 0) if type({name}) is _T else "
                f"((1 if {name} == 1 else 16 if {name} % 16 == 0 else 0) "
                f"if type({name}) is int and -2147483648 <= {name} <= 2147483647 "
                f"else _spec({name})))")
    opts = ", ".join(f"kw.get({o!r})" for o in _OPTIONS)
    lines.append(f"    o = ({opts},)")
    present = str(n_required) + "".join(f" + ({n!r} in kw)" for n in optional)
    lines.append(f"    if len(kw) != {present} + {len(_OPTIONS)} - o.count(None):")
    lines.append("        raise _U('keyword')")
    lines.append(f"    return ({', '.join(key_items)}, o), ({', '.join(names)},)")
    exec("\n".join(lines), ns)  # noqa: S102 - generated from the kernel's own signature
    return ns["bind"]


def _state(fn) -> _KernelState | None:
    st = _states.get(id(fn), False)
    if st is not False:
        return st
    with _lock:
        st = None
        # a subclass with its own launch (anything but Gluon's, which only swaps the binder
        # and the AST source) takes Triton's path
        if isinstance(fn, JITFunction) and type(fn).run is JITFunction.run:
            try:
                bind = _make_binder(fn)
            except Exception:  # noqa: BLE001 - a signature we cannot generate for
                bind = None
            if bind is not None:
                st = _KernelState(fn, bind)
        _states[id(fn)] = st
    return st


_tuning_mod = None


def _tuning():
    global _tuning_mod
    if _tuning_mod is None:
        from tkit.kernels import _tuning as mod

        _tuning_mod = mod
    return _tuning_mod


def resolve(kernel, kwargs: dict):
    """(the JIT function, its full keyword arguments) that ``kernel[grid](**kwargs)`` would
    launch, with an autotuner's config chosen by :func:`config_for` instead of by timing.
    ``None`` for the function when the call should go through Triton's own path (tuning).
    ``kwargs`` is updated in place (``launch`` hands over a dict of its own)."""
    while True:
        if isinstance(kernel, Autotuner):
            if _env.AUTOTUNE and not _env.NO_AUTOTUNE:
                return None, kwargs
            cfg_kwargs = _tuning().config_kwargs_for(kernel, kwargs)
            if cfg_kwargs is None:
                return None, kwargs
            kwargs.update(cfg_kwargs)
            kernel = kernel.fn
        elif isinstance(kernel, Heuristics):
            for name, heur in kernel.values.items():
                kwargs[name] = heur(kwargs)
            kernel = kernel.fn
        else:
            return kernel, kwargs


_runtime_knobs = None


def _knobs_runtime():
    global _runtime_knobs
    if _runtime_knobs is None:
        from triton import knobs

        _runtime_knobs = knobs.runtime
    return _runtime_knobs


def hook_lists():
    """The lists Triton's launch hooks live in (``HookChain.calls``, mutated in place when a
    profiler attaches), for a per-call check that costs two loads; None on a Triton whose hooks
    are not HookChains (then plans stay off)."""
    rt = _knobs_runtime()
    enter, exit_ = rt.launch_enter_hook, rt.launch_exit_hook
    if isinstance(getattr(enter, "calls", None), list) and isinstance(
            getattr(exit_, "calls", None), list):
        return enter.calls, exit_.calls
    return None


def _hooks_active() -> bool:
    """A profiler (proton) or a stage-inspection hook is attached: Triton's path calls them."""
    rt = _knobs_runtime()
    enter = rt.launch_enter_hook
    # Triton 3.6+ holds the hooks in a HookChain that is never None; empty means none attached
    if enter is not None and getattr(enter, "calls", True):
        return True
    exit_ = rt.launch_exit_hook
    if exit_ is not None and getattr(exit_, "calls", True):
        return True
    return getattr(rt, "add_stages_inspection_hook", None) is not None


_driver = None


def _device_stream():
    """Triton's own notion of the launch device and stream (its driver calls torch)."""
    global _driver
    if _driver is None:
        from triton.runtime import driver

        d = driver.active
        _driver = (d.get_current_device, d.get_current_stream)
    dev = _driver[0]()
    return dev, _driver[1](dev)


#: threads recording launches for a plan (:mod:`tkit.kernels._plan`); 0 keeps ``run`` free of
#: the thread-local lookup
_recorders = 0
_tls = threading.local()


class Recording(list):
    """The launches of one recorded call, the scratch tensors it allocated
    (:func:`record_scratch`) and the stream-bound buffers its launches used
    (:func:`record_stream_buffers`)."""

    def __init__(self):
        super().__init__()
        self.scratch: list = []
        self.zeroed: list = []
        self.stream: int | None = None
        self.kept: list = []


class RawLaunch(tuple):
    """One launch of a CUDA-hatch kernel (``tkit.cuda_ext``'s loader) in a recording:
    (CUfunction, (grid x, y, z), threads, dynamic shared bytes, arguments). Each argument is
    a tensor (its pointer), a ``("const", struct format, value)`` scalar or a ``("map", base
    address, spec)`` host TMA descriptor, ``spec`` being (data type code, dims innermost
    first, byte strides of dims 1.., box, swizzle code, fill code, L2 promotion code)."""

    __slots__ = ()


def record_raw(function: int, grid: tuple, threads: int, shared: int, args: tuple) -> None:
    """Note a CUDA-hatch launch on the current stream in the call being recorded, if any
    (None: one a plan cannot replay)."""
    rec = getattr(_tls, "rec", None)
    if rec is not None:
        rec.append(None if args is None else RawLaunch((function, grid, threads, shared, args)))


def record_stream_buffers(stream: int, buffers) -> None:
    """Note buffers kept per stream (workspaces a kernel leaves as it found them) that the
    call being recorded launches with: its plan keeps them and serves this stream alone."""
    rec = getattr(_tls, "rec", None)
    if rec is not None:
        if rec.stream is not None and rec.stream != stream:
            rec.append(None)  # two streams in one call: never planned
        rec.stream = stream
        rec.kept.extend(buffers)


def record_scratch(t, zero: bool = False) -> None:
    """Note a scratch tensor of the call being recorded, if any: allocated by ``torch.empty``
    and fully written by the launches before they read it, or (``zero``) by ``torch.zeros``
    (counters the launches leave at any value)."""
    rec = getattr(_tls, "rec", None)
    if rec is not None:
        rec.scratch.append(t)
        rec.zeroed.append(zero)


@contextlib.contextmanager
def recording():
    """Collect what :func:`run` launches in this thread: (compiled kernel, (grid0, grid1,
    grid2), args in parameter order) per launch, None where a launch took Triton's own path."""
    global _recorders
    old = getattr(_tls, "rec", None)
    rec = Recording()
    _tls.rec = rec
    with _lock:
        _recorders += 1
    try:
        yield rec
    finally:
        with _lock:
            _recorders -= 1
        _tls.rec = old


def _record(item) -> None:
    rec = getattr(_tls, "rec", None)
    if rec is not None:
        rec.append(item)


#: CUDA's limit on a grid's second and third axes (the first takes 2**31 - 1)
GRID_YZ_MAX = 65535


def grid_error(kernel, grid) -> str:
    """The error of a launch whose grid passes :data:`GRID_YZ_MAX` (the driver's own is
    "invalid argument")."""
    name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__",
                                                        repr(kernel))
    return (f"{name}: the input needs a launch grid of {tuple(grid)}, past CUDA's limit of "
            f"{GRID_YZ_MAX} on a grid's second and third axes; split the call (fewer "
            "sequences, or shorter ones)")


def _grid3(grid, kw):
    if callable(grid):
        grid = grid(kw)
    n = len(grid)
    return grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1


def run(kernel, grid, kwargs: dict) -> None:
    """Launch ``kernel[grid](**kwargs)`` through the cached compiled kernel where possible.
    ``kwargs`` becomes the launch's own: config and heuristic values are added to it."""
    fn, kw = resolve(kernel, kwargs)
    if fn is not None:
        g = _grid3(grid, kw)
        if g[1] > GRID_YZ_MAX or g[2] > GRID_YZ_MAX:
            raise ValueError(grid_error(fn, g))
        grid = g
    if fn is None:  # TKIT_AUTOTUNE: Triton's autotuner times the configs; keep the winner
        # (or a config with a pre_hook, which only Triton's autotuner runs)
        if _recorders:
            _record(None)
        kernel[grid](**kwargs)
        if isinstance(kernel, Autotuner):
            _tuning().record(kernel, kwargs)
        return
    st = _states.get(id(fn)) if _enabled else None
    if st is None:
        if _enabled:
            st = _state(fn)
        if st is None:
            stats["fallback"] += 1
            if _recorders:
                _record(None)
            fn[grid](**kw)
            return
    dev, stream = _device_stream()
    try:
        key, args = st.bind(kw, dev)
        compiled = st.cache.get(key)
    except (_Unsupported, KeyError, TypeError):  # TypeError: an unhashable constexpr
        stats["fallback"] += 1
        if _recorders:
            _record(None)
        fn[grid](**kw)
        return
    if compiled is None or _hooks_active():
        stats["slow"] += 1
        compiled = fn.run(grid=grid, warmup=False, **kw)
        # an asynchronous compile returns a future; only a ready kernel that has launched (its
        # handles loaded) is kept
        ok = isinstance(compiled, CompiledKernel) and compiled.function is not None
        if ok:
            st.cache[key] = compiled
        if _recorders:
            _record((compiled, _grid3(grid, kw), args) if ok else None)
        return
    g = grid
    stats["fast"] += 1
    compiled.run(g[0], g[1], g[2], stream,
                 compiled.function, compiled.packed_metadata, None, None, None, *args)
    if _recorders:
        _record((compiled, g, args))


#: callbacks of the layers above (the plans of :mod:`tkit.kernels._plan`) run by
#: :func:`set_enabled` and :func:`clear`
_listeners: list = []


def on_change(fn) -> None:
    """Call ``fn(cleared: bool)`` after :func:`set_enabled` (False) and :func:`clear` (True)."""
    _listeners.append(fn)


def set_enabled(enabled: bool) -> bool:
    """Turn the fast path on or off (tests compare both); returns the previous setting."""
    global _enabled
    old = _enabled
    _enabled = bool(enabled) and not _env.INTERPRET and JITFunction is not None
    for fn in _listeners:
        fn(False)
    return old


def clear() -> None:
    """Forget every cached compiled kernel and every plan built on them (Triton's own caches
    are untouched)."""
    with _lock:
        _states.clear()
    for fn in _listeners:
        fn(True)
