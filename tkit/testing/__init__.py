"""Testing tools for tkit ops and for Triton kernels of your own.

* :func:`fuzz` property-tests a function against a PyTorch reference over hypothesis-drawn
  shapes, dtypes and layouts, with outputs poisoned, and shrinks a failure to a reproducer; a
  kernel that crashes its process is reported as a failure too (``KernelCrashed``).
* :func:`assert_close_to_reference` is the comparison rule (kernel error <= 2x the error of PyTorch
  in the same precision + one unit of rounding).
* :func:`check_spec` and :func:`fuzz_spec` run a registered op's check cases and fuzz recipe.
* :func:`make_tensor` builds random inputs in any layout; :mod:`tkit.testing.strategies` has the
  hypothesis strategies; :func:`poisoned_outputs` NaN-fills every output tkit allocates.
"""

from tkit.kernels._common import poisoned_outputs
from tkit.testing.compare import (
    ReferenceMismatch,
    assert_close_to_reference,
    eps,
    max_error,
)
from tkit.testing.fuzz import FuzzStats, KernelCrashed, check_against_reference, fuzz
from tkit.testing.specs import check_spec, fuzz_spec
from tkit.testing.tensors import LAYOUTS, default_device, make_tensor

__all__ = [
    "LAYOUTS",
    "FuzzStats",
    "KernelCrashed",
    "ReferenceMismatch",
    "assert_close_to_reference",
    "check_against_reference",
    "check_spec",
    "default_device",
    "eps",
    "fuzz",
    "fuzz_spec",
    "make_tensor",
    "max_error",
    "opcheck",
    "poisoned_outputs",
    "strategies",
]



def __getattr__(name: str):
    # the strategies need hypothesis, a test dependency: imported on first use, so that
    # check_against_reference and make_tensor (which tkit bench uses) need only the runtime ones
    if name == "strategies":
        import importlib

        return importlib.import_module("tkit.testing.strategies")
    raise AttributeError(f"module 'tkit.testing' has no attribute {name!r}")


def opcheck(op, args, kwargs=None, **opts):
    """``torch.library.opcheck`` on a tkit op (schema, fake tensor, autograd registration)."""
    import torch

    return torch.library.opcheck(op, args, kwargs or {}, **opts)
