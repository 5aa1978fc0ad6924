"""The GEMM family's launchers, argument checks and torch.library registrations
(``tkit::matmul``, ``tkit::matmul_glu``, ``tkit::grouped_matmul``,
``tkit::grouped_matmul_wgrad``) with their fakes and autograd."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from tkit import _hooks
from tkit.kernels import _common as C
from tkit.kernels import _device as D
from tkit.kernels import _plan as P
from tkit.kernels import _register as R
from tkit.kernels.elementwise.ops import _activation_grad, _sum_to
from tkit.kernels.matmul import config as MC
from tkit.kernels.matmul._kernels import (
    _grouped_matmul_kernel,
    _grouped_matmul_tma_kernel,
    _grouped_wgrad_kernel,
    _matmul_autotuned,
    _matmul_glu_kernel,
    _matmul_kernel,
    _matmul_splitk_fused_kernel,
    _matmul_splitk_kernel,
    _matmul_splitk_tma_kernel,
    _matmul_tma_autotuned,
    _matmul_tma_kernel,
    _splitk_glu_reduce_kernel,
    _splitk_reduce_kernel,
)
from tkit.kernels.matmul.config import (
    ACTIVATIONS,
    GluonConfig,
    GroupedConfig,
    GroupedTmaConfig,
    MatmulPlan,
    PtrConfig,
    SplitKConfig,
    TmaConfig,
    _default_out_dtype,
    _lead_stride,
    _tma_ok,
    grouped_b_view,
    grouped_plan,
    grouped_tma_reason,
    plan,
)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
def _scale_mode(s: torch.Tensor | None) -> int:
    if s is None:
        return 0
    return 1 if s.numel() == 1 else 2


def _epilogue_args(a, scale_a, scale_b, bias, res2, activation):
    """Keyword arguments every kernel's epilogue takes (dummies where switched off)."""
    return dict(
        sa_ptr=scale_a if scale_a is not None else a,
        sb_ptr=scale_b if scale_b is not None else a,
        bias_ptr=bias if bias is not None else a,
        stride_bias=bias.stride(0) if bias is not None else 0,
        res_ptr=res2 if res2 is not None else a,
        stride_rm=res2.stride(-2) if res2 is not None else 0,
        stride_rn=res2.stride(-1) if res2 is not None else 0,
        SCALE_A=_scale_mode(scale_a), SCALE_B=_scale_mode(scale_b), HAS_BIAS=bias is not None,
        ACT=activation or "", HAS_RES=res2 is not None,
    )


def _expect(config, cls):
    """An explicit config (benchmarks, tests) must be the launched kernel's type."""
    if config is not None and not isinstance(config, cls):
        raise TypeError(f"config must be a {cls.__name__} for this kernel, got "
                        f"{type(config).__name__}")
    return config


def _launch_ptr(a3, b3, out3, res3, epi, ieee, config: PtrConfig | None = None):
    """Batched pointer kernel on 3-D views (B, M, K) @ (B, K, N) -> (B, M, N); without a
    config, the fixed one for the shape (or the autotuner under TKIT_AUTOTUNE)."""
    B, M, K = a3.shape
    N = b3.shape[2]
    int64 = C.needs_int64(a3, b3, out3, res3)
    if res3 is not None:
        epi = dict(epi, res_ptr=res3)
    stride_rb = res3.stride(0) if res3 is not None else 0
    if _expect(config, PtrConfig) is None and not MC.autotuned():
        config = MC.current(PtrConfig.for_shape(M, N, K, a3.element_size()))
    kernel = _matmul_kernel if config is not None else _matmul_autotuned
    grid = lambda meta: (C.cdiv(M, meta["BLOCK_M"]) * C.cdiv(N, meta["BLOCK_N"]), B)
    C.launch(kernel, grid, a_ptr=a3, b_ptr=b3, c_ptr=out3, M=M, N=N, K=K,
             stride_ab=a3.stride(0), stride_am=a3.stride(1), stride_ak=a3.stride(2),
             stride_bb=b3.stride(0), stride_bk=b3.stride(1), stride_bn=b3.stride(2),
             stride_cb=out3.stride(0), stride_cm=out3.stride(1), stride_cn=out3.stride(2),
             stride_rb=stride_rb, **epi, IEEE=ieee, INT64=int64,
             **(config.launch_kwargs() if config is not None else {}))


