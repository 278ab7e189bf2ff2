"""Cost models: estimates of what an op costs to run, used to choose between graphs."""
from .model import CPU, Machine, active, at_sizes, node_seconds, using

__all__ = ["CPU", "Machine", "active", "at_sizes", "node_seconds", "using"]
