"""`opweave.from_onnx`: an ONNX model as a callable, specialized to each input shape."""
from __future__ import annotations

import os
import re
import warnings
from collections import OrderedDict
from dataclasses import dataclass

import onnx
import torch

from ..codegen import int8
from ..ir.graph import Graph
from ..ir.types import TensorType
from ..options import Options
from ..ir import symbols
from ..pipeline import CompiledGraph, compile_graph
from ..specializing import SymbolicGraph
from ..notices import OpweaveFallbackWarning
from .arrays import to_numpy, to_tensor
from .errors import OnnxError
from .importer import DeclaredInput, Lowering, declared_inputs, decode_initializers, value_inputs
from .load import default_opset, load_model
from . import ops_math, ops_resize, ops_shape  # noqa: F401  (register the operator handlers)


MAX_SPECIALIZATIONS = 16  # distinct input shapes kept compiled (least recently used go)


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t.numel()}


def _unaliased(outputs, owned: set[int]) -> list:
    """Outputs that share memory with an input or a weight (views; `owned` holds their
    storage addresses) are copied, so a caller writing into an output can never change
    the model or its own inputs."""
    return [o.clone() if o.numel() and o.untyped_storage().data_ptr() in owned else o
            for o in outputs]


@dataclass
class _Specialization:
    compiled: CompiledGraph
    runtime_inputs: list[str]  # the inputs the graph takes (value inputs are folded in)
    weight_storages: set[int]  # storage addresses of the constants, for `_unaliased`


