"""Where the Llama-3-8B layer's time goes (issue #14): each step of ``tkit.specs.model``'s layer
timed alone, tkit's op beside torch's, and the whole layer eager and replayed from a CUDA graph.

    python benchmarks/layer_breakdown.py [TOKENS ...]     # default 512; rows to $OUT

Steps are timed with ``tkit.bench.timing.time_fn`` replaying a CUDA graph of the step with the
L2 flushed (the kernels' time: a step of a few microseconds would otherwise time the host's
call), the two providers interleaved; the whole layer also as a back-to-back eager burst
(wall clock: the host's calls overlap the GPU's work as in a model's forward) and as a graph
replay (the GPU's time without the host), for tkit and torch eager and for each under
torch.compile (fullgraph; tkit's ops stay opaque custom ops in the compiled graph). The gap
between the eager burst and the graph replay is the host's share; each burst also gives the
host CPU time a call.

    python benchmarks/layer_breakdown.py --layer-only 512 4096   # the whole-layer rows only
Output: a table on stdout and long-form rows in ``$OUT/layer-breakdown.jsonl``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tkit  # noqa: E402
from tkit.bench.runner import environment  # noqa: E402
from tkit.bench.timing import time_fn  # noqa: E402
from tkit.specs import model as M  # noqa: E402

OUT = Path(os.environ.get("OUT", "out"))


def steps(x, w_in, w_qkv, w_o, w_post, w_gu, w_down, *, heads, kv_heads, eps=M.EPS):
    """step -> (tkit call, torch call), on intermediate tensors computed once."""
    t, d, mlp = M._dims(x, w_qkv, w_down, heads, kv_heads)
    hidden = x.shape[1]
    n1 = F.rms_norm(x, (hidden,), w_in, eps)
    qkv = F.linear(n1, w_qkv)
    q = qkv[:, :heads * d].view(1, t, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(1, t, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(1, t, kv_heads, d)
    qt, kt, vt = (z.transpose(1, 2) for z in (q, k, v))
    o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True,
                                       enable_gqa=heads != kv_heads).transpose(1, 2)
    o2 = o.reshape(t, heads * d)
    h = x + F.linear(o2, w_o)
    n2 = F.rms_norm(h, (hidden,), w_post, eps)
    gu = F.linear(n2, w_gu)
    act = F.silu(gu[:, :mlp]) * gu[:, mlp:]
    return {
        "rms_norm": (lambda: tkit.rms_norm(x, w_in, eps),
                     lambda: F.rms_norm(x, (hidden,), w_in, eps)),
        "qkv proj": (lambda: tkit.matmul(n1, w_qkv.t()), lambda: F.linear(n1, w_qkv)),
        "attention": (lambda: tkit.flash_attention(q, k, v, causal=True),
                      lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True,
                                                             enable_gqa=heads != kv_heads)),
        "o proj + residual": (lambda: tkit.matmul(o2, w_o.t(), residual=x),
                              lambda: x + F.linear(o2, w_o)),
        "gate_up + silu_mul": (lambda: tkit.matmul_glu(n2, w_gu.t()),
                               lambda: _torch_glu(n2, w_gu, mlp)),
        "down proj + residual": (lambda: tkit.matmul(act, w_down.t(), residual=h),
                                 lambda: h + F.linear(act, w_down)),
    }


def _torch_glu(x, w_gu, mlp):
    gu = F.linear(x, w_gu)
    return F.silu(gu[:, :mlp]) * gu[:, mlp:]


#: rounds of the whole-layer bursts (each provider once in each position of the order)
ROUNDS = 4


def burst_ms(fn, calls=50, rounds=7, host=None):
    """Wall clock of back-to-back calls, per call: the median of ``rounds`` bursts. ``host``:
    a list that gets the median host CPU time a call (thread time to enqueue the burst)."""
    fn()
    torch.cuda.synchronize()
    ts, cpu = [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            fn()
        c1 = time.thread_time()  # before the sync, which spins
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) / calls * 1e3)
        cpu.append((c1 - c0) / calls * 1e3)
    if host is not None:
        host.append(sorted(cpu)[len(cpu) // 2])
    return sorted(ts)[len(ts) // 2]


def measure(tokens, rows, layer_only=False):
    args, kw = M._make(tokens, M.LLAMA3_8B, torch.bfloat16)("cuda")
    if not layer_only:
        measure_steps(tokens, args, kw, rows)
    compiled = {name: torch.compile(fn, dynamic=False, fullgraph=True)
                for name, fn in (("tkit+compile", M.llama_layer),
                                 ("torch.compile", M.ref_llama_layer))}
    layer = {"tkit": lambda: M.llama_layer(*args, **kw),
             "torch": lambda: M.ref_llama_layer(*args, **kw),
             "tkit+compile": lambda: compiled["tkit+compile"](*args, **kw),
             "torch.compile": lambda: compiled["torch.compile"](*args, **kw)}
    for fn in layer.values():
        fn()  # compiles
    eager_out, compiled_out = layer["tkit"](), layer["tkit+compile"]()
    diff = (compiled_out.float() - eager_out.float()).abs().max().item()
    print(f"{tokens:5d} tkit+compile against tkit eager: max abs difference {diff:.3g}")
    bursts = {prov: [] for prov in layer}
    host = {prov: [] for prov in layer}
    names = list(layer)
    for r in range(ROUNDS):
        # providers interleaved, the order rotated each round so that each runs once in each
        # position (a provider timed right after another's burst of a 4096-token layer meets
        # a warmer GPU); the median of the rounds
        for prov in names[r % len(names):] + names[:r % len(names)]:
            bursts[prov].append(burst_ms(layer[prov], host=host[prov]))
    got = {}
    for prov, fn in layer.items():
        eager = statistics.median(bursts[prov])
        graph = time_fn(fn, cuda_graph=True).median_ms
        cpu = statistics.median(host[prov])
        got[prov] = eager
        rows += [dict(tokens=tokens, step="layer eager burst", provider=prov, median_ms=eager),
                 dict(tokens=tokens, step="layer graph replay", provider=prov,
                      median_ms=graph),
                 dict(tokens=tokens, step="layer host CPU", provider=prov, median_ms=cpu)]
        print(f"{tokens:5d} layer {prov:20s} burst {eager * 1e3:8.1f} us  graph "
              f"replay {graph * 1e3:8.1f} us  host CPU {cpu * 1e3:7.1f} us a call")
    print(f"{tokens:5d} burst time ratios: tkit / torch {got['tkit'] / got['torch']:.3f}, "
          f"tkit / torch.compile {got['tkit'] / got['torch.compile']:.3f}, "
          f"tkit+compile / tkit {got['tkit+compile'] / got['tkit']:.3f}")


def measure_steps(tokens, args, kw, rows):
    total = {"tkit": 0.0, "torch": 0.0}
    for name, (tk, tt) in steps(*args, **kw).items():
        got = {}
        for _ in range(2):
            for prov, fn in (("tkit", tk), ("torch", tt)):
                t = time_fn(fn, replay=True).median_ms
                got[prov] = min(got.get(prov, t), t)
        for prov in got:
            total[prov] += got[prov]
            rows.append(dict(tokens=tokens, step=name, provider=prov, median_ms=got[prov]))
        print(f"{tokens:5d} {name:22s} tkit {got['tkit'] * 1e3:8.1f} us  torch "
              f"{got['torch'] * 1e3:8.1f} us  {got['torch'] / got['tkit']:5.2f}x")
    print(f"{tokens:5d} {'sum of steps':22s} tkit {total['tkit'] * 1e3:8.1f} us  torch "
          f"{total['torch'] * 1e3:8.1f} us")


def main(argv):
    env = environment()
    rows = []
    layer_only = "--layer-only" in argv
    argv = [a for a in argv if a != "--layer-only"]
    with torch.no_grad():
        for tokens in [int(a) for a in argv] or [512]:
            measure(tokens, rows, layer_only)
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "layer-breakdown.jsonl", "a") as f:
        for r in rows:
            f.write(json.dumps({**r, **env}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
