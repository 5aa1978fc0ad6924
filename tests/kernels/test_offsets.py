"""Index tensors (grouped_matmul's offsets, varlen attention's cu_seqlens): validation, and
memory safety whatever values reach the kernels.

Validation runs in the public functions (always for host tensors, so always in the
interpreter; on the device under TKIT_CHECK=1). The registered ops (``torch.ops.tkit.*``) do not
validate, so calling them is how these tests hand adversarial values to the kernels: the result
must then follow the documented clamping (segment j is [bound(j), bound(j+1)) with bound the
running maximum of the offsets clamped to [0, total], cut to max_seqlen for attention; rows in
no segment are zeros, lse -inf) and nothing outside the tensors may be touched. The guard tests
put every input and output inside a larger buffer filled with a sentinel and check the sentinel
afterwards; they run in a child process, because an out-of-bounds access can also crash the
process (as it did: "malloc(): unaligned tcache chunk detected").
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tkit
import tkit.kernels.attention  # noqa: F401  (registers torch.ops.tkit.flash_attn_*)
import tkit.kernels.matmul  # noqa: F401  (registers torch.ops.tkit.grouped_matmul*)

I32 = torch.int32


def _dev():
    return "cuda" if torch.cuda.is_available() else "cpu"


# ---- validation: a clear ValueError naming the argument and the first bad entry -------------
@pytest.mark.parametrize("offsets, match", [
    ([0, 3, 5, 40], r"offsets\[3\] = 40 is outside \[0, a.shape\[0\] = 10\]"),
    ([0, -3, 12, 10], r"offsets\[1\] = -3 is outside"),
    ([0, 8, 3, 10], r"offsets\[2\] = 3 is smaller than offsets\[1\] = 8"),
    ([0, 3, 5, 8], r"offsets\[3\] = 8 but a.shape\[0\] = 10"),
    ([2, 3, 5, 10], r"offsets\[0\] = 2: the first offset must be 0"),
])
def test_grouped_matmul_rejects_bad_offsets(offsets, match):
    a = torch.randn(10, 16, device=_dev())
    b = torch.randn(3, 16, 8, device=_dev())
    # host offsets are always checked; device ones only under TKIT_CHECK=1 (test below)
    if _dev() == "cuda":
        pytest.skip("offsets on the GPU are checked only under TKIT_CHECK=1 (tested below)")
    with pytest.raises(ValueError, match=match):
        tkit.grouped_matmul(a, b, torch.tensor(offsets, dtype=I32))


@pytest.mark.parametrize("cu, max_seqlen, match", [
    ([0, 5, 20], 15, r"cu_seqlens_q\[2\] = 20 is outside \[0, q.shape\[0\] = 12\]"),
    ([0, -3, 12], 15, r"cu_seqlens_q\[1\] = -3 is outside"),
    ([0, 8, 5, 12], 15, r"cu_seqlens_q\[2\] = 5 is smaller than cu_seqlens_q\[1\] = 8"),
    ([0, 5, 10], 15, r"cu_seqlens_q\[2\] = 10 but q.shape\[0\] = 12"),
    ([1, 5, 12], 15, r"cu_seqlens_q\[0\] = 1: the first offset must be 0"),
    ([0, 5, 12], 6, r"cu_seqlens_q\[2\] - cu_seqlens_q\[1\] = 7 tokens, more than "
                    r"max_seqlen_q = 6"),
])
def test_varlen_rejects_bad_cu_seqlens(cu, max_seqlen, match):
    if _dev() == "cuda":
        pytest.skip("cu_seqlens on the GPU are checked only under TKIT_CHECK=1 (tested below)")
    q = torch.randn(12, 2, 16)
    bad = torch.tensor(cu, dtype=I32)
    ok = torch.tensor([0] * (len(cu) - 1) + [12], dtype=I32)
    with pytest.raises(ValueError, match=match):
        tkit.flash_attention_varlen(q, q, q, bad, ok, max_seqlen, 12)
    # the same checks for the keys, naming cu_seqlens_k
    with pytest.raises(ValueError, match=match.replace("_q", "_k").replace(r"q.shape", r"k.shape")):
        tkit.flash_attention_varlen(q, q, q, ok, bad, 12, max_seqlen)


def test_offsets_length_dtype_device_checked():
    a = torch.randn(10, 16, device=_dev())
    b = torch.randn(3, 16, 8, device=_dev())
    with pytest.raises(ValueError, match="offsets must have G \\+ 1 = 4 entries"):
        tkit.grouped_matmul(a, b, torch.tensor([0, 10], dtype=I32, device=_dev()))
    with pytest.raises(TypeError, match="offsets has dtype float32"):
        tkit.grouped_matmul(a, b, torch.tensor([0., 1, 2, 10], device=_dev()))
    q = torch.randn(12, 2, 16, device=_dev())
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k must have the same"):
        tkit.flash_attention_varlen(q, q, q, torch.tensor([0, 12], dtype=I32, device=_dev()),
                                    torch.tensor([0, 6, 12], dtype=I32, device=_dev()), 12, 12)


# ---- what invalid values give when they reach the kernels -----------------------------------
def _bounds(offsets, total):
    out, hi = [], 0
    for v in offsets:
        hi = max(hi, min(max(int(v), 0), total))
        out.append(hi)
    return out


def _grouped_clamped_ref(a, b, offsets):
    bd = _bounds(offsets, a.shape[0])
    out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64)
    for g in range(b.shape[0]):
        out[bd[g]:bd[g + 1]] = a[bd[g]:bd[g + 1]].double() @ b[g].double()
    return out


GROUPED_BAD = [[0, 3, 5, 40], [0, -3, 12, 10], [0, 8, 3, 10], [0, 3, 5, 8], [4, 6, 8, 10],
               [0, 2**40, -(2**40), 10]]


@pytest.mark.parametrize("offsets", GROUPED_BAD)
def test_grouped_matmul_clamps_offsets(offsets, device):
    """Forward, input gradient and weight gradient follow the documented clamping; rows in no
    group are zeros (never left unwritten)."""
    dtype = torch.int64 if max(map(abs, offsets)) >= 2**31 else I32
    g = torch.Generator().manual_seed(0)
    a = torch.randn(10, 16, generator=g).to(device)
    b = torch.randn(3, 16, 8, generator=g).to(device)
    dout = torch.randn(10, 8, generator=g).to(device)
    off = torch.tensor(offsets, dtype=dtype, device=device)
    with tkit.testing.poisoned_outputs():
        out = torch.ops.tkit.grouped_matmul(a, b, off, None)
        da = torch.ops.tkit.grouped_matmul(dout, b.transpose(1, 2), off, None)
        db = torch.ops.tkit.grouped_matmul_wgrad(a, dout, off, 3, torch.float32)
    tol = dict(atol=1e-4, rtol=1e-4) if device == "cpu" else dict(atol=2e-2, rtol=2e-2)  # tf32
    torch.testing.assert_close(out.cpu().double(), _grouped_clamped_ref(a.cpu(), b.cpu(), offsets),
                               **tol)
    torch.testing.assert_close(da.cpu().double(), _grouped_clamped_ref(
        dout.cpu(), b.cpu().transpose(1, 2), offsets), **tol)
    bd = _bounds(offsets, 10)
    db_ref = torch.stack([a.cpu()[bd[j]:bd[j + 1]].double().T @ dout.cpu()[bd[j]:bd[j + 1]].double()
                          for j in range(3)])
    torch.testing.assert_close(db.cpu().double(), db_ref, **tol)


@pytest.mark.parametrize("b_layout", ["linear stack", "row-major"])
@pytest.mark.parametrize("offsets", GROUPED_BAD)
def test_grouped_tma_kernel_clamps_offsets(offsets, b_layout, device):
    """The persistent TMA grouped kernel (sm_90's default for 16-bit operands) follows the
    same clamping: its row tiles are counted from the clamped bounds, and rows in no group
    are zeros."""
    from tkit.kernels.matmul import GroupedTmaConfig
    from tkit.kernels.matmul.ops import _grouped_impl

    dtype = torch.int64 if max(map(abs, offsets)) >= 2**31 else I32
    g = torch.Generator().manual_seed(0)
    a = torch.randn(10, 64, generator=g).bfloat16()  # K: whole BLOCK_Ks (CPU 32, GPU 64)
    b = torch.randn(3, 64, 8, generator=g).bfloat16()
    bd = b.to(device) if b_layout == "row-major" else \
        b.transpose(1, 2).contiguous().transpose(1, 2).to(device)
    off = torch.tensor(offsets, dtype=dtype, device=device)
    with tkit.testing.poisoned_outputs():
        out = _grouped_impl(a.to(device), bd, off, config=GroupedTmaConfig.for_shape(10, 8, 3))
    torch.testing.assert_close(out.cpu().double(), _grouped_clamped_ref(a, b, offsets),
                               atol=3e-2, rtol=1e-2)


def _varlen_clamped_ref(q, k, v, cu_q, cu_k, max_q, max_k, causal):
    """float64 attention over the clamped sequences, differentiable; (out, lse)."""
    from tkit.specs.attention import ref_attention

    bq, bk = _bounds(cu_q, q.shape[0]), _bounds(cu_k, k.shape[0])
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64)
    for j in range(len(cu_q) - 1):
        q0, q1 = bq[j], min(bq[j + 1], bq[j] + max_q)
        k0, k1 = bk[j], min(bk[j + 1], bk[j] + max_k)
        if q1 == q0:
            continue
        o, l_ = ref_attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=causal,
                              return_lse=True)
        out = torch.cat([out[:q0], o[0], out[q1:]])
        lse = torch.cat([lse[:, :q0], l_[0], lse[:, q1:]], 1)
    return out, lse


VARLEN_BAD = [([0, 5, 20], [0, 5, 20], 15, 15), ([0, -3, 12], [0, -3, 12], 15, 15),
              ([0, 8, 5, 12], [0, 2, 9, 12], 12, 12), ([0, 5, 10], [0, 5, 10], 12, 12),
              ([2, 5, 12], [0, 6, 12], 12, 12), ([0, 5, 12], [0, 7, 12], 4, 3)]


@pytest.mark.parametrize("cu_q, cu_k, max_q, max_k", VARLEN_BAD)
def test_varlen_clamps_cu_seqlens(cu_q, cu_k, max_q, max_k, device):
    """Forward (out, lse) and backward (dq, dk, dv) follow the documented clamping; tokens in
    no sequence get zeros (lse -inf), never unwritten memory."""
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(12, 2, 16, generator=g) for _ in range(4))
    args = [torch.tensor(cu_q, dtype=I32, device=device),
            torch.tensor(cu_k, dtype=I32, device=device), max_q, max_k, True, 0.25, -1, -1, 0.0]
    qd, kd, vd, dd = (t.to(device) for t in (q, k, v, dout))
    with tkit.testing.poisoned_outputs():
        out, lse = torch.ops.tkit.flash_attn_fwd(qd, kd, vd, *args)
        dq, dk, dv = torch.ops.tkit.flash_attn_bwd(dd, qd, kd, vd, out, lse, None, *args)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = _varlen_clamped_ref(q64, k64, v64, cu_q, cu_k, max_q, max_k, True)
    grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double(), allow_unused=True)
    grads = [gr if gr is not None else torch.zeros_like(t) for gr, t in zip(grads, (q, k, v))]
    torch.testing.assert_close(out.cpu().double(), ref.detach(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse.cpu().double(), ref_lse.detach(), atol=1e-4, rtol=1e-4)
    for got, want in zip((dq, dk, dv), grads):
        torch.testing.assert_close(got.cpu().double(), want, atol=2e-4, rtol=2e-4)


# ---- nothing outside the tensors is touched (child process: a stray access may crash) -------
_GUARD_CHILD = r"""
import sys, torch
import tkit
import tkit.kernels.attention, tkit.kernels.matmul
from tkit.kernels import _common

dev = "cuda" if torch.cuda.is_available() else "cpu"
SENT = 1234.0  # exact in every dtype used here
PAD = 4096  # elements of guard on each side of every tensor
guards = []


def guarded(shape, dtype, fill=None):
    n = 1
    for s in shape:
        n *= s
    buf = torch.full((n + 2 * PAD,), SENT, dtype=torch.float64).to(dtype).to(dev)
    t = buf[PAD:PAD + n].view(shape)
    if fill is not None:
        t.copy_(fill)
    guards.append((buf, n))
    return t


def empty(shape, dtype, device):  # every output tkit allocates, inside a guard
    return guarded(tuple(shape), dtype, torch.full(tuple(shape), float("nan")))


_common.empty = empty
case = sys.argv[1]
for arg in sys.argv[2:]:  # one set of offsets an argument, each with fresh tensors and guards
    values = [int(x) for x in arg.split(",")]
    print(f"offsets {values}:", end=" ", flush=True)  # the last one named if the process dies
    guards.clear()
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g)
    if case == "grouped":
        a = guarded((10, 16), torch.float32, rnd(10, 16))
        dout = guarded((10, 8), torch.float32, rnd(10, 8))
        b = guarded((3, 16, 8), torch.float32, rnd(3, 16, 8))
        off = guarded((4,), torch.int64, torch.tensor(values))
        outs = [torch.ops.tkit.grouped_matmul(a, b, off, None),
                torch.ops.tkit.grouped_matmul(dout, b.transpose(1, 2), off, None),
                torch.ops.tkit.grouped_matmul_wgrad(a, dout, off, 3, torch.float32)]
    else:
        q, k, v, do = (guarded((12, 2, 16), torch.float32, rnd(12, 2, 16)) for _ in range(4))
        cu = guarded((len(values),), torch.int32, torch.tensor(values))
        args = [cu, cu, 8, 8, True, 0.25, -1, -1, 0.0]
        out, lse = torch.ops.tkit.flash_attn_fwd(q, k, v, *args)
        outs = [out, lse, *torch.ops.tkit.flash_attn_bwd(do, q, k, v, out, lse, None, *args)]
    if dev == "cuda":
        torch.cuda.synchronize()
    for i, (buf, n) in enumerate(guards):
        cpu = buf.double().cpu()
        for side in (cpu[:PAD], cpu[PAD + n:]):
            if not bool((side == SENT).all()):
                print(f"guard {i} of {len(guards)} overwritten"); sys.exit(3)
    for i, o in enumerate(outs):
        o = o.double().cpu()
        if bool(o.isnan().any()) or bool((o == float("inf")).any()):
            print(f"output {i} has NaN or +inf: unwritten or read out of bounds"); sys.exit(4)
    print("OK", flush=True)
