"""tkit.sample's split rows (a scalar top_k <= SampleConfig.cap: chunk programs, then one merge
program a row) against its one-program-per-row passes: the same ids for the same seeds, on
random logits with ties and -inf entries, in every logits dtype, on vocabularies that the
chunk divides and that it does not, and on the rows the merge hands back to the passes (more
ties at the k-th value than CAP candidates, a chunk tied above the row's threshold).

Both paths are pinned to CAP 16 and 32-column chunks (several chunks on small vocabularies);
every comparison also goes to the Philox-exact reference.
"""

import pytest
import torch

import tkit
from tkit.kernels import sampling as SK
from tkit.kernels.sampling import ops as SO
from tkit.specs import sampling as S
from tkit.testing import make_tensor

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
PIN = dict(cap=16, split_block=32, split_warps=1 if ON_GPU else 4)


def both_paths(x, **opts):
    """(split ids, one-program-per-row ids) of the same call."""
    with SK.sample_config(split=True, **PIN):
        cfg = SK.current_config(x.shape[1])
        assert SO._split_chunks(x.shape[1], None, opts["top_k"], cfg), "not a split call"
        a = tkit.sample(x, **opts)
    with SK.sample_config(split=False, **PIN):
        b = tkit.sample(x, **opts)
    return a, b


def check_same(x, **opts):
    a, b = both_paths(x, **opts)
    assert torch.equal(a, b), f"split {a.tolist()} != rows {b.tolist()}"
    ref = S.ref_sample(x, **opts)
    assert torch.equal(a.cpu(), ref.cpu()), f"split {a.tolist()} != reference {ref.tolist()}"


def _with_ties(shape, dtype, seed):
    """Random logits rounded to quarter units (ties everywhere), some -inf entries."""
    x = make_tensor(shape, torch.float32, seed=seed, device="cpu", scale=2.5)
    x = (x * 4).round() / 4
    gen = torch.Generator().manual_seed(seed)
    x[torch.rand(shape, generator=gen) < 0.1] = -float("inf")
    return x.to(dtype).to(DEV)


# (dtype, vocab, options; "rows": per-row tensors) -- vocab 77, 45, 20: a partial last chunk
CASES = [
    (torch.float32, 100, dict(temperature=0.7, top_k=5, top_p=0.8, min_p="rows", seed="rows")),
    (torch.bfloat16, 77, dict(top_k=4, min_p=0.05, top_p=0.9, seed=1234)),
    (torch.float16, 45, dict(temperature="rows", top_k=7, top_p="rows", seed="rows")),
    (torch.float32, 64, dict(temperature=1.3, top_k=16, seed=2**40 + 3)),
    (torch.float32, 20, dict(top_k=3, top_p=0.5, seed=9)),  # one chunk
]


@pytest.mark.parametrize("i", range(len(CASES)))
def test_split_equals_rows(i):
    dtype, v, opts = CASES[i]
    b = 8
    x = _with_ties((b, v), dtype, seed=10 + i)
    gen = torch.Generator().manual_seed(i)
    kw = dict(opts)
    if kw.get("seed") == "rows":
        kw["seed"] = torch.randint(0, 2**62, (b,), generator=gen).to(DEV)
    if kw.get("temperature") == "rows":
        t = 0.5 + torch.rand(b, generator=gen)
        t[::3] = 0.0  # argmax rows
        kw["temperature"] = t.to(DEV)
    if kw.get("top_p") == "rows":
        kw["top_p"] = (0.3 + 0.7 * torch.rand(b, generator=gen)).to(DEV)
    if kw.get("min_p") == "rows":
        kw["min_p"] = (0.2 * torch.rand(b, generator=gen)).to(DEV)
    check_same(x, **kw)


