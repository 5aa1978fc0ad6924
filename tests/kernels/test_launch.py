"""The launch layer (tkit.kernels._launch, _tuning): the specialization key against Triton's own,
the cached-kernel path with a stand-in compiled kernel, config choice without timing, the
tuning cache on disk. The GPU half (every op against Triton's path, CUDA-graph capture) is
tests/kernels/test_launch_gpu.py."""

import json
import subprocess
import sys
import threading

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from triton.runtime.jit import JITFunction, native_specialize_impl

from tkit import _env
from tkit.kernels import _common as C
from tkit.kernels import _launch, _tuning

try:
    from triton.backends.compiler import BaseBackend
except ImportError:  # pragma: no cover
    BaseBackend = None


def _py_kernel(x_ptr, y_ptr, n, stride, scale, flag, OUT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs * stride, tl.load(x_ptr + offs) * scale, mask=offs < n)


# a real JITFunction even under TRITON_INTERPRET (triton.jit would give an interpreted one)
KERNEL = JITFunction(_py_kernel)
NON_CONST = ("x_ptr", "y_ptr", "n", "stride", "scale", "flag")


class FakeCompiled(_launch.CompiledKernel):
    """A compiled kernel that records its launches instead of making them."""

    run = None

    def __init__(self, tag):
        self.module = None  # Triton 3.9's __del__ unloads a module when one is set
        self.function = object()
        self.packed_metadata = ("meta", tag)
        self.tag = tag
        self.launches = []
        self.run = self._run

    def _run(self, *args):
        self.launches.append(args)


@pytest.fixture
def fast(monkeypatch):
    """The fast path switched on with a stand-in driver; JITFunction.run compiles nothing and
    returns a new FakeCompiled (recorded in the yielded list)."""
    made = []

    def fake_run(self, *args, grid, warmup, **kwargs):
        ck = FakeCompiled(len(made))
        made.append((ck, kwargs))
        return ck

    monkeypatch.setattr(_launch, "_enabled", True)
    monkeypatch.setattr(_launch, "_device_stream", lambda: (0, 1234))
    monkeypatch.setattr(JITFunction, "run", fake_run)
    monkeypatch.setattr(_launch, "_hooks_active", lambda: False)
    _launch.clear()
    yield made
    monkeypatch.undo()  # first: the clear below recomputes the plans' switch from these
    _launch.clear()


def _args(x, y, n=100, stride=1, scale=2.0, flag=True, OUT="a", BLOCK=64, **extra):
    return dict(x_ptr=x, y_ptr=y, n=n, stride=stride, scale=scale, flag=flag, OUT=OUT,
                BLOCK=BLOCK, **extra)


def _key(**kw):
    st_ = _launch._state(KERNEL)
    return st_.bind(dict(kw), 0)[0]


# --------------------------------------------------------------------------------------------
# the specialization key
# --------------------------------------------------------------------------------------------
INTS = st.one_of(st.sampled_from([0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 1, 2**31,
                                  2**31 + 16, -2**31, -2**31 - 1, 2**63 - 1, 2**63, 2**64 - 16]),
                 st.integers(-2**65, 2**65).filter(lambda v: -2**63 <= v < 2**64))


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int32]))
    base = torch.empty(64, dtype=dtype)
    return base[draw(st.integers(0, 15)):]


@pytest.mark.skipif(BaseBackend is None, reason="triton.backends.compiler.BaseBackend missing")
@settings(max_examples=400)
@given(st.lists(st.one_of(tensors(), INTS, st.floats(allow_nan=False), st.booleans(),
                          st.none()), min_size=2, max_size=2))
def test_key_is_never_coarser_than_triton(values):
    """Two argument values with the same key must get the same Triton specialization: else a
    binary compiled for one runs on the other."""
    a, b = values
    ka = _key(**_args(a, a))[1]
    kb = _key(**_args(b, b))[1]

    def triton_spec(v):
        return native_specialize_impl(BaseBackend, v, False, True, True)

    if ka == kb:
        assert triton_spec(a) == triton_spec(b), (a, b)


