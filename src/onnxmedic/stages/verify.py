"""The runtime and compare stages: the example and further input sets run in one sandboxed ONNX
Runtime session and compared with PyTorch; a value mismatch is localised (verify/localizer.py).
Used by export (``verify_stage``) and by the verify command (``verify_file``)."""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from onnxmedic import borrow, isa, sandbox
from onnxmedic._locate import location_from_onnx_node, onnx_neighbourhood, onnx_node_in_error
from onnxmedic._tensors import flatten_tensors, reference_mode, to_numpy
from onnxmedic.capture import capture
from onnxmedic.context import ExportContext
from onnxmedic.findings import Finding, OnnxMedicError, Severity, error, info, warning
from onnxmedic.inputs import Inputs
from onnxmedic.onnxfile import graph_io, make_feeds
from onnxmedic.result import PASSED, ExportResult
from onnxmedic.stages import check as checks
from onnxmedic.stages.fix import cpu_stand_in
from onnxmedic.stages.preflight import preflight_stage
from onnxmedic.verify.budget import (
    RULE_BUDGET,
    RULE_NORMWISE,
    RULE_PENDING,
    estimated_budget,
    judge_output,
    judge_quantized,
    quantization_scales,
    torch_error_scale,
)
from onnxmedic.verify.compare import OutputComparison, compare_outputs
from onnxmedic.verify.detections import RULE_DETECTIONS, rejudge_detections, row_keys
from onnxmedic.verify.input_sets import (
    branch_probe_sets,
    dim_symbols,
    same_shape_sets,
    shape_variants,
)
from onnxmedic.verify.localizer import Localizer
from onnxmedic.verify.ranking import ranked_outputs, rejudge_rankings
from onnxmedic.verify.reference import reference_outputs
from onnxmedic.verify.size_rules import (
    SizeRule,
    append_metadata,
    rules_from_guards,
    rules_from_metadata,
)
from onnxmedic.verify.upstream import upstream_ties

logger = logging.getLogger(__name__)

# How many input sets beyond the example verification uses.
def expected_outputs(model: Any, sets: list[Inputs]) -> list[list[np.ndarray]]:
    """PyTorch's outputs (flattened, numpy) for each input set."""
    fn = model.module() if isinstance(model, torch.export.ExportedProgram) else model
    out = []
    with reference_mode():
        for s in sets:  # each run on a copy of its own (a model may write its inputs)
            args, kwargs = borrow.copy_inputs((s.args, s.kwargs))
            out.append([to_numpy(t) for t in flatten_tensors(fn(*args, **kwargs))])
    return out


# -- runtime ----------------------------------------------------------------------------------
def attach_node(proto: Any, finding: Finding, message: str) -> None:
    """Point a runtime finding at the ONNX node its message names: op, the user's line, and the
    node's neighbourhood in the graph (for the report)."""
    node = onnx_node_in_error(proto, message)
    if node is None:
        return
    finding.op = finding.op or node.op_type
    finding.location = finding.location or location_from_onnx_node(node)
    try:
        finding.details["neighbourhood"] = onnx_neighbourhood(proto, node)
    except Exception:  # a report nicety: never fail the run for it
        logger.debug("no neighbourhood", exc_info=True)


def record_runtime(result: ExportResult, sbx: sandbox.SandboxResult, target: str,
                   timeout: float) -> bool:
    """Record the runtime stage from a sandbox result: failed (with its finding), or passed
    (with OM535 when ONNX Runtime fell back from the target's provider). True when passed."""
    st = result.record("runtime")
    if not sbx.ok:
        finding = sbx.finding("runtime", timeout)
        if finding is not None and finding.code in ("OM510", "OM511"):
            attach_node(result.onnx_model, finding, finding.details.get("error", ""))
        st.fail(finding)
        return False
    st.passed()
    if sbx.lean:
        size = (f" ({sbx.model_bytes / 2**30:.2f} GiB with its weights)"
                if sbx.model_bytes else "")
        st.add(info(
            "OM516", "runtime", f"the model{size} is big, so ONNX Runtime ran it in a "
            "memory-lean session: weights memory-mapped from the external data and held once "
            "(no folded float32 copies of bf16 weights, no packed MatMul weights), basic graph "
            "optimizations only. A default session (extended fusions, packed weights) may round "
            "some results differently, within the rounding of the model's dtype.",
            suggestion="Nothing to do. A session is lean for a model of at least "
            f"{sandbox.LEAN_MIN_BYTES / 2**30:g} GiB or more than {sandbox.LEAN_SHARE:.0%} of "
            "the memory available; ONNXMEDIC_SANDBOX_LEAN=0 asks for a default session."))
    fallback = sbx.provider_finding(sandbox.providers(target))
    if fallback is not None:
        st.add(fallback)
    if sbx.providers and sbx.providers[0] == "CUDAExecutionProvider":
        st.add(info(
            "OM536", "runtime", "ran on ONNX Runtime's CUDA provider with use_tf32=0 (full "
            "float32 MatMul/Gemm/Conv, as PyTorch computes by default). With the provider's "
            "default TF32 math, float32 results differ from PyTorch by about 1e-4 to 1e-3 "
            "relative.", suggestion="For PyTorch's float32 numbers in deployment, create the "
            "session with providers=[('CUDAExecutionProvider', {'use_tf32': '0'})]; keep the "
            "default for speed if that precision is enough."))
    return True


