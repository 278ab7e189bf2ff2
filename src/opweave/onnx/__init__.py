"""The ONNX frontend and exporter: `from_onnx` (load, lower to the IR, run) and
`export` (write an IR graph back as ONNX)."""
from .errors import OnnxError, OnnxUnsupported
from .export import OnnxExportError, export, to_onnx_model
from .model import OnnxModel, from_onnx

__all__ = ["OnnxError", "OnnxUnsupported", "OnnxExportError", "OnnxModel", "from_onnx",
           "export", "to_onnx_model"]
