"""tkit.ir on real compiles: every fact checked here is derived independently of the code under
test (grep of the raw PTX/SASS, ptxas -v, the arithmetic of the tile sizes).

Compiles take about a second each on CPU; they are cached in-process, so the tests below share
the handful of compiles made by the fixtures.
"""

import re
import subprocess
import warnings
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

import tkit
import tkit.ir_tools as ir
from tkit.ir_tools import aot as irc
from tkit.ir_tools.cli import main as cli_main


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M, N, K, sam, sbk, scm,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """c[M, N] = a[M, K] @ b[K, N], row-major, fp32 accumulation (a test kernel)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a = a_ptr + rm[:, None] * sam + rk[None, :]
    b = b_ptr + rk[:, None] * sbk + rn[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        x = tl.load(a, mask=rk[None, :] < K - k * BK, other=0.0)
        y = tl.load(b, mask=rk[:, None] < K - k * BK, other=0.0)
        acc += tl.dot(x, y)
        a += BK
        b += BK * sbk
    c = c_ptr + rm[:, None] * scm + rn[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


F16 = ((2048, 2048), torch.float16)
BM, BN, BK = 128, 128, 64


def _dot(arch, num_stages=3, num_warps=8):
    return ir.compile(_dot_kernel, F16, F16, F16, 2048, 2048, 2048, 2048, 2048, 2048,
                      BM=BM, BN=BN, BK=BK, num_warps=num_warps, num_stages=num_stages,
                      arch=arch)


@pytest.fixture(scope="module")
def add90():
    return ir.compile("add", arch="sm_90")  # first bench case: 16384x8192 bf16, contiguous


@pytest.fixture(scope="module")
def dot80():
    return _dot("sm_80")


@pytest.fixture(scope="module")
def dot90():
    return _dot("sm_90")


# ---- facts from the raw text ------------------------------------------------------------------
def test_vectorized_elementwise_has_128bit_global_loads(add90):
    ptx = add90.asm["ptx"]
    loads = re.findall(r"ld\.global[\w.:]*", ptx)
    assert loads and all(".v4.b32" in op for op in loads), loads  # 4 x 32 bit = 128 bit
    s = ir.summary(add90, echo=False)
    assert s.ptx.get("ld.global 128-bit") == len(loads)
    assert s.sass.get("LDG.128", 0) >= 1
    blocked = [lay for lay in s.layouts if lay["kind"] == "blocked"]
    assert "128-bit (16-byte) vectors for bf16" in blocked[0]["words"]


def test_sm80_dot_uses_mma_sync_and_ldmatrix(dot80):
    ptx = dot80.asm["ptx"]
    assert re.search(r"^\s*mma\.sync\.aligned\.m16n8k16", ptx, re.M)
    assert re.search(r"^\s*ldmatrix\.sync", ptx, re.M)
    assert "wgmma" not in ptx
    s = ir.summary(dot80, echo=False)
    assert s.ptx["mma.sync m16n8k16"] == len(re.findall(r"^\s*mma\.sync", ptx, re.M))
    mma = [lay for lay in s.layouts if lay["kind"] == "nvidia_mma"]
    assert mma and mma[0]["params"]["versionMajor"] == 2
    assert "HMMA" in dot80.sass()


def test_sm90_dot_uses_wgmma_and_hgmma(dot90):
    ptx = dot90.asm["ptx"]
    assert re.search(r"^\s*wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.f16\.f16", ptx, re.M)
    sass = dot90.sass()
    assert re.search(r"\bHGMMA\.64x128x16\.F32", sass)
    s = ir.summary(dot90, echo=False)
    assert s.sass["HGMMA.64x128x16"] == len(re.findall(r"\bHGMMA\.", sass))
    mma = [lay for lay in s.layouts if lay["kind"] == "nvidia_mma"]
    assert mma[0]["params"]["versionMajor"] == 3 and "wgmma" in mma[0]["words"]
    assert any(lay["kind"] == "nvmma_shared" for lay in s.layouts)


def test_num_stages_changes_the_reported_pipelining(dot90):
    two = _dot("sm_90", num_stages=2)
    s3, s2 = ir.summary(dot90, echo=False), ir.summary(two, echo=False)
    assert (s3.num_stages, s2.num_stages) == (3, 2)
    # one ring buffer slot per stage for each operand: 3 resp. 2 slots of a 128x64 / 64x128
    # fp16 tile, which is exactly the shared memory the kernel asks for
    tile_bytes = (BM * BK + BK * BN) * 2
    assert s3.pipelining["buffers"] == [3, 3] and s2.pipelining["buffers"] == [2, 2]
    assert s3.resources["shared"] == 3 * tile_bytes and s2.resources["shared"] == 2 * tile_bytes
    d = ir.diff(dot90, two, echo=False)
    keys = {k for k, _, _ in d.changes}
    assert {"num_stages", "pipelining.buffers", "resources.shared"} <= keys
    assert "3x128x64xf16" in d.unified and "2x128x64xf16" in d.unified


def test_main_loop_holds_the_pipelined_mmas(dot90, dot80):
    """The summary's main loop is the K loop: every MMA of the kernel, the cp.async copies of
    the next stages, no layout conversion in it; the text names it."""
    for k, mma in ((dot90, "HGMMA.64x128x16"), (dot80, "HMMA.16816")):
        s = ir.summary(k, echo=False)
        lp = s.main_loop
        assert lp["histogram"][mma] == s.sass[mma] > 0
        assert lp["histogram"]["LDGSTS"] >= 2 and lp["conversions"] == 0
        assert 0 < lp["instructions"] < s.sass["(all instructions)"]
        assert f"main loop (SASS {lp['start']:#06x}" in str(s)
    assert ir.summary(ir.compile("add", arch="sm_90"), echo=False).main_loop == {}


def test_sass_loops_and_loop_conversions_on_hand_written_text():
    """Loops are backward branches (predicated or not; forward branches are not loops),
    longest first; convert_layout counts only inside scf.for bodies."""
    from tkit.ir_tools.summary import loop_conversions, sass_loops

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0030*/                   LDS.128 R8, [R0] ;
        /*0040*/              @!P0 BRA 0x20 ;
        /*0050*/                   STL [R1], R8 ;
        /*0060*/               @P1 BRA 0x10 ;
        /*0070*/              @!P2 BRA 0x90 ;
        /*0080*/                   EXIT ;
        /*0090*/                   BRA 0x90;
    """
    loops = sass_loops(sass)
    assert [(lp["start"], lp["end"], lp["instructions"]) for lp in loops] == [
        (0x10, 0x60, 6), (0x20, 0x40, 3)]
    assert loops[0]["histogram"] == {"BAR": 1, "LDG.128": 1, "LDS.128": 1, "STL": 1}
    assert loops[1]["histogram"] == {"BAR": 1, "LDS.128": 1}
    ttgir = """
module attributes {"ttg.num-warps" = 4 : i32} {
  tt.func public @k(%arg0: !tt.ptr<f32>) {
    %0 = ttg.convert_layout %a : tensor<4xf32, #b0> -> tensor<4xf32, #b1>
    %1 = scf.for %i = %c0 to %c4 step %c1 iter_args(%x = %0) -> (tensor<4xf32, #b1>) : i32 {
      %2 = "tt.reduce"(%x) <{axis = 0 : i32}> ({
      ^bb0(%p: f32, %q: f32):
        tt.reduce.return %p : f32
      }) : (tensor<4xf32, #b1>) -> f32
      %3 = scf.if %c -> (tensor<4xf32, #b1>) {
        %4 = ttg.convert_layout %x : tensor<4xf32, #b1> -> tensor<4xf32, #b0>
        scf.yield %x : tensor<4xf32, #b1>
      } else {
        scf.yield %x : tensor<4xf32, #b1>
      }
      %5 = ttg.convert_layout %x : tensor<4xf32, #b1> -> tensor<4xf32, #b0>
      scf.yield %x : tensor<4xf32, #b1>
    }
    %6 = ttg.convert_layout %1 : tensor<4xf32, #b1> -> tensor<4xf32, #b0>
    tt.return
  }
}
"""
    assert loop_conversions(ttgir) == 2


