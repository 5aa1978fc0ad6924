"""What the compiler decided, read back from its output: layouts, pipelining, resources,
occupancy, instruction histograms, source mapping, and differences between two compiles.

Every fact comes from the compiled artifacts (TTGIR, PTX, SASS, cuobjdump's resource usage and
Triton's metadata), never from the inputs that asked for them.
"""

from __future__ import annotations

import difflib
import os
import re
from collections import Counter
from dataclasses import dataclass, field

from tkit.ir_tools.aot import CompiledIR, strip_locs
from tkit.ir_tools.layouts import parse_layouts

__all__ = ["Summary", "summarize", "occupancy", "ptx_histogram", "sass_histogram",
           "pipelining", "source_map", "Diff", "diff_compiled", "TARGET_LIMITS"]

# Per-SM limits (CUDA occupancy tables): registers, shared memory per SM / per block (bytes),
# resident threads and blocks. 1 KB of shared memory per block is reserved by the system.
TARGET_LIMITS = {
    80: dict(regs=65536, smem=164 * 1024, smem_block=163 * 1024, threads=2048, blocks=32),
    86: dict(regs=65536, smem=100 * 1024, smem_block=99 * 1024, threads=1536, blocks=16),
    87: dict(regs=65536, smem=164 * 1024, smem_block=163 * 1024, threads=2048, blocks=16),
    89: dict(regs=65536, smem=100 * 1024, smem_block=99 * 1024, threads=1536, blocks=24),
    90: dict(regs=65536, smem=228 * 1024, smem_block=227 * 1024, threads=2048, blocks=32),
    100: dict(regs=65536, smem=228 * 1024, smem_block=227 * 1024, threads=2048, blocks=32),
    103: dict(regs=65536, smem=228 * 1024, smem_block=227 * 1024, threads=2048, blocks=32),
    120: dict(regs=65536, smem=100 * 1024, smem_block=99 * 1024, threads=1536, blocks=32),
}
_RESERVED_SMEM = 1024
_REG_UNIT = 256  # registers are allocated per warp in units of 256


def counted_shared(cap: int, dynamic: int, static: int) -> int:
    """A program's shared memory for :func:`occupancy` (which adds the driver's 1 KB
    reservation): on sm_90 the cubin carries that reservation as 1 KB of static shared
    memory (cuobjdump reports SHARED:1024 for a kernel that declares none; on sm_80, 0), so
    it is counted once: the H200's driver fits four programs of 56848 dynamic bytes an SM,
    which the reservation counted twice would make three."""
    if cap == 90:
        static -= min(static, _RESERVED_SMEM)
    return dynamic + static


