// bf16 GEMM on tensor cores with mma.sync (the Ampere path, sm_80+; also runs on sm_90).
//
// C[M,N] = A[M,K] @ B[K,N]; A, B bf16 row-major contiguous; fp32 accumulation; C bf16 or fp32.
// Needs K % 8 == 0 and N % 8 == 0 (16-byte rows for cp.async) and 16-byte aligned pointers;
// M, N and K are otherwise free: out-of-range 16-byte chunks are zero-filled by cp.async's
// src-size operand and stores are guarded.
//
// Default build (the fastest of the tile/stage sweep on the H200: 418 / 423 TFLOP/s at 4096^3 /
// 8192^3, 0.59x / 0.64x cuBLAS): block tile 256 x 128 x 64, 8 warps as 4 (M) x 2 (N), each warp
// 64 x 64 = 4 x 8 mma.m16n8k16 per k16 step (8 ldmatrix.x4 for 32 mma). STAGES (3)
// shared-memory buffers filled by cp.async (LDGSTS): the loads for tile kt+STAGES-1 are in flight
// while tile kt is multiplied; 144 KiB of shared memory, one block per SM. Fragments come from
// shared memory by ldmatrix (A) and ldmatrix.trans (B, stored k-major as it is in memory),
// double-buffered in registers across k16 steps (FRAG_PIPE); the bf16 epilogue goes through
// shared memory for 16-byte stores (EPI_SMEM). Shared tiles are XOR-swizzled in 16-byte chunks
// so that the 8 row addresses of one ldmatrix phase hit 8 different bank groups:
//   A, BK = 64 (rows of 8 chunks):    chunk ^ (row & 7)
//   A, BK = 32 (rows of 4 chunks):    chunk ^ ((row >> 1) & 3)
//   B (rows of BN/8 chunks):          chunk ^ (row & 7)
// The first kernel of this file (128 x 128 x 32, 2 x 4 warps of 64 x 32, 4 stages, no fragment
// pipelining, direct stores; 0.43x cuBLAS) is the variant 128x128k32s4 of MMA_VARIANTS.
// No headers: compiles under NVRTC and nvcc.

// Every tile parameter is a macro with the defaults above, so one source gives the variants that
// tkit.cuda_ext.gemm.MMA_VARIANTS compiles (-DBM=128 -DBK=32 ...).
//   BM, BN, BK        block tile (BK 32 or 64); WARPS_M x WARPS_N warps, warp tile
//                     (BM/WARPS_M) x (BN/WARPS_N), a multiple of 16 x 16
//   STAGES, GROUP_M   cp.async pipeline depth; tile-rows per raster group (L2 reuse of B)
//   FRAG_PIPE=1       fragments double-buffered in registers across k16 steps: the ldmatrix of
//                     step kk+1 is issued before the mma of step kk, and the barrier of the next
//                     k tile sits before the last k16 step of this one (CUTLASS's multistage
//                     order), so ldmatrix latency hides behind mma work and never behind a barrier
//   EPI_SMEM=1        bf16 epilogue staged through shared memory (padded rows, no bank
//                     conflicts), then 16-byte coalesced global stores (fp32 output stays direct)
//   MIN_BLOCKS        __launch_bounds__ minimum blocks per SM
#ifndef BM
#define BM 256
#endif
#ifndef BN
#define BN 128
#endif
#ifndef BK
#define BK 64
#endif
#ifndef WARPS_M
#define WARPS_M 4
#endif
#ifndef WARPS_N
#define WARPS_N 2
#endif
#ifndef STAGES  // overridable with -DSTAGES=... (the build sweeps vary it)
#define STAGES 3
#endif
#define THREADS (32 * WARPS_M * WARPS_N)
#ifndef GROUP_M  // overridable with -DGROUP_M=... (the build sweeps vary it)
#define GROUP_M 8
#endif
#ifndef FRAG_PIPE
#define FRAG_PIPE 1
#endif
#ifndef EPI_SMEM
#define EPI_SMEM 1
#endif
#ifndef MIN_BLOCKS  // 0: no minimum (the original build)
#define MIN_BLOCKS 0
#endif
#if MIN_BLOCKS
#define LAUNCH_BOUNDS __launch_bounds__(THREADS, MIN_BLOCKS)
#else
#define LAUNCH_BOUNDS __launch_bounds__(THREADS)
#endif
#define WTM (BM / WARPS_M)  // warp tile
#define WTN (BN / WARPS_N)
#define MI (WTM / 16)       // m16 tiles per warp
#define NI (WTN / 8)        // n8 tiles per warp (even: ldmatrix.x4.trans loads two)
#define KS (BK / 16)        // k16 steps per k tile
#define C_PAD 8             // bf16 elements of padding per staged C row (16 bytes)

