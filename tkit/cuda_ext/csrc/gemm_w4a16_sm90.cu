// INT4 weight-only GEMM (W4A16) on Hopper's wgmma, sm_90a: rows of a from 1 to any M, the
// path between the GEMV (few rows: a stream of the weight) and dequantize + GEMM (prefill):
//
//   out[m, n] = sum_k a[m, k] * (q[n, k] - z[k / G, n]) * s[k / G, n]  (+ bias[n])
//
// Operands as gemm_int4_sm90.cu's: a (M, K) bf16 (fp16 with -DACT_F16=1), rows 16-byte
// aligned; qweight int32 (K / 8, N), word [i, n] holding q[n, 8 i + j] in bits 4 j .. 4 j + 3;
// scales and zeros (K / G, N) float16 / bfloat16 / float32 (SCALE_T 0 / 1 / 2; no zeros: z =
// 8); out (M, N) row-major in a's dtype. G = GROUP, 32 or a multiple of 64. TMA reads every
// operand and zero-fills what lies past its edges (rows of a past M, columns past N, packed
// rows past K / 8, scale rows past K / G: a weight there is (0 - 0) * 0), so no index the
// kernel makes can leave a tensor; the stores are masked by M and N.
//
// Why: past ~32 rows the GEMV's cost grows with each 32-row block (mma.sync on every block,
// latency-bound at 8 warps an SM), and dequantize + GEMM writes and reads the 16-bit weight.
// Here each weight element is dequantized once a CTA, into wgmma's register operand, and one
// m64nBTk16 wgmma multiplies it by BT rows of a (up to 128) at once:
//   out^T tile (BW weight columns x BT rows of a) = W tile @ a^T tile,
// the weight as A (registers, 64 columns a consumer warpgroup), a's rows as B (the N of the
// wgmma, K-major in shared memory through TMA's 128-byte swizzle). (256 rows a CTA, on one
// warpgroup since two would spill, lost to two 128-row tiles: docs/NOTES.md.)
//
// THREADS = 128 CW + 32: CW consumer warpgroups, then one producer warp (one thread issues
// TMA: a's BT x 64 box, the codes' BW x 8 packed rows, the scale and zero rows of the step)
// into a ring of STAGES 64-deep K steps. A consumer thread (warp w of its warpgroup, lane
// 4 g + t) holds A's fragment for weight columns 16 w + g and + 8 (mma.m16n8k16's A
// layout): in k16 slice kk its registers are K 2t, 2t + 1 (packed row 2 kk) and 2t + 8,
// 2t + 9 (row 2 kk + 1), i.e. byte t of a column's word: one 8-bit shared load, one IMAD
// (b * 0x1001 puts the low nibble at bit 0 and the high one at bit 16), one LOP3 (mask, and
// the magic exponent of 128 for bf16 / 1024 for fp16: (O + q_lo, O + q_hi) exactly), then
//   w = fma(x - A, s, B) as two 16-bit FMAs a pair, where for a zero point with O + z exact
//   in the 16-bit type (every integer code's) A = O + z, B = 0: (q - z) exactly, times s
//   rounded once; for any other z, A = O, B = -z s rounded.
// a 16-bit scale is used as is (a float32 one rounded to a's dtype first). Registers of one
// step's fragment are written while the previous step's wgmmas run (two fragment sets).
//
// Split-K (launcher's choice where the column x row tiles leave SMs idle): split p takes K
// steps [p steps / S, (p + 1) steps / S); each writes its float32 tile to a workspace and
// counts itself in on the tile's counter, and the last to arrive adds the S tiles in split
// order (deterministic), puts the counter back to 0 and stores.
// One local header (sm90_async.cuh, inlined by the loader); nvcc -arch sm_90a.
#define CLUSTER_M 1
#define GROUP_MC 1  // (the header's tile order is not used)
#include "sm90_async.cuh"

