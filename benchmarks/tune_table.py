"""Measure and write the shipped tuning table for this GPU (tkit/kernels/tuned/<device>.json).

Runs every autotuned tkit kernel at representative sizes with TKIT_AUTOTUNE=1, so Triton's
autotuner times each config list once per size bucket; each winner lands in a tuning cache
under $OUT (not the user's ~/.cache), which is then copied to $OUT/tuned/<device>.json in the
format ``tkit.kernels._tuning`` reads. Commit that file as tkit/kernels/tuned/<device>.json:
processes on that device then serve those configs without timing anything.

    python benchmarks/tune_table.py [--quick]        # $OUT/tuned/<device>.json, a summary

Kernels covered: the elementwise flat kernel (size classes from decode to 256 MiB), the
attention forward (decode, prefill at head dims 64/128/256, causal or not) and the Triton
backward (where it serves: the Gluon backward of sm_90 has fixed configs). The
GEMMs take the fixed configs of ``matmul.TmaConfig``/``PtrConfig.for_shape`` and are not run
here (under TKIT_AUTOTUNE=1 they would be tuned per M, N, K).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

OUT = Path(os.environ.get("OUT", "out"))
os.environ["TKIT_AUTOTUNE"] = "1"
os.environ["TKIT_CACHE_DIR"] = str(OUT / "tune-cache")
os.environ.pop("TKIT_NO_AUTOTUNE", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import tkit  # noqa: E402
from tkit.bench.runner import environment  # noqa: E402
from tkit.kernels import _tuning  # noqa: E402


def cases(quick: bool):
    bf = torch.bfloat16
    dev = "cuda"
    sizes = [4096, 14336, 1 << 16, 1 << 20, 1 << 24, 1 << 27]
    if quick:
        sizes = [4096, 1 << 20]
    for n in sizes:
        a, b = torch.randn(n, device=dev, dtype=bf), torch.randn(n, device=dev, dtype=bf)
        yield f"add {n}", lambda a=a, b=b: tkit.add(a, b)
        yield f"silu_mul {n}", lambda a=a, b=b: tkit.silu_mul(a, b)
        yield f"cast fp8 {n}", lambda a=a: tkit.cast(a, torch.float8_e4m3fn)
    shapes = [  # (B, Sq, Sk, Hq, Hkv, D, causal)
        (1, 1, 4096, 32, 8, 128, False), (32, 1, 8192, 32, 8, 128, False),
        (4, 4096, 4096, 16, 16, 128, False), (4, 4096, 4096, 16, 16, 128, True),
        (4, 4096, 4096, 32, 32, 64, True), (4, 4096, 4096, 16, 16, 256, True),
        (1, 512, 512, 32, 8, 128, True),
    ]
    if quick:
        shapes = shapes[:1] + shapes[3:4]
    for B, sq, sk, hq, hk, d, causal in shapes:
        q = torch.randn(B, sq, hq, d, device=dev, dtype=bf)
        k = torch.randn(B, sk, hk, d, device=dev, dtype=bf)
        v = torch.randn(B, sk, hk, d, device=dev, dtype=bf)
        yield (f"attention fwd B{B} {sq}x{sk} H{hq}/{hk} D{d} causal={causal}",
               lambda q=q, k=k, v=v, c=causal: tkit.flash_attention(q, k, v, causal=c))
    # the Triton backward (its tuning key holds the lengths, head dim and mask, not the
    # heads), forced where sm_90 takes the Gluon backward: the cases it serves on sm_90 (D=64
    # non-causal, D=256) and, for other GPUs and layouts TMA cannot read (and for a fair
    # comparison with the Gluon kernels), D=128 either way and D=64 causal
    from tkit.kernels.attention import attention_config

    bwd_cases = ((128, True), (64, False), (256, True), (128, False), (64, True))
    for d, causal in bwd_cases[:1 if quick else len(bwd_cases)]:
        q, k, v = (torch.randn(4, 4096, 16, d, device=dev, dtype=bf, requires_grad=True)
                   for _ in range(3))

        def bwd(q=q, k=k, v=v, causal=causal):
            with attention_config(hopper_bwd_cases=frozenset()):
                tkit.flash_attention(q, k, v, causal=causal).sum().backward()

        yield f"attention fwd+bwd (Triton backward) B4 4096 H16 D{d} causal={causal}", bwd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="two sizes of each kind")
    args = ap.parse_args()
    env = environment()
    print(f"{env['device']}, torch {env['torch']}, triton {env['triton']}, git {env['git_sha']}",
          flush=True)
    for name, fn in cases(args.quick):
        t0 = time.time()
        try:
            fn()
            torch.cuda.synchronize()
            print(f"tuned {name:50s} {time.time() - t0:6.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - one failing case must not lose the others
            print(f"FAILED {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    src = _tuning.disk_cache_path()
    dst = OUT / "tuned" / f"{_tuning.device_slug()}.json"
    dst.parent.mkdir(parents=True, exist_ok=True)
    if not src.exists():
        print(f"no tuning cache was written ({src}): nothing was autotuned")
        return 1
    data = json.loads(src.read_text())
    data["measured"] = {k: env.get(k) for k in ("device", "date", "git_sha", "torch", "triton")}
    dst.write_text(json.dumps(data, indent=1))
    for kname, entry in data.get("kernels", {}).items():
        print(f"\n{kname}")
        for bucket, cfg in sorted(entry.get("configs", {}).items()):
            print(f"  {bucket}: {cfg}")
    print(f"\nwrote {dst}; commit it as tkit/kernels/tuned/{dst.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
