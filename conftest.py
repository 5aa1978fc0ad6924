"""Shared test settings for tests/ and tutorials/: hypothesis profiles, the gpu marker, the
interpreter switch and two speed-ups of the interpreter."""

import os

import pytest
import torch

# Without a GPU, run kernels in Triton's interpreter. This must happen before any kernel module
# is imported (triton.jit reads it at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402


def _speed_up_interpreter() -> bool:
    """Two of Triton's interpreter costs that change nothing it computes, taken out for the
    suite (under ``TRITON_INTERPRET=1``; a Triton without these functions is left alone):

    - triton.language is patched (``_patch_lang``: every builtin of ``tl``, ``tl.math`` and
      ``tl.tensor``, found by ``inspect.getmembers``) at each launch and again at every call of
      a ``@triton.jit`` helper inside the kernel, although the launch's patches are still in
      place (a helper's own are never restored). Here a helper call whose language modules the
      running launch has patched patches nothing; any other call (a launch; the first helper
      of a launch whose module reaches ``triton.language.core`` where the kernel's does not)
      runs Triton's own, and its patches are undone when the launch ends (Triton leaves a
      helper's in place). In kernels built from helpers (sampling's search, norm, the GEMMs)
      the re-patching was 30-50% of the interpreter's time.
    - ``_get_np_dtype`` builds its table of 19 dtypes at every call (a few hundred thousand
      calls in a test of a kernel with loops): the answers, which depend on the element type
      alone, are kept.

    Returns whether the first is installed."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    get_np_dtype = getattr(interp, "_get_np_dtype", None)
    if get_np_dtype is not None and not hasattr(get_np_dtype, "triton_get_np_dtype"):
        np_dtypes = {}

        def cached_np_dtype(tt_dtype):
            # a block's numpy dtype is its element type's (a pointer's: uint64)
            ty = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
            if isinstance(ty, tl.pointer_type):  # unhashable; Triton answers before its table
                return get_np_dtype(ty)
            got = np_dtypes.get(ty)
            if got is None:
                got = np_dtypes[ty] = get_np_dtype(ty)
            return got

        cached_np_dtype.triton_get_np_dtype = get_np_dtype
        interp._get_np_dtype = cached_np_dtype

    patch = getattr(interp, "_patch_lang", None)
    scope_cls = getattr(interp, "_LangPatchScope", None)
    if patch is None or scope_cls is None or not hasattr(scope_cls, "restore"):
        return False
    if hasattr(patch, "triton_patch_lang"):
        return True
    patched: set[int] = set()  # the language modules patched since the running launch began
    helper_scopes: list = []  # patches made for helpers during the running launch

    def patch_lang(fn):
        want = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if patched:  # a helper called inside a launch
            if want <= patched:
                return scope_cls()  # its modules are patched until the launch ends
            patched.update(want)
            # Triton never restores a helper's patches: triton.language.core's builtins (add,
            # where, ...) stayed the interpreter's after the launch, and a later ahead-of-time
            # compile in the same process built its IR through them (tensor.__add__ calls
            # core.add) and failed. They are restored with the launch's, last first.
            scope = patch_lang.triton_patch_lang(fn)
            helper_scopes.append(scope)
            return scope
        scope = patch_lang.triton_patch_lang(fn)
        restore = scope.restore
        patched.update(want)

        def restore_and_forget():
            patched.clear()
            while helper_scopes:
                helper_scopes.pop().restore()
            restore()

        scope.restore = restore_and_forget
        return scope

    patch_lang.triton_patch_lang = patch
    interp._patch_lang = patch_lang
    return True


if os.environ.get("TRITON_INTERPRET") == "1":
    _speed_up_interpreter()

_common = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much, HealthCheck.differing_executors],
    print_blob=True,
)
# ci: interpreter-sized and derandomized, so a CI run is reproducible and bounded in time.
settings.register_profile("ci", max_examples=60, derandomize=True, **_common)
# gpu: more examples; strategies draw larger shapes when a GPU is present.
settings.register_profile("gpu", max_examples=50, **_common)
# dev: quick local iterations.
settings.register_profile("dev", max_examples=10, **_common)
settings.load_profile(os.environ.get("TKIT_HYPOTHESIS_PROFILE",
                                     "gpu" if torch.cuda.is_available() else "ci"))


def _toolchain_shard() -> tuple[int, int] | None:
    """TKIT_TOOLCHAIN_SHARD="i/n": this run takes the i-th of n shares of the ``toolchain``
    tests (None: all of them)."""
    value = os.environ.get("TKIT_TOOLCHAIN_SHARD", "").strip()
    if not value:
        return None
    i, _, n = value.partition("/")
    if not (i.isdigit() and n.isdigit() and int(i) < int(n)):
        raise pytest.UsageError(f"TKIT_TOOLCHAIN_SHARD must be i/n with 0 <= i < n, got "
                                f"{value!r}")
    return int(i), int(n)


def _toolchain_unit(item, marker) -> tuple:
    """The tests that share a build are one unit: ``group=`` names a build several modules
    share, the marker's arguments name the parameters that pick the build (neither: the test
    is its own unit)."""
    if "group" in marker.kwargs:
        return ("group", marker.kwargs["group"])
    cs = getattr(item, "callspec", None)
    if not marker.args:
        return (item.nodeid,)
    return (item.path, *(repr(cs.params.get(p)) if cs else None for p in marker.args))


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (runs on the device machine)")
    skip_slow = pytest.mark.skip(reason="slow; set TKIT_SLOW=1")
    shard = _toolchain_shard()
    units: dict[tuple, int] = {}
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
            continue
        if "slow" in item.keywords and os.environ.get("TKIT_SLOW") != "1":
            item.add_marker(skip_slow)
            continue
        marker = item.get_closest_marker("toolchain")
        if shard is not None and marker is not None:
            # units dealt round-robin in collection order: every run collects the same
            # toolchain tests, so the n shares together run each unit exactly once
            unit = units.setdefault(_toolchain_unit(item, marker), len(units))
            if unit % shard[1] != shard[0]:
                item.add_marker(pytest.mark.skip(
                    reason=f"toolchain test: runs in share {unit % shard[1]} of "
                           f"TKIT_TOOLCHAIN_SHARD (this run has {shard[0]}/{shard[1]})"))


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def full_checks(monkeypatch):
    """TKIT_CHECK=1 for one test: the values of index tensors on the device (lengths, tables,
    slots, positions, per-row options) are read and checked too, as host tensors always are."""
    from tkit import _env

    monkeypatch.setattr(_env, "CHECK", True)
