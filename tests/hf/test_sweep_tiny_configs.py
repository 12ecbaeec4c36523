"""bench/zoo/family_sweep.py's tiny configs of multimodal families whose text tower has a tiny
config of its own (Gemma 4, Qwen4-Exp: the tower takes it, not SHRINK's keys over the default
tower's per-layer ones) and of ZAYA (one expert a token): built, small (were "no tiny
config")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.zoo import family_sweep  # noqa: E402


@pytest.mark.parametrize("family,tower", [("gemma4", "gemma4_text"),
                                          ("qwen4_exp", "qwen4_exp_text"), ("zaya", None)])
def test_tiny_config_of_a_family_that_had_none(family, tower):
    model = family_sweep.tiny_model(family, "causal")
    assert sum(p.numel() for p in model.parameters()) < family_sweep.MAX_PARAMS
    if tower is not None:
        text = model.config.get_text_config()
        assert text.model_type == tower
        assert text.num_hidden_layers == family_sweep.CONFIGS[tower]["num_hidden_layers"]


def test_recurrent_gemma_tiny_config_keeps_an_attention_layer():
    """RecurrentGemma's pattern cut to two layers had no attention layer: PyTorch itself
    raised (OM830, the sweep's config at fault). With one, the refusal is the model's: its
    recurrent blocks keep their state in the module, not in the cache it returns (none):
    OM817."""
    from onnxmedic.hf import generation

    model = family_sweep.tiny_model("recurrent_gemma", "causal")
    assert "attention" in model.config.block_types
    said = generation.cache_problem(model)
    assert said is not None and said.code == "OM817", said