def occupancy(cap: int, num_warps: int, n_regs: int, shared: int) -> dict:
    """Resident blocks and warps per SM allowed by threads, registers and shared memory."""
    lim = TARGET_LIMITS[cap]
    threads = num_warps * 32
    by_threads = lim["threads"] // threads if threads <= 1024 else 0
    regs_per_warp = -(-max(n_regs, 1) * 32 // _REG_UNIT) * _REG_UNIT
    by_regs = (lim["regs"] // regs_per_warp) // num_warps
    smem_block = shared + _RESERVED_SMEM
    fits = shared <= lim["smem_block"]
    by_smem = lim["smem"] // smem_block if fits else 0
    blocks = min(lim["blocks"], by_threads, by_regs, by_smem)
    limits = {"threads": by_threads, "registers": by_regs, "shared memory": by_smem,
              "blocks/SM cap": lim["blocks"]}
    limiter = min(limits, key=lambda k: limits[k])
    max_warps = lim["threads"] // 32
    return dict(blocks_per_sm=blocks, warps_per_sm=blocks * num_warps, max_warps_per_sm=max_warps,
                occupancy=blocks * num_warps / max_warps, limited_by=limiter,
                by_limit=limits, fits_shared=fits, shared_limit_per_block=lim["smem_block"])


# --------------------------------------------------------------------------------------------
# Instruction histograms
# --------------------------------------------------------------------------------------------
_PTX_BITS = {"b8": 8, "u8": 8, "s8": 8, "b16": 16, "u16": 16, "s16": 16, "f16": 16,
             "bf16": 16, "b32": 32, "u32": 32, "s32": 32, "f32": 32, "b64": 64, "u64": 64,
             "s64": 64, "f64": 64, "b128": 128}


def _ptx_width(op: str) -> int | None:
    parts = op.split(".")
    vec = 1
    for p in parts:
        if re.fullmatch(r"v\d", p):
            vec = int(p[1:])
    bits = [_PTX_BITS[p] for p in parts if p in _PTX_BITS]
    return vec * bits[-1] if bits else None


def _ptx_category(op: str) -> str | None:
    if op.startswith(("ld.global", "st.global", "ld.shared", "st.shared")):
        kind = ".".join(op.split(".")[:2])
        w = _ptx_width(op)
        return f"{kind} {w}-bit" if w else kind
    if op.startswith("mma.sync"):
        shape = next((p for p in op.split(".") if re.fullmatch(r"m\d+n\d+k\d+", p)), "")
        return f"mma.sync {shape}".strip()
    if op.startswith("wgmma.mma_async"):
        shape = next((p for p in op.split(".") if re.fullmatch(r"m\d+n\d+k\d+", p)), "")
        return f"wgmma.mma_async {shape}".strip()
    if op.startswith("wgmma."):
        return ".".join(op.split(".")[:2])
    if op.startswith("ldmatrix"):
        return "ldmatrix" + (".trans" if ".trans" in op else "")
    if op.startswith("stmatrix"):
        return "stmatrix"
    if op.startswith("cp.async.bulk.tensor"):
        return ("TMA load (cp.async.bulk.tensor)" if "shared" in op.split(".global")[0]
                else "TMA store (cp.async.bulk.tensor)")
    if op.startswith(("cp.async.bulk", "cp.reduce.async.bulk")):
        return "cp.async.bulk"
    if op.startswith("cp.async"):
        if "commit_group" in op or "wait_group" in op or "wait_all" in op:
            return ".".join(op.split(".")[:3])
        return "cp.async (global->shared)"
    if op.startswith("mbarrier"):
        return ".".join(op.split(".")[:2])
    if op.startswith("shfl"):
        return "shfl.sync"
    if op.startswith(("bar.sync", "barrier.sync", "bar.arrive", "barrier.arrive")):
        return "bar/barrier"
    if op.startswith("bar.warp"):
        return "bar.warp.sync"
    if op.startswith("fence"):
        return "fence"
    if op.startswith(("atom", "red")):
        return op.split(".")[0]
    return None


def _ptx_ops(ptx: str):
    for line in ptx.splitlines():
        s = line.strip()
        if not s or s.startswith(("//", ".", "{", "}", "$", ")", "(")) or s.endswith(":"):
            continue
        s = re.sub(r"^@!?%?\w+\s+", "", s)
        op = s.split(None, 1)[0].rstrip(";")
        if re.fullmatch(r"[a-z][\w.:]*", op):
            yield op


def ptx_histogram(ptx: str) -> dict[str, int]:
    """Counts of the instructions that say how memory and tensor cores are used (static
    counts in the PTX text, not executions)."""
    c = Counter()
    total = 0
    for op in _ptx_ops(ptx):
        total += 1
        cat = _ptx_category(op)
        if cat:
            c[cat] += 1
    out = dict(sorted(c.items()))
    out["(all instructions)"] = total
    return out


_SASS_RE = re.compile(
    r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)")


def _sass_category(op: str) -> str | None:
    base = op.split(".")[0]
    mods = op.split(".")[1:]
    if base in ("LDG", "STG", "LDS", "STS", "LD", "ST"):
        width = next((m for m in mods if m in ("64", "128", "U8", "S8", "U16", "S16")), "32")
        return f"{base}.{width}"
    if base in ("HMMA", "IMMA", "DMMA"):
        return f"{base}.{mods[0]}" if mods else base
    if base in ("HGMMA", "QGMMA", "IGMMA", "BGMMA"):
        return f"{base}.{mods[0]}" if mods else base
    if base in ("LDL", "STL"):  # local memory: spills and the stack frame
        return base
    if base in ("LDSM", "STSM", "LDGSTS", "UTMALDG", "UTMASTG", "UTMAPF", "UBLKCP", "SYNCS",
                "SHFL", "BAR", "WARPGROUP", "DEPBAR", "LDGDEPBAR", "ARRIVES", "UTCMMA",
                "MEMBAR", "RED", "ATOM", "ATOMG", "REDG", "WARPSYNC"):
        return base
    return None


def sass_histogram(sass: str) -> dict[str, int]:
    return _histogram(m.group(1) for m in _SASS_RE.finditer(sass))


def _histogram(ops) -> dict[str, int]:
    c = Counter()
    total = 0
    for op in ops:
        total += 1
        cat = _sass_category(op)
        if cat:
            c[cat] += 1
    out = dict(sorted(c.items()))
    out["(all instructions)"] = total
    return out


_SASS_AT = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T\d]+\s+)?"
                      r"([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)([^;]*);")
