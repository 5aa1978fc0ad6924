"""Which config an autotuned kernel runs, chosen without benchmarking, and the tuning cache.

A deployed process never tunes: the first call of a new attention variant took 6-16 s when
Triton's autotuner benchmarked every config (docs/NOTES.md). For an ``Autotuner`` launch,
:func:`config_for` picks, in this order:

1. TKIT_NO_AUTOTUNE=1: the first config the kernel's own pruner keeps (no tables).
2. The tuning cache on disk, written by runs with TKIT_AUTOTUNE=1 on this machine:
   ``$TKIT_CACHE_DIR/autotune/<device>-triton<version>-torch<version>.json`` (default
   ``~/.cache/tkit/autotune/``). Entries are keyed by kernel, by the hash of the kernel's source
   and by size bucket; a changed kernel or another Triton/torch version simply misses.
   To clear it: ``rm -rf ~/.cache/tkit/autotune`` (or :func:`clear_disk_cache`).
3. The shipped table for the device, ``tkit/kernels/tuned/<device>.json`` (same format; written
   by ``benchmarks/tune_table.py`` on that device and committed).
4. The first config the kernel's pruner keeps (the heuristic on any other device).

A table entry is only served if the same config (every keyword, warps, stages) is among the
configs the kernel's pruner keeps for the current arguments, so a stale or foreign table can
cost speed, never correctness or a compile failure of a config that was taken off the list.

Size buckets: the autotune key's values are bucketed for the tables (ints below 64 exact,
larger ones by power of two: seqlen 3000 and 4096 share an entry), constexpr key values and
dtypes exactly. Within a process the choice is memoized per exact key.

TKIT_AUTOTUNE=1: calls go through Triton's autotuner (benchmarking each new key), and each
winner is merged into the disk cache with a file lock and an atomic replace, so concurrent
processes and threads never leave a torn file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
import threading
from pathlib import Path

import torch

from tkit import _env

_lock = threading.RLock()
#: id(Autotuner) -> {exact key: Config}
_memo: dict[int, dict] = {}
#: path -> parsed JSON (tables are read once a process; the disk cache again after a write)
_tables: dict[Path, dict] = {}
#: (kernel name, bucket) already recorded by this process in TKIT_AUTOTUNE mode
_recorded: set = set()
_slugs: dict[int, str] = {}

SHIPPED_DIR = Path(__file__).resolve().parent / "tuned"


# --------------------------------------------------------------------------------------------
# keys
# --------------------------------------------------------------------------------------------
def _base_fn(at):
    """The JIT function under an autotuner's wrappers (Triton's own ``base_fn`` is the plain
    Python function, which has neither the parameters nor the source text needed here)."""
    fn = at
    while hasattr(fn, "fn") and not hasattr(fn, "params"):
        fn = fn.fn
    return fn


def kernel_name(at) -> str:
    fn = _base_fn(at)
    inner = getattr(fn, "fn", fn)
    return f"{getattr(inner, '__module__', '?')}.{getattr(fn, '__name__', repr(fn))}"


def source_hash(at) -> str:
    """sha256 of the kernel's source text (not Triton's cache_key: that includes the line
    number, which any edit above the kernel moves)."""
    fn = _base_fn(at)
    src = getattr(fn, "src", None) or getattr(fn, "_src", None)
    if not src:
        import inspect

        src = inspect.getsource(getattr(fn, "fn", fn))
    return hashlib.sha256(src.encode()).hexdigest()[:16]


def _layout(v):
    if isinstance(v, torch.Tensor):  # subclasses (nn.Parameter)
        return v.dtype, v.data_ptr() % 16, v.stride()
    return None


def _make_key_fn(at):
    """Generate ``key(kw)`` for one autotuner: the autotune key's values, then for every
    tensor argument its dtype, base alignment (mod 16) and exact strides; straight-line code
    (a generic walk over the arguments cost several microseconds a call).

    This is what the choice may depend on: an early pruner may read the key, dtypes and
    layouts (the attention pruner keeps TMA configs only for TMA-able K and V, which the
    autotune key does not say), nothing else, since its answer is memoized under this key.
    Exact strides make the memo finer than needed (an entry per distinct layout); a miss
    costs one pruner call, never a timing."""
    fn = _base_fn(at)
    names = [p.name for p in getattr(fn, "params", ()) if not p.is_constexpr]
    if not names:
        return None
    keys = ", ".join(f"kw.get({k!r})" for k in at.keys)
    items = []
    lines = ["def key(kw):"]
    for i, n in enumerate(names):
        lines.append(f"    p{i} = kw.get({n!r})")
        items.append(f"((p{i}.dtype, p{i}.data_ptr() % 16, p{i}.stride()) "
                     f"if type(p{i}) is _T else None if type(p{i}) in _SCALARS else _L(p{i}))")
    lines.append(f"    return ({keys}{', ' if keys else ''}{', '.join(items)},)")
    ns = {"_T": torch.Tensor, "_L": _layout, "_SCALARS": (int, float, bool, type(None))}
    exec("\n".join(lines), ns)  # noqa: S102 - generated from the kernel's own signature
    return ns["key"]


def _generic_key(at, kwargs: dict) -> tuple:
    return tuple(kwargs.get(k) for k in at.keys) + tuple(
        _layout(v) for v in kwargs.values() if isinstance(v, torch.Tensor))


def _bucket(v):
    if type(v) is int and v >= 64:
        return f"p{(v - 1).bit_length()}"
    return v


def bucket_key(at, kwargs: dict) -> str:
    """The table key: bucketed autotune-key values and the tensor dtypes, as a string."""
    fn = _base_fn(at)
    consts = {p.name for p in getattr(fn, "params", ()) if p.is_constexpr}
    parts = []
    for k in at.keys:
        v = kwargs.get(k)
        parts.append(f"{k}={v if k in consts else _bucket(v)}")
    dts = ",".join(str(v.dtype).replace("torch.", "") for v in kwargs.values()
                   if isinstance(v, torch.Tensor))
    return "|".join(parts) + "|" + dts


def config_dict(cfg) -> dict:
    return {k: v for k, v in cfg.all_kwargs().items() if k != "ir_override"}


# --------------------------------------------------------------------------------------------
# device and files
# --------------------------------------------------------------------------------------------
def device_slug() -> str:
    """'nvidia-h200' for the current CUDA device; 'cpu' without one."""
    if _env.INTERPRET or not torch.cuda.is_available():
        return "cpu"
    idx = torch.cuda.current_device()
    slug = _slugs.get(idx)
    if slug is None:
        slug = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(idx).lower()).strip("-")
        _slugs[idx] = slug
    return slug


def _versions() -> str:
    import triton

    tv = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return f"triton{triton.__version__}-torch{tv}"


def cache_dir() -> Path:
    return _env.CACHE_DIR / "autotune"


def disk_cache_path(slug: str | None = None) -> Path:
    return cache_dir() / f"{slug or device_slug()}-{_versions()}.json"


def shipped_path(slug: str | None = None) -> Path:
    return SHIPPED_DIR / f"{slug or device_slug()}.json"


def _read(path: Path, reload: bool = False) -> dict:
    with _lock:
        if not reload and path in _tables:
            return _tables[path]
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                data = {}
        except (OSError, ValueError):
            data = {}
        _tables[path] = data
        return data


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive lock between processes (fcntl where it exists) and threads."""
    with _lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX: threads only
            yield
            return
        with open(path.with_suffix(path.suffix + ".lock"), "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)


def write_entry(path: Path, name: str, src: str, bucket: str, cfg: dict,
                extra: dict | None = None) -> None:
    """Merge one tuned config into a table file: read, update, write a temporary file in the
    same directory, ``os.replace`` it over the old one (atomic on POSIX), all under the lock."""
    with _file_lock(path):
        data = _read(path, reload=True)
        data = json.loads(json.dumps(data))  # a private copy to mutate
        data.setdefault("format", 1)
        data.setdefault("versions", _versions())
        kern = data.setdefault("kernels", {}).setdefault(name, {})
        if kern.get("src") != src:  # the kernel changed: its old entries no longer apply
            kern.clear()
            kern["src"] = src
        entry = dict(cfg)
        if extra:
            entry["_measured"] = extra
        kern.setdefault("configs", {})[bucket] = entry
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(data, fh, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _tables[path] = data


#: called after :func:`clear_disk_cache`: the eager plans (tkit.kernels._plan) hold configs
#: chosen from the cleared cache; tkit.kernels._common registers their ``clear`` (this module
#: sits below _launch and _plan, and imports neither)
_on_clear: list = []


def on_clear(fn) -> None:
    """Call ``fn()`` after every :func:`clear_disk_cache`."""
    if fn not in _on_clear:
        _on_clear.append(fn)


def clear_disk_cache() -> None:
    """Delete every tuned config cached on this machine (``$TKIT_CACHE_DIR/autotune``)."""
    import shutil

    with _lock:
        shutil.rmtree(cache_dir(), ignore_errors=True)
        _tables.clear()
        _memo.clear()
        _recorded.clear()
    for fn in _on_clear:
        fn()


# --------------------------------------------------------------------------------------------
# choice
# --------------------------------------------------------------------------------------------
def pruned_configs(at, kwargs: dict) -> list:
    """The configs the autotuner's early pruner keeps for these arguments (all when it has
    none). tkit launches with keywords only; the pruner gets them as both its named-argument
    dict and its keywords, as the attention pruners expect."""
    prune = getattr(at, "early_config_prune", None)
    if prune is None:
        return list(at.configs)
    kept = prune(at.configs, dict(kwargs), **kwargs)
    return list(kept) or list(at.configs[:1])


def _lookup(path: Path, name: str, bucket: str, src: str | None):
    kern = _read(path).get("kernels", {}).get(name)
    if not kern or (src is not None and kern.get("src") != src):
        return None
    return kern.get("configs", {}).get(bucket)


def _match(entry: dict, configs: list):
    want = {k: v for k, v in entry.items() if not k.startswith("_")}
    for cfg in configs:
        if config_dict(cfg) == want:
            return cfg
    return None


def choose(at, kwargs: dict):
    """The config for these arguments and where it came from ('table', 'cache', 'default')."""
    configs = pruned_configs(at, kwargs)
    if _env.NO_AUTOTUNE or len(configs) == 1:
        return configs[0], "default"
    name = kernel_name(at)
    bucket = bucket_key(at, kwargs)
    slug = device_slug()
    entry = _lookup(disk_cache_path(slug), name, bucket, source_hash(at))
    cfg = _match(entry, configs) if entry else None
    if cfg is not None:
        return cfg, "cache"
    entry = _lookup(shipped_path(slug), name, bucket, None)
    cfg = _match(entry, configs) if entry else None
    if cfg is not None:
        return cfg, "table"
    return configs[0], "default"


def config_for(at, kwargs: dict):
    """The config an autotuned kernel runs with these keyword arguments, without timing."""
    return _memo_entry(at, kwargs)[0]


def config_kwargs_for(at, kwargs: dict) -> dict | None:
    """:func:`config_for` as launch keywords (computed once per key), or None for a config
    with a ``pre_hook`` (only Triton's autotuner runs those)."""
    return _memo_entry(at, kwargs)[1]


#: id(Autotuner) -> its generated key function (None: the generic one)
_key_fns: dict[int, object] = {}
_MEMO_MAX = 8192


def _memo_entry(at, kwargs: dict):
    memo = _memo.get(id(at))
    if memo is None:
        with _lock:
            memo = _memo.setdefault(id(at), {})
            try:
                _key_fns[id(at)] = _make_key_fn(at)
            except Exception:  # noqa: BLE001 - a signature we cannot generate for
                _key_fns[id(at)] = None
    key_fn = _key_fns.get(id(at))
    key = key_fn(kwargs) if key_fn is not None else _generic_key(at, kwargs)
    hit = memo.get(key)
    if hit is None:
        cfg, _ = choose(at, kwargs)
        hit = (cfg, None if cfg.pre_hook is not None else cfg.all_kwargs())
        if len(memo) >= _MEMO_MAX:  # a server that sees ever new layouts: start over
            memo.clear()
        memo[key] = hit
        _tell_autotuner(at, kwargs, cfg)
    at.best_config = hit[0]
    return hit


def _tell_autotuner(at, kwargs: dict, cfg) -> None:
    """Record the choice where Triton's autotuner keeps its own (``cache`` under its key,
    ``best_config``), so that what reads the autotuner (tkit.ir compiling "the config that
    runs", scripts that report the chosen config) sees the config tkit launched."""
    try:
        names = set(at.arg_names)
        key = [kwargs[k] for k in at.keys if k in kwargs]
        key += [str(v.dtype) for k, v in kwargs.items() if k in names and hasattr(v, "dtype")]
        at.cache[tuple(key)] = cfg
    except Exception:  # noqa: BLE001 - informational only; another Triton may keep it elsewhere
        pass


def record(at, kwargs: dict) -> None:
    """After a TKIT_AUTOTUNE launch: write the autotuner's winner for this bucket to disk."""
    cfg = getattr(at, "best_config", None)
    if cfg is None or len(at.configs) <= 1:
        return
    name = kernel_name(at)
    bucket = bucket_key(at, kwargs)
    if (name, bucket) in _recorded:
        return
    _recorded.add((name, bucket))
    timings = getattr(at, "configs_timings", None) or {}
    extra = None
    if cfg in timings:
        t = timings[cfg]
        extra = {"ms": t[0] if isinstance(t, (list, tuple)) else t}
    write_entry(disk_cache_path(), name, source_hash(at), bucket, config_dict(cfg), extra)