def _ptxas_v(ptx: str, arch: str, cap: int) -> dict:
    # the ptxas Triton assembled this PTX with: the wheel's other one may be of an older CUDA
    # and reject the PTX's .version (triton 3.9 at sm_90: exit 255, "Unsupported .version")
    res = subprocess.run([irc.ptxas_path(cap), "-v", f"--gpu-name={arch}", "-", "-o", "/dev/null"],
                         input=ptx, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    out = res.stderr + res.stdout
    regs = int(re.search(r"Used (\d+) registers", out).group(1))
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    return dict(regs=regs, spill_stores=int(spill.group(1)))


@pytest.mark.parametrize("which", ["add90", "dot80", "dot90"])
def test_registers_and_shared_memory_agree_with_the_compiled_kernel(which, request):
    k = request.getfixturevalue(which)
    s = ir.summary(k, echo=False)
    ref = _ptxas_v(k.asm["ptx"], k.arch, k.cap)
    assert s.resources["n_regs"] == ref["regs"]
    assert s.resources["n_spills"] * 4 == ref["spill_stores"]
    assert s.resources["shared"] == k.metadata.shared
    occ = s.occupancy
    lim = {"sm_80": 2048, "sm_90a": 2048}[k.arch]
    # the register limit alone, computed here from ptxas' count
    by_regs = (65536 // (-(-ref["regs"] * 32 // 256) * 256)) // k.num_warps
    assert occ["blocks_per_sm"] <= min(by_regs, lim // (32 * k.num_warps))


@pytest.mark.gpu
def test_aot_compile_is_the_kernel_that_runs():
    """On a GPU: the launch tkit.ir compiles (local arch, tuned config) is the one Triton's JIT
    built when the op ran (same hash), and the driver reports the same registers and spills."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    tkit.add(a, a)
    torch.cuda.synchronize()
    k = ir.compile(tkit.add, a, a)
    # with several configs the autotuner ran and its choice is compiled; TKIT_NO_AUTOTUNE=1
    # leaves one config, the first
    assert "tuned config" in k.note or k.configs_available == 1
    from tkit.kernels import elementwise as ew

    jit = irc.unwrap(ew._kernels._ew_flat_autotuned)[2]
    kernels = {}
    for c in jit.device_caches[torch.cuda.current_device()][0].values():
        c._init_handles()
        kernels[c.metadata.hash] = c
    assert k.metadata.hash in kernels, _hash_mismatch(k, kernels)
    run = kernels[k.metadata.hash]
    assert (run.n_regs, run.n_spills, run.metadata.shared) == (k.n_regs, k.n_spills, k.shared)


def _hash_mismatch(k, kernels) -> str:
    """What differs between tkit.ir's compile and each kernel the JIT built: signature,
    constants, attributes and the metadata's options, side by side."""
    def facts(src, md):
        opts = {f: getattr(md, f) for f in getattr(md, "_fields", ())
                if f not in ("hash", "name", "shared", "tmem_size", "global_scratch_size",
                             "profile_scratch_size", "cluster_dims")}
        return {"signature": dict(src.signature), "constants": dict(src.constants),
                "attrs": dict(getattr(src, "attrs", {})), "options": opts}

    sig = k.signature
    ours = facts(SimpleNamespace(signature=sig.signature, constants=sig.constexprs,
                                 attrs=sig.attrs), k.metadata)
    lines = [f"tkit.ir hash {k.metadata.hash} not among the JIT's {len(kernels)} kernels"]
    for h, c in kernels.items():
        theirs = facts(c.src, c.metadata)
        for part in ours:
            a, b = ours[part], theirs[part]
            diff = {x: (a.get(x), b.get(x)) for x in set(a) | set(b) if a.get(x) != b.get(x)}
            if diff:
                lines.append(f"  JIT {h[:12]} {part}: (tkit.ir, JIT) {diff}")
    return "\n".join(lines)


def test_source_map_of_the_dot_line(dot90):
    m = ir.source_map(dot90, "tl.dot", echo=False)
    assert m["text"].startswith("acc += tl.dot")
    assert any(s.startswith("wgmma.mma_async") for s in m["ptx"])
    assert any("HGMMA" in s for s in m["sass"])


def test_show_prints_a_stage(add90, capsys):
    text = ir.show(add90, stage="ttgir")
    assert "#ttg.blocked" in text and " loc(" not in text
    assert capsys.readouterr().out.strip() == text.strip()
    assert "def _ew_flat_kernel" in ir.show(add90, stage="source")


def test_config_selects_autotune_configs():
    a = ir.compile("add", arch="sm_90", config={"BLOCK": 1024, "num_warps": 4})
    assert a.config["BLOCK"] == 1024 and a.num_warps == 4
    assert re.search(r"tensor<1024x", a.asm["ttgir"])


def test_compiles_choose_fp_fusion_explicitly():
    """Triton 3.9 warns on every compile that leaves FP fusion to its default (which turns to
    off in 3.10); tkit asks for fusion, the choice its kernels were measured with."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        k = _dot("sm_90", num_stages=2, num_warps=4)  # a compile no other test makes
    assert not [w for w in caught if "FP_FUSION" in str(w.message)], caught
    assert k.metadata.enable_fp_fusion is True
    off = ir.compile(_dot_kernel, F16, F16, F16, 2048, 2048, 2048, 2048, 2048, 2048, BM=BM,
                     BN=BN, BK=BK, num_warps=4, num_stages=2, enable_fp_fusion=False,
                     arch="sm_90")
    assert off.metadata.enable_fp_fusion is False  # an explicit choice still wins


# ---- bad input ----------------------------------------------------------------------------
def test_python_wrapper_is_refused_with_a_hint():
    from tkit.kernels.elementwise import _kernels as ew

    def my_add(x, y):  # a wrapper that launches a kernel, as users write them
        return ew._ew_flat_autotuned(x, y)

    with pytest.raises(ir.IRError, match=r"not a tkit op.*@triton\.jit function itself"
                                         r".*_ew_flat_autotuned"):
        ir.show(my_add, stage="ptx", arch="sm_90")


def test_one_shape_per_tensor_argument(capsys):
    with pytest.raises(ir.IRError, match=r"1 shape\(s\) given but rms_norm takes 2 tensor"
                                         r".*--shape '\d+x\d+:bf16;\d+:bf16'"):
        ir.compile("rms_norm", arch="sm_90", shapes=[((64, 4096), torch.bfloat16)])
    assert cli_main(["rms_norm", "--arch", "sm_90", "--summary",
                     "--shape", "64x4096:bf16;4096:bf16"]) == 0
    assert "shapes 64x4096:bf16;4096:bf16" in capsys.readouterr().out



def test_unknown_op_suggests_names():
    with pytest.raises(ir.IRError, match=r"unknown op 'rms_nrom'.*rms_norm"):
        ir.compile("rms_nrom", arch="sm_90")


def test_arch_spellings():
    assert [ir.parse_arch(a) for a in ("sm_80", "sm_90", "sm_90a", "90", 80, (9, 0))] == \
        [80, 90, 90, 90, 80, 90]


@pytest.mark.parametrize("arch", ["sm_70", "gfx90a", "hopper"])
def test_arch_triton_cannot_target(arch):
    with pytest.raises(ir.IRError, match="arch"):
        ir.compile("add", arch=arch)


def test_arguments_that_do_not_match_the_kernel():
    with pytest.raises(ir.IRError, match=r"missing .*BK"):
        ir.compile(_dot_kernel, F16, F16, F16, 64, 64, 64, 64, 64, 64, BM=64, BN=64,
                   arch="sm_90")
    with pytest.raises(ir.IRError, match="unexpected BLOCK"):
        ir.compile(_dot_kernel, F16, F16, F16, 64, 64, 64, 64, 64, 64, BM=64, BN=64, BK=32,
                   BLOCK=3, arch="sm_90")
    with pytest.raises(ir.IRError, match="takes 12 arguments"):
        ir.compile(_dot_kernel, *([F16] * 13), arch="sm_90")
    with pytest.raises(ir.IRError, match="do not broadcast"):
        ir.compile(tkit.add, ((3, 4), torch.float16), ((5, 4), torch.float16), arch="sm_90")
    with pytest.raises(ir.IRError, match="unknown stage 'ptxx'.*'ptx'"):
        ir.show("add", stage="ptxx", arch="sm_90")


# ---- the CLI --------------------------------------------------------------------------------
def test_cli_summary_and_errors(capsys):
    assert cli_main(["add", "--arch", "sm_90", "--summary"]) == 0
    out = capsys.readouterr().out
    assert "_ew_flat_kernel for sm_90a" in out and "ld.global 128-bit" in out
    assert cli_main(["silu", "--arch", "sm_90", "--stage", "ptx", "--shape", "1000x8:fp32"]) == 0
    assert ".target sm_90a" in capsys.readouterr().out
    assert cli_main(["add", "--arch", "sm_90", "--line", "tl.store"]) == 0
    out = capsys.readouterr().out
    assert "tl.store(out_ptr" in out and re.search(r"st\.global[\w.:]*\.v4\.b32", out)
    assert cli_main(["addd", "--arch", "sm_90"]) == 2
    assert "did you mean add" in capsys.readouterr().err
    assert cli_main(["add", "--arch", "sm_70"]) == 2
    assert "sm_70" in capsys.readouterr().err
