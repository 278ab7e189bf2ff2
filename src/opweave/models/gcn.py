"""Two-layer GCN (Kipf & Welling, 2017) on a random Cora-sized graph.

The normalized adjacency D^-1/2 (A + I) D^-1/2 is held as a sparse COO matrix, as real
GCN code does; `dense=True` gives the dense-adjacency variant beside it. The adjacency is
a buffer (a constant of the graph), the node features are the input.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import BenchmarkModel


def random_normalized_adjacency(nodes: int, edges: int, generator: torch.Generator) -> torch.Tensor:
    """Symmetric random graph with `edges` directed edges (no self loops), plus self loops,
    normalized as D^-1/2 (A + I) D^-1/2, returned as a coalesced sparse COO tensor."""
    pairs = set()
    while len(pairs) < edges // 2:
        src, dst = torch.randint(0, nodes, (2,), generator=generator).tolist()
        if src != dst:
            pairs.add((min(src, dst), max(src, dst)))
    pair_index = torch.tensor(sorted(pairs)).t()
    loops = torch.arange(nodes).repeat(2, 1)
    index = torch.cat([pair_index, pair_index.flip(0), loops], dim=1)
    ones = torch.ones(index.shape[1])
    degree = torch.zeros(nodes).index_add_(0, index[0], ones)
    inv_sqrt = degree.rsqrt()
    values = inv_sqrt[index[0]] * inv_sqrt[index[1]]
    return torch.sparse_coo_tensor(index, values, (nodes, nodes), check_invariants=True).coalesce()


class GCN(torch.nn.Module):
    def __init__(self, adjacency: torch.Tensor, features: int, hidden: int, classes: int,
                 dropout: float = 0.5):
        super().__init__()
        self.register_buffer("adjacency", adjacency)
        self.layer1 = torch.nn.Linear(features, hidden)
        self.layer2 = torch.nn.Linear(hidden, classes)
        self.dropout = dropout

    def with_dense_adjacency(self) -> "GCN":
        """A twin sharing the layers, with the adjacency as a dense matrix (which ONNX
        exporters accept); same outputs up to float summation order."""
        twin = GCN(self.adjacency.to_dense(), 1, 1, 1, self.dropout)
        twin.layer1, twin.layer2 = self.layer1, self.layer2
        return twin

    def _propagate(self, x):
        if self.adjacency.is_sparse:
            return torch.sparse.mm(self.adjacency, x)
        return self.adjacency @ x

    def forward(self, features):
        x = F.dropout(features, self.dropout, self.training)
        x = F.relu(self._propagate(self.layer1(x)))
        x = F.dropout(x, self.dropout, self.training)
        return F.log_softmax(self._propagate(self.layer2(x)), dim=1)


class NodeClassificationLoss(torch.nn.Module):
    """Negative log-likelihood over the labelled (training) nodes."""

    def __init__(self, model: GCN, train_nodes: torch.Tensor):
        super().__init__()
        self.model = model
        self.register_buffer("train_nodes", train_nodes)

    def forward(self, features, targets):
        return F.nll_loss(self.model(features)[self.train_nodes], targets)


def gcn(small: bool = False, dense: bool = False) -> BenchmarkModel:
    nodes, edges, features, hidden, classes = (2708, 10556, 1433, 16, 7)
    if small:
        nodes, edges, features, hidden, classes = (64, 200, 32, 8, 4)
    generator = torch.Generator().manual_seed(0)
    adjacency = random_normalized_adjacency(nodes, edges, generator)
    if dense:
        adjacency = adjacency.to_dense()
    model = GCN(adjacency, features, hidden, classes)
    x = (torch.rand(nodes, features, generator=generator) < 0.05).float()
    train_nodes = torch.arange(min(140, nodes))
    targets = torch.randint(0, classes, (len(train_nodes),), generator=generator)
    name = "gcn-dense" if dense else "gcn"
    nnz = int((adjacency != 0).sum()) if dense else adjacency._nnz()
    return BenchmarkModel(name, model.eval(), (x,), NodeClassificationLoss(model, train_nodes),
                          targets, notes=f"{nodes} nodes, {nnz} nnz, "
                          + ("dense" if dense else "sparse") + " adjacency",
                          export_module=None if dense else model.with_dense_adjacency().eval(),
                          export_note="" if dense else "dense adjacency", batched=False)
