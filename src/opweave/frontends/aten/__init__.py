"""The ATen table: how each supported ATen overload lowers into IR ops, one module per
kind of op. Importing this package fills `lowering.TABLE`.

Composites decompose here where that loses nothing (addmm -> matmul + add, embedding ->
index_select, select/squeeze/unsqueeze -> slice/reshape). A rule raises `Unsupported` for
uses it cannot express, and that node then runs in eager PyTorch.
"""
from . import contractions, elementwise, indexing, layout, norms  # noqa: F401  (register)
