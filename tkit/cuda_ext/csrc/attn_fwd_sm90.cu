// Hopper FlashAttention forward (sm_90a), FlashAttention-3 style: TMA -> mbarrier -> wgmma,
// warp specialized, with the softmax of one key block overlapped with the P @ V product of
// the block before it inside each consumer warpgroup.
//
// O = softmax(Q K^T * scale) V per (batch, query head), GQA by query-head groups; Q, K, V, O
// in the flash-attn layout (batch, seq, heads, head_dim), bf16 or fp16 (ELEM_FP16=1), any
// strides that are multiples of 16 bytes with a unit head_dim stride; the log-sum-exp of every
// row goes to LSE (batch, heads, seq_q) float32. causal aligns the mask to the bottom-right
// corner (query i sees keys j <= i + seq_k - seq_q); a row that sees no key gives 0 and -inf.
//
// A CTA takes BM = 128 query rows of one (batch, head) and walks the key blocks of BN = 128
// (80 at head_dim 256).
// 384 threads = 3 warpgroups:
//   warpgroup 0, the producer: gives registers back (setmaxnreg.dec 24); one thread loads the
//     Q tile once, then K and V tiles into a ring of STAGES slots each (its own full / empty
//     mbarriers for K and for V, so S = Q K^T starts before V lands).
//   warpgroups 1 and 2, the consumers (setmaxnreg.inc 240): 64 query rows each. For key block
//     j they issue S_j = Q K_j^T (wgmma.m64n128k16, both operands from shared memory), then
//     O += P_{j-1} V_{j-1} (wgmma.m64nDk16 with P from registers), wait for S_j alone, run the
//     online softmax of S_j while the P V product runs, then wait for it, rescale O and turn
//     S_j into P_j (bf16 A fragments). INTRA_OVERLAP=0 runs the two products one after the
//     other instead (S_j, softmax, P_j V_j). PINGPONG=1 makes the two consumers take turns
//     issuing their products (named barriers 1 and 2, consumer 0 first), so one's softmax
//     runs while the other's products keep the tensor cores busy.
//
// Tensor maps (host-encoded, passed by value): each of Q, K, V as a 4-d tensor (head_dim,
// seq, heads, batch) with its own strides, boxes of 64 x rows x 1 x 1 (rows: BM for Q, BN for
// K and V; 128-byte rows, the 128-byte swizzle); rows past seq read as 0 and are masked (keys)
// or not stored (queries).
//
// Shared memory, every tile 1024-byte aligned: a tile of R rows is HEAD_DIM / 64 column atoms
// of R rows x 128 B, atom a holding columns 64a..64a+63.
//   Q, K as K-major wgmma operands: SBO = 1024 B (8 rows), the 16-wide k slice kk at atom
//     kk / 4, +32 B (kk % 4).
//   V as the transposed (MN-major) B operand of P V: SBO = 1024 B (8 keys), LBO = BN x 128 B
//     (the next 64 head-dim columns: the next atom), the 16-key slice kk at +2048 B.
// The wgmma accumulator fragment of m64nN: acc[4j + 2h + e] at row 16 warp + lane / 4 + 8h,
// column 8j + 2 (lane % 4) + e; the A fragment of m64k16 from registers is the same layout
// over 16 columns, so P_j's fragments are S_j's accumulators packed in pairs.
// One local header (sm90_async.cuh, inlined by the loader); nvcc -arch sm_90a.

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#if HEAD_DIM != 64 && HEAD_DIM != 128 && HEAD_DIM != 256
#error "HEAD_DIM must be 64, 128 or 256"
#endif
#ifndef STAGES
#define STAGES 2
#endif
#ifndef ELEM_FP16
#define ELEM_FP16 0
#endif
#ifndef INTRA_OVERLAP
#define INTRA_OVERLAP 1
#endif
#ifndef PINGPONG
#define PINGPONG 0
#endif
#if PINGPONG && !INTRA_OVERLAP
#error "PINGPONG orders the overlapped schedule's products: it needs INTRA_OVERLAP=1"
#endif
#define BM 128
// keys a block: 128, or 80 at head_dim 256 (a consumer's o is 64 x 256 floats, 128 registers
// a thread, which leaves room for S and P of 80 keys; Q, two K and two V slots: 224 KiB)
#if HEAD_DIM == 256
#define BN 80
#else
#define BN 128
#endif
#define CONSUMERS 2
#define THREADS (128 * (CONSUMERS + 1))
#define ATOMS (HEAD_DIM / 64)
#define Q_BYTES (BM * HEAD_DIM * 2)
#define KV_BYTES (BN * HEAD_DIM * 2)
#define GROUP_MC 1  // (sm90_async.cuh's tile order: unused here)
#define CLUSTER_M 1
#define LOG2E 1.4426950408889634f
#define NEG_INF __int_as_float(0xff800000)

