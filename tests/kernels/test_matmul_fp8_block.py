"""Block-scaled FP8 GEMM (tkit.matmul_fp8 with DeepSeek-V3's 1x128 / 128x128 scales): against a
float64 reference that applies the scales block by block, partial blocks along K and N, both
operand layouts, the epilogue, the pointer and (on a GPU) TMA kernels, the mode detection next
to the per-tensor and per-row/column modes, errors, registration."""

import dataclasses

import pytest
import torch

import tkit
from tkit import registry
from tkit.kernels.matmul import fp8_block as FB
from tkit.testing import assert_close_to_reference, check_against_reference, opcheck

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
F8 = torch.float8_e4m3fn


def _operands(M, N, K, b_trans=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g).to(F8)
    w = torch.randn(N, K, generator=g).to(F8)
    b = w.t() if b_trans else w.t().contiguous()
    kb, nb = -(-K // 128), -(-N // 128)
    sa = torch.rand(M, kb, generator=g) + 0.5
    sb = (torch.rand(kb, nb, generator=g) + 0.5) * K ** -0.5
    return a.to(DEV), b.to(DEV), sa.to(DEV), sb.to(DEV)


def _f32_floor(ref):
    """The floor of a float32 output's comparison: in the interpreter the products and sums
    are float32 (only their order differs from the reference); on Hopper each 128-deep group
    is summed inside the fp8 MMA, which keeps about 14 bits of its running sum (docs/NOTES.md):
    errors up to 3.5e-4 of max|ref| measured on the H200, so 2**-10 of it there."""
    return (2.0 ** -10 if ON_GPU else 1e-5) * float(ref.abs().max())


def _chain_floor(ref, K):
    """The floor of a float32 output of the rescale schedule, whose running sum stays in the
    fp8 MMA over all of K: each m64nNk32 step keeps about 13 bits of it (truncated), so up to
    2**-13 of the sum a step, K / 32 steps (on the H200 the error at K = 1024 was half of
    that: 2e-3 of max|ref|, the schedule's own numerics, not a bug:
    test_gluon_rescale_numerics_are_an_fp8_mma_chain)."""
    if not ON_GPU:
        return _f32_floor(ref)
    return max(_f32_floor(ref), 2.0 ** -13 * -(-K // 32) * float(ref.abs().max()))


def _blockwise_ref(a, b, sa, sb):
    """The definition, one K block at a time: sum_kb sa[:, kb] * sb[kb, n // 128] * partial."""
    M, K = a.shape
    N = b.shape[1]
    a, b, sa, sb = a.cpu().double(), b.cpu().double(), sa.cpu().double(), sb.cpu().double()
    out = torch.zeros(M, N, dtype=torch.float64)
    cols = torch.arange(N) // 128
    for kb in range(sa.shape[1]):
        sl = slice(kb * 128, min(K, (kb + 1) * 128))
        out += (a[:, sl] @ b[sl]) * sa[:, kb:kb + 1] * sb[kb, cols][None, :]
    return out


@pytest.mark.parametrize("M,N,K,b_trans", [(33, 200, 384, True), (5, 128, 128, False),
                                           (70, 130, 260, True), (1, 256, 512, False)])
def test_block_scaled_against_float64(M, N, K, b_trans):
    a, b, sa, sb = _operands(M, N, K, b_trans)
    out = tkit.matmul_fp8(a, b, sa, sb, out_dtype=torch.float32)
    ref = _blockwise_ref(a, b, sa, sb)
    # float32 output: only the order of float32 additions differs from the reference
    assert_close_to_reference(out, ref, floor=_f32_floor(ref))
    # the registry's reference (regrouped: scale the operands, then one matmul) agrees
    spec_ref = registry.get("matmul_fp8").reference(a.double(), b.double(), sa, sb)
    torch.testing.assert_close(spec_ref.cpu(), ref, rtol=1e-12, atol=1e-9)


def test_block_scaled_epilogue_bf16():
    a, b, sa, sb = _operands(40, 160, 256, seed=1)
    g = torch.Generator().manual_seed(5)
    bias = torch.randn(160, generator=g).to(torch.bfloat16).to(DEV)
    res = torch.randn(40, 160, generator=g).to(torch.bfloat16).to(DEV)
    spec = registry.get("matmul_fp8")
    check_against_reference(spec.fn, spec.reference, (a, b, sa, sb),
                            dict(bias=bias, activation="silu", residual=res))


def test_scales_are_applied_per_block():
    """Scaling one K block of a row, or one 128x128 block of b, moves exactly the outputs it
    feeds (a kernel applying the scales in the epilogue could not get this right)."""
    a, b, sa, sb = _operands(8, 256, 384, seed=2)
    base = tkit.matmul_fp8(a, b, sa, sb, out_dtype=torch.float32)
    sa2 = sa.clone()
    sa2[3, 1] *= 2
    sb2 = sb.clone()
    sb2[2, 1] *= 4
    got = tkit.matmul_fp8(a, b, sa2, sb2, out_dtype=torch.float32)
    ref = _blockwise_ref(a, b, sa2, sb2)
    assert_close_to_reference(got, ref, floor=_f32_floor(ref))
    assert not torch.allclose(got[3], base[3])
    assert torch.equal(got[:3, :128], base[:3, :128])


def test_block_mode_detection_leaves_other_modes_alone():
    a, b, _, _ = _operands(16, 256, 256, seed=3)
    K, N = 256, 256
    assert FB.is_block_scaled(a, b, torch.ones(16, 2), torch.ones(2, 2))
    assert not FB.is_block_scaled(a, b, torch.ones(1), torch.ones(1))
    assert not FB.is_block_scaled(a, b, torch.ones(16, 1), torch.ones(1, N))
    assert not FB.is_block_scaled(a, b, torch.ones(16), torch.ones(N))
    del K


def test_block_scaled_errors_name_the_argument():
    a, b, sa, sb = _operands(16, 256, 384)
    with pytest.raises(ValueError, match="scale_b must have shape .* = \\(3, 2\\)"):
        tkit.matmul_fp8(a, b, sa, torch.ones(1, device=DEV))
    with pytest.raises(ValueError, match="scale_a must have shape .* = \\(16, 3\\)"):
        tkit.matmul_fp8(a, b, sa[:, :2], sb)
    with pytest.raises(TypeError, match="scale_b has dtype float16"):
        tkit.matmul_fp8(a, b, sa, sb.half())


def test_check_cases_and_opcheck():
    from tkit.specs.matmul import fp8_block_check_cases

    spec = registry.get("matmul_fp8")
    for case in fp8_block_check_cases():
        args, kwargs = case.make(DEV)
        check_against_reference(spec.fn, spec.reference, args, kwargs, ulps=spec.ulps)
    from tkit.specs.matmul import _opcheck_fp8_block

    op, args, kwargs = _opcheck_fp8_block()
    # opcheck's schema test compares inputs before and after with torch.allclose, which
    # neither torch's CPU nor its CUDA kernels implement for float8 ("mul_cuda" not
    # implemented for 'Float8_e4m3fn' on the H200)
    opcheck(op, args, kwargs, test_utils=("test_faketensor", "test_autograd_registration",
                                          "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("b_trans", [True, False])
def test_block_scaled_tma_path(b_trans):
    """The Hopper kernel, forced (the interpreter runs tensor descriptors too); TMA needs
    16-byte row strides, so N is a multiple of 16 here; partial blocks along M, N and K."""
    a, b, sa, sb = _operands(40, 144, 320, b_trans) if not ON_GPU else \
        _operands(300, 528, 1088, b_trans)
    out = FB._fp8_block_impl(a, b, sa, sb, out_dtype=torch.float32, path="tma")
    ref = _blockwise_ref(a, b, sa, sb)
    assert_close_to_reference(out, ref, floor=max(_f32_floor(ref), 1e-4 * float(ref.abs().max())))


def test_matmul_config_overrides_keep_the_scale_block():
    """``matmul_config`` reaches the block-scaled kernels (tile, warps) but not BLOCK_K, which
    is the scale block (128); captured on meta tensors, both kernels."""
    from tkit.kernels import _common
    from tkit.kernels import matmul as mm

    meta = dict(device="meta")
    a = torch.empty(256, 1024, dtype=F8, **meta)
    b = torch.empty(512, 1024, dtype=F8, **meta).t()
    sa = torch.empty(256, 8, dtype=torch.float32, **meta)
    sb = torch.empty(8, 4, dtype=torch.float32, **meta)
    for path in ("tma", "ptr"):
        with _common.capture_launches() as launches, \
                mm.matmul_config(block_n=64, block_k=64, num_warps=4):
            FB._fp8_block_impl(a, b, sa, sb, path=path)
        (kw,) = [lc.kwargs for lc in launches]
        assert (kw["BLOCK_N"], kw["BLOCK_K"], kw["num_warps"]) == (64, 128, 4), path
        with pytest.raises(TypeError, match="TmaConfig"):
            FB._fp8_block_impl(a, b, sa, sb, path="tma",
                               config=mm.PtrConfig(block_m=64, block_n=64, block_k=128,
                                                   num_warps=4))


def _bf16_peer(a, b, sa, sb):
    """PyTorch's own bfloat16 result of the block-scaled product: the dequantized operands
    multiplied in float32, rounded to bfloat16 (the peer of the reference rule)."""
    K = a.shape[1]
    ks = torch.arange(K) // 128
    cols = torch.arange(b.shape[1]) // 128
    a_dq = a.cpu().float() * sa.cpu()[:, ks]
    b_dq = b.cpu().float() * sb.cpu()[ks][:, cols]
    return (a_dq @ b_dq).to(torch.bfloat16)


_TMA_VARIANTS = [
    # two scale groups a step (K = 320: the second step's second group lies past K)
    dict(block_m=32, block_n=64, block_k=256, num_warps=4),
    # a tile over two 128-column blocks of b (two scales of b a step; N = 288: the second
    # block of the last tile column lies past N)
    dict(block_m=32, block_n=256, block_k=128, num_warps=4),
    dict(block_m=32, block_n=256, block_k=256, num_warps=4, num_stages=2, epi_subtile=False),
    # two programs an SM (the persistent stride is twice the SM count)
    dict(block_m=64, block_n=128, block_k=256, num_warps=4, programs_per_sm=2),
]


@pytest.mark.parametrize("variant", _TMA_VARIANTS, ids=lambda v: "-".join(
    f"{k}{v[k]}" for k in ("block_m", "block_n", "block_k")) + f"-p{v.get('programs_per_sm', 1)}")
@pytest.mark.parametrize("b_trans", [True, False])
def test_block_scaled_tma_variants(variant, b_trans):
    """The TMA kernel's tile / scale-group variants (the config sweep's), given as a TmaConfig
    and through matmul_config: the float32 output against the blockwise float64 reference."""
    from tkit.kernels import matmul as mm

    M, N, K = (40, 288, 320) if not ON_GPU else (300, 800, 1088)
    a, b, sa, sb = _operands(M, N, K, b_trans, seed=7)
    ref = _blockwise_ref(a, b, sa, sb)
    cfg = mm.TmaConfig(**variant)
    out = FB._fp8_block_impl(a, b, sa, sb, out_dtype=torch.float32, path="tma", config=cfg)
    assert_close_to_reference(out, ref, floor=_f32_floor(ref))
    with mm.matmul_config(**variant):
        out2 = FB._fp8_block_impl(a, b, sa, sb, out_dtype=torch.float32, path="tma")
    assert torch.equal(out2, out)


@pytest.mark.parametrize("path,variant", [
    ("ptr", {}), ("tma", {}), ("tma", dict(block_m=16, block_n=128, block_k=256, num_warps=4)),
])
def test_block_scaled_long_k(path, variant):
    """K = 8192 (64 scale groups, the length where a running fp8 MMA sum broke the rule for
    the per-tensor kernel): bfloat16 output against the float64 reference on the dequantized
    operands, the rule's peer PyTorch's float32 product rounded to bfloat16."""
    from tkit.kernels import matmul as mm

    M, N, K = (16, 144, 8192) if not ON_GPU else (256, 512, 8192)
    a, b, sa, sb = _operands(M, N, K, seed=11)
    with mm.matmul_config(**variant):
        out = FB._fp8_block_impl(a, b, sa, sb, out_dtype=torch.bfloat16, path=path)
    ref = _blockwise_ref(a, b, sa, sb)
    assert_close_to_reference(out, ref, _bf16_peer(a, b, sa, sb), name=f"{path} K=8192")


# --------------------------------------------------------------------------------------------
# The Gluon Hopper kernel (fp8_block_hopper): scope and dispatch on any machine, compiled
# schedule on the CPU (sm_90a, ahead of time), results on an sm_90 GPU
# --------------------------------------------------------------------------------------------
def _gluon_or_skip():
    try:
        from tkit.kernels.matmul import fp8_block_hopper as FH
    except ImportError as e:  # a Triton without Gluon's Hopper API
        pytest.skip(f"Gluon unavailable: {e}")
    return FH


def _on_h100_class():
    return ON_GPU and torch.cuda.get_device_capability() == (9, 0)


def test_gluon_scope_reasons():
    """supported() names what keeps an input off the Gluon kernel (no GPU needed: the device
    is checked last)."""
    FH = _gluon_or_skip()
    meta = dict(device="meta")
    a = torch.empty(256, 1024, dtype=F8, **meta)
    b = torch.empty(512, 1024, dtype=F8, **meta).t()
    sa = torch.empty(256, 8, dtype=torch.float32, **meta)
    sb = torch.empty(8, 4, dtype=torch.float32, **meta)
    bf = torch.bfloat16
    assert "K-major" in FH.supported(a, b.contiguous(), sa, sb, bf)
    assert "row-major" in FH.supported(a.t().contiguous().t(), b, sa, sb, bf)
    assert "output rows" in FH.supported(a, torch.empty(1020, 1024, dtype=F8, **meta).t(),
                                         sa, torch.empty(8, 8, **meta), bf)
    assert "CUDA" in FH.supported(a, b, sa, sb, bf)
    assert "dtype" in FH.supported(a, b, sa, sb, torch.float8_e4m3fn)
    # the dispatch: meta tensors, a forced path or a Triton config never reach it
    assert FB._gluon_choice(a, b, sa, sb, bf, None, None, None, None)[0] is None
    assert "forced" in FB._gluon_choice(a, b, sa, sb, bf, None, None, "tma", None)[1]
    with pytest.raises(ValueError, match="Gluon block-scaled kernel does not apply"):
        FB._fp8_block_impl(a, b, sa, sb, path="gluon")


def test_gluon_config_validation():
    FH = _gluon_or_skip()
    with pytest.raises(ValueError, match="stages"):
        FH.HopperBlockConfig(stages=1)
    with pytest.raises(ValueError, match="256 columns only with the rescale schedule"):
        FH.HopperBlockConfig(block_n=256, schedule="promote")
    with pytest.raises(ValueError, match=r"block_n must be one of \(0, 256\) with sche"):
        FH.HopperBlockConfig(block_n=128, schedule="rescale")
    with pytest.raises(ValueError, match="block_n must be one of"):
        FH.HopperBlockConfig(block_n=192)
    with pytest.raises(ValueError, match="schedule must be one of"):
        FH.HopperBlockConfig(schedule="fresh")
    with pytest.raises(ValueError, match="group_m"):
        FH.HopperBlockConfig(group_m=-1)
    with pytest.raises(TypeError, match="unknown HopperBlockConfig"):
        with FH.hopper_block_config(block_k=64):
            pass
    with FH.hopper_block_config(stages=3, group_m=4):
        assert FH.current_config() == FH.HopperBlockConfig(stages=3, group_m=4)
    # bf16 output: 6 slots of 32 KB and two 16 KB output tiles fit sm_90's 227 KB (auto)
    full = FH.HopperBlockConfig(block_n=128, stages=0)
    assert FH.stages_for(full, 2) == 6 and FH.stages_for(full, 4) == 5
    assert FH.stages_for(FH.HopperBlockConfig(block_n=128), 2) == 5
    # the promote schedule, block_n 0: 64 where 128 x 128 tiles would number at most half
    # the SMs; group_m 0: 8
    auto = FH.HopperBlockConfig(schedule="promote")
    K = 7168
    assert FH.resolve(auto, 128, 4096, K, 132).block_n == 64  # 32 tiles
    assert FH.resolve(auto, 256, 7168, K, 132).block_n == 128  # 112 tiles
    # rows for one consumer and long K: 128 columns, the deepest ring (an explicit one kept)
    long_k = FH.ONE_CONSUMER_LONG_K
    assert FH.resolve(auto, 64, 7168, long_k, 132) == dataclasses.replace(
        auto, block_n=128, stages=0, group_m=8)
    assert FH.resolve(dataclasses.replace(auto, stages=3), 64, 7168, long_k,
                      132).stages == 3
    assert FH.resolve(auto, 64, 7168, long_k - 128, 132).block_n == 64
    assert FH.resolve(auto, 65, 7168, long_k, 132).block_n == 64
    assert FH.resolve(auto, 8192, 8192, K, 132) == dataclasses.replace(auto, block_n=128,
                                                                       group_m=8)
    assert FH.resolve(FH.HopperBlockConfig(block_n=128), 64, 256, K, 132).block_n == 128
    # the rescale schedule: 256 columns (group_m 16) where 128 x 256 tiles fill the SMs, the
    # output is bf16 and K <= RESCALE_MAX_K; else the promote schedule's choice; a residual
    # always takes the promote one
    rs = FH.HopperBlockConfig(schedule="rescale")
    for M, N in ((8192, 8192), (4096, 4096)):  # 256 / 512 tiles
        assert FH.resolve(rs, M, N, K, 132) == dataclasses.replace(rs, block_n=256, group_m=16)
    assert FH.resolve(rs, 4096, 4096, FH.RESCALE_MAX_K, 132).schedule == "rescale"
    promote = dataclasses.replace(rs, schedule="promote", group_m=8)
    bf, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    for M, N, k, dt, res, bn in ((1024, 4096, K, bf, False, 128),  # 128 tiles: too few
                                 (128, 4096, K, bf, False, 64),
                                 (8192, 8192, FH.RESCALE_MAX_K + 128, bf, False, 128),
                                 (8192, 8192, K, f16, False, 128),
                                 (8192, 8192, K, f32, False, 128),
                                 (8192, 8192, K, bf, True, 128)):
        assert FH.resolve(rs, M, N, k, 132, dt, res) == dataclasses.replace(promote, block_n=bn)
    r256 = FH.HopperBlockConfig(schedule="rescale", block_n=256, group_m=4, shared_out=False)
    # asked for: even with few tiles, long K, other outputs; not with a residual
    assert FH.resolve(r256, 64, 256, 16384, 132, f32) == r256
    assert FH.resolve(r256, 64, 256, K, 132, bf, True).schedule == "promote"
    # stages: lowered to what fits (48 KB a slot, 64 KB of bf16 output tiles: 3 slots)
    assert FH.stages_for(r256, 2) == 3 and FH.stages_for(r256, 4) == 2
    assert FH.stages_for(dataclasses.replace(r256, stages=2), 2) == 2
    # one output staging tile for both consumers: 4 slots (float32 output: 3)
    shared = dataclasses.replace(r256, shared_out=True)
    assert FH.stages_for(shared, 2) == 4 and FH.stages_for(shared, 4) == 3
    assert FH.stages_for(dataclasses.replace(shared, schedule="promote", block_n=128), 2) == 5
    for cfg, es in ((r256, 2), (r256, 4), (full, 2), (full, 4), (shared, 2), (shared, 4)):
        assert FH.smem_bytes(cfg, FH.stages_for(cfg, es), es) <= 232448


def _sass_ops(sass: str) -> list[str]:
    """The opcodes of a SASS listing with WARPGROUP.DEPBAR's operand ("DEPBAR1" / "DEPBAR0")."""
    import re

    ops = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);", line)
        if m is None:
            continue
        op, rest = m.groups()
        if op == "WARPGROUP.DEPBAR.LE":
            op = "DEPBAR" + rest.strip()[-1]
        ops.append(op)
    return ops


@pytest.fixture(scope="module")
def gluon_compiled(tmp_path_factory):
    import os
    import subprocess

    import triton

    FH = _gluon_or_skip()
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    cache = {}

    def get(cfg):
        if cfg not in cache:
            k = FH.compile_sm90(cfg)
            path = tmp_path_factory.mktemp("cubin") / "k.cubin"
            path.write_bytes(k.asm["cubin"])
            sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", str(path)],
                                  capture_output=True, text=True, check=True).stdout
            cache[cfg] = (k, sass)
        return cache[cfg]

    return get


@pytest.mark.parametrize("block_n", [128, 64])
def test_gluon_compiled_schedule(gluon_compiled, block_n):
    """sm_90a build: no local memory; the wgmmas are not serialized (ptxas does that to the
    whole kernel when an accumulator is read in flight: a wait after every QGMMA); in the
    paired loop the first group's promotion (64 FFMA at block_n 128, and the slot's release)
    sits between ``wait_group 1`` and ``wait_group 0``, after both groups' MMAs were issued;
    consumer 1's lead group and the odd group left over wait with ``wait_group 0``."""
    FH = _gluon_or_skip()
    cfg = FH.HopperBlockConfig(block_n=block_n)
    k, sass = gluon_compiled(cfg)
    assert k.metadata.shared <= FH.smem_bytes(cfg, FH.stages_for(cfg, 2), 2)
    ops = _sass_ops(sass)
    assert "LDL" not in ops and "STL" not in ops
    qgmma = sum(op.startswith("QGMMA") for op in ops)
    waits = ops.count("DEPBAR0") + ops.count("DEPBAR1")
    assert qgmma >= 4 * waits, (qgmma, waits)  # 4 m64nNk32 a group, one wait a group
    assert "UTMALDG.2D" in ops and "UTMASTG.2D" in ops
    # two consumers: two paired loops (one wait_group 1 each); consumer 1's lead group
    assert ops.count("DEPBAR1") == 2 and ops.count("DEPBAR0") == 5
    for _ in range(2):
        i = ops.index("DEPBAR1")
        j = ops.index("DEPBAR0", i)
        between = ops[i:j]
        assert between.count("FFMA") == block_n // 2 and "SYNCS.ARRIVE.TRANS64.A1T0" in between
        prev = max((n for n, op in enumerate(ops[:i]) if op.startswith("DEPBAR")), default=0)
        assert sum(op.startswith("QGMMA") for op in ops[prev:i]) == 8
        ops = ops[j:]


@pytest.mark.parametrize("pingpong,shared_out", [(True, False), (False, False), (True, True)],
                         ids=["pingpong", "free", "pingpong-shared_out"])
def test_gluon_compiled_rescale_schedule(gluon_compiled, pingpong, shared_out):
    """The rescale schedule's sm_90a build: no local memory, shared memory within the
    budget; each consumer issues a group's four m64 x N x 32 wgmmas and waits for them
    (``wait_group 0``, nothing else in flight: a serialized build would wait after every
    QGMMA); in the K loop the accumulator's rescale (one FMUL an element: N / 2 a thread,
    the factor an outer product of a row and a column-block ratio, computed once) sits between
    the previous group's wait and this group's wgmmas, the next scales' loads and ratios
    under the MMAs; with pingpong each issue also waits for the other consumer's turn;
    shared_out: 4 ring slots fit, each TMA store is waited for (its read) before the staging
    tile is handed on."""
    FH = _gluon_or_skip()
    cfg = FH.HopperBlockConfig(schedule="rescale", block_n=256, pingpong=pingpong,
                               shared_out=shared_out)
    k, sass = gluon_compiled(cfg)
    assert FH.stages_for(cfg, 2) == (4 if shared_out else 3)
    assert k.metadata.shared <= FH.smem_bytes(cfg, FH.stages_for(cfg, 2), 2) <= 232448
    ops = _sass_ops(sass)
    assert "LDL" not in ops and "STL" not in ops
    qgmma = [n for n, op in enumerate(ops) if op.startswith("QGMMA")]
    waits = [n for n, op in enumerate(ops) if op == "DEPBAR0"]
    import re

    assert set(re.findall(r"QGMMA\.(\w+)", sass)) == {f"64x{cfg.block_n}x32"}
    # per consumer: the tile's first group, then the loop's, four wgmmas before each wait
    assert len(waits) == 4 and "DEPBAR1" not in ops
    for lo, hi in zip([-1] + waits, waits):
        assert sum(lo < q < hi for q in qgmma) == 4
    assert len(qgmma) == 16
    for first in (waits[0], waits[2]):  # a consumer's first group's wait, then its K loop
        nxt = next(q for q in qgmma if q > first)
        seg = ops[first:nxt]
        assert cfg.block_n // 2 <= seg.count("FMUL") <= cfg.block_n // 2 + 32, seg.count("FMUL")
        assert seg.count("SYNCS.PHASECHK.TRANS64.TRYWAIT") == (2 if cfg.pingpong else 1)
        # the next group's scales are loaded and its ratios (reciprocals) computed while
        # this group's wgmmas run
        under = ops[nxt:waits[waits.index(first) + 1]]
        assert "LDG" in " ".join(under) and "MUFU" in " ".join(under)
    # each consumer's store: the TMA store, then (shared_out) its read waited for, the arrive
    stores = [n for n, op in enumerate(ops) if op.startswith("UTMASTG")]
    assert len(stores) == 2
    for n in stores:
        after = ops[n + 1:n + 8]
        assert ("DEPBAR.LE" in after and "SYNCS.ARRIVE.TRANS64.A1T0" in after) == shared_out


def _rescale_model(a, b, sa, sb):
    """The rescale schedule's algebra in float32 (the kernel's: the accumulator in units of the
    current group's scales, u_a a row times u_b a 128-column block of b; before group g it is
    multiplied by u / s, or 1 where the new scale s is 0; after the last group by u), on
    group sums computed in float64."""
    M, K = a.shape
    N = b.shape[1]
    a, b = a.cpu().double(), b.cpu().double()
    sa, sb = sa.cpu().float(), sb.cpu().float()
    cols = torch.arange(N) // 128
    groups = sa.shape[1]

    def ratio(u, s):
        return torch.where(s != 0, u / s, torch.ones_like(u)), torch.where(s != 0, s, u)

    def part(g):
        sl = slice(g * 128, min(K, (g + 1) * 128))
        return (a[:, sl] @ b[sl]).float()

    u_a = torch.where(sa[:, 0] != 0, sa[:, 0], torch.ones(M))
    u_b = torch.where(sb[0] != 0, sb[0], torch.ones(sb.shape[1]))
    acc = part(0)
    for g in range(1, groups):
        r_a, u_a = ratio(u_a, sa[:, g])
        r_b, u_b = ratio(u_b, sb[g])
        acc = acc * (r_a[:, None] * r_b[cols][None, :]) + part(g)
    return acc * (u_a[:, None] * u_b[cols][None, :])


def _zero_scale_operands(M, N, K, seed):
    """Block-scaled operands whose scales span 2^-8..2^8 and are 0 in some groups (the
    group's codes then 0 too, as a quantizer makes them): scattered 1x128 groups of a,
    group 0 and the last group of some rows, one whole row, blocks of b in the first and last
    group."""
    a, b, sa, sb = _operands(M, N, K, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    sa = 2.0 ** (torch.rand(sa.shape, generator=g) * 16 - 8)
    sb = 2.0 ** (torch.rand(sb.shape, generator=g) * 16 - 8) * K ** -0.5
    za = torch.rand(sa.shape, generator=g) < 0.2
    za[1, 0] = za[2, -1] = za[3, :2] = True
    za[min(5, M - 1)] = True
    zb = torch.zeros(sb.shape, dtype=torch.bool)
    zb[0, 0] = zb[-1, -1] = True
    if sb.shape[0] > 2:
        zb[1:3, min(1, sb.shape[1] - 1)] = True
    ks = torch.arange(K) // 128
    cols = torch.arange(N) // 128
    a = torch.where(za[:, ks], 0.0, a.cpu().float()).to(F8)
    bt = b.cpu().float()
    bt = torch.where(zb[ks][:, cols], 0.0, bt).to(F8)
    b = bt.t().contiguous().t()  # K-major, as the kernel takes it
    sa = torch.where(za, 0.0, sa)
    sb = torch.where(zb, 0.0, sb)
    return a.to(DEV), b.to(DEV), sa.float().to(DEV), sb.float().to(DEV)


def test_rescale_model_matches_blockwise():
    """The rescale algebra (``_rescale_model``) gives the block-scaled product within float32
    rounding, with zero scales (and zero codes) in the first, last and middle groups, and
    scales over 16 binades; a zero scale whose codes are not zero is what the schedule does
    not support (the group is added in the previous group's units), and the model shows it."""
    a, b, sa, sb = _zero_scale_operands(24, 384, 1280, seed=3)
    a, b, sa, sb = a.cpu(), b.cpu(), sa.cpu(), sb.cpu()
    ref = _blockwise_ref(a, b, sa, sb)
    got = _rescale_model(a, b, sa, sb)
    assert_close_to_reference(got, ref, floor=1e-5 * float(ref.abs().max()))
    assert torch.equal(got[5], torch.zeros_like(got[5]))  # every scale of row 5 is 0
    a2 = a.float()
    a2[4, 128:256] = 1.0  # codes under a zero scale: the model is then wrong
    sa2 = sa.clone()
    sa2[4, 1] = 0.0
    ref2 = _blockwise_ref(a2.to(F8), b, sa2, sb)
    got2 = _rescale_model(a2.to(F8), b, sa2, sb)
    assert not torch.allclose(got2[4], ref2[4].float(), rtol=1e-3)


_GLUON_VARIANTS = [{}, dict(block_n=128), dict(block_n=64), dict(stages=2), dict(stages=3),
                   dict(group_m=1), dict(schedule="rescale", block_n=256, pingpong=False),
                   dict(schedule="rescale", block_n=256),
                   dict(schedule="rescale", block_n=256, stages=2, group_m=1),
                   dict(schedule="rescale", block_n=256, shared_out=True)]
_RESCALE_VARIANTS = [v for v in _GLUON_VARIANTS if v.get("schedule") == "rescale"]


@pytest.mark.skipif(not _on_h100_class(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("variant", _GLUON_VARIANTS, ids=lambda v: "-".join(
    f"{k}{v[k]}" for k in v) or "default")
@pytest.mark.parametrize("M,N,K", [(300, 528, 1088), (2048, 2304, 1024), (64, 256, 128),
                                   (129, 144, 320), (1, 16, 256), (8, 7168, 512)])
def test_gluon_against_float64(variant, M, N, K):
    """The Gluon kernel, forced, float32 output into poisoned memory: partial tiles along M, N
    and K (K = 320: a partial last group; K = 128: consumer 1's lead group alone, consumer 0's
    group left over; K = 256: one pair, or the lead and one left over; 1088: 9 groups),
    several tiles a CTA (2048 x 2304: 288 tiles over 132 SMs), the blockwise float64
    reference."""
    from tkit.kernels import _common
    FH = _gluon_or_skip()

    a, b, sa, sb = _operands(M, N, K, True, seed=M + N + K)
    ref = _blockwise_ref(a, b, sa, sb)
    cfg = FH.HopperBlockConfig(**variant)
    with _common.poisoned_outputs():
        out = FB._fp8_block_impl(a, b, sa, sb, out_dtype=torch.float32, path="gluon",
                                 config=cfg)
    floor = _chain_floor(ref, K) if cfg.schedule == "rescale" else _f32_floor(ref)
    assert_close_to_reference(out, ref, floor=floor)


@pytest.mark.skipif(not _on_h100_class(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("variant", _RESCALE_VARIANTS, ids=lambda v: "-".join(
    f"{k}{v[k]}" for k in v if k != "schedule"))
@pytest.mark.parametrize("M,N,K", [(200, 384, 1280), (70, 528, 384)])
def test_gluon_rescale_zero_scales(variant, M, N, K):
    """The rescale schedule with zero scales (and zero codes under them) in the first, last
    and middle groups of rows and of b's blocks, a row whose scales are all 0, scales over 16
    binades (ratios up to 2^16 between groups): float32 output against the float64
    reference; the all-zero row is exactly 0."""
    from tkit.kernels import _common
    FH = _gluon_or_skip()

    a, b, sa, sb = _zero_scale_operands(M, N, K, seed=M + K)
    ref = _blockwise_ref(a, b, sa, sb)
    with _common.poisoned_outputs():
        out = FB._fp8_block_impl(a, b, sa, sb, out_dtype=torch.float32, path="gluon",
                                 config=FH.HopperBlockConfig(**variant))
    assert_close_to_reference(out, ref, floor=_chain_floor(ref, K))
    assert torch.equal(out[5].cpu(), torch.zeros(N))


@pytest.mark.skipif(not _on_h100_class(), reason="needs an sm_90 GPU")
def test_gluon_rescale_numerics_are_an_fp8_mma_chain():
    """With unit scales the rescale schedule is one fp8 MMA chain over K, which is what
    torch._scaled_mm computes with use_fast_accum=True (4096^2 outputs: 512 tiles, no
    split-K), while the promote schedule restarts the chain every 128: float32 outputs at
    K = 2048, the rescale's error against float64 within 2x of cuBLAS's fast accumulation's
    and more than twice the promote's (the MMA keeps about 13 bits of a running sum)."""
    FH = _gluon_or_skip()
    M, N, K = 4096, 4096, 2048
    g = torch.Generator(device=DEV).manual_seed(9)
    a = torch.randn(M, K, device=DEV, generator=g).to(F8)
    b = torch.randn(N, K, device=DEV, generator=g).to(F8).t()
    sa = torch.ones(M, K // 128, device=DEV)
    sb = torch.ones(K // 128, N // 128, device=DEV)
    one = torch.ones((), device=DEV)
    ref = a.double() @ b.double()

    def err(x):
        return float((x.double() - ref).abs().max())
    fast = err(torch._scaled_mm(a, b, one, one, out_dtype=torch.float32, use_fast_accum=True))
    slow = err(torch._scaled_mm(a, b, one, one, out_dtype=torch.float32, use_fast_accum=False))
    res = err(FB._fp8_block_impl(a, b, sa, sb, out_dtype=torch.float32, path="gluon",
                                 config=FH.HopperBlockConfig(schedule="rescale", block_n=256)))
    pro = err(FB._fp8_block_impl(a, b, sa, sb, out_dtype=torch.float32, path="gluon",
                                 config=FH.HopperBlockConfig(block_n=128)))
    what = (f"max errors (max |ref| {float(ref.abs().max()):.4g}): rescale {res:.4g}, "
            f"fast accum {fast:.4g}, promote {pro:.4g}, cuBLAS {slow:.4g}")
    assert 0.5 * fast <= res <= 2 * fast, what
    assert res > 2 * pro, what


@pytest.mark.skipif(not _on_h100_class(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("variant", [dict(schedule="rescale", block_n=256),
                                     dict(block_n=128)],
                         ids=["256-pingpong", "promote-rescale-control"])
@pytest.mark.parametrize("K", [7168, 8192, 16384])
def test_gluon_rescale_long_k(variant, K):
    """The rescale schedule keeps one running sum inside the fp8 MMA over all of K (the
    promote schedule restarts it every 128, the control): bf16 output at DeepSeek-V3's
    K = 7168 and 16384 and at 8192 (where a running fp8 MMA sum broke the rule for the
    per-tensor kernel) against the float64 reference, the rule's peer PyTorch's float32
    product rounded to bf16."""
    FH = _gluon_or_skip()
    a, b, sa, sb = _operands(256, 512, K, seed=K)
    out = FB._fp8_block_impl(a, b, sa, sb, out_dtype=torch.bfloat16, path="gluon",
                             config=FH.HopperBlockConfig(**variant))
    ref = _blockwise_ref(a, b, sa, sb)
    assert_close_to_reference(out, ref, _bf16_peer(a, b, sa, sb), name=f"rescale K={K}")


@pytest.mark.skipif(not _on_h100_class(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("M,N,K,shared_out", [(2048, 4096, 7168, False),
                                              (1024, 7168, 8192, False),
                                              (2048, 4096, 7168, True)],
                         ids=["2048x4096x7168", "1024x7168x8192", "2048x4096x7168-shared_out"])
def test_gluon_rescale_chosen_by_resolve(M, N, K, shared_out):
    """What ``schedule="rescale"`` launches by itself at DeepSeek-V3-like shapes (128 x 256
    tiles filling the SMs, bf16 output, K up to RESCALE_MAX_K): the rescale schedule, within
    the reference rule on 256 rows against float64 on the dequantized operands (the peer:
    the same rows in float32, rounded to bf16); several tiles a CTA (shared_out: the
    consumers take the one staging tile in turn)."""
    from tkit.kernels import _common
    FH = _gluon_or_skip()

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert FH.resolve(FH.HopperBlockConfig(schedule="rescale"), M, N, K, sms).block_n == 256
    g = torch.Generator(device=DEV).manual_seed(M + K)
    a = torch.randn(M, K, device=DEV, generator=g).to(F8)
    b = torch.randn(N, K, device=DEV, generator=g).to(F8).t()
    sa = torch.rand(M, K // 128, device=DEV, generator=g) + 0.5
    sb = (torch.rand(K // 128, -(-N // 128), device=DEV, generator=g) + 0.5) * K ** -0.5
    with _common.poisoned_outputs(), FH.hopper_block_config(schedule="rescale",
                                                            shared_out=shared_out):
        out = tkit.matmul_fp8(a, b, sa, sb, out_dtype=torch.bfloat16)
    rows = torch.arange(0, M, M // 256, device=DEV)
    ks = torch.arange(K, device=DEV) // 128
    cols = torch.arange(N, device=DEV) // 128
    a_dq = a[rows].double() * sa[rows][:, ks].double()
    b_dq = b.double() * sb.double()[ks][:, cols]
    ref = a_dq @ b_dq
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        peer = (a_dq.float() @ b_dq.float()).to(torch.bfloat16)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert not torch.isnan(out.float()).any()
    assert_close_to_reference(out[rows], ref, peer, name=f"rescale {M}x{N}x{K}")


@pytest.mark.skipif(not _on_h100_class(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("res", [False, True])
def test_gluon_rescale_epilogue_256(res):
    """The rescale schedule at 256 columns with bias and activation (a residual takes the
    promote schedule: resolve), bf16 output: the reference rule."""
    from tkit.kernels import _common
    from tkit.kernels.elementwise.ops import _torch_activation
    FH = _gluon_or_skip()

    a, b, sa, sb = _operands(200, 400, 640, seed=23)
    g = torch.Generator().manual_seed(6)
    bias = torch.randn(400, generator=g).to(torch.bfloat16).to(DEV)
    resid = torch.randn(200, 400, generator=g).to(torch.bfloat16).to(DEV) if res else None
    cfg = FH.HopperBlockConfig(schedule="rescale", block_n=256)
    with _common.poisoned_outputs(), FH.hopper_block_config(**dataclasses.asdict(cfg)):
        out = tkit.matmul_fp8(a, b, sa, sb, out_dtype=torch.bfloat16, bias=bias,
                              activation="gelu_tanh", residual=resid)
    ks = torch.arange(a.shape[1]) // 128
    cols = torch.arange(b.shape[1]) // 128
    a_dq = a.cpu().float() * sa.cpu()[:, ks]
    b_dq = b.cpu().float() * sb.cpu()[ks][:, cols]
    ref = _torch_activation(_blockwise_ref(a, b, sa, sb) + bias.cpu().double(), "gelu_tanh")
    peer = _torch_activation(a_dq @ b_dq + bias.cpu().float(), "gelu_tanh")
    if res:
        ref = ref + resid.cpu().double()
        peer = peer + resid.cpu().float()
    assert_close_to_reference(out, ref, peer.to(torch.bfloat16), name="rescale epilogue")


@pytest.mark.skipif(not _on_h100_class(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ["", "silu", "gelu", "gelu_tanh", "relu"])
def test_gluon_epilogue(out_dtype, act):
    """Bias (strided), activation and a broadcast residual, 16-bit output: the reference
    rule against the float64 product, its peer PyTorch's float32 result rounded once."""
    from tkit.kernels import _common
    from tkit.kernels.elementwise.ops import _torch_activation

    a, b, sa, sb = _operands(200, 400, 640, seed=21)
    g = torch.Generator().manual_seed(4)
    bias = torch.randn(800, generator=g).to(out_dtype).to(DEV)[::2]
    res = torch.randn(1, 400, generator=g).to(out_dtype).to(DEV)
    assert FB.backend(a, b, sa, sb, out_dtype, bias, res).startswith("gluon")
    with _common.poisoned_outputs():
        out = tkit.matmul_fp8(a, b, sa, sb, out_dtype=out_dtype, bias=bias,
                              activation=act or None, residual=res)
    ks = torch.arange(a.shape[1]) // 128
    cols = torch.arange(b.shape[1]) // 128
    a_dq = a.cpu().float() * sa.cpu()[:, ks]
    b_dq = b.cpu().float() * sb.cpu()[ks][:, cols]
    ref = _blockwise_ref(a, b, sa, sb) + bias.cpu().double()
    peer = a_dq @ b_dq + bias.cpu().float()  # PyTorch's float32 product, rounded once below
    if act:
        ref = _torch_activation(ref, act)
        peer = _torch_activation(peer, act)
    ref = ref + res.cpu().double()
    peer = (peer + res.cpu().float()).to(out_dtype)
    assert_close_to_reference(out, ref, peer, name=f"gluon epilogue {act}")


@pytest.mark.skipif(not _on_h100_class(), reason="needs an sm_90 GPU")
def test_gluon_is_the_default_and_matches_triton():
    """Unforced calls on sm_90 take the Gluon kernel; its bf16 output is within the rule at
    K = 8192 and close to the Triton TMA kernel's."""
    a, b, sa, sb = _operands(256, 512, 8192, seed=11)
    assert FB.backend(a, b, sa, sb).startswith("gluon")
    assert FB.backend(a, b.contiguous(), sa, sb).startswith("triton")
    out = tkit.matmul_fp8(a, b, sa, sb)
    ref = _blockwise_ref(a, b, sa, sb)
    assert_close_to_reference(out, ref, _bf16_peer(a, b, sa, sb), name="gluon K=8192")
    tri = FB._fp8_block_impl(a, b, sa, sb, out_dtype=torch.bfloat16, path="tma")
    torch.testing.assert_close(out.float(), tri.float(), rtol=2 ** -7, atol=1e-3)


# --------------------------------------------------------------------------------------------
# The CUDA kernel (tkit.cuda_ext.gemm_fp8_block: 128 x 256 tiles): dispatch reasons on any
# machine, results on an sm_90 GPU with cupy and nvcc
# --------------------------------------------------------------------------------------------
def test_cuda_scope_reasons():
    """_cuda_choice names what keeps a call off the CUDA kernel before it looks at a device."""
    a, b, sa, sb = (t.cpu() for t in _operands(256, 512, 256))
    bias = torch.zeros(512)

    def why(**kw):
        args = dict(out_dtype=torch.bfloat16, bias=None, residual=None, activation=None,
                    path=None, config=None)
        args.update(kw)
        return FB._cuda_choice(a, b, sa, sb, **args)

    assert "forced" in why(path="tma")
    assert "epilogue" in why(bias=bias)
    assert "epilogue" in why(activation="silu")
    assert "float32" in why(out_dtype=torch.float32)
    assert "CUDA device" in why()
    from tkit.kernels import matmul as mm

    with mm.matmul_config(block_m=64):
        assert "overrides" in why()


@pytest.mark.parametrize("M,N,sms,cuda", [
    (4096, 4096, 132, True),    # 512 tiles: 3 full waves and a last one 88% full
    (1024, 2112, 132, True),    # 72 tiles: one wave, 55% full
    (1024, 4096, 132, True),    # 128 tiles: one wave, 97% full
    (1024, 7168, 132, True),    # 224 tiles: a full wave and one 70% full
    (4096, 2112, 132, True),    # 288 tiles: two full waves, the last 18% full (stream-K)
    (128, 1024, 132, False),    # 4 tiles
    (256, 4096, 132, False),    # 32 tiles: under half the SMs
    (8192, 8192, 132, True),
    (4608, 8192, 132, True),    # 1152 tiles: 8 full waves, the last 73% full
    (4096, 2112, 114, True),    # the same 288 tiles on 114 SMs: the last wave half full
    (512, 4096, 132, False),    # 64 tiles
    (512, 4352, 132, True),     # 68 tiles
])
def test_cuda_grid_rule(M, N, sms, cuda):
    """The unforced CUDA kernel's grid rule: it serves unless its tiles fill less than half
    the SMs; the reason
    names the tile count."""
    why = FB.cuda_grid_reason(M, N, sms)
    assert (why is None) == cuda, why
    if why is not None:
        tiles = -(-M // 128) * -(-N // 256)
        assert f"{tiles} tiles" in why


def test_cuda_build_reason_comes_through_the_hook(monkeypatch):
    """tkit.kernels reaches the CUDA kernel only through tkit._hooks (arrows point down): the
    hook's ``unavailable`` reason is reported, once a device, dtype and build (the column
    scale build asked for by name); no hook, or one that cannot import, is a reason too,
    never an exception."""
    from types import SimpleNamespace

    from tkit import _hooks

    calls = []

    def fake():
        return SimpleNamespace(unavailable=lambda out_dtype, col_scale=False: calls.append(
            (out_dtype, col_scale)) or ("nope" if not col_scale else None))

    dev = torch.device("cuda", 0)
    monkeypatch.setattr(FB, "_CUDA_BUILD", {})
    monkeypatch.setattr(_hooks, "cuda_fp8_block", fake)
    assert FB._cuda_build_reason(dev, torch.bfloat16) == "nope"
    assert FB._cuda_build_reason(dev, torch.bfloat16) == "nope" and len(calls) == 1
    assert FB._cuda_build_reason(dev, torch.bfloat16, True) is None
    assert calls == [(torch.bfloat16, False), (torch.bfloat16, True)]
    monkeypatch.setattr(FB, "_CUDA_BUILD", {})
    monkeypatch.setattr(_hooks, "cuda_fp8_block", None)
    assert "tkit._hooks" in FB._cuda_build_reason(dev, torch.float16)

    def broken():
        raise ImportError("no cupy")

    monkeypatch.setattr(FB, "_CUDA_BUILD", {})
    monkeypatch.setattr(_hooks, "cuda_fp8_block", broken)
    assert "no cupy" in FB._cuda_build_reason(dev, torch.bfloat16)


def _cuda_or_skip():
    if not _on_h100_class():
        pytest.skip("needs an sm_90 GPU")
    from tkit.cuda_ext import _loader

    why = _loader.missing(nvcc=True)
    if why is not None:
        pytest.skip(why)
    from tkit.cuda_ext import gemm_fp8_block as GB

    return GB


_CUDA_BUILDS = [{}, dict(stages=3, epi_split=1), dict(group_m=1), dict(stream_k=False),
                dict(stream_k=True), dict(ctas=5, stream_k=True)]


@pytest.mark.parametrize("M,N,K,sms,stream_k,expect", [
    (8192, 8192, 8192, 132, True, (132, 1980, 132)),  # 15 waves, then 68 tiles over 132
    (8192, 8192, 8192, 132, False, (132, 2048, 0)),
    (4096, 2112, 7168, 132, None, (132, 264, 132)),    # the last wave 18% full
    (1024, 7168, 2048, 132, None, (132, 224, 0)),      # the last wave 70% full
    (4096, 24576, 1536, 132, None, (132, 3072, 0)),    # 27% full
    (1024, 4096, 8192, 128, True, (128, 128, 0)),      # whole waves: nothing to balance
    (2048, 2304, 1024, 132, True, (132, 144, 0)),      # 12 tail tiles of 8 groups: 12 runs
    (256, 512, 4096, 132, None, (16, 0, 16)),          # 4 tiles of 32 groups in runs of 8
    (2048, 2304, 4096, 5, True, (5, 140, 5)),
    (64, 256, 128, 132, True, (1, 1, 0)),              # one group: nothing to split
])
def test_cuda_stream_k_schedule(M, N, K, sms, stream_k, expect):
    """The CUDA kernel's launch schedule (grid, whole-K tiles, stream-K CTAs): whole waves
    of tiles, the rest split by groups over more CTAs than tail tiles, each run at least
    the minimum, never more CTAs than SMs."""
    from tkit.cuda_ext import gemm_fp8_block as GB

    grid, dp, sk = GB.schedule(M, N, K, sms, stream_k)
    assert (grid, dp, sk) == expect
    tiles, groups = -(-M // 128) * -(-N // 256), -(-K // 128)
    assert grid <= sms and dp % sms in (0, tiles % sms) and dp <= tiles
    if sk:
        assert tiles - dp < sk <= grid and (tiles - dp) * groups // sk >= GB.SK_MIN_GROUPS


@pytest.mark.skipif(not _on_h100_class(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("build", _CUDA_BUILDS, ids=lambda v: "-".join(
    f"{k}{v[k]}" for k in v) or "default")
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K", [(300, 528, 1088), (2048, 2304, 1024), (64, 256, 128),
                                   (129, 144, 320), (1, 16, 256), (8, 7168, 512),
                                   (1000, 8192, 144), (1000, 2304, 4096)])
def test_cuda_against_float64(build, out_dtype, M, N, K):
    """The CUDA kernel's builds into poisoned memory: partial tiles along M, N and K (K = 320
    and 144: a partial last group; N = 144 and 528: a tile's right half past N, its scale block
    clamped), one group (K = 128), several tiles a CTA (2048 x 2304: 144 tiles over 132 SMs,
    1000 x 8192: 256), tiles split by stream-K (1000 x 2304 x 4096: 72 tiles over 132 CTAs,
    or 70 whole and 2 split over 5), against the blockwise float64 reference with PyTorch's
    own rounding of the dequantized product as the peer."""
    from tkit.kernels import _common
    GB = _cuda_or_skip()

    a, b, sa, sb = _operands(M, N, K, True, seed=M + N + K)
    ref = _blockwise_ref(a, b, sa, sb)
    with _common.poisoned_outputs():
        out = GB.matmul_fp8_block(a, b, sa, sb, out_dtype, **build)
    peer = _bf16_peer(a, b, sa, sb).to(out_dtype)
    assert_close_to_reference(out, ref, peer, name=f"cuda fp8 block {out_dtype}")


@pytest.mark.skipif(not _on_h100_class(), reason="needs an sm_90 GPU")
def test_cuda_scales_with_any_strides_and_zero_groups():
    """Column-major scales of a (DeepGEMM's layout), transposed scales of b, a zero scale over
    zero codes and a whole zero group: the same result as contiguous scales, within the rule."""
    GB = _cuda_or_skip()
    M, N, K = 512, 1024, 1024
    a, b, sa, sb = _operands(M, N, K, True, seed=5)
    a = a.clone()
    a[:, 256:384] = 0
    sa = sa.clone()
    sa[:, 2] = 0.0
    sa_cm = sa.t().contiguous().t()
    sb_t = sb.t().contiguous().t()
    ref = _blockwise_ref(a, b, sa, sb)
    out = GB.matmul_fp8_block(a, b, sa_cm, sb_t)
    assert_close_to_reference(out, ref, _bf16_peer(a, b, sa, sb), name="strided scales")
    torch.testing.assert_close(out, GB.matmul_fp8_block(a, b, sa, sb), rtol=0, atol=0)


@pytest.mark.skipif(not _on_h100_class(), reason="needs an sm_90 GPU")
def test_cuda_is_the_default_where_tiles_fill_the_sms():
    """Unforced bf16 calls whose 128 x 256 tiles fill the SMs well enough take the CUDA
    kernel, at any K (within the rule at K = 8192, on 256 rows); an epilogue, a float32
    output or a small grid keep the Gluon kernel; path="cuda" where it cannot serve is a
    ValueError with the reason."""
    _cuda_or_skip()
    a, b, sa, sb = _operands(2048, 4096, 8192, seed=13)
    assert FB.backend(a, b, sa, sb).startswith("cuda"), FB.backend(a, b, sa, sb)
    out = tkit.matmul_fp8(a, b, sa, sb)
    rows = slice(0, 2048, 8)
    ref = _blockwise_ref(a[rows], b, sa[rows], sb)
    assert_close_to_reference(out[rows], ref, _bf16_peer(a[rows], b, sa[rows], sb),
                              name="cuda K=8192")
    bias = torch.randn(4096, device=DEV).bfloat16()
    assert FB.backend(a, b, sa, sb, bias=bias).startswith("gluon")
    assert FB.backend(a, b, sa, sb, out_dtype=torch.float32).startswith("gluon")
    assert FB.backend(a[:, :7168].contiguous(), b[:7168], sa[:, :56].contiguous(),
                      sb[:56]).startswith("cuda")
    small = _operands(128, 1024, 8192, seed=14)
    assert FB.backend(*small).startswith("gluon")
    with pytest.raises(ValueError, match="epilogue"):
        FB._fp8_block_impl(a, b, sa, sb, bias=bias, path="cuda")


@pytest.mark.skipif(not _on_h100_class(), reason="needs an sm_90 GPU")
def test_cuda_kernel_in_a_cuda_graph():
    """Captured once, replayed over new operand values in the same buffers: the same result
    as an eager call."""
    GB = _cuda_or_skip()
    a, b, sa, sb = _operands(1024, 8192, 1024, seed=21)
    out = GB.matmul_fp8_block(a, b, sa, sb)  # builds and self-tests outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = GB.matmul_fp8_block(a, b, sa, sb)
    a2, b2, sa2, sb2 = _operands(1024, 8192, 1024, seed=22)
    a.copy_(a2)
    b.copy_(b2)
    sa.copy_(sa2)
    sb.copy_(sb2)
    g.replay()
    torch.testing.assert_close(out, GB.matmul_fp8_block(a, b, sa, sb), rtol=0, atol=0)


@pytest.mark.skipif(not _on_h100_class(), reason="needs an sm_90 GPU")
def test_cuda_grid_larger_than_the_sms_is_refused():
    """A grid of more CTAs than SMs could leave a split tile's owner waiting on a CTA that
    is not resident: a ValueError naming ``ctas``, before any launch."""
    GB = _cuda_or_skip()
    a, b, sa, sb = _operands(256, 512, 4096, seed=27)
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    for bad in (0, sms + 1):
        with pytest.raises(ValueError, match="ctas"):
            GB.matmul_fp8_block(a, b, sa, sb, ctas=bad, check=False)


@pytest.mark.skipif(not _on_h100_class(), reason="needs an sm_90 GPU")
def test_cuda_stream_k_in_a_cuda_graph():
    """Split tiles (4 tiles of 32 groups over 16 CTAs) captured once and replayed three times
    over new values: each replay equals an eager call bit for bit (the pieces' flags are
    back to 0 after every launch, their sums added in a fixed order)."""
    GB = _cuda_or_skip()
    a, b, sa, sb = _operands(256, 512, 4096, seed=23)
    assert GB.schedule(256, 512, 4096, 132)[2] > 0
    out = GB.matmul_fp8_block(a, b, sa, sb)
    assert_close_to_reference(out, _blockwise_ref(a, b, sa, sb), _bf16_peer(a, b, sa, sb),
                              name="stream-K")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = GB.matmul_fp8_block(a, b, sa, sb)
    for seed in (24, 25, 26):
        for x, y in zip((a, b, sa, sb), _operands(256, 512, 4096, seed=seed)):
            x.copy_(y)
        g.replay()
        torch.testing.assert_close(out, GB.matmul_fp8_block(a, b, sa, sb), rtol=0, atol=0)


def test_scales_as_block_views(monkeypatch):
    """Per-tensor scales, and per-row scales of a with one scale for b, as block scales:
    stride-0 views holding each block's scale (nothing copied), which ``tkit.matmul_fp8``
    hands to the block mode where the CUDA kernel serves them; per-column scales of b go as
    ``scale_n`` (the column scales themselves, a view) to the kernel's ``col_scale`` build,
    asked for by name in the dispatch check; a call the CUDA kernel does not serve (here: no
    CUDA device) keeps the Triton kernel."""
    from tkit.kernels import matmul as mm

    a, b, _, _ = _operands(300, 392, 520, seed=3)
    sa, sb = torch.rand(300, device=DEV) + 0.5, torch.tensor([0.25], device=DEV)
    cols = torch.rand(392, device=DEV) + 0.5
    if not ON_GPU:
        assert FB.scales_as_block(a, b, sa, sb, torch.bfloat16) is None
        assert FB.scales_as_block(a, b, sa, cols, torch.bfloat16) is None
    builds = []
    monkeypatch.setattr(FB, "_cuda_choice",
                        lambda *args, col_scale=False: builds.append(col_scale))
    blk_a, blk_b, none = FB.scales_as_block(a, b, sa, sb, torch.bfloat16)
    assert none is None and builds == [False]
    assert blk_a.shape == (300, 5) and blk_b.shape == (5, 4)
    assert blk_a.stride() == (1, 0) and blk_b.stride() == (0, 0)
    assert torch.equal(blk_a, sa[:, None].expand(300, 5)) and bool((blk_b == 0.25).all())
    one_a, _, _ = FB.scales_as_block(a, b, sa[:1], sb, torch.bfloat16)
    assert one_a.shape == (300, 5) and bool((one_a == sa[0]).all())
    col_a, col_b, scale_n = FB.scales_as_block(a, b, sa, cols, torch.bfloat16)
    assert builds[-1] is True and torch.equal(col_a, blk_a) and col_b.shape == (5, 4)
    assert scale_n.data_ptr() == cols.data_ptr() and torch.equal(scale_n, cols)
    every_other = torch.rand(1, 784, device=DEV)[:, ::2]  # the kernel reads them at stride 1
    _, _, packed = FB.scales_as_block(a, b, sa, every_other.reshape(392), torch.bfloat16)
    assert packed.is_contiguous() and torch.equal(packed, every_other.reshape(392))
    with monkeypatch.context() as m:  # torch.compile's fake tensors keep the registered op
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        assert FB.scales_as_block(a, b, sa, sb, torch.bfloat16) is None

    seen = []
    monkeypatch.setattr(FB, "matmul_fp8_block", lambda *args: seen.append(args) or "block")
    monkeypatch.setattr(mm.P, "plannable", lambda *args: False)
    assert tkit.matmul_fp8(a, b, sa.reshape(300, 1), sb) == "block"
    got_a, got_b, got_n = seen[0][2], seen[0][3], seen[0][8]
    assert torch.equal(got_a, blk_a) and torch.equal(got_b, blk_b) and got_n is None
    assert tkit.matmul_fp8(a, b, sa.reshape(300, 1), cols.reshape(1, 392)) == "block"
    assert torch.equal(seen[1][8], cols)


@pytest.mark.skipif(not _on_h100_class(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("M,N,K", [(1000, 2304, 4096), (2048, 4096, 8192)])
def test_cuda_serves_per_tensor_scales(per_row, M, N, K):
    """Per-tensor scales (and per-row scales of a) take the CUDA block kernel where its tiles
    fill the SMs (a partial row tile at M = 1000, stream-K there too), under the reference
    rule, equal to the same call with the block scales written out."""
    _cuda_or_skip()
    a, b, _, _ = _operands(M, N, K, seed=M + K)
    sa = torch.rand(M, 1, device=DEV) + 0.5 if per_row else torch.tensor(0.7, device=DEV)
    sb = torch.tensor(0.3, device=DEV) * K ** -0.5
    assert FB.scales_as_block(a, b, sa.reshape(-1), sb.reshape(1),
                              torch.bfloat16) is not None
    spec = registry.get("matmul_fp8")
    check_against_reference(spec.fn, spec.reference, [a, b, sa, sb], ref_dtype=torch.float32)
    kb, nb = -(-K // 128), -(-N // 128)
    full = tkit.matmul_fp8(a, b, sa.reshape(-1, 1).expand(M, kb).contiguous(),
                           sb.reshape(1, 1).expand(kb, nb).contiguous())
    out = tkit.matmul_fp8(a, b, sa, sb)
    torch.testing.assert_close(out, full, rtol=0, atol=0)
    # new scale values through the same call (an eager plan's replay): twice the scale of a,
    # exactly twice the output
    torch.testing.assert_close(tkit.matmul_fp8(a, b, sa * 2, sb), out * 2, rtol=0, atol=0)


@pytest.mark.skipif(not _on_h100_class(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("M,N,K,stream_k", [(300, 392, 1088, None), (1000, 2304, 4096, True),
                                            (2048, 4096, 8192, False)])
def test_cuda_column_scales_build(M, N, K, stream_k):
    """The CUDA kernel's ``col_scale`` build: per-row scales of a as block scales and
    per-column scales of b multiplied in before the store (b's block scales not read: NaN
    here), against the float64 reference of row/column scaling (a partial last column tile at
    N = 392, whose clamped scale reads stay inside the vector; a split tile's partial sums
    added before the column scale); ``tkit.matmul_fp8`` with row/column scales takes it (the
    same bits), and a second call with twice the column scales (an eager plan's replay where
    plans run) gives exactly twice the output."""
    GB = _cuda_or_skip()
    a, b, _, _ = _operands(M, N, K, seed=M + N)
    sa = torch.rand(M, 1, device=DEV) + 0.5
    sb = (torch.rand(1, N, device=DEV) + 0.5) * K ** -0.5
    kb, nb = -(-K // 128), -(-N // 128)
    nan = torch.full((1, 1), float("nan"), device=DEV).expand(kb, nb)

    def fn(a, b, sa, sb):
        return GB.matmul_fp8_block(a, b, sa.expand(M, kb), nan,
                                   scale_n=sb.reshape(-1).contiguous(), stream_k=stream_k)

    spec = registry.get("matmul_fp8")
    check_against_reference(fn, spec.reference, [a, b, sa, sb], ref_dtype=torch.float32)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    serves = FB.scales_as_block(a, b, sa.reshape(-1), sb.reshape(-1), torch.bfloat16)
    assert (serves is not None) == (FB.cuda_grid_reason(M, N, sms) is None)
    if serves is None:  # too few tiles to fill the SMs: the Triton kernel's call
        return
    out = tkit.matmul_fp8(a, b, sa, sb)
    if stream_k is None:
        torch.testing.assert_close(out, fn(a, b, sa, sb), rtol=0, atol=0)
    torch.testing.assert_close(tkit.matmul_fp8(a, b, sa, sb * 2), out * 2, rtol=0, atol=0)
