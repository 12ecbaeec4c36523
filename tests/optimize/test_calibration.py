"""``--calibration``: static int8 calibrated on the user's input sets (real data) instead of sets
derived from the example - read from a .pt, an .npz or a function, checked against the file's
inputs, used by the quantizer, and refused where it cannot apply."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import onnxmedic
from onnxmedic.findings import OnnxMedicError
from onnxmedic.inputs import load_calibration
from onnxmedic.optimize import (
    Pipeline,
    given_calibration_feeds,
    optimization_finding,
    optimize,
    passes,
)
from tests import onnx_models as om
from tests.optimize.test_static_int8 import FAST, STATIC

CNN = """
import torch


class CNN(torch.nn.Sequential):
    def __init__(self):
        torch.manual_seed(0)
        super().__init__(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
                         torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU(),
                         torch.nn.Conv2d(16, 8, 1))
"""


@pytest.fixture(scope="module")
def cnn(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path, Path]:
    """(the model, its .py file, its export)."""
    folder = tmp_path_factory.mktemp("cal")
    (folder / "cnn.py").write_text(CNN)
    model = onnxmedic.inputs.load_model(f"{folder / 'cnn.py'}:CNN")[0].eval()
    src = folder / "cnn.onnx"
    torch.onnx.export(model, (torch.randn(1, 3, 24, 24),), str(src), dynamo=True,
                      verbose=False)
    return model, folder / "cnn.py", src


def test_load_calibration_reads_every_form(tmp_path: Path) -> None:
    xs = [torch.randn(1, 3, 4) for _ in range(3)]
    torch.save(xs, tmp_path / "list.pt")
    torch.save([((x,), {"scale": torch.tensor(2.0)}) for x in xs], tmp_path / "args.pt")
    np.savez(tmp_path / "named.npz", x=np.stack([x.numpy() for x in xs]))
    np.savez(tmp_path / "positional.npz", np.stack([x.numpy() for x in xs]), np.arange(3))
    (tmp_path / "cal.py").write_text(
        "import torch\n"
        "def sets():\n"
        "    return (torch.full((1, 3, 4), float(i)) for i in range(4))\n")
    one = load_calibration(str(tmp_path / "list.pt"))
    assert len(one) == 3 and torch.equal(one[1].args[0], xs[1])
    two = load_calibration(str(tmp_path / "args.pt"))
    assert two[2].kwargs["scale"].item() == 2.0 and torch.equal(two[2].args[0], xs[2])
    named = load_calibration(str(tmp_path / "named.npz"))
    assert len(named) == 3 and np.array_equal(named[0].kwargs["x"], xs[0].numpy())
    positional = load_calibration(str(tmp_path / "positional.npz"))
    assert [int(s.args[1]) for s in positional] == [0, 1, 2]
    made = load_calibration(f"{tmp_path / 'cal.py'}:sets")
    assert [s.args[0].max().item() for s in made] == [0.0, 1.0, 2.0, 3.0]


class Evil:
    def __reduce__(self) -> tuple:
        return (print, ("ran",))


@pytest.mark.parametrize("name, content, code, message", [
    ("tuple.pt", (torch.zeros(2), torch.zeros(2)), "OM005", "tuple, not a list of input sets"),
    ("empty.pt", [], "OM005", "holds no input sets"),
    ("strings.pt", ["a"], "OM005", "set 0 returned str"),
    ("evil.pt", Evil(), "OM005", "refused without running any of its code"),
    ("ragged.npz", {"x": np.zeros((3, 2)), "m": np.zeros((2, 2))}, "OM005", "first axis"),
    ("missing.pt", None, "OM005", "does not exist"),
    ("nonsense", None, "OM004", "cannot read calibration spec"),
    ("", None, "OM004", "empty calibration spec")])
def test_load_calibration_refuses_what_is_not_a_list_of_input_sets(
        tmp_path: Path, name: str, content: object, code: str, message: str) -> None:
    path = tmp_path / name
    if name.endswith(".npz"):
        np.savez(path, **content)
    elif content is not None:
        torch.save(content, path)
    with pytest.raises(OnnxMedicError) as exc:
        load_calibration(str(path) if name.endswith((".pt", ".npz")) else name)
    assert exc.value.finding.code == code and message in exc.value.finding.message


def test_given_calibration_sets_are_checked_against_the_file(
        cnn: tuple[torch.nn.Module, Path, Path]) -> None:
    _, _, src = cnn
    good = given_calibration_feeds(src, [torch.randn(1, 3, 24, 24).double()])  # cast: ranges
    assert [a.dtype for a in good[0].values()] == [np.float32]
    with pytest.raises(OnnxMedicError, match="calibration set 1: input '.+' has rank 3") as exc:
        given_calibration_feeds(src, [torch.randn(1, 3, 24, 24), torch.randn(3, 24, 24)])
    assert exc.value.finding.code == "OM008"
    with pytest.raises(OnnxMedicError, match="calibration set 0: the ONNX model has 1 input"):
        given_calibration_feeds(src, [(torch.randn(1, 3, 24, 24), torch.randn(2))])
    with pytest.raises(TypeError, match="a list of input sets"):
        given_calibration_feeds(src, (torch.randn(1, 3, 24, 24),))


def test_cli_optimize_calibrates_static_int8_on_the_given_sets(
        cnn: tuple[torch.nn.Module, Path, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from onnxmedic.cli import main
    from onnxmedic.optimize import candidates

    _, py, src = cnn
    asked = []
    monkeypatch.setattr(candidates, "default_pipelines",
                        lambda *a, **k: asked.append(a) or [STATIC])
    torch.manual_seed(1)
    # covering the range the verification sets are drawn in (the example's: about +-4)
    torch.save([torch.rand(1, 3, 24, 24) * 8 - 4 for _ in range(5)], tmp_path / "cal.pt")
    rc = main(["optimize", str(src), f"{py}:CNN", "--input", "1x3x24x24:float32",
               "--precision", "int8", "--calibration", str(tmp_path / "cal.pt"), "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    static = data["variants"][1]
    assert static["verified"], static["rejected"]
    assert static["steps"][-1]["calibration_sets"] == 5 and data["calibration"] == (
        "5 given set(s)")
    assert asked[0][3] is True  # static int8 asked for, whatever the graph
    rc = main(["optimize", str(src), f"{py}:CNN", "--input", "1x3x24x24:float32",
               "--precision", "int8", "--calibration", str(tmp_path / "missing.pt")])
    assert rc == 1 and "OM005" in capsys.readouterr().err


def test_static_int8_is_only_as_good_as_its_calibration_sets(
        cnn: tuple[torch.nn.Module, Path, Path]) -> None:
    """Sets 1000x narrower than the inputs the model sees: every activation saturates the
    calibrated range, the all-layers variant fails the budget and so does keeping layers
    float32 - the sets given are the ones the quantizer used."""
    model, _, src = cnn
    torch.manual_seed(1)
    narrow = [torch.randn(1, 3, 24, 24) * 1e-3 for _ in range(4)]
    res = optimize(src, model, (torch.randn(1, 3, 24, 24),), precision="int8",
                   pipelines=[STATIC], calibration=narrow, **FAST)
    v = res.variants[1]
    assert any("ranking" in s for s in v.steps)  # measured: the first attempt failed
    assert v.steps[-1]["calibration_sets"] == 4
    # up to two of three layers float32 (never all: nothing would be quantized), still
    # outside; the variant reported is the all-layers one (the fastest file), with the tries
    assert not v.verified and v.steps[-1]["excluded"] == []
    assert re.search(r"\(every layer int8; keeping up to the 2 most sensitive layer\(s\) in "
                     r"float32 did not reach the budget either; worst cosine by layers kept "
                     r"float32: 0 -> 0\.\d{5}, 1 -> 0\.\d{5}, 2 -> 0\.\d{5}\)", v.rejected)
    # and the report says why: the inputs reach far beyond the calibrated range
    assert "reach beyond the calibration sets' range" in v.rejected
    assert res.calibration == "4 given set(s)"
    assert "static int8 calibrated on 4 given set(s)" in optimization_finding(res).message


def test_given_calibration_makes_static_int8_a_candidate_for_any_graph(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from onnxmedic.optimize import candidates

    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    x = torch.randn(2, 8)
    src = tmp_path / "mlp.onnx"
    torch.onnx.export(mlp.eval(), (x,), str(src), dynamo=True, verbose=False)
    asked = []
    monkeypatch.setattr(candidates, "default_pipelines", lambda *a, **k: asked.append(a) or [])
    optimize(src, mlp, (x,), precision="int8", **FAST)
    res = optimize(src, mlp, (x,), precision="int8", calibration=[torch.randn(2, 8)], **FAST)
    assert [a[3] for a in asked] == [False, True]
    assert res.calibration == ""  # no static candidate ran: nothing was calibrated


def test_calibration_is_refused_where_it_cannot_apply(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from onnxmedic.cli import main

    (tmp_path / "m.py").write_text("import torch\nM = torch.nn.ReLU\n")
    rc = main(["export", f"{tmp_path / 'm.py'}:M", "--input", "2:float32", "-o",
               str(tmp_path / "m.onnx"), "--optimize", "--precision", "int8", "--calibration",
               str(tmp_path / "missing.pt")])
    err = capsys.readouterr().err
    assert rc == 1 and "input file unusable: calibration file" in err and "does not exist" in err
    assert not (tmp_path / "m.onnx").exists()  # refused before the export ran

    for options, got in (({"optimize": True}, "not precision='fp32'"),
                         ({"precision": "int8"}, "not optimize=False, precision='int8'")):
        with pytest.raises(ValueError) as err:
            onnxmedic.export(torch.nn.ReLU(), (torch.randn(2),), calibration=[torch.randn(2)],
                             **options)
        assert "calibration sets are for " in str(err.value) and got in str(err.value)
    with pytest.raises(ValueError, match=r"for precision='int8' \(static int8\), not precision="):
        optimize("unused.onnx", torch.nn.ReLU(), (torch.randn(2),), precision="fp32",
                 calibration=[torch.randn(2)])
    with pytest.raises(SystemExit) as exc:
        main(["export", "m.py:M", "-o", "x.onnx", "--calibration", "cal.pt"])
    assert exc.value.code == 2
    assert "--calibration is for --optimize --precision int8" in capsys.readouterr().err
    assert main(["optimize", "in.onnx", "m.py:M", "--calibration", "cal.pt"]) == 2
    assert "--calibration is for --precision int8" in capsys.readouterr().err


def test_the_coverage_hint_names_float_inputs_beyond_the_calibrated_range() -> None:
    from onnxmedic.optimize.int8_search import coverage_hint

    cal = [{"x": np.array([-1.0, 0.5], np.float32), "ids": np.array([5])},
           {"x": np.array([1.0], np.float32), "ids": np.array([6])}]
    within = [{"x": np.array([-1.01, 1.0], np.float32), "ids": np.array([90])}]
    assert coverage_hint(cal, within) == ""  # 1 % slack; integer inputs are not ranges
    beyond = within + [{"x": np.array([0.0, 3.0], np.float32), "ids": np.array([1])}]
    assert "(x: [-1.01, 3] against [-1, 1])" in coverage_hint(cal, beyond)


def test_export_optimize_passes_the_calibration_sets_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """export(..., calibration=) reaches optimize: static int8 is asked for; sets that do not
    fit the exported file are an OM008 (exit 1) and the verified plain export stays written."""
    from onnxmedic.optimize import candidates

    asked = []
    monkeypatch.setattr(candidates, "default_pipelines", lambda *a, **k: asked.append(a) or [])
    model, x = torch.nn.Linear(4, 2).eval(), torch.randn(3, 4)
    seen: list[str] = []
    res = onnxmedic.export(model, (x,), tmp_path / "a.onnx", optimize=True, precision="int8",
                           calibration=[torch.randn(3, 4)], cuda_graph="off",
                           on_stage=seen.append)
    assert res.ok and asked == [("cpu", "int8", None, True)]
    assert seen[-2:] == ["write", "optimize"]  # the pipeline's optional last stage
    res = onnxmedic.export(model, (x,), tmp_path / "b.onnx", optimize=True, precision="int8",
                           calibration=[torch.randn(3, 4, 5)], cuda_graph="off")
    bad = next(f for f in res.findings if f.code == "OM008")
    assert not res.ok and res.exit_code == 1 and bad.message.startswith("calibration set 0:")
    assert (tmp_path / "b.onnx").is_file() and len(asked) == 1


def test_the_int8_search_says_why_it_stopped_and_how_the_cosine_moved() -> None:
    from onnxmedic.optimize.int8_search import search_end

    tries = [(0, 0.99696), (1, 0.997), (2, 0.99702)]
    assert search_end(2, None, tries, 600) == (
        " (every layer int8; keeping up to the 2 most sensitive layer(s) in float32 did not "
        "reach the budget either; worst cosine by layers kept float32: 0 -> 0.99696, "
        "1 -> 0.99700, 2 -> 0.99702)")
    assert search_end(1, 2, tries[:2], 60) == (
        " (every layer int8; sensitivity search stopped after 60 s; worst cosine by layers "
        "kept float32: 0 -> 0.99696, 1 -> 0.99700)")
    assert search_end(0, None, tries[:1], 600) == " (its only layer int8)"
    assert search_end(0, 1, tries[:1], 60) == (
        " (every layer int8; sensitivity search stopped after 60 s)")


def test_the_coverage_hint_is_for_static_int8_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamic int8 measures its ranges at run time: calibration sets cannot explain its
    failure."""
    from onnxmedic.optimize import Rejection, Variant, Verifier, Why, candidates
    from onnxmedic.optimize.maker import CandidateMaker

    monkeypatch.setattr(candidates, "int8_with_sensitivity", lambda pipe, *a, **k: (
        Variant(pipe.name, "int8", rejection=Rejection(
            Why.OUTSIDE_BUDGET, candidates.OUTSIDE_BUDGET + ": out: cosine 0.9")),
        Path("unused.onnx")))
    cal = [{"x": np.zeros(2, np.float32)}]
    feeds = [{"x": np.array([-1.0, 1.0], np.float32)}]
    dynamic = Pipeline("int8-dynamic", [(f"{passes.__name__}:quantize_int8", {})],
                       precision="int8")
    verifier = Verifier(["out"], feeds, [], 0.999, 60.0, None, "cpu")
    hints = [candidates.candidate(p, Path("m.onnx"), CandidateMaker(Path("."), 60.0), verifier,
                                  cal)[0].rejected
             for p in (STATIC, dynamic)]
    assert "reach beyond the calibration sets' range" in hints[0]
    assert "calibration" not in hints[1]


def test_cli_optimize_table_says_what_static_int8_was_calibrated_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from onnxmedic.cli import main
    from onnxmedic.optimize import OptimizationResult, Variant

    asked = {}

    def canned(*args: object, **kwargs: object) -> OptimizationResult:
        asked.update(kwargs)
        return OptimizationResult([Variant("plain", verified=True)], "plain", 2, 1, 1, 1,
                                  message="no variant beat the plain export",
                                  calibration="2 given set(s)")

    monkeypatch.setattr(sys.modules["onnxmedic.optimize"], "optimize", canned)
    (tmp_path / "m.py").write_text("import torch\nM = torch.nn.ReLU\n")
    torch.save([torch.randn(2), torch.randn(2)], tmp_path / "cal.pt")
    onnx_file = om.identity_model(tmp_path / "in.onnx", (2,))  # optimize reads it first
    assert main(["optimize", str(onnx_file), f"{tmp_path / 'm.py'}:M", "--input", "2:float32",
                 "--precision", "int8", "--calibration", str(tmp_path / "cal.pt")]) == 0
    assert len(asked["calibration"]) == 2
    assert ("static int8 calibrated on 2 given set(s) (--calibration); verified, like every "
            "variant, on the export's input sets") in capsys.readouterr().out
