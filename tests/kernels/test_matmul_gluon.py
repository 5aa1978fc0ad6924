"""The 16-bit GEMM's warp-specialized Gluon kernel for Hopper (``matmul/gemm_hopper.py``):
its config table and scope on any machine, its sm_90a build ahead of time (registers, shared
memory, the schedule in the SASS), and on an sm_90 GPU the reference rule over ragged shapes,
each tile, bias and residual, fp16, the dispatch inside ``tkit.matmul``, the eager plans and
CUDA-graph capture."""

import dataclasses
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


def _gluon_or_skip():
    try:
        from tkit.kernels.matmul import gemm_hopper as GH
    except ImportError as e:  # a Triton without Gluon's Hopper API
        pytest.skip(f"no Gluon Hopper API: {e}")
    return GH


def _on_sm90():
    return ON_GPU and torch.cuda.get_device_capability() == (9, 0)


def _check_gluon(cfg, a, w, bias=None, res=None):
    """The Gluon kernel at ``cfg`` (forced) on a @ w.t() (+ bias) (+ res) against the
    reference under the reference rule."""
    def fn(a, w, bias, res):
        return mm.ops._matmul_impl(a, w.t(), bias, res, path="gluon", config=cfg)

    check_against_reference(fn, lambda a, w, bias, res: spec_mm.ref_matmul(a, w.t(), bias,
                                                                            None, res),
                            [a, w, bias, res])


# ---- any machine ------------------------------------------------------------------------------
def test_gluon_config_table_and_validation():
    """The tile width from the wave count (Llama-3-8B's projections on 132 SMs), the stages
    that fit, and errors naming the field."""
    G = MC.GluonConfig
    assert G.for_shape(512, 6144, 4096).block_n == 192  # 128 tiles: one wave
    assert G.for_shape(512, 4096, 4096).block_n == 128  # 128 tiles
    assert G.for_shape(512, 4096, 14336).block_n == 128
    assert G.for_shape(4096, 6144, 4096).block_n == 256
    assert G.for_shape(4096, 28672, 4096).block_n == 256
    assert [G(block_n=n).stages() for n in (128, 192, 256)] == [6, 4, 3]
    for n in (128, 192, 256):
        assert MC.gluon_shared_bytes(n, G(block_n=n).stages()) <= MC.SMEM_BYTES
        assert MC.gluon_shared_bytes(n, G(block_n=n).stages() + 1) > MC.SMEM_BYTES
    assert G(block_n=192, num_stages=3).stages() == 3
    with pytest.raises(ValueError, match="block_n"):
        G(block_n=64)
    with pytest.raises(ValueError, match="num_stages"):
        G(num_stages=1)
    with pytest.raises(ValueError, match="group_m"):
        G(group_m=0)
    with pytest.raises(TypeError, match="overlap"):
        G(overlap=1)
    # the next tile's first step under the stores: 256-wide tiles without a residual
    assert G.for_shape(4096, 28672, 4096) == G(block_n=256, overlap=True)
    assert G.for_shape(4096, 4096, 4096, has_res=True) == G(block_n=256)
    assert not G.for_shape(512, 28672, 4096).overlap  # 128 wide
    assert not G.for_shape(512, 6144, 4096).overlap  # 192 wide

    with mm.matmul_config(block_n=192, group_m=4):
        assert MC.current(G()) == G(block_n=192, group_m=4)


