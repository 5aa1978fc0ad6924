"""The Gluon Hopper forward's configuration and scope: its constants, the (BLOCK_N, STAGES[,
WS]) candidates with their shared memory (``_smem_bytes``), ``configs`` and ``default_config``,
and ``supported`` (which inputs the kernel takes, with the TMA checks). Plain Python; the
kernels are in ``_hopper_kernels.py``, the launcher in ``hopper.py``."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
from triton.experimental.gluon import language as gl

from tkit.kernels import _device as D

BLOCK_M = 128
NUM_WARPS = 8
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)
# Shared memory per block on sm_90 (227 KB); the kernel's own need is computed in _smem_bytes.
SMEM_LIMIT = D.SM90_SMEM_LIMIT

# (BLOCK_N, STAGES[, WS[, PERSISTENT]]) candidates; a config is kept for a head dim when its shared
# memory fits (``configs``). Measured on the H200 (B=4 H=16 S=4096 bf16, median of 3 interleaved
# rounds, 2026-11-30, TFLOP/s, non-causal / causal): D=128: n128 s3 499.4 / 455.0, n64 s4 464.8 /
# 433.6, n128 s2 447.4 / 398.5, n64 s3 446.4 / 430.5, n64 s6 445.4 / 425.8 (tkit's Triton forward
# 475.7 / 413.3 at its best tile, SDPA flash 347.9 / 303.0, cuDNN 586.7 / 519.6 in the same rounds);
# D=64: n64 s4 411.2 / 375.2, n128 s3 340.3 / 304.8 (Triton 424.5 / 362.4). Warp-specialized (third
# entry True), a later run (h200-2026-11-30-l, 3 rounds, D=128): n128 s3 ws 580.6 / 569.8, n64 s4 ws
# 516.1 / 485.5, n128 s2 ws 447.8 / 395.4, beside n128 s3 499.9 / 455.0, Triton 479.1 / 426.4, SDPA
# flash 341.3 / 304.3 and cuDNN 587.2 / 505.8 in the same rounds. ``DEFAULTS`` holds the best per
# head dim.


class Candidate(NamedTuple):
    """One config of the Gluon forward: key block, ring stages, the warp-specialized kernel,
    its persistent form, CTAs an SM (2: the WS_TWO_CTA_* registers). :func:`config_dict`
    makes its launch config."""
    block_n: int
    stages: int
    ws: bool = False
    persistent: bool = False
    ctas: int = 1


CONFIGS = [
    Candidate(128, 3), Candidate(128, 2), Candidate(64, 4), Candidate(64, 3), Candidate(64, 6),
    Candidate(128, 4),
    Candidate(128, 3, ws=True), Candidate(128, 2, ws=True), Candidate(64, 4, ws=True),
    Candidate(64, 6, ws=True),
    Candidate(64, 4, ws=True, persistent=True), Candidate(64, 5, ws=True, persistent=True),
    # persistent with 128-key blocks: two stages beside the two Q buffers at D=128, three or
    # four at D=64
    Candidate(128, 2, ws=True, persistent=True), Candidate(128, 3, ws=True, persistent=True),
    Candidate(128, 4, ws=True, persistent=True),
    # two CTAs an SM, D=64 causal's defaults: persistent n64 s4 at short tiles, per tile n64
    # s3 elsewhere (docs/NOTES.md)
    Candidate(64, 4, ws=True, persistent=True, ctas=2), Candidate(64, 3, ws=True, ctas=2),
    # what fits at D=256 (a Q tile of 64 KB, K and V 64 KB a 64-key stage)
    Candidate(64, 2, ws=True), Candidate(32, 4, ws=True), Candidate(64, 2),
]
# D=256: the warp-specialized n64 s2 led every config at every shape once K's ring slots were
# handed back a block before V's (0.90-1.06x cuDNN; n32 s4 0.75-0.80x, docs/NOTES.md).
DEFAULTS = {128: Candidate(128, 3, ws=True), 64: Candidate(64, 4),
            256: Candidate(64, 2, ws=True)}
# Where a causal call's default differs: at D=64 the warp-specialized n64 s3 at two CTAs an
# SM led the one-partition n64 s4 by 1-2.5% from 2048 keys (docs/NOTES.md).
CAUSAL_DEFAULTS = {64: Candidate(64, 3, ws=True, ctas=2)}
# The persistent warp-specialized kernel (PERSISTENT=True: CTAS CTAs an SM take the tiles from
# a counter) is the default (``config_for``) in the cases of PERSISTENT_RULES (head dim, causal)
# where there is more than one wave of tiles, each rule up to ``max_keys`` keys a tile on
# average (causal: about (seqlen_k + BLOCK_M) / 2; the first rule of a case that holds wins).
# Short tiles are where the per-tile grid pays each CTA's start (Q and the first K/V blocks'
# latency, the first block without overlap) and its epilogue with the tensor cores idle.
# Since K's ring slots are handed back a block before V's, the two-stage n128 s2 (all the
# ring that fits beside two Q buffers at D=128) also leads at long tiles: D=128 causal takes
# n64 s5 up to 768 keys a tile (it led n128 s2 by 5-8% at 576, tied at 704) and n128 s2
# beyond, at any length (2-7% ahead of the better of n64 s5 and the per-tile kernel from
# 832 keys, GQA and 16K tokens included); without a mask n128 s2 up to 4096 keys (beyond, it
# tied the per-tile kernel). D=64: n128 s4 without a mask at every length (at 2048 and 4096
# keys it led the Triton kernel by 3-5%); causal at two CTAs an SM (n64 s4) up to 1024 keys
# (576 a tile), lost at 2048 (1088 a tile), where every one-CTA persistent config lost to the
# per-tile kernel too. D=64 without a mask takes the Gluon kernel only there
# (TRITON_UNLESS_PERSISTENT): in one wave of tiles the Triton kernel stays. Measurements in
# docs/NOTES.md.


@dataclass(frozen=True)
class PersistentRule:
    """One persistent default of a (head dim, causal) case: its :class:`Candidate` (a
    persistent one) and the most keys a tile (on average) it takes (None: no limit)."""
    candidate: Candidate
    max_keys: int | None

    def config(self) -> dict:
        return config_dict(*self.candidate)


def _persistent(block_n: int, stages: int, ctas: int = 1) -> Candidate:
    return Candidate(block_n, stages, ws=True, persistent=True, ctas=ctas)


PERSISTENT_RULES = {
    (128, False): (PersistentRule(_persistent(128, 2), max_keys=4096),),
    (128, True): (PersistentRule(_persistent(64, 5), max_keys=768),
                  PersistentRule(_persistent(128, 2), max_keys=None)),
    (64, False): (PersistentRule(_persistent(128, 4), max_keys=None),),
    # a limit between the measured win (576 keys a tile) and loss (1088)
    (64, True): (PersistentRule(_persistent(64, 4, ctas=2), max_keys=768),),
}
TRITON_UNLESS_PERSISTENT = frozenset({(64, False)})

# Warp-specialized launch: 4 warps (consumer warpgroup 0, the default partition) + 4 (consumer
# warpgroup 1) + 1 (loader) = 9 warps, 3 warpgroups once rounded. Registers are allotted per
# warpgroup (setmaxnreg): the loader's warpgroup drops to 24 a thread, each consumer
# warpgroup gets 240 (D=128 needs about 200 in the non-WS kernel); the launch cap of 168 a
# thread keeps 3 warpgroups within the 64K-register file (168 * 384 <= 65536) and is what the
# default partition's share is computed from (3 * 168 - 240 - 24 = 240).
WS_CONSUMER_REGS = gl.constexpr(240)
WS_LOADER_REGS = gl.constexpr(24)
WS_MAXNREG = 168
# Two CTAs an SM (D=64, where a consumer's O is 32 registers a thread): the launch cap 80 keeps
# 2 x 3 warpgroups within the register file (80 * 384 * 2 <= 65536); consumer warpgroup 1 is
# raised to 104 and the default partition gets 3 * 80 - 104 - 24 = 112 (a few spills outside
# the key loop at BLOCK_N = 64); both CTAs' shared memory must fit the SM's.
WS_TWO_CTA_MAXNREG = 80
WS_TWO_CTA_CONSUMER_REGS = 104
SMEM_PER_SM = 233472  # 228 KB, of which 1 KB is reserved a CTA


def _smem_bytes(block_n: int, stages: int, head_dim: int, itemsize: int = 2,
                ws: bool = False, persistent: bool = False) -> int:
    q_rows = 2 * BLOCK_M if persistent else BLOCK_M  # the persistent kernel's two Q buffers
    tiles = (q_rows + 2 * stages * block_n) * head_dim * itemsize
    if not ws:  # mbarriers (8 bytes each, counted twice over) and slack for alignment
        return tiles + 16 * 2 * stages + 64
    # and per slot an empty barrier; the warp-specialized region also keeps the values it
    # hands to the worker partitions in shared memory (232 to 256 bytes in the compiled
    # configs, with alignment; ``metadata.shared`` is checked against this in the tests);
    # persistent: a full and an empty barrier a Q buffer
    return tiles + 16 * 4 * stages + 64 + 256 + (64 if persistent else 0)


def _cfg_key(c) -> Candidate:
    """The :class:`Candidate` of a launch config dict, a Candidate or a tuple of its fields."""
    if isinstance(c, dict):
        return Candidate(c["BLOCK_N"], c["STAGES"], bool(c.get("WS", False)),
                         bool(c.get("PERSISTENT", False)), c.get("CTAS", 1))
    return Candidate(*c)


def config_dict(block_n: int, stages: int, ws: bool = False, persistent: bool = False,
                ctas: int = 1) -> dict:
    """The launch config of one candidate: the warp-specialized kernel runs num_warps = 4 in
    its default partition and the register cap WS_MAXNREG (see above); ``persistent`` (a
    warp-specialized kernel) runs ``ctas`` CTAs an SM over all the tiles; ``ctas=2`` (a
    warp-specialized kernel) takes the WS_TWO_CTA_* registers, so that two CTAs fit an SM."""
    if persistent and not ws:
        raise ValueError("the persistent forward is the warp-specialized kernel (WS=True)")
    if ctas not in (1, 2) or (ctas == 2 and not ws):
        raise ValueError(f"ctas={ctas}: 1, or 2 for the warp-specialized kernel")
    if ws:
        d = dict(BLOCK_N=block_n, STAGES=stages, WS=True, num_warps=4, maxnreg=WS_MAXNREG)
        if persistent:
            d["PERSISTENT"] = True
        if ctas == 2:
            d.update(maxnreg=WS_TWO_CTA_MAXNREG, CONSUMER_REGS=WS_TWO_CTA_CONSUMER_REGS,
                     CTAS=2)
        return d
    return dict(BLOCK_N=block_n, STAGES=stages, num_warps=NUM_WARPS)


def _fits(block_n, stages, head_dim, itemsize, ws, persistent, ctas=1) -> bool:
    b = _smem_bytes(block_n, stages, head_dim, itemsize, ws, persistent)
    return b <= SMEM_LIMIT and ctas * (b + 1024) <= SMEM_PER_SM


def configs(head_dim: int, itemsize: int = 2, ws: bool | None = None) -> list[dict]:
    """The configs of :data:`CONFIGS` that fit shared memory at this head dim, as dicts (only
    the warp-specialized ones with ``ws=True``, only the others with ``ws=False``)."""
    out = []
    for c in CONFIGS:
        bn, st, w, ps, ctas = _cfg_key(c)
        if ws is not None and w != ws:
            continue
        if _fits(bn, st, head_dim, itemsize, w, ps, ctas):
            out.append(config_dict(bn, st, w, ps, ctas))
    return out


@functools.cache
def default_config(head_dim: int, itemsize: int = 2) -> dict:
    """The measured best of :data:`DEFAULTS` where it fits, else the first config that does.
    Cached (computed per call it cost ~20 us of Gluon layout work); callers copy it."""
    fits = configs(head_dim, itemsize)
    want = DEFAULTS.get(head_dim)
    for c in fits:
        if want is not None and _cfg_key(c) == _cfg_key(want):
            return c
    return fits[0]


def config_for(head_dim: int, itemsize: int, seqlen_q: int, seqlen_k: int, causal: bool,
               tiles: int, sms: int) -> dict:
    """The config a call without one launches: the persistent kernel where its rule above
    holds (``tiles``: batch * heads * query blocks, ``sms`` the GPU's), else the causal
    default where one is set and fits, else :func:`default_config`. A new dict (callers may
    pop from it)."""
    rule = _persistent_rule(head_dim, itemsize, seqlen_k, causal, tiles, sms)
    if rule is not None:
        return rule.config()
    if causal and head_dim in CAUSAL_DEFAULTS:
        bn, st, ws, ps, ctas = _cfg_key(CAUSAL_DEFAULTS[head_dim])
        if _fits(bn, st, head_dim, itemsize, ws, ps, ctas):
            return config_dict(bn, st, ws, ps, ctas)
    return dict(default_config(head_dim, itemsize))


def _persistent_rule(head_dim, itemsize, seqlen_k, causal, tiles, sms) -> PersistentRule | None:
    """The first :class:`PersistentRule` of this case that holds, else None."""
    if tiles <= sms:
        return None
    keys = (seqlen_k + BLOCK_M) / 2 if causal else seqlen_k
    for rule in PERSISTENT_RULES.get((head_dim, bool(causal)), ()):
        if rule.max_keys is not None and keys > rule.max_keys:
            continue
        c = rule.candidate
        if _fits(c.block_n, c.stages, head_dim, itemsize, c.ws, c.persistent, c.ctas):
            return rule
    return None


def declines(head_dim: int, itemsize: int, seqlen_k: int, causal: bool, tiles: int,
             sms: int) -> str | None:
    """Why ``flash_attention`` leaves a call that :func:`supported` accepts to the Triton
    kernel (None: it does not): the TRITON_UNLESS_PERSISTENT cases outside the persistent
    rule."""
    case = (head_dim, bool(causal))
    if (case in TRITON_UNLESS_PERSISTENT
            and _persistent_rule(head_dim, itemsize, seqlen_k, causal, tiles, sms) is None):
        limits = [r.max_keys for r in PERSISTENT_RULES[case]]
        limit = None if None in limits else max(limits)
        return (f"head_dim {head_dim}{' causal' if causal else ''}: the Gluon kernel only "
                f"where the persistent one applies (> {sms} tiles"
                f"{'' if limit is None else f' of <= {limit} keys'}); the Triton kernel is "
                "faster elsewhere")
    return None


# --------------------------------------------------------------------------------------------
# Scope
# --------------------------------------------------------------------------------------------
def _tma_strides(t: torch.Tensor) -> list[int]:
    """The strides a TMA descriptor gets for ``t``: a dimension of size 1 is never stepped
    through, so its stride (arbitrary after some views) is replaced by a valid one."""
    return [st if n > 1 else t.shape[-1] for n, st in zip(t.shape, t.stride())]


def _tma_reason(t: torch.Tensor, name: str) -> str | None:
    es = t.element_size()
    if t.stride(-1) != 1:
        return f"{name} needs a unit head_dim stride for TMA (got {t.stride(-1)})"
    if t.data_ptr() % 16:
        return f"{name}'s base pointer is not 16-byte aligned (TMA)"
    for n, st in zip(t.shape[:-1], t.stride()[:-1]):
        if n > 1 and (st <= 0 or (st * es) % 16):
            return (f"{name}'s strides {tuple(t.stride())} are not positive multiples of 16 "
                    "bytes (TMA)")
    return None


def supported(q, k, v, causal=False, window=(-1, -1), softcap=0.0, varlen=False):
    """None when :func:`forward` handles these inputs, else the reason it does not.

    The checks that need no GPU come first (features, dtype, shapes, strides), the device
    last, so that every reason can be seen on a machine without a GPU."""
    if varlen:
        return "varlen is not supported"
    if window is not None and tuple(window) != (-1, -1):
        return "sliding windows are not supported"
    if softcap:
        return "softcap is not supported"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a tensor"
        if t.ndim != 4:
            return f"{name} is not (batch, seqlen, heads, head_dim)"
        if t.dtype not in DTYPES:
            return f"dtype {t.dtype} is not float16/bfloat16"
    if not (q.dtype == k.dtype == v.dtype):
        return "q, k, v have different dtypes"
    d = q.shape[-1]
    if d not in HEAD_DIMS or k.shape[-1] != d or v.shape[-1] != d:
        return f"head_dim {d} is not one of {HEAD_DIMS}"
    if k.shape != v.shape or k.shape[0] != q.shape[0]:
        return "k and v must match, with the batch of q"
    hq, hk = q.shape[2], k.shape[2]
    if hk == 0 or hq % hk:
        return f"query heads ({hq}) are not a multiple of key/value heads ({hk})"
    for name, t in (("q", q), ("k", k), ("v", v)):
        reason = _tma_reason(t, name)
        if reason is not None:
            return reason
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cuda":
            return f"{name} is not on a CUDA device"
    if not (q.device == k.device == v.device):
        return "q, k, v are on different devices"
    cap = D.capability(q.device)
    if tuple(cap) != (9, 0):
        return f"compute capability {tuple(cap)} is not (9, 0)"
    return None


# --------------------------------------------------------------------------------------------
# The backward (``_hopper_bwd_kernels.py``)
# --------------------------------------------------------------------------------------------
BWD_HEAD_DIMS = (64, 128)
BWD_NUM_WARPS = 8
BWD_DKDV_BLOCK = (64, 128)  # (query rows streamed, keys resident) of a dK/dV program
BWD_DQ_BLOCK_M = 128  # query rows resident in a dQ program
BWD_ROW_PAD = 128  # lse2 and delta rows are padded to a multiple of both query blocks


@dataclass(frozen=True)
class HopperBwdConfig:
    """One launch of the Gluon backward: the ring depth of the dK/dV kernel (Q and dO tiles of
    64 query rows), and the key block and ring depth of the dQ kernel."""
    dkdv_stages: int = 2
    dq_block_n: int = 64
    dq_stages: int = 3

    def __post_init__(self):
        for name in ("dkdv_stages", "dq_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"HopperBwdConfig.{name} must be an int >= 1, got {v!r}")
        if self.dq_block_n not in (32, 64, 128):
            raise ValueError(f"HopperBwdConfig.dq_block_n must be 32, 64 or 128, "
                             f"got {self.dq_block_n!r}")

    def smem_bytes(self, head_dim: int, itemsize: int = 2) -> tuple[int, int]:
        """Shared memory of (the dK/dV program, the dQ program), mbarriers included."""
        bm, bn = BWD_DKDV_BLOCK
        dkdv = ((2 * bn + 2 * self.dkdv_stages * bm) * head_dim * itemsize
                + 2 * self.dkdv_stages * bm * 4)  # and the lse2 and delta rows
        bars = 8 * (3 * self.dkdv_stages + 2)
        dq = (2 * BWD_DQ_BLOCK_M + 2 * self.dq_stages * self.dq_block_n) * head_dim * itemsize
        return dkdv + bars, dq + 8 * (2 * self.dq_stages + 2)


BWD_DEFAULTS = {128: HopperBwdConfig(dkdv_stages=2, dq_stages=3),
                64: HopperBwdConfig(dkdv_stages=3, dq_stages=4)}


def bwd_supported(q, k, v, causal=False, window=(-1, -1), softcap=0.0, varlen=False,
                  lse=None):
    """None when :func:`hopper.backward` handles these inputs, else the reason it does not:
    :func:`supported`'s checks, head_dim 64 or 128, sequences of at least one token and a
    contiguous lse."""
    shaped = all(isinstance(t, torch.Tensor) and t.ndim == 4 for t in (q, k))
    if shaped and q.shape[-1] not in BWD_HEAD_DIMS:
        return f"head_dim {q.shape[-1]} is not one of {BWD_HEAD_DIMS} (backward)"
    if shaped and (q.shape[1] == 0 or k.shape[1] == 0):
        return "an empty sequence"
    if lse is not None and not lse.is_contiguous():
        return "lse is not contiguous"
    padded = -(-q.shape[1] // BWD_ROW_PAD) * BWD_ROW_PAD if shaped else 0
    if shaped and 2 * q.shape[0] * q.shape[2] * padded >= 2**31:
        return "batch x heads x seqlen_q reaches 2**31 (the row vectors' 32-bit TMA coordinates)"
    return supported(q, k, v, causal, window, softcap, varlen)  # the device check last
