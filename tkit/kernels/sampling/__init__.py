"""Token sampling from logits (temperature, min-p, top-k, top-p) and speculative-decoding
acceptance, without sorting, without host syncs, reproducible from per-row seeds.

Math of :func:`sample`, per row of logits x (length V), in this order (vLLM v1's: min-p is a
logits processor applied before top-k and top-p; each filter renormalizes):

    z = x / T                                  T <= 0 (or top_k == 1): the row is argmax(x)
    min-p   keep z_i >= max(z) + log(min_p)    (p_i >= min_p * p_max; scale-free)
    top-k   of what min-p kept, keep z_i >= the k-th largest of them
    top-p   of what top-k kept (mass renormalized), keep z_i >= tau_p, the largest value v with
            sum_{kept j, z_j >= v} exp(z_j) >= top_p * sum_{kept j} exp(z_j)
    token   argmax over the kept i of z_i + g_i,  g_i = -log(-log(u_i))   (Gumbel-max)

Every filter is a threshold on z, so the kept set is {i : z_i >= tau} for one tau, and ties at
a threshold are all kept (sort-based samplers keep an arbitrary subset of them). Disabled per
row: top_k <= 0 or >= V, top_p >= 1, min_p <= 0. Tokens below max(z) - SPAN (40) are never
kept: the Gumbel noise spans less than 20, so they can never win the argmax, and their share
of any top-p mass is below V * exp(-40), far under float32 rounding.

Randomness: u_i comes from Philox-4x32-10 (``tl.philox``, counter-based) keyed by the row's
seed, with counter (i // 4, stream, purpose, 0) and output word i % 4, as a 24-bit uniform
strictly inside (0, 1): ``u = ((r >> 9) + 0.5) * 2**-23``. Nothing depends on the launch
configuration (block sizes, pivots, paths), so the same seed gives the same token, and
:func:`philox_uniform` (torch, int64 arithmetic) reproduces every u: the spec's reference
draws the same noise and must give the same ids. A scalar seed uses stream = row; a per-row
seed tensor uses stream 0 (a request keeps its draws wherever it sits in the batch).

Algorithm (one program per row, passes over the row; after the first read the 33 MB of a
128 x 128256 bf16 batch sit in the H200's 60 MB L2):

1. Pass 1: max of z and its first index (the argmax rows are done).
2. Threshold search, no sort: keys of float32 values as order-preserving int32
   (``_key``). ``lo`` is a valid lower bound of the final threshold, ``hi`` an upper one; each
   pass counts (and, for top-p, sums exp(z - max) over) the elements above ``PIVOTS`` pivots
   spread evenly in value over (lo, hi), clamped to distinct keys, and moves lo/hi to the
   nearest valid/invalid pivot: the interval shrinks (PIVOTS + 1)-fold a pass in value and
   never stalls in keys. Top-k runs on counts (valid: count >= k), then top-p on masses
   (valid: mass >= top_p * mass at its start, measured by the first pass's pivot at lo).
   FlashInfer's sorting-free samplers search pivots the same way (theirs by rejection).
3. As soon as at most ``CAP`` elements are >= lo, one pass compacts them (value, index) into a
   per-row scratch row (``cumsum`` of the mask gives each its slot) and the rest is exact in
   registers: k-th largest from pairwise counts, the top-p threshold from pairwise masses,
   then Gumbel-max over the kept candidates. With top_k = 50 and CAP = 256 this happens after
   a few passes whatever the distribution; top-p alone on a flat distribution may keep more
   than CAP tokens: the search then runs to the exact threshold (it stops when lo and hi
   bracket one element, or are adjacent keys) and a last streaming pass takes the Gumbel-max
   over {z >= tau}, skipping blocks with no kept token.
4. Temperature / min-p alone need no search: pass 1, then the streaming Gumbel-max pass (one
   Philox call gives four tokens' noise).

Split rows (a scalar top_k <= CAP, decided on the host: ``SampleConfig.split``): one program
per row leaves most of the GPU idle at small batches and re-reads its row from L2 pass after
pass. Instead two launches:

a. ``_chunk_kernel``, one program per (row, chunk of ``split_block`` columns; 16 a row at
   vocab 128256): the chunk is read once, into registers; its max and first argmax, then the
   same pivot search (``_search_keys``, on the keys in registers) from max(chunk) - SPAN down
   to a threshold t_c valid for the chunk (at least k of its elements >= t_c) with at most
   CAP elements >= t_c. Those are the chunk's candidates; their columns, in column order, go
   to a (B, chunks, CAP) scratch. Every token of the row's top k is >= its chunk's k-th
   largest, so it is among them. When more than CAP elements tie at t_c only the ones above
   it are written, and the chunk reports the key g = t_c + 1 above which it is complete.
b. ``_merge_kernel``, one program per row: m and its first index from the chunks' maxima,
   then the search once more, over the candidates (their z gathered back from the logits),
   from the row's lower bound (span, min-p): it stops at lo with at most CAP candidates
   >= lo and lo >= every chunk's g, so that the candidates are exactly the row's z >= lo,
   and lo is at most the top-k threshold. Compacted in column order they get the same
   finish as step 3 (``_finish_candidates``): the same kept set and the same noise, so the
   same token as the one-program-per-row path (the candidate lists can differ below the
   top-k threshold, which moves the float32 rounding of the top-p masses: a near-tie at the
   top-p boundary may resolve differently, as between two configs of steps 1-3). A row with
   more than CAP tokens tied at the k-th value (or a chunk tied at or above lo) runs steps
   1-3 in the merge program itself.

Speculative acceptance (:func:`speculative_accept`), per row with draft tokens t_0..t_{k-1}:
accept t_i while u_i < p_target(t_i) / p_draft(t_i) (always when p_target >= p_draft); at the
first rejection j draw from normalize(max(0, p_target[j] - p_draft[j])) (the target row j if
that is all zero, which rounding alone can cause); if all k are accepted draw a bonus token
from p_target[k]. Draws from a probability row use the exponential race argmax_i q_i / E_i,
E_i = -log(u_i) (Gumbel-max on log q without the log). The output distribution is the
target's (Leviathan et al. 2023, Chen et al. 2023). One program per row: the k acceptance
tests are gathers, then one pass over the row j (residual, or bonus).

Cost model: sample reads the logits once from HBM (B * V * itemsize bytes, 32.8 MB at
128 x 128256 bf16: 8 us at 4 TB/s); the search passes re-read from L2 (split rows: the chunk
once more, for the compaction, and the merge gathers the candidates); speculative_accept
reads two probability rows (draft and target) per sequence plus the gathers.
"""