def shape_finding(proto: Any, label: str, message: str) -> Finding:
    """OM402 for a run that fails at another size, pointing at the op that baked it in."""
    node = onnx_node_in_error(proto, message)
    op = None
    loc = None
    if node is not None:
        meta = {p.key: p.value for p in node.metadata_props}
        op = meta.get("namespace", "").rsplit(": ", 1)[-1] or node.op_type
        loc = location_from_onnx_node(node)
    first = " ".join(message.strip().splitlines()[:2])[:400]
    return error(
        "OM402", "runtime", f"the model was exported with a dynamic dimension but fails in ONNX "
        f"Runtime at {label}"
        + (f", in {node.op_type} node {node.name!r}" if node is not None else "")
        + f": {first}", op=op, location=loc,
        suggestion="This op baked the example's size in. Typical causes: view/reshape with a "
        "size computed by int() or .item(), a Python int taken from x.shape and used as a "
        "constant, or torch.export specialising the dim (see its constraint messages).",
        details={"error": message[:4000], "input_set": label,
                 **({"neighbourhood": onnx_neighbourhood(proto, node)} if node is not None
                    else {})})


# -- input sets ---------------------------------------------------------------------------------
@dataclass
class InputSets:
    """What verification runs: the first ``n_required`` sets must verify (the example, derived
    sets, branch probes); the rest are the shape variants (failures there are OM402)."""

    sets: list[Inputs] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    expected: list[list[np.ndarray]] = field(default_factory=list)
    n_required: int = 0
    references: list[list[np.ndarray | None]] = field(default_factory=list)  # float64 runs
    raw_references: dict[int, list[np.ndarray]] = field(default_factory=dict)  # as they came
    torch_seconds: float = 0.0  # PyTorch's own runs of the sets it timed (timed_sets)
    timed_sets: int = 0

    def add(self, label: str, inputs: Inputs, expected: list[np.ndarray]) -> None:
        self.sets.append(inputs)
        self.labels.append(label)
        self.expected.append(expected)

    def expected_of(self, model: Any, sets: list[Inputs]) -> list[list[np.ndarray]]:
        """PyTorch's outputs on ``sets``, timed (for the reference's time limit)."""
        t0 = time.perf_counter()
        out = expected_outputs(model, sets)
        self.torch_seconds += time.perf_counter() - t0
        self.timed_sets += len(sets)
        return out

    def seconds_for(self, which: list[int]) -> float:
        """PyTorch's time for the sets ``which``, estimated from the sets it timed."""
        return self.torch_seconds / self.timed_sets * len(which) if self.timed_sets else 0.0


def input_sets(result: ExportResult, model: Any, example: Inputs,
               example_expected: list[np.ndarray] | None, onnx_dims: list[Any],
               probe_branches: bool = False, rules: dict[str, SizeRule] | None = None,
               only_allowed: bool = False, probe_masks: bool = False) -> InputSets:
    """The example, further sets of its shapes (input_sets.same_shape_sets), branch probes (when
    a data-dependent branch was specialised), and the shape variants PyTorch itself accepts,
    with PyTorch's outputs (``rules``, ``only_allowed``: see input_sets.shape_variants)."""
    out = InputSets()
    with result.timed("compare"):
        out.add("example", example, example_expected if example_expected is not None
                else out.expected_of(model, [example])[0])
        extra = [(f"random#{i}", s) for i, s in
                 enumerate(same_shape_sets(example, onnx_dims), 1)]
        if probe_branches:  # a data-dependent branch was specialised: try to take the others
            extra += _accepted(result, model, [(p.specs[-1], p) for p in
                                               branch_probe_sets(example, probe_masks)],
                               "branch probe")
        try:
            for (label, s), exp in zip(extra, out.expected_of(model, [s for _, s in extra])):
                out.add(label, s, exp)
        except Exception as e:  # the derived data may be out of the model's domain
            result.findings.append(warning(
                "OM603", "compare", f"PyTorch rejected the generated input sets "
                f"({type(e).__name__}: {str(e)[:200]}); verifying on the example only."))
            out = InputSets(out.sets[:1], out.labels[:1], out.expected[:1])
        out.n_required = len(out.sets)
        for label, variant in shape_variants(example, onnx_dims, rules=rules,
                                             only_allowed=only_allowed):
            try:
                exp = out.expected_of(model, [variant])[0]
            except Exception as e:
                text = str(e).strip()
                result.findings.append(info(
                    "OM403", "compare", f"not checked at {label}: PyTorch itself rejects that "
                    f"size ({type(e).__name__}: {text.splitlines()[0][:200] if text else ''})."))
                continue
            out.add(label, variant, exp)
    return out


