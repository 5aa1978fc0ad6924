"""What tkit needs from the Triton (and numpy) it runs with: the supported range, the one pair
inside it whose interpreter breaks (checked once, where the kernels are imported), and the
compile options tkit sets instead of leaving them to a default that moves between releases.

pyproject declares triton >= 3.6, < 3.10 (3.6 is what torch's CUDA builds bring, 3.9 what pip
resolves on its own; CI runs the suite under both). One combination inside those ranges is
wrong at run time and pip cannot rule it out (its markers cannot depend on another package's
version): Triton's interpreter before 3.9 (``TRITON_INTERPRET=1``, the CPU path of the tests and
of ``tkit bench``) with numpy >= 2.4, whose scalar rules break it on the first kernel that loops
over a scalar argument ("only 0-dimensional arrays can be converted to Python scalars", from
deep inside the interpreter). Versions 3.7 and 3.8 are not tested and are treated as 3.6.
"""

from __future__ import annotations

TRITON_RANGE = ((3, 6), (3, 10))  # pyproject's bounds, [low, high)
INTERPRETER_NUMPY_FIXED_IN = (3, 9)  # first Triton whose interpreter works with numpy >= 2.4


def version_tuple(text: str) -> tuple[int, int]:
    """``"3.6.0"``, ``"2.4.0rc1"``, ``"3.9.0+git1234"`` -> (major, minor)."""
    parts = []
    for piece in text.split(".")[:2]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits or 0))
    return tuple(parts + [0] * (2 - len(parts)))


def interpreter_problem(triton_version: str, numpy_version: str, interpret: bool) -> str | None:
    """Why these versions cannot run tkit's kernels in Triton's interpreter, or None."""
    if not interpret:
        return None
    tv, nv = version_tuple(triton_version), version_tuple(numpy_version)
    if tv < INTERPRETER_NUMPY_FIXED_IN and nv >= (2, 4):
        return (f"Triton {triton_version}'s interpreter (TRITON_INTERPRET=1, how tkit runs "
                f"kernels without a GPU) does not work with numpy {numpy_version}: it needs "
                f"numpy < 2.4 before Triton 3.9. Install one of: pip install 'numpy<2.4', or "
                f"pip install 'triton>=3.9,<3.10' (its interpreter handles numpy 2.4).")
    return None


def check_interpreter() -> None:
    """Raise ImportError for a Triton/numpy pair whose interpreter fails, when it is on."""
    import numpy
    import triton

    from tkit import _env

    # the live value, not _env.INTERPRET: what counts is the switch as triton.jit sees it when
    # the kernel modules are defined, and the CLI may turn it on after tkit._env was read
    interpret = _env._flag("TRITON_INTERPRET")
    problem = interpreter_problem(triton.__version__, numpy.__version__, interpret)
    if problem:
        raise ImportError(problem)


# Compile options tkit always sets, so that what is compiled does not depend on a default that
# moves between Triton releases. FP fusion (mul + add -> fma) is on by default through 3.9,
# which warns on every compile that leaves the choice to it (its default turns to off in 3.10);
# tkit's kernels and their measurements assume fusion, so it is requested explicitly. Used by
# every ahead-of-time compile (tkit.ir, attention_hopper.compile_sm90); an explicit option in a
# call still wins.
COMPILE_DEFAULTS = {"enable_fp_fusion": True}


def compile_options(options: dict | None = None) -> dict:
    """``options`` over :data:`COMPILE_DEFAULTS`: what tkit passes to ``triton.compile``."""
    return {**COMPILE_DEFAULTS, **(options or {})}
