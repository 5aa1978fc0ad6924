// Hopper bf16 GEMM (sm_90a): TMA -> mbarrier -> wgmma, warp specialized, persistent.
//
// C[M,N] = A[M,K] @ B[K,N]; A, B bf16 row-major; fp32 accumulation; C bf16.
// Needs K % 8 == 0 and N % 8 == 0 (TMA wants 16-byte global strides) and 16-byte aligned bases;
// any M, N, K otherwise: TMA zero-fills out-of-bounds boxes and the epilogue guards its stores.
//
// Block tile 128 x 256 x 64, STAGES shared-memory stages of 48 KiB (A 16 KiB + B 32 KiB).
// 384 threads = 3 warpgroups:
//   warpgroup 0, the producer: gives registers back (setmaxnreg.dec 24); one thread waits for a
//     free stage (empty[s]), announces the bytes to come (mbarrier.arrive.expect_tx) and issues
//     the TMA loads (cp.async.bulk.tensor), which complete on full[s].
//   warpgroups 1 and 2, the consumers: take registers (setmaxnreg.inc 240) for a 64 x 256 fp32
//     accumulator each (128 registers a thread), wait on full[s], issue 4 wgmma.m64n256k16 from
//     shared memory, wait for them, and release the stage (arrive on empty[s]).
// Persistent: the grid is one CTA per SM; CTAs walk the tiles (grouped by GROUP_M tile-rows for
// L2 reuse) with a stride of gridDim.x, and the stage ring runs on across tiles, so the producer
// is already loading the next tile while the consumers write the last one out.
//
// Shared-memory layouts, both with the 128-byte swizzle TMA writes and wgmma reads:
//   A tile (K-major): 128 rows of 64 bf16 (128 B). wgmma descriptor: SBO = 1024 B (8 rows),
//     LBO unused; the k-th 16-wide slice starts 32 B further.
//   B tile (MN-major: N is contiguous in memory): four TMA boxes of 64 (k) rows x 64 (n) bf16,
//     8 KiB each. Descriptor with the transpose bit: LBO = 8192 B (next 64 columns of n),
//     SBO = 1024 B (next 8 rows of k); the k-th 16-row slice starts 2048 B further.
// The tensor maps are built on the host (cuTensorMapEncodeTiled) and passed by value as
// __grid_constant__ kernel parameters, 128 bytes each.
// No headers: compiles under NVRTC and nvcc (-arch sm_90a: wgmma and setmaxnreg need the "a").

#define BM 128
#define BN 256
#define BK 64
#ifndef STAGES  // overridable with -DSTAGES=... (scripts/gpu_cuda_ext.py sweeps it)
#define STAGES 4
#endif
#define CONSUMERS 2
#define THREADS (128 * (CONSUMERS + 1))
#ifndef GROUP_M  // overridable with -DGROUP_M=... (scripts/gpu_cuda_ext.py sweeps it)
#define GROUP_M 16
#endif
#ifndef WGMMA_INFLIGHT  // 1: keep one wgmma group in flight across k-steps (wait_group 1)
#define WGMMA_INFLIGHT 0
#endif
#define A_STAGE_BYTES (BM * BK * 2)
#define B_STAGE_BYTES (BK * BN * 2)
#define STAGE_BYTES (A_STAGE_BYTES + B_STAGE_BYTES)

typedef unsigned short bf16_t;
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

// ---- wgmma ------------------------------------------------------------------------------------
__device__ __forceinline__ u64 smem_desc(unsigned addr, unsigned lbo, unsigned sbo) {
  u64 d = 0;
  d |= (u64)((addr & 0x3FFFF) >> 4);
  d |= (u64)((lbo & 0x3FFFF) >> 4) << 16;
  d |= (u64)((sbo & 0x3FFFF) >> 4) << 32;
  d |= 1ull << 62;  // 128-byte swizzle
  return d;
}

#define F8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
              "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])

// d[128] += A(64x16, K-major, descriptor) @ B(16x256, MN-major, descriptor)
__device__ __forceinline__ void wgmma_m64n256k16(float* d, u64 desc_a, u64 desc_b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"  // scale-d: 1 accumulates into d, 0 overwrites it
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, 0, 1;\n"
      "}\n"
      : F8(0), F8(8), F8(16), F8(24), F8(32), F8(40), F8(48), F8(56), F8(64), F8(72), F8(80), F8(88), F8(96), F8(104), F8(112), F8(120)
      : "l"(desc_a), "l"(desc_b), "r"(1));
}

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

