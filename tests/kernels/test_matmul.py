"""GEMM family: fuzzing every path against the reference rule, epilogues, batching, autograd,
registration, the path heuristics, errors; bf16 and fp8 on the GPU."""

import dataclasses
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tkit
from tkit import registry
from tkit.kernels import _common, _device
from tkit.kernels import matmul as mm
from tkit.specs import matmul as spec_mm
from tkit.testing import check_against_reference, fuzz, make_tensor

SPECS = [s for s in registry.all_specs() if s.family == "matmul"]
IDS = [s.name for s in SPECS]
ON_GPU = torch.cuda.is_available()
CPU_DTYPES = (torch.float32, torch.float16)  # bf16 in the interpreter: test_bf16_everywhere


def _gpu_only(spec):
    if spec.name == "matmul_fp8" and not ON_GPU:
        pytest.skip("float8 conversion is wrong in the interpreter (docs/NOTES.md): GPU only")


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_fuzz_against_reference(spec):
    _gpu_only(spec)
    recipe = dict(spec.fuzz())
    fn = recipe.pop("fn", spec.fn)
    ref = recipe.pop("reference", spec.reference)
    fuzz(fn, ref, **recipe)


@st.composite
def _aligned_shapes(draw):
    # TMA needs 16-byte row strides: dims that are multiples of 8 (fp16) / 4 (fp32)
    M, N, K = (8 * draw(st.integers(1, 20)) for _ in range(3))
    return (M, K), (K, N)


