"""A generation package replaces the whole folder ``-o`` names: an existing folder that is not a
package (the user's own files) or an existing file is refused (OM738) and left as it was, by
the command line before anything is loaded and by ``replace_folder`` itself; ``--precision
fp16|int8`` without ``--optimize`` is a usage error instead of a float32 model written as if it
had been honoured."""

from __future__ import annotations

from pathlib import Path

import pytest

from onnxmedic import cli
from onnxmedic.findings import OnnxMedicError
from onnxmedic.onnxfile import package_output_problem, replace_folder


def _user_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "thesis.tex").write_text("years of work")
    return folder


def _package(tmp_path: Path, name: str = "pkg") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "model.onnx").write_bytes(b"old")
    (folder / "genai_config.json").write_text("{}")
    return folder


def test_what_a_package_may_replace(tmp_path):
    assert package_output_problem(tmp_path / "new") is None
    (tmp_path / "empty").mkdir()
    assert package_output_problem(tmp_path / "empty") is None
    assert package_output_problem(_package(tmp_path)) is None
    mine = package_output_problem(_user_folder(tmp_path))
    assert mine is not None and mine.code == "OM738" and "thesis.tex" in mine.message
    (tmp_path / "file").write_text("x")
    assert package_output_problem(tmp_path / "file").code == "OM738"
    nested = _package(tmp_path, "nested")
    (nested / "sub").mkdir()  # packages are flat: a subfolder is not one of ours
    assert package_output_problem(nested).code == "OM738"


def test_replace_folder_never_removes_the_users_files(tmp_path):
    mine = _user_folder(tmp_path)
    built = tmp_path / "built"
    built.mkdir()
    (built / "model.onnx").write_bytes(b"new")
    with pytest.raises(OnnxMedicError) as caught:
        replace_folder(built, mine)
    assert caught.value.finding.code == "OM738"
    assert sorted(p.name for p in mine.iterdir()) == ["thesis.tex"]
    (tmp_path / "file").write_text("mine")
    with pytest.raises(OnnxMedicError):
        replace_folder(built, tmp_path / "file")
    assert (tmp_path / "file").read_text() == "mine"
    old = _package(tmp_path)  # a package is replaced, as before
    replace_folder(built, old)
    assert (old / "model.onnx").read_bytes() == b"new" and not built.exists()


@pytest.mark.parametrize("command", [
    ["export", "hf:{tmp}/ckpt", "-o", "{out}"],
    ["optimize", "{tmp}/pkg", "hf:{tmp}/ckpt", "-o", "{out}"],
])
def test_cli_refuses_a_users_folder_before_loading(tmp_path, capsys, command):
    mine = _user_folder(tmp_path)
    _package(tmp_path)
    rc = cli.main([a.format(tmp=tmp_path, out=mine) for a in command])
    err = capsys.readouterr().err
    assert rc == 1 and "OM738" in err and "thesis.tex" in err and "Traceback" not in err
    assert sorted(p.name for p in mine.iterdir()) == ["thesis.tex"]


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_precision_without_optimize_is_a_usage_error(tmp_path, capsys, precision):
    with pytest.raises(SystemExit) as stop:
        cli.main(["export", "hf:{}".format(tmp_path), "--precision", precision,
                  "-o", str(tmp_path / "pkg")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "--optimize" in err and "int4" in err
    assert not (tmp_path / "pkg").exists()


def test_precision_without_optimize_is_refused_by_the_api():
    import torch

    import onnxmedic

    with pytest.raises(ValueError, match="optimize=True"):
        onnxmedic.export(torch.nn.Identity(), (torch.ones(2),), precision="fp16")


def _config(tmp_path: Path, arch: str, model_type: str) -> Path:
    import json

    folder = tmp_path / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": [arch],
                                                    "model_type": model_type}))
    return folder


@pytest.mark.parametrize("arch,model_type", [("Qwen2ForCausalLM", "qwen2"),
                                             ("T5ForConditionalGeneration", "t5")])
