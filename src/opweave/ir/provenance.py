"""Where an IR node came from, as the one string `Node.source` keeps through rewriting
and fusion: the frontend node, the innermost source line of the user's model and the
module path of the layer it ran in. The frontends write it with `describe`; the
profiler and the reports read it back with `parse`.

    add_3 @ "/models/bert.py", line 192, in forward [module encoder.layer.0.attention]
    onnx:/encoder/layer.0/Add
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_FRAME = re.compile(r'"(?P<file>[^"]*)", line (?P<line>\d+), in (?P<function>\S+)')
_MODULE = re.compile(r" \[module (?P<module>[^\]]*)\]$")
ROOT = "(root)"
_DYNAMO_ROOT = re.compile(r"^L\[['\"](self|fn|mod|model)['\"]\]\.?")


@dataclass(frozen=True)
class Provenance:
    node: str = ""       # the frontend node: the FX node's name, or onnx:NAME
    file: str = ""
    line: int = 0
    function: str = ""
    module: str = ""     # the nn.Module path: ROOT for the model itself, "" when unknown

    @property
    def location(self) -> str:
        """`file:line` with the file's last two path parts, or "" when unknown."""
        if not self.file:
            return ""
        short = "/".join(self.file.replace("\\", "/").split("/")[-2:])
        return f"{short}:{self.line}"


def describe(node: str, frame: str = "", module: str = "") -> str:
    """The string `parse` reads: `frame` is a traceback's `"file", line N, in fn` line."""
    text = node
    if frame:
        text += " @ " + frame.strip().removeprefix("File ")
    if module:
        text += f" [module {module}]"
    return text


def parse(source: str) -> Provenance:
    if not source:
        return Provenance()
    module = ""
    found = _MODULE.search(source)
    if found:
        module = found["module"]
        source = source[:found.start()]
    node, _, rest = source.partition(" @ ")
    frame = _FRAME.search(rest)
    if frame is None:
        return Provenance(node.strip(), module=module)
    return Provenance(node.strip(), frame["file"], int(frame["line"]), frame["function"],
                      module)


def module_path(stack: dict | None) -> str:
    """The innermost module of an FX node's `nn_module_stack` as a dotted path
    (torch.export writes `encoder.layer.0`; Dynamo `L['self'].encoder.layer[0]`), ROOT
    for the model itself, "" when the graph recorded none (AOTAutograd's joint graphs)."""
    if not stack:
        return ""
    value = list(stack.values())[-1]
    path = str(value[0] if isinstance(value, (tuple, list)) else value)
    path = _DYNAMO_ROOT.sub("", path)
    path = re.sub(r"\._modules\[['\"]([^'\"]+)['\"]\]", r".\1", path)
    path = re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", path)
    return path.strip(".") or ROOT
