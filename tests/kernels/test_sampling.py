"""Sampling: tkit.sample and tkit.speculative_accept.

Ids are checked three ways: exactly against the Philox-exact torch references (same seeds, same
noise: the spec's check cases and a fuzz run, on both finishes of the kernel: compacted
candidates and the streaming pass); statistically (chi-square over a small vocabulary, with a
fixed overall seed, so each test is deterministic; the threshold is low enough to survive a
legitimate change of the random streams, and each test shows that a wrong distribution fails
it); and by exact masks on hand-made logits (tokens outside top-k / top-p / min-p never drawn).

The distribution tests draw N_REF rows from the reference (row r: stream r of one seed) and run
the kernel on the first N_KERNEL of them, which must give the same ids: the kernel's ids are
the reference's draws, and the chi-square runs over all N_REF of them. The interpreter pays
0.03-0.1 s a kernel row, the reference microseconds: the statistics get 4000 draws (every
test's wrong distribution lands below p = 1e-30; weights 13% off in temperature fail with
probability 0.88-1), and a kernel row that strays from the reference fails the exact
comparison, which a histogram of a few hundred draws would mostly not see. Each exact
comparison also shows that it would see the wrong options (their reference differs on those
rows).
"""

import pytest
import torch

import tkit
from tkit import registry
from tkit.kernels import sampling as SK
from tkit.kernels.sampling import _kernels as SKK
from tkit.specs import sampling as S
from tkit.testing import check_against_reference, fuzz, make_tensor, opcheck

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
#: chi-square p-values below this fail; the wrong-distribution checks must land far below it
P_MIN = 1e-4
#: SampleConfig.cap values: 2 sends rows with top-k / top-p through the exact search and the
#: streaming pass; 256 compacts at once (the vocabularies here are smaller); 16 is in between
CAPS = (2, 16, 256)
#: distribution tests: reference draws in the chi-square, kernel rows compared with the first
#: of them (a chi-square over 4000 draws keeps its false-failure probability at P_MIN)
N_REF, N_KERNEL = 4000, 48


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed ``counts`` under ``probs`` (bins with expected counts under 5
    merged into one; a count in a bin of probability 0 gives 0)."""
    counts = counts.double()
    n = counts.sum()
    exp = probs.double() * n
    if bool((counts[exp == 0] > 0).any()):
        return 0.0
    big = exp >= 5
    obs_b, exp_b = counts[big], exp[big]
    rest_o, rest_e = counts[~big & (exp > 0)].sum(), exp[~big & (exp > 0)].sum()
    if rest_e > 0:
        obs_b = torch.cat([obs_b, rest_o[None]])
        exp_b = torch.cat([exp_b, rest_e[None]])
    df = obs_b.numel() - 1
    if df < 1:
        return 1.0
    stat = ((obs_b - exp_b) ** 2 / exp_b).sum()
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2.0))


def target_probs(logits_row, **opts):
    """The distribution sample() must draw from: softmax of z over the kept set."""
    x = logits_row[None].double()
    keep = S.kept_mask(x, **opts)[0]
    z, _ = S.scaled_logits(x, opts.get("temperature"))
    w = torch.where(keep, torch.exp(z[0] - z[0].max()), 0.0)
    return w / w.sum()


# ---- against the references --------------------------------------------------------------------
@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("name", ["sample", "speculative_accept"])
def test_check_cases(name, cap):
    if name == "speculative_accept" and cap != 16:
        pytest.skip("speculative_accept has no candidate path: one cap is enough")
    spec = registry.get(name)
    with SK.sample_config(cap=cap):
        for case in spec.check_cases():
            args, kwargs = case.make(DEV)
            check_against_reference(spec.fn, spec.reference, args, kwargs, ulps=spec.ulps)


def test_fuzz_sample():
    spec = registry.get("sample")
    fuzz(spec.fn, spec.reference, max_examples=None if ON_GPU else 15, **spec.fuzz())


def test_fuzz_speculative_accept():
    recipe = dict(registry.get("speculative_accept").fuzz())
    fn, ref = recipe.pop("fn"), recipe.pop("reference")
    fuzz(fn, ref, **recipe, max_examples=None if ON_GPU else 10)


def test_philox_matches_triton():
    """The torch Philox reproduces the kernels' uniforms bit for bit (seeds above 2**32 and
    streams included), in both of the kernels' forms (gathered and per block)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(O, seed, stream, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(O + i, SKK._uniform(seed, stream, 2, i))
        tl.store(O + N + i, SKK._uniform_block(seed, stream, 2, 0, N))

    out = torch.empty(64, device=DEV)
    for seed in (0, 12345, 2**40 + 17, 2**62 + 5):
        kernel[(1,)](out, seed, 3, N=32)
        ref = SK.philox_uniform(torch.tensor(seed), 3, 2, torch.arange(32, device=DEV))
        assert torch.equal(out[:32].double(), ref)
        assert torch.equal(out[32:].double(), ref)
        assert 0 < ref.min() and ref.max() < 1