def test_target_cuda_for_a_package_is_a_usage_error(tmp_path, capsys, arch, model_type):
    """A generation package is made and verified for the CPU: --target cuda wrote a CPU
    package (its genai_config.json naming no provider) as if the target had been honoured."""
    folder = _config(tmp_path, arch, model_type)
    with pytest.raises(SystemExit) as stop:
        cli.main(["export", f"hf:{folder}", "--target", "cuda", "-o", str(tmp_path / "pkg")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "--target cpu" in err and "-with-past" in err
    assert "Failed to load" not in err and "deprecated" not in err  # no third-party lines


def test_target_cuda_stays_for_other_tasks(tmp_path, capsys):
    folder = _config(tmp_path, "BertForSequenceClassification", "bert")
    rc = cli.main(["export", f"hf:{folder}", "--target", "cuda", "-o", str(tmp_path / "m.onnx")])
    err = capsys.readouterr().err
    assert rc == 1 and "OM800" in err  # past the flags: a folder without weights
    with pytest.raises(SystemExit) as stop:  # a hub id's task given: refused as well
        cli.main(["export", "hf:org/name", "--target", "cuda",
                  "--task", "text-generation-with-past"])
    assert stop.value.code == 2 and "--target cpu" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["doctor"], ["run"], ["bench"]])
def test_a_package_folder_given_as_the_onnx_file(tmp_path, capsys, command):
    """doctor/run/bench PACKAGE_FOLDER said the folder "does not exist"; it names the graph."""
    pkg = _package(tmp_path)
    rc = cli.main([*command, str(pkg)])
    err = capsys.readouterr().err
    assert rc == 1 and "OM007" in err and "is a folder" in err and "does not exist" not in err
    assert str(pkg / "model.onnx") in err


@pytest.mark.parametrize("make", ["missing", "no-weights"])
def test_optimize_package_names_what_is_wrong_with_the_checkpoint(tmp_path, capsys, make):
    """optimize PACKAGE hf:FOLDER said OM737 with transformers' "Repo id must be in the form
    'repo_name'" for a folder that does not exist; it says what export hf: says (OM800)."""
    ckpt = tmp_path / "ckpt"
    if make == "no-weights":
        _config(tmp_path, "Qwen2ForCausalLM", "qwen2").rename(ckpt)
    from onnxmedic import genpackage as gp
    from tests.test_genpackage import _cache_graph

    pkg = tmp_path / "pkg"  # a package the contract reads: the checkpoint is what is wrong
    _cache_graph(pkg / "model.onnx", gp.cache_names(1), gp.cache_names(1, present=True))
    (pkg / "genai_config.json").write_text("{}")
    rc = cli.main(["optimize", str(pkg), f"hf:{ckpt}", "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 1 and "OM800" in err and "Repo id" not in err, err
    assert not (tmp_path / "out").exists()


def test_verify_with_an_hf_checkpoint_says_what_verifies_one(tmp_path, capsys):
    """verify PKG/model.onnx hf:CKPT said "cannot read model spec" and "Use path/file.py:Attr";
    it says which commands verify a checkpoint's export and a package."""
    with pytest.raises(SystemExit) as stop:
        cli.main(["verify", str(_package(tmp_path) / "model.onnx"), f"hf:{tmp_path}"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "onnxmedic.hf.stream" in err and "export hf:" in err


@pytest.mark.parametrize("where", ["under-a-file", "missing-parent", "proc"])
def test_package_parent_that_cannot_take_it_is_om006_before_loading(tmp_path, capsys, where):
    """-o under a file said its folder "does not exist" after the model loaded; under /proc
    (a folder no one can make folders in) the builder's staging raised: OM009, exit 3."""
    if where == "proc" and not Path("/proc/self").is_dir():
        pytest.skip("no /proc")
    (tmp_path / "afile").write_text("x")
    out = {"under-a-file": tmp_path / "afile" / "pkg", "missing-parent": tmp_path / "no" / "pkg",
           "proc": Path("/proc/onnxmedic-test-pkg")}[where]
    rc = cli.main(["export", f"hf:{tmp_path}/ckpt-never-read", "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and "OM006" in err and "Traceback" not in err, err
    assert ("is a file" in err) == (where == "under-a-file")
