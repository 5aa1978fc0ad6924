"""Attention family: fuzzing against the float64 reference (forward, lse and gradients), varlen
packing, fully masked rows, registration, torch.compile, errors; GPU-only bf16 and large cases."""

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

import tkit
from tkit import registry
from tkit.kernels import _common, _device
from tkit.kernels import attention as A
from tkit.specs import attention as S
from tkit.testing import check_against_reference, fuzz, make_tensor

ON_GPU = torch.cuda.is_available()
SPEC = registry.get("flash_attention")
VARLEN_SPEC = registry.get("flash_attention_varlen")
CPU_DTYPES = (torch.float16, torch.float32)  # bf16 in the interpreter: test_bf16_everywhere
DTYPES = (torch.float16, torch.bfloat16) if ON_GPU else CPU_DTYPES
GRAD_FLOOR = S.GRAD_FLOOR  # the gradients' absolute floor (one-hot softmax rows)


def _qkv(b, sq, sk, hq, hk, d, dtype, device, seed=0):
    return (make_tensor((b, sq, hq, d), dtype, seed=seed, device=device),
            make_tensor((b, sk, hk, d), dtype, seed=seed + 1, device=device),
            make_tensor((b, sk, hk, d), dtype, seed=seed + 2, device=device))


# ---- fuzzing -------------------------------------------------------------------------------
def test_fuzz_forward():
    fuzz(SPEC.fn, SPEC.reference, **SPEC.fuzz(), max_examples=None if ON_GPU else 40)


def test_fuzz_gradients():
    recipe = SPEC.fuzz()
    # layouts are covered by the forward fuzz; here contiguous and views of a packed tensor
    recipe["layouts"] = ("contiguous", "sliced", "transposed")
    fuzz(SPEC.fn, SPEC.reference, **recipe, grad=True, floor=GRAD_FLOOR,
         max_examples=None if ON_GPU else 25)


def test_varlen_fuzz_recipe():
    """The spec's own recipe (the one benchmarks/reliability.py fuzzes with) builds cu_seqlens."""
    fuzz(VARLEN_SPEC.fn, VARLEN_SPEC.reference, **VARLEN_SPEC.fuzz(),
         max_examples=None if ON_GPU else 10)


@st.composite
def _varlen_batch(draw):
    n = draw(st.integers(1, 4))
    lens_q = draw(st.lists(st.sampled_from((1, 2, 9, 31, 32, 33, 47)), min_size=n, max_size=n))
    same = draw(st.booleans())
    lens_k = lens_q if same else draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
    hk = draw(st.sampled_from((1, 2)))
    hq = hk * draw(st.sampled_from((1, 2)))
    d = draw(st.sampled_from((16, 40, 64)))
    return lens_q, lens_k, hq, hk, d


@(settings() if ON_GPU else settings(max_examples=20))  # on a GPU: the loaded profile
@given(batch=_varlen_batch(), dtype=st.sampled_from(DTYPES), opts=S.attention_options(),
       seed=st.integers(0, 2**16), grad=st.booleans())
def test_varlen_against_reference(batch, dtype, opts, seed, grad):
    device = "cuda" if ON_GPU else "cpu"
    lens_q, lens_k, hq, hk, d = batch
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)
    q = make_tensor((sum(lens_q), hq, d), dtype, seed=seed, device=device)
    k = make_tensor((sum(lens_k), hk, d), dtype, seed=seed + 1, device=device)
    v = make_tensor((sum(lens_k), hk, d), dtype, seed=seed + 2, device=device)
    check_against_reference(VARLEN_SPEC.fn, VARLEN_SPEC.reference,
                            [q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)], opts, grad=grad,
                            floor=GRAD_FLOOR if grad else None)


