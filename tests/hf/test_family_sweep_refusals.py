"""Refusals of the family sweep's families that no task can serve: the finding says what
and why (the model type, the class), not a bare "give the task". Config files only, fast."""

from __future__ import annotations

import onnxmedic


def test_a_model_type_no_auto_class_maps_is_om805_naming_it(tmp_path):
    """Emu3's causal LM saves its text part's config (model type emu3_text_model), which no
    Auto class of transformers maps: --task (the suggestion before) cannot help; the finding
    says why and names the class to load the folder with."""
    from transformers import AutoConfig, Emu3ForCausalLM

    folder = tmp_path / "emu3"
    cfg = type(AutoConfig.for_model("emu3").text_config)(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, vocab_size=64, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)
    Emu3ForCausalLM(cfg).save_pretrained(folder)
    res = onnxmedic.export_pretrained(folder, tmp_path / "out")
    assert [f.code for f in res.errors] == ["OM805"], res.errors
    assert res.exit_code == 1
    err = res.errors[0]
    assert "maps no model class to the model type 'emu3_text_model'" in err.message
    assert "Emu3ForCausalLM.from_pretrained(FOLDER)" in err.suggestion
    assert not (tmp_path / "out").exists()


def test_a_config_without_a_length_limit_truncates_at_512():
    """XLNet's max_position_embeddings is -1 (no limit): the example inputs' truncation length
    was -1, which the tokenizer cannot take (OverflowError, OM009 on `export hf:` of a tiny
    XLNet); it is 512, as for a config without the key."""
    from transformers import XLNetConfig

    from onnxmedic.hf import tasks

    cfg = XLNetConfig(d_model=32, n_layer=1, n_head=2, d_inner=64, vocab_size=64)
    assert cfg.max_position_embeddings == -1
    assert tasks.text_length_limit(cfg) == 512
