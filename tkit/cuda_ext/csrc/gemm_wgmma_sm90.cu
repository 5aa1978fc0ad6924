// Hopper bf16 GEMM (sm_90a): TMA -> mbarrier -> wgmma, warp specialized, persistent.
//
// C[M,N] = A[M,K] @ B[K,N]; A, B bf16 row-major; fp32 accumulation; C bf16.
// Needs K % 8 == 0 and N % 8 == 0 (TMA wants 16-byte global strides) and 16-byte aligned bases;
// any M, N, K otherwise: TMA zero-fills out-of-bounds boxes and the epilogue guards its stores.
//
// Block tile 128 x 256 x 64, STAGES (3) shared-memory stages of 48 KiB (A 16 KiB + B 32 KiB)
// and the epilogue through shared memory + TMA stores (EPI_TMA, one 64 KiB part: EPI_SPLIT 1):
// the default build is the fastest of the tile/stage sweep on the H200 (0.996x / 1.036x cuBLAS
// at 4096^3 / 8192^3). The first kernel (4 stages, stores from registers: 0.95x / 1.00x) is
// the variant direct_s4 of WGMMA_VARIANTS.
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
// One local header (sm90_async.cuh, inlined by the loader); compiles under NVRTC and nvcc
// (-arch sm_90a: wgmma and setmaxnreg need the "a").
//
// Compile-time variants (defaults: STAGES 3, EPI_TMA 1, EPI_SPLIT 1, GROUP_M 16, CLUSTER_M 1):
//   WGMMA_INFLIGHT=1  wgmma.wait_group 1: one k-step's wgmmas stay in flight while the next
//                     ones are issued; a stage is released one k-step later (so with 4 stages
//                     only ~3 are loading: it measured like STAGES=3 on the H200)
//   EPI_TMA=1         epilogue through shared memory and TMA stores: each consumer writes its
//                     64 x 256 bf16 result into 128-byte-swizzled 64 x 64 boxes (conflict-free
//                     32-bit stores), one thread issues cp.async.bulk.tensor stores, and the
//                     consumers go straight back to the next tile's mainloop while TMA drains
//                     them (out-of-range rows/columns are clipped by TMA). EPI_SPLIT parts per
//                     consumer, staged one after another through a buffer of 64 x BN/EPI_SPLIT:
//                     1 part (32 KiB a consumer) fits next to 3 stages, 2 parts (16 KiB)
//                     next to 4 stages in 227 KiB. EPI_TMA=0: stores from registers.
//   CLUSTER_M=2       clusters of 2 CTAs on consecutive tile-rows (same B tile): each CTA loads
//                     half of the B tile and multicasts it to both (cp.async.bulk.tensor
//                     .multicast::cluster), cutting L2->SM traffic per CTA from 48 to 32 KiB a
//                     k-step. A stage is free only when the consumers of both CTAs released it:
//                     empty[s] counts CONSUMERS x CLUSTER_M arrivals, remote ones via mapa +
//                     mbarrier.arrive.shared::cluster. Both CTAs of a cluster walk the same
//                     cluster tiles (an odd last tile-row: the upper CTA loads zeros, stores
//                     nothing) and meet at a cluster barrier before exiting.

