"""Per-signature launch plans: an eager call that has been seen before only allocates its
outputs and launches its kernels (in C++ where :mod:`tkit.kernels._cplan` loads; through
Triton's C launcher otherwise).

Why: after :mod:`tkit.kernels._launch` cached the compiled kernels, a small eager call still
spent most of its host time in Python that gives the same answer for the same inputs every
time: validation, broadcasting, layout analysis, config choice, the specialization key, the grid
(docs/NOTES.md, "Host time per eager call"). A plan is all of that, computed once per
signature by the ordinary path and recorded:

    signature (the op's own key) -> a generated function ``go(stream, inputs) -> outputs``
    that allocates the outputs (``torch.empty``), checks their 16-byte alignment and calls each
    recorded launch's launcher with the recorded grid and constant arguments and the
    tensors' data pointers (ints, which Triton's C launcher takes without a driver call).

The signature key is built from the inputs alone (:func:`serve_fast`), and must hold
everything the ordinary path reads from them: every tensor's shape, strides, dtype, device
index and whether its data pointer is 16-byte aligned (Triton specializes on exactly that, so
the key is never coarser than Triton's); the current device (compiled kernels are loaded per
device); every scalar option. Storage offsets are left out on purpose: kernels index from the
data pointer, which carries the offset, so an int32/int64 choice made for one offset is right
for any other. A plan is only ever built from a call that the ordinary path validated and
launched, so validation errors keep coming from there.

A plan's outputs come from ``torch.empty`` and its launches: the ordinary path of a planned op
must write its outputs with the recorded launches only. A call gets no plan when an output (of
nonzero size) is not an argument of any launch, or was touched by an in-place torch op (its
version counter moved; inference tensors have none, so under ``torch.inference_mode`` this rests
on the ops themselves). A recorded launch's tensor arguments are matched to the call's inputs
and outputs by data pointer (views such as ``x.view(-1, N)`` share it; Triton's launcher only
reads the pointer). Scratch tensors that the op allocated through ``_common.scratch`` (fully
written before read: split-K partials; or, with ``zero=True``, starting at zero: counters)
are allocated afresh per call like outputs (those with ``zero`` by ``torch.zeros``). A launch
argument that matches none of them (another temporary, a contiguous copy) or more than one
(``add(x, x)``) makes the signature unplannable: permanently for the first (``False`` is stored
and later calls skip the recording), for this call only for the second (for good after
:data:`TRANSIENT_LIMIT` such calls).

Every family serves its calls through :func:`serve_fast` (the key, the lookup, the hit, the
recorded first miss, the fallback) with its options as the key's prefix and its tensors as the
plan's inputs; the registered ops' implementations (what a torch.compile graph and the autograd
path call) through :func:`serve_op`, from plans of each op keyed by its arguments in schema
order. Where the C++ executor (:mod:`tkit.kernels._cplan`) loads, the key is built, looked up
and a plan run in one call into it, and plans are executor objects (``at::empty`` and
``cuLaunchKernel``); elsewhere keys are Python tuples and plans the generated functions below.
On a GPU the executor's kernel for the registered ops (:func:`register_ops`) serves their
planned calls below the dispatcher, without entering Python: a registered call otherwise paid
the boxing into the Python autograd kernel and the implementation's Python (2-3x an eager
call's host time, the whole of a compiled layer's excess over eager).

Plans are off (:data:`ON` false) whenever the ordinary path must run each call: under the
interpreter, TKIT_NO_FAST_LAUNCH / TKIT_NO_DIRECT, ``_launch.set_enabled(False)``, while any
thread captures launches (``tkit.ir``) or poisons outputs, and per call while a Triton launch
hook (a profiler) is attached. The public functions also skip them under torch.compile, for
tensor subclasses (fake, functional tensors) and when autograd needs the registered op (whose
implementation runs below autograd and serves from the op's plans).
"""

from __future__ import annotations

import contextlib
import struct
import threading

import torch

from tkit import _env
from tkit.kernels import _cplan, _launch
from tkit.kernels import _register as R

