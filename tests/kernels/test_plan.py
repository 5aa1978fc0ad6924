"""Eager plans (tkit.kernels._plan): a repeated eager call launches from its per-signature plan,
with what the ordinary path would launch; anything Triton specializes on, or the ordinary path
reads, gives another plan; everything that needs the ordinary path still gets it.

Plans need real ``JITFunction`` kernels, which the interpreter does not have: the tests marked
``jit`` run in a child pytest without TRITON_INTERPRET (``test_plans_in_a_jit_process``), with
CPU tensors standing in for CUDA ones and a stand-in compiled kernel that records its launches
(Triton's C launcher cannot run here). The rest run in this process, under the interpreter when
there is no GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tkit
from tkit import _env
from tkit.kernels import _common as C
from tkit.kernels import _device, _launch, _plan

JIT_CHILD = os.environ.get("TKIT_PLAN_JIT_CHILD") == "1"
jit = pytest.mark.skipif(not JIT_CHILD, reason="runs in test_plans_in_a_jit_process's child")
BF = torch.bfloat16


# --------------------------------------------------------------------------------------------
# in this process
# --------------------------------------------------------------------------------------------
@pytest.mark.skipif(JIT_CHILD, reason="the parent's test")
def test_plans_in_a_jit_process():
    """Run this file's ``jit`` tests in a process where kernels are JIT functions."""
    env = dict(os.environ, TRITON_INTERPRET="0", TKIT_PLAN_JIT_CHILD="1")
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                          __file__, "-k", "test_jit_"], env=env, cwd=root, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    summary = res.stdout.strip().split("\n")[-1]
    assert " passed" in summary and "skipped" not in summary, res.stdout[-4000:]


@pytest.mark.skipif(JIT_CHILD or not _env.INTERPRET, reason="the interpreter's case")
def test_interpreter_takes_the_ordinary_path(device):
    """Under TRITON_INTERPRET plans are off: results are the interpreter's and no plan counts."""
    assert _plan.ON is False
    before = dict(_launch.stats)
    a, b = torch.randn(3, 100, device=device), torch.randn(100, device=device)
    for _ in range(3):
        torch.testing.assert_close(tkit.add(a, b), a + b)
        torch.testing.assert_close(tkit.softmax(a), torch.softmax(a, -1))
        torch.testing.assert_close(tkit.silu_mul(a, a), torch.nn.functional.silu(a) * a)
        w = torch.randn(100, device=device)
        torch.testing.assert_close(tkit.rms_norm(a, w, 1e-6),
                                   torch.nn.functional.rms_norm(a, (100,), w, 1e-6))
    assert _launch.stats["plan"] == before["plan"]
    assert _launch.stats["plan_built"] == before["plan_built"]


# --------------------------------------------------------------------------------------------
# in the child: JIT kernels, a stand-in compiled kernel
# --------------------------------------------------------------------------------------------
class FakeCompiled(_launch.CompiledKernel):
    """Records each launch (the arguments Triton's launcher would get); nothing runs."""

    run = None

    def __init__(self, kwargs):
        self.module = None  # Triton 3.9's __del__ unloads a module when one is set
        self.function = object()
        self.packed_metadata = ("meta", id(self))
        self.kwargs = kwargs
        self.launches = []
        self.run = self._run

    def _run(self, *args):
        self.launches.append(args)


@pytest.fixture
def jitplans(monkeypatch):
    """Plans on with CPU tensors: the device check passes them (as under the interpreter),
    Triton's JIT launch compiles nothing and returns a FakeCompiled (listed in the yield)."""
    made = []

    def fake_run(self, *args, grid, warmup, **kwargs):
        ck = FakeCompiled(kwargs)
        made.append(ck)
        return ck

    assert not _env.INTERPRET and isinstance(
        tkit.kernels.elementwise._kernels._ew_strided_kernel, _launch.JITFunction)
    monkeypatch.setattr(_env, "INTERPRET", True)  # read by the device check only, per call
    monkeypatch.setattr(_launch, "_enabled", True)
    monkeypatch.setattr(_launch, "_device_stream", lambda: (0, 77))
    monkeypatch.setattr(_launch.JITFunction, "run", fake_run)
    monkeypatch.setattr(_plan, "CPU_OK", True)
    _launch.clear()
    _plan.refresh()
    assert _plan.ON
    yield made
    _launch.clear()


class _Recorder:
    """Numbers every launch so that the last one can be found across compiled kernels."""

    def __init__(self, made):
        self.made = made

    def take(self):
        """The launches made since the last take: (compiled, args) in order."""
        out = []
        for ck in self.made:
            for args in ck.launches[getattr(ck, "_taken", 0):]:
                out.append((ck, args))
            ck._taken = len(ck.launches)
        return out


def _normal(launches, inputs, outputs):
    """Launches with every pointer argument (a tensor, or the int data pointer a plan passes)
    named by the call tensor it points into."""
    named = [(f"in{i}", t) for i, t in enumerate(inputs)] + [
        (f"out{i}", t) for i, t in enumerate(outputs)]
    ptrs = {t.data_ptr(): n for n, t in named if isinstance(t, torch.Tensor)}
    res = []
    for ck, args in launches:
        norm = []
        for v in args:
            if isinstance(v, torch.Tensor):
                hits = [n for n, t in named if t.data_ptr() == v.data_ptr()]
                assert len(hits) <= 1, hits
                # none: an output the op does not return (attention's lse without return_lse)
                norm.append(("ptr", hits[0]) if hits else
                            ("ptr", "hidden", v.shape, v.stride(), v.dtype))
            elif type(v) is int and v in ptrs:
                norm.append(("ptr", ptrs[v]))
            elif hasattr(v, "block_shape") and hasattr(v, "base"):  # a host TMA descriptor
                base = v.base.data_ptr()
                norm.append(("desc", ptrs.get(base, "hidden"), list(v.shape), list(v.strides),
                             list(v.block_shape), getattr(v, "layout", None), v.padding))
            else:
                norm.append(v)
        res.append((ck, tuple(norm)))
    return res


def _same_launches(planned, ordinary) -> bool:
    """Equal, except that where the ordinary path passed a tensor the call does not return
    (hidden), the plan passes a pointer (an int) of its own allocation."""
    if len(planned) != len(ordinary):
        return False
    for (ck1, a1), (ck2, a2) in zip(planned, ordinary):
        if ck1 is not ck2 or len(a1) != len(a2):
            return False
        for x, y in zip(a1, a2):
            hidden = isinstance(y, tuple) and y[:2] == ("ptr", "hidden")
            if not (x == y or hidden and type(x) is int and x % 16 == 0):
                return False
    return True


def _outs(r):
    return r if isinstance(r, tuple) else (r,)


def _buf(n, dtype=BF, offset=0):
    return torch.randn(n + offset).to(dtype)[offset:]


_ops = torch.ops.tkit
_int4 = tkit.matmul_int4  # its module defines tkit::matmul_int4 (imported on first use)


def _codes(K, N):
    """Random packed INT4 codes of a (N, K) weight in tkit's layout: int32 (K // 8, N)."""
    return torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32)

# the registered ops whose implementations serve from plans, each as a torch.compile graph (or
# the autograd path) calls it: name -> ((make inputs, call), make inputs of another signature)
OP_CASES = {
    "op_rms_norm": ((lambda: (torch.randn(1, 4096).to(BF), torch.randn(4096).to(BF)),
                     lambda x, w: _ops.rms_norm(x, w, 1e-6, False)),
                    lambda: (torch.randn(2, 4096).to(BF), torch.randn(4096).to(BF))),
    "op_rms_norm_stats": ((lambda: (torch.randn(3, 256), torch.randn(256)),
                           lambda x, w: _ops.rms_norm(x, w, 1e-5, True)),
                          lambda: (torch.randn(3, 256).to(BF), torch.randn(256))),
    "op_rms_norm_param": ((lambda: (torch.randn(3, 256).to(BF),
                                    torch.nn.Parameter(torch.randn(256).to(BF))),
                           lambda x, w: _ops.rms_norm(x, w, 1e-5, False)),
                          lambda: (torch.randn(6, 256).to(BF)[::2],
                                   torch.nn.Parameter(torch.randn(256).to(BF)))),
    "op_rms_norm_residual": ((lambda: (torch.randn(3, 512), torch.randn(3, 512),
                                       torch.randn(512)),
                              lambda x, r, w: _ops.rms_norm_residual(x, r, w, 1e-6, False)),
                             lambda: (torch.randn(3, 1024)[:, :512], torch.randn(3, 512),
                                      torch.randn(512))),
    "op_softmax": ((lambda: (torch.randn(1, 4096).to(BF),),
                    lambda x: _ops.softmax(x, 1, False)),
                   lambda: (torch.randn(1, 4096),)),
    "op_log_softmax_split": ((lambda: (torch.randn(4, 30000).to(BF),),
                              lambda x: _as_on_h200(lambda: _ops.softmax(x, 1, True))),
                             lambda: (torch.randn(30000, 4).to(BF).t(),)),
    "op_matmul_M1": ((lambda: (torch.randn(1, 512).to(BF), torch.randn(512, 256).to(BF)),
                      lambda a, b: _ops.matmul(a, b, None, None, None, None, "", None, True,
                                               "auto")),
                     lambda: (torch.randn(1, 512).to(BF), torch.randn(256, 512).to(BF).t())),
    "op_matmul_act_f32": ((lambda: (torch.randn(16, 128), torch.randn(64, 128).t()),
                           lambda a, b: _ops.matmul(a, b, None, None, None, None, "silu",
                                                    torch.float32, False, "auto")),
                          lambda: (torch.randn(17, 128), torch.randn(64, 128).t())),
    "op_matmul_residual": ((lambda: (torch.randn(8, 128).to(BF), torch.randn(64, 128).to(BF).t(),
                                     torch.randn(8, 64).to(BF)),
                            lambda a, b, r: _ops.matmul(a, b, None, r, None, None, "", None,
                                                        True, "auto")),
                           lambda: (torch.randn(8, 128).to(BF), torch.randn(64, 128).to(BF).t(),
                                    torch.randn(64).to(BF))),
    "op_matmul_bias_act": ((lambda: (torch.randn(5, 64), torch.randn(64, 48), torch.randn(48)),
                            lambda a, b, c: _ops.matmul(a, b, c, None, None, None, "gelu",
                                                        None, False, "auto")),
                           lambda: (torch.randn(5, 64), torch.randn(64, 48),
                                    torch.randn(48).to(BF))),
    "op_matmul_glu_bias": ((lambda: (torch.randn(2, 5, 64), torch.randn(96, 64).t(),
                                     torch.randn(96)),
                            lambda a, b, c: _ops.matmul_glu(a, b, c, "gelu", None, False)),
                           lambda: (torch.randn(2, 6, 64), torch.randn(96, 64).t(),
                                    torch.randn(96))),
    "op_matmul_int4": ((lambda: (torch.randn(1, 256).to(BF), _codes(256, 96),
                                 torch.rand(2, 96).half(), torch.rand(2, 96).half() * 15),
                        lambda a, q, s, z: _ops.matmul_int4(a, q, s, z, 128, None)),
                       lambda: (torch.randn(3, 256).to(BF), _codes(256, 96),
                                torch.rand(2, 96).half(), torch.rand(2, 96).half() * 15)),
    "op_attn_decode": ((lambda: (torch.randn(1, 1, 8, 64).to(BF),
                                 torch.randn(1, 300, 2, 64).to(BF),
                                 torch.randn(1, 300, 2, 64).to(BF)),
                        lambda q, k, v: _ops.flash_attn_fwd(q, k, v, None, None, 1, 300, False,
                                                            0.125, -1, -1, 0.0)),
                       lambda: (torch.randn(1, 1, 8, 64), torch.randn(1, 300, 2, 64),
                                torch.randn(1, 300, 2, 64))),
    "op_attn_causal": ((lambda: (torch.randn(2, 40, 4, 32), torch.randn(2, 40, 4, 32),
                                 torch.randn(2, 40, 4, 32)),
                        lambda q, k, v: _ops.flash_attn_fwd(q, k, v, None, None, 40, 40, True,
                                                            32 ** -0.5, -1, 0, 0.0)),
                       lambda: (torch.randn(2, 40, 4, 32), torch.randn(2, 48, 4, 32)[:, :40],
                                torch.randn(2, 40, 4, 32))),
}

