// The native execution plan: replays a recorded call of an opweave plan without Python.
//
// runtime/native.py records one call of an Executor: every ATen/dispatcher operator it
// ran (with its arguments, as a boxed stack) and every generated kernel (a C function
// over raw pointers). A Plan holds those instructions over numbered slots; run() checks
// that the inputs have the recorded sizes, strides, dtypes and device (the Python steps
// decided on those), then executes the instructions, dropping each slot after its last
// use. On any mismatch it returns None and the caller runs the Python plan.
//
// A plan may also be given stages (schedule/concurrent.py, IOS): each stage runs its
// groups of instructions at once, each on one thread of the calling thread's OpenMP team,
// and joins before the next stage.
//
// A plan may keep the calling thread's OpenMP workers off the CPU the caller runs on
// (`set_workers_apart`, Options.workers; WorkersApart below says why).
#include <ATen/Functions.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/ScalarOps.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

// The OpenMP runtime and MKL torch itself loaded (resolved through libtorch_cpu): a
// thread's team size for OpenMP regions (generated kernels, ATen, oneDNN) and for MKL.
// Weak: a torch built without OpenMP or MKL loads this module all the same; stages then
// run their groups one after another, and team sizes are left alone.
extern "C" {
void omp_set_num_threads(int) __attribute__((weak));
int omp_get_max_threads(void) __attribute__((weak));
int omp_get_num_threads(void) __attribute__((weak));
int omp_get_thread_num(void) __attribute__((weak));
int omp_get_level(void) __attribute__((weak));
int omp_get_proc_bind(void) __attribute__((weak));  // an enum whose 0 is omp_proc_bind_false
void GOMP_parallel(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags)
    __attribute__((weak));
// mkl_service.h spells mkl_set_num_threads_local so (the lower-case symbol is Fortran's, by pointer)
int MKL_Set_Num_Threads_Local(int) __attribute__((weak));
}

namespace py = pybind11;

namespace {

// This thread's thread count for OpenMP and MKL, restored when the guard ends.
class TeamSize {
 public:
  explicit TeamSize(int threads) {
    if (omp_get_max_threads && omp_set_num_threads) {
      omp_ = omp_get_max_threads();
      omp_set_num_threads(threads);
    }
    if (MKL_Set_Num_Threads_Local) mkl_ = MKL_Set_Num_Threads_Local(threads);
  }
  ~TeamSize() {
    if (omp_ > 0) omp_set_num_threads(omp_);
    if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(mkl_);
  }
  TeamSize(const TeamSize&) = delete;
  TeamSize& operator=(const TeamSize&) = delete;

