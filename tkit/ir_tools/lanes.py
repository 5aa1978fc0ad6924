"""Do the lanes of a warp end a butterfly reduction holding bitwise-equal copies? Read from PTX.

A reduction across the lanes of a warp (``tl.sum`` over a dimension that lanes share) is a
butterfly: each step ``x = op(x, shfl.bfly(x, k))``. Lane i computes ``op(x_i, x_j)`` and its
partner ``op(x_j, x_i)``; for a commutative ``op`` (add, min, max) both are the same bits, and
after the last step every lane holds one value. Anything else in a step breaks that:

* a multiply contracted into the step, ``fma(a_i, a_i, shfl(a_j * a_j))``: lane i rounds
  ``a_i^2`` inside the fma and lane j rounds it before the shuffle, so the copies differ in the
  last bit;
* a non-commutative combine (Chan's update, a subtraction).

Copies that differ are harmless while each lane only uses its own, but a layout conversion
that stores the reduced tensor through shared memory has every lane of a row write the same
word: racecheck reports a WAW hazard with different values, and which copy is read back is a
race.

:func:`butterfly_asymmetries` lists the steps of a PTX text that are not of the symmetric form.
It follows registers by name (the PTX that Triton emits defines each virtual register once) and
looks at arithmetic only: shuffles whose result is merely selected or moved (layout
conversions) are not reductions.
"""

from __future__ import annotations

import re

__all__ = ["butterfly_asymmetries"]

_INSTR = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.]*)\s+(.*?);")
_REG = re.compile(r"%[a-z]+\d+")
#: operations that leave the same bits whichever operand comes first
_SYMMETRIC = ("add", "min", "max", "and", "or", "xor")
#: data movement: a shuffle feeding these is a layout conversion, not a reduction step
_MOVES = ("mov", "selp", "st", "cvt", "prmt", "shfl", "setp", "bar", "ret", "bra")


def _instructions(ptx: str):
    for line in ptx.splitlines():
        line = line.split("//", 1)[0]
        m = _INSTR.match(line)
        if not m:
            continue
        op, rest = m.group(1), m.group(2)
        regs = _REG.findall(rest)
        yield op, regs, line.strip()


def _contractible_mul(op: str) -> bool:
    """A float multiply without a rounding mode: ptxas may fuse it into the add it feeds."""
    parts = op.split(".")
    return parts[0] == "mul" and parts[-1] in ("f32", "f64", "f16", "bf16") \
        and not any(p in ("rn", "rz", "rm", "rp") for p in parts[1:])


def butterfly_asymmetries(ptx: str) -> list[str]:
    """The instructions that consume a ``shfl.sync.bfly`` result in a way that can leave the
    two partner lanes with different bits (empty: every butterfly step is ``op(x, shfl(x))``
    with a commutative ``op`` whose ``x`` cannot be fused into it)."""
    instrs = list(_instructions(ptx))
    defs = {regs[0]: (op, text) for op, regs, text in instrs if regs}
    shuffles = {regs[0]: regs[1] for op, regs, _ in instrs
                if op.startswith("shfl.sync.bfly") and len(regs) >= 2}
    found = []
    for op, regs, text in instrs:
        if not regs or op.split(".")[0] in _MOVES:
            continue
        srcs = regs[1:]
        for dst in [r for r in srcs if r in shuffles]:
            src = shuffles[dst]
            base = op.split(".")[0]
            if base not in _SYMMETRIC or sorted(srcs) != sorted([src, dst]):
                found.append(f"{text}  (consumes the shuffle of {src}: not op({src}, {dst}) "
                             f"with a commutative op)")
            elif src in defs and _contractible_mul(defs[src][0]):
                found.append(f"{text}  ({src} is `{defs[src][1]}`, a multiply the assembler "
                             f"may contract into this step)")
    return found
