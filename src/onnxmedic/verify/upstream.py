"""Evidence that a detection set differs because of a near tie at a top-k upstream of it.

A two-stage detector ranks proposals before it detects anything: Mask R-CNN's RPN keeps the
1000 best anchors of each FPN level (a TopK). Where two anchors' objectness scores lie within
float32 rounding of each other at that cut, ONNX Runtime may keep the one the float64 run drops;
another proposal then flows down, and a detection or two at the end differ, although nothing is
wrong with the translation. The final comparison alone cannot tell that from a fault, and the
final rule must not be loosened. So the evidence is taken from the program itself
(:func:`upstream_ties`):

1. the model runs in float32 and in float64 with every ``aten.topk`` recorded (its input, k and
   the indices it picks);
2. the ONNX model runs once more with each of its top-level TopK nodes matched to a recorded
   top-k (the same input shape and k, in order) made to pick what the float64 run picks - its
   values gathered from its own input at those indices - and with ONNX Runtime's own input and
   picks of that TopK exposed as outputs;
3. each matched TopK's exchange is judged (:func:`judge_exchange`): ONNX Runtime's picks
   differing from the float64 ones only where the float64 values lie within float32's reach of
   the cut (two values each off by ONNX Runtime's error, at most twice it apart, can swap), that
   error no more than BUDGET times PyTorch's own float32 error on the same input, and the
   float64 picks still a top-k of ONNX Runtime's values within that reach.

When every matched TopK that picks otherwise is a near tie, and at least one does, the
detections of the forced run - everything else as ONNX Runtime computes it - are judged by the
usual rules (verify/detections.py): a fault downstream (a moved, dropped or relabelled box) is
still in them and still found, a fault upstream of the TopK moves its input beyond float32's
reach and is no tie, and a TopK that picks far from the float64 cut is no tie either. What is
excused is exactly what the exchange changes. The tie is reported as OM621 (info), naming the
node.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from onnxmedic._tensors import reference_mode
from onnxmedic._torch_compat import dispatch_mode_base
from onnxmedic.borrow import copy_inputs
from onnxmedic.findings import Finding, info
from onnxmedic.verify.budget import BUDGET

logger = logging.getLogger(__name__)
STAGE = "compare"
SUFFIX = "__onnxmedic_ort"  # ONNX Runtime's own picks and input of a forced TopK
# the recorded top-k inputs kept at most (bytes, float64): a detector's are a few MB
RECORD_BYTES = 256 * 2**20


@dataclass
class TopKCall:
    """One ``aten.topk`` as PyTorch ran it: its input (float64 copy), k, dim, largest, and the
    indices it picked."""

    x: np.ndarray
    k: int
    dim: int
    largest: bool
    indices: np.ndarray

    @property
    def signature(self) -> tuple[tuple[int, ...], int, bool]:
        return (tuple(self.x.shape), self.k, self.largest)


class _Recorder(dispatch_mode_base()):  # type: ignore[misc]
    """Records every ``aten.topk`` call's input, arguments and indices."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[TopKCall] = []
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten.topk.default and self.bytes < RECORD_BYTES:
            x = args[0]
            rest = dict(zip(("k", "dim", "largest"), args[1:4]), **kwargs)
            dim = int(rest.get("dim", -1)) % max(1, x.dim())
            self.calls.append(TopKCall(
                x=x.detach().to(torch.float64).cpu().numpy(), k=int(rest["k"]), dim=dim,
                largest=bool(rest.get("largest", True)),
                indices=out[1].detach().cpu().numpy().astype(np.int64)))
            self.bytes += x.numel() * 8
        return out


def record_topk(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                dtype: torch.dtype) -> list[TopKCall]:
    """The top-k calls of ``model`` run at ``dtype`` (float64: on a copy) on ``args``/``kwargs``
    (copied; float tensors cast to ``dtype``)."""
    from onnxmedic.verify.reference import converted_inputs

    run = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
    a, kw = copy_inputs((converted_inputs(args, dtype), converted_inputs(kwargs, dtype)))
    rec = _Recorder()
    with reference_mode(), rec:
        run(*a, **kw)
    return rec.calls


def topk_nodes(proto: Any) -> list[Any]:
    """The top-level TopK nodes of ``proto``'s graph, in graph (topological) order."""
    return [n for n in proto.graph.node if n.op_type == "TopK" and len(n.output) >= 2]


