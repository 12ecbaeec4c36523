"""How every candidate is judged: :class:`Verifier` holds what it is judged with (the file's
output names, the input sets, PyTorch's outputs and float64 references, the cosine budget, the
timeout and the target) and runs a file in the sandbox to judge it.

float32 variants are judged like the export itself (verify/budget.py: float32 agreement, else
the float64 budget with the references, else the scaled normwise rule); reduced precision by
the cosine budget (:func:`judge_reduced`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from onnxmedic import sandbox
from onnxmedic.optimize.int8 import cosine as cosine_of
from onnxmedic.optimize.variant import DEFAULT_COSINE, OUTSIDE_BUDGET, REFUSED, Variant, Why
from onnxmedic.verify.budget import RULE_PENDING, judge_output
from onnxmedic.verify.compare import compare_outputs


def judge_reduced(names: list[str], expected: list[list[np.ndarray]],
                  actual: list[list[np.ndarray]], cosine: float = DEFAULT_COSINE
                  ) -> tuple[bool, dict[str, dict[str, float]], str]:
    """The reduced-precision budget: per output, the worst cosine similarity over the input sets
    must be >= ``cosine``; max/mean absolute error reported; for outputs whose last axis looks
    like class scores (float, >= 2 wide), argmax agreement is reported - not judged: hidden
    states are >= 2 wide too, and the argmax of near-equal features flips under any rounding."""
    acc: dict[str, dict[str, float]] = {}
    why = ""
    for s, (exp, act) in enumerate(zip(expected, actual)):
        for i, e in enumerate(exp):
            name = names[i] if i < len(names) else f"output_{i}"
            a = act[i] if i < len(act) else None
            m = acc.setdefault(name, {"cosine": 1.0, "max_abs": 0.0, "mean_abs": 0.0})
            if a is None or np.shape(a) != np.shape(e):
                m["cosine"] = 0.0
                why = why or f"{name}: shape {np.shape(a)} != {np.shape(e)} at set {s}"
                continue
            if not np.issubdtype(np.asarray(e).dtype, np.floating):
                if not np.array_equal(a, e):
                    m["cosine"] = 0.0
                    why = why or f"{name}: integer output differs at set {s}"
                continue
            bad = ~np.isfinite(np.asarray(a)) & np.isfinite(np.asarray(e))
            if bad.any():  # inf/nan where PyTorch has numbers: cosine is undefined
                m["cosine"] = 0.0
                m["nonfinite"] = max(m.get("nonfinite", 0), int(bad.sum()))
                why = why or (f"{name}: {int(bad.sum())} non-finite value(s) where PyTorch's "
                              f"are finite at set {s}")
                continue
            d = np.abs(np.asarray(a, np.float64) - np.asarray(e, np.float64))
            m["cosine"] = min(m["cosine"], cosine_of(e, a))
            m["max_abs"] = max(m["max_abs"], float(d.max()) if d.size else 0.0)
            m["mean_abs"] = max(m["mean_abs"], float(d.mean()) if d.size else 0.0)
            if np.ndim(e) >= 2 and np.shape(e)[-1] >= 2:
                agree = float(np.mean(np.argmax(e, -1) == np.argmax(a, -1)))
                m["argmax_agreement"] = min(m.get("argmax_agreement", 1.0), agree)
    for name, m in acc.items():
        if not m["cosine"] >= cosine:  # nan fails too
            why = why or f"{name}: cosine {m['cosine']:.6f} < {cosine:g}"
    return not why, acc, why


def budget_judge(refs: list[np.ndarray | None], label: str) -> Any:
    """compare_outputs' judge for one input set: verify/budget.py's fast float32 rule, the
    float64 references ``refs`` (by output) where it cannot decide."""
    def one(name: str, exp: np.ndarray, act: np.ndarray | None, i: int) -> Any:
        c = judge_output(name, exp, act, None, input_set=label, fast=True)
        if c.rule == RULE_PENDING:
            c = judge_output(name, exp, act, refs[i] if i < len(refs) else None,
                             input_set=label)
        return c
    return one


@dataclass
class Verifier:
    """What every candidate is judged with: the file's output ``names``, the input sets
    (``feeds``; ``feeds[0]`` is the example), PyTorch's outputs per set (``expected``), the
    float64 ``references`` per set (the float32 budget; None: none), the reduced-precision
    budget (``cosine``), the sandbox's ``timeout`` and the ``target`` whose providers run it
    (a CUDA session computes float32 without TF32, as PyTorch does)."""

    names: list[str]
    feeds: list[dict[str, np.ndarray]]
    expected: list[list[np.ndarray]]
    cosine: float = DEFAULT_COSINE
    timeout: float = 600.0
    references: list[list[np.ndarray | None]] | None = None
    target: str = "cpu"

    def verify(self, variant: Variant, path: Path) -> list[str]:
        """Run ``path`` on every input set and judge it (:meth:`judge`); a file ONNX Runtime
        refuses rejects ``variant``. Returns the providers the session used."""
        sbx = sandbox.run_model(path, self.feeds, timeout=self.timeout,
                                providers=sandbox.providers(self.target))
        if not sbx.ok:
            variant.reject(Why.REFUSED, f"{REFUSED} ({sbx.summary()[:200]})")
            return sbx.providers
        self.judge(variant, sbx.outputs)
        return sbx.providers

    def judge(self, variant: Variant, actual: list[list[np.ndarray]]) -> None:
        """Judge ``actual`` (per input set, the first ``len(actual)`` sets) by the variant's
        precision's rule: sets ``verified``, ``accuracy`` and, when it fails, the rejection."""
        expected = self.expected[:len(actual)]
        references = self.references[:len(actual)] if self.references else None
        if variant.precision == "fp32":
            acc: dict[str, dict[str, float]] = {}
            bad = ""
            for s, (exp, act) in enumerate(zip(expected, actual)):
                refs = references[s] if references and s < len(references) else []
                for c in compare_outputs(self.names, exp, act, input_set=f"set {s}",
                                         judge=budget_judge(refs, f"set {s}")):
                    m = acc.setdefault(c.name, {"max_abs": 0.0, "max_rel": 0.0})
                    m["max_abs"] = max(m["max_abs"], c.max_abs)
                    m["max_rel"] = max(m["max_rel"], c.max_rel)
                    if not c.ok and not bad:
                        bad = (f"{c.name} at {c.input_set}: {c.reason or ''} max abs error "
                               f"{c.max_abs:.3g} ({c.rule})")
            variant.accuracy = acc
            if bad:
                variant.reject(Why.FAILED_VERIFICATION, f"failed verification: {bad}")
                return
        else:
            ok, acc, why = judge_reduced(self.names, expected, actual, self.cosine)
            variant.accuracy = acc
            if not ok:
                variant.reject(Why.OUTSIDE_BUDGET, f"{OUTSIDE_BUDGET}: {why}",
                               cosine=variant.worst_cosine(), budget=self.cosine)
                return
        variant.verified = True
