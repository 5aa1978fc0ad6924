"""The Gluon sm_90 attention backward: its scope (``bwd_supported``), its compiled kernels
(ahead of time on any machine: asynchronous wgmmas, TMA rings, shared memory that fits), and on
an H200 the gradients of ``tkit.flash_attention`` against the float64 reference, next to the
Triton backward's."""

import re

import pytest
import torch
import triton

import tkit
from tkit.kernels import attention as A
from tkit.kernels.attention import hopper as AH
from tkit.specs import attention as S
from tkit.testing import check_against_reference, make_tensor

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
TRITON = tuple(int(x) for x in triton.__version__.split(".")[:2])
GRAD_FLOOR = S.GRAD_FLOOR
# every case the Gluon backward supports (the default dispatches only those measured faster
# than the Triton backward: AttentionConfig.hopper_bwd_cases)
EVERY_CASE = frozenset({(64, False), (64, True), (128, False), (128, True)})


@pytest.fixture
def every_case():
    with A.attention_config(hopper_bwd_cases=EVERY_CASE):
        yield


def _qkv(b, sq, sk, hq, hk, d, dtype, device, seed=0):
    return (make_tensor((b, sq, hq, d), dtype, seed=seed, device=device),
            make_tensor((b, sk, hk, d), dtype, seed=seed + 1, device=device),
            make_tensor((b, sk, hk, d), dtype, seed=seed + 2, device=device))


# ---- scope ---------------------------------------------------------------------------------
def test_scope():
    q, k, v = _qkv(2, 64, 64, 4, 2, 128, torch.bfloat16, "cpu")
    assert "CUDA" in AH.bwd_supported(q, k, v, causal=True)  # every other check passes
    assert "window" in AH.bwd_supported(q, k, v, window=(16, 0))
    assert "softcap" in AH.bwd_supported(q, k, v, softcap=5.0)
    assert "varlen" in AH.bwd_supported(q, k, v, varlen=True)
    q2, k2, v2 = _qkv(1, 16, 16, 2, 2, 256, torch.bfloat16, "cpu")
    assert "backward" in AH.bwd_supported(q2, k2, v2)
    q3, k3, v3 = _qkv(1, 0, 16, 2, 2, 64, torch.float16, "cpu")
    assert "empty" in AH.bwd_supported(q3, k3, v3)
    lse = torch.zeros(2, 64, 4).transpose(1, 2)
    assert "lse" in AH.bwd_supported(q, k, v, lse=lse)


def test_config_is_validated():
    with pytest.raises(ValueError, match="dkdv_stages"):
        AH.HopperBwdConfig(dkdv_stages=0)
    with pytest.raises(ValueError, match="dq_block_n"):
        AH.HopperBwdConfig(dq_block_n=48)
    for d, cfg in AH.BWD_DEFAULTS.items():
        assert all(n <= AH.SMEM_LIMIT for n in cfg.smem_bytes(d))


def test_backend_names_the_reason():
    q, k, v = _qkv(1, 64, 64, 2, 2, 128, torch.bfloat16, "cpu")
    assert A.bwd_backend(q, k, v).startswith("triton (not on a CUDA device")
    with A.attention_config(hopper_bwd_cases=frozenset()):
        assert "hopper_bwd_cases" in A.bwd_backend(q, k, v)


