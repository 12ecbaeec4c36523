"""Package transforms as passes on optimize's pass infrastructure (optimize/pass_infra.py), over
package folders instead of files: any backend's package goes in, read through the contract
(onnxmedic/genpackage.py).

:class:`PackagePass` requires that the contract can feed the input package's decoder a step,
and ensures that the package it writes keeps the input's interface (its decoder's inputs,
outputs and cache, fed the same way): onnxruntime-genai's config and every loop that serves
the package still hold. Whether the transformed package still *computes* what the model does
is the verification's (fuse_decoder.py: token by token against PyTorch; int4_package.py: the
task budget), which runs on what the pass wrote. One pass per module: fuse_decoder.py's
``FusePass`` is ONNX Runtime's fusions with GroupQueryAttention. int4's candidates are
passes of optimize's pipeline on the decoder file (int4_search.py: the quantize step with
the shared 4-bit embedding); int4_package.py checks the package it assembles with
:func:`interface_change`, as :class:`PackagePass` does.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from onnxmedic.genpackage import NotAStep, StepLayout, read_package
from onnxmedic.optimize.pass_infra import (
    PassBase,
    PassResult,
    PostconditionError,
    PreconditionError,
)


def copy_side_files(src: Path, dst: Path, graph: str) -> None:
    """Every file of the package ``src`` but its decoder ``graph`` (and its weights) into
    ``dst``."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file() and not p.name.startswith(graph):
            shutil.copy2(p, dst / p.name)


def _interface(layout: StepLayout) -> tuple[Any, ...]:
    return (layout.inputs, layout.outputs, [(c.name, c.present) for c in layout.cache])


class PackagePass(PassBase):
    """A pass from one generation package folder to another (see the module docstring)."""

    def requires(self, src: Path) -> None:
        """The contract feeds ``src``'s decoder (PreconditionError with its reason)."""
        try:
            read_package(src).empty_past()
        except (NotAStep, OSError) as e:
            raise PreconditionError(f"{self.name}: {src}: {e}") from e

    def ensures(self, src: Path, result: PassResult) -> None:
        """The written package keeps ``src``'s interface and can be fed (PostconditionError)."""
        why = interface_change(src, result.path)
        if why is not None:
            raise PostconditionError(f"{self.name}: {why}")


def interface_change(src: Path, dst: Path) -> str | None:
    """Why the package ``dst`` does not serve as ``src`` does (its decoder's inputs, outputs
    or cache differ, or the contract cannot feed it); None when it does."""
    try:
        before, after = read_package(src), read_package(dst)
        after.empty_past()
    except (NotAStep, OSError) as e:
        return f"no package the contract can feed at {dst}: {e}"
    if _interface(before) != _interface(after):
        return (f"the package at {dst} changed its decoder's interface (inputs "
                f"{before.inputs} -> {after.inputs}, outputs {before.outputs} -> "
                f"{after.outputs})")
    return None