#if (BK != 32 && BK != 64) || BN % 64 || WTM % 16 || WTN % 16 || STAGES < 2
#error "unsupported tile: BK must be 32 or 64, BN a multiple of 64, warp tiles multiples of 16"
#endif
#if (BM * BK / 8) % THREADS || (BK * BN / 8) % THREADS || (THREADS / (BK / 8)) % 8 || \
    (THREADS / (BN / 8)) % 8
#error "the k tile must split into whole 16-byte chunks per thread, 8-row multiples apart"
#endif

typedef unsigned short bf16_t;

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void cp_async_16_zfill(unsigned dst, const void* src, bool pred) {
  int n = pred ? 16 : 0;  // src-size 0: the 16 bytes are zero-filled, nothing is read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned addr, unsigned& r0, unsigned& r1,
                                            unsigned& r2, unsigned& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned addr, unsigned& r0, unsigned& r1,
                                                  unsigned& r2, unsigned& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ void mma_bf16_16816(float* c, const unsigned* a, const unsigned* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ int a_off(int row, int chunk) {  // element offset in an A stage
#if BK == 32  // 64-byte rows: two rows share a 128-byte line
  return row * BK + ((chunk ^ ((row >> 1) & 3)) << 3);
#else  // 128-byte rows: 8 chunks, XOR with the row's low 3 bits
  return row * BK + ((chunk ^ (row & 7)) << 3);
#endif
}
__device__ __forceinline__ int b_off(int row, int chunk) {  // element offset in a B stage
  return row * BN + ((chunk ^ (row & 7)) << 3);
}

// fragments of one k16 step of the warp tile: A by ldmatrix.x4, B by ldmatrix.x4.trans
__device__ __forceinline__ void load_frags(const bf16_t* as, const bf16_t* bs, int kk, int wm,
                                           int wn, int lane, unsigned (&af)[MI][4],
                                           unsigned (&bfr)[NI][2]) {
#pragma unroll
  for (int i = 0; i < MI; ++i) {
    int row = wm * WTM + i * 16 + (lane & 15);
    int ch = kk * 2 + (lane >> 4);
    ldmatrix_x4(smem_u32(as + a_off(row, ch)), af[i][0], af[i][1], af[i][2], af[i][3]);
  }
#pragma unroll
  for (int p = 0; p < NI / 2; ++p) {
    int row = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
    int ch = (wn * WTN + p * 16) / 8 + (lane >> 4);
    ldmatrix_x4_trans(smem_u32(bs + b_off(row, ch)), bfr[2 * p][0], bfr[2 * p][1],
                      bfr[2 * p + 1][0], bfr[2 * p + 1][1]);
  }
}

template <bool OUT_F32>
__device__ __forceinline__ void gemm_mma_body(const bf16_t* __restrict__ A,
                                              const bf16_t* __restrict__ B, void* __restrict__ C,
                                              int M, int N, int K) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16_t* As = reinterpret_cast<bf16_t*>(smem);
  bf16_t* Bs = As + STAGES * BM * BK;

  // grouped raster: GROUP_M tile-rows share their B tiles in L2
  int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
  int pid = blockIdx.x;
  int width = GROUP_M * tiles_n;
  int group = pid / width;
  int first_m = group * GROUP_M;
  int gsize = min(tiles_m - first_m, GROUP_M);
  int tm = first_m + (pid % width) % gsize;
  int tn = (pid % width) / gsize;
  int m0 = tm * BM, n0 = tn * BN;

  int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int wm = warp / WARPS_N, wn = warp % WARPS_N;

  // Each thread copies the same chunks (row, 16-byte chunk) of every k tile: chunk i of A sits
  // A_ROWS rows below chunk 0, and A_ROWS is a multiple of 8, so its swizzled shared offset is
  // chunk 0's plus a constant (the same for B): one base address per operand instead of one per
  // chunk, which keeps the big warp tiles inside 255 registers.
  constexpr int A_ROWS = THREADS / (BK / 8), B_ROWS = THREADS / (BN / 8);
  const int a_row = tid / (BK / 8), a_ch = tid % (BK / 8);
  const int b_row = tid / (BN / 8), b_ch = tid % (BN / 8);
  const unsigned a_dst = smem_u32(As + a_off(a_row, a_ch));
  const unsigned b_dst = smem_u32(Bs + b_off(b_row, b_ch));
  const bf16_t* a_src = A + (long long)(m0 + a_row) * K + a_ch * 8;
  const bf16_t* b_src = B + (long long)b_row * N + n0 + b_ch * 8;
  const bool b_col_ok = n0 + b_ch * 8 < N;
  auto load_tile = [&](int stage, int kt) {
    int k0 = kt * BK;
    bool a_k_ok = k0 + a_ch * 8 < K;
#pragma unroll
    for (int i = 0; i < BM * BK / 8 / THREADS; ++i) {  // A: BM x BK in 16-byte chunks
      bool ok = a_k_ok && (m0 + a_row + i * A_ROWS < M);
      const bf16_t* src = ok ? a_src + (long long)i * A_ROWS * K + k0 : A;
      cp_async_16_zfill(a_dst + 2 * (stage * BM * BK + i * A_ROWS * BK), src, ok);
    }
#pragma unroll
    for (int i = 0; i < BK * BN / 8 / THREADS; ++i) {  // B: BK x BN
      bool ok = b_col_ok && (k0 + b_row + i * B_ROWS < K);
      const bf16_t* src = ok ? b_src + (long long)(k0 + i * B_ROWS) * N : B;
      cp_async_16_zfill(b_dst + 2 * (stage * BK * BN + i * B_ROWS * BN), src, ok);
    }
  };

  float acc[MI][NI][4];
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;

  int KT = (K + BK - 1) / BK;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < KT) load_tile(s, s);
    asm volatile("cp.async.commit_group;\n" ::);
  }

