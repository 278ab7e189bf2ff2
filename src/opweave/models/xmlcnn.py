"""XML-CNN (Liu et al., 2017): CNN for extreme multi-label text classification.

Word embeddings (300-d), 1-D convolutions of widths 2, 4 and 8 with 32 filters each,
dynamic max pooling (adaptive max pooling into `chunks` pieces per filter), a 512-wide
bottleneck and one logit per label, trained with binary cross-entropy.

Neither torch ONNX exporter handles adaptive max pooling, so `pooling="gather"` computes
the same pooling as a gather of each chunk's positions followed by a max; the ONNX-based
peers run that formulation (same weights, identical outputs).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from ..ir.ops.nn import chunk_positions
from .base import BenchmarkModel


class XMLCNN(torch.nn.Module):
    def __init__(self, vocab=30000, embed_dim=300, widths=(2, 4, 8), filters=32,
                 chunks=8, bottleneck=512, labels=4000, pooling="adaptive"):
        super().__init__()
        if pooling not in ("adaptive", "gather"):
            raise ValueError(f"pooling must be 'adaptive' or 'gather', not {pooling!r}")
        self.pooling = pooling
        self.embedding = torch.nn.Embedding(vocab, embed_dim)
        self.convs = torch.nn.ModuleList(
            torch.nn.Conv1d(embed_dim, filters, w) for w in widths)
        self.chunks = chunks
        self.bottleneck = torch.nn.Linear(len(widths) * filters * chunks, bottleneck)
        self.dropout = torch.nn.Dropout(0.5)
        self.out = torch.nn.Linear(bottleneck, labels)

    def forward(self, tokens):
        x = self.embedding(tokens).transpose(1, 2)  # [batch, embed, seq]
        pooled = [self._pool(F.relu(conv(x))).flatten(1) for conv in self.convs]
        hidden = F.relu(self.bottleneck(torch.cat(pooled, dim=1)))
        return self.out(self.dropout(hidden))


    def _pool(self, x):
        if self.pooling == "adaptive":
            return F.adaptive_max_pool1d(x, self.chunks)
        return x[..., chunk_positions(x.shape[-1], self.chunks, x.device)].max(-1).values

    def with_gather_pooling(self) -> "XMLCNN":
        """A shallow copy that shares every weight but pools by gather + max."""
        twin = copy.copy(self)
        twin._modules = dict(self._modules)
        twin.pooling = "gather"
        return twin


class MultiLabelLoss(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens, targets):
        return F.binary_cross_entropy_with_logits(self.model(tokens), targets)


def xmlcnn(small: bool = False, seq_len: int = 500) -> BenchmarkModel:
    if small:
        model, seq_len, vocab, labels = XMLCNN(vocab=500, embed_dim=32, filters=8, chunks=4,
                                               bottleneck=64, labels=100), 40, 500, 100
    else:
        vocab, labels = 30000, 4000
        model = XMLCNN(vocab=vocab, labels=labels)
    tokens = torch.randint(0, vocab, (1, seq_len))
    targets = (torch.rand(1, labels) < 0.01).float()
    return BenchmarkModel("xmlcnn", model.eval(), (tokens,), MultiLabelLoss(model), targets,
                          notes=f"seq {seq_len}, {labels} labels",
                          export_module=model.with_gather_pooling().eval(),
                          export_note="adaptive max pooling as gather + max")
