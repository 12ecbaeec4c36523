"""Finding codes are stable and documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from onnxmedic.findings import CODES, Finding, Location

DOC = Path(__file__).resolve().parents[1] / "docs" / "findings.md"


def test_every_code_is_documented_and_every_documented_code_exists():
    text = DOC.read_text()
    documented = set(re.findall(r"^\| `(OM\d{3})` ", text, re.MULTILINE))
    assert documented == set(CODES), (set(CODES) ^ documented)


def test_codes_are_well_formed():
    for code, info in CODES.items():
        assert re.fullmatch(r"OM\d{3}", code)
        assert info.exit_code in (0, 1, 2, 3)
        assert info.title and info.doc.endswith(".")


def test_unknown_code_is_rejected():
    with pytest.raises(ValueError, match="unknown finding code"):
        Finding("OM999", "x", "error", "nope")


def test_one_paragraph_names_what_where_and_next_step():
    f = Finding("OM201", "translate", "error", "aten.foo has no translation", op="aten.foo",
                location=Location(file="m.py", line=3, module_path="enc.layer.0"),
                suggestion="register one")
    text = f.one_paragraph()
    assert text.startswith("OM201 operator has no ONNX translation")
    assert "module enc.layer.0, m.py:3" in text and "Next step: register one" in text


def test_supported_ops_doc_is_current():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gen_ops_doc", Path(__file__).resolve().parents[1] / "tools" / "gen_ops_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.DOC.read_text() == mod.render(), "run: python tools/gen_ops_doc.py"


def test_every_builtin_family_loads():
    from onnxmedic.ops import REGISTRY

    REGISTRY.load_builtin()
    assert REGISTRY.load_errors == {}
    families = {m.family for m in REGISTRY.entries()}
    assert {"special", "linalg", "elementwise", "selection", "cumulative"} <= families
