"""The decode step of a layer from tkit ops (``tkit.specs.model.llama_decode_layer``): its
output and the cache it writes against the torch step under the reference rule, fuzzed batch
sizes and cache forms, a whole-graph torch.compile, and (GPU) a CUDA graph replayed over
several steps with new positions, slots and lengths."""

from __future__ import annotations

import pytest
import torch

from tkit.specs import model as M
from tkit.testing import check_against_reference, check_spec, fuzz_spec
from tkit.testing.tensors import default_device

ON_GPU = torch.cuda.is_available()


def _dev():
    return default_device()


def _clone(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def test_check_cases():
    assert check_spec("llama_decode_layer") > 0


def _with_cache(*args, fn, **kw):
    """The step's output and both caches after it."""
    out = fn(*args, **kw)
    return out, args[7], args[8]


def _tkit_with_cache(*args, **kw):
    return _with_cache(*args, fn=M.llama_decode_layer, **kw)


def _ref_with_cache(*args, **kw):
    return _with_cache(*args, fn=M.ref_llama_decode_layer, **kw)


@pytest.mark.parametrize("page", [None, 1, 8])
def test_writes_the_rotated_token_into_the_cache(page):
    # the whole caches compared: the new tokens' slots against the reference's rotated k and
    # v, every other slot unchanged
    lens = [5, 17, 1]
    args, kw = M._make_decode(3, lens, M.TINY, torch.bfloat16, page=page, seed=3)(_dev())
    before = args[7].clone()
    check_against_reference(_tkit_with_cache, _ref_with_cache, args, kw)
    flat = args[7].view(-1, *args[7].shape[2:])
    written = torch.zeros(flat.shape[0], dtype=torch.bool, device=flat.device)
    written[kw["slot_mapping"]] = True
    assert torch.equal(flat[~written], before.view_as(flat)[~written])
    assert not torch.equal(flat[written], before.view_as(flat)[written])


def test_fuzz():
    fuzz_spec("llama_decode_layer", max_examples=None if ON_GPU else 8)


def test_torch_compile_fullgraph():
    """The step traces whole (the in-place RoPE of q and k, views of the QKV product, and the
    cache writes functionalized) and gives eager's output and caches."""
    args, kw = M._make_decode(4, [9, 16, 1, 30], M.TINY, torch.bfloat16, page=4)(_dev())
    eager_args = _clone(args)
    eager = M.llama_decode_layer(*eager_args, **kw)
    f = torch.compile(M.llama_decode_layer, fullgraph=True,
                      backend="inductor" if ON_GPU else "aot_eager")
    out = f(*args, **kw)
    assert torch.equal(out, eager)
    assert torch.equal(args[7], eager_args[7]) and torch.equal(args[8], eager_args[8])


@pytest.mark.gpu
def test_cuda_graph_replays_the_next_steps():
    """Captured once, replayed for four steps of a batch of sequences: each step moves every
    position one on (new slots, a new page where one fills, lengths + 1) by copying into the
    captured tensors, and brings new tokens; outputs and caches equal eager steps on the same
    values."""
    b, page, steps = 4, 16, 4
    cfg = dict(hidden=512, heads=8, kv_heads=2, head_dim=64, mlp=1024)
    lens0 = [15, 16, 1, 100]
    args, made = M._make_decode(b, [n + steps for n in lens0], cfg, torch.bfloat16, page=page,
                                seed=11)("cuda")
    table = made["block_table"]
    rows = torch.arange(b, device="cuda")

    def step_inputs(lens):
        n = torch.tensor(lens, dtype=torch.int32, device="cuda")
        pos = n.long() - 1
        slots = table[rows, pos // page].long() * page + pos % page
        return dict(positions=pos, slot_mapping=slots, cache_seqlens=n, block_table=table,
                    heads=cfg["heads"], kv_heads=cfg["kv_heads"])

    kw = step_inputs(lens0)
    M.llama_decode_layer(*args, **kw)  # compiles outside the capture (and writes step 0)
    eager_args = _clone(args)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = M.llama_decode_layer(*args, **kw)
    for step in range(1, steps + 1):
        new = step_inputs([n + step for n in lens0])
        for name in ("positions", "slot_mapping", "cache_seqlens"):
            kw[name].copy_(new[name])
        args[0].copy_(torch.randn(args[0].shape, device="cuda").to(args[0].dtype))
        eager_args[0].copy_(args[0])
        g.replay()
        eager = M.llama_decode_layer(*eager_args, **new)
        assert torch.equal(out, eager), step
        assert torch.equal(args[7], eager_args[7]) and torch.equal(args[8], eager_args[8])