#if FRAG_PIPE
  unsigned af[2][MI][4], bfr[2][NI][2];
  asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
  __syncthreads();
  load_frags(As, Bs, 0, wm, wn, lane, af[0], bfr[0]);
  for (int kt = 0; kt < KT; ++kt) {
    const int st = kt % STAGES, nst = (kt + 1) % STAGES;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      if (kk == 0) {
        // stage (kt-1) % STAGES is free: every warp passed the barrier of the previous k tile,
        // which comes after its last ldmatrix from that stage
        int pf = kt + STAGES - 1;
        if (pf < KT) load_tile(pf % STAGES, pf);
        asm volatile("cp.async.commit_group;\n" ::);
      }
      if (kk == KS - 1) {  // tile kt+1 landed for everyone before its first ldmatrix below
        asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
        __syncthreads();
      }
      // the next step's fragments (past the last k tile this reads a stale stage, unused)
      int ls = kk == KS - 1 ? nst : st;
      load_frags(As + ls * BM * BK, Bs + ls * BK * BN, (kk + 1) % KS, wm, wn, lane,
                 af[(kk + 1) & 1], bfr[(kk + 1) & 1]);
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j) mma_bf16_16816(acc[i][j], af[kk & 1][i], bfr[kk & 1][j]);
    }
  }