 private:
  int omp_ = 0, mkl_ = 0;
};

// Runs the tasks at once, one per thread of an OpenMP team: the calling thread's own
// team, whose threads wait spinning between parallel regions. (A pool of other threads
// competed with those spinning threads for the cores: concurrent stages took twice their
// time.) Inside the region ATen, oneDNN, MKL and the generated kernels run each task on its
// thread alone, so a concurrent stage gives each group one thread.
void run_together(const std::vector<std::function<void()>>& tasks) {
  struct Shared {
    const std::vector<std::function<void()>>* tasks;
    std::vector<std::exception_ptr> errors;
  } shared{&tasks, std::vector<std::exception_ptr>(tasks.size())};
  if (!GOMP_parallel || !omp_get_num_threads || !omp_get_thread_num) {
    for (const auto& task : tasks) task();  // no OpenMP: one after another
    return;
  }
  GOMP_parallel(
      [](void* data) {
        auto* s = static_cast<Shared*>(data);
        size_t n = static_cast<size_t>(omp_get_num_threads());  // fewer if nested
        for (size_t i = omp_get_thread_num(); i < s->tasks->size(); i += n) {
          try {
            (*s->tasks)[i]();
          } catch (...) {
            s->errors[i] = std::current_exception();
          }
        }
      },
      &shared, static_cast<unsigned>(tasks.size()), 0);
  for (auto& e : shared.errors) {
    if (e) std::rethrow_exception(e);
  }
}

// Keeps the OpenMP workers of the calling thread's team off the CPU that thread is on.
//
// Why: a call that starts after an idle gap wakes its workers, and on the KVM guests this
// project runs on, the guest's scheduler often woke a worker onto the caller's own vCPU
// though the other one was idle (likely because the host had descheduled that one). The
// caller then spins at the region's barrier waiting for a worker queued behind it until
// a scheduler tick preempts it: an empty 2-thread region after a 50 ms pause took 3.0-5.7
// ms when that happened (3 of 8), against 0.06-0.08 ms with the worker kept on the other
// vCPU (8 of 8); XML-CNN's bf16 call after a 100 ms pause took 11.7-11.8 ms (median)
// against 1.3-1.5 kept apart (AMD EPYC Zen 4, 2 vCPUs; docs/runtime.md). A worker sharing
// the caller's CPU never helps it: the caller spins at the barrier until it is done.
//
// How: the workers' thread ids are learned with one region per team size (libgomp keeps
// a team's threads by position across regions), and their affinity (every CPU the caller
// may use but its own) is set again only when the caller is found on another CPU at a
// call's start or end, after checking that the ids are still this process's threads (a
// smaller multi-thread team ends the threads past its size and a larger one starts new
// ones: a team of more than two has its last worker checked on every call). Most calls
// cost two sched_getcpu. The CPUs are those the caller could use when the team was
// learned. The setting stays after the call: torch's own regions on this thread gain from
// it too, until the caller moves onto the workers' CPUs (on 2 CPUs, the one they may use)
// between calls; the next call places them again. Left alone: a team of more than
// kLargestTeam threads or more than the CPUs the caller may use, a caller inside a
// parallel region, any forked process (libgomp's pool does not survive a fork if the
// parent used it: a region there never returns, and whether it did cannot be told),
// another OpenMP runtime than libgomp, and placement the user chose (OMP_PROC_BIND,
// OMP_PLACES, GOMP_CPU_AFFINITY, KMP_AFFINITY set, or the runtime binding its threads).
class WorkersApart {
 public:
  // Places this thread's team for a call; whether its workers are kept apart.
  static bool apply() {
#ifdef __linux__
    static const bool usable = runtime_allows();
    if (!usable || forked_ || (omp_get_level && omp_get_level() > 0)) return false;
    thread_local WorkersApart state;
    return state.place(at::get_num_threads(), sched_getcpu());
#else
    return false;
#endif
  }

  // From the module's loading on, a forked child knows it is one; `forked()` says so for a
  // process that was forked before the module was loaded (runtime/native.py knows).
  static void watch_forks() {
#ifdef __linux__
    pthread_atfork(nullptr, nullptr, [] { forked_ = true; });
#endif
  }
  static void forked() {
#ifdef __linux__
    forked_ = true;
#endif
  }

 private:
#ifdef __linux__
  // libgomp's entry points are there, and nothing in the environment places threads.
  static bool runtime_allows() {
    if (!omp_get_max_threads || !GOMP_parallel || !omp_get_thread_num) return false;
    for (const char* name : {"OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY"}) {
      if (std::getenv(name)) return false;
    }
    if (omp_get_proc_bind && omp_get_proc_bind() != 0) return false;  // omp_proc_bind_false
    Dl_info info;
    if (!dladdr(reinterpret_cast<void*>(GOMP_parallel), &info) || !info.dli_fname ||
        !std::strstr(info.dli_fname, "libgomp")) {
      return false;  // Intel's OpenMP offers GOMP_parallel too, with another thread pool
    }
    return true;
  }

  bool place(int team, int cpu) {
    if (team < 2 || team > kLargestTeam || cpu < 0) return false;
    if (team != team_) learn(team);
    if (!usable_) return false;
    // a team of two never loses its worker; a larger one may have been remade since
    if (cpu == cpu_ && (team == 2 || alive(workers_.back()))) return true;
    if (!std::all_of(workers_.begin(), workers_.end(), alive)) {
      learn(team);  // remade: a smaller multi-thread team ran since
      if (!usable_) return false;
    }
    cpu_set_t others = allowed_;
    CPU_CLR(cpu, &others);
    if (CPU_COUNT(&others) == 0) return false;
    for (pid_t tid : workers_) {
      if (sched_setaffinity(tid, sizeof others, &others) != 0) {
        // a thread ended, or the CPUs the process may use changed: learn again at the
        // next call, three times at most before leaving the team alone for its size
        cpu_ = -1;
        if (++failures_ < 3) {
          team_ = 0;
        } else {
          usable_ = false;
        }
        return false;
      }
    }
    failures_ = 0;
    cpu_ = cpu;
    return true;
  }