def test_gluon_scope_reasons():
    """supported() names what keeps a call on the Triton kernels (no GPU needed: the device
    is checked last); plan() reports it, and a forced Gluon path that does not apply is a
    ValueError naming the reason."""
    GH = _gluon_or_skip()
    meta = dict(device="meta", dtype=torch.bfloat16)
    a = torch.empty(512, 1024, **meta)
    w = torch.empty(768, 1024, **meta)
    bf = torch.bfloat16
    assert "K-major" in GH.supported(a, w.t().contiguous(), bf)
    assert "row-major" in GH.supported(a.t().contiguous().t(), w.t(), bf)
    assert "output dtype" in GH.supported(a, w.t(), torch.float32)
    assert "activation" in GH.supported(a, w.t(), bf, activation="silu")
    assert "scales" in GH.supported(a, w.t(), bf, scaled=True)
    assert "bf16/fp16" in GH.supported(a.float(), w.t().float(), torch.float32)
    res = torch.empty(512, 768, **meta)
    assert "residual" in GH.supported(a, w.t(), bf, residual=res.float())
    assert "residual" in GH.supported(a, w.t(), bf, residual=res[:1].expand(512, 768))
    assert "output rows" in GH.supported(a, torch.empty(1020, 1024, **meta).t(), bf)
    assert "CUDA" in GH.supported(a, w.t(), bf, residual=res)
    p = mm.plan(a, w.t())  # meta tensors: planned as an sm_90, kept on the Triton kernel here
    assert p.path == "tma" and "not the Gluon one" in p.reason and "CUDA" in p.reason
    with pytest.raises(ValueError, match="Gluon GEMM does not apply.*CUDA"):
        mm.plan(a, w.t(), path="gluon")


def test_gluon_dispatch_follows_the_wave_model(monkeypatch):
    """Where the Gluon kernel takes the operands (stood in for here: meta tensors are not on a
    GPU), plan() picks it with the table's tile, except where the Triton kernel's wave model
    takes 64-row tiles (few 128-row ones) or TKIT_AUTOTUNE tunes the Triton kernel."""
    monkeypatch.setattr(MC._env, "INTERPRET", False)
    monkeypatch.setattr(MC, "gluon_supported", lambda *args, **kwargs: None)
    meta = dict(device="meta", dtype=torch.bfloat16)
    x = torch.empty(512, 4096, **meta)
    w = torch.empty(6144, 4096, **meta)
    p = mm.plan(x, w.t())
    assert p.path == "gluon" and p.config == MC.GluonConfig(block_n=192), p
    assert mm.plan(torch.empty(4096, 4096, **meta), w.t()).config == MC.GluonConfig(
        block_n=256, overlap=True)
    o = torch.empty(4096, 4096, **meta)
    assert mm.plan(o, o.t(), residual=o).config == MC.GluonConfig(block_n=256)  # no overlap
    p = mm.plan(x[:256], torch.empty(4096, 4096, **meta).t())
    assert p.path == "tma" and "64-row tiles at M=256" in p.reason
    # the down-projection: K = 14336 in one wave (M = 512) takes it, over 4 waves does not
    down = torch.empty(4096, 14336, **meta).t()
    assert mm.plan(torch.empty(512, 14336, **meta), down).path == "gluon"
    p = mm.plan(torch.empty(4096, 14336, **meta), down)
    assert p.path == "tma" and "K=14336 over 4 waves" in p.reason
    with mm.matmul_config(block_n=64):  # no Gluon tile: the Triton kernel, with the reason
        p = mm.plan(x, w.t())
        assert p.path == "tma" and "block_n" in p.reason
    monkeypatch.setattr(MC._env, "AUTOTUNE", True)
    monkeypatch.setattr(MC._env, "NO_AUTOTUNE", False)
    assert "TKIT_AUTOTUNE" in mm.plan(x, w.t()).reason