def test_split_ties_and_fallbacks():
    """Rows built to reach each branch of the merge (CAP 16, 32-column chunks, top_k 3)."""
    v = 96
    x = make_tensor((8, v), torch.float32, seed=7, device="cpu", scale=2.0)
    x[0] = 1.0                                  # all tied: > CAP kept, the passes decide
    x[1, :20] = 5.0                             # 20 tied maxima across one chunk: the passes
    x[2, 32:64] = -3.0                          # a chunk tied below the threshold: merged
    x[2, 70] = 9.0
    x[3, :] = -float("inf")                     # all -inf: token 0
    x[4, :] = -float("inf")
    x[4, [5, 40, 90]] = torch.tensor([0.5, 0.5, 0.25])  # three finite tokens, a tie
    x[5, 64:] = 2.0                             # ties at the k-th value within a chunk
    x[5, 3] = 4.0
    x[6, ::7] = 3.0                             # ties spread over every chunk, 14 of them
    x[7, 33] = x[7, 80] = x[7].max() + 1        # a tied maximum in two chunks
    x = x.to(DEV)
    seeds = torch.arange(1000, 1008, device=DEV)
    check_same(x, top_k=3, seed=seeds)
    check_same(x, top_k=3, top_p=0.7, temperature=0.8, seed=seeds)
    # argmax rows (top_k 1 and T = 0): the first maximum, from the chunks' statistics
    a, b = both_paths(x, top_k=1, seed=5)
    assert torch.equal(a, b)
    assert a[7] == 33 and a[3] == 0


def test_split_many_seeds_one_row():
    """One row with ties at the threshold, 24 seeds (per-row tensor): the same draws."""
    row = _with_ties((1, 70), torch.bfloat16, seed=3)
    x = row.repeat(24, 1)
    check_same(x, temperature=0.9, top_k=6, top_p=0.85, seed=torch.arange(24, device=DEV) * 7919)


def test_split_choice_is_host_side():
    """Which path runs is decided from host values only (no device read)."""
    cfg = SK.SampleConfig(cap=16, split_block=32)
    assert SO._split_chunks(100, None, 5, cfg) == 4
    assert SO._split_chunks(20, None, 5, cfg) == 0           # one chunk: the passes (auto)
    forced = SK.SampleConfig(cap=16, split_block=32, split=True)
    assert SO._split_chunks(20, None, 5, forced) == 1
    assert SO._split_chunks(100, None, 17, cfg) == 0         # top_k > cap
    assert SO._split_chunks(100, None, 100, forced) == 0     # top_k >= vocab: off
    assert SO._split_chunks(100, None, -1, forced) == 0      # no top_k
    assert SO._split_chunks(100, torch.ones(2), 0, forced) == 0  # per-row top_k
    off = SK.SampleConfig(cap=16, split_block=32, split=False)
    assert SO._split_chunks(100, None, 5, off) == 0
    with pytest.raises(TypeError, match="split must be None, True or False"):
        with SK.sample_config(split="yes"):
            SK.current_config(100)
    with pytest.raises(ValueError, match="split_pivots"):
        with SK.sample_config(split_pivots=1):
            SK.current_config(100)


@pytest.mark.skipif(not ON_GPU, reason="full-size vocabulary: GPU only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_equals_rows_full_vocab(dtype):
    b, v = 64, 128256
    x = make_tensor((b, v), dtype, seed=2, device=DEV, scale=2.5)
    x[:, 1000:1100] = x[:, 1000:1100].max()  # ties above any top-50 threshold
    x[1::2, 5000:70000] = -float("inf")
    seeds = torch.arange(b, device=DEV) + 17
    for opts in (dict(temperature=0.7, top_k=50, top_p=0.9), dict(top_k=256, min_p=0.01),
                 dict(top_k=20)):
        with SK.sample_config(split=True):
            a = tkit.sample(x, seed=seeds, **opts)
        with SK.sample_config(split=False):
            r = tkit.sample(x, seed=seeds, **opts)
        assert torch.equal(a, r), opts
