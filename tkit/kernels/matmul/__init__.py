"""GEMM: ``out = act(scale_a * scale_b * (a @ b) + bias) + residual``, rounded once to out_dtype.

Math. ``a`` is (..., M, K), ``b`` is (..., K, N) (leading dims broadcast), accumulation is in
float32 whatever the inputs (fp16/bf16 on tensor cores; fp32 on tf32 tensor cores unless
``allow_tf32=False``; float8_e4m3fn on fp8 tensor cores). The epilogue, in float32, applies in
this order: per-tensor / per-row (M) ``scale_a`` and per-tensor / per-column (N) ``scale_b``,
``bias`` (N,), the activation (silu, gelu, gelu_tanh, relu), ``residual`` (broadcast to the
output), then one rounding to ``out_dtype``.

Cost model: FLOPs = 2*M*N*K per batch; bytes >= (M*K + K*N) * in_size + M*N * out_size.
Arithmetic intensity of the whole problem at 4096^3 bf16 is ~1365 FLOP/byte, far past the
H200's balance point (~990 TFLOP/s dense bf16 / 4.8 TB/s ~ 200 FLOP/byte): compute-bound.
What matters is the intensity of one *tile*: a BM x BN tile with K-step BK loads
(BM + BN) * BK * 2 bytes for 2 * BM * BN * BK FLOPs, i.e. BM*BN/(BM+BN) FLOP/byte from L2/HBM:
64 for 128x128, 85 for 128x256, 128 for 256x256. Tiles must be large for the operands to come
from shared memory fast enough, and L2 reuse across tiles (grouped ordering) makes up the rest.
At M <= 64 (decode) the problem flips: intensity ~ M FLOP/byte, memory-bound, and the goal is
streaming the K*N weight at copy bandwidth.

Five kernels (and :func:`matmul_glu`, the gated up-projection of a SwiGLU / GeGLU MLP,
``act(a @ b_gate + bias) * (a @ b_up + bias)``, on three of them: the Gluon GEMM with a
gated epilogue on sm_90, split-K with the gate applied in the reduce at M <= 64, and a
pointer kernel with two accumulators elsewhere; :func:`glu_plan` says which):

* the Gluon GEMM (``gemm_hopper.py``, ``_gemm_hopper_kernels.py``; sm_90, bf16/fp16, a
  row-major, b K-major as an nn.Linear weight's ``w.t()``, bias and residual epilogues):
  persistent and warp-specialized, a TMA producer warp filling a ring of K steps and two
  consumer warpgroups issuing wgmma, tiles 128 x 128 / 192 / 256 chosen by the wave count
  (:class:`GluonConfig`); the 16-bit calls it takes on sm_90, where the wave model takes
  128-row tiles. Everything else keeps the Triton kernels below, with the reason in
  :func:`plan`.
* ``_matmul_tma_kernel`` (Hopper, sm_90): persistent (one program per SM walks tiles with a
  grouped, L2-friendly order), operands through device-side TMA tensor descriptors
  (``tl.make_tensor_descriptor``; a column-major operand is described as its transpose and
  transposed in shared memory, no copy), wgmma, ``tl.range(..., flatten=True)`` so that loads
  for the next tile are issued while the epilogue of this one runs, and an optional epilogue
  split into two half-tiles (less register pressure, two smaller TMA stores).
* ``_matmul_kernel`` (portable, sm_80 and any strides or batch): pointer-based tiles with
  grouped ordering; ``num_stages`` >= 3 becomes cp.async pipelining on sm_80 and later.
* ``_matmul_splitk_kernel`` + ``_splitk_reduce_kernel`` (M <= 64, large K*N; 16-bit up to M =
  128 where one wave holds its tiles): the K dimension is split across programs so that one
  wave of them streams the weight at once (1 split runs the pointer kernel); each writes a
  float32 partial tile, and a second kernel sums the partials in a fixed order (deterministic,
  no atomics) and applies the epilogue.
  ``_matmul_splitk_fused_kernel`` (``SplitKConfig.fused_reduce``, opt-in) does both in one
  launch: the last program to finish a tile (per-tile arrival counter) sums the partials in
  split order and applies the epilogue.
* ``_grouped_matmul_tma_kernel`` (sm_90+, 16-bit operands, a row-major, the weights one
  TMA-describable matrix): many problems in one launch, rows of ``a`` split into groups by
  ``offsets`` (the MoE layout), one ``b`` per group; persistent, every group's row tiles
  numbered into one virtual M axis walked in grouped order, as the TMA kernel walks one
  problem. :func:`grouped_plan` says which grouped kernel runs and why.
* ``_grouped_matmul_kernel``: the same problem through pointers, any device, dtype and
  strides.

Which one runs for a call is :func:`plan`'s decision; it returns the path, the reason and the
config, and ``tkit.ir`` shows the launched kernel. Configs are typed and frozen, one class per
kernel (:class:`GluonConfig`, :class:`TmaConfig`, :class:`PtrConfig`, :class:`SplitKConfig`,
:class:`GroupedConfig`, :class:`GroupedTmaConfig`),
fixed per shape class by default (each ``for_shape`` with its derivation); experiments change
them inside ``with matmul_config(block_n=128, num_stages=4): ...`` (scoped, per thread, an
unknown field is a TypeError). ``TKIT_AUTOTUNE=1`` tunes the TMA and pointer kernels per shape
over pruned config lists instead; docs/NOTES.md has the H200 timings of the alternatives side
by side.

The package: ``config.py`` (constants, autotune lists, the config classes, :func:`plan`),
``_kernels.py`` (the Triton code), ``ops.py`` (launchers, checks, torch.library), this module
(the public functions and ``cost``), and two variants of the same GEMM beside them:
``fp8_block.py`` (block-scaled fp8, the DeepSeek-V3 recipe behind :func:`matmul_fp8`'s block
mode) and ``int4.py`` (``matmul_int4``, the INT4 weight-only GEMM, with
``quantize_int4``/``dequantize_int4`` and the AWQ/GPTQ converters). INT4 lives here and not in
``quant/``: its kernel is a matmul (the split-K reduce, ``_dot`` and the tile plan are this
family's, and the registry counts it in the matmul family), and its quantize helpers only
produce that kernel's packed weight format, offline; ``quant/`` is the dynamic per-token
activation quantization that runs in the forward pass. Both import ``config`` and
``_kernels``, never this module, so the package has no import cycle.

Not here yet: a TMA path for batched operands (3-D descriptors; batched problems with a shared
weight are folded into M and do take it), a warp-specialized grouped kernel, and per-stream
counters that would let the one-launch split-K be the default.
"""

