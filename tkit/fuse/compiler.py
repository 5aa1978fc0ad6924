"""The stages of :mod:`tkit.fuse`: trace (:func:`trace`), group (:func:`group`), generate
(:func:`generate`), launch (:class:`Fused`). The package docstring says what each does."""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import tempfile
from dataclasses import dataclass, field

import torch
from torch.fx import Node

from tkit.fuse.config import current_config
from tkit.kernels import _common as C

aten = torch.ops.aten

#: the longest row a group with a reduction holds in registers; longer rows run in torch
MAX_ROW = 16384
#: dtypes a group reads and writes (others, float64 and integers, run in torch)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_TL = {torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16"}

# ---- what the generator knows --------------------------------------------------------------
#: pointwise ops: a format of the operands' expressions (a, b, c) and the node's scalars
_UNARY = {
    aten.neg.default: "(-{a})", aten.exp.default: "tl.exp({a})", aten.log.default: "tl.log({a})",
    aten.sqrt.default: "tl.sqrt({a})", aten.rsqrt.default: "(1.0 / tl.sqrt({a}))",
    aten.sigmoid.default: "tl.sigmoid({a})", aten.abs.default: "tl.abs({a})",
    aten.relu.default: "tl.maximum({a}, 0.0)", aten.reciprocal.default: "(1.0 / {a})",
    aten.sin.default: "tl.sin({a})", aten.cos.default: "tl.cos({a})",
    aten.erf.default: "tl.erf({a})", aten.silu.default: "({a} * tl.sigmoid({a}))",
    aten.tanh.default: "(2.0 * tl.sigmoid(2.0 * {a}) - 1.0)",
    aten.clone.default: "{a}", aten.alias.default: "{a}", aten.detach.default: "{a}",
    aten.logical_not.default: "({a} == 0)",
}
_BINARY = {
    aten.add.Tensor: "({a} + {b})", aten.sub.Tensor: "({a} - {b})",
    aten.mul.Tensor: "({a} * {b})", aten.div.Tensor: "({a} / {b})",
    aten.maximum.default: "tl.maximum({a}, {b})", aten.minimum.default: "tl.minimum({a}, {b})",
    aten.gt.Tensor: "({a} > {b})", aten.gt.Scalar: "({a} > {b})",
    aten.lt.Tensor: "({a} < {b})", aten.lt.Scalar: "({a} < {b})",
    aten.ge.Tensor: "({a} >= {b})", aten.ge.Scalar: "({a} >= {b})",
    aten.le.Tensor: "({a} <= {b})", aten.le.Scalar: "({a} <= {b})",
    aten.eq.Tensor: "({a} == {b})", aten.eq.Scalar: "({a} == {b})",
    aten.ne.Tensor: "({a} != {b})", aten.ne.Scalar: "({a} != {b})",
}
#: reductions over the last dim (dims argument, keepdim argument positions)
_REDUCE = {aten.sum.dim_IntList: "sum", aten.mean.dim: "mean", aten.amax.default: "max",
           aten.amin.default: "min"}
_ROW_OPS = {aten._softmax.default: "softmax", aten._log_softmax.default: "log_softmax"}
#: views that a group takes when they only add or drop the last size-1 dim of a per-row value
#: (``s.unsqueeze(-1)``, ``s.view(R, 1)``, ``s.squeeze(-1)``) or keep a shape: a value's name
#: is unchanged, its form is the view's shape
_VIEWS = (aten.unsqueeze.default, aten.squeeze.dim, aten.view.default,
          aten._unsafe_view.default, aten.reshape.default)


def _lit(v) -> str:
    v = float(v)
    if math.isnan(v):
        return 'float("nan")'
    if math.isinf(v):
        return 'float("inf")' if v > 0 else 'float("-inf")'
    return repr(v)


def _val(n):
    return n.meta.get("val") if isinstance(n, Node) else None


def _last_dim(dims, ndim) -> bool:
    dims = [dims] if isinstance(dims, int) else list(dims)
    return len(dims) == 1 and dims[0] % max(ndim, 1) == ndim - 1


