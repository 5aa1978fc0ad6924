"""The CUDA GEMMs: argument validation and dispatch everywhere; correctness on the GPU.

GPU tests compare against the reference rule of docs/DESIGN.md (float64 reference, PyTorch in the
same precision as the peer) with outputs NaN-poisoned before the launch, at shapes that break
tiles: one row, tile +/- 1, odd M, K not a multiple of the k tile.
"""

import functools
import math

import numpy as np
import pytest
import torch

import tkit.cuda_ext as cx
from tkit import registry
from tkit.cuda_ext import _loader
from tkit.cuda_ext.gemm import check_gemm_operands
from tkit.testing import check_against_reference, fuzz, make_tensor

ON_GPU = torch.cuda.is_available()
BF16 = torch.bfloat16


def _major():
    return torch.cuda.get_device_capability()[0] if ON_GPU else 0


# The Hopper kernel waits on mbarriers: a protocol bug would hang the GPU, and with it the
# whole test session. tkit.cuda_ext runs it once in a subprocess with a timeout before trusting
# it (gemm.wgmma_selftest, cached on disk); if that fails, the dispatcher does not choose it (so
# the other tests still run on the mma.sync path), test_wgmma_probe fails with the reason and
# the wgmma-only tests skip.
@functools.cache
def wgmma_probe() -> str | None:
    """None when the wgmma kernel runs and is roughly right, else why not."""
    if not ON_GPU or torch.cuda.get_device_capability() != (9, 0):
        return "needs compute capability 9.0"
    return cx.wgmma_selftest()


@pytest.fixture(autouse=True)
def _guard_wgmma(monkeypatch):
    if ON_GPU and _major() == 9 and wgmma_probe() is not None:
        monkeypatch.setitem(cx.DISPATCH, 9, [p for p in cx.DISPATCH[9] if p[0] != "sm90a_wgmma"])


def skip_unless_wgmma():
    why = wgmma_probe()
    if why is not None:
        pytest.skip(f"wgmma path off: {why.splitlines()[0][:200]}")


@pytest.mark.gpu
def test_wgmma_probe():
    if _major() != 9:
        pytest.skip("the wgmma kernel needs sm_90a")
    why = wgmma_probe()
    assert why is None, why


# ---- validation (host-side metadata only: runs on CPU) --------------------------------------
@pytest.mark.parametrize("make_args, error, match", [
    (lambda: (torch.zeros(8, 8), torch.zeros(8, 8, dtype=BF16)), TypeError, r"^a has dtype"),
    (lambda: (torch.zeros(8, 8, dtype=BF16), torch.zeros(8, dtype=BF16)), ValueError,
     r"^b must be 2-D"),
    (lambda: (torch.zeros(8, 16, dtype=BF16), torch.zeros(8, 8, dtype=BF16)), ValueError,
     r"inner dimensions"),
    (lambda: (torch.zeros(16, 8, dtype=BF16).t(), torch.zeros(16, 8, dtype=BF16)), ValueError,
     r"^a must be row-major"),
    (lambda: (torch.zeros(8, 12, dtype=BF16), torch.zeros(12, 8, dtype=BF16)), ValueError,
     r"K = 12"),
    (lambda: (torch.zeros(8, 8, dtype=BF16), torch.zeros(8, 12, dtype=BF16)), ValueError,
     r"N = 12"),
    (lambda: (torch.zeros(8, 8, dtype=BF16), torch.zeros(65, dtype=BF16)[1:].view(8, 8)),
     ValueError, r"^b must start on a 16-byte boundary"),
    (lambda: ([[1.0]], torch.zeros(8, 8, dtype=BF16)), TypeError, r"^a must be a torch.Tensor"),
])
def test_validation_names_the_argument(make_args, error, match):
    a, b = make_args()
    with pytest.raises(error, match=match):
        check_gemm_operands(a, b, (BF16,))


@pytest.mark.skipif(ON_GPU, reason="checks the CPU-tensor message")
def test_cpu_tensors_are_refused_by_name():
    with pytest.raises(ValueError, match=r"^a is on cpu"):
        check_gemm_operands(torch.zeros(8, 8, dtype=BF16), torch.zeros(8, 8, dtype=BF16), (BF16,))


