"""The launch fast path on the GPU: every op through the cached compiled kernel gives what
Triton's own launch path gives, with inputs whose alignment, strides and size-1 dimensions
change between calls (a kernel specialized for one must never serve the other); and every
registered op is captured in a CUDA graph and replayed on new data, equal to eager."""

import functools

import pytest
import torch
from torch.utils import _pytree as pytree

import tkit
from tkit.kernels import _launch, _plan

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF = torch.bfloat16


def _r(*shape, dtype=BF, offset=0):
    """Random data; ``offset`` elements into a larger buffer (offset 1 of a 2-byte dtype: a
    pointer that is not 16-byte aligned)."""
    n = 1
    for s in shape:
        n *= s
    buf = torch.randn(n + offset, device=DEV, dtype=torch.float32).to(dtype)
    return buf[offset:].view(shape)


def _fp8(*shape):
    return (torch.randn(*shape, device=DEV) * 4).to(torch.float8_e4m3fn)


def _offsets(T, G):
    cuts = torch.sort(torch.randint(0, T + 1, (G - 1,), device=DEV)).values
    z = torch.zeros(1, device=DEV, dtype=torch.int64)
    return torch.cat([z, cuts, z + T]).to(torch.int32)


_int4 = tkit.matmul_int4  # its module defines tkit::matmul_int4 (imported on first use)

