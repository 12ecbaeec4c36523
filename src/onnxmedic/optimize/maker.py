"""Building candidates: a :class:`CandidateMaker` runs pipelines (passes.run_pipeline, in the pass
child) into one scratch folder and remembers every file it built there, so that candidates
with the same leading steps share that graph (built once)."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from onnxmedic.optimize.files import save_feeds
from onnxmedic.optimize.passes import Pipeline, run_passes
from onnxmedic.optimize.variant import CHANGED_NOTHING, Variant, Why

NAME_NODES = ("onnxmedic.optimize.fp16:name_nodes", {})


def steps_key(src: Path, steps: list[Any]) -> str:
    """What a built file is remembered by: its source and the steps run on it."""
    return json.dumps([str(src), steps], sort_keys=True, default=str)


class CandidateMaker:
    """Runs pipelines into ``folder`` (each step in the pass child, ``timeout`` each run) and
    keeps what it built: (source, steps) -> (the variant as built, its file)."""

    def __init__(self, folder: Path, timeout: float) -> None:
        self.folder = folder
        self.timeout = timeout
        self.built: dict[str, tuple[Variant, Path]] = {}

    def build(self, pipe: Pipeline, src: Path, suffix: str = "") -> tuple[Variant, Path]:
        """Run ``pipe`` on ``src`` into ``<folder>/<name><suffix>.onnx``: the variant as built
        (rejected when a pass failed or changed nothing; verification later marks it)."""
        path = self.folder / f"{pipe.name}{suffix}.onnx"
        v = Variant(pipe.name, precision=pipe.precision, passes=[s for s, _ in pipe.steps],
                    path=str(path))
        run = run_passes(pipe, src, path, timeout=self.timeout)
        v.steps = run.steps
        for st in run.steps:
            v.fusions.update(st.get("fusions", {}))
            v.nodes = st.get("nodes_after", v.nodes)
        if not run.ok:
            v.reject(Why.PASS_FAILED, f"the pass failed: {run.error}")
        elif not run.modified:  # pass_infra.Sequential: the graph written is the one read
            v.reject(Why.CHANGED_NOTHING, CHANGED_NOTHING)
        self.built[steps_key(src, list(pipe.steps))] = (replace(v), path)
        return v, path

    def prefix(self, base: Pipeline, last: str, src: Path) -> tuple[Variant, Path, int]:
        """Run the steps of ``base`` before its ``last`` step, plus node naming (the
        quantizer's exclusions and the converter's block list are by node name): the graph
        that step will see. Returns the variant so far, that graph's file (``src`` when nothing
        changed) and the index of the ``last`` step. Candidates with the same leading steps
        share that graph (built once)."""
        at = next(i for i, (s, _) in enumerate(base.steps) if s.endswith(last))
        pre_steps = list(base.steps[:at]) + [NAME_NODES]
        key = steps_key(src, pre_steps)
        if key not in self.built:  # build() records it under ``key``; named()'s result here
            self.built[key] = (self.named(base, at, src)
                               or self.build(Pipeline(f"{base.name}-pre", pre_steps), src))
        v, pre = copy.deepcopy(self.built[key][0]), self.built[key][1]
        v.name, v.precision = base.name, base.precision
        v.passes = [s for s, _ in base.steps]
        if v.is_rejected(Why.CHANGED_NOTHING):  # already folded and named
            v.rejection, pre = None, src
        return v, pre, at

    def named(self, base: Pipeline, at: int, src: Path) -> tuple[Variant, Path] | None:
        """The prefix of ``base`` (its steps before ``at``) from the candidate that ran exactly
        those steps already (ort-fusions for ort-fusions-fp16): node naming on its file, not
        the passes again (Llama's fusions took about 12 s on this CPU). None when no candidate
        did, or its passes failed."""
        done = self.built.get(steps_key(src, list(base.steps[:at])))
        if done is None or done[0].rejection and not done[0].is_rejected(Why.CHANGED_NOTHING):
            return None
        first, built = done
        start = src if first.rejection else built
        v, path = self.build(Pipeline(f"{base.name}-pre", [NAME_NODES]), start)
        if v.is_rejected(Why.CHANGED_NOTHING) and start is built:
            v.rejection, path = None, built  # named already, but not src
        v.steps = first.steps + v.steps
        v.fusions, v.nodes = {**first.fusions, **v.fusions}, first.nodes
        v.passes = [s for s, _ in base.steps[:at]] + v.passes
        return v, path

    def feeds_file(self, feeds: list[dict[str, np.ndarray]], name: str = "feeds.npz") -> Path:
        """``feeds`` saved once in the folder (files.save_feeds), for a measuring step."""
        npz = self.folder / name
        if not npz.exists():
            save_feeds(feeds, npz)
        return npz

    def measure(self, step: str, pre: Path, feeds: list[dict[str, np.ndarray]],
                options: dict[str, Any] | None = None) -> tuple[dict[str, Any] | None, str]:
        """Run a measuring step (``module:function(src, dst, feeds=..., **options)``) in the
        pass child: (what it measured, None where it failed; the error)."""
        npz = self.feeds_file(feeds)
        run = run_passes(Pipeline("measure", [(step, {"feeds": str(npz), **(options or {})})]),
                         pre, self.folder / "unused.onnx", timeout=self.timeout, writes=False)
        return (run.steps[0] if run.ok else None), run.error