from __future__ import annotations

import torch

from tkit.kernels import _common as C
from tkit.kernels.sampling.config import (  # noqa: F401  (public)
    LOGIT_DTYPES,
    PROB_DTYPES,
    PURPOSE_ACCEPT,
    PURPOSE_RESAMPLE,
    PURPOSE_SAMPLE,
    SampleConfig,
    current_config,
    sample_config,
)
from tkit.kernels.sampling.ops import (
    _option,
    _sample_impl,
    _sample_op,
    _seeds,
    _spec_impl,
    _spec_op,
    _values_checked,
)


def sample(logits, *, temperature=None, top_k=None, top_p=None, min_p=None, seed=None):
    """Sample one token id per row of ``logits``; see the module docstring for the math.

    Parameters
    ----------
    logits : Tensor (batch, vocab), float32, float16 or bfloat16, any strides.
    temperature : float or Tensor (batch,), optional
        z = logits / temperature; 0 (or <= 0 in a tensor) means argmax. Default 1.
    top_k : int or integer Tensor (batch,), optional
        Keep the k largest; 1 means argmax; <= 0 or >= vocab (in a tensor) disables it.
    top_p : float or Tensor (batch,), optional
        Nucleus: the smallest set of largest tokens holding at least this share of the
        probability left by top-k; 1 (or more, in a tensor) disables it.
    min_p : float or Tensor (batch,), optional
        Keep tokens whose probability is at least min_p times the largest one's; 0 disables.
    seed : int or int64 Tensor (batch,), optional
        An int seeds the batch (row r draws stream r); a tensor seeds each row on its own
        (stream 0: the same seed and logits give the same token in any row). None draws
        per-row seeds from torch's generator on the logits' device.

    Scalars are checked here; per-row tensors are checked where that costs no device sync
    (host tensors, TKIT_CHECK=1) and are otherwise taken as documented (out-of-range values
    clamp or disable). Nothing reads device values: the call is capturable in a CUDA graph.

    Returns
    -------
    Tensor (batch,) int64.
    """
    C.check_tensor(logits, "logits", LOGIT_DTYPES, ndim=2)
    b, v = logits.shape
    if v == 0 and b > 0:
        raise ValueError("logits must have at least one column (vocab >= 1)")
    t, t_val = _option(temperature, "temperature", b, logits, LOGIT_DTYPES, "float")
    k, k_val = _option(top_k, "top_k", b, logits, (torch.int32, torch.int64), "int")
    p, p_val = _option(top_p, "top_p", b, logits, LOGIT_DTYPES, "float")
    mp, mp_val = _option(min_p, "min_p", b, logits, LOGIT_DTYPES, "float")
    if t is None and temperature is not None and t_val < 0:
        raise ValueError(f"temperature must be >= 0, got {t_val}")
    if k is None and top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if p is None and top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if mp is None and min_p is not None and not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    for name, x, lo, hi in (("temperature", t, 0.0, float("inf")), ("top_p", p, 0.0, 1.0),
                            ("min_p", mp, 0.0, 1.0)):
        if x is not None and _values_checked(x):
            bad = ~((x >= lo) & (x <= hi))
            if name == "top_p":
                bad = bad | (x == 0)
            if bool(bad.any()):
                i = int(bad.nonzero()[0])
                raise ValueError(f"{name}[{i}] = {x[i].item()} is outside its range")
    seeds, seed_val = _seeds(seed, b, logits)
    # scalars: -1 = not given (compiled out), 0 = given as a tensor; temperature defaults to 1
    t_val = 1.0 if temperature is None or t is not None else float(t_val)
    args = (logits, t, k, p, mp, seeds, t_val, int(k_val), float(p_val), float(mp_val),
            int(seed_val))
    if C.use_direct_path(logits):
        return _sample_impl(*args)
    return _sample_op(*args)


