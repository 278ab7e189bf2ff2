"""The rule sets; importing this package registers every rule."""
from . import algebra, layout, merge, recompose, reduce, simplify, weights  # noqa: F401
