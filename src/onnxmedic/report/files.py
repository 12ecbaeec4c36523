"""JSON and self-contained HTML reports, written atomically."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import jinja2

from onnxmedic._locate import snippet
from onnxmedic.findings import CODES, error

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("onnxmedic.report", "templates"),
    autoescape=True,  # every user string (module names, paths, exception text) is escaped
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write via a temp file in the same folder and rename: never a half-written file."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write via a temp file in the same folder and rename: never a half-written file."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent or ".")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def render_json(result: Any) -> str:
    return json.dumps(result.to_dict(), indent=2, default=str, allow_nan=True)


def render_template(name: str, **context: Any) -> str:
    """Render one of the package's HTML templates (autoescaped, strict about undefined names)."""
    return _ENV.get_template(name).render(**context)


def render_html(result: Any) -> str:
    data = result.to_dict()
    for f, obj in zip(data["findings"], result.findings):
        f["snippet"] = snippet(obj.location)
        f["exit_code"] = CODES[obj.code].exit_code
    return _ENV.get_template("report.html.j2").render(r=data)


def report_path_problem(path: str | os.PathLike[str]) -> Any:
    """The finding that stops a report from being written at ``path``, or None. Checked before
    the slow stages so that a typo costs nothing; the report is written exactly at ``path``
    (a symlink there is replaced, never followed) with only a same-folder temp file on the way."""
    p = Path(path)
    if p.suffix.lower() not in (".json", ".html", ".htm"):
        return error("OM004", "report", f"report path {str(path)!r} must end in .json or .html.")
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        return error("OM006", "report", f"the folder {str(folder)!r} for the report does not "
                     "exist.", suggestion=f"Create it first (mkdir -p {folder}).")
    if p.is_dir() and not p.is_symlink():
        return error("OM006", "report", f"report path {str(path)!r} is a folder.",
                     suggestion="Give a file name such as report.html.")
    if not os.access(folder, os.W_OK | os.X_OK):
        return error("OM006", "report", f"the folder {str(folder)!r} is not writable.")
    return None


def write_report(result: Any, path: str | os.PathLike[str]) -> None:
    """Write ``result`` as .json or .html (by extension). Failures become a finding (OM006)."""
    p = Path(path)
    suffix = p.suffix.lower()
    bad = report_path_problem(path)
    if bad is not None:
        result.findings.append(bad)
        result.ok = False
        return
    try:
        text = render_json(result) if suffix == ".json" else render_html(result)
        atomic_write_text(p, text)
    except OSError as e:
        result.findings.append(error("OM006", "report", f"cannot write the report {str(path)!r}: "
                                     f"{e.strerror or e}"))
        result.ok = False


__all__ = ["atomic_write_bytes", "atomic_write_text", "render_html", "render_json", "write_report"]
