"""The INT4 decode GEMM in CUDA (tkit.cuda_ext.gemm_int4, csrc/gemm_int4_sm90.cu) and its
dispatch from tkit.matmul_int4: builds and their limits on any machine; on a GPU, against the
float64 reference over rows of a, group sizes, dtypes, partial K steps and column tiles,
stream-K splits (the same bits whoever finishes a tile), the counters back at zero, CUDA-graph
replay, and the fall-back to the Triton kernels with the reason."""

import pytest
import torch

import tkit
from tkit import registry
from tkit.cuda_ext import gemm_int4 as G4
from tkit.kernels.matmul import int4 as I4
from tkit.testing import check_against_reference, make_tensor, poisoned_outputs

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


# ---- any machine ----------------------------------------------------------------------------
def test_config_picks_the_build_and_checks_its_limits():
    """Rows of a pick the n8 tiles (8, 16 or 32 rows), the group size the scale rows a 512-deep
    step holds; a group that straddles steps, too few stages or too much shared memory are
    refused by name."""
    c1 = G4.config(1, BF16, F16, 128)
    assert (c1["nt"], c1["sr"]) == (1, 4) and "-DNT=1" in c1["options"]
    c16 = G4.config(16, F16, F32, 32)
    assert (c16["nt"], c16["sr"]) == (2, 16) and "-DACT_F16=1" in c16["options"]
    assert G4.config(9, BF16, BF16, 1024)["sr"] == 1
    c32 = G4.config(32, BF16, F16, 128)
    assert c32["nt"] == 4 and "-DSTAGES" not in " ".join(c32["options"])  # 3 slots fit
    assert "-DSTAGES=2" in G4.config(32, F16, F32, 32)["options"]  # as many as fit
    assert c16["smem"] <= G4.SMEM_LIMIT
    with pytest.raises(ValueError, match="group_size=384"):
        G4.config(4, BF16, F16, 384)
    with pytest.raises(ValueError, match="stages"):
        G4.config(4, BF16, F16, 128, stages=1)
    with pytest.raises(ValueError, match="shared memory"):
        G4.config(16, BF16, F32, 32, stages=8)


def _case(M, N, K, G, dtype=BF16, sym=False, scale_dtype=None, seed=0):
    w = make_tensor((N, K), dtype, seed=2 + seed, device=DEV)
    q, s, z = tkit.quantize_int4(w, G, symmetric=sym)
    if scale_dtype is not None:
        s = s.to(scale_dtype)
        z = z.to(scale_dtype) if z is not None else None
    a = make_tensor((M, K), dtype, seed=1 + seed, device=DEV)
    return a, q, s, z


def _want(a, q, s, z, G, bias=None):
    """The float64 product a @ dequant(w).T (+ bias) and the tolerance of a 16-bit output
    against it: 2^-7 of its largest value."""
    want = a.double() @ I4.dequantize_int4(q, s, z, group_size=G).double().t()
    if bias is not None:
        want += bias.double()
    return want, 2.0 ** -7 * float(want.abs().max())


def test_dispatch_off_gpu_says_why_and_forcing_it_fails_by_name():
    """Off a CUDA device (or outside M = 2..32 unforced) the Triton kernels serve and
    ``backend`` says why; ``path='cuda'`` where it cannot serve is a ValueError with the
    reason, not a silent fall-back."""
    a, q, s, z = _case(4, 64, 256, 128)
    if not ON_GPU:
        assert "not on a CUDA device" in I4.backend(a, q, s, z, group_size=128)
        with I4.int4_config(path="cuda"), pytest.raises(ValueError, match="CUDA INT4"):
            tkit.matmul_int4(a, q, s, z, group_size=128)
    a1 = a[:1]
    assert I4.cuda_reason(a1, q, s, z, 128, None).startswith("M=1 is outside")
    # forced, the ring's slots are the kernel's own choice unless num_stages is given (32
    # rows with fp32 scales in groups of 32 fit two slots, not three)
    with I4.int4_config(path="cuda"):
        assert I4.current_config(32, 4096, 1088, 32, 132).num_stages == 0
    assert I4.backend(a1, q, s, z, group_size=128).startswith("triton gemv")


