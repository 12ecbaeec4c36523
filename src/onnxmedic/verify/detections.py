"""Comparing detection sets: (boxes [N, 4], scores [N], labels [N]) from PyTorch and ONNX Runtime.

A detector's outputs are sets, not arrays: the count depends on the data, and boxes whose scores
are equal (or equal within float32 rounding) may come out in either order. Comparing them
element by element raises false alarms; comparing them as sets still has to catch a wrong box, a
dropped box and a wrong class. :func:`compare_detections` matches each expected detection to an
actual one of the same class with the highest IoU, requires the matched boxes' corners and
scores to agree within the budget, and names every detection left over:

- OM613 a detection PyTorch makes and ONNX Runtime drops;
- OM614 a detection ONNX Runtime makes and PyTorch does not;
- OM615 a detection found with a different class;
- OM616 a detection of the right class whose box is elsewhere (IoU below the match threshold, or
  corners outside the budget);
- OM617 a matched detection whose score is outside the budget;
- OM618 the outputs are not a detection set (shapes that disagree);
- OM619 an output with a row per detection (Mask R-CNN's masks, Keypoint R-CNN's keypoints)
  differs for a matched pair.

Ties are tolerated: a detection left over whose class and score another detection on its side
shares (a tie group) may be exchanged for one of the same class and score on the other side -
which of several tied boxes survive top-k and NMS depends on the order a kernel visits equal
scores (torch's topk does not promise one; ONNX's TopK takes the lower index), so a tied box is
checked by its group's count, not by its place. A moved box, a dropped box or a wrong class in
a group of one is still a finding. Ties at the cut too: where a postprocess keeps the top k of a set, boxes whose scores
equal the lowest kept score (within the budget), a score that other kept boxes share, may be
exchanged for others of that score on the other side, as many dropped as added. Anything else
left over is a finding.

The float64-anchored budget, for sets: where the sets differ and the model's float64 run is at
hand, ONNX Runtime's set is judged against the float64 set instead (:func:`within_float32_noise`),
within float32's reach as PyTorch's float32 set shows it. Its detections kept (paired with float64
ones by class and IoU) set how far float32 moves a box or a score (:func:`float32_budget`: ten
times their largest difference, as the float budget, at most ten budgets); beyond that, ONNX
Runtime may leave no more float64 detections unmatched and no more of its own over than PyTorch's
set does, only at or below the best score PyTorch's leaves over (:func:`unstable_top`: near-equal
scores flipped by rounding at a top-k or NMS exchange detections there, and none above), and no
more per-detection rows outside the budget. Where PyTorch's set agrees with the float64 one, ONNX
Runtime's must agree with it too, every detection within the budget: the two float32 sets may
then be up to twice the budget apart, each rounded to its own side of the float64 value (a deep
box head: PyTorch's score 0.46890 and ONNX Runtime's 0.46901 around the float64 0.46898), while a
dropped, moved, extra or relabelled box is a finding as it is against PyTorch's set.

A near tie upstream: where the float64 judgement fails too, a TopK inside the model (an RPN's
pre-NMS top-n) may have broken a near tie otherwise than the float64 run while PyTorch's float32
run happened to break it as float64 does, so that nothing in the outputs shows float32 to be
unstable. verify/upstream.py looks for that in the program: the TopK's exchanged items within
float32's reach of the float64 cut, and ONNX Runtime's detections, run again with the TopK
picking as float64 does, agreeing by the rules above. Only then is the set verified (OM621
names the node); a fault anywhere else is in that run too, and still found.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onnxmedic.findings import Finding, error
from onnxmedic.verify.budget import BUDGET

logger = logging.getLogger(__name__)
STAGE = "compare"


@dataclass(frozen=True)
class DetectionBudget:
    """How close matched detections must be. ``rtol``/``atol`` for the box corners and scores,
    relative to the set's coordinate scale (the largest |corner|, at least 1) and to 1;
    ``min_iou``: a pair of the same class below it is not the same box."""

    box_rtol: float = 1e-4
    score_atol: float = 1e-4
    min_iou: float = 0.5


@dataclass
class DetectionComparison:
    """What matched and what did not; ``findings`` is empty when the sets agree."""

    matched: int = 0
    expected: int = 0
    actual: int = 0
    tied: int = 0  # exchanged within a group of equal class and score (tolerated)
    tied_at_cut: int = 0  # exchanged among equal scores at the cut (tolerated)
    # judged against the float64 set: PyTorch's float32 set differs from it at least as much
    within_float32: bool = False
    # and that only with a near-tied TopK upstream picking as float64 does (verify/upstream.py)
    upstream_tie: bool = False
    max_box_error: float = 0.0
    max_score_error: float = 0.0
    findings: list[Finding] = field(default_factory=list)
    # (expected, actual) index of each matched detection
    pairs: list[tuple[int, int]] = field(default_factory=list)
    # the detections left over, ties tolerated: expected ones unmatched, actual ones extra
    missing: list[int] = field(default_factory=list)
    extra: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    def disagreement(self) -> tuple[int, int, int]:
        """(expected detections left unmatched, actual detections left over, per-detection
        row findings): how far one set is from the other, ties tolerated."""
        paired = self.matched + self.tied + self.tied_at_cut
        rows = sum(f.code == "OM619" for f in self.findings)
        return (self.expected - paired, self.actual - paired, rows)


def _area(boxes: np.ndarray) -> np.ndarray:
    """Areas of (x1, y1, x2, y2) boxes, 0 for reversed corners."""
    return np.clip(boxes[:, 2] - boxes[:, 0], 0, None) * np.clip(boxes[:, 3] - boxes[:, 1], 0,
                                                                   None)


def _iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU [len(a), len(b)] of (x1, y1, x2, y2) boxes; 0 where there is no union."""
    area_a, area_b = _area(a), _area(b)
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    wh = np.clip(rb - lt, 0, None)
    inter = wh[..., 0] * wh[..., 1]
    union = area_a[:, None] + area_b[None, :] - inter
    same = np.all(a[:, None, :] == b[None, :, :], axis=-1)  # also a zero-area box is itself
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(same, 1.0, np.where(union > 0, inter / union, 0.0))


