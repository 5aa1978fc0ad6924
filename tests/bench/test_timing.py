"""time_fn's kernel timer: the runs found in the device records, and its arguments."""

import pytest
import torch

from tkit import cli
from tkit.bench import timing

LEAD = ["spin_kernel", "Memset (Device)", "reduce_kernel"]


def _records(calls):
    """Device records (start us, end us, name) of runs that open with LEAD (each record
    10 us long, 1 us apart) and go on with the names in ``calls[i]``; each run's own span."""
    events, spans, t = [], [], 0.0
    for names in calls:
        for name in LEAD:
            events.append((t, t + 10.0, name))
            t += 11.0
        first = t
        for name in names:
            events.append((t, t + 10.0, name))
            t += 11.0
        spans.append((t - 1.0 - first) / 1e3)
    return events, spans


def test_each_run_spans_its_own_records_whatever_their_names():
    # a call may launch kernels named as the flush's, or a spin of its own
    calls = [["a"], ["reduce_kernel", "b"], ["spin_kernel", "c", "Memset (Device)"]]
    events, spans = _records(calls)
    got = timing.run_spans(events, LEAD, len(calls))
    assert got == pytest.approx(spans)
    assert got[1] == pytest.approx(0.021) and got[2] == pytest.approx(0.032)


def test_records_that_do_not_split_into_the_runs_raise():
    events, _ = _records([["a"], ["b"]])
    with pytest.raises(RuntimeError, match="found 2 runs"):
        timing.run_spans(events, LEAD, 3)
    events, _ = _records([["a"], []])  # a run with nothing of its own on the device
    with pytest.raises(RuntimeError, match="no device record"):
        timing.run_spans(events, LEAD, 2)
    with pytest.raises(RuntimeError, match="left no device records"):
        timing.run_spans(events, [], 2)


def test_time_fn_names_a_bad_timer_before_touching_a_device():
    with pytest.raises(ValueError, match="timer='cupti' must be one of"):
        timing.time_fn(lambda: None, timer="cupti")
    with pytest.raises(ValueError, match="cuda_graph"):
        timing.time_fn(lambda: None, timer="kernels", cuda_graph=True)


def test_cli_takes_the_timer():
    args = cli.build_parser().parse_args(["bench", "add", "--timer", "kernels"])
    assert args.timer == "kernels"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "add", "--timer", "cupti"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_time_of_a_call_lies_inside_its_event_time():
    x = torch.randn(1 << 22, device="cuda")
    y = torch.empty_like(x)

    def two_kernels():  # a copy and a fill: the span holds both and the gap between them
        y.copy_(x * 2)
        y.add_(1)

    ev = timing.time_fn(two_kernels, rep_ms=20)
    kn = timing.time_fn(two_kernels, rep_ms=20, timer="kernels")
    assert 0 < kn.median_ms <= ev.median_ms
    assert kn.p20_ms <= kn.median_ms <= kn.p80_ms
