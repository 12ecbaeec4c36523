"""The export's stage list, declared once: the stages in order, and the statuses each records
on the result (the keys of ``result.stages``, in the JSON). pipeline.py binds each name to its
function (``EXPORT_STAGES``, in this order); result.py's ``STAGES`` and the architecture page
(tools/gen_architecture_doc.py) read this list.

Each stage lives in this package, in the module named after it (``stages/<name>.py``: the
stage's function and what only it does); the machinery stages share with the other commands
stays in its own packages (capture/ strategies, verify/ the budget and comparison, fixes/ the
fixes, optimize/ the searches). tests/test_architecture.py checks the layout.

A stage that records no status (``output`` and ``plan`` check the request; ``optimize`` is
optional and reports in ``result.optimization``) still runs in its place.
"""

from __future__ import annotations

# (stage, the statuses it records): the verify stage records runtime and compare
EXPORT_STAGE_LIST: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("output", ()),
    ("plan", ()),
    ("preflight", ("preflight",)),
    ("capture", ("capture",)),
    ("translate", ("translate",)),
    ("check", ("check",)),
    ("fix", ("fix",)),
    ("verify", ("runtime", "compare")),
    ("write", ("write",)),
    ("optimize", ()),
)
STAGE_NAMES = tuple(name for name, _ in EXPORT_STAGE_LIST)
# the statuses an ExportResult records, in pipeline order
STATUSES = tuple(status for _, statuses in EXPORT_STAGE_LIST for status in statuses)
