"""Every bench case and check case of every registered spec builds inputs its op accepts.

Bench cases are benchmark-size (GEMMs of 8192^3, attention over 16K tokens): they are built on
the CPU without drawing values (``without_values``: uninitialized memory the op never reads
here) and the op runs under ``capture_launches``, which validates and plans every launch but
runs none. Offset tensors are built with their real values and checked: start at 0, never
decrease, end at the packed rows; sequence lengths of varlen attention are all >= 1.
"""

from __future__ import annotations

import pytest
import torch

from tkit import registry
from tkit.kernels._common import capture_launches
from tkit.testing.tensors import without_values

CASES = [(spec.name, kind, i, case.label)
         for spec in registry.all_specs()
         for kind in ("bench", "check")
         for i, case in enumerate(getattr(spec, f"{kind}_cases")())]


def _offsets(args):
    """The 1-D integer tensors among the arguments (cu_seqlens, group offsets)."""
    return [a for a in args if isinstance(a, torch.Tensor) and a.ndim == 1
            and not a.dtype.is_floating_point]


def _check_inputs(spec, args, kwargs):
    rows = next(a for a in args if isinstance(a, torch.Tensor)).shape[0]
    for offs in _offsets(args):
        o = offs.tolist()
        assert len(o) >= 2 and o[0] == 0, f"offsets must start at 0: {o}"
        lengths = [b - a for a, b in zip(o, o[1:])]
        assert min(lengths) >= 0, f"offsets decrease: lengths {lengths}"
        assert o[-1] == rows, f"offsets end at {o[-1]}, the inputs have {rows} rows"
    if spec.name == "flash_attention_varlen":
        q, k, v, cu_q, cu_k, max_q, max_k = args
        for cu, m in ((cu_q, max_q), (cu_k, max_k)):
            lengths = cu.diff().tolist()
            assert min(lengths) >= 1, f"sequence lengths must be >= 1: {lengths}"
            assert m == max(lengths), f"max_seqlen {m} but the longest sequence is {max(lengths)}"
    cost = spec.cost(*args, **kwargs)
    assert cost.bytes > 0


@pytest.mark.parametrize("name,kind,index,label", CASES,
                         ids=[f"{n}-{k}{i}" for n, k, i, _ in CASES])
def test_case_builds_inputs_the_op_accepts(name, kind, index, label):
    spec = registry.get(name)
    case = getattr(spec, f"{kind}_cases")()[index]
    with without_values():
        args, kwargs = case.make("cpu")
    _check_inputs(spec, args, kwargs)
    if spec.family == "cuda_ext" and not torch.cuda.is_available():
        pytest.skip("inputs checked; the CUDA escape hatches reject CPU tensors before "
                    "looking at shapes (tests/cuda_ext checks them on a GPU)")
    with capture_launches() as launches:
        spec.fn(*args, **kwargs)
    assert launches, f"{name} {label}: no kernel launch planned"


def test_varlen_lengths_are_checked_when_the_case_is_built():
    from tkit.specs.attention import _varlen_case

    with pytest.raises(ValueError, match="lengths must all be >= 1"):
        _varlen_case([5, -1], 2, 2, 64)
    with pytest.raises(ValueError, match="total=16"):
        _varlen_case([5, 10], 2, 2, 64, total=16)
