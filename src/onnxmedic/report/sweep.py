"""The sweep's summary: the table in the terminal, and the .json / .html report."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from onnxmedic.findings import Severity, error
from onnxmedic.report.files import atomic_write_text, render_template


def summary_rows(result: Any) -> list[dict[str, Any]]:
    """Per entry: the columns of the summary table."""
    rows = []
    for e in result.entries:
        codes = sorted({f["code"] for f in e["findings"] if f["severity"] != "info"})
        stages = e.get("stages") or {}
        rows.append({
            "name": e["name"], "status": e["status"], "ok": e["ok"],
            "stages": "".join("✔" if v == "passed" else "✘" if v == "failed" else "·"
                              for v in stages.values()),
            "failed_stage": e.get("failed_stage") or "",
            "findings": ", ".join(codes), "max_abs": e.get("max_abs"),
            "export_seconds": e.get("export_seconds"), "peak_rss_mb": e.get("peak_rss_mb"),
            "note": e.get("note") or "",
        })
    return rows


def render_sweep_terminal(result: Any, console: Any = None) -> None:
    """The summary table on stderr: per model, stages, findings, max error, export seconds."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console(stderr=True, soft_wrap=True)
    t = Table(title=f"onnxmedic sweep {escape(result.zoo)}", title_justify="left")
    for col in ("model", "status", "stages", "findings", "max abs err", "export s", "peak MiB"):
        t.add_column(col)
    for r in summary_rows(result):
        status = f"[green]{r['status']}[/]" if r["ok"] else f"[red]{r['status']}[/]"
        t.add_row(escape(r["name"]), status, r["stages"], escape(r["findings"]),
                  "" if r["max_abs"] is None else f"{r['max_abs']:.2g}",
                  "" if r["export_seconds"] is None else f"{r['export_seconds']:.1f}",
                  "" if r["peak_rss_mb"] is None else f"{r['peak_rss_mb']:.0f}")
    if result.entries:
        console.print(t)
    for f in result.findings:
        if f.code == "OM700":
            continue  # in the table already
        color = {"error": "red", "warning": "yellow", "info": "blue"}[f.severity.value]
        console.print(f"[{color}]{f.code}[/] [bold]{escape(f.title)}[/]: {escape(f.message)}")
        if f.suggestion and f.severity == Severity.ERROR:
            console.print(f"    [cyan]Next step:[/] {escape(f.suggestion)}")


def write_sweep_report(result: Any, path: str | os.PathLike[str]) -> None:
    """Write the sweep as .json or .html (by extension); failures become findings."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".json", ".html", ".htm"):
        result.findings.append(error("OM004", "report", f"report path {str(path)!r} must end "
                                     "in .json or .html."))
        return
    try:
        if suffix == ".json":
            text = json.dumps(result.to_dict(), indent=2, default=str)
        else:
            text = render_template("sweep.html.j2", r=result.to_dict(),
                                   rows=summary_rows(result))
        atomic_write_text(p, text)
    except OSError as e:
        result.findings.append(error("OM006", "report", f"cannot write the report "
                                     f"{str(path)!r}: {e.strerror or e}"))
