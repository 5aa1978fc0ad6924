"""Specs of the GEMM family (tkit/kernels/matmul/)."""

from __future__ import annotations

import torch

import tkit
from tkit.registry import (
    Case,
    Cost,
    OpSpec,
    eager_baseline,
    lazy_composite,
    optional_module,
    torch_compile_baseline,
    unique_bytes,
)
from tkit.testing.tensors import LAYOUTS, make_tensor

# hypothesis is a test dependency: imported when a fuzz recipe is first used
st = optional_module("hypothesis.strategies")
S = optional_module("tkit.testing.strategies")

BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn

#: (N, K) of the Llama-3 projections, as the weights of y = x @ W^T: name -> (N, K)
LLAMA_SHAPES = {
    "8B qkv": (6144, 4096), "8B o": (4096, 4096), "8B gate_up": (28672, 4096),
    "8B down": (4096, 14336),
    "70B qkv": (10240, 8192), "70B o": (8192, 8192), "70B gate_up": (57344, 8192),
    "70B down": (8192, 28672),
}
LLAMA_M = (1, 16, 64, 256, 1024, 4096, 16384)


# ---- references ----------------------------------------------------------------------------
def _act(y, activation):
    if not activation:
        return y
    if activation == "silu":
        return torch.nn.functional.silu(y)
    if activation in ("gelu", "gelu_tanh"):
        return torch.nn.functional.gelu(y, approximate="tanh" if activation == "gelu_tanh"
                                        else "none")
    return torch.relu(y)


def ref_matmul(a, b, bias=None, activation=None, residual=None, out_dtype=None,
               allow_tf32=True, backend="auto"):
    """PyTorch: matmul, then the epilogue as separate ops (in the inputs' dtype for the peer)."""
    y = torch.matmul(a, b)
    if bias is not None:
        y = y + bias.to(y.dtype)
    y = _act(y, activation)
    if residual is not None:
        y = y + residual.to(y.dtype)
    if out_dtype is not None and y.dtype != torch.float64:
        y = y.to(out_dtype)
    return y


def ref_matmul_glu(a, b, bias=None, activation="silu", out_dtype=None, allow_tf32=True):
    """PyTorch: the gate/up GEMM (F.linear's product), then act(gate) * up as separate ops
    (in the inputs' dtype for the peer: the (M, 2N) product rounded before the act-mul)."""
    y = torch.matmul(a, b)
    if bias is not None:
        y = y + bias.to(y.dtype)
    n = b.shape[-1] // 2
    y = _act(y[..., :n], activation) * y[..., n:]
    if out_dtype is not None and y.dtype != torch.float64:
        y = y.to(out_dtype)
    return y


def ref_matmul_fp8(a, b, scale_a, scale_b, out_dtype=BF16, bias=None, activation=None,
                   residual=None):
    """torch._scaled_mm's math: (a @ b) * scale_a * scale_b in float32 (float64 for the
    reference), then the epilogue of :func:`ref_matmul`."""
    wide = torch.float64 if a.dtype == torch.float64 else torch.float32
    if _block_scaled(a, b, scale_a, scale_b):
        # DeepSeek-V3's block scales: each element of a times its 1x128 group's scale, each
        # of b times its 128x128 block's, then one matmul (the same sum, regrouped)
        M, K = a.shape
        N = b.shape[1]
        sa = scale_a.to(wide).repeat_interleave(128, 1)[:, :K]
        sb = scale_b.to(wide).repeat_interleave(128, 0).repeat_interleave(128, 1)[:K, :N]
        y = (a.to(wide) * sa) @ (b.to(wide) * sb)
    else:
        sa = scale_a.to(wide).reshape(-1, 1) if scale_a.numel() > 1 else scale_a.to(wide)
        sb = scale_b.to(wide).reshape(1, -1) if scale_b.numel() > 1 else scale_b.to(wide)
        y = (a.to(wide) @ b.to(wide)) * sa * sb
    if bias is not None:
        y = y + bias.to(wide)
    y = _act(y, activation)
    if residual is not None:
        y = y + residual.to(wide)
    return y if wide == torch.float64 else y.to(out_dtype)


