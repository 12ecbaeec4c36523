"""The side files of a generation package: ``genai_config.json`` (ONNX Runtime GenAI's
description of the graph and its search defaults), the model's ``config.json`` and
``generation_config.json``, and the tokenizer's files.

``genai_config.json`` follows what onnxruntime-genai's model builder writes
(``onnxruntime_genai/models/builders/base.py``, ``make_genai_config``): ``model.decoder``
names the graph file, its inputs and outputs (``%d`` for the layer), the heads and sizes;
``model.type`` is ``decoder``, GenAI's generic decoder-only model (its model-specific types
name the same class for the layouts written here); ``search`` holds greedy defaults.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, (list, tuple)) and value else value


def _token_ids(model: Any, tokenizer: Any) -> dict[str, Any]:
    gen = getattr(model, "generation_config", None)
    cfg = model.config
    out: dict[str, Any] = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(gen, key, None) if gen is not None else None
        if value is None:
            value = getattr(cfg, key, None)
        if value is None and tokenizer is not None:
            value = getattr(tokenizer, key, None)
        out[key] = value
    if out["pad_token_id"] is None:
        out["pad_token_id"] = _first(out["eos_token_id"]) if out["eos_token_id"] is not None \
            else 0
    if out["bos_token_id"] is None:
        out["bos_token_id"] = out["pad_token_id"]
    if out["eos_token_id"] is None:
        out["eos_token_id"] = out["pad_token_id"]
    return out


def genai_config(model: Any, tokenizer: Any, layout: dict[str, Any],
                 context_length: int | None = None) -> dict[str, Any]:
    """The genai_config.json dict for the graph ``layout`` (``filename``, ``head_size``,
    ``kv_heads``, ``layers``, ``position_ids``: what the written graph has)."""
    cfg = model.config
    ctx = context_length or getattr(cfg, "max_position_embeddings", None) or 2048
    inputs = {"input_ids": "input_ids", "attention_mask": "attention_mask"}
    if layout["position_ids"]:
        inputs["position_ids"] = "position_ids"
    inputs.update(past_key_names="past_key_values.%d.key",
                  past_value_names="past_key_values.%d.value")
    heads = getattr(cfg, "num_attention_heads", None) or layout["kv_heads"]
    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "filename": layout["filename"],
        "head_size": layout["head_size"],
        "hidden_size": getattr(cfg, "hidden_size", None) or layout["head_size"] * heads,
        "inputs": inputs,
        "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value"},
        "num_attention_heads": heads,
        "num_hidden_layers": layout["layers"],
        "num_key_value_heads": layout["kv_heads"],
    }
    ids = _token_ids(model, tokenizer)
    return {
        "model": {"bos_token_id": ids["bos_token_id"], "context_length": int(ctx),
                  "decoder": decoder, "eos_token_id": ids["eos_token_id"],
                  "pad_token_id": ids["pad_token_id"], "type": "decoder",
                  "vocab_size": int(cfg.vocab_size)},
        "search": {"diversity_penalty": 0.0, "do_sample": False, "early_stopping": True,
                   "length_penalty": 1.0, "max_length": int(ctx), "min_length": 0,
                   "no_repeat_ngram_size": 0, "num_beams": 1, "num_return_sequences": 1,
                   "past_present_share_buffer": False, "repetition_penalty": 1.0,
                   "temperature": 1.0, "top_k": 1, "top_p": 1.0},
    }


def write_side_files(model: Any, tokenizer: Any, folder: Path, layout: dict[str, Any],
                     genai: bool = True) -> list[str]:
    """Write genai_config.json (with ``genai``), config.json, generation_config.json and the
    tokenizer's files into ``folder``; returns the names written."""
    folder = Path(folder)
    if genai:
        (folder / "genai_config.json").write_text(
            json.dumps(genai_config(model, tokenizer, layout), indent=2) + "\n")
    model.config.save_pretrained(folder)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return sorted(p.name for p in folder.iterdir())
