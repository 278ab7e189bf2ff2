"""Errors of the ONNX frontend: each names the file, node or value it is about."""
from __future__ import annotations


class OnnxError(ValueError):
    """A problem with an ONNX model or its inputs; the message says what and where."""


class OnnxUnsupported(OnnxError):
    """A valid ONNX construct opweave does not handle (op, attribute value, dtype)."""


def where(node) -> str:
    """How an error names an ONNX node: its name (if any) and op type."""
    label = f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
    return f"node {node.name!r} ({label})" if node.name else f"a {label} node"
