"""The terminal summary: a stage checklist, the findings, the error table.

Tables fit the console's width without cutting a cell short: on a narrow console (80 columns,
or output piped to a file) the least needed columns are left out, and said so; where even the
fewest do not fit, each row is printed as a block of lines. The JSON and HTML reports always
hold every column.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

_MARK = {"passed": "[green]✔[/]", "failed": "[red]✘[/]", "not run": "[dim]·[/]"}
# the stages whose passing is what "verified" says, the last one present deciding: an export's
# comparison with PyTorch, a generation package's token-by-token generation
_VERIFYING = ("compare", "generate")
_SEV = {"error": "red", "warning": "yellow", "info": "blue"}

# each table's columns, then the ones left out first when the console is too narrow
_VERIFY = ("output", "input set", "shape", "dtype", "max abs", "max rel", "rule",
           "vs PyTorch's own", "status")
_VERIFY_DROP = ("vs PyTorch's own", "rule", "dtype", "shape", "max rel")
_LOCALIZE = ("FX node", "ATen op", "ONNX node", "where", "max abs", "err/tol",
             "inputs' err/tol", "growth")
_LOCALIZE_DROP = ("inputs' err/tol", "max abs", "ONNX node", "growth", "ATen op")
_INVENTORY = ("ATen op", "count", "translated by", "first use")
_INVENTORY_DROP = ("first use",)


def _cell_width(markup: str, longest_word: bool) -> int:
    plain = Text.from_markup(markup).plain
    parts = plain.split() if longest_word else plain.splitlines()
    return max((Text(p).cell_len for p in parts), default=0)


def table_width(columns: tuple[str, ...] | list[str], rows: list[list[str]]) -> int:
    """The console columns a rich table of ``rows`` takes with every cell on one line, except
    the last column's, which may wrap between words (a failure's reason)."""
    total = len(columns) + 1  # the vertical rules
    for i, name in enumerate(columns):
        last = i == len(columns) - 1
        cells = [_cell_width(r[i], longest_word=last) for r in rows]
        header = max(_cell_width(name, longest_word=last), 1)
        total += max([header, *cells]) + 2  # one space of padding on each side
    return total


def fit_columns(columns: tuple[str, ...], rows: list[list[str]], drop: tuple[str, ...],
                width: int) -> list[str] | None:
    """The columns to show at ``width``: all of them, or fewer, leaving out ``drop``'s in order
    until no cell is cut short; None when even the fewest do not fit."""
    shown = list(columns)
    for name in (None, *drop):
        if name is not None:
            shown.remove(name)
        keep = [columns.index(c) for c in shown]
        if table_width(shown, [[r[i] for i in keep] for r in rows]) <= width:
            return shown
    return None


def print_table(console: Console, title: str, columns: tuple[str, ...], rows: list[list[str]],
                drop: tuple[str, ...]) -> None:
    """Print ``rows`` as a table titled ``title`` that fits ``console``'s width without cutting
    a cell short (see :func:`fit_columns`), naming the columns left out; too narrow even for
    the fewest, each row as a line of ``column: value`` pairs."""
    shown = fit_columns(columns, rows, drop, console.width)
    if shown is None:  # too narrow for a table: one block of lines per row
        console.print(title)
        for row in rows:
            console.print("  " + "  ".join(f"{c}: {v}" for c, v in zip(columns, row) if v))
        return
    keep = [columns.index(c) for c in shown]
    t = Table(title=title, title_justify="left")
    for i, name in enumerate(shown):
        t.add_column(name, no_wrap=i < len(shown) - 1)
    for row in rows:
        t.add_row(*[row[i] for i in keep])
    console.print(t)
    left_out = [c for c in columns if c not in shown]
    if left_out:
        console.print(f"[dim](not shown at this width: {', '.join(left_out)}; --report and "
                      "--json have every column)[/]")


def _findings(result: Any, console: Console, verbose: bool) -> None:
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


def _verification_rows(result: Any) -> list[list[str]]:
    rows = []
    for c in result.verification:
        ratio = ("" if getattr(c, "ratio", None) is None else
                 f"{c.ratio:.2g}x (budget {c.budget:g}x)")
        rows.append([escape(c.name), c.input_set, str(c.expected_shape), c.expected_dtype,
                     f"{c.max_abs:.3g}", f"{c.max_rel:.3g}", getattr(c, "rule", ""), ratio,
                     "[green]ok[/]" if c.ok else f"[red]{escape(c.reason)}[/]"])
    return rows


def _localization_rows(loc: Any) -> list[list[str]]:
    return [[escape(n.fx_node), escape(n.aten_op), escape(f"{n.onnx_op} {n.onnx_node}"),
             escape(str(n.location) if n.location else ""), f"{n.max_abs:.3g}",
             f"[red]{n.score:.3g}[/]" if n.exceeds else f"{n.score:.3g}",
             f"{n.input_score:.3g}", f"{n.growth:.3g}"] for n in loc.top]


def _inventory_rows(inventory: list[dict[str, Any]]) -> list[list[str]]:
    color = {"onnxmedic": "cyan", "torchlib": "green", "none": "red"}
    return [[escape(row["op"]), str(row["count"]),
             f"[{color[row['translated_by']]}]{row['translated_by']}[/]",
             escape(row["first_use"] or "")] for row in inventory]


def render_terminal(result: Any, console: Console | None = None, verbose: bool = False) -> None:
    """Print ``result`` for a person: the verdict, the stages, the findings and the tables,
    fitted to the console's width."""
    console = console or Console(stderr=True, soft_wrap=True)
    good, bad = (("reduced", "not reduced") if result.command == "reduce"
                 else ("verified", "not verified"))
    checks = [result.stages.get(s) for s in _VERIFYING if s in result.stages]
    if checks and checks[-1] != "passed":  # --no-verify: written, its last check not run
        good = "written, not verified"
    verdict = (f"[bold green]{good}[/]" if result.ok else f"[bold red]{bad}[/]")
    head = f"onnxmedic {result.command}: {escape(str(result.model))} — {verdict}"
    if result.path and result.ok:
        head += f" → {escape(result.path)}"
    console.print(head)
    console.print("  ".join(f"{_MARK.get(status, status)} {stage}"
                            for stage, status in result.stages.items()))
    _findings(result, console, verbose)
    if result.verification:
        print_table(console, "verification against PyTorch", _VERIFY,
                     _verification_rows(result), _VERIFY_DROP)
    loc = getattr(result, "localization", None)
    if loc is not None and loc.top:
        print_table(console, f"divergence localisation ({loc.input_set}): top nodes by error "
                     "growth", _LOCALIZE, _localization_rows(loc), _LOCALIZE_DROP)
    if getattr(result, "inventory", None):
        print_table(console, "op inventory (after torch.onnx's decompositions)", _INVENTORY,
                     _inventory_rows(result.inventory), _INVENTORY_DROP)
    if result.used_translations:
        console.print("translated by onnxmedic: " + ", ".join(result.used_translations))
    if verbose and getattr(result, "reasons", None):
        console.print("not applied: " + "; ".join(
            f"{escape(n['what'])} ({escape(n['reason'])})" for n in result.reasons))
    if result.traceback:
        console.print("[red]internal error[/] (traceback in the --report file)")
