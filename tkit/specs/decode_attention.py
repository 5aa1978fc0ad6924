"""Specs of decode attention, append_kv and merge_attention_states
(tkit/kernels/decode/), in the attention family."""

from __future__ import annotations

import torch

import tkit
from tkit.kernels import decode as DA
from tkit.registry import Case, Cost, OpSpec, eager_baseline, lazy_composite, optional_module
from tkit.specs.attention import ref_attention
from tkit.testing.tensors import make_tensor

st = optional_module("hypothesis.strategies")

BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
I32 = torch.int32
ON_GPU = torch.cuda.is_available()


# ---- references ------------------------------------------------------------------------------
def gather_cache(cache, seq: int, length: int, block_table=None):
    """The first ``length`` positions of sequence ``seq``: (length, heads, ...) gathered
    through ``block_table`` (page j of the sequence is block ``block_table[seq, j]``)."""
    if block_table is None:
        return cache[seq, :length]
    page = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_table[seq].to(cache.device).long()[pos // page]
    return cache[blocks, pos % page]


def dequantize(cache, scale, seq, length, block_table, dtype):
    """K or V of one sequence in ``dtype``: the cache's values times the scale (per tensor or
    per token and head)."""
    x = gather_cache(cache, seq, length, block_table).to(dtype)
    if scale is None:
        return x
    if scale.ndim == 0:
        return x * scale.to(dtype)
    return x * gather_cache(scale, seq, length, block_table).to(dtype)[..., None]


def ref_decode_attention(q, k_cache, v_cache, cache_seqlens, *, block_table=None,
                         softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0,
                         k_scale=None, v_scale=None, num_splits=None, return_lse=False):
    """Decode attention in PyTorch: each sequence's K and V gathered (pages through the block
    table, fp8 dequantized in q's dtype: float64 for the reference) and handed to
    :func:`tkit.specs.attention.ref_attention`, whose bottom-right masks place the new tokens
    at the end of the sequence."""
    b, sq, hq, d = q.shape
    max_len = k_cache.shape[1] if block_table is None else \
        block_table.shape[1] * k_cache.shape[1]
    outs, lses = [], []
    for i, n in enumerate(cache_seqlens.tolist()):
        n = min(max(n, 0), max_len)
        k = dequantize(k_cache, k_scale, i, n, block_table, q.dtype)
        v = dequantize(v_cache, v_scale, i, n, block_table, q.dtype)
        o, lse = ref_attention(q[i:i + 1], k[None], v[None], causal=causal,
                               softmax_scale=softmax_scale, window_size=window_size,
                               softcap=softcap, return_lse=True)
        outs.append(o)
        lses.append(lse)
    out = torch.cat(outs) if outs else q.new_zeros(q.shape)
    if not return_lse:
        return out
    lse = torch.cat(lses) if lses else q.new_zeros((b, hq, sq), dtype=torch.float32)
    return out, lse


def ref_merge_attention_states(o_a, lse_a, o_b, lse_b):
    """PyTorch: weights from the lse's (a part of weight 0 contributes nothing)."""
    wide = torch.float64 if o_a.dtype == torch.float64 else torch.float32
    lse = torch.logaddexp(lse_a.to(wide), lse_b.to(wide))
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, 0.0)
    if o_a.ndim == 3:  # (tokens, heads, dim) with lse (heads, tokens)
        wa, wb = (torch.exp(x.to(wide) - safe).transpose(0, 1)[..., None] for x in (lse_a, lse_b))
    else:  # (batch, seq, heads, dim) with lse (batch, heads, seq)
        wa, wb = (torch.exp(x.to(wide) - safe).transpose(1, 2)[..., None] for x in (lse_a, lse_b))
    o = torch.where(wa > 0, wa * o_a.to(wide), 0.0) + torch.where(wb > 0, wb * o_b.to(wide), 0.0)
    lse = torch.where(finite, lse, float("-inf"))
    return o.to(o_a.dtype), lse if wide == torch.float64 else lse.float()


