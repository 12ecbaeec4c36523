"""Third-party lines a normal command would print on stderr, silenced where they are emitted.

Each entry of :data:`KNOWN` names the logger that emits one known message, a pattern of that
message and why it is noise here; :func:`silence` puts a filter on that logger that drops that
message only, so everything else the library logs still shows. None of them is about the
user's model or what onnxmedic did with it: they come from importing torchao, which
transformers does on its first ``from_pretrained`` and onnxruntime-genai's builder does too.
A message that is about the user's model, but that onnxmedic says itself in its own words
(:data:`SAID_INSTEAD`), is dropped only while onnxmedic does what makes the library say it
(:func:`said_instead`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Iterator
from typing import TextIO

# (logger, pattern of the message, why it is noise)
KNOWN: tuple[tuple[str, str, str], ...] = (
    ("torchao", r"^Failed to load .*\.so: Could not load this library",
     "torchao's optional kernels built for other CUDA/Python versions; onnxmedic uses none"),
    ("torchao.kernel.intmm", r"Detected no triton",
     "torchao's GPU int-matmul kernels need Triton; onnxmedic uses none"),
    ("torch.utils._pytree", r"is an Enum subclass and is now natively supported by "
     r"torch\.compile", "torchao registers its enums as pytree constants, which torch "
     "deprecates; nothing onnxmedic can change"),
)


# (library, pattern of the message, why onnxmedic says it instead): a message that many of
# the library's module loggers emit, which reaches stderr through the handler the library puts
# on its own root logger on first use; dropped there by :func:`said_instead` while onnxmedic
# does what makes the library say it, and only then
SAID_INSTEAD: dict[str, tuple[str, str, str]] = {
    "is_decoder": (
        "transformers", r"as a standalone, add `is_decoder=True",
        "an encoder's causal-LM class (BertLMHeadModel ...) built without is_decoder keeps no "
        "cache: for text-generation-with-past OM817 says so, with the fix"),
}


class _Drop(logging.Filter):
    """Drops the records of one logger whose message matches ``pattern``."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def silence(progress: bool | None = None) -> None:
    """Drop the :data:`KNOWN` messages (idempotent). ``progress=False`` also turns off the
    Hugging Face libraries' progress bars (transformers' "Loading weights" bar) unless
    ``HF_HUB_DISABLE_PROGRESS_BARS`` is set already; None: off when stderr is not a terminal."""
    for name, pattern, _why in KNOWN:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.pattern.pattern == pattern
                   for f in logger.filters):
            logger.addFilter(_Drop(pattern))
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:  # read when huggingface_hub is imported (transformers imports it)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@contextlib.contextmanager
def said_instead(key: str) -> Iterator[None]:
    """While the block runs, the message :data:`SAID_INSTEAD` names by ``key`` is dropped on the
    handlers its library's loggers reach (the library's root logger's, and its ancestors' while
    it propagates): onnxmedic says it in its own words. Every other message still shows, and
    the same message outside the block."""
    library, pattern, _why = SAID_INSTEAD[key]
    drop = _Drop(pattern)
    handlers, log = [], logging.getLogger(library)
    while log is not None:
        handlers += [h for h in log.handlers if h not in handlers]
        log = log.parent if log.propagate else None
    for h in handlers:
        h.addFilter(drop)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(drop)


@contextlib.contextmanager
def torch_logs_to(stream: TextIO) -> Iterator[None]:
    """While the block runs, the lines torch logs through its own handlers (torch.export's
    guard warnings, draft_export's summary of what it could not capture soundly) go to
    ``stream`` instead of stderr: torch's handlers hold the stderr of its import, which
    ``contextlib.redirect_stderr`` does not reach. For a call whose failures onnxmedic
    reports itself (a capture attempt), the lines are kept for the report."""

    def divert(record: logging.LogRecord) -> bool:
        stream.write(f"{record.levelname[:1]} {record.name}: {record.getMessage()}\n")
        return False

    handlers = {id(h): h for name, lg in list(logging.root.manager.loggerDict.items())
                if (name == "torch" or name.startswith("torch."))
                and isinstance(lg, logging.Logger) for h in lg.handlers}.values()
    for h in handlers:
        h.addFilter(divert)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(divert)
