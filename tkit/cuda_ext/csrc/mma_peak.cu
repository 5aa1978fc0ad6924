// Peak issue rate of mma.sync.aligned.m16n8k16 (tensor cores driven from registers, the Ampere
// instruction), for comparison with what cuBLAS reaches with wgmma on Hopper.
//
// Each warp keeps ILP independent accumulator sets (one m16n8 tile each) and runs `trips`
// iterations of a loop whose body issues MMA_UNROLL rounds of ILP mma.sync: ILP * MMA_UNROLL
// mma per iteration, no memory instruction inside the loop. Within a set, every mma reads the
// accumulator the previous one wrote (acc = mma(a, b[s], acc)): a dependency chain MMA_UNROLL *
// trips long, so one set alone measures latency-bound issue and ILP >= 2 sets fill the pipe.
// Sets share the A fragment and each has its own B fragment, as in a GEMM warp tile (one A
// fragment multiplied into several n8 tiles).
//
// Nothing can be folded or dropped:
//   * the fragments are hashed from (seed, global thread id, slot) at run time; `mant_bits`
//     (a kernel argument) says how many of the top mantissa bits stay random: all of them for
//     realistic data (full-toggle operands, as cuBLAS sees on randn inputs), 2 for values that
//     are multiples of 1/16 so that the result is exact and tkit.cuda_ext.mma_peak.reference_output
//     can check it on the host. Magnitudes are in [0.25, 0.5), signs random;
//   * the asm is volatile, the accumulators start at different values per set;
//   * every thread stores the sum of all its accumulators to out[global thread id]: one STG
//     after the loop, unconditional. Thread 0 of each block also stores the clock64() cycles
//     its warp spent in the loop to cycles[blockIdx.x] (the SM clock under load, from which the
//     launcher derives the effective clock and mma per SM per cycle).
//
// Kernels (extern "C", no templates in the names), XX = ILP in {1, 2, 4, 8}:
//   mma_peak_bf16_f32_ilpXX   m16n8k16.row.col.f32.bf16.bf16.f32   (the GEMM's instruction)
//   mma_peak_f16_f32_ilpXX    m16n8k16.row.col.f32.f16.f16.f32
//   mma_peak_f16_f16_ilpXX    m16n8k16.row.col.f16.f16.f16.f16     (fp16 accumulators)
// Signature: (float* out, long long* cycles, int trips, unsigned seed, int mant_bits).
// mma per warp per launch = ILP * MMA_UNROLL * trips; 2 * 16 * 8 * 16 = 4096 flops each.
// No headers: compiles under NVRTC and nvcc (sm_80+).

#ifndef MMA_UNROLL
#define MMA_UNROLL 8
#endif

