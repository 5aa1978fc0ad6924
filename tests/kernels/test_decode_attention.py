"""Decode attention over a (paged) KV cache, append_kv, merge_attention_states: fuzzing against
the float64 reference (fp16/fp32 and fp8 caches), targeted lengths / pages / GQA / head dims /
splits, round trips, merging, clamping of garbage tables and lengths, errors, registration."""

import dataclasses

import pytest
import torch

import tkit
from tkit import registry
from tkit.kernels import decode as DA
from tkit.specs import decode_attention as S
from tkit.testing import check_against_reference, fuzz, make_tensor, poisoned_outputs

ON_GPU = torch.cuda.is_available()
DTYPES = (torch.float16, torch.bfloat16) if ON_GPU else (torch.float16, torch.float32)
I32 = torch.int32
FP8 = torch.float8_e4m3fn
SPEC = registry.get("decode_attention")


def _dev():
    return "cuda" if ON_GPU else "cpu"


def _paged(b, sq, hq, hk, d, page, per_seq, dtype, seed=0, extra_blocks=0):
    """q, k_cache, v_cache (b * per_seq + extra_blocks blocks) and a shuffled block table."""
    dev = _dev()
    nb = b * per_seq + extra_blocks
    q = make_tensor((b, sq, hq, d), dtype, seed=seed, device=dev)
    k = make_tensor((nb, page, hk, d), dtype, seed=seed + 1, device=dev)
    v = make_tensor((nb, page, hk, d), dtype, seed=seed + 2, device=dev)
    gen = torch.Generator().manual_seed(seed + 3)
    table = S.paged_table(b, per_seq, nb, gen).to(dev)
    return q, k, v, table


def _lens(*n):
    return torch.tensor(n, dtype=I32, device=_dev())


# ---- fuzzing -------------------------------------------------------------------------------
def test_fuzz_decode():
    recipe = dict(SPEC.fuzz())
    fn, ref = recipe.pop("fn"), recipe.pop("reference")
    fuzz(fn, ref, **recipe, max_examples=None if ON_GPU else 40)


@pytest.mark.parametrize("name", ["append_kv", "merge_attention_states"])
def test_fuzz_append_and_merge(name):
    recipe = dict(registry.get(name).fuzz())
    fn, ref = recipe.pop("fn"), recipe.pop("reference")
    fuzz(fn, ref, **recipe, max_examples=None if ON_GPU else 20)


@pytest.mark.parametrize("name", ["decode_attention", "append_kv", "merge_attention_states"])
def test_check_cases(name):
    spec = registry.get(name)
    for case in spec.check_cases():
        args, kwargs = case.make(_dev())
        check_against_reference(spec.fn, spec.reference, args, kwargs, ulps=spec.ulps)