def _launch_tma(a, b, out, epi, ieee, num_sms, config: TmaConfig | None = None):
    _, a_trans = _tma_ok(a)
    _, b_trans = _tma_ok(b)
    M, K = a.shape
    N = b.shape[1]
    D.ensure_tma_allocator()
    if _expect(config, TmaConfig) is None and not MC.autotuned():
        config = MC.current(TmaConfig.for_shape(M, N, K, a.element_size(), num_sms))
    kernel = _matmul_tma_kernel if config is not None else _matmul_tma_autotuned

    def grid(meta):
        tiles = C.cdiv(M, meta["BLOCK_M"]) * C.cdiv(N, meta["BLOCK_N"])
        return (max(1, min(num_sms, tiles)),)

    res = epi["res_ptr"] if epi["HAS_RES"] else None
    if res is not None and res.dim() == 2 and tuple(res.shape) == (M, N) \
            and res.stride(0) > 0 and res.element_size() <= 2 and _tma_ok(res) == (True, False):
        # a row-major 16-bit residual is read by TMA (see the kernel's RES_TMA); its staging
        # buffer is 32 KB at 128x256 tiles (a float32 one, 64 KB, would not fit next to the
        # pipeline stages). Its row stride is the one _tma_ok checked: a single row's own
        # stride(0) may be anything, and a descriptor stride must be a multiple of 16 bytes.
        epi = dict(epi, HAS_RES=False, RES_TMA=True, stride_rm=_lead_stride(res, False))
    if config is not None:
        # the table's config (or one given) fitted to shared memory with this call's output
        # and residual: fewer stages where the epilogue's buffers would push it past 227 KB
        config = MC.fit_shared(config, a.element_size(), out.element_size(),
                               res.element_size() if res is not None else 0)

    C.launch(kernel, grid, a_ptr=a, b_ptr=b, c_ptr=out, M=M, N=N, K=K,
             stride_a=_lead_stride(a, a_trans), stride_b=_lead_stride(b, b_trans),
             stride_cm=out.stride(0), A_TRANS=a_trans, B_TRANS=b_trans, **epi, IEEE=ieee,
             NUM_SMS=num_sms, **(config.launch_kwargs() if config is not None else {}))


_COUNTERS: dict = {}


def _splitk_counters(device: torch.device, n: int) -> torch.Tensor:
    """Per-tile arrival counters of the one-launch split-K (``SplitKConfig.fused_reduce``, opt-in
    for now), zeroed once and left at zero by every launch, so calls need no memset. One buffer
    per device: two such launches running concurrently on different streams would share it,
    which is why it is not the default yet (and why the buffer must exist before a CUDA graph
    capture: the first call is eager)."""
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n or device.type == "meta":
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        if device.type != "meta":
            _COUNTERS[key] = buf
    return buf


def _launch_splitk(a, b, out, epi, ieee, cfg: SplitKConfig):
    M, K = a.shape
    N = b.shape[1]
    split, bm, bn = cfg.split_k, cfg.block_m, cfg.block_n
    if split == 1:  # nothing to reduce: the pointer kernel with this tile, epilogue included
        r3 = epi["res_ptr"].unsqueeze(0) if epi["HAS_RES"] else None
        _launch_ptr(a.unsqueeze(0), b.unsqueeze(0), out.unsqueeze(0), r3, epi, ieee,
                    cfg.unsplit())
        return
    # partials are float32 and fully overwritten: a plain allocation, never poisoned
    ws = C.scratch((split, M, N), torch.float32, a.device)
    if cfg.tma and not cfg.fused_reduce and a.element_size() == 2 \
            and _tma_ok(a) == (True, False) and _tma_ok(b)[0]:
        from triton.tools.tensor_descriptor import TensorDescriptor as TD

        b_trans = _tma_ok(b)[1]
        bm, bk = cfg.block_m, cfg.block_k
        a_d = TD(a, [M, K], [a.stride(0), 1], [bm, bk])
        b_d = (TD(b.t(), [N, K], [_lead_stride(b, True), 1], [bn, bk]) if b_trans
               else TD(b, [K, N], [_lead_stride(b, False), 1], [bk, bn]))
        C.launch(_matmul_splitk_tma_kernel, (C.cdiv(N, bn), C.cdiv(M, bm), split),
                 a_desc=a_d, b_desc=b_d, ws_ptr=ws, M=M, N=N, K=K, B_TRANS=b_trans,
                 IEEE=False, **cfg.launch_kwargs())
    elif cfg.fused_reduce:
        grid = (C.cdiv(N, bn), C.cdiv(M, bm), split)
        C.launch(_matmul_splitk_fused_kernel, grid, a_ptr=a, b_ptr=b, ws_ptr=ws,
                 cnt_ptr=_splitk_counters(a.device, grid[0] * grid[1]), c_ptr=out,
                 M=M, N=N, K=K, stride_am=a.stride(0), stride_ak=a.stride(1),
                 stride_bk=b.stride(0), stride_bn=b.stride(1), stride_cm=out.stride(0),
                 stride_cn=out.stride(1), **epi, IEEE=ieee, **cfg.launch_kwargs())
        return
    else:
        C.launch(_matmul_splitk_kernel, (C.cdiv(N, bn), C.cdiv(M, bm), split),
                 a_ptr=a, b_ptr=b, ws_ptr=ws, M=M, N=N, K=K,
                 stride_am=a.stride(0), stride_ak=a.stride(1),
                 stride_bk=b.stride(0), stride_bn=b.stride(1),
                 IEEE=ieee, **cfg.launch_kwargs())
    rbn = 128 if N >= 128 else max(16, C.next_power_of_2(N))
    C.launch(_splitk_reduce_kernel, (C.cdiv(N, rbn), C.cdiv(M, bm)),
             ws_ptr=ws, c_ptr=out, M=M, N=N, stride_cm=out.stride(0), stride_cn=out.stride(1),
             **epi, SPLIT_K=split, BLOCK_M=bm, BLOCK_N=rbn, num_warps=4)


