"""`opweave.compile(model, example_inputs)`: capture with torch.export, compile, run.

Parameters and buffers are read as constants (this path is for inference). Where
torch.export cannot capture the model, opweave traces it with make_fx (tensors the model
holds, such as a sparse adjacency, become constants); where that fails too, or where the
model writes to its own buffers (BatchNorm in training mode), the model runs in eager
PyTorch and opweave says so once.

A compiled model computes what the eager model computes on the same call:
- calls are bound to `forward`'s signature, keywords included (see `binding`);
- a call whose Python values or argument structure differ from the example's gets a
  program compiled for it (torch.export bakes such values in), up to MAX_SPECIALIZATIONS,
  least recently used dropped;
- tensors must keep the example's shapes and dtypes (a clear error otherwise), except
  along the dims given as `torch.export.Dim`s in `dynamic_shapes`: those are captured as
  symbols, one program serves every size in their ranges (a plan per size, see
  `specializing`), and a call outside them gets a static program of its own, with one
  warning (`dynamic_inputs`);
- the output has the eager output's structure (tensor, tuple, dict, dataclass, ...);
- transformers' caches (`use_cache=True`, the default of decoder models) are captured as
  their tensors and returned as real cache objects; a cache passed in is updated in place,
  as eager does. Shapes are static, so one cache length is compiled per call structure
  and a decode loop's later steps run in eager, with one warning (see `caches`);
- weights are read as they are at compile time; when they change afterwards (an
  optimizer step, `load_state_dict`), the next call notices and recompiles, with one
  WeightsChangedWarning (see `weights` for what is detected).
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._dynamo.exc import UserError, UserErrorType

from ..codegen import int8
from ..ir.symbols import SymbolError
from ..options import Options
from ..runtime.executor import InputError
from . import caches
from .binding import (Binder, Spelling, call_key, check_tensor_types, flatten, is_flat,
                      tensor_leaves, tensor_types)
from .decompositions import decomposition_table, ops_kept_whole
from .dynamic_inputs import DynamicInputTypes, export_ranges
from .program import CompiledProgram, Coverage, OpweaveFallbackWarning
from .weights import WeightsChangedWarning, WeightWatch

_MODELS_DIMS = object()  # `_specialize`'s default: the dynamic_shapes the model was given
MAX_SPECIALIZATIONS = 8  # distinct calls (values, structure) kept compiled per model
# cache lengths compiled per call structure: a decode loop passes a longer cache at every
# step, and a compile per generated token would cost far more than it saves
MAX_CACHE_LENGTHS = 1


class _StateMutation(RuntimeError):
    """The model writes to its own parameters or buffers: no capture can compile that."""


@dataclass
class _Specialization:
    program: CompiledProgram | None  # None: the model runs in eager PyTorch
    capture: str                     # "export", "make_fx" or "eager"
    out_spec: pytree.TreeSpec | None = None
    capture_error: str = ""
    types: list | None = None        # the tensors' (shape, dtype, device, layout)
    watch: WeightWatch | None = None
    spelling: Spelling | None = None  # how the call it was compiled for spelled its arguments
    dynamic: DynamicInputTypes | None = None  # the sizes a program with symbols takes


class CompiledModel:
    """A model compiled by opweave; call it like the original module."""

    def __init__(self, model: torch.nn.Module, example_args: Sequence, example_kwargs=None, *,
                 name: str, options: Options | None = None, dynamic_shapes=None,
                 calibration=None):
        self.model = model
        self._calibration = calibration_calls(calibration)
        self.dynamic_shapes = dynamic_shapes
        self.name = name
        self._options = Options.resolve(options)
        caches.register()  # transformers' caches: outputs and inputs torch.export can flatten
        self._binder = Binder(model, name)
        self._cache: OrderedDict[Hashable, _Specialization] = OrderedDict()
        self._cache_lengths: dict[Hashable, set] = {}  # call key -> cache lengths compiled
        self._warned: set[str] = set()
        args, kwargs = tuple(example_args), dict(example_kwargs or {})
        key, lengths = _key(self._binder.canonical(args, kwargs))
        if lengths is not None:
            self._new_cache_length(key)  # the example's cache length is the one compiled
        self._current = self._specialize(key, args, kwargs, stacklevel=5, first=True)
        # the last call's program where it was tensors only, given positionally, and
        # the program took them as they came: a call like it skips binding (`_replay`)
        self._repeat: tuple[int, _Specialization] | None = None

    # -- what the most recent call ran -------------------------------------------------------
    @property
    def program(self) -> CompiledProgram | None:
        return self._current.program

    @property
    def capture(self) -> str:
        return self._current.capture

    @property
    def capture_error(self) -> str:
        return self._current.capture_error

    @property
    def coverage(self) -> Coverage:
        return self.program.coverage if self.program else Coverage()

    @property
    def graphs(self):
        return self.program.graphs if self.program else []

    def refresh(self) -> None:
        """Drop every compiled program: the next call compiles against the model's weights
        as they are then (needed after a change `weights.WeightWatch` cannot see)."""
        self._cache.clear()
        self._repeat = None

    # -- calling -------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        repeat = self._repeat
        if repeat is not None and not kwargs and len(args) == repeat[0]:
            outputs = self._replay(repeat[1], args)
            if outputs is not None:
                return outputs
        self._repeat = None
        canonical = self._binder.canonical(args, kwargs)
        key, lengths = _key(canonical)
        entry = self._cache.get(key) if key is not None else None
        if entry is None and lengths is not None and self._new_cache_length(key):
            entry = _Specialization(None, "eager", capture_error="a cache of a new length")
        elif entry is None:
            entry = self._specialize(key, args, kwargs)
        elif entry.watch is not None and entry.watch.changed():
            self._warn_once(f"the weights of {self.name} changed after it was compiled; opweave "
                            f"recompiles it (each change costs a compile)", WeightsChangedWarning)
            entry = self._specialize(key, args, kwargs)
        else:
            self._cache.move_to_end(key)
        self._current = entry
        if entry.program is None:
            return self.model(*args, **kwargs)
        tensors = entry.spelling.tensors(canonical)
        static = entry.dynamic is None
        flat = self._run_dynamic(entry, tensors) if entry.dynamic is not None else None
        if flat is None:
            if entry.dynamic is not None:  # sizes it does not take: a static program
                entry = self._current = self._static(key, tensors, args, kwargs)
                if entry.program is None:
                    return self.model(*args, **kwargs)
            check_tensor_types(self.name, entry.types, tensors)
            flat = entry.program.replay(tensors)
            if flat is None:
                flat = entry.program(*tensors)
            elif static and not kwargs and lengths is None and len(tensors) == len(args) \
                    and all(t is a for t, a in zip(tensors, args)):
                # it replayed: a call like it skips binding (not one the plan refuses,
                # such as a call under grad, which would check the weights twice)
                self._repeat = (len(args), entry)
        outputs = pytree.tree_unflatten(list(flat), entry.out_spec)
        return outputs if lengths is None else caches.carry_into_inputs(canonical, outputs)

    @staticmethod
    def _replay(entry: _Specialization, args: tuple):
        """The outputs of `entry`'s program straight from its native plan, or None where
        the call needs binding and checks (the weights changed, or the plan does not take
        these tensors: the plan checks their kinds). Positional tensors bind as the last
        call's did, so the call's key is the same. A call after the weights went through
        the caches finds the binding's Python cold: ResNet-50's took 170 us there against
        20 warm (Intel Xeon family 6 model 207), 2% of the call in bf16."""
        if entry.watch is not None and entry.watch.changed():
            return None
        flat = entry.program.replay(args)
        return None if flat is None else pytree.tree_unflatten(list(flat), entry.out_spec)

    def _run_dynamic(self, entry: _Specialization, tensors: list) -> list | None:
        """The program with symbols run on the call, or None (with one warning) when the
        call's sizes do not fit it."""
        why = entry.dynamic.misfit(self.name, tensors)
        if not why:
            try:
                return entry.program(*tensors)
            except SymbolError as err:  # sizes the symbolic graph does not hold for
                why = str(err)
        if "sizes outside dynamic_shapes" not in self._warned:  # one warning, the first why
            self._warned.add("sizes outside dynamic_shapes")
            warnings.warn(f"{self.name} was called with sizes its dynamic program does not "
                          f"take ({why}); opweave compiles a static program for each such "
                          f"size", OpweaveFallbackWarning, stacklevel=3)
        return None

    def _static(self, key, tensors: list, args: tuple, kwargs: dict) -> _Specialization:
        static_key = (key, tuple(tuple(t.shape) for t in tensors))
        entry = self._cache.get(static_key)
        if entry is None or (entry.watch is not None and entry.watch.changed()):
            return self._specialize(static_key, args, kwargs, dynamic_shapes=None)
        self._cache.move_to_end(static_key)
        return entry

    def _new_cache_length(self, key) -> bool:
        """Whether this call passes a cache of a length beyond those compiled for its call
        structure; such calls run in eager PyTorch, with one warning."""
        structure, length = key
        seen = self._cache_lengths.setdefault(structure, set())
        if length in seen or len(seen) < MAX_CACHE_LENGTHS:
            seen.add(length)
            return False
        self._warn_once(f"{self.name} was called with a cache of another length than the one "
                        f"opweave compiled; opweave compiles static shapes, so such calls (each "
                        f"step of a decode loop) run in eager PyTorch", OpweaveFallbackWarning)
        return True

    def _specialize(self, key, args: tuple, kwargs: dict, stacklevel: int = 3,
                    dynamic_shapes=_MODELS_DIMS, first: bool = False) -> _Specialization:
        """Compile for this call. `dynamic_shapes` the user gave that torch.export refuses
        are an error on the first compile; a later one (after a weight change, from a call
        of other sizes: a size of 1 fixes a dim) compiles for the call's sizes instead."""
        if key is None:
            self._warn_once(f"{self.name} was called with a value opweave cannot compare "
                            f"(not hashable); such calls run in eager PyTorch",
                            OpweaveFallbackWarning)
            return _Specialization(None, "eager", capture_error="an unhashable argument")
        if dynamic_shapes is _MODELS_DIMS:
            dynamic_shapes = self.dynamic_shapes
        entry = _compile(self.model, args, kwargs, self.name, stacklevel=stacklevel + 1,
                         options=self._options, dynamic_shapes=dynamic_shapes, strict=first)
        entry.spelling = self._binder.spelling(args, kwargs)
        if entry.program is not None and self._options.precision == "int8":
            self._calibrate(entry, args, kwargs, strict=first)
        self._cache[key] = entry
        self._cache.move_to_end(key)
        if len(self._cache) > MAX_SPECIALIZATIONS:
            self._cache.popitem(last=False)
            self._warn_once(f"{self.name} was called with more than {MAX_SPECIALIZATIONS} "
                            f"distinct non-tensor arguments or argument structures; each new "
                            f"one costs a compile", OpweaveFallbackWarning)
        return entry

    def _calibrate(self, entry: _Specialization, args: tuple, kwargs: dict,
                   strict: bool) -> None:
        """Calibrate a new int8 program (codegen/int8.py) on the calibration batches that are
        calls like this one (on the first compile every batch must be), else on this call."""
        calls = []
        call_key = _key(self._binder.canonical(args, kwargs))[0]
        for i, (batch_args, batch_kwargs) in enumerate(self._calibration):
            canonical = self._binder.canonical(batch_args, batch_kwargs)
            same = _key(canonical)[0] == call_key
            tensors = entry.spelling.tensors(canonical) if same else None
            problem = "" if same else \
                "another argument structure or other non-tensor values than the example"
            try:
                if same and entry.dynamic is not None:
                    problem = entry.dynamic.misfit(self.name, tensors)
                elif same:
                    check_tensor_types(self.name, entry.types, tensors)
            except InputError as err:
                problem = str(err)
            if not problem:
                calls.append(tensors)
            elif strict:
                raise ValueError(f"calibration batch {i} of {self.name} is not a call like the "
                                 f"example: {problem}")
        if not calls:
            calls = [entry.spelling.tensors(self._binder.canonical(args, kwargs))]
        with torch.no_grad(), int8.calibrating():
            for tensors in calls:
                entry.program(*tensors)

    def _warn_once(self, message: str, category) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, category, stacklevel=3)


