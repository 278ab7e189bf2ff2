"""`opweave bench --device cuda`: refused clearly without a GPU; its table (ratios over
eager, failures named) from results, as the GPU run prints it."""
from __future__ import annotations

import pytest
import torch

from opweave.bench.gpu import Entry, ModelResult, table
from opweave.cli import main


def test_the_table_gives_each_backend_its_ratio_over_eager():
    results = [ModelResult("bert-base", [Entry("eager", 4.0), Entry("inductor", 2.0),
                                         Entry("opweave", 1.0), Entry("ort-cuda", note="none")])]
    text = table(results, ["eager", "inductor", "opweave", "ort-cuda"])
    assert "| bert-base | 4.000 | 2.000 (2.00x) | 1.000 (4.00x) | failed |" in text


def test_without_a_gpu_the_command_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["bench", "--device", "cuda"]) == 2
    assert "--device cuda needs a CUDA GPU" in capsys.readouterr().err
