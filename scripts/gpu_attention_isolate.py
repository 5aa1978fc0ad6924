"""Run every forward/backward attention config at odd head dims in child processes, so a
launch that leaves a sticky CUDA error (e.g. a misaligned address) is pinned to one config
instead of failing everything after it. Prints one line per job.

    python scripts/gpu_attention_isolate.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def jobs():
    sys.path.insert(0, str(ROOT))
    from tkit.kernels import attention as A
    out = []
    for d in (192, 256, 80, 112, 96):
        for causal in (False, True):
            for c in A._fwd_configs():
                cfg = dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
                out.append(("fwd", d, causal, cfg))
            out.append(("bwd-default", d, causal, None))
    return out


def child(start: int) -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    from tkit.kernels import _common as C
    from tkit.kernels import attention as A
    for i, (kind, d, causal, cfg) in enumerate(jobs()):
        if i < start:
            continue
        g = torch.Generator(device="cuda").manual_seed(i)
        q, k, v = (torch.randn(2, 300, 4, d, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(3))
        try:
            if kind == "fwd":
                out, _ = A._fwd_impl(q, k, v, None, None, 300, 300, causal, d ** -0.5, -1, -1,
                                     0.0, config=cfg)
                ref = torch.nn.functional.scaled_dot_product_attention(
                    *(t.transpose(1, 2).float() for t in (q, k, v)), is_causal=causal)
                err = (out.float() - ref.transpose(1, 2)).abs().max().item()
            else:
                C._env.NO_AUTOTUNE = True
                qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
                import tkit
                tkit.flash_attention(qq, kk, vv, causal=causal).sum().backward()
                torch.cuda.synchronize()
                err = max(t.grad.float().abs().max().item() for t in (qq, kk, vv))
            torch.cuda.synchronize()
            print("RESULT " + json.dumps(dict(i=i, kind=kind, d=d, causal=causal, cfg=cfg,
                                              ok=True, err=err)), flush=True)
        except Exception as e:
            print("RESULT " + json.dumps(dict(i=i, kind=kind, d=d, causal=causal, cfg=cfg,
                                              ok=False, error=f"{type(e).__name__}: "
                                              f"{str(e).splitlines()[0][:160]}")), flush=True)
            if "CUDA error" in str(e) or "AcceleratorError" in type(e).__name__:
                sys.exit(3)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(int(sys.argv[2]))
        return
    n = len(jobs())
    start, results = 0, {}
    while start < n:
        p = subprocess.run([sys.executable, __file__, "--child", str(start)],
                           capture_output=True, text=True, timeout=300)
        for line in p.stdout.splitlines():
            if line.startswith("RESULT "):
                r = json.loads(line[7:])
                results[r["i"]] = r
                print(line[7:], flush=True)
        done = [i for i in results if i >= start]
        start = (max(done) + 1) if done else start + 1
        if p.returncode not in (0, 3) and start < n and (start - 1) not in results:
            print(f"child died at job {start - 1}: {p.stderr[-300:]}", flush=True)
    bad = [r for r in results.values() if not r["ok"]]
    print(f"{len(results)} jobs, {len(bad)} failed")


if __name__ == "__main__":
    main()
