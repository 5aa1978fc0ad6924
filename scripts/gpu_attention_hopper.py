"""The Gluon sm_90 attention forward (tkit/kernels/attention_hopper.py) on the H200: every config
checked against the float64 reference at several shapes, then timed beside tkit's Triton
forward and SDPA's flash and cuDNN backends. About three minutes.

    python scripts/gpu_attention_hopper.py          # OUT=./out by default
    python scripts/gpu_attention_hopper.py --dry    # CPU plumbing check (a reference stands in
                                                    # for the kernels; numbers mean nothing)

    # a short run (about 2.5 minutes): three configs, D=128 only
    HOPPER_ATTN_CONFIGS="128,3;128,3,ws;64,4,ws" HOPPER_ATTN_DIMS=128 \
        python scripts/gpu_attention_hopper.py

Environment: HOPPER_ATTN_CONFIGS restricts the Gluon configs to a ';'-separated list of
"BLOCK_N,STAGES" or "BLOCK_N,STAGES,ws" (the warp-specialized kernel), kept in that order where
they fit the head dim; HOPPER_ATTN_DIMS restricts the head dims (comma-separated, of 128 and
64); HOPPER_ATTN_BUDGET_S (230) and HOPPER_ATTN_STEP_TIMEOUT_S (90) bound the run and a step.

Phases, each in child processes so that a launch leaving a sticky CUDA error (a fault) costs
only its own step: the parent restarts a child from the step after the one that died.

  check  per head dim (128, 64) and config of ``attention_hopper.configs`` (with and without
         warp specialization): seqlen 1, 65, 1000 (causal and not), seqlen_q != seqlen_k both
         ways (causal), GQA 16/4 and MQA 8/1, fp16 and bf16, outputs NaN-poisoned, judged by
         tkit's reference rule (kernel error <= 2x PyTorch's same-precision error + one
         rounding unit). A config that fails anywhere is left out of the timings.
  time   B=4 H=16 S=4096 bf16, D=128 and D=64, causal and not, 3 interleaved rounds: every
         config that passed, tkit's Triton forward (its two best measured configs, through
         ``attention._fwd_impl``), SDPA flash and cuDNN. ``triton.testing.do_bench`` medians
         (L2 flushed between runs); FLOPs 4*B*H*Sq*Sk*D, half when causal.

Every step appends one row to $OUT/attention_hopper.jsonl and rewrites
$OUT/attention_hopper.json (all rows so far plus a summary), so a run cut short keeps what it
measured. The summary table (median over rounds) is printed at the end with the total time.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DRY = "--dry" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"
OUT = Path(os.environ.get("OUT", "out"))
JSONL = OUT / "attention_hopper.jsonl"
JSON = OUT / "attention_hopper.json"
T0 = time.time()
ROUNDS = 3
STEP_TIMEOUT_S = float(os.environ.get("HOPPER_ATTN_STEP_TIMEOUT_S", 90))
BENCH_SHAPE = dict(b=4, s=4096, h=16)
TARGETS = {(128, False): 485, (128, True): 425}
# tkit's Triton forward at its two best measured tiles (attention.py's _FWD_TILES notes):
# 128x64 s3 w8 pointer loads (non-causal), 64x64 s3 w4 through TMA (causal)
TRITON_CONFIGS = {
    "triton 128x64 s3 w8": dict(BLOCK_M=128, BLOCK_N=64, num_stages=3, num_warps=8,
                                USE_TMA=False, WARP_SPEC=True),
    "triton 64x64 s3 w4 tma": dict(BLOCK_M=64, BLOCK_N=64, num_stages=3, num_warps=4,
                                   USE_TMA=True, WARP_SPEC=False),
}
# (name, batch, seqlen_q, seqlen_k, heads_q, heads_kv, causal, dtype); each config compiles
# once per (dtype, causal) (the kernel does not specialize on its integer arguments), so fp16,
# the same code with another element type, is checked on the first config of each kernel (with
# and without warp specialization) of a head dim only
CHECK_SHAPES = [
    ("s1", 2, 1, 1, 4, 2, False, "bf16"),
    ("s65 causal", 2, 65, 65, 4, 2, True, "bf16"),
    ("s1000", 1, 1000, 1000, 4, 2, False, "bf16"),
    ("s1000 causal", 1, 1000, 1000, 4, 2, True, "bf16"),
    ("q100 k300 causal", 2, 100, 300, 4, 4, True, "bf16"),
    ("q300 k100 causal", 2, 300, 100, 4, 4, True, "bf16"),
    ("gqa 16/4 s333", 1, 333, 333, 16, 4, False, "bf16"),
    ("mqa 8/1 s257 causal", 1, 257, 257, 8, 1, True, "bf16"),
    ("s777 causal fp16", 1, 777, 777, 4, 2, True, "fp16"),
    ("q50 k400 fp16", 1, 50, 400, 4, 2, False, "fp16"),
]
FIRST_CONFIG_ONLY = ("fp16",)


# --------------------------------------------------------------------------------------------
# Rows and files
# --------------------------------------------------------------------------------------------
def read_rows() -> list[dict]:
    if not JSONL.exists():
        return []
    rows = []
    for line in JSONL.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a dying process
            pass
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Median TFLOP/s over rounds per (head dim, causal, provider)."""
    by = {}
    for r in rows:
        if r.get("phase") == "time" and r.get("tflops"):
            by.setdefault((r["d"], r["causal"], r["provider"]), []).append(r)
    out = []
    for (d, causal, provider), rs in sorted(by.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        tf = sorted(x["tflops"] for x in rs)
        ms = sorted(x["median_ms"] for x in rs)
        out.append(dict(d=d, causal=causal, provider=provider, rounds=len(rs),
                        tflops=tf[len(tf) // 2], median_ms=ms[len(ms) // 2],
                        tflops_all=tf, target=TARGETS.get((d, causal))))
    return out


def _git_head() -> str:
    """The checkout's commit (git is called directly: this parent never imports tkit/torch)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:
        return "?"


def write_json() -> None:
    rows = read_rows()
    meta = dict(elapsed_s=time.time() - T0, dry=DRY,
                git_sha=os.environ.get("TKIT_GIT_SHA") or _git_head())
    try:  # versions from a child (the parent never imports torch: no CUDA context there)
        if "torch" not in sys.modules:
            raise ImportError
        import torch
        import triton

        meta.update(torch=torch.__version__, triton=triton.__version__,
                    device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    except Exception:
        pass
    tmp = JSON.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(dict(meta=meta, summary=summary(rows), rows=rows), indent=1))
    tmp.replace(JSON)


def emit(row: dict) -> None:
    row = dict(row, t=round(time.time() - T0, 2))
    with JSONL.open("a") as f:
        f.write(json.dumps(row) + "\n")
    write_json()
    brief = {k: v for k, v in row.items() if k not in ("trace",)}
    print("ROW " + json.dumps(brief), flush=True)


# --------------------------------------------------------------------------------------------
# Steps
# --------------------------------------------------------------------------------------------
def head_dims() -> list[int]:
    """HOPPER_ATTN_DIMS (e.g. "128" or "128,64"), default both."""
    text = os.environ.get("HOPPER_ATTN_DIMS", "").strip()
    if not text:
        return [128, 64]
    dims = [int(x) for x in text.replace(";", ",").split(",") if x.strip()]
    bad = [d for d in dims if d not in (128, 64)]
    if bad:
        raise SystemExit(f"HOPPER_ATTN_DIMS: head dims {bad} are not 128 or 64")
    return dims


def wanted_configs() -> list[tuple] | None:
    """HOPPER_ATTN_CONFIGS as (BLOCK_N, STAGES, WS) keys, or None for every config."""
    text = os.environ.get("HOPPER_ATTN_CONFIGS", "").strip()
    if not text:
        return None
    keys = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        fields = [f.strip().lower() for f in part.split(",")]
        try:
            bn, st = int(fields[0]), int(fields[1])
        except (IndexError, ValueError):
            raise SystemExit(f"HOPPER_ATTN_CONFIGS: {part!r} is not BLOCK_N,STAGES[,ws]") \
                from None
        if len(fields) > 3 or (len(fields) == 3 and fields[2] not in ("ws", "")):
            raise SystemExit(f"HOPPER_ATTN_CONFIGS: {part!r} is not BLOCK_N,STAGES[,ws]")
        keys.append((bn, st, len(fields) == 3 and fields[2] == "ws"))
    return keys


def selected_configs(d: int) -> list[dict]:
    """The configs of ``attention_hopper.configs(d)`` that HOPPER_ATTN_CONFIGS names, in its
    order (those that do not fit this head dim are left out, with a note)."""
    from tkit.kernels import attention_hopper as AH

    fits = AH.configs(d)
    keys = wanted_configs()
    if keys is None:
        return fits
    by_key = {AH._cfg_key(c): c for c in fits}
    missing = [k for k in keys if k not in by_key]
    if missing:
        print(f"  note: D{d}: {missing} not among the configs that fit "
              f"({sorted(by_key)}); left out", flush=True)
    return [by_key[k] for k in keys if k in by_key]


def check_steps() -> list[dict]:
    steps = []
    for d in head_dims():
        seen_kinds = set()
        for cfg in selected_configs(d):
            ws = bool(cfg.get("WS", False))
            steps.append(dict(phase="check", d=d, config=cfg, first=ws not in seen_kinds))
            seen_kinds.add(ws)
    return steps


def cfg_name(cfg: dict) -> str:
    return f"gluon n{cfg['BLOCK_N']} s{cfg['STAGES']}" + (" ws" if cfg.get("WS") else "")


def time_steps(passed: dict) -> list[dict]:
    """3 rounds; in each, every (head dim, causal) case with every provider."""
    steps = []
    for rnd in range(ROUNDS):
        for d in head_dims():
            for causal in (False, True):
                provs = [("gluon", cfg_name(c), c) for c in passed.get(d, [])]
                provs += [("triton", n, c) for n, c in TRITON_CONFIGS.items()]
                provs += [("sdpa", "sdpa_flash", None), ("sdpa", "sdpa_cudnn", None)]
                for kind, name, cfg in provs:
                    steps.append(dict(phase="time", round=rnd, d=d, causal=causal, kind=kind,
                                      provider=name, config=cfg))
    return steps


def _dtype(name):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _qkv(b, sq, sk, hq, hk, d, dtype, seed=0):
    import torch

    dev = "cpu" if DRY else "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    return (torch.randn(b, sq, hq, d, device=dev, dtype=dtype, generator=g),
            torch.randn(b, sk, hk, d, device=dev, dtype=dtype, generator=g),
            torch.randn(b, sk, hk, d, device=dev, dtype=dtype, generator=g))


def _gluon(causal, cfg):
    from tkit.kernels import attention_hopper as AH
    from tkit.specs.attention import ref_attention

    def fn(q, k, v):
        if DRY:  # the plumbing only: the reference stands in for the kernel
            return ref_attention(q.float(), k.float(), v.float(), causal=causal,
                                 return_lse=True)[0].to(q.dtype), None
        return AH.forward(q, k, v, causal=causal, config=cfg)
    return fn


def run_check(step: dict) -> None:
    from tkit.specs.attention import ref_attention
    from tkit.testing import check_against_reference

    d, cfg = step["d"], step["config"]
    for i, (name, b, sq, sk, hq, hk, causal, dt) in enumerate(CHECK_SHAPES):
        if dt in FIRST_CONFIG_ONLY and not step["first"]:
            continue
        row = dict(phase="check", d=d, config=cfg, provider=cfg_name(cfg), shape=name,
                   causal=causal, dtype=dt)
        t = time.time()
        try:
            args = _qkv(b, sq, sk, hq, hk, d, _dtype(dt), seed=i)
            fn = _gluon(causal, cfg)
            if DRY:
                def call(q, k, v, fn=fn):
                    return fn(q, k, v)[0]

                def ref(q, k, v, c=causal):
                    return ref_attention(q, k, v, causal=c)
            else:
                call = fn

                def ref(q, k, v, c=causal):
                    return ref_attention(q, k, v, causal=c, return_lse=True)
            check_against_reference(call, ref, list(args))
            row.update(ok=True)
        except Exception as e:
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}",
                       trace=traceback.format_exc()[-1500:])
            if _sticky(e):
                row.update(sticky=True)
                emit(dict(row, seconds=round(time.time() - t, 2)))
                sys.exit(3)
        emit(dict(row, seconds=round(time.time() - t, 2)))


def _sticky(e: Exception) -> bool:
    text = f"{type(e).__name__} {e}"
    return "CUDA error" in text or "AcceleratorError" in text or "illegal" in text.lower()


_CASES: dict = {}


def _case(d, causal):
    if d not in _CASES:
        sh = BENCH_SHAPE
        s = 512 if DRY else sh["s"]
        _CASES[d] = _qkv(1 if DRY else sh["b"], s, s, 2 if DRY else sh["h"],
                         2 if DRY else sh["h"], d, _dtype("bf16"), seed=123)
    return _CASES[d]


def _provider_fn(step, q, k, v):
    import torch

    causal = step["causal"]
    if step["kind"] == "gluon":
        fn = _gluon(causal, step["config"])
        return lambda: fn(q, k, v)
    if step["kind"] == "triton":
        from tkit.kernels import attention as A

        sq, sk, d = q.shape[1], k.shape[1], q.shape[-1]
        cfg = step["config"]
        if DRY:
            cfg = dict(BLOCK_M=32, BLOCK_N=32, USE_TMA=False, WARP_SPEC=False)
        return lambda: A._fwd_impl(q, k, v, None, None, sq, sk, causal, d ** -0.5, -1, -1, 0.0,
                                   config=cfg)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = (SDPBackend.FLASH_ATTENTION if step["provider"] == "sdpa_flash"
               else SDPBackend.CUDNN_ATTENTION)
    if DRY:
        backend = SDPBackend.MATH
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def run():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt,
                                                                    is_causal=causal)
    return run


def _bench(fn) -> tuple[float, float, float]:
    if DRY:
        t = time.time()
        fn()
        ms = (time.time() - t) * 1e3
        return ms, ms, ms
    import triton

    med = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    p20, p80 = triton.testing.do_bench(fn, warmup=0, rep=50, quantiles=[0.2, 0.8])
    return med, p20, p80


def run_time(step: dict) -> None:
    d, causal = step["d"], step["causal"]
    q, k, v = _case(d, causal)
    b, s, h = q.shape[0], q.shape[1], q.shape[2]
    fl = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    row = {k_: v_ for k_, v_ in step.items()}
    row.update(shape=f"B{b} S{s} H{h} D{d} bf16")
    try:
        fn = _provider_fn(step, q, k, v)
        fn()  # compile / warm up outside the timing
        med, p20, p80 = _bench(fn)
        row.update(ok=True, median_ms=med, p20_ms=p20, p80_ms=p80,
                   tflops=fl / (med * 1e-3) / 1e12)
    except Exception as e:
        row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        if _sticky(e):
            emit(dict(row, sticky=True))
            sys.exit(3)
    emit(row)


def child(phase: str, start: int, steps: list[dict]) -> None:
    if not DRY:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
    for i, step in enumerate(steps):
        if i < start:
            continue
        step = dict(step, step=i)
        if phase == "check":
            run_check(step)
        else:
            run_time(step)
        print(f"DONE {i}", flush=True)


# --------------------------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------------------------
def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def run_phase(phase: str, steps: list[dict], deadline: float) -> None:
    """Run the steps in child processes; after a child dies (or hangs: a step running over
    STEP_TIMEOUT_S, e.g. a kernel that never finishes), continue from the next step."""
    spec = OUT / f"attention_hopper_{phase}_steps.json"
    spec.write_text(json.dumps(steps))
    start = 0
    while start < len(steps) and time.time() < deadline:
        cmd = [sys.executable, __file__, "--child", phase, str(start), str(spec)]
        if DRY:
            cmd.append("--dry")
        last, tail, reason = start - 1, [], None
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=dict(os.environ, OUT=str(OUT)))
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(p.stdout, lines), daemon=True).start()
        step_t0 = time.time()
        while True:
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                line = ""
            if line is None:
                break
            if line.startswith("DONE "):
                last, step_t0 = int(line.split()[1]), time.time()
            elif line.startswith("ROW "):
                _print_row(json.loads(line[4:]))
            elif line:
                tail = (tail + [line.rstrip()])[-15:]
            if time.time() > deadline or time.time() - step_t0 > STEP_TIMEOUT_S:
                reason = "deadline" if time.time() > deadline else "step timeout (hang?)"
                p.kill()
                break
        p.wait()
        if (p.returncode != 0 or reason) and last + 1 < len(steps):
            bad = steps[last + 1]
            print(f"[{phase}] child exited {p.returncode} ({reason or 'died'}) in step "
                  f"{last + 1}; output tail:\n  " + "\n  ".join(tail[-8:]), flush=True)
            emit(dict(phase=phase, step=last + 1, ok=False, d=bad.get("d"),
                      config=bad.get("config"), provider=bad.get("provider"),
                      error=f"child exited {p.returncode} ({reason or 'died'})",
                      tail=tail[-8:]))
            start = last + 2
        else:
            start = len(steps)


def _print_row(r: dict) -> None:
    if r.get("phase") == "check":
        status = "ok" if r.get("ok") else "FAIL " + r.get("error", "")[:200]
        print(f"  check D{r['d']} {r['provider']:19s} {r['shape']:22s} {status}", flush=True)
    elif r.get("phase") == "time":
        tag = "causal" if r["causal"] else "full  "
        if r.get("ok"):
            print(f"  time r{r['round']} D{r['d']} {tag} {r['provider']:24s} "
                  f"{r['median_ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s", flush=True)
        else:
            print(f"  time r{r['round']} D{r['d']} {tag} {r['provider']:24s} FAIL "
                  f"{r.get('error', '')[:160]}", flush=True)


def main() -> None:
    if "--child" in sys.argv:
        i = sys.argv.index("--child")
        phase, start, spec = sys.argv[i + 1], int(sys.argv[i + 2]), sys.argv[i + 3]
        child(phase, start, json.loads(Path(spec).read_text()))
        return
    OUT.mkdir(parents=True, exist_ok=True)
    if JSONL.exists():
        JSONL.unlink()
    budget = float(os.environ.get("HOPPER_ATTN_BUDGET_S", 230))
    steps = check_steps()
    print(f"== check ({len(steps)} configs over head dims {head_dims()}, up to "
          f"{len(CHECK_SHAPES)} shapes each)", flush=True)
    run_phase("check", steps, T0 + 0.55 * budget)
    rows = read_rows()
    checked = [r for r in rows if r.get("phase") == "check" and r.get("config")]
    failed = {(r["d"], json.dumps(r["config"], sort_keys=True))
              for r in checked if not r.get("ok")}
    seen = {(r["d"], json.dumps(r["config"], sort_keys=True)): r["config"] for r in checked}
    passed = {}
    for (d, key), cfg in seen.items():
        if (d, key) not in failed:
            passed.setdefault(d, []).append(cfg)
    print("== configs passing every check: "
          + ", ".join(f"D{d}: {[cfg_name(c) for c in cs]}" for d, cs in passed.items()),
          flush=True)
    print(f"== time ({ROUNDS} interleaved rounds)", flush=True)
    run_phase("time", time_steps(passed), T0 + budget)
    write_json()
    print("\n== median over rounds (TFLOP/s), B=4 H=16 S=4096 bf16 (ws: warp-specialized)",
          flush=True)
    print(f"{'D':>4} {'mask':7s} {'provider':26s} {'ms':>8s} {'TFLOP/s':>8s} {'rounds':>6s}"
          f"  target", flush=True)
    for r in summary(read_rows()):
        print(f"{r['d']:>4} {'causal' if r['causal'] else 'full':7s} {r['provider']:26s} "
              f"{r['median_ms']:8.3f} {r['tflops']:8.1f} {r['rounds']:>6d}"
              + (f"  {r['target']}" if r["target"] and r["provider"].startswith("gluon")
                 else ""), flush=True)
    bad = [r for r in read_rows() if r.get("ok") is False]
    print(f"\n{len(bad)} failed steps; total {time.time() - T0:.0f} s; rows in {JSON}",
          flush=True)


if __name__ == "__main__":
    main()