_BRA_TO = re.compile(r"^\s*(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)")


def sass_loops(sass: str) -> list[dict]:
    """Every loop of the SASS, found as a backward branch: its first and last offsets, its
    instruction count and its :func:`sass_histogram`; longest first (an outer loop contains
    its inner ones)."""
    lines = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in _SASS_AT.finditer(sass)]
    loops = []
    for at, op, rest in lines:
        b = _BRA_TO.match(rest) if op.split(".")[0] == "BRA" else None
        if b and int(b.group(1), 16) < at:
            start = int(b.group(1), 16)
            hist = _histogram(o for a, o, _ in lines if start <= a <= at)
            loops.append(dict(start=start, end=at, instructions=hist.pop("(all instructions)"),
                              histogram=hist))
    return sorted(loops, key=lambda d: -d["instructions"])


def loop_conversions(ttgir: str) -> int:
    """The ``ttg.convert_layout`` ops inside ``scf.for`` bodies of the TTGIR: a layout change
    every iteration (through shared memory or shuffles, often with CTA barriers)."""
    stack: list[bool] = []  # the open regions: is each an scf.for body
    n = 0
    for line in ttgir.splitlines():
        s = line.strip()
        if s.startswith("}") and stack:
            stack.pop()
        if "ttg.convert_layout" in s and any(stack):
            n += 1
        if s.endswith("{"):
            stack.append("scf.for" in s)
    return n


# --------------------------------------------------------------------------------------------
# Pipelining
# --------------------------------------------------------------------------------------------
def pipelining(ttgir: str, ptx: str, num_stages: int) -> dict:
    """Evidence that loads were software-pipelined, from TTGIR and PTX."""
    buffers = [int(m) for m in re.findall(
        r"ttg\.local_alloc\s*(?::|\{[^}]*\}\s*:)\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x\d+x\d+x",
        ttgir)]  # multi-buffered operand tiles: (slots) x rows x cols; barriers are 2-D
    async_copies = len(re.findall(r"ttg\.async_copy_global_to_local", ttgir))
    async_waits = sorted({int(n) for n in re.findall(r"ttg\.async_wait[^\n]*\{num = (\d+)",
                                                     ttgir)})
    tma = len(re.findall(r"ttng\.async_tma_copy_global_to_local", ttgir))
    barrier_waits = len(re.findall(r"ttng\.wait_barrier", ttgir))
    wgmma_pend = sorted({int(n) for n in re.findall(
        r"ttng\.warp_group_dot_wait[^\n]*\{pendings = (\d+)", ttgir)})
    ptx_wg = sorted({int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)})
    ptx_cp_wait = sorted({int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)})
    evidence = []
    if buffers:
        evidence.append(f"{len(buffers)} shared-memory buffer(s) with "
                        f"{'/'.join(map(str, sorted(set(buffers))))} slots "
                        "(one per stage in flight)")
    if async_copies:
        evidence.append(f"{async_copies} async copies global->shared (cp.async)")
    if tma:
        evidence.append(f"{tma} TMA loads")
    if barrier_waits:
        evidence.append(f"{barrier_waits} mbarrier waits")
    if async_waits:
        evidence.append(f"async_wait keeps {'/'.join(map(str, async_waits))} copy groups "
                        "in flight")
    if wgmma_pend:
        evidence.append(f"wgmma wait depth {'/'.join(map(str, wgmma_pend))} "
                        "(MMAs left in flight)")
    return dict(num_stages=num_stages, pipelined=bool(buffers and max(buffers) > 1
                                                      or async_copies or tma),
                buffers=buffers, async_copies=async_copies, async_wait_num=async_waits,
                tma_loads=tma, mbarrier_waits=barrier_waits, wgmma_pendings=wgmma_pend,
                ptx_cp_async_wait_group=ptx_cp_wait, ptx_wgmma_wait_group=ptx_wg,
                evidence=evidence)


