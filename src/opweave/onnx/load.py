"""Reading ONNX files: protobuf, external data and opset, with clear errors."""
from __future__ import annotations

import os
from pathlib import Path

import onnx

from .errors import OnnxError, OnnxUnsupported, where

MIN_OPSET = 13  # older default-domain opsets go through onnx's version converter


def load_model(source: "str | os.PathLike | bytes | onnx.ModelProto",
               label: str | None = None) -> onnx.ModelProto:
    """An in-memory ModelProto (external data loaded), at opset >= 13 in the default domain.
    Errors name the file, or `label` for in-memory models."""
    if isinstance(source, onnx.ModelProto):
        model, label, base_dir = source, label or "the ONNX model", None
    elif isinstance(source, (bytes, bytearray)):
        label = label or "the ONNX bytes"
        model, base_dir = _parse(bytes(source), label), None
    else:
        path = Path(source)
        label, base_dir = str(path), path.parent
        if not path.is_file():
            raise OnnxError(f"{path}: no such file")
        model = _parse(path.read_bytes(), label)
    _check_structure(model, label)
    if base_dir is not None:
        _load_external_data(model, base_dir, label)
    elif any(_is_external(t) for t in _all_tensors(model.graph)):
        raise OnnxError(f"{label} refers to external data files; load it from its path")
    try:
        model = _upgrade_opset(model, label)
    except OnnxUnsupported:
        check_operators(model, label)  # an unknown operator is the clearer reason
        raise
    check_operators(model, label)
    return model


def check_operators(model: onnx.ModelProto, label: str) -> None:
    """Refuse a model with an operator opweave lacks, or a node with more or fewer inputs
    or outputs than its operator's schema allows, when it is loaded, not when run."""
    from .importer import HANDLERS

    opset = default_opset(model)
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            raise OnnxUnsupported(f"{label}: {where(node)}: operator domain {node.domain!r} "
                                  f"is not supported")
        if node.op_type not in HANDLERS:
            raise OnnxUnsupported(f"{label}: {where(node)}: ONNX operator {node.op_type!r} "
                                  f"is not supported")
        _check_arity(node, opset, label)


def _check_arity(node: onnx.NodeProto, opset: int, label: str) -> None:
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        return  # not defined at this opset: the operator's handler decides
    for kind, names, low, high in (("input", node.input, schema.min_input, schema.max_input),
                                   ("output", node.output, schema.min_output, schema.max_output)):
        if not low <= len(names) <= high:
            allowed = f"{low}" if low == high else f"{low} to {high}" if high < 1 << 20 \
                else f"at least {low}"
            raise OnnxError(f"{label}: {where(node)} has {len(names)} {kind}(s) "
                            f"({', '.join(map(repr, names)) or 'none'}); {node.op_type} at opset "
                            f"{opset} takes {allowed}")
        for position, name in enumerate(names[:low] if kind == "input" else []):
            if not name:  # (an unused required output may stay unnamed)
                raise OnnxError(f"{label}: {where(node)}: {kind} {position} is required by "
                                f"{node.op_type} but left empty")


def _parse(data: bytes, label: str) -> onnx.ModelProto:
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as error:  # protobuf's DecodeError and friends
        raise OnnxError(f"{label} is not a valid ONNX file (protobuf could not decode it: "
                        f"{error}); is it truncated or another format?") from None
    return model


def _check_structure(model: onnx.ModelProto, label: str) -> None:
    if model.ir_version <= 0 or not model.HasField("graph"):
        raise OnnxError(f"{label} is not an ONNX model (no IR version or no graph)")
    if not model.graph.output:
        raise OnnxError(f"{label}: the graph declares no outputs")
    _check_names(model.graph, label)


def _check_names(graph: onnx.GraphProto, label: str) -> None:
    """Names must be text: protobuf hands back bytes for a string field that is not valid
    UTF-8 (a damaged file can still parse), which would fail far from the cause."""
    def check(what: str, name) -> None:
        if not isinstance(name, str):
            raise OnnxError(f"{label}: {what} {name!r} is not valid UTF-8 text; is the file "
                            f"damaged?")

    for kind, infos in (("graph input", graph.input), ("graph output", graph.output),
                        ("value_info", graph.value_info), ("initializer", graph.initializer)):
        for info in infos:
            check(f"{kind} name", info.name)
    for node in graph.node:
        for what, name in [("node name", node.name), ("operator", node.op_type),
                           ("operator domain", node.domain)]:
            check(what, name)
        for name in [*node.input, *node.output]:
            check(f"value name in {where(node)}", name)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                _check_names(attr.g, label)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    _check_names(sub, label)


def _all_tensors(graph: onnx.GraphProto):
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t
            elif attr.type == onnx.AttributeProto.GRAPH:
                yield from _all_tensors(attr.g)


def _is_external(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == onnx.TensorProto.EXTERNAL


def _load_external_data(model: onnx.ModelProto, base_dir: Path, label: str) -> None:
    from onnx.external_data_helper import load_external_data_for_tensor

    for tensor in _all_tensors(model.graph):
        if not _is_external(tensor):
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location", "")
        path = (base_dir / location).resolve()
        if not location or not path.is_file():
            raise OnnxError(f"{label}: external data file {location!r} of tensor {tensor.name!r} "
                            f"is missing (looked in {base_dir})")
        if base_dir.resolve() not in path.parents:
            raise OnnxError(f"{label}: external data of tensor {tensor.name!r} points outside the "
                            f"model's folder ({location!r})")
        try:
            load_external_data_for_tensor(tensor, str(base_dir))
        except Exception as error:
            raise OnnxError(f"{label}: cannot read external data of tensor {tensor.name!r} from "
                            f"{location!r}: {error}") from None
        expected = _expected_bytes(tensor)
        if expected is not None and len(tensor.raw_data) != expected:
            raise OnnxError(f"{label}: external data of tensor {tensor.name!r} in {location!r} "
                            f"has {len(tensor.raw_data)} bytes, expected {expected} (truncated?)")
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT


def _expected_bytes(tensor: onnx.TensorProto) -> int | None:
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except Exception:
        return None
    count = 1
    for d in tensor.dims:
        count *= d
    return count * itemsize


def default_opset(model: onnx.ModelProto) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    return 1  # no default-domain import: the spec's default


def _upgrade_opset(model: onnx.ModelProto, label: str) -> onnx.ModelProto:
    version = default_opset(model)
    newest = onnx.defs.onnx_opset_version()
    if version > newest:  # operators may mean something else there: never guess
        raise OnnxUnsupported(f"{label} uses opset {version} of the default domain, newer than "
                              f"opset {newest}, the newest the installed onnx "
                              f"{onnx.__version__} defines")
    if version >= MIN_OPSET:
        return model
    from onnx import version_converter

    try:
        return version_converter.convert_version(model, MIN_OPSET)
    except Exception as error:
        raise OnnxUnsupported(f"{label} uses opset {version}; opweave reads opset {MIN_OPSET} and "
                              f"newer, and onnx's version converter could not upgrade it: "
                              f"{str(error).strip().splitlines()[-1][:300]}") from None
