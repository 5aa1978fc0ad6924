"""Compile-only checks of every .cu in tkit/cuda_ext/csrc (nvcc, no GPU needed) and of its SASS.

What the SASS must show: tensor-core instructions of the right generation (HGMMA for the Hopper
GEMM; HMMA, LDSM and LDGSTS for the Ampere one), TMA loads and mbarrier waits on Hopper, and no
local memory traffic (LDL/STL: register spills or dynamically indexed arrays) anywhere in the
GEMM kernels, hot loops included. Cubins are cached per source hash in one temporary directory
for the test session.
"""

import re
import subprocess
import sys

import pytest

from tkit.cuda_ext import _loader
from tkit.cuda_ext.gemm import (
    MMA_DEFAULT_VARIANT,
    MMA_VARIANTS,
    WGMMA_DEFAULT_VARIANT,
    WGMMA_VARIANTS,
    mma_config,
    wgmma_config,
)

pytestmark = pytest.mark.skipif(_loader.nvcc_path() is None,
                                reason="nvcc not on the PATH: compile-only checks need it")

SASS_TOOL = _loader.cuda_binutil("cuobjdump")
needs_cuobjdump = pytest.mark.skipif(SASS_TOOL is None,
                                     reason="cuobjdump not found (CUDA install or Triton wheel)")


@pytest.fixture(scope="session")
def cubin_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cuda_ext_cubins")


@pytest.fixture(scope="session")
def build(cubin_dir):
    cache = {}

    def _build(name, arch):
        if (name, arch) not in cache:
            cache[(name, arch)] = _loader.compile_cubin(name, arch, cache_dir=cubin_dir)
        return cache[(name, arch)]

    return _build


kernels_sass = _loader.sass_by_function


def opcodes(sass: str) -> set[str]:
    return set(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass))


SGEMM = ["sgemm_naive", "sgemm_smem", "sgemm_1d_blocking", "sgemm_2d_blocking",
         "sgemm_vectorized", "sgemm_cp_async"]


@pytest.mark.toolchain
@pytest.mark.parametrize("arch", ["80", "90"])
@needs_cuobjdump
def test_sgemm_ladder(build, arch):
    k = kernels_sass(build("sgemm.cu", arch))
    assert set(SGEMM) <= set(k), f"missing kernels: {set(SGEMM) - set(k)}"
    for name in SGEMM:
        ops = opcodes(k[name])
        assert "FFMA" in ops, f"{name}: no FFMA in its SASS"
        assert not ops & {"LDL", "STL"}, f"{name}: local memory traffic (spills) in its SASS"
    assert "LDGSTS" in opcodes(k["sgemm_cp_async"]), "sgemm_cp_async: no cp.async (LDGSTS)"
    assert "LDGSTS" not in opcodes(k["sgemm_vectorized"])
    # float4 shared loads in the vectorized steps
    assert re.search(r"LDS\.128", k["sgemm_vectorized"]), "sgemm_vectorized: no LDS.128"


@pytest.mark.toolchain
@pytest.mark.parametrize("arch", ["80", "90"])
@needs_cuobjdump
def test_mma_sync_gemm(build, arch):
    k = kernels_sass(build("gemm_mma_sm80.cu", arch))
    for name in ("gemm_mma_bf16", "gemm_mma_bf16_f32out"):
        ops = opcodes(k[name])
        assert {"HMMA", "LDGSTS", "LDSM"} <= ops, f"{name}: {ops & {'HMMA', 'LDGSTS', 'LDSM'}}"
        assert not ops & {"LDL", "STL"}, f"{name}: local memory traffic (spills)"
        # the default build (256x128x64, 4 x 2 warps of 64 x 64): 4 x 8 mma per warp and k16
        # step, four k16 steps per 64-wide k tile, unrolled
        assert len(re.findall(r"HMMA\.16816\.F32\.BF16", k[name])) == 128
    assert re.search(r"STG\.E\.128", k["gemm_mma_bf16"]), "no 16-byte stores (EPI_SMEM)"


