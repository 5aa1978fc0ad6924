// Device helpers of the INT4 decode kernels (gemm_int4_sm90.cu, gemv_int4.cu): the nibble
// pairs' dequantization into mma.sync m16n8k16's register operand, the MMA, and the 16-bit
// conversions. The includer defines ACT_F16 (fp16 activations, else bf16) and SCALE_T (0
// float16, 1 bfloat16, 2 float32) first.
#pragma once

#if ACT_F16
#define MAGIC 0x64006400u
#define ONES 0x3C003C00u
#define MMA_TYPE "f16"
#else
#define MAGIC 0x43004300u
#define ONES 0x3F803F80u
#define MMA_TYPE "bf16"
#endif
#define OFFSET_F (ACT_F16 ? 1024.0f : 128.0f)

__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
  unsigned r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// (O + q_j, O + q_j+4) of the nibbles at bits 4 i .. and 16 + 4 i .. of w, as one register:
// one LOP3 (mask and magic in registers: LOP3 takes one immediate) after the shift
__device__ __forceinline__ unsigned pair(unsigned w, int i, unsigned mask, unsigned magic) {
  unsigned r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(w >> (4 * i)), "r"(mask), "r"(magic));
  return r;
}

__device__ __forceinline__ void mma(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                    unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// a 16-bit scale (SCALE_T 0 / 1) as a float
__device__ __forceinline__ float half_to_f32(unsigned short h) {
#if SCALE_T == 1
  return __uint_as_float(((unsigned)h) << 16);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
  return f;
#endif
}

__device__ __forceinline__ unsigned short to_act(float v) {
  unsigned short h;
#if ACT_F16
  asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(h) : "f"(v));
#else
  asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(h) : "f"(v));
#endif
  return h;
}

__device__ __forceinline__ float act_to_f32(unsigned short h) {
#if ACT_F16
  float f;
  asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
  return f;
#else
  return __uint_as_float(((unsigned)h) << 16);
#endif
}
