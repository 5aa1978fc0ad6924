"""Every environment switch tkit reads, read once at import.

TRITON_INTERPRET=1   run Triton kernels on CPU tensors through Triton's interpreter (Triton's own
                     switch; it must be set before any kernel module is imported).
TKIT_POISON=1        fill every output tkit allocates with NaN before the launch, so a test sees
                     any element a kernel forgot to write (tests also turn this on per call with
                     ``tkit.testing.poisoned_outputs()``).
TKIT_CACHE_DIR       tkit's on-disk caches (default ~/.cache/tkit): measured device ceilings,
                     tuned configs (autotune/), Triton's version key (triton-key/, one small
                     file per installed Triton, so a new process's first launch does not rehash
                     libtriton.so). Deleting the folder clears them all; each is rebuilt on use.
TKIT_HYPOTHESIS_PROFILE  ``ci`` (derandomized, interpreter-sized) or ``gpu`` (larger shapes, more
                     examples); default ``ci``.
TKIT_NO_DIRECT=1     always go through the registered torch.library op, even in eager mode.
TKIT_SLOW=1          run tests marked slow.
TKIT_TOOLCHAIN_SHARD=i/n  run share i of n of the tests marked toolchain (nvcc builds, no
                     Triton or numpy in them; read by conftest.py): CI's two stages take
                     one share each. Unset: all of them.
TKIT_WGMMA_SELFTEST=0  skip the one-time subprocess self-test of the hand-written Hopper GEMM
                     before its first use on a machine (the self-test guards against a hang).
TKIT_GIT_SHA         the git sha stamped on benchmark rows where the tree has no .git (the copy
                     sent to a GPU machine).
TKIT_CHECK=1         full validation of index tensors (grouped_matmul's offsets, varlen attention's
                     cu_seqlens and max_seqlen): monotonic, in range, first 0, last the total,
                     segments no longer than max_seqlen, with a ValueError naming the argument
                     and its first bad entry. It reads device tensors (one sync per call), so it
                     is off by default; host tensors (and every call in the interpreter) are
                     checked always. The kernels clamp offsets either way: no value reads or
                     writes outside a tensor.
TKIT_NO_AUTOTUNE=1   use each kernel's first (default) config (after its pruner), ignoring the tuned
                     tables: reproducible runs and GPU test runs.
TKIT_AUTOTUNE=1      tune at call time: an autotuned kernel benchmarks its configs the first time
                     it sees a size bucket and writes the winner to the tuning cache
                     ($TKIT_CACHE_DIR/autotune/). Without it no call ever benchmarks: a config
                     comes from that cache, then the shipped table (tkit/kernels/tuned/), then
                     the kernel's first config that its pruner keeps.
TKIT_NO_CPLAN=1      eager plans stay in Python: never build or load the C++ plan executor
                     (tkit/kernels/_cplan.cpp, compiled once into $TKIT_CACHE_DIR/cplan/).
TKIT_NO_FAST_LAUNCH=1  launch every kernel through ``kernel[grid](**kwargs)`` instead of the cached
                     compiled kernel (``tkit.kernels._launch``): a switch for bisecting.
"""

from __future__ import annotations

import os
from pathlib import Path


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


INTERPRET: bool = _flag("TRITON_INTERPRET")
POISON: bool = _flag("TKIT_POISON")
CACHE_DIR: Path = Path(os.environ.get("TKIT_CACHE_DIR", Path.home() / ".cache" / "tkit"))
HYPOTHESIS_PROFILE: str = os.environ.get("TKIT_HYPOTHESIS_PROFILE", "ci")
NO_DIRECT: bool = _flag("TKIT_NO_DIRECT")
SLOW: bool = _flag("TKIT_SLOW")
NO_AUTOTUNE: bool = _flag("TKIT_NO_AUTOTUNE")
CHECK: bool = _flag("TKIT_CHECK")
AUTOTUNE: bool = _flag("TKIT_AUTOTUNE")
NO_FAST_LAUNCH: bool = _flag("TKIT_NO_FAST_LAUNCH")
WGMMA_SELFTEST: bool = os.environ.get("TKIT_WGMMA_SELFTEST", "1").strip() != "0"
GIT_SHA: str = os.environ.get("TKIT_GIT_SHA", "")
NO_CPLAN: bool = _flag("TKIT_NO_CPLAN")