# ---- distributions -----------------------------------------------------------------------------
#: (options, a wrong version of them the same draws must fail against)
CHI_CASES = {
    "temperature": (dict(temperature=0.6), dict(temperature=1.0)),
    "top_k": (dict(top_k=3), dict(top_k=4)),
    "top_p": (dict(top_p=0.7), dict(top_p=0.9)),
    "min_p": (dict(min_p=0.2), dict(min_p=0.05)),
    "all": (dict(temperature=0.8, top_k=4, top_p=0.8, min_p=0.1), dict(temperature=0.8)),
}


@pytest.mark.parametrize("what, cap", [(w, 16) for w in CHI_CASES]
                         + [(w, 2) for w in ("top_k", "top_p", "all")])
def test_chi_square(what, cap):
    """Many rows of the same logits, one scalar seed (row r draws stream r): the histogram of
    ids matches softmax over the kept set, and not the distribution of the wrong options. The
    kernel's rows are the reference's first N_KERNEL draws, exactly."""
    opts, wrong = CHI_CASES[what]
    gen = torch.Generator().manual_seed(11)
    v = 8
    row = torch.randn(v, generator=gen) * 1.2
    ref = S.ref_sample(row.repeat(N_REF, 1), seed=2024, **opts)
    with SK.sample_config(cap=cap):
        ids = tkit.sample(row.repeat(N_KERNEL, 1).to(DEV), seed=2024, **opts).cpu()
    assert torch.equal(ids, ref[:N_KERNEL]), f"{what}: {ids.tolist()} != {ref[:N_KERNEL]}"
    other = S.ref_sample(row.repeat(N_KERNEL, 1), seed=2024, **wrong)
    assert not torch.equal(other, ids), f"{what}: the wrong options draw the same ids"
    counts = torch.bincount(ref, minlength=v)
    p_ok = chi_square_p(counts, target_probs(row, **opts))
    p_wrong = chi_square_p(counts, target_probs(row, **wrong))
    assert p_ok > P_MIN, f"{what}: counts {counts.tolist()} vs {target_probs(row, **opts)}"
    assert p_wrong < P_MIN, f"{what}: the wrong distribution passes ({p_wrong})"


# ---- exact masks on hand-made logits ----------------------------------------------------------
def _log(probs):
    return torch.tensor(probs, dtype=torch.float64).log().float()


#: (logits row, options, the set that may be drawn)
MASKS = [
    # probabilities 0.4 0.25 0.15 0.1 0.05 0.03 0.02: top-3 = {0, 1, 2}
    (_log([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]), dict(top_k=3), {0, 1, 2}),
    # shuffled order, ties at the k-th value are kept: {5, 1, 3 (tie), 6 (tie)}
    (torch.tensor([0.0, 3.0, -1.0, 2.0, -2.0, 4.0, 2.0, 1.0]), dict(top_k=3), {5, 1, 3, 6}),
    # top-p 0.6: 0.4 + 0.25 >= 0.6 -> {0, 1}
    (_log([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]), dict(top_p=0.6), {0, 1}),
    # min-p 0.3: p >= 0.12 -> {0, 1, 2}
    (_log([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]), dict(min_p=0.3), {0, 1, 2}),
    # top-k 4 then top-p 0.75 of the renormalized four (0.4/0.9 + 0.25/0.9 = 0.72 < 0.75)
    (_log([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]), dict(top_k=4, top_p=0.75), {0, 1, 2}),
    # min-p first: 0.1 * 0.4 keeps 5 tokens, top-k 10 keeps them all
    (_log([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]), dict(min_p=0.1, top_k=10),
     {0, 1, 2, 3, 4}),
    # a masked vocabulary (-inf) and a far token: the rest never drawn
    (torch.tensor([-float("inf"), 1.0, 1.5, -60.0, -float("inf")]), dict(), {1, 2}),
]


