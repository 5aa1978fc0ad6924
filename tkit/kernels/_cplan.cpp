// Eager plans executed in C++: the allocation of a planned call's outputs and the launches of
// its compiled kernels, in one call from Python (tkit/kernels/_cplan.py builds this file and
// says why; tkit/kernels/_plan.py records what a plan launches).
//
// A Plan holds, per launch, the CUfunction, grid, block size, dynamic shared memory and the
// kernel's parameter values as Triton's launcher would pass them (one 8-byte slot each; the
// driver reads the parameter's own size from its slot), with the slots of tensor pointers
// patched per call from the call's inputs and fresh outputs. No CUDA header is needed:
// cuLaunchKernel is looked up in libcuda at first launch.

#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/GradMode.h>

#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void*, void**, void**);
using ErrorStringFn = int (*)(int, const char**);
using EncodeTiledFn = int (*)(void*, int, unsigned, void*, const uint64_t*, const uint64_t*,
                              const unsigned*, const unsigned*, int, int, int, int);

constexpr size_t kMaxParams = 128;
LaunchFn g_launch = nullptr;
ErrorStringFn g_error_string = nullptr;
EncodeTiledFn g_encode_tiled = nullptr;
// tests: launches appended to this list (as tuples) instead of reaching the driver
PyObject* g_recorder = nullptr;
// host-cost benchmarks on a machine without a GPU: launches dropped
bool g_discard = false;

bool load_driver() {
  if (g_launch) return true;
  void* h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (!h) {
    PyErr_SetString(PyExc_RuntimeError, "tkit C++ plans: cannot open libcuda.so.1");
    return false;
  }
  g_launch = reinterpret_cast<LaunchFn>(dlsym(h, "cuLaunchKernel"));
  g_error_string = reinterpret_cast<ErrorStringFn>(dlsym(h, "cuGetErrorString"));
  g_encode_tiled = reinterpret_cast<EncodeTiledFn>(dlsym(h, "cuTensorMapEncodeTiled"));
  if (!g_launch) {
    PyErr_SetString(PyExc_RuntimeError, "tkit C++ plans: no cuLaunchKernel in libcuda.so.1");
    return false;
  }
  return true;
}

// One host TMA descriptor parameter: cuTensorMapEncodeTiled's arguments but the base pointer,
// which is the call's tensor `tensor`; dimensions innermost first, as the driver takes them
struct Tma {
  alignas(128) unsigned char map[128];  // the last encoding (CUtensorMap), for `encoded_ptr`
  uint64_t encoded_ptr = 0;
  bool encoded = false;
  size_t slot;
  int tensor;
  int dtype;      // CUtensorMapDataType
  unsigned rank;
  uint64_t dims[5];
  uint64_t strides[4];  // bytes, dimensions 1..rank-1
  unsigned box[5];
  int swizzle;    // CUtensorMapSwizzle
  int fill;       // CUtensorMapFloatOOBfill
  int l2;         // CUtensorMapL2promotion
};

struct Launch {
  void* function;
  unsigned grid[3];
  unsigned threads;
  unsigned shared;
  std::vector<uint64_t> slots;                   // one 8-byte slot a parameter
  std::vector<std::pair<size_t, int>> patches;   // (slot, tensor index) per call
  std::vector<Tma> tmas;                         // descriptor parameters (their slots unused)
};

constexpr int kL2Promotion128B = 2;  // CU_TENSOR_MAP_L2_PROMOTION_L2_128B, as Triton's
constexpr int kInterleaveNone = 0;

bool encode(Tma& t, uint64_t ptr) {
  if (t.encoded && t.encoded_ptr == ptr) return true;
  if (!g_launch && !load_driver()) return false;
  if (!g_encode_tiled) {
    PyErr_SetString(PyExc_RuntimeError, "tkit C++ plans: no cuTensorMapEncodeTiled in libcuda");
    return false;
  }
  const unsigned elem_strides[5] = {1, 1, 1, 1, 1};
  t.encoded = false;
  int err = g_encode_tiled(t.map, t.dtype, t.rank, reinterpret_cast<void*>(ptr), t.dims,
                           t.strides, t.box, elem_strides, kInterleaveNone, t.swizzle,
                           t.l2, t.fill);
  if (err != 0) {
    const char* msg = nullptr;
    if (g_error_string) g_error_string(err, &msg);
    PyErr_Format(PyExc_RuntimeError,
                 "tkit C++ plan: cuTensorMapEncodeTiled failed (%d: %s) for a pointer 0x%llx",
                 err, msg ? msg : "unknown error", static_cast<unsigned long long>(ptr));
    return false;
  }
  t.encoded_ptr = ptr;
  t.encoded = true;
  return true;
}

PyObject* tma_record(const Tma& t, uint64_t ptr) {
  // tests: what would be encoded, (slot, pointer, dtype, dims, strides, box, swizzle, fill,
  // L2 promotion)
  PyObject* dims = PyTuple_New(t.rank);
  PyObject* strides = PyTuple_New(t.rank ? t.rank - 1 : 0);
  PyObject* box = PyTuple_New(t.rank);
  if (!dims || !strides || !box) {
    Py_XDECREF(dims);
    Py_XDECREF(strides);
    Py_XDECREF(box);
    return nullptr;
  }
  for (unsigned i = 0; i < t.rank; ++i) {
    PyTuple_SET_ITEM(dims, i, PyLong_FromUnsignedLongLong(t.dims[i]));
    PyTuple_SET_ITEM(box, i, PyLong_FromUnsignedLong(t.box[i]));
    if (i + 1 < t.rank) PyTuple_SET_ITEM(strides, i, PyLong_FromUnsignedLongLong(t.strides[i]));
  }
  return Py_BuildValue("(nKiNNNiii)", static_cast<Py_ssize_t>(t.slot),
                       static_cast<unsigned long long>(ptr), t.dtype, dims, strides, box,
                       t.swizzle, t.fill, t.l2);
}

struct Alloc {
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
  int device;  // -1: CPU (tests only)
  int like;    // an input with this output's shape, device and strides (empty_like of it,
               // with this dtype), or -1; -2: a scratch tensor allocated by at::zeros
};

struct PlanObject {
  PyObject_HEAD
  std::vector<Launch>* launches;
  std::vector<Alloc>* allocs;
  int n_in;
  int n_out;
  PyObject* enter;   // Triton's launch hook lists: a plan steps aside while one is attached
  PyObject* exit_;
  PyObject* stats;   // tkit's launch counters: stats["plan"] += 1 a call
  PyObject* plan_key;
  PyObject* keep;    // buffers the launches use by address (a stream's workspace), or None
  bool bound;        // the launches use `stream`'s workspace: a call on another steps aside
  unsigned long long stream;
};

void plan_dealloc(PyObject* self) {
  auto* p = reinterpret_cast<PlanObject*>(self);
  delete p->launches;
  delete p->allocs;
  Py_XDECREF(p->enter);
  Py_XDECREF(p->exit_);
  Py_XDECREF(p->stats);
  Py_XDECREF(p->plan_key);
  Py_XDECREF(p->keep);
  Py_TYPE(self)->tp_free(self);
}