#define BM 128
#define BN 256
#define BK 64
#ifndef STAGES  // overridable with -DSTAGES=... (the build sweeps vary it)
#define STAGES 3
#endif
#define CONSUMERS 2
#define THREADS (128 * (CONSUMERS + 1))
#ifndef GROUP_M  // overridable with -DGROUP_M=... (the build sweeps vary it)
#define GROUP_M 16
#endif
#ifndef WGMMA_INFLIGHT  // 1: keep one wgmma group in flight across k-steps (wait_group 1)
#define WGMMA_INFLIGHT 0
#endif
#ifndef EPI_TMA
#define EPI_TMA 1
#endif
#ifndef EPI_SPLIT
#define EPI_SPLIT 1
#endif
#ifndef CLUSTER_M
#define CLUSTER_M 1
#endif
#if CLUSTER_M != 1 && CLUSTER_M != 2
#error "CLUSTER_M must be 1 or 2"
#endif
#if BN % (64 * EPI_SPLIT)
#error "EPI_SPLIT must split BN into whole 64-column boxes"
#endif
#define GROUP_MC (GROUP_M / CLUSTER_M > 0 ? GROUP_M / CLUSTER_M : 1)  // in cluster tile-rows
#define C_PART_COLS (BN / EPI_SPLIT)
#define C_PART_BYTES (64 * C_PART_COLS * 2)  // one consumer's staging buffer
#define C_BYTES (EPI_TMA ? CONSUMERS * C_PART_BYTES : 0)
#define A_STAGE_BYTES (BM * BK * 2)
#define B_STAGE_BYTES (BK * BN * 2)
#define STAGE_BYTES (A_STAGE_BYTES + B_STAGE_BYTES)

typedef unsigned short bf16_t;
#include "sm90_async.cuh"

// ---- wgmma ------------------------------------------------------------------------------------
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