def test_untyped_scalars_are_refused():
    with pytest.raises(TypeError, match=r"argument 1 has type int"):
        _loader._c_arg(7, 1)
    assert _loader._c_arg(np.int32(7), 0).value == 7
    assert len(bytes(_loader._c_arg(b"\x01" * 128, 2))) == 128


def test_unknown_sgemm_step():
    with pytest.raises(ValueError, match=r"step must be one of"):
        cx.sgemm(torch.zeros(8, 8), torch.zeros(8, 8), step="fastest")


@pytest.mark.skipif(ON_GPU, reason="checks the no-GPU report")
def test_status_without_gpu():
    s = cx.status()
    assert s["ops"]["matmul"]["path"] == "triton"
    assert "no CUDA GPU" in s["ops"]["matmul"]["why"] or "cupy" in s["ops"]["matmul"]["why"]
    assert "matmul" in str(s)
    with pytest.raises(cx.CudaPathUnavailable, match="no CUDA matmul path"):
        cx.matmul(torch.zeros(8, 8, dtype=BF16), torch.zeros(8, 8, dtype=BF16))
    assert cx.unavailable_reason(torch.zeros(8, 8, dtype=BF16), torch.zeros(8, 8, dtype=BF16))


def test_dispatch_table_shape():
    assert set(cx.DISPATCH) == {8, 9}
    assert cx.DISPATCH[9][0][0] == "sm90a_wgmma" and cx.DISPATCH[8][0][0] == "sm80_mma"


# ---- GPU correctness ----------------------------------------------------------------------
def _fp32_floor(a, b):
    # fp32 sums of K products: rounding grows like sqrt(K) units at the output's scale
    K = a.shape[1]
    scale = (a.abs().max() * b.abs().max()).item() * math.sqrt(max(K, 1))
    return 2.0**-23 * math.sqrt(max(K, 1)) * scale


SGEMM_ANY = [(1, 1, 1), (7, 33, 5), (127, 129, 65), (200, 300, 257), (256, 128, 64)]
SGEMM_TILED = [(128, 128, 8), (256, 384, 136), (512, 512, 512)]


@pytest.mark.gpu
@pytest.mark.parametrize("step", list(cx.SGEMM_STEPS))
def test_sgemm_ladder(step):
    strict = cx.SGEMM_STEPS[step][3]
    for M, N, K in SGEMM_TILED + ([] if strict else SGEMM_ANY):
        a = make_tensor((M, K), torch.float32, seed=M + K)
        b = make_tensor((K, N), torch.float32, seed=N + 1)
        check_against_reference(lambda x, y: cx.sgemm(x, y, step), torch.matmul, [a, b],
                                floor=_fp32_floor(a, b))


@pytest.mark.gpu
def test_sgemm_strict_steps_refuse_odd_shapes():
    a = make_tensor((100, 64), torch.float32)
    b = make_tensor((64, 128), torch.float32)
    with pytest.raises(ValueError, match=r"M % 128"):
        cx.sgemm(a, b, "cp_async")


BF16_SHAPES = [(1, 8, 8), (16, 16, 16), (127, 136, 72), (129, 264, 200), (300, 1000, 520),
               (1024, 1024, 1024), (130, 520, 4096), (2048, 2048, 512)]


def _paths():
    if not ON_GPU:
        return ["sm80_mma", "sm90a_wgmma"]
    return [n for n, _f, _h in cx.DISPATCH.get(_major(), [])] or ["none"]


@pytest.mark.gpu
@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("shape", BF16_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bf16_gemm(path, shape):
    if path == "none":
        pytest.skip(f"no CUDA path for compute capability {_major()}")
    if path == "sm90a_wgmma":
        skip_unless_wgmma()
    M, N, K = shape
    a = make_tensor((M, K), BF16, seed=M)
    b = make_tensor((K, N), BF16, seed=N + K)
    check_against_reference(lambda x, y: cx.matmul(x, y, path=path), torch.matmul, [a, b])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU or _major() not in (8, 9), reason="needs sm_80 or sm_90")
def test_fp32_output():
    a = make_tensor((129, 200), BF16, seed=1)
    b = make_tensor((200, 264), BF16, seed=2)
    out = cx.matmul(a, b, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    ref = a.double() @ b.double()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU or _major() not in (8, 9), reason="needs sm_80 or sm_90")