def add_references(result: ExportResult, model: Any, sets: InputSets,
                   which: list[int]) -> None:
    """The float64 reference of the input sets ``which`` (verify/reference.py), or OM605
    saying why there is none (those outputs are then judged by the scaled normwise rule)."""
    fn = model.module() if isinstance(model, torch.export.ExportedProgram) else model
    with result.timed("reference"):
        ref = reference_outputs(fn, [sets.sets[i] for i in which],
                                [sets.expected[i] for i in which], sets.seconds_for(which))
    if len(sets.references) != len(sets.sets):
        sets.references = [[] for _ in sets.sets]
    for i, outs in zip(which, ref.outputs):
        sets.references[i] = outs
    for i, raw in zip(which, ref.raw):
        if raw is not None:
            sets.raw_references[i] = raw
    if ref.why_not is not None and not any(f.code == "OM605" for f in result.findings):
        result.findings.append(info(
            "OM605", "compare", f"no float64 reference for every input set: {ref.why_not}; "
            "float outputs without one are judged by the scaled normwise rule against "
            "PyTorch's own output."))


def _accepted(result: ExportResult, model: Any, probes: list[tuple[str, Inputs]],
              what: str) -> list[tuple[str, Inputs]]:
    """The probes PyTorch runs (an index now out of range is left out, with OM403)."""
    kept = []
    for label, probe in probes:
        try:
            expected_outputs(model, [probe])
        except Exception as e:
            result.findings.append(info(
                "OM403", "compare", f"{what} {label!r} not checked: PyTorch rejects it "
                f"({type(e).__name__}: {str(e).strip()[:160]})."))
            continue
        kept.append((label, probe))
    return kept


# -- run and compare ----------------------------------------------------------------------------
def run_and_compare(result: ExportResult, model: Any, onnx_path: Path, proto: Any,
                    example: Inputs, example_expected: list[np.ndarray] | None,
                    timeout: float, tolerance: tuple[float, float] | None,
                    worker: sandbox.Runner | None = None, target: str = "cpu",
                    localizer: Localizer | None = None, probe_branches: bool = False,
                    rules: dict[str, SizeRule] | None = None, only_allowed: bool = False,
                    probe_masks: bool = False) -> dict[str, SizeRule]:
    """runtime + compare stages, in one sandboxed session: the example, further input sets of
    the same shapes, and - for each dynamic dim of the ONNX model - sizes 1 and 2x. With a
    ``localizer``, a value mismatch (or every run, when it is ``always``) is localised.
    ``rules``: size rules of dynamic dims (verify/size_rules.py), checked at sizes they allow
    too; returns those applied (OM408: sizes they exclude failed, those they allow verified).
    With ``only_allowed`` (rules the file declares) only the sizes they allow are checked."""
    onnx_inputs, onnx_dims, onnx_outputs = graph_io(proto)
    sets = input_sets(result, model, example, example_expected, onnx_dims, probe_branches,
                      rules, only_allowed, probe_masks)
    with result.stage("runtime", conclude=False) as st:
        try:
            feeds = [make_feeds(onnx_inputs, s.args, s.kwargs) for s in sets.sets]
        except OnnxMedicError as e:
            st.fail(e.finding)
            return {}
        providers = sandbox.providers(target)
        config = isa.session_config_of(proto)  # what the file says it needs (OM546)
        if worker is None:
            sbx = sandbox.run_model(onnx_path, feeds, timeout=timeout, providers=providers,
                                    lean=None, session_config=config)
        else:
            sbx = worker.run(onnx_path, feeds, timeout=timeout, n_required=sets.n_required,
                             providers=providers, session_config=config)
    if not record_runtime(result, sbx, target, timeout):
        return {}
    mark = (len(result.verification), len(result.findings))

    def rerun(changed: Any, i: int) -> list[Any] | None:
        """Set ``i``'s outputs of ``changed`` (a modified copy of the model: a TopK made to
        pick as float64 does, verify/upstream.py), or None where it does not run."""
        from onnxmedic.verify.localize import save_proto, with_weights

        with tempfile.TemporaryDirectory(prefix="onnxmedic-tie-") as tmp:
            path = save_proto(with_weights(changed, Path(onnx_path).parent), Path(tmp))
            out = sandbox.run_model(path, [feeds[i]], timeout=timeout, providers=providers,
                                    lean=None, session_config=config)
        if not out.ok or not out.outputs:
            logger.info("the model with a TopK picking as float64 does: %s", out.summary())
            return None
        return out.outputs[0]

    def compare(sbx: sandbox.SandboxResult) -> Compared:
        with result.stage("compare", conclude=False):
            shape_failures = _compare(result, model, proto, sbx, sets,
                                      sbx.output_names or onnx_outputs, tolerance, rerun)
            shape_failures, applied = apply_size_rules(result, rules or {}, sets,
                                                       shape_failures,
                                                       dim_symbols(example, onnx_dims))
        return judge(result, sets, shape_failures), applied, shape_failures

    values, applied, shape_failures = compare(sbx)
    if values and not config and target.partition(":")[0] == "cpu" \
            and isa.integer_kernels(proto):
        values, applied, shape_failures = _both_ways(
            result, onnx_path, proto, feeds, sets, sbx, timeout,
            (values, applied, shape_failures), mark, compare)
    if localizer is None:
        return applied
    at_size = _size_failure(shape_failures) if not values else None
    if values or at_size is not None or localizer.always:
        label = (at_size.details["input_set"] if at_size is not None else
                 "example" if not values or "example" in {c.input_set for c in values}
                 else max(values, key=lambda c: c.max_rel).input_set)
        k = sets.labels.index(label) if label in sets.labels else 0
        localizer.run(result, proto, sets.sets[k], feeds[k], timeout, tolerance,
                      sets.labels[k], reference=sets.expected[k],
                      model_dir=Path(onnx_path).parent)
        if at_size is not None:
            point_at_first_node(at_size, result.localization)
    return applied


