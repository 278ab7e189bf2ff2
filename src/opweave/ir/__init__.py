"""The opweave IR: typed tensor graphs over one op registry."""
from .graph import Graph, Node, Value
from .registry import Cost, MappingType, OpDef, ShapeError
from .text import ParseError, parse_graph, print_graph
from .types import TensorType
from .verify import VerificationError, verify

__all__ = ["Graph", "Node", "Value", "Cost", "MappingType", "OpDef", "ShapeError", "TensorType",
           "ParseError", "parse_graph", "print_graph", "VerificationError", "verify"]
