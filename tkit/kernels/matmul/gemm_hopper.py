"""The 16-bit GEMM's Gluon kernel for Hopper (sm_90): its scope (:func:`supported`), launcher
(:func:`launch`) and ahead-of-time build (:func:`compile_sm90`); its config is
:class:`tkit.kernels.matmul.config.GluonConfig` (tile width from the wave count, scoped
overrides through ``matmul_config``) and :func:`tkit.kernels.matmul.plan` decides when it runs.
The kernel and its schedule are described in ``_gemm_hopper_kernels.py``.

Scope: sm_90, bf16 or fp16 operands with an output of the same dtype, a (M, K) row-major and b
(K, N) K-major (``b.stride(0) == 1``: the ``w.t()`` of an nn.Linear weight, what the decoder
layer's projections pass), TMA-aligned rows (K and N multiples of 8, 16-byte aligned bases
and strides), an epilogue of at most a bias and a residual. Anything else (activations,
scales, fp32 or fp8, other layouts) takes the Triton kernels, with the reason that
:func:`supported` gives. :func:`launch_glu` runs the same kernel's gated build for
``tkit.matmul_glu`` (b the (K, 2N) ``w_gu.t()`` of a merged gate/up weight; its config
:meth:`GluonConfig.for_glu`, its plan :func:`tkit.kernels.matmul.glu_plan`).
"""

from __future__ import annotations

import torch

from tkit.kernels import _common as C
from tkit.kernels import _device as D
from tkit.kernels.matmul import config as MC

# the warpgroup height, the register split (1-warp producer, two consumer warpgroups) and the
# shared layouts are the block-scaled fp8 kernel's, whose schedule this one follows
from tkit.kernels.matmul.fp8_block_hopper import (
    CONSUMER_REGS,
    MAXNREG,
    PRODUCER_REGS,
    WG_M,
    _smem_layout,
)

#: the scope check lives with the config (``plan()`` asks it; plain Python)
supported = MC.gluon_supported


def status(device=None) -> str:
    """Whether this machine's 16-bit matmul can take the Gluon kernel, and for which calls
    (``tkit info`` prints it; :func:`tkit.kernels.matmul.plan` says it per call)."""
    if not torch.cuda.is_available():
        return "Triton kernels (the Gluon GEMM needs an sm_90 GPU; none here)"
    cap = D.capability(None if device is None else torch.device(device))
    if tuple(cap) != (9, 0):
        return f"Triton kernels (the Gluon GEMM needs sm_90; this GPU is sm_{cap[0]}{cap[1]})"
    return ("Gluon sm_90 kernel for bf16/fp16 with a row-major a, a K-major b (w.t()), no "
            "activation or scales, a row-major residual of the output's dtype, where the wave "
            "model takes 128-row tiles, and matmul_glu's gated tiles above M = 64; the "
            "Triton kernels for the rest")


def column_parts(block_n: int) -> tuple[int, ...]:
    """The tile's column parts, each its own accumulator and a power of 2 (a Gluon tensor's
    dimensions must be): one, or two for 192 (128 + 64)."""
    return (block_n,) if block_n & (block_n - 1) == 0 else (128, block_n - 128)


def _descriptor(t: torch.Tensor, shape, strides, block):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(t, list(shape), list(strides), list(block),
                            _smem_layout(block[0], block[1], t.dtype))


