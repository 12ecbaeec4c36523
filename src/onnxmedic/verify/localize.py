"""Divergence localisation: the first node where ONNX Runtime and PyTorch part ways.

The ONNX model is run in the sandbox with intermediate values exposed as extra graph outputs,
the (decomposed) ExportedProgram is run node by node with an FX interpreter on the same inputs,
and the two are matched by name: torch.onnx names each ONNX value after the FX node it comes
from. Memory stays bounded: the exposed values are split into chunks by bytes, each chunk is one
sandbox run, and the FX interpreter (which frees each value after its last use) compares a value
the moment it is produced and keeps only its error. The FX side runs once; the ONNX side runs
once per chunk, and only up to the chunk that holds the first divergence when ``full=False``.
Given an nn.Module rather than a program, verify rebuilds the program from the ONNX file's own
metadata (``replay``) instead of capturing it again.
"""

from __future__ import annotations

import heapq
import logging
import math
import operator
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from onnxmedic import sandbox
from onnxmedic._locate import location_from_node, module_path_from_node_meta
from onnxmedic._tensors import to_numpy
from onnxmedic.findings import Finding, Location, error, info, warning
from onnxmedic.verify.budget import RULE_BUDGET, budget_excess
from onnxmedic.verify.compare import compare_arrays, tolerance_for

logger = logging.getLogger(__name__)

STAGE = "localize"
# Bytes of exposed intermediate values per sandbox run (both sides hold about this much).
DEFAULT_CHUNK_BYTES = 256 * 1024**2
# Never more than this many extra outputs per run (ONNX Runtime's per-output overhead).
MAX_CHUNK_VALUES = 4096
# A node out of tolerance that multiplies its inputs' error by at least this much makes the
# error; below, it carries rounding drift (deep stacks of float32 matmuls cross the tolerance by
# accumulation alone). The first node that makes the error is reported, else the first out.
BORN_GROWTH = 10.0
# Below this share of FX nodes matched by name, the program is decomposed as torch.onnx does.
MIN_COVERAGE = 0.8


@dataclass
class NodeError:
    """The error of one FX node's value in ONNX Runtime against PyTorch."""

    fx_node: str
    aten_op: str
    onnx_node: str | None
    onnx_op: str | None
    shape: list[int]
    dtype: str
    max_abs: float
    max_rel: float
    mismatched: int
    total: int
    score: float  # the error over what is allowed (the float64 budget, or the tolerance
    # scaled to the value's magnitude - see ``rule``); > 1 fails
    input_score: float  # the largest score among the values it consumes (0: exact inputs)
    inputs: list[dict[str, Any]] = field(default_factory=list)  # name and score per input
    onnx_inputs: list[str] = field(default_factory=list)
    location: Location | None = None
    rule: str = "tolerance"  # or RULE_BUDGET: judged against the value's float64 reference
    # an output of a TopK whose PyTorch input holds equal values among its k+1 best: which
    # indices win is arbitrary there, and PyTorch and ONNX Runtime choose differently (OM860)
    tied_topk: bool = False

    @property
    def exceeds(self) -> bool:
        return self.score > 1.0

    @property
    def growth(self) -> float:
        """How much worse this node makes the error: its score over its inputs' score."""
        if self.score == 0:
            return 0.0
        if self.input_score <= 0:
            return math.inf
        return self.score / self.input_score

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["growth"] = self.growth
        d["exceeds"] = self.exceeds
        d["location"] = asdict(self.location) if self.location else None
        d["where"] = str(self.location) if self.location else None
        return d


@dataclass
class Localization:
    """What localisation found: the first divergent node and the top nodes by error growth."""

    first: NodeError | None = None
    # the first value out of tolerance, when it is not ``first``: rounding drift (growth below
    # BORN_GROWTH) that crossed the tolerance before the error ``first`` makes
    drift: NodeError | None = None
    top: list[NodeError] = field(default_factory=list)
    compared: int = 0  # FX nodes compared with an ONNX value
    fx_nodes: int = 0  # FX call_function nodes with a tensor value
    onnx_nodes: int = 0
    chunks: int = 0  # sandbox runs
    input_set: str = "example"
    # where the PyTorch program came from: "torch.export" (captured or given) or "onnx
    # metadata" (rebuilt from the FX nodes torch.onnx recorded in the file, see replay.py)
    program: str = "torch.export"
    seconds: float = 0.0
    bad_initializers: list[dict[str, Any]] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "first": self.first.to_dict() if self.first else None,
            "drift": self.drift.to_dict() if self.drift else None,
            "top": [n.to_dict() for n in self.top],
            "compared": self.compared, "fx_nodes": self.fx_nodes, "onnx_nodes": self.onnx_nodes,
            "chunks": self.chunks, "input_set": self.input_set, "program": self.program,
            "seconds": round(self.seconds, 3), "bad_initializers": self.bad_initializers,
        }


