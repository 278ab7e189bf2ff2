"""The ONNX backend node tests: every case of every op opweave claims is right or refused."""
from __future__ import annotations

import functools


from opweave.onnx import conformance
from opweave.onnx.importer import HANDLERS

# Ops whose every case in the suite passes (onnx 1.23); a regression fails here.
FULLY_PASSING = {
    "Abs", "And", "Celu", "Clip", "Concat", "Constant", "ConstantOfShape", "Conv",
    "ConvTranspose", "Cos",
    "Elu", "Erf", "Exp", "Expand", "Flatten", "Gather", "GatherElements", "Gelu", "Gemm",
    "GlobalAveragePool", "GlobalMaxPool", "HardSigmoid", "HardSwish", "IsInf", "IsNaN",
    "LayerNormalization", "LeakyRelu", "Log", "LogSoftmax", "MatMul", "Mean", "Neg", "Not",
    "Or", "Pad", "PRelu", "Reciprocal", "ReduceMean", "Relu", "Reshape", "Selu", "Shape",
    "Sigmoid", "Sin", "Size", "Slice", "Softmax", "Softsign", "Split", "Sqrt", "Squeeze",
    "Sum", "Tanh", "ThresholdedRelu", "Transpose", "Unsqueeze", "Upsample", "Where", "Xor",
}


@functools.lru_cache(maxsize=None)
def report() -> conformance.Report:
    return conformance.run()


def test_no_case_fails_anywhere():
    """Claimed or not, no case may import and then give a wrong answer or crash."""
    failures = [f"{r.name} ({r.op}): {r.detail}" for r in report().results
                if r.status == conformance.FAILED]
    assert not failures, "\n".join(failures)


def test_claimed_ops_pass_every_case_they_import():
    rep = report()
    assert rep.claimed_pass_rate() == 1.0
    assert len(rep.claimed_ops) >= 75
    assert rep.count(conformance.PASSED) >= 730


def test_fully_passing_ops_do_not_regress():
    missing = FULLY_PASSING - set(report().full_ops())
    assert not missing, f"ops that no longer pass all their cases: {sorted(missing)}"


def test_unsupported_ops_are_refused_by_name():
    """A case whose model contains an op opweave lacks is refused, naming that op (older
    opsets are left out: the version converter may turn such an op into one we have)."""
    from opweave.onnx.load import default_opset

    cases = {case.name: case for _, case in conformance.node_test_cases()}
    checked = 0
    for result in report().results:
        model = cases[result.name].model
        if default_opset(model) < 13:
            continue
        ops = {node.op_type for node in model.graph.node}
        lacking = sorted(ops - set(HANDLERS))
        if lacking:
            checked += 1
            assert result.status == conformance.UNSUPPORTED, result
            assert any(op in result.detail for op in lacking), result.detail
    assert checked > 500
