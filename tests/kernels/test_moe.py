"""The MoE family: router top-k, the alignment by expert, the combine and the whole MoE MLP,
against torch under the reference rule (values and gradients), the tie rule, bad inputs, and
the registered ops (opcheck, torch.compile)."""

from __future__ import annotations

import pytest
import torch

import tkit
from tkit.specs import moe as S
from tkit.testing import check_against_reference, check_spec, fuzz_spec, opcheck
from tkit.testing.tensors import default_device, make_tensor

ON_GPU = torch.cuda.is_available()
NAMES = ("moe_route", "moe_combine", "moe")


def _dev():
    return default_device()


@pytest.mark.parametrize("name", NAMES)
def test_check_cases(name):
    assert check_spec(name) > 0


@pytest.mark.parametrize("name", NAMES)
def test_fuzz(name):
    fuzz_spec(name, max_examples=None if ON_GPU else 15)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_gradient(scoring, renormalize):
    z = make_tensor((19, 7), torch.float32, seed=3, device=_dev(), scale=2.0)

    def weights(fn):
        return lambda z: fn(z, 3, renormalize=renormalize, scoring=scoring)[0]

    check_against_reference(weights(tkit.moe_route), weights(S.ref_moe_route), [z], grad=True)


def test_route_ties_go_to_the_lower_index():
    z = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]], device=_dev())
    w, ids = tkit.moe_route(z, 3)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    torch.testing.assert_close(w, torch.full((2, 3), 1 / 3, device=_dev()))


def test_route_nan_row_keeps_ids_in_range():
    z = torch.randn(4, 6, device=_dev())
    z[2] = float("nan")
    w, ids = tkit.moe_route(z, 2)
    assert int(ids.min()) >= 0 and int(ids.max()) < 6
    assert torch.isnan(w[2]).all() and torch.isfinite(w[[0, 1, 3]]).all()


def test_no_tokens():
    x, z, wgu, wd, k = S._moe_inputs(0, 4, 2, 32, 16, torch.float32, _dev())
    w, ids = tkit.moe_route(z, k)
    assert w.shape == (0, 2) and ids.shape == (0, 2)
    assert tkit.moe(x, z, wgu, wd, k).shape == (0, 32)


def test_align_groups_by_expert_stably():
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 5, (23, 3), generator=gen).to(_dev())
    order, inv, offsets = tkit.moe_align(ids, 6)
    flat = ids.reshape(-1)
    assert torch.equal(order[inv.reshape(-1)], torch.arange(69, device=_dev()))
    e = flat[order]
    assert bool((e[1:] >= e[:-1]).all())
    for g in range(6):  # within an expert, choices in their original order
        rows = order[offsets[g]:offsets[g + 1]]
        assert bool((flat[rows] == g).all()) and bool((rows[1:] > rows[:-1]).all())
    assert offsets.tolist() == [0] + torch.bincount(flat.cpu(), minlength=6).cumsum(0).tolist()


def test_combine_clamps_rows_outside_y():
    y = make_tensor((6, 16), torch.float32, seed=5, device=_dev())
    w = torch.ones((2, 2), device=_dev())
    inv = torch.tensor([[0, 99], [-7, 5]], device=_dev())
    out = tkit.moe_combine(y, w, inv)
    torch.testing.assert_close(out, torch.stack([y[0] + y[5], y[0] + y[5]]))


def test_moe_gradients():
    args = S._moe_inputs(13, 5, 2, 32, 16, torch.float32, _dev(), seed=6)
    check_against_reference(tkit.moe, S.ref_moe, list(args[:4]) + [args[4]], grad=True)


def test_moe_equals_the_grouped_torch_pipeline():
    # the same routing, alignment and combine written with torch ops (GEMMs by a loop here)
    x, z, wgu, wd, k = S._moe_inputs(29, 6, 2, 48, 24, torch.float32, _dev(), seed=7)
    torch.testing.assert_close(tkit.moe(x, z, wgu, wd, k), S.ref_moe(x, z, wgu, wd, k),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bad, match", [
    (dict(top_k=0), "top_k"), (dict(top_k=7), "top_k"), (dict(scoring="relu"), "scoring"),
    (dict(z_rows=5), "router_logits has 5 rows"), (dict(wd_shape=(6, 48, 20)), "w_down"),
    (dict(w_dtype=torch.float16), "w_gate_up has dtype"),
])
def test_moe_bad_inputs_name_the_argument(bad, match):
    x, z, wgu, wd, k = S._moe_inputs(9, 6, 2, 48, 24, torch.float32, _dev(), seed=8)
    if "z_rows" in bad:
        z = z[:bad["z_rows"]]
    if "wd_shape" in bad:
        wd = torch.zeros(bad["wd_shape"], device=_dev())
    if "w_dtype" in bad:
        wgu = wgu.to(bad["w_dtype"])
    kw = {key: bad[key] for key in ("scoring",) if key in bad}
    with pytest.raises((ValueError, TypeError), match=match):
        tkit.moe(x, z, wgu, wd, bad.get("top_k", k), **kw)


def test_opcheck():
    z = make_tensor((7, 5), torch.float32, seed=9, device=_dev())
    opcheck(torch.ops.tkit.moe_route.default, (z.requires_grad_(), 2, True, False))
    y = make_tensor((12, 16), torch.float32, seed=10, device=_dev()).requires_grad_()
    w = torch.rand((4, 3), device=_dev()).requires_grad_()
    inv = torch.randperm(12).view(4, 3).to(_dev())
    opcheck(torch.ops.tkit.moe_combine.default, (y, w, inv))


def test_torch_compile_fullgraph():
    x, z, wgu, wd, k = S._moe_inputs(11, 4, 2, 32, 16, torch.float32, _dev(), seed=11)
    f = torch.compile(tkit.moe, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    torch.testing.assert_close(f(x, z, wgu, wd, k), tkit.moe(x, z, wgu, wd, k))
