"""What ``import onnxmedic`` and the command line load, and when: the package's public names
are imported on first use, so that the command line parses its arguments (and starts the genai
builder, tests/hf/test_backends.py) before torch.export, onnx-ir and the translations load;
the names are still the functions they were when the package imported them all at once."""

from __future__ import annotations

import gc
import importlib
import json
import subprocess
import sys

import pytest

import onnxmedic
from onnxmedic import cli

HEAVY = ("torch", "onnx_ir", "onnxruntime", "transformers", "onnxmedic.api",
         "onnxmedic.optimize.core", "onnxmedic.stages.verify")


def loaded_after(code: str) -> list[str]:
    """The HEAVY modules a fresh interpreter has loaded after ``code``."""
    probe = f"{code}\nimport sys, json\nprint(json.dumps([m for m in {HEAVY!r} " \
            "if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_and_the_parser_load_nothing_heavy():
    assert loaded_after("import onnxmedic") == []
    assert loaded_after("from onnxmedic import cli\ncli.build_parser().parse_args("
                        "['export', 'hf:x', '--task', 'text-generation-with-past', "
                        "'-o', 'pkg', '--optimize'])") == []


def test_a_public_name_loads_its_module_on_first_use():
    assert "onnxmedic.api" in loaded_after("import onnxmedic\nonnxmedic.export")
    assert loaded_after("from onnxmedic import CODES") == []  # findings.py is light


def test_public_names_are_the_functions_whatever_was_imported_first():
    """doctor, verify, sweep and optimize are submodules too: importing those submodules
    must not turn the package's names into modules."""
    code = ("import onnxmedic.verify.budget, onnxmedic.sweep, onnxmedic.doctor, "
            "onnxmedic.optimize.bench\nimport onnxmedic, onnxmedic.api as api\n"
            "from onnxmedic.optimize import bench\nimport importlib\n"
            "core = importlib.import_module('onnxmedic.optimize.core')\n"
            "assert onnxmedic.verify is api.verify and onnxmedic.sweep is api.sweep\n"
            "assert onnxmedic.doctor is api.doctor and onnxmedic.optimize is core.optimize\n"
            "assert callable(bench) and onnxmedic.bench is bench\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_every_public_name_resolves_and_an_unknown_one_is_an_attribute_error():
    for name in onnxmedic.__all__:
        assert getattr(onnxmedic, name) is not None and name in dir(onnxmedic)
    optimize = importlib.import_module("onnxmedic.optimize")
    for name in optimize.__all__:
        assert getattr(optimize, name) is not None
    assert optimize.CALIBRATION_SETS > 0  # a name of optimize/core.py outside __all__
    for module in (onnxmedic, optimize):
        with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
            module.not_a_name  # noqa: B018


def test_the_command_exits_with_mains_code(monkeypatch):
    """entry() (the onnxmedic command, python -m onnxmedic) exits with main's code, what main
    made frozen out of the final garbage collections first."""
    monkeypatch.setattr(cli, "main", lambda: 3)
    try:
        with pytest.raises(SystemExit) as e:
            cli.entry()
        assert e.value.code == 3 and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