def _attr(node: Any, name: str, default: int) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(a.i)
    return default


def _static_shape(proto: Any, name: str) -> tuple[int, ...] | None:
    for vi in list(proto.graph.value_info) + list(proto.graph.input) + list(
            proto.graph.output):
        if vi.name == name and vi.type.HasField("tensor_type"):
            dims = vi.type.tensor_type.shape.dim
            if dims and all(d.HasField("dim_value") for d in dims):
                return tuple(int(d.dim_value) for d in dims)
    return None


def _constant_k(proto: Any, name: str) -> int | None:
    from onnx import numpy_helper

    for t in proto.graph.initializer:
        if t.name == name:
            return int(numpy_helper.to_array(t).reshape(-1)[0])
    for n in proto.graph.node:
        if n.op_type == "Constant" and n.output and n.output[0] == name:
            for a in n.attribute:
                if a.name == "value":
                    return int(numpy_helper.to_array(a.t).reshape(-1)[0])
    return None


def match_topk(proto: Any, calls: list[TopKCall]) -> dict[int, int]:
    """Which recorded call each TopK node of ``proto`` (its index in :func:`topk_nodes`) is:
    a node whose input has a static shape (and whose K, where constant, is the call's k) is
    matched to the calls of that shape, k and direction in order; ambiguous counts (more nodes
    of a signature than calls, or fewer) match nothing of that signature."""
    by_sig: dict[tuple[Any, ...], list[int]] = {}
    for c, call in enumerate(calls):
        by_sig.setdefault(call.signature, []).append(c)
    wanted: dict[tuple[Any, ...], list[int]] = {}
    for t, node in enumerate(topk_nodes(proto)):
        shape = _static_shape(proto, node.input[0])
        if shape is None:
            continue
        k = _constant_k(proto, node.input[1]) if len(node.input) > 1 else None
        largest = bool(_attr(node, "largest", 1))
        axis = _attr(node, "axis", -1) % max(1, len(shape))
        sigs = [s for s in by_sig if s[0] == shape and s[2] == largest
                and (k is None or s[1] == k)
                and calls[by_sig[s][0]].dim == axis]
        if len(sigs) == 1:
            wanted.setdefault(sigs[0], []).append(t)
    return {t: c for sig, nodes in wanted.items() if len(nodes) == len(by_sig[sig])
            for t, c in zip(nodes, by_sig[sig])}


def forced(proto: Any, picks: dict[int, np.ndarray]) -> tuple[Any, list[tuple[str, str]]]:
    """A copy of ``proto`` whose TopK nodes (index in :func:`topk_nodes` -> indices) pick the
    given indices: the node's outputs renamed (ONNX Runtime's own picks, exposed as graph
    outputs after the original ones, with the node's input), its indices output a constant,
    its values gathered from its input at them. Returns the model and, per forced node, the
    names of (its input, ONNX Runtime's indices) among the outputs."""
    import onnx
    from onnx import helper, numpy_helper

    from onnxmedic.verify.localize import value_types

    m = onnx.ModelProto()
    m.CopyFrom(proto)
    nodes = topk_nodes(m)
    exposed: list[tuple[str, str]] = []
    after: dict[str, list[Any]] = {}  # a forced TopK's own picks -> the nodes replacing it
    for t, idx in sorted(picks.items()):
        node = nodes[t]
        values, indices = node.output[0], node.output[1]
        own_i = indices + SUFFIX
        node.output[0], node.output[1] = values + SUFFIX, own_i
        const = indices + SUFFIX + "_float64"
        m.graph.initializer.append(numpy_helper.from_array(idx.astype(np.int64), const))
        after[own_i] = [helper.make_node("Identity", [const], [indices]),
                           helper.make_node("GatherElements", [node.input[0], const], [values],
                                            axis=_attr(node, "axis", -1))]
        exposed.append((node.input[0], own_i))
    order = []
    for node in m.graph.node:  # right after their TopK: the graph stays in topological order
        own = onnx.NodeProto()
        own.CopyFrom(node)
        order.append(own)
        order.extend(after.get(node.output[1] if len(node.output) > 1 else "", []))
    del m.graph.node[:]
    m.graph.node.extend(order)
    types = value_types(m)
    for x, i in exposed:  # the input's type as the graph has it (float where unknown)
        m.graph.output.append(helper.make_tensor_value_info(
            x, types.get(x) or onnx.TensorProto.FLOAT, None))
        m.graph.output.append(helper.make_tensor_value_info(i, onnx.TensorProto.INT64, None))
    return m, exposed


