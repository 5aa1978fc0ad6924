"""The CuTe mma.sync GEMM (csrc/gemm_cute_sm80.cu, tkit.cuda_ext.gemm_cute).

On CPU: every build of CUTE_VARIANTS compiles with nvcc for sm_90a (the H200) and sm_80, and its
SASS is the Ampere recipe: HMMA (mma.sync), LDSM (ldmatrix, transposed for B), LDGSTS
(cp.async), every mma of a k tile unrolled, no HGMMA, no local memory (LDL/STL, spills), a stack
of 0; the registers of each kernel are recorded (``-rP`` / ``--junitxml`` show them). The CuTe
headers make each build take about a minute on two cores, so cubins go to tkit's disk cache
(``$TKIT_CACHE_DIR/cuda_ext``, keyed by source hash and options) and the builds a run needs are
compiled side by side first; the sm_80 builds other than the default are marked slow.

On the GPU: correctness against a float64 reference with the DESIGN rule (fresh random inputs,
output NaN-poisoned before the launch) at shapes that are whole tiles but otherwise uneven (one
tile, a single k tile, partial raster groups, K not a power of two), fp32 output, and the errors
for inputs the kernel does not take.
"""

import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tkit.cuda_ext import _loader
from tkit.cuda_ext.gemm_cute import (
    CUTE_DEFAULT_VARIANT,
    CUTE_DEFAULTS,
    CUTE_VARIANTS,
    check_cute_tiles,
    compile_cute,
    cubin_resources,
    cute_config,
    matmul_cute_sm80,
)
from tkit.testing import check_against_reference, make_tensor

ON_GPU = torch.cuda.is_available()
BF16 = torch.bfloat16
# its GPU tests build with nvcc and the CuTe headers: they skip where those are missing
# (tests/cuda_ext/conftest.py)
pytestmark = pytest.mark.cute
KERNELS = ("gemm_cute_bf16", "gemm_cute_bf16_f32out")

_why_no_build = (
    "nvcc not on the PATH: compile-only checks need it" if _loader.nvcc_path() is None else
    "CuTe headers not found (pip install nvidia-cutlass)" if _loader.cutlass_include() is None
    else "cuobjdump not found (CUDA install or the Triton wheel)"
    if _loader.cuda_binutil("cuobjdump") is None else None)
needs_build = pytest.mark.skipif(_why_no_build is not None, reason=_why_no_build or "")


def _variant_params(arch):
    """Every variant; on sm_80 the non-default builds are slow-marked (same PTX as sm_90a's,
    one more minute each)."""
    return [pytest.param(v, marks=() if arch == "90a" or v == CUTE_DEFAULT_VARIANT
                         else pytest.mark.slow) for v in CUTE_VARIANTS]


# ---- configuration (no compiler needed) ------------------------------------------------------
def test_default_build_has_no_options():
    """The default variant is the source's macro defaults, and no two variants are one build."""
    cfg = cute_config()
    assert cfg["variant"] == CUTE_DEFAULT_VARIANT and cfg["options"] == ()
    assert {k: cfg[k] for k in CUTE_DEFAULTS} == CUTE_DEFAULTS
    opts = {v: cute_config(v)["options"] for v in CUTE_VARIANTS}
    assert len(set(opts.values())) == len(opts), "two variants name the same build"
    src = _loader.read_source("gemm_cute_sm80.cu")
    for key, value in CUTE_DEFAULTS.items():  # the Python defaults are the source's
        assert re.search(rf"#define {key.upper()} {value}\n", src), key