@pytest.mark.parametrize("cap", [2, 256])
@pytest.mark.parametrize("i", range(len(MASKS)))
def test_exact_masks(i, cap):
    """The kernel's rows never draw outside the set and are the reference's draws exactly;
    the reference's N_REF draws reach every token of probability >= 0.1 in the set."""
    row, opts, allowed = MASKS[i]
    n = 16
    with SK.sample_config(cap=cap):
        ids = tkit.sample(row.repeat(n, 1).to(DEV), seed=5, **opts).cpu()
    drawn = set(ids.tolist())
    assert drawn <= allowed, f"drew {sorted(drawn - allowed)} outside {sorted(allowed)}"
    ref = S.ref_sample(row.repeat(N_REF, 1), seed=5, **opts)
    assert torch.equal(ids, ref[:n]), f"{ids.tolist()} != reference {ref[:n].tolist()}"
    likely = set((target_probs(row, **opts) >= 0.1).nonzero().flatten().tolist())
    assert likely <= set(ref.tolist()) <= allowed
    assert S.kept_mask(row[None], **opts)[0].nonzero().flatten().tolist() == sorted(allowed)


# ---- seeds, argmax rows, per-row options --------------------------------------------------------
def test_same_seed_same_token_anywhere():
    """Per-row seeds: the token depends on the row's seed and logits only (not on its position
    in the batch, the batch size or the launch configuration); an int seed repeats a call."""
    x = make_tensor((6, 90), torch.float32, seed=3, device=DEV, scale=2.0)
    seeds = torch.tensor([5, 6, 7, 8, 9, 2**50], device=DEV)
    opts = dict(temperature=0.9, top_k=20, top_p=0.95)
    a = tkit.sample(x, seed=seeds, **opts)
    perm = torch.tensor([3, 0, 5, 1, 4, 2], device=DEV)
    assert torch.equal(tkit.sample(x[perm], seed=seeds[perm], **opts), a[perm])
    assert torch.equal(tkit.sample(x[2:4], seed=seeds[2:4], **opts), a[2:4])
    with SK.sample_config(block=32, pivots=2, cap=2):
        assert torch.equal(tkit.sample(x, seed=seeds, **opts), a)
    b = tkit.sample(x, seed=123, **opts)
    assert torch.equal(tkit.sample(x, seed=123, **opts), b)
    draws = torch.stack([tkit.sample(x, seed=s, temperature=2.0) for s in range(4)])
    assert (draws != draws[0]).any(), "different seeds never gave a different token"


def test_seed_none_uses_torch_generator():
    x = make_tensor((4, 50), torch.float32, seed=3, device=DEV)
    torch.manual_seed(0)
    a = tkit.sample(x, temperature=3.0)
    torch.manual_seed(0)
    assert torch.equal(tkit.sample(x, temperature=3.0), a)


def test_argmax_rows():
    """temperature 0 or top_k 1 is argmax (first index of a tied maximum), per row too."""
    x = make_tensor((8, 70), torch.float16, seed=4, device=DEV, scale=3.0)
    x[1, 10] = x[1, 50] = x[1].max() + 1  # tie: index 10
    am = x.float().argmax(1)
    assert torch.equal(tkit.sample(x, temperature=0.0, seed=1), am)
    assert torch.equal(tkit.sample(x, top_k=1, temperature=2.0, seed=1), am)
    t = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 5.0, 0.0, 1.0], device=DEV)
    k = torch.tensor([0, 5, 1, 0, 3, 1, 0, 0], device=DEV)
    ids = tkit.sample(x, temperature=t, top_k=k, seed=1)
    greedy = (t == 0) | (k == 1)
    assert torch.equal(ids[greedy], am[greedy])
    assert S.kept_mask(x, temperature=t, top_k=k).gather(1, ids[:, None]).all()