def calibration_calls(batches) -> list[tuple[tuple, dict]]:
    """`calibration=` as (args, kwargs) calls: each batch a tuple or list of positional
    arguments, a dict of keyword arguments, or one tensor."""
    if batches is None:
        return []
    calls = []
    for i, batch in enumerate(batches):
        if isinstance(batch, torch.Tensor):
            calls.append(((batch,), {}))
        elif isinstance(batch, dict):
            calls.append(((), dict(batch)))
        elif isinstance(batch, (tuple, list)):
            calls.append((tuple(batch), {}))
        else:
            raise TypeError(f"calibration batch {i} is a {type(batch).__name__}; give a tuple "
                            "of positional arguments, a dict of keyword arguments or a tensor")
    if not calls:
        raise ValueError("calibration= holds no batch; give at least one")
    return calls


def _key(canonical: dict) -> tuple:
    """(the call's key, the shapes of the caches it passes or None). A cache's length is
    part of the key: programs are compiled for static shapes."""
    key = call_key(canonical)
    lengths = None if key is None or is_flat(canonical) else caches.lengths(canonical)
    return (key if lengths is None else (key, lengths)), lengths


def _compile(model, args: tuple, kwargs: dict, name: str, *, options: Options,
             stacklevel: int, dynamic_shapes=None, strict: bool = True) -> _Specialization:
    errors = []
    ranges: dict = {}
    refused = []  # why torch.export refused dynamic_shapes (when not strict)

    def export(model, args, kwargs):
        try:
            gm, constants, out_spec, found = _capture_export(model, args, kwargs, dynamic_shapes)
        except DynamicShapesError as err:
            if strict:
                raise
            refused.append(str(err).splitlines()[0])
            gm, constants, out_spec, found = _capture_export(model, args, kwargs)
        ranges.update(found)
        return gm, constants, out_spec

    for capture, fn in (("export", export), ("make_fx", _capture_make_fx)):
        try:
            gm, constants, out_spec = fn(model, args, kwargs)
        except DynamicShapesError:
            raise
        except Exception as err:  # capture failures are reported, never fatal
            errors.append(f"{capture}: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
            if isinstance(err, _StateMutation):
                break
            continue
        program = CompiledProgram(gm, constants, name=name, options=options)
        program.warn_fallbacks()
        if errors:
            warnings.warn(f"opweave captured {name} with {capture} after " + "; ".join(errors),
                          OpweaveFallbackWarning, stacklevel=stacklevel)
        tensors = tensor_leaves(flatten(args, kwargs)[0])
        # asked for dynamic dims, calls are checked against the captured sizes: those
        # that do not fit get static programs (none fit when only make_fx captured)
        dynamic = None
        if dynamic_shapes is not None:
            dynamic = DynamicInputTypes(program.placeholders, ranges)
            if not dynamic.symbolic:
                why = f": {refused[0]}" if refused else ""
                warnings.warn(f"opweave compiled {name} for this call's sizes only: no dim "
                              f"of dynamic_shapes stayed dynamic in the capture "
                              f"({capture}{why}); calls of other sizes each compile a program",
                              OpweaveFallbackWarning, stacklevel=stacklevel)
        return _Specialization(program, capture, out_spec, "; ".join(errors),
                               tensor_types(tensors), WeightWatch(model, program.constants.values()),
                               dynamic=dynamic)
    message = f"opweave could not capture {name}; it runs in eager PyTorch ({'; '.join(errors)})"
    warnings.warn(message, OpweaveFallbackWarning, stacklevel=stacklevel)
    return _Specialization(None, "eager", capture_error="; ".join(errors))


class DynamicShapesError(ValueError):
    """`dynamic_shapes` that torch.export refuses: a malformed spec, or a dim marked
    dynamic that the model fixes (torch's message suggests the fix)."""


def _capture_export(model, args: tuple, kwargs: dict, dynamic_shapes=None):
    """(graph module, constants, output spec, symbol ranges): the ranges are empty unless
    `dynamic_shapes` made some input dims symbols."""
    try:
        exported = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes)
    except UserError as err:
        if dynamic_shapes is not None and err.error_type in (
                UserErrorType.CONSTRAINT_VIOLATION, UserErrorType.INVALID_INPUT):
            raise DynamicShapesError(f"torch.export refused the dynamic_shapes given for "
                                     f"{type(model).__name__}: {err}") from None
        raise
    exported = exported.run_decompositions(decomposition_table())
    gm = exported.graph_module
    sig = exported.graph_signature
    if sig.buffers_to_mutate:
        raise _StateMutation(f"the model writes to its buffers ({', '.join(sig.buffers_to_mutate.values())}; "
                             f"training mode?): call model.eval() to compile it for inference")
    if sig.user_inputs_to_mutate:
        raise RuntimeError("the model writes to its inputs")
    if exported.call_spec.in_spec != flatten(args, kwargs)[1]:
        raise RuntimeError("torch.export flattened the inputs differently")
    state = {**exported.state_dict, **exported.constants}
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    constants: dict[fx.Node, torch.Tensor] = {}
    for spec in sig.input_specs:
        target = getattr(spec, "target", None)
        node = placeholders[spec.arg.name]
        if target is not None and target in state:
            constants[node] = state[target]
        elif not isinstance(spec.arg, torch.export.graph_signature.TensorArgument):
            # a Python value, baked in by export: the call's key guards it
            if node.users:
                raise RuntimeError(f"input {spec.arg.name} is a Python value the graph reads")
            gm.graph.erase_node(node)
    _drop_metadata_asserts(gm.graph)
    gm.recompile()
    ranges = export_ranges(exported) if dynamic_shapes is not None else {}
    return gm, constants, exported.call_spec.out_spec, ranges