CASES = {
    "add": (lambda: (torch.randn(1, 4096).to(BF), torch.randn(1, 4096).to(BF)), tkit.add),
    "add_bcast": (lambda: (torch.randn(7, 1, 96), torch.randn(5, 96)), tkit.add),
    "sub_T": (lambda: (torch.randn(64, 48).t(), torch.randn(48, 64)), tkit.sub),
    "mul_out_dtype": (lambda: (torch.randn(3, 100).to(BF), torch.randn(3, 100).to(BF)),
                      lambda a, b: tkit.mul(a, b, out_dtype=torch.float32)),
    "residual_add": (lambda: (torch.randn(2, 64).to(BF), torch.randn(2, 64)),
                     tkit.residual_add),
    "silu": (lambda: (torch.randn(1, 4097),), tkit.silu),
    "gelu_tanh": (lambda: (torch.randn(33, 100),), lambda x: tkit.gelu(x, "tanh")),
    "silu_mul": (lambda: (torch.randn(1, 14336).to(BF), torch.randn(1, 14336).to(BF)),
                 tkit.silu_mul),
    "gelu_mul_chunk": (lambda: torch.randn(4, 2000).chunk(2, -1), tkit.gelu_mul),
    "cast": (lambda: (torch.randn(8, 64),), lambda x: tkit.cast(x, BF)),
    # outputs with a transposed input's strides (empty_like of it; a cast's with its dtype)
    "silu_T": (lambda: (torch.randn(48, 40).t(),), tkit.silu),
    "cast_T": (lambda: (torch.randn(3, 64, 40).transpose(1, 2),), lambda x: tkit.cast(x, BF)),
    "op_cast_T_scaled": (lambda: (torch.randn(64, 40).t(), torch.rand(1) + 0.5),
                         lambda x, s: torch.ops.tkit.cast(x, torch.float16, s)),
    "cast_scale": (lambda: (torch.randn(8, 64), torch.rand(1) + 0.5),
                   lambda x, s: tkit.cast(x, torch.float8_e4m3fn, s)),
    "softmax": (lambda: (torch.randn(1, 4096).to(BF),), tkit.softmax),
    "log_softmax_rows": (lambda: (torch.randn(37, 1000),), tkit.log_softmax),
    # the registered ops (what a torch.compile graph calls): served by plans too
    "op_binary": (lambda: (torch.randn(3, 64).to(BF), torch.randn(64).to(BF)),
                  lambda a, b: torch.ops.tkit.binary(a, b, "add", None)),
    "op_unary": (lambda: (torch.randn(5, 33),), lambda x: torch.ops.tkit.unary(x, "silu")),
    "op_act_mul": (lambda: (torch.randn(2, 300).to(BF), torch.randn(2, 300).to(BF)),
                   lambda a, b: torch.ops.tkit.act_mul(a, b, "silu")),
    "op_cast_scaled": (lambda: (torch.randn(8, 64), torch.rand(1) + 0.5),
                       lambda x, s: torch.ops.tkit.cast(x, torch.float8_e4m3fn, s)),
    # ... and the registered forwards of the norms, softmax, matmul and attention
    **{name: case for name, (case, _) in OP_CASES.items()},
    # few long rows on a GPU of 132 SMs: the split path, two launches over float32 partials
    "log_softmax_split": (lambda: (torch.randn(4, 30000).to(BF),), lambda x: _as_on_h200(
        lambda: tkit.log_softmax(x))),
    "rms_norm": (lambda: (torch.randn(1, 4096).to(BF), torch.randn(4096).to(BF)),
                 tkit.rms_norm),
    "rms_norm_param": (lambda: (torch.randn(3, 256).to(BF),
                                torch.nn.Parameter(torch.randn(256).to(BF))),
                       lambda x, w: tkit.rms_norm(x, w, 1e-5)),
    "rms_norm_residual": (lambda: (torch.randn(3, 512), torch.randn(512), torch.randn(3, 512)),
                          lambda x, w, r: tkit.rms_norm(x, w, residual=r)),
    "matmul_M1": (lambda: (torch.randn(1, 512).to(BF), torch.randn(512, 256).to(BF)),
                  tkit.matmul),
    "matmul_linear_act": (lambda: (torch.randn(16, 128), torch.randn(64, 128).t()),
                          lambda a, b: tkit.matmul(a, b, activation="silu")),
    "matmul_residual": (lambda: (torch.randn(8, 128).to(BF), torch.randn(64, 128).to(BF).t(),
                                 torch.randn(8, 64).to(BF)),
                        lambda a, b, r: tkit.matmul(a, b, residual=r)),
    "matmul_bias_bcast_residual": (lambda: (torch.randn(3, 64), torch.randn(64, 32),
                                            torch.randn(32), torch.randn(32)),
                                   lambda a, b, c, r: tkit.matmul(a, b, c, "relu", r)),
    "matmul_glu": (lambda: (torch.randn(16, 128).to(BF), torch.randn(96, 128).to(BF).t()),
                   tkit.matmul_glu),
    "matmul_glu_bias_lead": (lambda: (torch.randn(2, 3, 64), torch.randn(64, 48),
                                      torch.randn(48)),
                             lambda a, b, c: tkit.matmul_glu(a, b, c, "gelu_tanh")),
    # decode on 132 SMs: split-K over the (K, 2N) weight, float32 partials, the gated reduce
    "matmul_glu_splitk": (lambda: (torch.randn(1, 1024).to(BF), torch.randn(2048, 1024).to(BF).t()),
                          lambda a, b: _as_on_h200(lambda: tkit.matmul_glu(a, b))),
    "attn_decode": (lambda: (torch.randn(1, 1, 8, 64).to(BF), torch.randn(1, 300, 2, 64).to(BF),
                             torch.randn(1, 300, 2, 64).to(BF)), tkit.flash_attention),
    "attn_causal_lse": (lambda: (torch.randn(2, 40, 4, 32), torch.randn(2, 40, 4, 32),
                                 torch.randn(2, 40, 4, 32)),
                        lambda q, k, v: tkit.flash_attention(q, k, v, causal=True,
                                                             return_lse=True)),
    # decode attention (split-KV over float32 scratch partials on 132 SMs), paged with an fp8
    # cache and per-token scales, GQA 4; the cache writer (no outputs) and the merge
    "decode_dense_split": (lambda: _decode_inputs(), lambda *a: _decode_on_h200(
        lambda: tkit.decode_attention(*a))),
    "decode_paged_fp8_lse": (lambda: _decode_inputs(paged=True, fp8=True),
                             lambda q, k, v, n, bt, ks, vs: _decode_on_h200(
                                 lambda: tkit.decode_attention(q, k, v, n, block_table=bt,
                                                               k_scale=ks, v_scale=vs,
                                                               return_lse=True))),
    "decode_one_split_window": (lambda: _decode_inputs()[:4], lambda q, k, v, n:
                                tkit.decode_attention(q, k, v, n, window_size=(100, 0),
                                                      num_splits=1, return_lse=True)),
    "append_kv_fp8_tok": (lambda: (torch.randn(3, 2, 64).to(BF), torch.randn(3, 2, 64).to(BF),
                                   torch.zeros(8, 16, 2, 64).to(torch.float8_e4m3fn),
                                   torch.zeros(8, 16, 2, 64).to(torch.float8_e4m3fn),
                                   torch.tensor([5, -1, 100]), torch.ones(8, 16, 2),
                                   torch.ones(8, 16, 2)),
                          lambda k, v, kc, vc, s, ks, vs: tkit.append_kv(
                              k, v, kc, vc, s, k_scale=ks, v_scale=vs) or ()),
    # rope: out of place (two outputs), in place (none: the inputs are written), and fused
    # with the cache write (fp8 with per-token scales)
    "rope": (lambda: (torch.randn(7, 4, 64).to(BF), torch.randn(7, 2, 64).to(BF),
                      torch.randint(0, 32, (7,)), tkit.rope_cache(32, 64)), tkit.rope),
    "rope_inplace_gptj": (lambda: (torch.randn(7, 4, 48).to(BF), torch.randn(7, 2, 48).to(BF),
                                   torch.randint(0, 32, (7,)), tkit.rope_cache(32, 32)),
                          lambda q, k, p, cs: tkit.rope(q, k, p, cs, is_neox=False,
                                                        rotary_dim=32, inplace=True) and ()),
    "rope_append_fp8_tok": (lambda: (torch.randn(3, 4, 64).to(BF), torch.randn(3, 2, 64).to(BF),
                                     torch.randn(3, 2, 64).to(BF), torch.randint(0, 32, (3,)),
                                     tkit.rope_cache(32, 64),
                                     torch.zeros(8, 16, 2, 64).to(torch.float8_e4m3fn),
                                     torch.zeros(8, 16, 2, 64).to(torch.float8_e4m3fn),
                                     torch.tensor([5, -1, 100]), torch.ones(8, 16, 2),
                                     torch.ones(8, 16, 2)),
                            lambda q, k, v, p, cs, kc, vc, s, ks, vs: tkit.rope_append_kv(
                                q, k, v, p, cs, kc, vc, s, k_scale=ks, v_scale=vs) and ()),
    "grouped_matmul": (lambda: (torch.randn(50, 64).to(BF), torch.randn(3, 64, 32).to(BF),
                                torch.tensor([0, 7, 7, 50], dtype=torch.int32)),
                       tkit.grouped_matmul),
    "layer_norm_bias": (lambda: (torch.randn(3, 1000).to(BF), torch.randn(1000).to(BF),
                                 torch.randn(1000).to(BF)),
                        lambda x, w, b: tkit.layer_norm(x, w, b, 1e-5)),
    "matmul_fp8_rowcol": (lambda: (torch.randn(16, 128).to(torch.float8_e4m3fn),
                                   torch.randn(64, 128).to(torch.float8_e4m3fn).t(),
                                   torch.rand(16) + 0.5, torch.rand(64) + 0.5),
                          tkit.matmul_fp8),
    # dynamic quantization: per token (a scalar and a tensor bound), 1x128 groups, the
    # fused RMSNorm (with the residual stream's h as a third output) and SiLU-and-mul forms
    "quantize_fp8_tok_ub": (lambda: (torch.randn(5, 256).to(BF),),
                            lambda x: tkit.quantize_fp8(x, scale_ub=3.0)),
    "quantize_fp8_ub_tensor": (lambda: (torch.randn(5, 256).to(BF), torch.tensor([2.0])),
                               lambda x, u: tkit.quantize_fp8(x, scale_ub=u)),
    "quantize_fp8_1x128": (lambda: (torch.randn(3, 512),),
                           lambda x: tkit.quantize_fp8(x, group_size=128)),
    "quantize_int8": (lambda: (torch.randn(4, 300).to(BF),), tkit.quantize_int8),
    "rms_norm_quant_res": (lambda: (torch.randn(4, 512).to(BF), torch.randn(512).to(BF),
                                    torch.randn(4, 512).to(BF)),
                           lambda x, w, r: tkit.rms_norm_quant(x, w, 1e-6, residual=r)),
    "silu_mul_quant_1x128": (lambda: torch.randn(4, 2 * 256).to(BF).chunk(2, -1),
                             lambda a, b: tkit.silu_mul_quant(a, b, group_size=128)),
    # INT4 at M = 5 on 132 SMs: the tensor-core decode kernel with host descriptors of the
    # packed weight, scales and zeros, K split (float32 partials and the reduce launch)
    "matmul_int4_tc": (lambda: (torch.randn(5, 2048).to(BF),
                                torch.randint(-2**31, 2**31 - 1, (256, 256), dtype=torch.int32),
                                torch.rand(16, 256).to(BF), torch.rand(16, 256).to(BF)),
                       lambda a, q, s, z: _as_on_h200(lambda: tkit.matmul_int4(a, q, s, z))),
    # MoE routing and combine; cross-entropy's loss rows (no gradient: the plan's path)
    "moe_route_sigmoid": (lambda: (torch.randn(9, 12).to(BF),),
                          lambda z: tkit.moe_route(z, 3, scoring="sigmoid")),
    "moe_combine": (lambda: (torch.randn(12, 64).to(BF), torch.rand(4, 3),
                             torch.randperm(12).view(4, 3)), tkit.moe_combine),
    "cross_entropy_rows": (lambda: (torch.randn(5, 300).to(BF), torch.tensor([1, -100, 299, 0, 7])),
                           lambda x, t: tkit.cross_entropy(x, t, reduction="none")),
    "merge_states_3d": (lambda: (torch.randn(5, 4, 64).to(BF), torch.randn(4, 5),
                                 torch.randn(5, 4, 64).to(BF), torch.randn(4, 5)),
                        tkit.merge_attention_states),
}