def speculative_accept(draft_token_ids, draft_probs, target_probs, *, seed=None):
    """Chain rejection sampling of speculative decoding (see the module docstring).

    Parameters
    ----------
    draft_token_ids : int64 or int32 Tensor (batch, k), the draft model's tokens.
    draft_probs : Tensor (batch, k, vocab), the draft's probabilities at each of them.
    target_probs : Tensor (batch, k + 1, vocab), the target's (its last row for the bonus).
        float32, float16 or bfloat16 probability rows (each summing to 1), any strides.
    seed : int or int64 Tensor (batch,), optional; as in :func:`sample`.

    Returns
    -------
    accepted_ids : int64 Tensor (batch, k + 1): the accepted draft tokens, then the resampled
        (or bonus) token, then -1.
    num_accepted : int32 Tensor (batch,): accepted draft tokens (0..k); the row holds
        num_accepted + 1 tokens.
    """
    C.check_tensor(draft_token_ids, "draft_token_ids", (torch.int64, torch.int32), ndim=2)
    C.check_tensor(draft_probs, "draft_probs", PROB_DTYPES, ndim=3)
    C.check_tensor(target_probs, "target_probs", PROB_DTYPES, ndim=3)
    C.check_same_device(draft_token_ids=draft_token_ids, draft_probs=draft_probs,
                        target_probs=target_probs)
    b, k = draft_token_ids.shape
    if tuple(draft_probs.shape[:2]) != (b, k):
        raise ValueError(f"draft_probs must be (batch, k, vocab) = ({b}, {k}, vocab) for "
                         f"draft_token_ids of shape {(b, k)}, got {tuple(draft_probs.shape)}")
    v = draft_probs.shape[2]
    if tuple(target_probs.shape) != (b, k + 1, v):
        raise ValueError(f"target_probs must be (batch, k + 1, vocab) = {(b, k + 1, v)}, got "
                         f"{tuple(target_probs.shape)}")
    if k < 1 or v < 1:
        raise ValueError(f"draft_token_ids needs k >= 1 and draft_probs vocab >= 1, got k={k}, "
                         f"vocab={v}")
    if draft_probs.dtype != target_probs.dtype:
        raise TypeError(f"draft_probs ({C.dtype_name(draft_probs.dtype)}) and target_probs "
                        f"({C.dtype_name(target_probs.dtype)}) must have the same dtype")
    if _values_checked(draft_token_ids):
        bad = (draft_token_ids < 0) | (draft_token_ids >= v)
        if bool(bad.any()):
            i, j = bad.nonzero()[0].tolist()
            raise ValueError(f"draft_token_ids[{i}, {j}] = {int(draft_token_ids[i, j])} is "
                             f"outside [0, vocab = {v})")
    seeds, seed_val = _seeds(seed, b, draft_probs, "draft_probs")
    if C.use_direct_path(draft_probs, target_probs):
        return _spec_impl(draft_token_ids, draft_probs, target_probs, seeds, seed_val)
    return _spec_op(draft_token_ids, draft_probs, target_probs, seeds, seed_val)