#: the one switch the public functions read per call (see :func:`refresh`)
ON = False
#: plans for CPU tensors too: only for the host-cost harness and tests, which stand a no-op
#: launcher in for Triton's (a CPU tensor never reaches a plan otherwise: the device check
#: refuses it unless the interpreter runs, and then plans are off)
CPU_OK = False
#: plans kept per cache before it starts over (a server that sees ever new shapes)
MAX_PLANS = 4096

_T = torch.Tensor
_Param = torch.nn.Parameter
_grad_enabled = torch.is_grad_enabled

#: tests: C++ plans for CPU tensors and stand-in kernels (their launches go to
#: ``_cplan``'s recorder, never to the driver)
_cplan_test = False

#: argument types a plan may replay as constants (values of the signature, not of the call)
_CONST_TYPES = (int, float, bool, str)

#: calls of one signature that may fail to give a plan for reasons of their own (aliased
#: tensors, an unaligned output) before the signature is given up
TRANSIENT_LIMIT = 3
_transient: dict = {}

_lock = threading.Lock()
_off_reasons = {"capture": 0, "poison": 0}
_caches: list[dict] = []
_codegen_cache: dict = {}
stats = _launch.stats
stats.update(plan=0, plan_miss=0, plan_built=0, plan_refused=0, op_fast=0)


def refresh() -> None:
    """Recompute :data:`ON` after any of its inputs changed."""
    global ON
    ON = bool(_launch._enabled and not _env.NO_DIRECT and not _env.POISON
              and not any(_off_reasons.values()) and _launch.hook_lists() is not None)


@contextlib.contextmanager
def off(reason: str):
    """Plans off in every thread while this is active (captures and poisoning are rare and
    per-thread; counting them globally keeps the per-call check to one global)."""
    with _lock:
        _off_reasons[reason] = _off_reasons.get(reason, 0) + 1
        refresh()
    try:
        yield
    finally:
        with _lock:
            _off_reasons[reason] -= 1
            refresh()


def new_cache() -> dict:
    cache: dict = {}
    _caches.append(cache)
    return cache


def clear() -> None:
    """Forget every plan (compiled kernels, configs or tables changed)."""
    for c in _caches:
        c.clear()
    for op in R.PLAN_OPS:
        op.plans.clear()
    _transient.clear()


def _on_launch_change(cleared: bool) -> None:
    refresh()
    if cleared:
        clear()


_launch.on_change(_on_launch_change)
recording = _launch.recording


def store(cache: dict, key, rec: list, inputs: tuple, outputs: tuple):
    """Build the plan for ``key`` from one recorded call and keep it (or ``False`` for a
    signature that can never have one). Returns what was stored (None: nothing)."""
    plan = build(rec, inputs, outputs)
    if plan is None:
        stats["plan_refused"] += 1
        # a signature whose calls keep aliasing two tensors (``f(x, x)``) would pay for the
        # recording every call: after a few, it keeps the ordinary path for good
        tk = (id(cache), key)
        n = _transient.get(tk, 0) + 1
        if n < TRANSIENT_LIMIT:
            if len(_transient) >= MAX_PLANS:
                _transient.clear()
            _transient[tk] = n
            return None
        _transient.pop(tk, None)
        plan = False
        cache[key] = False
        return plan
    if len(cache) >= MAX_PLANS:
        cache.clear()
    cache[key] = plan
    if plan is False:
        stats["plan_refused"] += 1
    else:
        stats["plan_built"] += 1
    return plan