@pytest.mark.parametrize("variant", list(CUTE_VARIANTS))
def test_variant_fits(variant):
    """Tiles the kernel takes (its #error conditions), within the H200's 227 KiB a block; the
    two-blocks-per-SM builds fit twice in the SM's 228 KiB (1 KiB reserved per block)."""
    cfg = cute_config(variant)
    threads = cfg["threads"]
    assert cfg["bk"] in (32, 64) and cfg["bn"] % 64 == 0 and cfg["stages"] >= 2
    assert (cfg["bm"] // cfg["warps_m"]) % 16 == 0 and (cfg["bn"] // cfg["warps_n"]) % 16 == 0
    assert threads in (128, 256)
    assert cfg["bm"] % (threads // (cfg["bk"] // 8)) == 0
    assert cfg["bk"] % (threads // (cfg["bn"] // 8)) == 0
    assert cfg["smem"] <= 227 * 1024
    if cfg["min_blocks"]:
        assert cfg["min_blocks"] * (cfg["smem"] + 1024) <= 228 * 1024


def test_unknown_variant_names_the_choices():
    with pytest.raises(ValueError, match=r"variant must be one of 128x256k32s4, "):
        cute_config("fastest")


@pytest.mark.parametrize("shape, match", [
    ((100, 256, 64), r"^M = 100 \(a\.shape\[0\]\) must be a multiple of 128"),
    ((128, 320, 64), r"^N = 320 \(b\.shape\[1\]\) must be a multiple of 256"),
    ((128, 256, 40), r"^K = 40 \(a\.shape\[1\]\) must be a multiple of 32"),
])
def test_tile_errors_name_the_argument(shape, match):
    with pytest.raises(ValueError, match=match) as info:
        check_cute_tiles(cute_config(), *shape)
    assert "no edge predication" in str(info.value)
    check_cute_tiles(cute_config(), 256, 512, 96)  # whole tiles pass


@pytest.mark.skipif(ON_GPU, reason="checks the CPU-tensor message")
def test_cpu_tensors_are_refused_by_name():
    with pytest.raises(ValueError, match=r"^a is on cpu"):
        matmul_cute_sm80(torch.zeros(128, 32, dtype=BF16), torch.zeros(32, 256, dtype=BF16))


# ---- compile-only: nvcc + SASS ---------------------------------------------------------------
@pytest.fixture(scope="session")
def cute_cubins(request):
    """{(variant, arch): cubin} for the compile tests selected in this run, built two or more at
    a time (each nvcc run is single-threaded; the CuTe templates take most of a minute)."""
    wanted = []
    for item in request.session.items:
        cs = getattr(item, "callspec", None)
        if (item.module.__name__ == __name__ and cs is not None and "arch" in cs.params
                and not any(m.name == "skip" for m in item.iter_markers())):
            wanted.append((cs.params["variant"], cs.params["arch"]))
    wanted = list(dict.fromkeys(wanted))
    built, errors = {}, {}

    def one(key):
        try:
            return key, compile_cute(key[0], key[1]), None
        except Exception as e:  # reported by the test of that build
            return key, None, e

    with ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2))) as ex:
        for key, path, err in ex.map(one, wanted):
            if err is None:
                built[key] = path
            else:
                errors[key] = err

    def get(variant, arch):
        if (variant, arch) in errors:
            raise errors[(variant, arch)]
        if (variant, arch) not in built:
            built[(variant, arch)] = compile_cute(variant, arch)
        return built[(variant, arch)]

    return get


def opcodes(sass: str) -> set[str]:
    return set(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass))


def _check_build(cubin, variant, arch, record_property):
    cfg = cute_config(variant)
    kernels = _loader.sass_by_function(cubin)
    assert set(KERNELS) <= set(kernels), f"missing kernels: {set(KERNELS) - set(kernels)}"
    res = cubin_resources(cubin)
    # mma per k tile and thread-warp: (warp tile / m16n8) x (BK / 16) k16 blocks, all unrolled
    per_k_tile = (cfg["bm"] // cfg["warps_m"] // 16) * (cfg["bn"] // cfg["warps_n"] // 8) * (
        cfg["bk"] // 16)
    for name in KERNELS:
        sass = kernels[name]
        ops = opcodes(sass)
        assert {"HMMA", "LDSM", "LDGSTS"} <= ops, f"{variant} {name}: {ops}"
        assert "HGMMA" not in ops, f"{variant} {name}: wgmma in an mma.sync build"
        assert not ops & {"LDL", "STL"}, f"{variant} {name}: local memory traffic (spills)"
        assert len(re.findall(r"HMMA\.16816\.F32\.BF16", sass)) == per_k_tile
        assert re.search(r"LDSM\.16\.MT88\.4", sass), "no ldmatrix.x4.trans for B"
        assert re.search(r"LDSM\.16\.M88\.4", sass), "no ldmatrix.x4 for A"
        assert re.search(r"LDGSTS\.E\.BYPASS\.\S*128", sass), "no 16-byte cp.async.cg"
        r = res[name]
        assert r["local"] == 0 and r["stack"] == 0, f"{variant} {name}: {r}"
        assert r["reg"] <= 255
        if cfg["min_blocks"]:  # the register budget of min_blocks blocks per SM
            assert r["reg"] * cfg["threads"] * cfg["min_blocks"] <= 65536, r
        record_property(f"{name}_registers", r["reg"])
        print(f"{variant} sm_{arch} {name}: {r['reg']} registers, stack {r['stack']}, "
              f"local {r['local']}, static shared {r['shared']}, dynamic shared {cfg['smem']}")
    if cfg["epi_smem"]:  # the staged bf16 epilogue stores 16 bytes a thread
        assert re.search(r"STG\.E\.128", kernels["gemm_cute_bf16"]), "no 16-byte stores"
    else:
        assert not re.search(r"STG\.E\.128", kernels["gemm_cute_bf16"])
    assert re.search(r"STG\.E\.64", kernels["gemm_cute_bf16_f32out"]), "no 8-byte fp32 stores"


@pytest.mark.toolchain
@needs_build
@pytest.mark.parametrize("variant", _variant_params("90a"))
@pytest.mark.parametrize("arch", ["90a"])
def test_variant_sass_sm90a(cute_cubins, variant, arch, record_property):
    _check_build(cute_cubins(variant, arch), variant, arch, record_property)


@pytest.mark.toolchain
@needs_build
@pytest.mark.parametrize("variant", _variant_params("80"))
@pytest.mark.parametrize("arch", ["80"])
def test_variant_sass_sm80(cute_cubins, variant, arch, record_property):
    _check_build(cute_cubins(variant, arch), variant, arch, record_property)


# ---- GPU ------------------------------------------------------------------------------------
def _shapes(cfg):
    """Whole tiles, otherwise uneven: one tile; one k tile (fewer than the pipeline's stages);
    11 x 3 tiles (a partial raster group of 3 rows after a full one of 8) with 37 k tiles;
    1024 x 1024 x 1024 (256 x 256 x 1024 for the 256-wide tiles too)."""
    bm, bn, bk = cfg["bm"], cfg["bn"], cfg["bk"]
    return [(bm, bn, bk), (2 * bm, 2 * bn, bk), (11 * bm, 3 * bn, 37 * bk), (1024, 1024, 1024),
            (bm, bn, 4096)]


def _skip_unless_sm80():
    if not ON_GPU or torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("the CuTe mma.sync GEMM needs sm_80 or newer")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(CUTE_VARIANTS))
