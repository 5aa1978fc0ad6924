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
#include <torch/csrc/autograd/python_variable.h>
#include <ATen/ATen.h>

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
                           kL2Promotion128B, t.fill);
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
  // tests: what would be encoded, (slot, pointer, dtype, dims, strides, box, swizzle, fill)
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
  return Py_BuildValue("(nKiNNNii)", static_cast<Py_ssize_t>(t.slot),
                       static_cast<unsigned long long>(ptr), t.dtype, dims, strides, box,
                       t.swizzle, t.fill);
}

struct Alloc {
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
  int device;  // -1: CPU (tests only)
  int like;    // an input with this output's shape, dtype, device and strides, or -1;
               // -2: a scratch tensor allocated by at::zeros
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
};

void plan_dealloc(PyObject* self) {
  auto* p = reinterpret_cast<PlanObject*>(self);
  delete p->launches;
  delete p->allocs;
  Py_XDECREF(p->enter);
  Py_XDECREF(p->exit_);
  Py_XDECREF(p->stats);
  Py_XDECREF(p->plan_key);
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

// The outputs of one call of plan p (one tensor or a tuple), or None where the plan steps
// aside for this call (a launch hook attached, an output that is not 16-byte aligned)
PyObject* run_plan(PlanObject* p, unsigned long long stream, PyObject* inputs) {
  if (PyList_GET_SIZE(p->enter) || PyList_GET_SIZE(p->exit_)) Py_RETURN_NONE;
  if (!PyTuple_Check(inputs) || PyTuple_GET_SIZE(inputs) != p->n_in) {
    PyErr_SetString(PyExc_TypeError, "plan: inputs must be a tuple of the plan's length");
    return nullptr;
  }
  const size_t n_alloc = p->allocs->size();
  std::vector<uint64_t> ptrs(p->n_in + n_alloc, 0);
  std::vector<at::Tensor> made;
  made.reserve(n_alloc);
  try {
    for (int i = 0; i < p->n_in; ++i) {
      PyObject* o = PyTuple_GET_ITEM(inputs, i);
      if (o == Py_None) continue;
      if (!THPVariable_Check(o)) {
        PyErr_Format(PyExc_TypeError, "plan: input %d is not a tensor", i);
        return nullptr;
      }
      ptrs[i] = reinterpret_cast<uint64_t>(THPVariable_Unpack(o).data_ptr());
    }
    uint64_t misaligned = 0;
    for (size_t j = 0; j < n_alloc; ++j) {
      const Alloc& a = (*p->allocs)[j];
      if (a.like >= 0) {
        made.push_back(at::empty_like(THPVariable_Unpack(PyTuple_GET_ITEM(inputs, a.like))));
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
    if (misaligned & 15) Py_RETURN_NONE;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  for (Launch& L : *p->launches)
    if (!launch_one(L, stream, ptrs)) return nullptr;
  if (!count_call(p)) return nullptr;
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
    int idx, dtype, swizzle, fill;
    PyObject *dims, *strides, *box;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(ft, k), "niiOOOii", &slot, &idx, &dtype,
                          &dims, &strides, &box, &swizzle, &fill)) {
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
    one.tmas.push_back(t);
  }
  Py_DECREF(ft);
  return true;
}

// Plan(launches, allocs, n_in, n_out, enter, exit, stats)
//   launches: [(function, (gx, gy, gz), threads, shared, slots, ((slot, tensor index), ...),
//               ((slot, tensor index, dtype, dims, byte strides, box, swizzle, fill), ...))]
//   (the last: host TMA descriptors, dimensions innermost first; may be left out)
//   allocs: [(sizes, dtype code (c10::ScalarType), device index or -1, like input or -1,
//            or -2: zeros)]
PyObject* make_plan(PyObject*, PyObject* args) {
  PyObject *launches, *allocs, *enter, *exit_, *stats;
  int n_in, n_out;
  if (!PyArg_ParseTuple(args, "OOiiO!O!O!", &launches, &allocs, &n_in, &n_out, &PyList_Type,
                        &enter, &PyList_Type, &exit_, &PyDict_Type, &stats))
    return nullptr;
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

bool append_sig(std::string& s, PyObject* o) {
  if (o == Py_None) {
    s.push_back(static_cast<char>(0xff));
    return true;
  }
  if (!THPVariable_Check(o)) {
    PyErr_SetString(PyExc_TypeError, "plan key: an input is neither a tensor nor None");
    return false;
  }
  const at::Tensor& t = THPVariable_Unpack(o);
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
  PyObject* plan = PyDict_GetItemWithError(args[0], key);  // borrowed
  if (!plan && PyErr_Occurred()) {
    if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
      Py_DECREF(key);
      return nullptr;
    }
    PyErr_Clear();  // an unhashable option: the Python path names it
  }
  if (plan && plan != Py_False) {
    PyObject* out = nullptr;
    if (Py_TYPE(plan) == &PlanType) {
      out = run_plan(reinterpret_cast<PlanObject*>(plan), stream, args[2]);
    } else {  // a Python plan (a launch the executor does not take)
      PyObject* st = PyLong_FromUnsignedLongLong(stream);
      if (st) {
        out = PyObject_CallFunctionObjArgs(plan, st, args[2], nullptr);
        Py_DECREF(st);
      }
    }
    if (!out) {
      Py_DECREF(key);
      return nullptr;
    }
    if (out != Py_None) {
      Py_DECREF(key);
      return out;
    }
    Py_DECREF(out);
  }
  PyObject* st = PyLong_FromUnsignedLongLong(stream);
  if (!st) {
    Py_DECREF(key);
    return nullptr;
  }
  PyObject* miss = PyList_New(2);
  if (!miss) {
    Py_DECREF(key);
    Py_DECREF(st);
    return nullptr;
  }
  PyList_SET_ITEM(miss, 0, key);
  PyList_SET_ITEM(miss, 1, st);
  return miss;
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
    {"scalar_type_code", scalar_type_code, METH_O, "c10::ScalarType code of a torch.dtype"},
    {"make_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(make_key)), METH_FASTCALL,
     "make_key(prefix, device, inputs)"},
    {"serve", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(serve)), METH_FASTCALL,
     "serve(cache, prefix, inputs)"},
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