def _decode_inputs(paged=False, fp8=False):
    q = torch.randn(2, 1, 8, 64).to(BF)
    n = torch.tensor([300, 77], dtype=torch.int32)
    if not paged:
        return q, torch.randn(2, 320, 2, 64).to(BF), torch.randn(2, 320, 2, 64).to(BF), n
    dt = torch.float8_e4m3fn if fp8 else BF
    k, v = torch.randn(48, 16, 2, 64).to(dt), torch.randn(48, 16, 2, 64).to(dt)
    bt = torch.randperm(48).to(torch.int32).view(2, 24)
    ks, vs = (torch.rand(48, 16, 2), torch.rand(48, 16, 2)) if fp8 else (None, None)
    return q, k, v, n, bt, ks, vs


def _as_on_h200(call):
    """``call()`` with the path choices seeing 132 SMs (a CPU counts as one): softmax's split
    path, decode's split count (splits > 1 here)."""

    old, _device.sm_count = _device.sm_count, lambda device: 132
    try:
        return call()
    finally:
        _device.sm_count = old


_decode_on_h200 = _as_on_h200


@jit
@pytest.mark.parametrize("name", list(CASES))
def test_jit_plan_launches_what_the_ordinary_path_launches(jitplans, name):
    """The second call of a signature is served by its plan (no launch-layer work, one plan
    hit) and hands the launcher the kernel, grid, stream and arguments that the ordinary path
    hands it for the same inputs."""
    make, fn = CASES[name]
    _plan_vs_ordinary(jitplans, make, fn)


def _ordinary(rec, fn, inputs):
    """The same call on the ordinary path (plans off): its launches, named as :func:`_normal`
    names them, and its result."""
    _plan.ON = False
    try:
        ref = fn(*inputs)
    finally:
        _plan.refresh()
    return _normal(rec.take(), inputs, _outs(ref)), ref


#: cases with host TMA descriptors: the executor hands the kernel encoded maps where the
#: ordinary path hands Triton's launcher descriptor objects
#: (test_jit_cplan_int4_tc_encodes_its_descriptors)
_DESCRIPTOR_CASES = ("matmul_int4_tc",)


def _plan_vs_ordinary(made, make, fn, fresh=False):
    """``fresh``: the planned call takes new inputs of the first call's signature."""
    rec = _Recorder(made)
    with torch.no_grad():  # inference: the Parameter case must take the plan too
        inputs = make()
        fn(*inputs)  # miss: ordinary path, compiles (the stand-in), records the plan
        rec.take()
        if fresh:
            inputs = make()
        before = dict(_launch.stats)
        got = fn(*inputs)
        rec_raw = rec.take()
        planned = _normal(rec_raw, inputs, _outs(got))
        assert _launch.stats["plan"] == before["plan"] + 1
        assert (_launch.stats["fast"], _launch.stats["slow"]) == (before["fast"],
                                                                 before["slow"])
        ordinary, ref = _ordinary(rec, fn, inputs)
    assert planned and _same_launches(planned, ordinary), (planned, ordinary)
    # a plan hands the launcher data pointers, never tensors (no data_ptr() call and no
    # cuPointerGetAttribute in Triton's C launcher)
    assert not any(isinstance(v, torch.Tensor) for _, args in rec_raw for v in args)
    for g, r in zip(_outs(got), _outs(ref)):
        assert (g.shape, g.stride(), g.dtype, g.device) == (r.shape, r.stride(), r.dtype,
                                                            r.device)
    assert all(args[3] == 77 for _, args in planned)  # the stream of this call
    return ordinary  # the same launches, with the hidden tensors' shapes and dtypes


# ---- the C++ executor (tkit.kernels._cplan) ---------------------------------------------------
class _Md:
    num_ctas = 1
    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid = launch_pdl = False
    tensordesc_meta = None

    def __init__(self, warps, shared):
        self.num_warps, self.shared = warps, shared


@pytest.fixture
def cplans(jitplans, monkeypatch):
    """jitplans with the stand-in kernels dressed as Triton's compiled kernels (an int function
    handle, metadata, a signature taken from their first launch) and the C++ executor's
    launches recorded instead of reaching the driver."""
    from types import SimpleNamespace

    from tkit.kernels import _cplan
    from tkit.testing._standins import launch_signature

    mod = _cplan.module()
    if mod is None:
        pytest.skip(f"no C++ executor here: {_cplan.status()}")
    orig_record = _launch._record

    def record(item):
        if item is not None and not hasattr(item[0], "src"):
            ck, args = item[0], item[2]
            ck.function = 0x1000 + 16 * len(jitplans)
            ck.metadata = _Md(4 + len(jitplans) % 3, 64 * len(jitplans))
            sig, ck.metadata.tensordesc_meta = launch_signature(args)
            ck.src = SimpleNamespace(signature=sig)
            ck.consts = {i: v for i, v in enumerate(args)
                         if ck.src.signature[i] == "constexpr"}
        orig_record(item)

    monkeypatch.setattr(_launch, "_record", record)
    monkeypatch.setattr(_plan, "_cplan_test", True)
    launched = []
    mod.set_recorder(launched)
    yield jitplans, launched
    mod.set_recorder(None)