  // The team's worker thread ids (positions 1..team-1), and whether they may be placed:
  // not when the caller may use fewer CPUs than the team has threads, nor when the region
  // ran fewer threads than asked (neither is learned again until the team size changes).
  void learn(int team) {
    team_ = team;
    cpu_ = -1;
    usable_ = false;
    workers_.clear();
    if (sched_getaffinity(0, sizeof allowed_, &allowed_) != 0 || CPU_COUNT(&allowed_) < team) {
      return;
    }
    std::vector<pid_t> ids(team, 0);
    GOMP_parallel(
        [](void* data) {
          static_cast<pid_t*>(data)[omp_get_thread_num()] = static_cast<pid_t>(syscall(SYS_gettid));
        },
        ids.data(), static_cast<unsigned>(team), 0);
    workers_.assign(ids.begin() + 1, ids.end());
    usable_ = std::find(workers_.begin(), workers_.end(), 0) == workers_.end();
  }

  // Whether `tid` is a thread of this process still (a signal 0 checks, sends nothing).
  static bool alive(pid_t tid) {
    return tid > 0 && syscall(SYS_tgkill, getpid(), tid, 0) == 0;
  }

  // Each move of the caller costs a system call per worker (2 us each, the Zen 4): left
  // alone above this, where a worker also has more CPUs to be woken on.
  static constexpr int kLargestTeam = 8;
  static inline std::atomic<bool> forked_{false};
  int failures_ = 0;
  int team_ = 0;
  int cpu_ = -1;  // the caller's CPU the workers were last kept off
  bool usable_ = false;
  cpu_set_t allowed_{};
  std::vector<pid_t> workers_;
#endif
};

// For one call: places the team when `on` (at the start, and again at the end if the
// caller moved meanwhile, so that what runs on this thread next finds them apart), and
// says in `placed` whether it did.
class KeptApart {
 public:
  KeptApart(bool on, std::atomic<bool>& placed) : on_(on), placed_(placed) {
    if (on_) placed_ = WorkersApart::apply();
  }
  ~KeptApart() {
    if (on_) WorkersApart::apply();
  }
  KeptApart(const KeptApart&) = delete;
  KeptApart& operator=(const KeptApart&) = delete;

 private:
  bool on_;
  std::atomic<bool>& placed_;
};

// What one group of a stage runs: instructions in order, each with the slots dropped
// after it (the group's own last uses), on `threads` threads.
struct Group {
  std::vector<int> instructions;
  std::vector<std::vector<int>> frees;
  int threads = 1;
};

struct Stage {
  std::vector<Group> groups;
  std::vector<int> frees;  // slots several groups touched, dropped once all are done
};

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
  // a view computed without the dispatcher's boxing: slot `source` restrided (`sizes`,
  // `strides`, its storage offset plus `offset`) into `outputs[0]`; -1 there: dead
  bool is_view = false;
  // a fresh tensor: torch.empty_strided(sizes, strides, dtype) into `outputs[0]`
  bool is_empty = false;
  int source = -1;
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  c10::ScalarType dtype = c10::ScalarType::Float;
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

  // A view of slot `source` (a view operator's result, the recorded call's sizes and
  // strides, `offset` elements past the source's storage offset) into slot `output`
  // (-1: nothing reads it, so nothing runs).
  void add_view(int source, std::vector<int64_t> sizes, std::vector<int64_t> strides,
                int64_t offset, int output) {
    Instruction ins;
    ins.is_view = true;
    ins.source = source;
    ins.sizes = std::move(sizes);
    ins.strides = std::move(strides);
    ins.offset = offset;
    ins.outputs = {output};
    instructions_.push_back(std::move(ins));
  }

  // A fresh CPU tensor of the recorded sizes and strides, of `like`'s type, into slot
  // `output`.
  void add_empty(std::vector<int64_t> sizes, std::vector<int64_t> strides,
                 const at::Tensor& like, int output) {
    Instruction ins;
    ins.is_empty = true;
    ins.sizes = std::move(sizes);
    ins.strides = std::move(strides);
    ins.dtype = like.scalar_type();
    ins.outputs = {output};
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
    std::vector<at::Tensor> slots;
    if (!admit(inputs, slots)) return py::none();
    auto stages = active();
    {
      py::gil_scoped_release released;
      KeptApart apart(workers_apart_, placed_);
      if (stages) {
        execute_stages(*stages, slots);
      } else {
        execute(slots);
      }
    }
    return outputs(slots);
  }