def _block_scaled(a, b, scale_a, scale_b):
    from tkit.kernels.matmul.fp8_block import is_block_scaled

    return is_block_scaled(a, b, scale_a, scale_b)


def ref_grouped_matmul(a, b, offsets, out_dtype=None):
    offs = offsets.tolist()
    outs = [a[offs[g]:offs[g + 1]] @ b[g] for g in range(b.shape[0])]
    y = torch.cat(outs) if outs else a.new_zeros((a.shape[0], b.shape[2]))
    return y.to(out_dtype) if out_dtype is not None and y.dtype != torch.float64 else y


# ---- costs -----------------------------------------------------------------------------------
def cost_matmul(a, b, bias=None, activation=None, residual=None, out_dtype=None, **kw):
    from tkit.kernels.matmul import cost

    c = cost(a, b, out_dtype=out_dtype)
    extra = (unique_bytes(bias) if bias is not None else 0) + \
        (unique_bytes(residual) if residual is not None else 0)
    return Cost(c.bytes + extra, c.flops)


def cost_matmul_glu(a, b, bias=None, activation="silu", out_dtype=None, **kw):
    from tkit.kernels.matmul import glu_cost

    return glu_cost(a, b, bias, activation, out_dtype)


def cost_matmul_fp8(a, b, scale_a, scale_b, out_dtype=BF16, **kw):
    return cost_matmul(a, b, out_dtype=out_dtype)


def cost_grouped(a, b, offsets, out_dtype=None):
    T, K = a.shape
    N = b.shape[2]
    es = a.element_size()
    return Cost(T * K * es + unique_bytes(b) + T * N * es, 2.0 * T * N * K)


# ---- inputs ----------------------------------------------------------------------------------
def _mm_case(M, N, K, dtype=BF16, *, b_layout="contiguous", label=None, group="square",
             epilogue=False, a_layout="contiguous"):
    def build(device):
        a = make_tensor((M, K), dtype, a_layout, seed=1, device=device)
        b = make_tensor((K, N), dtype, b_layout, seed=2, device=device, scale=K ** -0.5)
        kw = {}
        if epilogue:
            kw = dict(bias=make_tensor((N,), dtype, seed=3, device=device), activation="silu",
                      residual=make_tensor((M, N), dtype, seed=4, device=device))
        return (a, b), kw

    lab = label or f"{M}x{N}x{K} {'B^T' if b_layout == 'transposed' else 'B'}"
    return Case(lab, build, group, meta=dict(M=M, N=N, K=K))


def _bench_matmul():
    cases = [_mm_case(4096, 4096, 4096), _mm_case(8192, 8192, 8192),
             _mm_case(4096, 4096, 4096, b_layout="transposed"),
             _mm_case(8192, 8192, 8192, b_layout="transposed"),
             _mm_case(8192, 8192, 8192, a_layout="transposed", label="8192^3 A^T"),
             _mm_case(8192, 8192, 8192, epilogue=True, label="8192^3 bias+silu+residual",
                      group="epilogue")]
    for M in (1, 16, 64):
        cases.append(_mm_case(M, 14336, 4096, b_layout="transposed", group="skinny",
                              label=f"M={M} K=4096 N=14336 (weight W^T)"))
    for name, (N, K) in LLAMA_SHAPES.items():
        for M in LLAMA_M:
            cases.append(_mm_case(M, N, K, b_layout="transposed", group="llama",
                                  label=f"llama-3 {name} M={M}"))
    return cases


def _check_matmul():
    f16 = torch.float16
    return [
        _mm_case(37, 70, 45, f16, label="37x70x45"),
        _mm_case(64, 96, 80, f16, b_layout="transposed", a_layout="transposed",
                 label="A^T B^T 64x96x80"),
        _mm_case(3, 300, 256, f16, b_layout="transposed", group="skinny", label="M=3 skinny"),
        _mm_case(33, 65, 17, f16, epilogue=True, group="epilogue", label="fused epilogue"),
    ]


