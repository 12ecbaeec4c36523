"""Tasks (optimum's names): which a checkpoint can serve, which its config.architectures asks
for, the example inputs (real text through the folder's tokenizer), the dynamic dims (named as
optimum names them) and the small module exported for each task (its outputs as tensors, named
as optimum names them)."""

from __future__ import annotations

import inspect
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Task:
    """One task: the Auto class that loads it, the transformers mappings (model_type -> class
    name) that say which model types serve it, and the outputs it exports (those the model
    returns, in this order)."""

    name: str
    auto: str
    mappings: tuple[str, ...]
    outputs: tuple[str, ...]
    modality: str = "any"  # text | vision | audio | text+vision | any (the model's main input)


TASKS: dict[str, Task] = {t.name: t for t in (
    Task("feature-extraction", "AutoModel", ("MODEL_MAPPING_NAMES",), ("last_hidden_state",)),
    Task("sentence-similarity", "AutoModel", ("MODEL_MAPPING_NAMES",),
         ("token_embeddings", "sentence_embedding"), "text"),
    Task("fill-mask", "AutoModelForMaskedLM", ("MODEL_FOR_MASKED_LM_MAPPING_NAMES",),
         ("logits",), "text"),
    Task("text-classification", "AutoModelForSequenceClassification",
         ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",), ("logits",), "text"),
    Task("token-classification", "AutoModelForTokenClassification",
         ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",), ("logits",), "text"),
    Task("question-answering", "AutoModelForQuestionAnswering",
         ("MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",), ("start_logits", "end_logits"), "text"),
    Task("multiple-choice", "AutoModelForMultipleChoice",
         ("MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES",), ("logits",), "text"),
    Task("text-generation", "AutoModelForCausalLM", ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",),
         ("logits",), "text"),
    Task("image-classification", "AutoModelForImageClassification",
         ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",), ("logits",), "vision"),
    Task("image-segmentation", "AutoModelForSemanticSegmentation",
         ("MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES",
          "MODEL_FOR_IMAGE_SEGMENTATION_MAPPING_NAMES"),
         ("logits", "pred_boxes", "pred_masks"), "vision"),
    Task("audio-classification", "AutoModelForAudioClassification",
         ("MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",), ("logits",), "audio"),
    Task("object-detection", "AutoModelForObjectDetection",
         ("MODEL_FOR_OBJECT_DETECTION_MAPPING_NAMES",), ("logits", "pred_boxes"), "vision"),
    Task("zero-shot-image-classification", "AutoModelForZeroShotImageClassification",
         ("MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES",),
         ("logits_per_image", "logits_per_text", "text_embeds", "image_embeds"), "text+vision"),
)}

# Generation tasks: a decoder with its KV cache (onnxmedic.hf.generation), and the
# encoder-decoder tasks, by the mapping that says which model types serve them.
GENERATION: dict[str, tuple[str, str]] = {
    "text-generation-with-past": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    "text2text-generation": ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    "text2text-generation-with-past": ("AutoModelForSeq2SeqLM",
                                       "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    "automatic-speech-recognition": ("AutoModelForSpeechSeq2Seq",
                                     "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"),
    "automatic-speech-recognition-with-past": ("AutoModelForSpeechSeq2Seq",
                                               "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"),
    "image-to-text": ("AutoModelForImageTextToText", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"),
}
ALL_TASKS = tuple(TASKS) + tuple(GENERATION)

TEXTS = ["onnxmedic exports this sentence and checks every number it computes.",
         "a short one"]
QUESTIONS = ["what does onnxmedic check?", "who exports it?"]
CHOICES = [("the model is exported", "to onnx", "to a picture"),
           ("the numbers are checked", "against pytorch", "by hand")]
CLIP_TEXTS = ["a photo of a cat", "a photo of two dogs on the grass"]


def classes_for(mapping: str, model_type: str) -> tuple[str, ...]:
    """The class names transformers' ``mapping`` (a ``MODEL_..._MAPPING_NAMES`` of
    modeling_auto) gives ``model_type``."""
    from transformers.models.auto import modeling_auto

    value = getattr(modeling_auto, mapping, {}).get(model_type)
    return () if value is None else (value,) if isinstance(value, str) else tuple(value)


def auto_mapped(model_type: str) -> bool:
    """Whether any of transformers' Auto model classes maps ``model_type`` to a class (a
    multimodal model's text part saved on its own, Emu3's ``emu3_text_model``, has a config
    class and no Auto model class)."""
    from transformers.models.auto import modeling_auto

    return any(model_type in v for n, v in vars(modeling_auto).items()
               if n.startswith("MODEL_") and n.endswith("_MAPPING_NAMES") and isinstance(v, dict))


def main_input(model_type: str) -> str | None:
    """The main input (input_ids, pixel_values, input_values ...) of the model type's base
    class, or None when transformers does not say."""
    import transformers

    for name in classes_for("MODEL_MAPPING_NAMES", model_type):
        cls = getattr(transformers, name, None)
        if cls is not None:
            return getattr(cls, "main_input_name", None)
    return None


def _modality_ok(task: Task, model_type: str) -> bool:
    if task.modality == "text+vision":
        return True
    if classes_for("MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES", model_type):
        return False  # a dual encoder (CLIP): its base model takes text and images together
    if task.modality == "any":
        return True
    main = main_input(model_type)
    want = {"text": "input_ids", "vision": "pixel_values", "audio": "input_values"}[task.modality]
    return main is None or main == want


def supported_tasks(config: dict[str, Any], arch: str | None = None) -> list[str]:
    """The tasks (optimum's names) the config's model type can serve, in TASKS order; with
    ``arch``, those its class ``arch`` serves (a model object's: whatever its modality)."""
    model_type = config.get("model_type", "")

    def serves(mapping: str) -> bool:
        classes = classes_for(mapping, model_type)
        return arch in classes if arch is not None else bool(classes)

    out = [t.name for t in TASKS.values() if any(serves(m) for m in t.mappings)
           and (arch is not None or _modality_ok(t, model_type))]
    out += [name for name, (_auto, mapping) in GENERATION.items() if serves(mapping)]
    return out


def detect_task(config: dict[str, Any], folder: Path | None = None) -> str | None:
    """The task config.architectures[0] was saved for (None when it names none): a causal LM
    is text-generation-with-past whatever its config's use_cache says (MPT's is off), unless
    its class cannot return a cache, or an encoder's causal-LM class is not configured as a
    decoder: text-generation; a base model feature-extraction (sentence-similarity in a
    sentence-transformers folder)."""
    if not config.get("architectures"):
        return None
    arch, model_type = config["architectures"][0], config.get("model_type", "")
    if arch in classes_for("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", model_type):
        # a class can return a cache when its forward takes past_key_values (OpenAI GPT's and
        # RWKV's do not; True for a class transformers does not have: the export says what it
        # finds); an encoder family's (a model type with a masked-LM class: BERT, BigBird,
        # RoBERTa...) not configured as a decoder (is_decoder not true) attends both ways and
        # returns none (BertLMHeadModel, BigBirdForCausalLM): generate() recomputes the whole
        # sequence
        import transformers

        cls = getattr(transformers, arch, None)
        cache = cls is None or accepts(cls, "past_key_values", unreadable=True)
        encoder = not config.get("is_decoder") and \
            bool(classes_for("MODEL_FOR_MASKED_LM_MAPPING_NAMES", model_type))
        return "text-generation-with-past" if cache and not encoder else "text-generation"
    for name, (_auto, mapping) in GENERATION.items():
        if name.endswith("-with-past") and arch in classes_for(mapping, model_type):
            return name
    # the base model's tasks last (feature-extraction first: sentence-similarity's classes are
    # the same, and it is told by modules.json below): a CLIPModel is both a base model and
    # the zero-shot-image-classification model
    for task in sorted(TASKS.values(), key=lambda t: t.auto == "AutoModel"):
        if any(arch in classes_for(m, model_type) for m in task.mappings) and \
                _modality_ok(task, model_type):
            if task.name == "feature-extraction" and folder is not None and \
                    (folder / "modules.json").is_file() and _modality_ok(TASKS[
                        "sentence-similarity"], model_type):
                return "sentence-similarity"
            return task.name
    return None


def auto_class(task: str, config: dict[str, Any]) -> str:
    """The Auto class that loads ``task`` for this config (segmentation: semantic or DETR's)."""
    if task in GENERATION:
        return GENERATION[task][0]
    if task == "image-segmentation" and not classes_for(
            "MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES", config.get("model_type", "")):
        return "AutoModelForImageSegmentation"
    return TASKS[task].auto


# ---------------------------------------------------------------------------------------------
# the exported module


@dataclass
class Pooling:
    """sentence-transformers' pooling: mean (default), cls or max; then L2-normalised."""

    mode: str = "mean"
    normalize: bool = True

    @classmethod
    def of_folder(cls, folder: Path | None) -> Pooling:
        """The pooling a sentence-transformers folder declares (modules.json, 1_Pooling);
        mean + normalize for a plain checkpoint, as sentence-transformers builds one."""
        if folder is None or not (folder / "modules.json").is_file():
            return cls()
        try:
            modules = json.loads((folder / "modules.json").read_text())
            types = [m.get("type", "") for m in modules]
            pool_dir = next((m.get("path", "") for m in modules
                             if m.get("type", "").endswith("Pooling")), "1_Pooling")
            cfg_path = folder / pool_dir / "config.json"
            pcfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        except (ValueError, OSError, AttributeError, TypeError):
            logger.warning("unreadable sentence-transformers modules in %s; mean pooling", folder)
            return cls()
        mode = ("cls" if pcfg.get("pooling_mode_cls_token") else
                "max" if pcfg.get("pooling_mode_max_tokens") else "mean")
        return cls(mode, any(t.endswith("Normalize") for t in types))

    def __call__(self, tokens: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if mask is None:
            mask = torch.ones(tokens.shape[:2], dtype=tokens.dtype, device=tokens.device)
        m = mask.unsqueeze(-1).to(tokens.dtype)
        if self.mode == "cls":
            pooled = tokens[:, 0]
        elif self.mode == "max":
            pooled = tokens.masked_fill(m == 0, -1e9).max(dim=1).values
        else:
            pooled = (tokens * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=1) if self.normalize else pooled


class TaskModule(torch.nn.Module):
    """The model as the task uses it: the inputs by their names, the task's outputs as a tuple
    of tensors (names in ``output_names``, fixed by the first call)."""

    def __init__(self, model: torch.nn.Module, task: str, pooling: Pooling | None = None) -> None:
        super().__init__()
        self.model = model
        self.task = task
        self.pooling = pooling
        # named as optimum names them; image-segmentation: a semantic-segmentation model's
        # logits, or DETR's logits, boxes and masks
        self.output_names = list(TASKS[task].outputs)
        if task == "image-segmentation" and type(model).__name__ in classes_for(
                "MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES",
                getattr(model.config, "model_type", "")):
            self.output_names = self.output_names[:1]
        self.training = model.training  # export() switches (and restores) the modes itself

    def forward(self, input_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None,
                pixel_values: torch.Tensor | None = None,
                input_values: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        given = {k: v for k, v in zip(INPUT_ORDER, (input_ids, attention_mask, token_type_ids,
                                                    pixel_values, input_values)) if v is not None}
        if self.task == "text-generation":
            given["use_cache"] = False  # one forward pass: the logits, no cache
        out = self.model(**given, return_dict=True)
        if self.task == "sentence-similarity":
            tokens = out["last_hidden_state"]
            return tokens, self.pooling(tokens, attention_mask)
        return tuple(out[k] for k in self.output_names)


# ---------------------------------------------------------------------------------------------
# example inputs


@dataclass
class Example:
    """What the task is exported with: keyword inputs, their dynamic dims, and a note on where
    they came from (the folder's tokenizer, the config)."""

    kwargs: dict[str, torch.Tensor]
    dynamic: dict[str, dict[int, str]]
    source: str


def accepts(model: torch.nn.Module | type, name: str, unreadable: bool = False) -> bool:
    """Whether ``model``'s (a module or its class) forward takes the keyword ``name``
    (``unreadable`` where its signature cannot be read)."""
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return unreadable


def text_length_limit(config: Any) -> int:
    """The tokenizer's truncation length: the config's max_position_embeddings, 512 where it
    has none or says no limit (XLNet's -1, which the tokenizer cannot take: OverflowError,
    OM009 before)."""
    n = int(getattr(config, "max_position_embeddings", 0) or 0)
    return n if n > 0 else 512


def _tokenize(task: str, tokenizer: Any, config: Any, segments: bool) -> dict[str, torch.Tensor]:
    if tokenizer.pad_token is None and getattr(tokenizer, "eos_token", None) is not None:
        tokenizer.pad_token = tokenizer.eos_token
    kw: dict[str, Any] = dict(return_tensors="pt", padding=tokenizer.pad_token is not None,
                              truncation=True, max_length=text_length_limit(config))
    if segments:  # the model has segment embeddings: the tokenizer's token_type_ids
        kw["return_token_type_ids"] = True
    texts = TEXTS if tokenizer.pad_token is not None else TEXTS[:1]
    if task == "fill-mask" and tokenizer.mask_token is not None:
        texts = [t.rsplit(" ", 1)[0] + " " + tokenizer.mask_token for t in texts]
    if task == "question-answering":
        return dict(tokenizer(QUESTIONS[:len(texts)], texts, **kw))
    if task == "multiple-choice":
        firsts = [c[0] for c in CHOICES for _ in c[1:]]
        seconds = [s for c in CHOICES for s in c[1:]]
        enc = tokenizer(firsts, seconds, **kw)
        return {k: v.view(len(CHOICES), len(CHOICES[0]) - 1, -1) for k, v in enc.items()}
    if task == "zero-shot-image-classification":
        return dict(tokenizer(CLIP_TEXTS, **kw))
    return dict(tokenizer(texts, **kw))


def _image_size(vcfg: Any, pre: dict[str, Any]) -> tuple[int, int]:
    """(height, width) of the images: preprocessor_config.json's crop or size, else the
    (vision) config's image_size, else 224 x 224."""
    for key in ("crop_size", "size"):
        s = pre.get(key)
        if isinstance(s, int):
            return s, s
        if isinstance(s, dict):
            if "height" in s and "width" in s:
                return int(s["height"]), int(s["width"])
            if "shortest_edge" in s and "longest_edge" not in s:
                return int(s["shortest_edge"]), int(s["shortest_edge"])
    size = getattr(vcfg, "image_size", None)
    if isinstance(size, int):
        return size, size
    if isinstance(size, (list, tuple)) and len(size) == 2:
        return int(size[0]), int(size[1])
    return 224, 224


def _audio(processor: Any, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], str]:
    rate = int(getattr(processor, "sampling_rate", 16000) or 16000)
    t = torch.arange(rate // 2, dtype=torch.float64) / rate
    waves = [torch.sin(2 * math.pi * f * t) * 0.5 for f in (220.0, 440.0)]
    if processor is not None:
        enc = processor([w.numpy() for w in waves], sampling_rate=rate, return_tensors="pt")
        out = {k: v for k, v in enc.items() if k in ("input_values", "attention_mask")}
        out["input_values"] = out["input_values"].to(dtype)
        return out, "two tones through the folder's feature extractor"
    x = torch.stack(waves)
    x = (x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True)
    return {"input_values": x.to(dtype)}, "two tones, normalised (no feature extractor)"


INPUT_ORDER = ("input_ids", "attention_mask", "token_type_ids", "pixel_values", "input_values")
TEXT_DIMS = {0: "batch_size", 1: "sequence_length"}
CHOICE_DIMS = {0: "batch_size", 1: "num_choices", 2: "sequence_length"}


def example_inputs(task: str, model: torch.nn.Module, tokenizer: Any = None,
                   processor: Any = None, preprocessor: dict[str, Any] | None = None,
                   seed: int = 0) -> Example:
    """The task's example inputs and dynamic dims: text through ``tokenizer`` when there is
    one (else ids from the config), images from the config / preprocessor_config.json, audio
    through ``processor`` (a feature extractor) when there is one."""
    config = model.config
    gen = torch.Generator().manual_seed(seed)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    modality = TASKS[task].modality
    if modality == "any":
        modality = {"pixel_values": "vision", "input_values": "audio"}.get(
            getattr(model, "main_input_name", "input_ids"), "text")
    kwargs: dict[str, torch.Tensor] = {}
    dims: dict[str, dict[int, str]] = {}
    sources = []
    if modality in ("text", "text+vision"):
        segments = accepts(model, "token_type_ids") and \
            int(getattr(config, "type_vocab_size", 0) or 0) > 1
        if tokenizer is not None:
            kwargs.update(_tokenize(task, tokenizer, config, segments))
            sources.append("text through the folder's tokenizer")
        else:  # ids from the config alone (a model object with no tokenizer): seeded, clear
            # of the first ids (special tokens), the second row's last two positions padding
            text_cfg = getattr(config, "text_config", None) or config
            vocab = int(getattr(text_cfg, "vocab_size", 0) or 100)
            shape = (2, 2, 8) if task == "multiple-choice" else (2, 8)
            kwargs["input_ids"] = torch.randint(min(4, vocab - 1), vocab, shape, generator=gen)
            kwargs["attention_mask"] = torch.ones_like(kwargs["input_ids"])
            if task != "multiple-choice":
                kwargs["attention_mask"][1, -2:] = 0
            sources.append("token ids from the config (no tokenizer)")
        kwargs = {k: v for k, v in kwargs.items() if accepts(model, k)}
        if "token_type_ids" not in kwargs and segments:
            kwargs["token_type_ids"] = torch.zeros_like(kwargs["input_ids"])
        text_dims = CHOICE_DIMS if task == "multiple-choice" else TEXT_DIMS
        if modality == "text+vision":
            text_dims = {0: "text_batch_size", 1: "sequence_length"}
        dims.update({k: dict(text_dims) for k in kwargs})
    if modality in ("vision", "text+vision"):
        vcfg = getattr(config, "vision_config", None) or config
        h, w = _image_size(vcfg, preprocessor or {})
        channels = int(getattr(vcfg, "num_channels", 3) or 3)
        kwargs["pixel_values"] = torch.randn(2, channels, h, w, generator=gen).to(dtype)
        dims["pixel_values"] = ({0: "image_batch_size"} if modality == "text+vision" else
                                {0: "batch_size", 2: "height", 3: "width"})
        sources.append(f"random {h}x{w} images (normalised pixel values)")
    if modality == "audio":
        audio, how = _audio(processor, dtype)
        kwargs.update(audio)
        dims.update({k: dict(TEXT_DIMS) for k in audio})
        sources.append(how)
    kwargs = {k: kwargs[k] for k in INPUT_ORDER if k in kwargs}  # optimum's input order
    return Example(kwargs, dims, "; ".join(sources))
