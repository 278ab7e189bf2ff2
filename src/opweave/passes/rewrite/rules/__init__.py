"""The rule sets; importing this package registers every rule."""
from . import algebra, layout, merge, recompose, simplify, weights  # noqa: F401
