"""The block-scaled FP8 GEMM's Gluon kernel for Hopper (sm_90): its config
(:class:`HopperBlockConfig`, scoped overrides :func:`hopper_block_config`), scope
(:func:`supported`), launcher (:func:`launch`) and ahead-of-time build (:func:`compile_sm90`).
The kernel and its schedule are described in ``_fp8_block_hopper_kernels.py``; the math and
the Triton kernels it stands in for are in ``fp8_block.py``.

Scope: sm_90, a (M, K) with unit K stride and b (K, N) K-major (b.stride(0) == 1, the
``w.t()`` of an (N, K) weight: wgmma reads 8-bit operands only K-major), 16-byte aligned rows
(K a multiple of 16), an output whose rows are a multiple of 16 bytes (TMA store). Anything
else takes the Triton kernels, with the reason :func:`supported` gives.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from tkit.kernels import _common as C
from tkit.kernels import _device as D
from tkit.kernels.matmul import config as MC

WG_M = 64  # rows of one consumer warpgroup
GROUP_K = 128
# Three warpgroups once rounded (two 4-warp consumers, the 1-warp producer): the producer's
# drops to 24 registers a thread and each consumer's rises to 240; the launch cap of 168 a
# thread keeps 3 warpgroups within the 64K-register file (3 * 168 - 24 - 240 = 240 is the
# default partition's share), as the attention forward's warp-specialized kernel.
CONSUMER_REGS = 240
PRODUCER_REGS = 24
MAXNREG = 168
MAX_STAGES = 8
SCHEDULES = ("promote", "rescale")
#: the shortest K at which rows for one consumer (M <= 64) take 128 columns (resolve)
ONE_CONSUMER_LONG_K = 8192
#: the longest K the rescale schedule takes by itself (resolve)
RESCALE_MAX_K = 8192
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclasses.dataclass(frozen=True)
class HopperBlockConfig:
    """The Gluon kernel's launch config: the tile is 128 x ``block_n`` (two consumer
    warpgroups of 64 rows; 0: :func:`resolve` picks it from the shape); ``stages`` ring slots
    of one 128-deep group (0: as many as shared memory holds, at most 8; a count that does
    not fit is lowered to what does; 5 measured ahead of 6 and 4 at 8192^3 for 128 columns);
    ``group_m`` the tile order's section height (0: 16 for the rescale schedule's 256-column
    tiles, 8 else). One persistent CTA an SM (two never fit: 384 threads at 168 registers
    each).

    ``schedule``: how the 128-deep groups' scales are applied (``_fp8_block_hopper_kernels``).
    "promote" (the default): each group's MMA sum is fresh and added to a float32 accumulator
    times its scales, DeepSeek-V3's promotion (a sum beside the accumulator: 128 columns at
    most). "rescale" (opt-in, **fast-accumulation numerics**): one accumulator the MMAs add
    into across all of K, kept in units of the current group's scales and multiplied by the
    ratio of consecutive scales between groups, 256 columns (at 128 it measured behind the
    promote schedule); the running sum stays inside the fp8 MMA over all of K, which keeps
    about 13 bits of it at each k32 step: the numerics of torch._scaled_mm's
    use_fast_accum=True, several times the promote schedule's error (2e-3 of max |ref| at
    K = 1024, 5e-3 at 8192 on the H200), what the promotion exists to avoid; ~15% faster at
    8192^3. Where it does not apply (:func:`resolve`) the promote schedule runs.
    ``pingpong`` (the rescale schedule's; the promote schedule ignores it): the two consumer
    warpgroups issue their groups' MMAs in turn, so each one's rescale runs under the
    other's MMAs. ``shared_out`` (the rescale schedule's): one output staging tile that the
    consumers take in turn, each waiting for its TMA store to have read it, so that 4 ring
    slots fit at 256 columns."""

    block_n: int = 0
    stages: int = 5
    group_m: int = 0
    schedule: str = "promote"
    pingpong: bool = True
    shared_out: bool = False

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        allowed = {"promote": (0, 64, 128), "rescale": (0, 256)}[self.schedule]
        if self.block_n not in allowed:
            raise ValueError(f"block_n must be one of {allowed} with schedule="
                             f"{self.schedule!r} (256 columns only with the rescale schedule: "
                             f"the promote schedule's sum beside the accumulator would take "
                             f"256 registers a thread; 64 and 128 only with the promote one), "
                             f"got {self.block_n}")
        if not 0 <= self.stages <= MAX_STAGES or self.stages == 1:
            raise ValueError(f"stages must be 0 (auto) or 2..{MAX_STAGES}, got {self.stages}")
        if self.group_m < 0:
            raise ValueError(f"group_m must be 0 (auto) or >= 1, got {self.group_m}")

    consumers = 2  # consumer warpgroups (not a field: one alone spilled at 255 registers)

    @property
    def block_m(self) -> int:
        return WG_M * self.consumers


_OVERRIDES = C.ConfigOverrides(HopperBlockConfig)


def hopper_block_config(**overrides):
    """Override fields of :class:`HopperBlockConfig` for the calls made inside (this thread
    only); an unknown field is a TypeError naming it. For the config sweeps and tests."""
    return _OVERRIDES.scope(**overrides)


def current_config(cfg: HopperBlockConfig | None = None) -> HopperBlockConfig:
    return _OVERRIDES.apply(cfg if cfg is not None else HopperBlockConfig())


def resolve(cfg: HopperBlockConfig, M: int, N: int, K: int, sms: int,
            out_dtype: torch.dtype = torch.bfloat16, has_res: bool = False) -> HopperBlockConfig:
    """``cfg`` with a concrete schedule, block_n and group_m.

    The rescale schedule: 256 columns; with block_n 0 only for bfloat16 outputs with K up to
    :data:`RESCALE_MAX_K` (its running fp8 MMA sum over K: measured at 0.67 of the reference
    rule's bound at 8192^3 in bfloat16; float16 and float32 outputs promise more) where
    128 x 256 tiles fill every SM, else the promote schedule's choice; a residual always
    takes the promote schedule (its pointer tensors spill at 256 columns).
    The promote schedule: the given block_n, or (0) 64 where 128 x 128 tiles would number at
    most half the SMs (DeepSeek-V3's M <= 256 rows with N = 4096 or 2112, M = 128 with
    N = 7168: twice the programs; measured 0.64-0.87x of _scaled_mm per tensor there against
    0.50-0.74x), else 128 (M = 256 with N = 7168, 112 tiles: 0.53x at 64 columns against
    0.74x). Except with rows for one consumer (M <= 64) and K >= :data:`ONE_CONSUMER_LONG_K`:
    128 columns and the deepest ring (DeepSeek-V3's M=64 N=7168 K=16384, the one such shape
    measured: 0.61-0.63x against 0.46-0.47x at 64 columns in three runs; why 64 columns
    stall there, and not at M = 128 or K = 7168, is not known: docs/NOTES.md)."""
    if cfg.schedule == "rescale":
        if has_res or (not cfg.block_n and (
                out_dtype != torch.bfloat16 or K > RESCALE_MAX_K
                or C.cdiv(M, 2 * WG_M) * C.cdiv(N, 256) < sms)):
            cfg = dataclasses.replace(cfg, schedule="promote", block_n=0)
        else:
            # group_m 16: at 8192^3 a wave of 132 tiles then reads 33 MB of operands, 42 MB
            # at 8 (1345 against 1281 TFLOP/s)
            return dataclasses.replace(cfg, block_n=256, group_m=cfg.group_m or 16)
    if not cfg.group_m:
        cfg = dataclasses.replace(cfg, group_m=8)
    if cfg.block_n:
        return cfg
    few = C.cdiv(M, 2 * WG_M) * C.cdiv(N, 128) <= sms // 2
    if few and M <= WG_M and K >= ONE_CONSUMER_LONG_K:
        # rows for one consumer, long K: 128 columns with the deepest ring that fits (6)
        stages = 0 if cfg.stages == HopperBlockConfig.stages else cfg.stages
        return dataclasses.replace(cfg, block_n=128, stages=stages)
    return dataclasses.replace(cfg, block_n=64 if few else 128)


def _pingpong(cfg: HopperBlockConfig) -> bool:
    return cfg.pingpong and cfg.schedule == "rescale"


def _shared_out(cfg: HopperBlockConfig) -> bool:
    return cfg.shared_out and cfg.schedule == "rescale"


def smem_bytes(cfg: HopperBlockConfig, stages: int, out_itemsize: int) -> int:
    """Shared memory of one CTA: the ring (a and b tiles of one group a slot), one output
    tile a consumer, two mbarriers a slot, and the values the warp-specialized region hands to
    its partitions (up to 256 bytes with alignment, as in the attention forward), the two
    turn mbarriers of ``pingpong``."""
    ring = stages * (cfg.block_m + cfg.block_n) * GROUP_K
    outs = 1 if _shared_out(cfg) else cfg.consumers
    return (ring + outs * WG_M * cfg.block_n * out_itemsize + 16 * stages + 64 + 256
            + 16 * _pingpong(cfg) + 16 * _shared_out(cfg))


def stages_for(cfg: HopperBlockConfig, out_itemsize: int) -> int:
    """``cfg.stages`` (0: :data:`MAX_STAGES`), lowered to the most slots that fit the sm_90
    shared memory (the default 5 is for 128-column tiles; 256 columns hold 3)."""
    s = cfg.stages or MAX_STAGES
    while s > 2 and smem_bytes(cfg, s, out_itemsize) > D.SM90_SMEM_LIMIT:
        s -= 1
    return s


def supported(a, b, scale_a, scale_b, out_dtype, bias=None, residual=None) -> str | None:
    """None when the Gluon kernel takes these operands, else why not (the checks that need no
    GPU first, the device last, so every reason shows on a machine without one)."""
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        return "operands are not float8_e4m3fn"
    if out_dtype not in OUT_DTYPES:
        return f"output dtype {out_dtype} is not bf16/fp16/fp32"
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0 or K == 0:
        return "an empty dimension"
    ok_a, a_trans = MC._tma_ok(a)
    ok_b, b_trans = MC._tma_ok(b)
    if not ok_a or a_trans:
        return "a is not row-major with 16-byte aligned rows (TMA, K-major wgmma operand)"
    if not ok_b or not b_trans:
        return ("b is not K-major with 16-byte aligned columns (wgmma reads fp8 operands "
                "only K-major: b must be the .t() of an (N, K) weight)")
    if (N * out_dtype.itemsize) % 16:
        return f"output rows of {N * out_dtype.itemsize} bytes are not a multiple of 16 (TMA)"
    for name, t in (("a", a), ("b", b), ("scale_a", scale_a), ("scale_b", scale_b),
                    ("bias", bias), ("residual", residual)):
        if t is not None and t.device.type != "cuda":
            return f"{name} is not on a CUDA device"
    cap = D.capability(a.device)
    if tuple(cap) != (9, 0):
        return f"compute capability {tuple(cap)} is not (9, 0)"
    return None


@functools.cache
def _smem_layout(rows: int, cols: int, dtype: torch.dtype):
    from triton.experimental.gluon import language as gl

    gdt = {torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16,
           torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gdt)


def _descriptor(t: torch.Tensor, shape, strides, block):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(t, list(shape), list(strides), list(block),
                            _smem_layout(block[0], block[1], t.dtype))


def epilogue_args(scale_a, scale_b, bias, residual, activation) -> dict:
    """The block-scaled kernels' scale and epilogue arguments (this Gluon kernel's and the
    Triton kernels' of ``fp8_block.py`` take the same ones); absent tensors are replaced by
    ``scale_a``, a valid pointer their flags keep unread."""
    return dict(sa_ptr=scale_a, sb_ptr=scale_b,
                bias_ptr=bias if bias is not None else scale_a,
                res_ptr=residual if residual is not None else scale_a,
                stride_sam=scale_a.stride(0), stride_sak=scale_a.stride(1),
                stride_sbk=scale_b.stride(0), stride_sbn=scale_b.stride(1),
                stride_rm=residual.stride(0) if residual is not None else 0,
                stride_rn=residual.stride(1) if residual is not None else 0,
                stride_bias=bias.stride(0) if bias is not None else 0,
                HAS_BIAS=bias is not None, ACT=activation or "", HAS_RES=residual is not None)


def launch(a, b, scale_a, scale_b, out, bias=None, residual=None, activation=None,
           config: HopperBlockConfig | None = None) -> torch.Tensor:
    """out = the block-scaled product of a and b with the epilogue, by the Gluon kernel
    (operands that :func:`supported` accepts; ``residual`` already expanded to (M, N))."""
    from tkit.kernels.matmul._fp8_block_hopper_kernels import _fp8_block_ws_kernel

    M, K = a.shape
    N = b.shape[1]
    sms = D.sm_count(a.device)
    cfg = resolve(current_config(config), M, N, K, sms, out.dtype, residual is not None)
    stages = stages_for(cfg, out.element_size())
    bt = b.t()  # (N, K), unit K stride
    a_desc = _descriptor(a, (M, K), (MC._lead_stride(a, False), 1), (cfg.block_m, GROUP_K))
    b_desc = _descriptor(bt, (N, K), (MC._lead_stride(b, True), 1), (cfg.block_n, GROUP_K))
    c_desc = _descriptor(out, (M, N), (MC._lead_stride(out, False), 1), (WG_M, cfg.block_n))
    tiles = C.cdiv(M, cfg.block_m) * C.cdiv(N, cfg.block_n)
    progs = max(1, min(sms, tiles))
    C.launch(_fp8_block_ws_kernel, (progs,), a_desc=a_desc, b_desc=b_desc, c_desc=c_desc,
             **epilogue_args(scale_a, scale_b, bias, residual, activation), M=M, N=N, K=K,
             STAGES=stages, GROUP_M=cfg.group_m, RESCALE=cfg.schedule == "rescale",
             PINGPONG=_pingpong(cfg), SHARED_OUT=_shared_out(cfg),
             CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
             num_warps=4, maxnreg=MAXNREG)
    return out


# --------------------------------------------------------------------------------------------
# Ahead-of-time compilation (no GPU needed)
# --------------------------------------------------------------------------------------------
def compile_sm90(config: HopperBlockConfig | None = None, out_dtype=torch.bfloat16,
                 has_bias=False, activation="", has_res=False):
    """Compile the kernel for sm_90a ahead of time; returns Triton's compiled kernel
    (``.asm`` holds ``ttgir``, ``ptx``, ``cubin``; ``.metadata.shared`` the shared memory)."""
    from tkit.kernels._gluon import compile_sm90 as gluon_compile_sm90
    from tkit.kernels.matmul._fp8_block_hopper_kernels import _fp8_block_ws_kernel

    # what launches for a large output (resolve)
    cfg = resolve(current_config(config), 1 << 16, 1 << 16, 4096, 1, out_dtype, has_res)
    out_es = torch.empty((), dtype=out_dtype).element_size()
    stages = stages_for(cfg, out_es)
    tname = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[out_dtype]

    def desc(t, rows, cols, dtype):
        return f"tensordesc<{t}[{rows}, {cols}],{_smem_layout(rows, cols, dtype)!r}>"

    signature = dict(
        a_desc=desc("fp8e4nv", cfg.block_m, GROUP_K, torch.float8_e4m3fn),
        b_desc=desc("fp8e4nv", cfg.block_n, GROUP_K, torch.float8_e4m3fn),
        c_desc=desc(tname, WG_M, cfg.block_n, out_dtype),
        sa_ptr="*fp32", sb_ptr="*fp32", bias_ptr="*bf16" if has_bias else "*fp32",
        res_ptr="*bf16" if has_res else "*fp32", M="i32", N="i32", K="i32",
        stride_sam="i32", stride_sak="i32", stride_sbk="i32", stride_sbn="i32",
        stride_rm="i32", stride_rn="i32", stride_bias="i32",
        HAS_BIAS="constexpr", ACT="constexpr", HAS_RES="constexpr", STAGES="constexpr",
        GROUP_M="constexpr", RESCALE="constexpr", PINGPONG="constexpr", SHARED_OUT="constexpr",
        CONSUMER_REGS="constexpr", PRODUCER_REGS="constexpr",
    )
    values = dict(HAS_BIAS=bool(has_bias), ACT=activation or "", HAS_RES=bool(has_res),
                  STAGES=stages, GROUP_M=cfg.group_m, RESCALE=cfg.schedule == "rescale",
                  PINGPONG=_pingpong(cfg), SHARED_OUT=_shared_out(cfg),
                  CONSUMER_REGS=CONSUMER_REGS,
                  PRODUCER_REGS=PRODUCER_REGS)
    return gluon_compile_sm90(_fp8_block_ws_kernel, signature, values, num_warps=4,
                              maxnreg=MAXNREG)