@pytest.mark.parametrize("name", ["flash_attention", "flash_attention_varlen"])
def test_check_cases(name, device):
    spec = registry.get(name)
    for case in spec.check_cases():
        args, kwargs = case.make(device)
        check_against_reference(spec.fn, spec.reference, args, dict(kwargs, return_lse=True),
                                grad=True)


def test_train_step_check_cases(device):
    # the training-step spec (output and d q, d k, d v for a given d out) under the reference
    # rule, each gradient against float64 autograd through the reference
    spec = registry.get("flash_attention_train")
    for case in spec.check_cases():
        args, kwargs = case.make(device)
        out = check_against_reference(spec.fn, spec.reference, args, kwargs)
        assert len(out) == 4 and [t.shape for t in out[1:]] == [t.shape for t in args[:3]]


def test_eager_gradients_skip_the_dispatcher(monkeypatch, device):
    # under autograd an eager call takes the eager Function (no torch.library dispatch, a
    # training step's host cost); TKIT_NO_DIRECT sends it through the registered op, with the
    # same kernels: the same output and gradients bit for bit
    calls = []
    real = A._fwd_op

    def spy(*a):
        calls.append(1)
        return real(*a)

    monkeypatch.setattr(A, "_fwd_op", spy)
    q, k, v = _qkv(1, 40, 40, 4, 2, 32, torch.float16, device)
    dout = make_tensor(q.shape, torch.float16, seed=9, device=device)

    def step():
        return S.train_step(q, k, v, dout, causal=True)

    eager = step()
    assert not calls
    monkeypatch.setattr(_common._env, "NO_DIRECT", True)
    dispatched = step()
    assert len(calls) == 1
    for a, b in zip(eager, dispatched):
        assert torch.equal(a, b)


# ---- targeted cases ------------------------------------------------------------------------
@pytest.mark.parametrize("sq, sk, hq, hk, d", [
    (1, 1, 1, 1, 16),        # one token
    (31, 33, 2, 2, 64),      # tile - 1 / tile + 1 (interpreter tile 32)
    (65, 64, 3, 1, 96),      # MQA, non-power-of-2 head dim
    (17, 70, 4, 2, 40),      # seqlen_q < seqlen_k: bottom-right causal
])
@pytest.mark.parametrize("dtype", CPU_DTYPES if not ON_GPU else DTYPES)
def test_causal_shapes_with_gradients(sq, sk, hq, hk, d, dtype, device):
    args = _qkv(1, sq, sk, hq, hk, d, dtype, device)
    check_against_reference(tkit.flash_attention, S.ref_attention, args,
                            dict(causal=True, return_lse=True), grad=True, floor=GRAD_FLOOR)


def test_fully_masked_rows_give_zero_and_minus_inf(device):
    # seqlen_q > seqlen_k with causal: the first sq - sk rows see no key; a window (0, 0) with
    # sk < sq too. Output 0, lse -inf, gradients finite.
    for kw in (dict(causal=True), dict(window_size=(0, 0))):
        q, k, v = (t.requires_grad_() for t in _qkv(1, 40, 9, 2, 2, 32, torch.float16, device))
        out, lse = tkit.flash_attention(q, k, v, return_lse=True, **kw)
        assert torch.all(out[:, :31] == 0)
        assert torch.all(lse[:, :, :31] == float("-inf"))
        assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, 31:]).all()
        out.sum().backward()
        for t in (q, k, v):
            assert torch.isfinite(t.grad).all()
        assert torch.all(q.grad[:, :31] == 0)


def test_packed_qkv_views(device):
    qkv = make_tensor((2, 45, 3, 2, 64), torch.float16, seed=4, device=device)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    check_against_reference(tkit.flash_attention, S.ref_attention, [q, k, v],
                            dict(causal=True), grad=True)


