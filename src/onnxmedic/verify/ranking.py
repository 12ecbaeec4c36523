"""Integer outputs selected by ranking float values, judged against the model's float64 run.

A top-k's indices, an argmax, an NMS's kept indices (and labels gathered by them) are integers,
compared exactly - but which index wins among near-equal float values depends on float32
rounding. Where PyTorch's own float32 ranking already differs from the float64 run's (near ties
flipped), an exact comparison would hold ONNX Runtime to a result PyTorch itself does not get
right. So, as the float64 budget does for float outputs, :func:`rejudge_rankings` judges such an
output against the float64 result, and ONNX Runtime passes when it is no further from it than
PyTorch's float32 result is:

- a selection (``TopK``, ``NonMaxSuppression`` among the nodes computing it): the items picked,
  as a multiset - no more items the float64 run does not pick (exchanged at the cut) than
  PyTorch's float32 picks; their order among ties is not judged;
- a choice per element (``ArgMax``, ``ArgMin``): differing from the float64 result at no more
  elements, and with no more values it does not hold, than PyTorch's float32 result.

Outputs no ranking op computes, and outputs whose float32 result equals the float64 one (always
so for an exact integer computation), stay exact: every difference is a mismatch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from onnxmedic.verify.detections import (
    RULE_DETECTIONS,
    RULE_DETECTIONS_F64,
    RULE_DETECTIONS_TIE,
    computed_from,
)

logger = logging.getLogger(__name__)

# a selection of items (their order among ties arbitrary) and a choice per row
SELECTION_OPS = frozenset({"TopK", "NonMaxSuppression"})
CHOICE_OPS = frozenset({"ArgMax", "ArgMin"})
RULE_RANKING_F64 = "ranking, within PyTorch's float32 error against float64"


def ranked_outputs(proto: Any, n: int) -> list[str | None]:
    """Per graph output of the ONNX model ``proto``, how a ranking computes it: ``"order"``
    where an ArgMax/ArgMin is among the nodes computing it (each element a choice), else
    ``"set"`` where a TopK/NonMaxSuppression is (the items picked), else None."""
    try:
        order = computed_from(proto.graph, CHOICE_OPS)
        picked = computed_from(proto.graph, SELECTION_OPS)
        kinds = [("order" if o.name in order else "set" if o.name in picked else None)
                 for o in list(proto.graph.output)[:n]]
    except AttributeError:  # no ONNX graph to read: nothing is judged by this rule
        kinds = []
    return kinds + [None] * (n - len(kinds))


def _differing(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.count_nonzero(a != b))


def _not_in(a: np.ndarray, b: np.ndarray) -> int:
    """How many of ``a``'s values (a multiset) ``b`` does not hold: the indices one selection
    picked that the other did not."""
    va, ca = np.unique(a, return_counts=True)
    vb, cb = np.unique(b, return_counts=True)
    held = dict(zip(vb.tolist(), cb.tolist()))
    return int(sum(max(0, c - held.get(v, 0)) for v, c in zip(va.tolist(), ca.tolist())))


def rejudge_rankings(expected: list[np.ndarray], actual: list[Any], comps: list[Any],
                     ranked: list[str | None], reference: Callable[[], list[Any] | None] | None
                     ) -> None:
    """Rejudge the failing integer outputs computed by ranking (``ranked``:
    :func:`ranked_outputs`) against the float64 outputs (``reference()``, asked only when
    there is one): accepted, ``comps`` updated in place, where PyTorch's float32 result
    differs from the float64 one and ONNX Runtime's does no more - picks no more items the
    float64 run does not, and for a choice per element (``"order"``) differs at no more
    elements."""
    todo = [k for k, c in enumerate(comps)
            if not c.ok and k < len(ranked) and ranked[k] and k < len(actual)
            and actual[k] is not None and c.rule not in (RULE_DETECTIONS, RULE_DETECTIONS_F64, RULE_DETECTIONS_TIE)
            and np.asarray(expected[k]).dtype.kind in "iu"
            and np.shape(actual[k]) == np.shape(expected[k])]
    if not todo or reference is None:
        return
    refs = reference()
    if not refs:
        return
    for k in todo:
        if k >= len(refs) or refs[k] is None or np.shape(refs[k]) != np.shape(expected[k]):
            continue
        ref = np.asarray(refs[k])
        exp, act = np.asarray(expected[k]), np.asarray(actual[k])
        torch_off, onnx_off = _differing(exp, ref), _differing(act, ref)
        torch_out, onnx_out = _not_in(exp, ref), _not_in(act, ref)
        logger.info("%s: against float64, PyTorch's float32 ranking differs at %d elements "
                    "and picks %d others, ONNX Runtime's at %d and %d", comps[k].name,
                    torch_off, torch_out, onnx_off, onnx_out)
        if torch_off and onnx_out <= torch_out and (ranked[k] == "set" or
                                                    onnx_off <= torch_off):
            c = comps[k]
            c.ok, c.rule, c.reason = True, RULE_RANKING_F64, ""
            c.torch_error, c.onnx_error = float(torch_off), float(onnx_off)
