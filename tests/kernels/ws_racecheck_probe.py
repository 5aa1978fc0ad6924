"""Launch one warp-specialized Gluon kernel so that compute-sanitizer can watch it.

``python tests/kernels/ws_racecheck_probe.py VARIANT`` launches one variant and prints "done"
(after checking its output). ``tkit`` launches tkit's warp-specialized attention forward
(``_attn_fwd_hopper_ws_kernel``) on a small causal shape. The others launch one probe kernel
whose only shared memory, in ``minimal`` and ``shaped``, is what Triton's ``warp_specialize``
lowering itself uses: the per-warp state bytes the idle worker warps read in their switch loop
and the captured values the default partition hands to the workers (a value loaded from
memory, so that the capture cannot be rematerialised).

* ``minimal``: a 4-warp default partition and two 1-warp workers, no register cap.
* ``shaped``: tkit's partition sizes and register split (4 + 4 + 1 warps, 240 and 24
  registers under a launch cap of 168, so that the lowering adds its setmaxnreg steps).
* ``shaped+FEATURE[+FEATURE...]``: ``shaped`` plus what tkit's kernel has that it lacks, any
  combination of:

  - ``mbar``: mbarriers allocated, initialised and fenced (``fence_async_shared``) before the
    region, as tkit's kernel does with its 1 + 3 * STAGES barriers, and passed to every
    partition (used on a branch never taken, so that they stay live through the region);
  - ``smem``: a large shared allocation before the region (tkit's tiles take 229376 bytes, so
    the lowering's capture bytes sit at ``global_smem+229376`` and up), written by the default
    warps before the region and passed to every partition as the mbarriers are;
  - ``bar0``: a CTA barrier (``gl.thread_barrier``: ``bar.sync 0, 128`` over the 4 default
    warps) before the region;
  - ``tma``: a TMA load into shared memory issued by the 1-warp worker on an mbarrier
    (``expect`` + copy), which the default partition waits on and reads, as tkit's loader and
    consumers do (it brings its own mbarrier and 8 KB tile; with ``smem`` the large
    allocation shrinks by that much so that the total stays tkit's);
  - ``captures``: as many captured values as tkit's call hands over. tkit's
    ``gl.warp_specialize`` passes 22 distinct run-time values (each consumer 18, the loader
    15): 4 TMA descriptors, 7 shared-memory descriptors, the LSE pointer, 5 kernel scalars
    (slb, slh, seqlen_q, seqlen_k, qk_scale) and 5 integers computed in the kernel (b, h, hk,
    m0, n_tiles). The probe passes, to every partition, its output pointer and the loaded base
    (as ``shaped``) plus a second pointer, 5 kernel scalars (4 int32, 1 float32) and 5
    integers computed from the program id with divisions, as ``_tile_origin`` does; with
    ``mbar``, ``smem`` or ``tma`` their shared descriptors are passed too. Every value feeds
    the output (through a select that is never taken), so none is dead.

``LADDER`` lists the variants the racecheck test runs: each feature alone on ``shaped`` and
then added one at a time, up to all five. Triton 3.6 names the TMA copy
``async_copy_global_to_shared`` and the CTA barrier ``thread_barrier``; 3.9 renamed them
``async_load`` and ``barrier`` and made ``worker_num_regs`` optional (the aliases below take
whichever exists). ``compile_sm90(variant)`` compiles a variant for sm_90a without a GPU.
"""

from __future__ import annotations

import re
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

if hasattr(tma, "async_load"):
    tma_load = tma.async_load
else:
    tma_load = tma.async_copy_global_to_shared
cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier

FEATURES = ("mbar", "smem", "bar0", "tma", "captures")
#: every single feature on ``shaped``, then the features added one at a time
LADDER = (["minimal", "shaped"] + [f"shaped+{f}" for f in FEATURES]
          + ["shaped+" + "+".join(FEATURES[:i]) for i in range(2, len(FEATURES) + 1)]
          + ["tkit"])