def test_lse_gradient_flows(device):
    """A loss that uses the lse (as ring/context-parallel attention does) backpropagates."""
    args = _qkv(1, 20, 33, 2, 1, 32, torch.float32, device)

    def fn(q, k, v):
        out, lse = tkit.flash_attention(q, k, v, causal=True, return_lse=True)
        return out.sum(-1) + lse.transpose(1, 2)

    def ref(q, k, v):
        out, lse = S.ref_attention(q, k, v, causal=True, return_lse=True)
        return out.sum(-1) + lse.transpose(1, 2).to(out.dtype)

    check_against_reference(fn, ref, args, grad=True)


def test_forward_is_deterministic(device):
    args = _qkv(2, 50, 50, 2, 2, 64, torch.float16, device)
    a = tkit.flash_attention(*args, causal=True)
    b = tkit.flash_attention(*args, causal=True)
    assert torch.equal(a, b)


def test_explicit_config_path_matches_autotuned(device):
    args = _qkv(1, 40, 40, 2, 2, 32, torch.float16, device)
    out, _ = A._fwd_impl(*args, None, None, 40, 40, True, 32 ** -0.5, -1, -1, 0.0,
                         config=dict(BLOCK_M=16, BLOCK_N=16))
    torch.testing.assert_close(out, tkit.flash_attention(*args, causal=True), atol=2e-3,
                               rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_tile_order_does_not_change_results(causal, device):
    # HEAD_GROUP only reorders (batch, head, query block) tiles: every order writes every
    # tile, with the same values (3 does not divide the 2 * 3 = 6 pairs: a partial section)
    b, s, hq, hk, d = 2, 40, 3, 1, 32
    args = _qkv(b, s, s, hq, hk, d, torch.float16, device)
    cfg = dict(BLOCK_M=16, BLOCK_N=16)
    with _common.poisoned_outputs():
        outs = [A._fwd_impl(*args, None, None, s, s, causal, d ** -0.5, -1, -1, 0.0,
                            config=dict(cfg, HEAD_GROUP=g)) for g in (1, 3, 4, 6, 100)]
    ref = S.ref_attention(*(t.double() for t in args), causal=causal, return_lse=True)
    for out, lse in outs:
        assert not out.isnan().any() and not lse.isnan().any()
        torch.testing.assert_close(out, outs[0][0], atol=0, rtol=0)
        torch.testing.assert_close(lse, outs[0][1], atol=0, rtol=0)
    torch.testing.assert_close(outs[0][0].double(), ref[0], atol=2e-3, rtol=0)


def test_fwd_head_group():
    # S=4096, D=128, bf16: K+V = 2 MB a head, 4 heads in the 8 MB budget; GQA multiplies
    assert A.fwd_head_group(4096, 128, 2, 1) == 4
    assert A.fwd_head_group(4096, 128, 2, 4) == 16
    assert A.fwd_head_group(3000, 128, 2, 1) == 4     # 5 fit: rounded down to a power of 2
    assert A.fwd_head_group(1 << 20, 256, 4, 1) == 1  # one head alone overflows the budget


def test_empty_inputs(device):
    q, k, v = _qkv(1, 0, 5, 2, 2, 32, torch.float16, device)
    out, lse = tkit.flash_attention(q, k, v, return_lse=True)
    assert out.shape == q.shape and lse.shape == (1, 2, 0)
    q, k, v = _qkv(1, 4, 0, 2, 2, 32, torch.float16, device)
    out, lse = tkit.flash_attention(q, k, v, return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


# ---- registration, compile, direct path ----------------------------------------------------
@pytest.mark.parametrize("spec", [SPEC, VARLEN_SPEC], ids=["dense", "varlen"])
def test_opcheck(spec):
    op, args, kwargs = spec.opcheck()
    torch.library.opcheck(op, args, kwargs)


def test_torch_compile_fullgraph(device):
    q, k, v = (t.requires_grad_() for t in _qkv(1, 33, 33, 4, 2, 32, torch.float16, device))
    backend = "inductor" if ON_GPU else "aot_eager"

    def f(q, k, v):
        return tkit.flash_attention(q, k, v, causal=True, window_size=(8, -1)) * 2

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    got = compiled(q, k, v)
    want = f(q, k, v)
    torch.testing.assert_close(got, want)
    (g_got,) = torch.autograd.grad(got.sum(), q)
    (g_want,) = torch.autograd.grad(want.sum(), q)
    torch.testing.assert_close(g_got, g_want)


def test_direct_and_dispatched_paths_agree(device, monkeypatch):
    args = _qkv(1, 21, 30, 2, 1, 48, torch.float16, device)
    direct = tkit.flash_attention(*args, causal=True)
    monkeypatch.setattr(_common._env, "NO_DIRECT", True)
    assert not _common.use_direct_path(*args)
    torch.testing.assert_close(tkit.flash_attention(*args, causal=True), direct, rtol=0, atol=0)


# ---- errors --------------------------------------------------------------------------------
def _t(*shape, dtype=torch.float16, device="cpu"):
    return torch.randn(shape, device=device).to(dtype)


@pytest.mark.parametrize("call, exc, words", [
    (lambda d: tkit.flash_attention(_t(1, 4, 2, 8, device=d), _t(1, 4, 2, 8, device=d),
                                    _t(1, 4, 2, 8, dtype=torch.float32, device=d)),
     TypeError, "share a dtype"),
    (lambda d: tkit.flash_attention(_t(1, 4, 2, 8, dtype=torch.float64, device=d),
                                    _t(1, 4, 2, 8, device=d), _t(1, 4, 2, 8, device=d)),
     TypeError, "q has dtype float64"),
    (lambda d: tkit.flash_attention(_t(4, 2, 8, device=d), _t(4, 2, 8, device=d),
                                    _t(4, 2, 8, device=d)), ValueError, "q must be"),
    (lambda d: tkit.flash_attention(_t(1, 4, 2, 512, device=d), _t(1, 4, 2, 512, device=d),
                                    _t(1, 4, 2, 512, device=d)), ValueError, "head_dim 512"),
    (lambda d: tkit.flash_attention(_t(1, 4, 3, 8, device=d), _t(1, 4, 2, 8, device=d),
                                    _t(1, 4, 2, 8, device=d)), ValueError, "multiple"),
    (lambda d: tkit.flash_attention(_t(1, 4, 2, 8, device=d), _t(1, 4, 2, 16, device=d),
                                    _t(1, 4, 2, 16, device=d)), ValueError, "head_dim"),
    (lambda d: tkit.flash_attention(_t(1, 4, 2, 8, device=d), _t(1, 4, 2, 8, device=d),
                                    _t(1, 5, 2, 8, device=d)), ValueError, "k and v"),
    (lambda d: tkit.flash_attention(_t(2, 4, 2, 8, device=d), _t(1, 4, 2, 8, device=d),
                                    _t(1, 4, 2, 8, device=d)), ValueError, "batch"),
    (lambda d: tkit.flash_attention(*[_t(1, 4, 2, 8, device=d)] * 3, window_size=(-2, 0)),
     ValueError, "window_size"),
    (lambda d: tkit.flash_attention(*[_t(1, 4, 2, 8, device=d)] * 3, softcap=-1.0),
     ValueError, "softcap"),
    (lambda d: tkit.flash_attention_varlen(
        *[_t(4, 2, 8, device=d)] * 3, torch.tensor([0, 4], device=d),
        torch.tensor([0, 4], dtype=torch.int32, device=d), 4, 4),
     TypeError, "cu_seqlens_q has dtype int64"),
])
def test_bad_input_errors(call, exc, words, device):
    with pytest.raises(exc, match=words):
        call(device)


def test_cpu_tensor_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(_common._env, "INTERPRET", False)
    with pytest.raises(ValueError, match="q is on the CPU"):
        tkit.flash_attention(*[torch.randn(1, 4, 2, 8).half()] * 3)


# ---- autotuning ------------------------------------------------------------------------------
def test_config_pruning_with_keyword_launch(monkeypatch):
    # tkit launches with keywords only, so Triton's autotuner hands the pruner an empty
    # ``named_args`` and everything in ``kwargs``
    monkeypatch.setattr(_device, "smem_limit", lambda: 232448)  # the H200's per-block limit
    monkeypatch.setattr(A.config, "_env_interpret", lambda: False)
    q = torch.empty(1, 8, 2, 128, dtype=torch.float16)
    configs = [triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "USE_TMA": tma, "WARP_SPEC": False},
                             num_stages=3, num_warps=8) for tma in (False, True)]
    prune = A.config._prune(A.config._fwd_smem)
    assert prune(configs, {}, Q=q, K=q, V=q, BLOCK_D=128) == configs
    # non-16-byte-aligned rows: the TMA config goes
    odd = torch.empty(1, 8, 2, 7, dtype=torch.float16)
    assert prune(configs, {}, Q=odd, K=odd, V=odd, BLOCK_D=8) == configs[:1]
    # too much shared memory for every config (D=256 with 128x64 over 3 stages): a fallback
    (kept,) = prune(configs, {}, Q=q, K=q, V=q, BLOCK_D=256)
    assert (kept.kwargs["BLOCK_M"], kept.kwargs["BLOCK_N"]) == (64, 32)
    bwd = [triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_stages=3, num_warps=8)]
    assert A.config._prune(A.config._bwd_smem("dq"))(bwd, {}, Q=q, K=q, V=q, BLOCK_D=128) == bwd


