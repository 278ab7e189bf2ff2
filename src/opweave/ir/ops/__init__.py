"""Importing this package registers every op of the IR."""
from . import creation, elementwise, indexing, linalg, nn, reduction, shape, upsample  # noqa: F401
