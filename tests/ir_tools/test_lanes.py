"""tkit.ir_tools.lanes on hand-written PTX: which butterfly steps leave partner lanes with
different bits."""

from tkit.ir_tools.lanes import butterfly_asymmetries

HEAD = """
	mul.rn.f32 %r1, %r9, %r9;
	shfl.sync.bfly.b32 	%r2, %r1, 2, 31, -1;
"""


def test_symmetric_steps_pass():
    ptx = HEAD + """
	add.f32 	%r3, %r1, %r2;
	shfl.sync.bfly.b32 	%r4, %r3, 1, 31, -1;
	max.f32 	%r5, %r4, %r3;
"""
    assert butterfly_asymmetries(ptx) == []


def test_a_multiply_fused_into_the_step_is_found():
    ptx = """
	mul.f32 	%r1, %r9, %r9;
	shfl.sync.bfly.b32 	%r2, %r1, 2, 31, -1;
	fma.rn.f32 	%r3, %r9, %r9, %r2;
"""
    (found,) = butterfly_asymmetries(ptx)
    assert found.startswith("fma.rn.f32")


def test_a_multiply_the_assembler_may_fuse_is_found():
    ptx = """
	mul.f32 	%r1, %r9, %r9;
	shfl.sync.bfly.b32 	%r2, %r1, 2, 31, -1;
	add.f32 	%r3, %r1, %r2;
"""
    (found,) = butterfly_asymmetries(ptx)
    assert "contract" in found


def test_non_commutative_combine_is_found():
    ptx = HEAD + """
	sub.f32 	%r3, %r2, %r1;
	@%p1 add.f32 	%r4, %r7, %r2;
"""
    assert len(butterfly_asymmetries(ptx)) == 2


def test_layout_conversion_shuffles_are_not_reductions():
    ptx = HEAD + """
	selp.f32 	%r3, %r2, %r1, %p4;
	@%p5 st.global.b32 [ %rd1 + 0 ], { %r2 };
"""
    assert butterfly_asymmetries(ptx) == []
