"""conftest.py's interpreter speed-up: triton.language is patched once per launch (and once
more per launch for a helper whose module reaches ``triton.language.core``), not at every
helper call; kernels built from helpers compute what they did, and a launch restores the
language as Triton's own patching does."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter only")


@triton.jit
def _twice(x):
    return x + x


@triton.jit
def _helpers_kernel(X, OUT, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(X + i)
    y = _twice(_twice(x))  # helpers of this module: covered by the launch's patches
    tl.store(OUT + i, y)
    tl.store(OUT + N, tl.sum(y, axis=0))  # tl.sum: a helper of triton.language.core's module
    tl.store(OUT + N + 1, tl.max(_twice(y), axis=0))


def test_patched_once_per_launch(monkeypatch):
    from triton.runtime import interpreter as interp

    patch = interp._patch_lang
    assert hasattr(patch, "triton_patch_lang"), "conftest's speed-up is not installed"
    calls = []
    original = patch.triton_patch_lang

    def counting(fn):
        calls.append(fn.__name__)
        return original(fn)

    monkeypatch.setattr(patch, "triton_patch_lang", counting)
    x = torch.arange(8, dtype=torch.float32)
    out = torch.full((10,), float("nan"))
    before = tl.tensor.__add__
    core_before = {name: getattr(tl.core, name) for name in ("add", "where", "full", "reduce")}
    for _ in range(2):
        calls.clear()
        _helpers_kernel[(3,)](x, out, N=8)
        # one patch for the launch and one for the first helper of triton.language.core's
        # module, whatever the number of programs and helper calls
        assert len(calls) == 2, calls
    assert torch.equal(out[:8], 4 * x) and out[8] == 4 * x.sum() and out[9] == 8 * x.max()
    assert tl.tensor.__add__ is before, "the launch left triton.language patched"
    # the helper of triton.language.core's module patched that module's builtins: undone too
    # (left in place, they turned a later ahead-of-time compile's tensor.__add__ into the
    # interpreter's)
    for name, fn in core_before.items():
        assert getattr(tl.core, name) is fn, f"triton.language.core.{name} left patched"


def test_numpy_dtypes_are_triton_answers():
    from triton.runtime import interpreter as interp

    get = interp._get_np_dtype
    original = get.triton_get_np_dtype
    scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64,
               tl.uint64, tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.float8e5,
               tl.float8e4nv, tl.pointer_type(tl.float32)]
    for ty in scalars:
        for t in (ty, tl.block_type(ty, [4]), tl.block_type(ty, [2, 8])):
            assert get(t) == original(t), t
            assert get(t) == original(t), t  # cached
    with pytest.raises(KeyError):
        get(tl.void)