def _decode_cplan(made, launched):
    """The recorded C++ launches in the stand-in's form: (compiled, Triton launcher args), each
    argument decoded by the kernel's signature (constexprs, which are not passed, put back)."""
    import struct

    by_fn = {ck.function: ck for ck in made if hasattr(ck, "src")}
    out = []
    for fn, gx, gy, gz, threads, shared, stream, slots, tmas in launched:
        ck = by_fn[fn]
        assert (threads, shared) == (32 * ck.metadata.num_warps, ck.metadata.shared)
        assert slots[-2:] == (0, 0)  # no global or profile scratch
        vals, it = [], iter(slots[:-2])
        tmas = iter(tmas)
        for i, ty in ck.src.signature.items():
            if ty == "constexpr":
                vals.append(ck.consts[i])
                continue
            if ty.startswith("tensordesc"):
                # the map's slot, then the shape (i32 each) and strides (i64 each)
                rank = ty.count(",") + 1
                next(it)
                shape = [struct.unpack("<i", next(it).to_bytes(8, "little")[:4])[0]
                         for _ in range(rank)]
                strides = [struct.unpack("<q", next(it).to_bytes(8, "little"))[0]
                           for _ in range(rank)]
                vals.append(("tma", next(tmas), shape, strides))
                continue
            raw = next(it).to_bytes(8, "little")
            if ty.startswith("*"):
                p = int.from_bytes(raw, "little")
                vals.append(p)
            else:
                fmt = {"i1": "<b", "i32": "<i", "i64": "<q", "fp32": "<f"}[ty]
                v = struct.unpack(fmt, raw[:struct.calcsize(fmt)])[0]
                vals.append(bool(v) if ty == "i1" else v)
        assert next(it, None) is None and next(tmas, None) is None
        out.append((ck, (gx, gy, gz, stream, fn, None, None, None, None, *vals)))
    return out


def _f32(v):
    import struct

    return struct.unpack("<f", struct.pack("<f", v))[0] if type(v) is float else v


@jit
@pytest.mark.parametrize("name", [n for n in CASES if not n.startswith("attn_causal")
                                  and n not in _DESCRIPTOR_CASES])
def test_jit_cplan_launches_what_the_ordinary_path_launches(cplans, name):
    """A plan built for the C++ executor launches each kernel with the grid, block size, shared
    memory, stream and parameter values (pointers of this call's tensors, integers, float32
    scalars) that Triton's launcher gets on the ordinary path, and returns outputs of the
    ordinary path's shapes, strides and dtypes."""
    made, launched = cplans
    make, fn = CASES[name]
    rec = _Recorder(made)
    with torch.no_grad():
        inputs = make()
        fn(*inputs)  # miss: the ordinary path, recorded into a plan
        rec.take()
        inputs = make()  # new tensors of the same signature
        before = _launch.stats["plan"]
        launched.clear()
        got = fn(*inputs)
        assert not rec.take(), "the plan went through Triton's launcher"
        assert _launch.stats["plan"] == before + 1
        planned = _normal(_decode_cplan(made, launched), inputs, _outs(got))
        ordinary, ref = _ordinary(rec, fn, inputs)
    ordinary = [(ck, tuple(a[:4]) + (None,) * 5 + tuple(_f32(x) for x in a[9:]))
                for ck, a in ordinary]
    planned = [(ck, tuple(a[:4]) + (None,) * 5 + tuple(a[9:])) for ck, a in planned]
    assert planned and _same_launches(planned, ordinary), (planned, ordinary)
    for g, r in zip(_outs(got), _outs(ref)):
        assert (g.shape, g.stride(), g.dtype, g.device) == (r.shape, r.stride(), r.dtype,
                                                            r.device)


@jit
@pytest.mark.parametrize("block_n", [128, 192])
def test_jit_cplan_gluon_gemm_encodes_its_descriptors(cplans, monkeypatch, block_n):
    """The Gluon GEMM's plan runs in the C++ executor: each host descriptor becomes the
    cuTensorMapEncodeTiled call that Triton's launcher would make for it (the arguments of
    ``fill_tma_descriptor`` put in the driver's order: dimensions innermost first, strides in
    bytes), over this call's tensors (b described as its (N, K) storage), followed by the
    descriptor's shape and strides; nothing goes through Triton's launcher."""
    from tkit.kernels import matmul as mm
    from tkit.kernels.matmul import config as MC

    made, launched = cplans
    monkeypatch.setattr(mm, "_FAST", {})  # the eager calls' plans of earlier tests
    monkeypatch.setattr(mm, "plan", lambda *a, **k: MC.MatmulPlan(
        "gluon", "stand-in", MC.GluonConfig(block_n=block_n)))

    def make():
        return (torch.randn(256, 512).to(BF), torch.randn(320, 512).to(BF).t(),
                torch.randn(256, 320).to(BF))

    rec = _Recorder(made)
    with torch.no_grad():
        tkit.matmul(*make()[:2], residual=make()[2])  # the ordinary path, recorded
        rec.take()
        a, b, r = make()
        launched.clear()
        got = tkit.matmul(a, b, residual=r)
        assert not rec.take(), "the plan went through Triton's launcher"
        assert len(launched) == 1
        (ck, args), = _decode_cplan(made, launched)
        _plan.ON = False
        try:
            ref = tkit.matmul(a, b, residual=r)
        finally:
            _plan.refresh()
        (ck2, oargs), = rec.take()  # the ordinary call's launch, descriptors as they are
    assert ck2 is ck
    ptrs = {a.data_ptr(): "a", b.data_ptr(): "b", r.data_ptr(): "r", got.data_ptr(): "out"}
    names = _check_encoded_descriptors(monkeypatch, ck, args, oargs, ptrs,
                                       {**ptrs, ref.data_ptr(): "out"})
    assert names == (["a", "b", "b", "out", "out", "r", "r"] if block_n == 192
                     else ["a", "b", "out", "r"])


def _check_encoded_descriptors(monkeypatch, ck, args, oargs, ptrs, optrs):
    """Each encoded map of the executor's launch ``args`` against what Triton's launcher hands
    ``fill_tma_descriptor`` for the ordinary call's descriptor (``oargs``) in the same
    place; returns the names (``ptrs``) of the tensors the maps describe."""
    import inspect
    from types import SimpleNamespace

    from triton.backends.nvidia import driver as nvd

    filled = []
    fill = lambda *x: filled.append(x) or "map"  # noqa: E731
    fake = SimpleNamespace(fill_tma_descriptor=fill, fill_tma_descriptor_tiled=fill)
    monkeypatch.setattr(nvd, "triton", SimpleNamespace(runtime=SimpleNamespace(
        driver=SimpleNamespace(active=SimpleNamespace(utils=fake)))))
    descs = [v for v in oargs[9:] if hasattr(v, "block_shape")]
    metas = ck.metadata.tensordesc_meta
    extra = (None,) * (len(inspect.signature(nvd.make_tensordesc_arg).parameters) - 2)
    expanded = [nvd.make_tensordesc_arg(v, m, *extra) for v, m in zip(descs, metas)]
    tmas = [v for v in args[9:] if isinstance(v, tuple) and v[0] == "tma"]
    assert len(tmas) == len(descs) == len(filled) > 0
    for (_, t, shape, strides), (addr, swz, es, dtype, block, dshape, dstrides, pad), ex in zip(
            tmas, filled, expanded):
        slot, ptr, cdtype, dims, bstrides, box, cswz, fill, l2 = t
        assert ptrs[ptr] == optrs[addr]
        assert (cdtype, cswz, fill, l2) == (dtype, swz, pad, 2)  # L2 promotion 128B, Triton's
        assert list(dims) == list(reversed(dshape)) and list(box) == list(reversed(block))
        assert list(bstrides) == [es * s for s in reversed(dstrides[:-1])]
        assert [shape, strides] == [list(ex[1:1 + len(shape)]), list(ex[1 + len(shape):])]
    return [ptrs[t[1][1]] for t in tmas]


@jit
@pytest.mark.parametrize("zeros", [True, False])
def test_jit_cplan_int4_tc_encodes_its_descriptors(cplans, monkeypatch, zeros):
    """matmul_int4's tensor-core decode kernel (M = 5 on 132 SMs: K split, then the reduce)
    takes host descriptors of the packed weight, the scales and the zeros (the scales' again
    when symmetric): its plan runs in the C++ executor, which encodes each over this call's
    tensors as Triton's launcher would; the other launch's arguments are the ordinary path's."""
    made, launched = cplans
    make, fn = CASES["matmul_int4_tc"]
    if not zeros:
        fn = lambda a, q, s, z: _as_on_h200(lambda: tkit.matmul_int4(a, q, s))  # noqa: E731
    rec = _Recorder(made)
    with torch.no_grad():
        fn(*make())  # the ordinary path, recorded
        rec.take()
        a, q, s, z = make()
        launched.clear()
        got = fn(a, q, s, z)
        assert not rec.take(), "the plan went through Triton's launcher"
        cp = _decode_cplan(made, launched)
        _plan.ON = False
        try:
            ref = fn(a, q, s, z)
        finally:
            _plan.refresh()
        ordinary = rec.take()
    assert len(cp) == len(ordinary) == 2  # the split kernel (K split 4), the reduce
    (ck, args), (ck2, oargs) = cp[0], ordinary[0]
    assert ck2 is ck
    ptrs = {q.data_ptr(): "q", s.data_ptr(): "s", z.data_ptr(): "z"}
    names = _check_encoded_descriptors(monkeypatch, ck, args, oargs, ptrs, ptrs)
    assert names == ["q", "s", "z" if zeros else "s"]
    assert (got.shape, got.stride(), got.dtype) == (ref.shape, ref.stride(), ref.dtype)


@jit
def test_jit_cplan_steps_aside_for_launch_hooks(cplans):
    """A profiler's launch hook attached: the C++ plan returns None and Triton's path (which
    calls the hook) runs."""
    made, launched = cplans
    a, b = torch.randn(1, 4096).to(BF), torch.randn(1, 4096).to(BF)
    with torch.no_grad():
        tkit.add(a, b)
        tkit.add(a, b)
        assert launched
        enter = _launch.hook_lists()[0]
        launched.clear()
        slow = _launch.stats["slow"]
        enter.append(lambda *x: None)
        try:
            tkit.add(a, b)
        finally:
            enter.pop()
        assert not launched and _launch.stats["slow"] == slow + 1