#: Llama-3-8B's MLP: hidden 4096, intermediate 14336 (the merged gate/up weight (28672, 4096))
GLU_N, GLU_K = 14336, 4096


def _glu_case(M, N, K, dtype=BF16, *, label=None, group="llama", bias=False, lead=(),
              a_layout="contiguous", activation="silu"):
    """a (lead..., M, K) and b = w_gu.t() of a merged (2N, K) gate/up weight."""
    def build(device):
        a = make_tensor((*lead, M, K), dtype, a_layout, seed=1, device=device)
        b = make_tensor((2 * N, K), dtype, seed=2, device=device, scale=K ** -0.5).t()
        kw = {"activation": activation}
        if bias:
            kw["bias"] = make_tensor((2 * N,), dtype, seed=3, device=device)
        return (a, b), kw

    lab = label or f"{M}x{N}x{K}"
    return Case(lab, build, group, meta=dict(M=M, N=N, K=K))


def _bench_glu():
    return [_glu_case(M, GLU_N, GLU_K, label=f"llama-3 8B gate_up+silu M={M}",
                      group="skinny" if M <= 64 else "llama") for M in (1, 16, 512, 4096)]


def _check_glu():
    f16 = torch.float16
    return [_glu_case(37, 70, 45, f16, label="37x70x45", group="odd"),
            _glu_case(17, 24, 40, f16, label="gelu_tanh, bias, 2x17 rows", lead=(2,),
                      bias=True, activation="gelu_tanh", group="epilogue")]


def _bench_fp8():
    def build(M, N, K, per_row):
        def make(device):
            a = make_tensor((M, K), torch.float32, seed=1, device=device).to(FP8)
            b = make_tensor((N, K), torch.float32, seed=2, device=device).to(FP8).t()
            sa = (torch.rand(M, 1, device=device) + 0.5) if per_row else \
                torch.tensor([0.7], device=device)
            sb = (torch.rand(1, N, device=device) + 0.5) if per_row else \
                torch.tensor([0.3], device=device)
            return (a, b, sa, sb), {}

        return make

    cases = [Case(f"fp8 {s}^3 {'row/col' if r else 'tensor'} scales", build(s, s, s, r), "fp8")
             for s in (4096, 8192) for r in (False, True)]
    cases.append(_fp8_block_case(8192, 8192, 8192, "fp8 8192^3 block scales (1x128, 128x128)"))
    for (N, K), name in DEEPSEEK_V3_SHAPES.items():
        for M in DEEPSEEK_V3_M:
            cases.append(_fp8_block_case(M, N, K, f"fp8 block DeepSeek-V3 {name} M={M}",
                                         group="fp8 block DeepSeek-V3"))
    return cases


#: (N, K) of DeepSeek-V3's dense GEMMs (DeepGEMM's table): the fused q_a + kv_a projection,
#: q_b, kv_b, o, and an expert's gate/up and down (intermediate 2048); hidden size 7168
DEEPSEEK_V3_SHAPES = {(2112, 7168): "q_a+kv_a", (24576, 1536): "q_b", (32768, 512): "kv_b",
                      (7168, 16384): "o", (4096, 7168): "expert gate_up",
                      (7168, 2048): "expert down"}
DEEPSEEK_V3_M = (64, 128, 4096)