extern "C" __global__ void CLUSTER_ATTR __launch_bounds__(THREADS, 1) gemm_wgmma_bf16(
    const __grid_constant__ TmaDesc tma_a, const __grid_constant__ TmaDesc tma_b,
#if EPI_TMA
    const __grid_constant__ TmaDesc tma_c,  // C, boxes of 64 x 64, 128-byte swizzle
#endif
    bf16_t* __restrict__ C, int M, int N, int K) {
  extern __shared__ unsigned char smem_raw[];
  // 128-byte swizzled tiles must start on a 1024-byte boundary (sm90_async.cuh's
  // smem_aligned_1024, written out: through it this build's address arithmetic is scheduled
  // differently, and it has not been timed that way)
  unsigned base = smem_u32(smem_raw);
  unsigned pad = ((base + 1023) & ~1023u) - base;
  unsigned char* smem = smem_raw + pad;
  unsigned sA = smem_u32(smem);
  unsigned sB = sA + STAGES * A_STAGE_BYTES;
  unsigned sC = sB + STAGES * B_STAGE_BYTES;  // EPI_TMA staging (C_BYTES, 1024-aligned)
  unsigned bars = sC + C_BYTES;  // full[STAGES], then empty[STAGES]
  auto full = [&](int s) { return bars + 8u * s; };
  auto empty = [&](int s) { return bars + 8u * (STAGES + s); };

  int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  init_ring(bars, STAGES, CONSUMERS * CLUSTER_M, CLUSTER_M);
  const int rank = CLUSTER_M > 1 ? (int)cluster_rank() : 0;

  int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
  // work units: CLUSTER_M consecutive tile-rows x one tile-column; CTA `rank` takes row `rank`
  int units_m = (tiles_m + CLUSTER_M - 1) / CLUSTER_M;
  int num_units = units_m * tiles_n;
  int unit0 = blockIdx.x / CLUSTER_M, unit_stride = gridDim.x / CLUSTER_M;
  int KT = (K + BK - 1) / BK;

  if (wg == 0) {
    // ---- producer ----
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (t == 0) {
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(&tma_a)));
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(&tma_b)));
      int it = 0;
      for (int unit = unit0; unit < num_units; unit += unit_stride) {
        int um, tn;
        tile_coords(unit, units_m, tiles_n, um, tn);
        int tm = um * CLUSTER_M + rank;
        for (int kt = 0; kt < KT; ++kt, ++it) {
          int s = it % STAGES;
          unsigned round = it / STAGES;
          mbar_wait(empty(s), (round & 1) ^ 1);  // round 0 passes: the stage starts free
          mbar_expect_tx(full(s), STAGE_BYTES);
          tma_load_2d(sA + s * A_STAGE_BYTES, &tma_a, kt * BK, tm * BM, full(s));
#if CLUSTER_M > 1
          // this CTA's share of the B boxes, into the same stage of every CTA of the cluster
#pragma unroll
          for (int jj = 0; jj < BN / 64 / CLUSTER_M; ++jj) {
            int j = rank * (BN / 64 / CLUSTER_M) + jj;
            tma_load_2d_multicast(sB + s * B_STAGE_BYTES + j * (BK * 128), &tma_b,
                                  tn * BN + 64 * j, kt * BK, full(s),
                                  (unsigned short)((1u << CLUSTER_M) - 1));
          }
#else
#pragma unroll
          for (int j = 0; j < BN / 64; ++j)
            tma_load_2d(sB + s * B_STAGE_BYTES + j * (BK * 128), &tma_b, tn * BN + 64 * j,
                        kt * BK, full(s));
#endif
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
    for (int unit = unit0; unit < num_units; unit += unit_stride) {
      int um, tn;
      tile_coords(unit, units_m, tiles_n, um, tn);
      int tm = um * CLUSTER_M + rank;
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
          u64 da = sw128_desc(a_base + kk * 32, 16, 1024);
          u64 db = sw128_desc(b_base + kk * 16 * 128, BK * 128, 1024);
          wgmma_m64n256k16(d, da, db);
        }
        wgmma_commit();
#if WGMMA_INFLIGHT
        // keep this k-step's wgmma in flight; the previous one is done: release its stage
        wgmma_wait1();
        if (kt > 0 && t == 0) release_slot(empty((it - 1) % STAGES));
#else
        wgmma_wait0();
        if (t == 0) release_slot(empty(s));
#endif
      }
#if WGMMA_INFLIGHT
      wgmma_wait0();
      if (KT > 0 && t == 0) release_slot(empty((it - 1) % STAGES));
#endif
#if EPI_TMA
      // (sm90_async.cuh's store_tile_tma, written out: through the shared function this build's
      // SASS is scheduled differently, and it has not been timed that way)
      // accumulator d[4j + 2h + {0,1}] at (row 16*warp + lane/4 + 8h, col 8j + 2*(lane%4)):
      // into 64 x 64 boxes, 128-byte rows, 16-byte chunk index XOR (row & 7) (the swizzle TMA
      // reads). One 32-bit store instruction: 8 rows x 4 lanes -> 32 distinct banks.
      unsigned cbuf = sC + c * C_PART_BYTES;
#pragma unroll
      for (int part = 0; part < EPI_SPLIT; ++part) {
        if (t == 0) bulk_wait_read0();  // the buffer's previous stores have read it
        named_bar(1 + c, 128);
#pragma unroll
        for (int jj = 0; jj < C_PART_COLS / 8; ++jj) {
          int j = part * (C_PART_COLS / 8) + jj;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            int row = warp * 16 + lane / 4 + 8 * h;
            unsigned addr = cbuf + (jj / 8) * 8192 + row * 128 + (((jj % 8) ^ (row & 7)) << 4) +
                            (lane % 4) * 4;
            st_shared_u32(addr, pack_bf16x2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]));
          }
        }
        fence_proxy_async_smem();
        named_bar(1 + c, 128);
        if (t == 0) {
#pragma unroll
          for (int box = 0; box < C_PART_COLS / 64; ++box)
            tma_store_2d(&tma_c, cbuf + box * 8192, tn * BN + part * C_PART_COLS + box * 64,
                         tm * BM + c * 64);
          bulk_commit();
        }
      }
#else
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
#endif
    }
#if EPI_TMA
    if (t == 0) bulk_wait0();  // the last stores are done before the CTA (and its smem) ends
#endif
  }
#if CLUSTER_M > 1
  // no CTA leaves while its peer may still arrive on its barriers or multicast into it
  cluster_sync();
#endif
}