def _malformed(boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray, side: str
               ) -> str | None:
    if boxes.ndim != 2 or boxes.shape[1] != 4:
        return f"{side} boxes have shape {list(boxes.shape)}, not [N, 4]"
    if scores.shape != (boxes.shape[0],) or labels.shape != (boxes.shape[0],):
        return (f"{side} boxes {list(boxes.shape)}, scores {list(scores.shape)} and labels "
                f"{list(labels.shape)} do not describe one set of N detections")
    return None


def _describe(i: int, boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray) -> str:
    b = ", ".join(f"{v:.4g}" for v in boxes[i])
    return f"#{i} class {int(labels[i])} score {float(scores[i]):.4g} box [{b}]"


def _match(exp: tuple[np.ndarray, ...], act: tuple[np.ndarray, ...], budget: DetectionBudget,
           scale: float, out: DetectionComparison) -> tuple[list[int], list[int]]:
    """Greedy matching by decreasing expected score: the same class, the highest IoU, corners
    and score within the budget. Returns the unmatched expected and actual indices."""
    (eb, es, el), (ab, as_, al) = exp, act
    iou = _iou(eb, ab) if len(eb) and len(ab) else np.zeros((len(eb), len(ab)))
    free = np.ones(len(ab), dtype=bool)
    missing = []
    # a box clipped flat at the image's edge (zero area: FCOS, RetinaNet) has no IoU with a
    # copy one rounding away; its corners within the budget (below) are what match it
    flat_a, flat_e = _area(ab) == 0, _area(eb) == 0
    for i in np.argsort(-es, kind="stable"):
        ok = free & (al == el[i]) & ((iou[i] >= budget.min_iou) | flat_a | flat_e[i])
        corner = np.abs(ab - eb[i]).max(axis=1) if len(ab) else np.zeros(0)
        close = ok & (corner <= budget.box_rtol * scale) & \
            (np.abs(as_ - es[i]) <= budget.score_atol)
        pick = close if close.any() else np.zeros_like(close)
        if not pick.any():
            missing.append(int(i))
            continue
        j = int(np.argmax(np.where(pick, iou[i], -1.0)))
        free[j] = False
        out.matched += 1
        out.pairs.append((int(i), j))
        out.max_box_error = max(out.max_box_error, float(corner[j]))
        out.max_score_error = max(out.max_score_error, float(abs(as_[j] - es[i])))
    return missing, [int(j) for j in np.flatnonzero(free)]