def test_default_builds_have_no_options():
    """The default variants are the sources' macro defaults: the build the dispatcher compiles
    (no -D options) is the one the sweeps measured as the default."""
    assert mma_config()["options"] == () and mma_config()["variant"] == MMA_DEFAULT_VARIANT
    assert wgmma_config()["options"] == () and wgmma_config()["variant"] == WGMMA_DEFAULT_VARIANT
    assert mma_config("default")["options"] == wgmma_config("default")["options"] == ()
    opts = {v: mma_config(v)["options"] for v in MMA_VARIANTS}
    assert len(set(opts.values())) == len(opts), "two mma variants name the same build"
    opts = {v: wgmma_config(v)["options"] for v in WGMMA_VARIANTS}
    assert len(set(opts.values())) == len(opts), "two wgmma variants name the same build"


@pytest.mark.toolchain
@pytest.mark.parametrize("variant", [v for v in MMA_VARIANTS if v != MMA_DEFAULT_VARIANT])
@pytest.mark.parametrize("arch", ["80", "90"])
@needs_cuobjdump
def test_mma_sync_gemm_variants(cubin_dir, variant, arch):
    """Every tile variant of the sweep builds for sm_80 (and the H200's sm_90, through the same
    ptxas) with tensor-core code, cp.async, ldmatrix, no spills, every mma unrolled."""
    cfg = mma_config(variant)
    k = kernels_sass(_loader.compile_cubin("gemm_mma_sm80.cu", arch, cfg["options"],
                                           cache_dir=cubin_dir))
    per_k_tile = (cfg["bm"] // cfg["warps_m"] // 16) * (cfg["bn"] // cfg["warps_n"] // 8) * (
        cfg["bk"] // 16)
    for name in ("gemm_mma_bf16", "gemm_mma_bf16_f32out"):
        ops = opcodes(k[name])
        assert {"HMMA", "LDGSTS", "LDSM"} <= ops, f"{variant} {name}: missing tensor-core code"
        assert not ops & {"LDL", "STL"}, f"{variant} {name}: local memory traffic (spills)"
        assert len(re.findall(r"HMMA\.16816\.F32\.BF16", k[name])) == per_k_tile
    if cfg["epi_smem"]:  # the staged bf16 epilogue stores 16 bytes a thread
        assert re.search(r"STG\.E\.128", k["gemm_mma_bf16"]), f"{variant}: no 16-byte stores"


@pytest.mark.toolchain
@pytest.mark.parametrize("variant", [v for v in WGMMA_VARIANTS if v != WGMMA_DEFAULT_VARIANT])
@needs_cuobjdump
def test_wgmma_gemm_variants(cubin_dir, variant):
    cfg = wgmma_config(variant)
    assert cfg["smem"] <= 227 * 1024, f"{variant}: {cfg['smem']} bytes of shared memory"
    sass = kernels_sass(_loader.compile_cubin("gemm_wgmma_sm90.cu", "90a", cfg["options"],
                                              cache_dir=cubin_dir))["gemm_wgmma_bf16"]
    ops = opcodes(sass)
    assert re.search(r"HGMMA\.64x256x16\.F32\.BF16", sass), f"{variant}: no HGMMA"
    assert {"UTMALDG", "SYNCS", "USETMAXREG"} <= ops, f"{variant}: {ops}"
    assert not ops & {"LDL", "STL"}, f"{variant}: local memory traffic (spills)"
    if cfg["epi_tma"]:
        assert "UTMASTG" in ops, f"{variant}: no TMA stores in the epilogue"
        assert "STG" not in ops, f"{variant}: the TMA epilogue still stores from registers"
    if cfg["cluster_m"] == 2:
        assert re.search(r"UTMALDG\.2D\.MULTICAST", sass), f"{variant}: no multicast loads"
        assert "UCGABAR_WAIT" in ops, f"{variant}: no cluster barrier"


@pytest.mark.toolchain
@pytest.mark.parametrize("options", [(), ("-DWGMMA_INFLIGHT=1",),
                                     ("-DSTAGES=4", "-DEPI_TMA=0", "-DEPI_SPLIT=2")],
                         ids=["default", "inflight", "direct_s4"])
@needs_cuobjdump
def test_wgmma_gemm(build, cubin_dir, options):
    cubin = (build("gemm_wgmma_sm90.cu", "90a") if not options else
             _loader.compile_cubin("gemm_wgmma_sm90.cu", "90a", options, cache_dir=cubin_dir))
    k = kernels_sass(cubin)
    sass = k["gemm_wgmma_bf16"]
    ops = opcodes(sass)
    assert "HGMMA" in ops, "no HGMMA: wgmma did not survive to SASS"
    assert re.search(r"HGMMA\.64x256x16\.F32\.BF16", sass)
    assert "UTMALDG" in ops, "no TMA loads (UTMALDG)"
    assert "SYNCS" in ops, "no mbarrier operations (SYNCS.*)"
    assert "USETMAXREG" in ops, "no setmaxnreg (USETMAXREG)"
    assert not ops & {"LDL", "STL"}, "local memory traffic (spills) in the Hopper GEMM"
    if "-DEPI_TMA=0" not in options:  # the default epilogue: TMA stores
        assert "UTMASTG" in ops, "no TMA stores (UTMASTG) in the epilogue"


FP8_BLOCK_BUILDS = [{}, dict(stages=3, epi_split=1), dict(out_dtype="float16"), dict(col_scale=1)]


@pytest.mark.toolchain
@pytest.mark.parametrize("build", FP8_BLOCK_BUILDS, ids=lambda v: "-".join(
    f"{k}{v[k]}" for k in v) or "default")
@needs_cuobjdump
def test_fp8_block_gemm_builds(cubin_dir, build):
    """The block-scaled fp8 GEMM: two 64 x 128 fp8 wgmma sums a group (four k32 steps each,
    A and B from shared memory), each waited for alone (two waits to zero) and promoted by
    64 FFMAs; TMA in and out, no spills."""
    import torch

    from tkit.cuda_ext.gemm_fp8_block import config

    kw = dict(build)
    if "out_dtype" in kw:
        kw["out_dtype"] = getattr(torch, kw["out_dtype"])
    cfg = config(**kw)
    sass = kernels_sass(_loader.compile_cubin("gemm_fp8_block_sm90.cu", "90a", cfg["options"],
                                              cache_dir=cubin_dir))["gemm_fp8_block"]
    ops = opcodes(sass)
    assert len(re.findall(r"QGMMA\.64x128x32\.F32\.E4M3\.E4M3 R\d+, gdesc", sass)) == 8, build
    waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d)", sass)
    assert waits == ["0x0", "0x0"], f"{build}: {waits}"
    assert len(re.findall(r"\bFFMA\b", sass)) == 128, build
    assert {"UTMALDG", "UTMASTG", "SYNCS", "USETMAXREG"} <= ops, f"{build}: {ops}"
    assert not ops & {"LDL", "STL"}, f"{build}: local memory traffic (spills)"


