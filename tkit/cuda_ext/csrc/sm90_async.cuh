// Hopper (sm_90a) building blocks shared by the hand-written GEMMs of this folder: mbarriers,
// clusters, TMA loads (multicast too) and stores, bulk-group waits, the wgmma fence / commit /
// wait, the grouped tile order (it needs GROUP_MC, the section height in cluster tile-rows:
// define it before the include), the ring's set-up and a consumer's TMA-store epilogue.
// GROUP_MC and CLUSTER_M (CTAs a cluster, 1 or 2) are the including source's macros. Inline
// PTX only, no headers; the loader inlines this file into each source that includes it.
#pragma once

typedef unsigned long long u64;

struct __align__(64) TmaDesc {  // CUtensorMap: 128 opaque bytes
  u64 opaque[16];
};

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}

// ---- mbarriers ----------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  // try_wait suspends for a while in hardware before it gives up; loop until the phase with
  // this parity has completed
  unsigned done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n"
        " mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  }
}

// remote (or local) arrive on the mbarrier at the same offset in CTA `rank` of this cluster
__device__ __forceinline__ void mbar_arrive_cluster(unsigned bar, unsigned rank) {
  asm volatile(
      "{\n .reg .b32 ra;\n"
      " mapa.shared::cluster.u32 ra, %0, %1;\n"
      " mbarrier.arrive.shared::cluster.b64 _, [ra];\n}\n"
      ::"r"(bar), "r"(rank) : "memory");
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

// ---- TMA ------------------------------------------------------------------------------------
__device__ __forceinline__ void tma_load_2d(unsigned dst, const TmaDesc* map, int c0, int c1,
                                            unsigned bar) {
  // c0 runs along the contiguous dimension, c1 along rows; out-of-bounds elements read as 0
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n"
      ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// the same box into the same shared offset of every CTA in cta_mask; complete_tx on each one's
// mbarrier at the same offset
__device__ __forceinline__ void tma_load_2d_multicast(unsigned dst, const TmaDesc* map, int c0,
                                                      int c1, unsigned bar,
                                                      unsigned short cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n"
      ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(cta_mask)
      : "memory");
}
__device__ __forceinline__ void tma_store_2d(const TmaDesc* map, unsigned src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n"
               ::"l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(src) : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_read0() {  // earlier stores have read shared memory
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait0() {  // earlier stores are complete
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
__device__ __forceinline__ void fence_proxy_async_smem() {  // st.shared -> visible to TMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void named_bar(unsigned id, unsigned count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void st_shared_u32(unsigned addr, unsigned v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// ---- the ring of a warp-specialized kernel ----------------------------------------------------
// The 1024-byte aligned start of dynamic shared memory (128-byte swizzled tiles need it).
__device__ __forceinline__ unsigned smem_aligned_1024(const void* smem_raw) {
  unsigned base = smem_u32(smem_raw);
  return base + (((base + 1023) & ~1023u) - base);
}
// full[s] at bars + 8 s (one arrival: the producer's expect_tx) and empty[s] at
// bars + 8 (stages + s) (empty_count arrivals: the consumers of every CTA that fills slot s),
// made visible to TMA and, in clusters of `cluster` CTAs, to the peers before anyone signals
// them. Every thread of the CTA calls it.
__device__ __forceinline__ void init_ring(unsigned bars, int stages, unsigned empty_count,
                                          int cluster) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(bars + 8u * s, 1);
      mbar_init(bars + 8u * (stages + s), empty_count);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  __syncthreads();
  if (cluster > 1) cluster_sync();
}

// ---- wgmma ------------------------------------------------------------------------------------
// eight accumulator registers d[i..i+7] as read-write asm operands
#define F8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
              "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait0() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait1() {
  asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
}
// A shared-memory matrix descriptor of the 128-byte swizzle: start address, leading and stride
// byte offsets (each 16-byte granular).
__device__ __forceinline__ u64 sw128_desc(unsigned addr, unsigned lbo, unsigned sbo) {
  u64 d = 0;
  d |= (u64)((addr & 0x3FFFF) >> 4);
  d |= (u64)((lbo & 0x3FFFF) >> 4) << 16;
  d |= (u64)((sbo & 0x3FFFF) >> 4) << 32;
  d |= 1ull << 62;  // 128-byte swizzle
  return d;
}
// Pins a register between two asm statements: no read or write of it moves across. A wgmma's
// outputs look written at issue to the compiler and its register operands read: pinned after
// the wait, an accumulator is read only once the product is done, and an A fragment keeps its
// registers (none reused for temporaries) until the product that reads it is waited for.
__device__ __forceinline__ void fence_operand(float& r) {
  asm volatile("" : "+f"(r)::"memory");
}
__device__ __forceinline__ void fence_operand(unsigned& r) {
  asm volatile("" : "+r"(r)::"memory");
}
// Two floats rounded to a pair of 16-bit values in one register, lo in the low half.
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ unsigned pack_f16x2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// the grouped tile order: sections of GROUP_MC tile-rows, column-major inside a section
__device__ __forceinline__ void tile_coords(int tile, int tiles_m, int tiles_n, int& tm,
                                            int& tn) {
  int width = GROUP_MC * tiles_n;
  int group = tile / width;
  int first_m = group * GROUP_MC;
  int gsize = min(tiles_m - first_m, GROUP_MC);
  tm = first_m + (tile % width) % gsize;
  tn = (tile % width) / gsize;
}

// A consumer warpgroup's 64 x COLS float32 accumulator (the m64nCOLS wgmma fragment: d[4j + 2h
// + {0,1}] at (row 16*warp + lane/4 + 8h, col 8j + 2*(lane%4))) to global memory in PARTS
// parts: each packed to 16 bits (pack(lo, hi)) into the staging buffer cbuf as 64 x 64 boxes
// of 128-byte rows, 16-byte chunk index XOR (row & 7) (the swizzle TMA reads; one 32-bit store
// instruction covers 8 rows x 4 lanes, 32 distinct banks), then stored by TMA at (col0,
// row0), clipped there at the tensor's edges. The buffer is reused only once the previous
// stores have read it; the last ones are waited for by the caller (bulk_wait0) before exit.
// Named barrier 1 + c keeps consumer c's 128 threads (t = 0..127: warp, lane) together.
template <int COLS, int PARTS, typename Pack>
__device__ __forceinline__ void store_tile_tma(const float* d, unsigned cbuf, const TmaDesc* map,
                                               int col0, int row0, int c, int t, int warp,
                                               int lane, Pack pack) {
#pragma unroll
  for (int part = 0; part < PARTS; ++part) {
    if (t == 0) bulk_wait_read0();  // the buffer's previous stores have read it
    named_bar(1 + c, 128);
#pragma unroll
    for (int jj = 0; jj < COLS / PARTS / 8; ++jj) {
      int j = part * (COLS / PARTS / 8) + jj;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int row = warp * 16 + lane / 4 + 8 * h;
        unsigned addr = cbuf + (jj / 8) * 8192 + row * 128 + (((jj % 8) ^ (row & 7)) << 4) +
                        (lane % 4) * 4;
        st_shared_u32(addr, pack(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]));
      }
    }
    fence_proxy_async_smem();
    named_bar(1 + c, 128);
    if (t == 0) {
#pragma unroll
      for (int box = 0; box < COLS / PARTS / 64; ++box)
        tma_store_2d(map, cbuf + box * 8192, col0 + part * (COLS / PARTS) + box * 64, row0);
      bulk_commit();
    }
  }
}

// a consumer is done with ring slot `bar`: tell the producer of every CTA that fills it
__device__ __forceinline__ void release_slot(unsigned bar) {
#if CLUSTER_M > 1
#pragma unroll
  for (unsigned r = 0; r < CLUSTER_M; ++r) mbar_arrive_cluster(bar, r);
#else
  mbar_arrive(bar);
#endif
}

#if CLUSTER_M > 1
#define CLUSTER_ATTR __cluster_dims__(CLUSTER_M, 1, 1)
#else
#define CLUSTER_ATTR
#endif