def serve(cache: dict, key, stream, slow, inputs: tuple, args: tuple, check=None):
    """One call of signature ``key``: its plan's launches on a hit, else ``slow(*args)`` (the
    ordinary path, which validates), recorded into the signature's plan on its first miss.

    ``inputs``: the call's tensors in the order the plan takes them (None for an absent
    optional one); ``slow`` returns the outputs: a tensor, a tuple of tensors, or None (an
    op that only writes its inputs). A plan that steps aside for this call (a launch hook, an
    unaligned output) returns None and the ordinary path runs. ``check(*args)`` runs before a
    plan's launches: value checks that the ordinary path makes per call and a plan would
    skip. The caller builds ``key`` inline, and the arguments are passed as tuples (a call
    with ``*args`` costs a few tenths of a microsecond more here, about what a plan leaves)."""
    try:
        plan = cache.get(key)
    except TypeError:  # an unhashable option: the ordinary path names it
        plan = False
    if plan:
        if check is not None:
            check(*args)
        out = plan(stream, inputs)
        if out is not None:
            return out
    elif plan is None:
        stats["plan_miss"] += 1
        with recording() as rec:
            out = slow(*args)
        store(cache, key, rec, inputs,
              out if type(out) is tuple else () if out is None else (out,))
        return out
    return slow(*args)


_compiling = torch.compiler.is_compiling


def plannable(overridden, *tensors) -> bool:
    """Whether plans may serve an eager call: plans on, not traced, no config override in force
    (``overridden``), every tensor a plain tensor or ``nn.Parameter`` (or None), and none that
    autograd would record. The public functions' shared test; the hottest ones inline it."""
    if not ON or overridden or _compiling():
        return False
    grad = _grad_enabled()
    for t in tensors:
        if t is not None and ((type(t) is not _T and type(t) is not _Param)
                              or (grad and t.requires_grad)):
            return False
    return True


def _py_sig(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.get_device(),
                                   not t.data_ptr() & 15)


def _py_key(prefix, dev, inputs):
    return (prefix, dev, tuple(_py_sig(t) for t in inputs))


def _py_fast(cache, prefix, inputs):
    dev, stream = _launch._device_stream()
    return [_py_key(prefix, dev, inputs), stream]


_fast = None  # serve_fast's lookup: the C++ executor's, or the Python form (resolved once)
_make_key = None


def _resolve_fast():
    """The key function and lookup for this process, chosen once: the C++ executor's where it
    loads (keys built from the tensors in C++, the current device and stream read from c10),
    else Python's. Keys of the two forms never meet: a process uses one."""
    global _fast, _make_key, _fast_op
    with _lock:
        if _fast is not None:
            return
        fns = _cplan.fast_functions(lambda: _launch._device_stream())
        if fns is None:
            _make_key, _fast, _fast_op = _py_key, _py_fast, _py_fast_op
        else:
            _fast, _make_key = fns
            mod = _cplan.module()
            _fast_op = mod.op_serve
            mod.set_op_stats(stats)
            # the C++ kernels read ON here and the override count there at each call
            mod.set_op_gates(globals(), vars(R))
    if fns is not None and torch.cuda.is_available():
        register_ops("cuda")


def serve_fast(cache: dict, prefix: tuple, inputs: tuple, slow, args: tuple, check=None):
    """:func:`serve` under the key ``(prefix, current device, the inputs' signature)``, built,
    looked up and (on a hit) launched in one call of the C++ executor where it is available.
    ``prefix``: the call's options (hashable); ``inputs``: the call's tensors (or None) in the
    plan's order, which are also the key's."""
    if _fast is None:
        _resolve_fast()
    if check is None:
        r = _fast(cache, prefix, inputs)
        if type(r) is not list:
            return r
        key, stream = r
    else:
        dev, stream = _launch._device_stream()
        key = _make_key(prefix, dev, inputs)
    return serve(cache, key, stream, slow, inputs, args, check)