def test_plan_descriptors_of_views():
    """An eager plan rebuilds a host descriptor per call over the call's tensor: accepted for
    the tensor as it is, its transpose (a K-major weight described as the (N, K) matrix) and
    a view merging leading dimensions; refused for anything else."""
    class Desc:
        def __init__(self, shape, strides):
            self.shape, self.strides = shape, strides

    w = torch.empty(768, 1024)
    b = w.t()
    assert _plan._same_view(Desc([768, 1024], [1024, 1]), b)
    assert _plan._same_view(Desc([1024, 768], [1, 1024]), b)
    x = torch.empty(4, 128, 1024)
    assert _plan._same_view(Desc([512, 1024], [1024, 1]), x)
    assert not _plan._same_view(Desc([512, 1024], [2048, 1]), x)
    assert not _plan._same_view(Desc([256, 1024], [1024, 1]), x)  # part of it: not a view
    assert not _plan._same_view(Desc([512, 1024], [1024, 1]), x.transpose(0, 1))
    # a stack of nn.Linear weights passed transposed (the grouped GEMM's b) as one matrix
    ws = torch.empty(8, 96, 1024)
    assert _plan._same_view(Desc([768, 1024], [1024, 1]), ws.transpose(1, 2))
    assert not _plan._same_view(Desc([384, 1024], [1024, 1]), ws[::2].transpose(1, 2))


@pytest.mark.parametrize("block_n,bias,res,overlap", [(256, True, True, True),
                                                      (192, False, True, False),
                                                      (128, False, False, False)])
def test_gluon_compiled_schedule(block_n, bias, res, overlap):
    """sm_90a builds of the widest tile with every epilogue (the most registers: a 64 x 256
    float32 accumulator and the residual) and the next tile's first step under the stores,
    the two-part tile (192 = 128 + 64) and the 128-wide one in the plain order: no local
    memory, shared memory within sm_90's limit and the config's count, a wgmma m64 x part x
    16 four times a K step per part at each place a step is issued, the K loop's wait
    leaving one step in flight (``wait_group`` 1 for one part, 2 for two: ptxas did not
    serialize the wgmmas), TMA loads and stores."""
    GH = _gluon_or_skip()
    cfg = MC.GluonConfig(block_n=block_n, overlap=overlap)
    k = GH.compile_sm90(cfg, has_bias=bias, has_res=res)
    assert k.metadata.shared <= MC.gluon_shared_bytes(block_n, cfg.stages()) <= MC.SMEM_BYTES
    sass = cubin_sass(k.asm["cubin"])
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Za-z0-9_.]+)([^;]*);",
                     sass, re.M)
    names = [op for op, _ in ops]
    assert "LDL" not in names and "STL" not in names
    parts = GH.column_parts(block_n)
    # places a K step is issued, per consumer: the tile's first step and the loop; with
    # overlap each twice (before the tile loop and under the stores; the loop and the peeled
    # last tile's), plus the step before the residual's load in both mainloops
    sites = 2 + (2 + 2 * res if overlap else 0)
    for w in set(parts):
        n = names.count(f"HGMMA.64x{w}x16.F32.BF16")
        assert n == 2 * sites * 4 * parts.count(w), (w, n)
    waits = [rest.strip() for op, rest in ops if op == "WARPGROUP.DEPBAR.LE"]
    assert f"gsb0, {hex(len(parts))}" in waits and "gsb0, 0x0" in waits
    assert "UTMALDG.2D" in names and "UTMASTG.2D" in names
    # with overlap, a tile's output goes to shared memory while the next tile's first wgmma
    # is in flight; without, only after the last wgmma retired
    assert _stsm_in_flight(ops) == overlap


def _stsm_in_flight(ops) -> bool:
    """Whether some STSM is issued while a wgmma group is still pending (after an HGMMA, with
    no ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` since)."""
    pending = False
    for op, rest in ops:
        if op.startswith("HGMMA"):
            pending = True
        elif op == "WARPGROUP.DEPBAR.LE" and rest.strip().endswith("0x0"):
            pending = False
        elif op.startswith("STSM") and pending:
            return True
    return False


# ---- GPU: sm_90 ------------------------------------------------------------------------------
def _linear_case(M, N, K, dtype, seed):
    a = make_tensor((M, K), dtype, seed=seed, device="cuda")
    w = make_tensor((N, K), dtype, seed=seed + 1, device="cuda", scale=K ** -0.5)
    return a, w


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("block_n", [128, 192, 256])
@pytest.mark.parametrize("M,N,K", [(300, 528, 1000), (129, 200, 72), (1000, 392, 4104),
                                   (2048, 2304, 1024), (128, 8, 16), (77, 6144, 64),
                                   (4096, 4096, 128)])