def _tied_pairs(missing: list[int], extra: list[int], exp: tuple[np.ndarray, ...],
                act: tuple[np.ndarray, ...], budget: DetectionBudget
                ) -> tuple[list[int], list[int], int]:
    """Pair leftovers that belong to a tie: the same class and score as another detection on
    their own side. Among tied boxes, which survive a top-k or NMS depends on the order the
    kernel visits equal scores, so a tied box is checked by its group's count, not its place.
    Returns the leftovers still unpaired and the number of pairs."""
    (_, es, el), (_, as_, al) = exp, act

    def tied(scores: np.ndarray, labels: np.ndarray, k: int) -> bool:
        same = (labels == labels[k]) & (np.abs(scores - scores[k]) <= budget.score_atol)
        return int(same.sum()) >= 2

    free = [j for j in extra if tied(as_, al, j)]
    left, pairs = [], 0
    for i in missing:
        j = next((j for j in free if al[j] == el[i] and
                  abs(as_[j] - es[i]) <= budget.score_atol), None)
        if j is None or not tied(es, el, i):
            left.append(i)
            continue
        free.remove(j)
        pairs += 1
    paired = set(j for j in extra if tied(as_, al, j)) - set(free)
    return left, [j for j in extra if j not in paired], pairs


def _at_cut(missing: list[int], extra: list[int], es: np.ndarray, as_: np.ndarray,
            budget: DetectionBudget) -> bool:
    """Whether every leftover on both sides scores the lowest kept score, as many on each
    side, and that score is tied: another detection on each side has it too (a top-k cut
    among equal scores, not one box exchanged for another). A set tied throughout (every
    score equal: a detector with fresh weights) may so be exchanged whole."""
    if len(missing) != len(extra) or not missing:
        return False
    cut = min(float(es.min()), float(as_.min()))
    at_e = np.abs(es - cut) <= budget.score_atol
    at_a = np.abs(as_ - cut) <= budget.score_atol
    return bool(at_e[missing].all() and at_a[extra].all() and
                at_e.sum() >= 2 and at_a.sum() >= 2)


def _leftovers(exp: tuple[np.ndarray, ...], act: tuple[np.ndarray, ...], missing: list[int],
               extra: list[int], budget: DetectionBudget, scale: float, name: str
               ) -> list[Finding]:
    """A finding per leftover: wrong class, moved box or wrong score where an actual leftover
    explains an expected one, else dropped; actual leftovers nothing explains are extra."""
    (eb, es, el), (ab, as_, al) = exp, act
    found: list[Finding] = []
    iou = _iou(eb, ab) if len(eb) and len(ab) else np.zeros((len(eb), len(ab)))
    used: set[int] = set()
    for i in missing:
        cands = [j for j in extra if j not in used]
        best = max(cands, key=lambda j: iou[i, j], default=None)
        want = _describe(i, eb, es, el)
        if best is not None and iou[i, best] >= budget.min_iou and al[best] != el[i]:
            code, what = "OM615", "found with another class"
        elif best is not None and al[best] == el[i] and iou[i, best] >= budget.min_iou and \
                np.abs(ab[best] - eb[i]).max() <= budget.box_rtol * scale:
            code, what = "OM617", "found with a score outside the budget"
        elif best is not None and al[best] == el[i] and iou[i, best] > 0:
            code, what = "OM616", "found with its box elsewhere"
        else:
            code, what, best = "OM613", "dropped by ONNX Runtime", None
        if best is not None:
            used.add(best)
            what += f": {_describe(best, ab, as_, al)} (IoU {iou[i, best]:.3f})"
        details: dict[str, Any] = {"output": name}
        if best is not None:  # (PyTorch's, ONNX Runtime's) index
            details["pair"] = [int(i), int(best)]
        found.append(error(code, STAGE, f"{name}: PyTorch's detection {want} is {what}.",
                           details=details))
    for j in extra:
        if j not in used:
            found.append(error("OM614", STAGE, f"{name}: ONNX Runtime's detection "
                               f"{_describe(j, ab, as_, al)} is not among PyTorch's.",
                               details={"output": name}))
    return found