def _drop_metadata_asserts(graph: fx.Graph) -> None:
    """torch.export records `.to(dtype)` as an assertion of its input's dtype and device.
    The program is compiled for the example's tensor types and every call is checked
    against them (`check_tensor_types`), so these hold by construction: drop them rather
    than run each in eager."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is _ASSERT_METADATA and not node.users:
            graph.erase_node(node)


_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default


def _capture_make_fx(model, args: tuple, kwargs: dict):
    """Trace `model` as a function of the call's tensors to its flat outputs, recording
    the output structure. Input writes become copies at the end of the graph
    (functionalized); writes to the model's own buffers are refused, and undone."""
    from torch.fx.experimental.proxy_tensor import make_fx

    leaves, in_spec = flatten(args, kwargs)
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    out_specs = []

    def flat_model(*tensors):
        full = list(leaves)
        for i, t in zip(where, tensors):
            full[i] = t
        call_args, call_kwargs = pytree.tree_unflatten(full, in_spec)
        outputs, out_spec = pytree.tree_flatten(model(*call_args, **call_kwargs))
        out_specs.append(out_spec)
        return outputs

    saved = {name: b.clone() for name, b in model.named_buffers()}  # tracing runs the model
    examples = [leaves[i].clone() for i in where]  # ... and must not write to the caller's
    with torch.no_grad(), ops_kept_whole():
        gm = make_fx(torch.func.functionalize(flat_model, remove="mutations"),
                     decomposition_table=decomposition_table())(*examples)
    written = _written_constants(gm)
    if written:
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(saved[name])
        raise _StateMutation(f"the model writes to its buffers ({', '.join(written)}; training "
                             f"mode?): call model.eval() to compile it for inference")
    return gm, {}, out_specs[-1]