#ifndef ACT_F16
#define ACT_F16 0
#endif
#ifndef SCALE_T
#define SCALE_T 1           // 0 float16, 1 bfloat16, 2 float32
#endif
#ifndef BT
#define BT 64               // rows of a a CTA (the wgmma's N)
#endif
#ifndef CW
#define CW 2                // consumer warpgroups, 64 weight columns each
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef GROUP
#define GROUP 128
#endif
#ifndef MINB
#define MINB 1              // CTAs an SM the launch bounds leave registers for
#endif
#define BK 64
#define BW (64 * CW)
#define CTHREADS (128 * CW)
#define THREADS (CTHREADS + 32)
#if SCALE_T == 2
#define SBYTES 4
#else
#define SBYTES 2
#endif
#define SR (GROUP >= BK ? 1 : BK / GROUP)  // scale rows a step
#define A_BYTES (BT * 128)                 // a: BT rows of 64 K, 128-byte swizzled
#define Q_BYTES (8 * BW * 4)               // codes: 8 packed rows of BW words
#define S_BYTES (SR * BW * SBYTES)         // scales (then zeros): SR rows of BW
#define SLOT ((A_BYTES + Q_BYTES + 2 * S_BYTES + 1023) / 1024 * 1024)

#if GROUP % BK && GROUP != 32
#error "GROUP must be 32 or a multiple of 64"
#endif

#include "int4_mma.cuh"

// wgmma m64nBTk16 with A (the weight) from registers, B (a) from shared memory: d += A B
#if BT == 8
#define WG_N "8"
#define WG_ASM asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n" WG_N "k16.f32." MMA_TYPE "." MMA_TYPE " {" \
      "%0, %1, %2, %3" \
      "}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1))
#elif BT == 16
#define WG_N "16"
#define WG_ASM asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n" WG_N "k16.f32." MMA_TYPE "." MMA_TYPE " {" \
      "%0, %1, %2, %3, %4, %5, %6, %7" \
      "}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n" \
      : F8(0) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1))
#elif BT == 32
#define WG_N "32"
#define WG_ASM asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n" WG_N "k16.f32." MMA_TYPE "." MMA_TYPE " {" \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
      "}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n" \
      : F8(0), F8(8) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1))
#elif BT == 64
#define WG_N "64"
#define WG_ASM asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n" WG_N "k16.f32." MMA_TYPE "." MMA_TYPE " {" \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, " \
      "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n" \
      : F8(0), F8(8), F8(16), F8(24) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1))
#elif BT == 128
#define WG_N "128"
#define WG_ASM asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n" WG_N "k16.f32." MMA_TYPE "." MMA_TYPE " {" \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, " \
      "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, " \
      "%34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, " \
      "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n" \
      : F8(0), F8(8), F8(16), F8(24), F8(32), F8(40), F8(48), F8(56) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1))
#else
#error "BT must be 8, 16, 32, 64 or 128"
#endif
__device__ __forceinline__ void wgmma_rs(float* d, const unsigned* a, u64 desc) { WG_ASM; }


__device__ __forceinline__ unsigned hfma2(unsigned a, unsigned b, unsigned c) {
  unsigned d;
#if ACT_F16
  asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
#else
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
#endif
  return d;
}

// a scale or zero at p as a float
__device__ __forceinline__ float load_scale(const unsigned char* p) {
#if SCALE_T == 2
  return *reinterpret_cast<const float*>(p);
#else
  return half_to_f32(*reinterpret_cast<const unsigned short*>(p));
#endif
}

// a weight column's constants for one group: s2 the scale pair, nz2 -A, b2 B (the top)
__device__ __forceinline__ void make_consts(float s, float z, unsigned& s2, unsigned& nz2,
                                            unsigned& b2) {
  const unsigned sh = to_act(s);
  s2 = sh | (sh << 16);
  const float oz = OFFSET_F + z;
  const unsigned short ozh = to_act(oz);
  const bool exact = act_to_f32(ozh) == oz;
  const unsigned nz = exact ? (unsigned)(ozh ^ 0x8000u) : (unsigned)to_act(-OFFSET_F);
  const unsigned bb = exact ? 0u : (unsigned)to_act(-z * s);
  nz2 = nz | (nz << 16);
  b2 = bb | (bb << 16);
}