def _run_2d(a, b, out, res, scale_a, scale_b, bias, activation, ieee, p: MatmulPlan,
            config=None):
    """Launch ``p`` (its config, or ``config`` given: a config of the kernel of ``p.path``)."""
    epi = _epilogue_args(a, scale_a, scale_b, bias, res, activation)
    cfg = config if config is not None else p.config
    if p.path == "empty":
        return
    if p.path == "gluon":
        from tkit.kernels.matmul import gemm_hopper as GH

        GH.launch(a, b, out, bias, res, _expect(cfg, GluonConfig))
    elif p.path == "tma":
        _launch_tma(a, b, out, epi, ieee, D.sm_count(a.device), cfg)
    elif p.path == "splitk":
        _launch_splitk(a, b, out, epi, ieee, _expect(cfg, SplitKConfig))
    elif p.path == "ptr":
        r3 = res.unsqueeze(0) if res is not None else None
        _launch_ptr(a.unsqueeze(0), b.unsqueeze(0), out.unsqueeze(0), r3, epi, ieee, cfg)
    else:
        raise ValueError(f"unknown matmul path {p.path!r}")


def _epi_plan(bias, res, activation, scale_a, scale_b) -> dict:
    """The epilogue arguments of :func:`plan` (which decide whether the Gluon GEMM runs)."""
    return dict(bias=bias, residual=res, activation=activation,
                scaled=scale_a is not None or scale_b is not None)


def _try_view(t: torch.Tensor, *shape: int) -> torch.Tensor | None:
    try:
        return t.view(*shape)
    except RuntimeError:
        return None


def _matmul_into(a, b, out, res, scale_a, scale_b, bias, activation, ieee, path, config):
    """a (..., M, K) @ b (..., K, N) into out (batch..., M, N); shapes already broadcast.
    ``config`` None (the plan's), or a :class:`TmaConfig` / :class:`PtrConfig` /
    :class:`SplitKConfig` for the kernel that ``path`` (or the plan) runs."""
    batch = tuple(out.shape[:-2])
    M, K = a.shape[-2:]
    N = b.shape[-1]
    ae, be = a.expand(*batch, M, K), b.expand(*batch, K, N)
    re = res.expand(out.shape) if res is not None else None
    if not batch:
        epi = _epi_plan(bias, re, activation, scale_a, scale_b)
        _run_2d(ae, be, out, re, scale_a, scale_b, bias, activation, ieee,
                plan(ae, be, out.dtype, path=path, **epi), config)
        return
    b_shared = all(st == 0 or sz == 1 for st, sz in zip(be.stride()[:-2], batch))
    nb = math.prod(batch)  # sizes, not -1: a view of (-1, 0) is ambiguous when K = 0
    a2 = _try_view(ae, nb * M, K) if b_shared else None
    if a2 is not None:
        # one weight for every batch: fold the batch into M (the nn.Linear case)
        b2 = be[(0,) * len(batch)]
        out2 = out.view(-1, N)
        r2 = None
        if re is not None:
            r2 = _try_view(re, nb * M, N)
            if r2 is None:  # an unusual residual layout: one copy, counted against nothing else
                r2 = re.reshape(nb * M, N)
        epi = _epi_plan(bias, r2, activation, scale_a, scale_b)
        _run_2d(a2, b2, out2, r2, scale_a, scale_b, bias, activation, ieee,
                plan(a2, b2, out.dtype, path=path, **epi), config)
        return
    a3, b3 = _try_view(ae, nb, M, K), _try_view(be, nb, K, N)
    r3 = _try_view(re, nb, M, N) if re is not None else None
    if a3 is None or b3 is None or (re is not None and r3 is None):
        # batch dims that do not merge into one stride: one launch per leading index
        for i in range(batch[0]):
            _matmul_into(ae[i], be[i], out[i], re[i] if re is not None else None, scale_a,
                         scale_b, bias, activation, ieee, path, config)
        return
    if a3.shape[0] == 1 or path in ("gluon", "tma", "splitk"):
        for i in range(a3.shape[0]):
            _run_2d(a3[i], b3[i], out.view(-1, M, N)[i], r3[i] if r3 is not None else None,
                    scale_a, scale_b, bias, activation, ieee,
                    plan(a3[i], b3[i], out.dtype, path=path,
                         **_epi_plan(bias, r3[i] if r3 is not None else None, activation,
                                     scale_a, scale_b)), config)
        return
    epi = _epilogue_args(a3, scale_a, scale_b, bias, r3, activation)
    _launch_ptr(a3, b3, out.view(-1, M, N), r3, epi, ieee, config)