def test_gluon_against_reference(block_n, overlap, M, N, K):
    """Forced Gluon kernel, bf16, bias and a row-major residual: partial tiles along M, N
    (N = 200 in a 192 tile: the second part partial) and K (1000, 4104, 72: a partial last
    step), several tiles a CTA (2048 x 2304; 4096 x 4096: 4-8 with two K steps), one K step
    (K = 16, 64), the reference rule; with and without the next tile's first step issued
    under the stores."""
    a, w = _linear_case(M, N, K, torch.bfloat16, seed=M + N + K)
    bias = make_tensor((N,), torch.bfloat16, seed=3, device="cuda")
    res = make_tensor((M, N), torch.bfloat16, seed=4, device="cuda")
    _check_gluon(MC.GluonConfig(block_n=block_n, overlap=overlap), a, w, bias, res)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("M,N,K,bias", [(4096, 4096, 128, False), (2000, 6144, 200, True),
                                        (77, 4104, 64, False)])
def test_gluon_overlap_without_residual(M, N, K, bias):
    """The table's 256-wide tile without a residual (the next tile's first step under the
    stores) through tkit.matmul: several tiles a CTA (512 of 128 x 256; 384 with partial rows
    and a partial K step, bias), one partial tile a CTA (the peeled last tile alone)."""
    a, w = _linear_case(M, N, K, torch.bfloat16, seed=M + K)
    b = make_tensor((N,), torch.bfloat16, seed=9, device="cuda") if bias else None
    cfg = MC.GluonConfig(block_n=256, overlap=True)
    if M > 1000:  # plan() runs the table's config, with overlap where it is 256 wide
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        table = MC.GluonConfig.for_shape(M, N, K, sms)
        assert mm.plan(a, w.t(), bias=b).config == table
        assert table.overlap == (table.block_n == 256)
        assert sms != 132 or table == cfg  # the H200's 132 SMs: 256 wide
    _check_gluon(cfg, a, w, b)


def _epilogue_case(dtype, epilogue, cfg, M=640):
    N, K = 1536, 1088
    a, w = _linear_case(M, N, K, dtype, seed=7)
    bias = res = None
    if "bias" in epilogue:
        bias = make_tensor((2 * N,), dtype, seed=5, device="cuda")[::2] \
            if epilogue == "strided bias" else make_tensor((N,), dtype, seed=5, device="cuda")
    if "res" in epilogue:
        res = make_tensor((M, N), dtype, seed=6, device="cuda")
    _check_gluon(cfg, a, w, bias, res)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("dtype,epilogue,overlap", [
    (torch.bfloat16, "plain", False), (torch.bfloat16, "strided bias", False),
    (torch.bfloat16, "res", False), (torch.float16, "bias res", False),
    (torch.bfloat16, "strided bias", True), (torch.float16, "bias res", True)])
