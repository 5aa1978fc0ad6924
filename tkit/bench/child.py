"""The child process of ``tkit bench``: ``python -m tkit.bench.child OPTIONS IDS``.

OPTIONS is the JSON of :func:`tkit.bench.runner.bench_case`'s keyword arguments plus the
parent's ``ceilings`` and ``warm`` (first calls only, untimed: :func:`tkit.bench.runner.warm_case`);
IDS are comma-separated case ids (``op/index`` into the op's bench cases).
Each case is answered on stdout in :mod:`tkit.bench.isolate`'s protocol, its rows as the OK
line's payload; after an error that poisons the CUDA context the child stops, and the parent
starts a new one on the cases left.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str] | None = None, specs=None) -> None:
    """``specs``: the specs to look ids up in (default: the registry)."""
    from tkit import registry
    from tkit.bench import runner
    from tkit.bench.ceilings import Ceilings
    from tkit.bench.isolate import child_loop

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit("usage: python -m tkit.bench.child OPTIONS_JSON CASE_IDS")
    opts = json.loads(argv[0])
    ceil = opts.pop("ceilings", None)
    warm = opts.pop("warm", False)
    ceilings = Ceilings(**ceil) if ceil else None
    lookup = {s.name: s for s in (specs if specs is not None else registry.all_specs())}
    env = runner.environment()
    cache: dict = {}

    def run_case(case_id: str):
        name, index = case_id.rsplit("/", 1)
        spec = lookup[name]
        case = spec.bench_cases()[int(index)]
        if warm:
            return runner.warm_case(spec, case, cache, **opts)
        return runner.bench_case(spec, case, ceilings, env, cache, **opts)

    child_loop(argv[1].split(","), run_case)


if __name__ == "__main__":
    main()