# --------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------
@dataclass
class Summary:
    name: str
    arch: str
    config: dict
    note: str
    launches: list
    num_warps: int
    num_stages: int
    layouts: list
    pipelining: dict
    resources: dict
    occupancy: dict
    ptx: dict
    sass: dict
    signature: dict = field(default_factory=dict)
    #: the longest SASS loop (:func:`sass_loops`; {} if none) with the TTGIR's layout
    #: conversions inside loops (:func:`loop_conversions`)
    main_loop: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dict(name=self.name, arch=self.arch, config=self.config, note=self.note,
                    launches=self.launches, num_warps=self.num_warps,
                    num_stages=self.num_stages, layouts=self.layouts,
                    pipelining=self.pipelining, resources=self.resources,
                    occupancy=self.occupancy, ptx=self.ptx, sass=self.sass,
                    signature=self.signature, main_loop=self.main_loop)

    def __str__(self) -> str:
        L = [f"{self.name} for {self.arch}"]
        if self.note:
            L.append(f"  ({self.note})")
        if len(self.launches) > 1:
            L.append(f"  the op launches {len(self.launches)} kernels: "
                     f"{', '.join(self.launches)}")
        cfg = ", ".join(f"{k}={v}" for k, v in self.config.items())
        L.append(f"config: {cfg}")
        sig = ", ".join(f"{k}: {v}" for k, v in self.signature.items())
        L.append(f"signature: {sig}")
        L.append("")
        L.append("layouts:")
        for lay in self.layouts:
            L.append(f"  {lay['name']}")
            if lay.get("uses"):
                L.append(f"      used by {', '.join(lay['uses'][:4])}")
            L.append(f"      {lay['words']}")
        p = self.pipelining
        L.append("")
        L.append(f"pipelining: num_warps={self.num_warps}, num_stages={self.num_stages}: "
                 + ("pipelined" if p["pipelined"] else "no software pipelining seen"))
        for e in p["evidence"]:
            L.append(f"  - {e}")
        r, o = self.resources, self.occupancy
        L.append("")
        L.append(f"resources: {r['n_regs']} registers/thread, {r['n_spills']} spilled "
                 f"(local {r['local_bytes']} B), stack {r.get('stack', 0)} B, shared "
                 f"{r['shared']} B")
        L.append(f"occupancy on {self.arch}: {o['blocks_per_sm']} blocks/SM = "
                 f"{o['warps_per_sm']}/{o['max_warps_per_sm']} warps "
                 f"({o['occupancy']:.0%}), limited by {o['limited_by']}"
                 + ("" if o["fits_shared"] else
                    f"; DOES NOT FIT: needs more than {o['shared_limit_per_block']} B shared"))
        lp = self.main_loop
        if lp:
            L.append("")
            L.append(f"main loop (SASS {lp['start']:#06x}-{lp['end']:#06x}, the longest "
                     f"backward branch): {lp['instructions']} instructions; layout "
                     f"conversions inside loops (TTGIR): {lp['conversions']}")
            items = [f"{k}: {v}" for k, v in lp["histogram"].items()]
            for i in range(0, len(items), 4):
                L.append("  " + "   ".join(items[i:i + 4]))
        for title, hist in (("PTX", self.ptx), ("SASS", self.sass)):
            L.append("")
            L.append(f"{title} instructions (static counts):")
            items = [f"{k}: {v}" for k, v in hist.items()]
            for i in range(0, len(items), 4):
                L.append("  " + "   ".join(items[i:i + 4]))
        return "\n".join(L)


def summarize(ir: CompiledIR) -> Summary:
    ttgir = ir.asm["ttgir"]
    ptx = ir.asm["ptx"]
    res = dict(ir.resources())
    res["shared"] = ir.shared
    layouts = []
    for lay in parse_layouts(ttgir):
        d = lay.as_dict()
        d["uses"] = lay.uses
        layouts.append(d)
    occ = occupancy(ir.cap, ir.num_warps, res["n_regs"],
                    counted_shared(ir.cap, ir.shared, res["static_shared"]))
    sass = ir.sass()
    loops = sass_loops(sass)
    main_loop = dict(loops[0], conversions=loop_conversions(ttgir)) if loops else {}
    return Summary(name=ir.name, arch=ir.arch, config=dict(ir.config), note=ir.note,
                   launches=list(ir.launches), num_warps=ir.num_warps,
                   num_stages=ir.num_stages, layouts=layouts,
                   pipelining=pipelining(ttgir, ptx, ir.num_stages), resources=res,
                   occupancy=occ, ptx=ptx_histogram(ptx), sass=sass_histogram(sass),
                   signature=dict(ir.signature.signature), main_loop=main_loop)


# --------------------------------------------------------------------------------------------
# Source mapping
# --------------------------------------------------------------------------------------------
def _resolve_line(ir: CompiledIR, line) -> int:
    if isinstance(line, int):
        return line
    src = _raw_source(ir)
    hits = [i for i, s in enumerate(src) if line in s]
    if not hits:
        raise ValueError(f"no line of {ir.jit.fn.__name__} contains {line!r}")
    return ir.first_line() + hits[0]