def serve_op(op, slow, args: tuple):
    """A registered op's implementation (``torch.ops.tkit.*``: what a torch.compile graph and
    the autograd path call) served as :func:`serve` serves an eager call, from the plans of
    ``op`` (an :class:`tkit.kernels._register.Op` made with ``plans=True``) under the key
    (current device, ``args``: the op's arguments in schema order, each tensor by its
    signature), which the op's C++ kernel (``_cplan.cpp``, ``FastOp``) builds alike from the
    dispatcher's arguments. ``slow(*args)`` is the implementation; the plan's inputs are the
    tensor arguments in schema order (None for an absent optional one).

    Its arguments were checked before the dispatcher (by the public function, eager or
    traced), and the ordinary path of a miss launches only what that validated signature
    launches, so a plan serves it: a compiled graph of tkit ops otherwise paid the launch
    layer's full Python a call (2.5x the eager time of a Llama layer at 512 tokens on the
    H200). The ordinary path runs when plans are off, for anything but plain tensors (fake
    and functional tensors of a trace; ``nn.Parameter`` passes) and where autograd would
    record the call. The implementation must call this only where nothing but ``args`` (and
    state that clears the plans or holds the C++ kernel off) decides what it launches."""
    if not ON:
        return slow(*args)
    tensors = tuple(args[i] for i in op.tensor_args)
    for t in tensors:
        if type(t) is not _T and type(t) is not _Param and t is not None:
            return slow(*args)
    if _grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return slow(*args)
    if _fast is None:
        _resolve_fast()
    cache = op.plans
    r = _fast_op(cache, args, tensors)
    if type(r) is not list:
        return r
    key, stream = r
    if key is None:  # an argument the key cannot hold: never planned
        return slow(*args)
    return serve(cache, key, stream, slow, tensors, args)


def _py_op_key(dev, args):
    return (dev, tuple(_py_sig(a) if isinstance(a, _T) else a for a in args))


def _py_fast_op(cache, args, inputs):
    dev, stream = _launch._device_stream()
    return [_py_op_key(dev, args), stream]


_fast_op = None
#: (handles of the registered ops' C++ kernels, the hook for later ops) per device type
_registered: dict = {}
#: plan ops left to their Python kernel, and why
unregistered: dict = {}


def register_ops(device: str = "cuda") -> bool:
    """Register the C++ kernels of every plan op (and of those defined later) for ``device``'s
    tensors ("cuda"; tests and the host-cost harness also "cpu"): at its autograd key (which
    serves calls that need no gradient, and hands the others to the op's autograd path or below
    autograd) and at its backend key (below autograd, e.g. under torch.inference_mode: serves
    the call or runs the Python implementation). Whether the executor is there to do it."""
    if _fast is None:
        _resolve_fast()
    mod = _cplan.module() if _fast_op is not _py_fast_op else None
    if mod is None:
        return False
    backend = {"cuda": "CUDA", "cpu": "CPU"}[device]
    with _lock:
        if device in _registered:
            return True
        handles = []

        def reg(op):
            try:
                handles.append(mod.register_op(op._qualname, "Autograd" + backend, op.plans,
                                               op.grad_apply))
                handles.append(mod.register_op(op._qualname, backend, op.plans, op.impl))
            except (ValueError, RuntimeError) as e:
                # an op whose schema the kernel does not take: its Python kernels serve
                unregistered[op._qualname] = str(e)

        for op in R.PLAN_OPS:
            reg(op)
        R.on_plan_op.append(reg)
        _registered[device] = (handles, reg)
    return True


def unregister_ops(device: str) -> None:
    """Remove the C++ kernels registered for ``device`` (tests, benchmarks)."""
    with _lock:
        entry = _registered.pop(device, None)
    if entry is None:
        return
    handles, reg = entry
    R.on_plan_op.remove(reg)
    mod = _cplan.module()
    for h in handles:
        mod.unregister_op(h)


