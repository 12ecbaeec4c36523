"""bench/peers/generation.py's table read back: a run in a fresh ``--root`` (onnxmedic's rows
only, say) keeps the other tools' rows of the committed table, cell for cell."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.peers import generation  # noqa: E402

ROWS = [
    {"tool": "onnxmedic", "family": "llama", "correct": True, "export_s": 24.5,
     "peak_mib": 494.0, "size_mb": 0.88, "tok_s": 103.0},
    # an error whose text starts with blanks and has parentheses of its own
    {"tool": "genai-builder", "family": "phi", "correct": False, "export_s": 4.4,
     "peak_mib": 408.0, "size_mb": 0.46,
     "error": "    gen.append_tokens(ids) RuntimeError: (status 1) GroupQueryAttention"},
    {"tool": "optimum-cli", "family": "olmo", "correct": False, "export_s": 4.8,
     "peak_mib": 393.0, "size_mb": 0.57, "tok_s": 979.0,
     "note": "transformers 4.57.6 in optimum's venv"},  # tokens differ
    {"tool": "onnxmedic-auto", "family": "deepseek_v3", "correct": True, "export_s": 8.5,
     "peak_mib": 523.0, "size_mb": 1.36,
     "note": "ONNX Runtime loop; no genai_config.json (OM820)"},
    {"tool": "optimum-cli", "family": "mixtral", "correct": False, "export_s": 3.9,
     "peak_mib": 383.0, "error": "ValueError: Trying to export a mixtral model"},
]


def _rows_part(text: str) -> list[str]:
    """A table's lines from its header row on (the lines above say how it was made)."""
    lines = text.splitlines()
    return lines[next(i for i, x in enumerate(lines) if x.startswith("| ")):]


def test_the_table_reads_back_row_for_row():
    text = generation._table(ROWS, "cmd")
    assert generation._table_rows(text) == ROWS
    assert generation._table(generation._table_rows(text), "cmd") == text


def test_the_committed_table_reads_back_unchanged():
    """Every row of bench/results/generation_peers.md, written again from what it shows."""
    text = (ROOT / "bench" / "results" / "generation_peers.md").read_text()
    rows = generation._table_rows(text)
    assert len(rows) > 100
    assert _rows_part(generation._table(rows, "cmd")) == _rows_part(text)


def test_a_fresh_root_starts_from_the_table(tmp_path, monkeypatch):
    """main() in a --root with no rows yet: the committed table's rows first, the rows
    measured here replace theirs (the other tools' rows stay)."""
    out = tmp_path / "peers.md"
    out.write_text(generation._table(ROWS, "before"))
    measured = {"tool": "onnxmedic", "family": "llama", "correct": False, "error": "boom"}
    monkeypatch.setattr(generation, "_run_one", lambda tool, family, root, steps: measured)
    monkeypatch.setattr(sys, "argv", ["generation.py", "--tools", "onnxmedic", "--families",
                                      "llama", "--root", str(tmp_path / "r"), "--out", str(out)])
    generation.main()
    rows = generation._rows(tmp_path / "r")
    assert rows[0] == measured and rows[1:] == ROWS[1:]
    assert "| llama | onnxmedic | no: boom |" in out.read_text()
    assert len((tmp_path / "r" / "results.jsonl").read_text().splitlines()) == len(ROWS) + 1
    assert json.loads((tmp_path / "r" / "results.jsonl").read_text().splitlines()[-1]) == measured


def test_the_seq2seq_table_reads_back_unchanged():
    """bench/results/seq2seq_peers.md's rows, its onnxruntime-genai column included."""
    from bench.peers import seq2seq

    text = (ROOT / "bench" / "results" / "seq2seq_peers.md").read_text()
    rows = seq2seq._table_rows(text)
    assert len(rows) == 15 and rows[0]["genai_correct"] and rows[0]["genai_tok_s"] > 0
    assert _rows_part(seq2seq._table(rows, "cmd")) == _rows_part(text)
    wrong = dict(rows[0], genai_correct=False, genai_tok_s=None, correct=False)
    assert seq2seq._table_rows(seq2seq._table([wrong], "cmd")) == [wrong]
