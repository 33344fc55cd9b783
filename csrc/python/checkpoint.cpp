// torch_ext._C.checkpoint: Python callables checkpointed through saved-tensor hooks (frame.h).
// Autograd's default saved-tensor hooks are Python objects, so this adapter is where a Frame's
// pack / unpack / repack become hooks; it also saves the segment's inputs and calls the segment.
// The algorithm is the core's (csrc/torch_ext/checkpoint/frame.h). The hooks and run() are plain
// CPython functions, not pybind11 ones: they run for every tensor autograd saves, and pybind11's
// dispatch would cost more than the rest of a small segment's bookkeeping.
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/SavedTensorHooks.h>
#include <c10/core/GradMode.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include "torch_ext/checkpoint/checkpoint.h"
#include "torch_ext/checkpoint/frame.h"
#include "torch_ext/checkpoint/frame_hooks.h"
#include "torch_ext/class_fields.h"

namespace py = pybind11;
namespace ck = torch_ext::checkpoint;

namespace {

using OptionsObject = c10::intrusive_ptr<torch_ext::Boxed<ck::CheckpointOptions>>;

// Python exception types, set by bind_checkpoint(); never destroyed (the interpreter goes first).
PyObject* checkpoint_error_type = nullptr;
PyObject* stop_type = nullptr;

// A C++ exception as the pending Python error.
void set_python_error() {
  try {
    throw;
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (python_error& e) {  // a Python hook's error through autograd (a replay stopping, nested)
    e.restore();
  } catch (const ck::CheckpointError& e) {
    PyErr_SetString(checkpoint_error_type, e.what());
  } catch (const ck::StopRecomputation&) {
    PyErr_SetNone(stop_type);
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
}

// A heap-held T in a capsule, deleted with it.
template <class T>
PyObject* capsule_of(T value, const char* name) {
  return PyCapsule_New(new T(std::move(value)), name, [](PyObject* capsule) {
    delete static_cast<T*>(PyCapsule_GetPointer(capsule, PyCapsule_GetName(capsule)));
  });
}

template <class T>
T* from_capsule(PyObject* capsule, const char* name) {
  return static_cast<T*>(PyCapsule_GetPointer(capsule, name));
}

constexpr const char* kFrame = "torch_ext.checkpoint.Frame";
constexpr const char* kHolder = "torch_ext.checkpoint.Holder";
constexpr const char* kRepack = "torch_ext.checkpoint.Repack";
constexpr const char* kOptions = "torch_ext.checkpoint.Options";

using FramePtr = std::shared_ptr<ck::Frame>;
using HolderPtr = std::shared_ptr<ck::Holder>;
struct RepackTarget {
  FramePtr frame;
  int64_t graph_task;
};

// pack hook (bound to a frame): tensor -> holder
PyObject* pack_hook(PyObject* frame, PyObject* tensor) {
  try {
    return capsule_of<HolderPtr>((*from_capsule<FramePtr>(frame, kFrame))->pack(THPVariable_Unpack(tensor)), kHolder);
  } catch (...) {
    set_python_error();
    return nullptr;
  }
}

// unpack hook: holder -> the recomputed tensor
PyObject* unpack_hook(PyObject* /*module*/, PyObject* holder_capsule) {
  try {
    HolderPtr& holder = *from_capsule<HolderPtr>(holder_capsule, kHolder);
    ck::Frame& frame = *holder->frame;
    // Wait for a frame another thread is replaying without the GIL: the replay runs Python.
    std::unique_lock<std::recursive_mutex> lock(frame.mutex(), std::try_to_lock);
    if (!lock.owns_lock()) {
      PyThreadState* state = PyEval_SaveThread();
      lock.lock();
      PyEval_RestoreThread(state);
    }
    return THPVariable_Wrap(frame.unpack(*holder));
  } catch (...) {
    set_python_error();
    return nullptr;
  }
}

// pack hook of a replay (bound to its frame and graph task): tensor -> what the replay's graph keeps
PyObject* repack_hook(PyObject* target, PyObject* tensor) {
  try {
    RepackTarget& t = *from_capsule<RepackTarget>(target, kRepack);
    return THPVariable_Wrap(t.frame->repack(THPVariable_Unpack(tensor), t.graph_task));
  } catch (...) {
    set_python_error();
    return nullptr;
  }
}

PyObject* identity_hook(PyObject* /*module*/, PyObject* value) {
  Py_INCREF(value);
  return value;
}

PyMethodDef pack_def{"pack", pack_hook, METH_O, nullptr};
PyMethodDef unpack_def{"unpack", unpack_hook, METH_O, nullptr};
PyMethodDef repack_def{"repack", repack_hook, METH_O, nullptr};
PyMethodDef identity_def{"identity", identity_hook, METH_O, nullptr};

PyObject* module_hook(PyMethodDef& def) {
  static PyObject* unpack = PyCFunction_New(&unpack_def, nullptr);
  static PyObject* identity = PyCFunction_New(&identity_def, nullptr);
  return &def == &unpack_def ? unpack : identity;
}

// Runs call() with pack / unpack (new references, stolen) as autograd's default saved-tensor hooks
// (what torch.autograd.graph.saved_tensors_hooks does, without its Python frames).
template <class Call>
PyObject* with_hooks(PyObject* pack, PyObject* unpack, Call&& call) {
  at::SavedTensorDefaultHooks::lazy_initialize();
  at::SavedTensorDefaultHooks::push_hooks(c10::SafePyObject(pack, getPyInterpreter()),
                                          c10::SafePyObject(unpack, getPyInterpreter()));
  PyObject* result = call();
  at::SavedTensorDefaultHooks::pop_hooks();
  return result;
}

// Python objects released under the GIL whatever thread drops the last reference.
struct PyRef {
  explicit PyRef(PyObject* o) : object(o) { Py_XINCREF(o); }
  ~PyRef() {
    if (object == nullptr || !Py_IsInitialized()) return;  // at exit: leak rather than touch it
    PyGILState_STATE state = PyGILState_Ensure();
    Py_DECREF(object);
    PyGILState_Release(state);
  }
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  PyObject* object;
};

// One argument of the segment as the replay gets it back: a tensor as the core keeps a boundary
// input (SavedInput), anything else as the Python object.
struct SavedArg {
  std::optional<ck::SavedInput> tensor;
  std::unique_ptr<PyRef> value;

  PyObject* restore() const {
    if (value) {
      Py_INCREF(value->object);
      return value->object;
    }
    return THPVariable_Wrap(tensor->restore());
  }
};

SavedArg save_arg(PyObject* arg, ck::StoragePolicy policy) {
  SavedArg saved;
  if (THPVariable_Check(arg)) {
    saved.tensor.emplace(THPVariable_Unpack(arg), policy);
  } else {
    saved.value = std::make_unique<PyRef>(arg);
  }
  return saved;
}

// What a frame's replay needs: the segment, its inputs and what its forward ran under.
struct Call {
  std::unique_ptr<PyRef> fn, kwargs;
  std::vector<SavedArg> inputs;
  ck::SegmentRuns runs;
};

void replay(const std::shared_ptr<Call>& call, ck::Frame& frame, int64_t graph_task) {
  py::gil_scoped_acquire gil;
  py::object args = py::reinterpret_steal<py::object>(PyTuple_New(static_cast<Py_ssize_t>(call->inputs.size())));
  for (size_t i = 0; i < call->inputs.size(); ++i) {
    PyObject* value = call->inputs[i].restore();
    if (value == nullptr) throw py::error_already_set();
    PyTuple_SET_ITEM(args.ptr(), static_cast<Py_ssize_t>(i), value);
  }
  PyObject* kwargs = call->kwargs ? call->kwargs->object : nullptr;
  call->runs.replay(frame.name(), [&] {
    PyObject* repack =
        PyCFunction_New(&repack_def, capsule_of(RepackTarget{frame.shared_from_this(), graph_task}, kRepack));
    Py_DECREF(PyCFunction_GET_SELF(repack));  // the function holds the capsule
    PyObject* identity = module_hook(identity_def);
    Py_INCREF(identity);
    PyObject* result = with_hooks(repack, identity, [&] { return PyObject_Call(call->fn->object, args.ptr(), kwargs); });
    if (result == nullptr) throw py::error_already_set();  // a stop among them: Frame::unpack() tells
    Py_DECREF(result);
  });
}

// The tensors in a segment's output: a tensor, or tuples, lists and dicts (Hugging Face's
// ModelOutput is one) holding tensors.
void collect_tensors(PyObject* value, std::vector<at::Tensor>& out, int depth) {
  if (depth > 8) return;
  if (THPVariable_Check(value)) {
    out.push_back(THPVariable_Unpack(value));
  } else if (PyTuple_Check(value) || PyList_Check(value)) {
    PyObject* seq = PySequence_Fast(value, "");
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
      collect_tensors(PySequence_Fast_GET_ITEM(seq, i), out, depth + 1);
    }
    Py_DECREF(seq);
  } else if (PyDict_Check(value)) {
    PyObject *key, *item;
    Py_ssize_t pos = 0;
    while (PyDict_Next(value, &pos, &key, &item)) collect_tensors(item, out, depth + 1);
  }
}

std::vector<at::Tensor> tensors_in(PyObject* value) {
  std::vector<at::Tensor> out;
  collect_tensors(value, out, 0);
  return out;
}

std::vector<c10::Device> devices_of(PyObject* args, PyObject* kwargs) {
  std::vector<c10::Device> devices;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); ++i) {
    PyObject* a = PyTuple_GET_ITEM(args, i);
    if (THPVariable_Check(a)) devices.push_back(THPVariable_Unpack(a).device());
  }
  if (kwargs != nullptr) {
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(kwargs, &pos, &key, &value)) {
      if (THPVariable_Check(value)) devices.push_back(THPVariable_Unpack(value).device());
    }
  }
  return devices;
}

