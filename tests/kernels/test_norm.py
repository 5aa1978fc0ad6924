"""Norm family: RMSNorm (plain and fused with the residual add) and LayerNorm, forward and
backward, against the reference rule; chunked long-row paths; registration; errors."""

import contextlib
import dataclasses

import pytest
import torch

import tkit
from tkit import registry
from tkit.kernels.reductions import NormBwdConfig, NormConfig, ops, overrides
from tkit.kernels.reductions import config as rconfig
from tkit.specs.reductions import (
    ODD_HIDDEN,
    ref_layer_norm,
    ref_rms_norm,
    ref_rms_norm_residual,
    rms_norm_residual,
)
from tkit.testing import check_against_reference, fuzz, make_tensor

NAMES = ("rms_norm", "rms_norm_residual", "layer_norm")
SPECS = [registry.get(n) for n in NAMES]
ON_GPU = torch.cuda.is_available()


def _inputs(kind, shape, dtype, device, layout="contiguous"):
    x = make_tensor(shape, dtype, layout, seed=1, device=device)
    w = 1.0 + 0.1 * make_tensor(shape[-1:], dtype, seed=2, device=device)
    if kind == "rms_norm":
        return [x, w]
    if kind == "rms_norm_residual":
        return [x, make_tensor(shape, dtype, layout, seed=3, device=device), w]
    return [x, w, 0.1 * make_tensor(shape[-1:], dtype, seed=4, device=device)]


