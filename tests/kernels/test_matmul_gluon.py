"""The 16-bit GEMM's warp-specialized Gluon kernel for Hopper (``matmul/gemm_hopper.py``):
its config table and scope on any machine, its sm_90a build ahead of time (registers, shared
memory, the schedule in the SASS), and on an sm_90 GPU the reference rule over ragged shapes,
each tile, bias and residual, fp16, the dispatch inside ``tkit.matmul``, the eager plans and
CUDA-graph capture."""

import os
import re
import subprocess

import pytest
import torch

import tkit
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
    assert mm.plan(torch.empty(4096, 4096, **meta), w.t()).config.block_n == 256
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


def _sass(kernel) -> str:
    import tempfile

    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        return subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", path],
                              capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("block_n,bias,res", [(256, True, True), (192, False, True),
                                              (128, False, False)])
def test_gluon_compiled_schedule(block_n, bias, res):
    """sm_90a builds of the widest tile with every epilogue (the most registers: a 64 x 256
    float32 accumulator and the residual), the two-part tile (192 = 128 + 64) and the
    128-wide one: no local memory, shared memory within sm_90's limit and the config's count,
    a wgmma m64 x part x 16 four times a K step per part, the K loop's wait leaving one step
    in flight (``wait_group`` 1 for one part, 2 for two), TMA loads and stores."""
    GH = _gluon_or_skip()
    cfg = MC.GluonConfig(block_n=block_n)
    k = GH.compile_sm90(cfg, has_bias=bias, has_res=res)
    assert k.metadata.shared <= MC.gluon_shared_bytes(block_n, cfg.stages()) <= MC.SMEM_BYTES
    sass = _sass(k)
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Za-z0-9_.]+)([^;]*);",
                     sass, re.M)
    names = [op for op, _ in ops]
    assert "LDL" not in names and "STL" not in names
    parts = GH.column_parts(block_n)
    for w in set(parts):
        n = names.count(f"HGMMA.64x{w}x16.F32.BF16")
        # 2 consumers x (first step + loop) x 4 k16 a step, per part of that width
        assert n == 2 * 2 * 4 * parts.count(w), (w, n)
    waits = [rest.strip() for op, rest in ops if op == "WARPGROUP.DEPBAR.LE"]
    assert f"gsb0, {hex(len(parts))}" in waits and "gsb0, 0x0" in waits
    assert "UTMALDG.2D" in names and "UTMASTG.2D" in names


# ---- GPU: sm_90 ------------------------------------------------------------------------------
def _linear_case(M, N, K, dtype, seed):
    a = make_tensor((M, K), dtype, seed=seed, device="cuda")
    w = make_tensor((N, K), dtype, seed=seed + 1, device="cuda", scale=K ** -0.5)
    return a, w


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("block_n", [128, 192, 256])
@pytest.mark.parametrize("M,N,K", [(300, 528, 1000), (129, 200, 72), (1000, 392, 4104),
                                   (2048, 2304, 1024), (128, 8, 16), (77, 6144, 64)])
def test_gluon_against_reference(block_n, M, N, K):
    """Forced Gluon kernel, bf16, bias and a row-major residual: partial tiles along M, N
    (N = 200 in a 192 tile: the second part partial) and K (1000, 4104, 72: a partial last
    step), several tiles a CTA (2048 x 2304), one K step (K = 16, 64), the reference rule."""
    a, w = _linear_case(M, N, K, torch.bfloat16, seed=M + N + K)
    bias = make_tensor((N,), torch.bfloat16, seed=3, device="cuda")
    res = make_tensor((M, N), torch.bfloat16, seed=4, device="cuda")
    cfg = MC.GluonConfig(block_n=block_n)

    def fn(a, w, bias, res):
        return mm.ops._matmul_impl(a, w.t(), bias, res, path="gluon", config=cfg)

    check_against_reference(fn, lambda a, w, bias, res: spec_mm.ref_matmul(a, w.t(), bias,
                                                                            None, res),
                            [a, w, bias, res])


def _epilogue_case(dtype, epilogue, cfg, M=640):
    N, K = 1536, 1088
    a, w = _linear_case(M, N, K, dtype, seed=7)
    bias = res = None
    if "bias" in epilogue:
        bias = make_tensor((2 * N,), dtype, seed=5, device="cuda")[::2] \
            if epilogue == "strided bias" else make_tensor((N,), dtype, seed=5, device="cuda")
    if "res" in epilogue:
        res = make_tensor((M, N), dtype, seed=6, device="cuda")

    def fn(a, w, bias, res):
        return mm.ops._matmul_impl(a, w.t(), bias, res, path="gluon", config=cfg)

    check_against_reference(fn, lambda a, w, bias, res: spec_mm.ref_matmul(a, w.t(), bias,
                                                                            None, res),
                            [a, w, bias, res])


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("dtype,epilogue", [(torch.bfloat16, "plain"),
                                            (torch.bfloat16, "strided bias"),
                                            (torch.bfloat16, "res"), (torch.float16, "bias res")])
def test_gluon_epilogues(dtype, epilogue):
    """Each epilogue, both 16-bit dtypes, at the table's tile (640 x 1536: 60 tiles of 128
    columns); every element written (outputs poisoned)."""
    _epilogue_case(dtype, epilogue, None)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("block_n,stages,group_m", [(128, 2, 1), (256, 2, 16), (192, 0, 8)])
def test_gluon_stages_and_order(block_n, stages, group_m):
    """A 2-slot ring (the producer a whole ring ahead at once), the tile order's extremes, and
    the residual with several tiles a CTA (2048 rows: its staging tile reused)."""
    cfg = MC.GluonConfig(block_n=block_n, num_stages=stages, group_m=group_m)
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