#else
  for (int kt = 0; kt < KT; ++kt) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
    __syncthreads();  // tile kt landed for everyone; stage (kt-1)%STAGES is free again
    int pf = kt + STAGES - 1;
    if (pf < KT) load_tile(pf % STAGES, pf);
    asm volatile("cp.async.commit_group;\n" ::);

    const bf16_t* as = As + (kt % STAGES) * BM * BK;
    const bf16_t* bs = Bs + (kt % STAGES) * BK * BN;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      unsigned af[MI][4], bfr[NI][2];
      load_frags(as, bs, kk, wm, wn, lane, af, bfr);
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j) mma_bf16_16816(acc[i][j], af[i], bfr[j]);
    }
  }
#endif
  asm volatile("cp.async.wait_group 0;\n" ::);

#if EPI_SMEM
  if (!OUT_F32) {
    // stage the bf16 tile in shared memory (the pipeline buffers are free once every warp is
    // past its last ldmatrix), rows padded by 16 bytes: the 8 rows a warp writes per store
    // start 4 banks apart, so 8 rows x 4 lanes hit 32 different banks
    __syncthreads();
    bf16_t* Cs = reinterpret_cast<bf16_t*>(smem);
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int j = 0; j < NI; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          int r = wm * WTM + i * 16 + (lane >> 2) + h * 8;
          int cc = wn * WTN + j * 8 + (lane & 3) * 2;
          *reinterpret_cast<unsigned*>(Cs + r * (BN + C_PAD) + cc) =
              pack_bf16x2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
        }
    __syncthreads();
    // 16-byte chunks, a warp covers 32 consecutive chunks of a row: coalesced stores
#pragma unroll 4
    for (int c = tid; c < BM * BN / 8; c += THREADS) {
      int r = c / (BN / 8), ch = c % (BN / 8);
      int row = m0 + r, col = n0 + ch * 8;
      if (row < M && col < N)  // N % 8 == 0: a chunk is wholly inside or outside
        *reinterpret_cast<uint4*>(reinterpret_cast<bf16_t*>(C) + (long long)row * N + col) =
            *reinterpret_cast<const uint4*>(Cs + r * (BN + C_PAD) + ch * 8);
    }
    return;
  }
#endif
  // epilogue: c0,c1 at (lane/4, 2*(lane%4) + {0,1}); c2,c3 eight rows below
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j) {
      int col = n0 + wn * WTN + j * 8 + (lane & 3) * 2;
      if (col >= N) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int row = m0 + wm * WTM + i * 16 + (lane >> 2) + h * 8;
        if (row >= M) continue;
        long long off = (long long)row * N + col;
        if (OUT_F32) {
          float2 v = make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
          *reinterpret_cast<float2*>(reinterpret_cast<float*>(C) + off) = v;
        } else {
          *reinterpret_cast<unsigned*>(reinterpret_cast<bf16_t*>(C) + off) =
              pack_bf16x2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
        }
      }
    }
}

extern "C" __global__ void LAUNCH_BOUNDS gemm_mma_bf16(
    const bf16_t* __restrict__ A, const bf16_t* __restrict__ B, bf16_t* __restrict__ C,
    int M, int N, int K) {
  gemm_mma_body<false>(A, B, C, M, N, K);
}

extern "C" __global__ void LAUNCH_BOUNDS gemm_mma_bf16_f32out(
    const bf16_t* __restrict__ A, const bf16_t* __restrict__ B, float* __restrict__ C,
    int M, int N, int K) {
  gemm_mma_body<true>(A, B, C, M, N, K);
}