def test_per_row_options_equal_scalar_calls():
    """Per-row tensors give each row what the same scalar options give it alone."""
    b, v = 6, 60
    x = make_tensor((b, v), torch.float32, seed=6, device=DEV, scale=2.0)
    t = torch.tensor([0.5, 1.0, 1.5, 0.8, 1.0, 2.0], device=DEV)
    k = torch.tensor([0, 5, 10, 3, 100, 7], device=DEV)
    p = torch.tensor([0.9, 1.0, 0.5, 0.7, 0.95, 0.3], device=DEV)
    mp = torch.tensor([0.0, 0.1, 0.0, 0.05, 0.2, 0.0], device=DEV)
    seeds = torch.arange(100, 100 + b, device=DEV)
    ids = tkit.sample(x, temperature=t, top_k=k, top_p=p, min_p=mp, seed=seeds)
    for r in range(b):
        one = tkit.sample(x[r:r + 1], temperature=float(t[r]), top_k=int(k[r]) or None,
                          top_p=float(p[r]), min_p=float(mp[r]), seed=seeds[r:r + 1])
        assert int(one) == int(ids[r]), f"row {r}"
    assert torch.equal(ids, S.ref_sample(x, temperature=t, top_k=k, top_p=p, min_p=mp,
                                         seed=seeds))


def test_empty_and_single_column():
    assert tkit.sample(torch.empty((0, 5), device=DEV), seed=1).shape == (0,)
    one = tkit.sample(torch.randn(3, 1, device=DEV), top_k=5, top_p=0.5, seed=1)
    assert one.tolist() == [0, 0, 0]


@pytest.mark.parametrize("call, match", [
    (lambda x: tkit.sample(x.long()), "logits has dtype int64"),
    (lambda x: tkit.sample(x[0]), "logits must have 2 dimensions"),
    (lambda x: tkit.sample(x, temperature=-1.0), "temperature must be >= 0"),
    (lambda x: tkit.sample(x, temperature="hot"), "temperature must be a float"),
    (lambda x: tkit.sample(x, top_k=0), "top_k must be >= 1"),
    (lambda x: tkit.sample(x, top_k=2.5), "top_k must be an int"),
    (lambda x: tkit.sample(x, top_k=torch.ones(4, device=x.device)), "top_k has dtype float32"),
    (lambda x: tkit.sample(x, top_k=torch.ones(3, dtype=torch.int64, device=x.device)),
     "top_k must have one value per row"),
    (lambda x: tkit.sample(x, top_p=0.0), r"top_p must be in \(0, 1\]"),
    (lambda x: tkit.sample(x, top_p=1.5), r"top_p must be in \(0, 1\]"),
    (lambda x: tkit.sample(x, top_p=torch.tensor([0.5, 2.0, 0.5, 0.5], device=x.device)),
     r"top_p\[1\]"),
    (lambda x: tkit.sample(x, min_p=-0.1), r"min_p must be in \[0, 1\]"),
    (lambda x: tkit.sample(x, seed=-1), r"seed must be in \[0, 2\*\*63\)"),
    (lambda x: tkit.sample(x, seed=1.5), "seed must be an int"),
    (lambda x: tkit.sample(x, seed=torch.ones(4, device=x.device)), "seed has dtype float32"),
    (lambda x: tkit.sample(x, seed=torch.ones(2, dtype=torch.int64, device=x.device)),
     "seed must be an int or have one value per row"),
])
def test_sample_errors_name_the_argument(call, match, full_checks):
    x = torch.randn(4, 10, device=DEV)
    with pytest.raises((ValueError, TypeError), match=match):
        call(x)


def test_opcheck():
    for name in ("sample", "speculative_accept"):
        op, args, kwargs = registry.get(name).opcheck()
        opcheck(op, args, kwargs)