def _fp8_block_case(M, N, K, label, group="fp8 block", dtype=torch.float32):
    """a (M, K) and b = w.t() of a (N, K) weight in fp8 with DeepSeek-V3's block scales:
    scale_a (M, K / 128) per 1x128 group, scale_b (K / 128, N / 128) per 128x128 block."""
    def make(device):
        a = make_tensor((M, K), dtype, seed=1, device=device).to(FP8)
        b = make_tensor((N, K), dtype, seed=2, device=device).to(FP8).t()
        kb, nb = -(-K // 128), -(-N // 128)
        sa = torch.rand(M, kb, device=device) + 0.5
        sb = (torch.rand(kb, nb, device=device) + 0.5) * K ** -0.5
        return (a, b, sa, sb), {}

    return Case(label, make, group, meta=dict(M=M, N=N, K=K))


def fp8_block_check_cases():
    """Block-scaled check cases (they pass in the interpreter too: tests/kernels/
    test_matmul_fp8_block.py runs them there)."""
    return [_fp8_block_case(33, 200, 384, "block scales 33x200x384 (N, K partial blocks)"),
            _fp8_block_case(5, 130, 260, "block scales 5x130x260 (K tail)")]


def _check_fp8():
    # the registry's CPU check of matmul_fp8 stays off (no_check_reason; tkit bench's CPU
    # report is tested on it); on a GPU the block-scaled cases are checked
    return fp8_block_check_cases() if torch.cuda.is_available() else []


def _bench_grouped():
    def build(G, tokens, N, K):
        def make(device):
            gen = torch.Generator().manual_seed(0)
            sizes = torch.multinomial(torch.ones(G), tokens, replacement=True, generator=gen)
            counts = torch.bincount(sizes, minlength=G)
            offs = torch.zeros(G + 1, dtype=torch.int32)
            offs[1:] = counts.cumsum(0)
            a = make_tensor((tokens, K), BF16, seed=1, device=device)
            b = make_tensor((G, N, K), BF16, seed=2, device=device).transpose(1, 2)
            return (a, b, offs.to(device)), {}

        return make

    return [Case(f"MoE G={G} tokens={t} N={n} K={k}", build(G, t, n, k), "grouped")
            for G, t, n, k in [(8, 16384, 14336, 4096), (64, 8192, 2048, 4096),
                               (128, 4096, 1536, 2048)]]


def _check_grouped():
    def make(device):
        offs = torch.tensor([0, 5, 5, 40, 41], dtype=torch.int32, device=device)
        a = make_tensor((41, 24), torch.float16, seed=1, device=device)
        b = make_tensor((4, 24, 33), torch.float16, "transposed", seed=2, device=device)
        return (a, b, offs), {}

    return [Case("4 groups (one empty) fp16", make, "grouped")]


# ---- fuzz recipes ------------------------------------------------------------------------------
#: the reference rule's floor for float32 GEMM outputs, in units of rounding at the largest
#: |reference|. tkit's float32 dot (Triton's IEEE dot, allow_tf32=False) accumulates a
#: product chain of K FMAs per output; cuBLAS, the peer, splits K at small shapes, so at the
#: fuzzed K <= 150 their errors differ by a few units either way (up to ~4 at K <= 128, within
#: twice the peer's error plus this floor). tf32 rounding, the failure this guards against,
#: is ~2^13 units. 16-bit outputs keep one unit.
F32_ULPS = 4.0
#: matmul_glu's float32 floor: its output is the product of two such dots (gate and up), so
#: their relative errors add (7.3 units seen on the H200: K = 108, gelu, |out| 328)
GLU_F32_ULPS = 2 * F32_ULPS + 1


@lazy_composite
def matmul_shapes(draw, max_mn=150, max_k=150):
    """((batch..., M, K), (batch'..., K, N)): batches equal, broadcast or absent on b."""
    M = draw(S.dim_sizes(tile=64, max_size=max_mn))
    N = draw(S.dim_sizes(tile=64, max_size=max_mn))
    K = draw(S.dim_sizes(tile=32, max_size=max_k))
    nb = draw(st.sampled_from([0, 0, 1, 2]))
    batch = tuple(draw(st.integers(1, 3)) for _ in range(nb))
    b_batch = draw(st.sampled_from([batch, (), tuple(1 for _ in batch)]))
    return (*batch, M, K), (*b_batch, K, N)


#: the GEMM kernels a fuzz example may force (``path``), beside the plan's own choice (None):
#: the plan takes split-K only for weights far larger than fuzzed ones, and TMA only on a
#: Hopper GPU, so without forcing, fuzzing (and the sanitizer campaign's examples) would
#: never reach them at edge sizes
FORCED_PATHS = ("ptr", "tma", "splitk")


def _tma_operands(a, b) -> bool:
    from tkit.kernels.matmul import config as MC

    return a.ndim == 2 and b.ndim == 2 and MC._tma_ok(a)[0] and MC._tma_ok(b)[0]


def fuzz_matmul_fn(a, b, with_bias=False, activation=None, with_residual=False,
                   allow_tf32=False, path=None):
    """tkit.matmul with an epilogue built from the inputs (bias: a row of b; residual: a@b's
    shape, from a fixed seed), so that the reference sees the same values. ``path``: one of
    :data:`FORCED_PATHS` forced (matmul's validated implementation, below the op), or None
    (the op); "tma" falls back to the op where an operand is not TMA-compatible."""
    bias, res = _fuzz_epilogue(a, b, with_bias, with_residual)
    if path == "tma" and not _tma_operands(a, b):
        path = None
    if path is None:
        return tkit.matmul(a, b, bias, activation, res, allow_tf32=allow_tf32)
    from tkit.kernels.matmul import ops as MO

    return MO._matmul_impl(a, b, bias, res, activation=activation, allow_tf32=allow_tf32,
                           path=path)


def fuzz_matmul_ref(a, b, with_bias=False, activation=None, with_residual=False,
                    allow_tf32=False, path=None):
    bias, res = _fuzz_epilogue(a, b, with_bias, with_residual)
    return ref_matmul(a, b, bias, activation, res)


def _fuzz_epilogue(a, b, with_bias, with_residual):
    N = b.shape[-1]
    bias = res = None
    if with_bias:
        bias = make_tensor((N,), torch.float32, seed=11, device=a.device).to(a.dtype)
    if with_residual:
        shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], N)
        res = make_tensor(shape, torch.float32, seed=12, device=a.device).to(a.dtype)
    return bias, res