def test_key_separates_what_triton_specializes():
    base = torch.empty(64, dtype=torch.float16)
    k = lambda **kw: _key(**_args(base, base, **kw))  # noqa: E731
    # pointer alignment: element offset 8 is 16 bytes, 1..7 are not
    assert _key(**_args(base[8:], base)) == _key(**_args(base, base))
    assert _key(**_args(base[1:], base)) != _key(**_args(base, base))
    assert _key(**_args(base.float(), base)) != _key(**_args(base, base))  # dtype
    assert k(n=1) != k(n=2)  # == 1 becomes a constant
    assert k(n=16) != k(n=17)  # divisibility by 16
    assert k(n=32) == k(n=48) and k(n=17) == k(n=19)
    assert k(n=2**31 - 16) != k(n=2**31)  # i32 / i64
    assert k(n=2**63 - 16) != k(n=2**63)  # i64 / u64
    assert k(scale=1.0) == k(scale=3.5)  # floats are not specialized
    assert k(flag=True) == k(flag=False)
    assert k(OUT="a") != k(OUT="b") and k(BLOCK=64) != k(BLOCK=128)  # constexprs by value
    assert k(OUT=True) != k(OUT=1) != k(OUT=1.0) != k(OUT=True)  # and by type
    assert k(num_warps=4) != k(num_warps=8) and k() != k(num_warps=4)


# --------------------------------------------------------------------------------------------
# the cached-kernel path
# --------------------------------------------------------------------------------------------
def test_fast_path_reuses_and_respecializes(fast):
    x = torch.empty(256, dtype=torch.float16)
    y = torch.empty(256, dtype=torch.float16)
    grid = lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]),)  # noqa: E731
    _launch.run(KERNEL, grid, _args(x, y, n=100, stride=5))
    assert len(fast) == 1 and not fast[0][0].launches  # the miss went through JITFunction.run
    _launch.run(KERNEL, grid, _args(x, y, n=200, stride=3))
    ck = fast[0][0]
    assert len(fast) == 1 and len(ck.launches) == 1
    grid0, grid1, grid2, stream, function, meta, lm, enter, exit_, *args = ck.launches[0]
    assert (grid0, grid1, grid2, stream) == (4, 1, 1, 1234)
    assert function is ck.function and meta == ck.packed_metadata
    assert (lm, enter, exit_) == (None, None, None)
    # every parameter, in signature order, constexprs included (as Triton passes them)
    assert args == [x, y, 200, 3, 2.0, True, "a", 64]
    # an unaligned pointer, n == 1, another dtype, other warps: each a new compile
    _launch.run(KERNEL, (1,), _args(x[1:], y, stride=5))
    _launch.run(KERNEL, (1,), _args(x, y, n=1, stride=5))
    _launch.run(KERNEL, (1,), _args(x.float(), y, stride=5))
    _launch.run(KERNEL, (1,), _args(x, y, stride=5, num_warps=8))
    _launch.run(KERNEL, (1,), _args(x, y, stride=1))  # stride 1 is a constant too
    assert len(fast) == 6
    # hits the num_warps=8 one (x[8:] is 16 bytes further, still aligned)
    _launch.run(KERNEL, (2, 3), _args(x[8:], y, n=7, stride=9, num_warps=8))
    assert len(fast) == 6 and fast[4][0].launches[-1][:3] == (2, 3, 1)


def test_unusual_arguments_take_tritons_path(fast, monkeypatch):
    x = torch.empty(64)
    calls = []
    monkeypatch.setattr(JITFunction, "__getitem__",
                        lambda self, grid: lambda **kw: calls.append(kw))
    _launch.run(KERNEL, (1,), _args(x, x, stride=(1, 2)))  # a tuple argument
    _launch.run(KERNEL, (1,), _args(x, x, not_an_option=1))  # unknown keyword: Triton raises
    _launch.run(KERNEL, (1,), dict(x_ptr=x))  # a missing argument: Triton raises
    assert len(calls) == 3 and not fast


