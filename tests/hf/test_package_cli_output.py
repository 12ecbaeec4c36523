"""What ``onnxmedic optimize PACKAGE hf:CHECKPOINT -o OUT`` tells its user, run as docs/int4.md
says: the folder written named as ``OUT`` (not the scratch folder it was built in), each
finding once, and ``--json`` a JSON result on stdout as every other command gives.

Each test is a defect found trying the documented commands as a new user: findings said
twice and --json ignored, the scratch folder named instead of OUT, an encoder-decoder package
called "not a generation package", ``python -m onnxmedic.hf.stream``'s third-party lines and
missing-checkpoint text, the builder's traceback quoted as OM838's message."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from onnxmedic.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.zoo.generation import save_family  # noqa: E402

LOOSE = "perplexity=10000%,agreement=1%,steps=4,prompts=1"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny qwen2 checkpoint and its package (onnxmedic's own export)."""
    root = tmp_path_factory.mktemp("pkgcli")
    ckpt = save_family("qwen2", root / "ckpt")
    rc = main(["export", f"hf:{ckpt}", "--backend", "export", "-o", str(root / "pkg"),
               "--no-progress"])
    assert rc == 0
    return ckpt, root / "pkg"


@pytest.mark.slow  # the export and the fusion, each verified token by token (~40 s)
def test_fused_package_findings_once_and_json(exported, tmp_path, capsys):
    ckpt, pkg = exported
    capsys.readouterr()
    out = tmp_path / "fused"
    rc = main(["optimize", str(pkg), f"hf:{ckpt}", "-o", str(out), "--no-progress", "--json"])
    printed = capsys.readouterr().out
    assert rc == 0 and (out / "model.onnx").is_file()
    result = json.loads(printed)  # --json: the result, machine-readable
    assert "OM734" in {f["code"] for f in result["findings"]}


@pytest.mark.slow  # the export, and twice the fusion and one int4 candidate (~90 s)
def test_int4_package_names_the_folder_written(exported, tmp_path, capsys, monkeypatch):
    """The int4 package is named as OUT (OM732: where its decoder was written), never the
    scratch folder it was built in, in the printed table and in --json; the package's own
    checks run once (before the checkpoint loads), not again when it is transformed."""
    from onnxmedic.hf.transforms import precision
    from onnxmedic.optimize import int4_search

    monkeypatch.setattr(int4_search, "DEFAULT_GRID", [(32, 4, "int4")])
    checked = []
    real = precision.preflight
    monkeypatch.setattr(precision, "preflight", lambda *a: checked.append(a) or real(*a))
    ckpt, pkg = exported
    capsys.readouterr()
    out = tmp_path / "int4"
    argv = ["optimize", str(pkg), f"hf:{ckpt}", "--precision", "int4", "--accuracy", LOOSE,
            "-o", str(out), "--no-progress"]
    rc = main(argv)
    printed = capsys.readouterr().out
    assert rc == 0 and (out / "model.onnx").is_file()
    assert ".tmp-" not in printed, printed
    assert f"written to {out / 'model.onnx'}" in printed, printed
    assert len(checked) == 1, checked
    rc = main([*argv, "--json"])
    printed = capsys.readouterr().out
    assert rc == 0 and ".tmp-" not in printed, printed
    result = json.loads(printed)
    assert result["path"] == str(out)
    om732 = next(f for f in result["findings"] if f["code"] == "OM732")
    assert om732["message"].endswith(f"written to {out / 'model.onnx'}"), om732["message"]
    assert om732["details"]["written"] == str(out / "model.onnx")


@pytest.mark.slow  # a child interpreter importing torch and transformers (~15 s)
def test_stream_module_missing_checkpoint_is_a_clear_finding(tmp_path):
    import subprocess

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "model.onnx").write_bytes(b"")
    p = subprocess.run([sys.executable, "-m", "onnxmedic.hf.stream", str(pkg),
                        str(tmp_path / "missing")], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "Failed to load" not in p.stderr and "deprecated" not in p.stderr, p.stderr
    assert "OM800" in p.stderr, p.stderr


def test_optimize_an_encoder_decoder_package_says_what_it_is(tmp_path, capsys):
    pkg = tmp_path / "t5"
    pkg.mkdir()
    for name in ("encoder_model.onnx", "decoder_with_past_model.onnx", "config.json"):
        (pkg / name).write_bytes(b"")
    rc = main(["optimize", str(pkg), "hf:unused", "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 1 and "OM740" in err and "not a generation package" not in err, err


@pytest.mark.slow  # the builder's child process refusing GPT-2 (~15 s)
def test_builder_refusal_is_its_message_not_its_traceback(tmp_path):
    from onnxmedic.hf import builder, export_pretrained

    if not builder.available():
        pytest.skip("onnxruntime-genai's model builder not installed")
    folder = save_family("gpt2", tmp_path / "ckpt")
    r = export_pretrained(folder, tmp_path / "pkg", backend="builder")
    said = [f for f in r.findings if f.code == "OM838"]
    assert said and "not currently supported" in said[0].message
    assert 'File "' not in said[0].message and "line " not in said[0].message, said[0].message