def test_no_autotune_default_is_the_first_tile_that_fits(monkeypatch):
    # TKIT_NO_AUTOTUNE launches the first of _FWD_TILES that fits shared memory at the head dim
    monkeypatch.setattr(_device, "smem_limit", lambda: 232448)
    monkeypatch.setattr(A.config, "_env_interpret", lambda: False)

    def tile(d, itemsize=2, tma=True, block_d=None):
        c = A.config._fwd_default_config(block_d or d, itemsize, tma, d)
        return c["BLOCK_M"], c["BLOCK_N"], c["num_stages"], c["num_warps"], c["USE_TMA"]

    assert tile(64) == tile(128) == (128, 64, 3, 8, False)
    assert tile(256) == (128, 64, 2, 8, False)
    assert tile(256, itemsize=4, tma=False) == (64, 32, 2, 4, False)  # the pruner's fallback
    # D=192 pads to 256: the 128x64 two-stage pointer tile (a misaligned-address fault there on
    # the H200, causal) is pruned, and the next tile that fits is taken
    assert tile(192, block_d=256) == (64, 64, 3, 4, False)


def test_padded_head_dims_prune_the_faulting_tile(monkeypatch):
    monkeypatch.setattr(_device, "smem_limit", lambda: 232448)
    monkeypatch.setattr(A.config, "_env_interpret", lambda: False)
    q = torch.empty(1, 8, 1, 192, dtype=torch.bfloat16)
    prune = A.config._prune(A.config._fwd_smem)
    configs = A.config._fwd_configs()  # the full list: the interpreter check is patched off
    padded = prune(configs, {}, Q=q, K=q, V=q, BLOCK_D=256, HEAD_DIM=192)
    exact = prune(configs, {}, Q=q, K=q, V=q, BLOCK_D=256, HEAD_DIM=256)
    assert any(A.config._faults_when_padded(c) for c in exact)
    assert not any(A.config._faults_when_padded(c) for c in padded) and padded


