"""The CUDA hatch's per-stream workspaces (``_loader.per_stream``): one a stream, kept alive
when replaced, and never made for a stream inside a CUDA-graph capture."""

from types import SimpleNamespace

import pytest
import torch

from tkit.cuda_ext import _loader


@pytest.fixture
def streams(monkeypatch):
    """``state["stream"]`` is torch's current stream, ``state["capturing"]`` whether it is
    being captured; ``made`` lists every value ``make`` returned."""
    state = {"stream": 11, "capturing": False}
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: SimpleNamespace(cuda_stream=state["stream"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    monkeypatch.setattr(_loader, "_retired", [])
    made = []

    def make(n=4):
        def f():
            made.append(torch.zeros(n, dtype=torch.int32))
            return made[-1]
        return f

    return state, made, make


def test_one_workspace_a_stream(streams):
    state, made, make = streams
    cache, dev = {}, torch.device("cpu")
    a = _loader.per_stream(cache, dev, make())
    assert _loader.per_stream(cache, dev, make()) is a and len(made) == 1
    state["stream"] = 12
    b = _loader.per_stream(cache, dev, make())
    assert b is not a and len(made) == 2
    state["stream"] = 11
    assert _loader.per_stream(cache, dev, make()) is a


def test_a_replaced_workspace_stays_alive(streams):
    _state, made, make = streams
    cache, dev = {}, torch.device("cpu")
    small = _loader.per_stream(cache, dev, make(4), lambda v: v.numel() >= 4)
    big = _loader.per_stream(cache, dev, make(8), lambda v: v.numel() >= 8)
    assert big is not small and big.numel() == 8
    # a graph captured with the small one replays it: it must not go back to the allocator
    assert any(v is small for v in _loader._retired)
    assert _loader.per_stream(cache, dev, make(8), lambda v: v.numel() >= 8) is big


def test_a_capture_never_makes_the_streams_workspace(streams):
    state, made, make = streams
    cache, dev = {}, torch.device("cpu")
    state["capturing"] = True
    first = _loader.per_stream(cache, dev, make())
    second = _loader.per_stream(cache, dev, make())
    # each captured call gets its own (zeroed in its graph); none is kept for the stream
    assert first is not second and cache == {}
    state["capturing"] = False
    kept = _loader.per_stream(cache, dev, make())
    assert kept is not first and kept is not second and len(made) == 3
    # made before a capture, the stream's workspace serves the captured calls too
    state["capturing"] = True
    assert _loader.per_stream(cache, dev, make()) is kept and len(made) == 3
    # one too small is not replaced inside a capture (the replacement would be kept)
    assert _loader.per_stream(cache, dev, make(8), lambda v: v.numel() >= 8) is not kept
    assert cache[(dev, 11)] is kept and _loader._retired == []
