"""Layout decoding on TTGIR text as Triton 3.6 prints it (no compile needed)."""

from tkit.ir_tools.layouts import parse_layout, parse_layouts
from tkit.ir_tools.summary import (
    counted_shared,
    occupancy,
    pipelining,
    ptx_histogram,
    sass_histogram,
)

TTGIR = """\
#blocked = #ttg.blocked<{sizePerThread = [1, 8], threadsPerWarp = [4, 8], warpsPerCTA = [8, 1], order = [1, 0]}>
#mma = #ttg.nvidia_mma<{versionMajor = 2, versionMinor = 0, warpsPerCTA = [2, 4], instrShape = [16, 8]}>
#shared = #ttg.swizzled_shared<{vec = 8, perPhase = 1, maxPhase = 8, order = [1, 0]}>
#shared1 = #ttg.nvmma_shared<{swizzlingByteWidth = 128, transposed = false, elementBitWidth = 16}>
#smem = #ttg.shared_memory
module attributes {"ttg.num-warps" = 8 : i32} {
  tt.func public @k() {
    %x = ttg.local_alloc : () -> !ttg.memdesc<3x128x64xbf16, #shared, #smem, mutable>
    %a = tt.load %p : tensor<128x64x!tt.ptr<bf16>, #blocked>
    %r = tt.make_range {end = 128 : i32, start = 0 : i32} : tensor<128xi32, #ttg.slice<{dim = 1, parent = #blocked}>>
    %d = ttg.local_load %x : !ttg.memdesc<128x64xbf16, #shared, #smem> -> tensor<128x64xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 8}>>
    %w = ttg.async_wait %x {num = 2 : i32}
    %q = ttng.warp_group_dot_wait %acc {pendings = 1 : i32} : tensor<128x128xf32, #mma>
  }
}
"""  # noqa: E501  (TTGIR lines as Triton prints them)


def test_blocked_in_words():
    lay = {x.name: x for x in parse_layouts(TTGIR)}["#blocked"]
    assert lay.params == {"sizePerThread": [1, 8], "threadsPerWarp": [4, 8],
                          "warpsPerCTA": [8, 1], "order": [1, 0]}
    w = lay.words
    assert "8 contiguous along dim 1" in w
    assert "128-bit (16-byte) vectors for bf16" in w  # 8 x 16 bit
    assert "covering 4x64" in w and "8 warps stacked along dim 0" in w and "order [1, 0]" in w


def test_mma_shared_slice_dot_operand():
    lays = {x.name: x for x in parse_layouts(TTGIR)}
    assert "mma.sync" in lays["#mma"].words and "16x8" in lays["#mma"].words
    assert "XOR swizzle" in lays["#shared"].words and "3x128x64xbf16" in lays["#shared"].uses
    assert "128-byte swizzle" in lays["#shared1"].words
    sl = lays["#ttg.slice<{dim = 1, parent = #blocked}>"]
    assert sl.kind == "slice" and "dim 1 removed" in sl.words
    dop = lays["#ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 8}>"]
    assert "operand A" in dop.words and "8 consecutive K" in dop.words


def test_wgmma_and_nested_params():
    lay = parse_layout("#ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, "
                       "warpsPerCTA = [4, 1], instrShape = [16, 256, 16]}>")
    assert lay.params["instrShape"] == [16, 256, 16]
    from tkit.ir_tools.layouts import describe
    assert "m64n256k16" in describe(lay) and "1 warpgroup" in describe(lay)
    lin = parse_layout("#ttg.linear<{register = [[0, 1], [0, 2]], lane = [[1, 0]], warp = [], "
                       "block = []}>")
    assert lin.params["register"] == [[0, 1], [0, 2]]


def test_pipelining_evidence():
    p = pipelining(TTGIR, "cp.async.wait_group 2;\nwgmma.wait_group.sync.aligned 1;", 3)
    assert p["buffers"] == [3] and p["async_wait_num"] == [2] and p["wgmma_pendings"] == [1]
    assert p["ptx_wgmma_wait_group"] == [1] and p["pipelined"]


def test_histograms():
    ptx = ("\tld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];\n"
           "\t@%p1 ld.global.b16 %rs1, [%rd2];\n"
           "\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {...};\n"
           "\tcp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [..];\n")
    h = ptx_histogram(ptx)
    assert h["ld.global 128-bit"] == 1 and h["ld.global 16-bit"] == 1
    assert h["mma.sync m16n8k16"] == 1 and h["TMA load (cp.async.bulk.tensor)"] == 1
    sass = ("        /*0100*/                   LDG.E.128 R4, desc[UR4][R2.64] ;\n"
            "        /*0110*/               @P0 LDG.E.U16 R6, desc[UR4][R8.64] ;\n"
            "        /*0120*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ ;\n")
    s = sass_histogram(sass)
    assert s == {"HGMMA.64x128x16": 1, "LDG.128": 1, "LDG.U16": 1, "(all instructions)": 3}


def test_occupancy_limits():
    # 4 warps, 32 regs, no smem: the 2048-thread limit allows 16 blocks on sm_90
    o = occupancy(90, 4, 32, 0)
    assert o["blocks_per_sm"] == 16 and o["occupancy"] == 1.0
    # 8 warps x 255 regs (256 x 32 = 8192 regs a warp): 8 warps an SM, 1 block
    assert occupancy(90, 8, 255, 0)["blocks_per_sm"] == 1
    # 100 KB of shared memory: 2 blocks on sm_90 (228 KB), 1 on sm_80 (164 KB)
    assert occupancy(90, 4, 32, 100 * 1024)["blocks_per_sm"] == 2
    assert occupancy(80, 4, 32, 100 * 1024)["limited_by"] == "shared memory"
    assert not occupancy(80, 4, 32, 200 * 1024)["fits_shared"]
    # sm_90 cubins carry the driver's 1 KB reservation as static shared memory: counted once
    # (the H200's driver: four 2-warp programs of 56848 dynamic bytes an SM)
    assert occupancy(90, 2, 216, counted_shared(90, 56848, 1024))["blocks_per_sm"] == 4
    assert counted_shared(80, 4096, 512) == 4608
