"""INT4 weight-only GEMM (tkit.matmul_int4) and its weight tools: the packed layout bit for bit,
quantize/dequantize round trips within int4 rounding, the GEMM against a float64 reference
(dequantize, then matmul) under the reference rule, split-K and the compute tile, the AWQ and
GPTQ converters against hand-packed checkpoints, errors, registration."""

import pytest
import torch

import tkit
from tkit import _env, registry
from tkit.kernels.matmul import int4 as I4
from tkit.kernels.matmul import ops as _matmul_ops
from tkit.testing import (
    assert_close_to_reference,
    check_against_reference,
    fuzz,
    make_tensor,
    opcheck,
    poisoned_outputs,
)

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
F16, BF16 = torch.float16, torch.bfloat16


# ---- layout -------------------------------------------------------------------------------------
def test_pack_layout_bit_for_bit():
    """qweight[i, n] holds q[n, 8*i + j] in bits 4*j .. 4*j + 3 (GPTQ's qweight layout)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (5, 24), generator=g)
    packed = I4.pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (3, 5)
    for i in range(3):
        for n in range(5):
            word = 0
            for j in range(8):
                word |= int(q[n, 8 * i + j]) << (4 * j)
            assert packed[i, n].item() == (word - (1 << 32) if word >= 1 << 31 else word)
    assert torch.equal(I4.unpack_int4(packed), q.to(torch.uint8))


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("dtype,group_size", [(F16, 128), (BF16, 32), (torch.float32, 16)])
def test_quantize_round_trip(symmetric, dtype, group_size):
    N, K = 33, 256
    w = make_tensor((N, K), dtype, seed=3)
    q, s, z = tkit.quantize_int4(w, group_size, symmetric=symmetric)
    assert q.shape == (K // 8, N) and s.shape == (K // group_size, N)
    assert (z is None) == symmetric
    wd = tkit.dequantize_int4(q, s, z, group_size=group_size, dtype=torch.float64)
    err = (wd - w.double()).abs().reshape(N, K // group_size, group_size)
    step = s.double().t()[:, :, None]
    # half a step of rounding, plus the rounding of s (and of the range's ends) to its dtype
    slack = {F16: 2e-3, BF16: 1.6e-2, torch.float32: 1e-6}[dtype] * 16
    assert (err <= step * (0.5 + slack) + 1e-6).all(), float((err / step).max())
    codes = I4.unpack_int4(q)
    assert int(codes.max()) <= 15
    if not symmetric:  # the group's minimum and maximum are reached (the range is used)
        assert int(codes.min()) == 0 and int(codes.max()) == 15


def test_quantize_constant_group_is_finite():
    w = torch.zeros(4, 32, device=DEV)
    w[1] = 3.0
    for sym in (False, True):
        q, s, z = tkit.quantize_int4(w, 16, symmetric=sym)
        wd = tkit.dequantize_int4(q, s, z, group_size=16, dtype=torch.float64)
        assert torch.isfinite(s).all()
        torch.testing.assert_close(wd, w.double(), rtol=0, atol=0.5 if sym else 1e-6)


# ---- the GEMM -----------------------------------------------------------------------------------
@pytest.mark.parametrize("M,N,K,G,dtype,sym,bias", [
    (1, 100, 256, 128, F16, False, False),
    (3, 70, 96, 32, BF16, False, True),
    (16, 64, 128, 64, F16, True, False),
    (65, 33, 64, 16, BF16, True, True),
])
def test_matmul_int4_against_reference(M, N, K, G, dtype, sym, bias):
    w = make_tensor((N, K), dtype, seed=2)
    q, s, z = tkit.quantize_int4(w, G, symmetric=sym)
    a = make_tensor((M, K), dtype, seed=1)
    kw = dict(group_size=G)
    if bias:
        kw["bias"] = make_tensor((N,), dtype, seed=5)
    spec = registry.get("matmul_int4")
    check_against_reference(spec.fn, spec.reference, (a, q, s, z), kw)


@pytest.mark.parametrize("split", [1, 2, 3, 8])
def test_split_k_sums_in_order(split):
    """Every split of K gives the same result as no split (fixed-order reduction), with the bias
    applied once by the reduce kernel."""
    M, N, K, G = 3, 40, 512, 64
    w = make_tensor((N, K), F16, seed=2)
    q, s, z = tkit.quantize_int4(w, G)
    a = make_tensor((M, K), F16, seed=1)
    bias = make_tensor((N,), F16, seed=5)
    cfg = I4.Int4Config(16, 32, 64, split)
    with poisoned_outputs():
        out = I4._matmul_int4_impl(a, q, s, z, G, bias, cfg)
    w16 = tkit.dequantize_int4(q, s, z, group_size=G, dtype=F16)
    ref = a.double() @ w16.double().T + bias.double()
    assert_close_to_reference(out, ref, a @ w16.T + bias)
    if split > 1:
        base = I4._matmul_int4_impl(a, q, s, z, G, bias, I4.Int4Config(16, 32, 64, 1))
        torch.testing.assert_close(out, base, rtol=0, atol=1e-2)


def test_config_override_is_scoped_and_checked():
    M, N, K, G = 2, 40, 256, 64
    q, s, z = tkit.quantize_int4(make_tensor((N, K), F16, seed=2), G)
    a = make_tensor((M, K), F16, seed=1)
    base = tkit.matmul_int4(a, q, s, z, group_size=G)
    with I4.int4_config(split_k=4, block_k=32, block_n=16):
        assert I4.current_config(M, N, K, G, 4).split_k == 4
        split = tkit.matmul_int4(a, q, s, z, group_size=G)
    torch.testing.assert_close(split, base, rtol=2e-3, atol=1e-2)  # another summation order
    with pytest.raises(TypeError, match="unknown Int4Config field"):
        with I4.int4_config(block=4):
            pass
    with I4.int4_config(block_k=128), pytest.raises(ValueError, match="block_k=128"):
        tkit.matmul_int4(a, q, s, z, group_size=G)


def test_leading_dims_and_strided_activations():
    N, K, G = 24, 64, 32
    q, s, z = tkit.quantize_int4(make_tensor((N, K), F16, seed=2), G)
    a = make_tensor((2, 3, 2 * K), F16, seed=1)[..., ::2]  # strided, 3-D
    out = tkit.matmul_int4(a, q, s, z, group_size=G)
    assert out.shape == (2, 3, N)
    w16 = tkit.dequantize_int4(q, s, z, group_size=G, dtype=F16)
    assert_close_to_reference(out, a.double() @ w16.double().T, a @ w16.T)


def test_empty_rows():
    q, s, z = tkit.quantize_int4(make_tensor((8, 32), F16, seed=2), 16)
    out = tkit.matmul_int4(torch.empty(0, 32, dtype=F16, device=DEV), q, s, z, group_size=16)
    assert out.shape == (0, 8)


def test_config_heuristic():
    """M <= GEMV_MAX_M takes the GEMV; other decode shapes (M <= TC_MAX_M) the tensor-core
    decode kernel with host descriptors and K split over the programs an SM holds; larger M
    takes one compute tile, and from DEQUANT_MIN_M rows the weight is dequantized once for
    the 16-bit GEMM. An overridden path starts from that path's own defaults."""
    assert I4.Int4Config.for_shape(1, 14336, 4096, 128, 132).path == "gemv"
    for M, bm, stages in ((2, 8, 3), (8, 8, 3), (9, 16, 4), (16, 16, 4), (17, 32, 2),
                          (32, 32, 2), (33, 64, 2), (I4.TC_MAX_M, 64, 2)):
        c = I4.Int4Config.for_shape(M, 14336, 4096, 128, 132)
        assert c.path == "tc" and (c.block_m, c.block_k) == (bm, 128)
        if not _env.INTERPRET:  # K split over programs, each with at least 4 K steps
            assert c.split_k > 1 and 4096 // c.block_k // c.split_k >= 4
            assert (c.block_n, c.num_warps, c.num_stages) == (128, 4, stages)
            assert c.q_tma
    g = I4.Int4Config.for_shape(1, 14336, 4096, 128, 132, path="gemv")
    # M = 1: K lanes, all of K in a program (no split), ~16 warps an SM
    assert g.path == "gemv" and g.block_m == 1 and g.split_k == 1 and 128 % g.block_k == 0
    assert (g.block_n, g.num_warps, g.k_lanes, g.n_vecs) == (32, 4, 32, 2)
    assert I4.Int4Config.for_shape(3, 14336, 4096, 128, 132, path="gemv").block_m == 4
    with I4.int4_config(path="gemv"):
        assert I4.current_config(1, 14336, 4096, 128, 132) == g
    c65 = I4.Int4Config.for_shape(I4.TC_MAX_M + 1, 14336, 4096, 128, 132)
    assert c65.path == "tile" and (c65.block_m, c65.block_k) == (64, 128)
    mid = I4.Int4Config.for_shape(I4.DEQUANT_MIN_M - 1, 14336, 4096, 128, 132)
    assert mid.split_k == 1 and mid.block_m == 128 and mid.path == "tile"
    # prefill: the weight dequantized once, then the 16-bit GEMM
    assert I4.Int4Config.for_shape(I4.DEQUANT_MIN_M, 14336, 4096, 128, 132).path == "dequant"
    assert I4.Int4Config.for_shape(4096, 14336, 4096, 128, 132).path == "dequant"
    assert I4.Int4Config.for_shape(1, 14336, 4096, 32, 132).block_k == 32
    assert I4.Int4Config.for_shape(32, 4096, 4096, 32, 132).block_k == 32


