"""Read TTGIR layout attributes and say them in words.

TTGIR (Triton 3.6) names each layout once at the top of the module, e.g.::

    #blocked = #ttg.blocked<{sizePerThread = [1, 8], threadsPerWarp = [4, 8],
                             warpsPerCTA = [8, 1], order = [1, 0]}>
    #mma = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [8, 1],
                            instrShape = [16, 128, 16]}>
    #shared = #ttg.nvmma_shared<{swizzlingByteWidth = 128, transposed = false,
                                 elementBitWidth = 16}>
    #shared1 = #ttg.swizzled_shared<{vec = 8, perPhase = 1, maxPhase = 8, order = [1, 0]}>

and uses ``#ttg.slice<{dim = 1, parent = #blocked}>`` and
``#ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 2}>`` inline in tensor types.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

__all__ = ["Layout", "parse_layouts", "parse_layout", "describe", "tensor_types"]

_ALIAS_RE = re.compile(r"^#(\w+)\s*=\s*(#ttg\.\w+(?:<.*>)?)\s*$", re.MULTILINE)
_INLINE_RE = re.compile(r"#ttg\.(slice|dot_op)<\{[^{}]*\}>")
_TENSOR_RE = re.compile(r"tensor<([0-9x]+)x([a-z0-9!._<>]+?), #(\w+)>")


@dataclass
class Layout:
    name: str  # "#blocked1", or the inline text for slice/dot_op
    kind: str  # blocked, nvidia_mma, amd_mfma, swizzled_shared, nvmma_shared, slice, dot_op...
    params: dict
    text: str
    words: str = ""
    uses: list = field(default_factory=list)  # element types/shapes of tensors in this layout

    def as_dict(self) -> dict:
        return dict(name=self.name, kind=self.kind, params=self.params, words=self.words)


def _value(v: str):
    v = v.strip()
    if v.startswith("["):
        try:
            return json.loads(v)
        except ValueError:
            return v
    if v in ("true", "false"):
        return v == "true"
    try:
        return int(v)
    except ValueError:
        return v


def _split_top(s: str) -> list[str]:
    """Split ``a = 1, b = [1, 2], c = #x`` on the commas outside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch in "[<{(":
            depth += 1
        elif ch in "]>})":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return parts


def parse_layout(text: str, name: str = "") -> Layout:
    """``#ttg.blocked<{...}>`` -> Layout(kind="blocked", params={...})."""
    m = re.match(r"#ttg\.(\w+)<\{(.*)\}>$", text.strip(), re.DOTALL)
    if not m:
        m2 = re.match(r"#ttg\.(\w+)(?:<(.*)>)?$", text.strip(), re.DOTALL)
        if not m2:
            raise ValueError(f"not a TTGIR layout: {text!r}")
        return Layout(name or text, m2.group(1), {}, text)
    kind, body = m.group(1), m.group(2)
    params = {}
    for part in _split_top(body):
        if "=" in part:
            k, v = part.split("=", 1)
            params[k.strip()] = _value(v)
        elif part.strip():
            params[part.strip()] = True
    return Layout(name or text, kind, params, text)


def parse_layouts(ttgir: str) -> list[Layout]:
    """Every layout defined at the top of a TTGIR module plus each distinct inline slice /
    dot_op layout, each described in words (element types are taken from the tensors that
    use the layout)."""
    layouts: dict[str, Layout] = {}
    for m in _ALIAS_RE.finditer(ttgir):
        layouts["#" + m.group(1)] = parse_layout(m.group(2), "#" + m.group(1))
    for m in _INLINE_RE.finditer(ttgir):
        if m.group(0) not in layouts:
            layouts[m.group(0)] = parse_layout(m.group(0), m.group(0))
    uses = tensor_types(ttgir)
    for name, lay in layouts.items():
        lay.uses = sorted(uses.get(name, set()))
        lay.words = describe(lay, layouts)
    return list(layouts.values())


def tensor_types(ttgir: str) -> dict[str, set]:
    """layout alias -> {"128x64xf16", ...} for every ranked tensor type in the module."""
    out: dict[str, set] = {}
    for shape, elt, alias in _TENSOR_RE.findall(ttgir):
        out.setdefault("#" + alias, set()).add(f"{shape}x{elt}")
    for shape, elt, alias in re.findall(r"memdesc<([0-9x]+)x(\w+), #(\w+)", ttgir):
        out.setdefault("#" + alias, set()).add(f"{shape}x{elt}")
    for m in re.finditer(r"tensor<([0-9x]+)x(\w+), (#ttg\.(?:slice|dot_op)<\{[^{}]*\}>)>",
                         ttgir):
        out.setdefault(m.group(3), set()).add(f"{m.group(1)}x{m.group(2)}")
    return out


_ELT_BITS = {"f16": 16, "bf16": 16, "f32": 32, "f64": 64, "i1": 8, "i8": 8, "i16": 16,
             "i32": 32, "i64": 64, "f8E4M3FN": 8, "f8E5M2": 8}


def _elt_bits(uses: list[str]) -> list[tuple[str, int]]:
    out = []
    for u in uses:
        m = re.search(r"!tt\.ptr<(\w+)>$", u)
        # a tensor of pointers: the type it loads or stores
        elt = m.group(1) if m else u.split("x")[-1]
        bits = _ELT_BITS.get(elt)
        if bits and (elt, bits) not in out:
            out.append((elt, bits))
    return out


