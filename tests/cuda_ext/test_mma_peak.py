"""The mma.sync peak microbenchmark (csrc/mma_peak.cu, tkit.cuda_ext.mma_peak).

On CPU (nvcc, no GPU): every kernel compiles for sm_80 and sm_90a, and its SASS is a pure
tensor-core loop: exactly one loop (one backward branch), ILP * UNROLL HMMA.16816 of the right
flavour inside it and none outside, every HMMA accumulating in place (a dependency chain per
accumulator set) into ILP distinct accumulators, no memory instruction in the loop, no load
from memory anywhere and no local memory, and the two stores after the loop (the per-thread sum,
warp 0's cycle count). The host emulation's operand bits are checked against the kernel's own
hash (the source's __host__ __device__ functions, run by a host program), and argument
validation names the argument.

On the GPU: one small configuration per dtype, its output equal to the float64 emulation
(bit for bit where that is exact), and a calibrated run that is finite and positive.
"""

import math
import re
import subprocess

import numpy as np
import pytest
import torch

from tkit.cuda_ext import _loader
from tkit.cuda_ext import mma_peak as mp

ON_GPU = torch.cuda.is_available()
ARCHS = ["80", "90a"]
HMMA_FLAVOUR = {"bf16": "HMMA.16816.F32.BF16", "f16": "HMMA.16816.F32",
                "f16_f16acc": "HMMA.16816.F16"}

_why_no_sass = ("nvcc not on the PATH: compile-only checks need it" if _loader.nvcc_path() is None
                else "cuobjdump not found (CUDA install or the Triton wheel)"
                if _loader.cuda_binutil("cuobjdump") is None else None)
needs_sass = pytest.mark.skipif(_why_no_sass is not None, reason=_why_no_sass or "")


# ---- configuration and validation (no compiler, no GPU) ---------------------------------------
def test_source_matches_python_constants():
    src = _loader.read_source(mp.SOURCE)
    assert re.search(rf"#define MMA_UNROLL {mp.UNROLL}\n", src), "UNROLL differs from the source"
    for dtype, (prefix, instr, _m, _f32) in mp.DTYPES.items():
        assert instr in src, f"{dtype}: {instr} not in the source"
        assert f"void {prefix}_ilp##ILP(" in src, f"{dtype}: no kernel {prefix}_ilpN"
    for ilp in mp.ILPS:
        assert f"MMA_PEAK_KERNELS({ilp})" in src


@pytest.mark.parametrize("kw, match", [
    (dict(dtype="fp8"), r"^dtype must be one of 'bf16', 'f16', 'f16_f16acc', got 'fp8'"),
    (dict(ilp=3), r"^ilp must be one of 1, 2, 4, 8, got 3"),
    (dict(ilp=True), r"^ilp must be one of"),
    (dict(warps_per_block=0), r"^warps_per_block must be an int in \[1, 32\], got 0"),
    (dict(warps_per_block=8.0), r"^warps_per_block must be an int"),
    (dict(blocks_per_sm=33), r"^blocks_per_sm must be an int in \[1, 32\], got 33"),
    (dict(iters=12), r"^iters must be a multiple of 8"),
    (dict(iters=0), r"^iters must be an int in \[8, "),
    (dict(data="zeros"), r"^data must be one of 'random', 'exact'"),
    (dict(reps=0), r"^reps must be an int in \[1, "),
    (dict(warmup=-1), r"^warmup must be an int in \[0, "),
    (dict(target_ms=0), r"^target_ms must be a number"),
    (dict(backend="clang"), r"^backend must be 'nvrtc' or 'nvcc'"),
])
def test_validation_names_the_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        mp.mma_sync_peak(**kw)


def test_sweep_validates_before_launching():
    with pytest.raises(ValueError, match=r"^ilp must be one of"):
        mp.sweep(ilps=(1, 3))
    with pytest.raises(ValueError, match=r"^warps must be a non-empty sequence"):
        mp.sweep(warps=())


@pytest.mark.skipif(ON_GPU, reason="checks the no-GPU error")
def test_needs_a_gpu():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        mp.mma_sync_peak()


@pytest.mark.parametrize("dtype", list(mp.DTYPES))
def test_operand_values(dtype):
    """Magnitudes in [0.25, 0.5), both signs; exact data in steps of 1/16, random data uses
    every mantissa bit."""
    v = mp.fragment_values(dtype, 8, 2048, data="exact")
    assert ((np.abs(v) >= 0.25) & (np.abs(v) < 0.5)).all()
    assert (v * 16 == np.round(v * 16)).all() and len(np.unique(np.abs(v))) == 4
    assert (v < 0).any() and (v > 0).any()
    v = mp.fragment_values(dtype, 8, 2048, data="random")
    assert ((np.abs(v) >= 0.25) & (np.abs(v) < 0.5)).all()
    assert len(np.unique(np.abs(v))) == 2 ** mp.DTYPES[dtype][2]


