"""SASS identity of the reductions family's default builds, for refactors.

    python tests/ir_tools/reductions_sass.py record  FILE   # hashes of every default build
    python tests/ir_tools/reductions_sass.py check   FILE   # the same builds, compared

Every reductions op (softmax, log_softmax, rms_norm, rms_norm_residual, layer_norm) on each of
its bench and check cases is captured on meta tensors (no GPU, TRITON_INTERPRET unset) and
every launched kernel is compiled for sm_90a with tkit.ir; the SASS (cuobjdump, from the
Triton wheel) is hashed per (op, case, kernel). Forwards with saved statistics and the
backwards are captured too, from the family's internal entry points. The SM count is taken as
the H200's (132) so that the grid-dependent choices are the GPU's.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

SMS = 132


def _entries():
    try:
        from tkit.kernels.reductions import config as D
        from tkit.kernels.reductions import ops as O
        try:
            from tkit.kernels import _device
            _device.sm_count = lambda device: SMS  # noqa: E731
        except ImportError:
            D.sm_count = lambda device, default: SMS  # noqa: E731
        return (O._norm_fwd_impl, O._norm_bwd_impl, O._softmax_fwd_impl, O._softmax_bwd_impl)
    except ImportError:
        from tkit.kernels import norm as N
        from tkit.kernels import softmax as S
        N._sm_count = S._sm_count = lambda device: SMS  # noqa: E731
        return N._norm_fwd_impl, N._norm_bwd_impl, S._softmax_fwd_impl, S._softmax_bwd_impl


def _builds():
    """(op, case, callable) for every default build."""
    from tkit import registry
    from tkit.ir_tools.aot import _make_meta

    norm_fwd, norm_bwd, sm_fwd, sm_bwd = _entries()
    out = []
    for spec in registry.all_specs():
        if spec.family != "reductions":
            continue
        for case in list(spec.bench_cases()) + list(spec.check_cases()):
            args, kwargs = _make_meta(case)
            out.append((spec.name, case.label, lambda f=spec.fn, a=args, k=kwargs: f(*a, **k)))
            x = args[0]
            if spec.name in ("softmax", "log_softmax"):
                log = spec.name == "log_softmax"
                dim = kwargs.get("dim", -1) % x.ndim
                out.append((spec.name + ".bwd", case.label,
                            lambda x=x, d=dim, lg=log: sm_bwd(x, torch.empty_like(x), d, lg)))
                continue
            if spec.name == "rms_norm":
                xx, r, w, b, rms = args[0], None, args[1], None, True
            elif spec.name == "rms_norm_residual":
                xx, r, w, b, rms = args[0], args[1], args[2], None, True
            else:
                xx, r, w, b, rms = args[0], None, args[1], args[2], False
            out.append((spec.name + ".fwd_stats", case.label,
                        lambda xx=xx, r=r, w=w, b=b, rms=rms:
                        norm_fwd(xx, w, b, r, 1e-6, rms, True)))
            for fs in (True, False):
                def bwd(xx=xx, r=r, w=w, b=b, rms=rms, fs=fs):
                    M = xx.numel() // xx.shape[-1]
                    stats = torch.empty((M, 2), dtype=torch.float32, device=xx.device) \
                        if fs else None
                    h = torch.empty(xx.shape, dtype=xx.dtype, device=xx.device)
                    norm_bwd(h, w, torch.empty_like(h), r, 1e-6, rms, b is not None, stats)
                out.append((spec.name + (".bwd_stats" if fs else ".bwd"), case.label, bwd))
    return out


def hashes() -> dict:
    from tkit.ir_tools.aot import compile_launch, unwrap
    from tkit.kernels import _common

    cache, result = {}, {}
    for op, label, fn in _builds():
        with _common.capture_launches() as launches:
            fn()
        for i, lc in enumerate(list(launches)):
            name = unwrap(lc.kernel)[2].fn.__name__
            ir = compile_launch(lc.kernel, dict(lc.kwargs), 90)
            key = (name, ir.signature.key() if hasattr(ir.signature, "key") else None)
            sass = ir.sass()
            h = hashlib.sha256(sass.encode()).hexdigest()[:16]
            cache[key] = h
            result[f"{op} | {label} | {i}:{name}"] = h
            print(f"{op} | {label} | {i}:{name} {h}", flush=True)
    return result


def main(argv):
    mode, path = argv[1], argv[2]
    now = hashes()
    if mode == "record":
        with open(path, "w") as f:
            json.dump(now, f, indent=1, sort_keys=True)
        print(f"{len(now)} builds, {len(set(now.values()))} distinct SASS -> {path}")
        return 0
    with open(path) as f:
        before = json.load(f)
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


if __name__ == "__main__":
    sys.exit(main(sys.argv))