// lowbias32 (Chris Wellons). The launcher's numpy emulation (mma_peak.fragment_values)
// computes the same bits; these three are __host__ too so a host program can check that
__host__ __device__ __forceinline__ unsigned hash32(unsigned x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// 16 bits of one operand element: sign random, exponent fixed ([0.25, 0.5)), the top
// `mant_bits` mantissa bits random, the rest zero
template <bool BF16>
__host__ __device__ __forceinline__ unsigned elem_bits(unsigned seed, unsigned gtid,
                                                       unsigned slot, int mant_bits) {
  const unsigned h = hash32(seed ^ hash32(gtid * 64u + slot));
  const int m = BF16 ? 7 : 10;  // mantissa width
  const unsigned mask = ((1u << mant_bits) - 1u) << (m - mant_bits);
  const unsigned exponent = BF16 ? (125u << 7) : (13u << 10);  // 2^-2 for both
  return ((h >> 31) << 15) | exponent | (h & mask);
}

// register `r` (elements 2r, 2r+1; the lower one in the low half) of a fragment
template <bool BF16>
__host__ __device__ __forceinline__ unsigned frag_reg(unsigned seed, unsigned gtid,
                                                      unsigned slot0, int r, int mant_bits) {
  return elem_bits<BF16>(seed, gtid, slot0 + 2 * r, mant_bits) |
         (elem_bits<BF16>(seed, gtid, slot0 + 2 * r + 1, mant_bits) << 16);
}

__device__ __forceinline__ void mma_bf16_f32(float* c, const unsigned* a, const unsigned* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void mma_f16_f32(float* c, const unsigned* a, const unsigned* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void mma_f16_f16(unsigned* c, const unsigned* a, const unsigned* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 "
      "{%0,%1}, {%2,%3,%4,%5}, {%6,%7}, {%0,%1};\n"
      : "+r"(c[0]), "+r"(c[1])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ float half_bits_to_float(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ unsigned short float_to_half_bits(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(h) : "f"(f));
  return h;
}

__device__ __forceinline__ long long clock_now() {
  long long t;
  asm volatile("mov.u64 %0, %%clock64;\n" : "=l"(t));
  return t;
}

// A fragment: slots 0..7; B fragment of set s: slots 8 + 4 s .. 8 + 4 s + 3
template <int ILP, bool BF16>
__device__ __forceinline__ void load_frags(unsigned* a, unsigned (*b)[2], unsigned seed,
                                           unsigned gtid, int mant_bits) {
#pragma unroll
  for (int r = 0; r < 4; ++r) a[r] = frag_reg<BF16>(seed, gtid, 0, r, mant_bits);
#pragma unroll
  for (int s = 0; s < ILP; ++s) {
    b[s][0] = frag_reg<BF16>(seed, gtid, 8 + 4 * s, 0, mant_bits);
    b[s][1] = frag_reg<BF16>(seed, gtid, 8 + 4 * s, 1, mant_bits);
  }
}

// fp32 accumulators (bf16 or f16 inputs); set s starts at 0.5 * s
template <int ILP, bool BF16>
__device__ __forceinline__ void peak_f32(float* out, long long* cycles, int trips,
                                         unsigned seed, int mant_bits) {
  const unsigned gtid = blockIdx.x * blockDim.x + threadIdx.x;
  unsigned a[4], b[ILP][2];
  load_frags<ILP, BF16>(a, b, seed, gtid, mant_bits);
  float acc[ILP][4];
#pragma unroll
  for (int s = 0; s < ILP; ++s)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[s][r] = 0.5f * s;
  const long long t0 = clock_now();
#pragma unroll 1
  for (int t = 0; t < trips; ++t) {
#pragma unroll
    for (int u = 0; u < MMA_UNROLL; ++u)
#pragma unroll
      for (int s = 0; s < ILP; ++s) {
        if (BF16)
          mma_bf16_f32(acc[s], a, b[s]);
        else
          mma_f16_f32(acc[s], a, b[s]);
      }
  }
  const long long t1 = clock_now();
  float sum = 0.f;
#pragma unroll
  for (int s = 0; s < ILP; ++s)
#pragma unroll
    for (int r = 0; r < 4; ++r) sum += acc[s][r];
  out[gtid] = sum;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

// fp16 accumulators (f16 inputs): two registers of two halves; set s starts at 0.5 * s
template <int ILP>
__device__ __forceinline__ void peak_f16acc(float* out, long long* cycles, int trips,
                                            unsigned seed, int mant_bits) {
  const unsigned gtid = blockIdx.x * blockDim.x + threadIdx.x;
  unsigned a[4], b[ILP][2];
  load_frags<ILP, false>(a, b, seed, gtid, mant_bits);
  unsigned acc[ILP][2];
#pragma unroll
  for (int s = 0; s < ILP; ++s) {
    const unsigned h = float_to_half_bits(0.5f * s);
    acc[s][0] = acc[s][1] = h | (h << 16);
  }
  const long long t0 = clock_now();
#pragma unroll 1
  for (int t = 0; t < trips; ++t) {
#pragma unroll
    for (int u = 0; u < MMA_UNROLL; ++u)
#pragma unroll
      for (int s = 0; s < ILP; ++s) mma_f16_f16(acc[s], a, b[s]);
  }
  const long long t1 = clock_now();
  float sum = 0.f;
#pragma unroll
  for (int s = 0; s < ILP; ++s)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      sum += half_bits_to_float(acc[s][r] & 0xffffu) + half_bits_to_float(acc[s][r] >> 16);
  out[gtid] = sum;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

#define MMA_PEAK_KERNELS(ILP)                                                                  \
  extern "C" __global__ void mma_peak_bf16_f32_ilp##ILP(float* out, long long* cycles,       \
                                                        int trips, unsigned seed,            \
                                                        int mant_bits) {                     \
    peak_f32<ILP, true>(out, cycles, trips, seed, mant_bits);                                \
  }                                                                                          \
  extern "C" __global__ void mma_peak_f16_f32_ilp##ILP(float* out, long long* cycles,        \
                                                       int trips, unsigned seed,             \
                                                       int mant_bits) {                      \
    peak_f32<ILP, false>(out, cycles, trips, seed, mant_bits);                               \
  }                                                                                          \
  extern "C" __global__ void mma_peak_f16_f16_ilp##ILP(float* out, long long* cycles,        \
                                                       int trips, unsigned seed,             \
                                                       int mant_bits) {                      \
    peak_f16acc<ILP>(out, cycles, trips, seed, mant_bits);                                   \
  }

MMA_PEAK_KERNELS(1)
MMA_PEAK_KERNELS(2)
MMA_PEAK_KERNELS(4)
MMA_PEAK_KERNELS(8)