@pytest.fixture
def hatch(cplans, monkeypatch):
    """cplans, with the CUDA INT4 launcher (tkit.cuda_ext) runnable here: stand-ins for the
    driver's launch and map encoding, the nvcc build, the SM count and torch's current stream
    (``stream[0]``, also the executor's); ``seen`` gets each launch the launcher makes itself,
    as (function, grid, block, args, shared)."""
    from types import SimpleNamespace

    from cupy_backends.cuda.api import driver

    from tkit.cuda_ext import _loader, gemm, gemm_int4

    stream = [77]
    monkeypatch.setattr(_launch, "_device_stream", lambda: (0, stream[0]))
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: SimpleNamespace(cuda_stream=stream[0]))
    monkeypatch.setattr(driver, "launchKernel", lambda *a: None)
    monkeypatch.setattr(driver, "funcSetAttribute", lambda *a: None)
    monkeypatch.setattr(gemm, "_libcuda", lambda: SimpleNamespace(
        cuTensorMapEncodeTiled=lambda *a: 0))
    monkeypatch.setattr(gemm, "_MAPS", {})
    monkeypatch.setattr(gemm_int4, "_WORKSPACE", {})
    monkeypatch.setattr(gemm_int4, "_num_sms", lambda dev: 132)
    monkeypatch.setattr(_loader, "nvcc_kernel", lambda *a, **k: 0x5000)
    seen = []
    real = _loader.launch

    def spy(func, grid, block, args, *, smem=0, stream=None):
        seen.append((func, grid, block, args, smem))
        real(func, grid, block, args, smem=smem, stream=stream)

    monkeypatch.setattr(_loader, "launch", spy)
    cache = _plan.new_cache()

    def slow(*x):
        return gemm_int4.matmul_int4_cuda(*x, 128, None, check=False)

    def op(a, q, s, z):  # as a public function serves its calls
        if _plan.plannable(False, a, q, s, z):
            return _plan.serve_fast(cache, (128,), (a, q, s, z), slow, (a, q, s, z))
        return slow(a, q, s, z)

    def make():
        return (torch.randn(16, 1024).to(BF),
                torch.randint(-2**31, 2**31 - 1, (128, 384), dtype=torch.int32),
                torch.randn(8, 384).to(BF), torch.randn(8, 384).to(BF))

    yield cplans[1], seen, stream, op, make


@jit
def test_jit_cplan_replays_a_cuda_hatch_launch(hatch):
    """An eager call of a CUDA-hatch kernel (the INT4 launcher: cuLaunchKernel through the
    loader, four tensor maps, a per-stream workspace) gets a C++ plan; for fresh tensors of the
    signature it launches what the launcher launches for them: function, grid, block, shared
    memory, this call's pointers, the integer arguments, each map encoded over this call's
    tensor from the launcher's own spec (its 256-byte L2 promotion, not Triton's), the
    stream's workspace by address."""
    import struct

    from tkit.cuda_ext import _loader

    launched, seen, stream, op, make = hatch
    with torch.no_grad():
        op(*make())  # recorded
        assert len(seen) == 1 and not launched
        a, q, s, z = make()
        seen.clear()
        got = op(a, q, s, z)
        assert not seen and len(launched) == 1, "the plan went through the launcher"
        _plan.ON = False
        try:
            ref = op(a, q, s, z)
        finally:
            _plan.refresh()
    (func, grid, block, args, smem), = seen
    fn, gx, gy, gz, threads, shared, st, slots, tmas = launched[0]
    assert (fn, (gx, gy, gz), threads, shared, st) == (func, (*grid, 1, 1), block[0], smem, 77)
    assert len(slots) == len(args)
    tmas = {t[0]: t for t in tmas}
    out_ptrs = {ref.data_ptr(): got.data_ptr()}
    kinds = []
    for i, v in enumerate(args):
        if isinstance(v, _loader.TensorMap):
            assert tmas.pop(i)[1:] == (v.ptr, *v.spec)
            assert v.spec[-1] == 3  # CU_TENSOR_MAP_L2_PROMOTION_L2_256B
            kinds.append("map")
        elif isinstance(v, torch.Tensor):
            assert slots[i] == out_ptrs.get(v.data_ptr(), v.data_ptr())
            kinds.append("out" if v is ref else "ptr")
        else:
            assert slots[i] == int.from_bytes(struct.pack("<q" if v.dtype.itemsize == 8 else "<i",
                                                          v.item()).ljust(8, b"\0"), "little")
            kinds.append("int")
    assert not tmas
    assert kinds == ["map"] * 4 + ["out", "int", "ptr", "ptr"] + ["int"] * 6
    assert [v.ptr for v in args[:4]] == [t.data_ptr() for t in (q, a, s, z)]
    assert (got.shape, got.stride(), got.dtype) == (ref.shape, ref.stride(), ref.dtype)


@jit
def test_jit_cplan_of_a_stream_workspace_serves_that_stream_only(hatch):
    """The plan of a launch with a stream's workspace (stream-K partials and counters, kept per
    stream) serves calls on that stream; on another stream it steps aside, and the launcher
    runs with that stream's own workspace."""
    launched, seen, stream, op, make = hatch
    with torch.no_grad():
        op(*make())
        op(*make())
        assert len(launched) == 1 and len(seen) == 1
        ws77 = [t.data_ptr() for t in seen[0][3][5:8] if isinstance(t, torch.Tensor)]
        stream[0] = 78
        op(*make())
        assert len(launched) == 1 and len(seen) == 2
        ws78 = [t.data_ptr() for t in seen[1][3][5:8] if isinstance(t, torch.Tensor)]
        stream[0] = 77
        op(*make())
        assert len(launched) == 2 and len(seen) == 2
    assert len(ws77) == len(ws78) == 2 and not set(ws77) & set(ws78)
    assert set(ws77) <= set(launched[1][7])


@jit
def test_jit_split_k_plan_allocates_its_partials(jitplans, monkeypatch):
    """The decode GEMM on an sm_90 with 132 SMs: split-K into float32 partials (scratch from
    ``_common.scratch``) and a reduce launch; the plan allocates the partials per call."""
    from tkit.kernels import matmul as mm

    monkeypatch.setattr(_device, "capability", lambda device=None: (9, 0))
    monkeypatch.setattr(_device, "sm_count", lambda device: 132)
    a, w = torch.randn(1, 4096).to(BF), torch.randn(4096, 4096).to(BF)
    assert mm.plan(a, w).path == "splitk" and mm.plan(a, w).config.split_k > 1
    planned = _plan_vs_ordinary(jitplans, lambda: (a, w), tkit.matmul)
    assert len(planned) == 2
    ws = [v for v in planned[0][1] if isinstance(v, tuple) and v[:2] == ("ptr", "hidden")]
    assert len(ws) == 1 and ws[0][4] == torch.float32


@jit
def test_jit_decode_plan_allocates_its_split_partials(jitplans):
    """decode_attention on 132 SMs: the split kernel writes float32 partials (scratch) that the
    combine launch reads; the plan allocates them per call. A new length is the same plan (the
    lengths are read on the device), a window or a longer cache another."""
    q, k, v, n = _decode_inputs()
    planned = _plan_vs_ordinary(jitplans, lambda: (q, k, v, n),
                                lambda *a: _decode_on_h200(lambda: tkit.decode_attention(*a)))
    assert len(planned) == 2
    hidden = [x for x in planned[0][1] if isinstance(x, tuple) and x[:2] == ("ptr", "hidden")]
    assert len(hidden) == 2 and all(h[4] == torch.float32 for h in hidden)
    with torch.no_grad():
        def built(fn, *args):
            m = _launch.stats["plan_built"]
            _decode_on_h200(lambda: fn(*args))
            return _launch.stats["plan_built"] - m

        assert built(tkit.decode_attention, q, k, v, n) == 0
        assert built(tkit.decode_attention, q, k, v,
                     torch.tensor([5, 320], dtype=torch.int32)) == 0
        assert built(lambda *a: tkit.decode_attention(*a, window_size=(64, -1)), q, k, v, n) == 1
        k2, v2 = torch.randn(2, 640, 2, 64).to(BF), torch.randn(2, 640, 2, 64).to(BF)
        assert built(tkit.decode_attention, q, k2, v2, n) == 1
        # the lengths' values are still checked per call where they are on the host
        with pytest.raises(ValueError, match="cache_seqlens"):
            tkit.decode_attention(q, k, v, torch.tensor([321, 1], dtype=torch.int32))
        for _ in range(2):
            tkit.append_kv(k[0, :3], v[0, :3], k, v, torch.tensor([0, 1, 2]))
        hits = _launch.stats["plan"]
        with pytest.raises(ValueError, match="slot_mapping"):
            tkit.append_kv(k[0, :3], v[0, :3], k, v, torch.tensor([0, 1, 9999]))
        assert _launch.stats["plan"] == hits


@jit
def test_jit_zeroed_scratch_is_zeroed_per_call(jitplans, monkeypatch):
    """decode_attention whose splits are merged by the last to finish (counters that must be
    zero at the launch): the plan allocates the counters per call with zeros, and launches
    the split kernel alone (no combine launch), as the ordinary path does."""
    import dataclasses

    from tkit.kernels.decode import config as DC

    orig = DC.DecodeConfig.for_device.__func__
    monkeypatch.setattr(DC.DecodeConfig, "for_device", classmethod(
        lambda cls, *a, **k: dataclasses.replace(orig(cls, *a, **k), combine="fused")))
    q, k, v, n = _decode_inputs()
    planned = _plan_vs_ordinary(jitplans, lambda: (q, k, v, n),
                                lambda *a: _decode_on_h200(lambda: tkit.decode_attention(*a)))
    assert len(planned) == 1  # the split kernel alone
    hidden = [x for x in planned[0][1] if isinstance(x, tuple) and x[:2] == ("ptr", "hidden")]
    # the partials, their lse, the unreturned lse and the counters
    assert sorted(str(h[4]) for h in hidden) == ["torch.float32"] * 3 + ["torch.int32"]