def _dims(v: list[int]) -> str:
    return "x".join(map(str, v))


def _stacked(warps: list[int]) -> str:
    total = math.prod(warps) if warps else 1
    split = [(d, w) for d, w in enumerate(warps) if w > 1]
    if not split:
        return f"{total} warp{'s' if total != 1 else ''} (no split across warps)"
    if len(split) == 1:
        d, w = split[0]
        return f"{w} warps stacked along dim {d}"
    return f"{total} warps arranged {_dims(warps)}"


def describe(lay: Layout, others: dict | None = None) -> str:
    p, k = lay.params, lay.kind
    if k == "blocked":
        spt, tpw, wpc, order = (p.get("sizePerThread", []), p.get("threadsPerWarp", []),
                                p.get("warpsPerCTA", []), p.get("order", []))
        fast = order[0] if order else len(spt) - 1
        n = spt[fast] if spt else 1
        words = [f"each thread holds {_dims(spt)} elements ({n} contiguous along dim {fast})"]
        vec = []
        for elt, b in _elt_bits(lay.uses):
            if not elt.startswith(("f", "bf")):
                continue  # masks and offsets: their width says nothing about memory access
            if n * b <= 128:
                vec.append(f"{n * b}-bit ({n * b // 8}-byte) vectors for {elt}")
            else:
                vec.append(f"{n * b // 128} x 128-bit vectors for {elt}")
        if vec:
            words[0] += " (" + "; ".join(dict.fromkeys(vec)) + ")"
        cover = [s * t for s, t in zip(spt, tpw)]
        words.append(f"a warp's 32 threads are laid {_dims(tpw)}, covering {_dims(cover)}")
        words.append(_stacked(wpc))
        cta = [c * w for c, w in zip(cover, wpc)]
        words.append(f"one CTA tile is {_dims(cta)} (larger tensors repeat it)")
        words.append(f"order {order} (dim {fast} fastest)")
        return "; ".join(words)
    if k == "nvidia_mma":
        major, minor = p.get("versionMajor"), p.get("versionMinor", 0)
        instr = p.get("instrShape", [])
        wpc = p.get("warpsPerCTA", [])
        if major == 3:
            wg = f"m64n{instr[1]}k{instr[2]}" if len(instr) == 3 else _dims(instr)
            what = (f"Hopper warpgroup MMA (wgmma {wg} per warpgroup; instrShape "
                    f"{_dims(instr)} per warp); "
                    f"{math.prod(wpc)} warps = {math.prod(wpc) // 4} warpgroup(s), "
                    f"warpsPerCTA {wpc}")
        elif major == 2:
            what = (f"Ampere-style mma.sync v{major}.{minor}, instruction tile {_dims(instr)} "
                    f"(M x N); warps tiled {_dims(wpc)} over the output")
        elif major == 5:
            what = f"Blackwell tcgen05 MMA v{major}.{minor}, instrShape {instr}, warps {wpc}"
        else:
            what = f"tensor-core MMA v{major}.{minor}, instrShape {instr}, warpsPerCTA {wpc}"
        return "accumulator layout: " + what
    if k == "nvmma_shared":
        sw = p.get("swizzlingByteWidth", 0)
        bits = p.get("elementBitWidth")
        tr = " transposed," if p.get("transposed") else ""
        fp = " fp4 padded," if p.get("fp4Padded") else ""
        sw_words = f"{sw}-byte swizzle" if sw else "no swizzle"
        return (f"shared memory in the NVMMA (wgmma/TMA) layout:{tr}{fp} {sw_words}, "
                f"{bits}-bit elements" + (f" ({sw * 8 // bits} elements per swizzled row)"
                                           if sw and bits else ""))
    if k in ("swizzled_shared", "shared"):
        vec, per, mx = p.get("vec", 1), p.get("perPhase", 1), p.get("maxPhase", 1)
        order = p.get("order", [])
        if mx <= 1:
            sw = "no swizzle"
        else:
            sw = (f"XOR swizzle: {vec}-element vectors, rows grouped {per} per phase, "
                  f"{mx} phases (avoids bank conflicts for ldmatrix)")
        return f"shared memory, {sw}; order {order}"
    if k == "padded_shared":
        return f"shared memory with padding {p}"
    if k == "shared_memory":
        return "the shared-memory address space"
    if k == "slice":
        parent = p.get("parent", "?")
        return (f"a 1-lower-rank slice of {parent}: its dim {p.get('dim')} removed (the layout "
                f"of a row/column vector that broadcasts against {parent})")
    if k == "dot_op":
        idx = p.get("opIdx")
        which = {0: "A (left, M x K)", 1: "B (right, K x N)"}.get(idx, f"operand {idx}")
        kw = p.get("kWidth")
        return (f"dot operand {which} in registers, laid out for {p.get('parent', '?')}"
                + (f"; {kw} consecutive K elements per thread" if kw else ""))
    if k == "linear":
        return "a general linear layout (register/lane/warp bases)"
    if k in ("amd_mfma", "amd_wmma"):
        return f"AMD matrix-core layout {p}"
    return f"{k} layout {p}"