__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ void tile_coords(int tile, int tiles_m, int tiles_n, int& tm,
                                            int& tn) {
  int width = GROUP_M * tiles_n;
  int group = tile / width;
  int first_m = group * GROUP_M;
  int gsize = min(tiles_m - first_m, GROUP_M);
  tm = first_m + (tile % width) % gsize;
  tn = (tile % width) / gsize;
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) gemm_wgmma_bf16(
    const __grid_constant__ TmaDesc tma_a, const __grid_constant__ TmaDesc tma_b,
    bf16_t* __restrict__ C, int M, int N, int K) {
  extern __shared__ unsigned char smem_raw[];
  // 128-byte swizzled tiles must start on a 1024-byte boundary
  unsigned base = smem_u32(smem_raw);
  unsigned pad = ((base + 1023) & ~1023u) - base;
  unsigned char* smem = smem_raw + pad;
  unsigned sA = smem_u32(smem);
  unsigned sB = sA + STAGES * A_STAGE_BYTES;
  unsigned bars = sB + STAGES * B_STAGE_BYTES;  // full[STAGES], then empty[STAGES]
  auto full = [&](int s) { return bars + 8u * s; };
  auto empty = [&](int s) { return bars + 8u * (STAGES + s); };

  int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), CONSUMERS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  __syncthreads();

  int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
  int num_tiles = tiles_m * tiles_n;
  int KT = (K + BK - 1) / BK;

  if (wg == 0) {
    // ---- producer ----
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (t == 0) {
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(&tma_a)));
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(&tma_b)));
      int it = 0;
      for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
        int tm, tn;
        tile_coords(tile, tiles_m, tiles_n, tm, tn);
        for (int kt = 0; kt < KT; ++kt, ++it) {
          int s = it % STAGES;
          unsigned round = it / STAGES;
          mbar_wait(empty(s), (round & 1) ^ 1);  // round 0 passes: the stage starts free
          mbar_expect_tx(full(s), STAGE_BYTES);
          tma_load_2d(sA + s * A_STAGE_BYTES, &tma_a, kt * BK, tm * BM, full(s));
#pragma unroll
          for (int j = 0; j < BN / 64; ++j)
            tma_load_2d(sB + s * B_STAGE_BYTES + j * (BK * 128), &tma_b, tn * BN + 64 * j,
                        kt * BK, full(s));
        }
      }
    }
  } else {
    // ---- consumers ----
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
    int c = wg - 1;
    int warp = t / 32, lane = t % 32;
    float d[128];
    int it = 0;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      int tm, tn;
      tile_coords(tile, tiles_m, tiles_n, tm, tn);
#pragma unroll
      for (int i = 0; i < 128; ++i) d[i] = 0.f;
      for (int kt = 0; kt < KT; ++kt, ++it) {
        int s = it % STAGES;
        unsigned round = it / STAGES;
        mbar_wait(full(s), round & 1);
        unsigned a_base = sA + s * A_STAGE_BYTES + c * (64 * 128);
        unsigned b_base = sB + s * B_STAGE_BYTES;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
          u64 da = smem_desc(a_base + kk * 32, 16, 1024);
          u64 db = smem_desc(b_base + kk * 16 * 128, BK * 128, 1024);
          wgmma_m64n256k16(d, da, db);
        }
        wgmma_commit();
#if WGMMA_INFLIGHT
        // keep this k-step's wgmma in flight; the previous one is done: release its stage
        wgmma_wait1();
        if (kt > 0 && t == 0) mbar_arrive(empty((it - 1) % STAGES));
#else
        wgmma_wait0();
        if (t == 0) mbar_arrive(empty(s));
#endif
      }
#if WGMMA_INFLIGHT
      wgmma_wait0();
      if (KT > 0 && t == 0) mbar_arrive(empty((it - 1) % STAGES));
#endif
      // epilogue: accumulator fragment of m64nNk16: d[4j + {0,1}] at (row, 8j + 2*(lane%4) +
      // {0,1}), d[4j + {2,3}] eight rows below; row = 16*warp + lane/4
      int row0 = tm * BM + c * 64 + warp * 16 + lane / 4;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        int col = tn * BN + j * 8 + (lane % 4) * 2;
        if (col >= N) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          int row = row0 + h * 8;
          if (row < M)
            *reinterpret_cast<unsigned*>(C + (long long)row * N + col) =
                pack_bf16x2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
        }
      }
    }
  }
}