INT4_BUILDS = [(1, "bfloat16", "float16", 128), (16, "bfloat16", "float16", 128),
               (16, "float16", "float32", 32), (3, "bfloat16", "bfloat16", 1024)]


@pytest.mark.toolchain
@pytest.mark.parametrize("build", INT4_BUILDS, ids=lambda v: "-".join(map(str, v)))
@needs_cuobjdump
def test_int4_gemm_builds(cubin_dir, build):
    """The INT4 decode GEMM: per 512-deep step a consumer warp's 8 chunks each take two k16
    steps of three m16n8k16 MMAs (two weight tiles and the all-ones row sums) for each n8
    tile of a's rows, in the dtype of a; the dequantization is LOP3 with the mask and magic
    in registers (0xEA: one instruction a pair); TMA in (3-d boxes), mbarriers, no spills."""
    import torch

    from tkit.cuda_ext.gemm_int4 import config

    M, act, sdt, G = build
    cfg = config(M, getattr(torch, act), getattr(torch, sdt), G)
    sass = kernels_sass(_loader.compile_cubin("gemm_int4_sm90.cu", "90a", cfg["options"],
                                              cache_dir=cubin_dir))["gemm_int4"]
    ops = opcodes(sass)
    kind = "" if act == "float16" else r"\.BF16"  # (fp16 operands carry no suffix)
    assert len(re.findall(rf"HMMA\.16816\.F32{kind} ", sass)) == 8 * 2 * 3 * cfg["nt"]
    assert len(re.findall(r"LOP3\.LUT R\d+, R\d+, 0xf000f, R\d+(?:\.reuse)?, 0xea", sass)) >= 8 * 16
    assert {"UTMALDG", "SYNCS", "ATOMG"} <= ops, ops
    assert not ops & {"LDL", "STL"}, f"{build}: local memory traffic (spills)"


