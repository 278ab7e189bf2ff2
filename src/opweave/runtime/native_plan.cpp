// The native execution plan: replays a recorded call of an opweave plan without Python.
//
// runtime/native.py records one call of an Executor: every ATen/dispatcher operator it
// ran (with its arguments, as a boxed stack) and every generated kernel (a C function
// over raw pointers). A Plan holds those instructions over numbered slots; run() checks
// that the inputs have the recorded sizes, strides, dtypes and device (the Python steps
// decided on those), then executes the instructions, dropping each slot after its last
// use. On any mismatch it returns None and the caller runs the Python plan.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ScalarOps.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

// A Python number where the schema wants a Tensor, as PyTorch's argument parser passes it:
// a 0-dim tensor marked as a wrapped number (which type promotion treats as a scalar).
// Dispatch modes see the plain number, so the recorded call has it that way.
py::object as_schema_argument(const c10::FunctionSchema& schema, size_t index, py::handle obj) {
  if (index >= schema.arguments().size() ||
      schema.arguments()[index].type()->kind() != c10::TypeKind::TensorType) {
    return py::reinterpret_borrow<py::object>(obj);
  }
  std::optional<c10::Scalar> scalar;
  PyObject* o = obj.ptr();
  if (PyBool_Check(o)) {
    scalar = c10::Scalar(o == Py_True);
  } else if (PyLong_Check(o)) {
    scalar = c10::Scalar(static_cast<int64_t>(PyLong_AsLongLong(o)));
  } else if (PyFloat_Check(o)) {
    scalar = c10::Scalar(PyFloat_AsDouble(o));
  } else if (PyComplex_Check(o)) {
    scalar = c10::Scalar(c10::complex<double>(PyComplex_RealAsDouble(o), PyComplex_ImagAsDouble(o)));
  }
  if (!scalar) return py::reinterpret_borrow<py::object>(obj);
  at::Tensor t = c10::scalar_to_tensor(*scalar);
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return py::cast(t);
}

// A place in a stack that holds a slot's tensor at run time: argument `index`, or
// element `element` of the list at `index`.
struct Ref {
  int index;
  int element;  // -1: the argument itself
  int slot;
};

struct Instruction {
  bool is_kernel = false;
  std::optional<c10::OperatorHandle> op;
  std::vector<c10::IValue> stack;  // the recorded arguments, slot tensors left in place
  std::vector<Ref> refs;
  std::vector<int> outputs;        // one slot per returned tensor (flattened), -1: unused
  void (*kernel)(void**) = nullptr;
  std::vector<int> kernel_slots;   // the kernel's pointer arguments, in order
  std::vector<int> frees;          // slots dropped after this instruction
};

struct InputGuard {
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype;
  c10::Device device;
};

class Plan {
 public:
  explicit Plan(const std::vector<at::Tensor>& examples) {
    for (const auto& t : examples) {
      guards_.push_back({t.sizes().vec(), t.strides().vec(), t.scalar_type(), t.device()});
    }
  }

  // An operator call: `name` and `overload` as in torch.ops; `slots` maps the slot of every
  // tensor of the call that is a value of the plan (not a constant) to that tensor as it
  // is while being recorded, so its places in the stack can be found by identity.
  void add_op(const std::string& name, const std::string& overload, py::tuple args,
              py::dict kwargs, py::dict slots, std::vector<int> outputs) {
    Instruction ins;
    ins.op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    const c10::FunctionSchema& schema = ins.op->schema();
    py::tuple positional(args.size());
    for (size_t i = 0; i < args.size(); ++i) {
      positional[i] = as_schema_argument(schema, i, args[i]);
    }
    py::kwargs kw;
    for (auto item : kwargs) {
      auto index = schema.argumentIndexWithName(py::cast<std::string>(item.first));
      kw[item.first] = index ? as_schema_argument(schema, *index, item.second)
                             : py::reinterpret_borrow<py::object>(item.second);
    }
    ins.stack = torch::jit::createStackForSchema(
        schema, torch::jit::tuple_slice(std::move(positional)), kw, std::nullopt);
    std::unordered_map<const c10::TensorImpl*, int> slot_of;
    for (auto item : slots) {
      slot_of[py::cast<at::Tensor>(item.second).unsafeGetTensorImpl()] = py::cast<int>(item.first);
    }
    auto find = [&](const at::Tensor& t) -> int {
      if (!t.defined()) return -1;
      auto it = slot_of.find(t.unsafeGetTensorImpl());
      return it == slot_of.end() ? -1 : it->second;
    };
    for (int i = 0; i < static_cast<int>(ins.stack.size()); ++i) {
      c10::IValue& v = ins.stack[i];
      if (v.isTensor()) {
        int s = find(v.toTensor());
        if (s >= 0) {
          ins.refs.push_back({i, -1, s});
          v = c10::IValue();  // never keep a recorded intermediate alive
        }
      } else if (v.isTensorList()) {
        auto list = v.toTensorList();
        for (int j = 0; j < static_cast<int>(list.size()); ++j) {
          int s = find(list.get(j));
          if (s >= 0) ins.refs.push_back({i, j, s});
        }
      } else if (v.isList()) {
        auto list = v.toList();
        for (int j = 0; j < static_cast<int>(list.size()); ++j) {
          c10::IValue e = list.get(j);
          if (e.isTensor()) {
            int s = find(e.toTensor());
            if (s >= 0) ins.refs.push_back({i, j, s});
          }
        }
      }
    }
    // Recorded intermediates inside lists are replaced at run time; drop them now.
    for (const Ref& r : ins.refs) {
      if (r.element < 0) continue;
      c10::IValue& v = ins.stack[r.index];
      if (v.isTensorList()) {
        auto list = v.toTensorList().copy();
        list.set(r.element, at::Tensor());
        v = list;
      } else {
        auto list = v.toList().copy();
        list.set(r.element, c10::IValue());
        v = list;
      }
    }
    ins.outputs = std::move(outputs);
    instructions_.push_back(std::move(ins));
  }

