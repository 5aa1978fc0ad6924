#include "fp8.cuh"
TKIT_PROBE_ENTRY(pt_coop_c21, Shape<_128, _256, _128>, Shape<_2, _1, _1>,
                 cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                 cutlass::epilogue::TmaWarpSpecializedCooperative, false)