from __future__ import annotations

import torch

from tkit import _env
from tkit.kernels import _common as C
from tkit.kernels import _offsets
from tkit.kernels import _plan as P
from tkit.kernels.matmul import config as MC
from tkit.kernels.matmul.config import (  # noqa: F401  (public: planning and configs)
    GluonConfig,
    GroupedConfig,
    GroupedTmaConfig,
    MatmulPlan,
    PtrConfig,
    SplitKConfig,
    TmaConfig,
    _default_out_dtype,
    glu_plan,
    grouped_plan,
    matmul_config,
    plan,
)
from tkit.kernels.matmul.ops import (
    _check_epilogue,
    _check_glu,
    _check_operands,
    _check_out_dtype,
    _glu_impl,
    _glu_op,
    _grouped_impl,
    _grouped_op,
    _matmul_impl,
    _matmul_op,
    _out_shape,
    _run_2d,
)


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None, residual: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, *, allow_tf32: bool = True,
           backend: str = "auto") -> torch.Tensor:
    """``act(a @ b + bias) + residual`` in one kernel, rounded once to ``out_dtype``.

    Parameters
    ----------
    a : Tensor
        (..., M, K), float32, float16 or bfloat16, any strides (row- or column-major, no copy).
    b : Tensor
        (..., K, N), same dtype; leading dims broadcast with a's. An nn.Linear weight ``w``
        (N, K) is passed as ``w.t()`` (a column-major view; no copy).
    bias : Tensor, optional
        (N,), added before the activation.
    activation : {None, "silu", "gelu", "gelu_tanh", "relu"}
    residual : Tensor, optional
        Broadcasts to the output; added after the activation.
    out_dtype : torch.dtype, optional
        Default: a's dtype.
    allow_tf32 : bool
        float32 inputs on tf32 tensor cores (default) or in full float32 (``False``).
    backend : {"auto", "triton", "cuda"}
        "auto" is the Triton kernel for now; "cuda" calls ``tkit.cuda_ext.dispatch("matmul",
        a, b)`` and applies the epilogue with separate torch ops.

    Returns
    -------
    Tensor
        (broadcast batch..., M, N), contiguous. :func:`plan` says which kernel runs.
    """
    if (P.ON and type(a) is _T and (type(b) is _T or type(b) is _Param) and bias is None
            and residual is None and backend == "auto" and not _compiling()
            and not (_grad_enabled() and (a.requires_grad or b.requires_grad))
            and not MC._DEPTH.n):  # (MC.overridden() without the call)
        # the eager plan (tkit.kernels._plan): the key holds all the ordinary path reads
        return P.serve_fast(_plans, (activation, out_dtype, allow_tf32), (a, b), _matmul_slow,
                            (a, b, None, activation, None, out_dtype, allow_tf32, backend))
    if backend == "auto" and P.plannable(MC._DEPTH.n, a, b, bias, residual):
        # with a bias or a residual: both are inputs of the plan (their signatures in its key)
        return P.serve_fast(_epi_plans, (activation, out_dtype, allow_tf32),
                            (a, b, bias, residual), _matmul_slow,
                            (a, b, bias, activation, residual, out_dtype, allow_tf32, backend))
    return _matmul_slow(a, b, bias, activation, residual, out_dtype, allow_tf32, backend)