// The segment's tensor inputs that stay alive as they are until its backward: args its SavedArg
// keeps itself and the tensors among kwargs (the call holds them).
std::vector<at::Tensor> inputs_kept_as_they_are(PyObject* args, PyObject* kwargs, const Call& call) {
  std::vector<at::Tensor> kept;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); ++i) {
    const auto& saved = call.inputs[static_cast<size_t>(i)].tensor;
    if (saved && saved->keeps_input()) kept.push_back(THPVariable_Unpack(PyTuple_GET_ITEM(args, i)));
  }
  if (kwargs != nullptr) {
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(kwargs, &pos, &key, &value)) {
      if (THPVariable_Check(value)) kept.push_back(THPVariable_Unpack(value));
    }
  }
  return kept;
}

// After the forward: an input written in place would make the replay start from other values.
void check_inputs_unchanged(PyObject* args, const std::vector<std::pair<Py_ssize_t, uint32_t>>& versions,
                            const std::string& name) {
  for (const auto& [i, version] : versions) {
    if (THPVariable_Unpack(PyTuple_GET_ITEM(args, i))._version() != version) {
      throw ck::input_written_in_place(name, static_cast<size_t>(i));
    }
  }
}

// run(fn, args: tuple, kwargs: dict | None, options: capsule from native_options(), name: str)
PyObject* run(PyObject* /*module*/, PyObject* const* argv, Py_ssize_t argc) {
  try {
    TORCH_CHECK(argc == 5 && PyTuple_Check(argv[1]) && (argv[2] == Py_None || PyDict_Check(argv[2])),
                "torch_ext._C.checkpoint.run(fn, args: tuple, kwargs: dict | None, options, name)");
    PyObject *fn = argv[0], *args = argv[1], *kwargs = argv[2] == Py_None ? nullptr : argv[2];
    if (kwargs != nullptr && PyDict_GET_SIZE(kwargs) == 0) kwargs = nullptr;
    if (!c10::GradMode::is_enabled()) return PyObject_Call(fn, args, kwargs);
    const auto* options = from_capsule<ck::CheckpointOptions>(argv[3], kOptions);
    if (options == nullptr) return nullptr;
    auto call = std::make_shared<Call>();
    const Py_ssize_t n = PyTuple_GET_SIZE(args);
    call->inputs.reserve(static_cast<size_t>(n));
    std::vector<std::pair<Py_ssize_t, uint32_t>> versions;  // tensor inputs' versions before the forward
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* arg = PyTuple_GET_ITEM(args, i);
      call->inputs.push_back(save_arg(arg, options->storage));
      if (THPVariable_Check(arg)) versions.emplace_back(i, THPVariable_Unpack(arg)._version());
    }
    // Begun after its inputs are saved (frame.h: how an enclosing frame sees a nested one).
    auto frame = std::make_shared<ck::Frame>(py::cast<std::string>(argv[4]), options->early_stop);
    if (!ck::saved_tensor_hooks_active()) frame->keep_free_tensors(inputs_kept_as_they_are(args, kwargs, *call));
    call->fn = std::make_unique<PyRef>(fn);
    if (kwargs != nullptr) call->kwargs = std::make_unique<PyRef>(kwargs);
    call->runs = ck::SegmentRuns::begin(devices_of(args, kwargs), *options);
    frame->set_recompute([call](ck::Frame& f, int64_t graph_task) { replay(call, f, graph_task); });
    PyObject* out = call->runs.forward(frame->name(), [&] {
      PyObject* pack = PyCFunction_New(&pack_def, capsule_of<FramePtr>(frame, kFrame));
      Py_DECREF(PyCFunction_GET_SELF(pack));
      PyObject* unpack = module_hook(unpack_def);
      Py_INCREF(unpack);
      return with_hooks(pack, unpack, [&] { return PyObject_Call(fn, args, kwargs); });
    });
    if (out == nullptr) return nullptr;
    frame->finish_forward(tensors_in(out));
    check_inputs_unchanged(args, versions, frame->name());
    return out;
  } catch (...) {
    set_python_error();
    return nullptr;
  }
}

