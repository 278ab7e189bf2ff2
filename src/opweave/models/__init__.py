"""The benchmark models (as in EVT), built from configs with random weights; no downloads."""
from __future__ import annotations

from typing import Callable

import torch

from .base import BenchmarkModel, like_trained
from .gcn import gcn
from .transformers_models import bert, resnet50, vit
from .xmlcnn import xmlcnn
from .zoo import ZOO

# name -> builder(small: bool) -> BenchmarkModel
BUILDERS: dict[str, Callable[[bool], BenchmarkModel]] = {
    "bert-base": lambda small=False: bert("base", small),
    "bert-large": lambda small=False: bert("large", small),
    "vit-b16": lambda small=False: vit(small),
    "resnet50": lambda small=False: resnet50(small),
    "xmlcnn": lambda small=False: xmlcnn(small),
    "gcn": lambda small=False: gcn(small),
    "gcn-dense": lambda small=False: gcn(small, dense=True),
    # the zoo (models/zoo.py): more architectures, for coverage; `opweave bench --zoo`
    **{f"zoo-{name}": builder for name, builder in ZOO.items()},
}
ZOO_SET = tuple(f"zoo-{name}" for name in ZOO)

# The five benchmark models of the demo (BERT-large is available but slow on 2 cores).
BENCHMARK_SET = ("bert-base", "vit-b16", "resnet50", "xmlcnn", "gcn")


def build(name: str, small: bool = False) -> BenchmarkModel:
    """Build a benchmark model by name (see `BUILDERS`)."""
    try:
        builder = BUILDERS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(BUILDERS)}") from None
    torch.manual_seed(0)  # the same random weights and inputs on every build
    model = builder(small)
    like_trained(model.loss_module)  # shares its parameters with `module`
    return model


__all__ = ["BenchmarkModel", "BUILDERS", "BENCHMARK_SET", "ZOO_SET", "build", "bert", "vit", "resnet50",
           "xmlcnn", "gcn"]
