"""Regenerate the stage table of docs/architecture.md from onnxmedic.pipeline.EXPORT_STAGES.

The table sits between the markers ``<!-- stages:begin -->`` and ``<!-- stages:end -->``; the
rest of the page is written by hand. tests/test_docs.py keeps the table in step with the code.

Usage: python tools/gen_architecture_doc.py
"""

from __future__ import annotations

import inspect
import logging
import re
from pathlib import Path

logging.getLogger("torch.onnx").setLevel(logging.ERROR)

from onnxmedic.pipeline import EXPORT_STAGES  # noqa: E402
from onnxmedic.result import STAGES  # noqa: E402
from onnxmedic.stages import EXPORT_STAGE_LIST  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
BEGIN, END = "<!-- stages:begin -->", "<!-- stages:end -->"


def first_sentence(fn: object) -> str:
    """The first sentence of ``fn``'s docstring, on one line."""
    doc = inspect.getdoc(fn) or ""
    para = " ".join(doc.split("\n\n")[0].split())
    m = re.match(r"(.+?\.)(\s|$)", para)
    text = (m.group(1) if m else para).rstrip(".")
    text = re.sub(r":\w+:`", "`", text.replace("``", "`"))
    return text.replace("|", "\\|")


def render_table() -> str:
    """The generated part of the page: the export's stages in order, then the recorded ones."""
    lines = [BEGIN, "",
             "| # | stage | records | function | when it fails | what it does |",
             "|---|---|---|---|---|---|"]
    records = dict(EXPORT_STAGE_LIST)
    for i, stage in enumerate(EXPORT_STAGES, 1):
        where = f"`{stage.run.__module__}.{stage.run.__qualname__}`"
        notice = ("stops; OM010: the file is not written" if stage.notice
                  else "the export stops")
        if stage.wanted is not None:
            why = first_sentence(stage.wanted)
            notice = f"optional: {why[:1].lower()}{why[1:]}; never stops the export"
        recorded = ", ".join(f"`{s}`" for s in records[stage.name]) or "-"
        lines.append(f"| {i} | `{stage.name}` | {recorded} | {where} | {notice} | "
                     f"{first_sentence(stage.run)} |")
    lines += ["", "The statuses a result records (`onnxmedic.result.STAGES`, the keys of "
              "`result.stages`): " + ", ".join(f"`{s}`" for s in STAGES) + ".", "", END]
    return "\n".join(lines)


def render(text: str) -> str:
    """``text`` (the page) with its generated table replaced by the current one."""
    head, rest = text.split(BEGIN, 1)
    return head + render_table() + rest.split(END, 1)[1]


if __name__ == "__main__":
    DOC.write_text(render(DOC.read_text()))