# ---- GPU ------------------------------------------------------------------------------------
def _forced(a, q, s, z, G, bias=None, **cfg):
    with I4.int4_config(path="cuda", **cfg):
        return tkit.matmul_int4(a, q, s, z, group_size=G, bias=bias)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,G,dtype,sym,sdt,bias", [
    (1, 14336 // 4, 4096, 128, BF16, False, F16, False),
    (2, 416, 576, 32, BF16, True, BF16, True),        # a partial last step (576 = 512 + 64)
    (3, 2048, 1536, 64, F16, False, F32, True),
    (8, 96, 2048, 256, BF16, False, BF16, False),     # one column tile, 32 columns short
    (9, 4096, 1024, 512, F16, True, F16, False),      # 16 rows of a (one row past 8)
    (16, 1056, 3072, 1024, BF16, False, F16, True),   # groups of two steps
    (3, 2048, 512, 512, F16, False, F16, False),      # one group: scales of one row
    (24, 1024, 2048, 128, BF16, False, BF16, True),   # four n8 tiles, 8 rows past M
    (32, 4096, 1088, 32, F16, True, F32, False),      # 32 rows, fp32 scales: two stages
    (16, 8192, 8192, 128, F16, False, F16, False),
])
def test_against_reference(M, N, K, G, dtype, sym, sdt, bias):
    """Forced onto the CUDA kernel: float64 reference (dequantize, then matmul), outputs
    poisoned first; every group size it takes, fp16 / bf16 / fp32 scales, symmetric weights,
    bias, N not a multiple of the 128-column tile, K not of the 512-deep step."""
    a, q, s, z = _case(M, N, K, G, dtype, sym, sdt, seed=M)
    b = make_tensor((N,), dtype, seed=7, device=DEV) if bias else None
    spec = registry.get("matmul_int4")
    assert I4.cuda_reason(a, q, s, z, G, b, forced=True) is None
    with I4.int4_config(path="cuda"), poisoned_outputs():
        check_against_reference(spec.fn, spec.reference, (a, q, s, z),
                                dict(group_size=G, bias=b))


