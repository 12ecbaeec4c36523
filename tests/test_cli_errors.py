"""Every command's error paths: a user's mistake is a finding and exit 1 (or 2), an exception
onnxmedic did not expect is OM009 and exit 3 with its traceback kept - never a traceback on
stderr. The commands are read from the parser itself, so a new one cannot go untested."""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from onnxmedic import cli
from tests import onnx_models as om

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tests/models.py:Identity"


def _commands() -> list[str]:
    spec = importlib.util.spec_from_file_location("gen_cli_doc", ROOT / "tools" / "gen_cli_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return sorted(mod.subcommands(cli.build_parser()))


COMMANDS = _commands()

# a user's mistake per command: (arguments, finding code, exit code); {tmp}: a fresh folder
MISTAKES: dict[str, tuple[list[str], str, int]] = {
    "export": (["export", "{tmp}/missing.py:M", "--input", "2"], "OM001", 1),
    "verify": (["verify", "{tmp}/missing.onnx", MODEL, "--input", "2x3"], "OM007", 1),
    "doctor": (["doctor", "{tmp}/missing.onnx"], "OM007", 1),
    "run": (["run", "{tmp}/missing.onnx", "--input", "2x3"], "OM007", 1),
    "reduce": (["reduce", "{tmp}/missing.onnx", "-o", "{tmp}/min.onnx"], "OM007", 1),
    "sweep": (["sweep", "{tmp}/missing_zoo.py"], "OM704", 1),
    "optimize": (["optimize", "{tmp}/missing.onnx", MODEL, "--input", "2x3"], "OM007", 1),
    "bench": (["bench", "{tmp}/missing.onnx", "--input", "2x3"], "OM007", 1),
}


@pytest.fixture(autouse=True)
def _temp_folder(tmp_path, monkeypatch):
    """The traceback files OM009 writes land in the test's own folder."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def _main(args: list[str], tmp: Path, capsys) -> tuple[int, str, str]:
    rc = cli.main([a.replace("{tmp}", str(tmp)) for a in args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err  # (--json's result on stdout keeps it)
    return rc, out, err


def test_every_command_is_dispatched_and_has_an_error_path_here():
    assert COMMANDS == sorted(cli.COMMANDS) == sorted(MISTAKES)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_users_mistake_is_a_finding_not_a_traceback(command, tmp_path, capsys):
    args, code, exit_code = MISTAKES[command]
    rc, out, err = _main(args, tmp_path, capsys)
    assert rc == exit_code and code in out + err, (rc, out, err)


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unexpected_exception_is_om009_exit_3_with_its_traceback_kept(
        command, tmp_path, capsys, monkeypatch):
    def broken(ns):
        raise RuntimeError(f"simulated bug in {ns.command}")

    monkeypatch.setitem(cli.COMMANDS, command, broken)
    args = MISTAKES[command][0]
    rc, out, err = _main(args, tmp_path, capsys)
    assert rc == 3 and "OM009" in err and f"simulated bug in {command}" in err, err
    kept = Path(re.search(r"traceback saved in (?:the report )?(\S+)", err).group(1))
    assert kept.parent == tmp_path and "Traceback" in kept.read_text()


def test_the_report_and_json_keep_an_unexpected_exception(tmp_path, capsys, monkeypatch):
    def broken(ns):
        raise RuntimeError("simulated bug")

    monkeypatch.setitem(cli.COMMANDS, "doctor", broken)
    rc, out, err = _main(["doctor", "x.onnx", "--json", "--report", str(tmp_path / "r.json")],
                         tmp_path, capsys)
    assert rc == 3 and f"saved in the report {tmp_path / 'r.json'}" in err
    for d in (json.loads(out), json.loads((tmp_path / "r.json").read_text())):
        assert d["exit_code"] == 3 and d["findings"][0]["code"] == "OM009"
        assert "simulated bug" in d["traceback"] and "Traceback" in d["traceback"]


def test_a_report_that_cannot_be_written_sends_the_traceback_to_a_file(tmp_path, capsys,
                                                                       monkeypatch):
    def broken(ns):
        raise RuntimeError("simulated bug")

    monkeypatch.setitem(cli.COMMANDS, "doctor", broken)
    rc, _, err = _main(["doctor", "x.onnx", "--report", str(tmp_path / "no" / "r.json")],
                       tmp_path, capsys)
    kept = Path(re.search(r"traceback saved in (\S+)", err).group(1))
    assert rc == 3 and kept.parent == tmp_path and "simulated bug" in kept.read_text()


def test_deep_faults_in_bench_and_optimize_are_om009(tmp_path, capsys, monkeypatch):
    """Where the exception is raised does not matter: bench's timing and optimize's package
    branch (reading the package's contract) raise; each is OM009, exit 3."""
    from onnxmedic import genpackage

    def broken(*a, **k):
        raise ValueError("past input 'past_key_values.0.key' is not (batch, heads, ...)")

    monkeypatch.setattr(importlib.import_module("onnxmedic.optimize"), "bench", broken)
    model = om.identity_model(tmp_path / "m.onnx")
    rc, _, err = _main(["bench", str(model), "--input", "2x3"], tmp_path, capsys)
    assert rc == 3 and "OM009" in err and "ValueError" in err
    # a module that binds read_package by name must be imported before the patch, or it
    # keeps the broken one for the tests that run after this one in the same process
    importlib.import_module("onnxmedic.hf.transforms.passes")
    monkeypatch.setattr(genpackage, "read_package", broken)
    (tmp_path / "pkg").mkdir()
    om.identity_model(tmp_path / "pkg" / "model.onnx")
    rc, _, err = _main(["optimize", str(tmp_path / "pkg"), "hf:ckpt", "-o",
                        str(tmp_path / "out"), "--precision", "int4"], tmp_path, capsys)
    assert rc == 3 and "OM009" in err and "past_key_values.0.key" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("kind", "code"), [("empty folder", "OM014"),
                                            ("other files", "OM014"),
                                            ("corrupt model.onnx", "OM007")])
def test_optimize_refuses_a_folder_that_is_not_a_package(kind, code, tmp_path, capsys):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    if kind == "other files":
        (pkg / "config.json").write_text("{}")
    elif kind == "corrupt model.onnx":
        (pkg / "model.onnx").write_bytes(b"not onnx at all")
    rc, _, err = _main(["optimize", str(pkg), "hf:ckpt", "-o", str(tmp_path / "out")],
                       tmp_path, capsys)
    assert rc == 1 and code in err and "OM737" not in err, err  # refused before loading
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("args", "code"), [
    (["bench", "{model}"], "OM008"),  # no input for the model's x
    (["bench", "{model}", "--input", "5x7"], "OM008"),
    (["bench", "{model}", "--input", "2x3:int64"], "OM008"),
    (["run", "{model}", "--input", "2x3", "--save", "{tmp}/no/out.npz"], "OM006"),
    (["optimize", "{model}", MODEL, "--input", "2x3", "-o", "{tmp}/no/o.onnx"], "OM006"),
])
def test_inputs_and_outputs_are_checked_before_anything_runs(args, code, tmp_path, capsys):
    """The input contract and the output path: findings first, not a failure (or a
    traceback) after the work."""
    model = om.identity_model(tmp_path / "m.onnx")
    rc, out, err = _main([a.replace("{model}", str(model)) for a in args], tmp_path, capsys)
    assert rc == 1 and code in out + err and "bench failed" not in out, (out, err)


@pytest.mark.parametrize("command", ["optimize", "bench"])
def test_a_file_that_is_not_onnx_is_om007(command, tmp_path, capsys):
    bad = tmp_path / "m.onnx"
    bad.write_bytes(b"\x08\x07not a model")
    args = [command, str(bad)] + ([MODEL] if command == "optimize" else []) + ["-i", "2x3"]
    rc, _, err = _main(args, tmp_path, capsys)
    assert rc == 1 and "OM007" in err


def test_the_installed_command_exits_with_a_finding_not_a_traceback(tmp_path):
    """The real entry point (python -m onnxmedic: cli.entry)."""
    p = subprocess.run([sys.executable, "-m", "onnxmedic", "bench", str(tmp_path / "no.onnx")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "OM007" in p.stderr and "Traceback" not in p.stderr, p.stderr