def launch(a, b, out, bias=None, residual=None, config: MC.GluonConfig | None = None):
    """out = a @ b (+ bias) (+ residual) by the Gluon kernel, for operands that
    :func:`supported` accepts (``residual`` (M, N)); ``config`` None: the table's for the
    shape (with the ``matmul_config`` overrides)."""
    from tkit.kernels.matmul._gemm_hopper_kernels import _gemm_ws_kernel

    M, K = a.shape
    N = b.shape[1]
    sms = D.sm_count(a.device)
    cfg = config if config is not None else MC.current(
        MC.GluonConfig.for_shape(M, N, K, sms, residual is not None))
    bn, bk = cfg.block_n, MC.GLUON_BLOCK_K
    parts = column_parts(bn)
    # b is (K, N) K-major: its storage is the row-major (N, K) matrix b.t()
    a_desc = _descriptor(a, (M, K), (MC._lead_stride(a, False), 1), (MC.GLUON_BLOCK_M, bk))
    bt = b.t()
    b_descs = [_descriptor(bt, (N, K), (MC._lead_stride(b, True), 1), (w, bk)) for w in parts]
    c_descs = [_descriptor(out, (M, N), (MC._lead_stride(out, False), 1), (WG_M, w))
               for w in parts]
    r_descs = [None, None]
    if residual is not None:
        r_descs = [_descriptor(residual, (M, N), (MC._lead_stride(residual, False), 1),
                               (WG_M, w)) for w in parts]
    two = len(parts) > 1  # (unused descriptors are None: each one given is encoded per call)
    tiles = C.cdiv(M, MC.GLUON_BLOCK_M) * C.cdiv(N, bn)
    C.launch(_gemm_ws_kernel, (max(1, min(sms, tiles)),), a_desc=a_desc, b_desc=b_descs[0],
             b2_desc=b_descs[1] if two else None, c_desc=c_descs[0],
             c2_desc=c_descs[1] if two else None, r_desc=r_descs[0],
             r2_desc=r_descs[1] if two else None,
             bias_ptr=bias if bias is not None else out, M=M, N=N, K=K,
             stride_bias=bias.stride(0) if bias is not None else 0,
             HAS_BIAS=bias is not None, HAS_RES=residual is not None, BLOCK_N=bn,
             OVERLAP=cfg.overlap, STAGES=cfg.stages(out.element_size()),
             GROUP_M=cfg.group_m,
             CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4,
             maxnreg=MAXNREG)
    return out


def glu_gated(cfg: MC.GluonConfig) -> int:
    """The kernel's GATED constexpr for a ``matmul_glu`` config: 1 two accumulators, 2 one
    split in the epilogue."""
    bad = MC.glu_config_error(cfg)
    if bad is not None:
        raise ValueError(bad)
    return 1 if cfg.glu_parts else 2


def _glu_overlap(cfg: MC.GluonConfig) -> int:
    """The kernel's OVERLAP for a gated config: 2 (the next tile's first step issued before
    the epilogue's math) or 0. The plain tiles' order (1: after the math, before the stores)
    lost to both at every gated width measured."""
    return 2 if cfg.overlap else 0


def launch_glu(a, b, out, bias=None, activation="silu", config: MC.GluonConfig | None = None):
    """out (M, N) = act(a @ b[:, :N] + bias[:N]) * (a @ b[:, N:] + bias[N:]) by the Gluon
    kernel (GATED), for operands that :func:`supported` accepts with ``b`` (K, 2N) K-major;
    ``config`` None: :meth:`GluonConfig.for_glu` with the ``matmul_config`` overrides."""
    from tkit.kernels.matmul._gemm_hopper_kernels import _gemm_ws_kernel

    M, K = a.shape
    N = out.shape[1]
    sms = D.sm_count(a.device)
    cfg = config if config is not None else MC.current(MC.GluonConfig.for_glu(M, N, K, sms))
    gated = glu_gated(cfg)
    w, bk = cfg.block_n // 2, MC.GLUON_BLOCK_K
    a_desc = _descriptor(a, (M, K), (MC._lead_stride(a, False), 1), (MC.GLUON_BLOCK_M, bk))
    # one descriptor over the (2N, K) storage serves the gate rows and the up rows (N on)
    b_desc = _descriptor(b.t(), (2 * N, K), (MC._lead_stride(b, True), 1), (w, bk))
    c_desc = _descriptor(out, (M, N), (MC._lead_stride(out, False), 1), (WG_M, w))
    tiles = C.cdiv(M, MC.GLUON_BLOCK_M) * C.cdiv(N, w)
    C.launch(_gemm_ws_kernel, (max(1, min(sms, tiles)),), a_desc=a_desc, b_desc=b_desc,
             b2_desc=None, c_desc=c_desc, c2_desc=None, r_desc=None, r2_desc=None,
             bias_ptr=bias if bias is not None else out, M=M, N=N, K=K,
             stride_bias=bias.stride(0) if bias is not None else 0,
             HAS_BIAS=bias is not None, HAS_RES=False, BLOCK_N=w, OVERLAP=_glu_overlap(cfg),
             STAGES=cfg.stages(out.element_size(), gated=True), GROUP_M=cfg.group_m,
             CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, GATED=gated,
             ACT=activation, num_warps=4, maxnreg=MAXNREG)
    return out