def ref_append_kv(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None):
    """The caches (and per-token scales) after the write, as new tensors (functional): fp8
    quantized as x / scale saturated to +-448, per-token-head scales amax / 448. A cache
    with a scale is an fp8 cache even when given upcast (the reference's float64 copy): its
    values are then the fp8 values."""
    outs = []
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        cache = cache.clone()
        scale = scale.clone() if scale is not None and scale.ndim > 0 else scale
        page = cache.shape[1]
        for t, s in enumerate(slot_mapping.tolist()):
            if s < 0 or s >= cache.shape[0] * page:
                continue
            blk, row = divmod(s, page)
            xt = x[t]
            if cache.dtype == FP8 or scale is not None:  # an fp8 cache (maybe upcast here)
                xf = xt.float()
                if scale is None or scale.ndim == 0:
                    sc = scale.float() if scale is not None else torch.ones((), device=x.device)
                    y = xf / sc
                else:
                    amax = xf.abs().amax(-1)
                    # amax / 448 rounded once (torch's CUDA division by a Python scalar
                    # multiplies by its float32 reciprocal: a last-bit error)
                    sc = torch.where(amax > 0, (amax.double() / 448.0).float(),
                                     torch.ones_like(amax))
                    scale[blk, row] = sc
                    y = xf / sc[:, None]
                cache[blk, row] = y.clamp(-448.0, 448.0).to(FP8)
            else:
                cache[blk, row] = xt.to(cache.dtype)
        outs.append((cache, scale))
    return outs


# ---- inputs ----------------------------------------------------------------------------------
def _lengths(batch: int, max_len: int, mode: str, gen: torch.Generator) -> list[int]:
    if mode == "full":
        return [max_len] * batch
    if mode == "mixed":  # 1 .. max_len, log-uniform: many short sequences, a few long ones
        logs = torch.rand(batch, generator=gen) * torch.log(torch.tensor(float(max_len)))
        lens = torch.exp(logs).round().clamp(1, max_len).long().tolist()
        lens[0] = max_len  # the longest the cache allows is in every mixed batch
        return lens
    raise ValueError(mode)


def paged_table(batch: int, blocks_per_seq: int, num_blocks: int, gen: torch.Generator,
                order: str = "shuffled") -> torch.Tensor:
    """(batch, blocks_per_seq) block indices: ``shuffled`` is a random permutation of the
    blocks (every page in its own block), ``ordered`` the blocks in order."""
    n = batch * blocks_per_seq
    if num_blocks < n:
        raise ValueError(f"{num_blocks} blocks cannot hold {n} distinct pages")
    idx = torch.randperm(num_blocks, generator=gen)[:n] if order == "shuffled" else \
        torch.arange(n)
    return idx.reshape(batch, blocks_per_seq).to(I32)


