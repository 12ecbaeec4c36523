"""The sweep's records: one dict per entry (as in the results file), the SweepResult that
holds them, and the results file, rewritten atomically after each entry."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onnxmedic.findings import Finding, InputError, ResultCodes, Severity, error, info
from onnxmedic.report.files import atomic_write_text
from onnxmedic.sweep.zoo import Entry

RESULTS_FORMAT = "onnxmedic-sweep/1"
STATUSES = ("verified", "failed", "factory-failed", "crashed", "timeout")


def record(entry: Entry, status: str, seconds: float, *, findings: list[Finding] | None = None,
            **extra: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "name": entry.name, "source": entry.source, "status": status,
        "ok": status == "verified", "stages": {}, "failed_stage": None,
        "findings": [f.to_dict() for f in findings or []], "max_abs": None, "max_rel": None,
        "export_seconds": None, "seconds": round(seconds, 3), "peak_rss_mb": None,
        "note": "", "check": None, "opset": None,
    }
    rec.update(extra)
    return rec


@dataclass
class SweepResult(ResultCodes):
    """The outcome of sweep(): one record per entry (dicts, as in the results file)."""

    zoo: str
    entries: list[dict[str, Any]] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    executor: str = "local"
    jobs: int = 1
    seconds: float = 0.0
    results_path: str | None = None
    command: str = "sweep"

    @property
    def ok(self) -> bool:
        return all(e["ok"] for e in self.entries) and not self.errors and bool(self.entries)

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in STATUSES}
        for e in self.entries:
            out[e["status"]] = out.get(e["status"], 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"format": RESULTS_FORMAT, "command": self.command, "zoo": self.zoo,
                "ok": self.ok, "exit_code": self.exit_code, "executor": self.executor,
                "jobs": self.jobs, "seconds": round(self.seconds, 3),
                "results_path": self.results_path, "counts": self.counts(),
                "findings": [f.to_dict() for f in self.findings], "entries": self.entries}


def read_results(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
        if data.get("format") != RESULTS_FORMAT or not isinstance(data.get("entries"), list):
            raise ValueError(f"not an onnxmedic sweep results file (format "
                             f"{data.get('format')!r})")
        return [e for e in data["entries"] if isinstance(e, dict) and "name" in e]
    except (ValueError, OSError, AttributeError) as e:
        raise InputError(error("OM706", "sweep", f"cannot resume from {str(path)!r}: {e}",
                               suggestion="Give the results file a previous `onnxmedic sweep "
                               "--results` wrote, or start afresh without --resume.")) from e


def write_results(result: SweepResult) -> None:
    if result.results_path is None:
        return
    atomic_write_text(result.results_path, json.dumps(result.to_dict(), indent=1, default=str))


def summarise(result: SweepResult) -> None:
    """One finding per entry that is not verified, and the summary line (OM708)."""
    for e in result.entries:
        if e["ok"]:
            continue
        own = [f for f in e["findings"] if f["severity"] == "error"]
        if e["status"] in ("crashed", "timeout", "factory-failed") and own:
            f = own[0]
            result.findings.append(Finding(f["code"], f["stage"], Severity.ERROR, f["message"],
                                           suggestion=f.get("suggestion"),
                                           details={"entry": e["name"]}))
            continue
        first = own[0] if own else None
        why = (f"{first['code']} {first['title']}: {first['message']}" if first
               else "no error finding recorded")
        result.findings.append(error(
            "OM700", "sweep", f"{e['name']}: not verified (stage {e.get('failed_stage') or '?'}"
            f"): {why[:400]}", suggestion="Run it alone for the full report: its findings "
            "are in the sweep's JSON report under entries.", details={"entry": e["name"]}))
    c = result.counts()
    result.findings.append(info(
        "OM708", "sweep", f"{c['verified']} of {len(result.entries)} entries exported and "
        f"verified; {c['failed']} failed, {c['factory-failed']} could not be built, "
        f"{c['crashed']} crashed, {c['timeout']} timed out ({result.seconds:.1f} s, "
        f"{result.jobs} job(s), executor {result.executor})."))
