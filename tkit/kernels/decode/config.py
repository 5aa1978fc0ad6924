"""The decode family's configuration: constants, :class:`DecodeConfig` with its measured
``for_device`` and the scoped overrides (:func:`decode_config`), and :func:`choose_num_splits`,
the split-KV heuristic. Plain Python, no kernel."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from tkit import _env
from tkit.kernels import _common as C

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
MAX_SEQLEN_Q = 16
MAX_SPLITS = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, FP8)


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernels.

    K and V reach the dots through Triton's software pipeline (cp.async into shared memory,
    read in the MMA operand layouts). An fp8 cache whose rows are whole 4-byte words
    (head dim >= 64) is streamed as int32 words, each converted into four float16
    quarters in the operand layout (V gathered a word at a time); other fp8 caches are
    read a byte at a time (``LDS.U8``: the B operand of P @ V wants consecutive keys, 128
    bytes apart, and there is no 8-bit ``ldmatrix.trans`` on sm_90). A paged loop keeps
    one K/V tile in flight below 5 stages (the block-table read takes part of the
    pipeliner's stages), two from 5, three from 7.

    block_n: keys per tile (a power of 2 >= 16), independent of the page size.
    sub_n: keys per sub-tile (a power of 2 >= 16 dividing block_n; None: block_n): a tile's
        loads are in flight together, its converted operands live one sub-tile at a time.
    block_m: the most packed (query, head) rows in one M tile (a power of 2 >= 16).
    num_warps, num_stages: of the split kernel (the software pipeline streams K/V tiles).
    num_splits: None lets :func:`choose_num_splits` decide; an int forces it (the call's own
        ``num_splits`` argument wins over both).
    ctas_per_sm: resident programs per SM that the split heuristic counts as slots.
    split_bytes: K+V bytes one split should stream at most (the split heuristic's floor on the
        number of splits, so that the longest sequence of a mixed batch is not one long tail).
    max_registers: None, or a cap on the split kernel's registers a thread (Triton's
        ``maxnreg``): more resident programs an SM at the price of spills, for experiments.
    combine: how several splits are merged: "launch" (a combine kernel after the split
        kernel) or "fused" (the last split of each (sequence, kv head, M tile) to finish
        merges them in the split kernel, counting on int32 counters zeroed per call: a fill
        launch instead of the combine launch).
    qk: how an fp8 cache's scores are computed: "mma" (K converted to float16 in registers,
        float16 MMAs) or "wgmma_fp8" (sm_90, 16-bit queries, the word pipeline's caches with
        a power-of-2 head dim from 64 to 256: the scores transposed, keys as M, by an fp8
        ``wgmma`` that reads K from shared memory as loaded, with the query split into hi and
        lo fp8 parts, ~8 significant bits as bfloat16 has; M tiles of 8 or 16 query rows
        (at most ``block_m``); wants 4 warps (a warpgroup) and 64 to 256 keys a tile).
        Elsewhere "mma" runs.
    """

    block_n: int = 64
    sub_n: Optional[int] = None  # noqa: UP045
    block_m: int = 64
    num_warps: int = 4
    num_stages: int = 3
    num_splits: Optional[int] = None  # noqa: UP045
    ctas_per_sm: int = 2
    split_bytes: int = 2 << 20
    max_registers: Optional[int] = None  # noqa: UP045
    combine: str = "launch"
    qk: str = "mma"

    @classmethod
    def for_device(cls, head_dim: int, cache_itemsize: int, paged: bool = True,
                   programs: int = 0, sms: int = 0, page_size: int = 0,
                   fp8_mma: bool = False) -> DecodeConfig:
        """The default for this head dim, cache element size and layout (``paged``: a block
        table; else a dense cache); docs/NOTES.md has the H200 sweeps of B32 Hq32/Hkv8 D128
        L8192, dense and paged, that chose the D=128 rows. Otherwise K tiles of 16 KB (64 keys
        at D=128 in 16 bits, 32 at D=256), 4 warps, 3 stages. The interpreter pays per tile,
        not per element, but tests want several tiles and splits on tiny caches: 16-key
        tiles there. ``programs``, ``sms``: the grid the dense 16-bit D=128 default makes
        (programs, splits included) and the SM count; more programs than one wave of three
        an SM take the 4-warp config instead (below). ``page_size``: the cache's (0: dense
        or not known). ``fp8_mma``: the call can take ``qk="wgmma_fp8"`` (sm_90, 16-bit
        queries, at most 8 packed rows a kv head: one 8-row M tile); ``programs`` is then
        its unsplit grid (sequences x kv heads).

        fp8 at D=128, paged with pages of 64 keys or more, ``fp8_mma``, an unsplit grid of
        80-100% of one wave of 2 programs an SM: the fp8 wgmma scores, 128-key tiles (two
        pages at page 64), 4 warps, 5 stages (two tiles in flight, 89 KB), one split (the
        planner takes the word pipeline where it would split). Its time is set per program,
        not by HBM (B33 took 1% longer than B32 for 3% more work; an L2 prefetch size on
        its cp.async copies, which Triton emits without one, gained nothing at 128 bytes and
        cost 2% at 256): at B32 Hkv8 0.554-0.561x
        the bf16 page-64 time on the H200 against 0.568-0.580x for the word pipeline below;
        elsewhere it lost or tied, split or not (B24 0.549 unsplit / 0.577 in 4 splits, B16
        / B40 / B64 0.531 / 0.615 / 0.550, against the word pipeline's 0.555 and 0.530 /
        0.577 / 0.535; docs/NOTES.md, "thirteenth session"). Where the wgmma does not apply
        after all (a cache not readable as words), the launcher plans again with
        ``fp8_mma`` off.

        fp8 at D=128 otherwise: the pipelined loops reading words (above), 2 warps, 64-key tiles,
        5 stages (two K/V tiles in flight a program even when paged): 216 registers, 40 KB,
        4 programs an SM, so the split heuristic counts 4 slots an SM (B32: 2 splits). Page
        64 with per-token scales took 0.563-0.578x the bf16 page-64 time on the H200, against
        0.79x for the register-prefetch loop (the default before: 200 registers, 2 programs
        an SM), 0.59-0.60x for 1 warp and 0.69-0.76x for 4 warps (cross-warp softmax through
        shared memory every tile). The register-prefetch loop is deleted: 16-bit caches never
        took it either (0.99-1.01x of the pipeline at 64 keys, slower at 32 and 128).

        Dense 16-bit D=128: 8 warps take 80 registers, and at 3 stages two K/V tiles are in
        flight a program (72 KB, three programs an SM); 4 MB a split keeps B32 L8192 at one
        split, so no combine launch follows. H200, whole calls against the 4-warp, 2-stage,
        2 MB config: B32 L8192 4.48 / 4.39 TB/s, 4 queries 4.46 / 4.32, B1 L131072 (29
        splits) 4.06 / 3.78, but B128 L1024 (1024 programs: 2.6 waves of three an SM against
        1.9 of four) 4.09 / 4.25: grids of more than one wave keep the 4-warp config.

        Paged 16-bit D=128 whose pages are smaller than a tile (each key's block read from
        the table): the splits are merged by the last split to finish (``combine="fused"``:
        a fill launch of the counters instead of the combine launch). H200, B32 page 16:
        4.20 / 4.17 TB/s against the combine launch in two runs (0.958-0.960x the dense
        default's TB/s, against 0.949-0.953x); page 64 (one table read a tile) gained
        nothing (0.997-1.000x) and keeps the launch, as does fp8 (0.998-0.999x)."""
        if _env.INTERPRET:
            return cls(block_n=16, block_m=16, num_stages=1)
        block_d = max(16, C.next_power_of_2(head_dim))
        block_n = max(16, min(128, (16 << 10) // (block_d * cache_itemsize)))
        if (cache_itemsize == 1 and block_d == 128 and fp8_mma and paged and page_size >= 64
                and 0.8 * 2 * sms <= programs <= 2 * sms):
            return cls(block_n=128, num_warps=4, num_stages=5, ctas_per_sm=2, qk="wgmma_fp8")
        if cache_itemsize == 1 and block_d == 128:
            return cls(block_n=64, num_warps=2, num_stages=5, ctas_per_sm=4)
        if cache_itemsize == 2 and block_d == 128 and not paged and not programs > 3 * sms > 0:
            return cls(block_n=64, num_warps=8, num_stages=3, split_bytes=4 << 20)
        if cache_itemsize == 2 and block_d == 256 and not paged:
            # a split streams up to 8 MB (8192 keys): B32 Hkv8 L8192 fills one wave of 2
            # programs an SM unsplit, with no combine launch (the 2 MB floor's 4 splits lost)
            return cls(block_n=block_n, num_stages=3, split_bytes=8 << 20)
        # 16-bit D=128, dense: two stages take 39 KB of shared memory and four programs fit an
        # SM (the register limit), three take 72 KB and three fit; the dense cache then read
        # 4.1 TB/s instead of 3.5 (a paged cache, whose loop keeps one K/V buffer at either
        # setting, read 4.0 both ways); other head dims keep three until measured
        stages = 2 if cache_itemsize == 2 and block_d == 128 else 3
        if cache_itemsize == 2 and block_d == 128 and paged and 0 < page_size < block_n:
            return cls(block_n=block_n, num_stages=stages, combine="fused")
        return cls(block_n=block_n, num_stages=stages)


QKS = ("mma", "wgmma_fp8")

_OVERRIDES = C.ConfigOverrides(DecodeConfig)


def decode_config(**overrides):
    """Override fields of :class:`DecodeConfig` for the calls made inside (this thread only);
    an unknown field is a TypeError naming it. For experiments and tests; calls never tune."""
    return _OVERRIDES.scope(**overrides)


def current_config(head_dim: int, cache_itemsize: int, paged: bool = True,
                   programs: int = 0, sms: int = 0, page_size: int = 0,
                   fp8_mma: bool = False) -> DecodeConfig:
    cfg = DecodeConfig.for_device(head_dim, cache_itemsize, paged, programs, sms, page_size,
                                  fp8_mma)
    return _OVERRIDES.apply(cfg)


#: the most key tiles a split of one program an SM may hold (:func:`choose_num_splits`)
ONE_AN_SM_TILES = 16


def choose_num_splits(work: int, n_tiles: int, sms: int, *, ctas_per_sm: int = 2,
                      min_splits: int = 1, max_splits: int = MAX_SPLITS) -> int:
    """Splits of each (sequence, kv head, M tile) program's keys.

    ``work``: programs without splitting (batch * kv heads * M tiles); ``n_tiles``: key tiles
    of the longest possible sequence; ``min_splits``: the floor from ``split_bytes``.

    Few programs (at most an eighth of the SMs: one or two sequences): one program an SM,
    where that leaves each split at most :data:`ONE_AN_SM_TILES` tiles. Short splits are
    mostly a program's fixed cost, so fewer, longer ones win; longer splits stream faster two
    an SM, as the rule below has them (the H200 figures are in docs/NOTES.md, "thirty-first
    session").

    Otherwise, among ``min_splits .. max_splits`` (no more than there are tiles) take the
    smallest whose waves over ``sms * ctas_per_sm`` slots are at least 85% as full as the
    best's (FlashAttention-2's rule, with the floor added: its batch-wide wave count ignores
    that one long sequence of a mixed batch would be a tail of few programs)."""
    cap = max(1, min(max_splits, n_tiles))
    lo = max(1, min(min_splits, cap))
    if work <= 0:
        return 1
    if 8 * work <= sms:
        one = max(lo, min(cap, sms // work))
        if math.ceil(n_tiles / one) <= ONE_AN_SM_TILES:
            return one
    slots = max(1, sms * ctas_per_sm)
    if lo == 1 and work >= 0.8 * slots:
        return 1
    eff = {}
    for s in range(lo, cap + 1):
        waves = work * s / slots
        eff[s] = waves / math.ceil(waves)
    best = max(eff.values())
    for s in range(lo, cap + 1):
        if eff[s] >= 0.85 * best:
            return s
    return lo




# --------------------------------------------------------------------------------------------
# append_kv's launch configuration (its own dataclass and scope: the decode kernel's fields
# above do not apply to it)
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AppendConfig:
    """Launch parameters of ``_append_kv_kernel``.

    block_t: tokens a program writes (a power of 2): each moves its keys and values, so a
        program has block_t x heads x head_dim x 2 elements in flight.
    num_warps: of the append kernel.
    """

    block_t: int = 4
    num_warps: int = 4

    @classmethod
    def for_device(cls) -> AppendConfig:
        """H200, kernel time with a cold L2 (docs/NOTES.md, "quant and append_kv"): one token
        a program (4 KB of K+V at 8 heads x 128 in bf16, its loads waiting on the slot's) took
        11.3 us for 4096 tokens; 4 tokens a program at 4 warps (8 16-byte loads a thread in
        flight, the loads masked by token, not waiting on the slot) 10.75 us, and every other
        block_t 1-16 x warps 2-8 11.2-11.6 us: the tokens a program are not what limits this
        33.6 MB kernel. fp8 per token: 12.4-13.3 us at 2-4 tokens a program."""
        if _env.INTERPRET:
            return cls(block_t=4, num_warps=4)
        return cls()


_APPEND_OVERRIDES = C.ConfigOverrides(AppendConfig)


def append_config(**overrides):
    """Override fields of :class:`AppendConfig` for the ``append_kv`` calls made inside (this
    thread only); an unknown field is a TypeError naming it. For experiments and tests."""
    return _APPEND_OVERRIDES.scope(**overrides)


def current_append_config() -> AppendConfig:
    return _APPEND_OVERRIDES.apply(AppendConfig.for_device())
