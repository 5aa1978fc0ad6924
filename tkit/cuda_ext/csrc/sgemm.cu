// The SGEMM ladder: C[M,N] = A[M,K] @ B[K,N] in fp32 on CUDA cores, row-major, contiguous.
//
// Six steps, each one fixing the bottleneck the previous one measures (tutorials/05):
//   1 sgemm_naive        one thread per output; every FMA reads two floats from DRAM/L2
//   2 sgemm_smem         32x32 tiles staged in shared memory: each global load reused 32x
//   3 sgemm_1d_blocking  each thread computes 8 outputs down a column: shared loads per FMA 2 -> 1.1
//   4 sgemm_2d_blocking  each thread computes an 8x8 block: outer products from registers
//   5 sgemm_vectorized   float4 global and shared loads; A stored transposed in shared memory;
//                        the 8x8 block split 4+4 so a quarter-warp's float4 reads are contiguous
//                        (bank-conflict free)
//   6 sgemm_cp_async     step 5 with two shared-memory buffers: B arrives by cp.async (no
//                        registers on the way), A through registers, while the previous tile
//                        is being multiplied
// Steps 1-4 handle any M, N, K (loads outside the matrix read zero, stores are guarded).
// Steps 5-6 need M % 128 == N % 128 == 0 and K % 8 == 0 (checked by the launcher).
// No headers: the file compiles under NVRTC (cupy.RawModule) and nvcc alike.

extern "C" __global__ void sgemm_naive(const float* __restrict__ A, const float* __restrict__ B,
                                       float* __restrict__ C, int M, int N, int K) {
  // blockDim (32, 8): threadIdx.x runs along N so that B loads and C stores coalesce
  int col = blockIdx.x * 32 + threadIdx.x;
  int row = blockIdx.y * 8 + threadIdx.y;
  if (row >= M || col >= N) return;
  float acc = 0.f;
  for (int k = 0; k < K; ++k) acc += A[(long long)row * K + k] * B[(long long)k * N + col];
  C[(long long)row * N + col] = acc;
}

#define T2 32
extern "C" __global__ void sgemm_smem(const float* __restrict__ A, const float* __restrict__ B,
                                      float* __restrict__ C, int M, int N, int K) {
  // blockDim (32, 32)
  __shared__ float As[T2][T2];
  __shared__ float Bs[T2][T2 + 1];
  int tx = threadIdx.x, ty = threadIdx.y;
  int row = blockIdx.y * T2 + ty, col = blockIdx.x * T2 + tx;
  float acc = 0.f;
  for (int k0 = 0; k0 < K; k0 += T2) {
    As[ty][tx] = (row < M && k0 + tx < K) ? A[(long long)row * K + k0 + tx] : 0.f;
    Bs[ty][tx] = (k0 + ty < K && col < N) ? B[(long long)(k0 + ty) * N + col] : 0.f;
    __syncthreads();
#pragma unroll
    for (int k = 0; k < T2; ++k) acc += As[ty][k] * Bs[k][tx];
    __syncthreads();
  }
  if (row < M && col < N) C[(long long)row * N + col] = acc;
}

// ---- step 3: 1-D register blocking: BM=BN=64, BK=8, each of 512 threads owns 8 rows x 1 col
#define B3M 64
#define B3N 64
#define B3K 8
#define T3M 8
extern "C" __global__ void __launch_bounds__(512) sgemm_1d_blocking(
    const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
    int M, int N, int K) {
  __shared__ float As[B3M][B3K];
  __shared__ float Bs[B3K][B3N];
  int tid = threadIdx.x;
  int tx = tid % B3N, ty = tid / B3N;  // ty in 0..7
  int m0 = blockIdx.y * B3M, n0 = blockIdx.x * B3N;
  int ar = tid / B3K, ac = tid % B3K;  // A tile: 64x8, one element each
  int br = tid / B3N, bc = tid % B3N;  // B tile: 8x64, one element each
  float acc[T3M] = {0.f};
  for (int k0 = 0; k0 < K; k0 += B3K) {
    As[ar][ac] = (m0 + ar < M && k0 + ac < K) ? A[(long long)(m0 + ar) * K + k0 + ac] : 0.f;
    Bs[br][bc] = (k0 + br < K && n0 + bc < N) ? B[(long long)(k0 + br) * N + n0 + bc] : 0.f;
    __syncthreads();
#pragma unroll
    for (int k = 0; k < B3K; ++k) {
      float b = Bs[k][tx];
#pragma unroll
      for (int i = 0; i < T3M; ++i) acc[i] += As[ty * T3M + i][k] * b;
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < T3M; ++i) {
    int r = m0 + ty * T3M + i, c = n0 + tx;
    if (r < M && c < N) C[(long long)r * N + c] = acc[i];
  }
}

// ---- step 4: 2-D register blocking: BM=BN=128, BK=8, 256 threads own 8x8 outputs each
#define BM 128
#define BN 128
#define BK 8
#define TM 8
#define TN 8
extern "C" __global__ void __launch_bounds__(256) sgemm_2d_blocking(
    const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
    int M, int N, int K) {
  __shared__ float As[BM][BK];
  __shared__ float Bs[BK][BN];
  int tid = threadIdx.x;
  int tx = tid % 16, ty = tid / 16;
  int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  float acc[TM][TN] = {{0.f}};
  float ra[TM], rb[TN];
  for (int k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // 1024 elements of each tile, 4 per thread
      int e = tid + i * 256;
      int r = e / BK, c = e % BK;
      As[r][c] = (m0 + r < M && k0 + c < K) ? A[(long long)(m0 + r) * K + k0 + c] : 0.f;
      int br = e / BN, bc = e % BN;
      Bs[br][bc] = (k0 + br < K && n0 + bc < N) ? B[(long long)(k0 + br) * N + n0 + bc] : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < BK; ++k) {
#pragma unroll
      for (int i = 0; i < TM; ++i) ra[i] = As[ty * TM + i][k];
#pragma unroll
      for (int j = 0; j < TN; ++j) rb[j] = Bs[k][tx * TN + j];
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] += ra[i] * rb[j];
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      int r = m0 + ty * TM + i, c = n0 + tx * TN + j;
      if (r < M && c < N) C[(long long)r * N + c] = acc[i][j];
    }
}

