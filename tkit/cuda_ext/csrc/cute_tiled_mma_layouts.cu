// Print the layouts of two tiled MMAs with CuTe, on the host (no GPU needed): the mma.sync
// atom that gemm_mma_sm80.cu issues by hand and the wgmma atom of gemm_wgmma_sm90.cu.
//
// Each layout maps (thread, value) -> (row, column) of the operand tile: read ALayout as
// "thread t's value v of A sits at row r, column k". Built by tkit.cuda_ext.cute_layouts()
// (nvcc, CuTe headers from the nvidia-cutlass wheel) for tutorial chapter 06b.
#include <cstdio>

#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>

using namespace cute;

template <class TiledMMA>
void show(const char* title, TiledMMA mma) {
  printf("==== %s\n", title);
  print(mma);
  printf("\n-- A (thr, val) -> (m, k)\n");
  print(typename TiledMMA::Atom::LayoutA_TV{});
  printf("\n-- B (thr, val) -> (n, k)\n");
  print(typename TiledMMA::Atom::LayoutB_TV{});
  printf("\n-- C (thr, val) -> (m, n)\n");
  print(typename TiledMMA::Atom::LayoutC_TV{});
  printf("\n");
}

int main() {
  // mma.sync m16n8k16 bf16 -> fp32, 2 x 4 warps, as in gemm_mma_sm80.cu (each warp then
  // repeats the atom 4 x 4 times over its 64 x 32 tile)
  auto sm80 = make_tiled_mma(SM80_16x8x16_F32BF16BF16F32_TN{}, Layout<Shape<_2, _4, _1>>{});
  show("SM80 mma.sync m16n8k16, 2x4 warps", sm80);

  // wgmma m64n256k16: one warpgroup (128 threads); A K-major and B MN-major, both from shared
  // memory, as in gemm_wgmma_sm90.cu
  auto sm90 = make_tiled_mma(
      SM90_64x256x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::MN>{});
  show("SM90 wgmma m64n256k16 (SS, A K-major, B MN-major)", sm90);

  // the 128-byte swizzled shared-memory atoms TMA writes and wgmma reads
  printf("==== GMMA::Layout_K_SW128_Atom<bf16> (A tile atom)\n");
  print(GMMA::Layout_K_SW128_Atom<bfloat16_t>{});
  printf("\n==== GMMA::Layout_MN_SW128_Atom<bf16> (B tile atom)\n");
  print(GMMA::Layout_MN_SW128_Atom<bfloat16_t>{});
  printf("\n");

  // The shared-memory stage of gemm_wgmma_sm90.cu, as CuTe sees it, and the wgmma descriptors
  // CuTe derives for one k16 slice: the kernel writes the same numbers by hand
  // (A: SBO 1024 B; B: LBO 8192 B, SBO 1024 B; layout type 1 = 128-byte swizzle).
  static bfloat16_t stage[256 * 64] __attribute__((aligned(1024)));
  auto layout_b = tile_to_shape(GMMA::Layout_MN_SW128_Atom<bfloat16_t>{}, Shape<_256, _64>{},
                                Step<_2, _1>{});  // 4 TMA boxes of 64 n x 64 k, k-rows first
  auto layout_a = tile_to_shape(GMMA::Layout_K_SW128_Atom<bfloat16_t>{}, Shape<_64, _64>{});
  printf("==== B stage (n, k) -> element: ");
  print(layout_b);
  printf("\n==== A stage, one consumer's 64 rows (m, k) -> element: ");
  print(layout_a);
  printf("\n");
  auto slice_b = local_tile(make_tensor(make_smem_ptr(stage), layout_b), Shape<_256, _16>{},
                            make_coord(0, 1));
  auto slice_a = local_tile(make_tensor(make_smem_ptr(stage), layout_a), Shape<_64, _16>{},
                            make_coord(0, 1));
  // (the start address needs a device; on the host CuTe leaves it 0 and says so on stdout)
  auto desc_b = GMMA::make_gmma_desc<GMMA::Major::MN>(slice_b);
  auto desc_a = GMMA::make_gmma_desc<GMMA::Major::K>(slice_a);
  printf("desc A: LBO %u B, SBO %u B, layout type %u\n",
         16u * desc_a.bitfield.leading_byte_offset_, 16u * desc_a.bitfield.stride_byte_offset_,
         (unsigned)desc_a.bitfield.layout_type_);
  printf("desc B: LBO %u B, SBO %u B, layout type %u\n",
         16u * desc_b.bitfield.leading_byte_offset_, 16u * desc_b.bitfield.stride_byte_offset_,
         (unsigned)desc_b.bitfield.layout_type_);
  return 0;
}
