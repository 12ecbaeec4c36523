"""Loading a Hugging Face model for a task: a checkpoint (a folder written by
``save_pretrained``, or a hub id) resolved and loaded safely (checkpoint.py), its task given or
told from config.architectures (tasks.py), its tokenizer and processor; or a loaded
``PreTrainedModel``, borrowed as it is. The facade (hf/__init__.py) calls :func:`load_for_task`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from onnxmedic import noise
from onnxmedic.findings import InputError
from onnxmedic.hf import checkpoint, tasks
from onnxmedic.hf.checkpoint import DTYPES, Checkpoint
from onnxmedic.hf.checkpoint import input_error as _err
from onnxmedic.hf.tasks import ALL_TASKS, GENERATION, TASKS, detect_task, supported_tasks

logger = logging.getLogger(__name__)


@dataclass
class Loaded:
    """A checkpoint loaded for one task."""

    model: Any
    task: str
    spec: str
    tokenizer: Any = None
    processor: Any = None
    ckpt: Checkpoint | None = None
    notes: list[str] = field(default_factory=list)
    build_job: Any = None  # builder.BuildJob: onnxruntime-genai's model builder writing
    # the package (hf/backends.py)


def spec_name(model: Any) -> str:
    if isinstance(model, torch.nn.Module):
        return type(model).__name__
    return checkpoint.PREFIX + checkpoint.strip_prefix(os.fspath(model))


def _pick_task(config: dict[str, Any], task: str | None, folder: Path | None,
               known: bool = True) -> tuple[str, str]:
    """(task, how it was chosen): OM804 an unknown name, OM805 one the model cannot serve."""
    supported = supported_tasks(config) if known else []
    if task is None:
        found = detect_task(config, folder)
        if found is None:
            archs = config.get("architectures") or "none"
            model_type = config.get("model_type")
            if known and not supported and model_type and not tasks.auto_mapped(model_type):
                cls = archs[0] if isinstance(archs, list) else "its class"
                raise _err(
                    "OM805", f"transformers maps no model class to the model type "
                    f"{model_type!r} (config.architectures: {archs}): none of its Auto "
                    "classes loads this folder, so no task can (a multimodal model's text "
                    "part saved on its own has such a config).",
                    f"Load the model with its own class ({cls}.from_pretrained(FOLDER)) and "
                    "export the object: onnxmedic.export_pretrained(model, task=...); or "
                    "export the whole model's checkpoint.")
            raise _err("OM805", f"the task cannot be told from config.architectures ({archs}); "
                       f"the model type {config.get('model_type')!r} serves: "
                       f"{', '.join(supported) or 'no task onnxmedic knows'}.",
                       "Give the task: --task NAME (task=...).")
        return found, f"detected from config.architectures ({config['architectures'][0]})"
    _known_task(task)
    if known and task not in supported:
        raise _err("OM805", f"a {config.get('model_type')!r} model cannot serve the task "
                   f"{task!r}; it serves: {', '.join(supported) or 'none onnxmedic knows'}.",
                   "Choose one of those tasks, or a checkpoint made for this one.")
    return task, "given"


def _known_task(task: str) -> None:
    """OM804: ``task`` is no task name onnxmedic knows."""
    if task not in ALL_TASKS:
        raise _err("OM804", f"unknown task {task!r}.",
                   f"Tasks (optimum's names): {', '.join(ALL_TASKS)}.")


def check_generation(task: str) -> None:
    """OM807 for a generation task exported by no road: one without its cache (the package's
    step needs it), or image-to-text."""
    if task in GENERATION and not task.endswith("-with-past"):
        with_past = f"{task}-with-past"
        hint = (f"Export {with_past} (a generation package)" if with_past in GENERATION else
                "Use text-generation (one forward pass, logits) for a decoder's single step")
        raise _err("OM807", f"the task {task!r} is not available in this onnxmedic: its "
                   "generation packages are exported with their cache (the -with-past "
                   f"tasks: {', '.join(t for t in GENERATION if t.endswith('-with-past'))}).",
                   hint + ".")


def _load_for_task(ckpt: Checkpoint, task: str | None, dtype: str, trust: bool,
                   job: Any) -> Loaded:
    task, how = _pick_task(ckpt.config, task, ckpt.folder, known=not ckpt.remote_code)
    check_generation(task)
    modality = TASKS[task].modality if task in TASKS else ""
    # a generation task takes text when its name says so
    text = (task.startswith("text") if task in GENERATION else
            modality in ("text", "text+vision") or (modality == "any" and tasks.main_input(
                ckpt.config.get("model_type", "")) in (None, "input_ids")))
    if text and not checkpoint.has_tokenizer(ckpt.folder):
        raise _err("OM806", f"{ckpt.spec} has no tokenizer, and the task {task!r} takes text "
                   f"(looked for {', '.join(checkpoint.TOKENIZER_FILES[:4])} ...).",
                   "Save the tokenizer beside the model: tokenizer.save_pretrained(folder).")
    tokenizer = checkpoint.load_tokenizer(ckpt, trust)
    if tokenizer is None and text:
        raise _err("OM806", f"the tokenizer of {ckpt.spec} cannot be loaded (see the log).",
                   "Save it again with tokenizer.save_pretrained(folder).")
    # no cache for one forward pass; a config without use_cache (OpenAI GPT's, a model that
    # keeps none) would hand it to the model's __init__, which raises TypeError (was OM808)
    extra = ({"use_cache": False} if task == "text-generation" and "use_cache" in ckpt.config
             else {})
    # an encoder's causal-LM class without is_decoder keeps no cache: the export refuses it
    # (OM817, with the fix), so transformers' "add `is_decoder=True`" line is not said too
    with (noise.said_instead("is_decoder") if task == "text-generation-with-past"
          else contextlib.nullcontext()):
        model = checkpoint.load_model(ckpt, tasks.auto_class(task, ckpt.config), dtype, trust,
                                      extra)
    # a feature extractor for an audio task's model, the encoder-decoder's among them
    audio = modality == "audio" or task.startswith("automatic-speech-recognition") or (
        modality == "any" and getattr(model, "main_input_name", "") == "input_values")
    kind = "audio" if audio else ""
    return Loaded(model, task, ckpt.spec, tokenizer, checkpoint.load_processor(ckpt, kind),
                  ckpt, [f"task {task} ({how})", f"loaded in {dtype}"], job)


def _load_object(model: torch.nn.Module, task: str | None, dtype: str) -> Loaded:
    """A PreTrainedModel the caller loaded: used as it is (borrowed, not converted)."""
    if dtype != "fp32" and DTYPES[dtype] != getattr(model, "dtype", None):
        raise ValueError("onnxmedic.export_pretrained: dtype sets the dtype a checkpoint is "
                         "loaded in; convert a model object yourself (model.to(dtype))")
    config = model.config.to_dict()
    config["architectures"] = [type(model).__name__]
    can = supported_tasks(config, type(model).__name__)
    if task is None:
        task = detect_task(config)
        how = f"detected from the class {type(model).__name__}"
    else:
        how = "given"
        _known_task(task)
    if task is None or task not in can:
        raise _err("OM805", f"a {type(model).__name__} cannot serve the task {task!r}; it "
                   f"serves: {', '.join(can) or 'none onnxmedic knows'}.",
                   "Load the model with the Auto class of the task (e.g. "
                   "AutoModelForSequenceClassification for text-classification).")
    check_generation(task)
    folder = Path(str(getattr(model, "name_or_path", "") or ""))
    ckpt = None
    if folder.is_dir() and (folder / "config.json").is_file():
        with contextlib.suppress(InputError):  # a folder it cannot read: no tokenizer from it
            ckpt = checkpoint.resolve(str(folder))
    tokenizer = checkpoint.load_tokenizer(ckpt, False) if ckpt is not None else None
    return Loaded(model, task, type(model).__name__, tokenizer, None, ckpt,
                  [f"task {task} ({how})", f"the model object as it is ({model.dtype})"])


def load_for_task(model: Any, task: str | None, dtype: str, trust: bool,
                  build: Callable[[Checkpoint, str], Any] | None = None) -> Loaded:
    """``model`` (a checkpoint or a PreTrainedModel) loaded for ``task`` (detected when
    None); ``build`` (hf/backends.py's starter) starts the package's builder first, as soon
    as the checkpoint's config is read. Problems of the checkpoint are InputErrors
    (OM800-OM809)."""
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise _err("OM808", "transformers is not installed; Hugging Face checkpoints need it.",
                   "pip install 'onnxmedic[hf]'.") from e
    if isinstance(model, torch.nn.Module):
        return _load_object(model, task, dtype)
    ckpt = checkpoint.resolve(os.fspath(model))
    job = None
    if build is not None and not ckpt.remote_code:
        # the genai builder (a child) starts first: it writes the package while the code is
        # checked, the task too, and the model loads here (a causal LM's task is told from
        # its class alone)
        job = build(ckpt, task if task is not None else detect_task(ckpt.config, ckpt.folder))
    try:
        checkpoint.check_code(ckpt, trust)
        return _load_for_task(ckpt, task, dtype, trust, job)
    except BaseException:
        if job is not None:
            job.discard()
        raise
