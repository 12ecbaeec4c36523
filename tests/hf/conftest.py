from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from tests.hf import checkpoints  # noqa: E402

# which tokenizer each tiny checkpoint gets (None: an image or audio model, no tokenizer)
TOKENIZER = {"gpt2": "bpe", "lfm2": "bpe", "falcon_h1": "bpe", "mamba": "bpe", "jamba-noattn": "bpe", "granitemoehybrid-noattn": "bpe", "minicpm3": "bpe", "vit": None, "segformer": None, "wav2vec2": None, "yolos": None}


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory):
    """hf_folder(name) -> the tiny checkpoint ``name`` saved once per session."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            folder = tmp_path_factory.mktemp(f"hf-{name}")
            checkpoints.save(folder, name, tok=TOKENIZER.get(name, "wordpiece"))
            if name == "segformer":  # the image size comes from the processor's config
                (folder / "preprocessor_config.json").write_text(json.dumps(
                    {"image_processor_type": "SegformerImageProcessor",
                     "size": {"height": 64, "width": 64}}))
            made[name] = folder
        return made[name]

    return get


@pytest.fixture(scope="session")
def bf16(tmp_path_factory):
    """A tiny Llama checkpoint saved in bfloat16 (the dtype people publish; plain rotary
    embedding), and the model loaded from it in float32 (as the whole-model verification
    holds it): the streamed roads' checkpoint (hf/stream.py, hf/transforms/stream_int4.py)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tmp_path_factory.mktemp("stream") / "bf16"
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, vocab_size=384,
                      max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(folder)
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def package(bf16, tmp_path_factory):
    """onnxruntime-genai's model builder's package of the bf16 checkpoint (float32; with
    save_family's tokenizer, copied into the checkpoint): the package the default backend
    writes, verified streamed."""
    import shutil
    import subprocess
    import sys

    pytest.importorskip("onnxruntime_genai")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.zoo.generation import save_family

    folder, _model = bf16
    out = tmp_path_factory.mktemp("stream-pkg")
    for f in save_family("llama", out / "src").glob("tokenizer*"):
        shutil.copy(f, folder / f.name)
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m",
                    str(folder), "-i", str(folder), "-o", str(out / "pkg"), "-p", "fp32",
                    "-e", "cpu", "-c", str(out / "cache")], check=True, capture_output=True)
    return out / "pkg"
