// bf16 GEMM on tensor cores with mma.sync (the Ampere path, sm_80+; also runs on sm_90).
//
// C[M,N] = A[M,K] @ B[K,N]; A, B bf16 row-major contiguous; fp32 accumulation; C bf16 or fp32.
// Needs K % 8 == 0 and N % 8 == 0 (16-byte rows for cp.async) and 16-byte aligned pointers;
// M, N and K are otherwise free: out-of-range 16-byte chunks are zero-filled by cp.async's
// src-size operand and stores are guarded.
//
// Block tile 128 x 128 x 32, 8 warps as 2 (M) x 4 (N), each warp 64 x 32 = 4 x 4 mma.m16n8k16.
// STAGES shared-memory buffers filled by cp.async (LDGSTS): the loads for tile kt+STAGES-1 are
// in flight while tile kt is multiplied. Fragments come from shared memory by ldmatrix (A) and
// ldmatrix.trans (B, stored k-major as it is in memory). Shared tiles are XOR-swizzled in
// 16-byte chunks so that the 8 row addresses of one ldmatrix phase hit 8 different bank groups:
//   A (rows of 32 bf16 = 4 chunks):   chunk ^ ((row >> 1) & 3)
//   B (rows of 128 bf16 = 16 chunks): chunk ^ (row & 7)
// No headers: compiles under NVRTC and nvcc.

#define BM 128
#define BN 128
#define BK 32
#ifndef STAGES  // overridable with -DSTAGES=... (scripts/gpu_cuda_ext.py sweeps it)
#define STAGES 4
#endif
#define THREADS 256
#ifndef GROUP_M  // overridable with -DGROUP_M=... (scripts/gpu_cuda_ext.py sweeps it)
#define GROUP_M 8
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
  return row * BK + ((chunk ^ ((row >> 1) & 3)) << 3);
}
__device__ __forceinline__ int b_off(int row, int chunk) {  // element offset in a B stage
  return row * BN + ((chunk ^ (row & 7)) << 3);
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
  int wm = warp >> 2, wn = warp & 3;

  auto load_tile = [&](int stage, int kt) {
    int k0 = kt * BK;
    bf16_t* as = As + stage * BM * BK;
    bf16_t* bs = Bs + stage * BK * BN;
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // A: 128 x 32 = 512 chunks
      int c = tid + i * THREADS;
      int row = c >> 2, ch = c & 3;
      bool ok = (m0 + row < M) && (k0 + ch * 8 < K);
      const bf16_t* src = ok ? A + (long long)(m0 + row) * K + k0 + ch * 8 : A;
      cp_async_16_zfill(smem_u32(as + a_off(row, ch)), src, ok);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // B: 32 x 128 = 512 chunks
      int c = tid + i * THREADS;
      int row = c >> 4, ch = c & 15;
      bool ok = (k0 + row < K) && (n0 + ch * 8 < N);
      const bf16_t* src = ok ? B + (long long)(k0 + row) * N + n0 + ch * 8 : B;
      cp_async_16_zfill(smem_u32(bs + b_off(row, ch)), src, ok);
    }
  };

  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;

  int KT = (K + BK - 1) / BK;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < KT) load_tile(s, s);
    asm volatile("cp.async.commit_group;\n" ::);
  }

  for (int kt = 0; kt < KT; ++kt) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
    __syncthreads();  // tile kt landed for everyone; stage (kt-1)%STAGES is free again
    int pf = kt + STAGES - 1;
    if (pf < KT) load_tile(pf % STAGES, pf);
    asm volatile("cp.async.commit_group;\n" ::);

    const bf16_t* as = As + (kt % STAGES) * BM * BK;
    const bf16_t* bs = Bs + (kt % STAGES) * BK * BN;
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      unsigned af[4][4], bfr[4][2];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        int row = wm * 64 + i * 16 + (lane & 15);
        int ch = kk * 2 + (lane >> 4);
        ldmatrix_x4(smem_u32(as + a_off(row, ch)), af[i][0], af[i][1], af[i][2], af[i][3]);
      }
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        int row = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        int ch = (wn * 32 + p * 16) / 8 + (lane >> 4);
        ldmatrix_x4_trans(smem_u32(bs + b_off(row, ch)), bfr[2 * p][0], bfr[2 * p][1],
                          bfr[2 * p + 1][0], bfr[2 * p + 1][1]);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_bf16_16816(acc[i][j], af[i], bfr[j]);
    }
  }
  asm volatile("cp.async.wait_group 0;\n" ::);

  // epilogue: c0,c1 at (lane/4, 2*(lane%4) + {0,1}); c2,c3 eight rows below
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      int col = n0 + wn * 32 + j * 8 + (lane & 3) * 2;
      if (col >= N) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int row = m0 + wm * 64 + i * 16 + (lane >> 2) + h * 8;
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

extern "C" __global__ void __launch_bounds__(THREADS) gemm_mma_bf16(
    const bf16_t* __restrict__ A, const bf16_t* __restrict__ B, bf16_t* __restrict__ C,
    int M, int N, int K) {
  gemm_mma_body<false>(A, B, C, M, N, K);
}

extern "C" __global__ void __launch_bounds__(THREADS) gemm_mma_bf16_f32out(
    const bf16_t* __restrict__ A, const bf16_t* __restrict__ B, float* __restrict__ C,
    int M, int N, int K) {
  gemm_mma_body<true>(A, B, C, M, N, K);
}
