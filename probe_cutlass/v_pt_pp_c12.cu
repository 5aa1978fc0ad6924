#include "fp8.cuh"
TKIT_PROBE_ENTRY(pt_pp_c12, Shape<_64, _128, _128>, Shape<_1, _2, _1>,
                 cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                 cutlass::epilogue::TmaWarpSpecialized, false)
