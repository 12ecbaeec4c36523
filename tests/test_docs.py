"""The README is a front page and the docs' generated parts are in step with the code (the site
itself is built with `mkdocs build --strict` by `make docs`, which `make test` runs)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_is_a_front_page_whose_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert "make demo" in text and "make test" in text
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert links, "the README links into the docs"
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, missing


def test_every_nav_page_exists():
    """mkdocs --strict fails on a nav entry without its page; a page left out of nav is only
    reported (pages other work adds are listed in nav's Guides when they land)."""
    nav = re.findall(r":\s*([\w-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.MULTILINE)
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert len(nav) >= 15 and set(nav) <= pages, set(nav) - pages


def test_architecture_stage_table_is_current():
    mod = _tool("gen_architecture_doc")
    text = mod.DOC.read_text()
    assert text == mod.render(text), "run: python tools/gen_architecture_doc.py"
    from onnxmedic.pipeline import EXPORT_STAGES

    for stage in EXPORT_STAGES:
        assert f"| `{stage.name}` |" in text


def test_cli_page_lists_every_command_and_flag():
    mod = _tool("gen_cli_doc")
    from onnxmedic.cli import build_parser

    text = mod.DOC.read_text()
    commands = mod.subcommands(build_parser())
    assert {"export", "verify", "doctor", "run", "reduce", "sweep", "optimize", "bench"} <= set(commands)
    for name, sub in commands.items():
        assert f"\n## {name}\n" in text, f"run: python tools/gen_cli_doc.py ({name})"
        section = text.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
        missing = [f for f in mod.flags(sub) if f not in section]
        assert not missing, f"run: python tools/gen_cli_doc.py ({name}: {missing})"


def test_architecture_code_layout_names_every_package():
    """The hand-written code layout of docs/architecture.md has a line for every package of
    src/onnxmedic (a folder added without one fails here)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    layout = text.split("## Code layout", 1)[1].split("```", 2)[1]
    named = set(re.findall(r"^  ([\w.]+/)", layout, re.MULTILINE))
    packages = {f"{p.parent.name}/" for p in (ROOT / "src" / "onnxmedic").glob("*/__init__.py")}
    assert packages <= named, sorted(packages - named)