PyMethodDef run_def{"run", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(run)), METH_FASTCALL,
                    "run(fn, args, kwargs, options, name): fn(*args, **kwargs) checkpointed. Its forward keeps only "
                    "its inputs (args' tensors under the storage policy, kwargs as they are) and builds the graph "
                    "around placeholders; its backward replays it. options: native_options(CheckpointOptions); "
                    "name: the segment's, for errors."};

}  // namespace

void bind_checkpoint(py::module_& m) {
  auto sub = m.def_submodule("checkpoint", "segment checkpointing (internal; use torch_ext.checkpoint)");
  checkpoint_error_type = py::exception<ck::CheckpointError>(sub, "CheckpointError", PyExc_RuntimeError).ptr();
  Py_INCREF(checkpoint_error_type);
  stop_type = py::exception<ck::StopRecomputation>(sub, "_StopRecomputation").ptr();
  Py_INCREF(stop_type);
  // A C++ frame's error in a backward raised as Python's CheckpointError: torch's engine keeps a
  // python_error's exception as it is (persisted here, for whichever thread rethrows it).
  ck::set_checkpoint_error_translator([](const ck::CheckpointError& error) {
    py::gil_scoped_acquire gil;
    PyErr_SetString(checkpoint_error_type, error.what());
    python_error translated;
    translated.persist();
    throw translated;
  });
  sub.add_object("run", py::reinterpret_steal<py::object>(PyCFunction_New(&run_def, nullptr)));
  sub.def(
      "native_options",
      [](const py::handle& options) {
        static const auto type = c10::getCustomClassType<OptionsObject>();
        ck::CheckpointOptions copy =
            torch::jit::toIValue(options, type).toCustomClass<torch_ext::Boxed<ck::CheckpointOptions>>()->value;
        return py::reinterpret_steal<py::object>(capsule_of(std::move(copy), kOptions));
      },
      py::arg("options"), "The C++ options of a torch.classes.torch_ext.CheckpointOptions, for run()");
  sub.def(
      "probe",
      [](const py::function& fn, std::vector<std::string> items) {
        const ck::SaveSpec spec(std::move(items));
        ck::SavedOutputs saved;
        static const std::string kName = "probe";  // outlives the scope, which keeps a reference
        {
          ck::SelectiveScope scope(spec.policy().get(), &saved, ck::SelectiveScope::Mode::kProbe, kName);
          fn();
        }
        return saved.probed;
      },
      py::arg("fn"), py::arg("items"),
      "Runs fn() and lists each call of the ops `items` name as the native policy counts them: (op as "
      "'aten::mm.default', occurrence in its item's group, bytes of its outputs' storages; -1 where a later op of fn "
      "changed the output in place)");
  sub.def("mark_hooks_transparent", &ck::mark_python_hooks_transparent,
          "Marks the saved-tensor hooks just pushed on this thread as returning every tensor as it is "
          "(torch_ext.memory.track's): checkpoints under them keep what they keep without them");
  sub.def("unmark_hooks_transparent", &ck::unmark_python_hooks_transparent,
          "Undoes mark_hooks_transparent, before those hooks are popped");
  sub.def(
      "save_rules",
      [](std::vector<std::string> items) {
        py::list rules;
        for (const auto& rule : ck::save_rules(ck::SaveSpec(std::move(items)))) {
          rules.append(py::make_tuple(rule.op, rule.group, rule.every, rule.occurrences));
        }
        return rules;
      },
      py::arg("items"),
      "The `save` option's rules: (op as 'aten::mm.default', group, every, occurrences) per op; the ops of one "
      "group are counted together, and occurrence k (from 0) of a group is saved when it is in occurrences, or "
      "(k + 1) % every == 0 when occurrences is empty");
}
