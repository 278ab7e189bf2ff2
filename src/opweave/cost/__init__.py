"""Cost models: estimates of what an op costs to run, used to choose between graphs."""
from .model import CPU, Machine, node_seconds

__all__ = ["CPU", "Machine", "node_seconds"]
