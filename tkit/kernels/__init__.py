"""Triton kernels, one package per op family. Import the public functions from ``tkit``."""

from tkit._compat import check_interpreter

# before any kernel is defined: a Triton/numpy pair whose interpreter breaks fails here, by name
check_interpreter()

from tkit.kernels import _triton_key  # noqa: E402

# a new process reads Triton's version key from disk instead of rehashing libtriton.so
_triton_key.install()
