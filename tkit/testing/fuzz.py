"""``fuzz``: property-test a kernel against a reference over shapes, dtypes and layouts.

A kernel under test may crash the process that runs it: an out-of-bounds access in Triton's
interpreter is a segmentation fault, one on a GPU loses the CUDA context (every later launch in
that process fails too). ``fuzz(isolate=True)`` therefore runs each example in a child
(:mod:`tkit.testing._worker`, supervised by :class:`tkit.bench.isolate.Worker`) and turns a
crash into an ordinary failure inside the hypothesis test, so hypothesis shrinks it like any
other and prints the reproducer. Only the example's description crosses to the child (shapes,
dtypes, layouts, seeds and keyword arguments; the functions by module and name): the child
rebuilds the tensors with :func:`make_tensor`, which is deterministic.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import importlib
import importlib.util
import itertools
import os
import pickle
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tkit.bench.isolate import Worker, context_lost
from tkit.kernels._common import poisoned_outputs
from tkit.testing.compare import ReferenceMismatch, assert_close_to_reference
from tkit.testing.tensors import default_device, describe, make_tensor
from tkit.testing.variants import NewVariant, Variants, is_new_variant, same_class_sizes

# hypothesis is imported where fuzzing happens: check_against_reference (and tkit bench, which
# uses it) needs only the runtime dependencies
if TYPE_CHECKING:
    from hypothesis import strategies as st


def _as_strategy(x):
    from hypothesis import strategies as st

    if isinstance(x, st.SearchStrategy):
        return x
    return st.sampled_from(tuple(x))


def _upcast(x, dtype=torch.float64):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().to(dtype)
    return x


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out if isinstance(t, torch.Tensor)]


def check_against_reference(
    fn: Callable,
    reference: Callable,
    inputs: Sequence,
    kwargs: dict | None = None,
    *,
    factor: float = 2.0,
    grad: bool = False,
    grad_factor: float = 3.0,
    ref_dtype: torch.dtype = torch.float64,
    floor: float | None = None,
    ulps: float = 1.0,
    times: dict | None = None,
):
    """One check of the DESIGN rule: run ``fn`` (outputs poisoned), ``reference`` in
    ``ref_dtype`` and ``reference`` in the inputs' own precision; compare. With ``grad``, also
    backpropagate one random output gradient through all three and compare input gradients.
    Returns what ``fn`` returned (checked), for further comparisons without another call.

    The reference and the comparison run where the inputs live: on a GPU, float64 on the GPU
    (a copy to the host and float64 on its CPU cost milliseconds an example at GPU sizes).
    ``times``: host seconds of ``fn`` (its compiles included), ``reference`` and ``compare``
    are added to it (the device's work counts where the host waits for it: the comparison,
    which reads every result in one transfer)."""
    kwargs = kwargs or {}
    clock = _Clock(times)
    is_float = [isinstance(x, torch.Tensor) and x.is_floating_point() for x in inputs]
    float_idx = [i for i, f in enumerate(is_float) if f]

    def prepare(dtype):
        out = []
        for x, f in zip(inputs, is_float):
            if f:
                x = x.detach() if dtype is None else _upcast(x, dtype)
                x = x.requires_grad_(grad)
            out.append(x)
        return out

    inputs, hp_inputs, peer_inputs = prepare(None), prepare(ref_dtype), prepare(None)
    clock.lap("reference")  # the float64 copies
    with poisoned_outputs():
        out = fn(*inputs, **kwargs)
    clock.lap("fn")
    with torch.set_grad_enabled(grad):
        ref = reference(*hp_inputs, **kwargs)
        peer = reference(*peer_inputs, **kwargs)
    clock.lap("reference")
    outs, refs, peers = _tensors(out), _tensors(ref), _tensors(peer)
    if len(outs) != len(refs):
        raise ReferenceMismatch(f"{len(outs)} outputs but the reference gives {len(refs)}")
    for i, (o, r, p) in enumerate(zip(outs, refs, peers)):
        assert_close_to_reference(o, r, p, factor=factor, floor=floor, ulps=ulps,
                                  name=f"output {i}")
    clock.lap("compare")
    if not grad:
        return out
    gen = torch.Generator().manual_seed(1234)
    douts = [torch.randn(o.shape, generator=gen).to(o.device) for o in outs]

    def grads(ins, os):
        used = [(o, d) for o, d in zip(os, douts) if o.requires_grad]
        return torch.autograd.grad(
            [o for o, _ in used], [ins[i] for i in float_idx],
            [d.to(o.dtype) for o, d in used], allow_unused=True)

    g_fn = grads(inputs, outs)
    clock.lap("fn")
    g_ref, g_peer = grads(hp_inputs, refs), grads(peer_inputs, peers)
    clock.lap("reference")
    for k, (g, gr, gp) in enumerate(zip(g_fn, g_ref, g_peer)):
        if gr is None:
            continue
        if g is None:
            raise ReferenceMismatch(f"input {float_idx[k]} got no gradient")
        assert_close_to_reference(g, gr, gp, factor=grad_factor, floor=floor, ulps=ulps,
                                  name=f"gradient of input {float_idx[k]}")
    clock.lap("compare")
    return out


class _Clock:
    """Host seconds between laps added to ``times[name]`` (nothing when ``times`` is None).
    It does not wait for the device: on a GPU a phase's kernels count where the host next
    waits for them (the comparison reads its results), since every wait costs time in a
    campaign whose processes share one GPU."""

    def __init__(self, times: dict | None):
        self.times = times
        self.t = time.perf_counter()

    def lap(self, name: str) -> None:
        if self.times is None:
            return
        now = time.perf_counter()
        self.times[name] = self.times.get(name, 0.0) + now - self.t
        self.t = now


# ---- one example, in this process or in the worker --------------------------------------------
_NO_DRIVER_HINT = (
    "Triton found no GPU driver, so it cannot launch a kernel on this machine. To run Triton "
    "kernels on the CPU, turn on Triton's interpreter before the module that defines your "
    "kernels is imported (triton.jit reads the switch when it decorates a function): run "
    "`TRITON_INTERPRET=1 python your_script.py` (or `TRITON_INTERPRET=1 pytest ...`), or put "
    "`import os; os.environ['TRITON_INTERPRET'] = '1'` at the very top of the script or of "
    "conftest.py, before anything imports triton. fuzz then draws CPU tensors.")


def run_example(fn, reference, specs, extra_args, kw, device, scale, options,
                times: dict | None = None) -> None:
    """Build the inputs of one example from their descriptions and check ``fn`` on them (raises
    ReferenceMismatch or whatever ``fn`` raises). ``times``: see check_against_reference, plus
    ``make`` (building the inputs)."""
    t0 = time.perf_counter()
    tensors = [make_tensor(s, d, lay, seed=sd, device=device, scale=scale)
               for s, d, lay, sd in specs]
    args = list(tensors) + list(extra_args(tensors, specs[0][1], device) if extra_args else ())
    if times is not None:
        times["make"] = times.get("make", 0.0) + time.perf_counter() - t0
    try:
        check_against_reference(fn, reference, args, kw, **options, times=times)
    except RuntimeError as e:
        if "active drivers" in str(e):
            raise RuntimeError(_NO_DRIVER_HINT) from e
        raise


def _move_sizes(shape_tuple, data) -> tuple:
    """``shape_tuple`` with some of its distinct sizes above 2 (each one drawn to move or
    stay) moved to a size of the same compile class (:func:`same_class_sizes`), the same
    everywhere it occurs (sizes that must match still do)."""
    from hypothesis import strategies as st

    moved = {}
    for d in sorted({d for shape in shape_tuple for d in shape}):
        sizes = same_class_sizes(d)
        # each size moves or stays (moving all at once changes the compile key more often)
        if len(sizes) > 1 and data.draw(st.booleans(), label=f"move {d}"):
            moved[d] = sizes[data.draw(st.integers(0, len(sizes) - 1), label=f"size for {d}")]
    return tuple(tuple(moved.get(d, d) for d in shape) for shape in shape_tuple)


# ---- sending functions to the worker by reference ----------------------------------------------
def _main_ref() -> str:
    """How a child finds this process's ``__main__``: its module name when run with ``-m``,
    else its file."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        return spec.name
    path = getattr(main, "__file__", None)
    if not path:
        raise TypeError(
            "fuzz(isolate=True) runs the kernel in a child process, which imports it by module "
            "and name, but this __main__ has no file (an interactive session or `python -c`). "
            "Put the function in a module or a script file, or pass isolate=False.")
    return os.path.abspath(path)