  void add_kernel(uintptr_t address, std::vector<int> slots) {
    Instruction ins;
    ins.is_kernel = true;
    ins.kernel = reinterpret_cast<void (*)(void**)>(address);
    ins.kernel_slots = std::move(slots);
    instructions_.push_back(std::move(ins));
  }

  // A tensor the recorded call read but no recorded operator made (a weight handed to a
  // kernel): put in its slot at the start of every run, never dropped.
  void add_constant(int slot, const at::Tensor& tensor) { constants_.emplace_back(slot, tensor); }

  void set_frees(int instruction, std::vector<int> frees) {
    instructions_.at(instruction).frees = std::move(frees);
  }

  void set_outputs(std::vector<int> outputs) { outputs_ = std::move(outputs); }

  void set_slots(int num_slots) { num_slots_ = num_slots; }

  int size() const { return static_cast<int>(instructions_.size()); }

  // The outputs as a list, or None when the inputs are not the recorded kind.
  py::object run(const py::sequence& inputs) {
    if (static_cast<size_t>(py::len(inputs)) != guards_.size()) return py::none();
    std::vector<at::Tensor> slots(num_slots_);
    bool grad = at::GradMode::is_enabled();
    for (size_t i = 0; i < guards_.size(); ++i) {
      PyObject* obj = inputs[i].ptr();
      if (!THPVariable_Check(obj)) return py::none();
      const at::Tensor& t = THPVariable_Unpack(obj);
      const InputGuard& g = guards_[i];
      if (t.layout() != at::kStrided || t.device() != g.device || t.scalar_type() != g.dtype ||
          t.sizes() != c10::IntArrayRef(g.sizes) || t.strides() != c10::IntArrayRef(g.strides) ||
          (grad && t.requires_grad())) {
        return py::none();
      }
      slots[i] = t;
    }
    for (const auto& [slot, tensor] : constants_) slots[slot] = tensor;
    {
      py::gil_scoped_release released;
      execute(slots);
    }
    py::list result;
    for (int s : outputs_) result.append(py::cast(slots[s]));
    return result;
  }

 private:
  void execute(std::vector<at::Tensor>& slots) {
    std::vector<void*> pointers;
    for (const Instruction& ins : instructions_) {
      if (ins.is_kernel) {
        pointers.resize(ins.kernel_slots.size());
        for (size_t i = 0; i < pointers.size(); ++i) {
          pointers[i] = slots[ins.kernel_slots[i]].data_ptr();
        }
        ins.kernel(pointers.data());
      } else {
        torch::jit::Stack stack = ins.stack;
        for (const Ref& r : ins.refs) {
          c10::IValue& v = stack[r.index];
          if (r.element < 0) {
            v = slots[r.slot];
          } else if (v.isTensorList()) {
            auto list = v.toTensorList().copy();
            list.set(r.element, slots[r.slot]);
            v = list;
          } else {
            auto list = v.toList().copy();
            list.set(r.element, slots[r.slot]);
            v = list;
          }
        }
        ins.op->callBoxed(stack);
        size_t k = 0;
        for (const c10::IValue& v : stack) {
          if (v.isTensor()) {
            assign(slots, ins.outputs, k++, v.toTensor());
          } else if (v.isTensorList()) {
            for (const at::Tensor& t : v.toTensorVector()) assign(slots, ins.outputs, k++, t);
          } else if (v.isNone()) {
            k++;
          }
        }
      }
      for (int s : ins.frees) slots[s] = at::Tensor();
    }
  }

