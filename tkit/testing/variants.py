"""Kernel variants compiled while fuzzing, counted through Triton's JIT hooks; and a bound on them.

Triton compiles a kernel once for every new combination of its specialization key: the dtypes,
the constexpr arguments, and for each integer argument whether it is 1 or a multiple of 16 (and
for each pointer whether it is 16-byte aligned). Shapes drawn at random change that key often,
and on a GPU a compile costs about a second (several for attention), against a few milliseconds
for everything else an example does: a fuzz campaign is then mostly compiles. :class:`Variants`
counts the compiles (``jit_cache_hook`` runs before one, ``jit_post_compile_hook`` after) and,
once a compile budget (seconds or a count) is spent, refuses the next new variant by raising
:class:`NewVariant` from the hook, before anything compiles or launches: fuzz turns that into a
rejected example (``hypothesis.reject``), so later examples run on the variants already compiled.

Under Triton's interpreter nothing compiles and the hooks never run: the counts stay 0.
"""

from __future__ import annotations

import time

#: in NewVariant's message, so that one wrapped in another exception is still recognised
MARKER = "[tkit: compile budget spent]"


class NewVariant(BaseException):
    """Raised in Triton's compile hook when the compile budget is spent and a launch would
    compile a new variant. A BaseException, so that a wrapper's ``except Exception`` fallback
    does not swallow it (and compile another kernel instead)."""


def is_new_variant(e: BaseException) -> bool:
    """``e`` is a :class:`NewVariant`, or carries one (re-raised under another type, as a
    C++ layer may do)."""
    return isinstance(e, NewVariant) or MARKER in str(e) or (
        e.__cause__ is not None and is_new_variant(e.__cause__))


class Variants:
    """While installed (``with Variants(...) as v:``): ``compiles`` (including loads from
    Triton's on-disk cache, which also miss the in-memory one), ``compile_s``, ``keys`` (one
    per kernel and specialization), ``refused``. ``budget_s`` / ``max_variants``: after either
    is reached, a new variant raises :class:`NewVariant` while ``bounded`` is True (fuzz turns
    it off once an example has failed, so that shrinking may compile what it needs)."""

    def __init__(self, budget_s: float | None = None, max_variants: int | None = None):
        self.budget_s, self.max_variants = budget_s, max_variants
        self.compiles = 0
        self.compile_s = 0.0
        self.keys: set = set()
        self.refused = 0
        self.bounded = True
        self._t0: dict = {}
        self._saved = None

    @property
    def spent(self) -> bool:
        """Whether the budget is used up (new variants are refused while ``bounded``)."""
        if self.budget_s is not None and self.compile_s >= self.budget_s:
            return True
        return self.max_variants is not None and len(self.keys) >= self.max_variants

    # ---- the hooks (Triton calls them with keyword arguments) ------------------------------
    def before_compile(self, *, key, fn=None, **_):
        if self.bounded and self.spent:
            self.refused += 1
            raise NewVariant(f"{MARKER} {self.describe()}")
        self._t0[self._name(fn, key)] = time.perf_counter()
        return None  # falsy: Triton goes on and compiles

    def after_compile(self, *, key, fn=None, **_):
        name = self._name(fn, key)
        t0 = self._t0.pop(name, None)
        if t0 is not None:
            self.compile_s += time.perf_counter() - t0
        self.compiles += 1
        self.keys.add(name)
        return None

    @staticmethod
    def _name(fn, key) -> tuple:
        return (getattr(fn, "name", None) or repr(fn), str(key))

    def describe(self) -> str:
        return (f"{self.compiles} compiles ({len(self.keys)} variants) in {self.compile_s:.1f} s"
                f" (budget {self.budget_s} s, {self.max_variants} variants)")

    def as_row(self) -> dict:
        return {"compiles": self.compiles, "variants": len(self.keys),
                "compile_s": round(self.compile_s, 2), "refused_new_variant": self.refused}

    # ---- installing -----------------------------------------------------------------------
    def __enter__(self) -> Variants:
        try:
            from triton import knobs
        except ImportError:  # a Triton without knobs: counts stay 0, nothing is bounded
            return self
        rt = knobs.runtime
        self._saved = (rt.jit_cache_hook, rt.jit_post_compile_hook)
        before, after = self._saved

        def pre(**kw):
            self.before_compile(**kw)
            return before(**kw) if before is not None else None

        def post(**kw):
            self.after_compile(**kw)
            return after(**kw) if after is not None else None

        rt.jit_cache_hook, rt.jit_post_compile_hook = pre, post
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is not None:
            from triton import knobs

            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._saved
            self._saved = None


def same_class_sizes(d: int) -> tuple:
    """Sizes that likely compile like ``d`` in the kernels tkit writes (a size that does not
    is refused by the compile hook, at the cost of one rejected example). Above 32: the same
    remainder modulo 16 (so sizes, strides and their products keep their ``% 16``
    specialization and pointer offsets their alignment) and the same next power of two (block
    sizes derived from it). From 3 to 32: the same next power of two and the same ``% 16``
    (5 -> 5..7, 17 -> 17..31). 0, 1 and 2 stand for themselves."""
    if d <= 2:
        return (d,)
    k = (d - 1).bit_length()
    lo, hi = (1 << (k - 1)) + 1, 1 << k
    if d <= 32:
        return tuple(x for x in range(lo, hi + 1) if (x % 16 == 0) == (d % 16 == 0))
    first = lo + (d - lo) % 16
    return tuple(range(first, hi + 1, 16))