@pytest.mark.parametrize("path", ["ptr", "tma", "splitk"])
def test_fuzz_each_path(path):
    """Every kernel, forced, on any layout it accepts (the auto heuristic only picks TMA on a
    Hopper GPU and split-K for skinny shapes)."""
    kw = st.fixed_dictionaries({"with_bias": st.booleans(),
                                "activation": st.sampled_from([None, "silu", "gelu_tanh"]),
                                "with_residual": st.booleans(), "path": st.just(path)})
    if path == "tma":
        shapes, layouts = _aligned_shapes(), ("contiguous", "transposed")
    else:
        shapes = spec_mm.matmul_shapes().filter(lambda s: len(s[0]) == 2 and len(s[1]) == 2)
        layouts = ("contiguous", "transposed", "sliced", "offset", "broadcast")
    fuzz(spec_mm.fuzz_matmul_fn, spec_mm.fuzz_matmul_ref, shapes=shapes,
         dtypes=spec_mm.S.gpu_dtypes(), layouts=layouts, kwargs=kw, max_examples=20,
         ulps=spec_mm.F32_ULPS)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_check_cases(spec, device):
    for case in spec.check_cases():
        args, kwargs = case.make(device)
        check_against_reference(spec.fn, spec.reference, args, kwargs, ulps=spec.ulps)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_opcheck(spec):
    built = spec.opcheck()
    if built is None:
        pytest.skip(f"{spec.name}: opcheck needs a GPU")
    op, args, kwargs = built
    fp8 = [t for t in args if isinstance(t, torch.Tensor) and t.dtype in _common.FP8_DTYPES]
    if not fp8:
        torch.library.opcheck(op, args, kwargs)
        return
    # opcheck's schema test compares the inputs before and after with torch.allclose, which
    # torch's CUDA kernels do not implement for float8 ("mul_cuda" not implemented for
    # 'Float8_e4m3fn'): the other tests, and the inputs' bytes compared here
    before = [t.view(torch.uint8).clone() for t in fp8]
    torch.library.opcheck(op, args, kwargs, test_utils=(
        "test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    op(*args, **kwargs)
    assert all(torch.equal(t.view(torch.uint8), b) for t, b in zip(fp8, before))


@pytest.mark.parametrize("case", ["plain", "epilogue", "batched", "shared_weight"])
def test_gradients(case, device):
    dt = torch.float32
    a = make_tensor((2, 9, 20) if case in ("batched", "shared_weight") else (9, 20), dt, seed=1,
                    device=device)
    b = make_tensor((2, 20, 12) if case == "batched" else (20, 12), dt, "transposed", seed=2,
                    device=device)
    kw = dict(allow_tf32=False)
    args = [a, b]
    if case == "epilogue":
        args += [make_tensor((12,), dt, seed=3, device=device), "gelu",
                 make_tensor((12,), dt, seed=4, device=device)]  # residual broadcast: reduced
    check_against_reference(tkit.matmul, spec_mm.ref_matmul, args, kw, grad=True)


@pytest.mark.parametrize("M, N, K", [(0, 5, 7), (5, 0, 7), (5, 7, 0), (1, 1, 1), (3, 9, 1),
                                     (1, 70, 33), (65, 1, 129)])
def test_odd_shapes(M, N, K, device):
    a = make_tensor((M, K), torch.float16, seed=1, device=device)
    b = make_tensor((K, N), torch.float16, "transposed", seed=2, device=device)
    bias = make_tensor((N,), torch.float16, seed=3, device=device)
    check_against_reference(tkit.matmul, spec_mm.ref_matmul, [a, b, bias, "silu"])


@pytest.mark.parametrize("a_shape, b_shape, a_layout, b_layout", [
    ((3, 17, 20), (20, 9), "contiguous", "transposed"),   # folded into one (51, 20) GEMM
    ((3, 17, 20), (3, 20, 9), "transposed", "contiguous"),  # a batched column-major: batch grid
    ((2, 1, 17, 20), (3, 20, 9), "contiguous", "sliced"),  # broadcast batch dims
    ((2, 3, 17, 20), (2, 3, 20, 9), "permuted", "contiguous"),  # batch dims that do not merge
    ((4, 17, 20), (1, 20, 9), "offset", "contiguous"),
])
def test_batched(a_shape, b_shape, a_layout, b_layout, device):
    a = make_tensor(a_shape, torch.float32, a_layout, seed=1, device=device)
    b = make_tensor(b_shape, torch.float32, b_layout, seed=2, device=device)
    res = make_tensor((17, 9), torch.float32, seed=3, device=device)
    check_against_reference(tkit.matmul, spec_mm.ref_matmul, [a, b, None, "relu", res],
                            dict(allow_tf32=False))


def test_scale_epilogue(device):
    """Per-tensor and per-row/column scales (the fp8 epilogue), checked on fp16 operands on CPU
    since the interpreter cannot convert float8."""
    a = make_tensor((33, 40), torch.float16, seed=1, device=device)
    b = make_tensor((40, 70), torch.float16, "transposed", seed=2, device=device)
    sa = torch.rand(33, device=device) + 0.5
    sb = torch.rand(70, device=device) + 0.5
    for path in ("ptr", "tma", "splitk"):
        if path == "tma":
            b2 = make_tensor((40, 72), torch.float16, "transposed", seed=2, device=device)
            sb2 = torch.rand(72, device=device) + 0.5
        else:
            b2, sb2 = b, sb
        for s_a, s_b in ((sa, sb2), (sa[:1], sb2[:1])):
            out = mm._matmul_impl(a, b2, scale_a=s_a, scale_b=s_b, out_dtype=torch.float32,
                                  path=path)
            want = (a.double() @ b2.double()) * (s_a.double().reshape(-1, 1) if s_a.numel() > 1
                                                 else s_a.double())
            want = want * (s_b.double() if s_b.numel() == 1 else s_b.double().reshape(1, -1))
            torch.testing.assert_close(out.double(), want, rtol=2e-3, atol=2e-3)


def test_grouped_list_form(device):
    xs = [make_tensor((m, 24), torch.float16, seed=m, device=device) for m in (5, 0, 33)]
    ws = [make_tensor((24, 40), torch.float16, "transposed", seed=10 + i, device=device)
          for i in range(3)]
    outs = tkit.grouped_matmul(xs, ws)
    assert [o.shape for o in outs] == [(5, 40), (0, 40), (33, 40)]
    for x, w, o in zip(xs, ws, outs):
        check_against_reference(lambda x, w, o=o: o, torch.matmul, [x, w])


@pytest.mark.parametrize("fn", ["matmul", "epilogue", "grouped"])
def test_torch_compile_fullgraph(fn, device):
    a = make_tensor((6, 40), torch.float16, seed=1, device=device)
    b = make_tensor((40, 24), torch.float16, "transposed", seed=2, device=device)
    bias = make_tensor((24,), torch.float16, seed=3, device=device)
    offs = torch.tensor([0, 2, 6], dtype=torch.int32, device=device)
    b3 = torch.stack([b, b * 0.5])
    calls = {
        "matmul": lambda a, b: tkit.matmul(a, b) * 2,
        "epilogue": lambda a, b: tkit.matmul(a, b, bias, "silu", a[:, :24]) * 2,
        "grouped": lambda a, b: tkit.grouped_matmul(a, b3, offs) * 2,
    }
    backend = "inductor" if ON_GPU else "aot_eager"
    compiled = torch.compile(calls[fn], fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(a, b), calls[fn](a, b))


def test_direct_and_dispatched_paths_agree(device, monkeypatch):
    a = make_tensor((5, 64), torch.float32, seed=1, device=device)
    b = make_tensor((64, 7), torch.float32, "transposed", seed=2, device=device)
    direct = tkit.matmul(a, b, activation="gelu")
    monkeypatch.setattr(_common._env, "NO_DIRECT", True)
    torch.testing.assert_close(tkit.matmul(a, b, activation="gelu"), direct, rtol=0, atol=0)


def test_signature_cache(device):
    """Eager 2-D calls validate and plan once per signature: a repeat with new data is still
    right, a new layout or alignment is a new entry, and bad input still raises. Full float32
    (allow_tf32=False): on a GPU the default tf32 dots are ~1e-3 off, above this tolerance."""
    mm._FAST.clear()
    a = make_tensor((5, 64), torch.float32, seed=1, device=device)
    b = make_tensor((64, 40), torch.float32, "transposed", seed=2, device=device)
    bias = make_tensor((40,), torch.float32, seed=3, device=device)
    ref = lambda a, b: (a.double() @ b.double() + bias.double()).relu()
    tkit.matmul(a, b, bias, "relu", allow_tf32=False)
    assert len(mm._FAST) == 1
    a2 = make_tensor((5, 64), torch.float32, seed=4, device=device)
    torch.testing.assert_close(tkit.matmul(a2, b, bias, "relu", allow_tf32=False).double(),
                               ref(a2, b), rtol=1e-4, atol=1e-4)
    assert len(mm._FAST) == 1  # the same signature: served from the cache
    flat = torch.randn(5 * 64 + 1, device=device)
    a3 = flat[1:].view(5, 64)  # same shape and strides, base address 4 bytes off: a new entry
    torch.testing.assert_close(tkit.matmul(a3, b, bias, "relu", allow_tf32=False).double(),
                               ref(a3, b), rtol=1e-4, atol=1e-4)
    assert len(mm._FAST) == 2
    with pytest.raises(ValueError, match="cannot be multiplied"):
        tkit.matmul(a, b.t())
    with pytest.raises(ValueError, match="bias must have shape"):
        tkit.matmul(a, b, bias[:7])
    with pytest.raises(ValueError, match="backend"):  # a cached signature, a bad option
        tkit.matmul(a, b, bias, "relu", backend="cublas")


def test_splitk_is_deterministic(device):
    a = make_tensor((3, 2048), torch.float32, seed=1, device=device)
    b = make_tensor((2048, 96), torch.float32, "transposed", seed=2, device=device)
    p = mm.plan(a, b, path="splitk")
    assert isinstance(p.config, mm.SplitKConfig) and p.config.split_k > 1
    first = mm._matmul_impl(a, b, path="splitk")
    for _ in range(2):
        assert torch.equal(mm._matmul_impl(a, b, path="splitk"), first)


@pytest.mark.parametrize("split", [2, 3])
def test_splitk_one_launch(split, device):
    """fused_reduce: the last program of a tile reduces in split order: the same bits as the
    two-launch path, every time, with the counters left at zero for the next call."""
    a = make_tensor((5, 512), torch.float16, seed=1, device=device)
    b = make_tensor((200, 512), torch.float16, "contiguous", seed=2, device=device).t()
    bias = make_tensor((200,), torch.float16, seed=3, device=device)
    res = make_tensor((5, 200), torch.float16, seed=4, device=device)
    cfg = mm.SplitKConfig(block_m=16, block_n=64, block_k=32, split_k=split, num_stages=2,
                          num_warps=4)

    def run(a, b, bias, res, fused=True):
        return mm._matmul_impl(a, b, bias, res, activation="silu", path="splitk",
                               config=dataclasses.replace(cfg, fused_reduce=fused))

    two = run(a, b, bias, res, fused=False)
    for _ in range(2):
        assert torch.equal(run(a, b, bias, res), two)
    assert not mm.ops._splitk_counters(a.device, 1).any()
    check_against_reference(
        run, lambda a, b, bias, res: torch.nn.functional.silu(a @ b + bias) + res,
        [a, b, bias, res])


def test_splitk_heuristic_at_decode_shapes():
    # the H200's 132 SMs: M=1, K=4096, N=14336 -> 112 weight slabs of 128 columns; about one
    # program per SM -> split 1 (measured: 3.63 / 3.85 TB/s at M=1 / 16 against 3.47 / 3.43
    # for split 2)
    splitk = mm.SplitKConfig.for_shape
    cfg = splitk(1, 14336, 4096, 132)
    assert (cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_stages) == (128, 128, 1, 4)
    assert splitk(16, 14336, 4096, 132).block_m == 16
    assert splitk(1, 4096, 4096, 132).split_k == 4  # 32 slabs
    assert splitk(1, 1024, 4096, 132).split_k == 8  # 8 slabs, >= 4 K-steps each
    # BLOCK_M=64: 64-column slabs before splits (measured on the H200: 17.6 us against 21.2
    # for 128 columns in 4 splits at M=64 N=K=4096)
    assert (splitk(64, 4096, 4096, 132).block_n, splitk(64, 4096, 4096, 132).split_k) == (64, 2)
    assert splitk(1, 100, 64, 132).split_k == 1  # too little K to split
    assert cfg.launch_kwargs() == dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, SPLIT_K=1,
                                       NUM_STAGES=4, num_warps=4)


def _meta(*shape, dtype):
    return torch.empty(*shape, dtype=dtype, device="meta")


_PLAN_SMEM_CASES = [
    # (label, op, argument builder): decode-sized GEMMs (split-K, and the pointer kernel at
    # split 1), a strided weight, the gated GEMM, a prefill GEMM, grouped GEMMs of large groups
    ("matmul 17x4096x4096", tkit.matmul, lambda dt: (_meta(17, 4096, dtype=dt),
                                                     _meta(4096, 4096, dtype=dt))),
    ("matmul 17x65x65", tkit.matmul, lambda dt: (_meta(17, 65, dtype=dt),
                                                 _meta(65, 65, dtype=dt))),
    ("matmul 64x4096x14336", tkit.matmul, lambda dt: (_meta(64, 4096, dtype=dt),
                                                      _meta(4096, 14336, dtype=dt))),
    ("matmul 64x4096x14336 sliced b", tkit.matmul,
     lambda dt: (_meta(64, 4096, dtype=dt), _meta(4096, 2 * 14336, dtype=dt)[:, ::2])),
    ("matmul 4096^3", tkit.matmul, lambda dt: (_meta(4096, 4096, dtype=dt),
                                               _meta(4096, 4096, dtype=dt))),
    ("matmul_glu 64x4096x2x14336", tkit.matmul_glu,
     lambda dt: (_meta(64, 4096, dtype=dt), _meta(4096, 2 * 14336, dtype=dt))),
    ("grouped 8192 tokens G4", tkit.grouped_matmul,
     lambda dt: (_meta(8192, 4096, dtype=dt), _meta(4, 4096, 4096, dtype=dt),
                 torch.tensor([0, 2048, 4096, 6144, 8192], dtype=torch.int32, device="meta"))),
    # many small groups: the TMA kernel's 64 x 256 tiles with the flattened loop (16-bit)
    ("grouped 4096 tokens G128", tkit.grouped_matmul,
     lambda dt: (_meta(4096, 2048, dtype=dt), _meta(128, 1536, 2048, dtype=dt).transpose(1, 2),
                 torch.arange(0, 4097, 32, dtype=torch.int32, device="meta"))),
    # long K at M = 256: split-K through TMA (16-bit)
    ("matmul 256x14336x4096", tkit.matmul,
     lambda dt: (_meta(256, 14336, dtype=dt), _meta(4096, 14336, dtype=dt).t())),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_gemm_configs_fit_shared_memory_sm90(dtype):
    """Every launch the GEMM plans make, compiled ahead of time for sm_90, fits the SM's
    shared memory. Configs sized for 16-bit operands took more than 232,448 B with float32
    ones and Triton refused the launch on the H200: split-K at 32 x 128 x 128 (245,760 B, a
    forced split-K fuzz example), the pointer kernel at split 1 (294,912 B at M = 64), the
    grouped GEMM's 128-row tiles (262,144 B). Run under both Triton versions of CI, this also
    catches a Triton that allocates more than the configs' own estimates."""
    from tkit import ir

    limit = mm.config.SMEM_BYTES
    # the kernels these 16-bit cases are planned for (the new TMA kernels compile under both
    # Triton versions of CI)
    kernels = {"grouped 8192 tokens G4": "_grouped_matmul_tma_kernel",
               "grouped 4096 tokens G128": "_grouped_matmul_tma_kernel",
               "matmul 256x14336x4096": "_matmul_splitk_tma_kernel"}
    for label, op, build in _PLAN_SMEM_CASES:
        args = build(dtype)
        first = ir.compile(op, *args, arch="sm_90")
        if dtype == torch.bfloat16 and label in kernels:
            assert first.name == kernels[label], (label, first.name)
        for i in range(len(first.launches or [first.name])):
            c = first if i == 0 else ir.compile(op, *args, arch="sm_90", launch=i)
            assert c.shared <= limit, f"{label} {dtype}: {c.name} takes {c.shared} B"


@pytest.mark.parametrize("M", [1, 16, 32, 33, 64, 100, 128])
def test_splitk_heuristic_stays_in_one_wave(M):
    """The split-K rule fills one wave of programs and never starts a second one (a split
    that did, 160 programs for 132 SMs at Llama-3-70B's qkv, measured 1.08-1.15x slower):
    every choice fits the SMs unless even one program a 128-column slab does not, and the
    next step of the rule (a narrower slab or one more split) would not fit."""
    splitk = mm.SplitKConfig.for_shape
    for sms in (132, 114, 78):
        for N in (1024, 4096, 6144, 8192, 10240, 14336, 57344):
            for K in (4096, 8192, 28672):
                c = splitk(M, N, K, sms)
                rows = -(-M // c.block_m)
                programs = rows * -(-N // c.block_n) * c.split_k
                assert c.block_m == max(16, min(64, 1 << (M - 1).bit_length()))
                if programs > sms:  # only the widest, unsplit slabs
                    assert (c.block_n, c.split_k) == (128, 1), (M, N, K, sms, c)
                    continue
                nxt = ((c.block_n, c.split_k * 2) if c.block_m < 64 or c.block_n == 64
                       else (64, 1))
                grown = rows * -(-N // nxt[0]) * nxt[1]
                cap = 128 if c.block_m < 64 else 4
                assert grown > sms or nxt[1] > cap or (-(-K // 128)) // nxt[1] < 4, (
                    M, N, K, sms, c)


def test_splitk_heuristic_at_llama_shapes():
    """The H200's choices at Llama-3's projections (docs/NOTES.md, "twentieth session": each
    the fastest of six slab widths and splits there, or within 4%)."""
    splitk = mm.SplitKConfig.for_shape

    def pick(M, N, K):
        c = splitk(M, N, K, 132)
        return c.block_n, c.split_k

    assert pick(16, 10240, 8192) == (128, 1)  # 80 slabs: a split would make 160 programs
    assert pick(64, 6144, 4096) == (64, 1)  # 96 programs, no partials
    assert pick(64, 10240, 8192) == (128, 1)
    assert pick(128, 4096, 4096) == (64, 1)  # two 64-row tiles x 64 slabs
    assert pick(128, 4096, 14336) == (64, 1)


def test_plan_takes_split_k_up_to_one_wave_at_m_128(monkeypatch):
    """M <= 64: split-K whenever the weight is big enough; up to M = 128 only where two 64-row
    tiles of each 128-column slab fit the SMs (Llama-3-8B's o at M = 128: split-K; its
    gate_up: the TMA / Gluon kernels)."""
    from tkit.kernels import _device

    monkeypatch.setattr(_device, "capability", lambda device=None: (9, 0))
    monkeypatch.setattr(_device, "sm_count", lambda device: 132)
    meta = dict(device="meta", dtype=torch.bfloat16)

    def path(M, N, K):
        return mm.plan(torch.empty(M, K, **meta), torch.empty(N, K, **meta).t()).path

    assert path(128, 4096, 4096) == "splitk"
    assert path(100, 8192, 8192) == "splitk"  # 2 x 64 = 128 programs
    assert path(128, 10240, 8192) != "splitk"  # 160
    assert path(129, 4096, 4096) != "splitk"
    assert path(64, 57344, 8192) == "splitk"
    assert path(128, 256, 1024) != "splitk"  # a small weight: not worth splitting
    # measured for 16-bit operands only: fp8 at M = 128 keeps its kernels (the block-scaled
    # mode's TMA kernel reads this plan)
    fp8 = dict(device="meta", dtype=torch.float8_e4m3fn)
    a8, w8 = torch.empty(128, 4096, **fp8), torch.empty(4096, 4096, **fp8)
    assert mm.plan(a8, w8.t(), torch.bfloat16).path != "splitk"
    assert mm.plan(a8[:64], w8.t(), torch.bfloat16).path == "splitk"


def test_splitk_fit_shared():
    """The split-K config's fit: stages down to 3, then the K step, then 2 stages; 16-bit
    configs of the heuristic unchanged."""
    fit = mm.SplitKConfig(block_m=32, block_n=128, block_k=128, split_k=1).fit_shared(4)
    assert (fit.num_stages, fit.block_k) == (3, 64)
    fit = mm.SplitKConfig(block_m=32, block_n=128, block_k=128, split_k=2).fit_shared(4)
    assert (fit.num_stages, fit.block_k) == (3, 128)  # 2 buffers of the split kernel
    for M, N, K in [(1, 14336, 4096), (16, 4096, 4096), (64, 4096, 4096)]:
        cfg = mm.SplitKConfig.for_shape(M, N, K, 132)
        assert cfg.fit_shared(2) == cfg


def test_capture_and_poison_cover_other_threads():
    """Autograd runs a CUDA backward pass on a thread of its own: capture and poisoning must
    see that thread's launches and outputs (the grouped GEMM's gradients went unrecorded on
    the H200 with a thread-local switch)."""
    import threading

    a = make_tensor((10, 16), torch.float32, seed=1)
    b = make_tensor((16, 8), torch.float32, seed=2)
    seen = {}

    def work():
        seen["out"] = _common.empty((3,), torch.float32, a.device)
        tkit.matmul(a, b)

    with _common.capture_launches() as launches, _common.poisoned_outputs():
        t = threading.Thread(target=work)
        t.start()
        t.join()
    assert [lc.kernel.__name__ for lc in launches][-1].startswith("_matmul")
    assert seen["out"].isnan().all()


def test_plan_picks_paths():
    meta = dict(device="meta", dtype=torch.bfloat16)
    big_a, big_b = torch.empty(4096, 4096, **meta), torch.empty(4096, 4096, **meta)
    assert mm.plan(big_a, big_b).path == "tma"  # meta tensors plan for an sm_90 (tkit.ir)
    assert mm.plan(big_a, big_b.t()).path == "tma"  # column-major B: a transposed descriptor
    assert mm.plan(torch.empty(16, 4096, **meta), torch.empty(14336, 4096, **meta).t()).path \
        == "splitk"
    sliced = torch.empty(4096, 8192, **meta)[:, ::2]
    p = mm.plan(big_a, sliced)
    assert p.path == "ptr" and "TMA" in p.reason
    assert mm.plan(torch.empty(128, 64, **meta), torch.empty(104, 64, **meta).t()).path == "tma"
    assert mm.plan(torch.empty(128, 64, **meta), torch.empty(64, 99, **meta)).path == "ptr"


def _launched(fn):
    with _common.capture_launches() as launches:
        fn()
    # (kernel name, the launch's non-tensor keywords)
    return [(lc.kernel.__name__ if hasattr(lc.kernel, "__name__") else lc.kernel.fn.__name__,
             {k: v for k, v in lc.kwargs.items() if not isinstance(v, torch.Tensor)})
            for lc in launches]


def test_matmul_config_overrides_are_scoped():
    """``matmul_config`` changes the launched config of whichever kernel runs, inside the block
    only (a signature cached before the block is not replayed inside it), and names an
    unknown field."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    a, w = torch.empty(256, 512, **meta), torch.empty(1024, 512, **meta)
    before = _launched(lambda: tkit.matmul(a, w.t()))  # also caches this signature
    default = mm.plan(a, w.t()).config
    assert isinstance(default, mm.TmaConfig)
    with mm.matmul_config(block_n=32, num_warps=2):
        assert mm.plan(a, w.t()).config == dataclasses.replace(default, block_n=32,
                                                               num_warps=2)
        ((_, kw),) = _launched(lambda: tkit.matmul(a, w.t()))
        assert (kw["BLOCK_N"], kw["num_warps"]) == (32, 2)
        with mm.matmul_config(block_n=16):  # nested: the inner value, the outer ones kept
            ((_, kw),) = _launched(lambda: tkit.matmul(a, w.t()))
            assert (kw["BLOCK_N"], kw["num_warps"]) == (16, 2)
    assert _launched(lambda: tkit.matmul(a, w.t())) == before
    assert mm.plan(a, w.t()).config == default
    with pytest.raises(TypeError, match="blok_n"):
        with mm.matmul_config(blok_n=64):
            pass


def test_matmul_config_reaches_split_k_and_grouped(device):
    """Fields apply to every kernel whose config has them: split-K's split and one-launch
    reduce, the grouped kernel's tile."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    a, w = torch.empty(4, 4096, **meta), torch.empty(4096, 4096, **meta)
    with mm.matmul_config(split_k=2, fused_reduce=True):
        assert mm.plan(a, w).config.split_k == 2
        ((name, kw),) = _launched(lambda: tkit.matmul(a, w))
    assert name == "_matmul_splitk_fused_kernel" and kw["SPLIT_K"] == 2
    assert [n for n, _ in _launched(lambda: tkit.matmul(a, w))][-1] == "_splitk_reduce_kernel"
    x = make_tensor((64, 128), torch.float32, seed=1, device=device)
    b = make_tensor((4, 128, 256), torch.float32, seed=2, device=device)
    offs = torch.tensor([0, 16, 32, 48, 64], dtype=torch.int32, device=device)
    with mm.matmul_config(block_m=16, block_n=32):
        ((_, kw),) = _launched(lambda: tkit.grouped_matmul(x, b, offs))
    assert (kw["BLOCK_M"], kw["BLOCK_N"]) == (16, 32)


def test_explicit_config_of_the_wrong_kernel_is_refused(device):
    a = make_tensor((8, 32), torch.float32, seed=1, device=device)
    b = make_tensor((32, 16), torch.float32, seed=2, device=device)
    with pytest.raises(TypeError, match="PtrConfig"):
        mm._matmul_impl(a, b, path="ptr",
                        config=mm.TmaConfig(block_m=16, block_n=16, block_k=16, num_warps=4))


def test_capture_shows_the_kernel():
    """tkit.ir's view: launches recorded on meta tensors name the kernel that would run."""
    a = torch.empty(2048, 1024, device="meta", dtype=torch.bfloat16)
    w = torch.empty(4096, 1024, device="meta", dtype=torch.bfloat16)
    with _common.capture_launches() as launches:
        tkit.matmul(a, w.t())
    assert len(launches) == 1 and launches[0].kwargs["B_TRANS"] is True
    assert "tma" in launches[0].kernel.fn.__name__
    with _common.capture_launches() as launches:
        tkit.matmul(a[:4], w.t())
    assert [k.kernel.__name__ for k in launches] == ["_matmul_splitk_kernel",
                                                     "_splitk_reduce_kernel"]


def test_cuda_backend_unavailable_is_a_clear_error(device, monkeypatch):
    if "cuda_ext" in vars(tkit):
        monkeypatch.delattr(tkit, "cuda_ext")
    monkeypatch.setitem(sys.modules, "tkit.cuda_ext", None)
    a = make_tensor((4, 8), torch.float32, seed=1, device=device)
    with pytest.raises(RuntimeError, match="backend='cuda' needs tkit.cuda_ext"):
        tkit.matmul(a, a.t(), backend="cuda")


def test_cuda_backend_dispatch(device, monkeypatch):
    class FakeCudaExt:
        calls = []

        @staticmethod
        def dispatch(name, a, b):
            FakeCudaExt.calls.append(name)
            return torch.matmul(a, b)

    monkeypatch.setitem(sys.modules, "tkit.cuda_ext", FakeCudaExt)
    monkeypatch.setattr(tkit, "cuda_ext", FakeCudaExt, raising=False)
    a = make_tensor((4, 8), torch.float32, seed=1, device=device)
    b = make_tensor((8, 5), torch.float32, seed=2, device=device)
    bias = make_tensor((5,), torch.float32, seed=3, device=device)
    out = tkit.matmul(a, b, bias, "relu", backend="cuda")
    assert FakeCudaExt.calls == ["matmul"]
    torch.testing.assert_close(out, torch.relu(a @ b + bias))


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda d: tkit.matmul(torch.ones(3, 4, device=d), torch.ones(5, 6, device=d)),
         ValueError, r"a.shape\[-1\]=4 != b.shape\[-2\]=5"),
        (lambda d: tkit.matmul(torch.ones(4, device=d), torch.ones(4, 6, device=d)),
         ValueError, "a must have at least 2 dimensions"),
        (lambda d: tkit.matmul(torch.ones(3, 4, device=d), torch.ones(4, 6, device=d).half()),
         TypeError, "b has dtype float16 but a has float32"),
        (lambda d: tkit.matmul(torch.ones(3, 4, device=d), torch.ones(4, 6, device=d),
                               torch.ones(5, device=d)), ValueError, "bias must have shape"),
        (lambda d: tkit.matmul(torch.ones(3, 4, device=d), torch.ones(4, 6, device=d),
                               activation="tanh"), ValueError, "activation must be one of"),
        (lambda d: tkit.matmul(torch.ones(3, 4, device=d), torch.ones(4, 6, device=d),
                               residual=torch.ones(2, 6, device=d)), ValueError, "residual"),
        (lambda d: tkit.matmul(torch.ones(2, 3, 4, device=d), torch.ones(3, 4, 6, device=d)),
         ValueError, "batch dimensions"),
        (lambda d: tkit.matmul(torch.ones(3, 4, device=d), torch.ones(4, 6, device=d),
                               backend="cublas"), ValueError, "backend must be"),
        (lambda d: tkit.matmul(torch.ones(3, 4, device=d, dtype=torch.float64),
                               torch.ones(4, 6, device=d)), TypeError, "a has dtype float64"),
        (lambda d: tkit.matmul_fp8(torch.ones(3, 4, device=d), torch.ones(4, 6, device=d),
                                   torch.ones(1, device=d), torch.ones(1, device=d)),
         TypeError, "a has dtype float32"),
        (lambda d: tkit.matmul_fp8(torch.ones(3, 4, device=d).to(torch.float8_e4m3fn),
                                   torch.ones(4, 6, device=d).to(torch.float8_e4m3fn),
                                   torch.ones(2, device=d), torch.ones(1, device=d)),
         ValueError, "scale_a must hold 1 element"),
        (lambda d: tkit.grouped_matmul(torch.ones(5, 4, device=d), torch.ones(2, 4, 3, device=d),
                                       torch.tensor([0, 5], dtype=torch.int32, device=d)),
         ValueError, "offsets must have G"),
        (lambda d: tkit.grouped_matmul(torch.ones(5, 4, device=d), torch.ones(2, 4, 3, device=d),
                                       torch.tensor([0, 2, 5.0], device=d)),
         TypeError, "offsets has dtype float32"),
    ],
)
def test_bad_input_errors(call, exc, words, device):
    with pytest.raises(exc, match=words):
        call(device)


# ---- GPU only ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("path", ["tma", "ptr", "splitk"])
@pytest.mark.parametrize("b_layout", ["contiguous", "transposed"])
def test_bf16_paths_at_size(path, b_layout):
    M = 16 if path == "splitk" else 1000
    a = make_tensor((M, 2048), torch.bfloat16, seed=1)
    b = make_tensor((2048, 3072), torch.bfloat16, b_layout, seed=2)
    bias = make_tensor((3072,), torch.bfloat16, seed=3)
    res = make_tensor((M, 3072), torch.bfloat16, seed=4)

    def fn(a, b, bias, act, res):
        return mm._matmul_impl(a, b, bias, res, activation=act, path=path)

    check_against_reference(fn, spec_mm.ref_matmul, [a, b, bias, "silu", res])


@pytest.mark.gpu
def test_hopper_plan_is_tma():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs sm_90")
    a = torch.empty(4096, 4096, device="cuda", dtype=torch.bfloat16)
    assert mm.plan(a, a).path == "tma"


@pytest.mark.gpu
@pytest.mark.parametrize("per_row", [False, True])
def test_fp8_matches_scaled_mm(per_row):
    M, N, K = 512, 768, 1024
    a = (torch.randn(M, K, device="cuda")).to(torch.float8_e4m3fn)
    b = (torch.randn(N, K, device="cuda")).to(torch.float8_e4m3fn).t()
    sa = torch.rand(M, 1, device="cuda") + 0.5 if per_row else torch.tensor([0.7], device="cuda")
    sb = torch.rand(1, N, device="cuda") + 0.5 if per_row else torch.tensor([0.3], device="cuda")
    got = tkit.matmul_fp8(a, b, sa, sb)
    want = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max())


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256, 256, 8192), (8192, 8192, 8192), (64, 512, 32768)])
@pytest.mark.parametrize("per_row", [False, True])
def test_fp8_long_k_meets_the_reference_rule(shape, per_row):
    """Long K under the reference rule: the fp8 tensor cores' running sum holds about 14 bits,
    and a kernel that keeps it across all of K = 8192 was off by 2 bf16 roundings (the H200
    benchmark's 8192^3 cases); each K step's MMA sum is added in float32 instead."""
    M, N, K = shape
    a = make_tensor((M, K), torch.float32, seed=1).to(torch.float8_e4m3fn)
    b = make_tensor((N, K), torch.float32, seed=2).to(torch.float8_e4m3fn).t()
    sa = (torch.rand(M, 1, device="cuda") + 0.5 if per_row
          else torch.tensor(0.7, device="cuda"))
    sb = (torch.rand(1, N, device="cuda") + 0.5 if per_row
          else torch.tensor(0.3, device="cuda"))
    spec = registry.get("matmul_fp8")
    check_against_reference(spec.fn, spec.reference, [a, b, sa, sb], ref_dtype=torch.float32)


