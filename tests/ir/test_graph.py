"""The Graph's own queries."""
from __future__ import annotations

import torch

from opweave.ir import Graph, TensorType


def test_users_lists_each_reader_in_graph_order_once_per_operand():
    g = Graph("users")
    x = g.add_input("x", TensorType((2, 3), torch.float32))
    square = g.add1("mul", [x, x])
    total = g.add1("add", [square, x])
    g.outputs = [total]
    users = g.users()
    assert users[x] == [square.producer, square.producer, total.producer]
    assert users[square] == [total.producer]
    assert total not in users  # nothing reads the output
