"""The float16 search: a measured block list (fp16.block_list), fill values left to saturate
where that verifies, and the nodes that amplify float16's error kept float32 where the budget
still fails (:func:`fp16_with_block_list`)."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

from onnxmedic import sandbox
from onnxmedic.findings import listed
from onnxmedic.optimize import fp16
from onnxmedic.optimize.int8 import next_count
from onnxmedic.optimize.maker import CandidateMaker
from onnxmedic.optimize.passes import Pipeline
from onnxmedic.optimize.variant import Variant, Why
from onnxmedic.optimize.verifier import Verifier

logger = logging.getLogger(__name__)

RANGE_STATS = "onnxmedic.optimize.fp16:range_stats"
AMPLIFIERS = "onnxmedic.optimize.fp16:amplifiers"


def fp16_with_block_list(base: Pipeline, src: Path, maker: CandidateMaker, verifier: Verifier
                         ) -> tuple[Variant, Path]:
    """The steps before the float16 step (and node naming) run first; the float32 values of
    that graph are measured on every feed (fp16.range_stats, in the pass child); the nodes that
    compute or read a value float16 cannot hold stay float32 (fp16.block_list); then float16.
    Values that overflow only in fill values (an attention mask's finfo.min: keeping them
    float32 keeps every fused attention reading the mask in float32) are first left in
    float16 to saturate (fp16.saturated); where that variant is not verified, the strict
    block list is built instead and says why (``saturation_rejected``)."""
    v, pre, at = maker.prefix(base, ":float16", src)
    if v.rejection:
        return v, pre
    measured, err = maker.measure(RANGE_STATS, pre, verifier.feeds)
    if measured is None:
        v.reject(Why.MEASURING_FAILED, f"measuring float32 ranges failed: {err}")
        return v, pre
    values = measured["values"]

    def convert(blocked: dict[str, str], suffix: str) -> tuple[Variant, Path]:
        cv = copy.deepcopy(v)
        cv.blocked = blocked
        if blocked:
            logger.info("fp16 (%s): keeping %d node(s) in float32: %s", base.name,
                        len(blocked), ", ".join(blocked))
        conv = Pipeline(base.name, [(s, dict(o, node_block_list=sorted(blocked)))
                                    for s, o in base.steps[at:]], precision="fp16")
        built, path = maker.build(conv, pre, suffix=suffix)
        cv.steps += built.steps
        cv.fusions.update(built.fusions)
        cv.nodes, cv.rejection, cv.path = built.nodes, built.rejection, built.path
        if not cv.rejection:
            verifier.verify(cv, path)
        return cv, path

    strict = fp16.block_list(pre, values)
    fills = fp16.saturated(values)
    lean = fp16.block_list(pre, values, saturate=True) if fills else strict
    if lean == strict:
        cv, path = convert(strict, "")
    else:
        sv, spath = convert(lean, "-saturated")
        sv.saturated = fills
        if sv.verified:
            return sv, spath
        cv, path = convert(strict, "")
        assert sv.rejection is not None
        cv.saturation_rejection = sv.rejection.prefixed(
            sv.rejection.kind, f"leaving {listed(sv.saturated, 4)} in float16 to saturate "
                               "was rejected: ")
    if cv.is_rejected(Why.OUTSIDE_BUDGET):
        return keep_amplifiers(cv, path, pre, convert, maker, verifier)
    return cv, path


def keep_amplifiers(failed: Variant, path: Path, pre: Path, convert: Any, maker: CandidateMaker,
                    verifier: Verifier) -> tuple[Variant, Path]:
    """The float16 block list's second rule, where ``failed`` (its file ``path``, built from
    ``pre`` by ``convert(blocked, suffix)``) is outside the budget: rank the nodes that add
    most error in float16 (fp16.amplifiers, in the pass child on the target's providers, on
    the verification sets) and keep the top 1, 2, 4 ... float32 with what they read from,
    each try built and verified. Returns the first try verified; else ``failed``, its
    rejection saying what the search tried."""
    measured, err = maker.measure(AMPLIFIERS, pre, verifier.feeds,
                                    {"float16": str(path),
                                     "providers": sandbox.providers(verifier.target)})
    if measured is None:
        failed.note(f" (measuring where float16 adds error failed: {err})")
        return failed, path
    ranked = measured["ranked"]
    if not ranked:
        failed.note(f" (no node adds float16 error of {fp16.ADDED_MIN:g} or more to "
                    "its inputs': no float32 node would help)")
        return failed, path
    report = {"step": AMPLIFIERS, "seconds": measured["seconds"],
              "ranked": [[e["node"], e["added"]] for e in ranked], "tries": []}
    blocked, k = dict(failed.blocked), 0
    while (k := next_count(k, len(ranked))) is not None:
        for e in ranked[:k]:
            blocked.setdefault(e["node"], (
                f"adds float16 error: its output is {e['output_err']:.2g} off (relative), "
                f"its inputs {e['input_err']:.2g}"))
            for name in e["keep"][1:]:
                blocked.setdefault(name, f"feeds {e['node']}, which amplifies float16's error")
        cv, cpath = convert(dict(blocked), f"-amplified{k}")
        report["tries"].append([k, len(blocked), cv.worst_cosine()])
        cv.steps.append({**report, "tries": list(report["tries"])})
        cv.saturation_rejection = failed.saturation_rejection
        if cv.verified:
            break
    if cv.verified:
        return cv, cpath
    curve = ", ".join(f"{n} -> {c:.5f}" if c is not None else f"{n} -> not judged"
                      for _, n, c in report["tries"])
    failed.note(f" (keeping float32 up to the {len(ranked)} node(s) that add most "
                f"float16 error, with what they read from, did not reach the budget "
                f"either; worst cosine by nodes kept float32: {curve})")
    failed.steps.append(report)
    return failed, path
