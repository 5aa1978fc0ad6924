"""``tkit.matmul_glu``, the gated up-projection in one GEMM: the reference rule on every
path (the pointer kernel with two accumulators, split-K with the gated reduce; interpreter on
CPU), leading dims, strides, each activation and the bias, gradients, registration, errors
before any launch, the plan's choices; the Gluon kernel's gated sm_90a builds ahead of time;
on an sm_90 GPU the Gluon kernel against the reference at the layer's shapes and at edges, the
eager plan and CUDA-graph capture."""

import re

import pytest
import torch

import tkit
from tkit.ir_tools.aot import cubin_sass
from tkit.kernels import _common, _cplan, _plan
from tkit.kernels import matmul as mm
from tkit.kernels.matmul import config as MC
from tkit.specs import matmul as spec_mm
from tkit.testing import check_against_reference, make_tensor

ON_GPU = torch.cuda.is_available()


def _on_sm90():
    return ON_GPU and torch.cuda.get_device_capability() == (9, 0)


def _operands(M, N, K, dtype, device, *, lead=(), a_layout="contiguous", bias=False, seed=0):
    """a (lead..., M, K), b = w.t() of a merged (2N, K) gate/up weight, bias (2N,) or None."""
    a = make_tensor((*lead, M, K), dtype, a_layout, seed=seed + 1, device=device)
    b = make_tensor((2 * N, K), dtype, seed=seed + 2, device=device, scale=max(K, 1) ** -0.5).t()
    bb = make_tensor((2 * N,), dtype, seed=seed + 3, device=device) if bias else None
    return a, b, bb


def _forced(path, config=None):
    def fn(a, b, bias, activation):
        return mm.ops._glu_impl(a, b, bias, activation, allow_tf32=False, path=path,
                                config=config)

    return fn


def _ref(a, b, bias, activation, allow_tf32=True):
    return spec_mm.ref_matmul_glu(a, b, bias, activation)


# ---- any machine (the interpreter on CPU) ------------------------------------------------------
@pytest.mark.parametrize("M,N,K,lead,a_layout,bias,act,dtype", [
    (37, 70, 45, (), "contiguous", True, "silu", torch.float16),
    (1, 9, 33, (), "transposed", False, "gelu", torch.float32),
    (17, 24, 40, (2,), "sliced", True, "gelu_tanh", torch.float16),
    (65, 33, 17, (), "offset", True, "silu", torch.bfloat16),
])
def test_against_reference(M, N, K, lead, a_layout, bias, act, dtype, device):
    """Odd M, N, K (partial tiles everywhere), a column-major / sliced / offset a, leading
    dims folded into M, each activation, the bias on both halves, fp16 / fp32 / bf16; outputs
    poisoned."""
    a, b, bb = _operands(M, N, K, dtype, device, lead=lead, a_layout=a_layout, bias=bias)
    out = check_against_reference(tkit.matmul_glu, _ref, [a, b, bb, act],
                                  dict(allow_tf32=False) if dtype == torch.float32 else None)
    assert out.shape == (*lead, M, N) and out.dtype == dtype


@pytest.mark.parametrize("split", [1, 3])
def test_splitk_path(split, device):
    """The decode path (forced, with the split set): split 1 is the pointer kernel with the
    split tile, more splits sum float32 partials of the (M, 2N) product and apply the gated
    epilogue in the reduce (N = 70: a partial reduce tile; bias)."""
    a, b, bb = _operands(5, 70, 200, torch.float16, device, bias=True)
    cfg = MC.SplitKConfig(block_m=16, block_n=32, block_k=32, split_k=split)
    check_against_reference(_forced("splitk", cfg), _ref, [a, b, bb, "silu"])


def test_edges_and_out_dtype(device):
    """K = 0 (the epilogue of zeros: act(bias_gate) * bias_up), empty M and N, a float32
    output from fp16 operands (one rounding)."""
    a, b, bb = _operands(3, 8, 0, torch.float16, device, bias=True)
    out = tkit.matmul_glu(a, b, bb)
    want = torch.nn.functional.silu(bb[:8].float()) * bb[8:].float()
    torch.testing.assert_close(out.float(), want.expand(3, 8), rtol=1e-3, atol=1e-3)
    # K = 0 with leading dims (an H200 fuzz example: folding them by a view of (-1, 0) raised)
    a, b, bb = _operands(1, 8, 0, torch.float16, device, lead=(2,), bias=True)
    out = tkit.matmul_glu(a, b, bb)
    torch.testing.assert_close(out.float(), want.expand(2, 1, 8), rtol=1e-3, atol=1e-3)
    assert tkit.matmul_glu(*_operands(0, 8, 16, torch.float16, device)[:2]).shape == (0, 8)
    a, b, _ = _operands(4, 8, 16, torch.float16, device)
    assert tkit.matmul_glu(a, b[:, :0]).shape == (4, 0)
    a, b, bb = _operands(9, 20, 24, torch.float16, device, bias=True)
    out = check_against_reference(
        lambda a, b, bb: tkit.matmul_glu(a, b, bb, out_dtype=torch.float32),
        lambda a, b, bb: spec_mm.ref_matmul_glu(a, b, bb, "silu", torch.float32), [a, b, bb])
    assert out.dtype == torch.float32