def build(rec: list, inputs: tuple, outputs: tuple):
    """The generated ``go(stream, inputs)`` (``inputs`` a tuple) for a recorded call; ``False``
    when the signature cannot have a plan, ``None`` when only this call could not give one."""
    if not ON:
        return None
    scratch = tuple(getattr(rec, "scratch", ()))
    zeroed = tuple(getattr(rec, "zeroed", ())) or (False,) * len(scratch)
    tensors = inputs + outputs + scratch
    if not CPU_OK and any(t is not None and not t.is_cuda for t in tensors):
        # keys hold device indices, -1 for CPU and meta alike: plans are for CUDA tensors
        return False
    for o in outputs + scratch:
        # outputs and scratch must be fresh, aligned allocations that torch.empty (contiguous)
        # or torch.empty_like of an input (its strides) reproduces, written by the launches
        # alone: an in-place torch op (zero_, fill_,
        # copy_; on any view of it) bumps the version counter that Triton's launches leave
        if (type(o) is not torch.Tensor or o.storage_offset()
                or (not o.is_contiguous() and _like_slot(inputs, o) == -1)
                or (not o.is_inference() and o._version)):
            return False  # (inference tensors keep no version counter: not checked there)
        if o.data_ptr() % 16:
            return None
    ptrs = [t.data_ptr() if t is not None else None for t in tensors]
    kept = {t.data_ptr() for t in getattr(rec, "kept", ())}
    launches = []
    cspecs = []  # the C++ executor's form of each launch (None: this launch needs Python)
    raw_used: set = set()
    for item in rec:
        if item is None:  # Triton's own path (an argument the binder does not know, hooks)
            return False
        if type(item) is _launch.RawLaunch:  # a CUDA-hatch kernel: the C++ executor's alone
            spec = _raw_spec(item, ptrs, kept, raw_used)
            if not spec:
                return spec
            cspecs.append(spec)
            continue
        compiled, grid, args = item
        pattern = []
        consts = []
        cvals = []
        for v in args:
            if isinstance(v, torch.Tensor):
                p = v.data_ptr()
                slots = [i for i, q in enumerate(ptrs) if q == p]
                if len(slots) != 1:
                    # no slot: a temporary or a copy (structural, never plannable); several:
                    # two of the call's tensors share memory this time
                    return False if not slots else None
                pattern.append(slots[0])
                cvals.append(("slot", slots[0]))
            elif v is None or type(v) in _CONST_TYPES:
                pattern.append(-1)
                consts.append(v)
                cvals.append(("const", v))
            elif _is_descriptor(v) and isinstance(v.base, torch.Tensor):
                # a host TMA descriptor of one of the call's tensors: rebuilt per call from a
                # template (its block shape and layout; shape and strides are the signature's)
                # with that tensor as the base
                p = v.base.data_ptr()
                slots = [i for i, q in enumerate(ptrs) if q == p]
                if len(slots) != 1 or not _same_view(v, tensors[slots[0]]):
                    return False if not slots else None
                pattern.append(-2 - slots[0])
                consts.append(_descriptor_template(v))
                cvals.append(("desc", (slots[0], tuple(int(n) for n in v.shape),
                                       tuple(int(n) for n in v.strides),
                                       getattr(v, "padding", "zero"), _plain_tiled(v))))
            else:
                # a tuple, or a descriptor of a temporary: holds a pointer of this call only
                return False
        launcher = compiled.run  # the C launcher's wrapper (the handles are loaded by now)
        c_launch = _direct_launch(launcher)
        cspecs.append(None if c_launch is None and not _cplan_test
                      else _cplan.launch_spec(compiled, grid, cvals))
        launches.append((tuple(pattern), (c_launch or launcher, *grid, compiled.function,
                                          compiled.packed_metadata, *consts),
                         c_launch is not None))
    used = {s if s >= 0 else -2 - s for pattern, _, _ in launches for s in pattern if s != -1}
    used |= raw_used
    if any(o.numel() and len(inputs) + j not in used for j, o in enumerate(outputs)):
        return False  # an output no launch writes (made by torch ops from a temporary)
    n_in = len(inputs)
    shape = tuple((tuple(o.shape), o.dtype, o.device) for o in outputs + scratch)
    # -2: a scratch tensor that starts at zero (torch.zeros)
    likes = tuple(_like_slot(inputs, o) for o in outputs) + tuple(
        -2 if z else _like_slot(inputs, o) for o, z in zip(scratch, zeroed))
    if _cplan.ON and all(c is not None for c in cspecs) and (_cplan_test or all(
            t is None or t.is_cuda for t in tensors)):
        mod = _cplan.module()
        if mod is not None:
            # the executor's empty_like takes the allocation's dtype: one slot form for both
            allocs = [(s, mod.scalar_type_code(dt), -1 if dev.type == "cpu" else dev.index,
                       -3 - like if like <= -3 else like)
                      for (s, dt, dev), like in zip(shape, likes)]
            # a stream's workspace (kept by the plan) binds the plan to that stream
            bound = getattr(rec, "stream", None)
            try:
                return mod.Plan(cspecs, allocs, n_in, len(outputs), *_launch.hook_lists(),
                                stats, tuple(rec.kept) if bound is not None else None, bound)
            except (ValueError, TypeError, OverflowError):
                pass  # a value the executor cannot hold: the Python plan below serves
    if len(launches) != len(cspecs) or getattr(rec, "stream", None) is not None:
        return False  # CUDA-hatch launches or a stream's workspace: the executor's alone
    code_key = (n_in, len(outputs), len(scratch), tuple(p for p, _, _ in launches), likes,
                tuple(d for _, _, d in launches))
    make = _codegen_cache.get(code_key)
    if make is None:
        make = _codegen(*code_key)
        _codegen_cache[code_key] = make
    values = [v for _, vals, _ in launches for v in vals]
    for s, dt, dev in shape:
        values += [s, dt, dev]
    return make(torch.empty, torch.empty_like, torch.zeros, stats, _launch.hook_lists(),
                _descriptor_for, *values)