@pytest.mark.gpu
@settings(max_examples=30)
@given(m=st.sampled_from([1, 7, 64, 129, 1000]), bias=st.booleans())
def test_bf16_linear_layout(m, bias):
    x = make_tensor((m, 1024), torch.bfloat16, seed=m)
    w = make_tensor((1536, 1024), torch.bfloat16, seed=1)
    bb = make_tensor((1536,), torch.bfloat16, seed=2) if bias else None
    check_against_reference(lambda x, w, bb: tkit.matmul(x, w.t(), bb),
                            lambda x, w, bb: spec_mm.ref_matmul(x, w.t(), bb), [x, w, bb])


@pytest.mark.parametrize("path", ["ptr", "tma"])
def test_autotuned_kernels(path, device, monkeypatch):
    """TKIT_AUTOTUNE=1 goes through triton.autotune (one config in the interpreter, so
    nothing is timed or written to the tuning cache)."""
    monkeypatch.setattr(mm.config._env, "AUTOTUNE", True)
    monkeypatch.setattr(mm.config._env, "NO_AUTOTUNE", False)
    a = make_tensor((40, 48), torch.float16, seed=1, device=device)
    b = make_tensor((48, 72), torch.float16, "transposed", seed=2, device=device)
    bias = make_tensor((72,), torch.float16, seed=3, device=device)

    def fn(a, b, bias):
        return mm._matmul_impl(a, b, bias, path=path)

    check_against_reference(fn, lambda a, b, bias: a @ b + bias, [a, b, bias])


