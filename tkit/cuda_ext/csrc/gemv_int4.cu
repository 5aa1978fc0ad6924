// INT4 weight-only GEMV at decode sizes (W4A16; 8 NT rows of a a CTA, more in more CTAs), sm_90a:
//
//   out[m, n] = sum_k a[m, k] * (q[n, k] - z[k / G, n]) * s[k / G, n]  (+ bias[n])
//
// Operands as gemm_int4_sm90.cu takes them (tkit's layout: qweight int32 (K / 8, N), word
// [i, n] holding q[n, 8 i + j] in bits 4 j .. 4 j + 3; scales and zeros (K / G, N) float16 /
// bfloat16 / float32, SCALE_T 0 / 1 / 2; zeros in code units, none: z = 8); a (M, K) bf16
// (fp16 with -DACT_F16=1) with 16-byte aligned rows; out (M, N) row-major in a's dtype.
// N a multiple of 32, G = GROUP a multiple of 32 dividing K (the launcher checks).
//
// Why a second kernel: at M = 1 the work is a read of the weight (31 MB at K=4096 N=14336),
// and the Triton GEMV's FMAs take ~3.5 instructions a weight, enough to make issue a large
// share of its time. Here a 32-bit word is dequantized two weights a LOP3 into mma.sync
// m16n8k16's register operand (the weight as A: out^T = W a^T, the rows of a the MMA's 8
// columns), the numerics of gemm_int4_sm90.cu:
//   sum_k a_k (q_k - z) s = s (sum_k a_k (O + q_k)) - s (O + z) (sum_k a_k),
// nibbles OR-ed into the mantissa of O = 128 (bf16) / 1024 (fp16), sum_k a_k from an MMA by
// an all-ones A, offset and zero point off once a group in float32: ~1.9 instructions a
// weight in the K loop. That kernel's TMA ring and stream-K cost fixed time at these sizes
// (~2-3 us to the first slot, ~2 us of hand-over); this one has none: a CTA is one
// 32-column slab with KL warps ("K lanes") on equal runs of whole groups, each thread loading
// its codes straight into register rings (PF chunks a pass; a ring in shared memory filled by
// cp.async, 1 to 15 chunks ahead, took 1.5-1.8x their time, and an L2 prefetch of the codes
// 8 to 32 chunks ahead 1.04-1.29x, the more the further: see docs/NOTES.md), a and the
// scales into smaller rings beside it; the lanes are summed once at the end through shared
// memory, in warp order (deterministic).
//
// Warp w's lane 4 g + t holds columns 4 g .. 4 g + 3 of the slab (tile 0: MMA rows g, g + 8
// = columns 4 g, 4 g + 1; tile 1: 4 g + 2, 4 g + 3) and, in chunk c (32 K), packed row
// r = 4 c + t: one 16-byte load of 4 words. In k16 step e the MMA's K slots 2t / 2t+1 /
// 2t+8 / 2t+9 are K = 8 r + 2 e + {0, 4, 1, 5}, so (w >> 4 i) & 0x000F000F is one register of
// the operand. B's column j is row 8 nt + j of a.
//
// Memory safety: every code, scale and zero index lies inside (K / 8, N) / (K / G, N) by the
// launcher's checks (N % 32, K % G, G % 32; the grid's CTAs N / 32 times the row blocks); a
// is read at its block's rows < M (rows past M read the last one: their B columns
// only feed C columns that are never stored) and K < K; stores masked by M. Offsets into
// qweight, a, the scales and out are 64-bit.
#ifndef NT
#define NT 1  // n8 tiles of rows of a a CTA: 1, 2 or 4 (8 NT rows; more rows: more CTAs a slab)
#endif
#if NT != 1 && NT != 2 && NT != 4
#error "NT must be 1, 2 or 4"
#endif
#ifndef KL
#define KL 4  // warps (K lanes) a CTA
#endif
#ifndef PF
// 32-deep chunks of codes a ring pass. A single ring (RB 1) reloads each slot as it reads it,
// and ptxas issues those loads a third of the way into the pass and waits for all of them on
// one scoreboard at the next pass's top, so deeper single rings hide no more: 4 was fastest
#define PF 4
#endif
#ifndef RB
// rings: with 2, a pass first loads the next pass's codes (and scales) into the other ring,
// so they have the whole pass in flight (the launcher's default, with PF 2: two rings of 4
// were slower at 8 rows and at 16, where they fit only with AS 1)
#define RB 1
#endif
#ifndef PA
#define PA 2  // 32-deep chunks of a in flight a thread (from L1 / L2); PF a multiple of it
#endif
#ifndef AS
// the groups' sums of a: 0, an MMA by an all-ones A each k16 step and n8 tile (B the rows of
// a, so each thread's C holds the sums of the rows its sums need); 1, one MMA a k16 step
// (NT 2) or a chunk (NT 1) with two of those B fragments side by side as A (the registers
// they are in) and a 0/1 B that sums each fragment's K slots into its own C column: half
// those MMAs, the sums then in row order (thread 4 g + t holds row g's), moved to
// the threads that need them by 2 NT shuffles a group (the launcher's default at 16 rows,
// where it freed 4 registers and took 0.97-1.00x the time; level or slower at 8 rows or fewer)
#define AS 0
#endif
#ifndef GROUP
#define GROUP 128
#endif
#ifndef SCALE_T
#define SCALE_T 0  // 0 float16, 1 bfloat16, 2 float32
#endif
#ifndef ACT_F16
#define ACT_F16 0
#endif
#ifndef WS
// warps an SM the launch bounds leave room for: 16 (128 registers a thread) up to 16 rows;
// 32 rows hold twice the sums and a's chunks
#define WS 16
#endif
#define THREADS (32 * KL)
#define MIN_BLOCKS (KL >= WS ? 1 : WS / KL)
#define GC (GROUP / 32)                     // chunks a group
#if SCALE_T == 2
#define SBYTES 4
#else
#define SBYTES 2
#endif

