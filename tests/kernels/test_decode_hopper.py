"""The warp-specialized Gluon decode kernel for fp8 paged caches (``DecodeConfig(qk="ws_fp8")``):
its scope, its sm_90 build (ahead of time, no GPU), and on an H200 its outputs against the
float64 reference and the split kernel, garbage tables and lengths, and graph replays."""

import re

import pytest
import torch

import tkit
from tkit.kernels import decode as DA
from tkit.kernels.decode import hopper as DH
from tkit.specs import decode_attention as S
from tkit.testing import check_against_reference, make_tensor, poisoned_outputs

FP8 = torch.float8_e4m3fn
I32 = torch.int32
H200 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
SM_SHARED = 233472  # bytes of shared memory an SM on sm_90; 1 KB of it reserved a program


# ---- scope ------------------------------------------------------------------------------------
def _call(b=2, sq=1, hq=8, hk=2, d=128, page=64, pages=4, dtype=torch.bfloat16, cache=FP8):
    q = torch.zeros(b, sq, hq, d, dtype=dtype)
    k = torch.zeros(b * pages, page, hk, d, dtype=cache)
    table = torch.zeros(b, pages, dtype=I32)
    return q, k, table


@pytest.mark.parametrize("change, why", [
    (dict(cache=torch.bfloat16), "fp8 caches"),
    (dict(dtype=torch.float32), "16-bit queries"),
    (dict(d=64), "head dim 64"),
    (dict(sq=3), "12 packed rows"),
    (dict(page=32), "page size 32"),
])
def test_scope(monkeypatch, change, why):
    monkeypatch.setattr(DH, "device_reason", lambda device: None)
    q, k, table = _call(**change)
    assert why in DH.supported(q, k, k, table, None, None, -1, 0, 0.0, 1)
    q, k, table = _call()
    assert DH.supported(q, k, k, table, None, None, -1, 0, 0.0, 1) is None
    assert "paged" in DH.supported(q, k, k, None, None, None, -1, 0, 0.0, 1)
    assert "window" in DH.supported(q, k, k, table, None, None, 100, 0, 0.0, 1)
    assert "softcap" in DH.supported(q, k, k, table, None, None, -1, 0, 30.0, 1)
    assert "splits" in DH.supported(q, k, k, table, None, None, -1, 0, 0.0, 2)
    wide = torch.zeros(k.shape[0], 2 * k.shape[1], *k.shape[2:], dtype=k.dtype)[:, :k.shape[1]]
    assert "stride" in DH.supported(q, k, wide, table, None, None, -1, 0, 0.0, 1)
    qn, kn, tn = _call(sq=2, hq=8, hk=2)
    assert DH.supported(qn, kn, kn, tn, None, None, -1, 0, 0.0, 1) is None  # causal
    assert "window" in DH.supported(qn, kn, kn, tn, None, None, -1, -1, 0.0, 1)


def test_not_on_the_interpreter_or_cpu():
    q, k, table = _call()
    assert DH.supported(q, k, k, table, None, None, -1, 0, 0.0, 1) is not None


# ---- the sm_90 build ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def builds():
    from triton.tools.disasm import get_sass

    cache = {}

    def get(**kw):
        key = tuple(sorted(kw.items()))
        if key not in cache:
            k = DH.compile_sm90(**kw)
            cache[key] = (k, get_sass(k.asm["cubin"]))
        return cache[key]

    return get


@pytest.mark.parametrize("kw", [dict(), dict(page=128, q_dtype=torch.float16, scale_k=1),
                                dict(page=256, scale_k=0, scale_v=0), dict(per_warp=True),
                                dict(per_warp=True, page=128, scale_v=1),
                                dict(per_warp=True, early=False)])
