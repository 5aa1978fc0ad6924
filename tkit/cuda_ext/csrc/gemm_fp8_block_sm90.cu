// Hopper block-scaled fp8 GEMM (sm_90a), DeepSeek-V3's recipe with its precise promotion:
//
//   C[m, n] = sum over 128-deep groups g of  sa[m, g] * sb[g, n / 128] * (A[m, g] . B[n, g])
//
// A (M, K) and B (N, K) float8_e4m3fn, both K-major (B is an (N, K) weight: wgmma reads 8-bit
// operands only K-major); sa (M, ceil(K / 128)) and sb (ceil(K / 128), ceil(N / 128)) float32
// with any strides; C (M, N) bf16 (fp16 with -DOUT_F16=1), row-major. Rows of A, B and C are
// 16-byte aligned (TMA); any M, N, K otherwise: TMA zero-fills the boxes past M, N, K (their
// sums are 0 whatever the scale), scale rows past M are clamped, the TMA store clips.
//
// Why CUDA: the promotion needs a fresh MMA sum beside the float32 accumulator for every
// 128-deep group. At 128 x 256 tiles a consumer warpgroup holds 64 x 256 (128 registers a
// thread), so the sum can only be a half (64 x 128, 64 registers): each group is two sums,
// each waited for and promoted before the next is issued into the same registers. Gluon's
// build of such schedules had ptxas move a sum's issue above the previous promotion and
// spill; here every wgmma, wait and operand fence is written out, so the sum keeps its 64
// registers. Lost on the H200 and removed (docs/NOTES.md): A read into registers by ldmatrix
// once a group (so it is not read from shared memory for each half); four 64-column sums a
// group with two in flight (each promoted under the next one's MMAs); 128 x 192 tiles with
// two 96-column sums in flight; 192 x 128 tiles on three consumers; 128 x 128 tiles with or
// without the next group's sum issued before the promotion (more L2 traffic a flop), also in
// CTA pairs; CTA pairs multicasting B; the consumers issuing their sums in turns; 128 x 192
// tiles with one 192-column sum a group; consumer 1 started one sum or one group behind
// consumer 0 (so that one promotes while the other's MMAs run: one consumer's dependent
// chain alone keeps the tensor pipe about half busy, so the offset lost more than it hid);
// cuBLAS's per-tensor tile, 128 x 144 with the next group's 144-column sum in flight (72 +
// 2 x 72 registers), alone or in CTA pairs (the tensor pipe ~64% busy, below this kernel's);
// the promotion FFMAs' scheduling hints edited in the cubin: DeepGEMM's edit (reuse flags and
// the yield bit cleared on a share of them) tied at an eighth or a quarter and lost from half
// on, and the yield bit set on half or all of them (the promoting warp keeps the issue slot)
// lost 6-15%, so ptxas's own alternation stands; the group loop unrolled over the ring's slots
// (constant slots and descriptors: 53 instructions a group besides the FFMAs, against 73)
// lost 1-7%.
//
// 384 threads = 3 warpgroups, persistent (one CTA an SM walking the tiles in GROUP_M
// sections; a last wave at most a quarter full split by stream-K, see WorkList below):
//   warpgroup 0, the producer: gives registers back (setmaxnreg.dec 24); one thread fills a
//     ring of STAGES slots, one 128-deep group each (A 128 x 128 and B 256 x 128 fp8, 48 KiB),
//     through TMA (cp.async.bulk.tensor, completing on full[s]) once empty[s] says both
//     consumers are done with the slot.
//   warpgroups 1 and 2, the consumers (setmaxnreg.inc 240): 64 rows of the tile each. Per
//     group: issue 4 wgmma.m64n128k32 for the left 128 columns into the sum, wait, add the sum
//     times sa[row, g] * sb[g, left block] into the accumulator (64 FFMA), the same for the
//     right 128 columns, release the slot. Both consumers issue off the same full slot, so
//     their sums run together and both promote at about the same time; the tensor pipe
//     idles then (busy ~71% of the time with the loop's earlier, longer form, against ~92%
//     for cuBLAS's per-tensor kernel), and
//     taking turns made it worse (one consumer's dependent chain alone does not fill the
//     pipe). The next group's scales are loaded (L2 hits) during this group.
// A consumer's loop is ~200 instructions a warp a group, 128 of them the promotion's FFMAs: the
// wgmma descriptors are made once, from warp-uniform values, and only the slot's offset is
// added each group (in uniform registers), and the next group's scale pointers move a group
// at a time. While one consumer promotes, the other's warps need issue slots for their wgmmas,
// so instructions in this loop cost tensor-pipe time: making each wgmma's descriptor from its
// address (286 instructions a group) was 9-14% slower at 8192^3 and ~12% at M=4096 N=4096
// K=7168.
// Epilogue through shared memory and TMA stores (EPI_SPLIT parts of 64 x BN / EPI_SPLIT a
// consumer, swizzled as TMA reads them), overlapped with the next tile's K loop.
//
// Shared-memory layouts (128-byte swizzle, as TMA writes them and wgmma reads them): A tile
// 128 rows x 128 B, B tile 256 rows x 128 B; wgmma descriptors K-major, SBO 1024 B (8 rows),
// the k-th 32-deep slice 32 B further; consumer c's rows start 64 * 128 B in, the right half
// of B 128 * 128 B in.
// One local header (sm90_async.cuh, inlined by the loader); compiles under nvcc -arch sm_90a
// (wgmma and setmaxnreg need the "a").

