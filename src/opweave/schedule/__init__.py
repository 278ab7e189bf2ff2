"""Scheduling across operators and models. Today: horizontal fusion of model arrays
(HFTA), `horizontal.py`, with its fused optimizers, `stacked_optim.py`."""
from .horizontal import ArchitectureMismatch, HorizontalArray, horizontal
from .stacked_optim import StackedAdam, StackedSGD

__all__ = ["ArchitectureMismatch", "HorizontalArray", "horizontal", "StackedAdam", "StackedSGD"]