bool count_call(PlanObject* p) {
  PyObject* v = PyDict_GetItemWithError(p->stats, p->plan_key);  // borrowed
  if (!v) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "plan");
    return false;
  }
  long n = PyLong_AsLong(v);
  if (n == -1 && PyErr_Occurred()) return false;
  PyObject* nv = PyLong_FromLong(n + 1);
  if (!nv) return false;
  int rc = PyDict_SetItem(p->stats, p->plan_key, nv);
  Py_DECREF(nv);
  return rc == 0;
}

bool launch_one(Launch& L, uint64_t stream, const std::vector<uint64_t>& ptrs) {
  if (static_cast<uint64_t>(L.grid[0]) * L.grid[1] * L.grid[2] == 0) return true;
  // the values live on this call's stack (the descriptors in the plan, which the GIL held
  // through the call guards; the driver copies parameters at the launch)
  uint64_t local[kMaxParams];
  void* params[kMaxParams];
  size_t n = L.slots.size();
  if (g_discard && !g_recorder) {
    for (const auto& pt : L.patches) local[pt.first] = ptrs[pt.second];  // the per-call work
    return true;
  }
  std::memcpy(local, L.slots.data(), n * sizeof(uint64_t));
  for (const auto& pt : L.patches) local[pt.first] = ptrs[pt.second];
  for (size_t i = 0; i < n; ++i) params[i] = &local[i];
  if (g_recorder) {
    PyObject* vals = PyTuple_New(static_cast<Py_ssize_t>(n));
    if (!vals) return false;
    for (size_t i = 0; i < n; ++i)
      PyTuple_SET_ITEM(vals, i, PyLong_FromUnsignedLongLong(local[i]));
    PyObject* tmas = PyTuple_New(static_cast<Py_ssize_t>(L.tmas.size()));
    if (!tmas) {
      Py_DECREF(vals);
      return false;
    }
    for (size_t k = 0; k < L.tmas.size(); ++k) {
      PyObject* r = tma_record(L.tmas[k], ptrs[L.tmas[k].tensor]);
      if (!r) {
        Py_DECREF(vals);
        Py_DECREF(tmas);
        return false;
      }
      PyTuple_SET_ITEM(tmas, k, r);
    }
    PyObject* rec = Py_BuildValue("(KIIIIIKNN)", reinterpret_cast<unsigned long long>(L.function),
                                  L.grid[0], L.grid[1], L.grid[2], L.threads, L.shared,
                                  static_cast<unsigned long long>(stream), vals, tmas);
    if (!rec) return false;
    int rc = PyList_Append(g_recorder, rec);
    Py_DECREF(rec);
    return rc == 0;
  }
  if (!g_launch && !load_driver()) return false;
  for (Tma& t : L.tmas) {
    if (!encode(t, ptrs[t.tensor])) return false;
    params[t.slot] = t.map;
  }
  int err = g_launch(L.function, L.grid[0], L.grid[1], L.grid[2], L.threads, 1, 1, L.shared,
                     reinterpret_cast<void*>(stream), params, nullptr);
  if (err != 0) {
    const char* msg = nullptr;
    if (g_error_string) g_error_string(err, &msg);
    PyErr_Format(PyExc_RuntimeError, "tkit C++ plan: cuLaunchKernel failed (%d: %s)", err,
                 msg ? msg : "unknown error");
    return false;
  }
  return true;
}

// One call of plan p on `inputs` (n_in entries, nullptr for an absent optional tensor): its
// outputs appended to `outs`. 1: served; 0: the plan steps aside for this call (a launch hook
// attached, an output that is not 16-byte aligned); -1: a Python error is set.
int run_plan_core(PlanObject* p, unsigned long long stream, const at::Tensor* const* inputs,
                  std::vector<at::Tensor>& outs) {
  if (PyList_GET_SIZE(p->enter) || PyList_GET_SIZE(p->exit_)) return 0;
  if (p->bound && stream != p->stream) return 0;
  const size_t n_alloc = p->allocs->size();
  std::vector<uint64_t> ptrs(p->n_in + n_alloc, 0);
  std::vector<at::Tensor> made;
  made.reserve(n_alloc);
  try {
    for (int i = 0; i < p->n_in; ++i)
      if (inputs[i]) ptrs[i] = reinterpret_cast<uint64_t>(inputs[i]->data_ptr());
    uint64_t misaligned = 0;
    for (size_t j = 0; j < n_alloc; ++j) {
      const Alloc& a = (*p->allocs)[j];
      if (a.like >= 0 && inputs[a.like]) {
        // the input's strides (a dense input's, kept), the allocation's dtype (a cast's)
        made.push_back(at::empty_like(*inputs[a.like], at::TensorOptions().dtype(a.dtype)));
      } else {
        auto opts = at::TensorOptions().dtype(a.dtype);
        opts = a.device >= 0 ? opts.device(at::kCUDA, static_cast<c10::DeviceIndex>(a.device))
                             : opts.device(at::kCPU);
        made.push_back(a.like == -2 ? at::zeros(a.sizes, opts) : at::empty(a.sizes, opts));
      }
      uint64_t ptr = reinterpret_cast<uint64_t>(made.back().data_ptr());
      ptrs[p->n_in + j] = ptr;
      misaligned |= ptr;
    }
    if (misaligned & 15) return 0;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return -1;
  }
  for (Launch& L : *p->launches)
    if (!launch_one(L, stream, ptrs)) return -1;
  if (!count_call(p)) return -1;
  for (int j = 0; j < p->n_out; ++j) outs.push_back(std::move(made[j]));
  return 1;
}

// The outputs of one call of plan p (one tensor or a tuple), or None where the plan steps
// aside for this call
PyObject* run_plan(PlanObject* p, unsigned long long stream, PyObject* inputs) {
  if (!PyTuple_Check(inputs) || PyTuple_GET_SIZE(inputs) != p->n_in) {
    PyErr_SetString(PyExc_TypeError, "plan: inputs must be a tuple of the plan's length");
    return nullptr;
  }
  std::vector<const at::Tensor*> ins(p->n_in, nullptr);
  for (int i = 0; i < p->n_in; ++i) {
    PyObject* o = PyTuple_GET_ITEM(inputs, i);
    if (o == Py_None) continue;
    if (!THPVariable_Check(o)) {
      PyErr_Format(PyExc_TypeError, "plan: input %d is not a tensor", i);
      return nullptr;
    }
    ins[i] = &THPVariable_Unpack(o);
  }
  std::vector<at::Tensor> made;
  int rc = run_plan_core(p, stream, ins.data(), made);
  if (rc < 0) return nullptr;
  if (rc == 0) Py_RETURN_NONE;
  if (p->n_out == 1) return THPVariable_Wrap(made[0]);
  PyObject* out = PyTuple_New(p->n_out);
  if (!out) return nullptr;
  for (int j = 0; j < p->n_out; ++j) {
    PyObject* t = THPVariable_Wrap(made[j]);
    if (!t) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, j, t);
  }
  return out;
}

