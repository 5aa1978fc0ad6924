// bf16 GEMM on tensor cores with mma.sync, written with CuTe's sm80 building blocks: an
// independent implementation of the Ampere-style kernel of gemm_mma_sm80.cu, written to tell
// whether ~0.6x cuBLAS is the ceiling of mma.sync on the H200 or the ceiling of one kernel.
//
// C[M,N] = A[M,K] @ B[K,N]; A, B bf16 row-major contiguous, 16-byte aligned; fp32 accumulation;
// C bf16 (or fp32). No edge predication: M % BM == 0, N % BN == 0 and K % BK == 0 (the launcher,
// tkit/cuda_ext/gemm_cute.py, checks this and names the argument that breaks it).
//
// In CuTe's terms (GEMM convention: A is (M, K), B is (N, K), C is (M, N)):
//   A   (M, K) K-major: stride (K, 1)
//   B   (N, K) N-major: stride (1, N), i.e. the row-major [K, N] matrix the caller passes
//   MMA TiledMMA over SM80_16x8x16_F32BF16BF16F32_TN (mma.sync.m16n8k16 bf16 -> fp32), warps
//       laid out WARPS_M x WARPS_N; the N extent of one MMA tile is 16 * WARPS_N (each warp
//       takes two n8 atoms per tile) so that one ldmatrix.x4.trans feeds two mma's B operands
//   gmem -> smem   cp.async.cg 16-byte copies (SM80_CP_ASYNC_CACHEGLOBAL, LDGSTS), STAGES deep
//   smem -> rmem   ldmatrix: SM75_U32x4_LDSM_N for A (K-major), SM75_U16x8_LDSM_T for B
//                  (N-major in shared memory, transposed into the mma's k-pairs on the way)
//   smem layouts   swizzled so the 8 row addresses of one ldmatrix phase hit 8 different
//                  16-byte bank groups:
//                    A, BK = 64: Swizzle<3,3,3> o (8 x 64 elements, K-major): chunk ^= row & 7
//                    A, BK = 32: Swizzle<2,3,3> o (8 x 32, K-major): chunk ^= (row >> 1) & 3
//                    B:          Swizzle<3,3,3> o (64 n x 8 k, N-major): chunk ^= k & 7
//   main loop      the loads of k tile t + STAGES - 1 are issued at the first k16 block of tile
//                  t; fragments are double-buffered in registers across k16 blocks: block
//                  kb + 1's ldmatrix is issued before block kb's mma, and the wait for the next
//                  k tile (cp.async.wait_group + barrier) sits before the last block's
//                  ldmatrix, so ldmatrix latency hides behind mma work, never behind a barrier
//   epilogue       EPI_SMEM=1 (bf16 output): the tile is converted to bf16 into padded shared
//                  memory, then written out in 16-byte coalesced stores; otherwise (and for fp32
//                  output) straight from the accumulators (4 / 8-byte stores)
//   raster         1-D grid, GROUP_M tile-rows per group so the group's B tiles stay in L2
//
// Tile parameters are macros (tkit.cuda_ext.gemm_cute.CUTE_VARIANTS passes -D options):
//   BM, BN, BK        CTA tile (BK 32 or 64); WARPS_M x WARPS_N warps, warp tile
//                     (BM / WARPS_M) x (BN / WARPS_N), a multiple of 16 x 16
//   STAGES            shared-memory pipeline depth (>= 2)
//   GROUP_M           tile-rows per raster group
//   EPI_SMEM          1: bf16 epilogue staged through shared memory
//   MIN_BLOCKS        __launch_bounds__ minimum blocks per SM (0: none)
// Dynamic shared memory: max(STAGES * (BM + BN) * BK * 2, BM * (BN + 8) * 2 if EPI_SMEM) bytes.
// Needs nvcc and the CuTe headers (the nvidia-cutlass wheel); sm_80 or newer.
#include <cute/tensor.hpp>

#ifndef BM
#define BM 128
#endif
#ifndef BN
#define BN 256
#endif
#ifndef BK
#define BK 32
#endif
#ifndef WARPS_M
#define WARPS_M 2
#endif
#ifndef WARPS_N
#define WARPS_N 4
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef GROUP_M
#define GROUP_M 8
#endif
#ifndef EPI_SMEM
#define EPI_SMEM 1
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 0
#endif
#define THREADS (32 * WARPS_M * WARPS_N)
#if MIN_BLOCKS
#define LAUNCH_BOUNDS __launch_bounds__(THREADS, MIN_BLOCKS)
#else
#define LAUNCH_BOUNDS __launch_bounds__(THREADS)
#endif
#define C_PAD 8  // bf16 elements of padding per staged C row: rows start 4 banks apart

