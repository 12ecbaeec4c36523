"""Hugging Face checkpoints: what a spec names (a folder written by ``save_pretrained`` or a hub
id), and loading it safely.

Safety: ``trust_remote_code`` is never implied - a checkpoint whose architecture only its own
Python code defines is refused (OM802) unless the caller passes ``trust_remote_code=True``; and
``.bin`` (pickle) weights are read only with ``torch.load(weights_only=True)`` - a file that
would run code when unpickled is refused before transformers sees it (OM803). Hub ids are
resolved to a local snapshot first (safetensors only when the repository has them), so the
checks run on files, the same way for both.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from onnxmedic.findings import InputError, error
from onnxmedic.genpackage import read_json

logger = logging.getLogger(__name__)

STAGE = "inputs"
PREFIX = "hf:"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json",
                   "spiece.model", "tokenizer.model", "sentencepiece.bpe.model")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
# what a hub snapshot needs: configs, tokenizer/processor files, the sentence-transformers
# modules, and one kind of weights (chosen from the repository's listing)
_HUB_FILES = ["*.json", "*.txt", "*.model", "1_Pooling/*", "2_Normalize/*"]


def input_error(code: str, message: str, suggestion: str | None = None) -> InputError:
    """A problem of the checkpoint or its loading: an error finding of the inputs stage."""
    return InputError(error(code, STAGE, message, suggestion=suggestion))


_err = input_error


def strip_prefix(spec: str) -> str:
    """``hf:ID_OR_FOLDER`` -> ``ID_OR_FOLDER``."""
    return spec[len(PREFIX):] if spec.startswith(PREFIX) else spec


@dataclass
class Checkpoint:
    """A checkpoint resolved to a local folder, its config read (nothing of its code run)."""

    spec: str
    folder: Path
    config: dict[str, Any]
    weights: list[Path] = field(default_factory=list)

    @property
    def remote_code(self) -> bool:
        """Whether only the checkpoint's own Python code defines its architecture."""
        if not self.config.get("auto_map"):
            return False  # (without importing transformers' auto classes: 0.6 s)
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        return self.config.get("model_type") not in CONFIG_MAPPING_NAMES


def has_tokenizer(folder: Path) -> bool:
    """Whether the checkpoint ``folder`` holds a tokenizer's file (:data:`TOKENIZER_FILES`)."""
    return any((folder / n).is_file() for n in TOKENIZER_FILES)


def resolve(spec: str) -> Checkpoint:
    """A folder or hub id as a local checkpoint folder with its config.json read.

    OM800: a folder (or file) that is not a checkpoint; OM801: a hub id that cannot be fetched
    (no network, offline mode, no such repository)."""
    ref = strip_prefix(spec.strip()) if isinstance(spec, str) else ""
    if not ref:
        raise _err("OM800", f"empty checkpoint spec {spec!r}.",
                   "Give a folder written by save_pretrained or a hub id: hf:bert-base-uncased.")
    path = Path(ref).expanduser()
    if path.exists():
        return _local(spec, path)
    # a hub id (org/name) is no path: it starts with none of ".", "/", "~" and has one "/" at
    # most and no other separator
    if not _HUB_ID.match(ref):
        raise _err("OM800", f"the checkpoint folder {ref!r} does not exist (and it is not a hub "
                   "id such as org/name).",
                   "Give a folder written by model.save_pretrained(...), or a hub id.")
    return _local(spec, _snapshot(ref))


def _local(spec: str, path: Path) -> Checkpoint:
    if not path.is_dir():
        raise _err("OM800", f"{str(path)!r} is a file, not a checkpoint folder.",
                   "Give the folder that save_pretrained wrote (it holds config.json and the "
                   "weights), not one of its files.")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        found = ", ".join(sorted(p.name for p in path.iterdir())[:8]) or "nothing"
        raise _err("OM800", f"{str(path)!r} is not a Hugging Face checkpoint: it has no "
                   f"config.json (it holds {found}).",
                   "Save the model with model.save_pretrained(folder) (and the tokenizer with "
                   "tokenizer.save_pretrained(folder)).")
    try:
        config = json.loads(cfg_path.read_text())
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (ValueError, OSError) as e:
        raise _err("OM800", f"{str(cfg_path)!r} cannot be read as a model config ({e}).",
                   "Write it again with model.save_pretrained(folder).") from e
    weights = sorted(p for p in path.iterdir() if p.is_file() and (
        p.name in WEIGHT_FILES or re.fullmatch(r"(model|pytorch_model)-\d+-of-\d+\.(safetensors|bin)",
                                               p.name)))
    if not weights:
        raise _err("OM800", f"{str(path)!r} holds a config.json but no weights (looked for "
                   f"{', '.join(WEIGHT_FILES)}).",
                   "Save the model with model.save_pretrained(folder); a config alone has no "
                   "weights to export.")
    return Checkpoint(spec, path, config, weights=weights)