def test_attention_config_scopes_the_gluon_cases():
    """The Gluon forward's cases are a scoped override, not a module global: inside the block
    the dispatch reason names the field, outside the default comes back; unknown fields are a
    TypeError naming them."""
    q = make_tensor((1, 17, 2, 128), torch.float16, seed=1)  # past the split-KV route's 16
    assert (128, False) in A.AttentionConfig().hopper_fwd_cases
    assert "not in" not in A.fwd_backend(q, q, q)  # the default serves D=128 where it can
    with A.attention_config(hopper_fwd_cases=frozenset()):
        assert "not in AttentionConfig.hopper_fwd_cases" in A.fwd_backend(q, q, q)
        with A.attention_config(hopper_fwd_cases=frozenset({(128, False)})):  # nested
            assert "not in" not in A.fwd_backend(q, q, q)
        assert "not in" in A.fwd_backend(q, q, q, causal=True)
    assert "not in" not in A.fwd_backend(q, q, q)
    with pytest.raises(TypeError, match="hopper_cases"):
        with A.attention_config(hopper_cases=frozenset()):
            pass


# ---- GPU only ------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 80, 96, 112, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hopper", [True, False], ids=["dispatch", "triton-only"])
def test_gpu_bf16_head_dims(d, causal, hopper):
    """Every head dim through the public function, with the Gluon Hopper forward and backward
    where they are dispatched (sm_90) and with the Triton kernels for everything."""
    over = {}
    if not hopper:
        if (d, causal) not in A.AttentionConfig().hopper_fwd_cases:
            pytest.skip("the Triton kernel serves this case either way")
        over = dict(hopper_fwd_cases=frozenset(), hopper_bwd_cases=frozenset())
    args = _qkv(2, 300, 300, 4, 2, d, torch.bfloat16, "cuda")
    with A.attention_config(**over):
        check_against_reference(tkit.flash_attention, S.ref_attention, args,
                                dict(causal=causal, return_lse=True), grad=True)


