"""The terminal summary reads at 80 columns: no cell is cut short ("…"); columns are left out,
and said so, or rows become blocks of lines. The JSON report keeps every column."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from onnxmedic.report.terminal import fit_columns, print_table, render_terminal, table_width

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = ("output", "input set", "shape", "dtype", "max abs", "max rel", "rule", "status")
DROP = ("rule", "dtype", "shape")
REASON = ("[red]max abs 0.25 exceeds 10x PyTorch's own float32 error on this input (budget "
          "4.1e-06, normwise and at element [3, 1])[/]")
ROWS = [["logits", "example", "[4, 8]", "float32", "3.58e-07", "1.81e-06", "float32 agreement",
         "[green]ok[/]"],
        ["logits", "random#1", "[4, 8]", "float32", "0.25", "0.9", "float64 budget", REASON]]


def test_demo_at_80_columns_cuts_no_cell_and_json_keeps_every_column(tmp_path):
    """`make demo`'s export with its output piped (rich then takes COLUMNS, or 80)."""
    env = dict(os.environ, COLUMNS="80")
    p = subprocess.run(
        [sys.executable, "-m", "onnxmedic", "export", "examples/gaussian_copula.py:GaussianCopulaHead",
         "--input", "4x16:float32", "-o", str(tmp_path / "g.onnx"),
         "--report", str(tmp_path / "r.json")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "verification against PyTorch" in p.stderr
    assert "…" not in p.stderr, p.stderr
    table = [line for line in p.stderr.splitlines() if line[:1] in "┏┃┡│└"]
    assert table and all(len(line) <= 80 for line in table), p.stderr
    for word in ("example", "random#1", "float32", "max abs", "max rel", "status"):
        assert word in p.stderr
    assert "not shown at this width: rule, vs PyTorch's own" in p.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    check = report["verification"][0]
    assert {"rule", "max_abs", "max_rel", "expected_dtype", "expected_shape"} <= set(check)


def _render(width: int, rows: list[list[str]]) -> str:
    buf = io.StringIO()
    print_table(Console(file=buf, width=width, soft_wrap=True), "verification",
                          COLUMNS, rows, DROP)
    return buf.getvalue()


def test_the_computed_width_is_the_width_rich_draws():
    out = _render(200, ROWS[:1])
    drawn = max(len(line) for line in out.splitlines() if line.startswith("┏"))
    assert table_width(COLUMNS, ROWS[:1]) == drawn


def test_columns_are_left_out_in_order_until_nothing_is_cut():
    assert fit_columns(COLUMNS, ROWS, DROP, 400) == list(COLUMNS)
    assert fit_columns(COLUMNS, ROWS, DROP, 80) == ["output", "input set", "shape", "dtype",
                                                     "max abs", "max rel", "status"]
    assert fit_columns(COLUMNS, ROWS, DROP, 60) == ["output", "input set", "max abs", "max rel",
                                                     "status"]
    assert fit_columns(COLUMNS, ROWS, DROP, 30) is None
    for width in (200, 100, 80, 72, 60):
        out = _render(width, ROWS)
        assert "…" not in out, out
        assert all(len(line) <= width for line in out.splitlines() if line[:1] in "┏┃┡│└")
        words = " ".join(line.strip("│ ").split("│")[-1].strip() for line in out.splitlines()
                         if line.startswith("│"))
        assert "normwise" in words and "1])" in words  # the reason wraps, every word whole


def test_too_narrow_for_a_table_prints_each_row_as_lines():
    out = _render(30, ROWS)
    assert "…" not in out and "┃" not in out
    assert "output: logits  input set: random#1" in out
    assert "rule: float64 budget" in out


def test_render_terminal_of_a_real_result_at_80_columns(tmp_path):
    import torch

    import onnxmedic

    class Wide(torch.nn.Module):
        def forward(self, a_rather_long_input_name):
            return torch.special.erfinv(a_rather_long_input_name.clamp(-0.5, 0.5)) * 2

    result = onnxmedic.export(Wide(), (torch.rand(3, 5),), tmp_path / "w.onnx")
    assert result.ok
    buf = io.StringIO()
    render_terminal(result, Console(file=buf, width=80, soft_wrap=True))
    out = buf.getvalue()
    assert "…" not in out and "verification against PyTorch" in out


def test_no_verify_is_not_called_verified():
    """--no-verify writes the model without comparing it: the verdict says so instead of
    "verified"; a package whose graph was compared but not generated from is not verified."""
    from onnxmedic.result import ExportResult

    def head(stages: dict[str, str]) -> str:
        buf = io.StringIO()
        result = ExportResult(command="export", model="m", stages=stages)
        result.ok, result.path = True, "out.onnx"
        render_terminal(result, Console(file=buf, width=120))
        return buf.getvalue().splitlines()[0]

    assert "— verified → out.onnx" in head({"runtime": "passed", "compare": "passed"})
    assert "written, not verified → out.onnx" in head({"runtime": "not run",
                                                        "compare": "not run"})
    assert "not verified" in head({"compare": "passed", "generate": "not run"})
    assert "— verified" in head({"compare": "passed", "generate": "passed"})