PyObject* plan_call(PyObject* self, PyObject* args, PyObject* kwargs) {
  if (PyTuple_GET_SIZE(args) != 2 || kwargs) {
    PyErr_SetString(PyExc_TypeError, "plan(stream, inputs)");
    return nullptr;
  }
  unsigned long long stream = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(args, 0));
  if (stream == static_cast<unsigned long long>(-1) && PyErr_Occurred()) return nullptr;
  return run_plan(reinterpret_cast<PlanObject*>(self), stream, PyTuple_GET_ITEM(args, 1));
}

PyTypeObject PlanType = {PyVarObject_HEAD_INIT(nullptr, 0)};

bool seq_u64(PyObject* seq, std::vector<uint64_t>& out) {
  PyObject* f = PySequence_Fast(seq, "expected a sequence");
  if (!f) return false;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(f);
  for (Py_ssize_t i = 0; i < n; ++i) {
    unsigned long long v = PyLong_AsUnsignedLongLongMask(PySequence_Fast_GET_ITEM(f, i));
    if (PyErr_Occurred()) {
      Py_DECREF(f);
      return false;
    }
    out.push_back(v);
  }
  Py_DECREF(f);
  return true;
}

bool seq_fixed(PyObject* seq, size_t n, uint64_t* out) {
  PyObject* f = PySequence_Fast(seq, "expected a sequence");
  if (!f) return false;
  bool ok = static_cast<size_t>(PySequence_Fast_GET_SIZE(f)) == n;
  for (size_t i = 0; ok && i < n; ++i) {
    out[i] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(f, static_cast<Py_ssize_t>(i)));
    ok = !PyErr_Occurred();
  }
  Py_DECREF(f);
  if (!ok && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "plan: bad TMA descriptor");
  return ok;
}

bool parse_tmas(PyObject* tmas, Launch& one, int n_tensors) {
  PyObject* ft = PySequence_Fast(tmas, "tmas must be a sequence");
  if (!ft) return false;
  for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(ft); ++k) {
    Py_ssize_t slot;
    int idx, dtype, swizzle, fill, l2 = kL2Promotion128B;
    PyObject *dims, *strides, *box;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(ft, k), "niiOOOii|i", &slot, &idx, &dtype,
                          &dims, &strides, &box, &swizzle, &fill, &l2)) {
      Py_DECREF(ft);
      return false;
    }
    Py_ssize_t rank = PySequence_Size(dims);
    Tma t;
    uint64_t b[5];
    if (rank < 1 || rank > 5 || slot < 0 || static_cast<size_t>(slot) >= one.slots.size() ||
        idx < 0 || idx >= n_tensors || !seq_fixed(dims, rank, t.dims) ||
        !seq_fixed(strides, rank - 1, t.strides) || !seq_fixed(box, rank, b)) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "plan: bad TMA descriptor");
      Py_DECREF(ft);
      return false;
    }
    t.slot = static_cast<size_t>(slot);
    t.tensor = idx;
    t.dtype = dtype;
    t.rank = static_cast<unsigned>(rank);
    for (Py_ssize_t i = 0; i < rank; ++i) t.box[i] = static_cast<unsigned>(b[i]);
    t.swizzle = swizzle;
    t.fill = fill;
    t.l2 = l2;
    one.tmas.push_back(t);
  }
  Py_DECREF(ft);
  return true;
}

// Plan(launches, allocs, n_in, n_out, enter, exit, stats[, keep, stream])
//   launches: [(function, (gx, gy, gz), threads, shared, slots, ((slot, tensor index), ...),
//               ((slot, tensor index, dtype, dims, byte strides, box, swizzle, fill[, L2
//                 promotion]), ...))]
//   (the last: host TMA descriptors, dimensions innermost first; may be left out)
//   keep, stream: objects the plan holds (buffers its launches use by address), and the one
//   stream it serves (None: any)
//   allocs: [(sizes, dtype code (c10::ScalarType), device index or -1, like input or -1,
//            or -2: zeros)]
PyObject* make_plan(PyObject*, PyObject* args) {
  PyObject *launches, *allocs, *enter, *exit_, *stats, *keep = Py_None, *bound = Py_None;
  int n_in, n_out;
  if (!PyArg_ParseTuple(args, "OOiiO!O!O!|OO", &launches, &allocs, &n_in, &n_out, &PyList_Type,
                        &enter, &PyList_Type, &exit_, &PyDict_Type, &stats, &keep, &bound))
    return nullptr;
  unsigned long long bound_stream = 0;
  if (bound != Py_None) {
    bound_stream = PyLong_AsUnsignedLongLong(bound);
    if (PyErr_Occurred()) return nullptr;
  }
  auto L = std::make_unique<std::vector<Launch>>();
  auto A = std::make_unique<std::vector<Alloc>>();
  PyObject* fl = PySequence_Fast(launches, "launches must be a sequence");
  if (!fl) return nullptr;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fl); ++i) {
    PyObject *fn, *grid, *slots, *patches, *tmas = nullptr;
    unsigned threads, shared;
    unsigned long long fptr;
    Launch one;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fl, i), "OOIIOO|O", &fn, &grid, &threads,
                          &shared, &slots, &patches, &tmas)) {
      Py_DECREF(fl);
      return nullptr;
    }
    fptr = PyLong_AsUnsignedLongLong(fn);
    if (PyErr_Occurred() || !PyArg_ParseTuple(grid, "III", &one.grid[0], &one.grid[1],
                                              &one.grid[2])) {
      Py_DECREF(fl);
      return nullptr;
    }
    one.function = reinterpret_cast<void*>(fptr);
    one.threads = threads;
    one.shared = shared;
    if (!seq_u64(slots, one.slots)) {
      Py_DECREF(fl);
      return nullptr;
    }
    if (one.slots.size() > kMaxParams) {
      Py_DECREF(fl);
      PyErr_SetString(PyExc_ValueError, "plan: more than 128 kernel parameters");
      return nullptr;
    }
    PyObject* fp = PySequence_Fast(patches, "patches must be a sequence");
    if (!fp) {
      Py_DECREF(fl);
      return nullptr;
    }
    for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(fp); ++k) {
      Py_ssize_t slot;
      int idx;
      if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fp, k), "ni", &slot, &idx) || slot < 0 ||
          static_cast<size_t>(slot) >= one.slots.size() || idx < 0 ||
          idx >= n_in + static_cast<int>(PySequence_Size(allocs))) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "plan: bad patch");
        Py_DECREF(fp);
        Py_DECREF(fl);
        return nullptr;
      }
      one.patches.emplace_back(static_cast<size_t>(slot), idx);
    }
    Py_DECREF(fp);
    if (tmas && !parse_tmas(tmas, one, n_in + static_cast<int>(PySequence_Size(allocs)))) {
      Py_DECREF(fl);
      return nullptr;
    }
    L->push_back(std::move(one));
  }
  Py_DECREF(fl);
  PyObject* fa = PySequence_Fast(allocs, "allocs must be a sequence");
  if (!fa) return nullptr;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fa); ++i) {
    PyObject* sizes;
    int dtype, device, like;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fa, i), "Oiii", &sizes, &dtype, &device,
                          &like) || like >= n_in) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "plan: bad like slot");
      Py_DECREF(fa);
      return nullptr;
    }
    Alloc a;
    std::vector<uint64_t> s;
    if (!seq_u64(sizes, s)) {
      Py_DECREF(fa);
      return nullptr;
    }
    for (auto v : s) a.sizes.push_back(static_cast<int64_t>(v));
    a.dtype = static_cast<at::ScalarType>(dtype);
    a.device = device;
    a.like = like;
    A->push_back(std::move(a));
  }
  Py_DECREF(fa);
  if (n_out < 0 || n_out > static_cast<int>(A->size())) {
    PyErr_SetString(PyExc_ValueError, "plan: n_out must be 0 to the number of allocations");
    return nullptr;
  }
  auto* p = PyObject_New(PlanObject, &PlanType);
  if (!p) return nullptr;
  p->launches = L.release();
  p->allocs = A.release();
  p->n_in = n_in;
  p->n_out = n_out;
  Py_INCREF(enter);
  p->enter = enter;
  Py_INCREF(exit_);
  p->exit_ = exit_;
  Py_INCREF(stats);
  p->stats = stats;
  p->plan_key = PyUnicode_FromString("plan");
  Py_INCREF(keep);
  p->keep = keep;
  p->bound = bound != Py_None;
  p->stream = bound_stream;
  return reinterpret_cast<PyObject*>(p);
}

