"""Running IR graphs: the executor, its memory plan and the native plan (native.py)."""
from .executor import Executor, InputError
from .memory_plan import MemoryPlan, plan_memory

__all__ = ["Executor", "InputError", "MemoryPlan", "plan_memory"]