// ---- steps 5 and 6 share the inner product: thread (tx, ty) owns rows {ty*4..+4, 64+ty*4..+4}
// and columns {tx*4..+4, 64+tx*4..+4}; its float4 shared reads are contiguous across a
// quarter-warp, so they are conflict free.
__device__ __forceinline__ void outer_8x8(const float* __restrict__ As_k,
                                          const float* __restrict__ Bs_k, int tx, int ty,
                                          float acc[8][8]) {
  float4 a0 = *reinterpret_cast<const float4*>(As_k + ty * 4);
  float4 a1 = *reinterpret_cast<const float4*>(As_k + 64 + ty * 4);
  float4 b0 = *reinterpret_cast<const float4*>(Bs_k + tx * 4);
  float4 b1 = *reinterpret_cast<const float4*>(Bs_k + 64 + tx * 4);
  float ra[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
  float rb[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] += ra[i] * rb[j];
}

__device__ __forceinline__ void store_8x8(float* __restrict__ C, int N, int m0, int n0, int tx,
                                          int ty, float acc[8][8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    int r = m0 + (i < 4 ? ty * 4 + i : 64 + ty * 4 + i - 4);
    float* row = C + (long long)r * N + n0;
    *reinterpret_cast<float4*>(row + tx * 4) =
        make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
    *reinterpret_cast<float4*>(row + 64 + tx * 4) =
        make_float4(acc[i][4], acc[i][5], acc[i][6], acc[i][7]);
  }
}

extern "C" __global__ void __launch_bounds__(256) sgemm_vectorized(
    const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
    int M, int N, int K) {
  __shared__ __align__(16) float As[BK][BM];  // transposed: As[k][m]
  __shared__ __align__(16) float Bs[BK][BN];
  int tid = threadIdx.x;
  int tx = tid % 16, ty = tid / 16;
  int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  // A tile 128x8: one float4 per thread (row tid/2, cols (tid%2)*4..+4)
  int ar = tid / 2, ac = (tid % 2) * 4;
  // B tile 8x128: one float4 per thread (row tid/32, cols (tid%32)*4..+4)
  int br = tid / 32, bc = (tid % 32) * 4;
  const float* Ap = A + (long long)(m0 + ar) * K + ac;
  const float* Bp = B + (long long)br * N + n0 + bc;
  float acc[8][8] = {{0.f}};
  for (int k0 = 0; k0 < K; k0 += BK) {
    float4 a = *reinterpret_cast<const float4*>(Ap + k0);
    As[ac + 0][ar] = a.x;
    As[ac + 1][ar] = a.y;
    As[ac + 2][ar] = a.z;
    As[ac + 3][ar] = a.w;
    *reinterpret_cast<float4*>(&Bs[br][bc]) =
        *reinterpret_cast<const float4*>(Bp + (long long)k0 * N);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < BK; ++k) outer_8x8(As[k], Bs[k], tx, ty, acc);
    __syncthreads();
  }
  store_8x8(C, N, m0, n0, tx, ty, acc);
}

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}

extern "C" __global__ void __launch_bounds__(256) sgemm_cp_async(
    const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
    int M, int N, int K) {
  __shared__ __align__(16) float As[2][BK][BM];
  __shared__ __align__(16) float Bs[2][BK][BN];
  int tid = threadIdx.x;
  int tx = tid % 16, ty = tid / 16;
  int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  int ar = tid / 2, ac = (tid % 2) * 4;
  int br = tid / 32, bc = (tid % 32) * 4;
  const float* Ap = A + (long long)(m0 + ar) * K + ac;
  const float* Bp = B + (long long)br * N + n0 + bc;
  float acc[8][8] = {{0.f}};
  int KT = K / BK;
  // prologue: tile 0 into buffer 0
  float4 a = *reinterpret_cast<const float4*>(Ap);
  cp_async_16(&Bs[0][br][bc], Bp);
  asm volatile("cp.async.commit_group;\n" ::);
  As[0][ac + 0][ar] = a.x;
  As[0][ac + 1][ar] = a.y;
  As[0][ac + 2][ar] = a.z;
  As[0][ac + 3][ar] = a.w;
  asm volatile("cp.async.wait_group 0;\n" ::);
  __syncthreads();
  for (int kt = 0; kt < KT; ++kt) {
    int cur = kt & 1, nxt = cur ^ 1;
    bool more = kt + 1 < KT;
    if (more) {  // issue the next tile's loads before the math on this one
      a = *reinterpret_cast<const float4*>(Ap + (kt + 1) * BK);
      cp_async_16(&Bs[nxt][br][bc], Bp + (long long)(kt + 1) * BK * N);
      asm volatile("cp.async.commit_group;\n" ::);
    }
#pragma unroll
    for (int k = 0; k < BK; ++k) outer_8x8(As[cur][k], Bs[cur][k], tx, ty, acc);
    if (more) {
      As[nxt][ac + 0][ar] = a.x;
      As[nxt][ac + 1][ar] = a.y;
      As[nxt][ac + 2][ar] = a.z;
      As[nxt][ac + 3][ar] = a.w;
      asm volatile("cp.async.wait_group 0;\n" ::);
    }
    __syncthreads();
  }
  store_8x8(C, N, m0, n0, tx, ty, acc);
}
