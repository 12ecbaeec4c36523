"""Output safety and concurrency: reports land exactly where asked (a symlink there is replaced,
never followed), a bad report path fails before the slow stages, and parallel exports into one
folder never collide on temp files or outputs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest
import torch

import onnxmedic
from onnxmedic import api
from tests import models
from tests import onnx_models as om
from tests.test_cli import ROOT

X = (torch.randn(2, 3),)


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("command", ["export", "verify", "doctor"])
def test_report_symlink_is_replaced_not_followed(tmp_path, command):
    victim = tmp_path / "outside" / "victim.json"
    victim.parent.mkdir()
    victim.write_text("precious")
    work = tmp_path / "work"
    work.mkdir()
    (work / "r.json").symlink_to(victim)
    onnx_path = om.identity_model(work / "id.onnx")
    if command == "export":
        r = onnxmedic.export(models.Identity(), X, report=work / "r.json")
    elif command == "verify":
        r = api.verify(onnx_path, models.Identity(), X, report=work / "r.json")
    else:
        r = api.doctor(onnx_path, report=work / "r.json")
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert victim.read_text() == "precious"
    assert not (work / "r.json").is_symlink()
    assert json.loads((work / "r.json").read_text())["ok"] is True
    assert _listing(work) == ["id.onnx", "r.json"]  # no temp files left beside it


@pytest.mark.parametrize("bad", ["missing-folder", "is-folder", "wrong-suffix"])
def test_bad_report_path_fails_before_any_work(tmp_path, bad):
    report = {"missing-folder": tmp_path / "nope" / "r.html", "is-folder": tmp_path / "d.html",
              "wrong-suffix": tmp_path / "r.txt"}[bad]
    if bad == "is-folder":
        report.mkdir()
    onnx_path = om.identity_model(tmp_path / "id.onnx")
    before = _listing(tmp_path)
    for r in (onnxmedic.export(models.Identity(), X, tmp_path / "m.onnx", report=report),
              api.verify(onnx_path, models.Identity(), X, report=report),
              api.doctor(onnx_path, report=report)):
        assert not r.ok
        (f,) = r.errors
        assert f.code == ("OM004" if bad == "wrong-suffix" else "OM006")
        assert f.stage == "report"
        assert all(v == "not run" for v in r.stages.values()), r.stages
    assert _listing(tmp_path) == before
    if bad == "is-folder":
        assert report.is_dir() and not any(report.iterdir())


_WORKER = r"""
import sys, torch, onnxmedic
sys.path.insert(0, {root!r})
from tests import models
torch.manual_seed(int(sys.argv[2]))
x = torch.randn(int(sys.argv[2]) + 1, 4)
r = onnxmedic.export(models.{model}(), (x,), sys.argv[1], report=sys.argv[1] + ".json")
print("OK" if r.ok else "FAIL " + " | ".join(f.one_paragraph() for f in r.findings))
"""


def test_parallel_exports_in_one_folder_never_collide(tmp_path):
    """Three processes export at once into one folder: one to its own file, two to the same
    file. Every process succeeds, each output is a complete verified model, and no temp file or
    folder is left behind."""
    script = tmp_path / "worker.py"
    script.write_text(_WORKER.format(root=str(ROOT), model="Erfinv"))
    out = tmp_path / "out"
    out.mkdir()
    targets = [out / "a.onnx", out / "same.onnx", out / "same.onnx"]
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(script), str(t), str(i)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, t in enumerate(targets)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (so, se) in zip(procs, outs):
        assert p.returncode == 0 and so.strip() == "OK", (so, se[-2000:])
    assert _listing(out) == ["a.onnx", "a.onnx.json", "same.onnx", "same.onnx.json"]
    for name in ("a.onnx", "same.onnx"):
        m = onnx.load(out / name)
        onnx.checker.check_model(m, full_check=True)
        assert json.loads((out / f"{name}.json").read_text())["ok"] is True
    assert time.monotonic() - t0 < 600
