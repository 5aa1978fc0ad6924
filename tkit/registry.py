"""One spec per op: the spine that bench, ir, tests and the CLI all read.

A spec ties together the public function, a PyTorch reference (called on float64 copies for the
reference and on the inputs themselves for the same-precision peer), the cost model, input
builders at benchmark sizes and at interpreter sizes, the fuzzing recipe, and the baselines.
Specs live in ``tkit/specs/<family>.py`` (a ``SPECS`` list each); adding an op means adding its
kernel module and one spec there.
"""

from __future__ import annotations

import difflib
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tkit._cost import Cost, unique_bytes  # noqa: F401  (the specs read them here)

#: Spec modules, in the order a reader learns the families.
SPEC_MODULES = (
    "tkit.specs.elementwise",
    "tkit.specs.reductions",
    "tkit.specs.matmul",
    "tkit.specs.int4",
    "tkit.specs.attention",
    "tkit.specs.decode_attention",
    "tkit.specs.inference",
    "tkit.specs.moe",
    "tkit.specs.losses",
    "tkit.specs.sampling",
    "tkit.specs.cuda_ext",
    "tkit.specs.model",
    "tkit.specs.fuse",
)


@dataclass
class Case:
    """One input configuration: ``make(device)`` returns ``(args, kwargs)`` for the op."""

    label: str
    make: Callable[[str], tuple[tuple, dict]]
    group: str = "default"  # e.g. contiguous / strided / broadcast: reports group by it
    meta: dict = field(default_factory=dict)


@dataclass
class OpSpec:
    name: str
    family: str
    fn: Callable
    reference: Callable
    cost: Callable[..., Cost]
    bench_cases: Callable[[], list[Case]]
    check_cases: Callable[[], list[Case]]
    fuzz: Callable[[], dict]  # keyword arguments for tkit.testing.fuzz
    baselines: dict[str, Callable[[], Callable | None]] = field(default_factory=dict)
    opcheck: Callable[[], tuple[Any, tuple, dict]] | None = None  # (op, args, kwargs) on CPU/GPU
    bound: str = "memory"  # which ceiling the roofline percentage is taken against
    doc: str = ""
    #: why ``check_cases()`` is empty on a machine without a GPU (``tkit bench`` says so)
    no_check_reason: str = ""
    #: units of rounding in the comparison floor (see tkit.testing.compare)
    ulps: float = 1.0

    def available_baselines(self) -> dict[str, Callable]:
        out = {}
        for name, factory in self.baselines.items():
            fn = factory()
            if fn is not None:
                out[name] = fn
        return out


_SPECS: dict[str, OpSpec] | None = None


def _load() -> dict[str, OpSpec]:
    global _SPECS
    if _SPECS is None:
        specs: dict[str, OpSpec] = {}
        for mod in SPEC_MODULES:
            try:
                module = importlib.import_module(mod)
            except ModuleNotFoundError as e:
                if e.name == mod:  # a family not written yet; any other missing import is a bug
                    continue
                raise
            for spec in module.SPECS:
                if spec.name in specs:
                    raise RuntimeError(f"two specs named {spec.name!r}")
                specs[spec.name] = spec
        _SPECS = specs
    return _SPECS


def all_specs() -> list[OpSpec]:
    return list(_load().values())


def names() -> list[str]:
    return list(_load())


def get(name_or_fn) -> OpSpec:
    """The spec of an op, by name (``"rms_norm"``) or by its public function (``tkit.rms_norm``)."""
    specs = _load()
    if callable(name_or_fn) and not isinstance(name_or_fn, str):
        for spec in specs.values():
            if spec.fn is name_or_fn:
                return spec
        raise KeyError(f"{getattr(name_or_fn, '__name__', name_or_fn)!r} is not a tkit op")
    if name_or_fn not in specs:
        close = [n for n in specs if name_or_fn in n or n in name_or_fn]
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise KeyError(f"unknown op {name_or_fn!r}{hint} (known: {', '.join(specs)})")
    return specs[name_or_fn]


def suggest(word: str, choices) -> str:
    """"; did you mean X?" for the choices closest to a mistyped ``word`` (empty if none)."""
    choices = list(dict.fromkeys(choices))
    close = difflib.get_close_matches(word, choices, n=3, cutoff=0.6)
    close += [c for c in choices if c not in close and (word in c or c in word)][:3 - len(close)]
    return f"; did you mean {', '.join(close)}?" if close else ""


def select(patterns: list[str] | None) -> list[OpSpec]:
    """Specs whose name or family matches one of ``patterns`` (all when empty)."""
    specs = all_specs()
    if not patterns:
        return specs
    out = [s for s in specs if any(p == s.name or p == s.family for p in patterns)]
    known = [s.name for s in specs] + [s.family for s in specs]
    unknown = [p for p in patterns if p not in known]
    if unknown:
        hints = "".join(f"\n  {p!r}{suggest(p, known)}" for p in unknown)
        families = ", ".join(dict.fromkeys(s.family for s in specs))
        raise KeyError(f"unknown op or family:{hints}\n(ops: {', '.join(names())}; "
                       f"families: {families})")
    return out


# ---- helpers the spec modules share -------------------------------------------------------
class optional_module:
    """A module imported on first attribute access. Spec modules reach hypothesis through it:
    the CLI (``tkit info``, ``tkit bench``, ``tkit ir``) imports every spec but needs only the
    runtime dependencies, and hypothesis is a test dependency used where fuzzing happens."""

    def __init__(self, name: str, extra: str = "test"):
        self._name, self._extra = name, extra

    def __getattr__(self, attr):
        try:
            module = importlib.import_module(self._name)
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError(
                f"{self._name} is needed here (pip install 'tkit[{self._extra}]')",
                name=e.name) from e
        return getattr(module, attr)


def lazy_composite(fn: Callable) -> Callable:
    """``@hypothesis.strategies.composite``, applied when the strategy is first asked for
    instead of when the spec module is imported."""

    @functools.wraps(fn)
    def strategy(*args, **kwargs):
        from hypothesis import strategies as st

        return st.composite(fn)(*args, **kwargs)

    return strategy


def torch_compile_baseline(fn: Callable) -> Callable[[], Callable | None]:
    """A baseline factory: ``torch.compile(fn)``, built on first use."""

    def factory():
        if not torch.cuda.is_available():
            return None
        # Benchmarks see many shapes and layouts of one reference (and references built by one
        # closure share a code object): past dynamo's default limit of 8 recompiles it would
        # silently run eager, and the baseline would be torch eager under another name.
        import torch._dynamo as dynamo

        dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 1024)
        dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, 1024)
        return torch.compile(fn, dynamic=False)

    return factory


def eager_baseline(fn: Callable) -> Callable[[], Callable]:
    return lambda: fn