def _fuzz_matmul():
    kw = st.fixed_dictionaries({
        "with_bias": st.booleans(),
        "activation": st.sampled_from([None, "silu", "gelu", "relu"]),
        "with_residual": st.booleans(),
        "path": st.sampled_from((None, None) + FORCED_PATHS),
    })
    # on the GPU every (dtype, layout, epilogue) combination is a compile of its own: cap the
    # examples there; the interpreter compiles nothing and takes the profile's count
    return dict(fn=fuzz_matmul_fn, reference=fuzz_matmul_ref, shapes=matmul_shapes(),
                dtypes=S.gpu_dtypes(), layouts=LAYOUTS, kwargs=kw, ulps=F32_ULPS,
                max_examples=40 if torch.cuda.is_available() else None)


@lazy_composite
def glu_shapes(draw, max_mn=100, max_k=100):
    """((lead..., M, K), (K, 2N))."""
    M = draw(S.dim_sizes(tile=64, max_size=max_mn))
    N = draw(S.dim_sizes(tile=32, max_size=max_mn, allow_zero=False))
    K = draw(S.dim_sizes(tile=32, max_size=max_k))
    lead = draw(st.sampled_from([(), (), (2,), (1, 3)]))
    return (*lead, M, K), (K, 2 * N)


def fuzz_glu_fn(a, b, with_bias=False, activation="silu", path=None):
    """tkit.matmul_glu with ``allow_tf32=False`` (the float32 peer is torch's full float32)
    and a bias built from a fixed seed, so that the reference sees the same values. ``path``
    "ptr" or "splitk" forces that kernel (the plan takes split-K only for large weights);
    None: the op."""
    bias = _fuzz_epilogue(a, b, with_bias, False)[0]
    if path is None:
        return tkit.matmul_glu(a, b, bias, activation, allow_tf32=False)
    from tkit.kernels.matmul import ops as MO

    # the public op's checks first: a forced kernel must not see inputs the op refuses (the
    # reliability campaign's replays move sizes, e.g. 2N to an odd count)
    MO._check_glu(a, b, bias, activation, None)
    return MO._glu_impl(a, b, bias, activation, allow_tf32=False, path=path)


