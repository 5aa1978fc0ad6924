"""NaN through fp8: ``tkit.cast`` to float8_e4m3fn and ``tkit.matmul_fp8`` propagate NaN as torch
does, in the interpreter (whose fp8 conversions know no NaN) and on the GPU."""

import pytest
import torch

import tkit

F8 = torch.float8_e4m3fn
SPECIALS = [float("nan"), -float("nan"), float("inf"), -float("inf"), 500.0, -500.0, 1.999,
            0.3, -0.0011, 0.0]


def _torch_cast(x, scale):
    y = x.float() / scale if scale is not None else x.float()
    return y.clamp(-448, 448).to(F8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("scaled", [False, True])
def test_cast_to_fp8_keeps_nan(dtype, layout, scaled, device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 24, generator=g) * 100
    x.view(-1)[: len(SPECIALS)] = torch.tensor(SPECIALS)
    x.view(-1)[-len(SPECIALS):] = torch.tensor(SPECIALS)
    x = x.to(dtype).to(device)
    if layout == "transposed":  # the strided kernel
        x = x.T
    scale = torch.tensor([0.5], device=device) if scaled else None
    got = tkit.cast(x, F8, scale).cpu()
    want = _torch_cast(x.cpu(), scale.cpu() if scaled else None)
    nan = want.float().isnan()
    assert nan.sum() == 4
    assert torch.equal(got.float().isnan(), nan), "NaN must stay NaN (and only NaN)"
    # every other value bit for bit, saturation included
    assert torch.equal(got.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan])


def test_matmul_fp8_propagates_nan(device):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(33, 64, generator=g).to(F8)
    b = torch.randn(40, 64, generator=g).to(F8).T  # the column-major (nn.Linear) layout
    a[3, 5] = float("nan")  # row 3 of the output is NaN
    bt = b.T.clone()
    bt[7, 9] = float("nan")  # column 7 of the output is NaN
    b = bt.T
    sa, sb = torch.tensor([0.5]), torch.tensor([2.0])
    out = tkit.matmul_fp8(a.to(device), b.to(device), sa.to(device), sb.to(device)).cpu()
    nan = torch.zeros(33, 40, dtype=torch.bool)
    nan[3, :] = True
    nan[:, 7] = True
    assert torch.equal(out.float().isnan(), nan)
    ref = (a.double() @ b.double()) * 0.5 * 2.0
    torch.testing.assert_close(out.double()[~nan], ref[~nan], rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_fp8_nan_matches_scaled_mm():
    """On the GPU, against torch._scaled_mm on the same NaN-holding operands (TMA path)."""
    a = torch.randn(256, 512, device="cuda").to(F8)
    b = torch.randn(384, 512, device="cuda").to(F8).t()
    a[17, 100] = float("nan")
    sa, sb = torch.tensor([0.7], device="cuda"), torch.tensor([0.3], device="cuda")
    got = tkit.matmul_fp8(a, b, sa, sb)
    want = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    assert torch.equal(got.isnan(), want.isnan())
    assert bool(got[17].isnan().all())