def _raw_source(ir: CompiledIR) -> list[str]:
    # the lines from first_line() on (decorators included), as inspect.getsourcelines gives them
    return [s.rstrip("\n") for s in ir.jit.raw_src]


def source_map(ir: CompiledIR, line) -> dict:
    """PTX and SASS produced for one Python line of the kernel (an absolute line number in
    its file, or a piece of its text such as ``"tl.dot"``)."""
    lineno = _resolve_line(ir, line)
    # Compare file names only: Triton's compile cache is keyed on the kernel's source, not its
    # path, so a kernel compiled earlier from another checkout carries that checkout's paths.
    path = os.path.basename(ir.source_file())
    ptx = ir.asm["ptx"]
    files = {m.group(1): m.group(2) for m in re.finditer(r'^\s*\.file\s+(\d+)\s+"([^"]+)"',
                                                         ptx, re.MULTILINE)}
    ids = {i for i, f in files.items() if os.path.basename(f) == path}
    ptx_lines, current = [], False
    for raw in ptx.splitlines():
        s = raw.strip()
        m = re.match(r"\.loc\s+(\d+)\s+(\d+)\s+\d+", s)
        if m:
            current = m.group(1) in ids and int(m.group(2)) == lineno
            continue
        if current and s and not s.startswith(("//", ".", "$")) and not s.endswith(":"):
            ptx_lines.append(s)
    sass_lines, current = [], False
    for raw in ir.sass(line_info=True).splitlines():
        m = re.search(r'//## File "([^"]+)", line (\d+)', raw)
        if m:
            current = os.path.basename(m.group(1)) == path and int(m.group(2)) == lineno
            continue
        if current and _SASS_RE.search(raw):
            sass_lines.append(raw.strip())
    src = _raw_source(ir)
    rel = lineno - ir.first_line()
    text = src[rel].strip() if 0 <= rel < len(src) else ""
    return dict(line=lineno, text=text, ptx=ptx_lines, sass=sass_lines)


# --------------------------------------------------------------------------------------------
# Diff
# --------------------------------------------------------------------------------------------
def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


@dataclass
class Diff:
    changes: list  # (key, a, b)
    unified: str
    stage: str

    def __str__(self) -> str:
        L = ["summary differences:"]
        if not self.changes:
            L.append("  (none)")
        for key, a, b in self.changes:
            if key == "layouts":
                gone = [x for x in a if x not in b]
                new = [x for x in b if x not in a]
                for x in gone:
                    L.append(f"  layout - {x}")
                for x in new:
                    L.append(f"  layout + {x}")
                continue
            L.append(f"  {key}: {a} -> {b}")
        L.append("")
        L.append(f"{self.stage} diff:")
        L.append(self.unified or "  (identical)")
        return "\n".join(L)


def diff_compiled(a: CompiledIR, b: CompiledIR, stage: str = "ttgir", context: int = 2) -> Diff:
    sa, sb = summarize(a).as_dict(), summarize(b).as_dict()
    for s in (sa, sb):
        s["layouts"] = [lay["words"] for lay in s["layouts"]]
        s.pop("note", None)
    fa, fb = _flatten(sa), _flatten(sb)
    changes = [(k, fa.get(k), fb.get(k)) for k in dict.fromkeys(list(fa) + list(fb))
               if fa.get(k) != fb.get(k)]
    ta, tb = a.stage(stage), b.stage(stage)
    if stage in ("ttir", "ttgir"):
        ta, tb = strip_locs(ta), strip_locs(tb)
    if stage == "sass":  # addresses and encodings differ everywhere; compare instructions
        ta, tb = _sass_body(ta), _sass_body(tb)
    unified = "\n".join(difflib.unified_diff(
        ta.splitlines(), tb.splitlines(), f"{a.name} {a.arch} {_cfg(a)}",
        f"{b.name} {b.arch} {_cfg(b)}", n=context, lineterm=""))
    return Diff(changes, unified, stage)


def _cfg(ir: CompiledIR) -> str:
    return ",".join(f"{k}={v}" for k, v in ir.config.items())


def _sass_body(sass: str) -> str:
    return "\n".join(re.sub(r"\s+", " ", m.group(0).split("*/", 1)[1]).strip()
                     for m in re.finditer(r"/\*[0-9a-f]{4,}\*/[^;]*;", sass))
