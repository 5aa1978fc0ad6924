// INT4 weight-only GEMM at decode sizes (W4A16, M <= 32 rows of a), sm_90a:
//
//   out[m, n] = sum_k a[m, k] * (q[n, k] - z[k / G, n]) * s[k / G, n]  (+ bias[n])
//
// a (M, K) bf16 (fp16 with -DACT_F16=1), row-major with 16-byte aligned rows; the weight in
// tkit's layout: qweight int32 (K / 8, N), word [i, n] holding q[n, 8 i + j] in bits 4 j ..
// 4 j + 3; scales and zeros (K / G, N) (zeros in code units; none: z = 8), float16 / bfloat16
// / float32 (SCALE_T 0 / 1 / 2), rows 16-byte aligned; out (M, N) in a's dtype. G a multiple
// of 32. TMA reads every operand and zero-fills what lies past its edges (columns past N,
// packed rows past K / 8, rows of a past M, scale rows past K / G), so no index the kernel
// makes can leave a tensor; the output stores are masked by M and N.
//
// Why CUDA: the work is a stream of the weight (29 MB of codes at K=4096 N=14336), and at
// M > 1 the Triton kernels could not both keep enough of it in flight and feed the tensor
// cores (the tc kernel: few warps an SM, latency-bound). Here one producer warp keeps STAGES
// slots of 512-deep K steps in flight through TMA (32 KiB of codes a slot, in four boxes a
// step: each operand's 128 columns as one 3-d box, the 32-column slab a dimension, since
// small boxes cost the TMA unit per operation), and the work is dealt out as equal runs of
// K steps over one CTA an SM (stream-K), so every SM streams the same bytes, no last wave.
//
// 288 threads: warps 0-7 consume, warp 8 produces (one thread). Consumer warp 4 kw + slab
// takes the slab's 32 columns and half kw of each step's 16 chunks of 32 K (a contiguous
// half, so it promotes once a group). Per chunk j a thread (lane = 4 g + t) takes the four
// words of packed row r = 4 j + t at the columns 4 c(g) .. 4 c(g) + 3 of its slab (one
// 16-byte shared load; c is the permutation below, which with TMA's 128-byte swizzle makes
// the load free of bank conflicts), dequantizes them to the MMA's register operand and
// multiplies on mma.sync m16n8k16 with the weight as A:
//   out^T (columns x rows of a) = W a^T.
// The MMA's K order is a permutation of the chunk's (the weight and a take the same one): in
// k16 step e (0, 1) slot 2t / 2t+1 / 2t+8 / 2t+9 is K = 8 r + 2 e + {0, 4, 1, 5},
// so a word's nibble pairs (j, j + 4) are one register each: (w >> 4 i) & 0x000F000F OR-ed
// into the exponent of 128 (bf16 0x4300; fp16 1024, 0x6400) is (O + q_j, O + q_j+4) exactly,
// one shift and one LOP3 per two weights, and a's 8 values of row r are one 16-byte load and
// four PRMTs. Offset and zero point come off once per group in float32:
//   sum_k a_k (q_k - z) s = s (sum_k a_k (O + q_k)) - s (O + z) (sum_k a_k),
// with sum_k a_k from an MMA of the same a fragment by an all-ones A (the tensor pipe is
// otherwise idle here); exact for any z up to float32 rounding (O costs ~4 of float32's 24
// bits in bf16, ~7 in fp16).
// The MMA's rows (weight columns) and columns (rows of a) are permuted too, c(g) =
// (0, 4, 1, 5, 2, 6, 3, 7)[g]: lane group g holds columns 4 c(g) + {0, 1} (tile 0 rows g,
// g + 8) and + {2, 3} (tile 1), and loads row c(g) (+ 8 in the second n8 tile) of a.
//
// Stream-K: the (column tile, K step) pairs in tile-major order, split into equal runs over
// the grid. A tile that one CTA covers is stored from registers (the two halves of each
// step meet through shared memory first); the pieces of a shared tile are added up in CTA
// order (deterministic) by the last to finish: a piece that finds every other one already
// in finishes at once, the others store their float32 sums in a workspace (two slots a CTA:
// the first and the last tile of its run) and count themselves in on the tile's counter
// (put back to 0 by the finisher).
// One local header (sm90_async.cuh, inlined by the loader); nvcc -arch sm_90a.
#define CLUSTER_M 1
#define GROUP_MC 1  // (the header's tile order is not used)
#include "sm90_async.cuh"