def _per_detection(extras: list[tuple[str, np.ndarray, np.ndarray]],
                   pairs: list[tuple[int, int]], budget: DetectionBudget, name: str
                   ) -> list[Finding]:
    """OM619: an output with a row per detection (Mask R-CNN's masks, Keypoint R-CNN's
    keypoints and their scores) compared row by row for each matched pair: within
    ``box_rtol`` of the output's scale (its largest |value|, at least 1)."""
    found: list[Finding] = []
    for label, exp, act in extras:
        exp, act = np.asarray(exp, np.float64), np.asarray(act, np.float64)
        if exp.shape[1:] != act.shape[1:]:
            found.append(error("OM619", STAGE, f"{name}: {label} has rows of shape "
                               f"{list(act.shape[1:])} in ONNX Runtime, {list(exp.shape[1:])} "
                               "in PyTorch.", details={"output": label}))
            continue
        scale = max(1.0, float(np.abs(exp).max(initial=0.0)))
        for i, j in pairs:
            diff = np.abs(exp[i] - act[j])
            if diff.size and diff.max() > budget.box_rtol * scale:
                at = np.unravel_index(int(diff.argmax()), diff.shape)
                found.append(error(
                    "OM619", STAGE, f"{name}: {label} of PyTorch's detection #{i} (ONNX "
                    f"Runtime's #{j}) differs by {diff.max():.4g} at {list(map(int, at))} "
                    f"({int((diff > budget.box_rtol * scale).sum())} of {diff.size} values "
                    f"outside {budget.box_rtol * scale:.3g}).", details={"output": label}))
                break
    return found


def compare_detections(expected: tuple[np.ndarray, np.ndarray, np.ndarray],
                       actual: tuple[np.ndarray, np.ndarray, np.ndarray],
                       budget: DetectionBudget | None = None, *, name: str = "detections",
                       extras: list[tuple[str, np.ndarray, np.ndarray]] | None = None
                       ) -> DetectionComparison:
    """Compare PyTorch's (boxes, scores, labels) with ONNX Runtime's as sets of detections.
    ``extras``: (name, PyTorch's, ONNX Runtime's) outputs with a row per detection (masks,
    keypoints), compared for each matched pair (OM619)."""
    out = _compare_sets(expected, actual, budget or DetectionBudget(), name)
    if extras and out.expected == len(expected[0]) and not any(
            f.code == "OM618" for f in out.findings):
        out.findings += _per_detection(extras, out.pairs, budget or DetectionBudget(), name)
    return out


def _compare_sets(expected: tuple[np.ndarray, np.ndarray, np.ndarray],
                  actual: tuple[np.ndarray, np.ndarray, np.ndarray],
                  budget: DetectionBudget, name: str) -> DetectionComparison:
    exp = tuple(np.asarray(a) for a in expected)
    act = tuple(np.asarray(a) for a in actual)
    out = DetectionComparison(expected=len(exp[0]), actual=len(act[0]))
    for side, arrays in (("PyTorch's", exp), ("ONNX Runtime's", act)):
        why = _malformed(*arrays, side)
        if why is not None:
            out.findings.append(error("OM618", STAGE, f"{name}: {why}.",
                                      details={"output": name}))
            return out
    exp = (exp[0].astype(np.float64), exp[1].astype(np.float64), exp[2])
    act = (act[0].astype(np.float64), act[1].astype(np.float64), act[2])
    scale = max(1.0, float(np.abs(exp[0]).max(initial=0.0)))
    missing, extra = _match(exp, act, budget, scale, out)
    missing, extra, out.tied = _tied_pairs(missing, extra, exp, act, budget)
    if not missing and not extra:
        return out
    if _at_cut(missing, extra, exp[1], act[1], budget):
        out.tied_at_cut = len(missing)
        return out
    out.missing, out.extra = missing, extra
    out.findings = _leftovers(exp, act, missing, extra, budget, scale, name)
    return out


def unstable_top(reference: tuple[np.ndarray, np.ndarray, np.ndarray],
                 expected: tuple[np.ndarray, np.ndarray, np.ndarray],
                 torch_err: DetectionComparison) -> float | None:
    """The highest score among the detections PyTorch's float32 set leaves over against the
    float64 set (``torch_err``: the float64 ones it leaves unmatched, its own extra ones), or
    None where it reproduces the float64 set. Below that score float32 rounding is seen to
    exchange detections (a near tie flipped at a top-k or NMS upstream: other proposals, other
    boxes); above it every float64 detection is reproduced by float32 within the budget."""
    scores = [float(reference[1][i]) for i in torch_err.missing]
    scores += [float(expected[1][j]) for j in torch_err.extra]
    return max(scores, default=None)


Triple = tuple[np.ndarray, np.ndarray, np.ndarray]


