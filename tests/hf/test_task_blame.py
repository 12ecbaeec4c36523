"""The task ``onnxmedic export hf:FOLDER`` picks for families the family sweep found blamed
wrongly: an encoder's causal-LM class not configured as a decoder (BigBird, BERT) keeps no
cache, so its default is text-generation (was text-generation-with-past, refused OM817)."""

from __future__ import annotations

import pytest

from onnxmedic.hf import tasks


@pytest.mark.parametrize("config,task", [
    # an encoder's causal-LM head, is_decoder false or absent: both ways, no cache
    ({"architectures": ["BigBirdForCausalLM"], "model_type": "big_bird", "is_decoder": False},
     "text-generation"),
    ({"architectures": ["BertLMHeadModel"], "model_type": "bert"}, "text-generation"),
    # configured as a decoder: causal, with a cache
    ({"architectures": ["BertLMHeadModel"], "model_type": "bert", "is_decoder": True},
     "text-generation-with-past"),
    # a decoder family (no masked-LM class) keeps its cache whatever is_decoder says
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "is_decoder": False},
     "text-generation-with-past"),
    ({"architectures": ["OpenAIGPTLMHeadModel"], "model_type": "openai-gpt"},
     "text-generation"),
])
def test_an_encoder_not_configured_as_a_decoder_is_text_generation(config, task):
    assert tasks.detect_task(config) == task
