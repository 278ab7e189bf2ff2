"""Running IR graphs: the reference executor and its memory plan."""
from .executor import Executor, InputError
from .memory_plan import MemoryPlan, plan_memory

__all__ = ["Executor", "InputError", "MemoryPlan", "plan_memory"]