def float32_judgement(reference: Triple, expected: Triple, actual: Triple,
                      budget: DetectionBudget | None = None, *, name: str = "detections",
                      extras: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]] | None
                      = None) -> tuple[bool, DetectionComparison, DetectionComparison]:
    """:func:`within_float32_noise`'s verdict with its two comparisons against the float64
    set, PyTorch's float32 one and ONNX Runtime's, within float32's reach
    (:func:`float32_budget`)."""
    budget = budget or DetectionBudget()
    ext = extras or []
    torch_err = compare_detections(reference, expected, budget, name=name,
                                   extras=[(n, r, e) for n, r, e, _ in ext])
    onnx_err = compare_detections(reference, actual, budget, name=name,
                                  extras=[(n, r, a) for n, r, _, a in ext])
    if any(f.code == "OM618" for f in torch_err.findings + onnx_err.findings):
        return False, torch_err, onnx_err
    # how far float32 moves the boxes and scores it keeps: PyTorch's detections paired with
    # the float64 ones by class and IoU alone (Faster R-CNN MobileNetV3 FPN at 800 px: scores
    # up to 5e-4 off, all 100 detections kept); within that, a detection is float32's
    wide = float32_budget(reference, expected, budget)
    torch_wide = compare_detections(reference, expected, wide, name=name)
    onnx_wide = compare_detections(reference, actual, wide, name=name)
    floor = torch_wide.disagreement()[:2]
    top = unstable_top(reference, expected, torch_wide)
    # rows (masks, keypoints) of the pairs within the budget, no more outside it than PyTorch's
    worse = [o > t for o, t in zip((*onnx_wide.disagreement()[:2],
                                    onnx_err.disagreement()[2]),
                                   (*floor, torch_err.disagreement()[2]))]
    # ONNX Runtime's leftovers must lie where float32 is seen to exchange detections: a
    # moved, dropped or relabelled detection above that (the best ones) is no rounding
    left = [float(reference[1][i]) for i in onnx_wide.missing]
    left += [float(actual[1][j]) for j in onnx_wide.extra]
    above = [v for v in left if top is None or v > top + wide.score_atol]
    logger.info("%s: against the float64 set, float32 moves boxes by up to %.3g and scores "
                "by up to %.3g; PyTorch's float32 set leaves %s beyond that, ONNX Runtime %s "
                "(unmatched, extra); float32 exchanges detections up to score %s, ONNX "
                "Runtime %d above it", name, wide.box_rtol * _scale(reference),
                wide.score_atol, floor, onnx_wide.disagreement()[:2],
                "none" if top is None else f"{top:.4g}", len(above))
    return not any(worse) and not above, torch_wide, onnx_wide


# how many budgets float32 may move a detection it keeps, at most (Faster R-CNN MobileNetV3
# FPN at 800 px: PyTorch's scores 5 budgets off, ONNX Runtime's 2); an exchanged proposal gives
# boxes pixels and scores 1e-2 apart, and a box moved by 2 px is 60 budgets at 320 px
REACH = 10.0


def _scale(dets: Triple) -> float:
    """A set's coordinate scale: its largest |corner|, at least 1 (the box budget's unit)."""
    return max(1.0, float(np.abs(np.asarray(dets[0], np.float64)).max(initial=0.0)))


def float32_budget(reference: Triple, expected: Triple, budget: DetectionBudget
                   ) -> DetectionBudget:
    """``budget`` widened to how far float32 moves the detections it keeps, as the float
    budget does (verify/budget.py: ONNX Runtime's error up to BUDGET times PyTorch's own): each
    float64 detection (``reference``) paired with one of PyTorch's float32 set (``expected``)
    of its class (IoU at least ``budget.min_iou``) within REACH times the budget; BUDGET times
    the largest corner and score difference of those pairs, at least the budget and at most
    REACH times it. A pair further apart is no detection moved by rounding but another one
    (an exchanged proposal), and widens nothing."""
    loose = DetectionBudget(box_rtol=REACH * budget.box_rtol,
                            score_atol=REACH * budget.score_atol, min_iou=budget.min_iou)
    kept = compare_detections(reference, expected, loose)
    box = BUDGET * kept.max_box_error / _scale(reference)
    return DetectionBudget(box_rtol=min(REACH * budget.box_rtol, max(budget.box_rtol, box)),
                           score_atol=min(REACH * budget.score_atol,
                                          max(budget.score_atol,
                                              BUDGET * kept.max_score_error)),
                           min_iou=budget.min_iou)