def decomposed_program(program: torch.export.ExportedProgram, opset: int | None = None
                       ) -> torch.export.ExportedProgram:
    """The program as torch.onnx translates it (after its decompositions), whose node names
    are the ONNX value names."""
    from onnxmedic.ops import REGISTRY
    from onnxmedic.stages.translate import decompose_for_export

    return decompose_for_export(program, REGISTRY.onnx_registry(opset))


def score(expected: np.ndarray, actual: np.ndarray, rtol: float, atol: float) -> float:
    """max |actual - expected| / (atol + rtol * max |expected|): above 1 the value is out of
    tolerance. The tolerance is scaled to the tensor's magnitude, not to each element's: at a
    cancellation (a matmul output near 0) an element's own relative error means nothing, and
    deep float32 stacks would leave tolerance there without any fault. NaN against NaN and
    equal infinities count as exact; other special values as inf. Integers must be equal."""
    e, a = np.asarray(expected), np.asarray(actual)
    if e.size == 0:
        return 0.0
    if e.dtype.kind in "biu" and a.dtype.kind in "biu":
        diff = np.abs(e.astype(np.int64) - a.astype(np.int64))
        m = int(diff.max())
        return 0.0 if m == 0 else 1.0 + float(m)
    cplx = e.dtype.kind == "c" or a.dtype.kind == "c"
    e = e.astype(np.complex128 if cplx else np.float64)
    a = a.astype(np.complex128 if cplx else np.float64)
    nan_e, nan_a = np.isnan(e), np.isnan(a)
    inf_e, inf_a = np.isinf(e), np.isinf(a)
    if ((nan_e ^ nan_a) | ((inf_e | inf_a) & ~(inf_e & inf_a & (e == a)) & ~(nan_e | nan_a))
            ).any():
        return math.inf
    finite = ~(nan_e | nan_a | inf_e | inf_a)
    if not finite.any():
        return 0.0
    max_diff = float(np.abs(e[finite] - a[finite]).max())
    scale = float(np.abs(e[finite]).max())
    if max_diff == 0.0:
        return 0.0
    tol = atol + rtol * scale
    return math.inf if tol == 0 else max_diff / tol


def _onnx_dtype(t: torch.dtype) -> int | None:
    from onnx import helper

    try:
        return helper.np_dtype_to_tensor_dtype(np.dtype(str(t).replace("torch.", "")))
    except Exception:
        return None


def _candidates(program: torch.export.ExportedProgram, proto: Any
                ) -> tuple[list[torch.fx.Node], dict[str, Any]]:
    """FX nodes (in order) whose value torch.onnx left under the same name in the ONNX graph,
    and, per name, the ONNX node producing it."""
    producer = {}
    for n in proto.graph.node:
        for o in n.output:
            if o:
                producer[o] = n
    nodes = []
    for node in program.graph_module.graph.nodes:
        if node.op != "call_function" or node.name not in producer:
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            nodes.append(node)
    return nodes, producer


def _tensor_nodes(program: torch.export.ExportedProgram) -> int:
    return sum(1 for n in program.graph_module.graph.nodes if n.op == "call_function"
               and isinstance(n.meta.get("val"), torch.Tensor))


def value_chunks(nodes: list[torch.fx.Node], chunk_bytes: int) -> list[list[torch.fx.Node]]:
    out: list[list[torch.fx.Node]] = [[]]
    size = 0
    for node in nodes:
        val = node.meta["val"]
        try:
            nbytes = int(val.numel()) * val.element_size()
        except Exception:  # symbolic sizes: count a nominal amount
            nbytes = 1 << 20
        if out[-1] and (size + nbytes > chunk_bytes or len(out[-1]) >= MAX_CHUNK_VALUES):
            out.append([])
            size = 0
        out[-1].append(node)
        size += nbytes
    return [c for c in out if c]


def _with_outputs(proto: Any, names: list[str], types: dict[str, int]) -> Any:
    """A copy of ``proto`` whose graph outputs are ``names`` (the original outputs dropped)."""
    import onnx
    from onnx import helper

    m = onnx.ModelProto()
    m.CopyFrom(proto)
    del m.graph.output[:]
    for n in names:
        m.graph.output.append(helper.make_tensor_value_info(n, types.get(n, 0), None))
    return m


