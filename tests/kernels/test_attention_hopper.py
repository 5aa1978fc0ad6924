"""The Gluon sm_90 attention forward: its scope (``supported``), its compiled schedules (ahead of
time on any machine: the PTX and SASS must show the asynchronous wgmmas with one group in flight
inside the key loop; for the warp-specialized kernel also the loader partition and only
warpgroup-local barriers in the key loop), and on an H200 its outputs against the float64
reference, with and without warp specialization."""

import contextlib
import os
import re
import subprocess
import warnings

import pytest
import torch
import triton

from tkit.kernels.attention import hopper as AH
from tkit.specs import attention as S
from tkit.testing import check_against_reference, make_tensor, poisoned_outputs

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
TRITON = tuple(int(x) for x in triton.__version__.split(".")[:2])
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _qkv(b, sq, sk, hq, hk, d, dtype, device, seed=0):
    return (make_tensor((b, sq, hq, d), dtype, seed=seed, device=device),
            make_tensor((b, sk, hk, d), dtype, seed=seed + 1, device=device),
            make_tensor((b, sk, hk, d), dtype, seed=seed + 2, device=device))


# ---- scope ---------------------------------------------------------------------------------
def _cpu(shape=(2, 64, 4, 128), dtype=torch.bfloat16, hk=None):
    q = torch.zeros(shape, dtype=dtype)
    kshape = (shape[0], shape[1], hk or shape[2], shape[3])
    return q, torch.zeros(kshape, dtype=dtype), torch.zeros(kshape, dtype=dtype)


@pytest.mark.parametrize("kwargs, words", [
    (dict(varlen=True), "varlen"),
    (dict(window=(128, 0)), "window"),
    (dict(softcap=30.0), "softcap"),
])
def test_unsupported_features(kwargs, words):
    assert words in AH.supported(*_cpu(), causal=True, **kwargs)


def test_unsupported_dtype_and_head_dim():
    assert "dtype" in AH.supported(*_cpu(dtype=torch.float32))
    for d in (32, 96, 192, 512):
        assert "head_dim" in AH.supported(*_cpu(shape=(1, 16, 2, d)))
    q, k, v = _cpu()
    assert "dtypes" in AH.supported(q, k.half(), v)
    assert "multiple" in AH.supported(*_cpu(shape=(1, 16, 6, 64), hk=4))


def test_unsupported_strides():
    q, k, v = _cpu()
    # head_dim not contiguous
    qt = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert "unit head_dim stride" in AH.supported(qt, k, v)
    # rows 2 bytes apart from 16-byte alignment: a slice of a wider last dim
    wide = torch.zeros(2, 64, 4, 129, dtype=torch.bfloat16)[..., :128]
    assert "16 bytes" in AH.supported(wide, k, v)
    # base pointer off by one element
    flat = torch.zeros(2 * 64 * 4 * 128 + 1, dtype=torch.bfloat16)[1:].view(2, 64, 4, 128)
    assert "16-byte aligned" in AH.supported(flat, k, v)
    # broadcast batch (stride 0) cannot be described to TMA
    kb = k[:1].expand(2, -1, -1, -1)
    assert "strides" in AH.supported(q, kb, kb)


def test_supported_layouts_reach_the_device_check():
    """Views TMA can read (a packed qkv tensor, size-1 dims with odd strides) pass every check
    but the device one on a CPU."""
    qkv = torch.zeros(2, 64, 3, 4, 128, dtype=torch.float16)
    q, k, v = qkv.unbind(2)
    assert "CUDA" in AH.supported(q, k, v, causal=True)
    one = torch.zeros(1, 64, 1, 64, dtype=torch.bfloat16).as_strided((1, 64, 1, 64),
                                                                    (7, 64, 3, 1))
    assert "CUDA" in AH.supported(one, one, one)
    assert AH._tma_strides(one) == [64, 64, 64, 1]


def test_default_at_d128_is_warp_specialized():
    assert AH.default_config(128).get("WS") is True  # measured fastest at D=128