# name -> (make inputs(offset) -> tuple, call(*inputs) -> tensor or tuple)
CASES = {
    "add": (lambda o: (_r(1, 4096, offset=o), _r(1, 4096)), tkit.add),
    "add_bcast": (lambda o: (_r(7, 1, 96, offset=o), _r(5, 96)), tkit.add),
    "sub_T": (lambda o: (_r(64, 48, offset=o).t(), _r(48, 64)), tkit.sub),
    "mul_fp32": (lambda o: (_r(3, 1000, dtype=torch.float32, offset=o),
                            _r(3, 1000, dtype=torch.float32)), tkit.mul),
    "residual_add": (lambda o: (_r(2, 4096, offset=o), _r(2, 4096, dtype=torch.float32)),
                     tkit.residual_add),
    "silu": (lambda o: (_r(1, 4097, offset=o),), tkit.silu),
    "gelu": (lambda o: (_r(33, 100, offset=o),), tkit.gelu),
    "relu": (lambda o: (_r(16, 16, offset=o),), tkit.relu),
    "silu_mul": (lambda o: (_r(1, 14336, offset=o), _r(1, 14336)), tkit.silu_mul),
    "gelu_mul_chunk": (lambda o: _r(4, 2 * 1000, offset=o).chunk(2, -1), tkit.gelu_mul),
    "cast_fp8": (lambda o: (_r(8, 4096, offset=o),
                            torch.rand(1, device=DEV, dtype=torch.float32) + 0.5),
                 lambda x, s: tkit.cast(x, torch.float8_e4m3fn, s).float()),
    "softmax": (lambda o: (_r(1, 4096, offset=o),), tkit.softmax),
    "softmax_rows": (lambda o: (_r(37, 1000, offset=o),), tkit.softmax),
    "log_softmax": (lambda o: (_r(4, 30000, offset=o),), tkit.log_softmax),
    "rms_norm": (lambda o: (_r(1, 4096, offset=o), _r(4096)), tkit.rms_norm),
    "rms_norm_rows": (lambda o: (_r(100, 1000, offset=o), _r(1000)), tkit.rms_norm),
    "rms_norm_residual": (lambda o: (_r(3, 4096, offset=o), _r(4096), _r(3, 4096)),
                          lambda x, w, r: tkit.rms_norm(x, w, residual=r)),
    "layer_norm": (lambda o: (_r(5, 2048, offset=o), _r(2048), _r(2048)), tkit.layer_norm),
    "matmul_M1": (lambda o: (_r(1, 4096, offset=o), _r(4096, 4096)), tkit.matmul),
    "matmul_linear": (lambda o: (_r(16, 4096, offset=o), _r(4096, 1024).t().contiguous().t()),
                      tkit.matmul),
    "matmul_bias": (lambda o: (_r(64, 256, offset=o), _r(256, 384), _r(384)),
                    lambda a, b, bias: tkit.matmul(a, b, bias, activation="gelu")),
    # matmul_glu: split-K at M = 1, the Gluon GEMM's gated build (the pointer kernel when
    # unaligned)
    "matmul_glu_M1": (lambda o: (_r(1, 4096, offset=o), _r(4096, 4096).t()), tkit.matmul_glu),
    "matmul_glu_bias": (lambda o: (_r(256, 1024, offset=o), _r(1536, 1024).t(), _r(1536)),
                        tkit.matmul_glu),
    "matmul_fp8": (lambda o: (_fp8(64, 256), _fp8(512, 256).t(),
                              torch.rand(1, device=DEV) + 0.5, torch.rand(1, device=DEV) + 0.5),
                   tkit.matmul_fp8),
    "grouped_matmul": (lambda o: (_r(200, 128, offset=o), _r(4, 128, 96), _offsets(200, 4)),
                       tkit.grouped_matmul),
    "attn_decode": (lambda o: (_r(1, 1, 32, 128, offset=o), _r(1, 4096, 8, 128),
                               _r(1, 4096, 8, 128)), tkit.flash_attention),
    "attn_prefill": (lambda o: (_r(2, 300, 8, 64, offset=o), _r(2, 300, 2, 64),
                                _r(2, 300, 2, 64)),
                     lambda q, k, v: tkit.flash_attention(q, k, v, causal=True)),
    "attn_varlen": (lambda o: (_r(250, 4, 64, offset=o), _r(250, 4, 64), _r(250, 4, 64),
                               torch.tensor([0, 100, 250], device=DEV, dtype=torch.int32)),
                    lambda q, k, v, cu: tkit.flash_attention_varlen(q, k, v, cu, cu, 150, 150,
                                                                    causal=True)),
    # the registered ops as a torch.compile graph (or the autograd path) calls them: their
    # implementations serve repeated signatures from plans of their own
    "op_rms_norm": (lambda o: (_r(1, 4096, offset=o), _r(4096)),
                    lambda x, w: torch.ops.tkit.rms_norm(x, w, 1e-6, False)),
    "op_rms_norm_stats": (lambda o: (_r(100, 1000, offset=o), _r(1000)),
                          lambda x, w: torch.ops.tkit.rms_norm(x, w, 1e-5, True)),
    "op_rms_norm_residual": (lambda o: (_r(3, 4096, offset=o), _r(3, 4096), _r(4096)),
                             lambda x, r, w: torch.ops.tkit.rms_norm_residual(x, r, w, 1e-6,
                                                                              False)),
    "op_softmax": (lambda o: (_r(37, 1000, offset=o),),
                   lambda x: torch.ops.tkit.softmax(x, 1, False)),
    "op_log_softmax": (lambda o: (_r(4, 30000, offset=o),),
                       lambda x: torch.ops.tkit.softmax(x, 1, True)),
    "op_matmul_M1": (lambda o: (_r(1, 4096, offset=o), _r(4096, 4096)),
                     lambda a, b: torch.ops.tkit.matmul(a, b, None, None, None, None, "", None,
                                                        True, "auto")),
    "op_matmul_linear_silu": (lambda o: (_r(16, 4096, offset=o),
                                         _r(4096, 1024).t().contiguous().t()),
                              lambda a, b: torch.ops.tkit.matmul(a, b, None, None, None, None,
                                                                 "silu", torch.float32, True,
                                                                 "auto")),
    "op_matmul_glu": (lambda o: (_r(256, 1024, offset=o), _r(1536, 1024).t()),
                      lambda a, b: torch.ops.tkit.matmul_glu(a, b, None, "silu", None, True)),
    # the CUDA GEMV on sm_90 (a raw launch in the plan; a at offset 1 takes the Triton GEMV)
    "op_matmul_int4": (lambda o: (_r(1, 4096, offset=o),
                                  torch.randint(-2**31, 2**31 - 1, (512, 14336), device=DEV,
                                                dtype=torch.int32),
                                  _r(32, 14336, dtype=torch.float16).abs(),
                                  (_r(32, 14336, dtype=torch.float16).abs() * 8).round()),
                       lambda a, q, s, z: torch.ops.tkit.matmul_int4(a, q, s, z, 128, None)),
    "op_attn_decode": (lambda o: (_r(1, 1, 32, 128, offset=o), _r(1, 4096, 8, 128),
                                  _r(1, 4096, 8, 128)),
                       lambda q, k, v: torch.ops.tkit.flash_attn_fwd(
                           q, k, v, None, None, 1, 4096, False, 128 ** -0.5, -1, -1, 0.0)),
    "op_attn_prefill": (lambda o: (_r(2, 300, 8, 64, offset=o), _r(2, 300, 2, 64),
                                   _r(2, 300, 2, 64)),
                        lambda q, k, v: torch.ops.tkit.flash_attn_fwd(
                            q, k, v, None, None, 300, 300, True, 0.125, -1, 0, 0.0)),
}