def _pointwise_expr(n: Node, ops: list[str]) -> str | None:
    """The expression of pointwise node ``n`` over its operands' expressions ``ops`` (tensor
    operands by name, scalars as literals), or None where the generator does not know it."""
    t, kw = n.target, n.kwargs
    if t in _UNARY and not kw:
        return _UNARY[t].format(a=ops[0])
    if t in _BINARY:
        if t in (aten.add.Tensor, aten.sub.Tensor) and kw.get("alpha", 1) != 1:
            ops = [ops[0], f"({_lit(kw['alpha'])} * {ops[1]})"]
        elif kw and set(kw) != {"alpha"}:
            return None
        return _BINARY[t].format(a=ops[0], b=ops[1])
    if t is aten.where.self and not kw:
        return f"tl.where({ops[0]}, {ops[1]}, {ops[2]})"
    if t is aten.masked_fill.Scalar and not kw:
        return f"tl.where({ops[1]}, {ops[2]}, {ops[0]})"
    if t is aten.pow.Tensor_Scalar and not kw:
        e = n.args[1]
        if e == 0.5:
            return f"tl.sqrt({ops[0]})"
        if float(e).is_integer() and 1 <= abs(e) <= 4:
            p = "(" + " * ".join([ops[0]] * int(abs(e))) + ")"
            return p if e > 0 else f"(1.0 / {p})"
        return None
    if t is aten.clamp.default and not kw:
        lo = n.args[1] if len(n.args) > 1 else None
        hi = n.args[2] if len(n.args) > 2 else None
        e = ops[0]
        if lo is not None:
            e = f"tl.maximum({e}, {_lit(lo)})"
        if hi is not None:
            e = f"tl.minimum({e}, {_lit(hi)})"
        return e
    if t is aten.gelu.default and set(kw) <= {"approximate"}:
        a = ops[0]
        if kw.get("approximate", "none") == "tanh":
            u = f"0.7978845608028654 * ({a} + 0.044715 * {a} * {a} * {a})"
            return f"({a} * tl.sigmoid(2.0 * ({u})))"  # 0.5 (1 + tanh u) = sigmoid(2u)
        return f"(0.5 * {a} * (1.0 + tl.erf({a} * 0.7071067811865476)))"
    if t is aten._to_copy.default and set(kw) <= {"dtype"}:
        d = kw.get("dtype")
        if d in (torch.float16, torch.bfloat16):  # rounded where the function rounds
            return f"{ops[0]}.to({_TL[d]}).to(tl.float32)"
        if d is torch.float32:
            return f"{ops[0]}.to(tl.float32)"
        return None
    return None