#if ELEM_FP16
#define ELEM_PTX "f16"
#else
#define ELEM_PTX "bf16"
#endif
typedef unsigned short elem_t;
#include "sm90_async.cuh"

#define ACC8(i) "+f"(acc[i]), "+f"(acc[i + 1]), "+f"(acc[i + 2]), "+f"(acc[i + 3]), \
                "+f"(acc[i + 4]), "+f"(acc[i + 5]), "+f"(acc[i + 6]), "+f"(acc[i + 7])

__device__ __forceinline__ void tma_load_4d(unsigned dst, const TmaDesc* map, int c0, int c1,
                                            int c2, int c3, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
      ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
      "r"(bar)
      : "memory");
}

__device__ __forceinline__ void named_bar_arrive(unsigned id, unsigned count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  return ELEM_FP16 ? pack_f16x2(lo, hi) : pack_bf16x2(lo, hi);
}

// ---- wgmma (generated operand lists) -----------------------------------------------------
// acc[64] (+)= A(64x16, K-major desc) @ B(16x128, K-major desc); scale_d 0 overwrites acc
__device__ __forceinline__ void wgmma_ss_m64n128(float* acc, u64 desc_a, u64 desc_b,
                                                 int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." ELEM_PTX "." ELEM_PTX " {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : ACC8(0), ACC8(8), ACC8(16), ACC8(24), ACC8(32), ACC8(40), ACC8(48), ACC8(56)
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// acc[64] (+)= A(64x16 from registers a[0..3]: the m64k16 fragment) @ B(16x128, MN-major
// desc, transposed); scale_d 0 overwrites acc
__device__ __forceinline__ void wgmma_rs_m64n128(float* acc, const unsigned* a, u64 desc_b,
                                                 int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." ELEM_PTX "." ELEM_PTX " {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n"
      "}\n"
      : ACC8(0), ACC8(8), ACC8(16), ACC8(24), ACC8(32), ACC8(40), ACC8(48), ACC8(56)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

// acc[32] (+)= A(64x16 from registers a[0..3]: the m64k16 fragment) @ B(16x64, MN-major
// desc, transposed); scale_d 0 overwrites acc
__device__ __forceinline__ void wgmma_rs_m64n64(float* acc, const unsigned* a, u64 desc_b,
                                                 int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." ELEM_PTX "." ELEM_PTX " {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n"
      "}\n"
      : ACC8(0), ACC8(8), ACC8(16), ACC8(24)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

// acc[40] (+)= A(64x16, K-major desc) @ B(16x80, K-major desc); scale_d 0 overwrites acc
__device__ __forceinline__ void wgmma_ss_m64n80(float* acc, u64 desc_a, u64 desc_b,
                                                 int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %42, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n80k16.f32." ELEM_PTX "." ELEM_PTX " {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39"
      "}, %40, %41, p, 1, 1, 0, 0;\n"
      "}\n"
      : ACC8(0), ACC8(8), ACC8(16), ACC8(24), ACC8(32)
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// acc[128] (+)= A(64x16 from registers a[0..3]: the m64k16 fragment) @ B(16x256, MN-major
// desc, transposed); scale_d 0 overwrites acc
__device__ __forceinline__ void wgmma_rs_m64n256(float* acc, const unsigned* a, u64 desc_b,
                                                 int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." ELEM_PTX "." ELEM_PTX " {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n"
      "}\n"
      : ACC8(0), ACC8(8), ACC8(16), ACC8(24), ACC8(32), ACC8(40), ACC8(48), ACC8(56),
        ACC8(64), ACC8(72), ACC8(80), ACC8(88), ACC8(96), ACC8(104), ACC8(112),
        ACC8(120)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

#if HEAD_DIM == 256
#define WGMMA_PV wgmma_rs_m64n256
#elif HEAD_DIM == 128
#define WGMMA_PV wgmma_rs_m64n128
#else
#define WGMMA_PV wgmma_rs_m64n64
#endif
#if BN == 80
#define WGMMA_QK wgmma_ss_m64n80
#else
#define WGMMA_QK wgmma_ss_m64n128
#endif

extern "C" __global__ void __launch_bounds__(THREADS, 1) attn_fwd_sm90(
    const __grid_constant__ TmaDesc tma_q, const __grid_constant__ TmaDesc tma_k,
    const __grid_constant__ TmaDesc tma_v, elem_t* __restrict__ O, float* __restrict__ LSE,
    long long so_b, long long so_s, long long so_h, int seq_q, int seq_k, int heads,
    int batches, int group, int causal, float scale_log2) {
  extern __shared__ unsigned char smem_raw[];
  const unsigned sQ = smem_aligned_1024(smem_raw);
  const unsigned sK = sQ + Q_BYTES;
  const unsigned sV = sK + STAGES * KV_BYTES;
  const unsigned bars = sV + STAGES * KV_BYTES;
  // bar_q, q_free, then full_k[STAGES], empty_k[STAGES], full_v[STAGES], empty_v[STAGES]
  const unsigned bar_q = bars, q_free = bars + 8u;
  auto full_k = [&](int s) { return bars + 8u * (2 + s); };
  auto empty_k = [&](int s) { return bars + 8u * (2 + STAGES + s); };
  auto full_v = [&](int s) { return bars + 8u * (2 + 2 * STAGES + s); };
  auto empty_v = [&](int s) { return bars + 8u * (2 + 3 * STAGES + s); };

  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  const int num_m = (seq_q + BM - 1) / BM;
  const int num_tiles = num_m * heads * batches;
  const int diag = seq_k - seq_q;  // with causal, query i sees keys j <= i + diag
  // Tile `tile` (the CTAs take them in turn: one each when the grid has one a tile, several
  // when it is persistent): query block m_block of (batch, head), the blocks of a head next
  // to each other (their K and V shared in L2), causal ones heaviest first.
  struct Tile {
    int m0, head, batch, n_blocks;
  };
  auto tile_at = [&](int tile) {
    Tile r;
    const int mi = tile % num_m, hb = tile / num_m;
    r.m0 = (causal ? num_m - 1 - mi : mi) * BM;
    r.head = hb % heads;
    r.batch = hb / heads;
    r.n_blocks = (seq_k + BN - 1) / BN;
    if (causal) r.n_blocks = min(r.n_blocks, max(0, (r.m0 + BM + diag + BN - 1) / BN));
    return r;
  };

  if (threadIdx.x == 0) {
    mbar_init(bar_q, 1);
    mbar_init(q_free, CONSUMERS);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full_k(s), 1);
      mbar_init(empty_k(s), CONSUMERS);
      mbar_init(full_v(s), 1);
      mbar_init(empty_v(s), CONSUMERS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {
    // ---- producer ----
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (t == 0) {
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(&tma_q)));
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(&tma_k)));
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(&tma_v)));
      int it = 0, round = 0;  // K/V blocks loaded and tiles begun, over this CTA's tiles
      for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x, ++round) {
        const Tile w = tile_at(tile);
        const int head_kv = w.head / group;
        mbar_wait(q_free, (round & 1) ^ 1);  // the last tile's products are done with Q
        mbar_expect_tx(bar_q, Q_BYTES);
#pragma unroll
        for (int a = 0; a < ATOMS; ++a)
          tma_load_4d(sQ + a * (BM * 128), &tma_q, 64 * a, w.m0, w.head, w.batch, bar_q);
        for (int j = 0; j < w.n_blocks; ++j, ++it) {
          const int s = it % STAGES;
          const unsigned free_parity = ((it / STAGES) & 1) ^ 1;  // round 0: slots start free
          mbar_wait(empty_k(s), free_parity);
          mbar_expect_tx(full_k(s), KV_BYTES);
#pragma unroll
          for (int a = 0; a < ATOMS; ++a)
            tma_load_4d(sK + s * KV_BYTES + a * (BN * 128), &tma_k, 64 * a, j * BN, head_kv,
                        w.batch, full_k(s));
          mbar_wait(empty_v(s), free_parity);
          mbar_expect_tx(full_v(s), KV_BYTES);
#pragma unroll
          for (int a = 0; a < ATOMS; ++a)
            tma_load_4d(sV + s * KV_BYTES + a * (BN * 128), &tma_v, 64 * a, j * BN, head_kv,
                        w.batch, full_v(s));
        }
      }
    }
    return;  // the consumers wait for every load, so the CTA outlives them
  }

  // ---- consumers ----
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
  const int c = wg - 1, warp = t / 32, lane = t % 32;
  const int row0 = c * 64 + warp * 16 + lane / 4;  // tile row of h = 0; h = 1 is 8 rows below
  const unsigned q_base = sQ + c * (64 * 128);
  float o[HEAD_DIM / 2], s[BN / 2], m[2], l[2], alpha[2];
  unsigned p[BN / 4];
  int m0 = 0;  // the current tile's first query row (the masks read it)

  auto issue_qk = [&](int st) {  // s = Q K^T of the key tile in slot st
    const unsigned kb = sK + st * KV_BYTES;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
      u64 da = sw128_desc(q_base + (kk / 4) * (BM * 128) + (kk % 4) * 32, 16, 1024);
      u64 db = sw128_desc(kb + (kk / 4) * (BN * 128) + (kk % 4) * 32, 16, 1024);
      WGMMA_QK(s, da, db, kk > 0);
    }
    wgmma_commit();
  };
  auto issue_pv = [&](int st) {  // o += P V of the value tile in slot st
    const unsigned vb = sV + st * KV_BYTES;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      WGMMA_PV(o, p + 4 * kk, sw128_desc(vb + kk * 2048, BN * 128, 1024), 1);
    wgmma_commit();
  };
  auto pin_s = [&]() {
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) fence_operand(s[i]);
  };
  auto pin_op = [&]() {
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 2; ++i) fence_operand(o[i]);
#pragma unroll
    for (int i = 0; i < BN / 4; ++i) fence_operand(p[i]);
  };
  // The online softmax of key block j over s (raw scores): the masks where the block crosses
  // the end of the keys or the causal diagonal, the new row maxima m (log2 domain, scaled),
  // the unnormalised probabilities in s, the running sums l (this thread's columns) and
  // alpha, the factor that rescales what o holds.
  auto softmax = [&](int j) {
    const int k0 = j * BN;
    if (k0 + BN > seq_k || (causal && k0 + BN - 1 > m0 + c * 64 + diag)) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m0 + row0 + 8 * h;
        const int last = causal ? min(seq_k - 1, row + diag) : seq_k - 1;
#pragma unroll
        for (int jj = 0; jj < BN / 8; ++jj)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (k0 + 8 * jj + 2 * (lane % 4) + e > last) s[4 * jj + 2 * h + e] = NEG_INF;
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = NEG_INF;
#pragma unroll
      for (int jj = 0; jj < BN / 8; ++jj)
        mx = fmaxf(mx, fmaxf(s[4 * jj + 2 * h], s[4 * jj + 2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[h], mx * scale_log2);
      const float m_use = m_new == NEG_INF ? 0.f : m_new;  // a row with nothing visible yet
      alpha[h] = ex2(m[h] - m_use);
      m[h] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int jj = 0; jj < BN / 8; ++jj)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float x = ex2(fmaf(s[4 * jj + 2 * h + e], scale_log2, -m_use));
          s[4 * jj + 2 * h + e] = x;
          sum += x;
        }
      l[h] = l[h] * alpha[h] + sum;
    }
  };
  auto rescale = [&]() {
#pragma unroll
    for (int jj = 0; jj < HEAD_DIM / 8; ++jj)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        o[4 * jj + 2 * h] *= alpha[h];
        o[4 * jj + 2 * h + 1] *= alpha[h];
      }
  };
  auto to_p = [&]() {  // s's columns 16 kk.. as the A fragment of k-slice kk
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) p[4 * kk + i] = pack2(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
  };

  // PINGPONG: consumer c issues its products after bar.sync 1 + c (256 threads: its own 128
  // and the other consumer's 128 arrivals) and then lets the other go (bar.arrive 2 - c);
  // consumer 1's first arrival lets consumer 0 start, and consumer 0 takes the last one.
  auto my_turn = [&]() {
    if (PINGPONG) named_bar(1 + c, 256);
  };
  auto your_turn = [&]() {
    if (PINGPONG) named_bar_arrive(2 - c, 256);
  };
  if (PINGPONG && c == 1) named_bar_arrive(1, 256);
  int it = 0, round = 0;  // K/V blocks consumed and tiles done, over this CTA's tiles
  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x, ++round) {
    const Tile w = tile_at(tile);
    const int n_blocks = w.n_blocks;
    m0 = w.m0;
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 2; ++i) o[i] = 0.f;
    m[0] = m[1] = NEG_INF;
    l[0] = l[1] = 0.f;
    mbar_wait(bar_q, round & 1);
    // the ring's slot and phase of this tile's block j
    auto slot = [&](int j) { return (it + j) % STAGES; };
    auto phase = [&](int j) { return (unsigned)(((it + j) / STAGES) & 1); };
