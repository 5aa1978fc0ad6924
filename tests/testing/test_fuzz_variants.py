"""fuzz's bound on compiled kernel variants and its accounting of where time goes, on a CPU.

Triton's interpreter compiles nothing, so a stand-in "kernel" calls Triton's compile hooks as
JITFunction.run does on a GPU: ``jit_cache_hook`` before compiling a new specialization key,
``jit_post_compile_hook`` after. Its key is what Triton's would be for an elementwise kernel:
the dtype, and whether the element count is 1 or a multiple of 16.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st
from triton import knobs

from tkit.testing import FuzzStats, ReferenceMismatch, fuzz
from tkit.testing.variants import NewVariant, Variants, same_class_sizes

COMPILED: set = set()
SEEN_BY_REFERENCE: list = []


class _Info:
    name = "stand_in_kernel"


def _launch(x: torch.Tensor) -> None:
    n = x.numel()
    key = (str(x.dtype), n == 1, n % 16 == 0)
    if key in COMPILED:
        return
    rt = knobs.runtime
    if rt.jit_cache_hook is not None:
        rt.jit_cache_hook(key=key, fn=_Info(), repr="", compile={}, is_manual_warmup=False,
                          already_compiled=False)
    COMPILED.add(key)
    if rt.jit_post_compile_hook is not None:
        rt.jit_post_compile_hook(key=key, fn=_Info(), repr="", compile={},
                                 is_manual_warmup=False, already_compiled=False)


def double(x):
    _launch(x)
    return x * 2


def double_wrong_past_200(x):
    _launch(x)
    return x * 2 + (1.0 if x.numel() > 200 else 0.0)


def double_ref(x):
    SEEN_BY_REFERENCE.append((x.dtype, x.device))
    return x * 2


def sizes():
    return st.integers(1, 400).map(lambda n: ((n,),))


@pytest.fixture(autouse=True)
def _fresh():
    COMPILED.clear()
    SEEN_BY_REFERENCE.clear()
    yield
    assert knobs.runtime.jit_cache_hook is None  # fuzz put Triton's hooks back


def test_same_class_sizes_keep_the_specialization():
    assert same_class_sizes(1) == (1,) and same_class_sizes(2) == (2,)
    assert same_class_sizes(7) == (5, 6, 7, 8) and same_class_sizes(32) == (32,)
    assert same_class_sizes(17) == tuple(range(17, 32)) and same_class_sizes(3) == (3, 4)
    assert same_class_sizes(100) == (68, 84, 100, 116)
    for d in (33, 64, 65, 100, 128, 1000, 2999):
        got = list(same_class_sizes(d))
        assert d in got and len(got) > 1
        assert all(s % 16 == d % 16 and (s - 1).bit_length() == (d - 1).bit_length()
                   for s in got)


def test_compiles_are_counted_without_a_bound():
    stats = fuzz(double, double_ref, shapes=sizes(), dtypes=(torch.float32, torch.float16),
                 max_examples=40, isolate=False)
    v = stats.variants
    assert v.compiles == len(COMPILED) == len(v.keys) > 1 and v.refused == 0
    assert stats.examples == 40 and stats.rejected == 0 and stats.replayed == 0


def test_the_bound_refuses_new_variants_and_replays_compiled_ones():
    stats = fuzz(double, double_ref, shapes=sizes(), dtypes=(torch.float32, torch.float16),
                 max_examples=80, isolate=False, max_variants=2)
    v = stats.variants
    assert len(v.keys) == 2 == len(COMPILED)  # nothing past the bound compiled
    assert stats.examples == 80 and stats.failed == 0
    assert stats.rejected == v.refused > 0
    assert stats.replayed > 0  # examples keep coming on the compiled variants
    row = stats.as_row()
    assert row["variants"] == 2 and row["rejected_new_variant"] == stats.rejected
    assert row["examples"] == 80 and row["replayed"] == stats.replayed


def test_a_failure_lifts_the_bound_so_that_shrinking_finds_the_smallest():
    stats = FuzzStats()
    with pytest.raises(ReferenceMismatch) as info:
        fuzz(double_wrong_past_200, double_ref, shapes=sizes(), max_examples=200,
             isolate=False, max_variants=2, stats=stats)
    assert "make_tensor((201,)" in str(info.value)
    assert not stats.variants.bounded  # shrinking was free to compile


def test_where_the_time_went_and_where_the_reference_ran():
    stats = FuzzStats()
    fuzz(double, double_ref, shapes=sizes(), max_examples=5, isolate=False, stats=stats)
    assert set(stats.times) == {"make", "fn", "reference", "compare"}
    assert 0 < sum(stats.times.values()) <= stats.seconds
    row = stats.as_row()
    assert {"make_s", "fn_s", "reference_s", "compare_s", "compiles", "compile_s"} <= set(row)
    # the float64 reference ran on the inputs' device (the GPU on a GPU), next to the peer
    assert (torch.float64, torch.device("cpu")) in SEEN_BY_REFERENCE
    assert {d for _, d in SEEN_BY_REFERENCE} == {torch.device("cpu")}


def test_the_hook_raises_past_the_budget_and_not_while_unbounded():
    v = Variants(max_variants=1)
    with v:
        knobs.runtime.jit_cache_hook(key="a", fn=_Info())
        knobs.runtime.jit_post_compile_hook(key="a", fn=_Info())
        with pytest.raises(NewVariant):
            knobs.runtime.jit_cache_hook(key="b", fn=_Info())
        v.bounded = False
        knobs.runtime.jit_cache_hook(key="b", fn=_Info())
    assert v.as_row()["variants"] == 1 and v.refused == 1
    assert Variants(budget_s=0.0).spent and not Variants().spent