# ---- the GEMV kernel (M <= 16, CUDA cores) -------------------------------------------------------
def _gemv_case(M, N, K, G, dtype, sym, seed=0):
    w = make_tensor((N, K), dtype, seed=2 + seed)
    q, s, z = tkit.quantize_int4(w, G, symmetric=sym)
    a = make_tensor((M, K), dtype, seed=1 + seed)
    return a, q, s, z


@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 16])
@pytest.mark.parametrize("path", ["gemv", "tile", "tc"])
def test_small_m_paths_against_reference(M, path):
    """Every decode path, forced through int4_config, at every M they serve; odd N (the
    column edge), K of several groups, bias, fp16."""
    N, K, G = 37, 192, 64
    a, q, s, z = _gemv_case(M, N, K, G, F16, False, seed=M)
    bias = make_tensor((N,), F16, seed=5)
    spec = registry.get("matmul_int4")
    with I4.int4_config(path=path):
        assert I4.current_config(M, N, K, G, 4).path == path
        check_against_reference(spec.fn, spec.reference, (a, q, s, z),
                                dict(group_size=G, bias=bias))


@pytest.mark.parametrize("M,dtype,sym", [(3, F16, False), (40, BF16, True), (70, F16, True)])
def test_dequant_path_against_reference(M, dtype, sym):
    """The prefill path forced through int4_config: the weight written once in a's dtype by
    the dequantization kernel (odd N: the column edge; K of several groups; symmetric and
    asymmetric), then the 16-bit GEMM by its transpose, with a bias."""
    N, K, G = 37, 192, 64
    a, q, s, z = _gemv_case(M, N, K, G, dtype, sym, seed=M)
    bias = make_tensor((N,), dtype, seed=6)
    spec = registry.get("matmul_int4")
    with I4.int4_config(path="dequant"):
        assert I4.current_config(M, N, K, G, 4).path == "dequant"
        check_against_reference(spec.fn, spec.reference, (a, q, s, z),
                                dict(group_size=G, bias=bias))