def _matmul_impl(a, b, bias=None, residual=None, scale_a=None, scale_b=None, activation=None,
                 out_dtype=None, allow_tf32=True, backend="auto", path=None, config=None):
    out_dtype = out_dtype or _default_out_dtype(a.dtype)
    batch = C.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    M, N = a.shape[-2], b.shape[-1]
    out = C.empty((*batch, M, N), out_dtype, a.device)
    if out.numel() == 0:
        return out
    if backend == "cuda":
        return _cuda_matmul(a, b, out, bias, residual, scale_a, scale_b, activation)
    ieee = a.dtype == torch.float32 and not allow_tf32
    _matmul_into(a, b, out, residual, scale_a, scale_b, bias, activation, ieee, path, config)
    return out


def _cuda_matmul(a, b, out, bias, residual, scale_a, scale_b, activation):
    """backend="cuda": the CUDA escape hatch of tkit.cuda_ext, epilogue applied unfused."""
    try:  # tkit.cuda_ext's GEMM, plugged in by the layer above (tkit/_hooks.py)
        if _hooks.cuda_matmul is None:
            raise ImportError("no CUDA matmul is registered in tkit._hooks")
        call = _hooks.cuda_matmul()
    except (ImportError, AttributeError) as e:
        raise RuntimeError(
            "backend='cuda' needs tkit.cuda_ext.matmul(a, b) (or dispatch('matmul', a, b)), "
            f"which is not available here ({e}); use backend='triton' or 'auto'"
        ) from None
    if scale_a is not None or scale_b is not None:
        raise NotImplementedError("backend='cuda' does not take fp8 scales; use 'triton'")
    # tkit.cuda_ext raises its own CudaPathUnavailable, naming the reason, when it cannot run
    y = call(a, b).float()
    if bias is not None:
        y = y + bias.float()
    if activation:
        y = _torch_activation(y, activation)
    if residual is not None:
        y = y + residual.float()
    out.copy_(y)
    return out


def _torch_activation(x: torch.Tensor, act: str | None) -> torch.Tensor:
    if not act:
        return x
    if act == "silu":
        return torch.nn.functional.silu(x)
    if act in ("gelu", "gelu_tanh"):
        return torch.nn.functional.gelu(x, approximate="tanh" if act == "gelu_tanh" else "none")
    return torch.relu(x)


def _grouped_impl(a, b, offsets, out_dtype=None, config=None, allow_tf32=True):
    T, K = a.shape
    G, _, N = b.shape
    out = C.empty((T, N), out_dtype or a.dtype, a.device)
    if out.numel() == 0 or G == 0:
        if out.numel() and G == 0:
            out.zero_()
        return out
    offsets = offsets.contiguous()  # read densely by the kernels
    if config is None:
        config = grouped_plan(a, b).config
    elif isinstance(config, GroupedTmaConfig):
        why = grouped_tma_reason(a, b, config)
        if why is not None:
            raise ValueError(f"the grouped TMA kernel does not apply to this call: {why}")
    if isinstance(config, GroupedTmaConfig):
        _launch_grouped_tma(a, b, out, offsets, config)
        return out
    cfg = _expect(config, GroupedConfig)
    bm, bn = cfg.block_m, cfg.block_n
    # one tile more per group than cdiv(T, bm), and one each for the rows before the first
    # group and after the last (zeros; see the kernel)
    grid = (C.cdiv(T, bm) + G + 2, C.cdiv(N, bn))
    C.launch(_grouped_matmul_kernel, grid, a_ptr=a, b_ptr=b, c_ptr=out, off_ptr=offsets,
             T=T, G=G, N=N, K=K, stride_am=a.stride(0), stride_ak=a.stride(1),
             stride_bg=b.stride(0), stride_bk=b.stride(1), stride_bn=b.stride(2),
             stride_cm=out.stride(0), stride_cn=out.stride(1),
             IEEE=a.dtype == torch.float32 and not allow_tf32,
             INT64=C.needs_int64(a, b, out), **cfg.launch_kwargs())
    return out