def test_gluon_epilogues(dtype, epilogue, overlap):
    """Each epilogue, both 16-bit dtypes, at the table's tile (640 x 1536: 60 tiles of 128
    columns); every element written (outputs poisoned)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = MC.current(MC.GluonConfig.for_shape(640, 1536, 1088, sms))
    _epilogue_case(dtype, epilogue, dataclasses.replace(cfg, overlap=overlap))


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("block_n,stages,group_m,overlap", [
    (128, 2, 1, False), (256, 2, 16, False), (192, 0, 8, False), (128, 2, 1, True),
    (256, 2, 16, True), (256, 0, 8, True)])
def test_gluon_stages_and_order(block_n, stages, group_m, overlap):
    """A 2-slot ring (the producer a whole ring ahead at once; with overlap the next tile's
    first step takes a slot while the stores run), the tile order's extremes, and the
    residual with several tiles a CTA (2048 rows: its staging tile reused)."""
    cfg = MC.GluonConfig(block_n=block_n, num_stages=stages, group_m=group_m,
                         overlap=overlap)
    _epilogue_case(torch.bfloat16, "bias res", cfg)
    _epilogue_case(torch.bfloat16, "res", cfg, M=2048)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
def test_gluon_is_the_default_and_matches_triton():
    """tkit.matmul on a K-major weight takes the Gluon kernel (plan says so) at the layer's
    shapes, with and without the residual; other layouts and epilogues keep Triton; the
    result is within rounding of the Triton TMA kernel's."""
    a, w = _linear_case(512, 6144, 4096, torch.bfloat16, seed=11)
    res = make_tensor((512, 6144), torch.bfloat16, seed=12, device="cuda")
    p = mm.plan(a, w.t(), residual=res)
    assert p.path == "gluon" and p.config.block_n == 192, p
    assert mm.plan(a, w.t(), activation="silu").path == "tma"
    assert mm.plan(a, w.t().contiguous()).path == "tma"
    assert mm.plan(a[:64], w.t()).path != "gluon"
    out = check_against_reference(
        lambda a, w, res: tkit.matmul(a, w.t(), residual=res),
        lambda a, w, res: spec_mm.ref_matmul(a, w.t(), None, None, res), [a, w, res])
    tri = mm.ops._matmul_impl(a, w.t(), None, res, path="tma")
    torch.testing.assert_close(out.float(), tri.float(), rtol=2 ** -7, atol=2e-2)
    # a batched activation folds into M and still takes it
    x = a.view(4, 128, 4096)
    torch.testing.assert_close(tkit.matmul(x, w.t()).view(512, 6144).float(),
                               mm.ops._matmul_impl(a, w.t(), path="tma").float(),
                               rtol=2 ** -7, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
def test_gluon_eager_plan_and_graph_capture():
    """A repeated eager call is served by its plan (host descriptors rebuilt over the call's
    tensors, w.t() included) with the same bits as the ordinary path, on new data too; the
    call captures into a CUDA graph and replays with new inputs."""
    a, w = _linear_case(512, 4096, 4096, torch.bfloat16, seed=21)
    res = make_tensor((512, 4096), torch.bfloat16, seed=22, device="cuda")
    first = tkit.matmul(a, w.t(), residual=res)
    before = _plan.stats["plan"]
    again = tkit.matmul(a, w.t(), residual=res)
    assert _plan.stats["plan"] == before + 1, "the eager plan did not serve the second call"
    assert torch.equal(first, again)
    a2 = torch.randn_like(a)
    with _common.poisoned_outputs():
        want = mm.ops._matmul_impl(a2, w.t(), None, res)
    assert torch.equal(tkit.matmul(a2, w.t(), residual=res), want)
    if _cplan.status() == "ready":  # the plan is the C++ executor's, encoding the tensor maps
        plans = [p for c in (mm._plans, mm._epi_plans) for p in c.values() if p]
        assert any(type(p).__name__ == "Plan" for p in plans), plans
    # new tensors behind every descriptor (weight, input, residual; the output is new each
    # call): each map is encoded again, and a call back on the first tensors reuses none
    w2, res2 = torch.randn_like(w), torch.randn_like(res)
    for x, wt, r in ((a2, w2, res2), (a, w, res2), (a2, w2, res)):
        with _common.poisoned_outputs():
            want_x = mm.ops._matmul_impl(x, wt.t(), None, r)
        assert torch.equal(tkit.matmul(x, wt.t(), residual=r), want_x)
    g = torch.cuda.CUDAGraph()
    static = a.clone()
    with torch.cuda.graph(g):
        out = tkit.matmul(static, w.t(), residual=res)
    static.copy_(a2)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
