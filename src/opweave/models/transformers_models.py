"""BERT, ViT and ResNet-50 from `transformers` configs, with random weights.

Backbones return plain tuples (`return_dict=False`) so that graph capture sees tensors
only. Training adds a linear classifier over the pooled output and a cross-entropy loss.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import BenchmarkModel

BERT_SEQ_LEN = 128


class ClassifierLoss(torch.nn.Module):
    """Backbone, then a linear head over its pooled output (tuple item 1), then cross-entropy."""

    def __init__(self, backbone: torch.nn.Module, width: int, classes: int):
        super().__init__()
        self.backbone = backbone
        self.head = torch.nn.Linear(width, classes)

    def forward(self, *inputs_and_targets):
        *inputs, targets = inputs_and_targets
        pooled = self.backbone(*inputs)[1].flatten(1)
        return F.cross_entropy(self.head(pooled), targets)


def _classifier(name, backbone, inputs, width, classes, notes="") -> BenchmarkModel:
    return BenchmarkModel(
        name=name,
        module=backbone.eval(),
        inputs=inputs,
        loss_module=ClassifierLoss(backbone, width, classes),
        targets=torch.randint(0, classes, (inputs[0].shape[0],)),
        notes=notes,
    )


def bert(size: str = "base", small: bool = False, seq_len: int = BERT_SEQ_LEN) -> BenchmarkModel:
    from transformers import BertConfig, BertModel

    if small:
        config = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=128, vocab_size=1000, max_position_embeddings=64)
        seq_len = min(seq_len, 16)
    elif size == "large":
        config = BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                            intermediate_size=4096)
    else:
        config = BertConfig()
    config.return_dict = False
    ids = torch.randint(0, config.vocab_size, (1, seq_len))
    return _classifier(f"bert-{size}", BertModel(config), (ids,), config.hidden_size, 2,
                       notes=f"seq {seq_len}")


def vit(small: bool = False) -> BenchmarkModel:
    from transformers import ViTConfig, ViTModel

    if small:
        config = ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, image_size=32, patch_size=8)
    else:
        config = ViTConfig()  # ViT-B/16 at 224x224
    config.return_dict = False
    pixels = torch.randn(1, config.num_channels, config.image_size, config.image_size)
    return _classifier("vit-b16", ViTModel(config), (pixels,), config.hidden_size, 10,
                       notes=f"{config.image_size}px")


def resnet50(small: bool = False) -> BenchmarkModel:
    from transformers import ResNetConfig, ResNetModel

    if small:
        config = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1])
        side = 64
    else:
        config = ResNetConfig()  # the default config is ResNet-50
        side = 224
    config.return_dict = False
    pixels = torch.randn(1, config.num_channels, side, side)
    return _classifier("resnet50", ResNetModel(config), (pixels,), config.hidden_sizes[-1], 10,
                       notes=f"{side}px")