def _worst(comps: list[OutputComparison], steps: dict[str, float]) -> dict[str, Any]:
    """The figures of the worst output (isa.precision_findings)."""
    c = max(comps, key=lambda c: c.max_abs)
    step = steps.get(c.name)
    return {"output": c.name, "input_set": c.input_set, "max_abs": float(c.max_abs),
            "steps": float(c.max_abs / step) if step else None, "ok": c.ok}


# a judgement: the value mismatches, the size rules applied, the shape failures
Compared = tuple[list[OutputComparison], dict[str, SizeRule], list[Finding]]


def _both_ways(result: ExportResult, onnx_path: Path, proto: Any, feeds: list[dict[str, Any]],
               sets: InputSets, sbx: sandbox.SandboxResult, timeout: float,
               default: Compared, mark: tuple[int, int], compare: Any) -> Compared:
    """An integer-kernel file outside the budget run again with isa.PRECISION_CONFIG: where
    that changes its outputs, this CPU's u8s8 kernels saturate, and the file is judged by the
    exact kernels' outputs (OM546: verified with the setting; OM547: it fails both ways),
    both figures given. Where the outputs are the same (no saturation here, or a file the
    setting does not load) the default verdict stands."""
    precise = sandbox.run_model(onnx_path, feeds, timeout=timeout, lean=None,
                                session_config=isa.PRECISION_CONFIG)
    if not precise.ok:
        logger.info("with %s: %s", isa.PRECISION_CONFIG, precise.summary())
        return default
    if len(precise.outputs) == len(sbx.outputs) and all(
            len(a) == len(b) and all(np.array_equal(x, y, equal_nan=True)
                                     for x, y in zip(a, b))
            for a, b in zip(sbx.outputs, precise.outputs)):
        return default  # the same integers: nothing saturates here
    steps = quantization_scales(proto)
    before = _worst(default[0], steps)
    # the default's verdict is replaced by the exact kernels' (the float64 reference and
    # OM605 stay: they are the model's, not this run's)
    del result.verification[mark[0]:]
    result.findings[mark[1]:] = [f for f in result.findings[mark[1]:]
                                 if f.stage != "compare" or f.code == "OM605"]
    result.record("compare").reopen()
    judged = compare(precise)
    required = set(sets.labels[:sets.n_required])
    mine = [c for c in result.verification if c.input_set in required]
    with_setting = _worst(judged[0] or mine, steps)
    result.findings.extend(isa.precision_findings("compare", before, with_setting,
                                                  verified=not judged[0]))
    return judged


def _variant_sizes(sets: InputSets, name: str) -> list[tuple[int, str]]:
    """(size, label) of the shape variants of dim ``name`` that ran (labels ``name=size``)."""
    out = []
    for label in sets.labels[sets.n_required:]:
        sym, _, size = label.rpartition("=")
        if sym == name and size.isdigit():
            out.append((int(size), label))
    return out