def test_compiled_build(builds, kw):
    """The loader's loop issues the TMA copies (one a page for K and for V at page 64, one a
    tile above) and gives its registers to the consumer; the consumer's loop has the fp8
    wgmma and the mma.sync of P V and no load of the cache; no spills; two programs an SM
    (registers: 8 warps at the launch's cap; shared memory)."""
    k, sass = builds(**kw)
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3" in ptx
    assert "cp.async.bulk.tensor.2d" in ptx and "mma.sync.aligned.m16n8k16" in ptx
    assert re.search(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+48;", ptx)
    assert re.search(r"\.maxnreg\s+128", ptx) and re.search(r"\.reqntid\s+256", ptx)
    assert "QGMMA" in sass and "UTMALDG" in sass and "HMMA.16816" in sass
    assert not re.search(r"\b(LDL|STL)\b", sass)
    assert 2 * (k.metadata.shared + 1024) <= SM_SHARED
    # the consumer's loop bodies read the cache only from shared memory
    assert "ld.global" not in "".join(b for b in _loops(ptx) if "wgmma" in b)


def _loops(ptx):
    """Bodies of the innermost PTX loops (a label to the branch back to it)."""
    out = []
    for m in re.finditer(r"^(\$L__BB\d+_\d+):", ptx, re.M):
        back = re.search(rf"bra(?:\.uni)?\s+{re.escape(m.group(1))};", ptx[m.end():])
        if back:
            out.append(ptx[m.end():m.end() + back.start()])
    return out


# ---- H200 --------------------------------------------------------------------------------------
def _spy(monkeypatch):
    calls, launch = [], DH.launch

    def spy(*a, **kw):
        calls.append(a[1].shape)
        return launch(*a, **kw)

    monkeypatch.setattr(DH, "launch", spy)
    return calls


def _fp8_call(b, sq, hq, hk, page, per_seq, dtype, seed, scales=("token", "token"),
              extra_blocks=3):
    dev = "cuda"
    nb = b * per_seq + extra_blocks
    q = make_tensor((b, sq, hq, 128), dtype, seed=seed, device=dev)
    k = make_tensor((nb, page, hk, 128), torch.float32, seed=seed + 1, device=dev)
    v = make_tensor((nb, page, hk, 128), torch.float32, seed=seed + 2, device=dev)
    gen = torch.Generator().manual_seed(seed)
    table = S.paged_table(b, per_seq, nb, gen).to(dev)

    def scale(mode):
        if mode == "token":
            return ((torch.rand(k.shape[:-1], generator=gen) + 0.5) / 64).to(dev)
        return None if mode is None else torch.tensor(1 / 48, device=dev)

    ks, vs = scale(scales[0]), scale(scales[1])
    k8 = (k * 64).to(FP8) if scales[0] else k.to(FP8)
    v8 = (v * 64).to(FP8) if scales[1] else v.to(FP8)
    return q, k8, v8, table, ks, vs


#: (batch, queries, heads q / kv, page, pages a sequence, query dtype, scales of K / V, lengths)
GPU_CASES = [
    (32, 1, 32, 8, 64, 32, torch.bfloat16, ("token", "token"), [2048, 1000, 37, 1531] * 8),
    (6, 2, 16, 4, 128, 4, torch.float16, ("tensor", "token"), [0, 1, 127, 128, 129, 300]),
    (4, 1, 8, 1, 256, 4, torch.bfloat16, (None, None), [5, 256, 257, 1000]),
    (3, 1, 4, 4, 64, 3, torch.float16, ("token", "tensor"), [64, 65, 63]),
    (4, 4, 8, 4, 64, 4, torch.bfloat16, ("token", "token"), [3, 64, 200, 129]),
]


@pytest.mark.gpu
@pytest.mark.skipif(not H200, reason="sm_90's kernel")
@pytest.mark.parametrize("per_warp", [False, True, "late"])
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
def test_gpu_against_reference_and_split_kernel(monkeypatch, case, per_warp):
    """Each case against the float64 reference (poisoned outputs) and the split kernel's
    output on the same values: lengths 0, 1, around pages and tiles; pages 64 / 128 / 256 in
    shuffled order; GQA 4 and 8, MQA, one head a kv head; 1, 2 and 4 queries (causal within
    the last tile, the first row of length 3 seeing nothing); per-token, per-tensor and no
    scales."""
    b, sq, hq, hk, page, per_seq, dtype, scales, lens = GPU_CASES[case]
    q, k8, v8, table, ks, vs = _fp8_call(b, sq, hq, hk, page, per_seq, dtype, 300 + case,
                                         scales)
    lens = torch.tensor(lens, dtype=I32, device="cuda")
    kw = dict(block_table=table, k_scale=ks, v_scale=vs, return_lse=True)
    calls = _spy(monkeypatch)
    with DA.decode_config(qk="ws_fp8", per_warp=bool(per_warp),
                          early_scores=per_warp != "late"), poisoned_outputs():
        got, got_lse = check_against_reference(tkit.decode_attention, S.ref_decode_attention,
                                               [q, k8, v8, lens], kw)
    assert calls, "the warp-specialized kernel did not run"
    with DA.decode_config(qk="mma"):
        want, want_lse = tkit.decode_attention(q, k8, v8, lens, **kw)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=0)
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(got_lse))
    torch.testing.assert_close(got_lse[finite], want_lse[finite], atol=1e-2, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not H200, reason="sm_90's kernel")
