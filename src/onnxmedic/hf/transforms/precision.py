"""A generation package at a precision: the one road of ``optimize PACKAGE hf:CHECKPOINT
--precision P`` and ``export hf:CHECKPOINT --precision P`` (any backend's package, read through
onnxmedic/genpackage.py).

``fp32``: the package fused (fuse_decoder.py), verified token by token against PyTorch.
``int4``: the fused package where it verifies (else the plain one) through int4_package.py's
candidates, judged by the task budget (optimize/int4.py) and served by onnxruntime-genai.
Nothing is written at ``out`` unless verified.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onnxmedic.findings import error, info
from onnxmedic.hf.transforms.passes import PackageOutcome, staged

logger = logging.getLogger(__name__)

PRECISIONS = ("fp32", "int4")  # what a generation package can be made at here (CPU)


@dataclass
class PackagePrecision(PackageOutcome):
    """The transform's outcome: ``ok`` when ``path`` was written; ``fused`` (fuse_decoder's
    FuseResult), ``int4`` (int4_package's Int4PackageResult, None at fp32) and every
    ``findings`` of both."""

    fused: Any = None
    int4: Any = None


def precision_problem(precision: str, target: str = "cpu", flags: bool = True) -> str | None:
    """Why a generation package cannot be made at ``precision`` for ``target`` (None when it
    can), worded with the CLI's flags (``flags``) or the API's arguments."""
    p, t = ("--precision ", "--target ") if flags else ("precision=", "target=")
    if precision not in PRECISIONS:
        return (f"a generation package is made at {p}{' or '.join(PRECISIONS)} here, not "
                f"{precision}")
    if target != "cpu":
        return f"a generation package is made for {t}cpu here, not {target}"
    return None


def preflight(folder: Path, precision: str, shown: str | None = None) -> Any:
    """Why the package at ``folder`` cannot be made at ``precision``, before any work (the
    checkpoint not loaded yet): OM839 when the contract cannot feed its decoder a step, OM741
    when it has no genai_config.json (every transform is judged by onnxruntime-genai
    generating from it: the export said why it has none, OM820/OM829); None when it can: at
    int4 too for a cache of convolution or state-space states (LFM2's builder package), which
    the task budget's PyTorch reference feeds as the package's contract does. ``shown``: how
    the findings name the package (default: ``folder``)."""
    from onnxmedic.genpackage import NotAStep, read_package
    from onnxmedic.hf.transforms.int4_package import not_fed

    try:  # the package first: a folder its contract cannot feed is said before any work
        read_package(folder).empty_past()
    except NotAStep as e:
        return not_fed(folder, e, shown)
    if (folder / "genai_config.json").is_file():
        return None
    why = ("it has no genai_config.json: onnxruntime-genai cannot serve it (its export said "
           "why, OM820/OM829), and a transformed package is judged by onnxruntime-genai "
           "generating from it")
    return error("OM741", "preflight", f"{shown or folder} cannot be made {precision} here: "
                 f"{why}; nothing was written.", suggestion="Serve the package as export hf: wrote "
                 "it (verified at float32).")


def unhonoured_precision(options: dict[str, Any]) -> str | None:
    """export_pretrained's ``precision`` fp16/int8 without ``optimize`` (optimize/passes'
    :func:`~onnxmedic.optimize.passes.unused_precision`, in the API's words): why it would not
    be honoured, None when it would."""
    from onnxmedic.optimize.passes import unused_precision

    return unused_precision(options.get("precision") or "fp32", bool(options.get("optimize")))


def int4_not_for(task: str) -> Any:
    """OM840: ``precision="int4"`` asked for a task whose export it does not serve."""
    return error("OM840", "preflight", f"--precision int4 makes a text-generation-with-past "
                 f"package (a decoder judged by the task budget, docs/int4.md), not {task}; "
                 "nothing was exported.", suggestion="Export it at fp32, or with --optimize "
                 "--precision int8 (CPU) or fp16 (GPU targets); for a decoder give "
                 "--task text-generation-with-past.")


def package_precision(folder: str | os.PathLike[str], out: str | os.PathLike[str], model: Any,
                      tokenizer: Any = None, precision: str = "int4", *, budget: Any = None,
                      threads: int = 2, timeout: float = 600.0, grid: Any = None,
                      search: bool = True, say: Any = None,
                      checked: bool = False, shown: str | None = None) -> PackagePrecision:
    """Write ``out``: the package ``folder`` at ``precision`` (see the module docstring),
    judged against ``model`` (the PyTorch causal LM it was exported from); ``budget``:
    int4's TaskBudget or its spec (``"agreement=95%"``; None: optimize/int4.py's default),
    ``grid`` and ``search`` int4_search's (its default grid and per-layer search);
    ``say(line)``: progress lines (the CLI prints them); ``checked``: :func:`preflight` has
    already said None for ``folder`` at ``precision`` (the CLI asks it before it loads the
    checkpoint), so it is not asked again; ``shown``: how the findings name ``folder``
    (default: its path; a caller whose ``folder`` is a scratch folder names what it stands
    for). Raises ValueError for a precision :func:`precision_problem` refuses or a budget spec
    that does not parse."""
    from onnxmedic.hf.transforms.fuse_decoder import fuse_package
    from onnxmedic.hf.transforms.int4_package import int4_package
    from onnxmedic.optimize.int4 import TaskBudget, parse_budget

    if (why := precision_problem(precision, flags=False)) is not None:
        raise ValueError(why)
    if not isinstance(budget, TaskBudget):
        budget = parse_budget(budget)
    folder, out = Path(folder), Path(out)
    if not checked and (bad := preflight(folder, precision, shown)) is not None:
        return PackagePrecision(findings=[bad])
    res = PackagePrecision()
    if precision == "fp32":
        res.fused = made = fuse_package(folder, out, model, tokenizer, timeout=timeout)
    else:
        with staged(out) as work:
            before = f"{out} (before int4)"  # the fused package lives in the scratch folder
            res.fused = fuse_package(folder, work / "fused", model, tokenizer, timeout=timeout,
                                     shown=before)
            src, src_shown = (work / "fused", before) if res.fused.ok else (folder, shown)
            # the fusion's verdict, on the package int4 started from
            res.findings = [f for f in res.fused.findings if f.code in ("OM734", "OM735")]
            if say is not None:
                said = "; ".join(f.message for f in res.findings)
                say(f"int4 of the {'fused' if res.fused.ok else 'plain'} package ({said})")
            res.int4 = made = int4_package(src, out, model, tokenizer, budget=budget,
                                           grid=grid, search=search, threads=threads,
                                           timeout=timeout, shown=src_shown)
    res.findings.extend(made.findings)
    res.ok, res.path = made.ok, made.path
    return res


def export_at_precision(model: Any, out: str | os.PathLike[str], precision: str = "int4", *,
                        budget: Any = None, report: str | os.PathLike[str] | None = None,
                        **export: Any) -> Any:
    """``export_pretrained(..., precision="int4")`` for text-generation-with-past: the
    float32 package exported and verified beside ``out`` by hf/generation.py's
    ``export_generation`` (``export``: its arguments; either backend), then made at
    ``precision`` into ``out`` by :func:`package_precision` (``budget``: int4's). Its findings
    and the "optimize" stage join the export's ExportResult; only the package made is written,
    and only when both passed. Raises ValueError for a precision it does not make or
    ``verify=False``."""
    from onnxmedic.hf import export_generation, report_to

    if (why := precision_problem(precision, flags=False)) is not None:
        raise ValueError(f"onnxmedic.export_pretrained: {why}")
    if not export.get("verify", True):
        raise ValueError(f"onnxmedic.export_pretrained: precision={precision!r} writes a "
                         "package judged against PyTorch; it needs verify=True")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with staged(out) as stage:
        # the road fuses the package itself: the export's own fusion would be done twice
        result = export_generation(model, stage / "pkg", **{**export, "optimize": False})
        made = None
        if result.ok:
            with result.guard(), result.stage("optimize") as st:
                # a refusal names the package it took, not the scratch folder it is in
                made = package_precision(stage / "pkg", out, model, export.get("tokenizer"),
                                         precision, budget=budget,
                                         timeout=export.get("timeout") or 600.0,
                                         shown=f"the float32 package exported for {out}")
                result.findings.extend(made.findings)
                if not made.ok:
                    st.fail()
    result.int4 = getattr(made, "int4", None)  # type: ignore[attr-defined]
    # the float32 package stayed in the staging folder: only the one made is written
    result.findings = [f for f in result.findings if f.code != "OM819"]
    # (result.ok: the package made, and written; a refusal or a failure failed the stage)
    result.path = str(out) if result.ok else None
    if result.ok:
        result.findings.append(info("OM819", "write", f"{written(precision, out)}."))
    return report_to(result, report)


def written(precision: str, out: Path) -> str:
    """Where the package made at ``precision`` was written, and its files (OM819's words and
    the optimize command's last line)."""
    return (f"{precision} generation package written to {out}: "
            f"{', '.join(sorted(p.name for p in out.iterdir()))}")