@pytest.fixture
def override():
    """``override(key=value, ...)``: reductions overrides in force until the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda **keys: stack.enter_context(overrides(**keys))


@pytest.fixture
def force_chunked(override):
    """Every row through the long-row paths (forward: one program looping over its row;
    backward: stats kernel), in chunks of 64 columns."""
    override(norm_fwd_single_bytes=0, norm_bwd_single_bytes=0, norm_chunk=64)


@pytest.mark.parametrize("spec", SPECS, ids=NAMES)
def test_fuzz_against_reference(spec):
    fuzz(spec.fn, spec.reference, max_examples=20, **spec.fuzz())


@pytest.mark.parametrize("spec", SPECS, ids=NAMES)
def test_check_cases(spec, device):
    for case in spec.check_cases():
        args, kwargs = case.make(device)
        check_against_reference(spec.fn, spec.reference, args, kwargs, grad=True)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", ODD_HIDDEN)
def test_odd_hidden_sizes(name, n, device):
    spec = registry.get(name)
    rows = (3,) if n < 10000 else (1,)
    # N = 1: the gradient cancels to ~eps/x^2 of its terms (see the spec's _hidden_sizes); the
    # floor is then 8 float32 ulps of the terms (|dy * w * rstd| ~ 1), not of the result
    floor = 1e-6 if n == 1 else None
    check_against_reference(spec.fn, spec.reference,
                            _inputs(name, rows + (n,), torch.float32, device),
                            grad=n < 10000,  # long-row backward: test_chunked_long_row_path
                            floor=floor)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_chunked_long_row_path(name, dtype, force_chunked, device):
    spec = registry.get(name)
    check_against_reference(spec.fn, spec.reference,
                            _inputs(name, (5, 3, 150), dtype, device, "sliced"), grad=True)


#: the loop path's LayerNorm lane combine, second-walk order and second walk unrolled or not:
#: two sums, last chunk first, a run-time loop (the first default); one Chan reduce, column
#: order, unrolled; and the two mixed
LOOP_STYLES = [{}, {"norm_chan": True, "norm_rev2": False, "norm_static2": True},
               {"norm_chan": True, "norm_static2": False},
               {"norm_rev2": True, "norm_static2": True}]
LOOP_STYLE_IDS = ["sum2-rev", "chan-fwd-s2", "chan-rev", "sum2-rev-s2"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [256, 1280])
@pytest.mark.parametrize("style", LOOP_STYLES, ids=LOOP_STYLE_IDS)
def test_loop_path_whole_chunks(name, n, style, override, device):
    """The forward's loop path when every chunk is full (no masks): unrolled at compile time
    (4 chunks of 64) and a run-time loop (20 chunks, over STATIC_CHUNKS_MAX). The loop path
    takes one row a program (ROWS = 1): two rows show the row stride."""
    for k, v in style.items():
        override(**{k: v})
    override(norm_fwd_single_bytes=0)
    override(norm_chunk=64)
    cfg = NormConfig.for_device(n, 2, is_rms=name != "layer_norm",
                                has_res=name == "rms_norm_residual")
    assert not cfg.single and cfg.even and cfg.nchunk == (n // 64 if n // 64 <= 16 else 0)
    assert cfg.rows == 1
    spec = registry.get(name)
    check_against_reference(spec.fn, spec.reference,
                            _inputs(name, (2, n), torch.float16, device, "offset"), grad=False)


@pytest.mark.parametrize("layout", ["transposed", "offset", "permuted"])
def test_strided_rows(layout, device):
    """Leading shape, strided rows, a non-unit column stride (transposed), storage offset."""
    for name in NAMES:
        spec = registry.get(name)
        check_against_reference(spec.fn, spec.reference,
                                _inputs(name, (2, 3, 40), torch.float16, device, layout),
                                grad=True)


def test_row_view_of_wider_buffer(device):
    """Rows with a stride larger than N (a slice of a fused projection): no copy, same result."""
    buf = make_tensor((8, 96), torch.float32, seed=1, device=device)
    x = buf[:, 16:80]
    w = 1.0 + 0.1 * make_tensor((64,), torch.float32, seed=2, device=device)
    assert x.stride() == (96, 1)
    check_against_reference(tkit.rms_norm, ref_rms_norm, [x, w], grad=True)


def test_layer_norm_variance_is_stable(device):
    """A large mean and a small spread: E[x^2] - E[x]^2 in float32 loses every digit (it gives
    a variance of 0 here); the on-chip two-pass variance keeps xhat within the float32 mean's
    own rounding (an ulp of 1e4 is 1e-3, a tenth of the spread; torch's float32 layer_norm is
    off by ~0.09 here)."""
    x = (1e4 + make_tensor((4, 4097), torch.float32, seed=3, device=device) * 1e-2)
    w = torch.ones(4097, device=device)
    naive_var = (x * x).mean(-1) - x.mean(-1) ** 2
    true_var = x.double().var(-1, unbiased=False)
    assert ((naive_var.double() - true_var).abs() / true_var).max() > 0.5
    got = tkit.layer_norm(x, w, None)
    want = ref_layer_norm(x.double(), w.double())
    assert (got.double() - want).abs().max().item() < 0.1


def test_layer_norm_variance_is_stable_chunked(force_chunked, device):
    x = 1e4 + make_tensor((2, 1000), torch.float32, seed=3, device=device) * 1e-2
    w = torch.ones(1000, device=device)
    want = ref_layer_norm(x.double(), w.double())
    assert (tkit.layer_norm(x, w, None).double() - want).abs().max().item() < 0.1


@pytest.mark.parametrize("chunk", [64, 256])
@pytest.mark.parametrize("style", LOOP_STYLES, ids=LOOP_STYLE_IDS)
def test_layer_norm_loop_variance_tracks_a_drifting_row(chunk, style, override, device):
    """The loop path's per-lane Welford update and its lane combine: a row whose level moves
    from chunk to chunk (a large mean, a step of 1 halfway, a spread of 1e-2), a partial last
    chunk, and rows shorter than a chunk (lanes that saw nothing: count 0)."""
    for k, v in style.items():
        override(**{k: v})
    override(norm_fwd_single_bytes=0)
    override(norm_chunk=chunk)
    for n in (1000, 37, 256, 1280):  # partial last chunk, short row, whole chunks
        x = make_tensor((3, n), torch.float32, seed=5, device=device) * 1e-2 + 1e4
        x[:, n // 2:] += 1.0
        w = torch.ones(n, device=device)
        want = ref_layer_norm(x.double(), w.double())
        assert (tkit.layer_norm(x, w, None).double() - want).abs().max().item() < 0.05


def test_residual_output_is_sum_and_norm_uses_it(device):
    x = make_tensor((4, 100), torch.float16, seed=1, device=device)
    r = make_tensor((4, 100), torch.float16, seed=2, device=device)
    w = torch.ones(100, dtype=torch.float16, device=device)
    y, h = tkit.rms_norm(x, w, residual=r)
    torch.testing.assert_close(h, x + r, rtol=0, atol=0)
    torch.testing.assert_close(y, tkit.rms_norm(h, w), rtol=0, atol=0)


def test_residual_gradient_of_h_alone(device):
    """Only h used downstream: x and residual get dh exactly, weight gets zero."""
    x, r, w = (t.requires_grad_() for t in _inputs("rms_norm_residual", (3, 33),
                                                   torch.float32, device))
    _, h = tkit.rms_norm(x, w, residual=r)
    g = torch.randn_like(h)
    h.backward(g)
    torch.testing.assert_close(x.grad, g)
    torch.testing.assert_close(r.grad, g)
    assert w.grad is None or not w.grad.any()


def test_layer_norm_without_bias(device):
    x, w, _ = _inputs("layer_norm", (5, 70), torch.float32, device)
    check_against_reference(tkit.layer_norm, ref_layer_norm, [x, w], grad=True)


def test_many_rows_per_program_partials(device, override):
    """Few programs each walking many row tiles: the dw/db partial sums over rows."""
    override(norm_bwd_programs=3)
    check_against_reference(tkit.layer_norm, ref_layer_norm,
                            _inputs("layer_norm", (300, 24), torch.float32, device), grad=True)


@pytest.mark.parametrize("name", ["rms_norm", "layer_norm", "rms_norm_residual"])
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("fstats", [False, True], ids=["recompute-stats", "forward-stats"])
def test_backward_variants(name, prefetch, fstats, device, override):
    """The backward with and without the prefetch of the next row tile, with few programs so
    each walks many row tiles (the prefetch's masked loads past the last tile included), and
    with the forward's (mean, rstd) or statistics recomputed from h."""
    override(norm_bwd_prefetch=prefetch)
    override(norm_bwd_programs=3)
    override(norm_bwd_fstats=fstats)
    spec = registry.get(name)
    check_against_reference(spec.fn, spec.reference,
                            _inputs(name, (37, 129), torch.float32, device), grad=True)


@pytest.mark.parametrize("fstats", [False, True], ids=["recompute-stats", "forward-stats"])
def test_chunked_backward_stats(fstats, force_chunked, device, override):
    """Long rows (stats kernel) with the forward's statistics or without them."""
    override(norm_bwd_fstats=fstats)
    for name in ("layer_norm", "rms_norm_residual"):
        spec = registry.get(name)
        check_against_reference(spec.fn, spec.reference,
                                _inputs(name, (6, 150), torch.float32, device), grad=True)


@pytest.mark.parametrize("is_rms", [True, False])
def test_forward_saves_row_stats(is_rms, device):
    """The (mean, rstd) rows the forward saves for the backward, on every forward path, are
    those of a float64 computation (mean 0 for RMSNorm)."""
    loop = {"norm_fwd_single_bytes": 0, "norm_chunk": 64}
    paths = [{}, loop] + [dict(loop, **st) for st in LOOP_STYLES[1:]]
    for n in (300, 256):  # a partial last chunk; whole chunks (the Chan combine's count-1 form)
        x, w, b = _inputs("layer_norm", (2, 3, n), torch.float32, device)
        x64 = x.detach().double().reshape(-1, n)
        mean = torch.zeros(6, dtype=torch.float64, device=x.device) if is_rms else x64.mean(1)
        var = (x64 * x64).mean(1) if is_rms else x64.var(1, unbiased=False)
        rstd = (var + 1e-5).rsqrt()
        for path in paths:
            with overrides(**path):
                for save in (False, True):
                    y, _, stats = ops._norm_fwd_impl(x, w, None if is_rms else b, None, 1e-5,
                                                      is_rms, save)
                    assert stats.dtype == torch.float32
                    if not save:
                        assert stats.shape == (0, 2)
                        continue
                    assert stats.shape == (6, 2), path
                    torch.testing.assert_close(stats[:, 0].double(), mean, atol=1e-6, rtol=0)
                    torch.testing.assert_close(stats[:, 1].double(), rstd, atol=0, rtol=1e-5)


def _fwd_ptx(kind, n, dtype, monkeypatch, rows=37):
    """PTX of the forward as a GPU launch (sm_90) of the op with saved statistics compiles it,
    ahead of time: the config the GPU gets, not the interpreter's."""
    from tkit import _env
    from tkit.ir_tools import aot
    from tkit.kernels import _common

    monkeypatch.setattr(_env, "INTERPRET", False)
    x = torch.empty(rows, n, dtype=dtype, device="meta")
    w = torch.empty(n, dtype=dtype, device="meta")
    b = torch.empty(n, dtype=dtype, device="meta") if kind == "layer_norm" else None
    r = torch.empty(rows, n, dtype=dtype, device="meta") if kind == "rms_norm_residual" else None
    with _common.capture_launches() as launches:
        ops._norm_fwd_impl(x, w, b, r, 1e-5, kind != "layer_norm", True)
    (launch,) = launches
    return aot.compile_launch(launch.kernel, launch.kwargs, 90).asm["ptx"], launch.kwargs


@pytest.mark.parametrize("kind, n, dtype", [
    ("rms_norm", 3, torch.float32),           # 4 lanes a row, 64 rows a program
    ("rms_norm_residual", 17, torch.bfloat16),  # a row on one warp's 32 lanes
    ("layer_norm", 33, torch.float32),        # a row on 2 warps of 32 lanes
    ("layer_norm", 100, torch.bfloat16),
])
def test_row_statistics_are_equal_in_every_lane(kind, n, dtype, monkeypatch):
    """Every lane that holds a copy of a row's (mean, rstd) holds the same bits. The saved
    statistics are stored through a layout conversion in which each such lane writes the same
    shared-memory word: copies that differ are a write-write race (racecheck's WAW hazard in
    the reliability campaign), and which one is saved is left to chance. A butterfly step
    leaves equal copies when it is ``op(x, shfl(x))`` with a commutative op and nothing fused
    into it (the square of the variance contracted into the first add was the defect)."""
    from tkit.ir_tools.lanes import butterfly_asymmetries

    ptx, kwargs = _fwd_ptx(kind, n, dtype, monkeypatch)
    assert kwargs["SINGLE"] and kwargs["SAVE_STATS"]
    assert "shfl.sync.bfly" in ptx  # the rows are reduced across lanes
    assert butterfly_asymmetries(ptx) == []


def test_int64_index_path(device, monkeypatch):
    from tkit.kernels import _common

    monkeypatch.setattr(_common, "needs_int64", lambda *t: True)
    for name in NAMES:
        spec = registry.get(name)
        check_against_reference(spec.fn, spec.reference,
                                _inputs(name, (7, 50), torch.float32, device), grad=True)


@pytest.mark.parametrize("spec", SPECS, ids=NAMES)
def test_opcheck(spec):
    op, args, kwargs = spec.opcheck()
    torch.library.opcheck(op, args, kwargs)


def test_torch_compile_fullgraph(device):
    x, r, w = (t.requires_grad_() for t in _inputs("rms_norm_residual", (6, 40),
                                                   torch.float32, device))
    b = torch.zeros(40, device=device)
    backend = "inductor" if ON_GPU else "aot_eager"

    def block(x, r, w, b):
        y, h = tkit.rms_norm(x, w, 1e-6, residual=r)
        return tkit.layer_norm(y * 2, w, b) + tkit.rms_norm(h, w)

    out = torch.compile(block, fullgraph=True, backend=backend)(x, r, w, b)
    y, h = ref_rms_norm_residual(x, r, w)
    want = ref_layer_norm(y * 2, w, b) + ref_rms_norm(h, w)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    out.sum().backward()
    assert all(t.grad is not None for t in (x, r, w))


def test_empty_inputs(device):
    w = torch.ones(5, device=device, requires_grad=True)
    x = torch.randn(0, 5, device=device, requires_grad=True)
    y = tkit.rms_norm(x, w)
    y.sum().backward()
    assert y.shape == (0, 5) and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda d: tkit.rms_norm(torch.ones(3, 4, device=d), torch.ones(5, device=d)),
         ValueError, "weight must have shape"),
        (lambda d: tkit.rms_norm(torch.ones(3, 4, device=d), torch.ones(1, 4, device=d)),
         ValueError, "weight must have 1 dimensions"),
        (lambda d: tkit.rms_norm(torch.ones(3, 4, dtype=torch.float64, device=d),
                                 torch.ones(4, device=d)), TypeError, "x has dtype float64"),
        (lambda d: tkit.rms_norm(torch.ones(3, 4, device=d), torch.ones(4, device=d),
                                 residual=torch.ones(3, 5, device=d)), ValueError, "residual"),
        (lambda d: tkit.rms_norm(torch.ones(3, 4, device=d), torch.ones(4, device=d),
                                 residual=torch.ones(3, 4, device=d).half()), TypeError,
         "residual has dtype"),
        (lambda d: tkit.rms_norm(torch.ones(3, 4, device=d), torch.ones(4, device=d), eps=-1.0),
         ValueError, "eps"),
        (lambda d: tkit.layer_norm(torch.ones(3, 4, device=d), torch.ones(4, device=d),
                                   torch.ones(3, device=d)), ValueError, "bias must have"),
    ],
)
def test_bad_input_errors(call, exc, words, device):
    with pytest.raises(exc, match=words):
        call(device)