# ---- 1. trace --------------------------------------------------------------------------------
def trace(fn, args) -> torch.fx.GraphModule:
    """``fn`` as ATen ops with the shapes and dtypes of ``args`` (run once on them)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad():
        return make_fx(fn)(*args)


# ---- 2. group --------------------------------------------------------------------------------
@dataclass
class Group:
    """Nodes that become one kernel. ``shape``: the iteration shape (..., N); values are FULL
    (that shape) or ROW (one a row: the shape with a last dim of 1, or without the last dim)."""

    shape: tuple
    nodes: list = field(default_factory=list)
    row_form: dict = field(default_factory=dict)  # node -> None (FULL) or its ROW shape
    reduces: bool = False
    outputs: list = field(default_factory=list)
    source: str = ""
    kernel: object = None
    args: list = field(default_factory=list)  # (external node, form) a kernel argument each


def _form(shape: tuple, full: tuple):
    """None for the full shape, the shape itself for a per-row shape, False otherwise."""
    if shape == full:
        return None
    if shape in (full[:-1] + (1,), full[:-1]):
        return shape
    return False


def _fits(t, form, full) -> bool:
    """Whether tensor value ``t`` (an external operand) broadcasts to the operand form."""
    target = tuple(full if form is None else form)
    try:
        return torch.broadcast_shapes(tuple(t.shape), target) == target
    except RuntimeError:
        return False


def _operands(n: Node):
    return [a for a in n.args if isinstance(a, Node)]


def _try_join(g: Group, n: Node) -> bool:
    """Add ``n`` to ``g`` where the generator knows it and its shape fits; else False."""
    v = _val(n)
    if not isinstance(v, torch.Tensor) or v.dtype not in FLOATS + (torch.bool,):
        return False
    shape, full = tuple(v.shape), g.shape
    if len(full) > 4 or len(full) == 0 or full[-1] == 0:
        return False
    reduces = False
    if n.target in _VIEWS:
        x = n.args[0]
        if x not in g.row_form or _val(x).dtype != v.dtype:
            return False
        f, form = g.row_form[x], _form(shape, full)
        same = tuple(_val(x).shape) == shape
        if form is False or not (same or (f is not None and form is not None)):
            return False
    elif n.target in _REDUCE or n.target in _ROW_OPS:
        x = n.args[0]
        xv = _val(x)
        if not isinstance(xv, torch.Tensor) or tuple(xv.shape) != full or xv.dtype not in FLOATS:
            return False
        if x in g.row_form and g.row_form[x] is not None:
            return False
        if n.target in _REDUCE:
            dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
            if dims is None or not _last_dim(dims, len(full)):
                return False
            keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
            if set(n.kwargs) - {"dim", "keepdim"} or (len(n.args) > 3):
                return False
            form = full[:-1] + (1,) if keep else full[:-1]
        else:
            if not _last_dim(n.args[1], len(full)):
                return False
            form = None
        if full[-1] > MAX_ROW or (form is not None and shape != form):
            return False
        reduces = True
    else:
        if _pointwise_expr(n, ["a", "b", "c"]) is None:
            return False
        form = _form(shape, full)
        if form is False:
            return False
        for a in _operands(n):
            if a in g.row_form:
                f = g.row_form[a]
                # a per-row value meets full ones only with its last dim kept (torch aligns
                # shapes on the right: (R,) against (R, N) is not per row)
                if f is not None and f != form and not (form is None and len(f) == len(full)):
                    return False
            else:
                av = _val(a)
                if not isinstance(av, torch.Tensor) or av.dtype not in FLOATS + (torch.bool,):
                    return False
                if not _fits(av, form, full):
                    return False
    g.nodes.append(n)
    g.row_form[n] = form
    g.reduces |= reduces
    return True


def group(gm: torch.fx.GraphModule) -> list:
    """The plan: a list of Group (one kernel each) and fx nodes run by torch, in order."""
    steps: list = []
    g = None
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if g is not None and _try_join(g, n):
            continue
        v = _val(n)
        start = None
        if isinstance(v, torch.Tensor) and v.ndim:
            full = (tuple(_val(n.args[0]).shape) if (n.target in _REDUCE or n.target in _ROW_OPS)
                    and isinstance(_val(n.args[0]), torch.Tensor) else tuple(v.shape))
            start = Group(shape=full)
            if not _try_join(start, n):
                start = None
        if g is not None and g.nodes:
            steps.append(g)
        g = start
        if g is None:
            steps.append(n)
    if g is not None and g.nodes:
        steps.append(g)
    # what each group stores: its values read outside it or returned
    members = {n: s for s in steps if isinstance(s, Group) for n in s.nodes}
    for s in steps:
        if isinstance(s, Group):
            s.outputs = [n for n in s.nodes
                         if any(members.get(u) is not s for u in n.users)]
    return steps


# ---- 3. generate -----------------------------------------------------------------------------
def _pad4(shape, strides):
    shape, strides = list(shape), list(strides)
    while len(shape) < 4:
        shape.insert(0, 1)
        strides.insert(0, 0)
    return shape, strides


def generate(g: Group, name: str) -> str:
    """The Triton source of group ``g``'s kernel ``name``; fills ``g.args``."""
    names: dict = {}
    body: list[str] = []
    g.args = []

    def operand(a, form) -> str:
        """A scalar's literal, a member's name, or an external tensor loaded in ``form``
        (None: a row's columns; a per-row shape: one value a row)."""
        if not isinstance(a, Node):
            return ("1" if a else "0") if isinstance(a, bool) else _lit(a)
        if a in g.row_form:
            return names[a]
        if (a, form) not in g.args:
            g.args.append((a, form))
        k = g.args.index((a, form))
        row = f"(i0 * s{k}_0 + i1 * s{k}_1 + i2 * s{k}_2)"
        load = (f"tl.load(IN{k} + {row} + cols * s{k}_3, mask=mask, other=0)" if form is None
                else f"tl.load(IN{k} + {row})")
        line = f"    x{k} = {load}" + (" != 0" if _val(a).dtype == torch.bool
                                        else ".to(tl.float32)")
        if line not in body:
            body.append(line)
        return f"x{k}"

    for i, n in enumerate(g.nodes):
        form = g.row_form[n]
        out = f"v{i}"
        if n.target in _REDUCE:
            x = operand(n.args[0], None)
            kind = _REDUCE[n.target]
            if kind in ("sum", "mean"):
                e = f"tl.sum(tl.where(mask, {x}, 0.0), axis=0)"
                if kind == "mean":
                    e = f"({e} / N)"
            else:
                e = (f"tl.{kind}(tl.where(mask, {x}, float(\"{'-' if kind == 'max' else ''}inf\")),"
                     f" axis=0)")
            body.append(f"    {out} = {e}")
        elif n.target in _VIEWS:
            names[n] = names[n.args[0]]
            continue
        elif n.target in _ROW_OPS:
            x = operand(n.args[0], None)
            body.append(f"    {out}_m = tl.max(tl.where(mask, {x}, float(\"-inf\")), axis=0)")
            body.append(f"    {out}_e = tl.where(mask, tl.exp({x} - {out}_m), 0.0)")
            body.append(f"    {out}_s = tl.sum({out}_e, axis=0)")
            if _ROW_OPS[n.target] == "softmax":
                body.append(f"    {out} = {out}_e / {out}_s")
            else:
                body.append(f"    {out} = ({x} - {out}_m) - tl.log({out}_s)")
        else:
            ops = [operand(a, form) for a in n.args]
            body.append(f"    {out} = {_pointwise_expr(n, ops)}")
        names[n] = out
    stores = []
    for j, n in enumerate(g.outputs):
        v = _val(n)
        cast = ".to(tl.int8)" if v.dtype == torch.bool else f".to({_TL[v.dtype]})"
        if g.row_form[n] is None:
            stores.append(f"    tl.store(OUT{j} + (i0 * o{j}_0 + i1 * o{j}_1 + i2 * o{j}_2) + "
                          f"cols * o{j}_3, {names[n]}{cast}, mask=mask)")
        else:
            stores.append(f"    if first:\n        tl.store(OUT{j} + (i0 * o{j}_0 + i1 * o{j}_1 "
                          f"+ i2 * o{j}_2), {names[n]}{cast})")
    params = [f"IN{k}" for k in range(len(g.args))] + [f"OUT{j}" for j in range(len(g.outputs))]
    params += ["D1", "D2", "N"]
    params += [f"s{k}_{d}" for k in range(len(g.args)) for d in range(4)]
    params += [f"o{j}_{d}" for j in range(len(g.outputs)) for d in range(4)]
    params += ["BLOCK: tl.constexpr"]
    head = [
        "import triton", "import triton.language as tl", "", "",
        "@triton.jit",
        f"def {name}(" + ", ".join(params) + "):",
        "    r = tl.program_id(0).to(tl.int64)",
        "    i2 = r % D2",
        "    i1 = (r // D2) % D1",
        "    i0 = r // (D2 * D1)",
        "    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)",
        "    mask = cols < N",
        "    first = tl.program_id(1) == 0",
    ]
    return "\n".join(head + body + stores) + "\n"