# ---- speculative decoding ----------------------------------------------------------------------
def _spec_probs(b, k, v, gen, same=False):
    tgt = torch.randn((k + 1, v), generator=gen) * 1.5
    target = tgt.softmax(-1).repeat(b, 1, 1)
    if same:
        draft = target[:, :k].clone()
    else:
        draft = (tgt[:k] + torch.randn((k, v), generator=gen) * 1.5).softmax(-1).repeat(b, 1, 1)
    ids = torch.multinomial(draft.reshape(-1, v), 1, generator=gen).reshape(b, k)
    return ids.to(DEV), draft.to(DEV), target.to(DEV)


def test_speculative_output_distribution_is_the_target():
    """The first emitted token, accepted draft or resampled, is distributed as
    target_probs[:, 0] (and not as the draft's) over the reference's N_REF rows, whose first
    N_KERNEL the kernel reproduces exactly; rows are laid out as documented."""
    gen = torch.Generator().manual_seed(3)
    k, v = 2, 8
    ids, draft, target = _spec_probs(N_REF, k, v, gen)
    b = N_KERNEL
    out, nacc = tkit.speculative_accept(ids[:b], draft[:b], target[:b], seed=99)
    ref, ref_nacc = S.ref_speculative_accept(ids, draft, target, seed=99)
    assert torch.equal(out.cpu(), ref[:b].cpu()) and torch.equal(nacc.cpu(), ref_nacc[:b].cpu())
    # both branches are among the kernel's rows: accepted drafts and resampled tokens
    assert 0 < int((nacc < k).sum()) < b, nacc.tolist()
    counts = torch.bincount(ref[:, 0].cpu(), minlength=v)
    assert chi_square_p(counts, target[0, 0].cpu()) > P_MIN, counts.tolist()
    # the draft's distribution is wrong for the output, and the test sees it
    assert chi_square_p(counts, draft[0, 0].cpu()) < P_MIN
    # rows layout: accepted drafts, one new token, then -1
    pos = torch.arange(k + 1, device=DEV)[None, :]
    n = nacc.long()[:, None]
    assert torch.equal(out[pos < n], ids[:b][pos[:, :k] < n])
    assert (out[pos > n] == -1).all() and (out[pos == n] >= 0).all()


def test_speculative_draft_equal_to_target_accepts_all():
    gen = torch.Generator().manual_seed(4)
    k, v = 3, 8
    ids, draft, target = _spec_probs(N_REF, k, v, gen, same=True)
    b = N_KERNEL
    seeds = torch.arange(N_REF, device=DEV)
    out, nacc = tkit.speculative_accept(ids[:b], draft[:b], target[:b], seed=seeds[:b])
    assert (nacc == k).all()
    assert torch.equal(out[:, :k], ids[:b])
    ref, ref_nacc = S.ref_speculative_accept(ids, draft, target, seed=seeds)
    assert torch.equal(out.cpu(), ref[:b].cpu()) and (ref_nacc == k).all()
    bonus = torch.bincount(ref[:, k].cpu(), minlength=v)
    assert chi_square_p(bonus, target[0, k].cpu()) > P_MIN, bonus.tolist()
    assert chi_square_p(bonus, target[0, 0].cpu()) < P_MIN


def test_speculative_seeds_reproduce():
    gen = torch.Generator().manual_seed(5)
    ids, draft, target = _spec_probs(6, 3, 20, gen)
    a = tkit.speculative_accept(ids, draft, target, seed=7)
    b = tkit.speculative_accept(ids, draft, target, seed=7)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("mutate, match", [
    (lambda i, d, t: (i.float(), d, t), "draft_token_ids has dtype float32"),
    (lambda i, d, t: (i, d[:, :1], t), r"draft_probs must be \(batch, k, vocab\)"),
    (lambda i, d, t: (i, d, t[:, :2]), r"target_probs must be \(batch, k \+ 1, vocab\)"),
    (lambda i, d, t: (i, d, t.half()), "must have the same dtype"),
    (lambda i, d, t: (i.clone().fill_(20), d, t), r"draft_token_ids\[0, 0\] = 20"),
    (lambda i, d, t: (i, d.long(), t), "draft_probs has dtype int64"),
])
def test_speculative_errors_name_the_argument(mutate, match, full_checks):
    gen = torch.Generator().manual_seed(6)
    args = mutate(*_spec_probs(2, 2, 20, gen))
    with pytest.raises((ValueError, TypeError), match=match):
        tkit.speculative_accept(*args, seed=1)