// ---- the signature key and the lookup of a call's plan --------------------------------------
// A call's key is (prefix, device, signature): prefix the op's options (a Python tuple),
// device the current CUDA device, signature bytes holding each input's dimensions, sizes,
// strides, dtype, device and whether its data pointer is 16-byte aligned (None: one byte).
// The current device and stream come from c10 and torch's C shim where they are found, else
// from a Python callable returning (device, stream) (tests; a torch without CUDA).
using CurrentDeviceFn = int8_t (*)();
using CurrentStreamFn = int32_t (*)(int32_t, void**);
CurrentDeviceFn g_current_device = nullptr;
CurrentStreamFn g_current_stream = nullptr;
PyObject* g_device_stream = nullptr;  // Python fallback: () -> (device, stream)

void append_tensor_sig(std::string& s, const at::Tensor& t) {
  const int64_t nd = t.dim();
  s.push_back(static_cast<char>(nd));
  s.append(reinterpret_cast<const char*>(t.sizes().data()), nd * sizeof(int64_t));
  s.append(reinterpret_cast<const char*>(t.strides().data()), nd * sizeof(int64_t));
  s.push_back(static_cast<char>(t.scalar_type()));
  s.push_back(static_cast<char>(t.device().type()));
  s.push_back(static_cast<char>(t.device().index()));
  char aligned = 2;  // no data pointer to read (a tensor without storage)
  try {
    aligned = (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) ? 0 : 1;
  } catch (const std::exception&) {
  }
  s.push_back(aligned);
}

bool append_sig(std::string& s, PyObject* o) {
  if (o == Py_None) {
    s.push_back(static_cast<char>(0xff));
    return true;
  }
  if (!THPVariable_Check(o)) {
    PyErr_SetString(PyExc_TypeError, "plan key: an input is neither a tensor nor None");
    return false;
  }
  append_tensor_sig(s, THPVariable_Unpack(o));
  return true;
}

PyObject* key_of(PyObject* prefix, long device, PyObject* inputs) {
  if (!PyTuple_Check(inputs)) {
    PyErr_SetString(PyExc_TypeError, "plan key: inputs must be a tuple");
    return nullptr;
  }
  std::string s;
  s.reserve(64 * PyTuple_GET_SIZE(inputs));
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(inputs); ++i)
    if (!append_sig(s, PyTuple_GET_ITEM(inputs, i))) return nullptr;
  PyObject* sig = PyBytes_FromStringAndSize(s.data(), static_cast<Py_ssize_t>(s.size()));
  if (!sig) return nullptr;
  PyObject* dev = PyLong_FromLong(device);
  if (!dev) {
    Py_DECREF(sig);
    return nullptr;
  }
  Py_INCREF(prefix);
  PyObject* key = PyTuple_New(3);
  if (!key) {
    Py_DECREF(sig);
    Py_DECREF(dev);
    Py_DECREF(prefix);
    return nullptr;
  }
  PyTuple_SET_ITEM(key, 0, prefix);
  PyTuple_SET_ITEM(key, 1, dev);
  PyTuple_SET_ITEM(key, 2, sig);
  return key;
}

// make_key(prefix, device, inputs) -> the key the plans of a call are stored under
PyObject* make_key(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 3) {
    PyErr_SetString(PyExc_TypeError, "make_key(prefix, device, inputs)");
    return nullptr;
  }
  long dev = PyLong_AsLong(args[1]);
  if (dev == -1 && PyErr_Occurred()) return nullptr;
  return key_of(args[0], dev, args[2]);
}

bool device_stream(long* dev, unsigned long long* stream) {
  if (g_current_device && g_current_stream) {
    *dev = g_current_device();
    void* st = nullptr;
    if (g_current_stream(static_cast<int32_t>(*dev), &st) != 0) {
      PyErr_SetString(PyExc_RuntimeError, "tkit C++ plans: no current CUDA stream");
      return false;
    }
    *stream = reinterpret_cast<unsigned long long>(st);
    return true;
  }
  if (!g_device_stream) {
    PyErr_SetString(PyExc_RuntimeError, "tkit C++ plans: no device and stream source");
    return false;
  }
  PyObject* r = PyObject_CallNoArgs(g_device_stream);
  if (!r) return false;
  bool ok = PyTuple_Check(r) && PyTuple_GET_SIZE(r) == 2;
  if (ok) {
    *dev = PyLong_AsLong(PyTuple_GET_ITEM(r, 0));
    *stream = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(r, 1));
    ok = !PyErr_Occurred();
  } else {
    PyErr_SetString(PyExc_TypeError, "device_stream() must return (device, stream)");
  }
  Py_DECREF(r);
  return ok;
}

// runs a plan found in a cache: an executor plan, or a Python plan (a launch the executor does
// not take) called as plan(stream, inputs); a new reference (None: the plan stepped aside), or
// nullptr with the error set. The plan is held for the call: a Python plan may clear the cache.
PyObject* call_plan(PyObject* plan, unsigned long long stream, PyObject* inputs) {
  PyObject* out = nullptr;
  Py_INCREF(plan);
  if (Py_TYPE(plan) == &PlanType) {
    out = run_plan(reinterpret_cast<PlanObject*>(plan), stream, inputs);
  } else {
    PyObject* st = PyLong_FromUnsignedLongLong(stream);
    if (st) {
      out = PyObject_CallFunctionObjArgs(plan, st, inputs, nullptr);
      Py_DECREF(st);
    }
  }
  Py_DECREF(plan);
  return out;
}

