"""The int8 search: quantize; when the budget fails, keep the layers that lose most to
quantization in float32 and retry (:func:`int8_with_sensitivity`)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from onnxmedic.optimize.int8 import SEARCH_SETS, exclusion_cap, next_count
from onnxmedic.optimize.maker import CandidateMaker
from onnxmedic.optimize.passes import QUANTIZE_STEPS, Pipeline, is_static
from onnxmedic.optimize.variant import NO_CALIBRATION, Variant, Why
from onnxmedic.optimize.verifier import Verifier

logger = logging.getLogger(__name__)

FLOAT_GAINS = "onnxmedic.optimize.int8:float_gains"
LAYER_ERRORS = "onnxmedic.optimize.int8:layer_errors"


def int8_with_sensitivity(base: Pipeline, src: Path, maker: CandidateMaker, verifier: Verifier,
                          max_excluded: int | None = None, search_seconds: float = 600.0,
                          calibration: list[dict[str, np.ndarray]] | None = None
                          ) -> tuple[Variant, Path]:
    """Quantize (``base``'s quantize step: passes.QUANTIZE_STEPS); when the budget fails, keep
    the layers that lose most to quantization (:class:`Ranking`: ranked on the whole model, or
    by their own errors) in float32 and retry - up to ``max_excluded`` layers
    (int8.exclusion_cap: by default a quarter, at least 4, never all) and ``search_seconds``:
    the count the switch search predicts, else 1, 2, 4 ...; when k layers pass and k/2
    failed, the gap is halved until it is one layer or an eighth of k
    (:func:`fewest_excluded`). A failed search reports its all-layers variant (the fastest
    file) with its tries (:func:`search_end`)."""
    deadline = time.monotonic() + search_seconds
    feeds = verifier.feeds
    qstep, qopts = next((s, o) for s, o in base.steps if s.endswith(QUANTIZE_STEPS))
    search = Ranking(qstep, dict(qopts), maker, feeds, calibration, verifier.cosine,
                     max_excluded)
    if not search.step:
        v = Variant(base.name, precision=base.precision, passes=[s for s, _ in base.steps])
        v.reject(Why.NO_CALIBRATION, NO_CALIBRATION)
        return v, src
    suffix = qstep[qstep.index(":"):]
    v, pre, at = maker.prefix(base, suffix, src)
    if v.rejection:
        return v, pre
    pre_steps = list(v.steps)

    def attempt(k: int) -> tuple[Variant, Path, bool]:
        """Quantize with the ``k`` most sensitive layers kept; (variant, file, built)."""
        pipe = Pipeline(base.name, [(s, dict(o, nodes_to_exclude=search.kept(k), **search.extra)
                                     if s.endswith(QUANTIZE_STEPS) else o)
                                    for s, o in base.steps[at:]], precision="int8")
        cv, path = maker.build(pipe, pre, suffix=f"-keep{k}")
        cv.name, cv.passes = base.name, v.passes
        cv.steps = pre_steps + search.report(k) + cv.steps
        if cv.rejection:
            return cv, path, False
        verifier.verify(cv, path)
        return cv, path, True

    k = failed = 0
    tries: list[tuple[int | str, float | None]] = []  # (layers float32, worst cosine): failed
    while True:
        cv, path, built = attempt(k)
        if not built:
            return cv, path
        if cv.verified:
            return fewest_excluded(attempt, failed, k, (cv, path), deadline)
        tries.append((f"{k} (predicted)" if k and k == search.predicted else k,
                      cv.worst_cosine()))
        if not k:  # every layer int8: the fastest file, the one a failed search reports
            first = (cv, path)
            why = search.rank(pre, path, deadline)
            if why is not None:  # no ranking, or no count predicted to reach the budget
                cv.note(why)
                cv.steps[len(pre_steps):len(pre_steps)] = search.report(0)
                return cv, path
        elif k == search.predicted:  # refuted: the layers' own errors rank, from one layer
            why = search.own_errors(pre, cv.worst_cosine())
            if why is not None:
                first[0].note(why)
                return first
            k = 0
        if not k and search.predicted:  # the switch search: one layer fewer failed there
            failed, k = search.predicted - 1, search.predicted
        else:
            nxt = next_count(k, exclusion_cap(len(search.ranking), max_excluded))
            if nxt is None or time.monotonic() > deadline:
                first[0].note(search_end(k, nxt, tries, search_seconds))
                first[0].steps[len(pre_steps):len(pre_steps)] = search.report(0)
                return first
            failed, k = k, nxt
        logger.info("int8 (%s): keeping %d layer(s) in float32: %s", base.name, k,
                    ", ".join(search.kept(k)))


class Ranking:
    """The int8 search's ranking of the layers: how the quantize step ``qstep`` (options
    ``qopts``) measures it, run once after the all-layers try failed, and what it found.
    ``step``: the measuring step ("" where static int8 has no ``calibration``); ``options``:
    its options; ``extra``: options the quantize step needs too (static int8's calibration
    file).

    Dynamic and weight-only int8 rank the layers on the whole model and predict the fewest the
    budget needs (int8.float_gains: one file with each layer switchable between its int8 and
    its float32 node, run on ``feeds``, the verification sets); only that count is built and
    verified. Where no count within the cap is predicted to pass, the search ends without
    building one. A count the verification refutes (a model whose int8 error turns on
    rounding, where the built file and the switch part ways: ONNX Runtime fuses a float32
    layer's bias in the built file, not behind a switch) hands the search to the layers' own
    errors (int8.layer_errors of the step's scheme, from one layer) - as where the switch
    search finds no layer to switch. On torchcde's CDE the switch predicted one layer at
    cosine 0.99923 and the built file gave 0.99900; along the switch's ranking 2, 4 and 8
    layers gave 0.99224, 0.99858 and 0.99753, by own errors 5 layers verify. Static int8
    ranks by int8.static_errors (each layer's own error in the QDQ graph, calibrated on
    ``calibration``)."""

    def __init__(self, qstep: str, qopts: dict[str, Any], maker: CandidateMaker,
                 feeds: list[dict[str, np.ndarray]],
                 calibration: list[dict[str, np.ndarray]] | None, cosine: float,
                 max_excluded: int | None) -> None:
        self.maker = maker
        self.feeds = feeds
        self.ranking: list[tuple[str, float]] = []
        self.found: dict[str, Any] = {}  # the switch search's prediction, for the report
        self.predicted: int | None = None
        self.extra: dict[str, Any] = {}
        self.scheme = {k: qopts[k] for k in ("per_channel", "block_size", "accuracy_level")
                       if k in qopts}
        self.scheme["reduce_range"] = qopts.get("reduce_range", True)  # quantize_int8's
        if not is_static([qstep]):  # on the sets the budget is judged on (see float_gains)
            self.sets = f"{min(len(feeds), SEARCH_SETS)} verification set(s)"
            self.step = FLOAT_GAINS  # measure() gives it the verification sets' file
            self.options: dict[str, Any] = {"cosine": cosine, "max_excluded": max_excluded}
            return
        self.step, self.options = "", {}
        if calibration:
            npz = maker.feeds_file(calibration, "calibration.npz")
            self.extra = {"calibration": str(npz)}
            self.step = "onnxmedic.optimize.int8:static_errors"
            self.options = {"per_channel": qopts.get("per_channel", True), **self.extra}

    def kept(self, k: int) -> list[str]:
        """The ``k`` most sensitive layers."""
        return [n for n, _ in self.ranking[:k]]

    def report(self, k: int) -> list[dict[str, Any]]:
        """The ranking step as reported beside a try with ``k`` layers float32."""
        if not self.ranking:
            return []
        return [{"step": self.step, **{key: o for key, o in self.options.items()
                                       if key not in self.extra},
                 **self.found, "ranking": [[n, e] for n, e in self.ranking[:max(8, k)]]}]

    def rank(self, pre: Path, quantized: Path, deadline: float) -> str | None:
        """Rank the layers of ``pre`` (``quantized``: every layer int8, which failed). None to
        go on; else why the search ends, for the all-layers variant's rejection."""
        options = dict(self.options, quantized=str(quantized))
        if self.step == FLOAT_GAINS:
            options["seconds"] = max(1.0, min(deadline - time.monotonic(),
                                              0.8 * self.maker.timeout))
        measured, err = self.maker.measure(self.step, pre, self.feeds, options)
        if self.step == FLOAT_GAINS and not (measured or {}).get("errors"):
            logger.info("int8: the switch search gave no ranking (%s); ranking by each "
                        "layer's own error", err or "no layer it could switch")
            return self.own_errors(pre)
        if measured is None:
            return f" (measuring the layers' quantization error failed: {err})"
        self.ranking = sorted(measured["errors"].items(), key=lambda kv: -kv[1])
        if not self.ranking:
            return ""
        if self.step != FLOAT_GAINS:
            return None
        self.predicted = measured["predicted"]
        self.found = {"search_sets": self.sets, "predicted": self.predicted,
                      "curve": measured["curve"]}
        return None if self.predicted else predicted_end(measured, self.sets)

    def own_errors(self, pre: Path, refuted: float | None = None) -> str | None:
        """Rank by each layer's own error (int8.layer_errors of the quantize step's scheme):
        where the switch search gave no ranking, or its prediction failed verification (with
        worst cosine ``refuted``: a model whose int8 error turns on rounding, where the built
        file and the switch part ways). As :meth:`rank` returns."""
        if refuted is not None:
            self.found = {"switch_search": {**self.found, "verified_cosine": refuted}}
        self.step, self.options, self.predicted = LAYER_ERRORS, {"scheme": self.scheme}, None
        measured, err = self.maker.measure(self.step, pre, self.feeds, self.options)
        if measured is None:
            return f" (measuring the layers' quantization error failed: {err})"
        self.ranking = sorted(measured["errors"].items(), key=lambda kv: -kv[1])
        return None if self.ranking else ""


def predicted_end(measured: dict[str, Any], sets: str) -> str:
    """Why the switch search (int8.float_gains' result ``measured``, on ``sets``) predicts
    that no count of float32 layers within its cap reaches the budget."""
    curve = ", ".join(f"{int(k)} -> {c:.5f}" for k, c in measured["curve"])
    why = (f"the search ran out of time after {measured['seconds']:.0f} s"
           if measured["stopped"] else f"keeping up to the {measured['cap']} most sensitive "
           "layer(s) in float32 did not reach the budget either")
    return (f" (every layer int8; {why}, predicted on {sets} by one file with each layer "
            f"switchable; worst cosine by layers kept float32: {curve})")


def search_end(k: int, nxt: int | None, tries: list[tuple[int | str, float | None]],
               search_seconds: float) -> str:
    """For the all-layers variant a failed int8 search reports (the fastest file it built, the
    one a looser budget would admit as it is): the search's outcome - up to ``k`` float32
    layers tried (``nxt``: the count it would have tried next, None at its cap) - and how the
    worst cosine moved over its tries: whether more float32 layers would help, or the error
    is spread out."""
    if nxt is None and not k:
        return " (its only layer int8)"
    why = "every layer int8; " + (
        f"keeping up to the {k} most sensitive layer(s) in float32 did not reach the budget "
        "either" if nxt is None else f"sensitivity search stopped after {search_seconds:g} s")
    if len(tries) > 1 and all(c is not None for _, c in tries):
        why += "; worst cosine by layers kept float32: " + ", ".join(
            f"{n} -> {c:.5f}" for n, c in tries)
    return f" ({why})"


def fewest_excluded(attempt: Any, failed: int, passed: int, best: tuple[Variant, Path],
                    deadline: float) -> tuple[Variant, Path]:
    """Between ``failed`` layers in float32 (outside the budget) and ``passed`` (within it),
    halve the gap while it is over one in eight of ``passed`` (and time is left): the verified
    variant with the fewest float32 layers found."""
    while passed - failed > max(1, passed // 8) and time.monotonic() < deadline:
        mid = (failed + passed) // 2
        cv, path, _ = attempt(mid)
        if cv.verified:
            passed, best = mid, (cv, path)
        else:
            failed = mid
    return best


def coverage_hint(calibration: list[dict[str, np.ndarray]],
                  feeds: list[dict[str, np.ndarray]]) -> str:
    """Where the verification sets reach beyond the calibration sets' range (by over 1 % of
    that range) on a float input: static int8 clips what lies outside the calibrated
    activation ranges - say so ("" otherwise)."""
    out = []
    for name, first in feeds[0].items():
        if not np.issubdtype(first.dtype, np.floating) or any(name not in c for c in calibration):
            continue
        clo = min(float(np.min(c[name])) for c in calibration)
        chi = max(float(np.max(c[name])) for c in calibration)
        vlo = min(float(np.min(f[name])) for f in feeds if name in f)
        vhi = max(float(np.max(f[name])) for f in feeds if name in f)
        slack = 0.01 * max(chi - clo, 1e-12)
        if vlo < clo - slack or vhi > chi + slack:
            out.append(f"{name}: [{vlo:.3g}, {vhi:.3g}] against [{clo:.3g}, {chi:.3g}]")
    if not out:
        return ""
    return ("; the verification inputs reach beyond the calibration sets' range ("
            + "; ".join(out[:4]) + "): static int8 clips activations outside the calibrated "
            "ranges - calibrate on sets that cover the inputs the model will see")