def test_hooks_send_calls_through_triton(fast, monkeypatch):
    x = torch.empty(64)
    _launch.run(KERNEL, (1,), _args(x, x))
    monkeypatch.setattr(_launch, "_hooks_active", lambda: True)
    _launch.run(KERNEL, (1,), _args(x, x))
    assert len(fast) == 2 and not fast[0][0].launches


def test_hooks_active_on_this_triton():
    # Triton's launch hooks are HookChains (never None) with nothing attached by default
    assert _launch._hooks_active() is False


def test_capture_records_the_original_kernel(fast):
    at = triton.autotune([triton.Config({"BLOCK": 32}), triton.Config({"BLOCK": 64})],
                         key=["n"])(KERNEL)
    x = torch.empty(64)
    with C.capture_launches() as launches:
        C.launch(at, (1,), **{k: v for k, v in _args(x, x).items() if k != "BLOCK"})
    assert len(launches) == 1 and launches[0].kernel is at and "BLOCK" not in launches[0].kwargs
    assert not fast


# --------------------------------------------------------------------------------------------
# config choice without timing
# --------------------------------------------------------------------------------------------
CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((64, 4), (128, 4), (128, 8))]


def _prune_small(configs, named_args, **kwargs):
    n = {**named_args, **kwargs}["n"]
    return [c for c in configs if c.kwargs["BLOCK"] <= max(64, n)]


