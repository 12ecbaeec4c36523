"""ONNX Runtime's transformers optimizer pass (the "ort-transformers-<type>" candidates), and the
model type it is given for a model. Its step is named
``onnxmedic.optimize.passes:ort_transformers``; its test is
tests/optimize/passes/test_transformers_optimizer.py."""

from __future__ import annotations

from typing import Any

from onnxmedic.optimize.files import has_external_data, op_count_diff, op_counts

# the model types ONNX Runtime's transformers optimizer knows by name (its MODEL_TYPES, read
# without importing it into the exporting process). Not "phi": that optimizer unrolls the
# local function torch's first dynamo exporter wrote per Phi-2 decoder layer and raises where
# there is none (ORT 1.32: "TypeError: 'method' object is not iterable" in preprocess_onnx on
# every torch 2.13 export); phi goes with the decoders below.
ORT_MODEL_TYPES = ("bart", "bert", "clip", "conformer", "gpt2", "gpt_neox", "qwen3", "sam2",
                   "swin", "t5", "unet", "vae", "vit")
# for the rest, the type optimum's exporter picks for the architecture (decoders as gpt2,
# seq2seq as bart, vision transformers as vit, other encoders as bert)
ORT_TYPE_FAMILIES = {
    "gpt2": ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "gemma", "gemma2", "phi",
             "phi3", "falcon", "gptj", "gpt_neo", "gpt_bigcode", "bloom", "codegen", "granite",
             "olmo", "opt", "stablelm", "starcoder2", "smollm3"),
    "bart": ("whisper", "marian", "mbart", "m2m_100", "pegasus", "blenderbot", "mt5", "plbart"),
    "vit": ("segformer", "deit", "beit", "dinov2", "pix2struct", "vit_mae", "yolos"),
}


_HEADS = ("num_attention_heads", "n_head", "encoder_attention_heads", "num_heads")


def ort_model_type(model: Any) -> str | None:
    """The ``model_type`` to give ONNX Runtime's transformers optimizer for ``model``: from the
    transformers config of the model or of the first submodule that has one (a wrapper such
    as ``LastHidden(m)``). None for a model with no transformers config, or one without
    attention heads (the optimizer's fusions target transformer blocks)."""
    import torch

    mods = model.modules() if isinstance(model, torch.nn.Module) else [model]
    for m in mods:
        cfg = getattr(m, "config", None)
        name = getattr(cfg, "model_type", None)
        if isinstance(name, str) and name:
            if name in ORT_MODEL_TYPES:
                return name
            for family, names in ORT_TYPE_FAMILIES.items():
                if name in names:
                    return family
            # other encoders with attention as bert; a CNN (resnet, convnext, regnet: no
            # attention heads) has nothing for the optimizer to fuse (seen on a GPU: a wasted
            # candidate for ResNet-50)
            return "bert" if any(hasattr(cfg, a) for a in _HEADS) else None
    return None


def ort_transformers(src: str, dst: str, model_type: str = "bert") -> dict[str, Any]:
    """ONNX Runtime's transformers optimizer (``onnxruntime.transformers.optimizer``), Python
    fusions only (``opt_level=0``: ONNX Runtime's own session optimizations still run when the
    file is loaded): Attention, SkipLayerNormalization, BiasGelu, ... for ``model_type``'s
    patterns. Emits ``com.microsoft`` ops: ONNX Runtime only."""
    from onnxruntime.transformers.optimizer import optimize_model

    before = op_counts(src)
    model = optimize_model(src, model_type=model_type, opt_level=0)
    model.save_model_to_file(dst, use_external_data_format=has_external_data(src))
    info = op_count_diff(before, op_counts(dst))
    stats = getattr(model, "get_fused_operator_statistics", dict)() or {}
    info["fusions"] = {k: int(v) for k, v in stats.items() if v}
    return info