# --------------------------------------------------------------------------------------------
# Ahead-of-time compilation (no GPU needed)
# --------------------------------------------------------------------------------------------
def compile_sm90(config: MC.GluonConfig | None = None, dtype=torch.bfloat16, has_bias=False,
                 has_res=False, activation: str | None = None):
    """Compile the kernel for sm_90a ahead of time; returns Triton's compiled kernel
    (``.asm`` holds ``ttgir``, ``ptx``, ``cubin``; ``.metadata.shared`` the shared memory).
    ``activation`` (silu, gelu, gelu_tanh): ``matmul_glu``'s gated build of ``config``."""
    if activation:
        return _compile_glu_sm90(config, dtype, has_bias, activation)
    from tkit.kernels._gluon import compile_sm90 as gluon_compile_sm90
    from tkit.kernels.matmul._gemm_hopper_kernels import _gemm_ws_kernel

    cfg = config if config is not None else MC.GluonConfig()
    bn, bk = cfg.block_n, MC.GLUON_BLOCK_K
    tname = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]

    def desc(rows, cols):
        return f"tensordesc<{tname}[{rows}, {cols}],{_smem_layout(rows, cols, dtype)!r}>"

    es = torch.empty((), dtype=dtype).element_size()
    p0, p1 = column_parts(bn)[0], column_parts(bn)[-1]
    two = p1 != p0
    rows = WG_M
    signature = dict(
        a_desc=desc(MC.GLUON_BLOCK_M, bk), b_desc=desc(p0, bk),
        b2_desc=desc(p1, bk) if two else "constexpr", c_desc=desc(rows, p0),
        c2_desc=desc(rows, p1) if two else "constexpr",
        r_desc=desc(rows, p0) if has_res else "constexpr",
        r2_desc=desc(rows, p1) if has_res and two else "constexpr",
        bias_ptr=f"*{tname}", M="i32", N="i32", K="i32",
        stride_bias="i32", HAS_BIAS="constexpr", HAS_RES="constexpr", BLOCK_N="constexpr",
        OVERLAP="constexpr", STAGES="constexpr", GROUP_M="constexpr",
        CONSUMER_REGS="constexpr", PRODUCER_REGS="constexpr", GATED="constexpr",
        ACT="constexpr",
    )
    # every constexpr named, its defaults included (triton 3.9's ahead-of-time compile does not
    # fill in a parameter's default)
    values = dict(HAS_BIAS=bool(has_bias), HAS_RES=bool(has_res), BLOCK_N=bn,
                  OVERLAP=cfg.overlap, STAGES=cfg.stages(es),
                  GROUP_M=cfg.group_m, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
                  GATED=0, ACT="")
    for k in ("b2_desc", "c2_desc", "r_desc", "r2_desc"):
        if signature[k] == "constexpr":
            values[k] = None
    return gluon_compile_sm90(_gemm_ws_kernel, signature, values, num_warps=4, maxnreg=MAXNREG)


def _compile_glu_sm90(config, dtype, has_bias, activation):
    from tkit.kernels._gluon import compile_sm90 as gluon_compile_sm90
    from tkit.kernels.matmul._gemm_hopper_kernels import _gemm_ws_kernel

    cfg = config if config is not None else MC.GluonConfig(block_n=256)
    gated = glu_gated(cfg)
    w, bk = cfg.block_n // 2, MC.GLUON_BLOCK_K
    tname = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]

    def desc(rows, cols):
        return f"tensordesc<{tname}[{rows}, {cols}],{_smem_layout(rows, cols, dtype)!r}>"

    es = torch.empty((), dtype=dtype).element_size()
    signature = dict(
        a_desc=desc(MC.GLUON_BLOCK_M, bk), b_desc=desc(w, bk), b2_desc="constexpr",
        c_desc=desc(WG_M, w), c2_desc="constexpr", r_desc="constexpr", r2_desc="constexpr",
        bias_ptr=f"*{tname}", M="i32", N="i32", K="i32", stride_bias="i32",
        HAS_BIAS="constexpr", HAS_RES="constexpr", BLOCK_N="constexpr", OVERLAP="constexpr",
        STAGES="constexpr", GROUP_M="constexpr", CONSUMER_REGS="constexpr",
        PRODUCER_REGS="constexpr", GATED="constexpr", ACT="constexpr",
    )
    values = dict(b2_desc=None, c2_desc=None, r_desc=None, r2_desc=None,
                  HAS_BIAS=bool(has_bias), HAS_RES=False, BLOCK_N=w, OVERLAP=_glu_overlap(cfg),
                  STAGES=cfg.stages(es, gated=True), GROUP_M=cfg.group_m,
                  CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, GATED=gated,
                  ACT=activation)
    return gluon_compile_sm90(_gemm_ws_kernel, signature, values, num_warps=4, maxnreg=MAXNREG)
