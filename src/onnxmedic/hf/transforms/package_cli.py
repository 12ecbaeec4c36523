"""``onnxmedic optimize PACKAGE_FOLDER hf:CHECKPOINT -o OUT_FOLDER [--precision fp32|int4]``:
a generation package made fast, each step verified (docs/int4.md).

``fp32``: the package fused (hf/transforms/fuse_decoder.py: GroupQueryAttention with a shared KV
buffer, SkipSimplifiedLayerNormalization), verified against PyTorch token by token. ``int4``:
the fused package when it verifies (else the plain one) through hf/transforms/int4_package.py's
candidates and task budget (``--accuracy``). The checkpoint is the PyTorch model the package
was exported from (a folder written by ``save_pretrained``, ``hf:`` optional).
"""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def load_reference(spec: str) -> tuple[Any, Any]:
    """(causal LM in eval mode, tokenizer or None) of a checkpoint folder; raises
    OnnxMedicError (OM737) when it cannot be loaded."""
    from onnxmedic.findings import OnnxMedicError, error

    folder = spec[3:] if spec.startswith("hf:") else spec
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


def cli_package(ns: Any) -> int:
    """The package branch of ``onnxmedic optimize``: 0 written, 1 not (a finding says why),
    2 for a bad flag."""
    from onnxmedic.findings import OnnxMedicError
    from onnxmedic.genpackage import NotAStep, read_package
    from onnxmedic.hf.transforms.fuse_decoder import fuse_package
    from onnxmedic.hf.transforms.int4_package import not_fed

    if ns.precision not in ("fp32", "int4") or ns.target != "cpu" or not ns.output:
        sys.stderr.write("onnxmedic optimize: error: a generation package folder takes "
                         "--precision fp32 or int4, --target cpu and -o OUT_FOLDER\n")
        return 2
    try:  # the package first: a folder its contract cannot feed is said before loading
        read_package(ns.onnx).empty_past()
    except NotAStep as e:
        _print([not_fed(Path(ns.onnx), e)])
        return 1
    try:
        model, tok = load_reference(ns.model)
    except OnnxMedicError as err:
        sys.stderr.write(err.finding.one_paragraph() + "\n")
        return err.finding.exit_code
    out = Path(ns.output)
    if ns.precision == "fp32":
        res = fuse_package(ns.onnx, out, model, tok, timeout=ns.timeout)
        _print(res.findings)
        return 0 if res.ok else 1
    return _int4(ns, model, tok, out)


def _int4(ns: Any, model: Any, tok: Any, out: Path) -> int:
    from onnxmedic.hf.transforms.fuse_decoder import fuse_package
    from onnxmedic.hf.transforms.int4_package import int4_package
    from onnxmedic.optimize import int4
    from onnxmedic.optimize.int4_search import print_result

    try:
        budget = int4.parse_budget(ns.accuracy)
    except ValueError as e:
        sys.stderr.write(f"onnxmedic optimize: error: {e}\n")
        return 2
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.fused-", dir=out.parent))
    try:
        fused = fuse_package(ns.onnx, work / "fused", model, tok, timeout=ns.timeout)
        src = work / "fused" if fused.ok else Path(ns.onnx)
        print(f"int4 of the {'fused' if fused.ok else 'plain'} package "
              f"({'; '.join(f.message for f in fused.findings if f.code in ('OM734', 'OM735'))})")
        res = int4_package(src, out, model, tok, budget=budget, threads=ns.threads,
                           timeout=ns.timeout)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if res.search is not None:
        print_result(res.search)
    _print([f for f in res.findings if f.code not in ("OM730", "OM731", "OM732")])
    return 0 if res.ok else 1


def _print(findings: list[Any]) -> None:
    for f in findings:
        print(f"{f.code} {f.message}")