def _load(source: str, name: str):
    """The kernel ``name`` of generated ``source``, from a file (Triton reads a kernel's
    source through ``inspect``), one a source hash."""
    root = os.environ.get("TKIT_FUSE_CACHE") or os.path.join(tempfile.gettempdir(), "tkit-fuse")
    os.makedirs(root, exist_ok=True)
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    path = os.path.join(root, f"fused_{digest}.py")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(f"tkit_fused_{digest}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


# ---- 4. launch -------------------------------------------------------------------------------
def _operand_view(t: torch.Tensor, form, full):
    """(strides of ``t`` as read in the iteration shape, 4 of them): broadcast strides are 0."""
    if form is None:
        v = t.broadcast_to(full)
        _, st = _pad4(v.shape, v.stride())
        return st
    shape = form if len(form) == len(full) else tuple(form) + (1,)
    base = t.broadcast_to(form)
    strides = list(base.stride()) + ([0] if len(form) < len(full) else [])
    _, st = _pad4(shape, strides)
    st[3] = 0
    return st


def _run_group(g: Group, env: dict, device) -> None:
    full = g.shape
    (d0, d1, d2, n), _ = _pad4(full, [0] * len(full))
    rows = d0 * d1 * d2
    kw = {}
    for k, (a, form) in enumerate(g.args):
        t = env[a]
        kw[f"IN{k}"] = t
        for d, s in enumerate(_operand_view(t, form, full)):
            kw[f"s{k}_{d}"] = s
    for j, node in enumerate(g.outputs):
        v = _val(node)
        if v.dtype == torch.bool:  # written as bytes 0 / 1
            raw = C.empty(tuple(v.shape), torch.int8, device)  # poisoned under tests' checks
            out = raw.view(torch.bool)
        else:
            raw = out = C.empty(tuple(v.shape), v.dtype, device)
        env[node] = out
        kw[f"OUT{j}"] = raw
        for d, s in enumerate(_operand_view(out, g.row_form[node], full)):
            kw[f"o{j}_{d}"] = s
    cfg = current_config()
    if g.reduces:
        block, cols = C.next_power_of_2(n), 1
    else:
        block = min(cfg.block_cols, C.next_power_of_2(n))
        cols = C.cdiv(n, block)
    # no FMA contraction: each op rounds as torch's own does (contracted, ``x * y - m`` with m
    # the row's max of x * y is the rounding error of x * y at the max, not 0)
    C.launch(g.kernel, (rows, cols), D1=d1, D2=d2, N=n, BLOCK=block,
             num_warps=cfg.warps(block), enable_fp_fusion=False, **kw)


class Fused:
    """A function compiled by :func:`fuse`: call it as the function."""

    def __init__(self, fn):
        self.fn = fn
        self._plans: dict = {}

    def _key(self, args):
        key = []
        for a in args:
            if isinstance(a, torch.Tensor):
                if a.requires_grad and torch.is_grad_enabled():
                    raise ValueError("tkit.fuse runs inference only: an input needs a gradient "
                                     "(call under torch.no_grad())")
                key.append((tuple(a.shape), a.dtype, a.device))
            else:
                key.append(("const", repr(a)))
        return tuple(key)

    def plan(self, *args):
        """(graph module, steps) for these inputs, traced and generated on the first call."""
        key = self._key(args)
        if key not in self._plans:
            gm = trace(self.fn, args)
            steps = group(gm)
            for i, s in enumerate(steps):
                if isinstance(s, Group):
                    name = f"fused_{i}"
                    s.source = generate(s, name)
                    s.kernel = _load(s.source, name)
            self._plans[key] = (gm, steps)
        return self._plans[key]

    def __call__(self, *args):
        gm, steps = self.plan(*args)
        env = dict(zip((n for n in gm.graph.nodes if n.op == "placeholder"), args))
        device = next((a.device for a in args if isinstance(a, torch.Tensor)),
                      torch.device("cpu"))
        for s in steps:
            if isinstance(s, Group):
                if s.outputs:
                    _run_group(s, env, device)
            else:
                a, kw = torch.fx.node.map_arg((s.args, s.kwargs), lambda x: env[x])
                env[s] = s.target(*a, **kw)
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        return torch.fx.node.map_arg(out, lambda x: env[x])


def fuse(fn) -> Fused:
    """``fn`` (tensors in, tensors out) compiled by the stages of :mod:`tkit.fuse`."""
    return Fused(fn)


def explain(f, *args) -> str:
    """The plan of ``f`` (a :class:`Fused` or a plain function) for ``args``: each step, a
    kernel's nodes and generated source, or the torch op that runs alone."""
    f = f if isinstance(f, Fused) else Fused(f)
    _, steps = f.plan(*args)
    lines = []
    for i, s in enumerate(steps):
        if isinstance(s, Group):
            kinds = "rows held whole (a reduction)" if s.reduces else "rows in blocks"
            lines.append(f"[{i}] kernel over {tuple(s.shape)}, {kinds}: "
                         + ", ".join(str(n.target).replace("aten.", "") for n in s.nodes)
                         + f"; stores {len(s.outputs)}")
            lines.append(s.source)
        else:
            lines.append(f"[{i}] torch: {s.target}")
    return "\n".join(lines)
