"""Launch configurations of the reductions family: typed, frozen, chosen from one table.

``NormConfig.for_device`` / ``NormBwdConfig.for_device`` / ``SoftmaxConfig.for_device`` give the
configuration a call uses; the launchers in ``ops`` take it as ``config=`` (None: the default
for the call's shape). Experiments change the choice through :func:`overrides`, a scoped,
thread-local context that rejects unknown keys; nothing reads a module global at call time.

How the table was derived (the figures and the variants that lost are in docs/NOTES.md,
"Reductions: configurations"): rows up to a size are held whole in registers, a program moving
about 4 KiB of input and a thread about 16 values (``row_config``); longer rows are walked in
chunks by one program a row (the "loop" path), with the chunk, warps and style of
``LOOP_SHAPES``, which beat a row in registers from the lengths listed there because its
programs hold far fewer registers and several share an SM. Calls never tune.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading

import torch

from tkit import _env
from tkit.kernels import _common as C
from tkit.kernels import _device as D
from tkit.kernels import _register as R

# --------------------------------------------------------------------------------------------
# Overrides: a scoped, validated context
# --------------------------------------------------------------------------------------------
#: Every key :func:`overrides` accepts, with its type and what it sets.
OVERRIDE_KEYS: dict[str, tuple[type, str]] = {
    "rows": (int, "rows a program for rows held in registers"),
    "num_warps": (int, "warps of the fused (rows in registers) kernels"),
    "fused_max_bytes": (int, "largest row in bytes held in registers (softmax; forward)"),
    "fused_max_bytes_bwd": (int, "the same for softmax's backward"),
    "chunk": (int, "columns a program on softmax's split path"),
    "split_warps": (int, "warps of softmax's split path"),
    "softmax_long": (str, "softmax rows past the fused limit: 'loop' or 'split'"),
    "loop_chunk": (int, "columns a chunk on softmax's loop path"),
    "norm_fwd_single_bytes": (int, "largest norm row held in registers (forward)"),
    "norm_chunk": (int, "columns a chunk on the norms' loop paths"),
    "norm_loop_warps": (int, "warps of the norm forward's loop path"),
    "norm_chan": (bool, "LayerNorm loop: combine the lanes by one Chan reduce"),
    "norm_rev2": (bool, "norm loop: second walk last chunk first"),
    "norm_static2": (bool, "norm loop: second walk unrolled at compile time"),
    "norm_static_chunks_max": (int, "most chunks of an unrolled first walk"),
    "norm_static_values_max": (int, "most values a thread of an unrolled first walk"),
    "norm_bwd_single_bytes": (int, "largest norm row held in registers (backward)"),
    "norm_bwd_fstats": (bool, "the backward uses the forward's saved statistics"),
    "norm_bwd_warps": (int, "warps of the norm backward, rows in registers"),
    "norm_bwd_programs": (int, "programs of the norm backward (dw/db partial rows)"),
    "norm_bwd_prefetch": (bool, "the norm backward loads the next row tile ahead"),
}
_CHOICES = {"softmax_long": ("loop", "split")}


class _State(threading.local):
    current: dict = {}


_STATE = _State()


def active() -> dict:
    """The overrides in force in this thread (empty, and falsy, in normal use)."""
    return _STATE.current


@contextlib.contextmanager
def overrides(**keys):
    """Override configuration choices of the reductions family inside a ``with`` block.

    ``with overrides(num_warps=8, softmax_long="split"): ...``. Keys are those of
    ``OVERRIDE_KEYS``; an unknown key or a value of the wrong type is a ``ValueError`` /
    ``TypeError`` naming it. Scoped (nested blocks stack, the outer values come back on exit)
    and thread-local. Calls inside the block skip the eager plans and the per-shape caches.
    """
    unknown = sorted(set(keys) - set(OVERRIDE_KEYS))
    if unknown:
        raise ValueError(f"unknown reductions override(s): {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(OVERRIDE_KEYS))})")
    for k, v in keys.items():
        typ = OVERRIDE_KEYS[k][0]
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            raise TypeError(f"override {k} must be {typ.__name__}, got {v!r}")
        if k in _CHOICES and v not in _CHOICES[k]:
            raise ValueError(f"override {k} must be one of {_CHOICES[k]}, got {v!r}")
    old = _STATE.current
    _STATE.current = {**old, **keys}
    try:
        # the registered ops' C++ kernels serve plans without reading overrides
        with R.fast_ops_held() if keys else contextlib.nullcontext():
            yield
    finally:
        _STATE.current = old


def _ov(key, default):
    return _STATE.current.get(key, default)


def _itemsize(itemsize_or_dtype) -> int:
    if isinstance(itemsize_or_dtype, torch.dtype):
        return itemsize_or_dtype.itemsize
    return int(itemsize_or_dtype)


# --------------------------------------------------------------------------------------------
# The measured table
# --------------------------------------------------------------------------------------------
#: Largest row a program holds in registers (ptxas for sm_90a on tkit's launches, bf16, no
#: spills): 64 KiB for the norms' forward in the interpreter rule, 32 KiB for their backward
#: (it also holds w and the dw/db partials), 32 KiB for plain RMSNorm's interpreter rule.
NORM_FWD_SINGLE_MAX_BYTES = 64 * 1024
NORM_BWD_SINGLE_MAX_BYTES = 32 * 1024
RMS_FWD_SINGLE_MAX_BYTES = 32 * 1024
#: Softmax: rows up to 32 KiB forward (the loop path is faster beyond) and 64 KiB backward in
#: registers; split-path chunk; loop-path chunk.
SOFTMAX_FUSED_MAX_BYTES = 32 * 1024
SOFTMAX_FUSED_MAX_BYTES_BWD = 64 * 1024
SOFTMAX_SPLIT_CHUNK = 8192
SOFTMAX_LOOP_CHUNK = 16384
#: The norm forward on the GPU: (largest N, chunk, warps, style) rows, first match wins;
#: chunk 0 = the row held in registers (``row_config``). style: "chan" (LayerNorm's lanes
#: combined by one Chan reduce, else two sums), "fwd" (the second walk in column order, else
#: last chunk first), "s2" (the second walk unrolled at compile time when the first is).
LOOP_SHAPES = {
    "rms_norm": ((2048, 0, 0, ""), (4096, 4096, 8, ""), (16384, 8192, 16, "fwd s2"),
                 (32768, 16384, 32, "fwd s2"), (None, 32768, 32, "")),
    "rms_norm_residual": ((1024, 0, 0, ""), (4096, 2048, 8, ""), (8192, 8192, 32, ""),
                          (None, 16384, 32, "")),
    "layer_norm": ((8192, 0, 0, ""), (16384, 4096, 16, "chan fwd s2"),
                   (32768, 8192, 32, "fwd s2"), (65536, 16384, 32, "chan fwd s2"),
                   (None, 8192, 32, "")),
}
LOOP_STYLES = ("chan", "fwd", "s2")
#: The loop path's first walk is unrolled at compile time (one build per chunk count) for rows
#: of up to this many chunks and values a thread, so that all of a row's loads are in flight
#: before the first update, as in torch.compile's kernels for fixed shapes.
STATIC_CHUNKS_MAX = 16
STATIC_VALUES_MAX = 64


def _check_table():
    for rows in LOOP_SHAPES.values():
        if rows[-1][0] is not None:
            raise AssertionError("LOOP_SHAPES: each table ends with a catch-all row")
        for row in rows:
            if not set(row[3].split()) <= set(LOOP_STYLES):
                raise AssertionError(f"LOOP_SHAPES: unknown style in {row}")


_check_table()


def row_config(N: int, itemsize: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS, num_warps) for rows held whole in registers.

    A program should move at least ~4 KiB of input (short rows are packed ROWS to a program)
    and a thread hold about 16 values of a tile, which keeps every kernel of the family at or
    under 64 registers so that two or more programs fit on an SM (measured grid in NOTES).
    """
    block_n = C.next_power_of_2(N)
    if _env.INTERPRET:
        # the interpreter pays per program: few, large programs
        rows = max(1, min(64, 8192 // block_n))
        return block_n, _ov("rows", rows), 4
    rows = max(1, min(64, (4096 // itemsize) // block_n))
    warps = max(4, min(32, C.next_power_of_2(max(1, rows * block_n // 512))))
    return block_n, _ov("rows", rows), _ov("num_warps", warps)


def _loop_shape(N: int, is_rms: bool, has_res: bool) -> tuple[int, int, str]:
    table = LOOP_SHAPES["layer_norm" if not is_rms else
                        "rms_norm_residual" if has_res else "rms_norm"]
    for max_n, chunk, warps, style in table:
        if max_n is None or N <= max_n:
            return chunk, warps, style
    raise AssertionError("unreachable: LOOP_SHAPES ends with a catch-all row")


# --------------------------------------------------------------------------------------------
# Norm forward
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class NormConfig:
    """Launch of the norm forward (``_norm_fwd_kernel``).

    single: rows held whole in registers, ``rows`` to a program; else one program a row walks
    it twice in chunks of ``block_n`` columns (the loop path), with ``nchunk`` > 0 when the
    first walk is unrolled, ``even`` when every chunk is full, and the style flags ``chan``,
    ``rev2``, ``static2`` (see ``LOOP_SHAPES``)."""

    block_n: int
    rows: int
    warps: int
    single: bool
    nchunk: int = 0
    even: bool = False
    chan: bool = False
    rev2: bool = True
    static2: bool = False

    @staticmethod
    def for_device(n: int, itemsize: int, *, is_rms: bool = True,
                   has_res: bool = False) -> NormConfig:
        """The configuration for rows of ``n`` columns of ``itemsize`` bytes (or a dtype;
        the GPU's table, or the interpreter's few large programs), under the active
        overrides."""
        if type(itemsize) is not int:
            itemsize = _itemsize(itemsize)
        if not _STATE.current:
            return _norm_config_cached(n, itemsize, is_rms, has_res, _env.INTERPRET)
        return _norm_config(n, itemsize, is_rms, has_res)

    def constexprs(self) -> dict:
        return dict(ROWS=self.rows, BLOCK_N=self.block_n, SINGLE=self.single,
                    NCHUNK=self.nchunk, EVEN=self.even, CHAN=self.chan, REV2=self.rev2,
                    STATIC2=self.static2, num_warps=self.warps)


@functools.lru_cache(maxsize=1024)
def _norm_config_cached(n, itemsize, is_rms, has_res, interpret):
    # ``interpret`` keys the cache only (tests switch _env.INTERPRET)
    return _norm_config(n, itemsize, is_rms, has_res)


def _norm_shape(N: int, itemsize: int, is_rms: bool, has_res: bool) -> tuple[int, int, int, bool]:
    """(BLOCK_N, ROWS, num_warps, SINGLE). Departures from ``row_config`` measured on the
    H200 (NOTES): LayerNorm keeps 32 values a thread (at least 8 warps) because each of its
    two reductions a row is a barrier across the program's warps; the residual form takes 32
    warps where ``row_config`` gives one row 16; plain RMSNorm pairs rows of 8-16 KiB at half
    the warps."""
    ov = _STATE.current
    if _env.INTERPRET or "norm_fwd_single_bytes" in ov:
        single_max = NORM_FWD_SINGLE_MAX_BYTES if has_res else RMS_FWD_SINGLE_MAX_BYTES
        single = N * itemsize <= ov.get("norm_fwd_single_bytes", single_max)
        chunk, loop_warps = ov.get("norm_chunk", 4096 if _env.INTERPRET else 16384), 16
    else:
        chunk, loop_warps, _style = _loop_shape(N, is_rms, has_res)
        single = chunk == 0
        chunk = ov.get("norm_chunk", chunk)
    if single:
        block_n, rows, warps = row_config(N, itemsize)
        if not _env.INTERPRET and "num_warps" not in ov:
            if not is_rms:
                warps = min(warps, max(8, (block_n * rows) // 1024))
            elif has_res and warps == 16 and rows == 1:
                warps = 32
            elif (not has_res and rows == 1 and "rows" not in ov
                  and 8192 <= block_n * itemsize <= 16384):
                rows, warps = 2, max(4, warps // 2)
        return block_n, rows, warps, True
    if _env.INTERPRET:
        return chunk, 1, 4, False
    return chunk, 1, ov.get("norm_loop_warps", loop_warps), False


def _static_chunks(N: int, block_n: int, single: bool, warps: int) -> int:
    if single:
        return 0
    n = C.cdiv(N, block_n)
    if n * block_n > _ov("norm_static_values_max", STATIC_VALUES_MAX) * 32 * warps:
        return 0
    return n if n <= _ov("norm_static_chunks_max", STATIC_CHUNKS_MAX) else 0


def _norm_config(N, itemsize, is_rms, has_res) -> NormConfig:
    block_n, rows, warps, single = _norm_shape(N, itemsize, is_rms, has_res)
    style = "" if _env.INTERPRET else _loop_shape(N, is_rms, has_res)[2].split()
    return NormConfig(block_n=block_n, rows=rows, warps=warps, single=single,
                      nchunk=_static_chunks(N, block_n, single, warps),
                      even=not single and rows == 1 and N % block_n == 0,
                      chan=_ov("norm_chan", "chan" in style),
                      rev2=_ov("norm_rev2", "fwd" not in style),
                      static2=_ov("norm_static2", "s2" in style))


# --------------------------------------------------------------------------------------------
# Norm backward
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class NormBwdConfig:
    """Launch of the norm backward: ``programs`` programs (one dw/db partial row each) walk row
    tiles of ``rows`` rows, whole rows in registers (``single``) or ``block_n`` column chunks
    with per-row statistics from ``_norm_bwd_stats_kernel`` (``stats_warps``); ``prefetch``:
    the next tile's loads are issued before the current tile's reductions; ``fwd_stats``: the
    forward's saved (mean, rstd) are used (for rows in registers, RMSNorm only by default)."""

    block_n: int
    rows: int
    warps: int
    single: bool
    programs: int
    prefetch: bool = True
    fwd_stats: bool = True
    fwd_stats_single: bool = True
    stats_warps: int = 16

    @staticmethod
    def for_device(m: int, n: int, itemsize: int, *, is_rms: bool, has_stats: bool,
                   device: torch.device) -> NormBwdConfig:
        """The backward's configuration for an (m, n) input of ``itemsize`` bytes (or a
        dtype); ``has_stats``: the forward saved (mean, rstd)."""
        itemsize = _itemsize(itemsize)
        ov = _STATE.current
        single = n * itemsize <= ov.get("norm_bwd_single_bytes", NORM_BWD_SINGLE_MAX_BYTES)
        fstats = has_stats and ov.get("norm_bwd_fstats", True)
        # rows in registers: the forward's statistics serve RMSNorm only (LayerNorm ran
        # slower with them; NOTES). The long-row path uses them for both.
        fstats_single = fstats and (is_rms or ov.get("norm_bwd_fstats") is True)
        if single:
            block_n, rows, warps = row_config(n, itemsize)
            warps = ov.get("norm_bwd_warps", warps)
            nchunk = 1
        else:
            block_n = ov.get("norm_chunk", 4096 if _env.INTERPRET else 8192)
            rows, warps = 1, (4 if _env.INTERPRET else 32)
            nchunk = C.cdiv(n, block_n)
        # one program an SM: a program holding an 8 KiB row fills the register file, so a
        # second wave would only add a tail
        programs = ov.get("norm_bwd_programs", max(1, D.sm_count(device) // nchunk))
        programs = max(1, min(C.cdiv(m, rows), programs))
        return NormBwdConfig(block_n=block_n, rows=rows, warps=warps, single=single,
                             programs=programs, prefetch=ov.get("norm_bwd_prefetch", True),
                             fwd_stats=fstats, fwd_stats_single=fstats_single and single,
                             stats_warps=4 if _env.INTERPRET else 16)


# --------------------------------------------------------------------------------------------
# Softmax
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SoftmaxConfig:
    """Launch of softmax/log_softmax (forward or backward). path: "fused" (``rows`` whole rows
    a program in registers), "loop" (one program a row, online softmax over ``block_n``
    chunks, then a second walk) or "split" (a row across programs of ``block_n`` columns, two
    launches)."""

    path: str
    block_n: int
    rows: int
    warps: int

    @staticmethod
    def for_device(m: int, n: int, itemsize: int, *, device: torch.device,
                   backward: bool = False) -> SoftmaxConfig:
        """The configuration for (m, n) rows of ``itemsize`` bytes (or a dtype)."""
        itemsize = _itemsize(itemsize)
        ov = _STATE.current
        if backward:
            limit = ov.get("fused_max_bytes_bwd", ov.get("fused_max_bytes",
                                                         SOFTMAX_FUSED_MAX_BYTES_BWD))
        else:
            limit = ov.get("fused_max_bytes", SOFTMAX_FUSED_MAX_BYTES)
        if n <= limit // itemsize:
            block_n, rows, warps = row_config(n, itemsize)
            return SoftmaxConfig("fused", block_n, rows, warps)
        # the loop path when there are at least as many rows as SMs, else split (NOTES)
        path = "split" if backward else ov.get(
            "softmax_long", "loop" if m >= D.sm_count(device) else "split")
        if path == "loop":
            chunk = ov.get("loop_chunk", 4096 if _env.INTERPRET else SOFTMAX_LOOP_CHUNK)
            warps = 4 if _env.INTERPRET else max(4, min(32, chunk // 1024))
            return SoftmaxConfig("loop", chunk, 1, warps)
        chunk = ov.get("chunk", 4096 if _env.INTERPRET else SOFTMAX_SPLIT_CHUNK)
        # 16 values a thread, as in row_config
        warps = 4 if _env.INTERPRET else ov.get("split_warps", max(4, min(32, chunk // 512)))
        return SoftmaxConfig("split", chunk, 1, warps)
