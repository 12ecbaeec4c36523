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


def test_a_decoder_fed_by_an_audio_encoder_is_said_to_be_one():
    """AudioFlamingo3 (an audio encoder spliced into a Qwen2 decoder's inputs) is listed by
    transformers among the seq-to-seq LMs, so its detected task is
    text2text-generation-with-past: OM822 says what it is and where the task came from, and
    suggests its parts, not "a task the model serves" (text-generation-with-past, which its
    class cannot load for)."""
    from types import SimpleNamespace

    import torch

    from onnxmedic.hf import seq2seq
    from onnxmedic.result import ExportResult

    class Fed(torch.nn.Module):
        config = SimpleNamespace(audio_config=object(), text_config=object(),
                                 is_encoder_decoder=False)

    result = ExportResult(command="export", model="fed")
    req = SimpleNamespace(model=Fed())
    assert not seq2seq.preflight_refused(result, req, "text2text-generation-with-past")
    said = result.errors[0]
    assert said.code == "OM822"
    assert "a text decoder fed by a audio encoder" not in said.message
    assert "fed by an audio encoder" in said.message, said.message
    assert "seq-to-seq LMs" in said.message and "config.text_config" in said.suggestion