def cost(logits, **kw):
    """Bytes of one :func:`sample`: the logits read once (plus the ids written)."""
    from tkit._cost import Cost

    return Cost(logits.numel() * logits.element_size() + 8 * logits.shape[0], 0.0)


def cost_speculative(draft_token_ids, draft_probs, target_probs, **kw):
    """Bytes of one :func:`speculative_accept`: per row one draft and one target probability
    row read (the residual's, or the bonus row's), the gathers and the outputs."""
    from tkit._cost import Cost

    b, k = draft_token_ids.shape
    v = draft_probs.shape[-1]
    item = draft_probs.element_size()
    return Cost(b * (2 * v * item + k * (8 + 2 * item) + 8 * (k + 1) + 4), 0.0)


# --------------------------------------------------------------------------------------------
# The counter-based RNG in torch (references and tests)
# --------------------------------------------------------------------------------------------
_M32 = 0xFFFFFFFF


def _mulhilo(a: int, b: torch.Tensor):
    """(hi, lo) 32-bit words of a * b for a uint32 constant and a tensor of uint32 in int64,
    without int64 overflow (16-bit halves of a)."""
    t_lo = (a & 0xFFFF) * b
    t_hi = (a >> 16) * b
    w = ((t_hi & 0xFFFF) << 16) + t_lo
    return (t_hi >> 16) + (w >> 32), w & _M32


def philox_uniform(seed: torch.Tensor, stream, purpose: int, idx: torch.Tensor) -> torch.Tensor:
    """The kernels' u for elements ``idx`` (int64 tensor), float64, bit-for-bit: Philox-4x32-10
    as ``tl.philox`` computes it, counter (idx // 4, stream, purpose, 0), key (seed low, high
    32 bits), word idx % 4, then ((r >> 9) + 0.5) * 2**-23. ``seed``/``stream`` broadcast
    against ``idx`` (int64 tensors or ints)."""
    seed = torch.as_tensor(seed, dtype=torch.int64, device=idx.device)
    stream = torch.as_tensor(stream, dtype=torch.int64, device=idx.device)
    k0 = seed & _M32
    k1 = (seed >> 32) & _M32
    c0 = (idx >> 2) & _M32
    c1 = (stream & _M32) + torch.zeros_like(c0)
    c2 = torch.full_like(c0, purpose & _M32)
    c3 = torch.zeros_like(c0)
    k0 = k0 + torch.zeros_like(c0)
    k1 = k1 + torch.zeros_like(c0)
    for _ in range(10):
        hi_b, lo_b = _mulhilo(0xCD9E8D57, c2)
        hi_a, lo_a = _mulhilo(0xD2511F53, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + 0x9E3779B9) & _M32
        k1 = (k1 + 0xBB67AE85) & _M32
    o = idx & 3
    r = torch.where(o == 0, c0, torch.where(o == 1, c1, torch.where(o == 2, c2, c3)))
    return ((r >> 9).to(torch.float64) + 0.5) * 2.0**-23