def test_pruner_reads_keyword_arguments(monkeypatch):
    """triton.autotune hands its early pruner the positional arguments as ``named_args`` and
    the keywords apart; tkit launches with keywords only (TKIT_AUTOTUNE=1 on a GPU raised
    KeyError 'M' when the pruner read ``named_args`` alone)."""
    from tkit.kernels.matmul.config import _prune, _ptr_configs

    monkeypatch.setattr(mm.config._env, "INTERPRET", False)
    a = torch.empty(40, 48, dtype=torch.float16)
    kw = dict(a_ptr=a, M=40, N=72, K=48)
    kept = _prune(_ptr_configs(), {}, **kw)
    assert kept and kept == _prune(_ptr_configs(), kw, **kw)
    # tall tiles over 40 rows are pruned
    assert all(c.kwargs["BLOCK_M"] <= 128 for c in kept)


def test_fixed_configs_per_shape_class(monkeypatch):
    monkeypatch.setattr(mm.config._env, "INTERPRET", False)
    tma, ptr = mm.TmaConfig.for_shape, mm.PtrConfig.for_shape
    big = tma(8192, 8192, 8192)
    assert (big.block_m, big.block_n, big.block_k, big.num_warps) == (128, 256, 64, 8)
    assert big.launch_kwargs() == dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8,
                                       EPI_SUBTILE=True, FLATTEN=True, num_warps=8,
                                       num_stages=3)
    assert tma(512, 4096, 4096).block_n == 128  # 32 tiles of 128x256: too few
    # fp8: 128x128 tiles with BLOCK_K = 256 (the promotion interval)
    fp8 = tma(8192, 8192, 8192, elem_size=1)
    assert (fp8.block_m, fp8.block_n, fp8.block_k, fp8.num_stages) == (128, 128, 256, 3)
    # fewer tiles than SMs: 64x128 tiles fill the SMs (M=256, N=4096: 128 tiles, one wave)
    mid = tma(256, 4096, 4096)
    assert (mid.block_m, mid.block_n, mid.num_warps) == (64, 128, 4)
    # 128 tiles of 128x256 are one whole wave: the big tile
    assert tma(1024, 4096, 4096).block_n == 256
    assert ptr(100, 4096, 4096).block_m == 64
    assert ptr(8192, 8192, 8192, elem_size=4).block_k == 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        big.block_m = 64