// the code byte b (nibbles for K 2t and 2t + 1) as the fragment register (w_lo, w_hi)
__device__ __forceinline__ unsigned deq(unsigned b, unsigned nz2, unsigned s2, unsigned b2) {
  unsigned p;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n"
      : "=r"(p) : "r"(b * 0x1001u), "r"(0x000F000Fu), "r"(MAGIC));
  return hfma2(hfma2(p, ONES, nz2), s2, b2);
}

extern "C" __global__ void __launch_bounds__(THREADS, MINB)
gemm_w4a16(const __grid_constant__ TmaDesc a_map, const __grid_constant__ TmaDesc q_map,
           const __grid_constant__ TmaDesc s_map, const __grid_constant__ TmaDesc z_map,
           unsigned short* __restrict__ out, const unsigned short* __restrict__ bias,
           float* __restrict__ ws, int* __restrict__ counters, int M, int N, int K,
           int has_zeros, int tiles_m, int splits) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  __shared__ int last_arrival;
  const unsigned base = smem_aligned_1024(smem_raw);
  // the same bytes through a generic pointer: C++ loads the compiler may schedule (the
  // mbarrier waits' "memory" clobbers keep them after the waits)
  const unsigned char* gbase = smem_raw + (base - smem_u32(smem_raw));
  const unsigned bars = base + STAGES * SLOT;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // the row tiles of a column tile are neighbours in the grid (its codes from L2 after the
  // first), the K splits outermost
  const int tiles_n = (N + BW - 1) / BW;
  const int tm = blockIdx.x % tiles_m;
  const int rest = blockIdx.x / tiles_m;
  const int tn = rest % tiles_n, split = rest / tiles_n;
  const int steps = (K + BK - 1) / BK;
  const int kb0 = (int)((long long)split * steps / splits);
  const int nsteps = (int)((long long)(split + 1) * steps / splits) - kb0;

  init_ring(bars, STAGES, 4 * CW, 1);

  if (warp == 4 * CW) {  // ---- producer ----
    if (lane == 0) {
      const unsigned tx = A_BYTES + Q_BYTES + S_BYTES * (has_zeros ? 2 : 1);
      for (int i = 0; i < nsteps; ++i) {
        const int s = i % STAGES;
        if (i >= STAGES) mbar_wait(bars + 8u * (STAGES + s), ((i / STAGES) - 1) & 1);
        const unsigned full = bars + 8u * s, slot = base + s * SLOT;
        const int kb = kb0 + i, srow = kb * BK / GROUP;
        mbar_expect_tx(full, tx);
        tma_load_2d(slot, &a_map, kb * BK, tm * BT, full);
        tma_load_2d(slot + A_BYTES, &q_map, tn * BW, kb * (BK / 8), full);
        tma_load_2d(slot + A_BYTES + Q_BYTES, &s_map, tn * BW, srow, full);
        if (has_zeros)
          tma_load_2d(slot + A_BYTES + Q_BYTES + S_BYTES, &z_map, tn * BW, srow, full);
      }
    }
    return;
  }

  // ---- consumers: warpgroup c, warp w of it, lane 4 g + t ----
  const int c = warp / 4, w = warp % 4, g = lane / 4, t = lane % 4;
  const int col = 64 * c + 16 * w + g;  // this thread's weight columns: col, col + 8
  float acc[BT / 2];
