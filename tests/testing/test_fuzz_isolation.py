"""fuzz survives a crashing kernel: the example runs in a child, the crash is a failure that
hypothesis shrinks, and the reproducer is printed; without Triton's interpreter on a CPU
machine the error says how to turn it on."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import strategies as st

from tkit.testing import KernelCrashed, ReferenceMismatch, fuzz

ROOT = Path(__file__).resolve().parents[2]
#: elements past the output that the bad kernel writes: 64 GiB of float32 away, unmapped
FAR = 1 << 34


@triton.jit
def _add_kernel(a, b, out, n, far, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    # far is 0 for a small tensor and FAR past 100 elements: a bug that only large inputs
    # trigger, so that shrinking has a boundary to find
    tl.store(out + offs + far, tl.load(a + offs, mask=m) + tl.load(b + offs, mask=m), mask=m)


def add_far_past_100(a, b):
    """Correct up to 100 elements; beyond, it writes 64 GiB past its output."""
    out = torch.empty_like(a)
    n = out.numel()
    _add_kernel[(triton.cdiv(n, 64),)](a, b, out, n, FAR if n > 100 else 0, BLOCK=64)
    return out


def add_off_by_one_past_3(a, b):
    """No crash, a wrong answer from 3 elements on."""
    out = torch.empty_like(a)
    n = out.numel()
    _add_kernel[(triton.cdiv(n, 64),)](a, b, out, n, 0, BLOCK=64)
    return out + (1.0 if n >= 3 else 0.0)


def same_shape_twice():
    # a plain integer range, so that shrinking can reach any size (S.shapes prefers its
    # special sizes and would stop at the first one past a boundary)
    return st.integers(1, 300).map(lambda n: ((n,), (n,)))


def test_an_out_of_bounds_kernel_is_a_shrunk_failure_and_this_process_survives():
    with pytest.raises(KernelCrashed) as info:
        fuzz(add_far_past_100, torch.add, shapes=same_shape_twice(), max_examples=30)
    msg = str(info.value)
    # the child died of the write (SIGSEGV in the interpreter, a lost context on a GPU) ...
    assert "crashed" in msg, msg
    # ... and hypothesis shrank the crash to the boundary: 101 elements, seed 0
    assert "reproduce: add_far_past_100(make_tensor((101,), torch.float32" in msg, msg
    # this process is fine, and so is the worker for the next call
    stats = fuzz(add_far_past_100, torch.add, max_examples=5,
                 shapes=st.just(((100,), (100,))))
    assert stats.examples == 5 and stats.failed == 0


def test_a_wrong_answer_from_the_child_is_a_reference_mismatch_with_its_reproducer():
    with pytest.raises(ReferenceMismatch) as info:
        fuzz(add_off_by_one_past_3, torch.add, shapes=same_shape_twice(), max_examples=20)
    assert "reproduce: add_off_by_one_past_3(make_tensor((3,), torch.float32" in str(info.value)


def test_a_function_the_child_cannot_import_is_a_clear_error():
    def local_add(a, b):
        return a + b

    with pytest.raises(TypeError, match="module level"):
        fuzz(local_add, torch.add, shapes=same_shape_twice(), max_examples=2, isolate=True)
    with pytest.raises(TypeError, match="module level"):
        fuzz(add_far_past_100, lambda a, b: a + b, shapes=same_shape_twice(), max_examples=2,
             isolate=True)
    # by default it says why and runs here (tests written before isolation keep working)
    with pytest.warns(UserWarning, match="runs in this process.*module level"):
        stats = fuzz(local_add, torch.add, shapes=same_shape_twice(), max_examples=2)
    assert stats.examples == 2


def test_a_lost_context_in_process_stops_at_once_with_its_reproducer():
    calls = []

    def faulting_add(a, b):
        calls.append(a.numel())
        if a.numel() > 10:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return a + b

    with pytest.raises(KernelCrashed, match="not shrunk") as info:
        fuzz(faulting_add, torch.add, shapes=same_shape_twice(), max_examples=50,
             isolate=False)
    assert "reproduce: " in str(info.value)
    assert calls[-1] > 10 and sum(n > 10 for n in calls) == 1  # no example after the fault


def test_budget_stops_running_examples():
    stats = fuzz(torch.add, torch.add, shapes=same_shape_twice(), max_examples=20,
                 isolate=False, budget_s=0.0)
    assert stats.examples == 0 and stats.stopped

    def slow_and_wrong_from_2(a, b):
        time.sleep(0.2)  # shrinking (tens of candidates) cannot finish within the budget
        return a + b + (1.0 if a.numel() >= 2 else 0.0)

    # the budget ends while a failure is being shrunk: that failure is raised, not lost, and
    # soon (a full shrink would take dozens of 0.2 s candidates)
    t0 = time.time()
    with pytest.raises(ReferenceMismatch, match="reproduce: "):
        fuzz(slow_and_wrong_from_2, torch.add, shapes=same_shape_twice(), max_examples=200,
             isolate=False, budget_s=0.5)
    assert time.time() - t0 < 3.0


SCRIPT = textwrap.dedent("""
    import torch, triton, triton.language as tl
    from hypothesis import strategies as st
    from tkit.testing import KernelCrashed, fuzz

    @triton.jit
    def _copy_kernel(x, out, n, far, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(out + offs + far, tl.load(x + offs, mask=offs < n), mask=offs < n)

    def bad_copy(x):  # defined in __main__: the child imports this file under another name
        out = torch.empty_like(x)
        _copy_kernel[(1,)](x, out, x.numel(), {far} if x.numel() > 4 else 0, BLOCK=512)
        return out

    if __name__ == "__main__":
        shapes = st.integers(1, 300).map(lambda n: ((n,),))
        try:
            fuzz(bad_copy, torch.clone, shapes=shapes,
                 max_examples=20)
        except KernelCrashed as e:
            print("REPORTED", e)
        except RuntimeError as e:
            print("RUNTIME", e)
""")


def _run_script(tmp_path, env):
    path = tmp_path / "user_script.py"
    path.write_text(SCRIPT.format(far=FAR))
    env = {**env, "PYTHONPATH": str(ROOT), "TKIT_HYPOTHESIS_PROFILE": "dev"}
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          env=env, timeout=600, cwd=tmp_path)


def test_a_kernel_defined_in_main_crashes_and_the_script_reports_it(tmp_path):
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    out = _run_script(tmp_path, env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "REPORTED the kernel crashed" in out.stdout, out.stdout + out.stderr
    assert "reproduce: bad_copy(make_tensor((5,), torch.float32" in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the hint is for machines without a GPU")
def test_without_the_interpreter_on_a_cpu_machine_the_error_says_how_to_turn_it_on(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = _run_script(tmp_path, env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "RUNTIME Triton found no GPU driver" in out.stdout, out.stdout + out.stderr
    assert "TRITON_INTERPRET=1 python your_script.py" in out.stdout