@dataclass
class Exchange:
    """One TopK's picks in ONNX Runtime against the float64 run's: how many items it picks
    that the float64 run does not, the float64 value at the cut, how far from it the exchanged
    items' float64 values lie, and float32's reach on the TopK's input (ONNX Runtime's largest
    error against float64, and PyTorch's float32 one)."""

    node: str
    k: int
    exchanged: int
    reordered: int
    cut: float
    gap: float
    reach: float
    torch_reach: float
    near_tie: bool
    why: str = ""

    def describe(self) -> str:
        return (f"TopK node {self.node!r} (k={self.k}): ONNX Runtime picks {self.exchanged} "
                f"item(s) the float64 run does not ({self.reordered} place(s) in another "
                f"order), all within {self.gap:.3g} of the float64 value at the cut "
                f"({self.cut:.6g}); ONNX Runtime's float32 error on the TopK's input is "
                f"{self.reach:.3g} (PyTorch's {self.torch_reach:.3g})")


def _rows(a: np.ndarray, axis: int) -> np.ndarray:
    return np.moveaxis(a, axis, -1).reshape(-1, a.shape[axis])


def judge_exchange(node: str, x64: np.ndarray, picks64: np.ndarray, x32: np.ndarray,
                   x_onnx: np.ndarray, picks_onnx: np.ndarray, axis: int, largest: bool
                   ) -> Exchange:
    """Whether ONNX Runtime's picks (``picks_onnx`` of its input ``x_onnx``) differ from the
    float64 run's (``picks64`` of ``x64``) only by a near tie: every item one picks and the
    other does not has a float64 value within twice ONNX Runtime's error (its reach) of the
    float64 value at the cut; that reach is at most BUDGET times PyTorch's float32 error
    (``x32`` against ``x64``, at least a float32 rounding of the input's scale); and the
    float64 picks, in their order, are a top-k of ONNX Runtime's values within that reach."""
    x64 = np.asarray(x64, np.float64)
    xo = np.asarray(x_onnx, np.float64)
    sign = 1.0 if largest else -1.0
    scale = float(np.abs(x64).max(initial=0.0))
    ulp = float(np.spacing(np.float32(max(scale, 1e-30))))
    reach = float(np.abs(xo - x64).max(initial=0.0)) if xo.shape == x64.shape else np.inf
    torch_reach = float(np.abs(np.asarray(x32, np.float64) - x64).max(initial=0.0)) \
        if np.shape(x32) == x64.shape else np.inf
    k = picks64.shape[axis]
    out = Exchange(node=node, k=k, exchanged=0, reordered=0, cut=float("nan"), gap=0.0,
                   reach=reach, torch_reach=torch_reach, near_tie=False)
    if xo.shape != x64.shape or picks_onnx.shape != picks64.shape or \
            not np.isfinite(torch_reach):
        out.why = "shapes differ from the float64 run's"
        return out
    allowed = 2.0 * reach
    xr, xor_ = _rows(x64, axis) * sign, _rows(xo, axis) * sign
    p64, po = _rows(picks64, axis), _rows(picks_onnx, axis)
    gaps, cuts = [0.0], []
    for r in range(len(xr)):
        a, b = set(p64[r].tolist()), set(po[r].tolist())
        cut = float(xr[r][p64[r]].min(initial=np.inf))
        cuts.append(cut)
        swapped = sorted(a ^ b)
        out.exchanged += len(b - a)
        out.reordered += int(np.count_nonzero(p64[r] != po[r]))
        if swapped:
            gaps.append(float(np.abs(xr[r][swapped] - cut).max()))
        # the float64 picks in their order: a top-k of ONNX Runtime's values within its reach
        mine = xor_[r][p64[r]]
        if len(mine) > 1 and float((mine[1:] - mine[:-1]).max()) > allowed:
            out.why = "the float64 picks are out of ONNX Runtime's order beyond its reach"
    out.gap = max(gaps)
    out.cut = sign * (min(cuts) if cuts else float("nan"))
    if out.why:
        return out
    if reach > BUDGET * max(torch_reach, ulp):
        out.why = (f"ONNX Runtime's error on the TopK's input ({reach:.3g}) is over {BUDGET:g} "
                   f"times PyTorch's float32 one ({torch_reach:.3g})")
    elif out.gap > allowed:
        out.why = (f"an item exchanged lies {out.gap:.3g} from the cut, beyond twice ONNX "
                   f"Runtime's error ({allowed:.3g}): no near tie")
    out.near_tie = not out.why
    return out