#if (BK != 32 && BK != 64) || BN % 64 || (BM / WARPS_M) % 16 || (BN / WARPS_N) % 16 || \
    BM % (16 * WARPS_M) || BN % (16 * WARPS_N) || STAGES < 2
#error "unsupported tile: BK 32 or 64, BN a multiple of 64, warp tiles multiples of 16 x 16"
#endif
#if THREADS % (BK / 8) || BM % (THREADS / (BK / 8)) || THREADS % (BN / 8) || \
    BK % (THREADS / (BN / 8)) || (BM * BN / 8) % THREADS
#error "the copies must split into whole 16-byte chunks per thread"
#endif

namespace tkit_cute {
using namespace cute;

using T = cute::bfloat16_t;

// ---- the static configuration ---------------------------------------------------------------
using TileM = Int<BM>;
using TileN = Int<BN>;
using TileK = Int<BK>;
using Stages = Int<STAGES>;

// shared-memory layouts, one swizzled atom tiled over (rows, k, stage)
#if BK == 64
using SmemAtomA = decltype(composition(Swizzle<3, 3, 3>{},
                                       Layout<Shape<_8, _64>, Stride<_64, _1>>{}));
#else
using SmemAtomA = decltype(composition(Swizzle<2, 3, 3>{},
                                       Layout<Shape<_8, _32>, Stride<_32, _1>>{}));
#endif
using SmemAtomB = decltype(composition(Swizzle<3, 3, 3>{},
                                       Layout<Shape<_64, _8>, Stride<_1, _64>>{}));
using SmemLayoutA = decltype(tile_to_shape(SmemAtomA{}, make_shape(TileM{}, TileK{}, Stages{})));
using SmemLayoutB = decltype(tile_to_shape(SmemAtomB{}, make_shape(TileN{}, TileK{}, Stages{})));
// the staged bf16 output tile: row-major, padded rows
using SmemLayoutC = Layout<Shape<TileM, TileN>, Stride<Int<BN + C_PAD>, _1>>;

constexpr int kSmemPipe = STAGES * (BM + BN) * BK * 2;
constexpr int kSmemEpi = EPI_SMEM ? BM * (BN + C_PAD) * 2 : 0;
static_assert(kSmemPipe <= 227 * 1024 && kSmemEpi <= 227 * 1024,
              "more shared memory than a block can have on any sm_80 / sm_90 part");

// global -> shared: 16-byte cp.async chunks; A along K (BK / 8 threads a row), B along N
using GmemCopyA = decltype(make_tiled_copy(
    Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>, T>{},
    Layout<Shape<Int<THREADS / (BK / 8)>, Int<BK / 8>>, Stride<Int<BK / 8>, _1>>{},
    Layout<Shape<_1, _8>>{}));
using GmemCopyB = decltype(make_tiled_copy(
    Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>, T>{},
    Layout<Shape<Int<BN / 8>, Int<THREADS / (BN / 8)>>, Stride<_1, Int<BN / 8>>>{},
    Layout<Shape<_8, _1>>{}));

// the MMA: m16n8k16 atoms, WARPS_M x WARPS_N warps; N tile 16 per warp (two n8 atoms)
using TiledMma = decltype(make_tiled_mma(
    MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>{},
    Layout<Shape<Int<WARPS_M>, Int<WARPS_N>, _1>>{},
    Tile<Int<16 * WARPS_M>, Int<16 * WARPS_N>, _16>{}));

// shared -> registers
using SmemCopyAtomA = Copy_Atom<SM75_U32x4_LDSM_N, T>;
using SmemCopyAtomB = Copy_Atom<SM75_U16x8_LDSM_T, T>;

// staged C, shared -> global: 16-byte chunks, a warp covers whole rows
using EpiCopy = decltype(make_tiled_copy(
    Copy_Atom<UniversalCopy<uint128_t>, T>{},
    Layout<Shape<Int<THREADS / (BN / 8)>, Int<BN / 8>>, Stride<Int<BN / 8>, _1>>{},
    Layout<Shape<_1, _8>>{}));

static_assert(size(TiledMma{}) == THREADS, "one MMA thread per block thread");
static_assert(size(GmemCopyA{}) == THREADS && size(GmemCopyB{}) == THREADS);

// ---- the kernel body ------------------------------------------------------------------------
template <class OutT>
__device__ __forceinline__ void gemm_body(const T* __restrict__ pa, const T* __restrict__ pb,
                                          OutT* __restrict__ pc, int M, int N, int K) {
  extern __shared__ __align__(1024) unsigned char smem[];

  // grouped raster over the (M / BM) x (N / BN) tiles
  const int tiles_m = M / BM, tiles_n = N / BN;
  const int pid = blockIdx.x;
  const int width = GROUP_M * tiles_n;
  const int first_m = (pid / width) * GROUP_M;
  const int gsize = min(tiles_m - first_m, GROUP_M);
  const int tm = first_m + (pid % width) % gsize;
  const int tn = (pid % width) / gsize;

  Tensor mA = make_tensor(make_gmem_ptr(pa), make_shape(M, K), make_stride(K, _1{}));
  Tensor mB = make_tensor(make_gmem_ptr(pb), make_shape(N, K), make_stride(_1{}, N));
  Tensor mC = make_tensor(make_gmem_ptr(pc), make_shape(M, N), make_stride(N, _1{}));
  Tensor gA = local_tile(mA, make_shape(TileM{}, TileK{}), make_coord(tm, _));  // (BM,BK,kt)
  Tensor gB = local_tile(mB, make_shape(TileN{}, TileK{}), make_coord(tn, _));  // (BN,BK,kt)
  Tensor gC = local_tile(mC, make_shape(TileM{}, TileN{}), make_coord(tm, tn));  // (BM,BN)

  T* smem_a = reinterpret_cast<T*>(smem);
  T* smem_b = smem_a + cosize(SmemLayoutA{});
  Tensor sA = make_tensor(make_smem_ptr(smem_a), SmemLayoutA{});  // (BM,BK,STAGES)
  Tensor sB = make_tensor(make_smem_ptr(smem_b), SmemLayoutB{});  // (BN,BK,STAGES)

  const int tid = threadIdx.x;
  GmemCopyA g2s_a;
  GmemCopyB g2s_b;
  auto g2s_thr_a = g2s_a.get_slice(tid);
  auto g2s_thr_b = g2s_b.get_slice(tid);
  Tensor tAgA = g2s_thr_a.partition_S(gA);  // (CPY,CPY_M,CPY_K,kt)
  Tensor tAsA = g2s_thr_a.partition_D(sA);  // (CPY,CPY_M,CPY_K,STAGES)
  Tensor tBgB = g2s_thr_b.partition_S(gB);
  Tensor tBsB = g2s_thr_b.partition_D(sB);

  TiledMma mma;
  auto thr_mma = mma.get_slice(tid);
  Tensor tCrA = thr_mma.partition_fragment_A(sA(_, _, 0));  // (MMA,MMA_M,MMA_K)
  Tensor tCrB = thr_mma.partition_fragment_B(sB(_, _, 0));  // (MMA,MMA_N,MMA_K)
  Tensor tCrC = thr_mma.partition_fragment_C(gC);           // (MMA,MMA_M,MMA_N) fp32
  clear(tCrC);

  auto s2r_a = make_tiled_copy_A(SmemCopyAtomA{}, mma);
  auto s2r_b = make_tiled_copy_B(SmemCopyAtomB{}, mma);
  auto s2r_thr_a = s2r_a.get_slice(tid);
  auto s2r_thr_b = s2r_b.get_slice(tid);
  Tensor tXsA = s2r_thr_a.partition_S(sA);  // (CPY,CPY_M,CPY_K,STAGES)
  Tensor tXrA = s2r_thr_a.retile_D(tCrA);   // (CPY,CPY_M,CPY_K)
  Tensor tXsB = s2r_thr_b.partition_S(sB);
  Tensor tXrB = s2r_thr_b.retile_D(tCrB);

  const int k_tiles = K / BK;
  constexpr int k_blocks = size<2>(tCrA);  // k16 blocks per k tile

  // prologue: k tiles 0 .. STAGES-2 in flight, one commit group each (empty past the end, so
  // the group count, and with it every wait below, stays the same for any K)
  int k_load = 0;
  CUTE_UNROLL
  for (int s = 0; s < STAGES - 1; ++s) {
    if (k_load < k_tiles) {
      copy(g2s_a, tAgA(_, _, _, k_load), tAsA(_, _, _, s));
      copy(g2s_b, tBgB(_, _, _, k_load), tBsB(_, _, _, s));
    }
    cp_async_fence();
    ++k_load;
  }
  int read_stage = 0, write_stage = STAGES - 1;

  cp_async_wait<STAGES - 2>();  // k tile 0 landed (this thread's part) ...
  __syncthreads();              // ... and everyone's
  copy(s2r_a, tXsA(_, _, 0, read_stage), tXrA(_, _, 0));
  copy(s2r_b, tXsB(_, _, 0, read_stage), tXrB(_, _, 0));

  for (int kt = 0; kt < k_tiles; ++kt) {
    CUTE_UNROLL
    for (int kb = 0; kb < k_blocks; ++kb) {
      if (kb == k_blocks - 1) {
        // the next k tile: landed for everyone before the ldmatrix below reads it; the barrier
        // also retires every warp's reads of this tile's stage before it is refilled
        read_stage = read_stage == STAGES - 1 ? 0 : read_stage + 1;
        cp_async_wait<STAGES - 2>();
        __syncthreads();
      }
      // fragments of the next k16 block (past the last k tile: a stale stage, never used)
      const int kb_next = (kb + 1) % k_blocks;
      copy(s2r_a, tXsA(_, _, kb_next, read_stage), tXrA(_, _, kb_next));
      copy(s2r_b, tXsB(_, _, kb_next, read_stage), tXrB(_, _, kb_next));
      if (kb == 0) {
        // write_stage held k tile kt - 1, whose last reads were issued before the barrier of
        // the previous iteration
        if (k_load < k_tiles) {
          copy(g2s_a, tAgA(_, _, _, k_load), tAsA(_, _, _, write_stage));
          copy(g2s_b, tBgB(_, _, _, k_load), tBsB(_, _, _, write_stage));
        }
        cp_async_fence();
        ++k_load;
        write_stage = write_stage == STAGES - 1 ? 0 : write_stage + 1;
      }
      gemm(mma, tCrA(_, _, kb), tCrB(_, _, kb), tCrC);
    }
  }
  cp_async_wait<0>();

  if constexpr (EPI_SMEM && sizeof(OutT) == 2) {
    // every warp is past its last ldmatrix before the pipeline buffers are reused
    __syncthreads();
    Tensor sC = make_tensor(make_smem_ptr(reinterpret_cast<T*>(smem)), SmemLayoutC{});
    Tensor tCsC = thr_mma.partition_C(sC);
    Tensor tCrD = make_tensor_like<T>(tCrC);
    CUTE_UNROLL
    for (int i = 0; i < size(tCrC); ++i) tCrD(i) = T(tCrC(i));
    copy(AutoVectorizingCopyWithAssumedAlignment<32>{}, tCrD, tCsC);
    __syncthreads();
    EpiCopy s2g;
    auto s2g_thr = s2g.get_slice(tid);
    copy(s2g, s2g_thr.partition_S(sC), s2g_thr.partition_D(gC));
  } else {
    Tensor tCgC = thr_mma.partition_C(gC);
    Tensor tCrD = make_tensor_like<OutT>(tCrC);
    CUTE_UNROLL
    for (int i = 0; i < size(tCrC); ++i) tCrD(i) = OutT(tCrC(i));
    // the two values of an atom row are adjacent in C: 4-byte (bf16) / 8-byte (fp32) stores
    copy(AutoVectorizingCopyWithAssumedAlignment<16 * sizeof(OutT)>{}, tCrD, tCgC);
  }
}
}  // namespace tkit_cute

extern "C" __global__ void LAUNCH_BOUNDS gemm_cute_bf16(const cute::bfloat16_t* __restrict__ A,
                                                        const cute::bfloat16_t* __restrict__ B,
                                                        cute::bfloat16_t* __restrict__ C,
                                                        int M, int N, int K) {
  tkit_cute::gemm_body<cute::bfloat16_t>(A, B, C, M, N, K);
}

extern "C" __global__ void LAUNCH_BOUNDS gemm_cute_bf16_f32out(
    const cute::bfloat16_t* __restrict__ A, const cute::bfloat16_t* __restrict__ B,
    float* __restrict__ C, int M, int N, int K) {
  tkit_cute::gemm_body<float>(A, B, C, M, N, K);
}