def apply_size_rules(result: ExportResult, rules: dict[str, SizeRule], sets: InputSets,
                     shape_failures: list[Finding],
                     symbols: dict[str, tuple[int, list[Any]]]) -> tuple[list[Finding],
                                                                         dict[str, SizeRule]]:
    """The shape failures left once size rules explain some, and the rules applied. A rule is
    applied when a size it excludes failed and none it allows did: OM408 says so (with the
    line that introduced it) and the excluded sizes' comparisons are dropped. The OM402 left
    name the pattern their sizes show (passes only at multiples of k, only from m up)."""
    failed = {f.details.get("input_set"): f for f in shape_failures}
    applied: dict[str, SizeRule] = {}
    explained: set[str] = set()
    for name, rule in rules.items():
        tried = _variant_sizes(sets, name)
        out = [(s, lb) for s, lb in tried if lb in failed and not rule.allows(s)]
        inside = [(s, lb) for s, lb in tried if lb in failed and rule.allows(s)]
        n = symbols.get(name, (0, []))[0]
        good = sorted({n} | {s for s, lb in tried if rule.allows(s) and lb not in failed})
        if not out or inside or len(good) < 2:  # verified at the example's size alone: no
            continue
        applied[name] = rule
        explained |= {lb for _, lb in out}
        result.findings.append(size_rule_finding(rule, [s for s, _ in out], good))
    if explained:
        result.verification = [c for c in result.verification if c.input_set not in explained]
    left = [f for f in shape_failures if f.details.get("input_set") not in explained]
    for name, (n, _) in symbols.items():
        mine = [f for f in left if str(f.details.get("input_set", "")).rpartition("=")[0]
                == name]
        if mine:
            pattern = size_pattern(n, [(s, lb in failed) for s, lb in _variant_sizes(sets, name)],
                                   rules.get(name))
            if pattern:
                mine[0].message += f" At {name}: {pattern}."
                mine[0].details["size_pattern"] = pattern
    return left, applied


def size_rule_finding(rule: SizeRule, failed: list[int], verified: list[int]) -> Finding:
    """OM408: a dynamic dim is valid only at some sizes; the file says so and was verified
    there."""
    loc = rule.location
    where = (f" ({loc.file}:{loc.line}" + (f" `{loc.code}`" if loc.code else "") + ")"
             if loc is not None and loc.file else "")
    guard = f" (guard `{rule.guard}`)" if rule.guard else ""
    return warning(
        "OM408", "compare", f"{rule.name} is dynamic in sizes that are {rule.describe()}"
        f"{where}: torch.export followed code that holds only at those sizes{guard}, and the "
        f"ONNX file rejects or miscomputes other sizes (it failed at "
        f"{', '.join(map(str, sorted(failed)))}); it verified at "
        f"{', '.join(map(str, verified))}. The file records the rule in its metadata "
        "(metadata_props 'onnxmedic.dim_constraints').",
        location=loc,
        suggestion=f"Feed {rule.name} sizes that are {rule.describe()} (pad the input up to "
        "one). To make it explicit, declare the dim as "
        + (f"{rule.multiple} * Dim('{rule.name}_div{rule.multiple}', min="
           f"{max(1, -(-rule.minimum // rule.multiple))})" if rule.multiple > 1 else
           f"Dim('{rule.name}', min={rule.minimum})")
        + "; to support every size, compute the branch from shapes (pad by "
        "`(-x.shape[-1]) % k`) instead of a Python `if` on the size.",
        details={"dim": rule.name, "rule": rule.to_dict(), "failed_at": sorted(failed),
                 "verified_at": verified, "guard": rule.guard})


def size_pattern(n: int, tried: list[tuple[int, bool]], rule: SizeRule | None) -> str:
    """Words for the sizes of one dim that passed and failed ('passes at 32, 64; fails at 1,
    37: it works at multiples of 32 only, as far as checked'), '' when nothing failed."""
    bad = sorted(s for s, f in tried if f)
    good = sorted({n} | {s for s, f in tried if not f})
    if not bad:
        return ""
    text = f"passes at {', '.join(map(str, good))}; fails at {', '.join(map(str, bad))}"
    k = 0
    for s in good:
        k = math.gcd(k, s)
    several = len(good) >= 2  # the example alone shows no pattern
    if several and k > 1 and all(s % k for s in bad):
        text += f": it works at multiples of {k} only, as far as checked"
    elif several and max(bad) < min(good):
        text += f": it works from {min(good)} up only, as far as checked"
    if rule is not None:
        text += (f" (torch.export's guards allow sizes that are {rule.describe()}, but the "
                 "file fails at some of those too)" if any(rule.allows(s) for s in bad)
                 else "")
    return text


def _size_failure(shape_failures: list[Finding]) -> Finding | None:
    """The OM402 to localise: the first whose outputs ONNX Runtime computed (wrong values or
    shapes at another size; a size where the run itself failed names its node already)."""
    return next((f for f in shape_failures if "comparison" in f.details), None)


def point_at_first_node(finding: Finding, loc: Any) -> None:
    """OM402 names the first PyTorch node whose value goes wrong at that size, with the user's
    line, when localisation found it there."""
    first = getattr(loc, "first", None)
    if first is None or loc.input_set != finding.details.get("input_set"):
        return
    finding.message += (f" The first value to go wrong at that size is FX node {first.fx_node} "
                        f"({first.aten_op}, ONNX {first.onnx_op} node {first.onnx_node!r}); "
                        "see OM610.")
    finding.op = first.aten_op
    finding.location = first.location
    finding.details["first_divergent"] = first.to_dict()