@pytest.fixture
def tuning_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(_env, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(_tuning, "SHIPPED_DIR", tmp_path / "shipped")
    monkeypatch.setattr(_env, "NO_AUTOTUNE", False)
    monkeypatch.setattr(_env, "AUTOTUNE", False)
    _tuning._tables.clear()
    _tuning._memo.clear()
    _tuning._recorded.clear()
    yield tmp_path
    _tuning._tables.clear()
    _tuning._memo.clear()
    _tuning._recorded.clear()


def _autotuner(prune=None):
    return triton.autotune(CONFIGS, key=["n"],
                           prune_configs_by={"early_config_prune": prune} if prune else None)(
        KERNEL)


def _tune_args(n=1000):
    x = torch.empty(64, dtype=torch.float16)
    return {k: v for k, v in _args(x, x, n=n).items() if k != "BLOCK"}


def test_default_is_first_config_the_pruner_keeps(tuning_dir):
    at = _autotuner()
    assert _tuning.choose(at, _tune_args()) == (CONFIGS[0], "default")
    pruned = _autotuner(lambda configs, named, **kw: configs[1:])
    assert _tuning.choose(pruned, _tune_args())[0] is CONFIGS[1]


def test_tables_serve_only_configs_the_pruner_keeps(tuning_dir):
    at = _autotuner(_prune_small)
    args = _tune_args(1000)
    name, bucket = _tuning.kernel_name(at), _tuning.bucket_key(at, args)
    shipped = _tuning.shipped_path()
    _tuning.write_entry(shipped, name, "other-source", bucket, _tuning.config_dict(CONFIGS[2]))
    _tuning._tables.clear()
    assert _tuning.choose(at, args) == (CONFIGS[2], "table")  # shipped: source hash ignored
    # the disk cache wins over the table, but only for the same kernel source
    disk = _tuning.disk_cache_path()
    _tuning.write_entry(disk, name, "stale", bucket, _tuning.config_dict(CONFIGS[1]))
    assert _tuning.choose(at, args) == (CONFIGS[2], "table")
    _tuning.write_entry(disk, name, _tuning.source_hash(at), bucket,
                        _tuning.config_dict(CONFIGS[1]))
    assert _tuning.choose(at, args) == (CONFIGS[1], "cache")
    # a bucket where the pruner drops the tuned config: the default, not the table's
    small = _tune_args(70)
    _tuning.write_entry(disk, name, _tuning.source_hash(at), _tuning.bucket_key(at, small),
                        _tuning.config_dict(CONFIGS[1]))
    assert _tuning.bucket_key(at, small) != bucket
    assert _tuning.choose(at, _tune_args(40)) == (CONFIGS[0], "default")
    # a config that is no longer on the list at all
    _tuning.write_entry(disk, name, _tuning.source_hash(at), bucket, {"BLOCK": 4096,
                                                                    "num_warps": 4})
    assert _tuning.choose(at, args) == (CONFIGS[2], "table")


def test_no_autotune_ignores_tables(tuning_dir, monkeypatch):
    at = _autotuner()
    args = _tune_args()
    _tuning.write_entry(_tuning.shipped_path(), _tuning.kernel_name(at), "x",
                        _tuning.bucket_key(at, args), _tuning.config_dict(CONFIGS[2]))
    monkeypatch.setattr(_env, "NO_AUTOTUNE", True)
    assert _tuning.choose(at, args) == (CONFIGS[0], "default")


def test_buckets():
    at = _autotuner()
    b = lambda n: _tuning.bucket_key(at, _tune_args(n))  # noqa: E731
    assert b(3000) == b(4096) != b(4097) == b(8192)
    assert b(1) != b(2) and b(63) != b(62)


def test_resolve_applies_config_and_heuristics(tuning_dir):
    heur = triton.heuristics({"flag": lambda a: a["n"] % a["BLOCK"] == 0})(KERNEL)
    at = triton.autotune(CONFIGS, key=["n"])(heur)
    kw = _tune_args(1024)
    del kw["flag"]
    fn, out = _launch.resolve(at, kw)
    assert fn is KERNEL and out["BLOCK"] == 64 and out["num_warps"] == 4 and out["flag"] is True


def test_autotune_mode_records_the_winner(tuning_dir, monkeypatch):
    at = _autotuner()
    monkeypatch.setattr(_env, "AUTOTUNE", True)
    args = _tune_args()

    def fake_getitem(self, grid):
        def call(**kw):
            self.best_config = CONFIGS[2]
            self.configs_timings = {CONFIGS[2]: [0.01]}
        return call

    monkeypatch.setattr(type(at), "__getitem__", fake_getitem)
    _launch.run(at, (1,), dict(args))
    data = json.loads(_tuning.disk_cache_path().read_text())
    entry = data["kernels"][_tuning.kernel_name(at)]
    assert entry["src"] == _tuning.source_hash(at)
    got = entry["configs"][_tuning.bucket_key(at, args)]
    assert got["BLOCK"] == 128 and got["num_warps"] == 8 and got["_measured"] == {"ms": 0.01}
    monkeypatch.setattr(_env, "AUTOTUNE", False)
    _tuning._memo.clear()
    assert _tuning.choose(at, args) == (CONFIGS[2], "cache")


def test_concurrent_writers_leave_a_whole_file(tuning_dir):
    path = tuning_dir / "t.json"
    threads = [threading.Thread(target=lambda i=i: [
        _tuning.write_entry(path, f"k{i}", "s", f"b{j}", {"BLOCK": j}) for j in range(10)])
        for i in range(4)]
    for t in threads:
        t.start()
    # two other processes at the same time
    code = ("import sys; from pathlib import Path; from tkit.kernels import _tuning as T\n"
            "for j in range(10): T.write_entry(Path(sys.argv[1]), 'p' + sys.argv[2], 's', "
            "f'b{j}', {'BLOCK': j})")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path), str(i)]) for i in range(2)]
    for t in threads:
        t.join()
    assert all(p.wait(timeout=120) == 0 for p in procs)
    data = json.loads(path.read_text())
    assert set(data["kernels"]) == {"k0", "k1", "k2", "k3", "p0", "p1"}
    assert all(len(v["configs"]) == 10 for v in data["kernels"].values())
    assert not list(tuning_dir.glob("*.tmp"))