def with_weights(proto: Any, model_dir: str | Path | None) -> Any:
    """``proto`` itself, or, when it refers to external data in ``model_dir``, a copy with the
    data loaded (localisation saves modified copies of the model elsewhere)."""
    import onnx

    if model_dir is None or not any(t.data_location == onnx.TensorProto.EXTERNAL
                                    for t in proto.graph.initializer):
        return proto
    full = onnx.ModelProto()
    full.CopyFrom(proto)
    onnx.external_data_helper.load_external_data_for_model(full, str(model_dir))
    return full


def value_types(proto: Any) -> dict[str, int]:
    """The element type of each value the graph declares (inputs, intermediate values,
    outputs), by name; values of unknown type left out."""
    types = {}
    for vi in list(proto.graph.value_info) + list(proto.graph.input) + list(proto.graph.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    return types


def save_proto(model: Any, folder: Path) -> Path:
    import onnx

    path = folder / "exposed.onnx"
    if model.ByteSize() > 2**31 - 2**26:
        onnx.save(model, path, save_as_external_data=True, location="exposed.onnx.data")
    else:
        onnx.save(model, path)
    return path


def _flat_inputs(program: torch.export.ExportedProgram, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> list[Any]:
    """The graph module's placeholders in order: lifted parameters, buffers and constants,
    then the user's inputs flattened as torch.export does."""
    from torch.export.graph_signature import InputKind

    user = [x for x in torch.utils._pytree.tree_leaves((args, kwargs))]
    user_iter = iter(user)
    flat = []
    state = program.state_dict
    for spec in program.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            flat.append(next(user_iter, None))
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            flat.append(state[spec.target] if spec.target in state
                        else program.constants[spec.target])
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            flat.append(program.constants[spec.target])
        else:
            flat.append(None)
    return flat


def _aten(node: torch.fx.Node) -> str:
    t = node.target
    name = getattr(t, "name", None)
    if callable(name):
        return str(name())
    return str(getattr(t, "__name__", t))


def _to64(value: Any) -> Any:
    """float32 tensors and the dtype float32 itself as float64 (a cast or a factory op
    with dtype=float32 in the graph would pull the shadow run back to float32)."""
    if isinstance(value, torch.Tensor):
        return value.double() if value.dtype == torch.float32 else value
    return torch.float64 if value is torch.float32 else value


class _Comparer(torch.fx.Interpreter):
    """Runs the program node by node; each mapped value is compared when produced. With
    ``shadow``, every node also runs in float64 on its inputs' float64 values (a node that
    cannot takes its float32 value), so each value has its float64 reference: localisation
    judges intermediate values by the same budget as the outputs (verify/budget.py)."""

    def __init__(self, gm: torch.fx.GraphModule, on_value: Any, shadow: bool = False,
                 tied: set[str] | None = None) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.on_value = on_value
        self.env64: dict[torch.fx.Node, Any] | None = {} if shadow else None
        self.tied = tied  # the names of the topk nodes whose input ties (filled here)

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if self.tied is not None and n.target is torch.ops.aten.topk.default:
            args, kwargs = self.fetch_args_kwargs_from_env(n)  # still live: freed after
            if topk_tied(*args, **kwargs):
                self.tied.add(n.name)
        ref = self._shadow(n, out) if self.env64 is not None else None
        self.on_value(n, out, ref)
        if self.env64 is not None:
            for dead in self.user_to_last_uses.get(n, []):
                self.env64.pop(dead, None)
        return out

    def _shadow(self, n: torch.fx.Node, out: Any) -> torch.Tensor | None:
        env64 = self.env64
        assert env64 is not None
        if n.op != "call_function":
            env64[n] = torch.utils._pytree.tree_map(_to64, out)
        else:
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs),
                                                 lambda a: env64.get(a, self.env.get(a)))
            args, kwargs = torch.utils._pytree.tree_map(_to64, (args, kwargs))
            try:
                env64[n] = n.target(*args, **kwargs)
            except Exception:  # no float64 kernel, or dtypes it will not mix: go on in float32
                env64[n] = out
        ref = env64[n]
        ok = (isinstance(out, torch.Tensor) and isinstance(ref, torch.Tensor)
              and out.dtype == torch.float32 and ref.dtype == torch.float64
              and ref.shape == out.shape)
        return ref if ok else None