def _k_loop(sass: str) -> str:
    """The text of a kernel's K loop: the shortest loop (``tkit.ir_tools``' backward
    branches) around MMAs."""
    from tkit.ir_tools.summary import sass_loops

    lp = min((lp for lp in sass_loops(sass) if any(k.startswith("HMMA") for k in lp["histogram"])),
             key=lambda lp: lp["instructions"])
    return "\n".join(ln for ln in sass.splitlines()
                     if (m := re.search(r"/\*([0-9a-f]{4,})\*/", ln))
                     and lp["start"] <= int(m.group(1), 16) <= lp["end"])


# (M, N, K, a's dtype, the scales', group, the sums' form: None the default's)
GEMV_INT4_BUILDS = [(1, 14336, 4096, "bfloat16", "float16", 128, None),
                    (1, 8192, 8192, "bfloat16", "bfloat16", 128, None),
                    (16, 4096, 4096, "float16", "float32", 32, None),
                    (5, 1024, 2048, "bfloat16", "float16", 512, None),
                    (16, 14336, 4096, "bfloat16", "float16", 128, None),
                    (16, 14336, 4096, "bfloat16", "bfloat16", 128, None),
                    (1, 14336, 4096, "bfloat16", "float16", 128, True),
                    (16, 14336, 4096, "bfloat16", "float16", 128, False),
                    (32, 14336, 4096, "bfloat16", "float16", 128, None),
                    (64, 8192, 8192, "float16", "float32", 32, False)]


