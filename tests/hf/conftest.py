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