#if INTRA_OVERLAP
    if (n_blocks > 0) {
      mbar_wait(full_k(slot(0)), phase(0));
      my_turn();
      issue_qk(slot(0));
      your_turn();
      wgmma_wait0();
      pin_s();
      if (t == 0) mbar_arrive(empty_k(slot(0)));
      softmax(0);  // o is still 0: nothing to rescale
      to_p();
      for (int j = 1; j < n_blocks; ++j) {
        mbar_wait(full_k(slot(j)), phase(j));
        mbar_wait(full_v(slot(j - 1)), phase(j - 1));
        my_turn();
        issue_qk(slot(j));
        issue_pv(slot(j - 1));
        your_turn();
        wgmma_wait1();  // S_j is done (groups complete in order); P_{j-1} V_{j-1} may run on
        pin_s();
        if (t == 0) mbar_arrive(empty_k(slot(j)));
        softmax(j);
        wgmma_wait0();
        pin_op();
        if (t == 0) mbar_arrive(empty_v(slot(j - 1)));
        rescale();
        to_p();
      }
      mbar_wait(full_v(slot(n_blocks - 1)), phase(n_blocks - 1));
      issue_pv(slot(n_blocks - 1));
      wgmma_wait0();
      pin_op();
      if (t == 0) mbar_arrive(empty_v(slot(n_blocks - 1)));
    }