@pytest.mark.gpu
def test_gpu_forward_backends_agree():
    """The Gluon and Triton forwards on the same inputs: both near the reference (above),
    and near each other here (bf16 outputs within a few ulps, lse in float32)."""
    q, k, v = _qkv(2, 700, 900, 8, 2, 128, torch.bfloat16, "cuda")
    assert A.fwd_backend(q, k, v, True).startswith("gluon")
    for causal in (False, True):
        o1, l1 = A._fwd_impl(q, k, v, None, None, 700, 900, causal, 0.088, -1, -1, 0.0)
        o2, l2 = A._fwd_impl(q, k, v, None, None, 700, 900, causal, 0.088, -1, -1, 0.0,
                             config=A.config._fwd_default_config(128, 2, True, 128))
        torch.testing.assert_close(o1.float(), o2.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(l1, l2, atol=1e-3, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(256, 0)),
                                dict(causal=True, softcap=30.0)])
def test_gpu_long_sequence(kw):
    args = _qkv(1, 2048, 2048, 2, 1, 128, torch.bfloat16, "cuda")
    check_against_reference(tkit.flash_attention, S.ref_attention, args, kw, grad=True,
                            ref_dtype=torch.float32)


@pytest.mark.gpu
def test_gpu_backward_is_deterministic():
    q, k, v = (t.requires_grad_() for t in _qkv(2, 1000, 1000, 8, 2, 128, torch.bfloat16,
                                                 "cuda"))
    do = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    g1 = torch.autograd.grad(tkit.flash_attention(q, k, v, causal=True), (q, k, v), do)
    g2 = torch.autograd.grad(tkit.flash_attention(q, k, v, causal=True), (q, k, v), do)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("sq,sk,hq,hk,d,causal,window,softcap,dtype", [
    (1, 70, 4, 2, 64, True, (-1, -1), 0.0, torch.float16),
    (3, 70, 4, 1, 40, True, (5, -1), 0.0, torch.float16),
    (16, 37, 2, 2, 64, False, (-1, -1), 30.0, torch.float32),
    (4, 2, 2, 1, 32, True, (-1, -1), 0.0, torch.float16),  # early rows see no key
    (2, 5, 4, 2, 32, False, (1, 0), 0.0, torch.float32),
])
def test_few_queries_take_the_split_kv_kernel(sq, sk, hq, hk, d, causal, window, softcap,
                                              dtype, device):
    """At most 16 queries a sequence, flash_attention runs the decode family's split-KV
    kernel: fwd_backend says so; out and lse agree with this family's Triton kernel on the
    same inputs (the same visibility rule; rows without a visible key 0 and -inf) and with the
    reference, and gradients flow through the saved lse."""
    from tkit.kernels.attention import ops as AO

    q, k, v = _qkv(2, sq, sk, hq, hk, d, dtype, device, seed=sq * 7 + sk)
    assert A.fwd_backend(q, k, v).startswith("split-kv")
    opts = dict(causal=causal, window_size=window, softcap=softcap)
    out, lse = check_against_reference(tkit.flash_attention, S.ref_attention, [q, k, v],
                                       dict(opts, return_lse=True))
    cfg = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    out2, lse2 = AO._fwd_impl(q, k, v, None, None, sq, sk, causal, d ** -0.5, *window,
                              softcap, config=cfg)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(lse2))
    fin = torch.isfinite(lse2)
    torch.testing.assert_close(lse[fin], lse2[fin], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, out2, atol=2e-3 if dtype != torch.float32 else 1e-5,
                               rtol=0)
    check_against_reference(tkit.flash_attention, S.ref_attention, [q, k, v], opts,
                            grad=True, floor=GRAD_FLOOR)