def _decode_case(b, hq, hk, d, max_len, *, sq=1, page=None, lengths="full", fp8=None,
                 dtype=BF16, group="dense", label=None, causal=True, **kw):
    """One decode case. ``page``: None for a dense cache, else the page size (blocks in a
    shuffled order); ``fp8``: None, "tensor" or "token" (per-token-head scales)."""

    def build(device):
        gen = torch.Generator().manual_seed(b * 7 + max_len)
        lens = _lengths(b, max_len, lengths, gen)
        q = make_tensor((b, sq, hq, d), dtype, seed=1, device=device)
        if page is None:
            shape = (b, max_len, hk, d)
            table = None
        else:
            per_seq = -(-max_len // page)
            shape = (b * per_seq, page, hk, d)
            table = paged_table(b, per_seq, b * per_seq, gen).to(device)
        cache_dtype = FP8 if fp8 else dtype
        k = make_tensor(shape, cache_dtype, seed=2, device=device)
        v = make_tensor(shape, cache_dtype, seed=3, device=device)
        kwargs = dict(cache_seqlens=torch.tensor(lens, dtype=I32, device=device),
                      block_table=table, causal=causal, **kw)
        if fp8 == "tensor":
            kwargs.update(k_scale=torch.tensor(0.05, device=device),
                          v_scale=torch.tensor(0.02, device=device))
        elif fp8 == "token":
            kwargs.update(k_scale=0.05 + 0.01 * torch.rand(shape[:3], generator=gen).to(device),
                          v_scale=0.02 + 0.01 * torch.rand(shape[:3], generator=gen).to(device))
        return (q, k, v), kwargs

    opts = "".join(f" {k}={v}" for k, v in kw.items())
    lab = label or (f"B{b} Sq{sq} H{hq}/{hk} D{d} L{max_len}"
                    + (" dense" if page is None else f" page{page} shuffled")
                    + (f" {lengths}" if lengths != "full" else "")
                    + (f" fp8/{fp8}" if fp8 else "") + opts)
    return Case(lab, build, group, meta=dict(batch=b, seqlen_q=sq, heads=hq, heads_kv=hk,
                                             head_dim=d, max_len=max_len, page_size=page or 0))


def bench_cases():
    """The shapes decode attention is judged on: B=32 Hq=32 Hkv=8 D=128 L=8192 bf16 dense, paged
    with pages of 16 and 64 in shuffled order; one long sequence; many short ones; mixed
    lengths; fp8 caches with per-token-head scales; 4 new tokens; D=64 and D=256; one short
    sequence."""
    return [
        _decode_case(32, 32, 8, 128, 8192),
        _decode_case(32, 32, 8, 128, 8192, page=16, group="paged"),
        _decode_case(32, 32, 8, 128, 8192, page=64, group="paged"),
        _decode_case(1, 32, 8, 128, 131072, group="long"),
        _decode_case(128, 32, 8, 128, 1024, group="many"),
        _decode_case(32, 32, 8, 128, 32768, page=64, lengths="mixed", group="mixed"),
        _decode_case(32, 32, 8, 128, 8192, page=64, fp8="token", group="fp8"),
        _decode_case(32, 32, 8, 128, 8192, sq=4, group="seqlen_q"),
        _decode_case(32, 32, 8, 128, 8192, sq=4, page=64, group="seqlen_q"),
        _decode_case(32, 32, 8, 64, 8192, group="head_dim"),
        _decode_case(32, 32, 8, 256, 8192, group="head_dim"),
        # one short sequence (a local chat's step): launch and prologue costs, not HBM
        _decode_case(1, 32, 8, 128, 4096, group="short"),
    ]


def check_cases():
    f16 = torch.float16

    def mixed(device):
        gen = torch.Generator().manual_seed(5)
        q = make_tensor((3, 2, 4, 64), f16, seed=1, device=device)
        k = make_tensor((12, 16, 2, 64), f16, seed=2, device=device)
        v = make_tensor((12, 16, 2, 64), f16, seed=3, device=device)
        table = paged_table(3, 4, 12, gen).to(device)
        table[2] = table[0]  # sequence 2 shares sequence 0's pages (a shared prefix)
        lens = torch.tensor([50, 0, 17], dtype=I32, device=device)
        return (q, k, v), dict(cache_seqlens=lens, block_table=table, num_splits=3,
                               window_size=(20, -1), softcap=10.0, return_lse=True)

    return [
        _decode_case(2, 4, 2, 64, 40, dtype=f16, return_lse=True),
        _decode_case(2, 4, 1, 32, 48, sq=3, page=8, dtype=f16, lengths="mixed"),
        _decode_case(1, 2, 2, 64, 33, page=4, fp8="token", dtype=f16),
        Case("B3 Sq2 H4/2 D64 page16 shared pages window softcap", mixed, "paged"),
    ]


def _kv_dense(q, k_cache, v_cache, cache_seqlens, block_table=None):
    """K and V as dense (batch, heads_kv, L, head_dim) tensors for SDPA, where the case has
    one length for every sequence (SDPA takes no per-sequence lengths)."""
    lens = cache_seqlens.tolist()
    if len(set(lens)) > 1:
        raise NotImplementedError("SDPA takes no per-sequence lengths")
    n = lens[0] if lens else 0
    if block_table is None:
        return k_cache[:, :n].transpose(1, 2), v_cache[:, :n].transpose(1, 2)
    b = q.shape[0]
    ks = torch.stack([gather_cache(k_cache, i, n, block_table) for i in range(b)])
    vs = torch.stack([gather_cache(v_cache, i, n, block_table) for i in range(b)])
    return ks.transpose(1, 2).contiguous(), vs.transpose(1, 2).contiguous()


def _sdpa_decode(backend_name: str):
    """SDPA's flash or cuDNN backend on the dense equivalent of a case's cache (a paged cache
    is gathered once per case, outside the timed calls: SDPA has no paging); q of one token,
    or several without a causal mask (SDPA's causal mask is top-left aligned)."""

    def factory():
        if not ON_GPU:
            return None
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        held: dict = {}

        def run(q, k_cache, v_cache, cache_seqlens, *, block_table=None, softmax_scale=None,
                causal=True, window_size=(-1, -1), softcap=0.0, k_scale=None, v_scale=None,
                num_splits=None, return_lse=False):
            if k_cache.dtype == FP8:
                raise NotImplementedError("SDPA has no fp8 KV cache")
            if tuple(window_size) != (-1, -1) or softcap:
                raise NotImplementedError("SDPA has no window/softcap")
            if causal and q.shape[1] > 1:
                raise NotImplementedError("SDPA's causal mask is top-left aligned")
            key = (q, k_cache, v_cache, cache_seqlens, block_table)
            if held.get("key") is None or any(a is not b for a, b in zip(held["key"], key)):
                held.clear()
                held["key"] = key  # holds the tensors: their ids cannot be reused meanwhile
                held["kv"] = _kv_dense(q, k_cache, v_cache, cache_seqlens, block_table)
            k, v = held["kv"]
            with sdpa_kernel(backend):
                o = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k, v, scale=softmax_scale,
                    enable_gqa=q.shape[2] != k.shape[1])
            return o.transpose(1, 2)

        return run

    return factory