#pragma unroll
  for (int e = 0; e < BT / 2; ++e) acc[e] = 0.f;
  unsigned cs[SR][2], cz[SR][2], cb[SR][2];  // a group's constants, columns col / col + 8

  auto consts = [&](unsigned off) {
#pragma unroll
    for (int sr = 0; sr < SR; ++sr)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const unsigned char* sp =
            gbase + off + A_BYTES + Q_BYTES + sr * (BW * SBYTES) + (col + 8 * h) * SBYTES;
        const float s = load_scale(sp);
        const float z = has_zeros ? load_scale(sp + S_BYTES) : 8.f;
        make_consts(s, z, cs[sr][h], cz[sr][h], cb[sr][h]);
      }
  };
  auto dequant = [&](unsigned off, unsigned (&A)[4][4]) {
    const unsigned char* q = gbase + off + A_BYTES + col * 4 + t;
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      const int gr = SR == 1 ? 0 : r * 8 / GROUP;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        A[r / 2][(r & 1) * 2 + h] = deq(q[r * (BW * 4) + 32 * h], cz[gr][h], cs[gr][h],
                                        cb[gr][h]);
    }
  };
  // step i's slot: wait for it, its group's constants, its fragments into A
  auto load = [&](int i, unsigned (&A)[4][4]) {
    const int s = i % STAGES;
    mbar_wait(bars + 8u * s, (i / STAGES) & 1);
    if (SR > 1 || i == 0 || ((kb0 + i) * BK) % GROUP == 0) consts(s * SLOT);
    dequant(s * SLOT, A);
  };
  // step i's wgmmas on fragments A; the next step's fragments (N) are made while they run,
  // and they are waited for before the next issue (ptxas serializes wgmmas whose register
  // operands are written while an earlier group is in flight and feed a wgmma before it
  // retires). A group a k16 slice with three kept in flight, each slice's fragment made as
  // the group three back retires, builds without that and was slower (docs/NOTES.md)
  auto step = [&](int i, unsigned (&A)[4][4], unsigned (&N)[4][4]) {
    const int s = i % STAGES;
    wgmma_fence();
    // K-major a tile: SBO 1024 B between 8-row core groups, LBO unused (16)
    const u64 desc = sw128_desc(base + s * SLOT, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_rs(acc, A[kk], desc + (kk * 32 >> 4));
    wgmma_commit();
    if (i + 1 < nsteps) load(i + 1, N);
    wgmma_wait0();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) fence_operand(A[kk][e]);
    if (lane == 0) mbar_arrive(bars + 8u * (STAGES + s));
  };

  unsigned A0[4][4], A1[4][4];
  if (nsteps > 0) load(0, A0);
  for (int i = 0; i < nsteps; i += 2) {
    step(i, A0, A1);
    if (i + 1 < nsteps) step(i + 1, A1, A0);
  }
  wgmma_wait0();
#pragma unroll
  for (int e = 0; e < BT / 2; ++e) fence_operand(acc[e]);

  const int ctid = threadIdx.x;
  const int tile = tn * tiles_m + tm;
  if (splits > 1) {
    float* mine = ws + ((size_t)(tile * splits + split) * CTHREADS + ctid) * (BT / 2);
#pragma unroll
    for (int e = 0; e < BT / 2; e += 4)
      *reinterpret_cast<float4*>(mine + e) = make_float4(acc[e], acc[e + 1], acc[e + 2],
                                                         acc[e + 3]);
    __threadfence();
    named_bar(1, CTHREADS);
    if (ctid == 0) {
      const int prev = atomicAdd(counters + tile, 1);
      last_arrival = prev == splits - 1;
      if (prev == splits - 1) counters[tile] = 0;  // every split is in: back to 0
    }
    named_bar(1, CTHREADS);
    if (!last_arrival) return;
    __threadfence();
#pragma unroll
    for (int e = 0; e < BT / 2; ++e) acc[e] = 0.f;
    for (int p = 0; p < splits; ++p) {
      const float* src = ws + ((size_t)(tile * splits + p) * CTHREADS + ctid) * (BT / 2);
#pragma unroll
      for (int e = 0; e < BT / 2; e += 4) {
        const float4 v = __ldcg(reinterpret_cast<const float4*>(src + e));
        acc[e] += v.x, acc[e + 1] += v.y, acc[e + 2] += v.z, acc[e + 3] += v.w;
      }
    }
  }
  // d[4 j + 2 h + e] is (weight column col + 8 h, row of a 8 j + 2 t + e)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int n = tn * BW + col + 8 * h;
    if (n >= N) continue;
    const float bv = bias != nullptr ? act_to_f32(bias[n]) : 0.f;
#pragma unroll
    for (int j = 0; j < BT / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int m = tm * BT + 8 * j + 2 * t + e;
        if (m < M) out[(size_t)m * N + n] = to_act(acc[4 * j + 2 * h + e] + bv);
      }
  }
}
