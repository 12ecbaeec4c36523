"""The OpInfo coverage harness (bench/peers/opinfo_coverage.py) on a few ops, through its Python API."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "peers" / "opinfo_coverage.py"


@pytest.fixture(scope="module")
def coverage():
    spec = importlib.util.spec_from_file_location("opinfo_coverage", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["opinfo_coverage"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def result(coverage):
    # sin passes under both; erfinv has no torchlib translation (export fails) but onnxmedic
    # has one; cos's first sample crashes its worker (injected), which must be recorded while
    # the run goes on with a fresh worker.
    mp = pytest.MonkeyPatch()
    mp.setenv(coverage.FAULT_ENV, "crash:cos:0")
    try:
        return coverage.run_coverage(["sin", "erfinv", "cos"], limit_samples=2, jobs=1,
                                     timeout=300)
    finally:
        mp.undo()


def test_statuses(result) -> None:
    assert sorted(o.key for o in result.ops) == ["cos", "erfinv", "sin"]
    sin, cos, erfinv = (result.op(k) for k in ("sin", "cos", "erfinv"))
    assert (sin.status("torch_onnx"), sin.status("onnxmedic")) == ("passed", "passed")
    assert (erfinv.status("torch_onnx"), erfinv.status("onnxmedic")) == ("export", "passed")
    assert "erf_inv" in erfinv.samples[0]["torch_onnx"]["error"]  # prims.erf_inv
    assert result.differing() == [("erfinv", "export", "passed")]
    assert "aten.erfinv.default" in result.registry


def test_crash_is_recorded_and_run_continues(result) -> None:
    cos = result.op("cos")
    assert cos.samples[0]["torch_onnx"]["stage"] == "crash"
    assert cos.samples[0]["onnxmedic"]["stage"] == "crash"
    assert "worker exited with 3" in cos.samples[0]["torch_onnx"]["error"]
    assert cos.status("torch_onnx") == "crash"
    # the samples after the crash ran in the replacement worker
    assert all(s["torch_onnx"]["stage"] == "passed" for i, s in cos.samples.items() if i > 0)
    assert len(cos.samples) == 2


def test_counts(result) -> None:
    for column, passed in (("torch_onnx", 1), ("onnxmedic", 2)):
        s = result.summary(column)
        assert s["tested"] == 3
        assert s["passed"] == passed
        assert s["crash"] == 1
        assert s["compare"] == 0 and s["any_silent"] == 0
    assert result.summary("torch_onnx")["export"] == 1
    assert result.summary("onnxmedic")["export"] == 0
    data = result.to_dict()
    assert data["summary"]["onnxmedic"]["passed"] == 2
    assert {o["name"] for o in data["ops"]} == {"sin", "cos", "erfinv"}


def test_select_ops(coverage) -> None:
    assert coverage.select_ops(["scatter_reduce.mean"]) == [("scatter_reduce", "mean")]
    assert len(coverage.select_ops(["scatter_reduce"])) == 5
    with pytest.raises(KeyError, match="no_such_op"):
        coverage.select_ops(["no_such_op"])


def test_up_to_sign_ops_use_their_comparator_in_both_columns(coverage, monkeypatch) -> None:
    """linalg.eigh's first OpInfo sample: the eigenvectors differ from LAPACK's in sign, which
    the harness counted as a silent mismatch; with the documented comparator it passes, the
    result names the comparator, and torch.onnx's column gets the same treatment."""
    import torch

    from onnxmedic.ops.testing import comparator_for

    monkeypatch.setattr(coverage, "_emit", lambda event: None)
    a = torch.randn(5, 5, generator=torch.Generator().manual_seed(0))
    plain = coverage._check_sample(torch.linalg.eigh, (a,), {"UPLO": "U"})
    assert plain["onnxmedic"]["stage"] == "compare"
    out = coverage._check_sample(torch.linalg.eigh, (a,), {"UPLO": "U"},
                                 comparator_for("linalg.eigh"))
    assert out["onnxmedic"]["stage"] == "passed"
    assert out["onnxmedic"]["comparator"] == "eigh-up-to-sign"
    assert out["torch_onnx"]["stage"] == "export"  # torchlib has no eigh: nothing to compare


def test_report_lists_the_ops_compared_up_to_sign(coverage) -> None:
    import io

    from rich.console import Console

    r = coverage.CoverageResult(ops=[coverage.OpResult("linalg.eigh"), coverage.OpResult("sin")],
                                seconds=0.0, jobs=1, limit_samples=1)
    buf = io.StringIO()
    coverage.print_report(r, Console(file=buf, width=200))
    text = buf.getvalue()
    assert "Per-op comparators (1 ops" in text
    assert "linalg.eigh: eigh-up-to-sign: eigenvalues elementwise" in text