def _launch_grouped_tma(a, b, out, offsets, cfg: GroupedTmaConfig):
    from triton.tools.tensor_descriptor import TensorDescriptor as TD

    T, K = a.shape
    G, _, N = b.shape
    b_trans, stride_b = grouped_b_view(b)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    # host descriptors (no per-program descriptor writes; the eager plans rebuild them over
    # each call's tensors): b's over its groups as one 2-D matrix
    a_d = TD(a, [T, K], [a.stride(0), 1], [bm, bk])
    b_d = (TD(b, [G * N, K], [stride_b, 1], [bn, bk]) if b_trans
           else TD(b, [G * K, N], [stride_b, 1], [bk, bn]))
    kw = cfg.launch_kwargs()
    kw["TMA_STORE"] = cfg.tma_store and _tma_ok(out) == (True, False)
    c_d = TD(out, [T, N], [out.stride(0), 1], [bm, bn // 2]) if kw["TMA_STORE"] else a_d
    sms = D.sm_count(a.device)
    # a program per SM at most: the kernel counts the tiles on the device, the host bounds
    # them by every row tile plus one per group and per gap segment
    tiles = (C.cdiv(T, bm) + G + 2) * C.cdiv(N, bn)
    C.launch(_grouped_matmul_tma_kernel, (max(1, min(sms, tiles)),), a_desc=a_d, b_desc=b_d,
             c_desc=c_d, c_ptr=out, off_ptr=offsets, T=T, G=G, N=N, K=K,
             stride_cm=out.stride(0), stride_cn=out.stride(1), B_TRANS=b_trans, IEEE=False,
             NUM_SMS=sms, SEG_BLOCK=C.next_power_of_2(G + 2), **kw)


def _grouped_wgrad_impl(a, grad, offsets, G, b_dtype, allow_tf32=True):
    T, K = a.shape
    N = grad.shape[1]
    db = torch.empty((G, K, N), dtype=torch.float32, device=a.device)
    if db.numel() == 0:
        return db.to(b_dtype)
    cfg = (dict(BLOCK_K=32, BLOCK_N=64, BLOCK_R=32, num_warps=4) if a.device.type == "cpu"
           else dict(BLOCK_K=128, BLOCK_N=128, BLOCK_R=64, num_warps=8, num_stages=3))
    grid = (G, C.cdiv(K, cfg["BLOCK_K"]) * C.cdiv(N, cfg["BLOCK_N"]))
    offsets = offsets.contiguous()
    C.launch(_grouped_wgrad_kernel, grid, a_ptr=a, g_ptr=grad, db_ptr=db, off_ptr=offsets,
             T=T, G=G, K=K, N=N, stride_am=a.stride(0), stride_ak=a.stride(1),
             stride_gm=grad.stride(0), stride_gn=grad.stride(1), stride_dg=db.stride(0),
             stride_dk=db.stride(1), stride_dn=db.stride(2),
             IEEE=a.dtype == torch.float32 and not allow_tf32,
             INT64=C.needs_int64(a, grad, db), G_BLOCK=C.next_power_of_2(G + 1), **cfg)
    return db.to(b_dtype)


# --------------------------------------------------------------------------------------------
def _out_shape(a, b):
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return (*batch, a.shape[-2], b.shape[-1])


@R.custom_op("tkit::matmul", mutates_args=(), plans=True)
def _matmul_op(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor],  # noqa: UP045
               residual: Optional[torch.Tensor], scale_a: Optional[torch.Tensor],  # noqa: UP045
               scale_b: Optional[torch.Tensor], activation: str,  # noqa: UP045
               out_dtype: Optional[torch.dtype], allow_tf32: bool,  # noqa: UP045
               backend: str) -> torch.Tensor:
    if a.ndim == 2 and b.ndim == 2 and backend in ("auto", "triton") and not MC.overridden():
        # served by an eager plan on a repeated signature, as the eager 2-D call is; bias,
        # residual and scales are inputs of the plan (None or a tensor's signature in its key)
        args = (a, b, bias, residual, scale_a, scale_b, activation, out_dtype, allow_tf32,
                backend)
        return P.serve_op(_matmul_op, _matmul_op_impl, args)
    return _matmul_impl(a, b, bias, residual, scale_a, scale_b, activation or None, out_dtype,
                        allow_tf32, backend)


def _matmul_op_impl(a, b, bias, residual, scale_a, scale_b, activation, out_dtype, allow_tf32,
                    backend):
    return _matmul_impl(a, b, bias, residual, scale_a, scale_b, activation or None, out_dtype,
                        allow_tf32, backend)


@_matmul_op.register_fake
def _(a, b, bias, residual, scale_a, scale_b, activation, out_dtype, allow_tf32, backend):
    return a.new_empty(_out_shape(a, b), dtype=out_dtype or _default_out_dtype(a.dtype))


def _matmul_setup(ctx, inputs, output):
    a, b, bias, residual, scale_a, scale_b, activation, out_dtype, allow_tf32, backend = inputs
    ctx.activation = activation
    ctx.allow_tf32 = allow_tf32
    ctx.res_meta = (tuple(residual.shape), residual.dtype) if residual is not None else None
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.save_for_backward(a, b, bias, scale_a, scale_b)


def _matmul_backward(ctx, grad):
    """out = act(s * a@b + bias) + residual: the GEMMs of the backward run through tkit too
    (transposed operands are views, so no copies); the pre-activation is recomputed."""
    a, b, bias, scale_a, scale_b = ctx.saved_tensors
    if scale_a is not None or scale_b is not None:
        raise NotImplementedError("tkit.matmul with fp8 scales has no backward")
    g = grad
    if ctx.activation:
        pre = _matmul_op(a, b, bias, None, None, None, "", torch.float32, ctx.allow_tf32, "auto")
        g = _activation_grad(grad, pre, ctx.activation)
    ga = _matmul_op(g.to(a.dtype), b.mT, None, None, None, None, "", torch.float32,
                    ctx.allow_tf32, "auto")
    gb = _matmul_op(a.mT, g.to(b.dtype), None, None, None, None, "", torch.float32,
                    ctx.allow_tf32, "auto")
    ga = _sum_to(ga, a.shape, a.dtype)
    gb = _sum_to(gb, b.shape, b.dtype)
    gbias = None
    if bias is not None:
        gbias = g.float().reshape(-1, g.shape[-1]).sum(0).to(ctx.bias_dtype)
    gres = _sum_to(grad, *ctx.res_meta) if ctx.res_meta is not None else None
    return ga, gb, gbias, gres, None, None, None, None, None, None


_matmul_op.register_autograd(_matmul_backward, setup_context=_matmul_setup)


@R.custom_op("tkit::grouped_matmul", mutates_args=())
def _grouped_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                out_dtype: Optional[torch.dtype],  # noqa: UP045
                allow_tf32: bool = True) -> torch.Tensor:
    return _grouped_impl(a, b, offsets, out_dtype, allow_tf32=allow_tf32)