def _every_code_case(M):
    """Each of the 16 codes at each of the 8 nibbles of a word over 128 columns, zero points
    0..15 and a fractional one, M rows of a: (a, qweight, scales, zeros, group size)."""
    N, K, G = 128, 1024, 128
    codes = torch.arange(N * K, device=DEV).view(N, K) % 16
    codes = (codes + torch.arange(N, device=DEV)[:, None] // 8) % 16
    q = I4.pack_int4(codes.to(torch.int32))
    s = (torch.rand(K // G, N, device=DEV) + 0.5).half()
    z = (torch.arange(K // G * N, device=DEV).view(K // G, N) % 16).half()
    z[0, :7] = 7.5
    return make_tensor((M, K), BF16, seed=3, device=DEV), q, s, z, G


@pytest.mark.gpu
def test_every_code_in_every_nibble():
    """Each of the 16 codes at each of the 8 nibbles of a word, against zero points 0..15 and
    a fractional one: the LOP3 dequantization and the K permutation of the MMA operands."""
    a, q, s, z, G = _every_code_case(3)
    spec = registry.get("matmul_int4")
    with I4.int4_config(path="cuda"):
        check_against_reference(spec.fn, spec.reference, (a, q, s, z), dict(group_size=G))


@pytest.mark.gpu
def test_stream_k_splits_are_deterministic_and_counters_rest_at_zero():
    """Any number of CTAs gives the reference's result; a fixed grid gives the same bits every
    call (the pieces of a tile are added in CTA order, whoever finishes); every tile's counter
    is back at 0 after each launch."""
    a, q, s, z = _case(5, 4096, 4096, 128, seed=11)
    want, tol = _want(a, q, s, z, 128)  # bf16 outputs
    for ctas in (1, 7, 64, 132, 300):
        got = [G4.matmul_int4_cuda(a, q, s, z, 128, ctas=ctas) for _ in range(3)]
        assert all(torch.equal(got[0], g) for g in got[1:]), ctas
        assert float((got[0].double() - want).abs().max()) <= tol, ctas
        counters = G4._WORKSPACE[(a.device, torch.cuda.current_stream().cuda_stream)][1]
        assert int(counters.abs().sum()) == 0


@pytest.mark.gpu
def test_cuda_graph_replay_with_new_inputs():
    """Captured once, replayed after the activations change: the same bits as eager calls."""
    a, q, s, z = _case(12, 2048, 2048, 128, seed=5)
    torch.cuda.synchronize()
    G4.matmul_int4_cuda(a, q, s, z, 128)  # the build and workspace before the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        G4.matmul_int4_cuda(a, q, s, z, 128)
        with torch.cuda.graph(graph, stream=stream):
            out = G4.matmul_int4_cuda(a, q, s, z, 128)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (1, 2):
        a.copy_(make_tensor(a.shape, a.dtype, seed=seed, device=DEV))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, G4.matmul_int4_cuda(a, q, s, z, 128))


@pytest.mark.gpu
def test_graphs_captured_on_a_new_stream_replay_in_any_order():
    """Two graphs captured one after the other on a stream that had no workspace: each call
    captured gets a workspace of its own, zeroed in its graph, so the second graph replayed
    before the first still starts from zeroed counters (stream-K: 7 CTAs); the same bits as
    eager calls, and no workspace is kept for the capture stream."""
    a1, q, s, z = _case(12, 2048, 2048, 128, seed=5)
    a2 = make_tensor(a1.shape, a1.dtype, seed=6, device=DEV)
    want1 = G4.matmul_int4_cuda(a1, q, s, z, 128, ctas=7)
    want2 = G4.matmul_int4_cuda(a2, q, s, z, 128, ctas=7)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graphs, outs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()], []
    with torch.cuda.stream(stream):
        for graph, a in zip(graphs, (a1, a2)):
            with torch.cuda.graph(graph, stream=stream):
                outs.append(G4.matmul_int4_cuda(a, q, s, z, 128, ctas=7))
    torch.cuda.current_stream().wait_stream(stream)
    assert (a1.device, stream.cuda_stream) not in G4._WORKSPACE
    for _ in range(2):
        graphs[1].replay()
        graphs[0].replay()
        torch.cuda.synchronize()
        assert torch.equal(outs[1], want2) and torch.equal(outs[0], want1)


@pytest.mark.gpu
def test_unforced_calls_take_it_and_fall_back_with_the_reason(monkeypatch):
    """Where the CUDA GEMV does not serve (here: its unforced rows cut to 16), M = 17..32 on
    an sm_90 device goes to the stream-K CUDA kernel (fewer rows to the GEMV); operands
    outside its scope (N not a multiple of 32, strided rows of a) go to the Triton kernels,
    ``backend`` naming the reason, and forcing the CUDA path there raises it."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the kernel is built for sm_90a")
    assert I4.backend(*_case(20, 512, 1024, 128), group_size=128).startswith("cuda gemv")
    monkeypatch.setattr(I4, "CUDA_GEMV_MAX_M", 16)
    a, q, s, z = _case(20, 512, 1024, 128)
    assert I4.backend(a, q, s, z, group_size=128).startswith("cuda (")
    got = tkit.matmul_int4(a, q, s, z, group_size=128)
    assert torch.equal(got, G4.matmul_int4_cuda(a, q, s, z, 128))
    assert I4.backend(a[:4], q, s, z, group_size=128).startswith("cuda gemv")
    a2, q2, s2, z2 = _case(20, 520, 1024, 128)
    assert "multiple of 32" in I4.backend(a2, q2, s2, z2, group_size=128)
    with pytest.raises(ValueError, match="multiple of 32"):
        _forced(a2, q2, s2, z2, 128)
    wide = make_tensor((20, 2048), BF16, seed=3, device=DEV)[:, ::2]
    assert "contiguous" in I4.backend(wide, q, s, z, group_size=128)
    spec = registry.get("matmul_int4")
    check_against_reference(spec.fn, spec.reference, (wide, q, s, z), dict(group_size=128))


def _plans_serve_repeats(M, kernel):
    """An eager call of M rows at K=2048 N=4096 recorded, then two of fresh inputs of its
    signature: each served by its plan (one plan hit), the same bits as ``kernel`` (the
    launcher) gives. Skips off sm_90 and without the C++ plans. The last inputs."""
    from tkit.kernels import _cplan, _launch, _plan

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the kernel is built for sm_90a")
    if not _plan.ON or _cplan.module() is None:
        pytest.skip(f"no eager plans here: {_cplan.status()}")
    a, q, s, z = _case(M, 4096, 2048, 128, seed=9)
    tkit.matmul_int4(a, q, s, z, group_size=128)  # the recorded call
    for seed in (1, 2):
        a, q, s, z = _case(M, 4096, 2048, 128, seed=seed)
        plans = _launch.stats["plan"]
        got = tkit.matmul_int4(a, q, s, z, group_size=128)
        assert _launch.stats["plan"] == plans + 1
        assert torch.equal(got, kernel(a, q, s, z, 128))
    return a, q, s, z


@pytest.mark.gpu
def test_repeated_eager_calls_are_served_by_their_plan_on_their_stream(monkeypatch):
    """The second eager call of a signature is served by its C++ plan (no Python launcher:
    the maps encoded over the call's tensors, the stream's workspace by address): the same bits
    as the launcher for fresh activations and weights. A call on another stream takes the
    launcher (that stream's workspace), the same bits again. (24 rows go to the stream-K
    kernel where the GEMV does not serve: here its unforced rows cut to 16.)"""
    from tkit.kernels import _launch

    monkeypatch.setattr(I4, "CUDA_GEMV_MAX_M", 16)
    with torch.no_grad():
        a, q, s, z = _plans_serve_repeats(24, G4.matmul_int4_cuda)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        plans = _launch.stats["plan"]
        with torch.cuda.stream(side):
            got = tkit.matmul_int4(a, q, s, z, group_size=128)
        torch.cuda.current_stream().wait_stream(side)
        assert _launch.stats["plan"] == plans
        assert torch.equal(got, G4.matmul_int4_cuda(a, q, s, z, 128))


# ---- the GEMV (csrc/gemv_int4.cu) -----------------------------------------------------------
def test_gemv_config_picks_lanes_and_refuses_by_name():
    """K lanes give the SMs about 16 warps each (fewer slabs, more lanes), never more lanes
    than groups; M picks the n8 tiles; lanes, pf and M outside their ranges are ValueErrors
    naming them."""
    cfg = G4.gemv_config(1, 14336, 4096, BF16, F16, 128, 132)
    assert (cfg["nt"], cfg["kl"]) == (1, 4) and "-DGROUP=128" in cfg["options"]
    assert G4.gemv_config(1, 8192, 8192, BF16, F16, 128, 132)["kl"] == 8
    assert G4.gemv_config(1, 1024, 4096, BF16, F16, 128, 132)["kl"] == 16
    assert G4.gemv_config(1, 1024, 256, BF16, F16, 128, 132)["kl"] == 2  # two groups
    c16 = G4.gemv_config(16, 4096, 4096, F16, F32, 32, 132)
    assert c16["nt"] == 2 and "-DACT_F16=1" in c16["options"] and "-DSCALE_T=2" in c16["options"]
    # the rings: two of 2 chunks; fewer chunks where that lines up with the group's chunks or
    # fits; the stacked sums of a at 16 rows
    assert (cfg["rb"], cfg["pf"]) == (2, 2) and "-DRB=2" in cfg["options"]
    assert not cfg["stacked"] and "-DAS=0" in cfg["options"]
    st = G4.gemv_config(16, 4096, 4096, BF16, F16, 128, 132, stacked=True)
    assert st["stacked"] and "-DAS=1" in st["options"]
    assert "-DAS=0" in G4.gemv_config(16, 4096, 4096, BF16, F16, 128, 132, stacked=False)["options"]
    c16b = G4.gemv_config(16, 4096, 4096, BF16, F16, 128, 132)
    assert (c16b["rb"], c16b["pf"], c16b["stacked"]) == (2, 2, True)
    assert (c16["rb"], c16["pf"]) == (2, 1)  # fp32 scales of 32-wide groups: a group a chunk
    assert G4.gemv_config(16, 4096, 4096, BF16, F16, 128, 132, rb=1)["pf"] == 4
    assert G4.gemv_config(16, 4096, 4096, BF16, F16, 128, 132, rb=1, stacked=False)["pf"] == 4
    assert G4.gemv_config(1, 4096, 4096, F16, F32, 32, 132)["pf"] == 1  # two rings' words
    assert G4.gemv_config(1, 4096, 4096 * 3, BF16, F16, 96, 132)["pf"] == 1  # 3 chunks a group
    assert G4.gemv_config(1, 4096, 4096, BF16, F16, 512, 132)["pf"] == 2
    assert G4.gemv_config(16, 4096, 4096 * 3, BF16, F16, 96, 132)["pf"] == 1  # 2 does not fit 3
    assert G4.gemv_config(16, 4096, 4096 * 3, BF16, F16, 96, 132, rb=1)["pf"] == 3
    assert G4.gemv_config(1, 4096, 4096, BF16, F16, 128, 132, rb=1)["pf"] == 4
    with pytest.raises(ValueError, match="lanes"):
        G4.gemv_config(1, 4096, 4096, BF16, F16, 128, 132, lanes=3)
    with pytest.raises(ValueError, match="pf"):
        G4.gemv_config(1, 4096, 4096, BF16, F16, 128, 132, pf=0)
    with pytest.raises(ValueError, match="pf"):
        G4.gemv_config(1, 4096, 4096, BF16, F16, 128, 132, pf=6)  # 4 chunks a group
    # past 16 rows: four n8 tiles a CTA (8 warps an SM), more rows in more CTAs a slab, and
    # the lanes count them (448 slabs, 1 / 2 / 4 CTAs each)
    c32 = G4.gemv_config(32, 14336, 4096, BF16, F16, 128, 132)
    assert (c32["nt"], c32["rbs"], c32["kl"]) == (4, 1, 2) and "-DWS=8" in c32["options"]
    assert G4.gemv_config(17, 14336, 4096, BF16, F16, 128, 132)["rbs"] == 1
    c64 = G4.gemv_config(64, 14336, 4096, BF16, F16, 128, 132)
    assert (c64["nt"], c64["rbs"], c64["kl"]) == (4, 2, 1)
    assert G4.gemv_config(100, 14336, 4096, BF16, F16, 128, 132)["rbs"] == 4
    n2 = G4.gemv_config(40, 14336, 4096, BF16, F16, 128, 132, nt=2)
    assert (n2["nt"], n2["rbs"]) == (2, 3) and "-DWS" not in " ".join(n2["options"])
    assert G4.gemv_config(8, 1024, 4096, BF16, F16, 128, 132, nt=4)["kl"] <= 8  # WS caps it
    with pytest.raises(ValueError, match="nt"):
        G4.gemv_config(16, 4096, 4096, BF16, F16, 128, 132, nt=8)
    with pytest.raises(ValueError, match=f"M={G4.GEMV_MAX_M + 1}"):
        G4.gemv_config(G4.GEMV_MAX_M + 1, 4096, 4096, BF16, F16, 128, 132)
    with pytest.raises(ValueError, match="rb"):
        G4.gemv_config(1, 4096, 4096, BF16, F16, 128, 132, rb=3)


def test_gemv_scope_names_what_is_out_of_it():
    """The operands the GEMV does not take, each refused with its reason (on any machine:
    the device is checked last)."""
    a, q, s, z = _case(1, 512, 1024, 128)
    why = G4.gemv_supported(a, q, s, z, 128, None)
    assert (why is None or "sm_90" in why) if ON_GPU else "not an sm_90 device" in why
    a2, q2, s2, z2 = _case(1, 520, 1024, 128)
    assert "multiple of 32" in G4.gemv_supported(a2, q2, s2, z2, 128, None)
    big = G4.GEMV_MAX_M + 1
    assert f"M={big}" in G4.gemv_supported(make_tensor((big, 1024), BF16, device=DEV), q, s, z,
                                           128, None)
    assert "group_size=48" in G4.gemv_supported(a, q, s, z, 48, None)
    strided = make_tensor((2, 2048), BF16, device=DEV)[:, ::2]
    assert "contiguous" in G4.gemv_supported(strided, q, s, z, 128, None)
    assert "differ in dtype" in G4.gemv_supported(a, q, s, z.float(), 128, None)
    if not ON_GPU:
        assert "not on a CUDA device" in I4.cuda_gemv_reason(a, q, s, z, 128, None)
        past = I4.CUDA_GEMV_MAX_M + 1
        assert I4.cuda_gemv_reason(a.expand(past, -1), q, s, z, 128, None).startswith(
            f"M={past} is outside")
        with I4.int4_config(path="cuda_gemv"), pytest.raises(ValueError, match="CUDA INT4 GEMV"):
            tkit.matmul_int4(a, q, s, z, group_size=128)


def _gemv(a, q, s, z, G, bias=None, **cfg):
    with I4.int4_config(path="cuda_gemv", **cfg):
        return tkit.matmul_int4(a, q, s, z, group_size=G, bias=bias)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,G,dtype,sym,sdt,bias", [
    (1, 14336, 4096, 128, BF16, False, F16, False),
    (1, 8192, 8192, 128, BF16, False, BF16, True),
    (1, 96, 2048, 32, F16, True, F32, True),          # 3 slabs, 16 lanes, fp32 scales
    (1, 4096, 384, 128, BF16, False, F16, False),     # 3 groups over 2 lanes (1 + 2)
    (2, 416, 576, 64, BF16, True, BF16, True),
    (3, 2048, 1536, 512, F16, False, F32, False),     # 3 groups, 2 lanes of 1 / 2
    (8, 1024, 2048, 256, BF16, False, BF16, False),   # one full n8 tile
    (9, 4096, 1024, 128, F16, True, F16, True),       # two n8 tiles, one row in the second
    (16, 1056, 3072, 128, BF16, False, F16, True),
])
def test_gemv_against_reference(M, N, K, G, dtype, sym, sdt, bias):
    """Forced onto the CUDA GEMV: float64 reference, outputs poisoned first; group sizes 32
    to 512, fp16 / bf16 / fp32 scales, symmetric weights, bias, 1 to 16 rows of a, K lanes
    holding unequal runs of groups."""
    a, q, s, z = _case(M, N, K, G, dtype, sym, sdt, seed=M + 20)
    b = make_tensor((N,), dtype, seed=7, device=DEV) if bias else None
    spec = registry.get("matmul_int4")
    assert I4.cuda_gemv_reason(a, q, s, z, G, b, forced=True) is None
    with I4.int4_config(path="cuda_gemv"), poisoned_outputs():
        check_against_reference(spec.fn, spec.reference, (a, q, s, z),
                                dict(group_size=G, bias=b))


@pytest.mark.gpu
@pytest.mark.parametrize("lanes,pf", [(1, 1), (2, 2), (4, 8), (16, 4), (8, 4)])
def test_gemv_lanes_and_ring_depths(lanes, pf):
    """Every K-lane count and ring depth (runs shorter than the ring, a ring that is not a
    multiple of the group's chunks) gives the reference's result."""
    a, q, s, z = _case(1, 2048, 4096, 128, seed=31)
    want, tol = _want(a, q, s, z, 128)
    got = G4.matmul_int4_gemv_cuda(a, q, s, z, 128, lanes=lanes, pf=pf)
    assert float((got.double() - want).abs().max()) <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,G,sdt,lanes,pf,rb", [
    (1, 2048, 4096, 128, F16, 4, 4, 2),    # 8 passes a lane: the paired loop only
    (1, 2048, 4096, 128, BF16, 8, 2, 2),   # 8 passes of 2
    (1, 4096, 384, 128, F16, 2, 4, 2),     # runs of 1 and 2 passes: a lone pass in the tail
    (2, 416, 576, 64, BF16, 1, 4, 2),      # 18 chunks: a partial last pass, 2 scale slots
    (1, 96, 2048, 32, F32, 16, 2, 2),      # a group a chunk: 2 scale slots a ring
    (3, 2048, 1536, 512, F16, 2, 2, 2),    # groups longer than the ring (scales at its start)
    (7, 1024, 640, 128, BF16, 1, 1, 2),    # 5 groups of single-chunk passes
    (9, 4096, 1024, 128, F16, 4, 2, 2),    # two n8 tiles
    (16, 1056, 3072, 128, BF16, 4, 2, 2),
    (8, 1024, 2048, 128, BF16, 2, 4, 1),   # one ring at 8 rows
])
def test_gemv_two_rings(M, N, K, G, sdt, lanes, pf, rb):
    """The two-ring form (rb=2: the next pass's codes and scales loaded at a pass's top) and
    one ring where two are the default give the reference's result: pass counts even and
    odd, partial last passes, groups shorter and longer than the ring, both n8-tile counts."""
    a, q, s, z = _case(M, N, K, G, BF16, False, sdt, seed=M + K)
    want, tol = _want(a, q, s, z, G)
    got = G4.matmul_int4_gemv_cuda(a, q, s, z, G, lanes=lanes, pf=pf, rb=rb)
    assert float((got.double() - want).abs().max()) <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,G,dt,sdt,sym,rb", [
    (1, 2048, 4096, 128, BF16, F16, False, 2),  # one tile: k16 steps stacked
    (3, 416, 576, 64, F16, F16, False, 1),      # fp16 a, partial passes
    (8, 1024, 2048, 32, BF16, F32, True, 2),    # a group a chunk, no zeros
    (9, 4096, 1024, 128, F16, BF16, False, 1),  # two tiles: rows 9.. from the stacked tile
    (16, 1056, 3072, 512, BF16, F16, False, 2),  # groups longer than the ring
    (16, 2048, 4096, 128, BF16, BF16, True, 1),
])
def test_gemv_stacked_sums_of_a(M, N, K, G, dt, sdt, sym, rb):
    """The groups' sums of a by the stacked MMA (``stacked``: two B fragments as one A, a
    0/1 B, shuffled to their threads) give the reference's result, and the same as the
    all-ones MMA's form to the reference's tolerance, at both tile counts, both rings, fp16
    and bf16 a, every scale dtype, with and without zero points."""
    a, q, s, z = _case(M, N, K, G, dt, sym, sdt, seed=M + G)
    a = a * torch.linspace(0.5, 4.0, K, device=DEV, dtype=dt)  # sums that differ by row and K
    want, tol = _want(a, q, s, z, G)
    got = G4.matmul_int4_gemv_cuda(a, q, s, z, G, rb=rb, stacked=True)
    assert float((got.double() - want).abs().max()) <= tol
    ones = G4.matmul_int4_gemv_cuda(a, q, s, z, G, rb=rb, stacked=False)
    assert float((got.double() - ones.double()).abs().max()) <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,G,dt,sdt,sym,bias,kw", [
    (17, 1024, 2048, 128, BF16, F16, False, False, {}),          # 32 rows a CTA, 17 used
    (32, 4096, 1024, 64, F16, BF16, True, True, {}),             # one full block, fp16 a
    (33, 1056, 3072, 512, BF16, F32, False, False, {}),          # a second block of one row
    (64, 2048, 4096, 128, BF16, F16, False, True, dict(stacked=False)),
    (100, 512, 1024, 32, BF16, BF16, False, False, dict(rb=2, pf=2)),  # 4 blocks, last of 4 rows
    (40, 1024, 2048, 128, F16, F16, True, False, dict(nt=2)),     # 16-row blocks
    (5, 1024, 2048, 128, BF16, F16, False, False, dict(nt=4)),     # 32-row block, 5 rows
    (128, 1024, 4096, 128, BF16, F16, False, False, dict(lanes=8)),
    (70, 1024, 2048, 64, F16, F32, False, False, {}),  # 3 row blocks, fp32 scales
])
def test_gemv_row_blocks(M, N, K, G, dt, sdt, sym, bias, kw):
    """Past 16 rows: 32 rows a CTA (four n8 tiles, the stacked sums in two pairs of tiles),
    and more rows in more CTAs a slab (each reading its own rows of a and storing only rows
    < M): the reference's result, outputs poisoned first, with partial last blocks, 16-row
    blocks, bias, both sums forms, one and two rings."""
    a, q, s, z = _case(M, N, K, G, dt, sym, sdt, seed=M + N)
    a = a * torch.linspace(0.5, 4.0, K, device=DEV, dtype=dt)  # sums that differ by row and K
    b = make_tensor((N,), dt, seed=5, device=DEV) if bias else None
    want, tol = _want(a, q, s, z, G, b)
    out = torch.full((M + 1, N), float("nan"), device=DEV, dtype=dt)  # a row past M, poisoned
    got = G4.matmul_int4_gemv_cuda(a, q, s, z, G, b, out=out[:M], **kw)
    assert got.data_ptr() == out.data_ptr()
    assert float((got.double() - want).abs().max()) <= tol
    assert out[M].isnan().all()  # nothing stored past row M - 1


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 3])
def test_gemv_every_code_in_every_nibble(M):
    """Each of the 16 codes at each of the 8 nibbles of a word, against zero points 0..15 and
    a fractional one."""
    a, q, s, z, G = _every_code_case(M)
    spec = registry.get("matmul_int4")
    with I4.int4_config(path="cuda_gemv"):
        check_against_reference(spec.fn, spec.reference, (a, q, s, z), dict(group_size=G))


@pytest.mark.gpu
def test_gemv_unforced_m1_takes_it_and_falls_back_with_the_reason():
    """M = 1 (and up to 16) on an sm_90 device goes to the CUDA GEMV, deterministic call to
    call; operands
    outside its scope go to the Triton GEMV with the reason; a CUDA graph replays it with new
    activations to the same bits as eager calls."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the kernel is built for sm_90a")
    a, q, s, z = _case(1, 4096, 4096, 128, seed=4)
    assert I4.backend(a, q, s, z, group_size=128).startswith("cuda gemv")
    got = tkit.matmul_int4(a, q, s, z, group_size=128)
    assert torch.equal(got, G4.matmul_int4_gemv_cuda(a, q, s, z, 128))
    a16 = make_tensor((16, 4096), BF16, seed=8, device=DEV)
    assert torch.equal(tkit.matmul_int4(a16, q, s, z, group_size=128),
                       G4.matmul_int4_gemv_cuda(a16, q, s, z, 128))
    assert torch.equal(got, tkit.matmul_int4(a, q, s, z, group_size=128))
    a2, q2, s2, z2 = _case(1, 520, 1024, 128)
    assert "multiple of 32" in I4.backend(a2, q2, s2, z2, group_size=128)
    with pytest.raises(ValueError, match="multiple of 32"):
        _gemv(a2, q2, s2, z2, 128)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tkit.matmul_int4(a, q, s, z, group_size=128)
        with torch.cuda.graph(graph, stream=stream):
            out = tkit.matmul_int4(a, q, s, z, group_size=128)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (1, 2):
        a.copy_(make_tensor(a.shape, a.dtype, seed=seed, device=DEV))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, G4.matmul_int4_gemv_cuda(a, q, s, z, 128))


@pytest.mark.gpu
def test_gemv_repeated_eager_calls_are_served_by_their_plan(monkeypatch):
    """The second eager call of a signature (M=1; M=40, two 32-row CTAs a slab, with the
    GEMV's unforced rows widened past the wgmma GEMM's start) is served by its plan: the same
    bits as the launcher for fresh activations and weights."""
    monkeypatch.setattr(I4, "CUDA_GEMV_MAX_M", 128)
    with torch.no_grad():
        _plans_serve_repeats(1, G4.matmul_int4_gemv_cuda)
        _plans_serve_repeats(40, G4.matmul_int4_gemv_cuda)


# ---- the wgmma GEMM (csrc/gemm_w4a16_sm90.cu) -----------------------------------------------
def test_wgmma_config_picks_tiles_and_refuses_by_name():
    """Rows of a pick the tile (the smallest of 8..128 that holds them; more rows, more
    tiles), two consumer warpgroups, two CTAs an SM up to 32 rows; K split to fill the SMs'
    CTAs, each split >= 8 steps; bad knobs are refused by name."""
    c1 = G4.w4_config(1, 14336, 4096, BF16, F16, 128, 132)
    assert (c1["bt"], c1["cw"], c1["minb"]) == (8, 2, 2)
    assert c1["split"] == 2 and c1["tiles_n"] == 112  # 224 CTAs on 264 places
    c64 = G4.w4_config(64, 8192, 8192, BF16, F16, 128, 132)
    assert (c64["bt"], c64["minb"], c64["split"], c64["tiles_n"]) == (64, 1, 2, 64)
    c300 = G4.w4_config(300, 14336, 4096, F16, F32, 32, 132)
    assert (c300["bt"], c300["cw"], c300["tiles_m"], c300["split"]) == (128, 2, 3, 1)
    assert "-DACT_F16=1" in c300["options"] and "-DGROUP=32" in c300["options"]
    c1w = G4.w4_config(128, 14336, 4096, BF16, F16, 128, 132, cw=1)
    assert (c1w["tiles_n"], c1w["split"]) == (224, 1) and "-DCW=1" in c1w["options"]
    assert all(G4.w4_config(M, 4096, 4096, BF16, F32, 32, 132)["smem"] <= G4.SMEM_LIMIT
               for M in (1, 16, 64, 128, 256))
    assert G4.w4_config(16, 4096, 256, BF16, F16, 128, 132)["split"] == 1  # 4 steps: no split
    with pytest.raises(ValueError, match="bt must be"):
        G4.w4_config(16, 4096, 4096, BF16, F16, 128, 132, bt=256)
    with pytest.raises(ValueError, match="cw must be"):
        G4.w4_config(256, 4096, 4096, BF16, F16, 128, 132, cw=3)
    with pytest.raises(ValueError, match="group_size=96"):
        G4.w4_config(16, 4096, 4032, BF16, F16, 96, 132)
    with pytest.raises(ValueError, match="stages"):
        G4.w4_config(128, 4096, 4096, BF16, F32, 32, 132, stages=20)
    with pytest.raises(ValueError, match="split"):
        G4.w4_config(16, 4096, 256, BF16, F16, 128, 132, split=5)


def test_wgmma_scope_names_what_is_out_of_it():
    a, q, s, z = _case(4, 64, 256, 128)
    assert "group_size=96" in G4.w4_supported(a[:, :192], q[:24], s, z, 96, None)
    assert "a's rows" in G4.w4_supported(a[:, 1:129], q[:16], s[:1], z[:1], 128, None)
    assert "bias" in G4.w4_supported(a, q, s, z, 128, torch.zeros(64, dtype=F32, device=DEV))
    if not ON_GPU:
        assert "sm_90" in G4.w4_supported(a, q, s, z, 128, None)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,G,dt,sdt,sym,bias,kw", [
    (1, 4096, 4096, 128, BF16, F16, False, False, {}),            # 8-row tile, split 2
    (5, 520, 2048, 64, F16, F16, True, True, {}),                 # N not a 128-column multiple
    (16, 1024, 96, 32, BF16, BF16, False, False, {}),             # K = 1.5 steps, groups of 32
    (24, 2048, 4096, 256, BF16, F32, False, True, dict(split=3)),  # uneven splits
    (33, 1056, 3072, 512, F16, F32, False, False, {}),            # 64-row tile, 31 rows unused
    (64, 2048, 2048, 128, BF16, F16, False, True, dict(stages=2)),
    (100, 4096, 1024, 32, BF16, BF16, True, False, dict(cw=1)),
    (128, 1024, 4096, 128, F16, BF16, False, False, dict(split=2)),
    (200, 768, 2048, 128, BF16, F16, False, True, {}),            # 128-row tiles, one partial
    (300, 1024, 1024, 64, BF16, F16, False, False, dict(bt=128)),  # 3 row tiles
    (40, 4096, 8192, 128, BF16, BF16, False, False, dict(split=8)),
])
def test_wgmma_against_reference(M, N, K, G, dt, sdt, sym, bias, kw):
    """Float64 reference, outputs poisoned and a row past M too: row tiles of 8 to 128 (one
    or two consumer warpgroups), several row tiles, partial ones, N not a multiple of the
    column tile, K not of the step, every scale dtype, groups of 32 to 512, K splits (even and
    not), two ring slots."""
    a, q, s, z = _case(M, N, K, G, dt, sym, sdt, seed=M + N)
    a = a * torch.linspace(0.5, 4.0, K, device=DEV, dtype=dt)
    b = make_tensor((N,), dt, seed=5, device=DEV) if bias else None
    assert G4.w4_supported(a, q, s, z, G, b) is None
    want, tol = _want(a, q, s, z, G, b)
    out = torch.full((M + 1, N), float("nan"), device=DEV, dtype=dt)
    got = G4.matmul_int4_wgmma(a, q, s, z, G, b, out=out[:M], **kw)
    assert got.data_ptr() == out.data_ptr()
    assert float((got.double() - want).abs().max()) <= tol
    assert out[M].isnan().all()  # nothing stored past row M - 1


