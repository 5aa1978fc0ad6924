"""Edits of a cubin's scheduling hints that nvcc cannot be asked for.

Each sm_90 instruction is 128 bits; ptxas writes its scheduling hints into the top 23 bits
(bits 41-63 of the upper 64-bit word, the second hex word ``cuobjdump -sass`` prints): stall
cycles (41-44), the yield hint (45), the write and read scoreboards (46-51), the wait mask
(52-57) and one operand-reuse flag per source slot (58-61). ptxas sets the yield bit where a
source operand is also kept in the reuse cache (a warp switch would drop the cache), so a run
of FFMAs sharing one scale register alternates between instructions after which the scheduler
may switch warps and ones after which it must not.

:func:`yield_ffma` clears the reuse flags and the yield bit of the FFMAs of the first part of
every long FFMA run (the promotion of a block-scaled GEMM), so the scheduler may switch warps
after each of them and issue the other warpgroups' MMAs and loads sooner. DeepGEMM's Hopper
kernels shipped this edit. The edit changes no result: reuse flags and the yield bit are
hints; an operand not taken from the reuse cache is read from the register file.

Instructions are located through the cubin's ELF section of each function (``.text.<name>``)
and the addresses ``cuobjdump -sass`` prints, and every located instruction is checked
against the two words the disassembly shows before anything is written.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

YIELD_BIT = 1 << 45
REUSE_FLAGS = 0xF << 58


@dataclass(frozen=True)
class Instr:
    addr: int  # byte offset in the function's .text section
    text: str  # the disassembly, without the trailing ';'
    lo: int
    hi: int

    @property
    def opcode(self) -> str:
        words = self.text.split()
        return words[1] if words and words[0].startswith("@") else (words[0] if words else "")


_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\*\s*(0x[0-9a-f]{16})\s*\*/\s*$")
_WORD = re.compile(r"^\s*/\*\s*(0x[0-9a-f]{16})\s*\*/\s*$")


def parse_sass(sass: str) -> dict[str, list[Instr]]:
    """{function name: its instructions} from ``cuobjdump -sass`` text."""
    out: dict[str, list[Instr]] = {}
    current: list[Instr] | None = None
    lines = sass.splitlines()
    for i, line in enumerate(lines):
        m = re.search(r"Function : (\S+)", line)
        if m:
            current = out.setdefault(m.group(1), [])
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            nxt = _WORD.match(lines[i + 1]) if i + 1 < len(lines) else None
            if nxt is None:
                raise ValueError(f"no upper word after the instruction at {m.group(1)}")
            current.append(Instr(int(m.group(1), 16), m.group(2), int(m.group(3), 16),
                                 int(nxt.group(1), 16)))
    return out


def ffma_runs(instrs: list[Instr], min_len: int = 16) -> list[list[Instr]]:
    """Runs of at least ``min_len`` consecutive unpredicated FFMAs."""
    runs, cur = [], []
    for ins in instrs + [Instr(-1, "END", 0, 0)]:
        if ins.opcode == "FFMA" and not ins.text.startswith("@"):
            cur.append(ins)
            continue
        if len(cur) >= min_len:
            runs.append(cur)
        cur = []
    return runs


def text_sections(cubin: bytes) -> dict[str, int]:
    """{function name: file offset of its ``.text.<name>`` section} of an ELF64 cubin."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not an ELF64 cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)

    def header(i):
        name, _type, _flags, _addr, offset, size = struct.unpack_from(
            "<IIQQQQ", cubin, shoff + i * shentsize)
        return name, offset, size

    _, str_off, _ = header(shstrndx)
    out = {}
    for i in range(shnum):
        name_off, offset, _size = header(i)
        end = cubin.index(b"\0", str_off + name_off)
        name = cubin[str_off + name_off:end].decode()
        if name.startswith(".text."):
            out[name[len(".text."):]] = offset
    return out


def yield_ffma(cubin: bytes, sass: str, fraction: float) -> tuple[bytes, int]:
    """``cubin`` with the reuse flags and yield bit cleared on the FFMAs of the first
    ``fraction`` of every run of 16 or more (module docstring) that have both set; ``sass`` is
    ``cuobjdump -sass`` of the same cubin. Returns (new cubin, instructions changed)."""
    return _edit_ffma(cubin, sass, fraction, hold=False)


def hold_ffma(cubin: bytes, sass: str, fraction: float) -> tuple[bytes, int]:
    """The opposite edit: the yield bit set on every FFMA of the first ``fraction`` of each
    long run (reuse flags kept), as ptxas marks the ones whose reuse cache must survive, so the
    warp that started a promotion keeps issuing it. Returns (new cubin, instructions
    changed)."""
    return _edit_ffma(cubin, sass, fraction, hold=True)


def _edit_ffma(cubin: bytes, sass: str, fraction: float, hold: bool) -> tuple[bytes, int]:
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    sections = text_sections(cubin)
    out = bytearray(cubin)
    changed = 0
    for name, instrs in parse_sass(sass).items():
        if name not in sections:
            raise ValueError(f"no .text section for {name} in the cubin")
        base = sections[name]
        for run in ffma_runs(instrs):
            for ins in run[:round(len(run) * fraction)]:
                at = base + ins.addr
                lo, hi = struct.unpack_from("<QQ", out, at)
                if (lo, hi) != (ins.lo, ins.hi):
                    raise ValueError(f"{name}+{ins.addr:#x}: the cubin holds "
                                     f"{lo:#018x} {hi:#018x}, the disassembly says "
                                     f"{ins.lo:#018x} {ins.hi:#018x}")
                if hold and not hi & YIELD_BIT:
                    struct.pack_into("<Q", out, at + 8, hi | YIELD_BIT)
                    changed += 1
                elif not hold and hi & REUSE_FLAGS and hi & YIELD_BIT:
                    struct.pack_into("<Q", out, at + 8, hi & ~(REUSE_FLAGS | YIELD_BIT))
                    changed += 1
    return bytes(out), changed


#: the L2 prefetch size field of LDGSTS (cp.async): bits 7-8 of the upper word
L2_PREFETCH = {0: 0, 64: 0x80, 128: 0x100, 256: 0x180}
_L2_FIELD = 0x180


def l2_prefetch(cubin: bytes, sass: str, size: int, *, wide_only: bool = True
                ) -> tuple[bytes, int]:
    """``cubin`` with the L2 prefetch size of its cp.async copies (LDGSTS) set to ``size``
    bytes (``cp.async...L2::128B`` / ``L2::256B`` in PTX: on a miss the L2 fetches that much
    around the address instead of the 32-byte sectors asked for); ``wide_only``: only the
    16-byte copies. Returns (new cubin, instructions changed)."""
    if size not in L2_PREFETCH:
        raise ValueError(f"size must be one of {sorted(L2_PREFETCH)}, got {size}")
    sections = text_sections(cubin)
    out = bytearray(cubin)
    changed = 0
    for name, instrs in parse_sass(sass).items():
        base = sections[name]
        for ins in instrs:
            if not ins.opcode.startswith("LDGSTS") or (wide_only and
                                                       not ins.opcode.endswith(".128")):
                continue
            at = base + ins.addr
            lo, hi = struct.unpack_from("<QQ", out, at)
            if (lo, hi) != (ins.lo, ins.hi):
                raise ValueError(f"{name}+{ins.addr:#x}: the cubin and its disassembly differ")
            new = (hi & ~_L2_FIELD) | L2_PREFETCH[size]
            if new != hi:
                struct.pack_into("<Q", out, at + 8, new)
                changed += 1
    return bytes(out), changed