def fuzz_glu_ref(a, b, with_bias=False, activation="silu", path=None):
    bias = _fuzz_epilogue(a, b, with_bias, False)[0]
    return ref_matmul_glu(a, b, bias, activation)


def _fuzz_glu():
    kw = st.fixed_dictionaries({"with_bias": st.booleans(),
                                "activation": st.sampled_from(["silu", "gelu", "gelu_tanh"]),
                                "path": st.sampled_from((None, None, "ptr", "splitk"))})
    # the interpreter's examples are few: the pointer kernel's edges are tested one by one
    # (tests/kernels/test_matmul_glu.py) and its tile code is matmul's
    return dict(fn=fuzz_glu_fn, reference=fuzz_glu_ref, shapes=glu_shapes(),
                dtypes=S.gpu_dtypes(), layouts=("contiguous", "transposed", "sliced", "offset"),
                kwargs=kw, ulps=GLU_F32_ULPS,
                max_examples=30 if torch.cuda.is_available() else 15)


def _fuzz_fp8():
    # GPU only: the interpreter converts float8 wrongly (docs/NOTES.md)
    def fn(a, b, per_row=False, block=False):
        sa, sb = _fp8_scales(a, b, per_row, block)
        return tkit.matmul_fp8(a.to(FP8), b.to(FP8), sa, sb)

    def ref(a, b, per_row=False, block=False):
        sa, sb = _fp8_scales(a, b, per_row, block)
        out = torch.float64 if a.dtype == torch.float64 else BF16
        return ref_matmul_fp8(a.float().to(FP8), b.float().to(FP8), sa, sb, out)

    shapes = st.tuples(S.dim_sizes(tile=128, max_size=300, allow_zero=False),
                       S.dim_sizes(tile=128, max_size=300, allow_zero=False),
                       st.sampled_from([16, 32, 48, 128, 256])).map(
        lambda mnk: ((mnk[0], mnk[2]), (mnk[2], mnk[1])))
    return dict(fn=fn, reference=ref, shapes=shapes, dtypes=(torch.float32,),
                layouts=("contiguous", "transposed"),
                kwargs=st.fixed_dictionaries({"per_row": st.booleans(),
                                              "block": st.booleans()}), factor=2.0)


def _fp8_scales(a, b, per_row, block=False):
    dev = a.device
    if block:  # DeepSeek-V3's 1x128 / 128x128 block scales
        kb, nb = -(-a.shape[1] // 128), -(-b.shape[1] // 128)
        return (torch.linspace(0.5, 1.5, a.shape[0] * kb, device=dev).reshape(-1, kb),
                torch.linspace(0.25, 2.0, kb * nb, device=dev).reshape(kb, nb))
    if per_row:
        return (torch.linspace(0.5, 1.5, a.shape[0], device=dev).reshape(-1, 1),
                torch.linspace(0.25, 2.0, b.shape[1], device=dev).reshape(1, -1))
    return torch.tensor([0.5], device=dev), torch.tensor([1.5], device=dev)


@lazy_composite
def grouped_shapes(draw):
    """((T, K), (G, K, N)); the split of T into groups comes from :func:`grouped_offsets`."""
    G = draw(st.integers(1, 6))
    T = draw(st.sampled_from([0, 1, 5, 33, 64, 100, 161]))
    K = draw(S.dim_sizes(tile=32, max_size=80, allow_zero=False))
    N = draw(S.dim_sizes(tile=64, max_size=100, allow_zero=False))
    return (T, K), (G, K, N)


def grouped_offsets(tensors, dtype, device):
    """Offsets that split a's T rows into b's G groups, some empty, from a seed of (T, G)."""
    T, G = tensors[0].shape[0], tensors[1].shape[0]
    gen = torch.Generator().manual_seed(T * 31 + G)
    cuts = torch.randint(0, T + 1, (G - 1,), generator=gen).sort().values
    offs = torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([T])])
    return (offs.to(torch.int32).to(device),)


