"""The user's text for ``--precision int4 --calibration TEXT``, and what the report says about
free-running generation (optimize/int4_search.py).

``--calibration FILE`` (a text file, read as UTF-8) is tokenized with the model's tokenizer and
cut into windows of 128 tokens: the first three quarters (at most 64 windows) calibrate GPTQ
(optimize/int4_gptq.py), the last quarter (at most 16 windows) is held out, and every
candidate's perplexity on it is reported and judged by the same budget as the built-in text's.

Free-running agreement (each side fed its own tokens) is reported per candidate, not judged:
where it is low, :func:`reference_margins` says whether the first divergence fell on a near
tie of PyTorch float32's own logits (the gap between its two best tokens at that step).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from onnxmedic.optimize import int4
from onnxmedic.optimize.int4_gptq import WINDOW, split_text

logger = logging.getLogger(__name__)

MAX_HELD_WINDOWS = 16  # the held-out text perplexity is measured on (2048 tokens at most)


@dataclass
class UserText:
    """The user's calibration text, tokenized: GPTQ's windows (in ``windows_path``, a JSON file
    the quantize step reads), the held-out tokens, and PyTorch float32's perplexity on them."""

    path: str
    windows: list[list[int]]
    held: list[int]
    windows_path: str = ""
    reference_perplexity: float = float("nan")

    def describe(self) -> str:
        """Where the figures come from, in one phrase."""
        return (f"{Path(self.path).name}: GPTQ calibrated on {len(self.windows)} windows of "
                f"{WINDOW} tokens, perplexity on the {len(self.held)} tokens after them")


def calibration_error(path: str | os.PathLike[str], reason: str) -> Exception:
    """OnnxMedicError(OM742) for a calibration text that cannot be used."""
    from onnxmedic.findings import OnnxMedicError, error

    return OnnxMedicError(error(
        "OM742", "optimize", f"--calibration {path}: {reason}",
        suggestion="Give a UTF-8 text file of the kind of text the model will see (a few "
        f"thousand tokens: at least {2 * WINDOW}), with a model that has a `tokenizer` "
        "attribute (anything with encode(str))."))


def load_user_text(path: str | os.PathLike[str], tokenizer: Any, work: str | os.PathLike[str]
                   ) -> UserText:
    """Read, tokenize and split the calibration text; the windows are written to ``work``.
    Raises OnnxMedicError (OM742) when the file cannot be read, the model has no tokenizer,
    or the text is under two windows."""
    encode = getattr(tokenizer, "encode", None)
    if encode is None:
        raise calibration_error(path, "the model has no tokenizer to encode the text with")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise calibration_error(path, f"cannot be read as UTF-8 text ({type(e).__name__}: "
                                f"{e})") from e
    try:
        windows, held = split_text(int4.encode_ids(encode, text))
    except ValueError as err:
        raise calibration_error(path, str(err)) from err
    held = held[:MAX_HELD_WINDOWS * WINDOW]
    out = Path(work) / "calibration.json"
    out.write_text(json.dumps({"windows": windows}))
    return UserText(str(path), windows, held, str(out))


def reference_margins(step: int4.Step, past0: list[np.ndarray], prompts: list[list[int]],
                      tokens: list[list[int]]) -> list[list[float]]:
    """Per prompt and step, the gap between PyTorch's two largest logits when it generated
    ``tokens`` greedily (small: a near tie, where any rounding may pick the other token)."""
    out = []
    for prompt, toks in zip(prompts, tokens):
        # the logits before each of ``toks`` (zip stops the decode at the last)
        tops = [np.sort(logits[0, -1].astype(np.float64))[-2:]
                for logits, _ in zip(int4.decode(step, past0, prompt, toks[:-1]), toks)]
        out.append([float(top[1] - top[0]) for top in tops])
    return out


def divergence_margins(margins: list[list[float]], first: list[int | None]
                       ) -> list[float | None]:
    """PyTorch's top-2 logit gap at each prompt's first divergence (None: no divergence)."""
    return [None if d is None or d >= len(m) else round(m[d], 4)
            for m, d in zip(margins, first)]


def median_margin(margins: list[list[float]]) -> float:
    """The median top-2 gap over every step of every prompt."""
    flat = [g for m in margins for g in m]
    return float(np.median(flat)) if flat else float("nan")
