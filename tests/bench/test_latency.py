"""tkit.bench.latency on CPU: the row format and the table (timings need a GPU; here the
interpreter runs the kernels and synchronize is a no-op)."""

import torch

import tkit
from tkit.bench import latency


def test_rows_and_table(monkeypatch):
    def small_cases(device="cpu", dtype=torch.float32):
        r = lambda *s: torch.randn(*s, dtype=dtype)  # noqa: E731
        return [latency.LatencyCase("add", "elementwise", "(1, 64)", lambda: (r(1, 64), r(1, 64)),
                                    tkit.add, torch.add),
                latency.LatencyCase("softmax", "softmax", "(1, 64)", lambda: (r(1, 64),),
                                    tkit.softmax, lambda x: torch.softmax(x, -1))]

    monkeypatch.setattr(latency, "decode_cases", small_cases)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    rows = latency.run(calls=3, rounds=2, compile=False, graphs=False, log=lambda s: None)
    assert [(r["op"], r["provider"]) for r in rows] == [
        ("add", "tkit"), ("add", "torch"), ("softmax", "tkit"), ("softmax", "torch")]
    for r in rows:
        assert r["ok"] and r["group"] == "latency" and r["bound"] == "host"
        assert 0 < r["p20_ms"] <= r["median_ms"] <= r["p80_ms"]
    text = latency.table(rows)
    assert "| add | (1, 64) |" in text and "tkit us" in text