def test_plan_codegen_allocates_zeroed_scratch_with_zeros():
    """A plan's allocation marked -2 (a scratch tensor that starts at zero) is made by
    ``zeros`` in the generated Python plan and by ``at::zeros`` in the C++ executor (checked
    on memory the allocator hands back after garbage was written to it)."""
    calls = []

    def zeros(*a, **k):
        calls.append((a, k))
        return torch.zeros(*a, **k)

    make = _plan._codegen(1, 1, 0, (), (-2,))
    go = make(torch.empty, torch.empty_like, zeros, {"plan": 0}, ([], []), None,
              (64,), torch.int32, torch.device("cpu"))
    out = go(0, (torch.ones(3),))
    assert calls and calls[0][0] == ((64,),)
    assert torch.equal(out, torch.zeros(64, dtype=torch.int32))
    from tkit.kernels import _cplan

    mod = _cplan.module()
    if mod is None:
        pytest.skip(f"no C++ executor here: {_cplan.status()}")
    plan = mod.Plan([], [((64,), mod.scalar_type_code(torch.int32), -1, -2)], 1, 1, [], [],
                    {"plan": 0})
    for _ in range(3):
        garbage = torch.full((64,), 7, dtype=torch.int32)
        del garbage
        got = plan(0, (torch.ones(3),))
        got = got[0] if isinstance(got, tuple) else got
        assert torch.equal(got, torch.zeros(64, dtype=torch.int32))


@jit
def test_jit_gluon_attention_plan_rebuilds_its_descriptors(jitplans, monkeypatch):
    """The Gluon Hopper forward takes host TMA descriptors of q, k, v and out: its plan keeps
    their block shapes and layouts and rebuilds each over the call's tensors (the fresh output
    included), the same descriptors the ordinary path builds."""
    from tkit.kernels.attention import hopper as H
    from tkit.kernels.attention import ops as AO

    monkeypatch.setattr(AO, "_hopper_choice", lambda *a, **k: (H, None))
    monkeypatch.setattr(H, "supported", lambda *a, **k: None)

    def make():
        return (torch.randn(1, 200, 8, 64).to(BF), torch.randn(1, 200, 2, 64).to(BF),
                torch.randn(1, 200, 2, 64).to(BF))

    planned = _plan_vs_ordinary(jitplans, make,
                                lambda q, k, v: tkit.flash_attention(q, k, v, causal=True),
                                fresh=True)
    descs = [x for x in planned[0][1] if isinstance(x, tuple) and x[0] == "desc"]
    assert [d[1] for d in descs] == ["in0", "in1", "in2", "out0"]


@jit
def test_jit_what_triton_specializes_gets_another_plan(jitplans):
    """Alignment, strides, dtype, a size-1 dimension, an option: each a new plan (and where
    Triton specializes, a new compiled kernel); the same signature again: no new plan."""
    buf = _buf(2 * 4096 + 8)
    a = buf[:4096].view(1, 4096)
    b = _buf(4096).view(1, 4096)
    with torch.no_grad():
        def built(fn, *args):
            n = _launch.stats["plan_built"]
            fn(*args)
            return _launch.stats["plan_built"] - n

        assert built(tkit.add, a, b) == 1
        assert built(tkit.add, a, b) == 0
        assert built(tkit.add, buf[8:4104].view(1, 4096), b) == 0  # 16 bytes on: aligned
        made = len(jitplans)
        assert built(tkit.add, buf[1:4097].view(1, 4096), b) == 1  # 2 bytes on: unaligned
        assert len(jitplans) == made + 1  # ... and Triton compiles another binary
        assert built(tkit.add, a, buf[3:4099].view(1, 4096)) == 1
        assert built(tkit.add, a.float(), b) == 1  # dtype
        assert built(tkit.add, a.view(64, 64).t(), b.view(64, 64)) == 1  # strides
        assert built(tkit.add, a.view(64, 64), b.view(64, 64)) == 1  # shape
        assert built(tkit.sub, a, b) == 1  # the op
        assert built(lambda x, y: tkit.add(x, y, out_dtype=torch.float32), a, b) == 1
        x = _buf(4096).view(1, 4096)
        w = _buf(4096)
        assert built(tkit.rms_norm, x, w) == 1
        assert built(lambda x, w: tkit.rms_norm(x, w, 1e-5), x, w) == 1  # eps
        assert built(tkit.softmax, x) == 1
        assert built(lambda x: tkit.softmax(x, 0), x) == 1  # dim


@jit
def test_jit_an_unaligned_output_is_never_served_by_an_aligned_plan(jitplans, monkeypatch):
    """An allocator that returns a pointer off 16 bytes (a custom one could): the plan steps
    aside and the ordinary path launches a kernel compiled for it."""
    a, b = _buf(4096).view(1, 4096), _buf(4096).view(1, 4096)
    real_empty = torch.empty
    skew = [False]

    def empty(*shape, **kw):
        if not skew[0]:
            return real_empty(*shape, **kw)
        size = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        n = 1
        for s in size:
            n *= s
        return real_empty(n + 1, **kw)[1:].view(size)

    def empty_like(t, **kw):  # plans allocate an output shaped like an input this way
        return empty(tuple(t.shape), dtype=t.dtype, device=t.device)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
    with torch.no_grad():
        tkit.add(a, b)
        tkit.add(a, b)
        hits = _launch.stats["plan"]
        skew[0] = True
        made = len(jitplans)
        out = tkit.add(a, b)
    assert out.data_ptr() % 16 and _launch.stats["plan"] == hits
    assert len(jitplans) == made + 1  # a new compile for the unaligned output


@jit
def test_jit_the_ordinary_path_when_it_is_needed(jitplans):
    """Autograd, a profiler's launch hook, captures (tkit.ir), poisoned outputs, experiment
    overrides: no plan serves these calls."""
    from triton import knobs

    from tkit.kernels.reductions import overrides

    a, b = torch.randn(4, 64), torch.randn(4, 64)
    tkit.add(a, b)
    tkit.add(a, b)
    hits = _launch.stats["plan"]
    tkit.add(a, b)
    assert _launch.stats["plan"] == hits + 1
    hits += 1
    # autograd: the registered op, whose output carries a grad_fn
    ar = a.clone().requires_grad_()
    assert tkit.add(ar, b).grad_fn is not None
    with torch.no_grad():
        assert tkit.add(ar, b).grad_fn is None  # no grad needed: plans serve it
    assert _launch.stats["plan"] == hits + 1
    hits += 1
    # a launch hook (proton attaches this way): Triton's own launch, which calls it
    seen = []
    hook = lambda *args, **kw: seen.append(1)  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        tkit.add(a, b)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert _launch.stats["plan"] == hits and _launch.stats["slow"] > 0
    # capture and poisoning switch plans off in every thread while active
    with C.capture_launches() as launches:
        tkit.add(a, b)
    assert len(launches) == 1 and _plan.ON
    with C.poisoned_outputs():
        assert not _plan.ON
        tkit.add(a, b)
    assert _plan.ON and _launch.stats["plan"] == hits
    x = torch.randn(2, 300)
    tkit.softmax(x)
    tkit.softmax(x)
    hits = _launch.stats["plan"]
    with overrides(num_warps=8):
        tkit.softmax(x)
    assert _launch.stats["plan"] == hits
    tkit.softmax(x)
    assert _launch.stats["plan"] == hits + 1


@jit
def test_jit_validation_still_names_the_argument(jitplans):
    """With plans built for a signature, a bad call of the same op still fails in the ordinary
    path's checks (values equal to a planned key's but of another type included)."""
    a, b = torch.randn(4, 64), torch.randn(4, 64)
    x, w = torch.randn(2, 64), torch.randn(64)
    for _ in range(2):
        tkit.add(a, b)
        tkit.softmax(x, 1)
        tkit.rms_norm(x, w, 1.0)
    with pytest.raises(ValueError, match="a of shape .* and b of shape"):
        tkit.add(a, torch.randn(3, 64))
    with pytest.raises(TypeError, match="b has dtype int32"):
        tkit.add(a, b.int())
    with pytest.raises(TypeError, match="dim must be an int"):
        tkit.softmax(x, True)  # == 1, a planned key
    with pytest.raises(TypeError, match="dim must be an int"):
        tkit.softmax(x, 1.0)
    with pytest.raises(ValueError, match="eps must be"):
        tkit.rms_norm(x, w, True)  # == 1.0, a planned key
    with pytest.raises(ValueError, match="weight must have shape"):
        tkit.rms_norm(x, torch.randn(63))
    with pytest.raises(TypeError, match="out_dtype"):
        tkit.add(a, b, out_dtype=[torch.float32])  # unhashable: the ordinary path says so
    with pytest.raises(ValueError, match="approximate"):
        tkit.gelu_mul(a, b, approximate="fast")
    # host offsets of a planned grouped GEMM: their values are checked on every call
    xa, wb = torch.randn(10, 32), torch.randn(2, 32, 16)
    for _ in range(2):
        tkit.grouped_matmul(xa, wb, torch.tensor([0, 4, 10], dtype=torch.int32))
    hits = _launch.stats["plan"]
    with pytest.raises(ValueError, match="offsets"):
        tkit.grouped_matmul(xa, wb, torch.tensor([0, 11, 10], dtype=torch.int32))
    assert _launch.stats["plan"] == hits


@jit
def test_jit_meta_tensors_capture_through_the_launch_path(jitplans):
    """tkit.ir's capture of an op on meta tensors, with plans on and plans built for the same
    shapes on real tensors."""
    a, b = torch.randn(1, 4096).to(BF), torch.randn(1, 4096).to(BF)
    tkit.add(a, b)
    tkit.add(a, b)
    am, bm = a.to("meta"), b.to("meta")
    with C.capture_launches() as launches:
        out = tkit.add(am, bm)
    assert out.device.type == "meta" and len(launches) == 1
    assert launches[0].kwargs["a_ptr"] is am