def topk_tied(x: Any, k: int, dim: int = -1, largest: bool = True, sorted: bool = True
              ) -> bool:
    """Whether ``torch.topk(x, k, dim, largest)`` has a tie that decides its indices: two
    equal values among the k+1 best of a row (the k-th place, or the order within the k)."""
    del sorted  # the order asked for does not change which values tie
    if not isinstance(x, torch.Tensor) or x.numel() == 0 or k <= 0:
        return False
    if x.dim() == 0:
        return False  # one value: nothing to tie with
    n = min(k + 1, x.shape[dim])
    if n < 2:
        return False
    # the k+1 best in order (a partial selection, not a sort of the whole row)
    best = torch.topk(x.detach(), n, dim=dim, largest=largest, sorted=True).values
    return bool((best.narrow(dim, 1, best.shape[dim] - 1) ==
                 best.narrow(dim, 0, best.shape[dim] - 1)).any())


def _matched_program(program: Any, proto: Any, decomposed: bool
                     ) -> tuple[Any, list[torch.fx.Node], dict[str, Any]]:
    """The program to localise on (``program`` or, when too few of its nodes match ONNX
    values by name and it is not ``decomposed``, the program torch.onnx decomposed), its FX
    nodes matched to ONNX values, and the ONNX node producing each value."""
    nodes, producer = _candidates(program, proto)
    if not decomposed and len(nodes) < MIN_COVERAGE * _tensor_nodes(program):
        # torch.onnx decomposed ops of this program; its decomposed program has the names.
        # Only then: decomposing costs more than the whole localisation of a mapped program.
        try:
            program = decomposed_program(program)
            nodes, producer = _candidates(program, proto)
        except Exception as e:  # go on with the program as given: fewer names match
            logger.debug("decomposition for localisation failed: %s", e)
    return program, nodes, producer


def _no_match_finding() -> Finding:
    return warning(
        "OM611", STAGE, "no ONNX value could be matched to a PyTorch (FX) node: the ONNX "
        "file was not exported by torch.onnx from this model, or its names were changed.",
        suggestion="Localise on the model as onnxmedic exports it: `onnxmedic export "
        "MODEL -o out.onnx`, then `onnxmedic verify out.onnx MODEL --localize`.")