def cost_decode(q, k_cache, v_cache, cache_seqlens=None, **kw):
    return DA.cost(q, k_cache, v_cache, cache_seqlens, **kw)


# ---- fuzz recipe -----------------------------------------------------------------------------
HEAD_DIMS = (16, 32, 40, 64) if not ON_GPU else (16, 64, 80, 128, 256)  # 16: see attention's
PAGE_SIZES = (1, 2, 4, 8, 16) if not ON_GPU else (1, 8, 16, 64, 256)


@lazy_composite
def decode_shapes(draw):
    """(q, k_cache, v_cache) shapes: q (B, Sq, Hq, D), caches (B * blocks_per_seq, page,
    Hkv, D) (a dense view is made of them by :func:`fuzz_decode` when ``paged`` is False)."""
    b = draw(st.sampled_from((1, 1, 2, 3)))
    sq = draw(st.sampled_from((1, 1, 2, 3, 4, 16)))
    hk = draw(st.sampled_from((1, 2)))
    hq = hk * draw(st.sampled_from((1, 2, 4, 5)))
    d = draw(st.sampled_from(HEAD_DIMS))
    page = draw(st.sampled_from(PAGE_SIZES))
    per_seq = draw(st.integers(1, max(1, 64 // page)))
    return (b, sq, hq, d), (b * per_seq, page, hk, d), (b * per_seq, page, hk, d)


def decode_tables(tensors, dtype, device):
    """(cache_seqlens, block_table) from a seed of the shapes: lengths among 0, 1, page +- 1,
    odd and full; the blocks shuffled, some pages shared between sequences."""
    q, k = tensors[0], tensors[1]
    b, page = q.shape[0], k.shape[1]
    per_seq = k.shape[0] // b
    max_len = per_seq * page
    gen = torch.Generator().manual_seed(q.shape[1] * 1009 + k.shape[0] * 31 + page)
    choices = sorted({0, 1, page - 1, page, page + 1, max_len - 1, max_len,
                      max_len // 2 + 1} & set(range(0, max_len + 1)))
    lens = [choices[int(i)] for i in torch.randint(0, len(choices), (b,), generator=gen)]
    if b > 1 and lens.count(0) == b:
        lens[0] = max_len
    table = paged_table(b, per_seq, k.shape[0], gen)
    if b > 1:  # share: sequence 1 takes sequence 0's first pages
        n = int(torch.randint(0, per_seq + 1, (1,), generator=gen))
        table[1, :n] = table[0, :n]
    return (torch.tensor(lens, dtype=I32, device=device), table.to(device))


def _fuzz_inputs(q, k, v, block_table, paged, fp8):
    """The caches and scales a fuzz example calls with: dense views when not ``paged``; fp8
    caches quantized from k, v (per tensor, or per token and head from their amax)."""
    if not paged:
        b = q.shape[0]
        k = k.reshape(b, -1, *k.shape[2:])
        v = v.reshape(b, -1, *v.shape[2:])
        block_table = None
    ks = vs = None
    if fp8 == "tensor":
        ks = torch.tensor(0.01, device=q.device)
        vs = torch.tensor(0.02, device=q.device)
        k = (k.float() / ks).clamp(-448, 448).to(FP8)
        v = (v.float() / vs).clamp(-448, 448).to(FP8)
    elif fp8 == "token":
        ks = (k.float().abs().amax(-1) / 448.0).clamp_min(1e-6)
        vs = (v.float().abs().amax(-1) / 448.0).clamp_min(1e-6)
        k = (k.float() / ks[..., None]).clamp(-448, 448).to(FP8)
        v = (v.float() / vs[..., None]).clamp(-448, 448).to(FP8)
    return k, v, block_table, ks, vs


def fuzz_decode(q, k, v, cache_seqlens, block_table, paged=True, fp8=None, **kw):
    k, v, bt, ks, vs = _fuzz_inputs(q, k, v, block_table, paged, fp8)
    return tkit.decode_attention(q, k, v, cache_seqlens, block_table=bt, k_scale=ks,
                                 v_scale=vs, **kw)


def fuzz_decode_ref(q, k, v, cache_seqlens, block_table, paged=True, fp8=None, **kw):
    # the fp8 caches are quantized from float32 copies, as in fuzz_decode (the inputs here are
    # float64 copies of the same values, so the fp8 bits are the same)
    k, v, bt, ks, vs = _fuzz_inputs(q, k.float(), v.float(), block_table, paged, fp8)
    return ref_decode_attention(q, k, v, cache_seqlens, block_table=bt, k_scale=ks,
                                v_scale=vs, **kw)


def decode_options():
    window = st.one_of(st.just((-1, -1)), st.tuples(st.integers(-1, 20), st.integers(-1, 4)))
    return st.fixed_dictionaries({
        "paged": st.booleans(),
        "fp8": st.sampled_from((None, None, "tensor", "token")),
        "causal": st.booleans(),
        "window_size": window,
        "softcap": st.sampled_from((0.0, 0.0, 5.0)),
        "num_splits": st.sampled_from((None, None, 1, 2, 3, 7)),
        "return_lse": st.booleans(),
    })


def _fuzz():
    dtypes = (torch.float16, torch.bfloat16) if ON_GPU else (torch.float16, torch.float32)
    return dict(fn=fuzz_decode, reference=fuzz_decode_ref, shapes=decode_shapes(),
                dtypes=dtypes, layouts=("contiguous", "sliced", "offset", "transposed"),
                extra_args=decode_tables, kwargs=decode_options())


# ---- append_kv and merge: specs -----------------------------------------------------------------
def fuzz_append(k, v, k_cache, v_cache, fp8=None):
    """append_kv on copies of the caches, returning them (the op works in place)."""
    slots = _slots(k.shape[0], k_cache.shape[0] * k_cache.shape[1], k.device)
    kc, vc, ks, vs = _append_targets(k_cache, v_cache, fp8)
    tkit.append_kv(k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
    return _append_result(kc, vc, ks, vs, fp8)


def fuzz_append_ref(k, v, k_cache, v_cache, fp8=None):
    slots = _slots(k.shape[0], k_cache.shape[0] * k_cache.shape[1], k.device)
    kc, vc, ks, vs = _append_targets(k_cache.to(k.dtype if fp8 is None else torch.float32),
                                     v_cache.to(k.dtype if fp8 is None else torch.float32), fp8)
    (kc, ks), (vc, vs) = ref_append_kv(k.float() if fp8 else k, v.float() if fp8 else v,
                                       kc, vc, slots, k_scale=ks, v_scale=vs)
    return _append_result(kc, vc, ks, vs, fp8)


def _slots(tokens, n_slots, device):
    gen = torch.Generator().manual_seed(tokens * 13 + n_slots)
    slots = torch.randperm(n_slots, generator=gen)[:tokens]
    slots = torch.cat([slots, torch.full((max(0, tokens - n_slots),), -1)])
    if tokens > 1:
        slots[1] = -1  # a skipped token
    return slots.to(device)


def _append_targets(k_cache, v_cache, fp8):
    kc, vc = k_cache.clone(), v_cache.clone()
    ks = vs = None
    if fp8:
        kc, vc = kc.float().to(FP8), vc.float().to(FP8)
        if fp8 == "tensor":
            ks = torch.tensor(0.01, device=kc.device)
            vs = torch.tensor(0.02, device=kc.device)
        else:
            ks = torch.ones(kc.shape[:3], device=kc.device)
            vs = torch.ones(vc.shape[:3], device=vc.device)
    return kc, vc, ks, vs


def _append_result(kc, vc, ks, vs, fp8):
    if not fp8:
        return kc, vc
    # the comparison is on the fp8 bits' values (and the scales): exact in both
    out = (kc.float(), vc.float())
    if fp8 == "token":
        out += (ks, vs)
    return out


def _append_cases():
    def build(tokens, blocks, page, hk, d, dtype, fp8=None):
        def make(device):
            k = make_tensor((tokens, hk, d), dtype, seed=1, device=device)
            v = make_tensor((tokens, hk, d), dtype, seed=2, device=device)
            cdt = FP8 if fp8 else dtype
            kc = make_tensor((blocks, page, hk, d), cdt, seed=3, device=device)
            vc = make_tensor((blocks, page, hk, d), cdt, seed=4, device=device)
            gen = torch.Generator().manual_seed(tokens)
            slots = torch.randperm(blocks * page, generator=gen)[:tokens].to(device)
            kw = dict(slot_mapping=slots)
            if fp8 == "token":
                kw.update(k_scale=torch.ones((blocks, page, hk), device=device),
                          v_scale=torch.ones((blocks, page, hk), device=device))
            return (k, v, kc, vc), kw

        return make

    return build


def append_bench_cases():
    b = _append_cases()
    return [Case("4096 tokens H8 D128 page16", b(4096, 8192, 16, 8, 128, BF16), "append",
                 meta=dict(tokens=4096, heads_kv=8, head_dim=128)),
            Case("4096 tokens H8 D128 page16 fp8/token", b(4096, 8192, 16, 8, 128, BF16, "token"),
                 "append", meta=dict(tokens=4096, heads_kv=8, head_dim=128))]


def append_check_cases():
    b = _append_cases()
    return [Case("37 tokens H2 D40 page8", b(37, 8, 8, 2, 40, torch.float16), "append")]


def _append_call(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    """tkit.append_kv (in place), returning the caches (and per-token scales) it wrote: a
    function of its inputs for the reference rule, and no copies in the timed call. Calling
    it twice writes the same values again (the reference's peer sees the written caches)."""
    tkit.append_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    per_token = k_scale is not None and k_scale.ndim > 0
    return (k_cache, v_cache) + ((k_scale, v_scale) if per_token else ())


def _torch_append(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    """torch's own scatter into the cache (index_copy_ over the flattened slots): caches of
    k's dtype only, every slot valid (no -1 skips)."""
    if k_cache.dtype != k.dtype:
        raise NotImplementedError("index_copy_ does not quantize: same-dtype caches only")
    h, d = k.shape[1:]
    k_cache.view(-1, h, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, h, d).index_copy_(0, slot_mapping, v)
    return k_cache, v_cache


_COPY_DST: dict = {}


def _copy_same_bytes(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    """Not an append: k and v copied into contiguous buffers of their own size, the copy rate
    a kernel moving these bytes can reach (the copy ceiling is measured over 1 GiB; at tens
    of MB the launch and the ramp of the memory system weigh on any kernel)."""
    key = (k.shape, k.dtype, k.device)
    if key not in _COPY_DST:
        _COPY_DST.clear()
        _COPY_DST[key] = (torch.empty_like(k), torch.empty_like(v))
    dk, dv = _COPY_DST[key]
    dk.copy_(k)
    dv.copy_(v)
    return k_cache, v_cache


def _append_ref(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    (kc, ks), (vc, vs) = ref_append_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale,
                                       v_scale=v_scale)
    per_token = k_scale is not None and k_scale.ndim > 0
    return (kc, vc) + ((ks, vs) if per_token else ())


def cost_append(k, v, k_cache, v_cache, slot_mapping=None, **kw):
    """k and v read, the same tokens written in the cache's dtype (and scales)."""
    t, hk, d = k.shape
    write = 2 * t * hk * d * k_cache.element_size()
    if kw.get("k_scale") is not None and kw["k_scale"].ndim:
        write += 2 * t * hk * 4
    return Cost(2 * k.numel() * k.element_size() + write + slot_mapping.numel() * 8)


def _fuzz_append():
    @lazy_composite
    def shapes(draw):
        t = draw(st.sampled_from((0, 1, 2, 7, 16)))
        hk = draw(st.sampled_from((1, 2, 3)))
        d = draw(st.sampled_from((16, 40, 64)))
        page = draw(st.sampled_from((1, 4, 16)))
        blocks = draw(st.integers(1, 4))
        return (t, hk, d), (t, hk, d), (blocks, page, hk, d), (blocks, page, hk, d)

    dtypes = (torch.float16, torch.bfloat16) if ON_GPU else (torch.float16, torch.float32)
    return dict(fn=fuzz_append, reference=fuzz_append_ref, shapes=shapes(), dtypes=dtypes,
                layouts=("contiguous", "sliced"),
                kwargs=st.fixed_dictionaries({"fp8": st.sampled_from((None, "tensor",
                                                                      "token"))}),
                floor=0.0)


def _merge_case(b, s, h, d, dtype=BF16, label=None, group="merge"):
    def make(device):
        oa = make_tensor((b, s, h, d), dtype, seed=1, device=device)
        ob = make_tensor((b, s, h, d), dtype, seed=2, device=device)
        la = make_tensor((b, h, s), torch.float32, seed=3, device=device)
        lb = make_tensor((b, h, s), torch.float32, seed=4, device=device)
        return (oa, la, ob, lb), {}

    return Case(label or f"B{b} S{s} H{h} D{d}", make, group, meta=dict(batch=b, heads=h))


def cost_merge(o_a, lse_a, o_b, lse_b):
    return Cost(3 * o_a.numel() * o_a.element_size() + 3 * lse_a.numel() * 4)


@lazy_composite
def merge_shapes(draw):
    b = draw(st.sampled_from((1, 2, 3)))
    s = draw(st.sampled_from((1, 2, 5)))
    h = draw(st.sampled_from((1, 3, 8)))
    d = draw(st.sampled_from((16, 40, 64, 128)))
    return (b, s, h, d), (b, h, s), (b, s, h, d), (b, h, s)


def fuzz_merge(o_a, lse_a, o_b, lse_b):
    # lse as float32 whatever the fuzzed dtype (the op takes float32 lse's)
    return tkit.merge_attention_states(o_a, lse_a.float(), o_b, lse_b.float())


def _fuzz_merge():
    dtypes = (torch.float16, torch.bfloat16) if ON_GPU else (torch.float16, torch.float32)
    return dict(fn=fuzz_merge, reference=ref_merge_attention_states, shapes=merge_shapes(),
                dtypes=dtypes, layouts=("contiguous", "sliced", "transposed"))


# ---- opcheck -----------------------------------------------------------------------------------
def _dev():
    return "cuda" if ON_GPU else "cpu"


def _opcheck_decode():
    dev = _dev()
    q = make_tensor((2, 2, 4, 32), torch.float32, seed=1, device=dev)
    k = make_tensor((6, 8, 2, 32), torch.float32, seed=2, device=dev)
    v = make_tensor((6, 8, 2, 32), torch.float32, seed=3, device=dev)
    table = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=I32, device=dev)
    lens = torch.tensor([19, 3], dtype=I32, device=dev)
    return torch.ops.tkit.decode_attention.default, (q, k, v, lens, table, None, None,
                                                     32 ** -0.5, -1, 0, 0.0, 2), {}


def _opcheck_append():
    dev = _dev()
    k = make_tensor((3, 2, 16), torch.float32, seed=1, device=dev)
    v = make_tensor((3, 2, 16), torch.float32, seed=2, device=dev)
    kc = make_tensor((2, 4, 2, 16), torch.float32, seed=3, device=dev)
    vc = make_tensor((2, 4, 2, 16), torch.float32, seed=4, device=dev)
    slots = torch.tensor([5, -1, 0], dtype=torch.int64, device=dev)
    return torch.ops.tkit.append_kv.default, (k, v, kc, vc, slots, None, None), {}


def _opcheck_merge():
    dev = _dev()
    oa = make_tensor((2, 1, 3, 16), torch.float32, seed=1, device=dev)
    ob = make_tensor((2, 1, 3, 16), torch.float32, seed=2, device=dev)
    la = make_tensor((2, 3, 1), torch.float32, seed=3, device=dev)
    lb = make_tensor((2, 3, 1), torch.float32, seed=4, device=dev)
    return torch.ops.tkit.merge_attention_states.default, (oa, la, ob, lb), {}


SPECS = [
    OpSpec(name="decode_attention", family="attention", fn=tkit.decode_attention,
           reference=ref_decode_attention, cost=cost_decode, bench_cases=bench_cases,
           check_cases=check_cases, fuzz=_fuzz,
           baselines={"sdpa_flash": _sdpa_decode("FLASH_ATTENTION"),
                      "sdpa_cudnn": _sdpa_decode("CUDNN_ATTENTION")},
           opcheck=_opcheck_decode, bound="memory",
           doc="bytes: K and V of every valid token read once (+ scales), q read, out written"),
    OpSpec(name="append_kv", family="attention", fn=_append_call, reference=_append_ref,
           cost=cost_append, bench_cases=append_bench_cases, check_cases=append_check_cases,
           fuzz=_fuzz_append, opcheck=_opcheck_append, bound="memory",
           baselines={"torch index_copy_": eager_baseline(_torch_append),
                      "copy of k, v (same bytes)": eager_baseline(_copy_same_bytes)},
           doc="fn returns copies of the caches after tkit.append_kv (which works in place); "
               "bytes: k, v read and written once (the timed call includes the copies)"),
    OpSpec(name="merge_attention_states", family="attention", fn=tkit.merge_attention_states,
           reference=ref_merge_attention_states, cost=cost_merge,
           bench_cases=lambda: [_merge_case(32, 1, 32, 128)],
           check_cases=lambda: [_merge_case(2, 3, 4, 40, torch.float16)], fuzz=_fuzz_merge,
           opcheck=_opcheck_merge, bound="memory"),
]