#define BM 128
#define BN 256
#define BK 128  // one scale group
#ifndef STAGES
#define STAGES 4
#endif
#define CONSUMERS 2
#define THREADS (128 * (CONSUMERS + 1))
#ifndef GROUP_M
#define GROUP_M 16
#endif
#ifndef EPI_SPLIT
#define EPI_SPLIT 2
#endif
#ifndef OUT_F16
#define OUT_F16 0
#endif
// COL_SCALE=1: b's scales are per column instead of per block: sb is not read, and the
// output's column n is multiplied by cs[n] before the store (the W8A8 recipe's per-channel
// weight scales, which have no 128-column block form, with sa holding per-row scales)
#ifndef COL_SCALE
#define COL_SCALE 0
#endif
#if COL_SCALE
#define LOAD_SB(p) 1.f
#else
#define LOAD_SB(p) __ldg(p)
#endif
#define SUM_N (BN / 2)  // columns of one MMA sum (two a group)
#define CLUSTER_M 1  // no CTA clusters (the header's helpers take them)
#define GROUP_MC GROUP_M
#if BN % (64 * EPI_SPLIT)
#error "EPI_SPLIT must split BN into whole 64-column boxes"
#endif
#define C_PART_COLS (BN / EPI_SPLIT)
#define C_PART_BYTES (64 * C_PART_COLS * 2)  // one consumer's staging buffer
#define C_BYTES (CONSUMERS * C_PART_BYTES)
#define A_STAGE_BYTES (BM * BK)
#define B_STAGE_BYTES (BN * BK)
#define STAGE_BYTES (A_STAGE_BYTES + B_STAGE_BYTES)

#include "sm90_async.cuh"

// ---- wgmma ------------------------------------------------------------------------------------
__device__ __forceinline__ u64 smem_desc(unsigned addr) {
  // K-major, 128-byte swizzle: SBO 1024 B between 8-row core groups, LBO unused (16)
  u64 d = 0;
  d |= (u64)((addr & 0x3FFFF) >> 4);
  d |= (u64)(16 >> 4) << 16;
  d |= (u64)(1024 >> 4) << 32;
  d |= 1ull << 62;
  return d;
}

#define R32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, " \
            "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define R64 R32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, " \
            "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, " \
            "%62, %63"

// d[SUM_N / 2] (+)= A(64x32 e4m3, K-major descriptor) @ B(32xSUM_N e4m3, K-major
// descriptor); scale_d 0 overwrites d
__device__ __forceinline__ void wgmma_sum(float* d, u64 desc_a, u64 desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" R64 "}, %64, %65, p, 1, 1;\n"
      "}\n"
      : F8(0), F8(8), F8(16), F8(24), F8(32), F8(40), F8(48), F8(56)
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

__device__ __forceinline__ unsigned pack_out(float lo, float hi) {
  return OUT_F16 ? pack_f16x2(lo, hi) : pack_bf16x2(lo, hi);
}

#define SUM_REGS (SUM_N / 2)

// the sum of columns [part * SUM_N, +SUM_N) of the group's tile, fresh, issued and committed,
// from the slot's descriptors: the k-step's and the half's offsets added to the start-address
// field (bits 0-13, in 16-byte units; shared memory ends below 256 KB, so the sum never
// carries out of it)
__device__ __forceinline__ void issue_sum(float* sum, u64 a_desc, u64 b_desc, int part) {
#pragma unroll
  for (int i = 0; i < SUM_REGS; ++i) fence_operand(sum[i]);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < BK / 32; ++kk) {
    wgmma_sum(sum, a_desc + (kk * 32 >> 4),
              b_desc + ((part * (SUM_N * BK) + kk * 32) >> 4), kk > 0);
  }
  wgmma_commit();
}

