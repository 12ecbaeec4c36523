"""onnxruntime-genai and encoder-decoder packages.

onnxruntime-genai (0.18) serves one encoder-decoder model type, ``whisper``
(``onnxruntime_genai/models/builders/whisper.py`` writes it; its runtime's ``WhisperState``
runs it): an encoder whose outputs are the hidden states and the cross-attention cache, a
decoder with self and cross caches. That is the layout of our package, so a Whisper package
gets a ``genai_config.json`` naming our graphs' inputs and outputs (optimum's names: genai
reads them from the config). genai has no model type for T5, BART, Marian or mBART: those
packages have none, and say so (OM825).

The check (a child process, hf/gen_genai_child.py's way): genai's greedy tokens from the
package, fed the same ``input_features`` as ONNX Runtime and PyTorch, must be PyTorch's
(OM814; OM816 when genai cannot load or run the folder).
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from onnxmedic.findings import error, info
from onnxmedic.hf import gen_verify

logger = logging.getLogger(__name__)

STAGE = gen_verify.STAGE
GENAI_TYPES = {"whisper": "whisper"}  # model_type -> genai's model type
CHILD = Path(__file__).resolve().parent / "seq2seq_genai_child.py"


def genai_config(model: Any, tokenizer: Any, layout: dict[str, Any]) -> dict[str, Any]:
    """genai_config.json of the ``whisper`` model type for the package's two graphs."""
    from onnxmedic.hf.gen_config import genai_config as decoder_config

    cfg = model.config
    base = decoder_config(model, tokenizer, {
        "filename": layout["decoder"], "head_size": layout["head_size"],
        "kv_heads": layout["heads"], "layers": layout["layers"], "position_ids": False})
    dec = base["model"]["decoder"]
    dec["hidden_size"] = int(cfg.d_model)
    dec["num_attention_heads"] = int(cfg.decoder_attention_heads)
    dec["inputs"] = {"input_ids": "input_ids",
                     "past_key_names": "past_key_values.%d.decoder.key",
                     "past_value_names": "past_key_values.%d.decoder.value",
                     "cross_past_key_names": "past_key_values.%d.encoder.key",
                     "cross_past_value_names": "past_key_values.%d.encoder.value"}
    dec["outputs"] = {"logits": "logits", "present_key_names": "present.%d.decoder.key",
                      "present_value_names": "present.%d.decoder.value"}
    heads = int(cfg.encoder_attention_heads)
    encoder = {"session_options": dict(dec["session_options"]), "filename": layout["encoder"],
               "head_size": int(cfg.d_model) // heads, "hidden_size": int(cfg.d_model),
               "inputs": {"audio_features": layout["main"]},
               "outputs": {"encoder_hidden_states": "last_hidden_state",
                           "cross_present_key_names": "present.%d.encoder.key",
                           "cross_present_value_names": "present.%d.encoder.value"},
               "num_attention_heads": heads, "num_hidden_layers": int(cfg.encoder_layers),
               "num_key_value_heads": heads}
    model_part = base["model"]
    model_part.update(type=GENAI_TYPES[cfg.model_type], encoder=encoder,
                      context_length=int(getattr(cfg, "max_target_positions", 448)),
                      bos_token_id=layout["start"])
    base["search"]["max_length"] = model_part["context_length"]
    return base


def write_genai_config(result: Any, model: Any, tokenizer: Any, folder: Path,
                       layout: dict[str, Any]) -> bool:
    """genai_config.json where genai serves the model type (True), else OM825 (False)."""
    model_type = getattr(model.config, "model_type", "")
    if model_type not in GENAI_TYPES:
        result.findings.append(info(
            "OM825", "write", f"no genai_config.json: onnxruntime-genai has no model type for "
            f"the encoder-decoder {model_type!r} (it serves Whisper alone among them). The "
            "package serves ONNX Runtime (encoder_model.onnx once, "
            "decoder_with_past_model.onnx per token), verified by onnxmedic's generation "
            "loop.", suggestion="Run the two graphs with your own loop, or with optimum's "
            "ORTModelForSeq2SeqLM-style code: the names are optimum's."))
        return False
    (folder / "genai_config.json").write_text(
        json.dumps(genai_config(model, tokenizer, layout), indent=2) + "\n")
    return True


def genai_generation(folder: Path, check: Any, inputs: list[dict[str, Any]], start: int,
                     steps: int, timeout: float) -> None:
    """onnxruntime-genai generating from ``folder`` (a child process), fed each input's
    features, must give PyTorch's tokens."""
    if not gen_verify.genai_available():
        check.findings.append(info(
            "OM815", STAGE, "onnxruntime-genai is not installed: the package was not "
            "generated from with it.", suggestion="pip install onnxruntime-genai"))
        return
    with tempfile.TemporaryDirectory(prefix="onnxmedic-genai-") as tmp:
        files = []
        for i, enc in enumerate(inputs):
            path = Path(tmp) / f"features{i}.npy"
            np.save(path, enc["input_features"].numpy())
            files.append(str(path))
        spec = json.dumps({"features": files, "input": "input_features", "start": start,
                           "steps": steps})
        out = gen_verify.run_genai_child(CHILD, folder, spec, timeout, check)
    if out is None:
        return
    check.tokens_genai = out["tokens"]
    for p, (got, want) in enumerate(zip(out["tokens"], check.tokens_torch)):
        if got != want[:len(got)] or not got:
            k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(got))
            check.fail(error(
                "OM814", STAGE, f"onnxruntime-genai's greedy tokens differ from PyTorch's "
                f"for input {p} at step {k}: {got} vs {want}.",
                details={"prompt": p, "step": k, "genai": got, "torch": want}))
            return
