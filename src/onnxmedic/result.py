"""Typed result records: ExportResult (export, verify, doctor, reduce), RunResult (run), and the
way a stage records its own status, time and findings (``with result.stage("check") as st``)."""

from __future__ import annotations

import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onnxmedic.findings import Finding, OnnxMedicError, ResultCodes, error
from onnxmedic.stages import STATUSES

STAGES = STATUSES  # the statuses an export records (stages.EXPORT_STAGE_LIST)
NOT_RUN, PASSED, FAILED = "not run", "passed", "failed"


class StageRecord:
    """A stage's handle on the result: it passes unless it fails (``fail``), and its findings
    join the result's (``add``)."""

    def __init__(self, result: ExportResult, name: str) -> None:
        self.result = result
        self.name = name

    @property
    def failed(self) -> bool:
        return self.result.stages.get(self.name) == FAILED

    def fail(self, *findings: Finding) -> None:
        self.result.fail(self.name, *findings)

    def add(self, *findings: Finding) -> None:
        self.result.findings.extend(findings)

    def passed(self) -> None:
        """Record the stage as passed (for a stage whose verdict comes after its timed work)."""
        if not self.failed:
            self.result.stages[self.name] = PASSED

    def reopen(self) -> None:
        """Set the stage back to not run: its verdict is judged again (verify's second run
        of an int8 file with ONNX Runtime's exact kernels, stages/verify.py)."""
        self.result.stages[self.name] = NOT_RUN


@dataclass
class ExportResult(ResultCodes):
    """The outcome of export() or verify(). ``ok``: exported *and* verified."""

    ok: bool = False
    path: str | None = None
    findings: list[Finding] = field(default_factory=list)
    stages: dict[str, str] = field(default_factory=lambda: {s: NOT_RUN for s in STAGES})
    verification: list[Any] = field(default_factory=list)  # verify.compare.OutputComparison
    attempts: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    command: str = "export"
    model: str | None = None
    inputs: list[str] = field(default_factory=list)
    used_translations: list[str] = field(default_factory=list)
    inventory: list[dict[str, Any]] = field(default_factory=list)  # with explain=True
    opset: int | None = None
    traceback: str | None = None
    onnx_model: Any = None  # the onnx.ModelProto (in memory; not serialised)
    program: Any = None  # the captured ExportedProgram, when there is one
    localization: Any = None  # verify.localize.Localization, when localisation ran
    optimization: Any = None  # optimize.OptimizationResult, with export(optimize=True)
    reasons: list[dict[str, str]] = field(default_factory=list)  # fixes/strategies not applied
    repro: str | None = None  # the repro script written (repro=), when one was

    @property
    def failed_stage(self) -> str | None:
        return next((s for s, v in self.stages.items() if v == FAILED), None)

    # -- recording ---------------------------------------------------------------------------
    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Add the block's wall time to ``timings[name]`` (status untouched)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t0

    @contextmanager
    def stage(self, name: str, conclude: bool = True) -> Iterator[StageRecord]:
        """Run one stage: timed; it passes when the block ends without ``st.fail`` (with
        ``conclude=False`` the block only times, and ``st.passed()`` concludes later). An
        exception leaves the status as it was (the guard reports it)."""
        rec = StageRecord(self, name)
        with self.timed(name):
            yield rec
        if conclude:
            rec.passed()

    def record(self, name: str) -> StageRecord:
        """The handle of a stage that has run (or is concluded outside a timed block)."""
        return StageRecord(self, name)

    def fail(self, stage: str, *findings: Finding) -> ExportResult:
        self.stages[stage] = FAILED
        self.findings.extend(findings)
        self.ok = False
        return self

    def skip_reason(self, what: str, reason: str) -> None:
        """Why a fix or strategy was not applied: kept for the report (not a finding)."""
        self.reasons.append({"what": what, "reason": reason})

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Problems become findings: an OnnxMedicError its own, any other exception (onnxmedic's
        bug) OM009 with the traceback kept for the report. Ctrl-C is not caught."""
        try:
            yield
        except OnnxMedicError as e:
            self.findings.append(e.finding)
            self.ok = False
        except Exception as e:
            self.traceback = traceback.format_exc()
            self.findings.append(error(
                "OM009", self.failed_stage or "internal",
                f"onnxmedic failed internally: {type(e).__name__}: {e}",
                suggestion="Please file a bug with the report attached."))
            self.ok = False

    # -- reading -----------------------------------------------------------------------------
    def verification_summary(self) -> dict[str, dict[str, float]]:
        """Per output: the worst max abs / rel error over all input sets."""
        out: dict[str, dict[str, float]] = {}
        for c in self.verification:
            d = out.setdefault(c.name, {"max_abs": 0.0, "max_rel": 0.0, "ok": True})
            d["max_abs"] = max(d["max_abs"], c.max_abs)
            d["max_rel"] = max(d["max_rel"], c.max_rel)
            d["ok"] = d["ok"] and c.ok
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "exit_code": self.exit_code,
            "command": self.command,
            "path": self.path,
            "model": self.model,
            "inputs": self.inputs,
            "opset": self.opset,
            "stages": dict(self.stages),
            "failed_stage": self.failed_stage,
            "findings": [f.to_dict() for f in self.findings],
            "verification": [c.to_dict() for c in self.verification],
            "verification_summary": self.verification_summary(),
            "capture_attempts": self.attempts,
            "used_translations": self.used_translations,
            "inventory": self.inventory,
            "timings": {k: round(v, 4) for k, v in self.timings.items()},
            "traceback": self.traceback,
            "localization": self.localization.to_dict() if self.localization else None,
            "optimization": self.optimization.to_dict() if self.optimization else None,
            "not_applied": self.reasons,
        }


VerifyResult = ExportResult


def stages_of(*names: str) -> dict[str, str]:
    """A fresh stage table for a command with its own stages (doctor, run, reduce)."""
    return {n: NOT_RUN for n in names}


@dataclass
class RunResult(ExportResult):
    """The outcome of run(): ``outputs`` maps output names to arrays."""

    outputs: dict[str, np.ndarray] = field(default_factory=dict)