  static void assign(std::vector<at::Tensor>& slots, const std::vector<int>& outputs, size_t k,
                     const at::Tensor& t) {
    if (k < outputs.size() && outputs[k] >= 0) slots[outputs[k]] = t;
  }

  int num_slots_ = 0;
  std::vector<InputGuard> guards_;
  std::vector<Instruction> instructions_;
  std::vector<int> outputs_;
  std::vector<std::pair<int, at::Tensor>> constants_;
};

// What a sequence of CPU tensors looked like when a plan was built from them (the native
// form of frontends/weights.TensorStamp, with the same checks): the same tensor objects,
// the same version counters, the same sizes, strides and storage, and the same bytes in
// each one's middle element (which sees writes through `.data`, whose version counter is
// separate).
class Stamp {
 public:
  explicit Stamp(const std::vector<at::Tensor>& tensors) : tensors_(tensors) {
    for (const at::Tensor& t : tensors_) {
      TORCH_CHECK(t.device().is_cpu(), "a native stamp takes CPU tensors only");
      versions_.push_back(t._version());
      bool strided = t.layout() == at::kStrided;
      sizes_.push_back(strided ? t.sizes().vec() : std::vector<int64_t>());
      strides_.push_back(strided ? t.strides().vec() : std::vector<int64_t>());
      pointers_.push_back(strided ? t.data_ptr() : nullptr);
      const char* sample = strided ? middle_element(t) : nullptr;
      samples_.emplace_back(sample, sample ? sample + t.element_size() : sample);
    }
  }

  bool matches(const py::sequence& current) const {
    if (static_cast<size_t>(py::len(current)) != tensors_.size()) return false;
    for (size_t i = 0; i < tensors_.size(); ++i) {
      PyObject* obj = current[i].ptr();
      if (!THPVariable_Check(obj)) return false;
      const at::Tensor& t = THPVariable_Unpack(obj);
      const at::Tensor& was = tensors_[i];
      if (t.unsafeGetTensorImpl() != was.unsafeGetTensorImpl() || t._version() != versions_[i]) {
        return false;
      }
      if (t.layout() != at::kStrided) continue;  // sparse: identity and version only
      if (t.sizes() != c10::IntArrayRef(sizes_[i]) || t.strides() != c10::IntArrayRef(strides_[i]) ||
          t.data_ptr() != pointers_[i]) {
        return false;
      }
      const std::string& sample = samples_[i];
      if (!sample.empty() && std::memcmp(middle_element(t), sample.data(), sample.size()) != 0) {
        return false;
      }
    }
    return true;
  }

 private:
  // The address of element numel/2 in row-major order (as TensorStamp samples it), or
  // null when there are no bytes to read (no elements, or storage without data).
  static const char* middle_element(const at::Tensor& t) {
    if (t.numel() == 0 || !t.has_storage() || t.data_ptr() == nullptr) return nullptr;
    int64_t rest = t.numel() / 2, offset = 0;
    for (int64_t d = t.dim() - 1; d >= 0; --d) {
      offset += (rest % t.size(d)) * t.stride(d);
      rest /= t.size(d);
    }
    int64_t bytes = static_cast<int64_t>(t.storage().nbytes());
    int64_t at = (t.storage_offset() + offset) * static_cast<int64_t>(t.element_size());
    if (at < 0 || at + static_cast<int64_t>(t.element_size()) > bytes) return nullptr;
    return static_cast<const char*>(t.data_ptr()) + offset * t.element_size();
  }

  std::vector<at::Tensor> tensors_;  // held, so an address is never reused while compared
  std::vector<int64_t> versions_;
  std::vector<std::vector<int64_t>> sizes_, strides_;
  std::vector<const void*> pointers_;
  std::vector<std::string> samples_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Plan>(m, "Plan")
      .def(py::init<const std::vector<at::Tensor>&>())
      .def("add_op", &Plan::add_op)
      .def("add_kernel", &Plan::add_kernel)
      .def("add_constant", &Plan::add_constant)
      .def("set_frees", &Plan::set_frees)
      .def("set_outputs", &Plan::set_outputs)
      .def("set_slots", &Plan::set_slots)
      .def("__len__", &Plan::size)
      .def("run", &Plan::run);
  py::class_<Stamp>(m, "Stamp")
      .def(py::init<const std::vector<at::Tensor>&>())
      .def("matches", &Stamp::matches);
  m.def("key", []() { return std::string(OPWEAVE_NATIVE_KEY); });
}
