#include "fp8.cuh"
TKIT_PROBE_ENTRY(bw_coop_c12, Shape<_128, _128, _128>, Shape<_1, _2, _1>,
                 cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise,
                 cutlass::epilogue::TmaWarpSpecializedCooperative, true)