// the outputs of the plan cached under key where it serves the call; otherwise the list
// [key, stream] for the Python path (a miss, a plan that steps aside, key None: not looked
// up). Steals key. A key that cannot be hashed (an option held as itself) is a miss: the
// Python path names it.
PyObject* serve_key(PyObject* cache, PyObject* key, unsigned long long stream,
                    PyObject* inputs) {
  if (key != Py_None) {
    PyObject* plan = PyDict_GetItemWithError(cache, key);  // borrowed
    if (!plan && PyErr_Occurred()) {
      if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
        Py_DECREF(key);
        return nullptr;
      }
      PyErr_Clear();
    }
    if (plan && plan != Py_False) {
      PyObject* out = call_plan(plan, stream, inputs);
      if (out != Py_None) {  // the outputs, or nullptr with the error set
        Py_DECREF(key);
        return out;
      }
      Py_DECREF(out);
    }
  }
  PyObject* st = PyLong_FromUnsignedLongLong(stream);
  PyObject* miss = st ? PyList_New(2) : nullptr;
  if (!miss) {
    Py_XDECREF(st);
    Py_DECREF(key);
    return nullptr;
  }
  PyList_SET_ITEM(miss, 0, key);
  PyList_SET_ITEM(miss, 1, st);
  return miss;
}

// serve(cache, prefix, inputs) -> the outputs where the call's plan serves it; otherwise the
// list [key, stream] for the Python path (a miss, a plan that steps aside, no plan)
PyObject* serve(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 3 || !PyDict_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "serve(cache: dict, prefix, inputs: tuple)");
    return nullptr;
  }
  long dev;
  unsigned long long stream;
  if (!device_stream(&dev, &stream)) return nullptr;
  PyObject* key = key_of(args[1], dev, args[2]);
  if (!key) return nullptr;
  return serve_key(args[0], key, stream, args[2]);
}

// ---- registered ops served below the dispatcher ---------------------------------------------
// A registered op (torch.ops.tkit.<op>, what a torch.compile graph calls) reaches its Python
// Autograd kernel through boxing into Python, then its implementation and the plan lookup: 2-3x
// the eager call's host time. FastOp kernels registered at the op's AutogradCUDA and CUDA keys
// serve a call of plain tensors that needs no gradient from the op's plan without entering
// Python (the GIL taken for the dict lookup only); anything else goes where the Python kernels
// sent it.
//
// An op's key: the current device (8 bytes), then each argument in schema order: a tensor 'T'
// and its signature (as append_sig), None 0xff, a bool 'b' and a byte, an int (a dtype: its
// ScalarType code) 'i' and 8 bytes, a float 'f' and the double's 8 bytes, a str 's', a 4-byte
// length and its UTF-8 bytes. op_serve builds the same key from the Python arguments.
// The gates, read per call (under the GIL) from the modules that own them: _plan.ON (plans on)
// and _register._held (config override scopes active in any thread)
PyObject* g_plan_globals = nullptr;
PyObject* g_register_globals = nullptr;
PyObject* g_on_key = nullptr;
PyObject* g_held_key = nullptr;
PyObject* g_op_stats = nullptr;  // tkit's launch counters: "op_fast" a call served here
PyObject* g_op_fast_key = nullptr;

// 1: the C++ kernels may serve; 0: not; -1: a Python error
int ops_on() {
  if (!g_plan_globals || !g_register_globals) return 0;
  PyObject* on = PyDict_GetItemWithError(g_plan_globals, g_on_key);  // borrowed
  if (!on) return PyErr_Occurred() ? -1 : 0;
  if (on != Py_True) return 0;
  PyObject* held = PyDict_GetItemWithError(g_register_globals, g_held_key);
  if (!held) return PyErr_Occurred() ? -1 : 0;
  const long n = PyLong_AsLong(held);
  if (n == -1 && PyErr_Occurred()) return -1;
  return n == 0;
}

struct Gil {
  PyGILState_STATE s;
  Gil() : s(PyGILState_Ensure()) {}
  ~Gil() { PyGILState_Release(s); }
};

void key_head(std::string& s, long device) {
  const int64_t d = device;
  s.append(reinterpret_cast<const char*>(&d), sizeof d);
}

void key_i64(std::string& s, char tag, int64_t v) {
  s.push_back(tag);
  s.append(reinterpret_cast<const char*>(&v), sizeof v);
}

void key_str(std::string& s, const char* p, size_t n) {
  s.push_back('s');
  const uint32_t len = static_cast<uint32_t>(n);
  s.append(reinterpret_cast<const char*>(&len), sizeof len);
  s.append(p, n);
}

// false: a value the key cannot hold (the call is not served here)
bool key_ivalue(std::string& s, const c10::IValue& v) {
  if (v.isTensor()) {
    s.push_back('T');
    append_tensor_sig(s, v.toTensor());
  } else if (v.isNone()) {
    s.push_back(static_cast<char>(0xff));
  } else if (v.isBool()) {
    s.push_back('b');
    s.push_back(v.toBool() ? 1 : 0);
  } else if (v.isInt()) {
    key_i64(s, 'i', v.toInt());
  } else if (v.isDouble()) {
    const double d = v.toDouble();
    int64_t bits;
    std::memcpy(&bits, &d, sizeof bits);
    key_i64(s, 'f', bits);
  } else if (v.isString()) {
    const auto& str = v.toStringRef();
    key_str(s, str.data(), str.size());
  } else {
    return false;
  }
  return true;
}

// 1: appended; 0: a value the key cannot hold; -1: a Python error
int key_pyobject(std::string& s, PyObject* o) {
  if (o == Py_None) {
    s.push_back(static_cast<char>(0xff));
  } else if (THPVariable_Check(o)) {
    s.push_back('T');
    append_tensor_sig(s, THPVariable_Unpack(o));
  } else if (PyBool_Check(o)) {
    s.push_back('b');
    s.push_back(o == Py_True ? 1 : 0);
  } else if (PyLong_CheckExact(o)) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow) return 0;
    if (v == -1 && PyErr_Occurred()) return -1;
    key_i64(s, 'i', v);
  } else if (PyFloat_CheckExact(o)) {
    const double d = PyFloat_AS_DOUBLE(o);
    int64_t bits;
    std::memcpy(&bits, &d, sizeof bits);
    key_i64(s, 'f', bits);
  } else if (PyUnicode_CheckExact(o)) {
    Py_ssize_t n;
    const char* p = PyUnicode_AsUTF8AndSize(o, &n);
    if (!p) return -1;
    key_str(s, p, static_cast<size_t>(n));
  } else if (THPDtype_Check(o)) {
    key_i64(s, 'i', static_cast<int64_t>(reinterpret_cast<THPDtype*>(o)->scalar_type));
  } else {
    return 0;
  }
  return 1;
}

bool count_op_fast() {
  if (!g_op_stats) return true;
  PyObject* v = PyDict_GetItemWithError(g_op_stats, g_op_fast_key);  // borrowed
  long n = 0;
  if (v) {
    n = PyLong_AsLong(v);
    if (n == -1 && PyErr_Occurred()) return false;
  } else if (PyErr_Occurred()) {
    return false;
  }
  PyObject* nv = PyLong_FromLong(n + 1);
  if (!nv) return false;
  int rc = PyDict_SetItem(g_op_stats, g_op_fast_key, nv);
  Py_DECREF(nv);
  return rc == 0;
}