def _compare(result: ExportResult, model: Any, proto: Any, sbx: sandbox.SandboxResult,
             sets: InputSets, names: list[str], tolerance: tuple[float, float] | None,
             rerun: Any = None) -> list[Finding]:
    """Every set's outputs compared (into ``result.verification``); the OM402 findings of the
    shape variants that fail. Outputs within a few ulps of PyTorch's are accepted as they are;
    the model runs in float64 only for the sets with outputs that are not (budget.py)."""
    ran = [i for i in range(len(sets.sets)) if i < len(sbx.outputs) and i not in sbx.run_errors]
    steps = quantization_scales(proto)  # QDQ outputs: one quantization step (budget.py)
    comps = {i: compare_outputs(names, sets.expected[i], sbx.outputs[i],
                                input_set=sets.labels[i], judge=_judge([], sets.labels[i],
                                                                       tolerance, fast=True))
             for i in ran}
    pending = [i for i in ran if any(c.rule == RULE_PENDING for c in comps[i])]
    if pending:
        judge_pending(result, model, sets, sbx.outputs, names, tolerance, comps, pending,
                       steps)
    shape_failures: list[Finding] = []
    keys = row_keys(proto, len(names))  # which outputs' rows one selection picks
    ranked = ranked_outputs(proto, len(names))  # integer outputs a top-k/argmax/NMS picks
    notes: list[Finding] = []  # near ties upstream that explain a detection set (OM621)
    for i in ran:  # detection outputs (boxes, scores, labels) are sets, compared as such
        shape_failures += rejudge_detections(
            names, sets.expected[i], sbx.outputs[i], comps[i], keys, sets.labels[i],
            reference=lambda i=i: _reference_of(result, model, sets, i),
            upstream=None if rerun is None else lambda i=i: upstream_ties(
                model, sets.sets[i].args, sets.sets[i].kwargs, proto, len(names),
                lambda changed: rerun(changed, i)),
            notes=notes)
        rejudge_rankings(sets.expected[i], sbx.outputs[i], comps[i], ranked,
                         reference=lambda i=i: _reference_of(result, model, sets, i))
    result.findings.extend(notes)
    for i, label in enumerate(sets.labels[:len(sbx.outputs)]):
        if i in sbx.run_errors:
            shape_failures.append(shape_finding(proto, label, sbx.run_errors[i]))
            continue
        result.verification.extend(comps[i])
        bad = [c for c in comps[i] if not c.ok]
        if i >= sets.n_required and bad:
            shape_failures.append(error(
                "OM402", "compare", f"at {label} the ONNX model computes output "
                f"{bad[0].name} wrong ({bad[0].reason}; max abs error "
                f"{bad[0].max_abs:.3g}) although it is right at the example's size.",
                suggestion="An op baked the example's size in (a constant shape in a "
                "Reshape/Expand, a size read with int()); use x.shape[...] arithmetic "
                "or -1 in view/reshape.",
                details={"comparison": bad[0].to_dict(), "input_set": label}))
    return shape_failures


def _reference_of(result: ExportResult, model: Any, sets: InputSets, i: int
                  ) -> list[np.ndarray] | None:
    """Set ``i``'s float64 outputs as they came (a detection set's own count and labels), run
    now if no judgement ran them yet (a detection set that differs is judged against them:
    verify/detections.py)."""
    if i not in sets.raw_references:
        add_references(result, model, sets, [i])
    return sets.raw_references.get(i)


def judge_pending(result: ExportResult, model: Any, sets: InputSets, outputs: list[Any],
                   names: list[str], tolerance: tuple[float, float] | None,
                   comps: dict[int, list[OutputComparison]], pending: list[int],
                   steps: dict[str, float] | None = None) -> None:
    """Judge the sets float32 agreement left open (into ``comps``): the example against its
    own float64 run first; each other set is accepted by the example's measured float32 error
    where that shows it within budget (budget.estimated_budget), and only the sets it does not
    show run in float64 too and are judged by the exact rule."""
    def rejudge(i: int, refs: list[np.ndarray | None]) -> None:
        comps[i] = compare_outputs(names, sets.expected[i], outputs[i], input_set=sets.labels[i],
                                   judge=_judge(refs, sets.labels[i], tolerance,
                                                steps=steps))

    def exact(which: list[int]) -> None:
        add_references(result, model, sets, which)
        for i in which:
            rejudge(i, sets.references[i])

    first = pending[:1] if pending[0] == 0 else pending
    exact(first)
    rest = pending[len(first):]
    if not rest:
        return
    if all(r is None for r in sets.references[0]):  # no float64 run (OM605 says why)
        for i in rest:
            rejudge(i, [])
        return
    stable = not any(c.unstable for c in comps[0])
    scales = [torch_error_scale(e, r) if stable else None
              for e, r in zip(sets.expected[0], sets.references[0])]
    still = []
    for i in rest:
        judged = _estimated(comps[i], sets.expected[i], outputs[i], scales, sets.labels[i])
        if judged is None:
            still.append(i)
        else:
            comps[i] = judged
    if still:
        exact(still)