class OnnxModel:
    """Call with arrays (numpy or torch), positionally or by input name; returns the outputs
    as a list, numpy arrays for numpy inputs and tensors for tensors.

    Symbolic dims (`dim_param`) are bound from the inputs of each call. The model is
    lowered to the IR once, with those dims as symbols (`ir.symbols`), and specialized to
    each distinct binding (a plan each, `specializing.SymbolicGraph`); a model whose
    lowering needs concrete sizes is lowered per distinct set of shapes instead.
    """

    def __init__(self, source, name: str | None = None, rewrite=None, fusion=None,
                 options: Options | None = None, precision: str | None = None,
                 schedule: str | None = None, calibration=None):
        self.options = Options.resolve(options, rewrite=rewrite, fusion=fusion,
                                       precision=precision, schedule=schedule)
        if calibration is not None and self.options.precision != "int8":
            raise ValueError(f"calibration= applies to precision='int8'; this model's precision "
                             f"is {self.options.precision!r}")
        self.model: onnx.ModelProto = load_model(source, label=name)
        self.label = name or (os.path.basename(str(source)) if isinstance(source, (str, os.PathLike))
                              else self.model.graph.name or "onnx")
        self.opset = default_opset(self.model)
        self.inputs: list[DeclaredInput] = declared_inputs(self.model.graph)
        self.input_names = [d.name for d in self.inputs]
        self.output_names = [o.name for o in self.model.graph.output]
        self._cache: OrderedDict[tuple, _Specialization] = OrderedDict()  # LRU
        self._initializers: dict[str, torch.Tensor] | None = None
        self.value_inputs = value_inputs(self.model.graph)
        self.lowerings = 0  # ONNX graph -> IR lowerings so far (one for a symbolic model)
        self._symbolic: SymbolicGraph | bool | None = None  # None: not tried yet
        self._symbolic_failure = ""  # why not, said once the per-shape lowering works
        if calibration is not None:
            self.calibrate(calibration)

    def calibrate(self, batches) -> None:
        """Fix the int8 scales (precision "int8", codegen/int8.py) from these batches' ranges:
        each a list of arrays in input order or a dict by input name. Plans of the shapes
        they have are calibrated on them; a plan of other shapes on its first call."""
        batches = list(batches)
        if not batches:
            raise ValueError(f"{self.label}: calibration= holds no batch; give at least one")
        with torch.no_grad(), int8.calibrating() as reached:
            for batch in batches:
                if isinstance(batch, dict):
                    self(**batch)
                else:
                    self(*batch)
        if not reached:
            warnings.warn(f"{self.label}: these batches calibrated nothing: no int8 group "
                          "they reached was still to calibrate (none computes in int8, or an "
                          "earlier call fixed their scales; scales are fixed once: load the "
                          "model again to calibrate it anew)", int8.Int8Warning, stacklevel=2)

    # -- shapes --------------------------------------------------------------------------
    def bind(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
        """Symbol values from the concrete shapes of (some of) the inputs; an OnnxError
        names any mismatch with the declared shapes."""
        symbols: dict[str, tuple[int, str]] = {}
        for declared in self.inputs:
            shape = shapes.get(declared.name)
            if shape is None or declared.dims is None:
                continue
            if len(shape) != len(declared.dims):
                raise OnnxError(f"{self.label}: input {declared.name!r} has rank {len(shape)}, "
                                f"the model declares {len(declared.dims)} {list(declared.dims)}")
            for axis, (dim, size) in enumerate(zip(declared.dims, shape)):
                if isinstance(dim, int) and dim > 0 and dim != size:
                    raise OnnxError(f"{self.label}: input {declared.name!r} dim {axis} is {size}, "
                                    f"the model declares {dim}")
                if isinstance(dim, str):
                    if dim in symbols and symbols[dim][0] != size:
                        seen, where = symbols[dim]
                        raise OnnxError(f"{self.label}: dimension {dim!r} is {size} in input "
                                        f"{declared.name!r} (dim {axis}) but {seen} in {where}")
                    symbols.setdefault(dim, (size, f"input {declared.name!r} (dim {axis})"))
        return {k: v for k, (v, _) in symbols.items()}

    def input_types(self, dims: dict[str, int] | None = None,
                    names=None) -> dict[str, TensorType]:
        """Concrete types of the inputs `names` (default all) from their declared shapes,
        with `dims` for the symbols; an OnnxError names any dimension left unknown."""
        dims = dims or {}
        types = {}
        for declared in self.inputs:
            if names is not None and declared.name not in names:
                continue
            if declared.dims is None:
                raise OnnxError(f"{self.label}: input {declared.name!r} has no declared shape; "
                                f"give an input array")
            shape = []
            for axis, dim in enumerate(declared.dims):
                if isinstance(dim, int) and dim > 0:
                    shape.append(dim)
                elif isinstance(dim, str) and dim in dims:
                    shape.append(dims[dim])
                else:
                    label = repr(dim) if dim else "unnamed"
                    raise OnnxError(f"{self.label}: dimension {label} (input {declared.name!r}, "
                                    f"dim {axis}) is not known; give its size")
            types[declared.name] = TensorType(tuple(shape), declared.dtype)
        return types

    # -- compiling and running ----------------------------------------------------------------
    def specialize(self, types: dict[str, TensorType],
                   values: dict[str, torch.Tensor] | None = None) -> _Specialization:
        values = values or {}
        missing = self.value_inputs - set(values)
        if missing:
            raise OnnxError(f"{self.label}: input(s) {', '.join(sorted(missing))} set shapes or "
                            f"axes; give their values to build the graph")
        key = tuple((n, types[n].shape, types[n].dtype) for n in self.input_names) + \
            tuple((n, tuple(values[n].reshape(-1).tolist())) for n in sorted(values))
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        family = self._family() if not values else None
        if family is not None:
            compiled = family.compiled_for([types[n].shape for n in self.input_names])
        else:
            compiled = compile_graph(self._lowering().lower(types, values), self.options)
            self.lowerings += 1
            if self._symbolic_failure:
                warnings.warn(f"{self.label}: opweave lowers this ONNX model once per input "
                              f"shape (its symbolic dims need concrete sizes: "
                              f"{self._symbolic_failure})", OpweaveFallbackWarning, stacklevel=4)
                self._symbolic_failure = ""
        runtime = [n for n in self.input_names if n not in values]
        self._cache[key] = _Specialization(compiled, runtime,
                                           _storages(compiled.graph.constants.values()))
        while len(self._cache) > MAX_SPECIALIZATIONS:
            self._cache.popitem(last=False)
        return self._cache[key]

    def _lowering(self) -> Lowering:
        if self._initializers is None:
            self._initializers = decode_initializers(self.model)
        return Lowering(self.model, self.opset, name=self.model.graph.name or "onnx",
                        initializers=self._initializers)

    def _family(self) -> SymbolicGraph | None:
        """The model lowered once with its symbolic dims (`dim_param`s, and a symbol of
        its own for each unnamed dim) as IR symbols, or None where it has none or where
        its lowering needs concrete sizes; each such model is lowered per shape instead,
        with one warning saying why."""
        if self._symbolic is None:
            self._symbolic = False
            types = symbolic_input_types(self.inputs)
            if types is not None:
                try:
                    graph = self._lowering().lower(types)
                except Exception as err:  # lowered per shape instead: a malformed model
                    # fails there too, with its own error and no word about symbols
                    self._symbolic_failure = f"{type(err).__name__}: " \
                                             f"{str(err).splitlines()[0][:200]}"
                else:
                    self.lowerings += 1
                    self._symbolic = SymbolicGraph(graph, self.options)
        return self._symbolic or None

    def graph(self, dims: dict[str, int] | None = None,
              values: dict | None = None) -> Graph:
        """The IR graph for the declared shapes (with `dims` for symbolic dims, and
        `values` for the inputs in `value_inputs`)."""
        values = {n: to_tensor(v, f"input {n!r}") for n, v in (values or {}).items()}
        return self.specialize(self.input_types(dims), values).compiled.graph

    def __call__(self, *args, **kwargs):
        spec, tensors, as_numpy = self._prepare(args, kwargs)
        outputs = _unaliased(spec.compiled(*[tensors[n] for n in spec.runtime_inputs]),
                             spec.weight_storages | _storages(tensors.values()))
        return [to_numpy(o) for o in outputs] if as_numpy else list(outputs)

    def compiled_for(self, *args, **kwargs) -> tuple[CompiledGraph, list[torch.Tensor]]:
        """The compiled graph a call with these inputs runs, and the tensors it is given
        (for the profiler)."""
        spec, tensors, _ = self._prepare(args, kwargs)
        return spec.compiled, [tensors[n] for n in spec.runtime_inputs]

    def _prepare(self, args, kwargs):
        arrays = self._arguments(args, kwargs)
        as_numpy = not any(isinstance(a, torch.Tensor) for a in arrays.values())
        tensors = {}
        for declared in self.inputs:
            tensor = to_tensor(arrays[declared.name], f"{self.label}: input {declared.name!r}")
            if tensor.dtype != declared.dtype:
                raise OnnxError(f"{self.label}: input {declared.name!r} has dtype {tensor.dtype}, "
                                f"the model declares {declared.dtype}")
            tensors[declared.name] = tensor
        self.bind({n: tuple(t.shape) for n, t in tensors.items()})
        types = {n: TensorType(tuple(t.shape), t.dtype) for n, t in tensors.items()}
        spec = self.specialize(types, {n: tensors[n] for n in self.value_inputs})
        return spec, tensors, as_numpy

    def _arguments(self, args, kwargs) -> dict:
        if len(args) > len(self.input_names):
            raise OnnxError(f"{self.label}: {len(args)} inputs given, the model has "
                            f"{len(self.input_names)} ({', '.join(self.input_names)})")
        arrays = dict(zip(self.input_names, args))
        for name, value in kwargs.items():
            if name not in self.input_names:
                raise OnnxError(f"{self.label}: no input named {name!r}; inputs: "
                                f"{', '.join(self.input_names)}")
            if name in arrays:
                raise OnnxError(f"{self.label}: input {name!r} given twice")
            arrays[name] = value
        missing = [n for n in self.input_names if n not in arrays]
        if missing:
            raise OnnxError(f"{self.label}: missing input(s) {', '.join(missing)}")
        return arrays


def symbolic_input_types(inputs: list[DeclaredInput]) -> dict[str, TensorType] | None:
    """The inputs' types with a symbol for each `dim_param` (one per name, so equal names
    share it) and one for each unnamed dim; None when every dim is a number (or a rank is
    not declared)."""
    if any(d.dims is None for d in inputs):
        return None
    if all(isinstance(d, int) and d >= 0 for declared in inputs for d in declared.dims):
        # every dim a number, 0 included (ONNX's size 0): lowered per shape, as a model of
        # positive sizes is. A declared 0 still binds any size (`bind`), for exporters
        # that wrote 0 for an unknown dim; made a symbol, it stopped graphs that reshape
        # to a size of 0 from lowering symbolically, with a warning (found by `opweave
        # fuzz`)
        return None
    names: dict[str, str] = {}

    def name_for(param: str) -> str:
        if param not in names:
            base = re.sub(r"\W", "_", param)
            base = base if base[:1].isalpha() else f"d_{base}"
            names[param] = base if base not in names.values() else f"{base}_{len(names)}"
        return names[param]

    types = {}
    for i, declared in enumerate(inputs):
        shape = []
        for axis, d in enumerate(declared.dims):
            if isinstance(d, int) and d > 0:
                shape.append(d)
            else:
                shape.append(symbols.symbol(name_for(d if isinstance(d, str) else f"{declared.name}_dim{axis}")))
        types[declared.name] = TensorType(tuple(shape), declared.dtype)
    return types if names else None


def from_onnx(source, name: str | None = None, rewrite=None, fusion=None,
              options: Options | None = None, precision: str | None = None,
              schedule: str | None = None, calibration=None) -> OnnxModel:
    """Load an ONNX model (path, bytes or ModelProto) as an opweave callable; `options`,
    `rewrite`, `fusion`, `precision` and `schedule` as in `opweave.compile`; `calibration`
    as in `OnnxModel.calibrate`."""
    return OnnxModel(source, name=name, rewrite=rewrite, fusion=fusion, options=options,
                     precision=precision, schedule=schedule, calibration=calibration)