# ---- targeted cases ------------------------------------------------------------------------
@pytest.mark.parametrize("page", [1, 4, 16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_lengths_around_pages(page, dtype):
    # interpreter tiles are 16 keys: page 32 holds two tiles, page 4 gathers four pages a tile
    per_seq = max(1, 48 // page) + 1
    q, k, v, table = _paged(6, 1, 4, 2, 32, page, per_seq, dtype, seed=page)
    n = per_seq * page
    lens = _lens(0, 1, page - 1 if page > 1 else 2, page + 1, 2 * page + 1 if 2 * page < n else n,
                 n)
    check_against_reference(tkit.decode_attention, S.ref_decode_attention, [q, k, v, lens],
                            dict(block_table=table, return_lse=True))


@pytest.mark.parametrize("sq, hq, hk", [(1, 1, 1), (1, 8, 1), (4, 8, 2), (16, 2, 2), (3, 6, 2)])
def test_gqa_and_seqlen_q(sq, hq, hk):
    # rows = sq * group: 1, 8, 16, 32 (two interpreter M tiles), 9 (padded)
    q, k, v, table = _paged(2, sq, hq, hk, 64, 8, 5, torch.float16, seed=sq * 10 + hq)
    for causal in (True, False):
        check_against_reference(tkit.decode_attention, S.ref_decode_attention,
                                [q, k, v, _lens(37, 11)],
                                dict(block_table=table, causal=causal, return_lse=True))


@pytest.mark.parametrize("d", [16, 40, 64, 96, 128, 256])
def test_head_dims_dense(d):
    dev = _dev()
    q = make_tensor((2, 2, 4, d), torch.float16, seed=d, device=dev)
    k = make_tensor((2, 35, 2, d), torch.float16, seed=d + 1, device=dev)
    v = make_tensor((2, 35, 2, d), torch.float16, seed=d + 2, device=dev)
    check_against_reference(tkit.decode_attention, S.ref_decode_attention,
                            [q, k, v, _lens(35, 18)], dict(return_lse=True))


@pytest.mark.parametrize("opts", [
    dict(window_size=(5, -1)), dict(window_size=(17, -1), causal=False),
    dict(window_size=(0, 0), causal=False), dict(window_size=(3, 2), causal=False),
    dict(softcap=2.0), dict(softcap=30.0, window_size=(9, -1)), dict(softmax_scale=0.3),
])
def test_window_softcap(opts):
    q, k, v, table = _paged(2, 3, 4, 2, 32, 8, 6, torch.float32, seed=7)
    check_against_reference(tkit.decode_attention, S.ref_decode_attention,
                            [q, k, v, _lens(45, 3)],
                            dict(block_table=table, return_lse=True, **opts))


@pytest.mark.parametrize("splits", [1, 2, 3, 5, 128])
def test_splits(splits):
    q, k, v, table = _paged(2, 2, 4, 2, 32, 8, 10, torch.float16, seed=11)
    lens = _lens(80, 9)  # 5 tiles and 1 tile: most splits of sequence 1 are empty
    check_against_reference(tkit.decode_attention, S.ref_decode_attention, [q, k, v, lens],
                            dict(block_table=table, num_splits=splits, return_lse=True))


def test_splits_agree_with_one_split():
    q, k, v, table = _paged(1, 1, 2, 1, 64, 16, 6, torch.float32, seed=12)
    lens = _lens(90)
    one = tkit.decode_attention(q, k, v, lens, block_table=table, num_splits=1,
                                return_lse=True)
    for s in (2, 4, 6):
        many = tkit.decode_attention(q, k, v, lens, block_table=table, num_splits=s,
                                     return_lse=True)
        torch.testing.assert_close(many[0], one[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(many[1], one[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("d,splits", [(32, 3), (64, 7)])
def test_splits_merged_in_the_split_kernel(d, splits):
    """The last split of each (sequence, kv head, M tile) to finish merges the partials (no
    combine launch): against the reference and the combine launch, with an empty sequence,
    a window and two queries, at 3 and 7 splits."""
    q, k, v, table = _paged(3, 2, 8, 2, d, 8, 14, torch.float16, seed=171)
    lens = _lens(104, 0, 17)
    kw = dict(block_table=table, return_lse=True, window_size=(20 * splits, -1))
    with DA.decode_config(block_n=16, num_splits=splits):
        want, want_lse = tkit.decode_attention(q, k, v, lens, **kw)
    with DA.decode_config(block_n=16, num_splits=splits, combine="fused"), poisoned_outputs():
        got, got_lse = check_against_reference(tkit.decode_attention, S.ref_decode_attention,
                                               [q, k, v, lens], kw)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="combine"), DA.decode_config(combine="merge"):
        tkit.decode_attention(q, k, v, lens, block_table=table, num_splits=2)


def test_shared_pages_and_overlong_table():
    # sequences 0 and 2 share pages (a common prefix), table columns past the length hold -1
    q, k, v, table = _paged(3, 1, 4, 2, 32, 4, 6, torch.float16, seed=13)
    table[2, :3] = table[0, :3]
    table[1, 2:] = -1
    check_against_reference(tkit.decode_attention, S.ref_decode_attention,
                            [q, k, v, _lens(24, 8, 13)], dict(block_table=table))


@pytest.mark.parametrize("mode", ["tensor", "token"])
@pytest.mark.parametrize("paged", [False, True])
def test_fp8_cache(mode, paged):
    dev = _dev()
    q = make_tensor((2, 2, 4, 64), torch.float16, seed=21, device=dev)
    kf = make_tensor((8, 8, 2, 64), torch.float32, seed=22, device=dev)
    vf = make_tensor((8, 8, 2, 64), torch.float32, seed=23, device=dev)
    table = S.paged_table(2, 4, 8, torch.Generator().manual_seed(1)).to(dev)
    k, v, bt, ks, vs = S._fuzz_inputs(q, kf, vf, table, paged, mode)
    assert k.dtype == FP8 and (ks.ndim == 0) == (mode == "tensor")
    check_against_reference(tkit.decode_attention, S.ref_decode_attention,
                            [q, k, v, _lens(32, 13)],
                            dict(block_table=bt, k_scale=ks, v_scale=vs, return_lse=True))


def test_bf16_in_the_interpreter():
    # bf16 arithmetic is wrong in the interpreter unless the kernel upcasts (docs/FACTS.md)
    q, k, v, table = _paged(2, 2, 4, 2, 32, 8, 4, torch.bfloat16, seed=31)
    check_against_reference(tkit.decode_attention, S.ref_decode_attention,
                            [q, k, v, _lens(30, 5)], dict(block_table=table))


def test_strided_inputs():
    # q and the caches as views: q transposed in memory, caches every other element of d
    dev = _dev()
    q = make_tensor((2, 1, 4, 32), torch.float16, "transposed", seed=41, device=dev)
    k = make_tensor((6, 8, 2, 32), torch.float16, "sliced", seed=42, device=dev)
    v = make_tensor((6, 8, 2, 32), torch.float16, "offset", seed=43, device=dev)
    table = torch.tensor([[5, 0, 3], [1, 4, 2]], dtype=I32, device=dev)
    check_against_reference(tkit.decode_attention, S.ref_decode_attention,
                            [q, k, v, _lens(20, 17)], dict(block_table=table))


def test_zero_length_gives_zero_and_minus_inf():
    q, k, v, table = _paged(2, 3, 2, 1, 16, 4, 2, torch.float16, seed=51)
    with poisoned_outputs():
        out, lse = tkit.decode_attention(q, k, v, _lens(0, 2), block_table=table,
                                         num_splits=2, return_lse=True)
    assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf"))
    # 2 keys, 3 new tokens, causal: the first query (position -1) sees nothing
    assert torch.all(out[1, 0] == 0) and torch.all(lse[1, :, 0] == float("-inf"))
    assert torch.isfinite(out[1, 1:]).all() and torch.isfinite(lse[1, :, 1:]).all()


# ---- split heuristic ---------------------------------------------------------------------
def test_device_defaults_for_head_dim_128(monkeypatch):
    """The GPU table's D=128 rows (read outside the interpreter): fp8 takes the word pipeline
    at 2 warps counting 4 programs an SM; a dense 16-bit cache one split of 8 warps only while
    the grid is one wave of three programs an SM; paged 16-bit caches 4 warps, 2 stages,
    their splits merged in the split kernel when pages are smaller than a tile."""
    from tkit.kernels.decode import config as DC

    monkeypatch.setattr(DC._env, "INTERPRET", False)
    fp8 = DC.DecodeConfig.for_device(128, 1)
    assert (fp8.num_warps, fp8.block_n, fp8.num_stages, fp8.ctas_per_sm) == (2, 64, 5, 4)
    one_wave = DC.DecodeConfig.for_device(128, 2, paged=False, programs=256, sms=132)
    assert (one_wave.num_warps, one_wave.num_stages, one_wave.split_bytes) == (8, 3, 4 << 20)
    waves = DC.DecodeConfig.for_device(128, 2, paged=False, programs=1024, sms=132)
    paged = DC.DecodeConfig.for_device(128, 2, paged=True, page_size=64)
    assert waves == paged and (paged.num_warps, paged.num_stages) == (4, 2)
    assert paged.combine == "launch" and fp8.combine == "launch"
    page16 = DC.DecodeConfig.for_device(128, 2, paged=True, page_size=16)
    assert page16 == dataclasses.replace(paged, combine="fused")


def test_fp8_default_takes_the_wgmma_where_it_applies(monkeypatch):
    """Outside the interpreter (meta tensors plan as the H200): a paged fp8 cache at D=128
    with pages of 64 keys or more, 16-bit queries, at most 8 packed rows a kv head and an
    unsplit grid of 80-100% of one wave of 2 programs an SM (B27-B33 at 8 kv heads) that
    plans one split gets the fp8 wgmma (128-key tiles, 4 warps, 8-row M tiles); other
    batches, more rows, float32 queries, smaller pages, a dense cache or keys enough for
    several splits keep the word pipeline."""
    from tkit.kernels.decode import config as DC

    monkeypatch.setattr(DC._env, "INTERPRET", False)

    def plan(sq=1, hq=32, dtype=torch.bfloat16, page=64, paged=True, b=32, n=8192):
        q = torch.empty((b, sq, hq, 128), dtype=dtype, device="meta")
        k = torch.empty((b * n // page, page, 8, 128), dtype=FP8, device="meta")
        table = torch.empty((b, n // page), dtype=I32, device="meta")
        if not paged:
            k, table = k.reshape(b, n, 8, 128), None
        splits, cfg, block_m, _ = DA.plan_splits(q, k, table)
        return splits, cfg.qk, cfg.block_n, cfg.num_warps, block_m

    assert plan() == plan(b=27) == plan(b=33) == (1, "wgmma_fp8", 128, 4, 8)
    assert plan(page=256)[1:] == plan(hq=64)[1:] == ("wgmma_fp8", 128, 4, 8)
    for other in (plan(sq=4), plan(hq=64, sq=2), plan(dtype=torch.float32), plan(page=16),
                  plan(paged=False), plan(b=16), plan(b=24), plan(b=40), plan(b=64),
                  plan(n=32768)):
        assert other[1:4] == ("mma", 64, 2)


def test_dense_head_dim_256_splits(monkeypatch):
    """Outside the interpreter (meta tensors plan as the H200, 132 SMs): a dense 16-bit cache
    at D=256 streams up to 8 MB a split, so B32 Hkv8 L8192 (256 programs, one wave of 2 an
    SM) runs unsplit, as the D=128 dense default does; one long sequence still splits to
    fill the SMs, and a paged cache keeps the 2 MB floor."""
    from tkit.kernels.decode import config as DC

    monkeypatch.setattr(DC._env, "INTERPRET", False)

    def splits(b, n, d=256, paged=False):
        q = torch.empty((b, 1, 32, d), dtype=torch.bfloat16, device="meta")
        k = torch.empty((b, n, 8, d), dtype=torch.bfloat16, device="meta")
        table = None
        if paged:
            k, table = k.reshape(b * n // 64, 64, 8, d), torch.empty((b, n // 64), dtype=I32,
                                                                       device="meta")
        return DA.plan_splits(q, k, table)[0]

    assert splits(32, 8192) == 1 and splits(32, 8192, d=128) == 1
    assert splits(32, 8192, paged=True) == 4  # 8 MB a program over the 2 MB floor
    assert 16 <= splits(1, 131072) < splits(1, 131072, paged=True)


@pytest.mark.parametrize("unaligned", [False, True])
def test_fp8_wgmma_default_and_its_fallback(monkeypatch, unaligned):
    """The GPU default planned for the fp8 wgmma (made the default here: the H200's table and
    capability) runs it where the cache reads as words, and where it does not (a cache one
    byte off alignment) falls back to the word default's own tiles (128-key wgmma tiles
    against 64-key word tiles: a sub-tile derived before the fallback would skip every
    tile): against the reference either way."""
    from tkit.kernels import _device
    from tkit.kernels.decode import config as DC

    real = DC.DecodeConfig.for_device

    def gpu_table(*args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(DC._env, "INTERPRET", False)
            return real(*args, **kwargs)

    monkeypatch.setattr(DC.DecodeConfig, "for_device", gpu_table)
    monkeypatch.setattr(_device, "CPU_CAPABILITY", (9, 0))
    if _dev() != "cpu":
        pytest.skip("the interpreter's run of the GPU default")
    # 4 sequences x 2 kv heads: 8 programs, one wave of 2 an SM on the interpreter's 4 SMs
    q, k, v, table = _paged(4, 1, 8, 2, 128, 64, 3, torch.bfloat16, seed=211)
    gen = torch.Generator().manual_seed(23)
    ks = torch.rand(k.shape[:-1], generator=gen) + 0.5
    vs = torch.rand(k.shape[:-1], generator=gen) + 0.5
    k8, v8 = k.to(FP8), v.to(FP8)
    if unaligned:
        k8, v8 = (torch.empty(x.numel() + 1, dtype=FP8)[1:].view(x.shape).copy_(x)
                  for x in (k8, v8))
    seen = _launches(monkeypatch)
    with poisoned_outputs():
        check_against_reference(tkit.decode_attention, S.ref_decode_attention,
                                [q, k8, v8, _lens(150, 37, 90, 1)],
                                dict(block_table=table, k_scale=ks, v_scale=vs))
    assert [(x.get("QK_WG"), x["BLOCK_N"]) for x in seen] == ([] if unaligned else [(True, 128)])


def test_choose_num_splits():
    # the bench shapes on 132 SMs, two programs an SM, 64-key tiles, 2 MB of K+V a split
    def splits(b, hk, length, d=128, itemsize=2):
        floor = -(-2 * length * d * itemsize // (2 << 20))
        return DA.choose_num_splits(b * hk, -(-length // 64), 132, min_splits=floor)

    assert splits(32, 8, 8192) == 2       # 512 programs, 1.94 waves of 264
    assert splits(128, 8, 1024) == 1      # 1024 programs already fill the machine
    assert splits(1, 8, 131072) == 32     # 256 programs for one long sequence
    assert splits(1, 8, 4096) == 16       # few programs, short: one an SM, 4 tiles each
    assert splits(1, 8, 16384) == 16      # 16 tiles a split: still one an SM
    assert splits(1, 8, 16385) == 29      # 17 tiles: two an SM (the rule below)
    assert splits(2, 8, 4096) == 8
    assert splits(4, 8, 4096) == 8        # 32 programs: the rule below
    assert splits(32, 8, 32768) == 8      # the longest of a mixed batch in 4096-key runs
    assert DA.choose_num_splits(4, 3, 132) == 3  # never more splits than tiles
    assert DA.choose_num_splits(0, 10, 132) == 1


def test_num_splits_from_shapes_only():
    # the plan reads shapes, never cache_seqlens (no host sync; capturable in a CUDA graph);
    # 1024 keys: 8 tiles of the GPU's 128-key default, 64 of the interpreter's 16
    q, k, v, table = _paged(1, 1, 4, 1, 32, 16, 64, torch.float16)
    a = DA.plan_splits(q, k, table)
    with DA.decode_config(num_splits=3):
        assert DA.plan_splits(q, k, table)[0] == 3
    assert DA.plan_splits(q, k, table, num_splits=5)[0] == 5
    # at most one split per tile of block_n keys (the device's default block_n)
    tiles = -(-table.shape[1] * k.shape[1] // a[1].block_n)
    assert DA.plan_splits(q, k, table, num_splits=1000)[0] == tiles
    assert a[0] >= 1
    with pytest.raises(TypeError, match="unknown DecodeConfig field"):
        with DA.decode_config(blok_n=32):
            pass


def test_config_override_gives_same_results():
    q, k, v, table = _paged(2, 2, 4, 2, 32, 8, 6, torch.float16, seed=61)
    lens = _lens(47, 20)
    ref = tkit.decode_attention(q, k, v, lens, block_table=table)
    with DA.decode_config(block_n=32, num_splits=2):
        other = tkit.decode_attention(q, k, v, lens, block_table=table)
    torch.testing.assert_close(other, ref, atol=2e-3, rtol=0)


@pytest.mark.parametrize("page", [8, 32])
def test_sub_tiles_match_whole_tiles(page):
    """Tiles of 64 keys taken in sub-tiles of 16 (the fp8 default's structure: block_n 128,
    sub_n 32 on a GPU): an fp8 cache with per-token scales, windowed and causal, several
    splits and several seqlen_q; against the reference and against whole 64-key tiles."""
    q, k, v, table = _paged(3, 2, 8, 2, 32, page, 128 // page, torch.float16, seed=83)
    k8, v8 = k.to(FP8), v.to(FP8)
    ks = (torch.rand(k.shape[:-1], generator=torch.Generator().manual_seed(5)) + 0.5).to(k.device)
    vs = (torch.rand(k.shape[:-1], generator=torch.Generator().manual_seed(6)) + 0.5).to(k.device)
    lens = _lens(128, 77, 5)
    kw = dict(block_table=table, k_scale=ks, v_scale=vs, window_size=(50, -1),
              return_lse=True)
    with DA.decode_config(block_n=64, sub_n=16, num_splits=2):
        sub = check_against_reference(tkit.decode_attention, S.ref_decode_attention,
                                      [q, k8, v8, lens], kw)
    with DA.decode_config(block_n=64, num_splits=2):
        whole = tkit.decode_attention(q, k8, v8, lens, **kw)
    torch.testing.assert_close(sub, whole, atol=2e-3, rtol=0)


@pytest.mark.parametrize("mode, page", [("token", None), ("token", 4), ("tensor", 32)])
def test_fp8_words_in_the_pipeline(mode, page):
    """The pipelined loops read an fp8 cache of head dim >= 64 as int32 words of 4 values
    (four float16 quarters a word, dotted apart): against the reference with a window,
    softcap, sub-tiles, two splits and two queries, lengths of 0 and 1, and against whole
    tiles."""
    b, d = 4, 64
    q, k, v, table = _paged(b, 2, 4, 2, d, page or 64, 64 // (page or 64), torch.float16,
                            seed=91)
    kw = dict(window_size=(40, -1), softcap=20.0, return_lse=True, num_splits=2)
    if page is None:
        k, v = k.reshape(b, 64, 2, d), v.reshape(b, 64, 2, d)
    else:
        kw["block_table"] = table
    gen = torch.Generator().manual_seed(9)
    if mode == "tensor":
        ks, vs = (torch.tensor(x, device=k.device) for x in (0.7, 1.3))
    else:
        ks = (torch.rand(k.shape[:-1], generator=gen) + 0.5).to(k.device)
        vs = (torch.rand(k.shape[:-1], generator=gen) + 0.5).to(k.device)
    k, v = k.to(FP8), v.to(FP8)
    kw.update(k_scale=ks, v_scale=vs)
    lens = _lens(64, 37, 0, 1)
    with DA.decode_config(block_n=32, sub_n=16), poisoned_outputs():
        got, got_lse = check_against_reference(tkit.decode_attention, S.ref_decode_attention,
                                               [q, k, v, lens], kw)
    with DA.decode_config(block_n=32):
        want, want_lse = tkit.decode_attention(q, k, v, lens, **kw)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
    assert torch.equal(torch.isinf(got_lse), torch.isinf(want_lse))


@pytest.mark.parametrize("paged", [False, True])
def test_fp8_head_dim_128_default(paged):
    """fp8 caches at head dim 128 under the default config (on a GPU the word pipeline at 2
    warps and 5 stages, two K/V tiles in flight even when paged): bfloat16 queries against
    the reference, with a window, per-token scales and a sequence shorter than a tile."""
    b, d, page = 3, 128, 16
    q, k, v, table = _paged(b, 1, 8, 2, d, page, 6, torch.bfloat16, seed=97)
    kw = dict(window_size=(70, -1), return_lse=True)
    if paged:
        kw["block_table"] = table
    else:
        k, v = k.reshape(b, 6 * page, 2, d), v.reshape(b, 6 * page, 2, d)
    gen = torch.Generator().manual_seed(11)
    ks = (torch.rand(k.shape[:-1], generator=gen) + 0.5).to(k.device)
    vs = (torch.rand(k.shape[:-1], generator=gen) + 0.5).to(k.device)
    with poisoned_outputs():
        check_against_reference(tkit.decode_attention, S.ref_decode_attention,
                                [q, k.to(FP8), v.to(FP8), _lens(96, 41, 9)],
                                dict(kw, k_scale=ks, v_scale=vs))


def test_fp8_words_clamp_garbage():
    """The word pipeline under garbage block indices and lengths (registered op, no
    validation): blocks clamp to [0, num_blocks - 1], lengths to the table."""
    d = 64
    q, k, v, table = _paged(4, 2, 4, 2, d, 16, 3, torch.float32, seed=103)
    k8, v8 = _guarded(k.to(FP8)), _guarded(v.to(FP8))
    nb = k.shape[0]
    bad = table.clone()
    bad[0, 1] = 10**9
    bad[1, 0] = -(2**31)
    bad[2] = torch.tensor([nb, -1, 2**31 - 1], dtype=I32)
    lens = _lens(48, 10**6, -5, 2**31 - 1)
    with DA.decode_config(block_n=16), poisoned_outputs():
        out, lse = torch.ops.tkit.decode_attention(q, k8, v8, lens, bad, None, None,
                                                   d ** -0.5, -1, 0, 0.0, 2)
    ref, ref_lse = S.ref_decode_attention(q.double(), k8.double(), v8.double(),
                                          lens.clamp(0, 48), block_table=bad.clamp(0, nb - 1),
                                          return_lse=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=0)


def _launches(monkeypatch, keep=lambda kw: "QK_WG" in kw or "FP8_WORDS" in kw):
    """The launch arguments of the calls that follow for which ``keep`` holds (a spy on the
    launcher; by default the split kernel's fp8 word and wgmma launches)."""
    from tkit.kernels import _common

    seen, launch = [], _common.launch

    def spy(kernel, grid, **kw):
        if keep(kw):
            seen.append(kw)
        return launch(kernel, grid, **kw)

    monkeypatch.setattr(_common, "launch", spy)
    return seen


@pytest.mark.parametrize("layout, hq, block_m", [("page8", 4, 8), ("page16", 8, 16),
                                                  ("dense", 8, 16)])
def test_fp8_scores_by_fp8_mma(monkeypatch, layout, hq, block_m):
    """``qk="wgmma_fp8"``: the scores transposed (keys as M) with the query split into hi and
    lo fp8 parts, the softmax along the keys: against the reference with per-token scales, a
    window, softcap, two splits, three queries, lengths 0 and 1, rows of very different
    magnitudes (per-row scales of the split), and against the word path. Interpreter tiles
    of 16 keys: page 8 puts two pages in a tile, page 16 one; 6 packed rows in a tile of 8,
    12 in a tile of 16."""
    b, sq, hk, d = 4, 3, 2, 64
    page = 8 if layout == "page8" else 16
    q, k, v, table = _paged(b, sq, hq, hk, d, page, 64 // page, torch.float16, seed=191)
    q[0, 0, 1] *= 300.0
    q[1, 2, 2] *= 0.01
    kw = dict(window_size=(40, -1), softcap=20.0, return_lse=True, num_splits=2)
    if layout == "dense":
        k, v = k.reshape(b, 64, hk, d), v.reshape(b, 64, hk, d)
    else:
        kw["block_table"] = table
    gen = torch.Generator().manual_seed(13)
    kw["k_scale"] = (torch.rand(k.shape[:-1], generator=gen) + 0.5).to(k.device)
    kw["v_scale"] = (torch.rand(k.shape[:-1], generator=gen) + 0.5).to(k.device)
    k, v = k.to(FP8), v.to(FP8)
    lens = _lens(64, 37, 0, 1)
    seen = _launches(monkeypatch)
    with DA.decode_config(qk="wgmma_fp8"), poisoned_outputs():
        got, got_lse = check_against_reference(tkit.decode_attention, S.ref_decode_attention,
                                               [q, k, v, lens], kw)
    assert [(x.get("QK_WG"), x["BLOCK_M"]) for x in seen] == [(True, block_m)]
    want, want_lse = tkit.decode_attention(q, k, v, lens, **kw)
    torch.testing.assert_close(got, want, atol=4e-3, rtol=0)
    assert torch.equal(torch.isinf(got_lse), torch.isinf(want_lse))
    torch.testing.assert_close(got_lse, want_lse, atol=2e-3, rtol=0)


def test_fp8_scores_by_fp8_mma_rows(monkeypatch):
    """``qk="wgmma_fp8"`` with 20 packed rows (two M tiles of 16, the second partial), a
    per-tensor scale and bfloat16 queries; where the fp8 MMA does not apply (head dim 48: no
    power of 2; float32 queries, whose scores it would round to bfloat16's precision) the
    other paths run."""
    dtype = torch.bfloat16
    q, k, v, table = _paged(2, 5, 8, 2, 64, 16, 4, dtype, seed=193)
    ks, vs = (torch.tensor(x, device=k.device) for x in (0.7, 1.3))
    kw = dict(block_table=table, k_scale=ks, v_scale=vs, return_lse=True)
    seen = _launches(monkeypatch)
    with DA.decode_config(qk="wgmma_fp8"):
        check_against_reference(tkit.decode_attention, S.ref_decode_attention,
                                [q, k.to(FP8), v.to(FP8), _lens(64, 30)], kw)
        q48, k48, v48 = q[..., :48].contiguous(), k[..., :48], v[..., :48]
        check_against_reference(tkit.decode_attention, S.ref_decode_attention,
                                [q48, k48.to(FP8), v48.to(FP8), _lens(50, 7)], kw)
        check_against_reference(tkit.decode_attention, S.ref_decode_attention,
                                [q.float(), k.to(FP8), v.to(FP8), _lens(64, 30)], kw)
    # the other paths' M tiles are their own (16 in the interpreter, 32 on a GPU)
    assert [x.get("QK_WG") for x in seen] == [True, None, None] and seen[0]["BLOCK_M"] == 16
    with pytest.raises(ValueError, match="qk"), DA.decode_config(qk="wgmma"):
        tkit.decode_attention(q, k.to(FP8), v.to(FP8), _lens(64, 30), **kw)


_WG = dict(qk="wgmma_fp8", num_warps=4)
#: (queries, config overrides, a cache misaligned by one byte, the fp8 wgmma expected)
_WG_GPU = [(1, {}, False, True), (4, {}, False, False), (1, {}, True, False),
           (4, dict(_WG, block_n=128, num_stages=5), False, True),
           (1, dict(_WG, block_n=64, num_stages=3), False, True),
           (1, dict(qk="mma"), False, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("sq, cfg, unaligned, wg", _WG_GPU)
def test_fp8_scores_by_fp8_mma_compiled(monkeypatch, sq, cfg, unaligned, wg):
    """``qk="wgmma_fp8"`` compiled for sm_90 at the bench case's structure (page 64 shuffled,
    GQA 4, D 128, per-token scales, bfloat16 queries; 32 sequences up to 2048 keys, some
    shorter than a tile): the default (the wgmma at one query, 8 rows a tile; the word
    pipeline at 4 queries, and where a cache one byte off 16-byte alignment cannot be read
    as words), other tiles and stages, 16 rows a tile, and the word path over the default's
    other fields: against the reference and the word pipeline's output."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the fp8 wgmma is sm_90's")
    # 32 sequences x 8 kv heads: one wave of 2 programs an SM, where the default takes it
    q, k, v, table = _paged(32, sq, 32, 8, 128, 64, 32, torch.bfloat16, seed=201)
    gen = torch.Generator().manual_seed(17)
    ks = (torch.rand(k.shape[:-1], generator=gen) + 0.5).to(k.device) / 64
    vs = (torch.rand(k.shape[:-1], generator=gen) + 0.5).to(k.device) / 64
    k8, v8 = (k * 64).to(FP8), (v * 64).to(FP8)
    if unaligned:
        k8, v8 = (torch.empty(x.numel() + 1, dtype=FP8, device=x.device)[1:].view(x.shape)
                  .copy_(x) for x in (k8, v8))
    lens = _lens(*[2048, 1000, 37, 1531] * 8)
    kw = dict(block_table=table, k_scale=ks, v_scale=vs, return_lse=True)
    seen = _launches(monkeypatch)
    with DA.decode_config(**cfg), poisoned_outputs():
        got, got_lse = check_against_reference(tkit.decode_attention, S.ref_decode_attention,
                                               [q, k8, v8, lens], kw)
    # (the spy sees the word and wgmma launches: none for a cache read a byte at a time)
    assert [x.get("QK_WG") for x in seen] == ([] if unaligned else [True if wg else None])
    assert not wg or seen[0]["BLOCK_M"] == (4 * sq if sq > 1 else 8)
    with DA.decode_config(qk="mma", block_n=64, num_warps=2, num_stages=5, ctas_per_sm=4):
        want, want_lse = tkit.decode_attention(q, k8, v8, lens, **kw)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-2, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("d, sq, dtype", [(64, 4, torch.float16), (256, 2, torch.bfloat16)])
def test_fp8_scores_by_fp8_mma_shapes(monkeypatch, d, sq, dtype):
    """``qk="wgmma_fp8"`` compiled for sm_90 at head dims 64 and 256, 16 packed rows a tile
    (GQA 4 x 4 queries) and 8 (2 x 4), a window, softcap, three splits, a tensor scale for V
    and per-token scales for K, page 16 (four pages a 64-key tile)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the fp8 wgmma is sm_90's")
    q, k, v, table = _paged(3, sq, 16, 4, d, 16, 40, dtype, seed=203 + d)
    gen = torch.Generator().manual_seed(19)
    ks = (torch.rand(k.shape[:-1], generator=gen) + 0.5).to(k.device)
    vs = torch.tensor(0.8, device=k.device)
    kw = dict(block_table=table, k_scale=ks, v_scale=vs, return_lse=True, num_splits=3,
              window_size=(300, -1), softcap=30.0)
    seen = _launches(monkeypatch)
    with DA.decode_config(qk="wgmma_fp8", num_warps=4), poisoned_outputs():
        check_against_reference(tkit.decode_attention, S.ref_decode_attention,
                                [q, k.to(FP8), v.to(FP8), _lens(640, 64, 333)], kw)
    assert [(x.get("QK_WG"), x["BLOCK_M"]) for x in seen] == [(True, 16 if sq == 4 else 8)]


# ---- append_kv, merge ----------------------------------------------------------------------
@pytest.mark.parametrize("fp8", [None, "tensor", "token"])
def test_append_kv_round_trip(fp8):
    """Tokens appended through slot_mapping then read by decode_attention give attention over
    those tokens (fp8: over their quantized values)."""
    dev = _dev()
    b, hk, d, page, per_seq = 2, 2, 32, 4, 5
    nb = b * per_seq
    table = S.paged_table(b, per_seq, nb, torch.Generator().manual_seed(3)).to(dev)
    lens = [17, 6]
    k = make_tensor((sum(lens), hk, d), torch.float16, seed=71, device=dev)
    v = make_tensor((sum(lens), hk, d), torch.float16, seed=72, device=dev)
    slots = []
    for i, n in enumerate(lens):
        for p in range(n):
            slots.append(int(table[i, p // page]) * page + p % page)
    slots = torch.tensor(slots, dtype=torch.int64, device=dev)
    cdt = FP8 if fp8 else torch.float16
    kc = torch.zeros((nb, page, hk, d), dtype=cdt, device=dev)
    vc = torch.zeros((nb, page, hk, d), dtype=cdt, device=dev)
    ks = vs = None
    if fp8 == "tensor":
        ks, vs = torch.tensor(0.01, device=dev), torch.tensor(0.02, device=dev)
    elif fp8 == "token":
        ks = torch.full((nb, page, hk), float("nan"), device=dev)
        vs = torch.full((nb, page, hk), float("nan"), device=dev)
    tkit.append_kv(k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
    (rk, rks), (rv, rvs) = S.ref_append_kv(
        k, v, torch.zeros_like(kc), torch.zeros_like(vc), slots,
        k_scale=torch.full_like(ks, float("nan")) if fp8 == "token" else ks,
        v_scale=torch.full_like(vs, float("nan")) if fp8 == "token" else vs)
    assert torch.equal(kc.float(), rk.float()) and torch.equal(vc.float(), rv.float())
    if fp8 == "token":
        assert torch.equal(ks.nan_to_num(-1), rks.nan_to_num(-1))
        assert torch.equal(vs.nan_to_num(-1), rvs.nan_to_num(-1))
    # decode over the written cache = attention over the same (dequantized) tokens
    q = make_tensor((b, 1, 4, d), torch.float16, seed=73, device=dev)
    out = tkit.decode_attention(q, kc, vc, _lens(*lens), block_table=table, k_scale=ks,
                                v_scale=vs)
    starts = [0, lens[0]]
    for i, n in enumerate(lens):
        kk, vv = k[starts[i]:starts[i] + n].double(), v[starts[i]:starts[i] + n].double()
        if fp8:
            pos = slots[starts[i]:starts[i] + n]
            kk = kc.view(nb * page, hk, d)[pos].double() * (
                ks.view(nb * page, hk)[pos][..., None].double() if fp8 == "token"
                else ks.double())
            vv = vc.view(nb * page, hk, d)[pos].double() * (
                vs.view(nb * page, hk)[pos][..., None].double() if fp8 == "token"
                else vs.double())
        ref = S.ref_attention(q[i:i + 1].double(), kk[None], vv[None], causal=True)
        assert (out[i:i + 1].double() - ref).abs().max() < 2e-3


@pytest.mark.parametrize("formats", [("token", None), (None, "tensor"), ("tensor", "token")])
def test_append_kv_keys_and_values_in_different_formats(formats):
    """One launch writes both caches: each follows its own format (fp8 with per-token or
    per-tensor scales, or the input dtype), equal to the reference bit for bit."""
    dev = _dev()
    t, hk, d, page, nb = 13, 3, 48, 4, 5
    k = make_tensor((t, hk, d), torch.bfloat16, seed=91, device=dev)
    v = make_tensor((t, hk, d), torch.bfloat16, seed=92, device=dev)
    slots = torch.randperm(nb * page, generator=torch.Generator().manual_seed(5))[:t].to(dev)
    caches, scales = [], []
    for i, fmt in enumerate(formats):
        cdt = FP8 if fmt else torch.bfloat16
        caches.append(torch.full((nb, page, hk, d), 3.0, device=dev).to(cdt))
        scales.append(torch.tensor(0.015 * (i + 1), device=dev) if fmt == "tensor" else
                      torch.full((nb, page, hk), float("nan"), device=dev) if fmt == "token"
                      else None)
    refs = [(c.clone(), s.clone() if s is not None else None) for c, s in zip(caches, scales)]
    tkit.append_kv(k, v, caches[0], caches[1], slots, k_scale=scales[0], v_scale=scales[1])
    (rk, rks), (rv, rvs) = S.ref_append_kv(k, v, refs[0][0], refs[1][0], slots,
                                           k_scale=refs[0][1], v_scale=refs[1][1])
    assert torch.equal(caches[0].float(), rk.float()), "k_cache"
    assert torch.equal(caches[1].float(), rv.float()), "v_cache"
    for fmt, got, want in zip(formats, scales, (rks, rvs)):
        if fmt == "token":
            assert torch.equal(got.nan_to_num(-1), want.nan_to_num(-1))


def test_append_kv_skips_and_dense_cache():
    dev = _dev()
    k = make_tensor((3, 2, 16), torch.float32, seed=81, device=dev)
    v = make_tensor((3, 2, 16), torch.float32, seed=82, device=dev)
    kc = torch.zeros((2, 10, 2, 16), device=dev)  # dense: (batch, max_len, ...) = page 10
    vc = torch.zeros((2, 10, 2, 16), device=dev)
    slots = torch.tensor([13, -1, 0], dtype=torch.int64, device=dev)
    tkit.append_kv(k, v, kc, vc, slots)
    assert torch.equal(kc[1, 3], k[0]) and torch.equal(vc[0, 0], v[2])
    assert int((kc != 0).any(-1).any(-1).sum()) == 2


def test_merge_of_two_halves_equals_the_whole():
    dev = _dev()
    b, hq, hk, d, n, m = 2, 4, 2, 32, 50, 21
    for sq, causal in ((1, True), (3, False)):
        q = make_tensor((b, sq, hq, d), torch.float32, seed=91 + sq, device=dev)
        k = make_tensor((b, n, hk, d), torch.float32, seed=92, device=dev)
        v = make_tensor((b, n, hk, d), torch.float32, seed=93, device=dev)
        whole = tkit.decode_attention(q, k, v, _lens(n, n), causal=causal, return_lse=True)
        first = tkit.decode_attention(q, k[:, :m], v[:, :m], _lens(m, m), causal=causal,
                                      return_lse=True)
        rest = tkit.decode_attention(q, k[:, m:], v[:, m:], _lens(n - m, n - m), causal=causal,
                                     return_lse=True)
        o, lse = tkit.merge_attention_states(first[0], first[1], rest[0], rest[1])
        torch.testing.assert_close(o, whole[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, whole[1], atol=1e-5, rtol=1e-5)


def test_merge_with_empty_parts_and_token_major():
    dev = _dev()
    oa = make_tensor((5, 3, 16), torch.float16, seed=1, device=dev)
    ob = make_tensor((5, 3, 16), torch.float16, seed=2, device=dev)
    la = make_tensor((3, 5), torch.float32, seed=3, device=dev)
    lb = make_tensor((3, 5), torch.float32, seed=4, device=dev)
    la[0] = float("-inf")
    lb[0, :2] = float("-inf")
    o, lse = tkit.merge_attention_states(oa, la, ob, lb)
    ro, rl = S.ref_merge_attention_states(oa.double(), la.double(), ob.double(), lb.double())
    assert torch.all(o[:2, 0] == 0) and torch.all(lse[0, :2] == float("-inf"))
    torch.testing.assert_close(o.double(), ro, atol=2e-3, rtol=0)
    torch.testing.assert_close(lse.double(), rl, atol=1e-6, rtol=0)


# ---- memory safety: garbage tables and lengths are clamped --------------------------------
def _guarded(x, guard=64):
    """``x``'s values inside a larger buffer of NaN: a read outside ``x`` poisons the output."""
    buf = torch.full((x.numel() + 2 * guard,), float("nan"), dtype=x.dtype, device=x.device)
    buf[guard:guard + x.numel()] = x.reshape(-1)
    return buf[guard:guard + x.numel()].view(x.shape)


@pytest.mark.parametrize("page", [2, 16])
def test_garbage_block_table_and_lengths_are_clamped(page):
    """The registered op does not validate (the public function does): garbage reaches the
    kernel. Block indices clamp to [0, num_blocks - 1], lengths to [0, max_blocks * page]."""
    q, k, v, table = _paged(4, 2, 4, 2, 32, page, 3, torch.float32, seed=101)
    k, v = _guarded(k), _guarded(v)
    nb = k.shape[0]
    bad = table.clone()
    bad[0, 1] = 10**9
    bad[1, 0] = -(2**31)
    bad[2] = torch.tensor([nb, -1, 2**31 - 1], dtype=I32)
    lens = _lens(3 * page, 10**6, -5, 2**31 - 1)
    with poisoned_outputs():
        out, lse = torch.ops.tkit.decode_attention(q, k, v, lens, bad, None, None,
                                                   32 ** -0.5, -1, 0, 0.0, 2)
    clamped = bad.clamp(0, nb - 1)
    cl = lens.clamp(0, 3 * page)
    ref, ref_lse = S.ref_decode_attention(q.double(), k.double(), v.double(), cl,
                                          block_table=clamped, return_lse=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    assert torch.all(lse[2] == ref_lse[2].float())  # length -5: nothing visible
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=0)


def test_garbage_lengths_dense():
    dev = _dev()
    q = make_tensor((2, 1, 2, 16), torch.float32, seed=111, device=dev)
    k = _guarded(make_tensor((2, 20, 1, 16), torch.float32, seed=112, device=dev))
    v = _guarded(make_tensor((2, 20, 1, 16), torch.float32, seed=113, device=dev))
    out = torch.ops.tkit.decode_attention(q, k, v, _lens(25, 2**31 - 1), None, None, None,
                                          0.25, -1, 0, 0.0, 0)[0]
    ref = S.ref_decode_attention(q.double(), k.double(), v.double(), _lens(20, 20),
                                 softmax_scale=0.25)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def test_append_kv_skips_slots_outside_the_cache():
    dev = _dev()
    k = make_tensor((3, 1, 16), torch.float32, seed=121, device=dev)
    kc = _guarded(torch.zeros((2, 4, 1, 16), device=dev))
    vc = _guarded(torch.zeros((2, 4, 1, 16), device=dev))
    base = kc._base
    slots = torch.tensor([8, 2**40, 3], dtype=torch.int64, device=dev)
    torch.ops.tkit.append_kv(k, k, kc, vc, slots, None, None)
    assert torch.equal(kc.view(8, 16)[3], k[2, 0])
    assert int((kc != 0).any(-1).sum()) == 1
    assert base[:64].isnan().all() and base[-64:].isnan().all()


# ---- errors name the argument --------------------------------------------------------------
def _small():
    q, k, v, table = _paged(2, 1, 4, 2, 16, 4, 2, torch.float16)
    return q, k, v, table, _lens(5, 8)


@pytest.mark.parametrize("change, exc, match", [
    (lambda a: a.update(block_table=a["block_table"].long()), TypeError, "block_table"),
    (lambda a: a.update(block_table=a["block_table"][:1]), ValueError, r"block_table must be"),
    (lambda a: a.update(cache_seqlens=_lens(5, 9)), ValueError,
     r"cache_seqlens\[1\] = 9 is outside \[0, block_table.shape\[1\] \* page_size = 8\]"),
    (lambda a: a.update(cache_seqlens=_lens(5)), ValueError, "cache_seqlens must have batch"),
    (lambda a: a.update(cache_seqlens=a["cache_seqlens"].long()), TypeError, "cache_seqlens"),
    (lambda a: a.update(k_cache=a["k_cache"][:, :3], v_cache=a["v_cache"][:, :3]), ValueError,
     "page_size = 3"),
    (lambda a: a.update(k_cache=a["k_cache"].float(), v_cache=a["v_cache"].float()), TypeError,
     "k_cache has dtype float32 but q has float16"),
    (lambda a: a.update(v_cache=a["v_cache"][..., :8]), ValueError, "k_cache and v_cache"),
    (lambda a: a.update(q=a["q"][:, :, :3]), ValueError, "multiple of the 2 key/value heads"),
    (lambda a: a.update(q=a["q"].expand(2, 17, 4, 16)), ValueError, "seqlen_q = 17"),
    (lambda a: a.update(q=a["q"][:, :, :, :8]), ValueError, "same head_dim, got 8 and 16"),
    (lambda a: a.update(k_scale=torch.tensor(1.0, device=_dev())), ValueError,
     "k_scale is given but k_cache is float16"),
    (lambda a: a.update(num_splits=0), ValueError, "num_splits"),
    (lambda a: a.update(window_size=(2,)), ValueError, "window_size"),
    (lambda a: a["block_table"].__setitem__((1, 1), 4), ValueError,
     r"block_table\[1, 1\] = 4 is outside \[0, num_blocks = 4\)"),
])
def test_errors_name_the_argument(change, exc, match, full_checks):
    q, k, v, table, lens = _small()
    a = dict(q=q, k_cache=k, v_cache=v, cache_seqlens=lens, block_table=table)
    change(a)
    with pytest.raises(exc, match=match):
        tkit.decode_attention(**a)


def test_fp8_scale_shape_error():
    q, k, v, table, lens = _small()
    k8, v8 = k.float().to(FP8), v.float().to(FP8)
    with pytest.raises(ValueError, match=r"k_scale must be a 0-d float32 tensor .* \(4, 4, 2\)"):
        tkit.decode_attention(q, k8, v8, lens, block_table=table,
                              k_scale=torch.ones(4, 4, device=q.device))
    with pytest.raises(TypeError, match="v_scale has dtype float16"):
        tkit.decode_attention(q, k8, v8, lens, block_table=table,
                              v_scale=torch.ones((), dtype=torch.float16, device=q.device))


def test_append_kv_errors(full_checks):
    dev = _dev()
    k = torch.randn(3, 2, 16, device=dev)
    kc = torch.zeros(2, 4, 2, 16, device=dev)
    ok = torch.tensor([0, 1, -1], dtype=torch.int64, device=dev)
    with pytest.raises(TypeError, match="slot_mapping"):
        tkit.append_kv(k, k, kc, kc.clone(), ok.int())
    with pytest.raises(ValueError, match=r"slot_mapping must have one slot per token \(3\)"):
        tkit.append_kv(k, k, kc, kc.clone(), ok[:2])
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 8 is outside \[0, num_blocks"):
        tkit.append_kv(k, k, kc, kc.clone(), torch.tensor([0, 8, 1], device=dev))
    with pytest.raises(ValueError, match="k is .* but k_cache holds"):
        tkit.append_kv(k[:, :1], k[:, :1], kc, kc.clone(), ok)


def test_merge_grid_takes_any_batch():
    """The merge runs one program a (batch, query, head) row on the grid's first axis (up to
    2^31 - 1): batch on the second stopped at CUDA's 65535 (a cascade merge of 70000
    sequences)."""
    from tkit.kernels import _common

    o = torch.empty(70000, 1, 8, 64, dtype=torch.bfloat16, device="meta")
    lse = torch.empty(70000, 8, 1, dtype=torch.float32, device="meta")
    with _common.capture_launches() as launches:
        tkit.merge_attention_states(o, lse, o, lse)
    (lc,) = launches
    assert tuple(lc.grid) == (70000 * 8,)


def test_merge_errors():
    o = torch.zeros(2, 1, 3, 16, device=_dev())
    lse = torch.zeros(2, 3, 1, device=_dev())
    with pytest.raises(ValueError, match=r"lse_b must have shape \(2, 3, 1\)"):
        tkit.merge_attention_states(o, lse, o, lse.transpose(1, 2))
    with pytest.raises(TypeError, match="lse_a has dtype float16"):
        tkit.merge_attention_states(o, lse.half(), o, lse)


# ---- registration --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["decode_attention", "append_kv", "merge_attention_states"])
def test_opcheck(name):
    op, args, kwargs = registry.get(name).opcheck()
    torch.library.opcheck(op, args, kwargs)


@pytest.mark.gpu
def test_cuda_graph_replay_with_new_lengths_and_tables():
    """Captured once at the largest shapes, replayed with new lengths and block tables:
    results exact against eager calls on the same values."""
    q, k, v, table = _paged(4, 1, 8, 2, 128, 16, 32, torch.bfloat16, seed=131)
    lens = _lens(512, 1, 300, 17)
    tkit.decode_attention(q, k, v, lens, block_table=table)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = tkit.decode_attention(q, k, v, lens, block_table=table)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        lens.copy_(torch.randint(0, 513, (4,), generator=gen).to(I32))
        table.copy_(S.paged_table(4, 32, 128, gen))
        g.replay()
        eager = tkit.decode_attention(q, k, v, lens, block_table=table)
        assert torch.equal(out, eager)


@pytest.mark.gpu
def test_cuda_graph_replay_with_splits_merged_in_the_split_kernel():
    """The split merge without a combine launch (fp8, three splits), captured once and
    replayed with new lengths and tables (the graph zeroes its counters each replay): exact
    against eager calls of the same config, close to the combine launch."""
    q, k, v, table = _paged(32, 1, 32, 8, 128, 64, 16, torch.bfloat16, seed=181)
    k, v = k.to(FP8), v.to(FP8)
    gen = torch.Generator().manual_seed(7)
    ks = (torch.rand(k.shape[:-1], generator=gen) + 0.5).to(k.device)
    vs = (torch.rand(k.shape[:-1], generator=gen) + 0.5).to(k.device)
    lens = torch.randint(0, 1025, (32,), generator=gen).to(I32).to(k.device)
    kw = dict(block_table=table, k_scale=ks, v_scale=vs)
    with DA.decode_config(combine="fused", num_splits=3):
        tkit.decode_attention(q, k, v, lens, **kw)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = tkit.decode_attention(q, k, v, lens, **kw)
        for _ in range(3):
            lens.copy_(torch.randint(0, 1025, (32,), generator=gen).to(I32))
            table.copy_(S.paged_table(32, 16, 512, gen))
            g.replay()
            eager = tkit.decode_attention(q, k, v, lens, **kw)
            assert torch.equal(out, eager)
    with DA.decode_config(num_splits=3, combine="launch"):
        torch.testing.assert_close(out, tkit.decode_attention(q, k, v, lens, **kw),
                                   atol=1e-2, rtol=0)


def test_torch_compile_fullgraph():
    q, k, v, table = _paged(2, 2, 4, 2, 32, 8, 3, torch.float16, seed=141)
    lens = _lens(20, 9)
    kn = make_tensor((2, 2, 32), torch.float16, seed=142, device=_dev())
    slots = torch.tensor([int(table[1, 1]) * 8 + 1, int(table[1, 1]) * 8 + 2], device=_dev())
    backend = "inductor" if ON_GPU else "aot_eager"

    def f(q, k, v, lens, table, kn, slots):
        tkit.append_kv(kn, kn, k, v, slots)
        out, lse = tkit.decode_attention(q, k, v, lens, block_table=table, return_lse=True)
        return tkit.merge_attention_states(out, lse, out * 0.5, lse - 1.0)

    k2, v2 = k.clone(), v.clone()
    got = torch.compile(f, fullgraph=True, backend=backend)(q, k, v, lens, table, kn, slots)
    want = f(q, k2, v2, lens, table, kn, slots)
    assert torch.equal(k, k2) and torch.equal(v, v2)  # the in-place append happened once
    torch.testing.assert_close(got, want)


def test_direct_and_dispatched_paths_agree(monkeypatch):
    from tkit.kernels import _common

    q, k, v, table = _paged(2, 1, 4, 2, 32, 8, 3, torch.float16, seed=151)
    args = (q, k, v, _lens(24, 5))
    direct = tkit.decode_attention(*args, block_table=table, return_lse=True)
    monkeypatch.setattr(_common._env, "NO_DIRECT", True)
    dispatched = tkit.decode_attention(*args, block_table=table, return_lse=True)
    assert torch.equal(direct[0], dispatched[0]) and torch.equal(direct[1], dispatched[1])


@pytest.mark.parametrize("block_t,warps", [(1, 4), (2, 2), (8, 4)])
def test_append_kv_tokens_per_program(block_t, warps):
    """append_config's tokens a program and warps write the same caches and per-token scales
    as the default (5 tokens: a partial last block; one skipped slot); bad fields are errors."""
    dev = _dev()
    k = make_tensor((5, 3, 24), torch.float16, seed=101, device=dev)
    v = make_tensor((5, 3, 24), torch.float16, seed=102, device=dev)
    slots = torch.tensor([9, 2, -1, 15, 4], dtype=torch.int64, device=dev)

    def run():
        kc = torch.zeros((2, 8, 3, 24), device=dev).to(torch.float8_e4m3fn)
        vc = torch.zeros((2, 8, 3, 24), dtype=torch.float16, device=dev)
        ks = torch.zeros((2, 8, 3), device=dev)
        tkit.append_kv(k, v, kc, vc, slots, k_scale=ks)
        return kc.view(torch.uint8), vc, ks

    want = run()
    with DA.append_config(block_t=block_t, num_warps=warps):
        got = run()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(TypeError, match="block_tokens"), DA.append_config(block_tokens=2):
        pass
    with pytest.raises(ValueError, match="power of 2"), DA.append_config(block_t=3):
        run()