def _eq(a, b):
    if isinstance(a, (tuple, list)):
        return all(_eq(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(
        a.nan_to_num(0), b.nan_to_num(0))


def _slow(fn, *args):
    old = _launch.set_enabled(False)
    try:
        return fn(*args)
    finally:
        _launch.set_enabled(old)


@pytest.mark.parametrize("name", list(CASES))
def test_fast_path_equals_tritons_path(name):
    """Aligned and unaligned inputs alternate (the unaligned call comes after an aligned one
    has cached its kernel): each result equals Triton's own launch of the same op, bit for
    bit (same kernel, same config)."""
    make, fn = CASES[name]
    assert _launch._enabled, "the fast path is off (TKIT_NO_FAST_LAUNCH set?)"
    before = dict(_launch.stats)
    # plans off: a repeat eager call would be served by its plan (tested below) and never
    # reach the launch layer's cache this test is about
    with _plan.off("test of the launch layer"):
        for offset in (0, 1, 0, 8, 1):
            inputs = make(offset)
            got = fn(*inputs)
            torch.cuda.synchronize()
            want = _slow(fn, *inputs)
            assert _eq(got, want), f"{name} offset {offset}"
    assert _launch.stats["fast"] > before["fast"], "no call took the fast path"


PLANNED = [n for n in CASES if not n.startswith(("matmul", "grouped", "attn", "layer_norm",
                                                  "op_matmul", "op_attn"))]


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("op_")])
def test_registered_op_plan_equals_tritons_path(name):
    """The registered ops' implementations on fresh inputs, aligned and not: bit for bit what
    Triton's own launch gives, whether a plan serves the call or (matmul and attention where
    they take TMA descriptors) the ordinary path runs."""
    make, fn = CASES[name]
    before = dict(_launch.stats)
    with torch.no_grad():
        for offset in (0, 0, 1, 1, 0, 8):
            inputs = make(offset)
            got = fn(*inputs)
            torch.cuda.synchronize()
            assert _eq(got, _slow(fn, *inputs)), f"{name} offset {offset}"
    if name in PLANNED:
        assert _launch.stats["plan"] >= before["plan"] + 3, "repeat calls did not take their plan"
    if "cuda" in _plan._registered and _launch.stats["plan"] > before["plan"]:
        # the ops' C++ kernel (below the dispatcher) served every planned call
        assert (_launch.stats["op_fast"] - before["op_fast"]
                == _launch.stats["plan"] - before["plan"]), "plans served in Python"


