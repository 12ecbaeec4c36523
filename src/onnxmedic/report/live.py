"""A live line on stderr while a long command runs: what it is doing and the time elapsed (a
silent multi-minute command looks hung). Shown on a terminal; ``--no-progress`` turns it off."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def live_line(description: str, enabled: bool, console: Any = None
              ) -> Iterator[Callable[[str], None] | None]:
    """A spinner, ``description`` and the time elapsed on stderr (``console``: rich's, for
    tests) while the block runs, gone when it ends. Yields a callable that replaces the
    description, or None when not ``enabled``. What the block prints on stdout goes around the
    line when stdout is the same terminal, and straight to stdout otherwise."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console or Console(stderr=True), transient=True,
                  redirect_stdout=sys.stdout.isatty(), redirect_stderr=False) as bar:
        task = bar.add_task(description, total=None)
        yield lambda text: bar.update(task, description=text)
