"""Package transforms as passes on optimize's pass infrastructure (optimize/pass_infra.py), over
package folders instead of files: any backend's package goes in, read through the contract
(onnxmedic/genpackage.py).

:class:`PackagePass` requires that the contract can feed the input package's decoder a step,
and ensures that the package it writes keeps the input's interface (its decoder's inputs,
outputs and cache, fed the same way): onnxruntime-genai's config and every loop that serves
the package still hold. Whether the transformed package still *computes* what the model does
is the verification's (fuse_decoder.py: token by token against PyTorch; int4_package.py: the
task budget), which runs on what the pass wrote, in the folder :func:`staged` made beside
the output: only a verified package is renamed into place. One pass per module:
fuse_decoder.py's ``FusePass`` (ONNX Runtime's fusions with GroupQueryAttention),
int4_package.py's ``Int4Pass`` (int4_search.py's candidates on the decoder file, the fastest
within the task budget).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onnxmedic.genpackage import NotAStep, read_package
from onnxmedic.onnxfile import staged  # noqa: F401  (the package transforms' scratch folder)
from onnxmedic.optimize.pass_infra import (
    PassBase,
    PassResult,
    PostconditionError,
    PreconditionError,
)


@dataclass
class PackageOutcome:
    """What a package transform returns: ``ok`` when it wrote the package at ``path``, and
    its ``findings`` (why not, or what it wrote)."""

    ok: bool = False
    path: str | None = None
    findings: list[Any] = field(default_factory=list)


def copy_side_files(src: Path, dst: Path, graph: str) -> None:
    """Every file of the package ``src`` but its decoder ``graph`` (and its weights) into
    ``dst``."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file() and not p.name.startswith(graph):
            shutil.copy2(p, dst / p.name)


class PackagePass(PassBase):
    """A pass from one generation package folder to another (see the module docstring)."""

    def requires(self, src: Path) -> None:
        """The contract feeds ``src``'s decoder (PreconditionError with its reason)."""
        try:
            read_package(src).empty_past()
        except (NotAStep, OSError) as e:
            raise PreconditionError(f"{self.name}: {src}: {e}") from e

    def ensures(self, src: Path, result: PassResult) -> None:
        """The written package keeps ``src``'s decoder interface (inputs, outputs, cache) and
        the contract feeds it (PostconditionError); a pass that wrote nothing (``modified``
        False) has nothing to keep."""
        if not result.modified:
            return
        dst = result.path
        try:
            before, after = read_package(src), read_package(dst)
            after.empty_past()
        except (NotAStep, OSError) as e:
            raise PostconditionError(f"{self.name}: no package the contract can feed at "
                                     f"{dst}: {e}") from e
        kept = [(x.inputs, x.outputs, [(c.name, c.present) for c in x.cache])
                for x in (before, after)]
        if kept[0] != kept[1]:
            raise PostconditionError(
                f"{self.name}: the package at {dst} changed its decoder's interface (inputs "
                f"{before.inputs} -> {after.inputs}, outputs {before.outputs} -> "
                f"{after.outputs})")