@jit
def test_jit_plans_are_for_cuda_tensors(jitplans, monkeypatch):
    """Keys hold device indices (-1 for CPU and meta alike): outside the harness no plan is
    built for tensors that are not on a CUDA device."""
    monkeypatch.setattr(_plan, "CPU_OK", False)
    a, b = torch.randn(4, 64), torch.randn(4, 64)
    before = dict(_launch.stats)
    for _ in range(3):
        tkit.add(a, b)
    delta = {k: _launch.stats[k] - before[k] for k in ("plan", "plan_built", "plan_refused")}
    assert delta == {"plan": 0, "plan_built": 0, "plan_refused": 1}  # marked once


@jit
def test_jit_aliased_inputs_give_up_after_a_few_calls(jitplans):
    """``add(x, x)``: which input a launch argument stands for is ambiguous, so no plan; after
    TRANSIENT_LIMIT such calls the signature stops paying for the recording."""
    x = torch.randn(4, 64)
    before = dict(_launch.stats)
    for _ in range(_plan.TRANSIENT_LIMIT + 3):
        tkit.add(x, x)  # (the stand-in launcher computes nothing)
    delta = {k: _launch.stats[k] - before[k] for k in ("plan", "plan_miss", "plan_built")}
    assert delta == {"plan": 0, "plan_miss": _plan.TRANSIENT_LIMIT, "plan_built": 0}


@jit
def test_jit_outputs_written_by_torch_ops_get_no_plan(jitplans, monkeypatch):
    """An ordinary path that touches its output with a torch op (a memset before an atomic
    kernel, say), or returns an output no launch wrote: torch.empty plus the launches would
    not reproduce it, so the signature keeps the ordinary path."""
    from tkit.kernels import elementwise as ew

    launch = ew.ops._launch

    def zeroing(op, a, b, out, scale=None):
        out.zero_()
        return launch(op, a, b, out, scale)

    a, b = torch.randn(4, 64), torch.randn(4, 64)
    monkeypatch.setattr(ew.ops, "_launch", zeroing)
    before = dict(_launch.stats)
    for _ in range(3):
        tkit.add(a, b)
    monkeypatch.setattr(ew.ops, "_launch", launch)
    # an output made by torch alone, no launch at all
    monkeypatch.setattr(ew, "_binary_impl", lambda a, b, op, out_dtype: torch.sub(a, b))
    for _ in range(3):
        tkit.sub(a, b)
    delta = {k: _launch.stats[k] - before[k] for k in ("plan", "plan_built", "plan_refused")}
    assert delta == {"plan": 0, "plan_built": 0, "plan_refused": 2}


@jit
def test_jit_plans_under_inference_mode(jitplans):
    """Serving code runs under torch.inference_mode (outputs are inference tensors)."""
    a, b = torch.randn(4, 64), torch.randn(4, 64)
    with torch.inference_mode():
        before = dict(_launch.stats)
        for _ in range(3):
            out = tkit.add(a, b)
        assert out.is_inference()
    assert _launch.stats["plan"] - before["plan"] == 2
    assert _launch.stats["plan_built"] - before["plan_built"] == 1


@pytest.fixture
def cppops(jitplans):
    """The registered ops' C++ kernels (``_cplan.cpp``'s FastOp), registered at AutogradCPU
    and CPU here as they are at AutogradCUDA and CUDA on a GPU: they serve plans below the
    dispatcher."""
    if not _plan.register_ops("cpu"):
        from tkit.kernels import _cplan

        pytest.skip(f"no C++ executor here: {_cplan.status()}")
    assert _plan.unregistered == {}  # every plan op's schema is one the kernel takes
    yield
    _plan.unregister_ops("cpu")


@pytest.fixture(params=["python", "cpp"])
def opkernel(request, jitplans):
    """The registered ops' kernel at autograd: the Python one or the C++ one (True)."""
    if request.param == "cpp":
        request.getfixturevalue("cppops")
    return request.param == "cpp"


@jit
@pytest.mark.parametrize("name", list(OP_CASES))
def test_jit_registered_op_served_on_fresh_inputs(opkernel, jitplans, name):
    """``torch.ops.tkit.<op>`` as a compiled graph calls it: the first call of a signature
    misses and builds a plan, the next (new random inputs of that signature) is served by it
    with what the ordinary implementation launches for those inputs (so on a GPU the same
    values: tests/kernels/test_launch_gpu.py compares them); a call whose shape, dtype or
    strides differ misses, builds its own plan and is served the same way. With the C++
    kernel, the plan that the Python implementation recorded (keyed from the Python
    arguments) serves the next call below the dispatcher (keyed from the dispatcher's)."""
    (make, fn), other = OP_CASES[name]
    keys = ("plan", "plan_miss", "plan_built", "op_fast")
    want = {"plan": 1, "plan_miss": 1, "plan_built": 1, "op_fast": int(opkernel)}
    before = dict(_launch.stats)
    _plan_vs_ordinary(jitplans, make, fn, fresh=True)
    assert {k: _launch.stats[k] - before[k] for k in keys} == want
    before = dict(_launch.stats)
    _plan_vs_ordinary(jitplans, other, fn, fresh=True)
    assert {k: _launch.stats[k] - before[k] for k in keys} == want