def test_registered_ops_have_their_cpp_kernel():
    """On a GPU the registered plan ops get their C++ kernels at AutogradCUDA and CUDA with
    the first planned call, where the executor loads."""
    from tkit.kernels import _cplan

    x, w = _r(2, 256), _r(256)
    with torch.no_grad():
        torch.ops.tkit.rms_norm(x, w, 1e-6, False)
    if _cplan.module() is None:
        pytest.skip(f"no C++ executor: {_cplan.status()}")
    assert "cuda" in _plan._registered and _plan.unregistered == {}
    for key in ("AutogradCUDA", "CUDA"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("tkit::rms_norm", key)


@pytest.mark.parametrize("name", PLANNED)
def test_eager_plan_equals_tritons_path(name):
    """Repeat eager calls are served by their plan (tkit.kernels._plan), bit for bit what
    Triton's own launch gives; a new alignment between them gets its own plan."""
    make, fn = CASES[name]
    before = _launch.stats["plan"]
    with torch.no_grad():
        for offset in (0, 0, 1, 1, 0):
            inputs = make(offset)
            got = fn(*inputs)
            torch.cuda.synchronize()
            assert _eq(got, _slow(fn, *inputs)), f"{name} offset {offset}"
    assert _launch.stats["plan"] >= before + 3, "repeat calls did not take their plan"


@pytest.mark.parametrize("name", list(CASES))
def test_cuda_graph_capture_and_replay(name):
    make, fn = CASES[name]
    static = make(0)
    fn(*static)  # compile and cache outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*static)  # warm-up on the side stream, as torch recommends
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            out = fn(*static)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(2):
        fresh = make(0)
        for s, f in zip(static, fresh):
            if s.dtype.is_floating_point:  # offsets and cu_seqlens keep their (valid) values
                s.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        assert _eq(out, fn(*static)), name


def test_autotuned_kernel_served_without_timing(monkeypatch):
    """A new attention variant's first call compiles one config and benchmarks none."""
    from triton.runtime.autotuner import Autotuner

    calls = []
    monkeypatch.setattr(Autotuner, "_bench", lambda *a, **k: calls.append(1) or [1.0])
    q = _r(1, 70, 4, 96)
    tkit.flash_attention(q, q, q, causal=True, softcap=30.0)
    torch.cuda.synchronize()
    assert not calls


def _tensors(obj):
    """Every tensor in a nest of tuples, lists and dicts, in order."""
    return [t for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _clone(obj):
    return pytree.tree_map_only(torch.Tensor, torch.clone, obj)


def _registry_names():
    from tkit import registry

    return registry.names()


@pytest.mark.parametrize("name", _registry_names())
def test_every_registry_op_replays_in_a_cuda_graph(name):
    """Each op of the registry, on its first check case: captured once, replayed on new
    values (floating-point inputs permuted along their first dimension, so probabilities,
    scales and caches stay valid; index tensors keep theirs), equal bit for bit to an eager
    call on a copy of the same new inputs, outputs and every input an op writes in place."""
    from tkit import registry

    spec = registry.get(name)
    cases = spec.check_cases()
    if not cases:
        pytest.skip(spec.no_check_reason or "no check case")
    args, kwargs = cases[0].make(DEV)
    spec.fn(*_clone(args), **_clone(kwargs))  # compile and cache outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        spec.fn(*_clone(args), **_clone(kwargs))
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            out = spec.fn(*args, **kwargs)
    torch.cuda.current_stream().wait_stream(stream)
    moved = 0
    for t in _tensors((args, kwargs)):
        if t.dtype.is_floating_point and t.ndim and t.shape[0] > 1:
            t.copy_(t.flip(0))
            moved += 1
    assert moved, "no input took new values"
    before = _clone((args, kwargs))
    graph.replay()
    torch.cuda.synchronize()
    want = spec.fn(*before[0], **before[1])
    torch.cuda.synchronize()
    assert _eq(_tensors(out), _tensors(want)), f"{name}: outputs" + _which_is_off(
        spec, before, _tensors(out), _tensors(want))
    assert _eq(_tensors((args, kwargs)), _tensors(before)), f"{name}: inputs written in place"


def _which_is_off(spec, inputs, replayed, eager):
    """For a failure's message: which of the replay and the eager call disagrees with the
    spec's reference, and where (the first differing output's differing positions)."""
    from tkit.testing.fuzz import check_against_reference

    notes = []
    for label, got in (("replay", replayed), ("eager", eager)):
        try:
            check_against_reference(lambda *a, **k: tuple(got),  # noqa: B023
                                    spec.reference, inputs[0], inputs[1], ulps=spec.ulps)
            notes.append(f"{label} matches the reference")
        except AssertionError as e:
            notes.append(f"{label} does not: {str(e)[:300]}")
    for i, (a, b) in enumerate(zip(replayed, eager)):
        if not _eq([a], [b]):
            av = a.view(torch.uint8) if a.dtype.itemsize == 1 else a
            bv = b.view(torch.uint8) if b.dtype.itemsize == 1 else b
            where = (av != bv).nonzero()
            notes.append(f"output {i}: {len(where)} positions differ, first {where[:8].tolist()}")
            break
    return "; " + "; ".join(notes)


# name -> (make leaf inputs that require grad, forward); the backward ops (norm_backward,
# softmax_backward, flash_attn_bwd, grouped_matmul_wgrad, ...) run inside the captured step
TRAIN = {
    "rms_norm": (lambda: (_r(64, 1024), _r(1024)), tkit.rms_norm),
    "layer_norm": (lambda: (_r(64, 1024), _r(1024), _r(1024)), tkit.layer_norm),
    "softmax": (lambda: (_r(64, 3000),), tkit.softmax),
    "silu_mul": (lambda: (_r(64, 512), _r(64, 512)), tkit.silu_mul),
    "matmul": (lambda: (_r(64, 256), _r(256, 128)), tkit.matmul),
    "matmul_glu": (lambda: (_r(64, 256), _r(256, 128), _r(128)), tkit.matmul_glu),
    "grouped_matmul": (lambda: (_r(96, 64), _r(3, 64, 32)),
                       lambda a, b: tkit.grouped_matmul(a, b, _group_offsets())),
    "flash_attention": (lambda: (_r(2, 130, 4, 64), _r(2, 130, 2, 64), _r(2, 130, 2, 64)),
                        lambda q, k, v: tkit.flash_attention(q, k, v, causal=True)),
}


@functools.cache
def _group_offsets():
    """grouped_matmul's offsets, made once before any capture (a host-to-device copy cannot be
    captured)."""
    return torch.tensor([0, 40, 40, 96], device=DEV, dtype=torch.int32)


@pytest.mark.parametrize("name", list(TRAIN))
def test_training_step_replays_in_a_cuda_graph(name):
    """Forward and backward of an op captured as one step, replayed on new inputs and upstream
    gradients: the gradients equal an eager step's bit for bit."""
    make, fn = TRAIN[name]
    leaves = [t.detach().requires_grad_() for t in make()]

    def step(grad_out):
        out = fn(*leaves)
        return torch.autograd.grad(out, leaves, grad_out)

    grad_out = torch.randn_like(fn(*leaves)).detach()
    step(grad_out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(grad_out)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            grads = step(grad_out)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.no_grad():
        for t, f in zip(leaves, make()):
            t.copy_(f)
        grad_out.copy_(torch.randn_like(grad_out))
    graph.replay()
    torch.cuda.synchronize()
    assert _eq(list(grads), list(step(grad_out))), name