#else
    for (int j = 0; j < n_blocks; ++j) {
      mbar_wait(full_k(slot(j)), phase(j));
      issue_qk(slot(j));
      wgmma_wait0();
      pin_s();
      if (t == 0) mbar_arrive(empty_k(slot(j)));
      softmax(j);
      rescale();
      to_p();
      mbar_wait(full_v(slot(j)), phase(j));
      issue_pv(slot(j));
      wgmma_wait0();
      pin_op();
      if (t == 0) mbar_arrive(empty_v(slot(j)));
    }
#endif
    it += n_blocks;
    if (t == 0) mbar_arrive(q_free);  // the producer may load the next tile's Q meanwhile

    // ---- epilogue: o / l to O (rows past seq_q are not stored), the lse to LSE ----
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = l[h];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int row = m0 + row0 + 8 * h;
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      if (row < seq_q) {
        elem_t* orow = O + w.batch * so_b + (long long)row * so_s + w.head * so_h;
#pragma unroll
        for (int jj = 0; jj < HEAD_DIM / 8; ++jj)
          *reinterpret_cast<unsigned*>(orow + 8 * jj + 2 * (lane % 4)) =
              pack2(o[4 * jj + 2 * h] * inv, o[4 * jj + 2 * h + 1] * inv);
        if (lane % 4 == 0)
          LSE[((long long)w.batch * heads + w.head) * seq_q + row] =
              sum > 0.f ? (m[h] + log2f(sum)) * (1.f / LOG2E) : NEG_INF;
      }
    }
  }
  if (PINGPONG && c == 0) named_bar(1, 256);  // consumer 1's last arrival
}