def _written_constants(gm: fx.GraphModule) -> list[str]:
    """The constants (the model's parameters and buffers) an op of `gm` writes to."""
    written = []
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, fx.Node) and value.op == "get_attr":
                written.append(f"{node.target}")
    return list(dict.fromkeys(written))


def compile(model: torch.nn.Module, example_inputs: Sequence, *, name: str | None = None,
            rewrite=None, fusion=None, train: bool = False, loss_every: int | None = 1,
            example_kwargs: dict | None = None, options: Options | None = None,
            memory_budget: int | float | None = None, precision: str | None = None,
            dynamic_shapes=None, device: str | None = None, schedule: str | None = None,
            calibration=None):
    """Compile `model` for inference on calls like `model(*example_inputs,
    **example_kwargs)`. `options`: an `opweave.Options` (default: from the environment);
    `rewrite`, `fusion`, `memory_budget`, `precision`, `device` and `schedule` override its
    fields. `calibration`: with precision "int8", the batches whose activation ranges fix
    the int8 scales (default: the example inputs).
    `dynamic_shapes`: as torch.export's, the input dims (`torch.export.Dim`) one program
    serves at every size. With `train=True`, `model(*inputs)` must return a scalar loss;
    see `training`."""
    name = name or type(model).__name__
    if train and precision not in (None, "fp32"):
        raise ValueError(f"precision={precision!r} applies to inference; a training step "
                         "computes in float32 (mixed-precision training is not built)")
    options = Options.resolve(options, rewrite=rewrite, fusion=fusion,
                              memory_budget=memory_budget, precision=precision, device=device,
                              schedule=schedule)
    if calibration is not None and (train or options.precision != "int8"):
        raise ValueError(f"calibration= applies to inference with precision='int8'; this "
                         f"compile is {'a training step' if train else repr(options.precision)}")
    if train:
        from .training import TrainingModel

        if example_kwargs:
            raise TypeError("train=True takes its inputs as example_inputs only")
        if dynamic_shapes is not None:
            raise ValueError("dynamic_shapes applies to inference; a training step is "
                             "compiled for the example's shapes (dynamic training is not built)")
        return TrainingModel(model, example_inputs, name=name, options=options,
                             loss_every=loss_every)
    return CompiledModel(model, tuple(example_inputs), example_kwargs, name=name,
                         options=options, dynamic_shapes=dynamic_shapes, calibration=calibration)