__device__ __forceinline__ void fence_sum(float* sum) {
#pragma unroll
  for (int i = 0; i < SUM_REGS; ++i) fence_operand(sum[i]);
}

// acc[4j + 2r + e] += sum[4j + 2r + e] * s[r] (r: the thread's upper or lower row), with
// (sl0, sl1) for the 8-column chunks j < JL and (sr0, sr1) from there on (the sum's columns
// in two 128-column blocks of b's scales)
template <int JL>
__device__ __forceinline__ void promote(float* acc, const float* sum, float sl0, float sl1,
                                        float sr0, float sr1) {
#pragma unroll
  for (int j = 0; j < SUM_N / 8; ++j) {
    const float s0 = j < JL ? sl0 : sr0, s1 = j < JL ? sl1 : sr1;
    acc[4 * j + 0] = fmaf(sum[4 * j + 0], s0, acc[4 * j + 0]);
    acc[4 * j + 1] = fmaf(sum[4 * j + 1], s0, acc[4 * j + 1]);
    acc[4 * j + 2] = fmaf(sum[4 * j + 2], s1, acc[4 * j + 2]);
    acc[4 * j + 3] = fmaf(sum[4 * j + 3], s1, acc[4 * j + 3]);
  }
}

// ---- the work: whole tiles, then the stream-K tail -------------------------------------------
// The first dp_tiles tiles (whole waves of the grid) go to the CTAs in turn, K whole. The rest
// (under one wave: a last wave that would leave SMs idle) are laid end to end as
// sk_tiles * KG groups and cut into sk_ctas runs of equal length (to a group), CTA c taking
// the c-th: a run is one or more pieces, each the groups of one tile it touches. A tile split
// between CTAs is finished by the CTA of its first piece (the owner: that piece is always the
// last of its run) once the later pieces' partial sums have arrived; a CTA's only piece that
// is not its tile's first is the first of its run, done before anything it could wait for,
// so every wait is on a CTA of higher index that never waits before its partial is out. (All
// CTAs of the grid are resident: one an SM, no more than the SMs.) Where the last wave was
// fuller than a quarter, splitting it lost or tied: the pieces' sums go through L2, and the
// runs' K offsets spread, so tiles that share operands no longer load them together.
struct Work {
  int tile, g0, g1;  // the tile and its groups [g0, g1) in this piece
};

// where CTA `cta`'s run starts: runs of total / sk_ctas groups, the first total % sk_ctas one
// longer (the launcher keeps sk_tiles * KG below 2^31: sk_tiles is under one wave)
__device__ __forceinline__ int sk_begin(int cta, int sk_ctas, int total) {
  if (sk_ctas == 0) return 0;
  cta = min(cta, sk_ctas);
  return cta * (total / sk_ctas) + min(cta, total % sk_ctas);
}