#: tkit's shared memory below the lowering's bytes (Q, the K/V rings), in bytes
TKIT_TILES = 229376
TILE_N = 64  # the TMA tile: TILE_N x TILE_N float16, 8 KB
TILE = gl.constexpr(TILE_N)
STAGES = gl.constexpr(3)  # mbarriers as tkit's default build: 1 + 3 * STAGES


@gluon.jit
def _partition(out_ptr, base, OFF: gl.constexpr, extra, tile_ptr, bar, tile_smem, bars, big,
               IS_DEFAULT: gl.constexpr, IS_LOADER: gl.constexpr, desc, MBAR: gl.constexpr,
               SMEM: gl.constexpr, TMA: gl.constexpr):
    """Write this partition's slice of the program's outputs (offs + base, plus ``extra``,
    which is 0 but not known to be). The mbarriers and the large buffer are used where the
    loaded base is negative (never), so that they stay live through the region as tkit's
    are. With TMA, the loader partition loads the tile and the default partition waits for it
    and copies it out."""
    NW: gl.constexpr = gl.num_warps()
    offs = gl.arange(0, 32 * NW, layout=gl.BlockedLayout([1], [32], [NW], [0]))
    gl.store(out_ptr + base + OFF + offs, offs + base + extra)
    if base < 0:
        if MBAR:
            mbarrier.arrive(bars.index(0))
        if SMEM:
            lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
            big.index(0).store(gl.full([TILE, TILE], 1.0, gl.float16, lay))
    if TMA:
        if IS_LOADER:
            mbarrier.expect(bar, desc.block_type.nbytes)
            tma_load(desc, [0, 0], bar, tile_smem)
        if IS_DEFAULT:
            mbarrier.wait(bar, 0)
            lay2: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
            tile = tile_smem.load(lay2)
            r = gl.arange(0, TILE, layout=gl.SliceLayout(1, lay2))
            c = gl.arange(0, TILE, layout=gl.SliceLayout(0, lay2))
            pid = gl.program_id(0)
            gl.store(tile_ptr + pid * TILE * TILE + r[:, None] * TILE + c[None, :], tile)


@gluon.jit
def _captured(out_ptr, base, OFF: gl.constexpr, aux_ptr, s1, s2, s3, s4, scale, b, h, hk, m0,
              n_tiles, tile_ptr, bar, tile_smem, bars, big, IS_DEFAULT: gl.constexpr,
              IS_LOADER: gl.constexpr, desc, MBAR: gl.constexpr, SMEM: gl.constexpr,
              TMA: gl.constexpr):
    """``_partition`` with tkit's number of captured values, all of them used."""
    extra = b + h + hk + m0 + n_tiles + s1 + s2 + s3 + s4 + gl.where(scale < -1e30, 1, 0)
    extra = gl.where(extra < 0, extra, 0)  # every term is >= 0: adds 0, but is not dead
    if extra < 0:
        gl.store(aux_ptr, extra)
    _partition(out_ptr, base, OFF, extra, tile_ptr, bar, tile_smem, bars, big, IS_DEFAULT,
               IS_LOADER, desc, MBAR, SMEM, TMA)


