"""The terminal summary: a stage checklist, the findings, the error table."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

_MARK = {"passed": "[green]✔[/]", "failed": "[red]✘[/]", "not run": "[dim]·[/]"}
_SEV = {"error": "red", "warning": "yellow", "info": "blue"}


def render_terminal(result: Any, console: Console | None = None, verbose: bool = False) -> None:
    console = console or Console(stderr=True, soft_wrap=True)
    good, bad = (("reduced", "not reduced") if result.command == "reduce"
                 else ("verified", "not verified"))
    verdict = (f"[bold green]{good}[/]" if result.ok else f"[bold red]{bad}[/]")
    head = f"onnxmedic {result.command}: {escape(str(result.model))} — {verdict}"
    if result.path and result.ok:
        head += f" → {escape(result.path)}"
    console.print(head)
    line = "  ".join(f"{_MARK.get(status, status)} {stage}"
                     for stage, status in result.stages.items())
    console.print(line)
    for f in result.findings:
        if f.severity.value == "info" and not verbose and f.code not in (
                "OM010", "OM310", "OM320", "OM540"):
            continue
        color = _SEV[f.severity.value]
        console.print(f"[{color}]{f.code}[/] [bold]{escape(f.title)}[/]: {escape(f.message)}")
        if f.location is not None and (f.location.file or f.location.module_path):
            console.print(f"    at {escape(str(f.location))}")
            if f.location.code:
                console.print(f"    [dim]{escape(f.location.code)}[/]")
        if f.suggestion:
            console.print(f"    [cyan]Next step:[/] {escape(f.suggestion)}")
    if result.verification:
        t = Table(title="verification against PyTorch", title_justify="left")
        for col in ("output", "input set", "shape", "dtype", "max abs", "max rel", "rule",
                    "vs PyTorch's own", "status"):
            t.add_column(col)
        for c in result.verification:
            ratio = ("" if getattr(c, "ratio", None) is None else
                     f"{c.ratio:.2g}x (budget {c.budget:g}x)")
            t.add_row(escape(c.name), c.input_set, str(c.expected_shape), c.expected_dtype,
                      f"{c.max_abs:.3g}", f"{c.max_rel:.3g}", getattr(c, "rule", ""), ratio,
                      "[green]ok[/]" if c.ok else f"[red]{escape(c.reason)}[/]")
        console.print(t)
    loc = getattr(result, "localization", None)
    if loc is not None and loc.top:
        t = Table(title=f"divergence localisation ({loc.input_set}): top nodes by error growth",
                  title_justify="left")
        for col in ("FX node", "ATen op", "ONNX node", "where", "max abs", "err/tol",
                    "inputs' err/tol", "growth"):
            t.add_column(col)
        for n in loc.top:
            t.add_row(escape(n.fx_node), escape(n.aten_op), escape(f"{n.onnx_op} {n.onnx_node}"),
                      escape(str(n.location) if n.location else ""), f"{n.max_abs:.3g}",
                      f"[red]{n.score:.3g}[/]" if n.exceeds else f"{n.score:.3g}",
                      f"{n.input_score:.3g}", f"{n.growth:.3g}")
        console.print(t)
    if getattr(result, "inventory", None):
        t = Table(title="op inventory (after torch.onnx's decompositions)", title_justify="left")
        for col in ("ATen op", "count", "translated by", "first use"):
            t.add_column(col)
        color = {"onnxmedic": "cyan", "torchlib": "green", "none": "red"}
        for row in result.inventory:
            by = row["translated_by"]
            t.add_row(escape(row["op"]), str(row["count"]), f"[{color[by]}]{by}[/]",
                      escape(row["first_use"] or ""))
        console.print(t)
    if result.used_translations:
        console.print("translated by onnxmedic: " + ", ".join(result.used_translations))
    if verbose and getattr(result, "reasons", None):
        console.print("not applied: " + "; ".join(
            f"{escape(n['what'])} ({escape(n['reason'])})" for n in result.reasons))
    if result.traceback:
        console.print("[red]internal error[/] (traceback in the --report file)")