@pytest.mark.toolchain
@pytest.mark.parametrize("build", GEMV_INT4_BUILDS, ids=lambda v: "-".join(map(str, v)))
@needs_cuobjdump
def test_int4_gemv_builds(cubin_dir, build):
    """The INT4 GEMV: the codes read by 16-byte loads that skip L1, straight into registers
    (no TMA, no mbarrier, no cp.async in the K loop: LDGSTS only stages a and the scales
    before it); each 32-deep chunk dequantized by 16 LOP3s (mask and magic in registers)
    into two k16 steps of two m16n8k16 MMAs an n8 tile of a's rows, in a's dtype, beside
    the groups' sums of a (an all-ones MMA a k16 step and tile, or the stacked form's one a
    chunk / k16 step and pair of tiles, and shuffles a group); a K loop with no barrier, and
    no spills (at 32 rows a CTA too, under its 8 warps an SM)."""
    import torch

    from tkit.cuda_ext.gemm_int4 import gemv_config

    M, N, K, act, sdt, G, stacked = build
    cfg = gemv_config(M, N, K, getattr(torch, act), getattr(torch, sdt), G, 132,
                      stacked=stacked)
    sass = kernels_sass(_loader.compile_cubin("gemv_int4.cu", "90a", cfg["options"],
                                              cache_dir=cubin_dir))["gemv_int4"]
    ops = opcodes(sass)
    kind = "" if act == "float16" else r"\.BF16"
    pf = cfg["pf"]
    hmma = len(re.findall(rf"HMMA\.16816\.F32{kind} ", sass))
    assert hmma >= pf * 4 * cfg["nt"], hmma  # the main loop's pass, and the tail's
    assert len(re.findall(r"LOP3\.LUT R\d+, R\d+, 0xf000f, R\d+(?:\.reuse)?, 0xea",
                          sass)) >= pf * 16
    assert re.search(r"LDG\.E\.NA\.128\.CONSTANT", sass)
    assert not ops & {"UTMALDG", "SYNCS", "LDL", "STL"}, ops
    body = _k_loop(sass)  # no barrier or shared stores
    assert "BAR" not in body and "STS" not in body
    # MMAs a chunk: 4 a tile for the product, and the sums of a
    nt, stacked = cfg["nt"], cfg["stacked"]
    per_chunk = 4 * nt + ((1 if nt == 1 else nt) if stacked else 2 * nt)
    body_hmma = len(re.findall(r"HMMA\.16816", body))
    assert body_hmma and body_hmma % per_chunk == 0, (body_hmma, per_chunk)
    assert ("SHFL.IDX" in body) == (stacked and G // 32 <= cfg["pf"] * cfg["rb"]), body_hmma


# (M, a's dtype, the scales', group, consumer warpgroups): one build of each row tile, and
# one consumer warpgroup
W4_BUILDS = [(1, "bfloat16", "float16", 128, 2), (16, "bfloat16", "bfloat16", 128, 2),
             (32, "float16", "float32", 32, 2), (64, "bfloat16", "float16", 256, 2),
             (128, "bfloat16", "float16", 128, 2), (256, "float16", "bfloat16", 64, 2),
             (64, "float16", "float32", 32, 1)]


@pytest.mark.toolchain
@pytest.mark.parametrize("build", W4_BUILDS, ids=lambda v: "-".join(map(str, v)))
@needs_cuobjdump
def test_int4_wgmma_builds(cubin_dir, build):
    """The wgmma INT4 GEMM: per 64-deep step four m64nBTk16 wgmmas with the weight from
    registers, in a's dtype; 16 LOP3s a step (one a pair of weights: mask and magic in
    registers) on 8-bit shared loads; TMA in; no spills, and ptxas does not serialize the
    wgmmas (the next step's fragments are written while a group runs, and fed to wgmmas only
    after it retires)."""
    import torch

    from tkit.cuda_ext.gemm_int4 import W4_SOURCE, w4_config

    M, act, sdt, G, cw = build
    cfg = w4_config(M, 14336, 4096, getattr(torch, act), getattr(torch, sdt), G, 132, cw=cw)
    sass = kernels_sass(_loader.compile_cubin(W4_SOURCE, "90a", cfg["options"],
                                              cache_dir=cubin_dir))["gemm_w4a16"]
    ops = opcodes(sass)
    kind = "" if act == "float16" else r"\.BF16"  # (fp16 operands carry no suffix)
    hgmma = re.findall(rf"HGMMA\.64x{cfg['bt']}x16\.F32{kind} R\d+, R\d+, gdesc", sass)
    assert len(hgmma) % 4 == 0 and len(hgmma) >= 8, len(hgmma)  # two fragment sets a loop
    assert len(re.findall(r"LOP3\.LUT R\d+, R\d+, 0xf000f, R\d+(?:\.reuse)?, 0xea",
                          sass)) >= 32
    assert "LDS.U8" in sass
    assert {"UTMALDG", "SYNCS"} <= ops, ops
    assert not ops & {"LDL", "STL"}, f"{build}: local memory traffic (spills)"
    report = _loader.resource_usage(W4_SOURCE, "90a", cfg["options"])
    assert "serialized" not in report, report


@pytest.mark.toolchain
def test_resource_usage_no_spills():
    """ptxas's own report agrees: 0 bytes spilled in every GEMM kernel."""
    for name, arch in (("gemm_mma_sm80.cu", "80"), ("gemm_wgmma_sm90.cu", "90a"),
                       ("gemm_fp8_block_sm90.cu", "90a"), ("gemm_int4_sm90.cu", "90a"),
                       ("gemv_int4.cu", "90a"), ("gemm_w4a16_sm90.cu", "90a")):
        report = _loader.resource_usage(name, arch)
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
        assert spills and all(s == ("0", "0") for s in spills), report


@pytest.mark.toolchain
def test_compile_error_names_the_file(tmp_path, monkeypatch):
    """The #line directive makes nvcc's diagnostics name the file in csrc/."""
    bad = tmp_path / "broken.cu"
    bad.write_text('extern "C" __global__ void k() {\n  int x = ;\n}\n')
    monkeypatch.setattr(_loader, "CSRC", tmp_path)
    with pytest.raises(_loader.CompileError, match=r"broken\.cu.*\(2\)"):
        _loader.compile_cubin("broken.cu", "80", cache_dir=tmp_path / "cache")


@pytest.mark.toolchain
def test_cache_reuses_cubins(cubin_dir, build):
    first = build("sgemm.cu", "80")
    again = _loader.compile_cubin("sgemm.cu", "80", cache_dir=cubin_dir)
    assert again == first
    other = _loader.compile_cubin("sgemm.cu", "80", ("-DTKIT_UNUSED=1",), cache_dir=cubin_dir)
    assert other != first  # options are part of the key


@pytest.mark.toolchain(group="cute_layouts")  # the host program tutorial 06b runs too
@pytest.mark.skipif(_loader.cutlass_include() is None, reason="nvidia-cutlass not installed")
def test_cute_prints_tiled_mma_layouts():
    import tkit.cuda_ext as cx

    # the host program goes to tkit's cache (TKIT_CACHE_DIR), which tutorial 06b reuses: the
    # CuTe headers take ~20 s to compile
    out = cx.cute_layouts()
    # the mma.sync m16n8k16 C fragment: thread (4 x 8) x value (2 x 2), as the kernel assumes
    assert "LayoutC_TV: ((_4,_8),(_2,_2)):((_32,_1),(_16,_8))" in out
    # the wgmma m64n256 accumulator: d[4j + 2h + e] at (16 warp + lane/4 + 8h, 8j + 2(lane%4) + e)
    assert "((_4,_8,_4),(_2,_2,_32)):((_128,_1,_16),(_64,_8,_512))" in out
    assert "Sw<3,4,3>" in out
    # the descriptors CuTe derives for the Hopper kernel's shared-memory stage are the ones the
    # kernel builds by hand (smem_desc(addr, 16, 1024) for A, (addr, 8192, 1024) for B)
    assert "desc A: LBO 16 B, SBO 1024 B, layout type 1" in out
    assert "desc B: LBO 8192 B, SBO 1024 B, layout type 1" in out


def test_nvrtc_compiles_runtime_sources():
    """The sources loaded through NVRTC at run time compile there too (needs libnvrtc)."""
    try:
        from cuda.bindings import nvrtc

        nvrtc.nvrtcVersion()
    except Exception as e:
        pytest.skip(f"NVRTC library not available here ({type(e).__name__})")
    for name in ("sgemm.cu", "gemm_mma_sm80.cu"):
        src = _loader.read_source(name).encode()
        _, prog = nvrtc.nvrtcCreateProgram(src, name.encode(), 0, [], [])
        opts = [b"-arch=sm_90", b"--device-as-default-execution-space"]
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _, n = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * n
        nvrtc.nvrtcGetProgramLog(prog, log)
        assert res == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode()


def test_without_cupy_status_says_why():
    """A process where cupy cannot be imported: status explains, matmul refuses by name."""
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "import torch, tkit.cuda_ext as c\n"
        "s = c.status()\n"
        "assert 'cupy is not importable' in s['cupy'], s\n"
        "assert s['ops']['matmul']['path'] == 'triton', s\n"
        "try:\n"
        "    c.matmul(torch.zeros(8, 8, dtype=torch.bfloat16), torch.zeros(8, 8, "
        "dtype=torch.bfloat16))\n"
        "except c.CudaPathUnavailable as e:\n"
        "    assert 'cupy' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('matmul ran without cupy')\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr
