"""Shared test settings for tests/ and tutorials/: hypothesis profiles, the gpu marker, the
interpreter switch."""

import os

import pytest
import torch

# Without a GPU, run kernels in Triton's interpreter. This must happen before any kernel module
# is imported (triton.jit reads it at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402


def _patch_language_once_per_launch() -> bool:
    """Triton's interpreter patches triton.language (``_patch_lang``: every builtin of
    ``tl``, ``tl.math`` and ``tl.tensor``, found by ``inspect.getmembers``) at each launch,
    and again at every call of a ``@triton.jit`` helper inside the kernel, although the
    launch's patches are still in place; the helper's patches are never restored. In kernels
    built from helpers (sampling's search, attention's blocks) that re-patching was about 40%
    of the interpreter's time. Here a call made while a launch's patches are active, from a
    module whose language modules that launch patched, patches nothing: the kernel sees the
    same interpreted builtins. Every other call (a launch; a helper whose module reaches
    ``triton.language.core`` where the kernel's does not) runs Triton's own. Returns whether
    it is installed (False: this Triton has no such function, nothing changed)."""
    import inspect

    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    patch = getattr(interp, "_patch_lang", None)
    scope_cls = getattr(interp, "_LangPatchScope", None)
    if patch is None or scope_cls is None or not hasattr(scope_cls, "restore"):
        return False
    if getattr(patch, "tkit_once_per_launch", False):
        return True
    patched: set[int] = set()  # the language modules patched since the running launch began

    def langs(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values()
                if inspect.ismodule(v) and (v is tl or v is tl.core)}

    def patch_lang(fn):
        want = langs(fn)
        if patched:  # a helper called inside a launch
            if want <= patched:
                return scope_cls()  # its modules are patched until the launch ends
            patched.update(want)  # Triton's patches of a helper are never restored
            return patch_lang.triton_patch_lang(fn)
        scope = patch_lang.triton_patch_lang(fn)
        restore = scope.restore
        patched.update(want)

        def restore_and_forget():
            patched.clear()
            restore()

        scope.restore = restore_and_forget
        return scope

    patch_lang.tkit_once_per_launch = True
    patch_lang.triton_patch_lang = patch
    interp._patch_lang = patch_lang
    return True


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_language_once_per_launch()

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