def test_row_major_residual_is_read_by_tma():
    """A row-major (M, N) residual goes through a TMA descriptor; a broadcast one does not."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    a, b = torch.empty(256, 64, **meta), torch.empty(64, 128, **meta)
    for res, tma in ((torch.empty(256, 128, **meta), True), (torch.empty(128, **meta), False)):
        with _common.capture_launches() as launches:
            mm._matmul_impl(a, b, None, res, path="tma")
        kw = launches[0].kwargs
        assert kw.get("RES_TMA", False) is tma and kw["HAS_RES"] is not tma


def test_tma_residual_epilogue(device):
    """The TMA-read residual lands after the activation, in both epilogue layouts."""
    a = make_tensor((40, 24), torch.float16, seed=1, device=device)
    b = make_tensor((32, 24), torch.float16, seed=2, device=device).t()
    bias = make_tensor((32,), torch.float16, seed=3, device=device)
    res = make_tensor((40, 32), torch.float16, seed=4, device=device)
    for subtile in (True, False):
        cfg = mm.TmaConfig(block_m=32, block_n=32, block_k=16, num_warps=4, group_m=4,
                           epi_subtile=subtile)

        def fn(a, b, bias, res, cfg=cfg):
            return mm._matmul_impl(a, b, bias, res, activation="silu", path="tma", config=cfg)

        check_against_reference(
            fn, lambda a, b, bias, res: torch.nn.functional.silu(a @ b + bias) + res,
            [a, b, bias, res])


def test_huge_weight_avoids_32_bit_split_k():
    meta = dict(device="meta", dtype=torch.bfloat16)
    x, w = torch.empty(8, 8192, **meta), torch.empty(8192, 270000, **meta)
    assert mm.plan(x, w).path != "splitk"


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_grouped_gradients(dtype, device):
    a = make_tensor((70, 24), dtype, seed=1, device=device)
    b = make_tensor((4, 24, 33), dtype, "transposed", seed=2, device=device)
    offs = torch.tensor([0, 5, 5, 40, 70], dtype=torch.int32, device=device)  # one group empty
    # full float32 (the float32 peer is torch's, without tf32 rounding)
    check_against_reference(spec_mm.fuzz_grouped_fn, spec_mm.ref_grouped_matmul, [a, b, offs],
                            grad=True, ulps=spec_mm.F32_ULPS)


@pytest.mark.parametrize("allow_tf32", [True, False])
def test_grouped_float32_precision_follows_allow_tf32(allow_tf32, device):
    """float32 grouped GEMMs, forward and both gradients, run the full-float32 dot with
    ``allow_tf32=False`` and tf32 tensor cores by default, as ``tkit.matmul`` does; other dtypes
    are unaffected. The interpreter computes float32 dots exactly either way, so what is checked
    is the kernels' IEEE argument."""
    def launches_of(dtype, **kw):
        a = make_tensor((10, 16), dtype, seed=1, device=device).requires_grad_()
        b = make_tensor((3, 16, 8), dtype, "transposed", seed=2, device=device).requires_grad_()
        offs = torch.tensor([0, 4, 4, 10], dtype=torch.int32, device=device)
        with _common.capture_launches() as launches:
            tkit.grouped_matmul(a, b, offs, **kw).sum().backward()
        return launches

    launches = launches_of(torch.float32, allow_tf32=allow_tf32)
    assert [lc.kernel.__name__ for lc in launches] == [
        "_grouped_matmul_kernel", "_grouped_matmul_kernel", "_grouped_wgrad_kernel"]
    assert [lc.kwargs["IEEE"] for lc in launches] == [not allow_tf32] * 3
    with _common.capture_launches() as mm_launches:
        tkit.matmul(make_tensor((10, 16), torch.float32, seed=1, device=device),
                    make_tensor((16, 8), torch.float32, seed=2, device=device),
                    allow_tf32=allow_tf32)
    assert mm_launches[-1].kwargs["IEEE"] is (not allow_tf32)
    assert [lc.kwargs["IEEE"] for lc in launches_of(torch.float16, allow_tf32=False)] == \
        [False] * 3