class _Localize:
    """One localisation run: ONNX Runtime computes the exposed values chunk by chunk while the
    FX interpreter runs the program; each matched value is compared the moment it is produced,
    the errors are ranked by growth, and what is reported is written into ``loc``."""

    def __init__(self, proto: Any, loc: Localization, nodes: list[torch.fx.Node],
                 producer: dict[str, Any], *, feeds: dict[str, np.ndarray],
                 tolerance: tuple[float, float] | None, timeout: float,
                 chunk_bytes: int | None, top_k: int, full: bool,
                 worker: sandbox.Runner | None) -> None:
        self.proto, self.loc, self.producer = proto, loc, producer
        self.feeds, self.tolerance, self.timeout = feeds, tolerance, timeout
        self.top_k, self.full = top_k, full
        self.chunks = value_chunks(nodes, chunk_bytes or DEFAULT_CHUNK_BYTES)
        self.chunk_of = {n.name: i for i, c in enumerate(self.chunks) for n in c}
        self.types = value_types(proto)
        for n in nodes:
            if n.name not in self.types:
                t = _onnx_dtype(n.meta["val"].dtype)
                if t is not None:
                    self.types[n.name] = t
        self.scores: dict[str, float] = {}  # every compared node's score (floats only: small)
        self.upstream: dict[str, float] = {}  # for nodes not compared: the max score feeding
        # the top_k nodes so far (min-heap on the report's order: growth where out of
        # tolerance, score, earlier first); only these, and the first out, get the full
        # comparison (counts, relative error): a deep divergent stack has thousands out
        self.top: list[tuple[float, float, int, NodeError]] = []
        self.tol_of: dict[Any, tuple[float, float]] = {}
        self.tied: set[str] = set()  # topk nodes whose PyTorch input ties (topk_tied)
        self.fx_of: dict[str, torch.fx.Node] = {}
        self.first_exceeding: NodeError | None = None
        self.chunk = -1  # the chunk whose values are loaded
        self.values: dict[str, Any] = {}
        self.stop = False
        self.failed: sandbox.SandboxResult | None = None
        self.tmp = Path(tempfile.mkdtemp(prefix="onnxmedic-localize-"))
        self.spare = worker  # the worker started ahead, for the first chunk

    # -- ONNX Runtime side ------------------------------------------------------------------

    def load_chunk(self, i: int) -> None:
        """Run ONNX Runtime on the model with chunk ``i``'s values as its outputs."""
        self.values = {}
        names = [n.name for n in self.chunks[i]]
        path = save_proto(_with_outputs(self.proto, names, self.types), self.tmp)
        if self.spare is not None:
            w, self.spare = self.spare, None
            with w:
                sbx = w.run(path, [self.feeds], timeout=self.timeout)
        else:
            sbx = sandbox.run_model(path, [self.feeds], timeout=self.timeout)
        self.loc.chunks += 1
        self.chunk = i
        if not sbx.ok:
            self.failed = sbx
            self.stop = True
            return
        self.values = dict(zip(sbx.output_names, sbx.outputs[0]))

    # -- PyTorch side and comparison --------------------------------------------------------

    def run_program(self, program: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                    replayed: bool, reference: list[np.ndarray] | None) -> None:
        """Run the program node by node, comparing each value as it is produced. A failure
        becomes a finding, except for a replayed program: NotReplayable (capture takes over).
        The spare worker and the temporary folder are released in any case."""
        from onnxmedic.verify.replay import NotReplayable

        try:
            flat = program.flat_inputs if replayed else _flat_inputs(program, args, kwargs)
            with torch.no_grad():
                outputs = _Comparer(program.graph_module, self.on_value,
                                    shadow=self.tolerance is None, tied=self.tied).run(*flat)
            if replayed:
                _check_replay(outputs, reference, self.tolerance)
        except Exception as e:
            if replayed:  # the rebuilt program does not run: capture takes over
                if isinstance(e, NotReplayable):
                    raise
                raise NotReplayable(f"{type(e).__name__}: {str(e)[:300]}") from e
            self.loc.findings.append(warning(
                "OM611", STAGE, f"running the PyTorch program node by node failed "
                f"({type(e).__name__}: {str(e)[:300]}); localisation is incomplete.",
                suggestion="Report it to onnxmedic with the model; the verification result "
                "itself is unaffected."))
        finally:
            if self.spare is not None:
                self.spare.close()
                self.spare = None
            shutil.rmtree(self.tmp, ignore_errors=True)

    def input_score(self, n: torch.fx.Node) -> tuple[float, list[dict[str, Any]]]:
        """The largest score among the values ``n`` consumes, and each input's score."""
        ins = []
        best = 0.0
        for a in n.all_input_nodes:
            s = self.scores.get(a.name, self.upstream.get(a.name, 0.0))
            if a.name in self.scores:
                ins.append({"name": a.name, "score": s})
            elif s > 0:
                ins.append({"name": a.name, "score": s, "via": "upstream"})
            best = max(best, s)
        return best, ins

    def on_value(self, n: torch.fx.Node, out: Any, ref: torch.Tensor | None = None) -> None:
        """The FX interpreter produced ``out`` for ``n`` (``ref``: its float64 value): compare
        it, or pass its inputs' error on when it has no ONNX value to compare with."""
        if n.op != "call_function":
            return
        pair = self._pair(n, out)
        if pair is None:
            self.upstream[n.name] = self.input_score(n)[0]
            return
        self._compare(n, *pair, None if ref is None else to_numpy(ref.detach()))

    def _pair(self, n: torch.fx.Node, out: Any) -> tuple[np.ndarray, Any] | None:
        """(PyTorch value, ONNX Runtime value) of ``n``, or None when it is not compared."""
        if n.name not in self.chunk_of or self.stop and self.failed is not None:
            return None
        if not isinstance(out, torch.Tensor):
            return None
        i = self.chunk_of[n.name]
        if i != self.chunk:
            if self.stop:
                return None
            self.load_chunk(i)
            if self.failed is not None:
                return None
        act = self.values.pop(n.name, None)
        if act is None:
            return None
        exp = to_numpy(out.detach())
        if tuple(exp.shape) != tuple(np.asarray(act).shape):
            return None
        return exp, act

    def _compare(self, n: torch.fx.Node, exp: np.ndarray, act: Any,
                 ref: np.ndarray | None = None) -> None:
        if exp.dtype not in self.tol_of:
            self.tol_of[exp.dtype] = tolerance_for(str(exp.dtype), self.tolerance)
        rtol, atol = self.tol_of[exp.dtype]
        judged = budget_excess(exp, act, ref) if ref is not None else None
        s = score(exp, act, rtol, atol) if judged is None else judged[0]
        self.scores[n.name] = s
        self.loc.compared += 1
        if s == 0:
            return  # exact: nothing to report, and its inputs' errors are not needed
        best, ins = self.input_score(n)
        onode = self.producer.get(n.name)
        ne = NodeError(
            fx_node=n.name, aten_op=_aten(n), onnx_node=onode.name if onode else None,
            onnx_op=onode.op_type if onode else None, shape=list(exp.shape),
            dtype=str(exp.dtype), max_abs=math.nan, max_rel=math.nan, mismatched=0,
            total=int(exp.size), score=s, input_score=best,
            inputs=ins, onnx_inputs=list(onode.input) if onode else [])
        if judged is not None:
            ne.rule, ne.mismatched = RULE_BUDGET, judged[1]
        source = n.args[0] if n.target is operator.getitem and n.args else None
        ne.tied_topk = isinstance(source, torch.fx.Node) and source.name in self.tied
        if self._rank(ne):
            self.fx_of[n.name] = n
            _measure(ne, exp, act, rtol, atol)

    # -- ranking and result -----------------------------------------------------------------

    def _rank(self, ne: NodeError) -> bool:
        """Record ``ne`` as the first out, the first divergence or among the top by growth;
        True when it is reported (and so needs the full comparison)."""
        key = (ne.growth if ne.exceeds else 0.0, ne.score, -self.loc.compared)
        reported = False
        if ne.exceeds and self.first_exceeding is None:
            self.first_exceeding = ne
            reported = True
        if ne.exceeds and ne.growth >= BORN_GROWTH and self.loc.first is None:
            self.loc.first = ne
            reported = True
            if not self.full:
                self.stop = True
        top = self.top
        if self.top_k > 0 and (len(top) < self.top_k or key > top[0][:3]):
            item = (*key, ne)
            if len(top) < self.top_k:
                heapq.heappush(top, item)
            else:
                heapq.heapreplace(top, item)
            reported = True
        return reported

    def finish(self, program: Any, replayed: bool) -> None:
        """Write what was found into ``loc``: the sandbox failure, the first divergent node,
        the drift before it, the top nodes by growth and the source location of each."""
        loc = self.loc
        failed = self.failed
        if failed is not None:
            f = failed.finding(STAGE, self.timeout)
            loc.findings.append(warning(
                "OM611", STAGE, "ONNX Runtime failed on the model with intermediate values "
                f"exposed ({f.title if f else failed.status}: {failed.error[:300]}); "
                f"localisation covers {loc.compared} node(s) only."))
        if loc.first is None:  # only gradual growth: the first value out of tolerance
            loc.first = self.first_exceeding
        elif self.first_exceeding is not loc.first:
            loc.drift = self.first_exceeding
        loc.top = [item[-1] for item in sorted(self.top, key=lambda t: t[:3], reverse=True)]
        for e in loc.top + [x for x in (loc.first, loc.drift) if x]:  # only what is reported
            n = self.fx_of[e.fx_node]
            e.location = (program.location(n.name) if replayed else
                          location_from_node(n) or Location(
                              module_path=module_path_from_node_meta(n.meta)))