@pytest.mark.parametrize("per_warp", [False, True, "late"])
def test_gpu_shared_pages_and_garbage_clamped(monkeypatch, per_warp):
    """Pages shared between sequences (prefix sharing), and a table and lengths with garbage
    (the registered op does not validate): block indices clamp to the cache, lengths to the
    table's capacity; caches inside NaN guards, so a read outside them poisons the output."""
    q, k8, v8, table, ks, vs = _fp8_call(4, 1, 16, 4, 64, 3, torch.bfloat16, 401)

    def guarded(x, guard=4096):
        buf = torch.full((x.numel() + 2 * guard,), float("nan"), device=x.device).to(x.dtype)
        buf[guard:guard + x.numel()] = x.reshape(-1)
        return buf[guard:guard + x.numel()].view(x.shape)

    k8, v8 = guarded(k8), guarded(v8)
    nb = k8.shape[0]
    bad = table.clone()
    bad[1] = table[0]  # sequence 1 shares sequence 0's pages
    bad[2, 1] = 10**9
    bad[3] = torch.tensor([nb, -1, 2**31 - 1], dtype=I32)
    lens = torch.tensor([150, 10**6, 129, -5], dtype=I32, device="cuda")
    calls = _spy(monkeypatch)
    with DA.decode_config(qk="ws_fp8", per_warp=bool(per_warp),
                          early_scores=per_warp != "late"), poisoned_outputs():
        out, lse = torch.ops.tkit.decode_attention(q, k8, v8, lens, bad, ks, vs,
                                                   128 ** -0.5, -1, 0, 0.0, 1)
    assert calls
    ref, ref_lse = S.ref_decode_attention(
        q.double(), k8, v8, lens.clamp(0, 3 * 64), block_table=bad.clamp(0, nb - 1),
        k_scale=ks, v_scale=vs, return_lse=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=0)
    assert torch.all(torch.isneginf(lse[3]))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=1e-2, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not H200, reason="sm_90's kernel")
def test_gpu_cuda_graph_replay(monkeypatch):
    """Captured once, replayed with new lengths and block tables: equal to eager calls."""
    q, k8, v8, table, ks, vs = _fp8_call(4, 1, 32, 8, 64, 16, torch.bfloat16, 501)
    lens = torch.tensor([1024, 1, 300, 17], dtype=I32, device="cuda")
    kw = dict(block_table=table, k_scale=ks, v_scale=vs)
    calls = _spy(monkeypatch)
    with DA.decode_config(qk="ws_fp8"):
        tkit.decode_attention(q, k8, v8, lens, **kw)  # compile outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = tkit.decode_attention(q, k8, v8, lens, **kw)
        gen = torch.Generator().manual_seed(5)
        for _ in range(3):
            lens.copy_(torch.randint(0, 1025, (4,), generator=gen).to(I32))
            table.copy_(S.paged_table(4, 16, k8.shape[0], gen))
            g.replay()
            eager = tkit.decode_attention(q, k8, v8, lens, **kw)
            assert torch.equal(out, eager)
    assert calls