_MAINS: dict[str, object] = {}


def _main_attr(ref: str, qualname: str):
    """In the child: the object ``qualname`` of the parent's ``__main__``, imported under
    another name so that its ``if __name__ == "__main__":`` block does not run."""
    mod = _MAINS.get(ref)
    if mod is None:
        if ref.endswith(".py") or os.sep in ref:
            spec = importlib.util.spec_from_file_location("__tkit_fuzz_main__", ref)
            mod = importlib.util.module_from_spec(spec)
            sys.modules["__tkit_fuzz_main__"] = mod
            spec.loader.exec_module(mod)
        else:
            mod = importlib.import_module(ref)
        _MAINS[ref] = mod
    obj = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class _ByReference(pickle.Pickler):
    def reducer_override(self, obj):
        if getattr(obj, "__module__", None) == "__main__" and isinstance(obj, type | _FUNC):
            qual = getattr(obj, "__qualname__", "")
            if "<" not in qual:  # a lambda or a local function: let pickle say so below
                return _main_attr, (_main_ref(), qual)
        return NotImplemented


_FUNC = type(_main_attr)


def _dumps(obj, what: str = "") -> str:
    import io

    buf = io.BytesIO()
    try:
        _ByReference(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(
            f"fuzz(isolate=True) runs the kernel in a child process, which imports {what} by "
            f"module and name, and that failed: {e}. Define the function (and any function it "
            "is given) at module level of an importable module or script, not as a lambda, "
            "a closure or inside a test; or pass isolate=False to run in this process.") from e
    return base64.b64encode(buf.getvalue()).decode()


# ---- the worker --------------------------------------------------------------------------------
class KernelCrashed(AssertionError):
    """The kernel took down the process running it (a signal, a lost CUDA context or a hang)."""


class _BudgetSpent(BaseException):
    """Raised inside the hypothesis test when ``budget_s`` is spent and nothing has failed: a
    BaseException, so that hypothesis stops at once instead of drawing the examples left."""


class _ContextLost(BaseException):
    """Raised inside the hypothesis test when the CUDA context of this process is lost: a
    BaseException, so that hypothesis stops at once instead of "shrinking" on examples that all
    fail because the context is gone."""


class _BoundReached(BaseException):
    """Raised inside the hypothesis test of fuzz's first phase when the compile budget is
    spent (an example would compile a new variant): ends the phase at once; the second phase
    goes on from the examples that passed (see ``fuzz(compile_budget_s=...)``)."""


_WORKER: Worker | None = None
_COUNTER = itertools.count()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def _worker(timeout: float) -> Worker:
    """The process's one worker, shared by every fuzz call (its start-up is paid once)."""
    global _WORKER
    if _WORKER is None:
        env = dict(os.environ)
        # the child imports what this process can: the same sys.path, in the same order
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        env["TKIT_FUZZ_FORK"] = "1" if _interpreting() and not torch.cuda.is_available() else "0"
        _WORKER = Worker([sys.executable, "-m", "tkit.testing._worker"], deadline=timeout,
                         first_deadline=timeout + 120.0, env=env,
                         hang_hint=" (a hang: killed; see fuzz's timeout)")
        atexit.register(_WORKER.close)
    _WORKER.deadline = timeout
    return _WORKER


def _ask_worker(worker: Worker, request: dict) -> dict:
    status, payload = worker.ask(f"ex{next(_COUNTER)}", _dumps(request))
    if status == "ok":
        return payload
    if status.startswith("child died") or status.startswith("no answer"):
        return {"outcome": "crash", "why": status}
    if context_lost(status):
        return {"outcome": "crash", "why": f"the CUDA context was lost: {status}"}
    return {"outcome": "fail", "type": "RuntimeError", "message": status, "traceback": ""}


def _raise_failure(result: dict, repro: str):
    if result["outcome"] == "crash":
        raise KernelCrashed(f"the kernel crashed: {result['why']}\n  reproduce: {repro}")
    exc = None
    if "exception" in result:
        try:
            exc = pickle.loads(base64.b64decode(result["exception"]))
        except Exception:
            exc = None
    if isinstance(exc, ReferenceMismatch):
        raise ReferenceMismatch(f"{exc}\n  reproduce: {repro}")
    if exc is None:
        exc = RuntimeError(f"{result['type']}: {result['message']}")
    tb = result.get("traceback", "")
    if tb and hasattr(exc, "add_note"):
        exc.add_note("in the fuzz worker:\n" + tb)
    raise exc


def _start_isolated(fn, reference, extra_args, timeout: float) -> Worker:
    """The worker, once it has imported the functions; TypeError saying why it cannot."""
    # fail before hypothesis starts if the child cannot get at the functions
    for what, obj in (("fn", fn), ("reference", reference), ("extra_args", extra_args)):
        _dumps(obj, f"`{what}` ({getattr(obj, '__qualname__', obj)!r})")
    worker = _worker(timeout)
    loaded = _ask_worker(worker, {"kind": "load", "fn": fn, "reference": reference,
                                  "extra_args": extra_args})
    if loaded["outcome"] != "pass":
        raise TypeError(
            f"fuzz(isolate=True): the child process could not import the functions "
            f"({loaded.get('type')}: {loaded.get('message', loaded.get('why'))}). They are "
            f"sent by module and name: define them at module level of a module the child "
            f"can import (the same sys.path as here), or pass isolate=False.")
    return worker


@dataclass
class FuzzStats:
    """What a fuzz call did: examples run (shrinking included), how many failed or crashed,
    whether ``budget_s`` stopped it, and the seconds spent.

    Where the time went (examples run in this process only): ``times`` holds the seconds of
    building inputs (``make``), of ``fn`` (its compiles included), of the references
    (``reference``, the float64 copies included) and of the comparisons (``compare``); the rest
    of ``seconds`` is hypothesis (drawing, shrinking) and rejected examples. With a compile
    budget (``fuzz(compile_budget_s=...)``): ``variants`` counts the compiles, ``rejected``
    the examples refused because they needed a new variant once it was spent, ``replayed`` the
    examples that re-ran a compiled example's dtype, layouts and options on new sizes of the
    same compile class and new values, ``replay_invalid`` those the op refused as inputs."""

    examples: int = 0
    failed: int = 0
    crashed: int = 0
    stopped: bool = False
    seconds: float = 0.0
    shapes: set = field(default_factory=set)
    times: dict = field(default_factory=dict)
    rejected: int = 0
    replayed: int = 0
    replay_invalid: int = 0
    variants: object = None  # tkit.testing.variants.Variants, when counted

    def as_row(self) -> dict:
        """The counts as a flat dict (a campaign's row)."""
        row = {"examples": self.examples, "failed": self.failed, "crashed": self.crashed,
               "stopped_by_budget": self.stopped, "seconds": round(self.seconds, 2),
               "distinct_shapes": len(self.shapes), "rejected_new_variant": self.rejected,
               "replayed": self.replayed, "replay_invalid": self.replay_invalid}
        row.update({f"{k}_s": round(v, 2) for k, v in sorted(self.times.items())})
        if self.variants is not None:
            row.update(self.variants.as_row())
        return row


def _owned_by_tkit(fn) -> bool:
    target = getattr(fn, "func", fn)  # functools.partial
    return (getattr(target, "__module__", "") or "").split(".")[0] == "tkit"


def fuzz(
    fn: Callable,
    reference: Callable,
    *,
    shapes: st.SearchStrategy,
    dtypes: Sequence[torch.dtype] | st.SearchStrategy = (torch.float32,),
    layouts: Sequence[str] | st.SearchStrategy = ("contiguous",),
    kwargs: st.SearchStrategy | None = None,
    extra_args: Callable | None = None,
    scale: float = 1.0,
    factor: float = 2.0,
    grad: bool = False,
    floor: float | None = None,
    ulps: float = 1.0,
    max_examples: int | None = None,
    device: str | None = None,
    isolate: bool | None = None,
    timeout: float = 600.0,
    budget_s: float | None = None,
    stats: FuzzStats | None = None,
    compile_budget_s: float | None = None,
    max_variants: int | None = None,
) -> FuzzStats:
    """Property-test ``fn`` against ``reference`` with hypothesis.

    Parameters
    ----------
    fn : callable
        The kernel under test, called as ``fn(*tensors, **kw)``: a tkit op or any function that
        launches a Triton kernel of your own.
    reference : callable
        Same signature, written in PyTorch; called on float64 copies for the reference and on
        the inputs themselves for the same-precision peer.
    shapes : strategy
        Draws a tuple with one shape per tensor input (see ``tkit.testing.strategies``).
    dtypes, layouts : sequences or strategies
        One dtype for all inputs; one layout drawn per input.
    kwargs : strategy, optional
        Draws a dict of keyword arguments.
    extra_args : callable, optional
        ``extra_args(tensors, dtype, device) -> tuple`` appends non-random arguments.
    grad : bool
        Also compare input gradients (factor 3).
    floor, ulps : optional
        The comparison's noise floor: ``floor`` absolute, or ``ulps`` units of rounding of the
        output dtype at the reference's largest magnitude (default 1; see
        :func:`tkit.testing.assert_close_to_reference`).
    isolate : bool, optional
        Run each example in a child process, so that a kernel that crashes (a segmentation
        fault in the interpreter, a lost CUDA context, a hang past ``timeout`` seconds) is
        reported as a failure with its shrunk reproducer instead of ending this process.
        Default: on for kernels of your own, off for tkit's ops (their launches are validated
        and sanitizer-checked, and the test suite calls fuzz hundreds of times). ``fn``,
        ``reference`` and ``extra_args`` must then be importable by module and name (module
        level of a module or of the script being run; not lambdas or closures): ``True``
        raises a TypeError saying so where they are not; the default warns and runs them in
        this process.
    budget_s : float, optional
        Stop after this many seconds (``stats.stopped``; no error): for campaigns with a time
        limit. A failure found before the limit is still raised, shrunk as far as the limit
        allowed.
    compile_budget_s, max_variants : optional
        Bound the kernel variants compiled (:mod:`tkit.testing.variants`). The recipe's
        examples run until this many seconds went to Triton compiles (or this many variants
        compiled) and an example would compile one more: that example is rejected before
        anything compiles, and a second hypothesis run takes the examples left. Three in four
        of its examples re-run one that passed before (its dtype, layouts and options) on new
        values and with some sizes moved within their compile class (within their power of
        two, keeping their remainder modulo 16 above 32 and their divisibility by 16 below;
        equal sizes stay equal), one in four is a fresh draw of the recipe; either
        is rejected (``stats.rejected``) when it would compile a new variant, and a replay the
        op refuses as inputs (an exception other than a mismatch or a crash, from a size
        relation the move broke) is rejected too (``stats.replay_invalid``). So the examples
        keep coming on the variants already compiled, checked by the same rule. Once an
        example has failed the bound is lifted, so that shrinking compiles what it needs. In
        this process only (not with ``isolate``).
    stats : FuzzStats, optional
        Filled in as examples run (also returned), so a caller sees the counts after a failure.

    A failure is shrunk by hypothesis to the smallest case and raised with the call that
    reproduces it, written with :func:`tkit.testing.make_tensor`.

    Outputs that tkit allocates are filled with NaN before the launch (``poisoned_outputs``),
    so an element a tkit kernel never writes fails the comparison. Outputs your own ``fn``
    allocates (``torch.empty``) are not poisoned: an element it never writes holds whatever the
    allocator returned, which may happen to pass; allocate with ``torch.full(..., nan)`` while
    testing to catch it.

    Deadlines are off (the first call of a kernel compiles it).
    """
    from hypothesis import given, note, reject, settings
    from hypothesis import strategies as st
    from hypothesis.errors import UnsatisfiedAssumption

    from tkit.testing.strategies import seeds

    device = device or default_device()
    dtype_st, layout_st = _as_strategy(dtypes), _as_strategy(layouts)
    kwargs_st = kwargs if kwargs is not None else st.just({})
    name = getattr(fn, "__qualname__", None) or getattr(getattr(fn, "func", None),
                                                        "__qualname__", repr(fn))
    options = dict(factor=factor, grad=grad, floor=floor, ulps=ulps)
    stats = stats if stats is not None else FuzzStats()
    worker = None
    if isolate or (isolate is None and not _owned_by_tkit(fn)):
        try:
            worker = _start_isolated(fn, reference, extra_args, timeout)
        except TypeError as e:
            if isolate:
                raise
            # the default asked for isolation, the functions cannot travel: run them here
            # rather than fail a test that ran before isolation existed, and say so
            warnings.warn(f"fuzz({name}) runs in this process, so a crash of the kernel ends "
                          f"it: {e}", stacklevel=2)
    t_start = time.time()
    last_failure: list[BaseException] = []
    bounded = worker is None and (compile_budget_s is not None or max_variants is not None)
    variants = Variants(compile_budget_s, max_variants) if worker is None else None
    stats.variants = variants
    pool: list = []  # examples that passed before the compile budget was spent
    times = stats.times if worker is None else None

    def check(specs, kw, phase: int, replay: bool) -> None:
        """Run one example (its specs and keyword arguments) and keep the counts."""
        repro = f"{name}(" + ", ".join(describe(*s) for s in specs)
        if extra_args:
            repro += ", *extra_args"
        repro += "".join(f", {k}={v!r}" for k, v in kw.items()) + ")"
        note(f"reproduce: {repro}")
        if budget_s is not None and time.time() - t_start > budget_s:
            raise _BudgetSpent  # ends hypothesis at once (while shrinking too: see below)
        example = dict(fn=fn, reference=reference, specs=specs, extra_args=extra_args, kw=kw,
                       device=device, scale=scale, options=options)
        try:
            if worker is not None:
                stats.examples += 1
                stats.shapes.add(tuple(s[0] for s in specs))
                result = _ask_worker(worker, {"kind": "example", "example": example})
                if result["outcome"] != "pass":
                    _raise_failure(result, repro)
                return
            counted = True
            try:
                run_example(**example, times=times)
            except NewVariant:
                counted = False
                stats.rejected += 1
                if phase == 1:
                    raise _BoundReached from None
                reject()
            except ReferenceMismatch as e:
                raise ReferenceMismatch(f"{e}\n  reproduce: {repro}") from None
            except Exception as e:
                if is_new_variant(e):  # re-raised under another type on its way here
                    counted = False
                    stats.rejected += 1
                    if phase == 1:
                        raise _BoundReached from None
                    reject()
                if context_lost(f"{type(e).__name__}: {e}"):
                    raise _ContextLost(f"{type(e).__name__}: {e}\n  reproduce: {repro}") from e
                if replay:
                    # new sizes broke a relation between them that the recipe keeps: not an
                    # example of the op's inputs
                    counted = False
                    stats.replay_invalid += 1
                    reject()
                raise
            finally:
                if counted:
                    stats.examples += 1
                    stats.replayed += replay
                    stats.shapes.add(tuple(s[0] for s in specs))
            if phase == 1 and bounded and len(pool) < 4096:
                pool.append((tuple(tuple(s[0]) for s in specs), specs[0][1] if specs else None,
                             tuple(s[2] for s in specs), kw))
        except UnsatisfiedAssumption:
            raise  # a rejected example (above): not a failure
        except Exception as e:
            stats.failed += 1
            stats.crashed += isinstance(e, KernelCrashed)
            if variants is not None:
                variants.bounded = False  # shrinking may compile what it needs
            # hypothesis tries smaller candidates only: the latest failure is the smallest yet
            last_failure[:] = [e, repro]
            raise
        finally:
            stats.seconds = time.time() - t_start

    def draw_fresh(data, shape_tuple, dtype, seed):
        specs = []
        for i, shape in enumerate(shape_tuple):
            layout = data.draw(layout_st, label=f"layout of input {i}")
            specs.append((tuple(shape), dtype, layout, seed + i))
        return specs

    # phase 1: the recipe's examples (all of them when nothing bounds the compiles)
    @given(shape_tuple=shapes, dtype=dtype_st, data=st.data(), kw=kwargs_st, seed=seeds())
    def run(shape_tuple, dtype, data, kw, seed):
        check(draw_fresh(data, shape_tuple, dtype, seed), kw, 1, False)

    # phase 2, once the compile budget is spent: three examples in four replay one that passed
    # in phase 1 on new values and moved sizes, one is a fresh draw (most of those need a new
    # variant where the recipe's key variety is large); either is rejected when it would
    # compile a new variant. Its own test, over the frozen pool, so that its draws are the
    # same function of hypothesis's choices every time (hypothesis replays them).
    @given(data=st.data(), seed=seeds())
    def run_bounded(data, seed):
        if data.draw(st.integers(0, 3), label="fresh (0) or replay"):
            shape_tuple, dtype, layouts_e, kw = data.draw(st.sampled_from(frozen),
                                                          label="compiled example")
            shape_tuple = _move_sizes(shape_tuple, data)
            specs = [(tuple(shape), dtype, layouts_e[i], seed + i)
                     for i, shape in enumerate(shape_tuple)]
            check(specs, kw, 2, True)
        else:
            shape_tuple = data.draw(shapes, label="shapes")
            dtype = data.draw(dtype_st, label="dtype")
            kw = data.draw(kwargs_st, label="kwargs")
            check(draw_fresh(data, shape_tuple, dtype, seed), kw, 2, False)

    # Every fuzz call runs these same inner functions, so hypothesis would file all their
    # failing examples under one database key and replay one call's failures into another's
    # run. The functions under test tell them apart.
    digest = "|".join(f"{getattr(f, '__module__', '')}.{getattr(f, '__qualname__', repr(f))}"
                      for f in (fn, reference))
    run.hypothesis.inner_test._hypothesis_internal_add_digest = digest.encode()
    run_bounded.hypothesis.inner_test._hypothesis_internal_add_digest = (
        digest + "|bounded").encode()
    run = settings(deadline=None, **({"max_examples": max_examples} if max_examples else {}))(run)
    frozen: list = []
    try:
        with variants or contextlib.nullcontext():
            try:
                run()
            except _BoundReached:
                frozen[:] = pool
            if frozen:
                left = (max_examples or settings().max_examples) - stats.examples
                if left > 0:
                    settings(deadline=None, max_examples=left)(run_bounded)()
    except _BudgetSpent:
        stats.stopped = True
        if last_failure:  # the budget ran out while shrinking: the smallest failure found
            e, repro = last_failure
            if hasattr(e, "add_note"):
                if repro not in str(e):
                    e.add_note(f"reproduce: {repro}")
                e.add_note(f"(shrinking stopped when budget_s={budget_s} ran out)")
            raise e from None
    except _ContextLost as e:
        stats.crashed += 1
        raise KernelCrashed(
            f"the kernel lost this process's CUDA context: {e}\n(not shrunk: every later "
            "example in this process would fail the same way; fuzz(isolate=True) runs each in "
            "a child and shrinks)") from e.__cause__
    finally:
        stats.seconds = time.time() - t_start
    return stats