def _estimated(fast: list[OutputComparison], expected: list[np.ndarray], actual: list[Any],
               scales: list[Any], label: str) -> list[OutputComparison] | None:
    """A set's comparisons with each pending output accepted by the example's error, or None
    when one is not (the set then needs its own reference)."""
    out = []
    for j, c in enumerate(fast):
        if c.rule != RULE_PENDING:
            out.append(c)
            continue
        scale = scales[j] if j < len(scales) else None
        est = (estimated_budget(c.name, expected[j], actual[j], scale, input_set=label)
               if scale is not None else None)
        if est is None:
            return None
        out.append(est)
    return out


def _judge(refs: list[np.ndarray | None], label: str,
           tolerance: tuple[float, float] | None, fast: bool = False,
           steps: dict[str, float] | None = None) -> Any:
    """The judge of one set's outputs; ``steps``: output name -> quantization step of the
    DequantizeLinear producing it (an output the float rule does not accept is judged again
    by one step, budget.judge_quantized)."""
    def one(name: str, exp: np.ndarray, act: np.ndarray | None, i: int) -> OutputComparison:
        c = judge_output(name, exp, act, refs[i] if i < len(refs) else None,
                         input_set=label, tolerance=tolerance, fast=fast)
        if steps and name in steps and tolerance is None and not c.ok \
                and (not fast or c.rule != RULE_PENDING):
            c = judge_quantized(c, exp, act, steps[name])
        return c
    return one


def judge(result: ExportResult, sets: InputSets, shape_failures: list[Finding]
          ) -> list[OutputComparison]:
    """The compare stage's verdict: OM402 (other sizes), OM602 (shape/dtype), OM601 (values).
    Returns the value mismatches of the required sets."""
    st = result.record("compare")
    if shape_failures:
        st.fail(*shape_failures)
    required = set(sets.labels[:sets.n_required])
    req = [c for c in result.verification if c.input_set in required and not c.ok]
    structural = [c for c in req if c.reason and any(
        w in c.reason for w in ("shape", "dtype", "missing", "extra"))]
    values = [c for c in req if c not in structural]
    if structural:
        c = structural[0]
        st.fail(error(
            "OM602", "compare", f"output {c.name} ({c.input_set}): {c.reason}.",
            suggestion="An output's shape or dtype differs from PyTorch: check dynamic dims "
            "and dtype casts around this output.",
            details={"comparison": c.to_dict()}))
    if values:
        worst = max(values, key=_badness)
        sets_bad = sorted({c.input_set for c in values})
        st.fail(error(
            "OM601", "compare",
            f"output {worst.name} differs from PyTorch on input set(s) {', '.join(sets_bad)}: "
            + (worst.reason if worst.rule in (RULE_BUDGET, RULE_DETECTIONS) else
               f"{worst.mismatched} of {worst.total} elements outside rtol={worst.rtol:g}, "
               f"atol={worst.atol:.3g}" + (" (scaled normwise rule)"
                                            if worst.rule == RULE_NORMWISE else ""))
            + f" (max abs error {worst.max_abs:.3g}, max rel error {worst.max_rel:.3g}).",
            suggestion="Run `onnxmedic verify --localize` to find the first operator whose "
            "output diverges.", details={"comparison": worst.to_dict()}))
    unstable = sorted({c.name for c in result.verification if c.unstable})
    if unstable:
        c = max((c for c in result.verification if c.unstable), key=lambda c: c.torch_error)
        result.findings.append(warning(
            "OM604", "compare", f"the model is numerically unstable on the input: PyTorch's "
            f"own float32 output {c.name} ({c.input_set}) is {c.torch_error:.2g} off its "
            f"float64 result (relative, normwise); output(s) {', '.join(unstable)}. ONNX "
            "Runtime was judged against the float64 run with the usual budget.",
            suggestion="The float32 results of this model are only as good as its "
            "conditioning allows; consider float64 or a more stable formulation.",
            details={"outputs": unstable}))
    st.passed()
    return values


def _badness(c: OutputComparison) -> tuple[float, float]:
    return (c.ratio if c.ratio is not None else 0.0, c.max_rel)


