"""The provenance string a node keeps: written by the frontends, read by the profiler."""
from __future__ import annotations

from opweave.ir import provenance


def test_describe_and_parse_round_trip():
    frame = 'File "/models/bert.py", line 192, in forward'
    text = provenance.describe("add_3", frame, "encoder.layer.0.attention")
    where = provenance.parse(text)
    assert where == provenance.Provenance("add_3", "/models/bert.py", 192, "forward",
                                          "encoder.layer.0.attention")
    assert where.location == "models/bert.py:192"


def test_sources_without_a_line_keep_their_node():
    assert provenance.parse("onnx:/encoder/Add").node == "onnx:/encoder/Add"
    assert provenance.parse("onnx:/encoder/Add").location == ""
    assert provenance.parse("") == provenance.Provenance()
    assert provenance.parse("mul_2 [module fc]") == provenance.Provenance("mul_2", module="fc")


def test_module_paths_from_export_and_dynamo_read_alike():
    export = {"L__self__": ("", "M"), "L__self__encoder.layer.0": ("encoder.layer.0", "Layer")}
    assert provenance.module_path(export) == "encoder.layer.0"
    dynamo = {"L['self'].encoder.layer[0]": ("L['self'].encoder.layer[0]", "Layer")}
    assert provenance.module_path(dynamo) == "encoder.layer.0"
    named = {"x": ("L['self'].blocks._modules['3'].attn", "Attn")}
    assert provenance.module_path(named) == "blocks.3.attn"
    assert provenance.module_path(None) == ""
    assert provenance.module_path({"L__self__": ("", "M")}) == provenance.ROOT
    assert provenance.module_path({}) == ""  # the graph recorded none