def test_reference_is_exact_in_fp32():
    """The premise of the bit-for-bit GPU check: with exact data and iters <= 256 every value
    the kernel forms is a multiple of 2^-8 below 2^16, so fp32 holds it exactly."""
    for ilp in mp.ILPS:
        r = mp.reference_output("bf16", ilp, 4096, 256, data="exact")
        assert (r * 256 == np.round(r * 256)).all() and np.abs(r).max() < 2**16
        assert (r.astype(np.float32).astype(np.float64) == r).all()
    # linear in iters, offset 2 * sum(s) per thread
    r0 = mp.reference_output("f16", 4, 64, 0)
    assert (r0 == 4 * 0.5 * sum(range(4))).all()
    r1, r2 = (mp.reference_output("f16", 4, 64, n) for n in (8, 16))
    np.testing.assert_allclose(r2 - r0, 2 * (r1 - r0))


# ---- the host program: the kernel's own hash against the numpy emulation -------------------
@pytest.mark.skipif(_loader.nvcc_path() is None, reason="nvcc not on the PATH")
def test_fragment_bits_match_the_kernel(tmp_path):
    """elem_bits / frag_reg of the .cu (they are __host__ __device__), run on the host, give the
    bits fragment_values emulates, for both input formats and both data modes."""
    src = _loader.source_path(mp.SOURCE)
    threads, ilp, seed = [0, 1, 31, 32, 1000, 270335], 8, 0x5EED
    prog = tmp_path / "bits.cu"
    loops = []
    for fmt, is_bf16, full in (("bf16", "true", 7), ("f16", "false", 10)):
        frag = f"frag_reg<{is_bf16}>({seed}u, t"
        loops.append(
            f"  for (unsigned t : tids) for (int mb : {{2, {full}}})\n"
            f"    for (int r = 0; r < {4 + 2 * ilp}; ++r)\n"
            f'      printf("{fmt} %u %d %d %u\\n", t, mb, r, r < 4 ? {frag}, 0, r, mb)\n'
            f"             : {frag}, 8 + 4 * ((r - 4) / 2), (r - 4) % 2, mb));\n")
    prog.write_text(f'#include "{src}"\n#include <cstdio>\nint main() {{\n'
                    f"  const unsigned tids[] = {{{', '.join(map(str, threads))}}};\n"
                    + "".join(loops) + "  return 0;\n}\n")
    exe = tmp_path / "bits"
    proc = subprocess.run([_loader.nvcc_path(), "-arch=sm_80", "-o", str(exe), str(prog)],
                          capture_output=True, text=True)
    if proc.returncode != 0 and "cannot find" in proc.stderr + proc.stdout:
        pytest.skip(f"no host toolchain for nvcc: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    n = 0
    for line in out.splitlines():
        fmt, t, mb, r, bits = line.split()
        t, mb, r, bits = int(t), int(mb), int(r), int(bits)
        dtype = "bf16" if fmt == "bf16" else "f16"
        data = "exact" if mb == mp.EXACT_MANT_BITS else "random"
        assert mb == mp.mant_bits(dtype, data)
        v = mp.fragment_values(dtype, ilp, t + 1, seed=seed, data=data)[t]
        lo, hi = v[2 * r], v[2 * r + 1]  # register r holds slots 2r, 2r + 1 (A, then B sets)
        for half, want in ((bits & 0xFFFF, lo), (bits >> 16, hi)):
            if dtype == "bf16":
                got = np.array([half << 16], dtype=np.uint32).view(np.float32)[0]
            else:
                got = np.array([half], dtype=np.uint16).view(np.float16)[0]
            assert float(got) == want, (line, float(got), want)
        n += 1
    assert n == len(threads) * 2 * 2 * (4 + 2 * ilp)


# ---- compile-only: SASS --------------------------------------------------------------------
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_MEMORY = re.compile(r"^(LD|ST|ATOM|RED|TLD|TEX|SULD|SUST|CCTL)")


def sass_instructions(sass: str) -> list[tuple[int, str, str]]:
    """[(address, opcode with modifiers, operands)] of one function's SASS."""
    return [(int(m.group(1), 16), m.group(3), m.group(4).strip())
            for m in _LINE.finditer(sass)]


def the_loop(ins):
    """Instructions of the only loop: from the target of the only backward branch to it."""
    back = [(a, ops) for a, op, ops in ins if op == "BRA" and (m := re.match(
        r"0x([0-9a-f]+)", ops)) and int(m.group(1), 16) < a]
    assert len(back) == 1, f"expected one loop (one backward branch), got {back}"
    end, ops = back[0]
    start = int(re.match(r"0x([0-9a-f]+)", ops).group(1), 16)
    return [i for i in ins if start <= i[0] <= end]


@pytest.fixture(scope="module")
def peak_sass(tmp_path_factory):
    d = tmp_path_factory.mktemp("mma_peak_cubins")
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = _loader.sass_by_function(_loader.compile_cubin(mp.SOURCE, arch,
                                                                         cache_dir=d))
        return cache[arch]

    return get


@pytest.mark.toolchain("arch")  # one build an arch: its tests go together
@needs_sass
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", list(mp.DTYPES))
@pytest.mark.parametrize("ilp", mp.ILPS)
def test_sass_is_a_pure_mma_loop(peak_sass, arch, dtype, ilp):
    name = mp.kernel_name(dtype, ilp)
    funcs = peak_sass(arch)
    assert name in funcs, f"no {name} in the sm_{arch} cubin (have {sorted(funcs)})"
    ins = sass_instructions(funcs[name])
    loop = the_loop(ins)
    hmma = [(op, ops) for _a, op, ops in loop if op.startswith("HMMA")]
    # the whole loop body is ILP * UNROLL mma of this instruction's flavour, nothing peeled out
    assert len(hmma) == ilp * mp.UNROLL, f"{name} sm_{arch}: {len(hmma)} HMMA in the loop"
    assert {op for op, _ in hmma} == {HMMA_FLAVOUR[dtype]}, {op for op, _ in hmma}
    assert sum(op.startswith("HMMA") for _a, op, _o in ins) == len(hmma), "HMMA outside the loop"
    # each HMMA accumulates in place (D == C): UNROLL-long chains on ILP distinct accumulators
    dests = []
    for _op, ops in hmma:
        regs = [r.strip().removesuffix(".reuse") for r in ops.split(",")]
        assert regs[0] == regs[3], f"{name}: HMMA not in place: {ops}"
        dests.append(regs[0])
    assert len(set(dests)) == ilp, f"{name}: accumulators {sorted(set(dests))}"
    for s in range(ilp):  # round-robin: set s is every ILP-th mma
        assert len(set(dests[s::ilp])) == 1, f"{name}: sets interleaved out of order {dests}"
    # no memory traffic in the loop (not even constant-bank LDC); outside it, nothing read but
    # kernel parameters (LDC) and nothing written but the two STG
    in_loop = sorted({op for _a, op, _o in loop if _MEMORY.match(op)})
    assert not in_loop, f"{name} sm_{arch}: memory instructions in the loop: {in_loop}"
    ops = [op for _a, op, _o in ins]
    loads = sorted({op for op in ops if _MEMORY.match(op) and not op.startswith(("STG", "LDC"))})
    assert not loads, f"{name} sm_{arch}: memory instructions besides STG: {loads}"
    stg = [a for a, op, _o in ins if op.startswith("STG")]
    assert len(stg) == 2 and min(stg) > loop[-1][0], f"{name}: stores at {stg}"


@pytest.mark.toolchain("arch")  # one build an arch: its tests go together
@needs_sass
@pytest.mark.parametrize("arch", ARCHS)
def test_no_spills(arch):
    """Registers (ptxas -v): no spill stores/loads and no stack in any kernel."""
    report = _loader.resource_usage(mp.SOURCE, arch)
    assert re.search(r"Used \d+ registers", report), report[:500]
    assert not re.search(r"[1-9]\d* bytes spill", report), report
    assert not re.search(r"[1-9]\d* bytes stack frame", report), report


# ---- on the GPU -------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(mp.DTYPES))
def test_small_run_matches_the_emulation(dtype):
    f32 = mp.DTYPES[dtype][3]
    iters = 64 if f32 else 8
    r = mp.mma_sync_peak(dtype, ilp=2, warps_per_block=4, blocks_per_sm=1, iters=iters,
                         data="exact", reps=3, warmup=1, check=True)
    assert math.isfinite(r["tflops"]) and r["tflops"] > 0 and r["ms"] > 0
    assert r["mma"] == r["sms"] * 4 * 2 * iters
    if f32:  # exact data, fp32 accumulators: equal bit for bit
        assert r["check_max_abs_err"] == 0, r
    else:  # fp16 accumulators round every step
        assert r["check_rel_err"] < 1e-2, r


@pytest.mark.gpu
def test_calibrated_run():
    r = mp.mma_sync_peak("bf16", ilp=4, warps_per_block=8, blocks_per_sm=1, target_ms=0.5,
                         reps=3, check=True)
    assert r["iters_calibrated"] and r["iters"] % mp.UNROLL == 0
    assert math.isfinite(r["tflops"]) and r["tflops"] > 0
    assert r["check_rel_err"] < 0.05, r  # fp32 drift over many iters, not a missing loop trip
    assert r["cycles"] > 0 and 100 < r["sm_clock_mhz"] < 5000


@pytest.mark.gpu
def test_oversubscribed_config_is_refused():
    with pytest.raises(ValueError, match=r"^blocks_per_sm = 32 does not fit"):
        mp.mma_sync_peak("bf16", ilp=8, warps_per_block=32, blocks_per_sm=32, iters=8)