#ifndef ACT_F16
#define ACT_F16 0
#endif
#define BN 128              // columns a tile (4 consumer warps x 32)
#define BKQ 64              // packed rows a K step (512-deep K steps)
#define KSTEP (BKQ * 8)
#define NCH (BKQ / 4)       // 32-deep chunks a step
#define KW 2                // consumer warps a 32-column slab (each takes half of each step)
#define CWARPS (4 * KW)
#define THREADS (32 * (CWARPS + 1))
#ifndef NT
#define NT 2                // n8 tiles of rows of a: 8 NT rows (1, 2 or 4: M <= 8, 16, 32)
#endif
#ifndef STAGES
#define STAGES 3
#endif
#ifndef SR
#define SR 4                // scale rows a K step: KSTEP / G (1 where G >= KSTEP)
#endif
#ifndef SCALE_T
#define SCALE_T 0           // 0 float16, 1 bfloat16, 2 float32
#endif
#define MPAD (8 * NT)
#if SCALE_T == 2
#define SBYTES 4
#else
#define SBYTES 2
#endif
#define GQ (NCH / SR)       // 32-deep chunks a group (G < KSTEP; SR 1: the step's NCH)
#define W_BYTES (4 * BKQ * 128)       // codes: a 32-column box of 128-byte rows a warp
#define A_BYTES (KSTEP / 64 * MPAD * 128)     // a: 64-deep boxes of MPAD 128-byte rows
#define S_BOX (SR * 32 * SBYTES)                   // one warp's scale rows (a TMA box)
#define S_WARP S_BOX                               // (the 4 slabs' boxes are one TMA box)
#define S_BYTES ((4 * S_WARP + 1023) / 1024 * 1024)
#define SLOT_BYTES (W_BYTES + A_BYTES + 2 * S_BYTES)

#include "int4_mma.cuh"