def test_grouped_fuzz_recipe_compares_full_float32():
    """The fuzz recipe's reference rule measures torch's float32 matmul (no tf32 rounding), so
    the recipe runs the kernel in full float32 too."""
    recipe = registry.get("grouped_matmul").fuzz()
    a = torch.empty(10, 16, device="meta")
    b = torch.empty(3, 16, 8, device="meta")
    offs = torch.tensor([0, 4, 4, 10], dtype=torch.int32, device="meta")
    with _common.capture_launches() as launches:
        recipe.get("fn", tkit.grouped_matmul)(a, b, offs)
    assert [lc.kwargs["IEEE"] for lc in launches] == [True]


def _splitk_tma(a, b, bias=None):
    """tkit.matmul through the TMA split-K kernel, forced: three splits of 64-deep steps (small
    tiles for the interpreter; a GPU takes the same config)."""
    cfg = mm.SplitKConfig(block_m=32, block_n=64, block_k=64, split_k=3, num_stages=3,
                          tma=True)
    return mm.ops._matmul_impl(a, b, bias, path="splitk", config=cfg)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("b_layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("M, N, K", [(50, 96, 200), (64, 64, 64), (8, 136, 456)])
def test_splitk_tma_kernel(dtype, b_layout, M, N, K, device):
    """The TMA split-K kernel against the float64 reference: partial tiles in M and N, a K
    tail (zeros past K from both descriptors), a split with no K step (K = 64: three splits of
    one step), the weight row-major or an nn.Linear weight passed transposed, a bias through
    the reduce; outputs poisoned."""
    a = make_tensor((M, K), dtype, seed=1, device=device)
    b = make_tensor((K, N), dtype, b_layout, seed=2, device=device)
    bias = make_tensor((N,), dtype, seed=3, device=device)
    check_against_reference(_splitk_tma, spec_mm.ref_matmul, [a, b, bias])
    with _common.capture_launches() as launches:
        _splitk_tma(a, b)
    assert [lc.kernel.__name__ for lc in launches] == ["_matmul_splitk_tma_kernel",
                                                       "_splitk_reduce_kernel"]


def test_long_k_plan_takes_tma_split_k(monkeypatch):
    """sm_90 (meta tensors), 16-bit: 64 < M <= 256 with K >= 14336 takes 128 x 256 tiles in
    the largest power of 2 of K splits that fits one wave, through TMA, where that is >= 4
    splits; fewer splits, a shorter K, M <= 64, fp8 or a column-major a keep their kernels."""
    monkeypatch.setattr(mm.config._env, "INTERPRET", False)
    meta = dict(device="meta", dtype=torch.bfloat16)

    def plan(M, N, K, **kw):
        return mm.plan(torch.empty(M, K, **meta), torch.empty(N, K, **meta).t(), **kw)

    for M, N, K, split in ((128, 4096, 14336, 8), (256, 4096, 14336, 4), (128, 8192, 28672, 4)):
        p = plan(M, N, K)
        assert p.path == "splitk" and p.config.tma, (M, N, K, p)
        assert (p.config.block_m, p.config.block_n, p.config.split_k) == (128, 256, split)
    for M, N, K in ((256, 8192, 28672), (128, 8192, 8192), (64, 4096, 14336), (512, 4096, 14336)):
        p = plan(M, N, K)
        assert not (p.path == "splitk" and p.config.tma), (M, N, K, p)
    assert not getattr(plan(128, 4096, 14336, scaled=True).config, "tma", False)
    a_cm = torch.empty(14336, 128, **meta).t()
    p = mm.plan(a_cm, torch.empty(4096, 14336, **meta).t())
    assert not (p.path == "splitk" and p.config.tma)


def _grouped_tma(a, b, offsets, **fields):
    """grouped_matmul through the persistent TMA kernel, forced (its CPU tile in the
    interpreter, the plan's on a GPU), with config ``fields`` changed."""
    T, _ = a.shape
    G, _, N = b.shape
    cfg = dataclasses.replace(mm.GroupedTmaConfig.for_shape(T, N, G), **fields)
    return mm.ops._grouped_impl(a, b, offsets, config=cfg)


def _grouped_tma_store(a, b, offsets):
    return _grouped_tma(a, b, offsets, tma_store=True, flatten=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("b_layout", ["linear stack", "row-major"])
@pytest.mark.parametrize("offsets", [[0, 5, 5, 40, 70], [0, 0, 0, 0, 70], [0, 70, 70, 70, 70],
                                     [0, 31, 33, 64, 70], [0, 1, 2, 3, 4, 5, 6, 7, 8, 70]],
                         ids=["one empty", "all in the last", "all in the first",
                              "tile edges", "nine groups"])
@pytest.mark.parametrize("store", ["pointer", "tma"])
def test_grouped_tma_kernel(dtype, b_layout, offsets, store, device):
    """The TMA kernel against the float64 reference: groups that start and end inside row
    tiles (a tile's rows past its group read the next group's and must not be stored), empty
    groups, a partial column tile (N = 40), both weight layouts, both epilogues (whole tiles
    by TMA); outputs poisoned."""
    G = len(offsets) - 1
    T, K, N = offsets[-1], 64, 40
    a = make_tensor((T, K), dtype, seed=1, device=device)
    b = (make_tensor((G, N, K), dtype, seed=2, device=device).transpose(1, 2)
         if b_layout == "linear stack" else make_tensor((G, K, N), dtype, seed=2, device=device))
    offs = torch.tensor(offsets, dtype=torch.int32, device=device)
    check_against_reference(_grouped_tma if store == "pointer" else _grouped_tma_store,
                            spec_mm.ref_grouped_matmul, [a, b, offs])


def test_grouped_tma_kernel_k_tail(device):
    """K not a multiple of BLOCK_K with an nn.Linear stack: the descriptors' zero fill past K
    (a's columns and b's) ends each group's sum; no other group's K leaks in."""
    a = make_tensor((50, 72), torch.bfloat16, seed=1, device=device)
    b = make_tensor((3, 24, 72), torch.bfloat16, seed=2, device=device).transpose(1, 2)
    offs = torch.tensor([0, 20, 21, 50], dtype=torch.int32, device=device)
    check_against_reference(_grouped_tma, spec_mm.ref_grouped_matmul, [a, b, offs])


def test_grouped_plan(monkeypatch):
    """sm_90 (meta tensors): 16-bit operands with a row-major a and the weights one
    TMA-describable matrix take the TMA kernel; everything else the pointer kernel, with the
    reason; forcing the TMA kernel where it does not apply names the requirement."""
    monkeypatch.setattr(mm.config._env, "INTERPRET", False)
    meta = dict(device="meta", dtype=torch.bfloat16)
    a = torch.empty(8192, 4096, **meta)
    stack = torch.empty(8, 14336, 4096, **meta).transpose(1, 2)
    p = mm.grouped_plan(a, stack)
    assert p.path == "grouped_tma" and isinstance(p.config, mm.GroupedTmaConfig)
    assert mm.grouped_plan(a, torch.empty(8, 4096, 14336, **meta)).path == "grouped_tma"
    # wider rows than K (a slice of each weight's columns) are still one matrix of longer rows
    wide = torch.empty(8, 14336, 8192, **meta)[:, :, :4096].transpose(1, 2)
    assert mm.grouped_plan(a, wide).path == "grouped_tma"
    # many small groups (T / G = 32 rows): 64-row tiles
    assert mm.grouped_plan(torch.empty(4096, 2048, **meta),
                           torch.empty(128, 2048, 1536, **meta)).config.block_m == 64
    cases = [
        (a.float(), stack.float(), "float32 operands"),
        (a.t().contiguous().t(), stack, "a is not row-major"),
        (a, torch.empty(16, 14336, 4096, **meta)[::2].transpose(1, 2), "not one"),
        (a[:, :4000], torch.empty(8, 4000, 512, **meta), "K=4000 is not a multiple"),
        (a, torch.empty(511, 64, 4096, **meta).transpose(1, 2), "G=511 groups"),
    ]
    for x, w, why in cases:
        p = mm.grouped_plan(x, w)
        assert p.path == "grouped" and why in p.reason, (why, p.reason)
        with pytest.raises(ValueError, match=why):
            mm.grouped_plan(x, w, path="grouped_tma")
    assert mm.grouped_plan(torch.empty(8, 64), torch.empty(2, 64, 8)).reason == \
        "Triton interpreter: portable kernel"
    with pytest.raises(ValueError, match="tma_store=True needs flatten=False"):
        mm.GroupedTmaConfig(128, 256, 64, 8, tma_store=True)


# ---- alignment: what a launch may assume about its operands' addresses --------------------
def _load_widths(launch, var: str) -> set[int]:
    """Bytes moved by each global load (or cp.async copy) that the kernel's
    ``{var} = tl.load(...)`` line compiles to, in the launch's sm_90 PTX (ahead of time)."""
    import re
    from pathlib import Path

    from tkit.ir_tools import aot

    ir = aot.compile_launch(launch.kernel, launch.kwargs, 90)
    src = Path(mm._kernels.__file__).read_text().splitlines()
    lines = {i + 1 for i, text in enumerate(src)
             if re.match(rf"\s*{var} = tl\.load\({var}_ptrs", text)}
    widths, current = set(), False
    for raw in ir.asm["ptx"].splitlines():
        m = re.match(r"\s*\.loc\s+\d+\s+(\d+)\s+\d+", raw)
        if m:
            current = int(m.group(1)) in lines
            continue
        if not current:
            continue
        m = re.search(r"cp\.async\.c[ag]\.shared\.global[^,]*,[^,]*,\s*(0x[0-9a-f]+|\d+)", raw)
        if m:
            widths.add(int(m.group(1), 0))
            continue
        m = re.search(r"ld\.global\S*?(?:\.v(\d))?\.b(\d+)\s", raw)
        if m:
            widths.add(int(m.group(1) or 1) * int(m.group(2)) // 8)
    return widths


def _gpu_launches(monkeypatch, fn):
    """The launches ``fn`` makes as on an sm_90 GPU (host-side decisions only; nothing runs)."""
    monkeypatch.setattr(_common._env, "INTERPRET", False)
    with _common.capture_launches() as launches:
        fn()
    return launches


@pytest.mark.parametrize("b_layout", ["broadcast", "column slice"])
@pytest.mark.parametrize("path", ["ptr", "splitk"])
def test_wrapped_tiles_load_no_misaligned_vectors(b_layout, path, monkeypatch):
    """The last column tile of b wraps around N (the kernels read columns ``n % N`` instead of
    masking). When N is not a multiple of the load's vector (8 fp16 here), a vector after the
    wrap starts at N's remainder: a 16-byte load or cp.async there is a misaligned address on
    the GPU. So with such an N, b's loads must be element-wide, even where b's base and row
    stride are 16-byte aligned (a broadcast row: stride 0; a slice of a wider matrix) so that
    the compiler could vectorize them."""
    K, N = 8192, 100
    dt = torch.float16
    a = torch.empty(16, K, dtype=dt, device="meta")
    b = (torch.empty(1, N, dtype=dt, device="meta").expand(K, N) if b_layout == "broadcast"
         else torch.empty(K, 256, dtype=dt, device="meta")[:, :N])
    launches = _gpu_launches(monkeypatch, lambda: mm._matmul_impl(a, b, path=path))
    assert _load_widths(launches[0], "b") == {2}


def test_grouped_wrapped_tiles_load_no_misaligned_vectors(monkeypatch):
    dt = torch.float16
    a = torch.empty(300, 64, dtype=dt, device="meta")
    b = torch.empty(4, 64, 256, dtype=dt, device="meta")[:, :, :100]
    offs = torch.tensor([0, 10, 100, 200, 300], dtype=torch.int32, device="meta")
    cfg = mm.GroupedConfig(block_m=64, block_n=128, block_k=64, num_warps=4)
    launches = _gpu_launches(monkeypatch, lambda: mm._grouped_impl(a, b, offs, config=cfg))
    assert _load_widths(launches[0], "b") == {2}


def test_aligned_operands_keep_vector_loads(monkeypatch):
    """N a multiple of 16 and a 16-byte row stride: b's loads stay 16-byte wide (the compiler
    proves it from the arguments' divisibility)."""
    a = torch.empty(64, 64, dtype=torch.float16, device="meta")
    b = torch.empty(64, 208, dtype=torch.float16, device="meta")
    launches = _gpu_launches(monkeypatch, lambda: mm._matmul_impl(a, b, path="ptr"))
    assert 16 in _load_widths(launches[0], "b")


def _on_hopper(monkeypatch):
    monkeypatch.setattr(_device, "capability", lambda device=None: (9, 0))
    monkeypatch.setattr(_device, "sm_count", lambda device: 132)


_DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _at_offset(shape, dtype, elements, transposed=False):
    """A contiguous (or column-major) view whose first element sits ``elements`` past a fresh
    allocation's start."""
    n = 1
    for s in shape:
        n *= s
    # on the GPU where there is one: tkit refuses CPU tensors outside the interpreter
    flat = torch.randn(n + elements, device=_DEV).to(dtype)[elements:]
    if transposed:
        return flat.view(shape[::-1]).t()
    return flat.view(shape)


def test_tma_eligibility_looks_at_addresses(monkeypatch):
    """TMA takes an operand only if its base address and row stride are 16-byte aligned: a
    bf16 view one element into its storage has 16-byte strides but a 2-byte-aligned base."""
    _on_hopper(monkeypatch)
    bf16 = torch.bfloat16
    a, b = _at_offset((128, 64), bf16, 0), _at_offset((64, 128), bf16, 0)
    assert a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
    assert mm.plan(a, b).path == "tma"
    for a2, b2 in ((_at_offset((128, 64), bf16, 1), b), (a, _at_offset((64, 128), bf16, 1)),
                   (a, _at_offset((64, 128), bf16, 1, transposed=True)),
                   (_at_offset((128, 64), bf16, 8), b)):  # 16 bytes in: aligned again
        want = "tma" if a2.data_ptr() % 16 == 0 and b2.data_ptr() % 16 == 0 else "ptr"
        assert mm.plan(a2, b2).path == want
    # tkit.ir plans on meta tensors: a view's storage offset decides there
    meta = torch.empty(128 * 64 + 1, dtype=bf16, device="meta")
    assert mm.plan(meta[1:].view(128, 64), b.to("meta")).path == "ptr"
    assert mm.plan(meta[:-1].view(128, 64), b.to("meta")).path == "tma"


@pytest.mark.parametrize("offset", [0, 1])
def test_tma_residual_needs_an_aligned_address(offset, monkeypatch):
    """The TMA kernel reads a row-major 16-bit residual through a descriptor only when the
    residual's own base and row stride allow it; otherwise through pointers."""
    _on_hopper(monkeypatch)
    bf16 = torch.bfloat16
    a, b = _at_offset((128, 64), bf16, 0), _at_offset((64, 128), bf16, 0)
    res = _at_offset((128, 128), bf16, offset)
    with _common.capture_launches() as launches:
        tkit.matmul(a, b, residual=res)
    (launch,) = launches
    assert launch.kwargs.get("RES_TMA", False) is (offset == 0)
    assert launch.kwargs["HAS_RES"] is (offset == 1)


def test_tma_residual_row_stride_of_one_row(monkeypatch):
    """M = 1: a residual row cut from a matrix of odd width has a row stride that is no
    multiple of 16 bytes; the descriptor gets the stride that eligibility checked."""
    _on_hopper(monkeypatch)
    bf16 = torch.bfloat16
    a, b = _at_offset((1, 64), bf16, 0), _at_offset((64, 128), bf16, 0)
    res = torch.randn(2, 131, device=_DEV).to(bf16)[:1, :128]
    with _common.capture_launches() as launches:
        tkit.matmul(a, b, residual=res)
    (launch,) = launches
    assert launch.kwargs["RES_TMA"] is True
    assert launch.kwargs["stride_rm"] * 2 % 16 == 0


# ---- shared memory: every TMA launch fits in the 227 KB a block may have ------------------
_SMEM_CASES = [  # (a dtype, out dtype, residual: None, "row" (TMA) or "bcast" (pointers))
    (torch.bfloat16, torch.bfloat16, None), (torch.bfloat16, torch.bfloat16, "row"),
    (torch.bfloat16, torch.bfloat16, "bcast"), (torch.bfloat16, torch.float32, None),
    (torch.float16, torch.float32, "row"), (torch.float32, torch.float32, None),
    (torch.float32, torch.float32, "row"), (torch.float8_e4m3fn, torch.float32, "row"),
    (torch.float8_e4m3fn, torch.bfloat16, "row"),
]


def _tma_launch(M, N, K, a_dtype, out_dtype, res):
    meta = dict(device="meta")
    a = torch.empty(M, K, dtype=a_dtype, **meta)
    b = torch.empty(N, K, dtype=a_dtype, **meta).t()
    r_dtype = torch.float16 if out_dtype == torch.float32 and a_dtype != torch.float32 \
        else out_dtype
    r = {None: None, "row": torch.empty(M, N, dtype=r_dtype, **meta),
         "bcast": torch.empty(N, dtype=r_dtype, **meta)}[res]
    with _common.capture_launches() as launches:
        mm._matmul_impl(a, b, None, r, out_dtype=out_dtype, path="tma")
    (launch,) = launches
    kw = launch.kwargs
    cfg = mm.TmaConfig(block_m=kw["BLOCK_M"], block_n=kw["BLOCK_N"], block_k=kw["BLOCK_K"],
                       num_warps=kw["num_warps"], num_stages=kw.get("num_stages"),
                       epi_subtile=kw["EPI_SUBTILE"])
    res_size = r.element_size() if r is not None else 0
    return launch, cfg, mm.config.tma_shared_bytes(cfg, a.element_size(),
                                                   torch.empty(0, dtype=out_dtype).element_size(),
                                                   res_size)


@pytest.mark.parametrize("a_dtype, out_dtype, res", _SMEM_CASES)
def test_tma_configs_fit_in_shared_memory(a_dtype, out_dtype, res, monkeypatch):
    """Every config the fixed table launches, with every output and residual, fits: the
    table's 4 stages of 128x256x32 float32 (262 KB beside a float32 half-tile buffer) and a
    16-bit GEMM's 3 stages beside a float32 output and a TMA residual (240 KB) run with fewer
    stages; the 16-bit GEMM without them keeps its 3."""
    monkeypatch.setattr(mm.config._env, "INTERPRET", False)
    for M, N, K in ((512, 6144, 4096), (4096, 28672, 4096), (256, 4096, 4096),
                    (8192, 8192, 8192), (1000, 1000, 1000)):
        _, cfg, est = _tma_launch(M, N, K, a_dtype, out_dtype, res)
        assert est <= mm.config.SMEM_BYTES, (M, N, K, cfg)
    _, cfg, _ = _tma_launch(8192, 8192, 8192, a_dtype, out_dtype, res)
    if (a_dtype, out_dtype, res) == (torch.bfloat16, torch.bfloat16, None):
        assert (cfg.block_n, cfg.num_stages) == (256, 3)  # unchanged
    if (a_dtype, out_dtype, res) == (torch.float32, torch.float32, None):
        assert (cfg.block_n, cfg.num_stages) == (256, 3)  # 4 would not fit
    if (a_dtype, out_dtype, res) == (torch.float16, torch.float32, "row"):
        assert (cfg.block_n, cfg.num_stages) == (256, 2)


def test_fit_shared_keeps_what_fits_and_shrinks_the_rest():
    fit, MC = mm.config.fit_shared, mm.config
    big = mm.TmaConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)
    assert fit(big, 2, 2) is big
    assert fit(big, 2, 4, 2).num_stages == 2
    whole = dataclasses.replace(big, block_k=32, num_stages=4, epi_subtile=False)
    shrunk = fit(whole, 4, 4, 4)  # 2 stages of a float32 tile still leave 256 KB: half epilogue
    assert (shrunk.num_stages, shrunk.epi_subtile) == (2, True)
    assert MC.tma_shared_bytes(shrunk, 4, 4, 4) <= MC.SMEM_BYTES
    huge = dataclasses.replace(big, block_m=256, block_k=256)  # nothing fits: left as asked
    assert fit(huge, 4, 4) is huge


@pytest.mark.parametrize("a_dtype, out_dtype, res", [
    (torch.bfloat16, torch.bfloat16, "row"), (torch.float32, torch.float32, None),
    (torch.float16, torch.float32, "row"), (torch.float32, torch.float32, "row")])
def test_tma_shared_memory_estimate_matches_the_compiler(a_dtype, out_dtype, res,
                                                          monkeypatch):
    """The estimate against the shared memory of the sm_90a build (tkit.ir): never below it,
    at most 128 bytes above (the barriers), and the build fits."""
    from tkit.ir_tools import aot

    monkeypatch.setattr(mm.config._env, "INTERPRET", False)
    launch, _, est = _tma_launch(512, 6144, 4096, a_dtype, out_dtype, res)
    ir = aot.compile_launch(launch.kernel, launch.kwargs, 90)
    assert 0 <= est - ir.shared <= 128, (est, ir.shared)
    assert ir.shared <= mm.config.SMEM_BYTES