def localize(
    proto: Any,
    program: torch.export.ExportedProgram,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    feeds: dict[str, np.ndarray],
    tolerance: tuple[float, float] | None = None,
    timeout: float = sandbox.DEFAULT_TIMEOUT,
    chunk_bytes: int | None = None,
    top_k: int = 10,
    full: bool = True,
    input_set: str = "example",
    decomposed: bool = False,
    worker: sandbox.Runner | None = None,
    reference: list[np.ndarray] | None = None,
    model_dir: str | Path | None = None,
) -> Localization:
    """Find the first FX node (in topological order) whose ONNX Runtime value is outside
    tolerance, with its inputs' errors, and the ``top_k`` nodes by error growth.

    ``program`` is the ExportedProgram the ONNX model was translated from (``decomposed``: it
    is already the decomposed one torch.onnx used); ``feeds`` the ONNX inputs for
    ``args``/``kwargs``. With ``full=False`` the sandbox stops at the chunk holding the first
    divergence. ``worker``: a sandbox worker started ahead (it imports ONNX Runtime while the
    caller captures), used for the first chunk. Never raises for problems of the model: they
    become findings. ``program`` not ``decomposed``: used as is when most of its nodes match
    ONNX values by name, else decomposed as torch.onnx does first.

    ``program`` may also be a ``replay.Replay`` (the program rebuilt from the ONNX file's
    metadata, see ``replay``); then ``reference`` (the eager model's outputs on these inputs)
    is required, and ``NotReplayable`` is raised when the rebuilt program does not compute
    them: the file describes another program than the model's, and localising against it
    would blame the wrong node.

    ``model_dir``: where the model's external data lies, when ``proto`` refers to it (the
    weights are read for the exposed-value runs only, not held by the caller).
    """
    from onnxmedic.verify.replay import Replay

    proto = with_weights(proto, model_dir)
    replayed = isinstance(program, Replay)
    if replayed and reference is None:
        raise TypeError("localize: a Replay program needs the reference outputs")
    t0 = time.perf_counter()
    loc = Localization(input_set=input_set, onnx_nodes=len(proto.graph.node),
                       program="onnx metadata" if replayed else "torch.export")
    program, nodes, producer = _matched_program(program, proto, decomposed or replayed)
    loc.fx_nodes = _tensor_nodes(program)
    if not nodes:
        loc.findings.append(_no_match_finding())
        if worker is not None:
            worker.close()
        loc.seconds = time.perf_counter() - t0
        return loc
    loc.bad_initializers = _compare_initializers(proto, program, tolerance)
    run = _Localize(proto, loc, nodes, producer, feeds=feeds, tolerance=tolerance,
                    timeout=timeout, chunk_bytes=chunk_bytes, top_k=top_k, full=full,
                    worker=worker)
    run.run_program(program, args, kwargs or {}, replayed, reference)
    run.finish(program, replayed)
    loc.seconds = time.perf_counter() - t0
    loc.findings.extend(_findings(loc))
    return loc