def _raw_spec(item, ptrs: list, kept: set, used: set):
    """The C++ executor's launch of a recorded CUDA-hatch launch
    (:class:`tkit.kernels._launch.RawLaunch`; :func:`tkit.kernels._cplan.launch_spec`'s form,
    one 8-byte slot a parameter), its call tensors' slots added to ``used``; False when no call
    of the signature can have a plan (an argument in no tensor of the call and in no buffer
    the call keeps per stream), None when this call cannot (two call tensors share the
    address)."""
    function, grid, threads, shared, args = item
    slots, patches, tmas = [], [], []
    for a in args:
        if isinstance(a, torch.Tensor) or a[0] == "map":
            p = a.data_ptr() if isinstance(a, torch.Tensor) else a[1]
            hit = [i for i, q in enumerate(ptrs) if q == p]
            if len(hit) > 1:
                return None
            if not hit:
                if isinstance(a, torch.Tensor) and p in kept:
                    slots.append(p)  # the stream's workspace: the same every call
                    continue
                return False
            used.add(hit[0])
            if isinstance(a, torch.Tensor):
                patches.append((len(slots), hit[0]))
            else:  # a map over call tensor hit[0], encoded per call from the recorded spec
                tmas.append((len(slots), hit[0], *a[2]))
            slots.append(0)
        else:
            _, fmt, v = a
            slots.append(int.from_bytes(struct.pack(fmt, v).ljust(8, b"\0"), "little"))
    if len(slots) > 128:
        return False
    return (function, tuple(int(g) for g in grid), threads, shared, tuple(slots),
            tuple(patches), tuple(tmas))


def _like_slot(inputs: tuple, o) -> int:
    """An input ``empty_like`` reproduces ``o`` from (same shape, device and strides:
    ``empty_like`` keeps a dense input's strides, and an input with the strides of a fresh
    allocation is dense): its index when the dtype is the same too, ``-3 - index`` when only
    the dtype differs and ``o`` is not contiguous (``empty_like(t, dtype=)``: a cast of a
    transposed tensor), or -1 (``torch.empty`` of the shape: contiguous)."""
    if type(o) is not torch.Tensor:
        return -1
    for i, t in enumerate(inputs):
        if (type(t) is torch.Tensor and t.shape == o.shape and t.device == o.device
                and t.stride() == o.stride()):
            if t.dtype == o.dtype:
                return i
            if not o.is_contiguous():
                return -3 - i
    return -1


