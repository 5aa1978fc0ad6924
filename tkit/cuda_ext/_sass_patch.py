"""Edits of a compiled cubin's instruction control bits (sm_90), after ptxas.

Every Volta-and-later SASS instruction is 128 bits; the top 23 bits are scheduling control
that ptxas sets and the hardware only reads as hints or waits: stall cycles (bits 105-108),
the yield hint (109), the write and read scoreboards (110-115), the wait mask (116-121) and
four operand-reuse flags (122-125). ``cuobjdump -sass`` prints each instruction as two
64-bit words, the low word on the instruction's line and the high word (control bits in its
bits 41-61) on the next.

:func:`ffma_yield` rewrites one thing: in long runs of FFMA (the block-scaled GEMM's
promotion of a group's sum into the float32 accumulator, 64 in a row a warp), ptxas keeps
about every other FFMA from yielding so its reused operand (the scale, read by the next FFMA
too) can stay in the operand-reuse cache. Clearing the reuse flag and the bit that holds
the warp makes every FFMA of the run a point where the scheduler may switch to another warp
of the sub-partition, such as the other consumer warpgroup's warp with its wgmmas to issue.
The reuse cache is a bandwidth hint only: without it the next instruction reads the
register file (a bank conflict may cost a cycle), so the results are the same bits; the
stall counts, scoreboards and waits are untouched. Whether it pays is measured
(``benchmarks/config_sweep.py matmul_fp8_block_cuda``, docs/NOTES.md).
"""

from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path

#: high-word bits: the operand-reuse flags (instruction bits 122-125) and the bit that, set,
#: keeps the warp issuing (109); ptxas sets the latter wherever a reuse flag is set
REUSE_BITS = 0xF << 58
HOLD_BIT = 1 << 45
#: runs shorter than this are left alone (address arithmetic, not a promotion)
MIN_RUN = 16

_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*/\*\s*(0x[0-9a-f]{16})\s*\*/\s*$")
_HIGH = re.compile(r"^\s*/\*\s*(0x[0-9a-f]{16})\s*\*/\s*$")


def instructions(sass_text: str) -> list[list[tuple[int, str, int, int]]]:
    """Per function of a ``cuobjdump -sass`` listing: (address, text, low word, high word)
    of each instruction, in order."""
    funcs: list[list[tuple[int, str, int, int]]] = []
    lines = sass_text.splitlines()
    for i, line in enumerate(lines):
        if "Function :" in line:
            funcs.append([])
            continue
        m = _INSN.match(line)
        if m is None or not funcs or i + 1 >= len(lines):
            continue
        h = _HIGH.match(lines[i + 1])
        if h is None:
            continue
        funcs[-1].append((int(m.group(1), 16), m.group(2), int(m.group(3), 16),
                          int(h.group(1), 16)))
    return funcs


def _ffma_runs(insns):
    run: list = []
    for x in insns + [(0, "END", 0, 0)]:
        if x[1].split(" ")[0].startswith("FFMA"):
            run.append(x)
            continue
        if len(run) >= MIN_RUN:
            yield run
        run = []


def _bytes(low: int, high: int) -> bytes:
    return low.to_bytes(8, "little") + high.to_bytes(8, "little")


def ffma_yield(cubin: str | Path, out: str | Path, sass_text: str,
               fraction: float = 1.0) -> dict:
    """Write ``cubin`` to ``out`` with the reuse flags and the hold bit cleared on the
    FFMAs of every run of >= :data:`MIN_RUN` FFMAs (the first ``fraction`` of each run);
    ``sass_text`` is ``cuobjdump -sass`` of ``cubin``. Each run's bytes must occur exactly
    once in the file (else ValueError: nothing is written). Returns counts: runs, FFMAs
    seen, FFMAs changed."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    data = bytearray(Path(cubin).read_bytes())
    runs = seen = changed = 0
    for insns in instructions(sass_text):
        for run in _ffma_runs(insns):
            old = b"".join(_bytes(lo, hi) for _, _, lo, hi in run)
            at = data.find(old)
            if at < 0 or data.find(old, at + 1) >= 0:
                raise ValueError(f"the FFMA run at {run[0][0]:#x} occurs "
                                 f"{'no' if at < 0 else 'more than one'} time(s) in {cubin}")
            runs += 1
            seen += len(run)
            limit = int(len(run) * fraction)
            new = []
            for k, (_, _, lo, hi) in enumerate(run):
                if k < limit and hi & (REUSE_BITS | HOLD_BIT):
                    hi &= ~(REUSE_BITS | HOLD_BIT)
                    changed += 1
                new.append(_bytes(lo, hi))
            data[at:at + len(old)] = b"".join(new)
    Path(out).write_bytes(bytes(data))
    return dict(runs=runs, ffma=seen, changed=changed)


#: the cubin patches :func:`tkit.cuda_ext._loader.compile_cubin` can apply, by name
PATCHES = {"ffma_yield": lambda cubin, out, sass_text: ffma_yield(cubin, out, sass_text),
           "ffma_yield_half": lambda cubin, out, sass_text: ffma_yield(cubin, out, sass_text,
                                                                      fraction=0.5)}


@functools.cache
def editor_hash() -> str:
    """A hash of this module's source: cubins and self-tests of patched builds key on it."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:8]