def test_runs_on_torch_current_stream():
    a = make_tensor((512, 512), BF16, seed=3)
    b = make_tensor((512, 512), BF16, seed=4)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        c = cx.matmul(a, b)
        d = c.float() * 2  # ordered after the GEMM on the same stream
    s.synchronize()
    torch.testing.assert_close(d, (a.float() @ b.float()) * 2, rtol=2e-2, atol=2e-1)


@pytest.mark.gpu
def test_status_on_gpu_names_a_path():
    s = cx.status()
    if _major() == 9:
        expect = "sm90a_wgmma" if wgmma_probe() is None else "sm80_mma"
        assert s["ops"]["matmul"]["path"] == expect, s
    elif _major() == 8:
        assert s["ops"]["matmul"]["path"] == "sm80_mma", s
    else:
        assert s["ops"]["matmul"]["path"] == "triton", s


@pytest.mark.gpu
def test_zero_sized():
    for M, N, K in ((0, 16, 16), (16, 0, 16), (16, 16, 0)):
        a = torch.randn(M, K, device="cuda").to(BF16)
        b = torch.randn(K, N, device="cuda").to(BF16)
        if cx.unavailable_reason(a, b) is not None:
            pytest.skip(cx.unavailable_reason(a, b))
        torch.testing.assert_close(cx.matmul(a, b).float(), (a.float() @ b.float()))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU or _major() not in (8, 9), reason="needs sm_80 or sm_90")
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_dispatch_any_layout_and_batch(dtype):
    a = make_tensor((3, 72, 136), dtype, "transposed", seed=5)
    b = make_tensor((136, 264), dtype, seed=6)
    check_against_reference(lambda x, y: cx.dispatch("matmul", x, y), torch.matmul, [a, b],
                            floor=_fp32_floor(a[0], b) if dtype == torch.float32 else None)


def test_dispatch_unknown_op():
    with pytest.raises(KeyError, match="no CUDA op"):
        cx.dispatch("conv", None)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU or _major() not in (8, 9), reason="needs sm_80 or sm_90")
def test_tkit_matmul_backend_cuda():
    import tkit

    a = make_tensor((257, 512), BF16, seed=7)
    b = make_tensor((512, 384), BF16, seed=8)
    try:
        out = tkit.matmul(a, b, backend="cuda")
    except TypeError as e:
        pytest.skip(f"tkit.matmul has no backend switch yet ({e})")
    check_against_reference(lambda x, y: tkit.matmul(x, y, backend="cuda"), torch.matmul,
                            [a, b])
    assert out.shape == (257, 384)


SPECS = [s for s in registry.all_specs() if s.family == "cuda_ext"]


@pytest.mark.gpu
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_spec_check_cases(spec):
    if spec.name == "cuda_matmul_wgmma":
        skip_unless_wgmma()
    if spec.family == "cuda_ext" and _major() not in (8, 9) and "sgemm" not in spec.name:
        pytest.skip("no tensor-core CUDA path for this GPU")
    for case in spec.check_cases():
        args, kwargs = case.make("cuda")
        floor = _fp32_floor(*args) if args[0].dtype == torch.float32 else None
        check_against_reference(spec.fn, spec.reference, args, kwargs, floor=floor)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [s for s in SPECS if s.name in (
    "cuda_matmul_mma", "cuda_matmul_wgmma", "cuda_sgemm_2d_blocking", "cuda_sgemm_cp_async")],
    ids=lambda s: s.name)
def test_spec_fuzz(spec):
    if spec.name == "cuda_matmul_wgmma":
        skip_unless_wgmma()
    if spec.name == "cuda_matmul_mma" and _major() not in (8, 9):
        pytest.skip("needs sm_80 or sm_90")
    recipe = spec.fuzz()
    fp32 = recipe["dtypes"] == (torch.float32,)
    # fp32 sums: the sqrt(K) noise floor at K <= 320, |a|,|b| ~ 4 sigma
    fuzz(spec.fn, spec.reference, **recipe, floor=2.0**-23 * 320 * 16 if fp32 else None,
         max_examples=40)