def test_errors_name_the_argument(device):
    a, b, bb = _operands(4, 8, 16, torch.float16, device, bias=True)
    with pytest.raises(ValueError, match="even number of columns"):
        tkit.matmul_glu(a, b[:, :15])
    with pytest.raises(ValueError, match="a.shape\\[-1\\]=16 != b.shape\\[0\\]=12"):
        tkit.matmul_glu(a, b[:12])
    with pytest.raises(TypeError, match="b has dtype"):
        tkit.matmul_glu(a, b.float())
    with pytest.raises(ValueError, match="bias must have shape \\(16,\\)"):
        tkit.matmul_glu(a, b, bb[:8])
    with pytest.raises(ValueError, match="activation must be one of"):
        tkit.matmul_glu(a, b, activation="relu")
    with pytest.raises(ValueError, match="b must have 2 dimensions"):
        tkit.matmul_glu(a, b.unsqueeze(0))
    with pytest.raises(TypeError, match="out_dtype"):
        tkit.matmul_glu(a, b, out_dtype=torch.int32)
    with pytest.raises(TypeError, match="a must be a torch.Tensor"):
        tkit.matmul_glu(a.tolist(), b)
    # the fuzz recipe's forced kernels refuse what the op refuses (the reliability campaign's
    # replays move sizes: an odd 2N reached the pointer kernel, which returned N = 2N // 2)
    for path in ("ptr", "splitk"):
        with pytest.raises(ValueError, match="even number of columns"):
            spec_mm.fuzz_glu_fn(a, b[:, :15], path=path)


def test_gradients(device):
    """Backward recomputes the gate/up product and runs a linear layer's two GEMMs: every
    input's gradient (leading dims, bias) under the reference rule."""
    a, b, bb = _operands(7, 12, 20, torch.float32, device, lead=(2,), bias=True)
    check_against_reference(tkit.matmul_glu, _ref, [a, b, bb, "gelu_tanh"],
                            dict(allow_tf32=False), grad=True)


def test_torch_compile_fullgraph(device):
    a, b, bb = _operands(6, 24, 40, torch.float16, device, bias=True)
    fn = lambda a, b: tkit.matmul_glu(a, b, bb) * 2  # noqa: E731
    backend = "inductor" if ON_GPU else "aot_eager"
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(a, b), fn(a, b))


