"""The FlashAttention-3-style CUDA forward (csrc/attn_fwd_sm90.cu): against a float64
reference under the reference rule on an sm_90 GPU (its builds, edge lengths, GQA, causal
with rows that see no key, packed qkv views), its argument errors on any machine, and its
build's resources without a GPU."""

from __future__ import annotations

import pytest
import torch

from tkit.cuda_ext import _loader
from tkit.cuda_ext import attention as CA
from tkit.specs import attention as S
from tkit.testing import check_against_reference, make_tensor

sm90 = pytest.mark.skipif(not torch.cuda.is_available()
                          or torch.cuda.get_device_capability() != (9, 0),
                          reason="sm_90a kernel: needs an sm_90 GPU")
needs_nvcc = pytest.mark.skipif(_loader.nvcc_path() is None
                                or _loader.cuda_binutil("cuobjdump") is None,
                                reason="nvcc and cuobjdump: the build and its SASS")


def _run(**build):
    def fn(q, k, v, causal=False, return_lse=True):
        return CA.flash_attention_sm90(q, k, v, causal=causal, **build)
    return fn


def _qkv(b, sq, sk, hq, hk, d, dtype, seed=0):
    return [make_tensor((b, n, h, d), dtype, seed=seed + i, device="cuda")
            for i, (n, h) in enumerate(((sq, hq), (sk, hk), (sk, hk)))]


SHAPES = [  # b, sq, sk, hq, hk
    (2, 300, 300, 4, 2),  # a ragged last tile of queries and of keys
    (1, 129, 257, 2, 1),  # tile + 1 queries over two key tiles + 1; MQA
    (1, 1, 1, 1, 1),
    (1, 128, 128, 2, 2),  # exactly one tile
    (1, 700, 900, 8, 2),  # more key blocks than ring slots, queries shorter than keys
]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", CA.HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_against_reference(shape, causal, d, dtype):
    b, sq, sk, hq, hk = shape
    check_against_reference(_run(), S.ref_attention, _qkv(b, sq, sk, hq, hk, d, dtype),
                            dict(causal=causal, return_lse=True))


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("build", [dict(intra_overlap=False), dict(stages=3),
                                   dict(stages=1), dict(pingpong=True),
                                   # persistent grids: each CTA takes several tiles
                                   dict(ctas=3), dict(ctas=2, pingpong=True),
                                   dict(ctas=5, intra_overlap=False)])
@pytest.mark.parametrize("causal", [False, True])
def test_other_builds(build, causal):
    check_against_reference(_run(**build), S.ref_attention,
                            _qkv(1, 600, 600, 4, 4, 128, torch.bfloat16, seed=7),
                            dict(causal=causal, return_lse=True))


@pytest.mark.gpu
@sm90
def test_rows_without_keys_and_no_keys():
    # causal with seq_q > seq_k: the first seq_q - seq_k rows see no key (0 and -inf)
    q, k, v = _qkv(1, 200, 70, 2, 2, 64, torch.float16, seed=3)
    out, lse = CA.flash_attention_sm90(q, k, v, causal=True)
    assert torch.all(out[:, :130] == 0) and torch.all(lse[:, :, :130] == float("-inf"))
    check_against_reference(_run(), S.ref_attention, [q, k, v],
                            dict(causal=True, return_lse=True))
    out, lse = CA.flash_attention_sm90(q, k[:, :0], v[:, :0])
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


@pytest.mark.gpu
@sm90
def test_packed_qkv_views():
    qkv = make_tensor((2, 333, 3, 4, 128), torch.bfloat16, seed=5, device="cuda")
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    check_against_reference(_run(), S.ref_attention, [q, k, v],
                            dict(causal=True, return_lse=True))


@pytest.mark.gpu
@sm90
def test_matches_tkit_flash_attention():
    import tkit

    q, k, v = _qkv(2, 1024, 1024, 8, 2, 128, torch.bfloat16, seed=11)
    ours, lse = CA.flash_attention_sm90(q, k, v, causal=True)
    theirs, lse_t = tkit.flash_attention(q, k, v, causal=True, return_lse=True)
    assert (ours.float() - theirs.float()).abs().max().item() < 2 ** -6
    assert (lse - lse_t).abs().max().item() < 1e-3


BAD = [
    (lambda q, k, v: CA.check_inputs(q.float(), k, v, None), TypeError, "q must be bfloat16"),
    (lambda q, k, v: CA.check_inputs(q, k.half(), v, None), TypeError, "share a dtype"),
    (lambda q, k, v: CA.check_inputs(q[..., :48], k[..., :48], v[..., :48], None), ValueError,
     "head_dim must be one of"),
    (lambda q, k, v: CA.check_inputs(q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1]
                                     .expand(-1, -1, 3, -1), None), ValueError, "multiple of"),
    (lambda q, k, v: CA.check_inputs(q, k, v[:, :2], None), ValueError, "one shape"),
    (lambda q, k, v: CA.check_inputs(torch.cat([q, q], 3)[..., ::2], k, v, None), ValueError,
     "unit head_dim stride"),
    (lambda q, k, v: CA.check_inputs(q, k, v, -1.0), ValueError, "softmax_scale"),
    (lambda q, k, v: CA.check_inputs(q[0], k, v, None), ValueError, r"q must be \(batch"),
]