def _measure(ne: NodeError, exp: np.ndarray, act: np.ndarray, rtol: float, atol: float
             ) -> None:
    """The full comparison of a reported node: max abs and rel error, elements out (those
    over the budget, for a node judged by it)."""
    if ne.score > 1 and ne.rule == RULE_BUDGET:
        cmp = compare_arrays(ne.fx_node, exp, act, tolerance=(rtol, atol), check_dtype=False)
        ne.max_abs, ne.max_rel = cmp.max_abs, cmp.max_rel
    elif ne.score > 1:
        cmp = compare_arrays(ne.fx_node, exp, act, tolerance=(rtol, atol), check_dtype=False)
        ne.max_abs, ne.max_rel, ne.mismatched = cmp.max_abs, cmp.max_rel, cmp.mismatched
    else:  # within tolerance: no special values differ, no element is out
        with np.errstate(invalid="ignore"):
            wide = np.complex128 if "c" in (exp.dtype.kind, act.dtype.kind) else np.float64
            diff = np.abs(exp.astype(wide) - np.asarray(act).astype(wide))
        ne.max_abs = float(np.nanmax(diff)) if diff.size else 0.0


def _check_replay(outputs: Any, reference: list[np.ndarray],
                  tolerance: tuple[float, float] | None) -> None:
    """NotReplayable unless the rebuilt program's outputs are the eager model's."""
    from onnxmedic.verify.replay import NotReplayable

    outputs = list(outputs)
    if len(outputs) != len(reference):
        raise NotReplayable(f"{len(outputs)} outputs, the model has {len(reference)}")
    for i, (got, exp) in enumerate(zip(outputs, reference)):
        if not isinstance(got, torch.Tensor):
            raise NotReplayable(f"output {i} is not a tensor")
        act = to_numpy(got.detach())
        exp = np.asarray(exp)
        if act.shape != exp.shape or act.dtype != exp.dtype:
            raise NotReplayable(f"output {i}: {act.dtype}{list(act.shape)}, the model's "
                                f"{exp.dtype}{list(exp.shape)}")
        rtol, atol = tolerance_for(str(exp.dtype), tolerance)
        if score(exp, act, rtol, atol) > 1.0:
            raise NotReplayable(f"output {i} differs from the model's")


def _compare_initializers(proto: Any, program: torch.export.ExportedProgram,
                          tolerance: tuple[float, float] | None) -> list[dict[str, Any]]:
    """ONNX initializers named after a parameter or buffer whose values differ from it."""
    from onnx import numpy_helper

    state = program.state_dict
    bad = []
    for init in proto.graph.initializer:
        t = state.get(init.name)
        if not isinstance(t, torch.Tensor) or init.data_location == 1:  # external: skip
            continue
        try:
            arr = numpy_helper.to_array(init)
        except Exception:
            continue
        exp = to_numpy(t.detach())
        if tuple(arr.shape) != tuple(exp.shape):
            continue
        rtol, atol = tolerance_for(str(exp.dtype), tolerance)
        s = score(exp, arr, rtol, atol)
        if s > 1.0:
            cmp = compare_arrays(init.name, exp, arr, tolerance=(rtol, atol), check_dtype=False)
            bad.append({"name": init.name, "score": s, "max_abs": cmp.max_abs,
                        "mismatched": cmp.mismatched, "total": cmp.total})
    return bad


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}"