@pytest.mark.gpu
@pytest.mark.parametrize("M", [3, 130])
def test_wgmma_every_code_in_every_nibble(M):
    """Each of the 16 codes at each of the 8 nibbles of a word, against zero points 0..15
    (exact: O + z in the 16-bit type) and a fractional one (-z s rounded)."""
    a, q, s, z, G = _every_code_case(M)
    want, tol = _want(a, q, s, z, G)
    got = G4.matmul_int4_wgmma(a, q, s, z, G)
    assert float((got.double() - want).abs().max()) <= tol


@pytest.mark.gpu
def test_wgmma_splits_are_deterministic_and_counters_rest_at_zero():
    """Split-K: the last split to arrive adds the partial tiles in split order, so repeated
    calls give the same bits, and every tile's counter is back at 0 after a launch."""
    a, q, s, z = _case(16, 2048, 8192, 128, seed=4)
    first = G4.matmul_int4_wgmma(a, q, s, z, 128, split=6)
    for _ in range(3):
        assert torch.equal(G4.matmul_int4_wgmma(a, q, s, z, 128, split=6), first)
    ws, counters = G4._w4_workspace(a.device, 0, 0)
    torch.cuda.synchronize()
    assert int(counters.abs().sum()) == 0
    want, tol = _want(a, q, s, z, 128)
    assert float((first.double() - want).abs().max()) <= tol


