"""The ONNX backend node-test suite (shipped inside the `onnx` package) through opweave.

Every case is a model plus input and expected output arrays. A case passes when opweave
imports it and reproduces the outputs within the case's own tolerances; it is unsupported
when the importer refuses it (OnnxUnsupported: an op, type or attribute value opweave does
not implement); anything else, a wrong value or a crash, is a failure.
"""
from __future__ import annotations

import functools
import time
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from .errors import OnnxUnsupported
from .importer import HANDLERS

PASSED, FAILED, UNSUPPORTED = "passed", "failed", "unsupported"


@dataclass
class CaseResult:
    name: str
    op: str
    status: str
    detail: str = ""


@functools.lru_cache(maxsize=1)
def node_test_cases() -> tuple:
    """The node test cases of the installed onnx package, each with the op it tests."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from onnx.backend.test.case.node import collect_testcases

        cases = collect_testcases()
    single = {c.name: c.model.graph.node[0].op_type for c in cases if len(c.model.graph.node) == 1}
    result = []
    for case in cases:
        base = case.name.split("_expanded")[0]
        op = single.get(case.name) or single.get(base) or _guess_op(case)
        result.append((op, case))
    return tuple(result)


def _guess_op(case) -> str:
    types = [n.op_type for n in case.model.graph.node]
    return types[-1] if types else "?"


def run_case(case, op: str) -> CaseResult:
    from .model import OnnxModel

    try:
        model = OnnxModel(case.model, name=case.name)
        for inputs, expected in case.data_sets:
            inputs, expected = _arrays(inputs), _arrays(expected)
            got = model(*inputs)
            _compare(got, expected, case.rtol, case.atol)
    except OnnxUnsupported as refused:
        return CaseResult(case.name, op, UNSUPPORTED, _short(str(refused)))
    except AssertionError as wrong:
        return CaseResult(case.name, op, FAILED, _short(str(wrong)))
    except Exception as error:  # a crash on a claimed op is a failure too
        return CaseResult(case.name, op, FAILED, f"{type(error).__name__}: {_short(str(error))}")
    return CaseResult(case.name, op, PASSED)


def _arrays(values) -> list[np.ndarray]:
    import onnx
    from onnx import numpy_helper

    result = []
    for value in values:
        if isinstance(value, onnx.TensorProto):
            value = numpy_helper.to_array(value)
        elif isinstance(value, np.generic):
            value = np.asarray(value)
        if not isinstance(value, np.ndarray):
            raise OnnxUnsupported(f"{type(value).__name__} values (sequences, optionals)")
        result.append(value)
    return result


def _compare(got, expected, rtol, atol) -> None:
    assert len(got) == len(expected), f"{len(got)} outputs, expected {len(expected)}"
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.dtype == e.dtype, f"output {i} has dtype {g.dtype}, expected {e.dtype}"
        assert g.shape == e.shape, f"output {i} has shape {g.shape}, expected {e.shape}"
        if e.dtype.name == "bfloat16":
            g, e = g.astype(np.float32), e.astype(np.float32)
        np.testing.assert_allclose(g, e, rtol=rtol, atol=atol, err_msg=f"output {i}")


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass
class Report:
    results: list[CaseResult]
    seconds: float
    by_op: dict = field(init=False)

    def __post_init__(self):
        self.by_op = defaultdict(Counter)
        for r in self.results:
            self.by_op[r.op][r.status] += 1

    def count(self, status: str) -> int:
        return sum(1 for r in self.results if r.status == status)

    @property
    def claimed_ops(self) -> list[str]:
        """Ops opweave implements that have cases in the suite."""
        return sorted(op for op in self.by_op if op in HANDLERS)

    def full_ops(self) -> list[str]:
        """Claimed ops whose every case passes."""
        return [op for op in self.claimed_ops if set(self.by_op[op]) == {PASSED}]

    def claimed_pass_rate(self) -> float:
        passed = sum(self.by_op[op][PASSED] for op in self.claimed_ops)
        failed = sum(self.by_op[op][FAILED] for op in self.claimed_ops)
        return passed / (passed + failed) if passed + failed else 1.0

    def text(self, verbose: bool = False) -> str:
        lines = [f"ONNX backend node tests: {len(self.results)} cases in {self.seconds:.0f} s: "
                 f"{self.count(PASSED)} passed, {self.count(FAILED)} failed, "
                 f"{self.count(UNSUPPORTED)} unsupported",
                 f"ops opweave claims: {len(self.claimed_ops)}; every case passes for "
                 f"{len(self.full_ops())}; pass rate over their imported cases "
                 f"{self.claimed_pass_rate():.1%} (a refused case is unsupported, never wrong)",
                 "", f"{'op':<28}{'passed':>7}{'failed':>7}{'unsupp.':>8}  claimed"]
        for op in sorted(self.by_op):
            c = self.by_op[op]
            if not verbose and op not in HANDLERS and not c[FAILED]:
                continue
            lines.append(f"{op:<28}{c[PASSED]:>7}{c[FAILED]:>7}{c[UNSUPPORTED]:>8}  "
                         f"{'yes' if op in HANDLERS else 'no'}")
        unclaimed = sorted(op for op in self.by_op if op not in HANDLERS)
        lines += ["", f"unsupported ops ({len(unclaimed)}): " + ", ".join(unclaimed)]
        failures = [r for r in self.results if r.status == FAILED]
        if failures:
            lines += ["", "FAILURES:"] + [f"  {r.name} ({r.op}): {r.detail}" for r in failures]
        refused = [r for r in self.results if r.status == UNSUPPORTED and r.op in HANDLERS]
        if refused:
            lines += ["", "refused cases of claimed ops:"]
            lines += [f"  {r.name}: {r.detail}" for r in refused]
        return "\n".join(lines)


def run(ops: set[str] | None = None) -> Report:
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = [run_case(case, op) for op, case in node_test_cases()
                   if ops is None or op in ops]
    return Report(results, time.perf_counter() - start)