@dataclass
class UpstreamTies:
    """What :func:`upstream_ties` found: each matched TopK's exchange, and ONNX Runtime's
    outputs with the matched TopKs picking as the float64 run does (the original outputs
    only)."""

    exchanges: list[Exchange] = field(default_factory=list)
    outputs: list[np.ndarray] = field(default_factory=list)

    @property
    def changed(self) -> list[Exchange]:
        return [e for e in self.exchanges if e.exchanged or e.reordered]

    @property
    def explains(self) -> bool:
        """Whether some TopK picks otherwise than float64, and each that does is a near
        tie: the forced outputs then differ from ONNX Runtime's by the ties alone."""
        return bool(self.changed) and all(e.near_tie for e in self.changed)

    def findings(self, name: str) -> list[Finding]:
        """OM621 (info): the near ties found and excused upstream of ``name``."""
        return [info("OM621", STAGE, f"{name}: {e.describe()}: a near tie, which float32 "
                     "rounding breaks either way. With it picking as the float64 run does, "
                     "ONNX Runtime's detections agree, so the difference is the tie's.",
                     op="TopK", details={"node": e.node, "k": e.k, "exchanged": e.exchanged,
                                         "cut": e.cut, "gap": e.gap, "reach": e.reach,
                                         "torch_reach": e.torch_reach})
                for e in self.changed]


# runs a modified ONNX model on one input set's feeds: its outputs, or None
Rerun = Callable[[Any], "list[np.ndarray] | None"]


def upstream_ties(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any], proto: Any,
                  n_outputs: int, rerun: Rerun) -> UpstreamTies | None:
    """The TopK exchanges upstream of the outputs and ONNX Runtime's outputs with the TopKs
    picking as float64 does (module docstring), or None where there is nothing to judge: no
    nn.Module, no TopK matched to PyTorch's top-k calls, no float64 run, the forced run failed."""
    if not isinstance(model, torch.nn.Module) or not topk_nodes(proto):
        return None
    try:
        return _upstream_ties(model, args, kwargs, proto, n_outputs, rerun)
    except Exception:  # no float64 kernel, a model that will not be copied, a graph not run
        logger.info("no evidence of a near tie upstream", exc_info=True)
        return None


def _upstream_ties(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                   proto: Any, n_outputs: int, rerun: Rerun) -> UpstreamTies | None:
    from onnxmedic._tensors import tensor_bytes
    from onnxmedic.sandbox import available_memory
    from onnxmedic.verify.reference import MEMORY_SHARE

    avail = available_memory()
    if avail is not None and tensor_bytes(model, torch.float64) > MEMORY_SHARE * avail:
        logger.info("no float64 copy of the model to record its top-k calls: too big")
        return None
    calls64 = record_topk(model, args, kwargs, torch.float64)
    calls32 = record_topk(model, args, kwargs, torch.float32)
    if len(calls32) != len(calls64):
        return None
    match = match_topk(proto, calls64)
    match = {t: c for t, c in match.items()
             if calls32[c].signature == calls64[c].signature}
    if not match:
        logger.info("no TopK of the ONNX model matched to PyTorch's %d top-k calls",
                    len(calls64))
        return None
    model_f, exposed = forced(proto, {t: calls64[c].indices for t, c in match.items()})
    outs = rerun(model_f)
    if outs is None or len(outs) < n_outputs + 2 * len(exposed):
        logger.info("the ONNX model with its TopKs picking as float64 does did not run")
        return None
    nodes = topk_nodes(proto)
    ties = UpstreamTies(outputs=list(outs[:n_outputs]))
    for j, (t, c) in enumerate(sorted(match.items())):
        x_o, p_o = outs[n_outputs + 2 * j], outs[n_outputs + 2 * j + 1]
        node = nodes[t]
        call = calls64[c]
        ties.exchanges.append(judge_exchange(
            node.name or node.output[1], call.x, call.indices, calls32[c].x,
            np.asarray(x_o), np.asarray(p_o), call.dim, call.largest))
        logger.info("%s", ties.exchanges[-1].describe())
    return ties