// The outputs of a Python plan's result (None: it stepped aside) into `outs`; 1 / 0 / -1
int take_outputs(PyObject* r, size_t n_returns, std::vector<at::Tensor>& outs) {
  if (r == Py_None) return 0;
  if (THPVariable_Check(r)) {
    outs.push_back(THPVariable_Unpack(r));
  } else if (PyTuple_Check(r)) {
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(r); ++j) {
      PyObject* t = PyTuple_GET_ITEM(r, j);
      if (!THPVariable_Check(t)) {
        PyErr_SetString(PyExc_TypeError, "tkit op: an output is not a tensor");
        return -1;
      }
      outs.push_back(THPVariable_Unpack(t));
    }
  } else {
    PyErr_SetString(PyExc_TypeError, "tkit op: outputs must be a tensor or a tuple of tensors");
    return -1;
  }
  if (outs.size() != n_returns) {
    PyErr_Format(PyExc_RuntimeError, "tkit op: %zu outputs where the schema has %zu",
                 outs.size(), n_returns);
    return -1;
  }
  return 1;
}

// One plan's call on the given inputs (a C++ plan, or a Python plan's go(stream, inputs)):
// 1 served (outputs in `outs`), 0 not served (no plan, a plan that steps aside), -1 error
int run_any_plan(PyObject* plan, unsigned long long stream,
                 const std::vector<const at::Tensor*>& ins, size_t n_returns,
                 std::vector<at::Tensor>& outs) {
  if (Py_TYPE(plan) == &PlanType) {
    auto* p = reinterpret_cast<PlanObject*>(plan);
    if (p->n_in != static_cast<int>(ins.size()) || p->n_out != static_cast<int>(n_returns))
      return 0;
    return run_plan_core(p, stream, ins.data(), outs);
  }
  if (plan == Py_False || plan == Py_None || !PyCallable_Check(plan)) return 0;
  PyObject* tup = PyTuple_New(static_cast<Py_ssize_t>(ins.size()));
  if (!tup) return -1;
  for (size_t i = 0; i < ins.size(); ++i) {
    PyObject* t = ins[i] ? THPVariable_Wrap(*ins[i]) : (Py_INCREF(Py_None), Py_None);
    if (!t) {
      Py_DECREF(tup);
      return -1;
    }
    PyTuple_SET_ITEM(tup, static_cast<Py_ssize_t>(i), t);
  }
  PyObject* st = PyLong_FromUnsignedLongLong(stream);
  PyObject* r = st ? PyObject_CallFunctionObjArgs(plan, st, tup, nullptr) : nullptr;
  Py_XDECREF(st);
  Py_DECREF(tup);
  if (!r) return -1;
  int rc = take_outputs(r, n_returns, outs);
  Py_DECREF(r);
  return rc;
}

enum ArgKind : char { kTensor, kDtype, kOther };

// At an op's AutogradCUDA key: serves plain tensors that need no gradient, and otherwise goes
// where the op's Python autograd kernel went (py_fn: its autograd.Function, or below
// autograd). At its CUDA key (reached below autograd: under torch.inference_mode, from the
// autograd kernel's miss, from the autograd.Function's forward): serves the call or runs the
// Python implementation (py_fn), as the CompositeExplicitAutograd kernel did.
struct FastOp final : c10::OperatorKernel {
  PyObject* cache;   // the op's plans (a dict; held for the life of the process)
  PyObject* py_fn;   // callable(*args): the autograd path, or the implementation (at_backend)
  bool at_backend;   // registered at the backend key (else at its autograd key)
  std::vector<ArgKind> kinds;  // per schema argument
  std::vector<size_t> tensors;  // schema positions of the tensor arguments
  size_t n_returns;
  c10::DispatchKeySet backend;  // the one backend served (CUDA; CPU for tests)

  bool needs_grad(c10::ArrayRef<c10::IValue> args) const {
    if (!c10::GradMode::is_enabled()) return false;
    for (size_t i : tensors)
      if (args[i].isTensor() && args[i].toTensor().requires_grad()) return true;
    return false;
  }

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                  torch::jit::Stack* stack) {
    const size_t n = kinds.size();
    auto args = torch::jit::last(*stack, n);
    if (at_backend) {
      // every key above the backend's was handled on the way here: the tensors are plain
      // (serve_op would still run the implementation for a tensor that needs a gradient)
      if (!needs_grad(args) && serve(args, stack)) return;
      call_python(stack);
      return;
    }
    if (needs_grad(args)) {
      call_python(stack);
      return;
    }
    const c10::DispatchKeySet below = ks & c10::after_autograd_keyset;
    // plain tensors of the one backend: no Python key (subclasses, dispatch modes), no
    // functionalization, conjugate or other wrapper keys between autograd and the backend
    const c10::DispatchKeySet rest = below.remove(c10::DispatchKey::ADInplaceOrView)
                                         .remove(c10::DispatchKey::BackendSelect);
    if (rest == backend) {
      if (serve(args, stack)) return;
      at::AutoDispatchBelowAutograd guard;
      op.redispatchBoxed(below, stack);
      return;
    }
    op.redispatchBoxed(below, stack);
  }

  bool serve(c10::ArrayRef<c10::IValue> args, torch::jit::Stack* stack) {
    std::vector<at::Tensor> outs;
    {
      Gil gil;
      int rc = lookup_and_run(args, outs);
      if (rc < 0) throw pybind11::error_already_set();
      if (rc == 0) return false;
    }
    torch::jit::drop(*stack, kinds.size());
    for (auto& t : outs) stack->emplace_back(std::move(t));
    return true;
  }

  int lookup_and_run(c10::ArrayRef<c10::IValue> args, std::vector<at::Tensor>& outs) {
    const int on = ops_on();
    if (on <= 0) return on;
    long dev;
    unsigned long long stream;
    if (!device_stream(&dev, &stream)) return -1;
    std::string s;
    s.reserve(160);
    key_head(s, dev);
    for (const auto& v : args)
      if (!key_ivalue(s, v)) return 0;
    PyObject* key = PyBytes_FromStringAndSize(s.data(), static_cast<Py_ssize_t>(s.size()));
    if (!key) return -1;
    PyObject* plan = PyDict_GetItemWithError(cache, key);  // borrowed
    Py_DECREF(key);
    if (!plan) return PyErr_Occurred() ? -1 : 0;
    std::vector<const at::Tensor*> ins;
    ins.reserve(tensors.size());
    for (size_t i : tensors) ins.push_back(args[i].isTensor() ? &args[i].toTensor() : nullptr);
    Py_INCREF(plan);  // a Python plan may run code that clears the cache
    int rc = run_any_plan(plan, stream, ins, n_returns, outs);
    Py_DECREF(plan);
    if (rc == 1 && !count_op_fast()) return -1;
    return rc;
  }

  void call_python(torch::jit::Stack* stack) {
    const size_t n = kinds.size();
    auto args = torch::jit::last(*stack, n);
    std::vector<at::Tensor> outs;
    {
      Gil gil;
      PyObject* tup = PyTuple_New(static_cast<Py_ssize_t>(n));
      if (!tup) throw pybind11::error_already_set();
      for (size_t i = 0; i < n; ++i) {
        PyObject* o = to_python(args[i], kinds[i]);
        if (!o) {
          Py_DECREF(tup);
          throw pybind11::error_already_set();
        }
        PyTuple_SET_ITEM(tup, static_cast<Py_ssize_t>(i), o);
      }
      PyObject* r = PyObject_Call(py_fn, tup, nullptr);
      Py_DECREF(tup);
      if (!r) throw pybind11::error_already_set();
      int rc = take_outputs(r, n_returns, outs);
      Py_DECREF(r);
      if (rc < 0) throw pybind11::error_already_set();
      if (rc == 0) {
        PyErr_SetString(PyExc_RuntimeError, "tkit op: the Python kernel returned None");
        throw pybind11::error_already_set();
      }
    }
    torch::jit::drop(*stack, n);
    for (auto& t : outs) stack->emplace_back(std::move(t));
  }

  static PyObject* to_python(const c10::IValue& v, ArgKind kind) {
    if (v.isNone()) Py_RETURN_NONE;
    if (v.isTensor()) return THPVariable_Wrap(v.toTensor());
    if (v.isBool()) return PyBool_FromLong(v.toBool());
    if (v.isInt()) {
      if (kind == kDtype) {
        PyObject* d = reinterpret_cast<PyObject*>(
            torch::getTHPDtype(static_cast<at::ScalarType>(v.toInt())));
        Py_XINCREF(d);
        return d;
      }
      return PyLong_FromLongLong(v.toInt());
    }
    if (v.isDouble()) return PyFloat_FromDouble(v.toDouble());
    if (v.isString()) {
      const auto& str = v.toStringRef();
      return PyUnicode_FromStringAndSize(str.data(), static_cast<Py_ssize_t>(str.size()));
    }
    try {  // symbolic sizes of a trace, and anything else: torch's own conversion
      return torch::jit::toPyObject(v).release().ptr();
    } catch (pybind11::error_already_set& e) {
      e.restore();
      return nullptr;
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
      return nullptr;
    }
  }
};