def within_float32_noise(reference: tuple[np.ndarray, np.ndarray, np.ndarray],
                         expected: tuple[np.ndarray, np.ndarray, np.ndarray],
                         actual: tuple[np.ndarray, np.ndarray, np.ndarray],
                         budget: DetectionBudget | None = None, *, name: str = "detections",
                         extras: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]] | None
                         = None) -> bool:
    """Whether ONNX Runtime's set (``actual``) is within the model's own float32 noise: within
    float32's reach of the float64 set (``reference``: :func:`float32_budget`, from PyTorch's
    float32 set ``expected``), it differs no more than PyTorch's set does, count by count
    (:meth:`DetectionComparison.disagreement`), and only where PyTorch's does: each detection
    ONNX Runtime leaves over (a float64 one unmatched, one of its own extra) scores no higher
    than the best one PyTorch's leaves over (:func:`unstable_top`). Where PyTorch's set agrees
    with the float64 one, ``actual`` must agree with it too (a dropped, moved, extra or
    relabelled box is no float32 noise), each detection within the budget of the float64 value
    rather than of PyTorch's float32 one; where PyTorch's moves scores further (at 800 px a
    MobileNetV3 FPN's float32 run moves 12 of 100 by up to 5e-4), ONNX Runtime's may move as
    far, and a box moved, dropped or relabelled is still found. ``extras``: (name, float64,
    PyTorch's, ONNX Runtime's) per-detection rows."""
    return float32_judgement(reference, expected, actual, budget, name=name, extras=extras)[0]


RULE_DETECTIONS = "detection set"
RULE_DETECTIONS_F64 = "detection set, within PyTorch's float32 error against float64"
RULE_DETECTIONS_TIE = ("detection set, within PyTorch's float32 error with a near-tied TopK "
                       "upstream picking as float64 does")
# every detection exchanged at a cut among equal scores: only the count and scores tell
RULE_DETECTIONS_TIED = "detection set, tied throughout: count and scores only"


# ops whose result is a data-dependent selection of rows (indices or a count): outputs
# gathered through one of them are a selected set, whatever their order
SELECTING_OPS = frozenset({"TopK", "NonMaxSuppression", "NonZero", "ArgMax", "ArgMin",
                           "Compress", "Unique"})


@dataclass(frozen=True)
class DetectionSet:
    """One detection set among a model's outputs, found from the program: output indices of
    its boxes [N, 4], scores [N] and labels [N], and of the outputs with a row per detection
    (masks, keypoints) that share its N."""

    boxes: int
    scores: int
    labels: int
    rows: tuple[int, ...] = ()

    @property
    def triple(self) -> tuple[int, int, int]:
        return (self.boxes, self.scores, self.labels)

    @property
    def members(self) -> tuple[int, ...]:
        return (*self.triple, *self.rows)


def computed_from(graph: Any, ops: frozenset[str]) -> set[str]:
    """Names of the graph outputs of ``graph`` that a node of one of ``ops`` is among the
    ancestors of (top-level nodes: a top-k, an NMS, a mask, an argmax)."""
    producer = {o: n for n in graph.node for o in n.output}
    memo: dict[str, bool] = {}

    def from_op(name: str) -> bool:
        stack = [(name, False)]
        while stack:  # iterative post-order: detection graphs are deep
            v, done = stack.pop()
            if done:
                node = producer[v]
                memo[v] = node.op_type in ops or any(memo.get(i, False)
                                                     for i in node.input if i)
                continue
            if v in memo:
                continue
            if v not in producer:  # a graph input or an initializer
                memo[v] = False
                continue
            memo[v] = False  # visiting; a cycle (none in a valid graph) reads False
            stack.append((v, True))
            stack.extend((i, False) for i in producer[v].input if i and i not in memo)
        return memo[name]

    return {o.name for o in graph.output if from_op(o.name)}


def row_keys(proto: Any, n: int) -> list[str | None]:
    """Per graph output of the ONNX model ``proto``: what its first dim is, for finding
    detection sets from the program - outputs with the same key have their rows selected
    together. A data-dependent or dynamic first dim: its symbol (outputs gathered by one
    selection share it; ``"?"`` when unnamed); a fixed first dim of an output computed from a
    selection (a top-k of a fixed k): ``"=<size>"``; otherwise None (not a set's member)."""
    keys: list[str | None] = []
    try:
        selected = computed_from(proto.graph, SELECTING_OPS)
        for o in list(proto.graph.output)[:n]:
            dims = o.type.tensor_type.shape.dim
            if not dims:
                keys.append(None)
            elif not dims[0].HasField("dim_value"):
                keys.append(dims[0].dim_param or "?")
            else:
                keys.append(f"={dims[0].dim_value}" if o.name in selected else None)
    except AttributeError:  # no ONNX graph to read: nothing is judged as a detection set
        keys = []
    return keys + [None] * (n - len(keys))


