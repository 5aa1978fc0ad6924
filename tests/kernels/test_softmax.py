"""Softmax family: fuzzing against the reference rule, the split (online) path against the fused
two-pass form, -inf rows, long rows, autograd, registration, errors."""

import contextlib
import dataclasses
import math

import pytest
import torch

import tkit
from tkit import registry
from tkit.kernels import _device
from tkit.kernels.reductions import SoftmaxConfig, ops, overrides
from tkit.kernels.reductions import config as rconfig
from tkit.specs.reductions import ref_log_softmax, ref_softmax
from tkit.testing import check_against_reference, fuzz, make_tensor

SPECS = [s for s in registry.all_specs() if s.name in ("softmax", "log_softmax")]
IDS = [s.name for s in SPECS]
ON_GPU = torch.cuda.is_available()
INF = float("inf")


@pytest.fixture
def force_split():
    """Send every row through the split online-softmax path, in chunks of 16 columns."""
    with overrides(fused_max_bytes=1, softmax_long="split", chunk=16):
        yield


def _force_long(stack, path, chunk):
    """Every row past the fused limit, through ``path`` ("split" or "loop") in chunks, until
    ``stack`` (an ExitStack) closes."""
    stack.enter_context(overrides(fused_max_bytes=1, softmax_long=path,
                                  **{"chunk" if path == "split" else "loop_chunk": chunk}))


@pytest.fixture
def stack():
    with contextlib.ExitStack() as s:
        yield s


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_fuzz_against_reference(spec):
    fuzz(spec.fn, spec.reference, max_examples=25, **spec.fuzz())


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_check_cases(spec, device):
    for case in spec.check_cases():
        args, kwargs = case.make(device)
        check_against_reference(spec.fn, spec.reference, args, kwargs,
                                grad=args[0].dtype != torch.bfloat16 or ON_GPU)


@pytest.mark.parametrize("path", ["split", "loop"])
@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_online_split_path_agrees_with_two_pass(path, log, dtype, device, stack):
    """The long-row paths (split: per-chunk (max, sum) partials combined with the online-
    softmax rule; loop: one program carrying a running (max, sum) over the chunks) give the
    same rows as the fused path (max, then sum, on the whole row in registers), to float32
    rounding; and both pass the reference rule."""
    fn = tkit.log_softmax if log else tkit.softmax
    x = make_tensor((9, 333), dtype, seed=4, device=device) * 4
    x[2, :200] -= 30  # chunks whose max is far below the row's: the rescaling matters
    x[3, 200:] += 30  # and a max that grows late: the running sum is rescaled
    fused = fn(x)
    _force_long(stack, path, 32)
    online = fn(x)
    tol = 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(online.float(), fused.float(), rtol=tol, atol=tol)
    check_against_reference(fn, ref_log_softmax if log else ref_softmax, [x], grad=True)


def test_online_combine_rule_in_float64():
    """The combine rule itself, written out: m = max m_c, s = sum s_c exp(m_c - m)."""
    x = torch.randn(1000, dtype=torch.float64) * 10
    chunks = x.split(64)
    m_c = torch.stack([c.max() for c in chunks])
    s_c = torch.stack([(c - c.max()).exp().sum() for c in chunks])
    m = m_c.max()
    s = (s_c * (m_c - m).exp()).sum()
    torch.testing.assert_close((x - m).exp() / s, torch.softmax(x, 0), rtol=1e-12, atol=0)