class _Seen(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@jit
def test_jit_cpp_op_kernel_defers_to_python(cppops, jitplans):
    """The C++ kernels serve plain tensors without a gradient to record, plans on and no
    override in force, at the autograd key and below it (inference mode, the autograd path's
    forward, the call a dispatch mode makes); everything else goes where the Python kernels
    send it: the autograd path (outputs with a grad_fn), dispatch modes, fake and meta tensors,
    plans off, a config override."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tkit.kernels.reductions import config as RC

    x, w = torch.randn(2, 256), torch.randn(256)
    rms = lambda x, w: _ops.rms_norm(x, w, 1e-6, False)  # noqa: E731
    with torch.no_grad():
        for _ in range(2):
            rms(x, w)

    def served(call, n=2):
        before = dict(_launch.stats)
        for _ in range(n):
            out = call()
        return _launch.stats["op_fast"] - before["op_fast"], out

    with torch.no_grad():
        assert served(lambda: rms(x, w))[0] == 2
        assert served(lambda: rms(x, torch.nn.Parameter(w)))[0] == 2
        mode = _Seen()
        with mode:  # the mode sees the op; its call below the mode is served
            assert served(lambda: rms(x, w))[0] == 2
        assert mode.ops == ["tkit.rms_norm.default"] * 2
        with FakeTensorMode() as fm:
            n, (y, _) = served(lambda: rms(fm.from_tensor(x), fm.from_tensor(w)))
            assert n == 0 and type(y) is not torch.Tensor and y.shape == x.shape
        n, (y, _) = served(lambda: rms(x.to("meta"), w.to("meta")))
        assert n == 0 and y.device.type == "meta"
        with RC.overrides(num_warps=8):
            assert served(lambda: rms(x, w))[0] == 0
        assert served(lambda: rms(x, w))[0] == 2
        with _plan.off("test"):
            assert served(lambda: rms(x, w))[0] == 0
    with torch.inference_mode():  # below autograd: the backend key's kernel serves
        n, (y, _) = served(lambda: rms(x, w))
        assert n == 2 and y.is_inference()
    # autograd: the op's autograd.Function, its forward served below autograd
    xg = x.clone().requires_grad_()
    before = dict(_launch.stats)
    n, (y, _) = served(lambda: rms(xg, w))
    assert n == 2 and y.grad_fn is not None and _launch.stats["plan"] - before["plan"] == 2
    with torch.no_grad():  # no gradient needed: served
        assert served(lambda: rms(xg, w))[0] == 2
    # an implementation that raises: the same exception as through the Python kernel, on the
    # autograd path and below it
    for a in (x, xg):
        with pytest.raises(ValueError, match="do not broadcast"):
            _ops.binary(a, torch.randn(3), "add", None)


@jit
def test_jit_registered_ops_keyed_apart_from_eager_calls(jitplans):
    """The same tensors through the public function and through its registered op: two
    signatures (the op's implementation returns other outputs: rms_norm's stats), two plans."""
    x, w, r = torch.randn(2, 256), torch.randn(256), torch.randn(2, 256)
    a, b = torch.randn(4, 64), torch.randn(64, 32)
    q, k, v = torch.randn(1, 5, 4, 32), torch.randn(1, 9, 2, 32), torch.randn(1, 9, 2, 32)
    calls = [
        (lambda: tkit.rms_norm(x, w), lambda: _ops.rms_norm(x, w, 1e-6, False)),
        (lambda: tkit.rms_norm(x, w, residual=r),
         lambda: _ops.rms_norm_residual(x, r, w, 1e-6, False)),
        (lambda: tkit.log_softmax(x), lambda: _ops.softmax(x, 1, True)),
        (lambda: tkit.matmul(a, b), lambda: _ops.matmul(a, b, None, None, None, None, "", None,
                                                         True, "auto")),
        (lambda: tkit.flash_attention(q, k, v), lambda: _ops.flash_attn_fwd(
            q, k, v, None, None, 5, 9, False, 32 ** -0.5, -1, -1, 0.0)),
    ]
    with torch.no_grad():
        for eager, op in calls:
            before = dict(_launch.stats)
            for _ in range(2):
                eager()
                op()
            delta = {s: _launch.stats[s] - before[s] for s in ("plan", "plan_built")}
            assert delta == {"plan": 2, "plan_built": 2}


@jit
def test_jit_registered_ops_under_autograd(jitplans):
    """A training step's forward: the public function takes the registered op (autograd), whose
    implementation runs below autograd and is served by a plan from the second call; the
    outputs still carry their grad_fn."""
    x = torch.randn(4, 128, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(128))
    a, b = torch.randn(8, 128, requires_grad=True), torch.randn(128, 64)
    for fn in (lambda: tkit.rms_norm(x, w), lambda: tkit.softmax(x),
               lambda: tkit.matmul(a, b), lambda: tkit.rms_norm(x, w, residual=x * 2)[0]):
        before = dict(_launch.stats)
        outs = [fn() for _ in range(3)]
        assert all(o.grad_fn is not None for o in outs)
        delta = {k: _launch.stats[k] - before[k] for k in ("plan", "plan_built")}
        assert delta == {"plan": 2, "plan_built": 1}


@jit
def test_jit_plan_ops_defined_later_get_the_cpp_kernels(cppops):
    """An op made with ``plans=True`` after the kernels were registered gets them too (ops are
    defined as their family is first imported), and loses them with the others."""
    from tkit.kernels import _register as R

    @R.custom_op("tkit_test::plans_later", plans=True)
    def later(x: torch.Tensor, scale: float) -> torch.Tensor:
        return x * scale

    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert has("tkit_test::plans_later", "AutogradCPU") and has("tkit_test::plans_later", "CPU")
    x = torch.randn(3)
    torch.testing.assert_close(torch.ops.tkit_test.plans_later(x, 2.0), x * 2)  # no plan: Python
    _plan.unregister_ops("cpu")
    assert not has("tkit_test::plans_later", "AutogradCPU")
    torch.testing.assert_close(torch.ops.tkit_test.plans_later(x, 2.0), x * 2)
    with pytest.raises(ValueError, match="functional"):
        R.custom_op("tkit_test::mutating", mutates_args=("x",), plans=True)


class _Sub(torch.Tensor):
    pass


@jit
def test_jit_registered_ops_trace_without_plans(opkernel, jitplans):
    """Fake tensors (torch.compile's tracing), functional tensors and meta tensors never reach
    a plan; a graph traced with torch.compile(fullgraph) runs its ops from plans (below the
    dispatcher where the C++ kernel is registered)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w = torch.randn(2, 256), torch.randn(256)
    for _ in range(2):
        _ops.rms_norm(x, w, 1e-6, False)  # a plan for these real tensors' signature
    before = dict(_launch.stats)
    with FakeTensorMode() as mode:
        fx, fw = mode.from_tensor(x), mode.from_tensor(w)
        y, st = _ops.rms_norm(fx, fw, 1e-6, False)
        assert type(y) is not torch.Tensor and y.shape == x.shape and st.shape == (0, 2)
    y, _ = _ops.rms_norm(x.to("meta"), w.to("meta"), 1e-6, False)
    assert y.device.type == "meta"
    # serve_op itself sends anything but a plain tensor (or Parameter) down the ordinary path
    slow = lambda *a: "ordinary"  # noqa: E731
    op = tkit.kernels.reductions.ops._softmax_op
    with FakeTensorMode() as mode:
        assert _plan.serve_op(op, slow, (mode.from_tensor(x), 1, False)) == "ordinary"
    assert _plan.serve_op(op, slow, (x.as_subclass(_Sub), 1, False)) == "ordinary"
    assert {k: _launch.stats[k] - before[k] for k in ("plan", "plan_miss")} == {
        "plan": 0, "plan_miss": 0}

    def layer(x, w, r, b):
        h, res = tkit.rms_norm(x, w, residual=r)
        return tkit.silu_mul(*tkit.matmul(h, b).chunk(2, -1)), tkit.softmax(res)

    f = torch.compile(layer, fullgraph=True, backend="aot_eager")
    inputs = (torch.randn(3, 128), torch.randn(128), torch.randn(3, 128), torch.randn(128, 64))
    with torch.no_grad():
        f(*inputs)
        before = dict(_launch.stats)
        out, sm = f(*inputs)
    assert out.shape == (3, 32) and sm.shape == (3, 128)
    assert _launch.stats["plan"] - before["plan"] == 4  # rms_norm, matmul, act_mul, softmax
    assert _launch.stats["op_fast"] - before["op_fast"] == (4 if opkernel else 0)
    assert (_launch.stats["fast"], _launch.stats["slow"]) == (before["fast"], before["slow"])


@pytest.mark.skipif(JIT_CHILD, reason="the parent's test")
def test_direct_launch_only_where_the_wrapper_would_add_nothing():
    """Plans call the C launch under Triton 3.6's launcher wrapper only for launchers with no
    global or profile scratch and no cooperative or PDL launch (the wrapper's other work);
    another Triton's wrapper is always called."""
    import triton

    class Launcher:
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid = launch_pdl = False

        def launch(self, *args):
            return args

    on_36 = triton.__version__.startswith("3.6")
    assert (_plan._LAUNCHER_FORM == "3.6") == on_36
    plain = Launcher()
    assert (_plan._direct_launch(plain) is not None) == on_36
    for field in ("global_scratch_size", "profile_scratch_size", "launch_cooperative_grid",
                  "launch_pdl"):
        other = Launcher()
        setattr(other, field, 8 if "size" in field else True)
        assert _plan._direct_launch(other) is None, field


@jit
def test_jit_gluon_gemm_plan_rebuilds_its_descriptors(jitplans, monkeypatch):
    """The Gluon GEMM takes host TMA descriptors of a, of the K-major b described as its
    (N, K) storage (b.t()), of the output and of the residual: its plan rebuilds each over the
    call's tensors (a transposed view of an input included), the same descriptors as the
    ordinary path; the descriptors a call does not use are None."""
    from tkit.kernels import matmul as mm
    from tkit.kernels.matmul import config as MC

    cfg = MC.GluonConfig(block_n=192)  # two column parts: two descriptors of b, out, residual
    monkeypatch.setattr(mm, "plan", lambda *a, **k: MC.MatmulPlan("gluon", "stand-in", cfg))

    def make():
        return (torch.randn(256, 512).to(BF), torch.randn(320, 512).to(BF).t(),
                torch.randn(256, 320).to(BF))

    planned = _plan_vs_ordinary(jitplans, make,
                                lambda a, b, r: tkit.matmul(a, b, residual=r), fresh=True)
    descs = [x for x in planned[0][1] if isinstance(x, tuple) and x[0] == "desc"]
    assert [d[1] for d in descs] == ["in0", "in1", "in1", "out0", "out0", "in2", "in2"]
    assert descs[1][2:4] == ([320, 512], [512, 1])  # b as the (N, K) matrix it stores
    monkeypatch.setattr(mm, "plan", lambda *a, **k: MC.MatmulPlan(
        "gluon", "stand-in", MC.GluonConfig(block_n=128)))
    planned = _plan_vs_ordinary(jitplans, lambda: make()[:2],
                                lambda a, b: tkit.matmul(a, b), fresh=True)
    args = planned[0][1]
    assert [x[1] for x in args if isinstance(x, tuple) and x[0] == "desc"] == [
        "in0", "in1", "out0"]


@jit
@pytest.mark.parametrize("registered", [False, True])
def test_jit_gluon_glu_plan_rebuilds_its_descriptors(jitplans, monkeypatch, registered):
    """matmul_glu on the Gluon GEMM (eager and through ``torch.ops.tkit.matmul_glu``): one
    descriptor of a, one of b's (2N, K) storage (b.t(), read for the gate and the up rows),
    one of the (M, N) output, each rebuilt over the call's tensors by its plan."""
    from tkit.kernels.matmul import config as MC

    cfg = MC.GluonConfig(block_n=128)
    monkeypatch.setattr(MC, "glu_plan", lambda *a, **k: MC.MatmulPlan("gluon", "stand-in", cfg))

    def make():
        return torch.randn(256, 512).to(BF), torch.randn(320, 512).to(BF).t()

    fn = (lambda a, b: _ops.matmul_glu(a, b, None, "silu", None, True)) if registered \
        else tkit.matmul_glu
    planned = _plan_vs_ordinary(jitplans, make, fn, fresh=True)
    descs = [x for x in planned[0][1] if isinstance(x, tuple) and x[0] == "desc"]
    assert [d[1] for d in descs] == ["in0", "in1", "out0"]
    assert descs[1][2:4] == ([320, 512], [512, 1])  # b as the (2N, K) matrix it stores


@jit
@pytest.mark.parametrize("residual", [False, True])
def test_jit_registered_gluon_gemm_is_planned(jitplans, monkeypatch, residual):
    """``torch.ops.tkit.matmul`` (what a compiled graph calls) on the Gluon GEMM, with and
    without the residual: served by a plan on fresh inputs (its host descriptors rebuilt over
    them), so a compiled layer pays no more host time a call than an eager one."""
    from tkit.kernels.matmul import config as MC
    from tkit.kernels.matmul import ops as MO

    cfg = MC.GluonConfig(block_n=128)
    monkeypatch.setattr(MO, "plan", lambda *a, **k: MC.MatmulPlan("gluon", "stand-in", cfg))

    def make():
        x = (torch.randn(512, 256).to(BF), torch.randn(384, 256).to(BF).t())
        return x + (torch.randn(512, 384).to(BF),) if residual else x

    def fn(a, b, r=None):
        return _ops.matmul(a, b, None, r, None, None, "", None, True, "auto")

    before = dict(_launch.stats)
    planned = _plan_vs_ordinary(jitplans, make, fn, fresh=True)
    delta = {k: _launch.stats[k] - before[k] for k in ("plan", "plan_miss", "plan_built")}
    assert delta == {"plan": 1, "plan_miss": 1, "plan_built": 1}, delta
    descs = [x[1] for x in planned[0][1] if isinstance(x, tuple) and x[0] == "desc"]
    assert descs == ["in0", "in1", "out0"] + (["in2"] if residual else [])


def test_cplan_tma_spec_takes_plain_tiled_maps_only():
    """The executor encodes what Triton's launcher would for a plain tiled descriptor of the
    tensor's own type; anything else (tf32 rounding, im2col, fp4 padding) stays with Triton."""
    from tkit.kernels import _cplan

    meta = dict(swizzle=3, elem_size=2, elem_type=10, block_size=[64, 64], fp4_padded=False)
    value = (2, (256, 320), (320, 1), "zero", True)
    assert _cplan._tma_spec(meta, "desc", value, 5) == (
        5, 2, 9, (320, 256), (640,), (64, 64), 3, 0)
    assert _cplan._tma_spec(meta, "desc", value[:3] + ("nan", True), 5)[-1] == 1
    assert _cplan._tma_spec(meta, "desc", value[:4] + (False,), 5) is None
    assert _cplan._tma_spec({**meta, "is_im2col": True}, "desc", value, 5) is None
    assert _cplan._tma_spec({**meta, "fp4_padded": True}, "desc", value, 5) is None
    assert _cplan._tma_spec(meta, "const", value, 5) is None