@_grouped_op.register_fake
def _(a, b, offsets, out_dtype, allow_tf32=True):
    return a.new_empty((a.shape[0], b.shape[2]), dtype=out_dtype or a.dtype)


def _grouped_setup(ctx, inputs, output):
    a, b, offsets, out_dtype, *rest = inputs
    ctx.allow_tf32 = rest[0] if rest else True
    ctx.save_for_backward(a, b, offsets)


def _grouped_backward(ctx, grad):
    """d a = grouped(grad, b^T) (one launch, b^T a strided view); d b[g] = a_g^T grad_g."""
    a, b, offsets = ctx.saved_tensors
    ga = gb = None
    if ctx.needs_input_grad[0]:
        ga = _grouped_op(grad.to(a.dtype), b.transpose(1, 2), offsets, a.dtype, ctx.allow_tf32)
    if ctx.needs_input_grad[1]:
        gb = _grouped_wgrad_op(a, grad.to(a.dtype), offsets, b.shape[0], b.dtype,
                               ctx.allow_tf32)
    return ga, gb, None, None, None


@R.custom_op("tkit::grouped_matmul_wgrad", mutates_args=())
def _grouped_wgrad_op(a: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor, G: int,
                      b_dtype: torch.dtype, allow_tf32: bool = True) -> torch.Tensor:
    return _grouped_wgrad_impl(a, grad, offsets, G, b_dtype, allow_tf32)


@_grouped_wgrad_op.register_fake
def _(a, grad, offsets, G, b_dtype, allow_tf32=True):
    return a.new_empty((G, a.shape[1], grad.shape[1]), dtype=b_dtype)


_grouped_op.register_autograd(_grouped_backward, setup_context=_grouped_setup)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def _check_out_dtype(out_dtype):
    if out_dtype is not None and out_dtype not in C.FLOAT_DTYPES:
        names = ", ".join(C.dtype_name(d) for d in C.FLOAT_DTYPES)
        raise TypeError(f"out_dtype {out_dtype} is not supported; supported: {names}")