#include <type_traits>

#include "int4_mma.cuh"

typedef unsigned long long u64;
template <int B>
using Ring = std::integral_constant<int, B>;  // a ring index the code fixes

// 16 bytes of streamed codes: read once, not kept in L1
__device__ __forceinline__ uint4 ld_codes(const unsigned* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// PF 32-deep chunks a ring in registers, and scale rows: where PF is a multiple of the
// group's chunks (GC), the scales of each group ending in the ring (PF / GC slots, loaded PF
// chunks ahead like the codes); where GC is a multiple of PF, one slot loaded as its group
// starts (at least GC - 1 >= PF chunks ahead of its use)
#define SCALES_AHEAD (PF % GC == 0)
#define SLOTS (SCALES_AHEAD ? PF / GC : 1)
#define SW (SBYTES)  // 32-bit words of 4 scales

__device__ __forceinline__ void ld_scales(const unsigned char* p, unsigned* r) {
#if SCALE_T == 2
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(p));
#else
  asm("ld.global.nc.v2.u32 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "l"(p));
#endif
}

// the 4 scales (or zeros) of ld_scales' words as floats
__device__ __forceinline__ void unpack4(const unsigned* r, float* v) {
#if SCALE_T == 2
  v[0] = __uint_as_float(r[0]), v[1] = __uint_as_float(r[1]);
  v[2] = __uint_as_float(r[2]), v[3] = __uint_as_float(r[3]);
#else
  v[0] = half_to_f32(r[0] & 0xFFFF), v[1] = half_to_f32(r[0] >> 16);
  v[2] = half_to_f32(r[1] & 0xFFFF), v[3] = half_to_f32(r[1] >> 16);
#endif
}

__device__ __forceinline__ uint4 ld_act(const unsigned short* p) {
  uint4 v;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
gemv_int4(const unsigned* __restrict__ q, const unsigned short* __restrict__ a,
          const unsigned char* __restrict__ s, const unsigned char* __restrict__ z,
          unsigned short* __restrict__ out, const unsigned short* __restrict__ bias,
          int M, int N, int K, int lda, int lds, int ldz, int has_zeros) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  // CTA b: slab b / RBS, rows 8 NT (b % RBS) ..; a slab's row blocks are neighbours in the
  // grid, so they run at once and all but the first read its codes from L2 (the block's row
  // offset is worked out again for the stores: kept live, out's would cost registers)
  const int rbs = (M + 8 * NT - 1) / (8 * NT), slab = blockIdx.x / rbs;
  const int row0 = 8 * NT * (blockIdx.x % rbs), rows = min(M - row0, 8 * NT);
  const int col0 = 32 * slab + 4 * g;  // this thread's 4 columns
  const int ng = K / GROUP;
  // this warp's groups (a contiguous run: it promotes once a group) and chunks
  const int g0 = warp * ng / KL, g1 = (warp + 1) * ng / KL;
  const int c0 = g0 * GC, c1 = g1 * GC;

  // chunk c: packed row r = 4 c + t of the codes (4 columns), and a's row 8 nt + g at K = 8 r
  // (rows past M read row M - 1: B's column g then only feeds C's column g, never stored)
  const u64 qstep = (u64)4 * N;
  const unsigned* qp = q + (u64)(4 * c0 + t) * N + col0;
  const unsigned short* ap[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
    ap[nt] = a + (u64)(row0 + min(8 * nt + g, rows - 1)) * lda + 8 * (4 * c0 + t);
  const unsigned char* sp = s + (u64)col0 * SBYTES;
  const unsigned char* zp = z + (u64)col0 * SBYTES;
  const u64 srow = (u64)lds * SBYTES, zrow = (u64)ldz * SBYTES;

  uint4 ring[RB][PF], aring[PA][NT];
  unsigned sraw[RB * SLOTS][SW], zraw[RB * SLOTS][SW];
  auto load_scales = [&](int slot, int grp) {
    ld_scales(sp + grp * srow, sraw[slot]);
    if (has_zeros) ld_scales(zp + grp * zrow, zraw[slot]);
  };
  // ---- the ring's first PF chunks (and the scales of the groups they end) ----
#pragma unroll
  for (int i = 0; i < PF; ++i)
    if (c0 + i < c1) {
      ring[0][i] = ld_codes(qp + i * qstep);
      if (i < PA)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) aring[i][nt] = ld_act(ap[nt] + 32 * i);
      if (SCALES_AHEAD && (i + 1) % GC == 0) load_scales(i / GC, (c0 + i) / GC);
    }
  qp += PF * qstep;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) ap[nt] += 32 * PA;

  // AS: tiles 2 p and 2 p + 1 (NT >= 2) sum into asx[p]
  constexpr int NP = NT == 1 ? 1 : NT / 2;
  float acc[2][NT][4], sum[2][NT][4], asum[NT][4], asx[NP][4];
#pragma unroll
  for (int p = 0; p < NP; ++p)
#pragma unroll
    for (int e = 0; e < 4; ++e) asx[p][e] = 0.f;
#pragma unroll
  for (int u = 0; u < 2; ++u)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[u][nt][e] = sum[u][nt][e] = 0.f;
  if (!AS)  // (AS fills asum from asx at each group's end)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) asum[nt][e] = 0.f;
  const unsigned mask = 0x000F000Fu, magic = MAGIC, ones = ONES;
  const unsigned bsel0 = g % 2 ? 0u : ONES, bsel1 = g % 2 ? ONES : 0u;  // AS's B

  // one ring pass: chunks c .. c + PF - 1 from ring B (TAIL: some of them, or their
  // successors' loads, past this warp's run)
  auto pass = [&](int c, auto tail, auto buf) {
    constexpr bool TAIL = decltype(tail)::value;
    constexpr int B = decltype(buf)::value, NB = (B + 1) % RB;
    if constexpr (RB == 2) {  // the next pass's codes and scales, a whole pass ahead
#pragma unroll
      for (int i = 0; i < PF; ++i)
        if (!TAIL || c + PF + i < c1) {
          ring[NB][i] = ld_codes(qp + i * qstep);
          if (SCALES_AHEAD && (i + 1) % GC == 0)
            load_scales(NB * SLOTS + i / GC, (c + PF + i) / GC);
        }
      qp += PF * qstep;
    }
#pragma unroll
    for (int i = 0; i < PF; ++i) {
      const int cc = c + i;
      if (TAIL && cc >= c1) break;
      if (!SCALES_AHEAD && i == 0 && cc % GC == 0) load_scales(0, cc / GC);
      // the chunk's operands first, then (one ring) the slot's next loads into the same
      // registers: no copies of the ring at the loop's back edge
      const uint4 w = ring[B][i];
      unsigned p[4][4];  // [word][nibble pair]
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const unsigned wj = j == 0 ? w.x : j == 1 ? w.y : j == 2 ? w.z : w.w;
#pragma unroll
        for (int k = 0; k < 4; ++k) p[j][k] = pair(wj, k, mask, magic);
      }
      unsigned b[NT][2][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint4 v = aring[i % PA][nt];
        b[nt][0][0] = prmt(v.x, v.z, 0x5410);
        b[nt][0][1] = prmt(v.x, v.z, 0x7632);
        b[nt][1][0] = prmt(v.y, v.w, 0x5410);
        b[nt][1][1] = prmt(v.y, v.w, 0x7632);
      }
      if (RB == 1 && (!TAIL || cc + PF < c1)) ring[0][i] = ld_codes(qp);
      if (!TAIL || cc + PA < c1)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) aring[i % PA][nt] = ld_act(ap[nt]);
      if (RB == 1) qp += qstep;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) ap[nt] += 32;
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          mma(sum[0][nt], p[0][2 * e], p[1][2 * e], p[0][2 * e + 1], p[1][2 * e + 1],
              b[nt][e][0], b[nt][e][1]);
          mma(sum[1][nt], p[2][2 * e], p[3][2 * e], p[2][2 * e + 1], p[3][2 * e + 1],
              b[nt][e][0], b[nt][e][1]);
          if (!AS) mma(asum[nt], ones, ones, ones, ones, b[nt][e][0], b[nt][e][1]);
        }
      // A = {X0, X1, Y0, Y1}: row g holds X's first pair (K slots 0..7) and Y's first (8..15),
      // row g + 8 their second pairs; B column g = 1 on K slots 0..7 (g even) or 8..15 (g
      // odd): C (g, 2t) / (g, 2t + 1) / (g + 8, 2t) / (g + 8, 2t + 1) = the sums of X's first
      // pair / Y's first / X's second / Y's second
      if (AS && NT == 1) {  // X, Y: row g at k16 steps 0, 1
        mma(asx[0], b[0][0][0], b[0][0][1], b[0][1][0], b[0][1][1], bsel0, bsel1);
      } else if (AS) {  // X, Y: rows 16 p + g, 16 p + 8 + g
#pragma unroll
        for (int e = 0; e < 2; ++e)
#pragma unroll
          for (int q2 = 0; q2 < NP; ++q2)
            mma(asx[q2], b[2 * q2][e][0], b[2 * q2][e][1], b[2 * q2 + 1][e][0],
                b[2 * q2 + 1][e][1], bsel0, bsel1);
      }
      // the group ends (runs start at a group: with PF a multiple of GC, at a fixed i)
      const bool ends = SCALES_AHEAD ? ((i + 1) % GC == 0) : (i == PF - 1 && (cc + 1) % GC == 0);
      if (ends) {  // scale, zero point, offset; then (one ring) the scales PF chunks ahead
        const int slot = SCALES_AHEAD ? B * SLOTS + i / GC : 0;
        if (AS) {  // C column 2 t + e of tile nt needs row 8 nt + 2 t + e's sum: lane 8 t + 4 e's
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const float* x = asx[nt / 2];
            const float v = NT == 1 ? (x[0] + x[2]) + (x[1] + x[3])
                                    : nt % 2 == 0 ? x[0] + x[2] : x[1] + x[3];
            const float s0 = __shfl_sync(0xFFFFFFFFu, v, 8 * t);
            const float s1 = __shfl_sync(0xFFFFFFFFu, v, 8 * t + 4);
            asum[nt][0] = asum[nt][2] = s0, asum[nt][1] = asum[nt][3] = s1;
          }
#pragma unroll
          for (int p = 0; p < NP; ++p)
#pragma unroll
            for (int e = 0; e < 4; ++e) asx[p][e] = 0.f;
        }
        float sc[4], zs[4], cz[4];
        unpack4(sraw[slot], sc);
        if (has_zeros) {
          unpack4(zraw[slot], zs);
        } else {
#pragma unroll
          for (int k = 0; k < 4; ++k) zs[k] = 8.f;
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) cz[k] = (OFFSET_F + zs[k]) * sc[k];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int u = 0; u < 2; ++u)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int k = 2 * u + e / 2;  // column col0 + k
              acc[u][nt][e] = fmaf(-cz[k], asum[nt][e], fmaf(sc[k], sum[u][nt][e], acc[u][nt][e]));
              sum[u][nt][e] = 0.f;
            }
        if (!AS)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) asum[nt][e] = 0.f;
        if (RB == 1 && SCALES_AHEAD && (!TAIL || cc + PF < c1)) load_scales(slot, (cc + PF) / GC);
      }
    }
  };
  int c = c0;
  if constexpr (RB == 1) {
    for (; c + 2 * PF <= c1; c += PF) pass(c, std::false_type{}, Ring<0>{});
    for (; c < c1; c += PF) pass(c, std::true_type{}, Ring<0>{});
  } else {  // passes in pairs: the rings' roles are fixed in the code
    for (; c + 3 * PF <= c1; c += 2 * PF) {
      pass(c, std::false_type{}, Ring<0>{});
      pass(c + PF, std::false_type{}, Ring<1>{});
    }
    for (; c < c1; c += 2 * PF) {
      pass(c, std::true_type{}, Ring<0>{});
      if (c + PF < c1) pass(c + PF, std::true_type{}, Ring<1>{});
    }
  }

  // ---- the K lanes meet: warps 1.. hand their sums to warp 0, added in warp order ----
  constexpr int PER = 8 * NT;  // floats a thread
  if (KL > 1) {
    __shared__ __align__(16) float red[(KL > 1 ? KL - 1 : 1) * 32 * PER];
    if (warp > 0) {
      float* dst = red + ((warp - 1) * 32 + lane) * PER;
#pragma unroll
      for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          *reinterpret_cast<float4*>(dst + (u * NT + nt) * 4) =
              make_float4(acc[u][nt][0], acc[u][nt][1], acc[u][nt][2], acc[u][nt][3]);
    }
    __syncthreads();
    if (warp > 0) return;
    for (int k = 1; k < KL; ++k) {
      const float* src = red + ((k - 1) * 32 + lane) * PER;
#pragma unroll
      for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const float4 v = *reinterpret_cast<const float4*>(src + (u * NT + nt) * 4);
          acc[u][nt][0] += v.x, acc[u][nt][1] += v.y, acc[u][nt][2] += v.z, acc[u][nt][3] += v.w;
        }
    }
  }
  // the CTA index read again (volatile: not the one row0 came from, which the compiler would
  // otherwise keep live through the K loop, and spill at 16 rows with bf16 scales)
  unsigned cta;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(cta));
  const int r0 = 8 * NT * ((int)cta % ((M + 8 * NT - 1) / (8 * NT)));
#pragma unroll
  for (int u = 0; u < 2; ++u)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = col0 + 2 * u + h;  // < N: N is a multiple of 32
      const float bv = bias != nullptr ? act_to_f32(bias[n]) : 0.f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int m = r0 + 8 * nt + 2 * t + e;  // C column 2 t + e: block row 8 nt + 2 t + e
          if (m < M) out[(u64)m * N + n] = to_act(acc[u][nt][2 * h + e] + bv);
        }
    }
}