# -- the two callers ----------------------------------------------------------------------------
def verify_stage(ctx: ExportContext) -> bool:
    """Export's runtime + compare stages (or OM603 when verification is off); sets
    ``ctx.verified``. A GPU-target model with no CPU kernel on a machine without the GPU is
    verified through a CPU stand-in (stages/fix.py)."""
    result, opts = ctx.result, ctx.opts
    if not opts.verify:
        ctx.verified = True  # verification not asked for: exported is all we can say
        result.findings.append(warning(
            "OM603", "compare", "verification was turned off (verify=False); the model "
            "was not run in ONNX Runtime."))
        result.ok = True
        return True
    decomposed = getattr(ctx.onnx_program, "exported_program", None)
    program = ctx.program
    stand_in_dir = Path(tempfile.mkdtemp(prefix=".onnxmedic-cpu-"))
    try:
        stand_in = cpu_stand_in(result, ctx.onnx_path, stand_in_dir, opts.target)
        localizer = (Localizer(False, lambda: (decomposed or program, decomposed is not None))
                     if opts.localize and not stand_in else None)
        applied = run_and_compare(
            result, ctx.judged_against or ctx.model, stand_in[0] if stand_in else ctx.onnx_path,
            stand_in[1] if stand_in else result.onnx_model, ctx.example, ctx.expected,
            opts.timeout, opts.tolerance, ctx.worker, opts.target, localizer=localizer,
            probe_branches=ctx.branch_probe, rules=guard_rules(ctx),
            probe_masks=ctx.mask_probe)
    finally:
        shutil.rmtree(stand_in_dir, ignore_errors=True)
    ctx.verified = result.stages.get("compare") == PASSED
    if ctx.verified and applied and ctx.onnx_path is not None:
        append_metadata(ctx.onnx_path, result.onnx_model, applied)
    if ctx.verified and ctx.onnx_path is not None and not stand_in:
        isa.record_session_config(ctx.onnx_path, result.onnx_model, result.findings)
    result.ok = ctx.verified
    return True


def guard_rules(ctx: ExportContext) -> dict[str, SizeRule]:
    """The size rules torch.export's guards on the captured program set the ONNX model's
    dynamic dims (verify/size_rules.py), with the lines that added them; {} when none."""
    if ctx.program is None or isinstance(ctx.model, torch.export.ExportedProgram):
        return {}
    from onnxmedic._torch_compat import export_guards
    from onnxmedic.capture.strategies import guard_locations

    guards = export_guards(ctx.program)
    if not guards or _no_dynamic_dims(ctx.result.onnx_model):
        return {}
    _, onnx_dims, _ = graph_io(ctx.result.onnx_model)
    try:
        return rules_from_guards(guards, ctx.model, ctx.args, ctx.kwargs,
                                 dim_symbols(ctx.example, onnx_dims),
                                 guard_locations(ctx.size_guards))
    except Exception:  # a reading of torch's guards must never fail the export
        logger.debug("size rules from guards failed", exc_info=True)
        return {}


def _no_dynamic_dims(proto: Any) -> bool:
    """True when no graph input has a dynamic dim."""
    _, dims, _ = graph_io(proto)
    return not any(not isinstance(d, int) for ds in dims for d in ds)


def verify_file(result: ExportResult, proto: Any, path: Path, model: Any,
                inputs: Inputs, timeout: float, tolerance: tuple[float, float] | None,
                worker: sandbox.Runner, localize: bool = False,
                loc_worker: sandbox.Runner | None = None) -> None:
    """The verify command on a loaded file: check, preflight, runtime, compare (and
    localisation, with ``localize``)."""
    with result.stage("check") as st:
        found = checks.check_model(proto)
        st.add(*found)
        if any(x.severity == Severity.ERROR for x in found):
            st.fail()
            return
    program = model
    if isinstance(model, torch.export.ExportedProgram):
        model = model.module()  # unlifted once, not once per input set (slow for big graphs)
    # a torch.ao quantized model runs in PyTorch: a file is judged against its own run
    expected = preflight_stage(result, model, inputs.args, inputs.kwargs, quantized_ok=True)
    if expected is None:
        return
    localizer = (Localizer(True, lambda: program_for(program, inputs),
                           None if program is not model else model, loc_worker)
                 if localize else None)
    declared = rules_from_metadata(proto)
    if declared:
        result.findings.append(info(
            "OM409", "compare", "the file declares size rules for its dynamic dims ("
            + "; ".join(f"{k}: {r.describe()}" for k, r in sorted(declared.items()))
            + "); other sizes were not checked.", details={k: r.to_dict()
                                                           for k, r in declared.items()}))
    run_and_compare(result, model, path, proto, inputs, expected, timeout, tolerance, worker,
                    localizer=localizer, rules=declared, only_allowed=True)
    result.ok = result.stages.get("compare") == PASSED


def program_for(model: Any, inputs: Inputs) -> tuple[Any, bool] | None:
    """(ExportedProgram, already decomposed?) of ``model`` for localisation, or None."""
    if isinstance(model, torch.export.ExportedProgram):
        return model, False
    attempts = capture(model, inputs.args, inputs.kwargs, None)
    program = attempts[-1].program if attempts else None
    return (program, False) if program is not None else None