# ---- compiled for sm_90 (no GPU needed) ----------------------------------------------------
@pytest.mark.parametrize("kind", ["dkdv", "dq"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_compiled(kind, d, causal):
    from tkit.ir_tools.aot import cubin_sass

    k = AH.compile_bwd_sm90(kind, d, causal)
    ptx = k.asm["ptx"]
    sass = cubin_sass(k.asm["cubin"])
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    # the two score wgmmas of a block are in flight together: one wait leaves one group
    assert "wgmma.wait_group.sync.aligned 1;" in ptx
    assert "HGMMA" in sass and "UTMALDG" in sass and "UTMASTG" in sass
    assert k.metadata.shared <= AH.SMEM_LIMIT
    if TRITON == (3, 6):  # the GPU machine's Triton: no spills (3.9 spills the causal D=128
        # dK/dV kernel, ~50 stores, holding both accumulators; not timed under 3.9)
        assert not re.search(r"\bSTL", sass)


# ---- H200 ----------------------------------------------------------------------------------
def _grads(fn, q, k, v, do, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    return torch.autograd.grad(fn(q, k, v, **kw), (q, k, v), do)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("s", [1, 63, 64, 65, 127, 128, 129, 1000])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_seqlens(s, causal, d, every_case):
    args = _qkv(2, s, s, 4, 2, d, torch.bfloat16, "cuda", seed=s)
    assert A.bwd_backend(*args, causal=causal).startswith("gluon")
    check_against_reference(tkit.flash_attention, S.ref_attention, args, dict(causal=causal),
                            grad=True, floor=GRAD_FLOOR)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("sq, sk", [(100, 300), (300, 100), (1, 257), (257, 1), (65, 200),
                                    (200, 65)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_unequal_lengths(sq, sk, causal, every_case):
    # causal with seqlen_q > seqlen_k: the first sq - sk rows see no key (zero gradients)
    args = _qkv(2, sq, sk, 4, 4, 64, torch.float16, "cuda", seed=3)
    check_against_reference(tkit.flash_attention, S.ref_attention, args, dict(causal=causal),
                            grad=True, floor=GRAD_FLOOR)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("hq, hk", [(16, 4), (8, 1), (4, 4)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gqa_head_dims_dtypes(hq, hk, d, dtype, every_case):
    args = _qkv(2, 333, 333, hq, hk, d, dtype, "cuda", seed=5)
    for causal in (False, True):
        check_against_reference(tkit.flash_attention, S.ref_attention, args,
                                dict(causal=causal, return_lse=True), grad=True,
                                floor=GRAD_FLOOR)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_every_stage_count(d):
    """Ring depths other than the default (the config a sweep would pick) give the same
    gradients as the default, bit for bit (the order of the sums does not depend on them)."""
    q, k, v = _qkv(1, 700, 700, 4, 2, d, torch.bfloat16, "cuda", seed=7)
    do = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    out, lse = A._fwd_impl(q, k, v, None, None, 700, 700, True, d ** -0.5, -1, -1, 0.0)
    want = AH.backward(do, q, k, v, out, lse, None, True)
    for cfg in (AH.HopperBwdConfig(1, 64, 2), AH.HopperBwdConfig(3, 64, 4),
                AH.HopperBwdConfig(2, 128, 2), AH.HopperBwdConfig(2, 32, 3)):
        if max(cfg.smem_bytes(d)) > AH.SMEM_LIMIT:
            continue
        got = AH.backward(do, q, k, v, out, lse, None, True, config=cfg)
        for a, b in zip(got[1:], want[1:]):  # dK, dV: the same sums in the same order
            assert torch.equal(a, b), cfg
        torch.testing.assert_close(got[0].float(), want[0].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
def test_gpu_backends_agree_and_expanded_gradient():
    """The Gluon and Triton backwards on the same inputs agree within bf16 rounding; an
    expanded output gradient (``out.sum().backward()``: stride 0, which TMA cannot read) is
    copied, not refused."""
    q, k, v = _qkv(2, 700, 900, 8, 2, 128, torch.bfloat16, "cuda")
    do = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    for causal in (False, True):
        g1 = _grads(tkit.flash_attention, q, k, v, do, causal=causal)
        with A.attention_config(hopper_bwd_cases=frozenset()):
            g2 = _grads(tkit.flash_attention, q, k, v, do, causal=causal)
        for a, b in zip(g1, g2):
            torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2)
    ones = torch.ones((), device="cuda", dtype=q.dtype).expand(q.shape)
    g1 = _grads(tkit.flash_attention, q, k, v, ones, causal=True)
    g2 = _grads(tkit.flash_attention, q, k, v, ones.contiguous(), causal=True)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
def test_gpu_graph_capture():
    """A training step's backward replayed from a CUDA graph equals the eager one."""
    q, k, v = (t.requires_grad_() for t in _qkv(2, 512, 512, 8, 2, 128, torch.bfloat16,
                                                 "cuda"))
    do = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    want = torch.autograd.grad(tkit.flash_attention(q, k, v, causal=True), (q, k, v), do)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            torch.autograd.grad(tkit.flash_attention(q, k, v, causal=True), (q, k, v), do)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = torch.autograd.grad(tkit.flash_attention(q, k, v, causal=True), (q, k, v), do)
    g.replay()
    torch.cuda.synchronize()
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_overrides_reach_a_backward_on_another_thread(monkeypatch, device):
    """autograd runs a CUDA backward on its own thread: the attention_config overrides in
    force at the forward must hold in its backward (eager Function and registered op)."""
    import threading

    from tkit.kernels.attention import config as AC
    from tkit.kernels.attention import ops as AO

    seen = []
    real = AO._bwd_impl

    def spy(*args, **kw):
        seen.append(AC.current_config().hopper_bwd_cases)
        return real(*args, **kw)

    monkeypatch.setattr(AO, "_bwd_impl", spy)
    q, k, v = (t.requires_grad_() for t in _qkv(1, 20, 20, 2, 2, 32, torch.float32, device))
    from tkit import _env

    for no_direct in (False, True):  # the eager Function, then the registered op
        monkeypatch.setattr(_env, "NO_DIRECT", no_direct)
        with A.attention_config(hopper_bwd_cases=frozenset({(7, True)})):
            out = tkit.flash_attention(q, k, v, causal=True)
        errors = []

        def backward(o=out, errors=errors):
            try:
                o.sum().backward()
            except Exception as e:  # noqa: BLE001 - reported below, not lost in the thread
                errors.append(e)

        t = threading.Thread(target=backward)
        t.start()
        t.join()
        assert not errors, errors
    assert seen == [frozenset({(7, True)})] * 2, seen