@pytest.mark.parametrize("path", ["fused", "split", "loop"])
@pytest.mark.parametrize("log", [False, True])
def test_inf_rows_match_torch(path, log, device, stack):
    if path != "fused":
        _force_long(stack, path, 16)
    x = make_tensor((5, 40), torch.float32, seed=2, device=device)
    x[0] = -INF                  # all -inf: NaN everywhere, as torch
    x[1, :20] = -INF             # a whole chunk of -inf: contributes nothing
    x[2, 7] = -INF               # one -inf entry: 0 (or -inf for log_softmax)
    x[3, 5] = INF                # +inf: NaN, as torch
    fn, ref = (tkit.log_softmax, torch.log_softmax) if log else (tkit.softmax, torch.softmax)
    got, want = fn(x).cpu(), ref(x.cpu(), -1)
    assert torch.equal(got.isnan(), want.isnan())
    fin = ~want.isnan()
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [1, 3, 127, 4097, 5120, 262147])
def test_odd_hidden_sizes(n, device):
    x = make_tensor((2, n), torch.float32, seed=n, device=device)
    check_against_reference(tkit.softmax, ref_softmax, [x], grad=n < 10000)
    check_against_reference(tkit.log_softmax, ref_log_softmax, [x])


def test_split_path_backward(force_split, device):
    for fn, ref in ((tkit.softmax, ref_softmax), (tkit.log_softmax, ref_log_softmax)):
        x = make_tensor((7, 70), torch.float16, "transposed", seed=3, device=device)
        check_against_reference(fn, ref, [x], {"dim": -1}, grad=True)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_any_dim_and_layout(dim, device):
    x = make_tensor((6, 9, 17), torch.float32, "permuted", seed=5, device=device)
    check_against_reference(tkit.softmax, ref_softmax, [x], {"dim": dim}, grad=True)


def test_rows_sum_to_one(device):
    x = make_tensor((4, 1000), torch.float32, seed=8, device=device) * 5
    torch.testing.assert_close(tkit.softmax(x).sum(-1).cpu(), torch.ones(4), rtol=1e-5, atol=0)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_opcheck(spec):
    op, args, kwargs = spec.opcheck()
    if spec.name == "log_softmax":
        args = args[:2] + (True,)
    torch.library.opcheck(op, args, kwargs)


def test_torch_compile_fullgraph(device):
    x = make_tensor((6, 40), torch.float16, seed=1, device=device).requires_grad_()
    backend = "inductor" if ON_GPU else "aot_eager"
    f = torch.compile(lambda x: tkit.softmax(x * 2, -1) * tkit.log_softmax(x, 0),
                      fullgraph=True, backend=backend)
    out = f(x)
    want = torch.softmax(x.float() * 2, -1) * torch.log_softmax(x.float(), 0)
    torch.testing.assert_close(out.float(), want, rtol=2e-3, atol=2e-3)
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_empty_inputs(device):
    for shape in ((0, 5), (3, 0)):
        x = torch.randn(shape, device=device)
        assert tkit.softmax(x).shape == shape


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda d: tkit.softmax(torch.ones(3, dtype=torch.int32, device=d)), TypeError,
         "x has dtype int32"),
        (lambda d: tkit.softmax(torch.ones(3, 4, device=d), dim=2), ValueError, "dim 2"),
        (lambda d: tkit.softmax(torch.ones(3, 4, device=d), dim=1.0), TypeError, "dim must"),
        (lambda d: tkit.log_softmax(torch.tensor(1.0, device=d)), ValueError, "x must have"),
    ],
)
def test_bad_input_errors(call, exc, words, device):
    with pytest.raises(exc, match=words):
        call(device)


def test_cost():
    x = torch.empty(16384, 8192, dtype=torch.bfloat16, device="meta")
    assert registry.get("softmax").cost(x).bytes == 2 * 16384 * 8192 * 2
    # one cost function per op, the family's own
    from tkit.kernels import reductions

    assert registry.get("softmax").cost is reductions.cost_softmax
    assert registry.get("layer_norm").cost is reductions.cost_layer_norm
    assert registry.get("softmax").cost(x).flops == 5 * x.numel()


def test_override_unknown_key_is_an_error_naming_it():
    with pytest.raises(ValueError, match="l2_batch_bytes.*norm_long"):
        with overrides(num_warps=8, l2_batch_bytes=64, norm_long="split"):
            pass
    with pytest.raises(TypeError, match="num_warps"):
        with overrides(num_warps="8"):
            pass
    with pytest.raises(ValueError, match="softmax_long"):
        with overrides(softmax_long="persistent"):
            pass
    assert rconfig.active() == {}