def test_clear_disk_cache(tuning_dir):
    _tuning.write_entry(_tuning.disk_cache_path(), "k", "s", "b", {"BLOCK": 1})
    assert _tuning.cache_dir().exists()
    _tuning.clear_disk_cache()
    assert not _tuning.cache_dir().exists()


def test_memo_separates_what_a_pruner_reads(tuning_dir):
    """The pruner's answer is memoized: inputs it answers differently for (unit inner stride,
    alignment, dtype) must not share an entry."""

    def needs_unit_stride(configs, named, **kw):
        x = {**named, **kw}["x_ptr"]
        ok = x.stride(-1) == 1 and x.data_ptr() % 16 == 0
        return configs[2:] if ok else configs[:1]

    at = _autotuner(needs_unit_stride)
    base = torch.empty(4096, dtype=torch.float16)

    def pick(x):
        kw = _tune_args()
        kw["x_ptr"] = x
        return _tuning.config_for(at, kw)

    assert pick(base.view(256, 16)) is CONFIGS[2]
    assert pick(base.view(16, 256)[:, ::17]) is CONFIGS[0]  # inner stride 17: 17 % 16 == 1
    assert pick(base[1:].view(-1)[:16]) is CONFIGS[0]  # unaligned
    assert pick(base.view(256, 16)) is CONFIGS[2]


@given(st.lists(st.tuples(st.sampled_from([0, 1, 2, 3, 1000, 2**16, 2**20]),
                          st.sampled_from([0, 1, 7, 2**10, 2**20, 2**31])), max_size=4),
       st.sampled_from([0, 5, 2**30, 2**31 - 10]))
def test_needs_int64_bound_agrees_with_the_span(dims, offset):
    shape = [d for d, _ in dims]
    stride = [s for _, s in dims]
    numel = 1
    for d in shape:
        numel *= d
    assume(numel < 2**62)  # torch refuses a shape whose element count overflows int64
    t = torch.empty_strided(shape, stride, device="meta").as_strided(shape, stride, offset)
    assert C.needs_int64(t) == C.span_needs_int64(shape, stride, offset)


def test_choice_is_recorded_where_triton_keeps_it(tuning_dir):
    """tkit.ir compiles "the tuned config" from the autotuner's cache: the launched one."""
    at = _autotuner(lambda configs, named, **kw: configs[1:])
    args = _tune_args()
    _tuning.config_for(at, args)
    assert at.best_config is CONFIGS[1]
    assert list(at.cache.values()) == [CONFIGS[1]]
    key = next(iter(at.cache))
    assert key[0] == args["n"] and "torch.float16" in key


def test_tensor_descriptor_keys():
    """Host tensor descriptors (the Gluon Hopper attention passes them): same key only where
    Triton's specialization is the same."""
    gluon = pytest.importorskip("triton.experimental.gluon")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GTD
    from triton.tools.tensor_descriptor import TensorDescriptor

    gl = gluon.language
    t = torch.empty(64, 128, dtype=torch.bfloat16)
    lay = gl.NVMMASharedLayout.get_default_for([16, 128], gl.bfloat16)
    lay32 = gl.NVMMASharedLayout.get_default_for([32, 128], gl.bfloat16)
    descs = [GTD.from_tensor(t, [16, 128], lay), GTD.from_tensor(t[16:], [16, 128], lay),
             GTD.from_tensor(t, [32, 128], lay32), GTD.from_tensor(t.half(), [16, 128], lay),
             TensorDescriptor.from_tensor(t, [16, 128]),
             TensorDescriptor.from_tensor(t, [32, 128])]
    for a in descs:
        for b in descs:
            ka, kb = _key(**_args(a, a))[1], _key(**_args(b, b))[1]
            if ka == kb:
                assert (native_specialize_impl(BaseBackend, a, False, True, True)
                        == native_specialize_impl(BaseBackend, b, False, True, True))
    assert len({_key(**_args(d, d)) for d in descs}) == 5  # t and t[16:] share one