def fuzz_grouped_fn(a, b, offsets, out_dtype=None):
    """tkit.grouped_matmul with ``allow_tf32=False``: the reference rule's peer for float32 is
    torch's float32 matmul, which does not round operands to tf32 (as in the matmul recipe)."""
    return tkit.grouped_matmul(a, b, offsets, out_dtype, allow_tf32=False)


def _fuzz_grouped():
    return dict(fn=fuzz_grouped_fn, shapes=grouped_shapes(), dtypes=S.gpu_dtypes(),
                extra_args=grouped_offsets, layouts=("contiguous", "transposed", "sliced"),
                ulps=F32_ULPS)


# ---- opcheck ----------------------------------------------------------------------------------
def _opcheck_matmul():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a = make_tensor((9, 16), torch.float32, seed=1, device=dev).requires_grad_()
    b = make_tensor((16, 12), torch.float32, "transposed", seed=2, device=dev).requires_grad_()
    bias = make_tensor((12,), torch.float32, seed=3, device=dev).requires_grad_()
    return torch.ops.tkit.matmul.default, (a, b, bias, None, None, None, "silu", None, False,
                                           "auto"), {}


def _opcheck_glu():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a = make_tensor((2, 5, 16), torch.float32, seed=1, device=dev).requires_grad_()
    b = make_tensor((16, 24), torch.float32, "transposed", seed=2, device=dev).requires_grad_()
    bias = make_tensor((24,), torch.float32, seed=3, device=dev).requires_grad_()
    return torch.ops.tkit.matmul_glu.default, (a, b, bias, "silu", None, False), {}


def _opcheck_grouped():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a = make_tensor((10, 16), torch.float32, seed=1, device=dev)
    b = make_tensor((3, 16, 8), torch.float32, seed=2, device=dev)
    offs = torch.tensor([0, 4, 4, 10], dtype=torch.int32, device=dev)
    return torch.ops.tkit.grouped_matmul.default, (a.requires_grad_(), b.requires_grad_(), offs,
                                                   None), {}


def _opcheck_fp8_block():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    (a, b, sa, sb), _ = _fp8_block_case(16, 130, 256, "opcheck").make(dev)
    bias = make_tensor((130,), BF16, seed=3, device=dev)
    return torch.ops.tkit.matmul_fp8_block.default, (a, b, sa, sb, bias, None, "silu", BF16), {}


def _opcheck_fp8():
    if not torch.cuda.is_available():
        # torch's CPU kernels cannot multiply float8 (opcheck's schema test does):
        # tests/kernels/test_matmul_fp8_block.py checks the block op's fake and autograd
        # registration on the CPU
        return None
    a = make_tensor((32, 64), torch.float32, seed=1, device="cuda").to(FP8)
    b = make_tensor((48, 64), torch.float32, seed=2, device="cuda").to(FP8).t()
    sa = torch.tensor([0.5], device="cuda")
    sb = torch.rand(48, device="cuda")
    return torch.ops.tkit.matmul.default, (a, b, None, None, sa, sb, "", BF16, True, "auto"), {}


# ---- baselines ----------------------------------------------------------------------------------
def _cublas():
    return ref_matmul  # torch.matmul + separate epilogue ops: cuBLAS on the GPU


def _scaled_mm():
    def fn(a, b, scale_a, scale_b, out_dtype=BF16, **kw):
        if _block_scaled(a, b, scale_a, scale_b):
            # torch 2.11's _scaled_mm refuses block scales ("Invalid scaling configuration"):
            # the comparison point is its per-tensor GEMM of the same operands
            one = torch.ones((), device=a.device)
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=out_dtype)
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)

    return fn


