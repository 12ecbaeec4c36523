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
     "seconds": 15.8, "exporters": "correct", "task": "text-generation-with-past"},
    {"family": "big_bird", "kind": "causal", "outcome": "verified", "codes": [], "first": "",
     "seconds": 99.8, "exporters": "correct", "task": "text-generation"},
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
    # both ran on gpt2, big_bird and bert (not blt: no model; not jamba: no exporters cell)
    assert "on the 3 families both were run on: onnxmedic verified 2, " \
        "transformers.exporters correct 2" in text


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
    monkeypatch.setattr(family_sweep, "tiny_task", lambda family, kind: None)  # no configs
    family_sweep.main(["--families", "gpt2,llama,bert", "--no-exporters"])
    assert ran == ["llama"]  # gpt2 and bert have rows: not run again
    saved = family_sweep.load_rows(rows)
    assert saved["gpt2"] == ROWS[0] and saved["llama"]["outcome"] == "verified"
    family_sweep.main(["--families", "bert", "--again", "--no-exporters"])
    assert ran == ["llama", "bert"]
    assert family_sweep.load_rows(rows)["bert"]["outcome"] == "verified"
    assert [json.loads(x)["family"] for x in rows.read_text().splitlines()] == sorted(
        ["gpt2", "big_bird", "bert", "blt", "jamba", "llama"])


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


def test_a_verified_row_says_what_it_was_judged_on():
    """A generation package is judged token by token, text-generation (an encoder's causal-LM
    class, a class without a cache) on its logits alone: the table tells them apart, row by
    row and in the totals; a row whose task is not recorded is not counted as either."""
    text = family_sweep.table(ROWS, "cmd", [])
    assert "| gpt2 | causal | text-generation-with-past | verified (tokens) |" in text
    assert "| big_bird | causal | text-generation | verified (logits) |" in text
    assert "| jamba | causal |  | verified |" in text  # no task recorded: no claim
    assert "onnxmedic verified by greedy tokens: 1; on logits only: 1 (big_bird); " \
        "task not recorded: 1" in text
    assert "onnxmedic only: big_bird (logits)" not in text  # both verified it
    peer_wrong = [dict(r, exporters="wrong tokens") if r["family"] == "big_bird" else r
                  for r in ROWS]
    assert "onnxmedic only: big_bird (logits), gpt2" not in family_sweep.table(
        peer_wrong, "cmd", [])
    assert "onnxmedic only: big_bird (logits)" in family_sweep.table(peer_wrong, "cmd", [])
    # a table from before the task column still reads back (no task)
    old = text.replace(" text-generation-with-past |", "").replace(" text-generation |", "")
    old = old.replace(" |  | verified |", " | verified |").replace(" (tokens)", "").replace(
        " (logits)", "")
    assert all("task" not in r for r in family_sweep.rows_from_table(old).values())
    assert family_sweep.rows_from_table(old)["big_bird"]["outcome"] == "verified"


def test_the_task_is_derived_as_the_export_detects_it():
    """The task of a row from before rows recorded it: the one its first error names (the
    task it ran), else its family's tiny config's, detected as ``export hf:FOLDER`` does
    (configs only, no weights)."""
    assert family_sweep.tiny_task("gpt2", "causal") == "text-generation-with-past"
    assert family_sweep.tiny_task("bert", "causal") == "text-generation"  # not a decoder
    assert family_sweep.tiny_task("openai-gpt", "causal") == "text-generation"  # no cache
    assert family_sweep.tiny_task("t5", "seq2seq") == "text2text-generation-with-past"
    assert [family_sweep.check_of(t) for t in (
        "text-generation-with-past", "text2text-generation-with-past", "text-generation",
        None)] == ["tokens", "tokens", "logits", None]
    # RoBERTa's row was refused when the task was text-generation-with-past: that is kept
    roberta = {"family": "roberta", "kind": "causal", "outcome": "refused", "codes": ["OM817"],
               "first": "cannot export for text-generation-with-past: RobertaForCausalLM ..."}
    bert = {"family": "bert", "kind": "causal", "outcome": "verified", "codes": [], "first": ""}
    blt = {"family": "blt", "kind": "causal", "outcome": "no tiny config", "codes": [],
           "first": "ValueError: 4633 M parameters"}
    done = {r["family"]: dict(r) for r in (roberta, bert, blt)}
    assert family_sweep._fill_tasks(done)
    assert done["roberta"]["task"] == "text-generation-with-past"
    assert done["bert"]["task"] == "text-generation" and "task" not in done["blt"]
    assert not family_sweep._fill_tasks(done)  # recorded once


def test_a_new_row_records_the_task_of_its_checkpoint(tmp_path, monkeypatch):
    """run() records the task the export chooses, from the saved checkpoint's config."""
    import bench.zoo.generation as zoo

    def fake_save(name, root, make):
        folder = Path(root) / name
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(
            {"model_type": "bert", "architectures": ["BertLMHeadModel"]}))
        return folder

    monkeypatch.setattr(family_sweep, "OUT", tmp_path)
    monkeypatch.setattr(zoo, "save_checkpoint", fake_save)
    monkeypatch.setattr(family_sweep, "_export", lambda folder, out, timeout: {
        "outcome": "verified", "codes": []})
    row = family_sweep.run("bert", "causal", 60, exporters=False)
    assert row["task"] == "text-generation" and "(logits)" in family_sweep._outcome(row)