def test_glu_config_table_and_plan(monkeypatch):
    """The gated tile from the wave count (Llama-3-8B's MLP on 132 SMs), the ring that fits
    beside the half-width staging, the plan's choices and reasons (meta tensors: planned as on
    an sm_90 without being on one)."""
    G = MC.GluonConfig
    # 896 tiles of 64 output columns: 7 waves; 3584 of 128 at M = 4096
    assert G.for_glu(512, 14336, 4096) == G(block_n=128, overlap=True)
    assert G.for_glu(4096, 14336, 4096) == G(block_n=256, glu_parts=True)
    assert [G(block_n=n).stages(gated=True) for n in (128, 256)] == [6, 4]
    for n in (128, 256):
        s = G(block_n=n).stages(gated=True)
        assert MC.gluon_shared_bytes(n, s, out_cols=n // 2) <= MC.SMEM_BYTES
        assert MC.gluon_shared_bytes(n, s + 1, out_cols=n // 2) > MC.SMEM_BYTES
    from tkit.kernels.matmul import gemm_hopper as GH

    with pytest.raises(ValueError, match="block_n must be one of \\(128, 256\\)"):
        GH.glu_gated(G(block_n=192))
    with pytest.raises(TypeError, match="glu_parts"):
        G(glu_parts=1)
    with pytest.raises(ValueError, match="overlap needs block_n 128"):
        GH.glu_gated(G(block_n=256, overlap=True))
    meta = dict(device="meta", dtype=torch.bfloat16)
    x = torch.empty(512, 4096, **meta)
    w = torch.empty(2 * 14336, 4096, **meta)
    p = mm.glu_plan(x, w.t())
    assert p.path == "ptr" and "not the Gluon one" in p.reason and "CUDA" in p.reason, p
    with pytest.raises(ValueError, match="Gluon GEMM does not apply.*CUDA"):
        mm.glu_plan(x, w.t(), path="gluon")
    p = mm.glu_plan(x[:16], w.t())
    assert p.path == "splitk" and p.config.split_k == 1 and p.config.block_n == 128, p
    monkeypatch.setattr(MC._env, "INTERPRET", False)
    monkeypatch.setattr(MC, "gluon_supported", lambda *args, **kwargs: None)
    p = mm.glu_plan(x, w.t())
    assert p.path == "gluon" and p.config == G(block_n=128, overlap=True), p
    assert mm.glu_plan(torch.empty(4096, 4096, **meta), w.t()).config == G(block_n=256,
                                                                           glu_parts=True)
    with mm.matmul_config(block_n=192):  # no gated tile of that width: the pointer kernel
        p = mm.glu_plan(x, w.t())
        assert p.path == "ptr" and "block_n" in p.reason, p
    with mm.matmul_config(block_n=256, overlap=True):  # no early issue at 256: the reason
        p = mm.glu_plan(x, w.t())
        assert p.path == "ptr" and "overlap needs block_n 128" in p.reason, p
    with mm.matmul_config(glu_parts=True):
        assert mm.glu_plan(x, w.t()).config == G(block_n=128, glu_parts=True, overlap=True)
    # an output row that TMA cannot store (N = 4: 8 bytes)
    p = mm.glu_plan(x, torch.empty(8, 4096, **meta).t())
    assert p.path == "ptr" and "output rows of 8 bytes" in p.reason, p


@pytest.mark.parametrize("block_n,parts,overlap,bias", [(256, True, False, True),
                                                        (128, False, True, False)])
def test_gluon_glu_compiled_schedule(block_n, parts, overlap, bias):
    """sm_90a builds of the gated kernel's two table configs: 256 computed as two
    accumulators of 128 (bias), and 128 as one accumulator split in the epilogue with the
    next tile's first step issued before the epilogue's math: no local memory, shared memory
    within sm_90's limit and the config's count, m64 x 128 wgmmas at each issue site (two a
    K step for the two accumulators, one for the split one), the K loop's wait leaving one
    step in flight (ptxas did not serialize the wgmmas: the early issue moves the old sums to
    other registers first), TMA loads and stores, the SiLU as two MUFU an output element,
    run under a wgmma in flight when issued early."""
    try:
        from tkit.kernels.matmul import gemm_hopper as GH
    except ImportError as e:  # a Triton without Gluon's Hopper API
        pytest.skip(f"no Gluon Hopper API: {e}")
    early = overlap
    cfg = MC.GluonConfig(block_n=block_n, glu_parts=parts, overlap=overlap)
    k = GH.compile_sm90(cfg, has_bias=bias, activation="silu")
    stages = cfg.stages(gated=True)
    assert k.metadata.shared <= MC.gluon_shared_bytes(block_n, stages, out_cols=block_n // 2) \
        <= MC.SMEM_BYTES
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Za-z0-9_.]+)([^;]*);",
                     cubin_sass(k.asm["cubin"]), re.M)
    names = [op for op, _ in ops]
    assert "LDL" not in names and "STL" not in names
    sites = 2 + (2 if overlap else 0)  # (the first step and the loop; twice with overlap)
    width = block_n // 2 if parts else block_n
    n = names.count(f"HGMMA.64x{width}x16.F32.BF16")
    assert n == 2 * sites * 4 * (2 if parts else 1), n
    waits = [rest.strip() for op, rest in ops if op == "WARPGROUP.DEPBAR.LE"]
    assert f"gsb0, {hex(2 if parts else 1)}" in waits and "gsb0, 0x0" in waits
    assert "UTMALDG.2D" in names and "UTMASTG.2D" in names
    # 64 x block_n / 2 outputs a warpgroup of 128 threads, two MUFU each (exp2, reciprocal),
    # at one epilogue site a consumer (two with overlap: the loop's and the peeled last
    # tile's); a few more for the tile loop's integer divisions
    mufu = sum(op.startswith("MUFU") for op in names)
    epilogues = 2 * (2 if overlap else 1) * 2 * 64 * (block_n // 2) // 128
    assert epilogues <= mufu <= epilogues + 16, mufu
    pending, in_flight = False, 0
    for op, rest in ops:
        if op.startswith("HGMMA"):
            pending = True
        elif op == "WARPGROUP.DEPBAR.LE" and rest.strip().endswith("0x0"):
            pending = False
        elif op.startswith("MUFU") and pending:
            in_flight += 1
    # early: the loop's epilogue (half of them; the peeled last tile's has no next tile)
    assert (in_flight >= epilogues // 2) == early, in_flight


# ---- GPU: sm_90 ------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("block_n,overlap,parts", [
    (128, False, False), (128, True, False), (128, True, True), (256, False, True),
    (256, False, False)])
