"""``onnxmedic optimize PACKAGE_FOLDER hf:CHECKPOINT -o OUT_FOLDER [--precision fp32|int4]``:
a generation package made fast, each step verified (docs/int4.md).

The package goes through hf/transforms/precision.py, as ``export hf:X --precision P`` does:
``fp32`` fused, ``int4`` fused then judged by the task budget (``--accuracy``). The
checkpoint is the PyTorch model the package was exported from (a folder written by
``save_pretrained``, ``hf:`` optional).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from onnxmedic.findings import OnnxMedicError, error, listed, print_findings, refuse

logger = logging.getLogger(__name__)


def load_reference(spec: str) -> tuple[Any, Any]:
    """(causal LM in eval mode, tokenizer or None) of a checkpoint folder; raises
    OnnxMedicError: OM800 when a folder given is not a checkpoint (missing, no config.json, no
    weights), said as ``export hf:`` says it, before anything is loaded (a hub id is fetched
    by the loader); OM737 when it cannot be loaded."""
    from onnxmedic.hf.checkpoint import resolve, strip_prefix

    folder = strip_prefix(spec)
    if Path(folder).expanduser().exists() or folder.startswith((".", "/", "~")):
        resolve(spec)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(folder).eval()
    except Exception as e:  # noqa: BLE001 - any loader failure is the user's checkpoint
        raise OnnxMedicError(error(
            "OM737", "preflight", f"cannot load the package's PyTorch model from {spec!r}: "
            f"{type(e).__name__}: {str(e)[:300]}",
            suggestion="Give the checkpoint folder the package was exported from: "
            "onnxmedic optimize PACKAGE hf:CHECKPOINT -o OUT")) from e
    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except Exception:  # noqa: BLE001 - no tokenizer: int4 samples its text from the model
        tok = None
    return model, tok


def package_problem(folder: Path) -> Any:
    """Why ``folder`` is not a decoder generation package that optimize can read: OM740 for an
    encoder-decoder package, OM014 when it holds no model.onnx, OM007 when that is not ONNX;
    None when it is one."""
    from onnxmedic.hf.generation import GRAPH  # the decoder file the export writes
    from onnxmedic.onnxfile import load_onnx

    graph = folder / GRAPH
    if not graph.is_file() and (folder / "encoder_model.onnx").is_file():
        return error("OM740", "load", f"{str(folder)!r} is an encoder-decoder generation "
                     "package (encoder_model.onnx, decoder_with_past_model.onnx): optimize "
                     "fuses and quantizes decoder-only packages (model.onnx); an "
                     "encoder-decoder package has no fused or int4 variant here.",
                     suggestion="Serve the package as export hf: wrote it (it is verified "
                     "at float32).")
    if not graph.is_file():
        held = sorted(p.name for p in folder.iterdir())
        return error("OM014", "load", f"{str(folder)!r} is not a generation package: it holds "
                     f"no {GRAPH} ({'it holds ' + listed(held, 6) if held else 'it is empty'}).",
                     suggestion="Give the folder that `onnxmedic export hf:CHECKPOINT --task "
                     "text-generation-with-past -o FOLDER` wrote (or onnxruntime-genai's "
                     "builder), or an ONNX file.")
    return load_onnx(graph, stage="load")[1]


def cli_package(ns: Any) -> int:
    """The package branch of ``onnxmedic optimize``: 0 written, 1 not (a finding says why),
    2 for a bad flag."""
    from onnxmedic.hf.transforms import precision
    from onnxmedic.optimize import int4
    from onnxmedic.optimize.int4_search import print_result

    bad = precision.precision_problem(ns.precision, ns.target) or (
        None if ns.output else "-o OUT_FOLDER is required")
    try:
        budget = int4.parse_budget(ns.accuracy) if ns.precision == "int4" else None
    except ValueError as e:
        bad = str(e)
    if bad:
        sys.stderr.write(f"onnxmedic optimize: error: {bad}\n")
        return 2
    if (unreadable := package_problem(Path(ns.onnx))) is not None:
        return refuse(unreadable)  # before the checkpoint is loaded
    if (bad := precision.preflight(Path(ns.onnx), ns.precision)) is not None:
        print_findings([bad])  # the package's own checks, before the checkpoint is loaded
        return 1
    try:  # after the package's own checks
        model, tok = load_reference(ns.model)
    except OnnxMedicError as err:
        return refuse(err.finding)
    quiet = bool(getattr(ns, "json", False))
    res = precision.package_precision(ns.onnx, ns.output, model, tok, ns.precision,
                                      budget=budget, threads=ns.threads, timeout=ns.timeout,
                                      say=None if quiet else print, checked=True)
    if quiet:
        print(json.dumps({"ok": res.ok, "path": res.path, "precision": ns.precision,
                          "findings": [f.to_dict() for f in res.findings]}, indent=2,
                         default=str))
    elif res.int4 is not None and res.int4.search is not None:
        # the candidate table, then the road's findings but the fusion's verdict (OM734,
        # OM735), said before int4 ran (package_precision's say line)
        print_result(res.int4.search, [f for f in res.findings
                                       if f.code not in ("OM734", "OM735")])
    else:
        print_findings(res.findings)
    if res.ok and not quiet:
        print(precision.written(ns.precision, Path(ns.output)))
    return 0 if res.ok else 1
