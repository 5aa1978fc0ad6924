"""A registered op's own checks: its check cases under the reference rule
(:func:`check_spec`) and its fuzz recipe (:func:`fuzz_spec`), as its tests run them."""

from __future__ import annotations

from tkit.testing.fuzz import FuzzStats, check_against_reference, fuzz
from tkit.testing.tensors import default_device


def check_spec(name: str, device=None) -> int:
    """Every check case of the registered op ``name`` against its reference (the spec's
    ``ulps``); returns how many ran. A mismatch raises ``ReferenceMismatch``."""
    from tkit import registry

    spec = registry.get(name)
    cases = spec.check_cases()
    for case in cases:
        args, kwargs = case.make(device or default_device())
        check_against_reference(spec.fn, spec.reference, args, kwargs, ulps=spec.ulps)
    return len(cases)


def fuzz_spec(name: str, max_examples: int | None = None, **overrides) -> FuzzStats:
    """The registered op ``name``'s fuzz recipe (its own ``fn`` and ``reference`` where the
    recipe names them), ``overrides`` replacing recipe entries."""
    from tkit import registry

    spec = registry.get(name)
    recipe = {**spec.fuzz(), **overrides}
    fn, ref = recipe.pop("fn", spec.fn), recipe.pop("reference", spec.reference)
    return fuzz(fn, ref, **recipe, max_examples=max_examples)