def test_persistent_rule():
    """Calls without a config take the persistent kernel of the first PERSISTENT_RULES entry of
    their case whose max_keys holds (keys a tile on average) where tiles outnumber the SMs,
    the per-tile default elsewhere: one wave (B1 x 32 heads x 4 query blocks), long tiles
    (non-causal 8192; D=64 causal 2048). D=128 causal runs n64 s5 up to 768 keys a tile and
    n128 s2 beyond, at any length. D=64 causal runs two CTAs an SM, persistent or per tile;
    D=64 without a mask goes to the Triton kernel outside the rule (``declines``)."""
    def cfg(b, s, h, causal, d=128, sk=None):
        tiles = b * h * -(-s // AH.BLOCK_M)
        return AH.config_for(d, 2, s, sk or s, causal, tiles, 132)

    short, long = (r.config() for r in AH.PERSISTENT_RULES[(128, True)])
    assert short == AH.config_dict(64, 5, True, True)
    assert long == AH.config_dict(128, 2, True, True)
    for b, s in ((32, 512), (16, 1024), (12, 1280)):  # (s + 128) / 2 <= 768 keys a tile
        assert cfg(b, s, 16, True) == short, s
    for b, s in ((10, 1536), (8, 2048), (4, 4096), (1, 16384)):
        assert cfg(b, s, 16, True) == long, s
    assert cfg(4, 4096, 32, True) == long  # GQA: the tiles are the query heads'
    # without a mask: 128-key blocks in a two-stage ring, up to 4096 keys
    (rule,) = AH.PERSISTENT_RULES[(128, False)]
    wide = rule.config()
    assert wide == AH.config_dict(128, 2, True, True) and wide in AH.configs(128)
    for b, s in ((16, 1024), (8, 2048), (4, 4096)):
        assert cfg(b, s, 16, False) == wide, s
    for c in (cfg(1, 512, 32, True), cfg(2, 8192, 16, False), cfg(8, 2048, 16, True, d=64),
              cfg(32, 100, 16, False, sk=8192)):
        assert not c.get("PERSISTENT"), c
    # D=64 causal: two CTAs an SM (3 warpgroups x 2 CTAs within the register file, the shared
    # memory twice within the SM's), persistent up to 1024 keys, per tile beyond and in one wave
    two = AH.config_dict(64, 4, True, True, 2)
    assert two["CTAS"] == 2 and two["maxnreg"] * 3 * 128 * 2 <= 65536
    assert two in AH.configs(64) and two not in AH.configs(128)
    for b, s in ((64, 256), (32, 512), (16, 1024), (8, 1408)):
        assert cfg(b, s, 16, True, d=64) == two, s
    per_tile = AH.config_dict(64, 3, True, False, 2)
    assert per_tile["CTAS"] == 2 and not per_tile.get("PERSISTENT") and per_tile in AH.configs(64)
    for b, s, h in ((8, 2048, 16), (4, 4096, 16), (1, 512, 16)):
        assert cfg(b, s, h, True, d=64) == per_tile, (b, s, h)
    with pytest.raises(ValueError, match="ctas"):
        AH.config_dict(64, 4, False, False, 2)
    assert cfg(1, 512, 8, True) == AH.default_config(128)  # 32 tiles: one wave
    (rule,) = AH.PERSISTENT_RULES[(64, False)]
    d64 = rule.config()
    assert d64["BLOCK_N"] == 128 and cfg(32, 512, 16, False, d=64) == d64
    assert cfg(8, 1024, 16, False, d=64) == d64
    assert cfg(4, 4096, 16, False, d=64) == d64  # no key limit at D=64 without a mask

    def declines(b, s, h, causal, d, sk=None):
        return AH.declines(d, 2, sk or s, causal, b * h * -(-s // AH.BLOCK_M), 132)

    assert declines(32, 512, 16, False, 64) is None
    assert declines(4, 4096, 16, False, 64) is None
    for args in ((1, 512, 16, False, 64), (1, 2048, 8, False, 64)):  # one wave of tiles
        assert "Triton kernel" in declines(*args), args
    for args in ((4, 4096, 16, True, 64), (32, 512, 16, True, 64), (4, 4096, 16, False, 128),
                 (1, 512, 16, False, 128), (4, 4096, 16, False, 256)):
        assert declines(*args) is None, args
    # D=256: the warp-specialized n64 s2, causal or not
    for causal in (True, False):
        assert cfg(4, 4096, 16, causal, d=256) == AH.config_dict(64, 2, True)
    c = cfg(32, 512, 16, True)
    c.pop("PERSISTENT")  # a fresh dict each call: callers pop from it
    assert cfg(32, 512, 16, True) == short


def test_configs_fit_shared_memory():
    for d in AH.HEAD_DIMS:
        cfgs = AH.configs(d)
        assert cfgs and AH.default_config(d) in cfgs
        assert AH._cfg_key(AH.default_config(d)) == AH._cfg_key(AH.DEFAULTS[d])  # it fits
        assert all(AH._smem_bytes(c["BLOCK_N"], c["STAGES"], d, ws=c.get("WS", False),
                                  persistent=c.get("PERSISTENT", False))
                   <= AH.SMEM_LIMIT for c in cfgs)
        # the persistent kernel is a warp-specialized one, with its two Q buffers counted
        assert all(c["WS"] for c in cfgs if c.get("PERSISTENT"))
        assert bool([c for c in cfgs if c.get("PERSISTENT")]) == any(
            d == case[0] for case in AH.PERSISTENT_RULES)
        ws = AH.configs(d, ws=True)
        assert ws and all(c["WS"] and c["num_warps"] == 4 and c["maxnreg"] == (
            AH.WS_TWO_CTA_MAXNREG if c.get("CTAS") == 2 else AH.WS_MAXNREG) for c in ws)
        assert AH.default_config(d).get("WS", False) == AH._cfg_key(AH.DEFAULTS[d])[2]
        assert len(cfgs) == len(AH.configs(d, ws=False)) + len(ws)
    # the empty barriers and the partitions' shared state are counted
    assert AH._smem_bytes(128, 3, 128, ws=True) > AH._smem_bytes(128, 3, 128)
    assert AH._smem_bytes(128, 2, 128, ws=True, persistent=True) \
        >= AH._smem_bytes(128, 2, 128, ws=True) + 128 * 128 * 2
    with pytest.raises(ValueError, match="warp-specialized"):
        AH.config_dict(128, 2, False, True)
    # three warpgroups at the launch cap fit the register file, and the partitions' shares add
    # up to it (the default partition gets what the workers leave)
    assert AH.WS_MAXNREG * 3 * 128 <= 65536
    assert 2 * AH.WS_CONSUMER_REGS.value + AH.WS_LOADER_REGS.value == 3 * AH.WS_MAXNREG


# ---- compiled schedule (ahead of time, no GPU needed) --------------------------------------
def _loop_bodies(ptx: str) -> list[str]:
    """The PTX between each label and the last backward branch to it (the loops)."""
    lines = ptx.splitlines()
    bodies = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\$L__BB\d+_\d+):", line)
        if not m:
            continue
        label = m.group(1)
        ends = [j for j in range(i + 1, len(lines))
                if re.search(r"\bbra(\.uni)?\s+" + re.escape(label) + ";", lines[j])]
        if ends:
            bodies.append("\n".join(lines[i:ends[-1] + 1]))
    return bodies


def _inner_wgmma_loops(ptx: str) -> list[str]:
    """The innermost loops that issue wgmmas (the key loops; the warp-specialized kernel also
    has the workers' dispatch loop around its partitions, which is left out)."""
    bodies = _loop_bodies(ptx)
    labels = [b.splitlines()[0].split(":")[0] for b in bodies]
    inner = [b for b in bodies
             if not any(lab + ":" in b.split("\n", 1)[1] for lab in labels)]
    return [b for b in inner if "wgmma.mma_async" in b]


def _bar_syncs(body: str) -> list[str]:
    return re.findall(r"\bbar\.sync\s+[^;]*;", body)


def _warpgroup_local(bars: list[str]) -> bool:
    """Every barrier a named one over one warpgroup's 128 threads."""
    return all(re.fullmatch(r"bar\.sync\s+\d+,\s*128;", b) for b in bars)


def _ex2_between_waits(sass: str) -> list[int]:
    """MUFU.EX2 count between each WARPGROUP.DEPBAR.LE gsb0, 0x1 and the next 0x0: the
    exponentials that run while the PV wgmma is in flight (ptxas may move the waits)."""
    counts, inside = [], False
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            counts.append(0)
            inside = True
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line:
            inside = False
        elif inside and "MUFU.EX2" in line:
            counts[-1] += 1
    return counts


def _tool(name, *args):
    return subprocess.run([os.path.join(BIN, name), *args], capture_output=True, text=True,
                          check=True).stdout


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    cache = {}

    def get(d, causal, dtype=torch.bfloat16, config=None):
        key = (d, causal, dtype, tuple(sorted((config or {}).items())))
        if key not in cache:
            k = AH.compile_sm90(d, causal, dtype, config)
            path = tmp_path_factory.mktemp("cubin") / "k.cubin"
            path.write_bytes(k.asm["cubin"])
            cache[key] = (k, _tool("cuobjdump", "-sass", str(path)),
                          _tool("cuobjdump", "--dump-resource-usage", str(path)))
        return cache[key]

    return get


def _plain(d):
    """The one-partition kernel at the default tile of head dim ``d``."""
    return AH.config_dict(*AH.DEFAULTS[d][:2], False)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_compiled_schedule(compiled, d, causal):
    """The one-partition schedule (the warp-specialized one: further below)."""
    k, sass, usage = compiled(d, causal, torch.bfloat16, _plain(d))
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx
    loops = [b for b in _loop_bodies(ptx) if "wgmma.mma_async" in b]
    # the unmasked and the masked key loops each keep one wgmma group (PV) in flight while
    # the softmax's exponentials run, then wait for it
    assert len(loops) >= 2, "expected two key loops with wgmmas"
    for body in loops:
        assert "wgmma.wait_group.sync.aligned 1;" in body
        assert "wgmma.wait_group.sync.aligned 0;" in body
        assert body.index("wgmma.wait_group.sync.aligned 1;") < body.index("ex2.approx") \
            < body.index("wgmma.wait_group.sync.aligned 0;")
        assert body.count("wgmma.commit_group") == 2  # QK^T and PV, one group each
        assert "cp.async.bulk.tensor" in body  # the ring is refilled by TMA inside the loop
        assert "ld.shared" not in body and "st.shared" not in body  # P stays in registers
    assert "HGMMA" in sass and "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass
    # and in the SASS, after ptxas's scheduling, every exponential of the tile (BLOCK_N / 2 a
    # thread, plus the rescale factors) still sits between the two waits
    block_n = _plain(d)["BLOCK_N"]
    between = _ex2_between_waits(sass)
    assert len(between) == 2 and all(n >= block_n // 2 for n in between), between
    assert "UTMALDG" in sass
    # no spills: no local memory, no stack
    assert re.search(r"LOCAL:0\b", usage) and re.search(r"STACK:0\b", usage), usage
    assert not re.search(r"\b(LDL|STL)\b", sass)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    assert regs <= 255
    assert k.metadata.shared <= AH.SMEM_LIMIT


def test_compiles_under_this_triton_without_warnings():
    """The kernel builds with the Triton installed (the API moves between the supported
    versions go through the aliases at the top of _hopper_kernels.py), and asks for FP fusion
    itself, so Triton 3.9 does not warn that its default is about to change."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        k = AH.compile_sm90(64, True, torch.float16, AH.config_dict(64, 3, False))
    assert "cp.async.bulk.tensor" in k.asm["ptx"] and "wgmma.mma_async" in k.asm["ptx"]
    assert k.metadata.enable_fp_fusion is True
    assert not [w for w in caught if "FP_FUSION" in str(w.message)], caught


def test_compiled_fp16_and_every_config(compiled):
    k, _, _ = compiled(128, True, torch.float16)
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16" in k.asm["ptx"]
    for cfg in AH.configs(128)[1:3]:  # a sample of the others (all are swept on the GPU)
        k, sass, usage = compiled(128, False, torch.bfloat16, cfg)
        assert "HGMMA" in sass and re.search(r"LOCAL:0\b", usage)
        assert all(n >= cfg["BLOCK_N"] // 2 for n in _ex2_between_waits(sass))
        assert k.metadata.shared <= AH.SMEM_LIMIT


@pytest.mark.parametrize("cfg", [AH.config_dict(64, 2, True), AH.config_dict(32, 4, True),
                                 AH.config_dict(64, 2)], ids=["ws64", "ws32", "plain64"])
@pytest.mark.parametrize("causal", [False, True])
def test_compiled_head_dim_256(compiled, cfg, causal):
    """Head dim 256 (a 64 KB Q tile, K and V 64 KB a 64-key stage): the configs that fit
    build for sm_90a without local memory, within shared memory, with the PV wgmma 256 wide
    and the QK^T one BLOCK_N wide."""
    k, sass, usage = compiled(256, causal, torch.bfloat16, cfg)
    assert re.search(r"LOCAL:0\b", usage) and not re.search(r"\b(LDL|STL)\b", sass)
    assert k.metadata.shared <= AH._smem_bytes(cfg["BLOCK_N"], cfg["STAGES"], 256,
                                               ws=cfg.get("WS", False)) <= AH.SMEM_LIMIT
    assert "HGMMA.64x256x16.F32.BF16" in sass
    assert f"HGMMA.64x{cfg['BLOCK_N']}x16.F32.BF16" in sass
    assert AH.default_config(256) == AH.config_dict(*AH.DEFAULTS[256][:2], True)


WS_SAMPLE = [AH.config_dict(128, 3, True), AH.config_dict(64, 4, True),
             AH.config_dict(64, 4, True, True)]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_compiled_warp_specialized(compiled, d, causal):
    """The WS kernel: two consumer partitions with the key loops (QK^T and PV async, PV in
    flight under the exponentials, slots released by mbarrier arrive, no TMA and no barrier
    across warpgroups inside), a loader loop with every TMA of K and V, registers moved from
    the loader to the consumers, no spills."""
    for cfg in WS_SAMPLE:
        k, sass, usage = compiled(d, causal, torch.bfloat16, cfg)
        ptx = k.asm["ptx"]
        loops = _inner_wgmma_loops(ptx)
        # per consumer warpgroup: the unmasked and the masked key loop
        assert len(loops) == 4, len(loops)
        for body in loops:
            assert body.count("wgmma.commit_group") == 2
            assert body.index("wgmma.wait_group.sync.aligned 1;") < body.index("ex2.approx") \
                < body.index("wgmma.wait_group.sync.aligned 0;")
            # two slots go back to the loader a block: V's of block j-1 (after PV) and K's of
            # block j (after its scores), each on its own empty barrier
            assert body.count("mbarrier.arrive.shared::cta.b64") == 2
            assert body.index("wgmma.wait_group.sync.aligned 0;") \
                < body.index("mbarrier.arrive.shared::cta.b64")
            assert "cp.async.bulk.tensor" not in body and "expect_tx" not in body
            assert "ld.shared" not in body and "st.shared" not in body
            # only warpgroup-local barriers: named barriers over 128 threads, Triton's
            # (WS_BARRIERS a block)
            bars = _bar_syncs(body)
            assert len(bars) == WS_BARRIERS and _warpgroup_local(bars), bars
        # the two consumers use different named barriers
        ids = {re.match(r"bar\.sync\s+(\d+)", b).group(1) for body in loops
               for b in _bar_syncs(body)}
        assert len(ids) == 2, ids
        # the loader: one loop waiting on the empty barriers and issuing K and V (TMA loads;
        # a consumer's tile loop of the persistent kernel holds its TMA store)
        tma_load = re.compile(r"cp\.async\.bulk\.tensor\.4d\.shared::\w+\.global")
        loader = [b for b in _loop_bodies(ptx) if tma_load.search(b) and "wgmma" not in b]
        assert loader and all(len(tma_load.findall(b)) >= 2 and "try_wait" in b
                              and not _bar_syncs(b) for b in loader)
        assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{AH.WS_LOADER_REGS.value};",
                         ptx)
        assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{AH.WS_CONSUMER_REGS.value};",
                         ptx)
        # SASS: HGMMA, every exponential of a tile between the waits in all four loops
        assert "HGMMA" in sass and "UTMALDG" in sass
        between = _ex2_between_waits(sass)
        assert len(between) == 4 and all(n >= cfg["BLOCK_N"] // 2 for n in between), between
        assert re.search(r"LOCAL:0\b", usage) and re.search(r"STACK:0\b", usage), usage
        assert not re.search(r"\b(LDL|STL)\b", sass)
        assert k.metadata.shared <= AH._smem_bytes(cfg["BLOCK_N"], cfg["STAGES"], d, ws=True,
                                                   persistent=cfg.get("PERSISTENT", False))
        assert k.metadata.shared <= AH.SMEM_LIMIT


# CTA-wide barriers a key block of the non-WS kernel: two are the kernel's own (before the
# refill's expects, after them), Triton's membar pass adds the rest: one at the loop head under
# 3.6; under 3.9 one after the K wait, one after wgmma.wait_group 1 and one between the two
# expects (its analysis treats the mbarrier ops as shared-memory accesses that conflict).
BASE_BARRIERS = 3 if TRITON < (3, 9) else 5
# Warpgroup barriers a key block of the WS kernel, all Triton's: under 3.6 one at the loop head
# and one ahead of each of the two arrives (K's slot, V's); 3.9 places two.
WS_BARRIERS = 3 if TRITON < (3, 9) else 2


def test_warp_specialized_key_loop_has_no_cta_barrier(compiled):
    """Per key block: the non-WS kernel runs BASE_BARRIERS barriers over both warpgroups
    (bar.sync 0: every thread of the CTA); the WS kernel's are over each warpgroup's own 128
    threads (WS_BARRIERS), so its warpgroups drift apart."""
    for d in (64, 128):
        k0, _, _ = compiled(d, False, torch.bfloat16, _plain(d))
        k1, _, _ = compiled(d, False, torch.bfloat16, AH.config_dict(*AH.DEFAULTS[d][:2], True))
        base = [_bar_syncs(b) for b in _inner_wgmma_loops(k0.asm["ptx"])]
        ws = [_bar_syncs(b) for b in _inner_wgmma_loops(k1.asm["ptx"])]
        assert base and all(len(b) == BASE_BARRIERS
                            and all(re.fullmatch(r"bar\.sync\s+0;", x) for x in b)
                            for b in base), base
        assert ws and all(len(b) == WS_BARRIERS and _warpgroup_local(b) for b in ws), ws


@pytest.mark.parametrize("causal", [False, True])
def test_compiled_two_ctas_an_sm(compiled, causal):
    """The D=64 configs at two CTAs an SM compile within their launch cap (two CTAs' registers
    and shared memory fit one SM), raise consumer warpgroup 1 to WS_TWO_CTA_CONSUMER_REGS, and
    keep the key loops free of local-memory traffic (the spills the tight cap causes sit
    outside them)."""
    two = [c for c in AH.configs(64, ws=True) if c.get("CTAS") == 2]
    assert {bool(c.get("PERSISTENT")) for c in two} == {False, True}
    for cfg in two:
        k, sass, usage = compiled(64, causal, torch.bfloat16, cfg)
        regs = int(re.search(r"REG:(\d+)", usage).group(1))
        assert regs <= AH.WS_TWO_CTA_MAXNREG and 2 * regs * 3 * 128 <= 65536, regs
        assert 2 * (k.metadata.shared + 1024) <= AH.SMEM_PER_SM, k.metadata.shared
        ptx = k.asm["ptx"]
        assert re.search(
            rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{AH.WS_TWO_CTA_CONSUMER_REGS};", ptx)
        loops = _inner_wgmma_loops(ptx)
        assert len(loops) == 4 and not any(re.search(r"\b(ld|st)\.local", b) for b in loops)


# ---- GPU -----------------------------------------------------------------------------------
def _fn(causal, config=None):
    def fn(q, k, v, **kw):
        return AH.forward(q, k, v, causal=causal, config=config)
    return fn


def _ref(causal):
    def ref(q, k, v, **kw):
        return S.ref_attention(q, k, v, causal=causal, return_lse=True)
    return ref


# both schedules (one partition; warp-specialized) at the default tile of the head dim, for the
# tests below that do not sweep every config (the default config itself is what
# tkit.flash_attention launches: tests/kernels/test_attention.py)
SCHEDULES = [pytest.param(False, id="plain"),
             pytest.param(True, id="ws"),
             pytest.param("persistent", id="persistent"),
             pytest.param("persistent2", id="persistent2")]


def _schedule_config(ws, d):
    if ws == "persistent2":  # two CTAs an SM: the D=64 candidate
        if d != 64:
            pytest.skip("the two-CTA persistent config is D=64's")
        return AH.config_dict(64, 4, True, True, 2)
    if ws == "persistent":
        if (d, False) not in AH.PERSISTENT_RULES:
            pytest.skip(f"no persistent config fits at head dim {d}")
        return AH.PERSISTENT_RULES[(d, False)][0].config()
    return AH.config_dict(*AH.DEFAULTS[d][:2], ws)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("ws", SCHEDULES)
@pytest.mark.parametrize("s", [1, 63, 64, 65, 127, 128, 1000, 4096])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_seqlens(s, causal, ws):
    args = _qkv(2 if s <= 1000 else 1, s, s, 4, 2, 128, torch.bfloat16, "cuda")
    assert AH.supported(*args, causal=causal) is None
    check_against_reference(_fn(causal, _schedule_config(ws, 128)), _ref(causal), args,
                            ref_dtype=torch.float64 if s <= 1000 else torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("ws", SCHEDULES)
@pytest.mark.parametrize("sq, sk", [(100, 300), (300, 100), (1, 257), (257, 1), (65, 200)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_unequal_lengths(sq, sk, causal, ws):
    # seqlen_q > seqlen_k with causal: the first sq - sk rows see no key (O = 0, lse = -inf)
    args = _qkv(2, sq, sk, 4, 4, 64, torch.float16, "cuda", seed=3)
    check_against_reference(_fn(causal, _schedule_config(ws, 64)), _ref(causal), args)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("ws", SCHEDULES)
@pytest.mark.parametrize("hq, hk", [(16, 4), (8, 1)])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gqa_head_dims_dtypes(hq, hk, d, dtype, ws):
    args = _qkv(2, 333, 333, hq, hk, d, dtype, "cuda", seed=5)
    for causal in (False, True):
        check_against_reference(_fn(causal, _schedule_config(ws, d)), _ref(causal), args)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("ws", [False, True], ids=["plain", "ws"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_every_config(d, ws):
    args = _qkv(1, 700, 700, 4, 2, d, torch.bfloat16, "cuda", seed=7)
    for cfg in AH.configs(d, ws=ws):
        for causal in (False, True):
            check_against_reference(_fn(causal, cfg), _ref(causal), args)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("ws", SCHEDULES)
def test_gpu_packed_qkv_and_fully_masked_rows(ws):
    qkv = make_tensor((2, 200, 3, 4, 128), torch.bfloat16, seed=9, device="cuda")
    q, k, v = qkv.unbind(2)
    assert AH.supported(q, k, v, causal=True) is None
    check_against_reference(_fn(True, _schedule_config(ws, 128)), _ref(True), [q, k, v])
    q, k, v = _qkv(1, 300, 40, 2, 2, 64, torch.bfloat16, "cuda", seed=11)
    out, lse = AH.forward(q, k, v, causal=True, config=_schedule_config(ws, 64))
    assert torch.all(out[:, :260] == 0) and torch.all(lse[:, :, :260] == float("-inf"))
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, 260:]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("sms", [1, 3, 7])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_persistent_walks_many_tiles_a_cta(monkeypatch, sms, d):
    """The persistent kernel on grids of 1, 3 and 7 CTAs (the SM count stood in for), so each
    CTA walks many tiles: its ring and Q buffers wrap across tiles of different key ranges
    (causal, seqlen_q != seqlen_k, rows that see no key, GQA), every persistent config,
    against the reference; outputs poisoned."""
    monkeypatch.setattr(AH.D, "sm_count", lambda device=None: sms)
    cases = [(3, 300, 300, 4, 2, False), (2, 257, 700, 4, 1, True), (2, 700, 257, 2, 2, True),
             (1, 1000, 1000, 3, 3, True)]
    for i, (b, sq, sk, hq, hk, causal) in enumerate(cases):
        args = _qkv(b, sq, sk, hq, hk, d, torch.bfloat16, "cuda", seed=20 + i)
        for cfg in (c for c in AH.configs(d, ws=True) if c.get("PERSISTENT")):
            with poisoned_outputs():
                check_against_reference(_fn(causal, cfg), _ref(causal), args)


@contextlib.contextmanager
def _launches():
    """The (kernel, grid) of each launch made inside, launched as usual (a spy on the
    launcher the forward calls)."""
    seen, real = [], AH.C.launch

    def spy(kernel, grid, **kw):
        seen.append((kernel, grid))
        return real(kernel, grid, **kw)

    AH.C.launch = spy
    try:
        yield seen
    finally:
        AH.C.launch = real


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
def test_gpu_persistent_grid_and_graph_replay():
    """One CTA an SM at most (fewer with fewer tiles), and a CUDA-graph capture replays with
    new inputs, the same bits as an eager call on them (the tile counter is zeroed a launch,
    inside the graph too)."""
    cfg = _schedule_config("persistent", 128)
    q, k, v = _qkv(4, 512, 512, 8, 8, 128, torch.bfloat16, "cuda", seed=31)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with _launches() as seen:
        AH.forward(q, k, v, causal=True, config=cfg)
        AH.forward(q[:1, :128, :2], k[:1, :128, :2], v[:1, :128, :2], causal=True, config=cfg)
    assert [g for _, g in seen] == [(min(sms, 4 * 8 * 4),), (2,)]
    assert all(kern is AH._attn_fwd_hopper_persistent_kernel for kern, _ in seen)
    static = [t.clone() for t in (q, k, v)]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = AH.forward(*static, causal=True, config=cfg)
    for seed in (41, 42):
        new = _qkv(4, 512, 512, 8, 8, 128, torch.bfloat16, "cuda", seed=seed)
        for t, n in zip(static, new):
            t.copy_(n)
        g.replay()
        want, want_lse = AH.forward(*new, causal=True, config=cfg)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("d, causal, b, s", [(128, True, 16, 512), (64, False, 16, 512),
                                             (128, True, 2, 2048)])
def test_gpu_flash_attention_takes_the_persistent_kernel(d, causal, b, s):
    """tkit.flash_attention with many tiles (b x 8 heads x s / 128 query blocks; D=128 causal
    at short tiles (n64 s5) and long ones (n128 s2), D=64 without a mask) launches the
    persistent kernel (fwd_backend says so), against the reference; the repeated calls that
    its eager plan serves (a fresh zeroed tile counter a call) and a CUDA-graph replay give
    the same bits as the first call on the same inputs. D=64 without a mask in one wave of
    tiles goes to the Triton kernel."""
    import tkit
    from tkit.kernels import attention as A

    q, k, v = _qkv(b, s, s, 8, 4, d, torch.bfloat16, "cuda", seed=51)
    assert "persistent" in A.fwd_backend(q, k, v, causal=causal)
    with _launches() as seen:
        check_against_reference(lambda q, k, v: tkit.flash_attention(q, k, v, causal=causal,
                                                                     return_lse=True),
                                _ref(causal), [q, k, v])
    assert AH._attn_fwd_hopper_persistent_kernel in [kern for kern, _ in seen]
    first = tkit.flash_attention(q, k, v, causal=causal)
    for _ in range(3):  # served by the plan after the first call
        assert torch.equal(tkit.flash_attention(q, k, v, causal=causal), first)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = tkit.flash_attention(q, k, v, causal=causal)
    for _ in range(2):
        out.zero_()
        g.replay()
        assert torch.equal(out, first)
    if d == 64:  # one wave of tiles (8 heads x 16 query blocks): the Triton kernel
        ql, kl, vl = _qkv(1, 2048, 2048, 8, 4, d, torch.bfloat16, "cuda", seed=52)
        assert A.fwd_backend(ql, kl, vl, causal=causal).startswith("triton")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_flash_attention_head_dim_256(causal):
    """tkit.flash_attention at head dim 256 takes the Gluon forward (its causal and
    non-causal defaults), against the reference, GQA and a ragged length."""
    import tkit
    from tkit.kernels import attention as A

    q, k, v = _qkv(2, 777, 777, 8, 4, 256, torch.bfloat16, "cuda", seed=61)
    assert A.fwd_backend(q, k, v, causal=causal).startswith("gluon")
    with poisoned_outputs():
        check_against_reference(lambda q, k, v: tkit.flash_attention(q, k, v, causal=causal,
                                                                     return_lse=True),
                                _ref(causal), [q, k, v])