_T = torch.Tensor
_Param = torch.nn.Parameter
_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_plans = P.new_cache()
_epi_plans = P.new_cache()


def _matmul_slow(a, b, bias, activation, residual, out_dtype, allow_tf32, backend):
    direct = C.use_direct_path(a, b, bias, residual)
    cacheable = (direct and backend in ("auto", "triton") and a.ndim == 2 and b.ndim == 2
                 and not MC.overridden())
    if cacheable:
        # eager 2-D calls: validation and planning once per call signature (a decode step
        # repeats the same few signatures; the kernels there last ~30 us, about what this
        # Python costs)
        key = _signature(a, b, bias, residual, activation, out_dtype, allow_tf32)
        hit = _FAST.get(key)
        if hit is not None:
            return _run_fast(a, b, bias, residual, activation, *hit)
    out_shape = _check_operands(a, b, C.FLOAT_DTYPES)
    _check_out_dtype(out_dtype)
    _check_epilogue(out_shape, a.device, bias, activation, residual)
    if backend not in ("auto", "triton", "cuda"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'cuda', got {backend!r}")
    if cacheable:
        od = out_dtype or _default_out_dtype(a.dtype)
        p = plan(a, b, od, bias=bias, residual=residual, activation=activation)
        ieee = a.dtype == torch.float32 and not allow_tf32
        if len(_FAST) >= _FAST_MAX:
            _FAST.clear()
        _FAST[key] = (od, ieee, p)
        return _run_fast(a, b, bias, residual, activation, od, ieee, p)
    if direct:
        return _matmul_impl(a, b, bias, residual, None, None, activation, out_dtype, allow_tf32,
                            backend)
    return _matmul_op(a, b, bias, residual, None, None, activation or "", out_dtype, allow_tf32,
                      backend)


#: call signature -> (out_dtype, ieee, plan) of eager 2-D matmul calls already validated
_FAST: dict = {}
_FAST_MAX = 4096


def _desc(t: torch.Tensor | None):
    """What validation and planning depend on, for one tensor: shape, strides, dtype, device
    and 16-byte alignment (TMA eligibility and Triton's pointer specialization)."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


def _signature(a, b, bias, residual, activation, out_dtype, allow_tf32):
    return (_desc(a), _desc(b), _desc(bias), _desc(residual), activation, out_dtype,
            allow_tf32)


def _run_fast(a, b, bias, residual, activation, out_dtype, ieee, p):
    out = C.empty((a.shape[0], b.shape[1]), out_dtype, a.device)
    if out.numel() == 0:
        return out
    if residual is not None and residual.shape != out.shape:
        residual = residual.expand(out.shape)
    _run_2d(a, b, out, residual, None, None, bias, activation, ieee, p)
    return out


def matmul_glu(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
               activation: str = "silu", out_dtype: torch.dtype | None = None, *,
               allow_tf32: bool = True) -> torch.Tensor:
    """The gated up-projection of a SwiGLU / GeGLU MLP in one GEMM:
    ``act(a @ b[:, :N] + bias[:N]) * (a @ b[:, N:] + bias[N:])``, float32 accumulation and
    epilogue, rounded once to ``out_dtype``; the (M, 2N) product is never written.

    Parameters
    ----------
    a : Tensor
        (..., M, K), float32, float16 or bfloat16; leading dims are folded into M.
    b : Tensor
        (K, 2N), a's dtype: gate columns first, then up. A merged gate/up nn.Linear weight
        ``w_gu`` (2N, K) (HF's and vLLM's layout) is passed as ``w_gu.t()`` (no copy).
    bias : Tensor, optional
        (2N,), gate then up, added before the activation.
    activation : {"silu", "gelu", "gelu_tanh"}
        Applied to the gate: SwiGLU ("silu"), GeGLU ("gelu", "gelu_tanh").
    out_dtype : torch.dtype, optional
        Default: a's dtype.
    allow_tf32 : bool
        float32 inputs on tf32 tensor cores (default) or in full float32, as in :func:`matmul`.

    Returns
    -------
    Tensor
        (..., M, N), contiguous. :func:`glu_plan` says which kernel runs: on sm_90 the Gluon
        GEMM with a gated epilogue (16-bit, a row-major, b K-major), at M <= 64 the split-K
        path, else the pointer kernel with two accumulators. Differentiable.

    Cost: FLOPs 2*M*2N*K; bytes a + b + the (M, N) output (against a + b + 2 * (M, 2N) + 3 *
    (M, N) for the GEMM, then a separate act-mul).
    """
    if P.plannable(MC._DEPTH.n, a, b, bias):
        # the eager plan: bias is an input (None or its signature in the key)
        return P.serve_fast(_glu_plans, (activation, out_dtype, allow_tf32), (a, b, bias),
                            _matmul_glu_slow, (a, b, bias, activation, out_dtype, allow_tf32))
    return _matmul_glu_slow(a, b, bias, activation, out_dtype, allow_tf32)


_glu_plans = P.new_cache()


def _matmul_glu_slow(a, b, bias, activation, out_dtype, allow_tf32):
    _check_glu(a, b, bias, activation, out_dtype)
    if C.use_direct_path(a, b, bias):
        return _glu_impl(a, b, bias, activation, out_dtype, allow_tf32)
    return _glu_op(a, b, bias, activation, out_dtype, allow_tf32)


def glu_cost(a: torch.Tensor, b: torch.Tensor, bias=None, activation="silu", out_dtype=None,
             **kwargs):
    """(bytes, FLOPs) of :func:`matmul_glu`: a, b (and bias) read once, the (..., M, N) output
    written once; 2 * M * 2N * K FLOPs."""
    from tkit._cost import Cost, unique_bytes

    shape = (*a.shape[:-1], b.shape[1] // 2)
    n = 1
    for s in shape:
        n *= s
    m = n // max(1, shape[-1])
    out_es = (out_dtype or a.dtype).itemsize
    extra = unique_bytes(bias) if bias is not None else 0
    return Cost(unique_bytes(a) + unique_bytes(b) + extra + n * out_es,
                2.0 * m * b.shape[1] * a.shape[-1])


def _check_scale(s, name, n, what):
    C.check_tensor(s, name, (torch.float32,))
    if s.numel() == 1:
        return s.reshape(1)
    if s.numel() != n or (s.ndim == 2 and s.shape not in ((n, 1), (1, n))) or s.ndim > 2:
        raise ValueError(f"{name} must hold 1 element (per-tensor) or {n} ({what}), got shape "
                         f"{tuple(s.shape)}")
    return s.reshape(n)


def matmul_fp8(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
               out_dtype: torch.dtype = torch.bfloat16, *, bias: torch.Tensor | None = None,
               activation: str | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """``(scale_a * scale_b * (a @ b))`` for float8_e4m3fn operands, float32 accumulation.

    Parameters
    ----------
    a : Tensor
        (M, K) float8_e4m3fn.
    b : Tensor
        (K, N) float8_e4m3fn; column-major (``w.t()`` of an (N, K) weight) is the fast layout on
        Hopper, as for ``torch._scaled_mm``.
    scale_a, scale_b : Tensor
        float32 dequantization scales: one element (per-tensor), or M (per-row of a,
        shape (M,) or (M, 1)) / N (per-column of b, shape (N,) or (1, N)); or block scales
        (DeepSeek-V3): scale_a (M, ceil(K / 128)) per 1x128 group of a row of a and scale_b
        (ceil(K / 128), ceil(N / 128)) per 128x128 block of b, applied to each 128-deep K
        step's MMA sum inside the K loop (tkit/kernels/matmul/fp8_block.py). On sm_90 an
        opt-in faster schedule, ``fp8_block_hopper.hopper_block_config(schedule="rescale")``,
        keeps one accumulator in the fp8 MMA over all of K instead: the numerics of
        ``torch._scaled_mm(..., use_fast_accum=True)``, several times the default's error.
        On sm_90, per-tensor, per-row and per-column scales run the block mode's CUDA
        kernel where it serves (``fp8_block.scales_as_block``: each block's scale the one
        value or the row's, the column scales multiplied in before the store): the same
        128-deep float32 promotion, faster than the Triton kernel.
    out_dtype : torch.dtype
        bfloat16 (default), float16 or float32.
    bias, activation, residual
        The epilogue of :func:`matmul`, applied after the scales.
    """
    if P.plannable(MC._DEPTH.n, a, b, scale_a, scale_b, bias, residual):
        # the eager plan: scales, bias and residual are inputs, the rest options
        return P.serve_fast(_fp8_plans, (out_dtype, activation),
                            (a, b, scale_a, scale_b, bias, residual), _matmul_fp8_slow,
                            (a, b, scale_a, scale_b, out_dtype, bias, activation, residual))
    return _matmul_fp8_slow(a, b, scale_a, scale_b, out_dtype, bias, activation, residual)


_fp8_plans = P.new_cache()


def _matmul_fp8_slow(a, b, scale_a, scale_b, out_dtype, bias, activation, residual):
    C.check_tensor(a, "a", C.FP8_DTYPES, ndim=2)
    C.check_tensor(b, "b", C.FP8_DTYPES, ndim=2)
    out_shape = _check_operands(a, b, C.FP8_DTYPES)
    _check_out_dtype(out_dtype)
    _check_epilogue(out_shape, a.device, bias, activation, residual)
    from tkit.kernels.matmul import fp8_block as _block

    if _block.is_block_scaled(a, b, scale_a, scale_b):
        return _block.matmul_fp8_block(a, b, scale_a, scale_b, out_dtype, bias, activation,
                                       residual)
    scale_a = _check_scale(scale_a, "scale_a", a.shape[0], "per row of a")
    scale_b = _check_scale(scale_b, "scale_b", b.shape[1], "per column of b")
    C.check_same_device(a=a, scale_a=scale_a, scale_b=scale_b)
    as_block = _block.scales_as_block(a, b, scale_a, scale_b, out_dtype, bias, residual,
                                      activation)
    if as_block is not None:  # sm_90: the CUDA block kernel (per-column scales: its build)
        sa, sb, scale_n = as_block
        return _block.matmul_fp8_block(a, b, sa, sb, out_dtype, None, None, None, scale_n)
    if C.use_direct_path(a, b, bias, residual):
        return _matmul_impl(a, b, bias, residual, scale_a, scale_b, activation, out_dtype)
    return _matmul_op(a, b, bias, residual, scale_a, scale_b, activation or "", out_dtype, True,
                      "auto")


def grouped_matmul(a, b, offsets: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None, *, allow_tf32: bool = True):
    """Many GEMMs in one launch: ``a[offsets[g]:offsets[g+1]] @ b[g]`` for every group g.

    Parameters
    ----------
    a : Tensor or list of Tensor
        (T, K): the rows of all groups back to back (the MoE layout, tokens sorted by expert);
        or a list of (M_g, K) tensors.
    b : Tensor or list of Tensor
        (G, K, N), any strides (an expert weight stack of shape (G, N, K) is passed as
        ``w.transpose(1, 2)``); or a list of G (K, N) tensors.
    offsets : Tensor
        (G + 1,) int32 or int64 on a's device, non-decreasing, offsets[0] = 0 and
        offsets[G] = T. Read on the device only (no host sync). Omitted for list inputs.
        Checked before the launch when on the host (always so in the interpreter), and on the
        device under ``TKIT_CHECK=1``. Unchecked invalid offsets cannot make the kernel touch
        memory outside a, b or the output: group g takes rows [bound(g), bound(g+1)) where
        bound(j) is the largest of offsets[:j+1] clamped to [0, T], and rows in no group are
        zeros.
    out_dtype : torch.dtype, optional
    allow_tf32 : bool
        float32 inputs on tf32 tensor cores (default) or in full float32 (``False``), as in
        :func:`matmul`, for the forward and both gradients. torch's own float32 matmul is full
        float32 unless ``torch.backends.cuda.matmul.allow_tf32`` is set: pass ``False`` to
        compare with it (tf32 keeps 10 mantissa bits of each operand: errors near 1e-3).

    Returns
    -------
    Tensor (T, N), or a list of (M_g, N) views of one output for list inputs. The list form
    concatenates its inputs first (one copy of a and b); pass the packed form to avoid it.
    Differentiable: the input gradient is one more grouped launch, the weight gradient a
    per-group reduction over rows (deterministic). On sm_90 with 16-bit operands, a row-major
    ``a`` and the weights one evenly strided stack, the forward and the input gradient run a
    persistent TMA kernel; :func:`grouped_plan` says which kernel a call takes and why.
    """
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            raise ValueError("a and b must be lists of the same length for the list form")
        if offsets is not None:
            raise ValueError("offsets is computed from the list form; do not pass it")
        if not a:
            return []
        for i, (x, w) in enumerate(zip(a, b)):
            C.check_tensor(x, f"a[{i}]", ndim=2)
            C.check_tensor(w, f"b[{i}]", ndim=2)
            if x.shape[1] != w.shape[0] or w.shape != b[0].shape or x.dtype != a[0].dtype \
                    or w.dtype != a[0].dtype:
                raise ValueError(f"group {i}: a[{i}] {tuple(x.shape)} @ b[{i}] {tuple(w.shape)} "
                                 "must match group 0's K, N and dtype")
        sizes = [x.shape[0] for x in a]
        offs = [0]
        for s in sizes:
            offs.append(offs[-1] + s)
        packed = grouped_matmul(torch.cat(list(a)), torch.stack(list(b)),
                                torch.tensor(offs, dtype=torch.int32).to(a[0].device), out_dtype,
                                allow_tf32=allow_tf32)
        return list(packed.split(sizes))
    if P.plannable(MC._DEPTH.n, a, b, offsets):
        # the eager plan: offsets' values are read on the device; host ones (and every one
        # under TKIT_CHECK=1) are still checked per call
        check = _grouped_hit_check if _env.CHECK or not offsets.is_cuda else None
        return P.serve_fast(_grouped_plans, (out_dtype, allow_tf32), (a, b, offsets),
                            _grouped_slow, (a, b, offsets, out_dtype, allow_tf32), check)
    return _grouped_slow(a, b, offsets, out_dtype, allow_tf32)


_grouped_plans = P.new_cache()


def _grouped_hit_check(a, b, offsets, *_):
    if _offsets.values_checked(offsets):
        _offsets.check_values(offsets, "offsets", a.shape[0], "a.shape[0]")


def _grouped_slow(a, b, offsets, out_dtype, allow_tf32):
    C.check_tensor(a, "a", ndim=2)
    C.check_tensor(b, "b", ndim=3)
    C.check_tensor(offsets, "offsets", (torch.int32, torch.int64), ndim=1)
    C.check_same_device(a=a, b=b, offsets=offsets)
    if a.dtype != b.dtype:
        raise TypeError(f"b has dtype {C.dtype_name(b.dtype)} but a has {C.dtype_name(a.dtype)}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"a of shape {tuple(a.shape)} and b of shape {tuple(b.shape)}: "
                         "a.shape[1] must equal b.shape[1] (K)")
    if offsets.shape[0] != b.shape[0] + 1:
        raise ValueError(f"offsets must have G + 1 = {b.shape[0] + 1} entries, got "
                         f"{offsets.shape[0]}")
    _check_out_dtype(out_dtype)
    if _offsets.values_checked(offsets):
        _offsets.check_values(offsets, "offsets", a.shape[0], "a.shape[0]")
    if C.use_direct_path(a, b):
        return _grouped_impl(a, b, offsets, out_dtype, allow_tf32=allow_tf32)
    return _grouped_op(a, b, offsets, out_dtype, allow_tf32)


def cost(a: torch.Tensor, b: torch.Tensor, *args, out_dtype=None, **kwargs):
    """(bytes, FLOPs) of ``a @ b``: every operand read once, the output written once."""
    from tkit._cost import Cost, unique_bytes

    shape = _out_shape(a, b)
    out_es = (out_dtype or _default_out_dtype(a.dtype)).itemsize
    n = 1
    for s in shape:
        n *= s
    flops = 2.0 * n * a.shape[-1]
    return Cost(unique_bytes(a) + unique_bytes(b) + n * out_es, flops)
