"""The reference rule of tkit.testing.compare, which reads all its counts and maxima in one
transfer: the same verdicts and messages as the rule states."""

from __future__ import annotations

import pytest
import torch

from tkit.testing import ReferenceMismatch, assert_close_to_reference, eps


def test_within_the_bound_and_the_errors_it_reports():
    ref = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    peer = (ref + 1e-3).float()
    out = (ref + 1.5e-3).float()
    got = assert_close_to_reference(out, ref, peer)
    assert got["error"] == pytest.approx(1.5e-3, rel=1e-3)
    assert got["peer_error"] == pytest.approx(1e-3, rel=1e-3)
    assert got["bound"] == pytest.approx(2e-3 + eps(torch.float32) * 3.0, rel=1e-3)


def test_past_the_bound_names_the_worst_element():
    ref = torch.zeros(2, 3, dtype=torch.float64)
    out = torch.zeros(2, 3)
    out[1, 2] = 0.5
    with pytest.raises(ReferenceMismatch, match=r"worst at \(1, 2\): got 0.5"):
        assert_close_to_reference(out, ref, ref.float())


def test_nan_where_the_reference_is_finite():
    ref = torch.ones(4, dtype=torch.float64)
    out = torch.ones(4)
    out[2] = float("nan")
    with pytest.raises(ReferenceMismatch, match=r"1 non-finite values .*first at \[2\]"):
        assert_close_to_reference(out, ref, ref.float())


def test_non_finite_pattern_and_empty_and_exact_outputs():
    ref = torch.tensor([float("inf"), 1.0, float("nan")], dtype=torch.float64)
    assert_close_to_reference(ref.float(), ref, ref.float())  # same pattern: passes
    with pytest.raises(ReferenceMismatch, match="inf/NaN pattern"):
        assert_close_to_reference(torch.tensor([-float("inf"), 1.0, float("nan")]), ref)
    empty = torch.empty(0, 5)
    assert assert_close_to_reference(empty, empty.double())["error"] == 0.0
    ids = torch.tensor([3, 1, 4])
    assert_close_to_reference(ids, ids.double())  # no peer: the floor alone, exact here
    with pytest.raises(ReferenceMismatch):
        assert_close_to_reference(torch.tensor([3, 1, 5]), ids.double())
    with pytest.raises(ReferenceMismatch, match="shape"):
        assert_close_to_reference(ids[:2], ids.double())


def test_a_non_finite_peer_widens_or_breaks_the_bound_as_before():
    ref = torch.tensor([1.0, 2.0], dtype=torch.float64)
    out = torch.tensor([1.5, 2.0])
    assert_close_to_reference(out, ref, torch.tensor([float("inf"), 2.0]))
    with pytest.raises(ReferenceMismatch):
        assert_close_to_reference(out, ref, torch.tensor([float("nan"), 2.0]))


def test_ulps_widen_the_float32_floor_only():
    ref = torch.tensor([1.0], dtype=torch.float64)
    out = torch.tensor([1.0 + 3 * 2.0**-23])  # 3 units off, no peer
    with pytest.raises(ReferenceMismatch):
        assert_close_to_reference(out, ref)
    assert_close_to_reference(out, ref, ulps=4)
    half = torch.tensor([1.0 + 2 * 2.0**-10], dtype=torch.float16)
    with pytest.raises(ReferenceMismatch):
        assert_close_to_reference(half, ref, ulps=4)  # one unit for low precision
