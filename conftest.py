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