@gluon.jit
def _probe_ws_kernel(in_ptr, out_ptr, aux_ptr, tile_ptr, desc, s1, s2, s3, s4, scale,
                     W1: gl.constexpr, W2: gl.constexpr, R1: gl.constexpr, R2: gl.constexpr,
                     MBAR: gl.constexpr, SMEM: gl.constexpr, BIG_BLOCKS: gl.constexpr,
                     BAR0: gl.constexpr, TMA: gl.constexpr, CAPTURES: gl.constexpr):
    """A 4-warp default partition and two workers of W1 and W2 warps (R1, R2 registers), each
    writing its own slice of the program's 128 + 32 * (W1 + W2) outputs; the features of the
    module docstring switched on by the constexpr flags."""
    base = gl.load(in_ptr + gl.program_id(0))  # a load: captured through shared memory
    bars = 0
    big = 0
    bar = 0
    tile_smem = 0
    if MBAR:
        bars = gl.allocate_shared_memory(gl.int64, [1 + 3 * STAGES, 1],
                                         mbarrier.MBarrierLayout())
        for i in gl.static_range(1 + 3 * STAGES):
            mbarrier.init(bars.index(i), count=1)
    if SMEM:
        big_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        big = gl.allocate_shared_memory(gl.float16, [BIG_BLOCKS, TILE, TILE], big_layout)
        zl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        big.index(0).store(gl.zeros([TILE, TILE], gl.float16, zl))
        big.index(BIG_BLOCKS - 1).store(gl.zeros([TILE, TILE], gl.float16, zl))
    if TMA:
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        tile_smem = gl.allocate_shared_memory(gl.float16, [TILE, TILE], desc.layout)
    if MBAR or TMA:
        fence_async_shared()
    if BAR0:
        cta_barrier()
    if CAPTURES:
        # integers computed in the kernel, as _tile_origin computes b, h, hk and m0
        pid = gl.program_id(0)
        n = gl.num_programs(0)
        b = pid // s1
        h = pid % s1
        hk = h // s2
        m0 = (n - 1 - pid // s2) * 128
        n_tiles = gl.maximum((m0 + s3 + 127) // 128, 1)
        gl.warp_specialize([
            (_captured, (out_ptr, base, 0, aux_ptr, s1, s2, s3, s4, scale, b, h, hk, m0, n_tiles,
                         tile_ptr, bar, tile_smem, bars, big, True, False, desc, MBAR, SMEM,
                         TMA)),
            (_captured, (out_ptr, base, 128, aux_ptr, s1, s2, s3, s4, scale, b, h, hk, m0,
                         n_tiles, tile_ptr, bar, tile_smem, bars, big, False, False, desc,
                         MBAR, SMEM, TMA)),
            (_captured, (out_ptr, base, 128 + 32 * W1, aux_ptr, s1, s2, s3, s4, scale, b, h,
                         hk, m0, n_tiles, tile_ptr, bar, tile_smem, bars, big, False, True,
                         desc, MBAR, SMEM, TMA)),
        ], [W1, W2], [R1, R2])
    else:
        gl.warp_specialize([
            (_partition, (out_ptr, base, 0, 0, tile_ptr, bar, tile_smem, bars, big, True,
                          False, desc, MBAR, SMEM, TMA)),
            (_partition, (out_ptr, base, 128, 0, tile_ptr, bar, tile_smem, bars, big, False,
                          False, desc, MBAR, SMEM, TMA)),
            (_partition, (out_ptr, base, 128 + 32 * W1, 0, tile_ptr, bar, tile_smem, bars, big,
                          False, True, desc, MBAR, SMEM, TMA)),
        ], [W1, W2], [R1, R2])


def parse(variant: str) -> dict:
    """The launch of a variant name: ``minimal``, ``shaped`` or ``shaped+FEATURE+...``."""
    head, *feats = variant.split("+")
    if head not in ("minimal", "shaped") or (feats and head != "shaped"):
        raise ValueError(f"unknown variant {variant!r} (minimal, shaped, shaped+FEATURE...; "
                         f"features {', '.join(FEATURES)}; or tkit)")
    unknown = [f for f in feats if f not in FEATURES]
    if unknown:
        raise ValueError(f"unknown feature(s) {unknown} in {variant!r} (known: {FEATURES})")
    shaped = head == "shaped"
    w1, w2 = (4, 1) if shaped else (1, 1)
    r1, r2 = (240, 24) if shaped else (24, 24)
    tma_bytes = TILE_N * TILE_N * 2 if "tma" in feats else 0
    return dict(W1=w1, W2=w2, R1=r1, R2=r2, MBAR="mbar" in feats, SMEM="smem" in feats,
                BIG_BLOCKS=(TKIT_TILES - tma_bytes) // (TILE_N * TILE_N * 2), BAR0="bar0" in feats,
                TMA="tma" in feats, CAPTURES="captures" in feats,
                maxnreg=168 if shaped else None)


def _tile_layout():
    return gl.NVMMASharedLayout.get_default_for([TILE_N, TILE_N], gl.float16)


def run_probe(variant: str, programs: int = 264) -> None:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    p = parse(variant)
    maxnreg = p.pop("maxnreg")
    w1, w2 = p["W1"], p["W2"]
    per = 128 + 32 * (w1 + w2)
    base = torch.arange(programs, device="cuda", dtype=torch.int32) * per
    out = torch.full((programs * per,), -1, device="cuda", dtype=torch.int32)
    aux = torch.zeros(2, device="cuda", dtype=torch.int32)
    src = torch.randn(TILE_N, TILE_N, device="cuda").half()
    tiles = torch.zeros(programs, TILE_N, TILE_N, device="cuda", dtype=torch.float16)
    desc = TensorDescriptor.from_tensor(src, [TILE_N, TILE_N], _tile_layout()) if p["TMA"] else None
    regs = {} if maxnreg is None else {"maxnreg": maxnreg}
    # s1 = heads, s2 = group, s3 = a sequence length, s4 = a stride: all positive
    _probe_ws_kernel[(programs,)](base, out, aux, tiles, desc, 4, 2, 300, 128, 0.125, **p,
                                  num_warps=4, **regs)
    torch.cuda.synchronize()
    parts = [torch.arange(32 * w, device="cuda", dtype=torch.int32) for w in (4, w1, w2)]
    want = (torch.cat(parts)[None, :] + base[:, None]).reshape(-1)
    assert torch.equal(out, want), f"the probe kernel {variant} wrote wrong values"
    assert torch.equal(aux, torch.zeros_like(aux)), "a select that is never taken was taken"
    if p["TMA"]:
        assert torch.equal(tiles, src[None].expand_as(tiles)), "the TMA tile came out wrong"


def compile_sm90(variant: str):
    """Compile a probe variant for sm_90a ahead of time (no GPU needed): Triton's compiled
    kernel (``.asm["ptx"]``, ``.metadata.shared``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    p = parse(variant)
    maxnreg = p.pop("maxnreg")
    desc_t = (f"tensordesc<fp16[{TILE_N}, {TILE_N}],{_tile_layout()!r}>" if p["TMA"]
              else "constexpr")
    signature = dict(in_ptr="*i32", out_ptr="*i32", aux_ptr="*i32", tile_ptr="*fp16",
                     desc=desc_t, s1="i32", s2="i32", s3="i32", s4="i32", scale="fp32")
    signature.update({k: "constexpr" for k in p})
    names = list(signature)
    constexprs = {(names.index(k),): v for k, v in p.items()}
    if not p["TMA"]:
        constexprs[(names.index("desc"),)] = None
    src = GluonASTSource(_probe_ws_kernel, signature, constexprs)
    options = {"num_warps": 4}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


if __name__ == "__main__":
    which = sys.argv[1]
    if which == "tkit":
        from tkit.kernels.attention import hopper as H

        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, 300, 4, 128, device="cuda", dtype=torch.bfloat16,
                               generator=g) for _ in range(3))
        H.forward(q, k, v, causal=True, config=H.config_dict(128, 3, True))
        torch.cuda.synchronize()
    elif which == "compile":  # python ws_racecheck_probe.py compile [VARIANT...]: no GPU
        for name in sys.argv[2:] or [v for v in LADDER if v != "tkit"]:
            k = compile_sm90(name)
            ptx = k.asm["ptx"]
            barriers = len(re.findall(r"\b(?:bar|barrier)\.sync", ptx))
            print(f"{name:40s} shared {k.metadata.shared} bytes, {barriers} CTA barriers "
                  f"in the PTX")
    else:
        run_probe(which)
    print("done")