def _torch_grouped_mm():
    """``torch._grouped_mm`` (CUTLASS's grouped GEMM, sm_90+), or None where this torch build
    or device lacks it or refuses a probe. It takes the groups' end offsets and, for bf16, the
    weights column-major per group (an nn.Linear stack passed transposed, as the bench's)."""
    if not (torch.cuda.is_available() and hasattr(torch, "_grouped_mm")):
        return None
    try:
        a = torch.randn(64, 128, device="cuda", dtype=BF16)
        b = torch.randn(2, 64, 128, device="cuda", dtype=BF16).transpose(1, 2)
        offs = torch.tensor([0, 24, 64], dtype=torch.int32, device="cuda")
        y = torch._grouped_mm(a, b, offs=offs[1:])
        if not torch.allclose(y.float(), ref_grouped_matmul(a.float(), b.float(), offs),
                              rtol=2e-2, atol=2e-1):
            return None
    except Exception:  # noqa: BLE001 (not in this build, or not on this device)
        return None

    def fn(a, b, offsets, out_dtype=None):
        y = torch._grouped_mm(a, b, offs=offsets[1:])
        return y.to(out_dtype) if out_dtype is not None else y

    return fn


def _glu_torch(a, b, bias=None, activation="silu", out_dtype=None, **kw):
    """What a model runs without the fusion: the merged gate/up GEMM (cuBLAS), then the
    activation and the product as torch ops."""
    return ref_matmul_glu(a, b, bias, activation, out_dtype)


def _glu_tkit_two():
    def fn(a, b, bias=None, activation="silu", out_dtype=None, **kw):
        y = tkit.matmul(a, b, bias)
        n = b.shape[-1] // 2
        if activation == "gelu_tanh":
            return tkit.act_mul(y[..., :n], y[..., n:], "gelu", approximate="tanh")
        return tkit.act_mul(y[..., :n], y[..., n:], activation)

    return fn


SPECS = [
    OpSpec(name="matmul", family="matmul", fn=tkit.matmul, reference=ref_matmul,
           cost=cost_matmul, bench_cases=_bench_matmul, check_cases=_check_matmul,
           fuzz=_fuzz_matmul, baselines={"cuBLAS (torch)": _cublas}, opcheck=_opcheck_matmul,
           bound="compute", doc="a @ b with fused bias/activation/residual", ulps=F32_ULPS),
    OpSpec(name="matmul_fp8", family="matmul", fn=tkit.matmul_fp8, reference=ref_matmul_fp8,
           cost=cost_matmul_fp8, bench_cases=_bench_fp8, check_cases=_check_fp8,
           fuzz=_fuzz_fp8, baselines={"torch._scaled_mm": _scaled_mm}, opcheck=_opcheck_fp8,
           bound="compute", doc="float8_e4m3fn GEMM with per-tensor / per-row / per-col or "
           "1x128 / 128x128 block scales",
           no_check_reason="Triton's interpreter converts float8 wrongly (docs/NOTES.md); "
           "verified at benchmark sizes on a GPU"),
    OpSpec(name="matmul_glu", family="matmul", fn=tkit.matmul_glu, reference=ref_matmul_glu,
           cost=cost_matmul_glu, bench_cases=_bench_glu, check_cases=_check_glu,
           fuzz=_fuzz_glu,
           baselines={"cuBLAS + torch act*mul": eager_baseline(_glu_torch),
                      "torch.compile": torch_compile_baseline(_glu_torch),
                      "tkit.matmul + act_mul": _glu_tkit_two},
           opcheck=_opcheck_glu, bound="compute", ulps=GLU_F32_ULPS,
           doc="act(a @ b_gate + bias) * (a @ b_up + bias): SwiGLU/GeGLU's gated up-projection "
           "in one GEMM"),
    OpSpec(name="grouped_matmul", family="matmul", fn=tkit.grouped_matmul,
           reference=ref_grouped_matmul, cost=cost_grouped, bench_cases=_bench_grouped,
           check_cases=_check_grouped, fuzz=_fuzz_grouped,
           baselines={"torch loop": eager_baseline(ref_grouped_matmul),
                      "torch._grouped_mm": _torch_grouped_mm},
           opcheck=_opcheck_grouped, bound="compute", doc="many GEMMs in one launch (MoE)",
           ulps=F32_ULPS),
]