def _findings(loc: Localization) -> list[Finding]:
    out = []
    coverage = (f"{loc.compared} of {loc.fx_nodes} PyTorch nodes compared in {loc.chunks} "
                f"ONNX Runtime run(s)")
    if loc.first is not None:
        n = loc.first
        # the budget: ONNX Runtime's error against the value's float64 reference, 10x
        # PyTorch's own float32 error (verify/budget.py); else the scaled tolerance
        limit = "its float64 error budget" if n.rule == RULE_BUDGET else "tolerance"
        ratio = "error/budget" if n.rule == RULE_BUDGET else "error/tolerance"
        ins = ", ".join(f"{i['name']} {_fmt(i['score'])}" for i in n.inputs) or "none compared"
        born = (f"its inputs are within {limit}, so the error is born here"
                if n.input_score <= 1.0 else
                f"it multiplies its inputs' error by {_fmt(n.growth)}, so the error is born here"
                if n.growth >= BORN_GROWTH else
                f"its inputs are already outside {limit} (error inherited and grown)")
        bad_inits = {b["name"] for b in loc.bad_initializers}
        init_names = ", ".join(sorted(bad_inits & set(n.onnx_inputs)))
        init_note = ""
        if loc.drift is not None:
            init_note += (f" (Values drift out of {limit} by accumulated rounding earlier, "
                          f"from {loc.drift.fx_node}, {ratio} {_fmt(loc.drift.score)} "
                          f"with growth {_fmt(loc.drift.growth)}; {n.fx_node} is where the "
                          f"error jumps.)")
        if loc.bad_initializers:
            names = ", ".join(b["name"] for b in loc.bad_initializers[:5])
            init_note += f" The ONNX initializer(s) {names} differ from the PyTorch parameters."
        out.append(error(
            "OM610", STAGE,
            f"the first value to leave {limit} (input set {loc.input_set}) is FX node "
            f"{n.fx_node} ({n.aten_op}, ONNX {n.onnx_op} node {n.onnx_node!r}, "
            f"{n.dtype}{n.shape}): max abs error {_fmt(n.max_abs)}, {n.mismatched} of "
            f"{n.total} elements outside {limit}, {ratio} {_fmt(n.score)}; inputs' "
            f"{ratio}: {ins} — {born}.{init_note} ({coverage}.)",
            op=n.aten_op, location=n.location,
            suggestion=(f"The ONNX file's weights ({init_names}) feed this node and differ "
                        "from the model's: the file is stale or was exported from other "
                        "weights; export it again." if init_names else
                        "See OM860: the TopK's input ties." if n.tied_topk else
                        f"Check the translation of {n.aten_op} (ONNX {n.onnx_op}) for these "
                        "dtypes and shapes; rewrite that line with other ops or cast around "
                        "it, and `onnxmedic reduce` the ONNX file for a bug report."),
            details={"node": n.to_dict()}))
        if n.tied_topk:
            out.append(_tied_topk_finding(n))
    else:
        out.append(info(
            "OM612", STAGE, f"no intermediate value left its float64 error budget or "
            f"tolerance ({coverage}); the output "
            "mismatch comes from values onnxmedic could not match by name, or from the "
            "outputs only." if loc.compared else f"nothing could be compared ({coverage})."))
    return out


def _tied_topk_finding(n: NodeError) -> Finding:
    """OM860: the first divergence is a TopK's indices over tied values (the model's own
    numerics, not the translation)."""
    where = f" in {n.location}" if n.location else ""
    return error(
        "OM860", STAGE,
        f"the outputs differ because the TopK at FX node {n.fx_node}{where} (ONNX node "
        f"{n.onnx_node!r}) chooses among tied values: PyTorch's input to it holds equal "
        "values among its k+1 best, so which indices win is arbitrary, and PyTorch and ONNX "
        "Runtime break the tie differently (ONNX's TopK takes the lower index). The "
        "translation is not at fault: the model's scores tie, e.g. an MoE router whose "
        "weights are all zero (transformers initialises some routers to zero, so a model "
        "built from a config and not trained routes every token by ties).",
        op=n.aten_op, location=n.location,
        suggestion="Verify the model with its trained weights (scores that do not tie); for "
        "a test model, give the router random weights.",
        details={"node": n.to_dict()})