// The argument kinds of a schema this kernel takes (tensors, optional tensors, bools, ints,
// floats, strs, dtypes, optional scalars; tensor returns only), or an error naming the first
// that it does not take
bool schema_kinds(const c10::FunctionSchema& schema, std::vector<ArgKind>& kinds,
                  std::vector<size_t>& tensors, std::string& why) {
  for (const auto& ret : schema.returns()) {
    if (ret.type()->kind() != c10::TypeKind::TensorType) {
      why = "a return of type " + ret.type()->str();
      return false;
    }
  }
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const auto& a = schema.arguments()[i];
    if (a.alias_info() && a.alias_info()->isWrite()) {
      why = "a mutated argument " + a.name();
      return false;
    }
    c10::TypePtr t = a.real_type();
    if (t->kind() == c10::TypeKind::OptionalType) t = t->containedTypes()[0];
    switch (t->kind()) {
      case c10::TypeKind::TensorType:
        kinds.push_back(kTensor);
        tensors.push_back(i);
        break;
      case c10::TypeKind::ScalarTypeType:
        kinds.push_back(kDtype);
        break;
      case c10::TypeKind::BoolType:
      case c10::TypeKind::IntType:
      case c10::TypeKind::SymIntType:
      case c10::TypeKind::FloatType:
      case c10::TypeKind::SymFloatType:
      case c10::TypeKind::SymBoolType:
      case c10::TypeKind::StringType:
        kinds.push_back(kOther);
        break;
      default:
        why = "an argument " + a.name() + " of type " + a.real_type()->str();
        return false;
    }
  }
  return true;
}

std::vector<torch::Library*>* g_libs = nullptr;  // never freed: see unregister_op

// register_op(qualname, dispatch_key, cache, py_fn) -> a handle for unregister_op. At
// AutogradCUDA (AutogradCPU: tests) py_fn is the op's autograd path; at CUDA (CPU) its
// implementation
PyObject* register_op(PyObject*, PyObject* args) {
  const char *qualname, *key_name;
  PyObject *cache, *py_fn;
  if (!PyArg_ParseTuple(args, "ssO!O", &qualname, &key_name, &PyDict_Type, &cache, &py_fn))
    return nullptr;
  if (!PyCallable_Check(py_fn)) {
    PyErr_SetString(PyExc_TypeError, "register_op: py_fn must be callable");
    return nullptr;
  }
  std::string q(qualname);
  const auto sep = q.find("::");
  if (sep == std::string::npos) {
    PyErr_SetString(PyExc_ValueError, "register_op: qualname must be ns::name");
    return nullptr;
  }
  try {
    const c10::DispatchKey key = c10::parseDispatchKey(key_name);
    c10::DispatchKeySet backend;
    bool at_backend = key == c10::DispatchKey::CUDA || key == c10::DispatchKey::CPU;
    if (key == c10::DispatchKey::AutogradCUDA || key == c10::DispatchKey::CUDA) {
      backend = c10::DispatchKeySet(c10::DispatchKey::CUDA);
    } else if (key == c10::DispatchKey::AutogradCPU || key == c10::DispatchKey::CPU) {
      backend = c10::DispatchKeySet(c10::DispatchKey::CPU);
    } else {
      PyErr_SetString(PyExc_ValueError, "register_op: AutogradCUDA, CUDA, AutogradCPU or CPU");
      return nullptr;
    }
    auto op = c10::Dispatcher::singleton().findSchema({q, ""});
    if (!op) {
      PyErr_Format(PyExc_ValueError, "register_op: no op %s", qualname);
      return nullptr;
    }
    auto kernel = std::make_unique<FastOp>();
    std::string why;
    if (!schema_kinds(op->schema(), kernel->kinds, kernel->tensors, why)) {
      PyErr_Format(PyExc_ValueError, "register_op: %s has %s", qualname, why.c_str());
      return nullptr;
    }
    kernel->n_returns = op->schema().returns().size();
    kernel->backend = backend;
    kernel->at_backend = at_backend;
    Py_INCREF(cache);
    kernel->cache = cache;
    Py_INCREF(py_fn);
    kernel->py_fn = py_fn;
    auto* lib = new torch::Library(torch::Library::IMPL, q.substr(0, sep), key, __FILE__,
                                   __LINE__);
    lib->impl(q.substr(sep + 2).c_str(),
              torch::CppFunction::makeFromBoxedFunctor(std::move(kernel)));
    if (!g_libs) g_libs = new std::vector<torch::Library*>();
    g_libs->push_back(lib);
    return PyLong_FromSize_t(g_libs->size() - 1);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// unregister_op(handle): removes the kernel (the references it held to the cache and the
// autograd callable are kept: the dispatcher may still be running it in another thread)
PyObject* unregister_op(PyObject*, PyObject* arg) {
  const size_t h = PyLong_AsSize_t(arg);
  if (PyErr_Occurred()) return nullptr;
  if (!g_libs || h >= g_libs->size() || !(*g_libs)[h]) {
    PyErr_SetString(PyExc_ValueError, "unregister_op: no such handle");
    return nullptr;
  }
  delete (*g_libs)[h];
  (*g_libs)[h] = nullptr;
  Py_RETURN_NONE;
}

// set_op_gates(plan_globals, register_globals): where ops_on() reads ON and _held
PyObject* set_op_gates(PyObject*, PyObject* args) {
  PyObject *plan_globals, *register_globals;
  if (!PyArg_ParseTuple(args, "O!O!", &PyDict_Type, &plan_globals, &PyDict_Type,
                        &register_globals))
    return nullptr;
  if (!g_on_key) g_on_key = PyUnicode_InternFromString("ON");
  if (!g_held_key) g_held_key = PyUnicode_InternFromString("_held");
  if (!g_on_key || !g_held_key) return nullptr;
  Py_INCREF(plan_globals);
  Py_INCREF(register_globals);
  Py_XDECREF(g_plan_globals);
  Py_XDECREF(g_register_globals);
  g_plan_globals = plan_globals;
  g_register_globals = register_globals;
  Py_RETURN_NONE;
}

PyObject* set_op_stats(PyObject*, PyObject* arg) {
  if (!PyDict_Check(arg)) {
    PyErr_SetString(PyExc_TypeError, "set_op_stats(dict)");
    return nullptr;
  }
  if (!g_op_fast_key) g_op_fast_key = PyUnicode_InternFromString("op_fast");
  Py_XDECREF(g_op_stats);
  Py_INCREF(arg);
  g_op_stats = arg;
  Py_RETURN_NONE;
}

// op_serve(cache, args, inputs) -> the outputs where the call's plan serves it; otherwise
// [key, stream] for the Python path (key None: arguments the key cannot hold). The key is the
// one FastOp builds from the same arguments (schema order); inputs: the tensor arguments
PyObject* op_serve(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 3 || !PyDict_Check(args[0]) || !PyTuple_Check(args[1]) || !PyTuple_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "op_serve(cache: dict, args: tuple, inputs: tuple)");
    return nullptr;
  }
  long dev;
  unsigned long long stream;
  if (!device_stream(&dev, &stream)) return nullptr;
  std::string s;
  s.reserve(160);
  key_head(s, dev);
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(args[1]); ++i) {
    int rc = key_pyobject(s, PyTuple_GET_ITEM(args[1], i));
    if (rc < 0) return nullptr;
    ok = rc == 1;
  }
  PyObject* key = Py_None;
  if (ok) {
    key = PyBytes_FromStringAndSize(s.data(), static_cast<Py_ssize_t>(s.size()));
    if (!key) return nullptr;
  } else {
    Py_INCREF(Py_None);
  }
  return serve_key(args[0], key, stream, args[2]);
}