def _direct_launch(launcher):
    """The C launch function under Triton 3.6's ``CudaLauncher`` when calling it directly is
    what the wrapper would do (no global or profile scratch to allocate: the wrapper passes
    None for both), else None (other Triton versions' wrappers take other arguments)."""
    fn = getattr(launcher, "launch", None)
    if (fn is None or _LAUNCHER_FORM != "3.6" or getattr(launcher, "global_scratch_size", 1)
            or getattr(launcher, "profile_scratch_size", 1)
            or getattr(launcher, "launch_cooperative_grid", True)
            or getattr(launcher, "launch_pdl", True)):
        return None
    return fn


def _launcher_form() -> str:
    """'3.6' where Triton's CudaLauncher.__call__ is (self, gridX, gridY, gridZ, stream,
    function, *args) and calls ``self.launch(gridX, gridY, gridZ, stream, function,
    launch_cooperative_grid, launch_pdl, global_scratch, profile_scratch, *args)``."""
    try:
        import inspect

        from triton.backends.nvidia.driver import CudaLauncher

        params = list(inspect.signature(CudaLauncher.__call__).parameters)
        src = inspect.getsource(CudaLauncher.__call__)
    except Exception:  # noqa: BLE001 - another backend layout: the wrapper is called
        return ""
    if (params == ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]
            and "self.launch(gridX, gridY, gridZ, stream, function, "
                "self.launch_cooperative_grid, self.launch_pdl,\n" in src
            and "global_scratch, profile_scratch, *args)" in src):
        return "3.6"
    return ""


_LAUNCHER_FORM = _launcher_form()


def _is_descriptor(v) -> bool:
    return hasattr(v, "block_shape") and hasattr(v, "base") and hasattr(v, "strides")


def _plain_tiled(desc) -> bool:
    """A descriptor Triton's launcher encodes as a plain tiled map of its tensor's own data
    type (no tf32 rounding of float32, no element strides or im2col of newer Triton versions):
    the form the C++ executor reproduces."""
    return (not getattr(desc, "round_f32_to_tf32", False)
            and getattr(desc, "element_strides", None) is None)


def _same_view(desc, t) -> bool:
    """The descriptor describes ``t`` as it is, as its transpose (a K-major weight ``w.t()``
    described as the row-major ``w``; a stack of them, ``ws.transpose(1, 2)``, as the
    (G N, K) matrix of the stacked ``ws``) or as a view of it that merges leading dimensions
    (a batch folded into M): its shape, with strides equal except where a dimension has size
    1, which TMA never steps through. Its start is ``t``'s data pointer (matched by the
    caller), and its shape and strides follow from ``t``'s, which the plan's key holds."""
    shape = [int(n) for n in desc.shape]
    views = [t] + ([t.t()] if t.dim() == 2 else []) + (
        [t.transpose(-1, -2)] if t.dim() == 3 else [])
    for v in views:
        if list(v.shape) != shape:
            try:
                v = v.view(shape)
            except RuntimeError:  # not a view of t's elements in this shape
                continue
        if all(n == 1 or a == b for n, a, b in zip(shape, desc.strides, v.stride())):
            return True
    return False


def _descriptor_template(desc):
    """A copy of a recorded descriptor without its base (the plan must not keep the recorded
    call's tensor alive); :func:`_descriptor_for` fills a copy of it per call."""
    tmpl = object.__new__(type(desc))
    tmpl.__dict__.update(desc.__dict__)
    tmpl.base = None
    return tmpl


def _descriptor_for(tmpl, t):
    """The template's descriptor over ``t``: what Triton's launcher encodes into a tensor map
    per call (about half a microsecond against several for the descriptor's constructor, whose
    checks the recorded call passed for this signature)."""
    desc = object.__new__(type(tmpl))
    desc.__dict__.update(tmpl.__dict__)
    desc.base = t
    return desc