def test_cute_gemm_correct(variant):
    _skip_unless_sm80()
    cfg = cute_config(variant)
    for i, (M, N, K) in enumerate(_shapes(cfg)):
        seed = 100 * list(CUTE_VARIANTS).index(variant) + 10 * i
        a = make_tensor((M, K), BF16, seed=seed)
        b = make_tensor((K, N), BF16, seed=seed + 1)
        check_against_reference(lambda x, y: matmul_cute_sm80(x, y, variant=variant),
                                torch.matmul, [a, b])


@pytest.mark.gpu
def test_cute_gemm_default_and_fp32_out():
    _skip_unless_sm80()
    a = make_tensor((384, 320), BF16, seed=11)
    b = make_tensor((320, 512), BF16, seed=12)
    check_against_reference(matmul_cute_sm80, torch.matmul, [a, b])
    out = matmul_cute_sm80(a, b, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), a.double() @ b.double(), rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
def test_cute_gemm_trivial_shapes():
    _skip_unless_sm80()
    a = torch.zeros(0, 64, dtype=BF16, device="cuda")
    b = make_tensor((64, 256), BF16, seed=3)
    assert matmul_cute_sm80(a, b).shape == (0, 256)
    a = make_tensor((128, 0), BF16, seed=4)
    b = make_tensor((0, 256), BF16, seed=5)
    out = matmul_cute_sm80(a, b)
    assert out.shape == (128, 256) and not out.any()


@pytest.mark.gpu
@pytest.mark.parametrize("shapes, kwargs, error, match", [
    (((200, 64), (64, 256)), {}, ValueError, r"^M = 200 \(a\.shape\[0\]\)"),
    (((128, 64), (64, 128)), {}, ValueError, r"^N = 128 \(b\.shape\[1\]\)"),
    (((128, 48), (48, 256)), {}, ValueError, r"^K = 48 \(a\.shape\[1\]\)"),
    (((128, 32), (32, 128)), dict(variant="128x128k64s3_2cta"), ValueError,
     r"^K = 32 \(a\.shape\[1\]\) must be a multiple of 64"),
    (((128, 64), (64, 256)), dict(out_dtype=torch.float16), TypeError,
     r"^out_dtype must be bfloat16 or float32"),
    (((128, 64), (64, 256)), dict(variant="nope"), ValueError, r"^variant must be one of"),
])
def test_cute_gemm_errors(shapes, kwargs, error, match):
    _skip_unless_sm80()
    a, b = make_tensor(shapes[0], BF16, seed=1), make_tensor(shapes[1], BF16, seed=2)
    with pytest.raises(error, match=match):
        matmul_cute_sm80(a, b, **kwargs)


@pytest.mark.gpu
def test_cute_gemm_refuses_views_and_dtypes():
    _skip_unless_sm80()
    a = make_tensor((256, 128), BF16, seed=6)
    b = make_tensor((128, 256), BF16, seed=7)
    with pytest.raises(ValueError, match=r"^a must be row-major"):
        matmul_cute_sm80(make_tensor((256, 128), BF16, "transposed", seed=8), b)
    with pytest.raises(ValueError, match=r"^b must be row-major"):
        matmul_cute_sm80(a, make_tensor((128, 256), BF16, "transposed", seed=9))
    with pytest.raises(TypeError, match=r"^a has dtype"):
        matmul_cute_sm80(a.half(), b)