def _sets_in(members: list[int], arrays: dict[int, np.ndarray]
             ) -> tuple[list[DetectionSet], list[int]]:
    """The sets among ``members`` (outputs of one count): as many boxes (float [N, 4]) as
    scores (float [N]) and labels (integer [N]) outputs, paired in output order, each with the
    other members after its boxes (before the next set's) as rows. Returns the sets and, when
    there are none, the members left."""
    boxes = [k for k in members if arrays[k].ndim == 2 and arrays[k].shape[1] == 4
             and arrays[k].dtype.kind == "f"]
    scores = [k for k in members if arrays[k].ndim == 1 and arrays[k].dtype.kind == "f"]
    labels = [k for k in members if arrays[k].ndim == 1 and arrays[k].dtype.kind in "iu"]
    n = len(boxes)
    if not n or len(scores) != n or len(labels) != n or len(
            {len(arrays[k]) for k in members}) != 1:
        return [], members
    triples = list(zip(boxes, scores, labels))
    rest = [k for k in members if k not in {*boxes, *scores, *labels}]
    return [DetectionSet(b, sc, lab, tuple(
        k for k in rest if (t == 0 or k > b) and (t + 1 == n or k < triples[t + 1][0])))
        for t, (b, sc, lab) in enumerate(triples)], []


def detection_sets(expected: list[np.ndarray], keys: list[str | None]) -> list[DetectionSet]:
    """The detection sets among PyTorch's outputs ``expected``, in any order and nesting of
    the user's flattening, found from the program (``keys``: :func:`row_keys`): outputs whose
    rows one selection picks (the same symbol for their first dim) holding boxes, scores and
    labels outputs (:func:`_sets_in`). Where the exporter named the dims of one selection
    differently (or proved one of them fixed), the outputs left over are grouped by their
    count instead, and one still left over joins, as rows, a set of its count."""
    arrays = {k: np.asarray(a) for k, a in enumerate(expected)
              if k < len(keys) and keys[k] is not None and a is not None and np.ndim(a) >= 1}
    groups: dict[str, list[int]] = {}
    for k in arrays:
        key = keys[k] or "?"
        groups.setdefault(key if key != "?" else f"?{len(arrays[k])}", []).append(k)
    found: list[DetectionSet] = []
    left: list[int] = []
    for members in groups.values():
        sets, rest = _sets_in(members, arrays)
        found += sets
        left += rest
    by_count: dict[int, list[int]] = {}
    for k in sorted(left):
        by_count.setdefault(len(arrays[k]), []).append(k)
    still: list[int] = []
    for members in by_count.values():
        sets, rest = _sets_in(members, arrays)
        found += sets
        still += rest
    for k in still:  # a row output whose dim the exporter named apart from its set's
        same = [d for d in found if len(arrays[d.boxes]) == len(arrays[k])]
        if same:
            d = max((d for d in same if d.boxes < k), key=lambda d: d.boxes, default=same[0])
            found[found.index(d)] = DetectionSet(*d.triple, tuple(sorted((*d.rows, k))))
    return sorted(found, key=lambda d: d.boxes)


def _as_comparison(c: Any, res: DetectionComparison) -> Any:
    """``c`` (an OutputComparison) judged as part of a detection set."""
    c.rule = RULE_DETECTIONS_TIE if res.upstream_tie else \
        RULE_DETECTIONS_F64 if res.within_float32 else RULE_DETECTIONS
    if res.ok and res.expected and res.tied_at_cut == res.expected:
        c.rule = RULE_DETECTIONS_TIED
        logger.info("%s: every detection has the same score, so which boxes are kept is "
                    "arbitrary; only the count and the scores are verified (trained or "
                    "calibrated weights give distinct scores)", c.name)
    c.ok = res.ok
    c.mismatched = 0 if res.ok else len(res.findings)
    c.reason = "" if res.ok else f"the detection set differs ({res.findings[0].code})"
    if res.ok:  # the largest corner or score difference between matched detections
        c.max_abs = max(res.max_box_error, res.max_score_error)
        c.max_rel = 0.0
    return c