def test_override_is_scoped_and_thread_local():
    import threading

    seen = {}
    with overrides(num_warps=8):
        with overrides(rows=2):
            assert rconfig.active() == {"num_warps": 8, "rows": 2}
            t = threading.Thread(target=lambda: seen.update(rconfig.active()))
            t.start()
            t.join()
        assert rconfig.active() == {"num_warps": 8}
        with pytest.raises(RuntimeError):
            with overrides(rows=4):
                raise RuntimeError("the block's error")
        assert rconfig.active() == {"num_warps": 8}
    assert rconfig.active() == {} and seen == {}


def test_softmax_config_selection(monkeypatch):
    """SoftmaxConfig.for_device on the GPU (host-side only): rows up to 32 KiB fused (64 KiB
    backward), longer ones the loop path with at least as many rows as SMs, else split."""
    from tkit import _env

    monkeypatch.setattr(_env, "INTERPRET", False)
    monkeypatch.setattr(_device, "sm_count", lambda device: 132)
    dev = torch.device("cpu")
    fused = SoftmaxConfig.for_device(16384, 8192, 2, device=dev)
    assert fused.path == "fused" and fused.block_n == 8192 and fused.rows == 1
    assert SoftmaxConfig.for_device(4096, 16384, 2, device=dev).path == "fused"
    assert SoftmaxConfig.for_device(4096, 16385, 2, device=dev).path == "loop"
    assert SoftmaxConfig.for_device(128, 2**20, 2, device=dev).path == "split"
    assert SoftmaxConfig.for_device(4096, 32768, 2, device=dev, backward=True).path == "fused"
    assert SoftmaxConfig.for_device(4096, 65536, 2, device=dev, backward=True).path == "split"
    with overrides(softmax_long="split", chunk=4096):
        cfg = SoftmaxConfig.for_device(4096, 65536, 2, device=dev)
        assert (cfg.path, cfg.block_n) == ("split", 4096)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fused.rows = 2


def test_softmax_launcher_takes_a_config(device):
    x = make_tensor((3, 100), torch.float32, seed=3, device=device)
    want = torch.softmax(x.double(), -1)
    for cfg in (SoftmaxConfig("loop", 32, 1, 4), SoftmaxConfig("split", 32, 1, 4),
                SoftmaxConfig("fused", 128, 2, 4)):
        got = ops._softmax_fwd_impl(x, 1, False, config=cfg)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


# ---- GPU -----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("n", [8192, 32768, 32769, 262144, 2**20])
def test_bf16_rows_on_gpu(n):
    x = torch.randn(max(1, 2**22 // n), n, device="cuda", dtype=torch.bfloat16) * 3
    for fn, ref in ((tkit.softmax, ref_softmax), (tkit.log_softmax, ref_log_softmax)):
        check_against_reference(fn, ref, [x], grad=n <= 262144)


@pytest.mark.gpu
def test_long_row_sums_to_one():
    x = torch.randn(4, 3_000_001, device="cuda") * 10
    s = tkit.softmax(x).double().sum(-1)
    assert (s - 1).abs().max().item() < 1e-4
    assert math.isfinite(tkit.log_softmax(x).float().sum().item())


@pytest.mark.gpu
@pytest.mark.parametrize("n", [8192, 2**20])
def test_more_than_2_31_elements(n):
    """Offsets past 2**31 elements (fused and split paths): the last rows."""
    x = torch.randn(2**31 // n + 3, n, device="cuda", dtype=torch.bfloat16)
    y = tkit.softmax(x)
    tail = slice(-3, None)
    torch.testing.assert_close(y[tail].float(), torch.softmax(x[tail].float(), -1),
                               rtol=2e-2, atol=1e-5)
    del x, y
    torch.cuda.empty_cache()