@pytest.mark.gpu
def test_wgmma_unforced_dispatch_forced_path_and_plans(monkeypatch):
    """In its unforced rows (here set to 17..512, the GEMV's cut to 16) calls take the wgmma
    GEMM, the same bits as its launcher, also when a repeated signature is served by its C++
    plan; ``path='cuda_wgmma'`` forces it with the ring's slots and K splits as num_stages and
    split_k (the reference's result), and where it cannot serve raises the reason."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the kernel is built for sm_90a")
    monkeypatch.setattr(I4, "CUDA_GEMV_MAX_M", 16)
    monkeypatch.setattr(I4, "CUDA_WGMMA_MIN_M", 17)
    monkeypatch.setattr(I4, "CUDA_WGMMA_MAX_M", 512)
    a, q, s, z = _case(40, 1024, 2048, 128)
    assert I4.backend(a, q, s, z, group_size=128).startswith("cuda wgmma")
    assert torch.equal(tkit.matmul_int4(a, q, s, z, group_size=128),
                       G4.matmul_int4_wgmma(a, q, s, z, 128))
    assert I4.backend(a[:8], q, s, z, group_size=128).startswith("cuda gemv")
    spec = registry.get("matmul_int4")
    with I4.int4_config(path="cuda_wgmma", num_stages=3, split_k=2), poisoned_outputs():
        check_against_reference(spec.fn, spec.reference, (a, q, s, z), dict(group_size=128))
    with I4.int4_config(path="cuda_wgmma"), pytest.raises(ValueError, match="group_size=96"):
        a3, q3, s3, z3 = _case(4, 64, 192, 96)
        tkit.matmul_int4(a3, q3, s3, z3, group_size=96)
    with torch.no_grad():
        _plans_serve_repeats(200, G4.matmul_int4_wgmma)