def _reference_noise(res: DetectionComparison, reference: Any, expected: list[np.ndarray],
                     actual: list[Any], det: DetectionSet, names: list[str], name: str,
                     upstream: Any = None, notes: list[Finding] | None = None
                     ) -> DetectionComparison:
    """``res`` cleared where the float64 outputs (``reference()``, fetched only now) show
    ONNX Runtime's set within the model's own float32 noise (within_float32_noise), or where
    a near tie at a TopK upstream explains the difference (``upstream()``:
    verify/upstream.py's UpstreamTies, asked only then; its OM621 notes into ``notes``).
    Where neither does, a score found outside the budget of PyTorch's (OM617) for a detection
    that both float32 sets match to the same float64 one within float32's reach (each rounded
    to its own side of it) is no finding, as long as another is left."""
    refs = reference() if reference is not None else None
    if not refs or len(refs) < len(expected) or any(refs[k] is None for k in det.members):
        return res
    extras = [(names[k], refs[k], expected[k], actual[k]) for k in det.rows]
    trio = det.triple
    sets = [tuple(o[k] for k in trio) for o in (refs, expected, actual)]
    ok, torch_err, onnx_err = float32_judgement(*sets, name=name, extras=extras)
    if ok:
        res.findings, res.within_float32 = [], True
        return res
    if upstream is not None and _tie_explains(upstream(), refs, expected, det, names, name,
                                              notes):
        res.findings, res.within_float32, res.upstream_tie = [], True, True
        return res
    both = {(i, j) for r, i in torch_err.pairs for s, j in onnx_err.pairs if r == s}
    kept = [f for f in res.findings
            if not (f.code == "OM617" and tuple(f.details.get("pair", ())) in both)]
    res.findings = kept or res.findings
    return res


def _tie_explains(ties: Any, refs: list[Any], expected: list[np.ndarray], det: DetectionSet,
                  names: list[str], name: str, notes: list[Finding] | None) -> bool:
    """Whether ``ties`` (UpstreamTies, or None) shows the set's difference to be a near tie's
    upstream: every TopK that picks otherwise than the float64 run is a near tie, and ONNX
    Runtime's outputs with those TopKs picking as float64 does agree with PyTorch's set, or are
    within its float32 noise against the float64 set - the usual rules, on outputs that differ
    from ONNX Runtime's by the exchange alone, so any other fault is still found."""
    if ties is None or not ties.explains or len(ties.outputs) < len(expected):
        return False
    forced = ties.outputs
    if any(forced[k] is None for k in det.members):
        return False
    trio, exp = det.triple, tuple(expected[k] for k in det.triple)
    got = tuple(forced[k] for k in trio)
    agree = compare_detections(exp, got, name=name,
                               extras=[(names[k], expected[k], forced[k]) for k in det.rows]).ok
    if not agree:
        agree = float32_judgement(
            tuple(refs[k] for k in trio), exp, got, name=name,
            extras=[(names[k], refs[k], expected[k], forced[k]) for k in det.rows])[0]
    if agree and notes is not None:
        notes.extend(ties.findings(name))
    logger.info("%s: with the upstream TopKs picking as float64 does, ONNX Runtime's set %s",
                name, "agrees" if agree else "still differs")
    return agree


def rejudge_detections(names: list[str], expected: list[np.ndarray], actual: list[Any],
                       comps: list[Any], keys: list[str | None], label: str,
                       reference: Any = None, upstream: Any = None,
                       notes: list[Finding] | None = None) -> list[Finding]:
    """Judge the detection sets among the outputs (:func:`detection_sets`, found from the
    program by ``keys``: :func:`row_keys`) as sets where their element-wise comparison failed
    (the counts or the order of equal scores differ): ``comps`` (one OutputComparison per
    output) are updated in place; returns the OM613-OM619 findings. ``reference``: a callable
    returning the float64 outputs (or None), asked only when the sets differ, to judge them
    by the float64-anchored budget (within_float32_noise). ``upstream``: a callable
    returning verify/upstream.py's UpstreamTies (or None), asked only when the float64 judgement
    fails too, to find a near tie at a TopK upstream that explains the difference (its OM621
    notes are appended to ``notes``)."""
    findings: list[Finding] = []
    for det in detection_sets(expected, keys):
        if any(k >= len(actual) or actual[k] is None for k in det.members):
            continue
        n, m = len(expected[det.boxes]), len(actual[det.boxes])
        rows = [k for k in det.rows if len(actual[k]) == m and len(expected[k]) == n]
        group = [comps[k] for k in (*det.triple, *rows)]
        if all(c.ok for c in group):
            continue
        name = "/".join(names[k] for k in det.triple) + f" at {label}"
        res = compare_detections(tuple(expected[k] for k in det.triple),
                                 tuple(actual[k] for k in det.triple), name=name,
                                 extras=[(names[k], expected[k], actual[k]) for k in rows])
        if not res.ok:
            res = _reference_noise(res, reference, expected, actual,
                                   DetectionSet(*det.triple, tuple(rows)), names, name,
                                   upstream, notes)
        for c in group:
            _as_comparison(c, res)
        findings += res.findings
    return findings
