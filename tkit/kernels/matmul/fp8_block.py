"""Block-scaled FP8 GEMM (the DeepSeek-V3 recipe), the ``scale_a`` / ``scale_b`` block mode of
:func:`tkit.matmul_fp8`.

Math. ``a`` (M, K) and ``b`` (K, N) are float8_e4m3fn; ``scale_a`` (M, ceil(K / 128)) float32
holds one scale per 1x128 group of a row of a, ``scale_b`` (ceil(K / 128), ceil(N / 128))
float32 one per 128x128 block of b:

    out[m, n] = sum over k-blocks kb of  sa[m, kb] * sb[kb, n // 128] * (a[m, kb] . b[kb, n])

then the epilogue of :func:`tkit.matmul` (bias, activation, residual), rounded once.

The scales change every 128 values of K, so they cannot wait for the epilogue: each 128-deep
scale group's MMA sum starts fresh and is added to the float32 accumulator times
``sa[:, None] * sb`` (DeepSeek-V3's promotion; the per-tensor path promotes every BLOCK_K step
too, see matmul's ``_dot``). A K step of the TMA kernel is one group (BLOCK_K = 128) or two
(256: two TMA loads of each operand, two MMA sums, each promoted with its own scales; the
default), of the pointer kernel one. The scales are BLOCK_M floats of a (one a row, rows
K / 128 floats apart) and one float of b a group when the tile lies in one 128-column block
(two for BLOCK_N = 256), loaded one step ahead (Triton pipelines only the loads that feed a
dot, so a scale loaded where it is used put a global-memory round trip into every step).
Measured (H200, docs/NOTES.md): 893 TFLOP/s at 8192^3, 0.69x ``torch._scaled_mm`` per tensor;
every promotion still waits for the MMAs in flight (Triton puts a wgmma wait right after each
dot whose result the loop reads), the bubble that keeps it under the per-tensor kernel.

Kernels: on sm_90, where 128 x 256 tiles fill the SMs well enough (:func:`cuda_grid_reason`),
with no epilogue and bf16/fp16 outputs, the CUDA kernel of ``tkit.cuda_ext.gemm_fp8_block``
(the promotion at 128 x 256 tiles, which Gluon's register allocation could not hold; see
:func:`_cuda_choice`); otherwise the Gluon kernel of ``fp8_block_hopper.py`` (warp-specialized:
a TMA producer warp, two consumer warpgroups that issue each group's wgmma asynchronously and
promote the previous group's sum while it runs; opt-in,
``HopperBlockConfig(schedule="rescale")``: 128 x 256 tiles with one accumulator rescaled
between groups, whose running sum stays in the fp8 MMA over all of K, the fast-accumulation
numerics the promotion avoids) serves every call whose operands it takes (a row-major, b
K-major, TMA-aligned rows, see its ``supported``; :func:`backend` says which kernel a call gets
and why); the rest, forced paths (``path="tma"`` / ``"ptr"``), Triton configs and
``matmul_config`` overrides take the Triton kernels: ``_fp8_block_tma_kernel`` (Hopper:
persistent, TMA descriptors, the tile order and configs of matmul's TMA kernel) and
``_fp8_block_kernel`` (pointer-based, any strides, sm_80+ and the interpreter);
:func:`tkit.kernels.matmul.plan` picks between them as for matmul (shapes it would split along
K take the pointer kernel with ``PtrConfig.for_shape``'s tile, unsplit: a block-scaled split-K
is not written yet), with the ``matmul_config`` overrides (BLOCK_K 128 or 256 on the TMA
kernel, 128 on the pointer kernel; ``programs_per_sm`` launches two persistent programs an SM
for one-warpgroup tiles). The kernels of the per-tensor and per-row/column modes are separate
and unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from tkit import _env, _hooks
from tkit.kernels import _common as C
from tkit.kernels import _device as D
from tkit.kernels import _register as R
from tkit.kernels._numerics import INTERPRET as _INTERPRET
from tkit.kernels._numerics import interpreter_operand as _interpreter_operand
from tkit.kernels.matmul import _kernels as MK
from tkit.kernels.matmul import config as MC

BLOCK = 128  # the scale block along K (and N for b)


@triton.jit
def _scaled_step(a, b, sa, sb, acc):
    """acc += (a @ b) * sa[:, None] * sb[None, :]: one K block, its own MMA sum."""
    if _INTERPRET:
        a = _interpreter_operand(a)
        b = _interpreter_operand(b)
    return acc + tl.dot(a, b) * sa[:, None] * sb[None, :]


@triton.jit
def _block_scales(sa_ptrs, sb_ptr, kb, kb_last, off_n, N, stride_sak, stride_sbk, stride_sbn,
                  BLOCK_N: tl.constexpr):
    """The scales of K block ``kb`` (clamped to the last one: a step of two groups past K's
    end reads TMA's zeros, whose scale does not matter): sa for this tile's rows (BLOCK_M
    floats, one per row) and sb, a scalar when the tile lies in one 128-column block, else
    one of two scalars per column (BLOCK_N = 256)."""
    kb = tl.minimum(kb, kb_last)
    sa = tl.load(sa_ptrs + kb * stride_sak)
    sb_row = sb_ptr + kb * stride_sbk + (off_n // 128) * stride_sbn
    if BLOCK_N <= 128:
        sb = tl.load(sb_row)
    else:
        tl.static_assert(BLOCK_N == 256, "block-scaled TMA kernel: BLOCK_N <= 128 or 256")
        sb0 = tl.load(sb_row)
        sb1 = tl.load(sb_row + stride_sbn, mask=off_n + 128 < N, other=1.0)  # past N: unused
        sb = tl.where(tl.arange(0, BLOCK_N) < 128, sb0, sb1)
    return sa, sb


@triton.jit
def _promote(acc, d, sa, sb, BLOCK_N: tl.constexpr):
    """acc += d * sa[:, None] * sb: one scale group's MMA sum into the float32 accumulator
    (sb a scalar, or a (BLOCK_N,) row when the tile spans two 128-column blocks)."""
    if BLOCK_N <= 128:
        return acc + d * (sa * sb)[:, None]
    else:
        return acc + d * sa[:, None] * sb[None, :]


@triton.jit
def _fp8_block_kernel(
    a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, res_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    stride_sam, stride_sak, stride_sbk, stride_sbn, stride_rm, stride_rn, stride_bias,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Pointer-based block-scaled GEMM, one output tile per program (grouped order).
    BLOCK_K must be 128; BLOCK_N may span several 128-column scale blocks."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = MK._tile_pid(pid, num_pid_m, num_pid_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_am = offs_m % M  # see matmul's _matmul_kernel: valid rows, masked on the store
    offs_bn = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn
    sa_ptrs = sa_ptr + offs_am * stride_sam
    sb_ptrs = sb_ptr + (offs_bn // 128) * stride_sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        sa = tl.load(sa_ptrs + k * stride_sak)
        sb = tl.load(sb_ptrs + k * stride_sbk)
        acc = _scaled_step(a, b, sa, sb, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    acc = MK._epilogue(acc, offs_m, offs_n, M, N, sa_ptr, sb_ptr, bias_ptr, stride_bias,
                       res_ptr, stride_rm, stride_rn, 0, 0, HAS_BIAS, ACT, HAS_RES)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_group(a_desc, b_desc, off_m, off_n, off_k, A_TRANS: tl.constexpr,
                B_TRANS: tl.constexpr):
    """One 128-deep scale group of a and b through their TMA descriptors."""
    a, b = MK._tma_tiles(a_desc, b_desc, off_m, off_n, off_k, A_TRANS, B_TRANS)
    if _INTERPRET:
        a = _interpreter_operand(a)
        b = _interpreter_operand(b)
    return a, b


@triton.jit
def _fp8_block_tma_kernel(
    a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, res_ptr, M, N, K,
    stride_a, stride_b, stride_cm, stride_sam, stride_sak, stride_sbk, stride_sbn,
    stride_rm, stride_rn, stride_bias,
    A_TRANS: tl.constexpr, B_TRANS: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr, NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPI_SUBTILE: tl.constexpr, FLATTEN: tl.constexpr,
):
    """Persistent TMA block-scaled GEMM: matmul's ``_matmul_tma_kernel`` with the scales of
    each K block applied to its MMA sum (operand layouts and the epilogue as there).

    A K step is BLOCK_K = 128 (one scale group) or 256 (two groups, two descriptor loads of
    each operand and two MMA sums, each promoted with its own scales). The scales of the next
    step are loaded during this one (carried in registers): Triton's pipeliner only pipelines
    the loads that feed a dot, so a scale loaded where it is used put a global-memory round
    trip into every step. BLOCK_N <= 128 (inside one 128-column block of b) or 256."""
    tl.static_assert(BLOCK_K == 128 or BLOCK_K == 256,
                     "block-scaled TMA kernel: BLOCK_K is one or two scale groups (128, 256)")
    GROUPS: tl.constexpr = BLOCK_K // 128
    dtype = c_ptr.dtype.element_ty
    if A_TRANS:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[K, M], strides=[stride_a, 1],
                                           block_shape=[128, BLOCK_M])
    else:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_a, 1],
                                           block_shape=[BLOCK_M, 128])
    if B_TRANS:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_b, 1],
                                           block_shape=[BLOCK_N, 128])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_b, 1],
                                           block_shape=[128, BLOCK_N])
    if EPI_SUBTILE:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_cm, 1],
                                           block_shape=[BLOCK_M, BLOCK_N // 2])
    else:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_cm, 1],
                                           block_shape=[BLOCK_M, BLOCK_N])
    start_pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    kb_last = tl.cdiv(K, 128) - 1
    num_tiles = num_pid_m * num_pid_n
    tile_id_c = start_pid - NUM_SMS
    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=FLATTEN):
        pid_m, pid_n = MK._tile_pid(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        sa_ptrs = sa_ptr + ((off_m + tl.arange(0, BLOCK_M)) % M) * stride_sam
        sa0, sb0 = _block_scales(sa_ptrs, sb_ptr, 0, kb_last, off_n, N, stride_sak, stride_sbk,
                                 stride_sbn, BLOCK_N)
        if GROUPS == 2:
            sa1, sb1 = _block_scales(sa_ptrs, sb_ptr, 1, kb_last, off_n, N, stride_sak,
                                     stride_sbk, stride_sbn, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            a, b = _load_group(a_desc, b_desc, off_m, off_n, off_k, A_TRANS, B_TRANS)
            # the next step's scales, in flight during this step's MMAs
            kb = (ki + 1) * GROUPS
            na0, nb0 = _block_scales(sa_ptrs, sb_ptr, kb, kb_last, off_n, N, stride_sak,
                                     stride_sbk, stride_sbn, BLOCK_N)
            d0 = tl.dot(a, b)
            if GROUPS == 2:
                a, b = _load_group(a_desc, b_desc, off_m, off_n, off_k + 128, A_TRANS, B_TRANS)
                na1, nb1 = _block_scales(sa_ptrs, sb_ptr, kb + 1, kb_last, off_n, N, stride_sak,
                                         stride_sbk, stride_sbn, BLOCK_N)
                d1 = tl.dot(a, b)
                acc = _promote(acc, d0, sa0, sb0, BLOCK_N)
                acc = _promote(acc, d1, sa1, sb1, BLOCK_N)
                sa1, sb1 = na1, nb1
            else:
                acc = _promote(acc, d0, sa0, sb0, BLOCK_N)
            sa0, sb0 = na0, nb0
        tile_id_c += NUM_SMS
        pid_m, pid_n = MK._tile_pid(tile_id_c, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        offs_m = off_m + tl.arange(0, BLOCK_M)
        if EPI_SUBTILE:
            acc = tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2))
            acc = tl.permute(acc, (0, 2, 1))
            acc0, acc1 = tl.split(acc)
            offs_n0 = off_n + tl.arange(0, BLOCK_N // 2)
            acc0 = MK._epilogue(acc0, offs_m, offs_n0, M, N, sa_ptr, sb_ptr, bias_ptr,
                                stride_bias, res_ptr, stride_rm, stride_rn, 0, 0, HAS_BIAS,
                                ACT, HAS_RES)
            c_desc.store([off_m, off_n], acc0.to(dtype))
            acc1 = MK._epilogue(acc1, offs_m, offs_n0 + BLOCK_N // 2, M, N, sa_ptr, sb_ptr,
                                bias_ptr, stride_bias, res_ptr, stride_rm, stride_rn, 0, 0,
                                HAS_BIAS, ACT, HAS_RES)
            c_desc.store([off_m, off_n + BLOCK_N // 2], acc1.to(dtype))
        else:
            offs_n = off_n + tl.arange(0, BLOCK_N)
            acc = MK._epilogue(acc, offs_m, offs_n, M, N, sa_ptr, sb_ptr, bias_ptr, stride_bias,
                               res_ptr, stride_rm, stride_rn, 0, 0, HAS_BIAS, ACT, HAS_RES)
            c_desc.store([off_m, off_n], acc.to(dtype))


# --------------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------------
def _ptr_tile(M, N, K) -> MC.PtrConfig:
    if _env.INTERPRET:
        return MC.PtrConfig(block_m=32, block_n=64, block_k=BLOCK, num_warps=4, group_m=4)
    return MC.PtrConfig.for_shape(M, N, K, 1)


def _config(config, cls, default):
    """An explicit config of the kernel's class, else ``default`` with the active
    ``matmul_config`` overrides. BLOCK_K is a whole number of scale groups: 128 or 256 (two
    groups a step) for the TMA kernel, 128 for the pointer kernel; any other value is taken
    as 128."""
    if config is not None and not isinstance(config, cls):
        raise TypeError(f"config must be a {cls.__name__} for this kernel, got "
                        f"{type(config).__name__}")
    cfg = config if config is not None else MC.current(default)
    allowed = (BLOCK, 2 * BLOCK) if cls is MC.TmaConfig else (BLOCK,)
    return cfg if cfg.block_k in allowed else dataclasses.replace(cfg, block_k=BLOCK)


def _gluon_choice(a, b, scale_a, scale_b, out_dtype, bias, residual, path, config):
    """(the fp8_block_hopper module, None) when the Gluon Hopper kernel serves this call, else
    (None, why not). It serves unforced calls (``path`` None, no Triton config, no
    ``matmul_config`` override) and ``path="gluon"`` or a HopperBlockConfig, on sm_90 with
    operands that its :func:`supported` takes."""
    if path not in (None, "gluon"):
        return None, f"path {path!r} forced"
    if config is not None and type(config).__name__ != "HopperBlockConfig":
        return None, f"a {type(config).__name__} selects the Triton kernel"
    if path is None and config is None and MC.overridden():
        return None, "matmul_config overrides select the Triton kernels"
    if a.device.type != "cuda":
        return None, "not on a CUDA device"
    try:
        from tkit.kernels.matmul import fp8_block_hopper as FH
    except ImportError as e:  # a Triton without Gluon's Hopper API
        return None, f"Gluon unavailable: {e}"
    reason = FH.supported(a, b, scale_a, scale_b, out_dtype, bias, residual)
    return (FH, None) if reason is None else (None, reason)


def cuda_grid_reason(M: int, N: int, sms: int) -> str | None:
    """Why an unforced call of this shape stays off the CUDA kernel's 128 x 256 tiles for
    the Gluon kernel's narrower ones, else None: where they fill less than half the SMs. On
    the H200 the CUDA kernel led at 11 of DeepSeek-V3's 12 shapes at M = 1024 / 4096 in one
    run (K from 512 to 16384; 0.61-1.02x _scaled_mm per tensor against 0.56-1.04x;
    docs/NOTES.md), with 72 tiles on 132 SMs too (M=1024 N=2112), and with a last wave 18%
    full (M=4096 N=2112: 288 tiles) once stream-K split that wave (0.80x against 0.76x).
    Shapes below M = 1024 were not measured with it; the rule sends them to it wherever
    their tiles reach that floor (M = 512 with N > 4096 on 132 SMs)."""
    tiles = C.cdiv(M, 128) * C.cdiv(N, 256)
    if 2 * tiles < sms:
        return (f"{tiles} tiles of 128 x 256 fill less than half of the {sms} SMs (the Gluon "
                f"kernel's narrower tiles spread wider)")
    return None


def _cuda_choice(a, b, scale_a, scale_b, out_dtype, bias, residual, activation, path,
                 config, col_scale=False):
    """None when the CUDA kernel (``tkit.cuda_ext.gemm_fp8_block``: 128 x 256 tiles, each
    128-deep group as two 128-column sums, each promoted once its wgmmas are done) serves
    this call, else why not. It serves unforced calls and ``path="cuda"`` with no epilogue
    (bias, activation, residual: the Gluon kernel's), bf16 or fp16 outputs, the Gluon
    kernel's operand scope, unforced only where its tiles fill the SMs well enough
    (:func:`cuda_grid_reason`), and a build (``col_scale``: the per-column scale build) that
    has passed its self-test on this machine."""
    if path not in (None, "cuda"):
        return f"path {path!r} forced"
    if config is not None:
        return f"a {type(config).__name__} selects another kernel"
    if path is None and MC.overridden():
        return "matmul_config overrides select the Triton kernels"
    if bias is not None or residual is not None or activation:
        return "an epilogue (bias, activation, residual) is the Gluon kernel's"
    if out_dtype not in (torch.bfloat16, torch.float16):
        return f"output dtype {out_dtype} is not bf16/fp16"
    if a.device.type != "cuda":
        return "not on a CUDA device"
    try:
        from tkit.kernels.matmul import fp8_block_hopper as FH
    except ImportError as e:
        return f"Gluon unavailable for the scope check: {e}"
    reason = FH.supported(a, b, scale_a, scale_b, out_dtype)
    if reason is not None:
        return reason
    M, N = a.shape[0], b.shape[1]
    if path is None:
        why = cuda_grid_reason(M, N, D.sm_count(a.device))
        if why is not None:
            return why
    return _cuda_build_reason(a.device, out_dtype, col_scale)


_CUDA_BUILD: dict = {}


def _cuda_build_reason(device, out_dtype, col_scale=False) -> str | None:
    """Why the CUDA kernel's build for this output dtype (``col_scale``: the per-column scale
    build) cannot run on this device (no tkit.cuda_ext hook, no cupy, no nvcc, a failed build
    or self-test), worked out once a device, dtype and build."""
    key = (device.index or 0, out_dtype, col_scale)
    if key not in _CUDA_BUILD:
        try:  # tkit.cuda_ext's kernel, plugged in by the layer above (tkit/_hooks.py)
            if _hooks.cuda_fp8_block is None:
                raise ImportError("no CUDA block-scaled kernel is registered in tkit._hooks")
            why = _hooks.cuda_fp8_block().unavailable(out_dtype, col_scale=col_scale)
        except (ImportError, AttributeError) as e:
            why = f"tkit.cuda_ext unavailable: {e}"
        _CUDA_BUILD[key] = why
    return _CUDA_BUILD[key]


def backend(a, b, scale_a, scale_b, out_dtype=torch.bfloat16, bias=None, residual=None) -> str:
    """Which kernel the block mode launches for these operands, and why: "cuda (...)",
    "gluon (...)" or "triton <path> (reason the Gluon kernel does not serve)"."""
    if _cuda_choice(a, b, scale_a, scale_b, out_dtype, bias, residual, None, None,
                    None) is None:
        return ("cuda (sm_90a: warp-specialized TMA producer, two consumer warpgroups, "
                "128 x 256 tiles, each 128-deep group as two 128-column sums, each waited "
                "for and promoted)")
    fh, reason = _gluon_choice(a, b, scale_a, scale_b, out_dtype, bias, residual, None, None)
    if fh is not None:
        (M, K), N = a.shape, b.shape[1]
        cfg = fh.resolve(fh.current_config(), M, N, K, D.sm_count(a.device), out_dtype,
                         residual is not None)
        how = ("one accumulator rescaled between 128-deep groups (a running fp8 MMA sum "
               "over K)" if cfg.schedule == "rescale" else
               "each pair of 128-deep groups' second wgmma running under the first's "
               "promotion")
        return (f"gluon (sm_90: warp-specialized TMA producer, two consumer warpgroups, "
                f"128 x {cfg.block_n} tiles, {cfg.schedule} schedule: {how})")
    return f"triton {MC.plan(a, b, out_dtype).path} ({reason})"


def _fp8_block_impl(a, b, scale_a, scale_b, bias=None, residual=None, activation=None,
                    out_dtype=torch.bfloat16, path=None, config=None, scale_n=None):
    """The block mode's launch. ``path``: None (the CUDA kernel where it serves, see
    :func:`_cuda_choice`, else the Gluon Hopper kernel where it serves, see
    :func:`_gluon_choice`, else :func:`tkit.kernels.matmul.plan`'s choice), "cuda" or
    "gluon" (forced: a ValueError with the reason where it cannot serve), "tma" or "ptr" (the
    Triton kernels). ``config``: a HopperBlockConfig, TmaConfig or PtrConfig for that kernel.
    ``scale_n``: (N,) per-column scales of b in place of ``scale_b``'s blocks (the CUDA
    kernel's ``col_scale`` build only; from :func:`scales_as_block`)."""
    M, K = a.shape
    N = b.shape[1]
    out = C.empty((M, N), out_dtype, a.device)
    if out.numel() == 0:
        return out
    res = residual.expand(M, N) if residual is not None else None
    why_cuda = _cuda_choice(a, b, scale_a, scale_b, out_dtype, bias, res, activation, path,
                            config, col_scale=scale_n is not None)
    if why_cuda is None:
        # the build's self-test ran in _cuda_choice (once a device, output dtype and build)
        return _hooks.cuda_fp8_block().matmul_fp8_block(a, b, scale_a, scale_b, out_dtype,
                                                         out=out, check=False, scale_n=scale_n)
    if path == "cuda" or scale_n is not None:
        raise ValueError(f"the CUDA block-scaled kernel does not apply: {why_cuda}")
    fh, reason = _gluon_choice(a, b, scale_a, scale_b, out_dtype, bias, res, path, config)
    if fh is not None:
        return fh.launch(a, b, scale_a, scale_b, out, bias, res, activation, config)
    if path == "gluon" or type(config).__name__ == "HopperBlockConfig":
        raise ValueError(f"the Gluon block-scaled kernel does not apply: {reason}")
    p = MC.plan(a, b, out_dtype, path=path)
    from tkit.kernels.matmul.fp8_block_hopper import epilogue_args

    common = dict(a_ptr=a, b_ptr=b, c_ptr=out, M=M, N=N, K=K,
                  **epilogue_args(scale_a, scale_b, bias, res, activation))
    if p.path == "tma":
        _, a_trans = MC._tma_ok(a)
        _, b_trans = MC._tma_ok(b)
        sms = D.sm_count(a.device)
        cfg = _config(config, MC.TmaConfig, MC.TmaConfig.for_shape(M, N, K, 1, sms))
        D.ensure_tma_allocator()
        tiles = C.cdiv(M, cfg.block_m) * C.cdiv(N, cfg.block_n)
        progs = sms * max(1, cfg.programs_per_sm)
        C.launch(_fp8_block_tma_kernel, (max(1, min(progs, tiles)),), **common,
                 stride_a=MC._lead_stride(a, a_trans), stride_b=MC._lead_stride(b, b_trans),
                 stride_cm=out.stride(0), A_TRANS=a_trans, B_TRANS=b_trans, NUM_SMS=progs,
                 **cfg.launch_kwargs())
        return out
    cfg = _config(config, MC.PtrConfig, _ptr_tile(M, N, K))
    grid = (C.cdiv(M, cfg.block_m) * C.cdiv(N, cfg.block_n),)
    C.launch(_fp8_block_kernel, grid, **common, stride_am=a.stride(0), stride_ak=a.stride(1),
             stride_bk=b.stride(0), stride_bn=b.stride(1), stride_cm=out.stride(0),
             stride_cn=out.stride(1), **cfg.launch_kwargs())
    return out


@R.custom_op("tkit::matmul_fp8_block", mutates_args=())
def _fp8_block_op(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                  scale_b: torch.Tensor, bias: Optional[torch.Tensor],  # noqa: UP045
                  residual: Optional[torch.Tensor], activation: str,  # noqa: UP045
                  out_dtype: torch.dtype,
                  scale_n: Optional[torch.Tensor] = None) -> torch.Tensor:  # noqa: UP045
    return _fp8_block_impl(a, b, scale_a, scale_b, bias, residual, activation or None, out_dtype,
                           scale_n=scale_n)


@_fp8_block_op.register_fake
def _(a, b, scale_a, scale_b, bias, residual, activation, out_dtype, scale_n=None):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def is_block_scaled(a, b, scale_a, scale_b) -> bool:
    """Whether the scales are in the block layout: scale_b (ceil(K/128), ceil(N/128)) with more
    than one element (never a per-tensor or per-column shape, which (1, N) with N > 1 is not)."""
    K, N = a.shape[1], b.shape[1]
    blk = (C.cdiv(K, BLOCK), C.cdiv(N, BLOCK))
    sa_blk = (a.shape[0], C.cdiv(K, BLOCK))
    return (isinstance(scale_b, torch.Tensor) and scale_b.ndim == 2 and scale_b.numel() > 1
            and tuple(scale_b.shape) == blk
            and not (tuple(scale_b.shape) == (1, N))) or (
        isinstance(scale_a, torch.Tensor) and scale_a.ndim == 2 and scale_a.shape[1] > 1
        and tuple(scale_a.shape) == sa_blk)


def scales_as_block(a, b, scale_a, scale_b, out_dtype, bias=None, residual=None,
                    activation=None):
    """(scale_a, scale_b, scale_n) for the CUDA block kernel from per-tensor, per-row (of a)
    or per-column (of b) scales (``scale_a`` (1,) or (M,), ``scale_b`` (1,) or (N,), as
    checked by :func:`tkit.matmul_fp8`), when that kernel serves the call with them
    (:func:`_cuda_choice`), else None. Per-tensor and per-row scales become stride-0 block
    views (nothing is copied) and scale_n None; per-column scales of b, which have no
    128-column block form, go as scale_n = scale_b to the kernel's ``col_scale`` build (which
    multiplies them in before the store and does not read the block view of b's scales it
    gets). There they run faster than the Triton kernel: a per-tensor or row/column product
    needs each K step's MMA sum added in float32 as the block recipe does (the fp8 MMA's own
    running sum misses the reference rule at long K), and the CUDA kernel's promotion is the
    faster of the two (docs/NOTES.md, forty-first and forty-third sessions). While
    torch.compile traces (fake tensors: no addresses to check for TMA) the call keeps the
    registered op."""
    if torch.compiler.is_compiling():
        return None
    M, K = a.shape
    N = b.shape[1]
    kb, nb = C.cdiv(K, BLOCK), C.cdiv(N, BLOCK)
    sa = scale_a.reshape(-1, 1).expand(M, kb)
    scale_n = None if scale_b.numel() == 1 else scale_b.reshape(-1)
    if scale_n is not None and scale_n.stride(0) != 1:  # the kernel reads cs[n] at stride 1
        scale_n = scale_n.contiguous()
    # b's one scale as every block's; per column, a view of the first of them in the shape
    # the block mode checks, which the col_scale build does not read
    sb = scale_b.reshape(-1)[:1].reshape(1, 1).expand(kb, nb)
    if _cuda_choice(a, b, sa, sb, out_dtype, bias, residual, activation, None, None,
                    col_scale=scale_n is not None):
        return None
    return sa, sb, scale_n


def matmul_fp8_block(a, b, scale_a, scale_b, out_dtype, bias, activation, residual,
                     scale_n=None):
    """The block mode of :func:`tkit.matmul_fp8` (a, b, the epilogue already validated there);
    ``scale_n`` from :func:`scales_as_block` only."""
    M, K = a.shape
    N = b.shape[1]
    kb, nb = C.cdiv(K, BLOCK), C.cdiv(N, BLOCK)
    C.check_tensor(scale_a, "scale_a", (torch.float32,))
    C.check_tensor(scale_b, "scale_b", (torch.float32,))
    if tuple(scale_a.shape) != (M, kb):
        raise ValueError(f"block scales: scale_a must have shape (M, ceil(K / 128)) = "
                         f"({M}, {kb}) (one per 1x128 group of a), got {tuple(scale_a.shape)}")
    if tuple(scale_b.shape) != (kb, nb):
        raise ValueError(f"block scales: scale_b must have shape (ceil(K / 128), ceil(N / 128))"
                         f" = ({kb}, {nb}) (one per 128x128 block of b), got "
                         f"{tuple(scale_b.shape)}")
    C.check_same_device(a=a, scale_a=scale_a, scale_b=scale_b)
    if C.use_direct_path(a, b, bias, residual):
        return _fp8_block_impl(a, b, scale_a, scale_b, bias, residual, activation, out_dtype,
                               scale_n=scale_n)
    return _fp8_block_op(a, b, scale_a, scale_b, bias, residual, activation or "", out_dtype,
                         scale_n)