def _snapshot(repo_id: str) -> Path:
    """Download (or find in the cache) what the export needs of a hub repository."""
    try:
        from huggingface_hub import HfApi, snapshot_download

        patterns = list(_HUB_FILES)
        try:
            files = HfApi().list_repo_files(repo_id)
            has_st = any(f.endswith(".safetensors") for f in files)
            patterns.append("*.safetensors" if has_st else "*.bin")
        except Exception:  # offline: whatever the cache holds
            patterns += ["*.safetensors", "*.bin"]
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except ImportError as e:
        raise _err("OM808", "huggingface_hub is not installed; hub ids need it.",
                   "pip install 'onnxmedic[hf]', or give a local folder.") from e
    except Exception as e:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")
        why = ("HF_HUB_OFFLINE is set and the cache holds no snapshot of it" if offline else
               f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        raise _err("OM801", f"the hub id {repo_id!r} cannot be fetched ({why}).",
                   "Check the id and your network (or unset HF_HUB_OFFLINE), or download it "
                   "where you have network (huggingface-cli download ID --local-dir DIR) and "
                   "give the folder.") from e


def check_code(ckpt: Checkpoint, trust_remote_code: bool) -> None:
    """OM802 unless the caller trusts the checkpoint's code (when it needs its own code); OM808
    when the installed transformers does not know the model type."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if ckpt.remote_code and not trust_remote_code:
        classes = ", ".join(f"{k}: {v}" for k, v in list(ckpt.config["auto_map"].items())[:4])
        raise _err("OM802", f"{ckpt.spec} needs its own Python code to build the model "
                   f"(config.json auto_map: {classes}); onnxmedic never runs a checkpoint's code "
                   "unless asked, and ran nothing from it.",
                   "Read that code first; if you trust it, pass --trust-remote-code "
                   "(trust_remote_code=True).")
    model_type = ckpt.config.get("model_type")
    if not ckpt.remote_code and model_type not in CONFIG_MAPPING_NAMES:
        import transformers

        raise _err("OM808", f"{ckpt.spec}: the installed transformers {transformers.__version__}"
                   f" does not know model_type {model_type!r}.",
                   "Upgrade transformers, or check config.json's model_type.")


def check_pickles(ckpt: Checkpoint) -> None:
    """OM803 for a ``.bin`` weights file that is not plain tensors (it would run code when
    unpickled); read with weights_only=True and memory-mapped, so nothing is copied."""
    if any(p.suffix == ".safetensors" for p in ckpt.weights):
        return  # transformers prefers safetensors when both exist
    for p in [w for w in ckpt.weights if w.suffix == ".bin"]:
        try:
            torch.load(p, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:
            unsafe = "weights_only" in str(e) or "Unsupported global" in str(e)
            raise _err("OM803", f"{str(p)!r} " + (
                "holds Python objects that are not plain tensors: unpickling it could run "
                "code, so it was refused and nothing of it was run." if unsafe else
                f"cannot be read as PyTorch weights ({type(e).__name__})."),
                "Convert the checkpoint to safetensors where you trust it "
                "(model.save_pretrained(folder, safe_serialization=True)).") from e


def load_model(ckpt: Checkpoint, auto_class: str, dtype: str, trust_remote_code: bool,
               extra: dict[str, Any] | None = None) -> Any:
    """``AutoModelFor...from_pretrained`` on the checked folder, in eval mode (OM808 when
    transformers cannot build it)."""
    import transformers

    check_pickles(ckpt)
    cls = getattr(transformers, auto_class)
    # transformers renamed torch_dtype to dtype in 4.56
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    try:
        model = cls.from_pretrained(str(ckpt.folder), **{dtype_kw: DTYPES[dtype]},
                                    trust_remote_code=trust_remote_code, **(extra or {}))
    except Exception as e:
        if "trust_remote_code" in str(e):
            raise _err("OM802", f"{ckpt.spec} needs its own Python code ({e}); nothing of it was "
                       "run.", "Pass --trust-remote-code if you trust it.") from e
        raise _err("OM808", f"{ckpt.spec} cannot be loaded with {auto_class}.from_pretrained "
                   f"({type(e).__name__}: {str(e)[:300]}).",
                   "Check the folder's weights and config (save it again with "
                   "save_pretrained), or the installed transformers version.") from e
    return model.eval()


def load_tokenizer(ckpt: Checkpoint, trust_remote_code: bool) -> Any:
    """The folder's tokenizer, or None when it has none (or it cannot be loaded: logged)."""
    if not has_tokenizer(ckpt.folder):
        return None
    return _load_part(ckpt, "AutoTokenizer", "tokenizer", trust_remote_code=trust_remote_code)


def load_processor(ckpt: Checkpoint, kind: str) -> Any:
    """The folder's audio feature extractor (``kind`` "audio"), or None: image processors need
    Pillow or torchvision, so images are made from the config and preprocessor_config.json."""
    if kind != "audio" or not (ckpt.folder / "preprocessor_config.json").is_file():
        return None
    return _load_part(ckpt, "AutoFeatureExtractor", "feature extractor")


def _load_part(ckpt: Checkpoint, auto_class: str, what: str, **kwargs: Any) -> Any:
    """``auto_class.from_pretrained`` on the folder (a tokenizer, a feature extractor), or None
    when it cannot be loaded (logged: the task says whether it needs it)."""
    import transformers

    try:
        return getattr(transformers, auto_class).from_pretrained(str(ckpt.folder), **kwargs)
    except Exception:
        logger.warning("the %s of %s cannot be loaded", what, ckpt.spec, exc_info=True)
        return None


def preprocessor_config(ckpt: Checkpoint | None) -> dict[str, Any]:
    """preprocessor_config.json as a dict ({} when there is none or it is unreadable)."""
    data = read_json(ckpt.folder, "preprocessor_config.json") if ckpt is not None else None
    return data if isinstance(data, dict) else {}