// this CTA's pieces as a counted sequence (a loop with a count keeps its counters in uniform
// registers, where an iterator's data-dependent exit did not)
struct WorkList {
  int dp_tiles, KG, n_dp, pos, end, n;
  __device__ __forceinline__ WorkList(int dp_tiles_, int sk_ctas, int sk_tiles, int KG_)
      : dp_tiles(dp_tiles_), KG(KG_) {
    const int total = sk_tiles * KG;
    n_dp = (int)blockIdx.x < dp_tiles ? (dp_tiles - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    pos = sk_begin(blockIdx.x, sk_ctas, total);
    end = sk_begin(blockIdx.x + 1, sk_ctas, total);
    n = n_dp + (pos < end ? (end - 1) / KG - pos / KG + 1 : 0);
  }
  __device__ __forceinline__ Work operator[](int u) const {
    if (u < n_dp) return {(int)blockIdx.x + u * (int)gridDim.x, 0, KG};
    const int lt = pos / KG + (u - n_dp);
    return {dp_tiles + lt, max(pos - lt * KG, 0), min(KG, end - lt * KG)};
  }
};

__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) gemm_fp8_block(
    const __grid_constant__ TmaDesc tma_a, const __grid_constant__ TmaDesc tma_b,
    const __grid_constant__ TmaDesc tma_c,  // C, boxes of 64 x 64, 128-byte swizzle
    const float* __restrict__ sa, const float* __restrict__ sb,
    const float* __restrict__ cs,  // (N,) float32, read only with COL_SCALE
    int M, int N, int K,
    int stride_sam, int stride_sak, int stride_sbk, int stride_sbn, int dp_tiles, int sk_ctas,
    float* __restrict__ partial, int* __restrict__ flags) {
  // partial: (sk_ctas, CONSUMERS, 128 x BN / 2) float32, a CTA's first stream-K piece's sums
  // when that is not its tile's first piece (each thread's fragment as float4s, thread-minor);
  // flags: (sk_ctas, CONSUMERS) int32, 1 while such a partial waits for its owner, which sets
  // it back to 0 (all 0 between launches)
  extern __shared__ unsigned char smem_raw[];
  unsigned sA = smem_aligned_1024(smem_raw);
  unsigned sB = sA + STAGES * A_STAGE_BYTES;
  unsigned sC = sB + STAGES * B_STAGE_BYTES;
  unsigned bars = sC + C_BYTES;  // full[STAGES], then empty[STAGES]
  auto full = [&](int s) { return bars + 8u * s; };
  auto empty = [&](int s) { return bars + 8u * (STAGES + s); };

  int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  init_ring(bars, STAGES, CONSUMERS, 1);

  const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
  const int num_tiles = tiles_m * tiles_n;
  const int KG = (K + BK - 1) / BK;
  const int NB = (N + 127) / 128;  // column blocks of sb
  const int sk_tiles = num_tiles - dp_tiles;

  if (wg == 0) {
    // ---- producer ----
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (t == 0) {
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(&tma_a)));
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(&tma_b)));
      int it = 0;
      const WorkList work(dp_tiles, sk_ctas, sk_tiles, KG);
      for (int u = 0; u < work.n; ++u) {
        const Work w = work[u];
        int tm, tn;
        tile_coords(w.tile, tiles_m, tiles_n, tm, tn);
        for (int g = w.g0; g < w.g1; ++g, ++it) {
          int s = it % STAGES;
          unsigned round = it / STAGES;
          mbar_wait(empty(s), (round & 1) ^ 1);  // round 0 passes: the slot starts free
          mbar_expect_tx(full(s), STAGE_BYTES);
          tma_load_2d(sA + s * A_STAGE_BYTES, &tma_a, g * BK, tm * BM, full(s));
          tma_load_2d(sB + s * B_STAGE_BYTES, &tma_b, g * BK, tn * BN, full(s));
        }
      }
    }
  } else {
    // ---- consumers ----
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
    const int c = wg - 1;
    const int warp = t / 32, lane = t % 32;
    float acc[BN / 2];
    float sum[SUM_REGS];
    // slot 0's descriptors (this consumer's rows of A), made once from warp-uniform values
    // (the shuffle tells the compiler so): they and the slot offsets added to them stay in
    // uniform registers, where the wgmma reads its descriptors
    const u64 a_desc0 = smem_desc(__shfl_sync(0xffffffffu, sA + c * (64 * BK), 0));
    const u64 b_desc0 = smem_desc(__shfl_sync(0xffffffffu, sB, 0));
    unsigned it = 0;
    const WorkList work(dp_tiles, sk_ctas, sk_tiles, KG);
    for (int u = 0; u < work.n; ++u) {
      const Work w = work[u];
      int tm, tn;
      tile_coords(w.tile, tiles_m, tiles_n, tm, tn);
      // this thread's two rows (clamped: rows past M have zero sums) and column blocks
      const int r0 = min(tm * BM + c * 64 + warp * 16 + lane / 4, M - 1);
      const int r1 = min(tm * BM + c * 64 + warp * 16 + lane / 4 + 8, M - 1);
      const float* sa0 = sa + (long long)r0 * stride_sam + (long long)w.g0 * stride_sak;
      const float* sa1 = sa + (long long)r1 * stride_sam + (long long)w.g0 * stride_sak;
      // the tile's two column blocks (its halves)
      const float* sbl = sb + (long long)min(2 * tn, NB - 1) * stride_sbn +
                         (long long)w.g0 * stride_sbk;
      const float* sbr = sb + (long long)min(2 * tn + 1, NB - 1) * stride_sbn +
                         (long long)w.g0 * stride_sbk;
      float a0 = __ldg(sa0), a1 = __ldg(sa1), bl = LOAD_SB(sbl), br = LOAD_SB(sbr);
      // the next group's scales, a group further each step (the last group's kept)
      const float *nsa0 = sa0, *nsa1 = sa1, *nsbl = sbl, *nsbr = sbr;
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
      for (int g = w.g0; g < w.g1; ++g, ++it) {
        // the next group's scales, under this group's MMAs (the last group's at the end)
        if (g + 1 < w.g1) nsa0 += stride_sak, nsa1 += stride_sak, nsbl += stride_sbk,
            nsbr += stride_sbk;
        float na0 = __ldg(nsa0), na1 = __ldg(nsa1), nbl = LOAD_SB(nsbl), nbr = LOAD_SB(nsbr);
        const unsigned s = it % STAGES;
        mbar_wait(full(s), (it / STAGES) & 1);
        const float l0 = a0 * bl, l1 = a1 * bl, r0s = a0 * br, r1s = a1 * br;
        const u64 a_desc = a_desc0 + s * (A_STAGE_BYTES >> 4);
        const u64 b_desc = b_desc0 + s * (B_STAGE_BYTES >> 4);
        issue_sum(sum, a_desc, b_desc, 0);
        wgmma_wait0();
        fence_sum(sum);
        promote<16>(acc, sum, l0, l1, r0s, r1s);
        issue_sum(sum, a_desc, b_desc, 1);
        wgmma_wait0();
        fence_sum(sum);
        if (t == 0) release_slot(empty(s));
        promote<0>(acc + 64, sum, l0, l1, r0s, r1s);
        a0 = na0, a1 = na1, bl = nbl, br = nbr;
      }
      if (w.g0 > 0) {
        // a later piece of a split tile: the sums to the owner, through L2
        float4* dst = reinterpret_cast<float4*>(partial) +
                      ((long long)blockIdx.x * CONSUMERS + c) * (BN / 2 / 4) * 128 + t;
#pragma unroll
        for (int j = 0; j < BN / 2 / 4; ++j)
          __stcg(dst + j * 128, make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2],
                                            acc[4 * j + 3]));
        __threadfence();
        named_bar(1 + c, 128);
        if (t == 0) st_release(flags + blockIdx.x * CONSUMERS + c, 1);
        continue;
      }
      if (w.g1 < KG) {
        // the owner of a split tile: add the later pieces' sums, CTA by CTA (the CTAs whose
        // runs start inside this tile)
        const int total = sk_tiles * KG, tile_end = (w.tile - dp_tiles + 1) * KG;
        for (int o = blockIdx.x + 1; o < sk_ctas && sk_begin(o, sk_ctas, total) < tile_end;
             ++o) {
          if (sk_begin(o + 1, sk_ctas, total) == sk_begin(o, sk_ctas, total)) continue;
          int* flag = flags + o * CONSUMERS + c;
          if (t == 0) {
            while (ld_acquire(flag) == 0) {
            }
            *flag = 0;  // the partial is this owner's alone; no other launch runs meanwhile
          }
          named_bar(1 + c, 128);
          const float4* src = reinterpret_cast<const float4*>(partial) +
                              ((long long)o * CONSUMERS + c) * (BN / 2 / 4) * 128 + t;
#pragma unroll
          for (int j = 0; j < BN / 2 / 4; ++j) {
            const float4 v = __ldcg(src + j * 128);
            acc[4 * j] += v.x, acc[4 * j + 1] += v.y, acc[4 * j + 2] += v.z,
                acc[4 * j + 3] += v.w;
          }
        }
      }
#if COL_SCALE
      {
        // acc[64 h + 4 j + 2 r + e] is column 128 h + 8 j + 2 (lane % 4) + e of the tile
        const int c0 = tn * BN + 2 * (lane % 4);
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) {
          const int col = c0 + (i / 64) * 128 + 8 * ((i % 64) / 4) + (i % 2);
          acc[i] *= __ldg(cs + min(col, N - 1));
        }
      }
#endif
      // the two sums' fragments one after the other: together the m64nBN fragment
      store_tile_tma<BN, EPI_SPLIT>(acc, sC + c * C_PART_BYTES, &tma_c, tn * BN,
                                    tm * BM + c * 64, c, t, warp, lane,
                                    [](float lo, float hi) { return pack_out(lo, hi); });
    }
    if (t == 0) bulk_wait0();  // the last stores are done before the CTA (and its smem) ends
  }
}
