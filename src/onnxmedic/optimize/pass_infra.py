"""optimize's pass infrastructure, modelled on onnx-ir's (``onnx_ir/passes/_pass_infra.py``): a
pass checks what it requires of its input (:meth:`PassBase.requires`), does its work
(:meth:`PassBase.call`) and checks what it ensures of its output (:meth:`PassBase.ensures`); it
returns a :class:`PassResult` saying what it wrote and whether the model changed.

onnx-ir's passes take and return an in-memory ``ir.Model``; optimize's work on files. Every pass
runs in the pass child (passes.run_pipeline), where a crash or a hang is a rejected candidate,
and several of the tools they call (ONNX Runtime's quantizers, its offline optimizer) read and
write files themselves. A pipeline step is a function ``step(src, dst, **options) -> info``
named ``"module:function"`` (:class:`StepPass`); :class:`Sequential` runs steps in order.
"""

from __future__ import annotations

import abc
import importlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onnxmedic.optimize.files import same_graph


class InvariantError(Exception):
    """A pass's precondition or postcondition does not hold."""


class PreconditionError(InvariantError):
    """What a pass requires of its input does not hold."""


class PostconditionError(InvariantError):
    """What a pass ensures of its output does not hold."""


@dataclass(frozen=True)
class PassResult:
    """What a pass wrote (``path``; for a measuring pass, its input), whether the model it wrote
    differs from its input (``modified``) and what it reports (``info``: fused-op and node
    counts, or what it measured)."""

    path: Path
    modified: bool
    info: dict[str, Any] = field(default_factory=dict)


class PassBase(abc.ABC):
    """A pass over an ONNX file. ``writes``: it writes a model (a measuring pass reads its
    input and writes none)."""

    writes: bool = True

    @property
    def name(self) -> str:
        """What the pass is called in reports."""
        return type(self).__name__

    def __call__(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> PassResult:
        """Check the preconditions, run the pass, check the postconditions."""
        self.requires(Path(src))
        result = self.call(Path(src), Path(dst))
        self.ensures(Path(src), result)
        return result

    @abc.abstractmethod
    def call(self, src: Path, dst: Path) -> PassResult:
        """The pass itself: read ``src``, write ``dst`` (a writing pass)."""

    def requires(self, src: Path) -> None:
        """The input exists (PreconditionError otherwise)."""
        if not src.is_file():
            raise PreconditionError(f"{self.name}: its input {src} does not exist")

    def ensures(self, src: Path, result: PassResult) -> None:
        """A writing pass wrote its output (PostconditionError otherwise)."""
        if self.writes and not result.path.is_file():
            raise PostconditionError(f"{self.name}: wrote no model to {result.path}")


class StepPass(PassBase):
    """A pipeline step ``spec`` ("module:function", called as ``function(src, dst, **options)``,
    returning what it did) as a pass. Whether it modified the model is left to the pipeline
    (:class:`Sequential`): comparing graphs after every step would cost a load of each."""

    def __init__(self, spec: str, options: dict[str, Any] | None = None,
                 writes: bool = True) -> None:
        self.spec = spec
        self.options = dict(options or {})
        self.writes = writes

    @property
    def name(self) -> str:
        return self.spec

    def call(self, src: Path, dst: Path) -> PassResult:
        module, _, function = self.spec.partition(":")
        step = getattr(importlib.import_module(module), function)
        info = step(str(src), str(dst), **self.options) or {}
        return PassResult(dst if self.writes else src, self.writes, info)


class Sequential(PassBase):
    """Passes run in order, each on the file the one before wrote (a measuring pipeline: one
    measuring pass). ``modified``: the last file's graph differs from the first's
    (files.same_graph); ``info``: each pass's, in order, under ``"steps"``. ``on_pass``:
    called with each pass's result as it ends (a failure later keeps what came before)."""

    def __init__(self, *passes: PassBase, scratch: Path, on_pass: Any = None) -> None:
        self.passes = passes
        self.scratch = scratch
        self.on_pass = on_pass
        self.writes = all(p.writes for p in passes)

    def call(self, src: Path, dst: Path) -> PassResult:
        path = src
        steps: list[dict[str, Any]] = []
        for i, p in enumerate(self.passes):
            out = dst if i == len(self.passes) - 1 else self.scratch / f"step{i}.onnx"
            result = p(path, out)
            steps.append(result.info)
            if self.on_pass is not None:
                self.on_pass(p, result)
            path = result.path
        modified = self.writes and not same_graph(src, path)
        return PassResult(path, modified, {"steps": steps})