@pytest.mark.parametrize("call,exc,words", BAD)
def test_bad_input_errors(call, exc, words):
    # the checks run before anything is compiled or launched: CPU tensors stand in for the
    # device ones (the device check comes after the others)
    q, k, v = (torch.randn(1, 4, h, 64, dtype=torch.bfloat16) for h in (4, 2, 2))
    with pytest.raises(exc, match=words):
        call(q, k, v)
    with pytest.raises(ValueError, match="CUDA device"):
        CA.check_inputs(q, k, v, None)


def test_config():
    assert CA.config(128, torch.bfloat16)["options"] == ("-DHEAD_DIM=128",)
    cfg = CA.config(64, torch.float16, stages=3, intra_overlap=False)
    assert cfg["options"] == ("-DHEAD_DIM=64", "-DELEM_FP16=1", "-DSTAGES=3",
                              "-DINTRA_OVERLAP=0")
    with pytest.raises(ValueError, match="shared memory"):
        CA.config(128, torch.bfloat16, stages=4)
    with pytest.raises(ValueError, match="head_dim"):
        CA.config(96, torch.bfloat16)
    with pytest.raises(ValueError, match="needs intra_overlap"):
        CA.config(128, torch.bfloat16, intra_overlap=False, pingpong=True)


@pytest.mark.toolchain
@needs_nvcc
@pytest.mark.parametrize("opts", [CA.config(128, torch.bfloat16)["options"],
                                  CA.config(64, torch.float16)["options"],
                                  CA.config(128, torch.bfloat16, intra_overlap=False)["options"],
                                  CA.config(128, torch.bfloat16, pingpong=True)["options"],
                                  CA.config(256, torch.bfloat16)["options"]])
def test_build_has_no_spills_and_overlaps(opts, tmp_path):
    # the consumers' registers (o, s and P: 160 at head_dim 128) fit without local memory,
    # and the overlapped build keeps one wgmma group in flight (wait_group 1) while the
    # softmax runs
    usage = _loader.resource_usage(CA.SOURCE, "90a", opts)
    assert "0 bytes spill stores" in usage, usage
    sass = _loader.sass(_loader.compile_cubin(CA.SOURCE, "90a", opts, cache_dir=tmp_path))
    assert "LDL" not in sass and "STL" not in sass
    # S over 128 keys a block (80 at head_dim 256), P V over the head dim
    n = 80 if "-DHEAD_DIM=256" in opts else 128
    d = int(opts[0].split("=")[1])
    assert f"HGMMA.64x{n}x16.F32" in sass and f"HGMMA.64x{d}x16.F32" in sass
    assert "UTMALDG.4D" in sass
    overlapped = "-DINTRA_OVERLAP=0" not in opts
    assert ("WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass) == overlapped


@pytest.mark.parametrize("kw,words", [
    (dict(causal=True, window_size=(8, 0)), "no window or softcap"),
    (dict(causal=True, softcap=5.0), "no window or softcap"),
    (dict(causal=True), "not on a CUDA device"),
])
def test_dispatch_says_why_the_cuda_kernel_declines(kw, words):
    # tkit.flash_attention sends AttentionConfig.cuda_fwd_cases to this kernel where it takes
    # the call; fwd_backend names the reason it does not (here: the options, or CPU tensors)
    from tkit.kernels import attention as A

    q, k, v = (torch.randn(1, 200, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    with A.attention_config(cuda_fwd_cases=frozenset({(64, True)})):
        got = A.fwd_backend(q, k, v, **kw)
        assert got.startswith("triton (") and "the CUDA kernel declines: " in got, got
        assert words in got.split("declines: ")[1], got
        # a case not asked of it (causal=False here) does not mention it
        assert "CUDA kernel" not in A.fwd_backend(q, k, v, **dict(kw, causal=False))
    assert "CUDA kernel" not in A.fwd_backend(q, k, v, **kw)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("d", CA.HEAD_DIMS)
def test_flash_attention_dispatches_asked_cases(d):
    # with the case asked, tkit.flash_attention's forward is this kernel's (bit for bit) and
    # its backward (the Triton kernels, from the saved output and lse) is right
    import tkit
    from tkit.kernels import attention as A

    q, k, v = _qkv(2, 300, 300, 4, 2, d, torch.bfloat16, seed=9)
    with A.attention_config(cuda_fwd_cases=frozenset({(d, True)})):
        assert A.fwd_backend(q, k, v, causal=True).startswith("cuda (")
        out, lse = tkit.flash_attention(q, k, v, causal=True, return_lse=True)
        check_against_reference(tkit.flash_attention, S.ref_attention, [q, k, v],
                                dict(causal=True), grad=True)
    want, want_lse = CA.flash_attention_sm90(q, k, v, causal=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