@pytest.mark.parametrize("M,N,K,bias,act", [
    (300, 200, 1000, True, "silu"),  # N not a multiple of 64 / 128, M of 128, K of 64
    (129, 72, 72, False, "gelu"),
    (2048, 1160, 1024, True, "silu"),  # several tiles a CTA
    (77, 4104, 64, False, "gelu_tanh"),  # one K step
])
def test_gluon_glu_against_reference(block_n, overlap, parts, M, N, K, bias, act):
    """Forced Gluon kernel, bf16, each computed width and accumulator form, at 128 with and
    without the next tile's first step issued before the epilogue's math: partial
    tiles along M, N (the gate's last tile reads past N into the up rows: those columns are
    clipped by the store) and K, several tiles a CTA, one K step; the reference rule."""
    a, b, bb = _operands(M, N, K, torch.bfloat16, "cuda", bias=bias, seed=M + N + K)
    cfg = MC.GluonConfig(block_n=block_n, overlap=overlap, glu_parts=parts)
    check_against_reference(_forced("gluon", cfg), _ref, [a, b, bb, act])


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("M,dtype", [(512, torch.bfloat16), (4096, torch.bfloat16),
                                     (512, torch.float16), (1, torch.bfloat16),
                                     (16, torch.bfloat16), (200, torch.bfloat16)])
def test_layer_shapes(M, dtype):
    """Llama-3-8B's MLP (K 4096, N 14336) through tkit.matmul_glu: the Gluon kernel (the
    split-K path at M <= 64, plan says which), the reference rule, and within rounding of the
    layer's former tkit.matmul + tkit.silu_mul."""
    a, b, _ = _operands(M, 14336, 4096, dtype, "cuda", seed=M)
    p = mm.glu_plan(a, b)
    assert p.path == ("splitk" if M <= 64 else "gluon"), p
    out = check_against_reference(tkit.matmul_glu, _ref, [a, b, None, "silu"])
    y = tkit.matmul(a, b)
    two = tkit.silu_mul(y[:, :14336], y[:, 14336:])
    torch.testing.assert_close(out.float(), two.float(), rtol=2 ** -6, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
def test_eager_plan_and_graph_capture():
    """A repeated eager call is served by its plan (the descriptors encoded again over the
    call's tensors) with the ordinary path's bits, on new data too; the call captures into a
    CUDA graph and replays with new inputs; a leading dim folds into M and takes it too."""
    a, b, bb = _operands(512, 1536, 1024, torch.bfloat16, "cuda", bias=True, seed=21)
    first = tkit.matmul_glu(a, b, bb)
    before = _plan.stats["plan"]
    again = tkit.matmul_glu(a, b, bb)
    assert _plan.stats["plan"] == before + 1, "the eager plan did not serve the second call"
    assert torch.equal(first, again)
    if _cplan.status() == "ready":
        assert any(type(p).__name__ == "Plan" for p in mm._glu_plans.values() if p)
    a2, w2 = torch.randn_like(a), torch.randn_like(b.t())
    for x, wt in ((a2, w2), (a, w2), (a2, b.t())):
        with _common.poisoned_outputs():
            want = mm.ops._glu_impl(x, wt.t(), bb)
        assert torch.equal(tkit.matmul_glu(x, wt.t(), bb), want)
    with _common.poisoned_outputs():
        want = mm.ops._glu_impl(a2, b, bb)
    g = torch.cuda.CUDAGraph()
    static = a.clone()
    with torch.cuda.graph(g):
        out = tkit.matmul_glu(static, b, bb)
    static.copy_(a2)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    assert torch.equal(tkit.matmul_glu(a2.view(4, 128, 1024), b, bb).view(512, 1536), want)