  // Runs the plan one instruction after another on `threads` threads and returns each
  // instruction's wall time in seconds (None when the inputs are not the recorded kind):
  // the cost of every step at that thread count, measured in place.
  py::object timed(const py::sequence& inputs, int threads) {
    std::vector<at::Tensor> slots;
    if (!admit(inputs, slots)) return py::none();
    std::vector<double> seconds(instructions_.size());
    {
      py::gil_scoped_release released;
      (void)at::get_num_threads();  // torch's per-thread setting made first, not after TeamSize
      TeamSize team(threads);
      KeptApart apart(workers_apart_, placed_);
      std::vector<void*> pointers;
      for (size_t i = 0; i < instructions_.size(); ++i) {
        auto start = std::chrono::steady_clock::now();
        execute_one(instructions_[i], slots, pointers);
        seconds[i] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        for (int s : instructions_[i].frees) slots[s] = at::Tensor();
      }
    }
    return py::cast(seconds);
  }

  // The stages set by set_stages, run once on these inputs without switching calls to
  // them: (the outputs, each stage's wall time in seconds), or None when the inputs are
  // not the recorded kind. To check the stages before any other thread's call runs them,
  // and to time them stage by stage (what `explain` shows beside the estimates).
  py::object run_stages(const py::sequence& inputs) {
    std::shared_ptr<const std::vector<Stage>> stages;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stages = stages_;
    }
    TORCH_CHECK(stages, "this plan has no stages");
    std::vector<at::Tensor> slots;
    if (!admit(inputs, slots)) return py::none();
    std::vector<double> seconds;
    {
      py::gil_scoped_release released;
      KeptApart apart(workers_apart_, placed_);
      execute_stages(*stages, slots, &seconds);
    }
    return py::make_tuple(outputs(slots), py::cast(seconds));
  }

  // Stages for calls to run once `use_stages(true)`: per stage, per group (instructions, the
  // slots dropped after each, threads), and the slots dropped after the stage.
  void set_stages(const std::vector<std::vector<std::tuple<std::vector<int>,
                      std::vector<std::vector<int>>, int>>>& stages,
                  const std::vector<std::vector<int>>& stage_frees) {
    auto built = std::make_shared<std::vector<Stage>>();
    for (size_t k = 0; k < stages.size(); ++k) {
      Stage stage;
      for (const auto& [instructions, frees, threads] : stages[k]) {
        TORCH_CHECK(frees.size() == instructions.size(), "each instruction needs its frees");
        for (int i : instructions) {
          TORCH_CHECK(i >= 0 && i < size(), "stage ", k, " names instruction ", i);
        }
        stage.groups.push_back({instructions, frees, std::max(threads, 1)});
      }
      stage.frees = stage_frees.at(k);
      built->push_back(std::move(stage));
    }
    std::lock_guard<std::mutex> lock(mutex_);
    stages_ = std::move(built);
    active_ = nullptr;
  }

  // Whether calls run the stages (true) or the instructions in recorded order (false).
  // Safe while other threads call run: each call runs the one or the other whole.
  void use_stages(bool on) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!on || stages_, "this plan has no stages");
    active_ = on ? stages_ : nullptr;
  }

  bool staged() const { return active() != nullptr; }

  // Whether calls keep the caller's OpenMP workers off its CPU (WorkersApart).
  void set_workers_apart(bool on) { workers_apart_ = on; }

  // Whether the last call's workers were kept off the caller's CPU.
  bool workers_kept_apart() const { return placed_; }

 private:
  py::list outputs(const std::vector<at::Tensor>& slots) const {
    py::list result;
    for (int s : outputs_) result.append(py::cast(slots[s]));
    return result;
  }

  // The call's slots with the inputs in place, or false when they are not the recorded kind.
  bool admit(const py::sequence& inputs, std::vector<at::Tensor>& slots) const {
    if (static_cast<size_t>(py::len(inputs)) != guards_.size()) return false;
    slots.assign(num_slots_, at::Tensor());
    bool grad = at::GradMode::is_enabled();
    for (size_t i = 0; i < guards_.size(); ++i) {
      PyObject* obj = inputs[i].ptr();
      if (!THPVariable_Check(obj)) return false;
      const at::Tensor& t = THPVariable_Unpack(obj);
      const InputGuard& g = guards_[i];
      if (t.layout() != at::kStrided || t.device() != g.device || t.scalar_type() != g.dtype ||
          t.sizes() != c10::IntArrayRef(g.sizes) || t.strides() != c10::IntArrayRef(g.strides) ||
          (grad && t.requires_grad())) {
        return false;
      }
      slots[i] = t;
    }
    for (const auto& [slot, tensor] : constants_) slots[slot] = tensor;
    return true;
  }

  void execute(std::vector<at::Tensor>& slots) const {
    std::vector<void*> pointers;
    for (const Instruction& ins : instructions_) {
      execute_one(ins, slots, pointers);
      for (int s : ins.frees) slots[s] = at::Tensor();
    }
  }

  void execute_group(const Group& group, std::vector<at::Tensor>& slots) const {
    std::vector<void*> pointers;
    for (size_t k = 0; k < group.instructions.size(); ++k) {
      execute_one(instructions_[group.instructions[k]], slots, pointers);
      for (int s : group.frees[k]) slots[s] = at::Tensor();
    }
  }

  std::shared_ptr<const std::vector<Stage>> active() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return active_;
  }

  void execute_stages(const std::vector<Stage>& stages, std::vector<at::Tensor>& slots,
                      std::vector<double>* times = nullptr) const {
    for (const Stage& stage : stages) {
      auto start = std::chrono::steady_clock::now();
      if (stage.groups.size() == 1) {
        const Group& only = stage.groups[0];
        if (!omp_get_max_threads || only.threads == omp_get_max_threads()) {
          execute_group(only, slots);
        } else {
          TeamSize team(only.threads);
          execute_group(only, slots);
        }
      } else {
        at::ThreadLocalState state;  // grad mode, dispatch keys: the caller's, in every group
        std::vector<std::function<void()>> tasks;
        for (const Group& group : stage.groups) {
          tasks.emplace_back([this, &group, &slots, &state] {
            at::ThreadLocalStateGuard guard(state);
            TeamSize team(group.threads);
            execute_group(group, slots);
          });
        }
        run_together(tasks);
      }
      for (int s : stage.frees) slots[s] = at::Tensor();
      if (times) {
        times->push_back(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
    }
  }

  void execute_one(const Instruction& ins, std::vector<at::Tensor>& slots,
                   std::vector<void*>& pointers) const {
    if (ins.is_view) {
      if (ins.outputs[0] >= 0) {
        const at::Tensor& source = slots[ins.source];
        slots[ins.outputs[0]] =
            source.as_strided(ins.sizes, ins.strides, source.storage_offset() + ins.offset);
      }
    } else if (ins.is_empty) {
      slots[ins.outputs[0]] = at::empty_strided(ins.sizes, ins.strides, at::TensorOptions().dtype(ins.dtype));
    } else if (ins.is_kernel) {
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
  std::atomic<bool> workers_apart_{false};
  std::atomic<bool> placed_{false};  // by the last call
  mutable std::mutex mutex_;  // guards the two below
  std::shared_ptr<const std::vector<Stage>> stages_;  // set by set_stages
  std::shared_ptr<const std::vector<Stage>> active_;  // what calls run: stages_ or none
};

// Seconds one fork and join of `groups` empty groups takes (median of `repeats`): the
// price of a concurrent stage beyond its slowest group.
double fork_join_seconds(int groups, int repeats) {
  std::vector<std::function<void()>> tasks(std::max(groups, 2), [] {});
  std::vector<double> times;
  py::gil_scoped_release released;
  for (int r = 0; r < std::max(repeats, 1); ++r) {
    auto start = std::chrono::steady_clock::now();
    run_together(tasks);
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

// What a sequence of CPU tensors looked like when a plan was built from them (the native
// form of frontends/weights.TensorStamp, with the same checks): the same tensor objects,
// the same version counters, the same sizes, strides and storage, and the same bytes in
// each one's middle element (which sees writes through `.data`, whose version counter is
// separate). It runs before every call, just after the previous call streamed the model's
// weights through the caches, so the tensors' metadata and middle elements are all cold:
// checked one tensor at a time, ResNet-50's 318 took 150 us (a Zen 4, 2 threads; 20 back
// to back), each check waiting on the one before. So the checks go in passes over all the
// tensors, each pass's loads independent of one another, the first prefetching.
class Stamp {
 public:
  explicit Stamp(const std::vector<at::Tensor>& tensors) : tensors_(tensors) {
    for (const at::Tensor& t : tensors_) {
      TORCH_CHECK(t.device().is_cpu(), "a native stamp takes CPU tensors only");
      impls_.push_back(t.unsafeGetTensorImpl());
      versions_.push_back(t._version());
      bool strided = t.layout() == at::kStrided;
      layout_at_.push_back(strided ? layouts_.size() : kNotStrided);
      if (strided) {  // dims, sizes, strides: one array for all, read in order
        layouts_.push_back(t.dim());
        layouts_.insert(layouts_.end(), t.sizes().begin(), t.sizes().end());
        layouts_.insert(layouts_.end(), t.strides().begin(), t.strides().end());
      }
      pointers_.push_back(strided ? t.data_ptr() : nullptr);
      const char* sample = strided ? middle_element(t) : nullptr;
      sample_at_.push_back(sample);
      samples_.emplace_back(sample, sample ? sample + t.element_size() : sample);
    }
  }

  bool matches(const py::sequence& current) const {
    py::object items = fast(current);
    if (static_cast<size_t>(PySequence_Fast_GET_SIZE(items.ptr())) != tensors_.size()) return false;
    return same(PySequence_Fast_ITEMS(items.ptr()));
  }

  // matches([table.get(key) for table, key in zip(tables, keys)] + others): the tensors
  // found again in a module's _parameters/_buffers tables (frontends/weights.WeightWatch),
  // looked up here, the tables prefetched first (they are as cold as the tensors).
  bool matches_entries(const py::sequence& tables, const py::sequence& keys,
                       const py::sequence& others) const {
    py::object table_list = fast(tables), key_list = fast(keys), other_list = fast(others);
    size_t n = static_cast<size_t>(PySequence_Fast_GET_SIZE(table_list.ptr()));
    size_t m = static_cast<size_t>(PySequence_Fast_GET_SIZE(other_list.ptr()));
    if (static_cast<size_t>(PySequence_Fast_GET_SIZE(key_list.ptr())) != n ||
        n + m != tensors_.size()) {
      return false;
    }
    PyObject** table_at = PySequence_Fast_ITEMS(table_list.ptr());
    PyObject** key_at = PySequence_Fast_ITEMS(key_list.ptr());
    for (size_t i = 0; i < n; ++i) __builtin_prefetch(table_at[i]);
    for (size_t i = 0; i < n; ++i) {  // and their hash tables (a module's are small)
      if (PyDict_CheckExact(table_at[i])) {
        const char* entries = reinterpret_cast<const char*>(
            reinterpret_cast<PyDictObject*>(table_at[i])->ma_keys);
        for (int line = 0; line < 4; ++line) __builtin_prefetch(entries + 64 * line);
      }
    }
    std::vector<PyObject*> items(n + m);
    for (size_t i = 0; i < n; ++i) {
      if (!PyDict_Check(table_at[i])) {
        throw py::type_error("a stamp looks tensors up in dicts (a module's _parameters)");
      }
      PyObject* found = PyDict_GetItemWithError(table_at[i], key_at[i]);
      if (found == nullptr) {
        if (PyErr_Occurred()) throw py::error_already_set();
        return false;  // the entry was removed
      }
      items[i] = found;
    }
    PyObject** other_at = PySequence_Fast_ITEMS(other_list.ptr());
    for (size_t j = 0; j < m; ++j) items[n + j] = other_at[j];
    return same(items.data());
  }

 private:
  // `sequence` as a list or tuple whose items can be read in place
  static py::object fast(const py::sequence& sequence) {
    py::object items = py::reinterpret_steal<py::object>(
        PySequence_Fast(sequence.ptr(), "a stamp compares sequences"));
    if (!items) throw py::error_already_set();
    return items;
  }

  bool same(PyObject* const* items) const {
    const size_t n = tensors_.size();
    for (size_t i = 0; i < n; ++i) {
      __builtin_prefetch(items[i]);
      const char* impl = reinterpret_cast<const char*>(impls_[i]);
      for (size_t line = 0; line < sizeof(c10::TensorImpl); line += 64) {
        __builtin_prefetch(impl + line);
      }
      if (sample_at_[i] != nullptr) __builtin_prefetch(sample_at_[i]);
    }
    for (size_t i = 0; i < n; ++i) {  // the same tensors
      if (!THPVariable_Check(items[i]) ||
          THPVariable_Unpack(items[i]).unsafeGetTensorImpl() != impls_[i]) {
        return false;
      }
    }
    for (size_t i = 0; i < n; ++i) {  // what the next checks read through the tensors
      // (a VariableVersion is one pointer to its counter)
      static_assert(sizeof(c10::VariableVersion) == sizeof(void*), "a version counter's layout");
      __builtin_prefetch(*reinterpret_cast<void* const*>(&impls_[i]->version_counter()));
      if (impls_[i]->has_storage()) {
        __builtin_prefetch(impls_[i]->unsafe_storage().unsafeGetStorageImpl());
      }
    }
    for (size_t i = 0; i < n; ++i) {  // not written in place (autograd's counter)
      if (tensors_[i]._version() != versions_[i]) return false;
    }
    for (size_t i = 0; i < n; ++i) {  // the same layout and storage
      const at::Tensor& t = tensors_[i];
      if ((t.layout() == at::kStrided) != (layout_at_[i] != kNotStrided)) return false;
      if (layout_at_[i] == kNotStrided) continue;  // sparse: identity and version only
      const int64_t* was = layouts_.data() + layout_at_[i];
      const int64_t dim = was[0];
      if (t.dim() != dim || t.sizes() != c10::IntArrayRef(was + 1, dim) ||
          t.strides() != c10::IntArrayRef(was + 1 + dim, dim) || t.data_ptr() != pointers_[i]) {
        return false;
      }
    }
    for (size_t i = 0; i < n; ++i) {  // the same middle element (writes through `.data`)
      // (the same sizes, strides and data pointer: the same element, at `sample_at_`)
      const std::string& sample = samples_[i];
      if (!sample.empty() && std::memcmp(sample_at_[i], sample.data(), sample.size()) != 0) {
        return false;
      }
    }
    return true;
  }

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
  std::vector<const c10::TensorImpl*> impls_;
  std::vector<int64_t> versions_;
  std::vector<int64_t> layouts_;     // per strided tensor: its dims, sizes, strides
  std::vector<size_t> layout_at_;    // where each tensor's are in `layouts_`
  static constexpr size_t kNotStrided = static_cast<size_t>(-1);
  std::vector<const void*> pointers_;
  std::vector<const char*> sample_at_;
  std::vector<std::string> samples_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  WorkersApart::watch_forks();
  py::class_<Plan>(m, "Plan")
      .def(py::init<const std::vector<at::Tensor>&>())
      .def("add_op", &Plan::add_op)
      .def("add_kernel", &Plan::add_kernel)
      .def("add_view", &Plan::add_view)
      .def("add_empty", &Plan::add_empty)
      .def("add_constant", &Plan::add_constant)
      .def("set_frees", &Plan::set_frees)
      .def("set_outputs", &Plan::set_outputs)
      .def("set_slots", &Plan::set_slots)
      .def("__len__", &Plan::size)
      .def("run", &Plan::run)
      .def("timed", &Plan::timed)
      .def("run_stages", &Plan::run_stages)
      .def("set_stages", &Plan::set_stages)
      .def("use_stages", &Plan::use_stages)
      .def("set_workers_apart", &Plan::set_workers_apart)
      .def_property_readonly("workers_kept_apart", &Plan::workers_kept_apart)
      .def_property_readonly("staged", &Plan::staged);
  m.def("fork_join_seconds", &fork_join_seconds);
  m.def("note_forked", &WorkersApart::forked);
  py::class_<Stamp>(m, "Stamp")
      .def(py::init<const std::vector<at::Tensor>&>())
      .def("matches", &Stamp::matches)
      .def("matches_entries", &Stamp::matches_entries);
  m.def("key", []() { return std::string(OPWEAVE_NATIVE_KEY); });
}