def test_grids_keep_batch_times_heads_on_the_first_axis():
    """A CUDA grid's second and third axes stop at 65535: batch x heads (4096 x 32 = 131072,
    short training sequences in large batches) rides the first axis in the forward and in
    every backward kernel (the delta kernel had it on the second, a launch the driver
    refuses)."""
    from tkit.kernels.attention.ops import _bwd_impl

    b, s, h, d = 4096, 64, 32, 64
    q = torch.empty(b, s, h, d, dtype=torch.bfloat16, device="meta")
    lse = torch.empty(b, h, s, dtype=torch.float32, device="meta")
    with _common.capture_launches() as launches:
        tkit.flash_attention(q, q, q, causal=True)
        _bwd_impl(q, q, q, q, q, lse, None, None, None, s, s, True, d ** -0.5, -1, -1, 0.0)
    assert len(launches) >= 4
    for lc in launches:
        grid = lc.grid(dict(lc.kwargs, BLOCK_M=16, BLOCK_N=16)) if callable(lc.grid) else lc.grid
        assert all(g <= 65535 for g in tuple(grid)[1:]), (lc.kernel, grid)


def test_a_grid_past_cudas_limit_is_refused_clearly():
    """Query tiles ride a grid's second axis (at most 65535): a single-head sequence of 2**23
    queries passes the 32-bit span check (2**29 elements) but needs 131072 tiles of 64, which
    the driver would refuse as "invalid argument". tkit refuses it first, naming the kernel,
    for a grid given as a tuple (here the backward's) and for one computed from a config."""
    from tkit.kernels import _launch
    from tkit.kernels.attention.ops import _bwd_impl

    s, d = 2**23, 64
    q = torch.empty(1, s, 1, d, dtype=torch.bfloat16, device="meta")
    lse = torch.empty(1, 1, s, dtype=torch.float32, device="meta")
    with pytest.raises(ValueError, match="_attn_bwd_delta_kernel.*65535"):
        with _common.capture_launches():
            _bwd_impl(q, q, q, q, q, lse, None, None, None, s, s, True, d ** -0.5, -1, -1, 0.0)

    @triton.jit
    def _noop(x, BLOCK: tl.constexpr):
        pass

    x = torch.zeros(4)
    with pytest.raises(ValueError, match="_noop.*65535"):
        _launch.run(_noop, lambda meta: (1, 70000 * meta["BLOCK"] // 16), dict(x=x, BLOCK=16))
