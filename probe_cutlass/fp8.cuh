// Probe: CUTLASS's own sm90 FP8 GEMMs (blockwise 1x128 / 128x128 scales, and per-tensor),
// instantiated from the nvidia-cutlass wheel's headers, launched through a C entry point.
#include <cuda_runtime.h>
#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "cutlass/detail/blockwise_scale_layout.hpp"

using namespace cute;

template <class TileShape, class ClusterShape, class KernelSchedule, class EpiSchedule, bool Blockwise,
          class Scheduler = void>
struct Fp8Gemm {
  using EA = cutlass::float_e4m3_t;
  using EB = cutlass::float_e4m3_t;
  using ED = cutlass::bfloat16_t;
  using EC = void;
  using LA = cutlass::layout::RowMajor;
  using LB = cutlass::layout::ColumnMajor;
  using LD = cutlass::layout::RowMajor;
  static constexpr int AlA = 16, AlB = 16, AlD = 8;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128>;
  using LSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      EC, LD, AlD, ED, LD, AlD, EpiSchedule,
      cutlass::epilogue::fusion::LinearCombination<ED, float, EC, float>>::CollectiveOp;
  using LayA = std::conditional_t<Blockwise, cute::tuple<LA, LSFA>, LA>;
  using LayB = std::conditional_t<Blockwise, cute::tuple<LB, LSFB>, LB>;
  using Main = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, EA, LayA, AlA, EB, LayB, AlB, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Main, Epi, Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Gemm::Arguments args(void* a, void* b, void* sa, void* sb, void* d, int M, int N, int K) {
    using SA = typename Kernel::StrideA; using SB = typename Kernel::StrideB; using SD = typename Kernel::StrideD;
    SA sA = cutlass::make_cute_packed_stride(SA{}, make_shape(M, K, 1));
    SB sB = cutlass::make_cute_packed_stride(SB{}, make_shape(N, K, 1));
    SD sD = cutlass::make_cute_packed_stride(SD{}, make_shape(M, N, 1));
    typename Gemm::Arguments x;
    if constexpr (Blockwise) {
      auto lsfa = ScaleConfig::tile_atom_to_shape_SFA(make_shape(M, N, K, 1));
      auto lsfb = ScaleConfig::tile_atom_to_shape_SFB(make_shape(M, N, K, 1));
      x = typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGemm, {M, N, K, 1},
          {(EA*)a, sA, (EB*)b, sB, (float*)sa, lsfa, (float*)sb, lsfb},
          {{}, nullptr, sD, (ED*)d, sD}};
    } else {
      x = typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGemm, {M, N, K, 1},
          {(EA*)a, sA, (EB*)b, sB}, {{}, nullptr, sD, (ED*)d, sD}};
    }
    x.epilogue.thread.alpha = 1.0f;
    x.epilogue.thread.beta = 0.0f;
    return x;
  }
};

#define TKIT_PROBE_ENTRY(NAME, ...)                                                              \
  using NAME##_t = Fp8Gemm<__VA_ARGS__>;                                                         \
  extern "C" size_t NAME##_workspace(int M, int N, int K) {                                      \
    auto x = NAME##_t::args(nullptr, nullptr, nullptr, nullptr, nullptr, M, N, K);               \
    return NAME##_t::Gemm::get_workspace_size(x);                                                \
  }                                                                                              \
  extern "C" int NAME(void* a, void* b, void* sa, void* sb, void* d, int M, int N, int K,        \
                      void* ws, void* stream) {                                                  \
    static NAME##_t::Gemm g;                                                                     \
    auto x = NAME##_t::args(a, b, sa, sb, d, M, N, K);                                           \
    if (g.can_implement(x) != cutlass::Status::kSuccess) return 1;                               \
    if (g.initialize(x, ws, (cudaStream_t)stream) != cutlass::Status::kSuccess) return 2;        \
    if (g.run((cudaStream_t)stream) != cutlass::Status::kSuccess) return 3;                      \
    return (int)cudaGetLastError();                                                              \
  }
