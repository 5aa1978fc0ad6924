"""How tkit's ops are registered with torch.library.

``torch.library.custom_op`` runs Python around every call of an op: an autograd kernel that
redispatches below autograd, and a check that outputs alias no input. On the 2-core CPU where
tkit is developed that costs 11-12 us a call of an op that does nothing, against 1.8 us for
the same op defined with the low-level ``torch.library.Library`` API and about 5 us with the
lean autograd kernel below (docs/NOTES.md, "Op registration"). A torch.compile graph calls
every registered op through the dispatcher, so the difference is paid per op per step.

:func:`custom_op` keeps custom_op's interface (``register_fake``, ``register_autograd``) and,
for the functional ops, registers them the low-level way:

- the schema is inferred from the type hints as custom_op infers it, tagged pt2-compliant;
- the implementation is the ``CompositeExplicitAutograd`` kernel (every device), the fake one
  goes through ``torch.library.register_fake``;
- the ``Autograd`` kernel redispatches below autograd unless grad mode is on and an input
  requires grad; then it runs an ``autograd.Function`` with the registered formula (or one
  whose backward raises, as custom_op's does for an op without a formula);
- calling the :class:`Op` object itself (what tkit's public functions do) skips the autograd
  kernel when no gradient is needed.

Ops that mutate an argument keep ``torch.library.custom_op``: it also registers the
ADInplaceOrView kernel that bumps the mutated tensors' version counters.

An op made with ``plans=True`` serves repeated signatures from eager plans
(:func:`tkit.kernels._plan.serve_op`, keyed by its arguments in schema order); where the C++
executor loads, C++ kernels at its ``AutogradCUDA`` and ``CUDA`` keys serve those calls without
entering Python and defer to the Python kernels otherwise (``tkit/kernels/_cplan.cpp``,
``FastOp``).
The implementations read per-thread config overrides that the C++ kernel cannot see, so every
override scope holds it off (:func:`fast_ops_held`) while it is active in any thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence

import torch

_LIBS: dict[str, torch.library.Library] = {}
_any_requires_grad = torch._C._any_requires_grad
_grad_enabled = torch.is_grad_enabled
_compiling = torch.compiler.is_compiling
_below_autograd = torch._C._AutoDispatchBelowAutograd
_modes = torch._C._len_torch_dispatch_stack  # user and infra (fake, functional) modes
_T = torch.Tensor
_Param = torch.nn.Parameter


def _plain(args) -> bool:
    """Every tensor argument a plain CUDA ``torch.Tensor`` (no subclass: fake, functional and
    wrapper tensors dispatch through the Python key below autograd; meta and CPU tensors to
    other backends' kernels, the fake one for meta), none a list."""
    for a in args:
        t = type(a)
        if t is _T or t is _Param:
            if a.is_cuda:
                continue
            return False
        if a is None or t is int or t is float or t is str or t is bool or t is torch.dtype:
            continue
        return False
    return True


#: the ops that serve eager plans (``plans=True``), in definition order
PLAN_OPS: list = []
#: called with each plan op defined after :mod:`tkit.kernels._plan` registered the C++ kernels
on_plan_op: list = []
#: active :func:`fast_ops_held` scopes (read by the C++ kernels at each call)
_held = 0
_held_lock = threading.Lock()


@contextlib.contextmanager
def fast_ops_held():
    """The registered ops' C++ path off in every thread while this is active: config overrides
    are per thread and read by the Python implementations only."""
    global _held
    with _held_lock:
        _held += 1
    try:
        yield
    finally:
        with _held_lock:
            _held -= 1


#: every family's override state (tkit.kernels._common.ConfigOverrides registers each)
OVERRIDE_SCOPES: list = []


def capture_overrides():
    """The config overrides in force in this thread, every family's (None without any), for a
    backward to restore: autograd runs a CUDA backward on its own device thread, where the
    thread-local overrides of the forward's thread are not set."""
    if not _held:  # no override scope is active in any thread
        return None
    return [(o, o.state.value) for o in OVERRIDE_SCOPES if o.state.value] or None


def restored_overrides(captured):
    """A context with the overrides of :func:`capture_overrides` in force again."""
    if not captured:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for o, value in captured:
        stack.enter_context(o.scope(**value))
    return stack


def _lib(ns: str) -> torch.library.Library:
    lib = _LIBS.get(ns)
    if lib is None:
        lib = _LIBS[ns] = torch.library.Library(ns, "FRAGMENT")
    return lib


class Op:
    """A functional op registered with the low-level torch.library API. Calling it runs
    ``torch.ops.<ns>.<name>.default`` (below autograd when no input needs a gradient)."""

    def __init__(self, qualname: str, fn: Callable, plans: bool = False):
        ns, name = qualname.split("::")
        self._qualname = qualname
        self._lib = _lib(ns)
        schema = torch.library.infer_schema(fn, mutates_args=())
        self._lib.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
        self._lib.impl(name, fn, "CompositeExplicitAutograd")
        self.overload = overload = getattr(getattr(torch.ops, ns), name).default
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        #: schema positions of the tensor arguments (the plans' inputs, in this order)
        self.tensor_args = tuple(i for i, a in enumerate(overload._schema.arguments)
                                 if str(a.type) in ("Tensor", "Optional[Tensor]"))
        #: the eager plans of this op's calls (``plans=True``), keyed as _plan.serve_op keys
        self.plans: dict | None = {} if plans else None
        #: the implementation (the op's CompositeExplicitAutograd kernel)
        self.impl = fn

        def no_formula(ctx, *grads):
            raise RuntimeError(f"Trying to backward through {qualname}, which has no "
                               "autograd formula")

        self._function = self._make_function(lambda ctx, inputs, output: None, no_formula)
        after = torch._C._after_autograd_keyset

        def autograd_kernel(keyset, *args):
            if _grad_enabled() and _any_requires_grad(*args):
                return self._function.apply(*args)
            if not _modes() and _plain(args):
                # below autograd a plain tensor's next kernel is the backend's, which is
                # ``fn``: called here without the redispatch through the dispatcher
                with _below_autograd():
                    return fn(*args)
            return overload.redispatch(keyset & after, *args)

        self._lib.impl(name, autograd_kernel, "Autograd", with_keyset=True)
        if plans:
            PLAN_OPS.append(self)
            for f in on_plan_op:
                f(self)

    def grad_apply(self, *args):
        """The autograd path of a call (what the C++ kernel calls when a gradient is needed)."""
        return self._function.apply(*args)

    def _make_function(self, setup_context: Callable, backward: Callable):
        overload = self.overload

        def forward(*args):
            with _below_autograd():
                return overload(*args)

        def setup(ctx, inputs, output):
            setup_context(ctx, inputs, output)
            ctx.tkit_overrides = capture_overrides()

        def backward_with_overrides(ctx, *grads):
            # the forward's config overrides, on autograd's thread too
            with restored_overrides(ctx.tkit_overrides):
                return backward(ctx, *grads)

        return type("Backward_" + self._qualname.replace("::", "_"), (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "setup_context": staticmethod(setup),
                     "backward": staticmethod(backward_with_overrides)})

    def register_fake(self, fn: Callable) -> Callable:
        torch.library.register_fake(self._qualname, fn, lib=self._lib)
        return fn

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        """``backward(ctx, *grads)`` and ``setup_context(ctx, inputs, output)`` as for
        ``torch.library.register_autograd``."""
        self._function = self._make_function(setup_context, backward)

    def __call__(self, *args):
        if _compiling():  # traced: dynamo reads the op and its autograd kernel
            return self.overload(*args)
        if _grad_enabled() and _any_requires_grad(*args):
            return self._function.apply(*args)
        with _below_autograd():
            return self.overload(*args)


def custom_op(qualname: str, *, mutates_args: Sequence[str] | str = (),
              plans: bool = False) -> Callable:
    """Decorator: register ``fn`` as ``qualname`` (``"tkit::name"``). Functional ops become an
    :class:`Op` (``plans``: it serves eager plans through ``_plan.serve_op``); ops that mutate
    arguments a ``torch.library.custom_op``."""
    if mutates_args:
        if plans:
            raise ValueError("plans=True is for functional ops")
        return torch.library.custom_op(qualname, mutates_args=mutates_args)

    def wrap(fn: Callable) -> Op:
        return Op(qualname, fn, plans)

    return wrap