// init_cuda(c10_cuda_path, torch_cuda_path) -> whether the native device and stream getters
// were found (libraries already loaded by torch)
PyObject* init_cuda(PyObject*, PyObject* args) {
  const char *c10_cuda, *torch_cuda;
  if (!PyArg_ParseTuple(args, "ss", &c10_cuda, &torch_cuda)) return nullptr;
  g_current_device = nullptr;
  g_current_stream = nullptr;
  if (!*c10_cuda || !*torch_cuda) Py_RETURN_FALSE;  // ("", ""): back to the Python source
  void* h1 = dlopen(c10_cuda, RTLD_LAZY | RTLD_NOLOAD);
  void* h2 = dlopen(torch_cuda, RTLD_LAZY | RTLD_NOLOAD);
  if (h1 && h2) {
    g_current_device = reinterpret_cast<CurrentDeviceFn>(dlsym(h1, "_ZN3c104cuda14current_deviceEv"));
    g_current_stream = reinterpret_cast<CurrentStreamFn>(dlsym(h2, "aoti_torch_get_current_cuda_stream"));
  }
  if (!g_current_device || !g_current_stream) {
    g_current_device = nullptr;
    g_current_stream = nullptr;
    Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

PyObject* set_device_stream(PyObject*, PyObject* arg) {
  Py_XDECREF(g_device_stream);
  g_device_stream = arg == Py_None ? nullptr : arg;
  Py_XINCREF(g_device_stream);
  Py_RETURN_NONE;
}

PyObject* native_device_stream(PyObject*, PyObject*) {
  // (device, stream) from the native getters, to check them against torch's at start-up
  if (!g_current_device || !g_current_stream) Py_RETURN_NONE;
  long dev;
  unsigned long long stream;
  if (!device_stream(&dev, &stream)) return nullptr;
  return Py_BuildValue("(lK)", dev, stream);
}

PyObject* set_recorder(PyObject*, PyObject* arg) {
  if (arg != Py_None && !PyList_Check(arg)) {
    PyErr_SetString(PyExc_TypeError, "set_recorder(list or None)");
    return nullptr;
  }
  Py_XDECREF(g_recorder);
  g_recorder = arg == Py_None ? nullptr : arg;
  Py_XINCREF(g_recorder);
  Py_RETURN_NONE;
}

PyObject* set_discard(PyObject*, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return nullptr;
  g_discard = on;
  Py_RETURN_NONE;
}

PyObject* scalar_type_code(PyObject*, PyObject* arg) {
  // the c10::ScalarType code of a torch.dtype, for Plan's allocations
  if (!THPDtype_Check(arg)) {
    PyErr_SetString(PyExc_TypeError, "expected a torch.dtype");
    return nullptr;
  }
  return PyLong_FromLong(static_cast<long>(reinterpret_cast<THPDtype*>(arg)->scalar_type));
}

PyMethodDef methods[] = {
    {"Plan", make_plan, METH_VARARGS, "Plan(launches, allocs, n_in, n_out, enter, exit, stats)"},
    {"set_recorder", set_recorder, METH_O, "tests: record launches instead of making them"},
    {"set_discard", set_discard, METH_O, "benchmarks without a GPU: drop the launches"},
    {"scalar_type_code", scalar_type_code, METH_O, "c10::ScalarType code of a torch.dtype"},
    {"make_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(make_key)), METH_FASTCALL,
     "make_key(prefix, device, inputs)"},
    {"serve", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(serve)), METH_FASTCALL,
     "serve(cache, prefix, inputs)"},
    {"op_serve", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(op_serve)), METH_FASTCALL,
     "op_serve(cache, args, inputs)"},
    {"register_op", register_op, METH_VARARGS, "register_op(qualname, key, cache, py_fn)"},
    {"unregister_op", unregister_op, METH_O, "unregister_op(handle)"},
    {"set_op_gates", set_op_gates, METH_VARARGS, "set_op_gates(plan_globals, register_globals)"},
    {"set_op_stats", set_op_stats, METH_O, "the launch counters (op_fast)"},
    {"init_cuda", init_cuda, METH_VARARGS, "init_cuda(c10_cuda_path, torch_cuda_path)"},
    {"set_device_stream", set_device_stream, METH_O, "the Python (device, stream) source"},
    {"native_device_stream", native_device_stream, METH_NOARGS, "(device, stream) or None"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tkit_cplan", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__tkit_cplan() {
  PlanType.tp_name = "_tkit_cplan.Plan";
  PlanType.tp_basicsize = sizeof(PlanObject);
  PlanType.tp_flags = Py_TPFLAGS_DEFAULT;
  PlanType.tp_dealloc = plan_dealloc;
  PlanType.tp_call = plan_call;
  if (PyType_Ready(&PlanType) < 0) return nullptr;
  return PyModule_Create(&module);
}