def test_cost():
    x = torch.empty(16384, 8192, dtype=torch.bfloat16, device="meta")
    w = torch.empty(8192, dtype=torch.bfloat16, device="meta")
    assert registry.get("rms_norm").cost(x, w).bytes == 2 * x.numel() * 2 + 8192 * 2
    assert registry.get("rms_norm_residual").cost(x, x, w).bytes == 4 * x.numel() * 2 + 8192 * 2
    assert rms_norm_residual.__name__ == "rms_norm_residual"


# ---- GPU -----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [1024, 4096, 5120, 8192, 16384, 32768, 65536, 262144])
def test_bf16_on_gpu(name, n):
    spec = registry.get(name)
    rows = max(1, 2**22 // n)
    check_against_reference(spec.fn, spec.reference,
                            _inputs(name, (rows, n), torch.bfloat16, "cuda"), grad=True)


@pytest.mark.gpu
def test_more_than_2_31_elements():
    """Offsets past 2**31 elements: the last rows, where 32-bit index math would wrap."""
    n = 8192
    x = torch.randn(2**31 // n + 3, n, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(n, device="cuda", dtype=torch.bfloat16)
    y = tkit.rms_norm(x, w)
    tail = slice(-3, None)
    torch.testing.assert_close(y[tail].float(), ref_rms_norm(x[tail].float(), w.float()),
                               rtol=2e-2, atol=2e-2)
    del x, y
    torch.cuda.empty_cache()


_RACE_PROBE = """
import torch
from tkit.kernels.reductions import ops
g = torch.Generator(device="cuda").manual_seed(0)
for n in (2, 3, 17, 33, 100, 129, 1000):
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(37, n, device="cuda", generator=g).to(dt)
        w = 1 + 0.1 * torch.randn(n, device="cuda", generator=g).to(dt)
        b = 0.1 * torch.randn(n, device="cuda", generator=g).to(dt)
        for is_rms, bias, res in ((True, None, None), (True, None, x.flip(0)),
                                  (False, b, None)):
            ops._norm_fwd_impl(x, w, bias, res, 1e-5, is_rms, True)
torch.cuda.synchronize()
print("done")
"""


@pytest.mark.gpu
def test_saved_stats_race_free_under_racecheck():
    """The forward with saved statistics at the shapes whose rows are reduced within a warp:
    racecheck reports no hazard (it reported WAW hazards at the statistics' store)."""
    import os
    import re
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    exe = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(exe):
        pytest.skip("compute-sanitizer not found")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               TKIT_NO_AUTOTUNE="1")
    out = subprocess.run([exe, "--tool", "racecheck", sys.executable, "-c", _RACE_PROBE],
                         capture_output=True, text=True, timeout=600, env=env)
    text = out.stdout + out.stderr
    assert "done" in out.stdout, text[-3000:]
    m = re.search(r"RACECHECK SUMMARY: (\d+) hazards?", text)
    assert m is not None and int(m.group(1)) == 0, text[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("n", [3, 17, 100])
def test_saved_stats_are_deterministic_on_gpu(n):
    """Repeated forwards save bit-identical statistics (a race between lanes holding
    different copies would not)."""
    x, w, b = _inputs("layer_norm", (4099, n), torch.float32, "cuda")
    for is_rms in (True, False):
        first = ops._norm_fwd_impl(x, w, None if is_rms else b, None, 1e-5, is_rms, True)[2]
        for _ in range(20):
            again = ops._norm_fwd_impl(x, w, None if is_rms else b, None, 1e-5, is_rms,
                                        True)[2]
            assert torch.equal(again, first)


@pytest.mark.parametrize("kind", ["rms_norm", "rms_norm_residual", "layer_norm"])
def test_gpu_config_selection_follows_the_table(kind, monkeypatch):
    """NormConfig.for_device on the GPU (host-side only): rows up to the table's first length
    in registers, longer ones walked in the table's chunks and warps; every config frozen,
    cached per shape and consistent (chunk counts, whole chunks, styles)."""
    from tkit import _env

    monkeypatch.setattr(_env, "INTERPRET", False)
    is_rms, has_res = kind != "layer_norm", kind == "rms_norm_residual"
    table = rconfig.LOOP_SHAPES[kind]
    for n in (1024, 1000, 4096, 8192, 16384, 32768, 65536, 262144, 262147):
        cfg = NormConfig.for_device(n, 2, is_rms=is_rms, has_res=has_res)
        assert cfg is NormConfig.for_device(n, 2, is_rms=is_rms, has_res=has_res)
        row = next(r for r in table if r[0] is None or n <= r[0])
        assert cfg.single == (row[1] == 0), (n, cfg)
        if cfg.single:
            assert cfg.block_n >= n and cfg.nchunk == 0 and cfg.rows * cfg.block_n * 2 >= 4096
            continue
        assert (cfg.block_n, cfg.rows, cfg.warps) == (row[1], 1, row[2])
        assert cfg.even == (n % cfg.block_n == 0)
        assert cfg.chan == ("chan" in row[3]) and cfg.rev2 == ("fwd" not in row[3])
        assert cfg.nchunk in (0, -(-n // cfg.block_n))
        assert not cfg.static2 or cfg.nchunk > 0
    assert NormConfig.for_device(n, torch.bfloat16, is_rms=is_rms, has_res=has_res) == cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rows = 3


def test_overrides_change_the_config_inside_the_block_only(monkeypatch):
    from tkit import _env

    monkeypatch.setattr(_env, "INTERPRET", False)
    base = NormConfig.for_device(8192, 2, is_rms=False)
    assert base.single and base.warps == 8
    with overrides(num_warps=16):
        assert NormConfig.for_device(8192, 2, is_rms=False).warps == 16  # an override wins
        with overrides(norm_fwd_single_bytes=0, norm_chunk=1024):
            inner = NormConfig.for_device(8192, 2, is_rms=False)
            assert not inner.single and inner.block_n == 1024
        assert NormConfig.for_device(8192, 2, is_rms=False).single  # the outer block again
    assert rconfig.active() == {} and NormConfig.for_device(8192, 2, is_rms=False) == base
    with overrides(norm_bwd_programs=3, norm_bwd_prefetch=False):
        bwd = NormBwdConfig.for_device(300, 24, 4, is_rms=False, has_stats=True,
                                       device=torch.device("cpu"))
        assert bwd.programs == 3 and not bwd.prefetch and bwd.single


def test_launchers_take_a_config(device):
    """A config passed to the launcher is the one launched: a loop-path config on short rows
    gives the same result as the default."""
    x, w, b = _inputs("layer_norm", (5, 300), torch.float32, device)
    cfg = NormConfig(block_n=64, rows=1, warps=4, single=False)
    want = ops._norm_fwd_impl(x, w, b, None, 1e-5, False)[0]
    got = ops._norm_fwd_impl(x, w, b, None, 1e-5, False, config=cfg)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
