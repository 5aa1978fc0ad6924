"""SASS identity of a kernel family's default builds, for refactors (issue #19).

    python tests/ir_tools/sass_identity.py record FAMILY [FILE]   # hashes of every default build
    python tests/ir_tools/sass_identity.py check  FAMILY [FILE]   # the same builds, compared

FAMILY is one of: matmul, attention, attention_bwd, decode, rope, quant, sampling,
elementwise ("all" runs each in turn). FILE defaults to ``sass_baseline_<FAMILY>.json`` next
to this script.

Every op of the family is called on each of its registry bench and check cases, captured on
meta tensors (no GPU, TRITON_INTERPRET unset), and every launched kernel is compiled for sm_90a
with tkit.ir; the SASS (cuobjdump from the Triton wheel) is hashed per (op, case, kernel).
The attention family adds the Gluon Hopper forward (which needs a CUDA tensor to be chosen at
run time): each of its default ``AttentionConfig().hopper_fwd_cases`` (``HOPPER_FWD_CASES`` on
older trees) in bf16 and fp16, at its default config, compiled
ahead of time by ``compile_sm90``. Meta tensors plan as an sm_90 with the H200's 132 SMs.
attention_bwd launches flash_attention's backward (delta, dK/dV, dQ kernels) on the inputs
of each flash_attention case, from the family's internal ``_bwd_impl``.
The reductions family has its own script (reductions_sass.py), which also covers backwards.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

#: family -> the registry ops it covers
FAMILIES = {
    "matmul": ("matmul", "matmul_fp8", "grouped_matmul", "matmul_int4"),
    "attention": ("flash_attention", "flash_attention_varlen"),
    "attention_bwd": ("flash_attention",),
    "decode": ("decode_attention", "append_kv", "merge_attention_states"),
    "rope": ("rope", "rope_append_kv"),
    "quant": ("quantize_fp8", "quantize_int8", "rms_norm_quant", "silu_mul_quant"),
    "sampling": ("sample", "speculative_accept"),
    "elementwise": ("add", "sub", "mul", "residual_add", "silu", "gelu", "gelu_tanh", "relu",
                    "silu_mul", "gelu_mul", "cast"),
}


def _hopper_module():
    try:
        from tkit.kernels.attention import hopper as H  # the package layout
    except ImportError:
        from tkit.kernels import attention_hopper as H  # the flat layout
    try:
        from tkit.kernels.attention.config import AttentionConfig
        cases = AttentionConfig().hopper_fwd_cases
    except ImportError:  # older trees: a module global
        try:
            from tkit.kernels.attention.config import HOPPER_FWD_CASES as cases
        except ImportError:
            from tkit.kernels.attention import HOPPER_FWD_CASES as cases
    return H, cases


def _sass_of_cubin(cubin: bytes) -> str:
    from tkit.ir_tools.aot import _bin, _run_tool

    fd, path = tempfile.mkstemp(suffix=".cubin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        return _run_tool([_bin("cuobjdump"), "-sass", path])
    finally:
        os.unlink(path)


def _h(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _attention_bwd():
    try:
        from tkit.kernels.attention.ops import _bwd_impl  # the package layout
    except ImportError:
        from tkit.kernels.attention import _bwd_impl  # the flat layout

    def run(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
            **_):
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        wl, wr = (int(w) for w in window_size)
        b, sq, hq = q.shape[:3]
        out = torch.empty_like(q)
        lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
        _bwd_impl(torch.empty_like(q), q, k, v, out, lse, None, None, None, sq, k.shape[1],
                  bool(causal), float(scale), wl, wr, float(softcap))
    return run


def hashes(family: str, only: str | None = None) -> dict:
    from tkit import registry
    from tkit.ir_tools.aot import _make_meta, compile_launch, unwrap
    from tkit.kernels import _common

    ops = FAMILIES[family]
    bwd = _attention_bwd() if family == "attention_bwd" else None
    result = {}
    for spec in registry.all_specs():
        if spec.name not in ops or (only and spec.name != only):
            continue
        fn = bwd or spec.fn
        cases = [("bench", c) for c in spec.bench_cases()] + \
                [("check", c) for c in spec.check_cases()]
        for kind, case in cases:
            with _common.capture_launches() as launches:
                # a case that builds its inputs with tkit ops (matmul_int4 quantizes its
                # weight) is made while capturing; those launches are not the op's
                try:
                    args, kwargs = _make_meta(case)
                except Exception as e:  # noqa: BLE001
                    key = f"{spec.name} | {kind}: {case.label} | no meta inputs"
                    result[key] = type(e).__name__
                    print(key, result[key], flush=True)
                    continue
                n0 = len(launches)
                fn(*args, **kwargs)
            for i, lc in enumerate(list(launches)[n0:]):
                name = unwrap(lc.kernel)[2].fn.__name__
                ir = compile_launch(lc.kernel, dict(lc.kwargs), 90)
                key = f"{spec.name} | {kind}: {case.label} | {i}:{name}"
                result[key] = _h(ir.sass())
                print(key, result[key], flush=True)
    if family == "attention" and not only:
        H, cases = _hopper_module()
        for d, causal in sorted(cases):
            for dtype in (torch.bfloat16, torch.float16):
                k = H.compile_sm90(head_dim=d, causal=causal, dtype=dtype)
                key = f"gluon hopper fwd | D={d} causal={causal} {dtype} | default config"
                result[key] = _h(_sass_of_cubin(k.asm["cubin"]))
                print(key, result[key], flush=True)
    return result


def _compare(before: dict, now: dict) -> int:
    missing = sorted(set(before) - set(now))
    extra = sorted(set(now) - set(before))
    differ = sorted(k for k in set(before) & set(now) if before[k] != now[k])
    for k in missing:
        print("MISSING", k)
    for k in extra:
        print("EXTRA  ", k)
    for k in differ:
        print("DIFFERS", k, before[k], now[k])
    same = len(set(before) & set(now)) - len(differ)
    print(f"{same} of {len(before)} builds identical; {len(differ)} differ, {len(missing)} "
          f"missing, {len(extra)} new")
    return 1 if (missing or differ or extra) else 0


def main(argv):
    mode, family = argv[1], argv[2]
    families = list(FAMILIES) if family == "all" else [family]
    rc = 0
    for fam in families:
        path = argv[3] if len(argv) > 3 and family != "all" else \
            os.path.join(HERE, f"sass_baseline_{fam}.json")
        now = hashes(fam)
        if mode == "record":
            with open(path, "w") as f:
                json.dump(now, f, indent=1, sort_keys=True)
            print(f"{fam}: {len(now)} builds, {len(set(now.values()))} distinct SASS -> {path}")
            continue
        with open(path) as f:
            before = json.load(f)
        print(f"{fam}: ", end="")
        rc |= _compare(before, now)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv))
