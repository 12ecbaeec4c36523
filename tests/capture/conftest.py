"""Fixtures shared by the capture tests."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest


@pytest.fixture
def source_frame(tmp_path: Path) -> Callable[..., Any]:
    """``make(src, f_locals=..., f_globals=...)``: a stand-in for the Python frame at line 1 of a
    file holding ``src`` (what capture's guard hooks read: the file, the line and the frame's
    names), for rule tables that judge source snippets without running a model."""

    def make(src: str, f_locals: dict[str, Any] | None = None,
             f_globals: dict[str, Any] | None = None) -> Any:
        path = tmp_path / "m.py"
        path.write_text(src + "\n")
        return SimpleNamespace(f_code=SimpleNamespace(co_filename=str(path)), f_lineno=1,
                               f_locals=f_locals or {}, f_globals=f_globals or {})

    return make
