"""The analytic roofline: measured parameters, cache sizes from sysfs, the cache-or-DRAM
bandwidth choice, and the machine a compile costs with."""
from __future__ import annotations

import math

import pytest
import torch

from opweave import cost
from opweave.cost import machine as measured
from opweave.cost.model import Machine
from opweave.ir import TensorType


def _cache(root, index, level, kind, size):
    d = root / f"index{index}"
    d.mkdir()
    for name, value in (("level", level), ("type", kind), ("size", size)):
        (d / name).write_text(f"{value}\n")


def test_cache_sizes_are_read_from_sysfs(tmp_path):
    _cache(tmp_path, 0, 1, "Data", "32K")
    _cache(tmp_path, 1, 1, "Instruction", "32K")
    _cache(tmp_path, 2, 2, "Unified", "512K")
    _cache(tmp_path, 3, 3, "Unified", "32768K")
    (tmp_path / "index4").mkdir()  # unreadable entries are skipped
    assert measured.cache_sizes(tmp_path) == {"L1d": 32768, "L1i": 32768, "L2": 512 * 1024,
                                              "L3": 32 * 1024 ** 2}
    assert measured.cache_sizes(tmp_path / "missing") == {}


def test_bandwidth_is_the_cache_one_while_the_data_fits():
    m = Machine(flops=1e12, bandwidth=10e9, launch=1e-6, cache_bytes=1 << 20,
                cache_bandwidth=100e9)
    assert math.isclose(m.seconds(0, 1 << 20), (1 << 20) / 100e9 + 1e-6)
    assert math.isclose(m.seconds(0, 2 << 20), (2 << 20) / 10e9 + 1e-6)
    assert math.isclose(m.seconds(4e12, 0), 4 + 1e-6)  # compute-bound
    assert math.isclose(Machine().seconds(0, 1024), 1024 / Machine().bandwidth + Machine().launch)


@pytest.mark.parametrize("field,value", [("flops", 0.0), ("bandwidth", float("nan")),
                                         ("launch", -1.0), ("cache_bytes", -1)])
def test_nonsense_parameters_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        Machine(**{field: value}).check()


def test_node_seconds_uses_the_active_machine():
    x = TensorType((1024, 1024), torch.float32)
    default = cost.node_seconds("exp", [x], [x], {})
    slow = Machine(flops=1e9, bandwidth=1e8, launch=1e-3)
    with cost.using(slow):
        assert cost.active() is slow
        assert cost.node_seconds("exp", [x], [x], {}) > 100 * default
    assert cost.active() is cost.CPU and cost.node_seconds("exp", [x], [x], {}) == default


def test_measure_gives_finite_positive_parameters():
    threads = torch.get_num_threads()
    machine, about = measured.measure(threads=1, quick=True)
    machine.check()
    assert machine.cache_bandwidth > 0 and machine.cache_bytes > 0
    assert about["threads"] == 1 and torch.get_num_threads() == threads  # restored
    assert 1e8 < measured.measure_gemm_peak(sizes=(256,), seconds_per_size=0.05) < 1e13