def _check_operands(a, b, dtypes):
    C.check_tensor(a, "a", dtypes, min_ndim=2)
    C.check_tensor(b, "b", dtypes, min_ndim=2)
    C.check_same_device(a=a, b=b)
    if a.dtype != b.dtype:
        raise TypeError(f"b has dtype {C.dtype_name(b.dtype)} but a has "
                        f"{C.dtype_name(a.dtype)}; cast one of them")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"a of shape {tuple(a.shape)} and b of shape {tuple(b.shape)} cannot "
                         f"be multiplied: a.shape[-1]={a.shape[-1]} != b.shape[-2]="
                         f"{b.shape[-2]}")
    try:
        return (*C.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
    except ValueError:
        raise ValueError(f"the batch dimensions of a {tuple(a.shape[:-2])} and b "
                         f"{tuple(b.shape[:-2])} do not broadcast") from None


def _check_epilogue(out_shape, device, bias, activation, residual):
    if bias is not None:
        C.check_tensor(bias, "bias", ndim=1)
        if bias.device != device:
            raise ValueError(f"bias is on {bias.device} but a is on {device}")
        if bias.shape[0] != out_shape[-1]:
            raise ValueError(f"bias must have shape ({out_shape[-1]},) (N), got "
                             f"{tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if residual is not None:
        C.check_tensor(residual, "residual")
        if residual.device != device:
            raise ValueError(f"residual is on {residual.device} but a is on {device}")
        try:
            ok = torch.broadcast_shapes(residual.shape, out_shape) == torch.Size(out_shape)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"residual of shape {tuple(residual.shape)} does not broadcast to "
                             f"the output shape {tuple(out_shape)}")




# --------------------------------------------------------------------------------------------
# matmul_glu: act(a @ b[:, :N] + bias[:N]) * (a @ b[:, N:] + bias[N:])
# --------------------------------------------------------------------------------------------
def _launch_glu_ptr(a, b, out, bias, activation, ieee, cfg: PtrConfig):
    M, K = a.shape
    N = out.shape[1]
    grid = (C.cdiv(M, cfg.block_m) * C.cdiv(N, cfg.block_n),)
    C.launch(_matmul_glu_kernel, grid, a_ptr=a, b_ptr=b, c_ptr=out,
             bias_ptr=bias if bias is not None else a, M=M, N=N, K=K,
             stride_am=a.stride(0), stride_ak=a.stride(1), stride_bk=b.stride(0),
             stride_bn=b.stride(1), stride_up=N * b.stride(1), stride_cm=out.stride(0),
             stride_cn=out.stride(1), stride_bias=bias.stride(0) if bias is not None else 0,
             HAS_BIAS=bias is not None, ACT=activation, IEEE=ieee,
             INT64=C.needs_int64(a, b, out), **cfg.launch_kwargs())


def _launch_glu_splitk(a, b, out, bias, activation, ieee, cfg: SplitKConfig):
    M, K = a.shape
    N2 = b.shape[1]
    N = N2 // 2
    split, bm, bn = cfg.split_k, cfg.block_m, cfg.block_n
    if split == 1:  # nothing to reduce: the pointer kernel streams the same weight columns
        unsplit = dataclasses.replace(cfg.unsplit(), block_n=max(16, bn // 2))
        _launch_glu_ptr(a, b, out, bias, activation, ieee, unsplit)
        return
    # partials are float32 and fully overwritten: a plain allocation, never poisoned
    ws = C.scratch((split, M, N2), torch.float32, a.device)
    C.launch(_matmul_splitk_kernel, (C.cdiv(N2, bn), C.cdiv(M, bm), split),
             a_ptr=a, b_ptr=b, ws_ptr=ws, M=M, N=N2, K=K,
             stride_am=a.stride(0), stride_ak=a.stride(1),
             stride_bk=b.stride(0), stride_bn=b.stride(1),
             IEEE=ieee, **cfg.launch_kwargs())
    rbn = 128 if N >= 128 else max(16, C.next_power_of_2(N))
    C.launch(_splitk_glu_reduce_kernel, (C.cdiv(N, rbn), C.cdiv(M, bm)),
             ws_ptr=ws, c_ptr=out, bias_ptr=bias if bias is not None else ws, M=M, N=N,
             stride_cm=out.stride(0), stride_cn=out.stride(1),
             stride_bias=bias.stride(0) if bias is not None else 0, SPLIT_K=split,
             HAS_BIAS=bias is not None, ACT=activation, BLOCK_M=bm, BLOCK_N=rbn, num_warps=4)


def _run_glu_2d(a, b, out, bias, activation, ieee, p: MatmulPlan, config=None):
    """Launch ``p`` for a 2-D ``a`` and ``out`` (its config, or ``config``: one of the kernel
    of ``p.path``)."""
    cfg = config if config is not None else p.config
    if p.path == "empty":
        return
    if p.path == "gluon":
        from tkit.kernels.matmul import gemm_hopper as GH

        GH.launch_glu(a, b, out, bias, activation, _expect(cfg, GluonConfig))
    elif p.path == "splitk":
        _launch_glu_splitk(a, b, out, bias, activation, ieee, _expect(cfg, SplitKConfig))
    elif p.path == "ptr":
        _launch_glu_ptr(a, b, out, bias, activation, ieee, _expect(cfg, PtrConfig))
    else:
        raise ValueError(f"unknown matmul_glu path {p.path!r}")


def _glu_impl(a, b, bias=None, activation="silu", out_dtype=None, allow_tf32=True, path=None,
              config=None):
    """The validated call: a (..., M, K) with its leading dims folded into M (a view where
    the strides allow, else one copy), b (K, 2N)."""
    K = a.shape[-1]
    N = b.shape[1] // 2
    out = C.empty((*a.shape[:-1], N), out_dtype or a.dtype, a.device)
    if out.numel() == 0:
        return out
    rows = out.numel() // N  # not -1: with K = 0 a view of (-1, 0) is ambiguous
    a2 = a if a.ndim == 2 else _try_view(a, rows, K)
    if a2 is None:
        a2 = a.reshape(rows, K)
    out2 = out.view(-1, N)
    p = MC.glu_plan(a2, b, out.dtype, path=path)
    _run_glu_2d(a2, b, out2, bias, activation, a.dtype == torch.float32 and not allow_tf32, p,
                config)
    return out


def _glu_shape(a, b):
    return (*a.shape[:-1], b.shape[1] // 2)


@R.custom_op("tkit::matmul_glu", mutates_args=(), plans=True)
def _glu_op(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor],  # noqa: UP045
            activation: str, out_dtype: Optional[torch.dtype],  # noqa: UP045
            allow_tf32: bool) -> torch.Tensor:
    if not MC.overridden():
        # served by an eager plan on a repeated signature (a compiled graph's calls)
        return P.serve_op(_glu_op, _glu_impl, (a, b, bias, activation, out_dtype, allow_tf32))
    return _glu_impl(a, b, bias, activation, out_dtype, allow_tf32)



@_glu_op.register_fake
def _(a, b, bias, activation, out_dtype, allow_tf32):
    return a.new_empty(_glu_shape(a, b), dtype=out_dtype or a.dtype)


def _glu_setup(ctx, inputs, output):
    a, b, bias, activation, out_dtype, allow_tf32 = inputs
    ctx.activation = activation
    ctx.allow_tf32 = allow_tf32
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.save_for_backward(a, b, bias)


def _glu_backward(ctx, grad):
    """out = act(g) * u with [g, u] = a @ b + bias: the pre-activations are recomputed by one
    tkit.matmul in float32; d[g, u] = [grad * u * act'(g), grad * act(g)], then the two GEMMs
    of a linear layer's backward through tkit.matmul (transposes are views)."""
    a, b, bias = ctx.saved_tensors
    K = a.shape[-1]
    N = b.shape[1] // 2
    a2 = a.reshape(-1, K)
    pre = _matmul_op(a2, b, bias, None, None, None, "", torch.float32, ctx.allow_tf32, "auto")
    g, u = pre[:, :N], pre[:, N:]
    go = grad.reshape(-1, N).float()
    dpre = torch.cat([_activation_grad(go * u, g, ctx.activation),
                      go * _torch_activation(g, ctx.activation)], dim=1)
    ga = gb = gbias = None
    if ctx.needs_input_grad[0]:
        ga = _matmul_op(dpre.to(a.dtype), b.t(), None, None, None, None, "", torch.float32,
                        ctx.allow_tf32, "auto").reshape(a.shape).to(a.dtype)
    if ctx.needs_input_grad[1]:
        gb = _matmul_op(a2.t(), dpre.to(b.dtype), None, None, None, None, "", torch.float32,
                        ctx.allow_tf32, "auto").to(b.dtype)
    if bias is not None and ctx.needs_input_grad[2]:
        gbias = dpre.sum(0).to(ctx.bias_dtype)
    return ga, gb, gbias, None, None, None


_glu_op.register_autograd(_glu_backward, setup_context=_glu_setup)


def _check_glu(a, b, bias, activation, out_dtype):
    """matmul_glu's argument checks (errors name the argument, before any launch)."""
    C.check_tensor(a, "a", C.FLOAT_DTYPES, min_ndim=2)
    C.check_tensor(b, "b", C.FLOAT_DTYPES, ndim=2)
    C.check_same_device(a=a, b=b)
    if a.dtype != b.dtype:
        raise TypeError(f"b has dtype {C.dtype_name(b.dtype)} but a has "
                        f"{C.dtype_name(a.dtype)}; cast one of them")
    if a.shape[-1] != b.shape[0]:
        raise ValueError(f"a of shape {tuple(a.shape)} and b of shape {tuple(b.shape)} cannot "
                         f"be multiplied: a.shape[-1]={a.shape[-1]} != b.shape[0]={b.shape[0]}")
    if b.shape[1] % 2:
        raise ValueError(f"b must have an even number of columns (gate columns, then up), got "
                         f"shape {tuple(b.shape)}")
    if activation not in MC.GLU_ACTIVATIONS:
        raise ValueError(f"activation must be one of {MC.GLU_ACTIVATIONS}, got {activation!r}")
    _check_out_dtype(out_dtype)
    if bias is not None:
        C.check_tensor(bias, "bias", ndim=1)
        if bias.device != a.device:
            raise ValueError(f"bias is on {bias.device} but a is on {a.device}")
        if bias.shape[0] != b.shape[1]:
            raise ValueError(f"bias must have shape ({b.shape[1]},) (2N: gate, then up), got "
                             f"{tuple(bias.shape)}")
