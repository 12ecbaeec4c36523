"""bench/zoo/family_sweep.py's rows file: the table is written from it, it is rebuilt from the
table, and a later run resumes from it (families with a row are not run again)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.zoo import family_sweep  # noqa: E402

ROWS = [
    {"family": "gpt2", "kind": "causal", "outcome": "verified", "codes": [], "first": "",
     "seconds": 15.8, "exporters": "correct"},
    {"family": "bert", "kind": "causal", "outcome": "refused", "codes": ["OM817"],
     "first": "cannot export: a / b", "seconds": 7.4, "exporters": "fails: ValueError: x"},
    {"family": "blt", "kind": "causal", "outcome": "no tiny config", "codes": [],
     "first": "ValueError: 4633 M parameters"},
    {"family": "jamba", "kind": "causal", "outcome": "verified", "codes": [], "first": "",
     "seconds": 80.9},  # transformers.exporters not run: "-"
]


def test_the_table_round_trips_through_the_rows():
    text = family_sweep.table(ROWS, "cmd", [])
    back = family_sweep.rows_from_table(text)
    assert back == {r["family"]: r for r in ROWS}
    assert family_sweep.table(list(back.values()), "cmd", []) == text
    assert "refused, by first error code: OM817 1" in text
    # both ran on gpt2 and bert (not blt: no model; not jamba: no exporters cell)
    assert "on the 2 families both were run on: onnxmedic verified 1, " \
        "transformers.exporters correct 1" in text


def test_a_timeout_is_named_under_the_totals():
    """A row past the timeout is in no column of the totals: the line under them names it."""
    row = {"family": "led", "kind": "seq2seq", "outcome": "timeout", "codes": [],
           "first": "", "seconds": 240.0}
    assert "neither verified nor refused: none" in family_sweep.table(ROWS, "cmd", [])
    text = family_sweep.table([*ROWS, row], "cmd", [])
    assert "neither verified nor refused: led (timeout)" in text
    assert family_sweep.rows_from_table(text)["led"] == row


def test_a_run_resumes_from_the_rows_file(tmp_path, monkeypatch):
    rows = tmp_path / "rows.jsonl"
    monkeypatch.setattr(family_sweep, "RESULTS", rows)
    monkeypatch.setattr(family_sweep, "TABLE", tmp_path / "t.md")
    monkeypatch.setattr(family_sweep, "OUT", tmp_path / "out")
    family_sweep.save_rows({r["family"]: r for r in ROWS})
    ran: list[str] = []

    def fake_run(model_type, kind, timeout, row=None, exporters=True):
        ran.append(model_type)
        return {"family": model_type, "kind": kind, "outcome": "verified", "codes": []}

    monkeypatch.setattr(family_sweep, "run", fake_run)
    family_sweep.main(["--families", "gpt2,llama,bert", "--no-exporters"])
    assert ran == ["llama"]  # gpt2 and bert have rows: not run again
    saved = family_sweep.load_rows(rows)
    assert saved["gpt2"] == ROWS[0] and saved["llama"]["outcome"] == "verified"
    family_sweep.main(["--families", "bert", "--again", "--no-exporters"])
    assert ran == ["llama", "bert"]
    assert family_sweep.load_rows(rows)["bert"]["outcome"] == "verified"
    assert [json.loads(x)["family"] for x in rows.read_text().splitlines()] == sorted(
        ["gpt2", "bert", "blt", "jamba", "llama"])


def test_nested_configs_are_shrunk_like_the_top_one():
    """A multimodal config's towers and an encoder-decoder's two stacks are shrunk too (Gemma 3
    and T5Gemma were thousands of M parameters with only their top keys shrunk)."""
    from transformers import AutoConfig

    keys = family_sweep._shrunk(AutoConfig.for_model("gemma3"), "gemma3")
    assert keys["text_config"]["hidden_size"] == keys["vision_config"]["hidden_size"] == 64
    assert keys["text_config"]["num_hidden_layers"] == 2
    assert set(keys["text_config"]["layer_types"]) == {"sliding_attention", "full_attention"}
    keys = family_sweep._shrunk(AutoConfig.for_model("t5gemma"), "t5gemma")
    assert keys["encoder"]["hidden_size"] == keys["decoder"]["hidden_size"] == 64
    assert keys["decoder"]["vocab_size"] == 384


def test_configs_the_shrinker_alone_cannot_build_are_built(monkeypatch):
    """XLNet (a max_position_embeddings that raises when set), Reformer (a causal LM only with
    is_decoder, axial positions that must match its sizes), dots3 note (per-layer sizes the
    shrinker's hasattr raised on) and X-MOD (no language: its forward raises) were "no tiny
    config" or OM830 with SHRINK alone; config and meta weights only."""
    import torch
    from transformers import AutoModelForCausalLM

    built = []
    real = AutoModelForCausalLM.from_config

    def on_meta(cfg, **kw):  # every build on the meta device: sizes checked, no memory
        with torch.device("meta"):
            model = real(cfg, **kw)
        built.append(model)
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", on_meta)
    for family in ("xlnet", "reformer", "dots3_note_text", "gemma4_unified_text", "xmod"):
        model = family_sweep.tiny_model(family, "causal")
        assert sum(p.numel() for p in model.parameters()) < family_sweep.MAX_PARAMS
    assert built[-1].config.default_language == "en_XX"
    reformer = next(m for m in built if m.config.model_type == "reformer")
    assert reformer.config.is_decoder and reformer.config.hidden_size == 64


def test_a_family_no_config_builds_says_why():
    """MusicGen's causal-LM class takes its decoder's config, which AutoModelForCausalLM does
    not map; Gemma 4's assistants draft from the target model's states: the row names that,
    not the class's bare AttributeError or config validation error."""
    import pytest

    for family in ("musicgen", "musicgen_melody"):
        with pytest.raises(ValueError, match="takes the decoder's config alone"):
            family_sweep.tiny_model(family, "causal")
    for family in ("gemma4_assistant", "gemma4_unified_assistant"):
        with pytest.raises(ValueError, match="speculative-decoding drafter"):
            family_sweep.tiny_model(family, "causal")