def _codegen(n_in: int, n_out: int, n_scratch: int, patterns: tuple, likes: tuple = (),
             direct: tuple = ()):
    """Source of ``make(empty, stats, hooks, *values) -> go`` for one plan structure: the
    values become closure cells, so ``go`` is straight-line code with no lookups.

    ``likes[j]``: an input slot whose shape, dtype, device and strides the j-th
    allocation has, allocated with ``empty_like`` (no argument parsing: half the cost of
    ``torch.empty(shape, dtype=, device=)``), or -1, or -2 for a scratch tensor allocated by
    ``torch.zeros``, or ``-3 - slot``: ``empty_like`` of that input with the allocation's
    dtype (:func:`_like_slot`). ``direct[j]``: launch j calls the
    compiled launcher's C function itself (:func:`_direct_launch`), not its Python wrapper."""
    likes = likes or (-1,) * (n_out + n_scratch)
    direct = direct or (False,) * len(patterns)
    params = []
    body = []
    ins = [f"t{i}" for i in range(n_in)]
    allocs = [f"t{n_in + j}" for j in range(n_out + n_scratch)]
    outs = allocs[:n_out]
    for j in range(len(patterns)):
        params += [f"r{j}", f"g{j}a", f"g{j}b", f"g{j}c", f"f{j}", f"m{j}"]
        params += [f"c{j}_{k}" for k, s in enumerate(patterns[j]) if s < 0]
    for j in range(len(allocs)):
        params += [f"s{j}", f"d{j}", f"v{j}"]
    body.append(f"        {''.join(t + ', ' for t in ins)}= inputs")
    body.append("        if enter or exit_:")  # a profiler attached: Triton's path calls it
    body.append("            return None")
    for j, o in enumerate(allocs):
        if likes[j] >= 0:
            body.append(f"        {o} = empty_like(t{likes[j]})")
        elif likes[j] <= -3:
            body.append(f"        {o} = empty_like(t{-3 - likes[j]}, dtype=d{j})")
        elif likes[j] == -2:
            body.append(f"        {o} = zeros(s{j}, dtype=d{j}, device=v{j})")
        else:
            body.append(f"        {o} = empty(s{j}, dtype=d{j}, device=v{j})")
    # the launchers get data pointers as ints: Triton's C launcher then skips, per tensor
    # argument, its call of data_ptr() and the driver's cuPointerGetAttribute (which only
    # checks that the pointer is a device one: these are the CUDA tensors of the signature)
    used = sorted({s for pat in patterns for s in pat if s >= 0} | set(range(n_in, n_in
                                                                             + len(allocs))))
    for i in used:
        body.append(f"        p{i} = t{i}.data_ptr()")
    if allocs:
        body.append(f"        if ({' | '.join(f'p{n_in + j}' for j in range(len(allocs)))})"
                    " & 15:")
        body.append("            return None")
    for j, pat in enumerate(patterns):
        args = [f"p{s}" if s >= 0 else f"c{j}_{k}" if s == -1 else f"desc(c{j}_{k}, t{-2 - s})"
                for k, s in enumerate(pat)]
        if direct[j]:  # the C launch of Triton 3.6's launcher, its two scratch sizes 0
            body.append(f"        r{j}(g{j}a, g{j}b, g{j}c, stream, f{j}, False, False, None, "
                        f"None, m{j}, None, None, None" + "".join(", " + a for a in args) + ")")
        else:
            body.append(f"        r{j}(g{j}a, g{j}b, g{j}c, stream, f{j}, m{j}, None, None, None"
                        + "".join(", " + a for a in args) + ")")
    body.append("        stats['plan'] += 1")
    ret = outs[0] if n_out == 1 else "(" + ", ".join(outs) + ("," if n_out == 1 else "") + ")"
    body.append(f"        return {ret}")
    src = (f"def make(empty, empty_like, zeros, stats, hooks, desc, {', '.join(params)}):\n"
           "    enter, exit_ = hooks\n"
           "    def go(stream, inputs):\n" + "\n".join(body) + "\n    return go\n")
    ns: dict = {}
    exec(src, ns)  # noqa: S102 - generated from the recorded launch structure
    return ns["make"]


refresh()