"""

GUARD_CASES = {
    "grouped": [[0, 3, 5, 40], [0, -3, 12, 10], [0, 8, 3, 10], [0, 3, 5, 8], [0, 2**40, 5, 10],
                [-(2**40), 0, 5, 9]],
    "varlen": [[0, 5, 20], [0, -3, 12], [0, 8, 5, 12], [0, 5, 10], [0, 2**31 - 1, 12],
               [-(2**31), 12]],
}


@pytest.mark.parametrize("case", list(GUARD_CASES))
def test_adversarial_offsets_stay_inside_tensors(case):
    """Every set of offsets of the case in one child (a torch import, not one a set): each with
    fresh guarded tensors, checked before the next; a crash names the set that was running."""
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    sets = GUARD_CASES[case]
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(_GUARD_CHILD), case,
                        *(",".join(map(str, values)) for values in sets)], env=env,
                       capture_output=True, text=True, timeout=600)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and len(lines) == len(sets) and all(
        line.endswith("OK") for line in lines), (
        f"{case}: exit {r.returncode}\n{r.stdout[-2000:]}{r.stderr[-3000:]}")


# ---- TKIT_CHECK=1 on the GPU: device offsets read and checked -------------------------------
@pytest.mark.gpu
def test_tkit_check_validates_device_offsets():
    code = textwrap.dedent(r"""
        import torch, tkit
        a, b = torch.randn(10, 16, device="cuda"), torch.randn(3, 16, 8, device="cuda")
        off = torch.tensor([0, 3, 5, 40], dtype=torch.int32, device="cuda")
        try:
            tkit.grouped_matmul(a, b, off)
        except ValueError as e:
            assert "offsets[3] = 40" in str(e), e
        else:
            raise SystemExit("no ValueError under TKIT_CHECK=1")
        q = torch.randn(12, 2, 16, device="cuda")
        cu = torch.tensor([0, -3, 12], dtype=torch.int32, device="cuda")
        try:
            tkit.flash_attention_varlen(q, q, q, cu, cu, 12, 12)
        except ValueError as e:
            assert "cu_seqlens_q[1] = -3" in str(e), e
        else:
            raise SystemExit("no ValueError under TKIT_CHECK=1")
        print("OK")
    """)
    env = dict(os.environ, TKIT_CHECK="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


@pytest.mark.gpu
def test_unchecked_device_offsets_give_clamped_result():
    """Without TKIT_CHECK the public function does not sync to read device offsets: invalid
    ones give the documented clamped result."""
    a, b = torch.randn(10, 16, device="cuda"), torch.randn(3, 16, 8, device="cuda")
    offsets = [0, 3, 5, 40]
    with tkit.testing.poisoned_outputs():
        out = tkit.grouped_matmul(a, b, torch.tensor(offsets, dtype=I32, device="cuda"))
    torch.testing.assert_close(out.cpu().double(), _grouped_clamped_ref(a.cpu(), b.cpu(), offsets),
                               atol=2e-2, rtol=2e-2)


def test_sequence_past_32_bit_offsets_is_refused(device):
    """Offsets inside one sequence are 32-bit in the attention kernels: a sequence whose
    elements (here those of the output, laid out like q) span 2**31 is refused before the
    launch instead of wrapping around. (An expanded tensor: no memory behind it.)"""
    n = 600_000  # x 32 heads x 128 = 2.46e9 elements
    q = torch.zeros(1, 1, 1, device=device).expand(n, 32, 128)
    cu = torch.tensor([0, n], dtype=I32, device=device)
    with pytest.raises(ValueError, match="q: one sequence of 600000 tokens spans"):
        tkit.flash_attention_varlen(q, q, q, cu, cu, n, n)
    with pytest.raises(ValueError, match="q: one sequence of 600000 tokens spans"):
        tkit.flash_attention(q[None], q[None], q[None])
