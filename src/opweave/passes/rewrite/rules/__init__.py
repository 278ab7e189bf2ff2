"""The rule sets; importing this package registers every rule."""
from . import algebra, layout, linear_maps, merge, recompose, reduce, simplify, weights  # noqa: F401