def test_dequant_kernel_writes_the_reference_weight():
    """_dequant_int4_kernel alone: exactly dequantize_int4's (q - z) * s, computed in float32
    and rounded once to the output dtype, for every element of an odd-sized weight (fp16 out:
    the interpreter rounds float32 to bf16 by truncation, a GPU to nearest)."""
    N, K, G = 37, 192, 64
    w = make_tensor((N, K), F16, seed=9)
    q, s, z = tkit.quantize_int4(w, G)
    out = torch.full((N, K), float("nan"), dtype=F16, device=w.device)
    cfg = I4.Int4Config.for_shape(64, N, K, G, path="dequant")
    I4.C.launch(I4._dequant_int4_kernel, (I4.C.cdiv(N, cfg.block_n), K // cfg.block_k),
                q_ptr=q, s_ptr=s, z_ptr=z, w_ptr=out, N=N, stride_qk=q.stride(0),
                stride_qn=q.stride(1), stride_sg=s.stride(0), stride_sn=s.stride(1),
                stride_zg=z.stride(0), stride_zn=z.stride(1), stride_wn=out.stride(0),
                stride_wk=out.stride(1), GROUP=G, HAS_ZEROS=True, BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k, num_warps=4)
    want = I4.dequantize_int4(q, s.float(), z.float(), group_size=G, dtype=torch.float32)
    assert torch.equal(out, want.to(F16))


@pytest.mark.parametrize("dtype,sym,G", [(BF16, False, 128), (BF16, True, 32), (F16, True, 16),
                                         (F16, False, 128)])
@pytest.mark.parametrize("split", [1, 3])
def test_gemv_dtypes_groups_and_splits(dtype, sym, G, split):
    """Symmetric (zeros None) and asymmetric weights, bf16 / fp16, groups of 16..128, K split
    (3 splits of an uneven number of steps: one split ends early)."""
    M, N, K = 4, 65, 5 * 128
    a, q, s, z = _gemv_case(M, N, K, G, dtype, sym, seed=7)
    spec = registry.get("matmul_int4")
    with I4.int4_config(path="gemv", split_k=split, block_k=min(G, 64)), poisoned_outputs():
        check_against_reference(spec.fn, spec.reference, (a, q, s, z), dict(group_size=G))


@pytest.mark.parametrize("M,path", [(1, "gemv"), (3, "gemv")])
def test_fused_reduce_is_the_two_launch_sum(M, path):
    """fused_reduce: the last program of an output tile sums the partials in split order, so
    the result is bit for bit the reduce kernel's; counters return to zero (called twice)."""
    N, K, G = 70, 512, 64
    a, q, s, z = _gemv_case(M, N, K, G, BF16, False, seed=11)
    bias = make_tensor((N,), BF16, seed=5)
    with I4.int4_config(path=path, split_k=4, block_k=32 if path == "gemv" else 64):
        two = tkit.matmul_int4(a, q, s, z, group_size=G, bias=bias)
        with I4.int4_config(fused_reduce=True), poisoned_outputs():
            one = tkit.matmul_int4(a, q, s, z, group_size=G, bias=bias)
            again = tkit.matmul_int4(a, q, s, z, group_size=G, bias=bias)
    assert torch.equal(one, two) and torch.equal(again, two)
    assert int(_matmul_ops._COUNTERS[(a.device.type, a.device.index)].abs().sum()) == 0


@pytest.mark.parametrize("M,K,lanes,warps,bk,split,vecs,dtype,strided", [
    (1, 576, 4, 1, 32, 1, 1, BF16, False),  # 18 chunks over 4 lanes: 2 live in the last step
    (1, 512, 4, 1, 32, 1, 2, F16, False),   # every lane live in every step (EVEN), 8 columns
    (3, 320, 2, 1, 64, 3, 1, BF16, False),  # rows of a, K split 3 ways (uneven), lanes on top
    (2, 576, 16, 4, 32, 2, 2, F16, False),  # lanes past the end of a split from the first step
    (4, 512, 8, 2, 16, 1, 1, BF16, True),   # strided a: 2-byte loads of the activations
    (5, 512, 4, 1, 32, 1, 2, BF16, False),  # 8 rows a program: 2-byte loads, EVEN
])
def test_gemv_k_lanes(M, K, lanes, warps, bk, split, vecs, dtype, strided):
    """k_lanes: a program's K range walked by interleaved lanes (warps, and threads N leaves
    over) summed once at the end; n_vecs 1 or 2 column vectors a thread; the activations'
    16-byte loads (contiguous a, M <= 4) or 2-byte ones. Lanes and steps past the range's end
    must add nothing, bias once."""
    N, G = 37, 64
    a, q, s, z = _gemv_case(M, N, K, G, dtype, M % 2 == 0, seed=23 + lanes)
    if strided:
        a = torch.cat([a, a], 1)[:, ::2]
    bias = make_tensor((N,), dtype, seed=5)
    spec = registry.get("matmul_int4")
    with I4.int4_config(path="gemv", block_n=32, block_k=bk, k_lanes=lanes, num_warps=warps,
                        split_k=split, n_vecs=vecs), poisoned_outputs():
        check_against_reference(spec.fn, spec.reference, (a, q, s, z),
                                dict(group_size=G, bias=bias))


@pytest.mark.parametrize("sdtype", [BF16, F16, torch.float32])
@pytest.mark.parametrize("N,K,bn,vecs,lanes,sym", [(64, 576, 16, 1, 4, False),
                                                   (37, 512, 16, 1, 8, True),
                                                   (100, 512, 32, 2, 4, False),
                                                   (64, 512, 32, 2, 8, False)])
def test_gemv_m1_column_tiles(sdtype, N, K, bn, vecs, lanes, sym):
    """The M=1 defaults' two column tiles (16 columns, one vector of 4 a thread; 32, two
    vectors) with 16-bit and float32 scales, fractional zero points, bias, odd N, lanes live
    and past the end (576 = 18 chunks over 4 lanes)."""
    G = 64
    a, q, s, z = _gemv_case(1, N, K, G, BF16, sym, seed=31 + lanes)
    s = s.to(sdtype)
    if z is not None:
        z = (z.float() + 0.25).to(sdtype)
    bias = make_tensor((N,), BF16, seed=5)
    spec = registry.get("matmul_int4")
    with I4.int4_config(path="gemv", block_n=bn, n_vecs=vecs, block_k=32, k_lanes=lanes,
                        num_warps=4), poisoned_outputs():
        check_against_reference(spec.fn, spec.reference, (a, q, s, z),
                                dict(group_size=G, bias=bias))


def test_gemv_m1_heuristic_columns():
    """M = 1: 4 warps of K lanes over all of K, 32-deep chunks; 16 columns a program (one
    vector a thread) where 32 would leave the SMs at most 2 programs each, else 32."""
    wide = I4.Int4Config.for_shape(1, 14336, 4096, 128, 132)
    narrow = I4.Int4Config.for_shape(1, 8192, 8192, 128, 132)
    for cfg in (wide, narrow):
        assert (cfg.path, cfg.num_warps, cfg.k_lanes, cfg.block_k, cfg.split_k) == (
            "gemv", 4, 32, 32, 1)
    assert (wide.block_n, wide.n_vecs) == (32, 2)
    assert (narrow.block_n, narrow.n_vecs) == (16, 1)
    assert I4.Int4Config.for_shape(1, 8192, 8192, 128, 64).block_n == 32  # fewer SMs
    assert I4.Int4Config.for_shape(1, 8192, 8192, 32, 132).block_k == 32  # groups of 32


def test_gemv_k_lanes_fused_reduce_and_checks():
    """Lanes with the one-launch split-K sum (the same bits as the reduce launch), and the
    override's checks on k_lanes and n_vecs."""
    M, N, K, G = 1, 40, 512, 64
    a, q, s, z = _gemv_case(M, N, K, G, BF16, False, seed=29)
    with I4.int4_config(path="gemv", block_n=32, block_k=32, k_lanes=4, split_k=2):
        two = tkit.matmul_int4(a, q, s, z, group_size=G)
        with I4.int4_config(fused_reduce=True):
            one = tkit.matmul_int4(a, q, s, z, group_size=G)
    assert torch.equal(one, two)
    for bad, match in ((dict(k_lanes=3), "k_lanes=3"), (dict(n_vecs=4), "n_vecs=4")):
        with I4.int4_config(path="gemv", **bad), pytest.raises(ValueError, match=match):
            tkit.matmul_int4(a, q, s, z, group_size=G)


def test_gemv_rejects_large_m():
    q, s, z = tkit.quantize_int4(make_tensor((8, 32), F16, seed=2), 16)
    with I4.int4_config(path="gemv"), pytest.raises(ValueError, match="M <= 16"):
        tkit.matmul_int4(make_tensor((17, 32), F16, seed=1), q, s, z, group_size=16)
    with I4.int4_config(path="wgmma"), pytest.raises(ValueError, match="path='wgmma'"):
        tkit.matmul_int4(make_tensor((1, 32), F16, seed=1), q, s, z, group_size=16)


# ---- the tensor-core decode kernel (weight as the MMA's register operand) ----------------------
@pytest.mark.parametrize("dtype,sym,G", [(BF16, False, 128), (BF16, True, 32), (F16, True, 16),
                                         (F16, False, 64)])
@pytest.mark.parametrize("split", [1, 3])
def test_tc_dtypes_groups_and_splits(dtype, sym, G, split):
    """Symmetric and asymmetric weights, bf16 / fp16 (each with its own magic offset), groups of
    16..128 (K steps shorter than 128: the plane order inside a step changes), K split 3 ways
    over an uneven number of steps, bias."""
    M, N, K = 5, 70, 5 * 128
    a, q, s, z = _gemv_case(M, N, K, G, dtype, sym, seed=13)
    bias = make_tensor((N,), dtype, seed=5)
    spec = registry.get("matmul_int4")
    with I4.int4_config(path="tc", split_k=split, block_n=32), poisoned_outputs():
        check_against_reference(spec.fn, spec.reference, (a, q, s, z),
                                dict(group_size=G, bias=bias))


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_tc_packed_tile_through_tma(dtype):
    """q_tma: the packed tile, scales and zeros through tensor descriptors made on the host,
    N a multiple of 8 but not of the tile (the last tile's columns past N read zeros), K
    split, with and without zeros; an unaligned N falls back to cp.async (same result)."""
    M, K, G = 3, 512, 128
    spec = registry.get("matmul_int4")
    for N, sym in ((72, False), (72, True), (70, False)):
        a, q, s, z = _gemv_case(M, N, K, G, dtype, sym, seed=19)
        with I4.int4_config(path="tc", q_tma=True, block_n=64, split_k=2), poisoned_outputs():
            check_against_reference(spec.fn, spec.reference, (a, q, s, z), dict(group_size=G))


def test_tc_descriptors_come_from_the_host_only():
    """The per-program descriptor form is gone: an override naming its knob is an unknown
    field."""
    with pytest.raises(TypeError, match="host_descriptors"):
        with I4.int4_config(host_descriptors=False):
            pass


@pytest.mark.parametrize("M,block_m,block_n", [(17, 8, 64), (17, 16, 32), (40, 32, 64),
                                               (64, 64, 32), (100, 64, 64)])
def test_tc_more_rows_than_one_tile(M, block_m, block_n):
    """Several M tiles of the activations (the grid's second axis), the last one partly past
    M (rows past the edge read the last row and are not stored)."""
    N, K, G = 40, 256, 128
    a, q, s, z = _gemv_case(M, N, K, G, F16, False, seed=17)
    spec = registry.get("matmul_int4")
    with I4.int4_config(path="tc", block_m=block_m, block_n=block_n,
                        num_stages=4 if block_m <= 16 else 2), poisoned_outputs():
        check_against_reference(spec.fn, spec.reference, (a, q, s, z), dict(group_size=G))


@pytest.mark.parametrize("path", ["gemv", "tc"])
def test_fractional_zeros_and_float32_scales(path):
    """Zero points need not be integers (HQQ-style) and scales may be float32: both decode
    kernels take z off in float32 sums (exact for any z)."""
    M, N, K, G = 2, 24, 256, 64
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (N, K), generator=g)
    qw = I4.pack_int4(q).to(DEV)
    s = (torch.rand(K // G, N, generator=g) * 0.02 + 0.001).to(DEV)
    z = (torch.rand(K // G, N, generator=g) * 15).to(DEV)  # fractional, float32
    for dtype in (BF16, F16):
        a = make_tensor((M, K), dtype, seed=1)
        spec = registry.get("matmul_int4")
        with I4.int4_config(path=path):
            check_against_reference(spec.fn, spec.reference, (a, qw, s, z), dict(group_size=G))


@pytest.mark.parametrize("path", ["gemv", "tc"])
def test_strided_activations(path):
    """Non-contiguous a (every other column of a wider tensor, and a transposed view)."""
    N, K, G = 40, 256, 128
    q, s, z = tkit.quantize_int4(make_tensor((N, K), BF16, seed=2), G)
    w16 = tkit.dequantize_int4(q, s, z, group_size=G, dtype=BF16)
    wide = make_tensor((3, 2 * K), BF16, seed=1)[:, ::2]
    tall = make_tensor((K, 2), BF16, seed=4).t()
    for a in (wide, tall):
        assert not a.is_contiguous()
        with I4.int4_config(path=path):
            out = tkit.matmul_int4(a, q, s, z, group_size=G)
        assert_close_to_reference(out, a.double() @ w16.double().T, a @ w16.T)


@pytest.mark.parametrize("path", ["gemv", "tc"])
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_every_code_in_every_nibble(path, dtype):
    """Every code 0..15 in every nibble position (the bit tricks of the dequantization: the
    GEMV's rotations, the decode kernel's byte gathers of q and q >> 4, the sign bit)."""
    N, K, G = 16, 128, 128
    codes = torch.arange(N * K).reshape(N, K) % 16
    codes[0] = 15  # the word 0xFFFFFFFF (-1 as int32)
    codes[1] = 8   # 0x88888888, negative
    codes[2] = (torch.arange(K) // 8) % 16  # one code a word
    qw = I4.pack_int4(codes).to(DEV)
    s = torch.full((1, N), 0.5, device=DEV)
    z = torch.full((1, N), 3.0, device=DEV)
    a = make_tensor((1, K), dtype, seed=1)
    ref = a.double() @ ((codes.double().to(DEV) - 3.0) * 0.5).T
    with I4.int4_config(path=path):
        out = tkit.matmul_int4(a, qw, s, z, group_size=G)
    assert_close_to_reference(out, ref, (a.float() @ ((codes.float().to(DEV) - 3) * .5).T
                                         ).to(dtype))


# ---- converters -------------------------------------------------------------------------------
def _awq_pack_cols(x):
    """AutoAWQ's WQLinear_GEMM packing, written out: word c of a row holds column
    8*c + order[i] in bits 4*i, order = [0, 2, 4, 6, 1, 3, 5, 7]."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    R, Cn = x.shape
    out = torch.zeros(R, Cn // 8, dtype=torch.int64)
    for c in range(Cn // 8):
        for i in range(8):
            out[:, c] |= x[:, 8 * c + order[i]].to(torch.int64) << (4 * i)
    return torch.where(out >= 2 ** 31, out - 2 ** 32, out).to(torch.int32)


def _gptq_pack(iw, zeros):
    """AutoGPTQ's QuantLinear.pack, written out: qweight (K // 8, N) packs 8 consecutive input
    rows per word, in order; qzeros (K // G, N // 8) packs 8 columns per word, in order, after
    ``zeros -= 1``."""
    K, N = iw.shape
    qw = torch.zeros(K // 8, N, dtype=torch.int64)
    for i in range(K // 8):
        for j in range(8):
            qw[i] |= iw[8 * i + j].to(torch.int64) << (4 * j)
    zm = (zeros - 1) & 0xF
    qz = torch.zeros(zeros.shape[0], N // 8, dtype=torch.int64)
    for c in range(N // 8):
        for j in range(8):
            qz[:, c] |= zm[:, 8 * c + j].to(torch.int64) << (4 * j)
    wrap = lambda t: torch.where(t >= 2 ** 31, t - 2 ** 32, t).to(torch.int32)  # noqa: E731
    return wrap(qw), wrap(qz)


def _checkpoint(K=64, N=16, G=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    iw = torch.randint(0, 16, (K, N), generator=g)  # codes, (in, out) as checkpoints hold them
    zeros = torch.randint(1, 16, (K // G, N), generator=g)
    scales = (torch.rand(K // G, N, generator=g) * 0.02 + 0.001).to(F16)
    w = ((iw - zeros.repeat_interleave(G, 0)).double()
         * scales.double().repeat_interleave(G, 0)).t()  # (N, K), the nn.Linear weight
    return iw, zeros, scales, w


def test_int4_from_awq_hand_packed():
    iw, zeros, scales, w = _checkpoint()
    packed = (_awq_pack_cols(iw), _awq_pack_cols(zeros), scales)
    q, s, z = tkit.int4_from_awq(*(t.to(DEV) for t in packed))
    w = w.to(DEV)
    wd = tkit.dequantize_int4(q, s, z, group_size=32, dtype=torch.float64)
    assert torch.equal(wd, w)
    a = make_tensor((3, 64), F16, seed=1)
    out = tkit.matmul_int4(a, q, s, z, group_size=32)
    assert_close_to_reference(out, a.double() @ w.T, (a @ w.to(F16).T), name="awq matmul")


@pytest.mark.parametrize("with_g_idx", [False, True])
def test_int4_from_gptq_hand_packed(with_g_idx):
    iw, zeros, scales, w = _checkpoint(seed=1)
    qw, qz = _gptq_pack(iw, zeros)
    g_idx = torch.arange(64, dtype=torch.int32, device=DEV) // 32 if with_g_idx else None
    qw, qz, scales, w = qw.to(DEV), qz.to(DEV), scales.to(DEV), w.to(DEV)
    q, s, z = tkit.int4_from_gptq(qw, qz, scales, g_idx)
    assert torch.equal(q, qw)  # tkit's layout is GPTQ's qweight
    wd = tkit.dequantize_int4(q, s, z, group_size=32, dtype=torch.float64)
    assert torch.equal(wd, w)


def test_int4_from_gptq_v2_and_act_order():
    iw, zeros, scales, w = _checkpoint(seed=2)
    qw, qz_minus_one = _gptq_pack(iw, zeros + 1)  # packs zeros + 1 - 1 = the zeros themselves
    qw, qz_minus_one, scales, w = (t.to(DEV) for t in (qw, qz_minus_one, scales, w))
    q, s, z = tkit.int4_from_gptq(qw, qz_minus_one, scales, checkpoint_format="gptq_v2")
    assert torch.equal(tkit.dequantize_int4(q, s, z, group_size=32, dtype=torch.float64), w)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="act-order"):
        g_idx = (torch.arange(64, device=DEV) // 32)[perm.to(DEV)]
        tkit.int4_from_gptq(qw, qz_minus_one, scales, g_idx)


# ---- errors -----------------------------------------------------------------------------------
def test_bad_arguments_are_named():
    w = make_tensor((16, 64), F16, seed=2)
    q, s, z = tkit.quantize_int4(w, 32)
    a = make_tensor((2, 64), F16, seed=1)
    with pytest.raises(ValueError, match="group_size=48 does not divide K=64"):
        tkit.quantize_int4(w, 48)
    with pytest.raises(ValueError, match="multiple of 16"):
        tkit.quantize_int4(w, 8)
    with pytest.raises(TypeError, match="a has dtype float32"):
        tkit.matmul_int4(a.float(), q, s, z, group_size=32)
    with pytest.raises(TypeError, match="qweight has dtype"):
        tkit.matmul_int4(a, q.to(torch.int64), s, z, group_size=32)
    with pytest.raises(ValueError, match="a.shape\\[-1\\]=32"):
        tkit.matmul_int4(a[:, :32], q, s, z, group_size=32)
    with pytest.raises(ValueError, match="scales must have shape"):
        tkit.matmul_int4(a, q, s, z, group_size=16)
    with pytest.raises(ValueError, match="zeros must have the shape"):
        tkit.matmul_int4(a, q, s, z[:1], group_size=32)
    with pytest.raises(ValueError, match="bias must have shape"):
        tkit.matmul_int4(a, q, s, z, group_size=32, bias=torch.zeros(5, dtype=F16, device=DEV))
    with pytest.raises(ValueError, match="group_size=64 does not divide K"):
        tkit.matmul_int4(make_tensor((2, 96), F16, seed=1), *tkit.quantize_int4(
            make_tensor((16, 96), F16, seed=2), 32), group_size=64)
    with pytest.raises(ValueError, match="checkpoint_format"):
        tkit.int4_from_gptq(q, torch.zeros(2, 2, dtype=torch.int32, device=DEV), s,
                            checkpoint_format="x")


# ---- registry ---------------------------------------------------------------------------------
def test_check_cases():
    spec = registry.get("matmul_int4")
    for case in spec.check_cases():
        args, kwargs = case.make(DEV)
        check_against_reference(spec.fn, spec.reference, args, kwargs, ulps=spec.ulps)


def test_fuzz():
    spec = registry.get("matmul_int4")
    recipe = dict(spec.fuzz())
    fn, ref = recipe.pop("fn"), recipe.pop("reference")
    fuzz(fn, ref, **recipe, max_examples=None if ON_GPU else 8)


def test_opcheck():
    op, args, kwargs = registry.get("matmul_int4").opcheck()
    opcheck(op, args, kwargs)


def test_gemv_loop_with_one_vector_a_thread_has_no_shared_round_trip():
    """The M=1 GEMV's 16-column default (K=N=8192): one vector of 4 columns a thread, so the
    scales' tl.load layout is the codes' own. Under triton 3.6 (the GPU machine's) its step
    is the threads' own work: no CTA barrier, no shared-memory store or load; under every
    version CI runs, 128 registers or fewer with no stack. The 32-column default (K=4096
    N=14336, two vectors a thread) meets its scales through shared memory every step under
    3.6 (8 barriers a step there); triton 3.9 gives both tiles barriers."""
    import triton

    from tkit import ir

    def loop_of(K, N):
        a = torch.empty(1, K, dtype=torch.bfloat16, device="meta")
        q = torch.empty(K // 8, N, dtype=torch.int32, device="meta")
        s = torch.empty(K // 128, N, dtype=torch.bfloat16, device="meta")
        c = ir.compile("matmul_int4", a, q, s, s, group_size=128, arch="sm_90")
        assert c.name == "_matmul_int4_gemv_kernel"
        return c, ir.summary(c, echo=False).main_loop

    c, loop = loop_of(8192, 8192)
    assert loop["instructions"] > 300, "the step loop was not found"  # 128 weights a thread
    hist = loop["histogram"]
    assert hist.get("LDG.128", 0) >= 8, hist  # the codes' 16-byte loads
    assert not [k for k in hist if k.startswith(("STL", "LDL"))], hist
    assert c.n_spills == 0 and c.n_regs <= 128 and c.resources()["stack"] == 0
    if triton.__version__.startswith("3.6"):
        assert not [k for k in hist if k.startswith(("BAR", "STS", "LDS"))], hist
        _, wide = loop_of(4096, 14336)
        assert wide["histogram"].get("BAR", 0) > 0, wide["histogram"]