// a 3-d box (c0 innermost) into shared memory, completing on the mbarrier
__device__ __forceinline__ void tma_load_3d(unsigned dst, const TmaDesc* map, int c0, int c1,
                                            int c2, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n"
      ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// the 4 consecutive scales (or zeros) at p (8- or 16-byte aligned) as floats: one load
__device__ __forceinline__ void scale4(const unsigned char* p, float* v) {
#if SCALE_T == 2
  const float4 f = *reinterpret_cast<const float4*>(p);
  v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
#else
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  v[0] = half_to_f32(u.x & 0xFFFF), v[1] = half_to_f32(u.x >> 16);
  v[2] = half_to_f32(u.y & 0xFFFF), v[3] = half_to_f32(u.y >> 16);
#endif
}

// the CTA whose run holds K step x of the flattened (tile, step) order: runs are
// [c total / P, (c + 1) total / P)
__device__ __forceinline__ int owner_of(int x, int total, int P) {
  return (int)(((long long)(x + 1) * P - 1) / total);
}
__device__ __forceinline__ int run_begin(int c, int total, int P) {
  return (int)((long long)c * total / P);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
gemm_int4(const __grid_constant__ TmaDesc q_map, const __grid_constant__ TmaDesc a_map,
          const __grid_constant__ TmaDesc s_map, const __grid_constant__ TmaDesc z_map,
          unsigned short* __restrict__ out, const unsigned short* __restrict__ bias,
          float* __restrict__ ws, int* __restrict__ counters, int M, int N, int K, int G,
          int has_zeros, int steps) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned base = smem_aligned_1024(smem_raw);
  // the same bytes through a generic pointer: C++ loads the compiler may schedule (the
  // mbarrier waits' "memory" clobbers keep them after the waits)
  const unsigned char* gbase = smem_raw + (base - smem_u32(smem_raw));
  const unsigned bars = base + STAGES * SLOT_BYTES;
  // where the two halves of a step meet (after the ring and its barriers)
  float* merge = reinterpret_cast<float*>(const_cast<unsigned char*>(gbase) +
                                          STAGES * SLOT_BYTES + 1024);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int P = gridDim.x;
  const int tiles = (N + BN - 1) / BN;
  const int total = tiles * steps;  // < 2^31 (the launcher checks)
  const int x0 = run_begin(blockIdx.x, total, P), x1 = run_begin(blockIdx.x + 1, total, P);

  init_ring(bars, STAGES, CWARPS, 1);

  if (warp == CWARPS) {  // ---- producer ----
    if (lane == 0) {
      const unsigned tx = W_BYTES + A_BYTES + 4 * S_BOX * (has_zeros ? 2 : 1);
      int tile = x0 / steps, ks = x0 % steps;
      for (int x = x0, i = 0; x < x1; ++x, ++i) {
        const int s = i % STAGES;
        if (i >= STAGES) mbar_wait(bars + 8u * (STAGES + s), ((i / STAGES) - 1) & 1);
        const unsigned full = bars + 8u * s, slot = base + s * SLOT_BYTES;
        mbar_expect_tx(full, tx);
        // four TMA boxes a step, three over the tile's 4 slabs of 32 columns (the slab a
        // third dimension): codes (32 x BKQ x 4), scale and zero rows (32 x SR x 4: the SR
        // groups of this step (G < KSTEP), or the one it lies in); and a (64 x MPAD x 8
        // chunks of 64 K)
        const int srow = ks * KSTEP / G;
        tma_load_3d(slot, &q_map, 0, ks * BKQ, 4 * tile, full);
        tma_load_3d(slot + W_BYTES + A_BYTES, &s_map, 0, srow, 4 * tile, full);
        if (has_zeros)
          tma_load_3d(slot + W_BYTES + A_BYTES + S_BYTES, &z_map, 0, srow, 4 * tile, full);
        tma_load_3d(slot + W_BYTES, &a_map, 0, 0, ks * (KSTEP / 64), full);
        if (++ks == steps) {
          ks = 0;
          ++tile;
        }
      }
    }
    return;
  }

  // ---- consumers: warp = 4 kw + slab (slab: 32 columns; kw: part of each K step) ----
  const int slab = warp % 4, kw = warp / 4;
  const int g = lane / 4, t = lane % 4;
  // the row of a lane group g loads (+ 8 nt), and the 16-byte chunk of its slab's 128-byte
  // rows it takes the 4 columns' words from: c(g) = (0, 4, 1, 5, 2, 6, 3, 7)[g] (no bank
  // conflicts under the 128-byte swizzle, see the top)
  const int mrow = ((g & 1) << 2) | (g >> 1);
  const int cg = mrow;
  float acc[2][NT][4];   // per tile (columns 4 cg + {0, 1} / + {2, 3}), n8 tile: the total
  float sum[2][NT][4];   // this group's sum_k a_k (O + q_k)
  float asum[NT][4];     // this group's sum_k a_k (columns 2t, 2t + 1 of each n8 tile)
#pragma unroll
  for (int u = 0; u < 2; ++u)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[u][nt][e] = sum[u][nt][e] = 0.f;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) asum[nt][e] = 0.f;

  const int col0 = 32 * slab + 4 * cg;  // this thread's 4 columns in the tile
  // Warp kw takes chunks j = CH kw + jj of each step (CH = NCH / KW: a contiguous part, so it
  // promotes once a group). Byte offsets in a slot: chunk j's packed row r = 8 (j >> 1) +
  // 4 (j & 1) + t has its words at 1024 (j >> 1) + wq[j & 1] and its row of a (n8 tile nt) in
  // box j >> 1 at ra[j & 1][nt]; the CTA's part kw adds kw CH / 2 to j >> 1.
  constexpr int CH = NCH / KW;
  int wq[2], ra[2][NT];
#pragma unroll
  for (int par = 0; par < 2; ++par) {
    const int c = 4 * par + t;
    wq[par] = slab * BKQ * 128 + kw * (CH / 2) * 1024 + c * 128 + ((cg ^ c) << 4);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      ra[par][nt] = W_BYTES + kw * (CH / 2) * MPAD * 128 + (mrow + 8 * nt) * 128 +
                    ((c ^ mrow) << 4);
  }
  // the scale rows of this part's groups (GQ <= CH: CH / GQ of them; else the step's one)
  const unsigned char* ssl = gbase + W_BYTES + A_BYTES + slab * S_WARP + 4 * cg * SBYTES +
                             (GQ <= CH ? kw * (CH / GQ) * 32 * SBYTES : 0);
  const unsigned mask = 0x000F000Fu, magic = MAGIC, ones = ONES;
  int tile = x0 / steps, ks = x0 % steps;
  for (int x = x0, i = 0; x < x1; ++x, ++i) {
    const int s = i % STAGES;
    const bool piece_end = (x + 1 == x1) || (ks + 1 == steps);
    // G >= KSTEP (SR 1): the step ends a group when (ks + 1) KSTEP is a multiple of G
    const bool step_promotes = SR > 1 || piece_end || ((ks + 1) * KSTEP) % G == 0;
    mbar_wait(bars + 8u * s, (i / STAGES) & 1);
    const unsigned char* sl = gbase + s * SLOT_BYTES;
#pragma unroll
    for (int jj = 0; jj < CH; ++jj) {
      const int jh = jj >> 1, jp = jj & 1;  // (j >> 1) and (j & 1), less this part's start
      const uint4 w = *reinterpret_cast<const uint4*>(sl + jh * 1024 + wq[jp]);
      unsigned b[NT][2][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint4 v = *reinterpret_cast<const uint4*>(sl + jh * MPAD * 128 + ra[jp][nt]);
        b[nt][0][0] = prmt(v.x, v.z, 0x5410);
        b[nt][0][1] = prmt(v.x, v.z, 0x7632);
        b[nt][1][0] = prmt(v.y, v.w, 0x5410);
        b[nt][1][1] = prmt(v.y, v.w, 0x7632);
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const unsigned p00 = pair(w.x, 2 * e, mask, magic), p01 = pair(w.x, 2 * e + 1, mask, magic);
        const unsigned p10 = pair(w.y, 2 * e, mask, magic), p11 = pair(w.y, 2 * e + 1, mask, magic);
        const unsigned p20 = pair(w.z, 2 * e, mask, magic), p21 = pair(w.z, 2 * e + 1, mask, magic);
        const unsigned p30 = pair(w.w, 2 * e, mask, magic), p31 = pair(w.w, 2 * e + 1, mask, magic);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          mma(sum[0][nt], p00, p10, p01, p11, b[nt][e][0], b[nt][e][1]);
          mma(sum[1][nt], p20, p30, p21, p31, b[nt][e][0], b[nt][e][1]);
          mma(asum[nt], ones, ones, ones, ones, b[nt][e][0], b[nt][e][1]);
        }
      }
      // promote at a group's end, or (groups longer than this part: SR 1 or GQ > CH) at the
      // part's end where a group or this CTA's piece of the tile ends (a piece ending inside
      // a group promotes its part)
      constexpr int PER = GQ < CH ? GQ : CH;
      if ((jj + 1) % PER == 0 && (GQ <= CH || step_promotes)) {
        const int grow = GQ <= CH ? jj / GQ : 0;  // the group's row, from this part's first
        const unsigned char* sp = ssl + s * SLOT_BYTES + grow * 32 * SBYTES;
        float sc[4], cz[4], zs[4];
        scale4(sp, sc);
        if (has_zeros) {
          scale4(sp + S_BYTES, zs);
        } else {
#pragma unroll
          for (int q = 0; q < 4; ++q) zs[q] = 8.f;
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) cz[q] = (OFFSET_F + zs[q]) * sc[q];
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int q = 2 * u + e / 2;  // column 4 cg + q
              acc[u][nt][e] = fmaf(-cz[q], asum[nt][e], fmaf(sc[q], sum[u][nt][e], acc[u][nt][e]));
              sum[u][nt][e] = 0.f;
            }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) asum[nt][e] = 0.f;
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(bars + 8u * (STAGES + s));
    const int this_tile = tile;
    if (++ks == steps) {
      ks = 0;
      ++tile;
    }
    if (!piece_end) continue;
    // ---- the K halves of this piece meet: warps 4-7 hand their sums to warps 0-3 ----
    named_bar(2, 256);  // (warps 0-3 have read the previous piece's)
    float* mine = merge + (threadIdx.x % 128) * (8 * NT);
    if (kw == 1) {
#pragma unroll
      for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            mine[(u * NT + nt) * 4 + e] = acc[u][nt][e];
            acc[u][nt][e] = 0.f;
          }
    }
    named_bar(2, 256);
    if (kw == 1) continue;
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[u][nt][e] += mine[(u * NT + nt) * 4 + e];
    // ---- the piece of this_tile this CTA holds is summed: store, or hand over ----
    const int t0 = this_tile * steps;
    const int first = owner_of(t0, total, P), last = owner_of(t0 + steps - 1, total, P);
    bool store = first == last;
    if (!store) {
      // the pieces of a shared tile: the last to finish adds them up in CTA order (the same
      // bits whoever it is). A piece that finds every other one already in (the counter at
      // last - first) finishes at once; the others store their sums, then count themselves
      // in, and the one that makes the count complete finishes.
      const int me = blockIdx.x;
      __shared__ int arrived;
      named_bar(1, 128);
      if (threadIdx.x == 0) {
        int v;
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(counters + this_tile)
                     : "memory");
        arrived = v;
      }
      named_bar(1, 128);
      store = arrived == last - first;
      if (!store) {
        const int slot_me = (this_tile == run_begin(me, total, P) / steps) ? 0 : 1;
        float4* dst = reinterpret_cast<float4*>(ws + ((size_t)(me * 2 + slot_me) * 128 +
                                                     threadIdx.x) * (8 * NT));
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
            __stcg(dst + u * NT + nt, make_float4(acc[u][nt][0], acc[u][nt][1],
                                                  acc[u][nt][2], acc[u][nt][3]));
        __threadfence();
        named_bar(1, 128);
        if (threadIdx.x == 0) arrived = atomicAdd(counters + this_tile, 1);
        named_bar(1, 128);
        store = arrived == last - first;
      }
      if (store) {
        __threadfence();
        float own[2][NT][4];
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) own[u][nt][e] = acc[u][nt][e], acc[u][nt][e] = 0.f;
        for (int c = first; c <= last; ++c) {  // CTA order: the same sum whoever finishes
          if (c == me) {
#pragma unroll
            for (int u = 0; u < 2; ++u)
#pragma unroll
              for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[u][nt][e] += own[u][nt][e];
            continue;
          }
          const int sl = (this_tile == run_begin(c, total, P) / steps) ? 0 : 1;
          const float4* src = reinterpret_cast<const float4*>(
              ws + ((size_t)(c * 2 + sl) * 128 + threadIdx.x) * (8 * NT));
#pragma unroll
          for (int u = 0; u < 2; ++u)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              const float4 v = __ldcg(src + u * NT + nt);
              acc[u][nt][0] += v.x;
              acc[u][nt][1] += v.y;
              acc[u][nt][2] += v.z;
              acc[u][nt][3] += v.w;
            }
        }
        if (threadIdx.x == 0) counters[this_tile] = 0;  // every piece is in: ready again
      }
    }
    if (store) {
#pragma unroll
      for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int n = this_tile * BN + col0 + 2 * u + h;
          if (n >= N) continue;
          const float bv = bias != nullptr ? act_to_f32(bias[n]) : 0.f;
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int m = 8 * nt + t + 4 * e;  // C column 2t + e is row c(2t + e) of a
              if (m < M) out[(size_t)m * N + n] = to_act(acc[u][nt][2 * h + e] + bv);
            }
        }
    }
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[u][nt][e] = 0.f;
  }
}
