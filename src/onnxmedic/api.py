"""The public API: export() and verify(). The CLI is a thin shell over these."""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import onnx
import torch

from onnxmedic import checks, preflight, sandbox
from onnxmedic import inputs as inputs_mod
from onnxmedic._tensors import flatten_tensors, to_numpy
from onnxmedic.capture import capture, classify_capture_error
from onnxmedic.findings import (
    Finding,
    OnnxMedicError,
    ResultCodes,
    Severity,
    error,
    info,
    warning,
)
from onnxmedic.sweep import SweepResult, ZooCase, sweep  # sweep(): a zoo, in worker processes
from onnxmedic.verify.compare import OutputComparison, compare_outputs

logger = logging.getLogger(__name__)

TARGETS = ("cpu", "cuda", "tensorrt")
STAGES = ("preflight", "capture", "translate", "check", "fix", "runtime", "compare", "write")
NOT_RUN, PASSED, FAILED = "not run", "passed", "failed"

# Models whose initializers exceed this many bytes are saved with external data (protobuf
# cannot hold more than 2 GiB). A module attribute so tests can lower it.
EXTERNAL_DATA_THRESHOLD = 2 * 1024**3 - 64 * 1024**2

# How many input sets beyond the example verification uses.
EXTRA_INPUT_SETS = 2


@dataclass
class ExportResult(ResultCodes):
    """The outcome of export() or verify(). ``ok``: exported *and* verified."""

    ok: bool = False
    path: str | None = None
    findings: list[Finding] = field(default_factory=list)
    stages: dict[str, str] = field(default_factory=lambda: {s: NOT_RUN for s in STAGES})
    verification: list[OutputComparison] = field(default_factory=list)
    attempts: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    command: str = "export"
    model: str | None = None
    inputs: list[str] = field(default_factory=list)
    used_translations: list[str] = field(default_factory=list)
    inventory: list[dict[str, Any]] = field(default_factory=list)  # with explain=True
    opset: int | None = None
    traceback: str | None = None
    onnx_model: Any = None  # the onnx.ModelProto (in memory; not serialised)
    program: Any = None  # the captured ExportedProgram, when there is one
    localization: Any = None  # verify.localize.Localization, when localisation ran
    optimization: Any = None  # optimize.OptimizationResult, with export(optimize=True)

    @property
    def failed_stage(self) -> str | None:
        return next((s for s, v in self.stages.items() if v == FAILED), None)

    def verification_summary(self) -> dict[str, dict[str, float]]:
        """Per output: the worst max abs / rel error over all input sets."""
        out: dict[str, dict[str, float]] = {}
        for c in self.verification:
            d = out.setdefault(c.name, {"max_abs": 0.0, "max_rel": 0.0, "ok": True})
            d["max_abs"] = max(d["max_abs"], c.max_abs)
            d["max_rel"] = max(d["max_rel"], c.max_rel)
            d["ok"] = d["ok"] and c.ok
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "exit_code": self.exit_code,
            "command": self.command,
            "path": self.path,
            "model": self.model,
            "inputs": self.inputs,
            "opset": self.opset,
            "stages": dict(self.stages),
            "failed_stage": self.failed_stage,
            "findings": [f.to_dict() for f in self.findings],
            "verification": [c.to_dict() for c in self.verification],
            "verification_summary": self.verification_summary(),
            "capture_attempts": self.attempts,
            "used_translations": self.used_translations,
            "inventory": self.inventory,
            "timings": {k: round(v, 4) for k, v in self.timings.items()},
            "traceback": self.traceback,
            "localization": self.localization.to_dict() if self.localization else None,
            "optimization": self.optimization.to_dict() if self.optimization else None,
        }


VerifyResult = ExportResult
__all__ = ["ExportResult", "RunResult", "SweepResult", "VerifyResult", "ZooCase", "doctor",
           "export", "run", "sweep", "verify"]


@contextmanager
def _stage(result: ExportResult, name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        result.timings[name] = result.timings.get(name, 0.0) + time.perf_counter() - t0


def _fail(result: ExportResult, stage: str, *findings: Finding) -> ExportResult:
    result.stages[stage] = FAILED
    result.findings.extend(findings)
    result.ok = False
    return result


@contextmanager
def _guard(result: ExportResult) -> Iterator[None]:
    """Problems become findings: an OnnxMedicError its own, any other exception (onnxmedic's
    bug) OM009 with the traceback kept for the report. Ctrl-C is not caught."""
    try:
        yield
    except OnnxMedicError as e:
        result.findings.append(e.finding)
        result.ok = False
    except Exception as e:
        result.traceback = traceback.format_exc()
        result.findings.append(error("OM009", result.failed_stage or "internal",
                                     f"onnxmedic failed internally: {type(e).__name__}: {e}",
                                     suggestion="Please file a bug with the report attached."))
        result.ok = False


@contextmanager
def _nothing() -> Iterator[None]:
    yield None


def _check_args(model: Any, args: Any, kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if not isinstance(model, (torch.nn.Module, torch.export.ExportedProgram)):
        raise TypeError(f"onnxmedic.export: model must be a torch.nn.Module or an "
                        f"ExportedProgram, not {type(model).__name__}")
    if isinstance(args, torch.Tensor):
        args = (args,)
    if isinstance(args, list):
        args = tuple(args)
    if not isinstance(args, tuple):
        raise TypeError(f"onnxmedic.export: args must be a tuple of example inputs, e.g. (x,), "
                        f"not {type(args).__name__}")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise TypeError(f"onnxmedic.export: kwargs must be a dict, not {type(kwargs).__name__}")
    return args, kwargs


def _report_problem(result: ExportResult, report: str | os.PathLike[str] | None) -> bool:
    """Fail fast when the report cannot be written where asked (nothing else runs)."""
    if report is None:
        return False
    from onnxmedic.report.files import report_path_problem

    bad = report_path_problem(report)
    if bad is not None:
        result.findings.append(bad)
        result.ok = False
    return bad is not None


def _check_output_path(f: str | os.PathLike[str] | None, stage: str = "write") -> Finding | None:
    """Fail fast (before the slow stages) when the output cannot be written."""
    if f is None:
        return None
    p = Path(f)
    if p.is_dir():
        return error("OM006", stage, f"output path {str(f)!r} is a folder.",
                     suggestion="Give a file name such as model.onnx.")
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        return error("OM006", stage, f"the folder {str(folder)!r} for the output does not exist.",
                     suggestion=f"Create it first (mkdir -p {folder}) or choose another path.")
    if not os.access(folder, os.W_OK | os.X_OK):
        return error("OM006", stage, f"the folder {str(folder)!r} is not writable.",
                     suggestion="Choose an output path you can write to.")
    if p.exists() and not os.access(p, os.W_OK):
        return error("OM006", stage, f"the existing file {str(f)!r} is not writable.")
    return None


def _feeds(onnx_inputs: list[str], args: tuple[Any, ...], kwargs: dict[str, Any]
           ) -> dict[str, np.ndarray]:
    """Flatten (args, kwargs) like torch.onnx does and map them onto the ONNX inputs."""
    leaves = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if x is not None]
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    values = leaves if len(leaves) == len(onnx_inputs) else tensors
    if len(values) != len(onnx_inputs):
        raise OnnxMedicError(error(
            "OM008", "runtime", f"the ONNX model has {len(onnx_inputs)} input(s) "
            f"({', '.join(onnx_inputs)}) but {len(tensors)} tensor(s) were given.",
            suggestion="Give one --input per model input, in the order of forward()'s "
            "parameters."))
    return {n: to_numpy(v) for n, v in zip(onnx_inputs, values)}


def _expected(model: Any, sets: list[inputs_mod.Inputs]) -> list[list[np.ndarray]]:
    fn = model.module() if isinstance(model, torch.export.ExportedProgram) else model
    out = []
    with torch.no_grad():
        for s in sets:
            out.append([to_numpy(t) for t in flatten_tensors(fn(*s.args, **s.kwargs))])
    return out


def _graph_io(proto: Any) -> tuple[list[str], list[list[int | str | None]], list[str]]:
    """ONNX input names, their dims (int, dim_param or None), and output names."""
    inits = {i.name for i in proto.graph.initializer}
    ins = [v for v in proto.graph.input if v.name not in inits]
    dims = []
    for v in ins:
        shape = v.type.tensor_type.shape.dim if v.type.HasField("tensor_type") else []
        dims.append([d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                     for d in shape])
    return [v.name for v in ins], dims, [o.name for o in proto.graph.output]


def _attach_node(proto: Any, finding: Finding, message: str) -> None:
    """Point a runtime finding at the ONNX node its message names: op, the user's line, and the
    node's neighbourhood in the graph (for the report)."""
    from onnxmedic._locate import location_from_onnx_node, onnx_neighbourhood, onnx_node_in_error

    node = onnx_node_in_error(proto, message)
    if node is None:
        return
    finding.op = finding.op or node.op_type
    finding.location = finding.location or location_from_onnx_node(node)
    try:
        finding.details["neighbourhood"] = onnx_neighbourhood(proto, node)
    except Exception:  # a report nicety: never fail the run for it
        logger.debug("no neighbourhood", exc_info=True)


def _runtime_stage(result: ExportResult, sbx: sandbox.SandboxResult, target: str,
                   timeout: float) -> bool:
    """Record the runtime stage from a sandbox result: failed (with its finding), or passed
    (with OM535 when ONNX Runtime fell back from the target's provider). True when passed."""
    if not sbx.ok:
        finding = sbx.finding("runtime", timeout)
        if finding is not None and finding.code in ("OM510", "OM511"):
            _attach_node(result.onnx_model, finding, finding.details.get("error", ""))
        _fail(result, "runtime", finding)
        return False
    result.stages["runtime"] = PASSED
    fallback = sbx.provider_finding(_providers(target))
    if fallback is not None:
        result.findings.append(fallback)
    if sbx.providers and sbx.providers[0] == "CUDAExecutionProvider":
        result.findings.append(info(
            "OM536", "runtime", "ran on ONNX Runtime's CUDA provider with use_tf32=0 (full "
            "float32 MatMul/Gemm/Conv, as PyTorch computes by default). With the provider's "
            "default TF32 math, float32 results differ from PyTorch by about 1e-4 to 1e-3 "
            "relative.", suggestion="For PyTorch's float32 numbers in deployment, create the "
            "session with providers=[('CUDAExecutionProvider', {'use_tf32': '0'})]; keep the "
            "default for speed if that precision is enough."))
    return True


def _run_and_compare(result: ExportResult, model: Any, onnx_path: Path, proto: Any,
                     example: inputs_mod.Inputs, example_expected: list[np.ndarray] | None,
                     timeout: float, tolerance: tuple[float, float] | None,
                     worker: sandbox.Worker | None = None, target: str = "cpu",
                     localizer: Any = None, probe_branches: bool = False) -> None:
    """runtime + compare stages, in one sandboxed session: the example, two further input sets
    of the same shapes, and - for each dynamic dim of the ONNX model - sizes 1 and 2x.

    ``localizer``: a ``_Localizer``; localisation runs on a value mismatch (OM601), or always
    when ``always``, with the program ``get_program()`` returns (None: skipped). With
    ``module`` (the nn.Module verified), the program is first rebuilt from the ONNX file's own
    metadata, and captured only where that fails (see verify/replay.py)."""
    onnx_inputs, onnx_dims, onnx_outputs = _graph_io(proto)
    sets = [example] + inputs_mod.derived_input_sets(example, EXTRA_INPUT_SETS)
    labels = ["example"] + [f"random#{i}" for i in range(1, len(sets))]
    if probe_branches:  # a data-dependent branch was specialised: try to take the others
        for probe in inputs_mod.branch_probe_sets(example):
            try:  # a probe PyTorch itself rejects (an index now out of range) is left out
                _expected(model, [probe])
            except Exception as e:
                result.findings.append(info(
                    "OM403", "compare", f"branch probe {probe.specs[-1]!r} not checked: PyTorch "
                    f"rejects it ({type(e).__name__}: {str(e).strip()[:160]})."))
                continue
            sets.append(probe)
            labels.append(probe.specs[-1])
    with _stage(result, "compare"):
        expected = ([example_expected] if example_expected is not None else
                    _expected(model, sets[:1]))
        try:
            expected += _expected(model, sets[1:])
        except Exception as e:  # the derived data may be out of the model's domain
            result.findings.append(warning(
                "OM603", "compare", f"PyTorch rejected the generated input sets "
                f"({type(e).__name__}: {str(e)[:200]}); verifying on the example only."))
            sets, labels = sets[:1], labels[:1]
        n_required = len(sets)
        for label, variant in inputs_mod.shape_variants(example, onnx_dims):
            try:
                expected += _expected(model, [variant])
            except Exception as e:
                result.findings.append(info(
                    "OM403", "compare", f"not checked at {label}: PyTorch itself rejects that "
                    f"size ({type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''})."))
                continue
            sets.append(variant)
            labels.append(label)
    with _stage(result, "runtime"):
        try:
            feeds = [_feeds(onnx_inputs, s.args, s.kwargs) for s in sets]
        except OnnxMedicError as e:
            _fail(result, "runtime", e.finding)
            return
        providers = _providers(target)
        if worker is None:
            sbx = sandbox.run_model(onnx_path, feeds, timeout=timeout, providers=providers)
        else:
            sbx = worker.run(onnx_path, feeds, timeout=timeout, n_required=n_required,
                             providers=providers)
    if not _runtime_stage(result, sbx, target, timeout):
        return
    shape_failures: list[Finding] = []
    with _stage(result, "compare"):
        names = sbx.output_names or onnx_outputs
        for i, (label, exp, act) in enumerate(zip(labels, expected, sbx.outputs)):
            if i in sbx.run_errors:
                shape_failures.append(_shape_finding(proto, label, sbx.run_errors[i]))
                continue
            comps = compare_outputs(names, exp, act, input_set=label, tolerance=tolerance)
            result.verification.extend(comps)
            bad = [c for c in comps if not c.ok]
            if i >= n_required and bad:
                shape_failures.append(error(
                    "OM402", "compare", f"at {label} the ONNX model computes output "
                    f"{bad[0].name} wrong ({bad[0].reason}; max abs error "
                    f"{bad[0].max_abs:.3g}) although it is right at the example's size.",
                    suggestion="An op baked the example's size in (a constant shape in a "
                    "Reshape/Expand, a size read with int()); use x.shape[...] arithmetic "
                    "or -1 in view/reshape.", details={"comparison": bad[0].to_dict()}))
    if shape_failures:
        _fail(result, "compare", *shape_failures)
    req = [c for c in result.verification
           if c.input_set in labels[:n_required] and not c.ok]
    structural = [c for c in req if c.reason and any(
        w in c.reason for w in ("shape", "dtype", "missing", "extra"))]
    values = [c for c in req if c not in structural]
    if structural:
        c = structural[0]
        _fail(result, "compare", error(
            "OM602", "compare", f"output {c.name} ({c.input_set}): {c.reason}.",
            suggestion="An output's shape or dtype differs from PyTorch: check dynamic dims "
            "and dtype casts around this output.",
            details={"comparison": c.to_dict()}))
    if values:
        worst = max(values, key=lambda c: c.max_rel)
        sets_bad = sorted({c.input_set for c in values})
        _fail(result, "compare", error(
            "OM601", "compare",
            f"output {worst.name} differs from PyTorch on input set(s) {', '.join(sets_bad)}: "
            f"{worst.mismatched} of {worst.total} elements outside rtol={worst.rtol:g}, "
            f"atol={worst.atol:g} (max abs error {worst.max_abs:.3g}, max rel error "
            f"{worst.max_rel:.3g}).",
            suggestion="Run `onnxmedic verify --localize` to find the first operator whose "
            "output diverges.", details={"comparison": worst.to_dict()}))
    if not structural and not values and not shape_failures:
        result.stages["compare"] = PASSED
    if localizer is not None and (values or localizer.always):
        label = ("example" if not values or "example" in {c.input_set for c in values}
                 else worst.input_set)
        k = labels.index(label) if label in labels else 0
        _localize_stage(result, proto, localizer.get_program, sets[k], feeds[k], timeout,
                        tolerance, labels[k], module=localizer.module, reference=expected[k],
                        worker=localizer.worker)


class _Localizer(NamedTuple):
    """When and on what _run_and_compare localises (see there)."""

    always: bool
    get_program: Any
    module: Any = None
    worker: sandbox.Worker | None = None


def _localize_stage(result: ExportResult, proto: Any, get_program: Any,
                    inputs: inputs_mod.Inputs, feeds: dict[str, np.ndarray], timeout: float,
                    tolerance: tuple[float, float] | None, label: str,
                    module: Any = None, reference: list[np.ndarray] | None = None,
                    worker: sandbox.Worker | None = None) -> None:
    """Localise the divergence on one input set; its findings join the result's.

    ``module``: the nn.Module whose outputs are ``reference`` on ``inputs``; localisation then
    first runs on the program rebuilt from the ONNX file (no capture), and captures only when
    that program cannot be rebuilt or does not compute ``reference``. ``worker``: a sandbox
    worker started ahead (it is closed here, used or not)."""
    from onnxmedic.verify import localize as loc_mod

    with _stage(result, "localize"):
        # it imports ONNX Runtime while the program is rebuilt or captured
        worker = worker if worker is not None else sandbox.Worker()
        if module is not None and reference is not None:
            loc, worker = _localize_replayed(proto, module, inputs, feeds, timeout, tolerance,
                                             label, reference, worker)
            if loc is not None:
                _add_localization(result, loc)
                return
        try:
            got = get_program()
        except BaseException:
            worker.close()
            raise
        if got is None:
            worker.close()
            result.findings.append(warning(
                "OM611", "localize", "no localisation: the model could not be captured with "
                "torch.export, so there are no FX nodes to compare with.",
                suggestion="Fix the capture findings first (onnxmedic export MODEL)."))
            return
        program, decomposed = got
        try:
            loc = loc_mod.localize(proto, program, inputs.args, inputs.kwargs, feeds=feeds,
                                   tolerance=tolerance, timeout=timeout, input_set=label,
                                   decomposed=decomposed, worker=worker)
        except Exception as e:  # localisation explains; it must never break the verdict
            worker.close()
            logger.debug("localisation failed", exc_info=True)
            result.findings.append(warning(
                "OM611", "localize", f"localisation failed ({type(e).__name__}: "
                f"{str(e)[:300]}); the verification result stands.",
                suggestion="Please report it to onnxmedic with the model."))
            return
    _add_localization(result, loc)


def _localize_replayed(proto: Any, module: Any, inputs: inputs_mod.Inputs,
                       feeds: dict[str, np.ndarray], timeout: float,
                       tolerance: tuple[float, float] | None, label: str,
                       reference: list[np.ndarray], worker: sandbox.Worker
                       ) -> tuple[Any, sandbox.Worker]:
    """Localisation on the program rebuilt from the ONNX file, or None (and a live worker
    for the capture that follows) where it cannot be rebuilt or does not compute the model's
    outputs."""
    from onnxmedic.verify import localize as loc_mod
    from onnxmedic.verify.replay import NotReplayable, replay_program

    try:
        replayed = replay_program(proto, module, feeds)
    except NotReplayable as e:
        logger.debug("localisation captures: the ONNX file's program is incomplete: %s", e)
        return None, worker
    except Exception as e:  # a bug of the rebuild must not cost the localisation
        logger.debug("localisation captures: rebuilding failed: %s", e, exc_info=True)
        return None, worker
    try:
        loc = loc_mod.localize(proto, replayed, inputs.args, inputs.kwargs, feeds=feeds,
                               tolerance=tolerance, timeout=timeout, input_set=label,
                               worker=worker, reference=reference)
    except Exception as e:  # NotReplayable, or a bug: capture as before
        logger.debug("localisation captures: the rebuilt program failed: %s", e)
        worker.close()  # used (or closed) by localize(): a fresh one for the capture path
        return None, sandbox.Worker()
    return loc, worker


def _add_localization(result: ExportResult, loc: Any) -> None:
    result.localization = loc
    # OM610 is an error only where the result already failed: it explains the mismatch
    for f in loc.findings:
        if f.code == "OM610" and result.stages.get("compare") == PASSED:
            f.severity = Severity.WARNING
        result.findings.append(f)


def _shape_finding(proto: Any, label: str, message: str) -> Finding:
    """OM402 for a run that fails at another size, pointing at the op that baked it in."""
    from onnxmedic._locate import location_from_onnx_node, onnx_neighbourhood, onnx_node_in_error

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


def _preflight(result: ExportResult, model: Any, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> list[np.ndarray] | None:
    """The preflight stage: the example's outputs in PyTorch, or None (and a finding)."""
    with _stage(result, "preflight"):
        pre = preflight.run(model, args, kwargs)
    if not pre.ok:
        _fail(result, "preflight", pre.finding)
        return None
    result.stages["preflight"] = PASSED
    return [to_numpy(t) for t in flatten_tensors(pre.outputs)]


def _save_program(prog: Any, folder: Path, name: str) -> Path:
    import onnx_ir as ir
    from torch.onnx._internal.exporter import _onnx_program

    size = _onnx_program._count_initializer_size(prog.model.graph)
    target = folder / name
    if size > EXTERNAL_DATA_THRESHOLD:
        ir.save(prog.model, target, external_data=f"{name}.data")
    else:
        ir.save(prog.model, target)
    return target


def _publish(tmp_dir: Path, name: str, dest: Path) -> None:
    """Move the model (and its external data) into place; the model file goes last."""
    files = sorted(tmp_dir.iterdir(), key=lambda p: p.name == name)
    for p in files:
        os.replace(p, dest.parent / p.name if p.name != name else dest)


def export(
    model: torch.nn.Module | torch.export.ExportedProgram,
    args: tuple[Any, ...] = (),
    f: str | os.PathLike[str] | None = None,
    *,
    kwargs: dict[str, Any] | None = None,
    dynamic_shapes: Any = None,
    target: str = "cpu",
    opset: int | None = None,
    verify: bool = True,
    report: str | os.PathLike[str] | None = None,
    keep_unverified: bool = False,
    timeout: float = sandbox.DEFAULT_TIMEOUT,
    tolerance: tuple[float, float] | None = None,
    explain: bool = False,
    model_spec: str | None = None,
    input_specs: list[str] | None = None,
    dtype_policy: str = "upcast",
    ort_version: str | None = None,
    localize: bool = True,
    optimize: bool = False,
    precision: str = "fp32",
) -> ExportResult:
    """Export ``model`` to ONNX, verify it in an isolated ONNX Runtime, and report.

    With ``optimize`` (and ``f``), the verified file is replaced by the fastest candidate
    variant at ``precision`` (fp32 or int8) that verifies too; see :mod:`onnxmedic.optimize`.

    When the outputs differ from PyTorch (OM601) and ``localize`` is on, the first divergent
    node is localised (OM610); this costs nothing when the model verifies.

    Problems of the model become findings in the returned :class:`ExportResult` (``ok`` is True
    only when the model was exported *and* verified). With ``f``, the file is written atomically
    and only when verified (or when ``keep_unverified``); an existing file is never replaced by
    an unverified model. ``report`` writes a .json or .html report, whatever the outcome.
    ``dtype_policy`` (upcast, boundary or keep) says how nodes without a kernel on ``target``
    for their dtype (bfloat16 Gemm on CPU) are repaired; see :mod:`onnxmedic.fixes.dtypes`.
    """
    args, kwargs = _check_args(model, args, kwargs)
    if target not in TARGETS:
        raise ValueError(f"onnxmedic.export: target must be one of {', '.join(TARGETS)}, not "
                         f"{target!r}")
    if dtype_policy not in ("keep", "upcast", "boundary"):
        raise ValueError("onnxmedic.export: dtype_policy must be 'keep', 'upcast' or "
                         f"'boundary', not {dtype_policy!r}")
    ort = _ort_version(ort_version, "export")
    result = ExportResult(command="export", model=model_spec or type(model).__name__,
                          inputs=list(input_specs or []))
    if _report_problem(result, report):
        return result
    was_training = isinstance(model, torch.nn.Module) and model.training
    try:
        with _guard(result):
            if was_training:
                model.eval()
                result.findings.append(info(
                    "OM011", "preflight", "the model was in training mode; it is exported and "
                    "verified in eval mode (call model.eval() first to silence this)."))
            # the sandbox child imports ONNX Runtime while capture and translation run
            with sandbox.Worker() if verify else _nothing() as worker:
                _export(result, model, args, kwargs, f, dynamic_shapes=dynamic_shapes,
                        target=target, opset=opset, verify=verify,
                        keep_unverified=keep_unverified, timeout=timeout, tolerance=tolerance,
                        worker=worker, explain=explain, dtype_policy=dtype_policy,
                        ort_version=ort, localize=localize)
            if optimize:  # hook (issue 17): optimize the verified, written export in place
                from onnxmedic.optimize import attach_to_export

                attach_to_export(result, model, args, kwargs, precision=precision,
                                 target=target, timeout=timeout)
    finally:
        if was_training:
            model.train(True)
    if report is not None:
        from onnxmedic.report import write_report

        write_report(result, report)
    return result


def _export(result: ExportResult, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
            f: Any, *, dynamic_shapes: Any, target: str, opset: int | None, verify: bool,
            keep_unverified: bool, timeout: float, tolerance: tuple[float, float] | None,
            worker: sandbox.Worker | None, explain: bool = False,
            dtype_policy: str = "upcast", ort_version: tuple[int, int] | None = None,
            localize: bool = True) -> None:
    from onnxmedic import translate as translate_mod
    from onnxmedic.fixes import opset as opset_fix

    bad_out = _check_output_path(f)
    if bad_out is not None:
        _fail(result, "write", bad_out)
        return
    if ort_version is not None:
        lim = opset_fix.limits(ort_version)
        if lim is None:
            _fail(result, "translate", error(
                "OM322", "translate", f"ONNX Runtime {'.'.join(map(str, ort_version))} is "
                "older than 1.0; onnxmedic cannot target it."))
            return
        if opset is not None and opset > lim[0]:
            _fail(result, "translate", error(
                "OM322", "translate", f"opset {opset} was asked for, but ONNX Runtime "
                f"{'.'.join(map(str, ort_version))} loads opsets up to {lim[0]}.",
                suggestion=f"Use --opset {lim[0]} or lower, or a newer ONNX Runtime."))
            return
    explicit_opset = opset is not None
    if opset is None:  # the highest opset the target supports
        opset, opset_bound = opset_fix.choose_opset(target, ort_version)
    else:
        opset_bound = "asked for"
    example = inputs_mod.Inputs(args, kwargs)
    example_expected = _preflight(result, model, args, kwargs)
    if example_expected is None:
        return

    str_dims = None
    auto = dynamic_shapes == inputs_mod.AUTO
    branch_probe = False
    with _stage(result, "capture"):
        if isinstance(model, torch.export.ExportedProgram):
            program = model
            result.attempts = [{"strategy": "given ExportedProgram", "ok": True,
                                "seconds": 0.0, "error": None}]
        else:
            from torch.onnx._internal.exporter import _dynamic_shapes

            if dynamic_shapes == inputs_mod.AUTO or inputs_mod.is_dynamic_axes(dynamic_shapes):
                dynamic_shapes = inputs_mod.complete_dynamic_shapes(
                    model, dynamic_shapes if dynamic_shapes == inputs_mod.AUTO else
                    inputs_mod.dynamic_axes_to_specs(dynamic_shapes), args, kwargs)
            export_dims, need_rename = _dynamic_shapes.convert_str_to_export_dim(dynamic_shapes)
            str_dims = dynamic_shapes if need_rename else None
            attempts = capture(model, args, kwargs, export_dims)
            if attempts[-1].program is None and export_dims is not None:
                attempts += _refined_capture(result, model, args, kwargs, export_dims, attempts)
            result.attempts = [a.summary() for a in attempts]
            program = attempts[-1].program
            if program is None:
                _fail(result, "capture", classify_capture_error(attempts))
                return
            if "draft_export" in attempts[-1].strategy:
                result.findings.append(_specialised_finding(attempts))
                branch_probe = True
            if _pytree_findings(result, attempts):
                # the example's outputs were flattened before these types were registered
                example_expected = None
            for a in attempts[:-1]:
                result.findings.append(info(
                    "OM110", "capture", f"{a.strategy} failed ({a.summary()['error']}); "
                    f"{attempts[-1].strategy} worked."))
    result.stages["capture"] = PASSED
    result.program = program
    if explain:
        with _stage(result, "explain"):
            try:
                result.inventory = translate_mod.op_inventory(program, opset=opset)
            except Exception as e:  # the translate stage reports decomposition failures
                logger.debug("op inventory failed: %s", e)

    with _stage(result, "translate"):
        tr = translate_mod.translate(program, args, kwargs, opset=opset)
    result.findings.extend(tr.findings)
    if not tr.ok:
        result.stages["translate"] = FAILED
        result.ok = False
        return
    result.stages["translate"] = PASSED
    result.used_translations = tr.used_translations
    prog = tr.onnx_program
    if str_dims is not None:
        try:
            prog._rename_dynamic_axes(str_dims)
        except Exception:
            logger.debug("could not rename dynamic axes", exc_info=True)
    from onnxmedic.fixes.shapes import static_dim_params

    if static_dim_params(prog.model):
        logger.debug("numeric dim_params made static")
    if ort_version is not None:
        _fit_ir_version(result, prog, ort_version, opset)
    try:  # what localisation needs to rebuild the program from the file (verify --localize)
        from onnxmedic.verify.replay import record_removed_nodes

        record_removed_nodes(prog)
    except Exception:
        logger.debug("the FX nodes the optimizer removed were not recorded", exc_info=True)
    result.onnx_model = prog.model_proto
    result.opset = next((o.version for o in result.onnx_model.opset_import if o.domain in
                         ("", "ai.onnx")), None)
    if not _opset_stage(result, opset, explicit_opset, opset_bound):
        return
    if auto:
        _report_auto_dims(result, args, kwargs)

    dest = Path(f) if f is not None else None
    parent = dest.parent if dest is not None else None
    tmp_dir = Path(tempfile.mkdtemp(prefix=".onnxmedic-", dir=parent))
    try:
        name = dest.name if dest is not None else "model.onnx"
        with _stage(result, "write"):
            try:
                onnx_path = _save_program(prog, tmp_dir, name)
            except OSError as e:
                _fail(result, "write", error("OM006", "write", f"cannot write the model: {e}"))
                return
        with _stage(result, "check"):
            check_findings = checks.check_file(onnx_path)
        result.findings.extend(check_findings)
        if any(x.severity == Severity.ERROR for x in check_findings):
            result.stages["check"] = FAILED
            _not_written(result, f)
            return
        result.stages["check"] = PASSED
        if not _fix_dtypes(result, prog, tmp_dir, name, target, dtype_policy):
            _not_written(result, f)
            return
        if verify:
            decomposed = getattr(prog, "exported_program", None)
            stand_in_dir = Path(tempfile.mkdtemp(prefix=".onnxmedic-cpu-"))
            try:
                stand_in = _cpu_stand_in(result, onnx_path, stand_in_dir, target)
                _run_and_compare(result, model, stand_in[0] if stand_in else onnx_path,
                                 stand_in[1] if stand_in else result.onnx_model, example,
                                 example_expected, timeout, tolerance, worker, target,
                                 localizer=_Localizer(False, lambda: (decomposed or program,
                                                                      decomposed is not None))
                                 if localize and not stand_in else None,
                                 probe_branches=branch_probe)
            finally:
                shutil.rmtree(stand_in_dir, ignore_errors=True)
            verified = result.stages["compare"] == PASSED
        else:
            verified = True  # verification not asked for: exported is all we can say
            result.findings.append(warning(
                "OM603", "compare", "verification was turned off (verify=False); the model "
                "was not run in ONNX Runtime."))
        result.ok = verified
        if dest is not None:
            if verified or keep_unverified:
                with _stage(result, "write"):
                    _publish(tmp_dir, name, dest)
                result.path = str(dest)
                result.stages["write"] = PASSED
                if not verified:
                    result.findings.append(warning(
                        "OM010", "write", f"{dest} was written although verification failed "
                        "(keep_unverified=True)."))
            else:
                _not_written(result, f)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


_DTYPE_FIX = ("Export with dtype_policy='upcast' (--dtype-policy upcast: these nodes compute in "
              "float32 between casts) or 'boundary' (the whole graph in float32, casts at its "
              "inputs and outputs), or cast the model to float32 yourself.")


def kernel_gap_finding(g: Any, target: str, node: Any, stage: str,
                       model: Any = None) -> Finding:
    """OM301 (no kernel) or OM303 (mixed int/float) for one node, with the user's line."""
    from onnxmedic._locate import location_from_onnx_node, onnx_neighbourhood

    if g.kind != "no-kernel":
        what = "its inputs mix integer and float types."
    elif target == "tensorrt":
        what = (f"TensorRT does not take it ({g.detail}), and ONNX Runtime has no CUDA or CPU "
                "kernel for it either.")
    else:
        what = f"ONNX Runtime has no {target} kernel for it."
    return Finding("OM301" if g.kind == "no-kernel" else "OM303", stage, Severity.ERROR,
                   f"{g.describe()}: {what}", op=g.op, location=location_from_onnx_node(node),
                   suggestion=_DTYPE_FIX if g.kind == "no-kernel" else
                   "Cast the integer operand to the float dtype in the model (x.float()), or "
                   "export with onnxmedic, which inserts the cast (dtype policy upcast).",
                   details={"node": g.node, "types": g.types, "kind": g.kind,
                            **({"neighbourhood": onnx_neighbourhood(model, node)}
                               if model is not None and node is not None else {})})


def _grouped_gap_warning(code: str, gaps: list[Any], stage: str, what: str,
                         suggestion: str) -> Finding:
    names = ", ".join(g.describe() for g in gaps[:8]) + (" ..." if len(gaps) > 8 else "")
    return warning(code, stage, f"{len(gaps)} {what}: {names}.", suggestion=suggestion,
                   details={"nodes": [g.node for g in gaps]})


def cpu_fallback_finding(gaps: list[Any], target: str, stage: str) -> Finding:
    """One OM304 warning for nodes the target provider has no kernel for (they run on CPU)."""
    return _grouped_gap_warning(
        "OM304", gaps, stage, f"node(s) have no {'TensorRT or CUDA' if target == 'tensorrt' else target} "
        "kernel as typed; ONNX Runtime runs them on the CPU, with copies to and from the device",
        "Cast them to a dtype the target has kernels for (see ONNX Runtime's "
        "OperatorKernels.md), or accept the CPU fallback.")


def trt_fallback_finding(gaps: list[Any], model: Any, stage: str) -> Finding:
    """One OM305 warning for the nodes TensorRT's parser does not take (they run on CUDA
    between TensorRT engines), with how many engines the graph splits into."""
    from onnxmedic.fixes.dtypes import tensorrt_partitions, tensorrt_table

    parts = tensorrt_partitions(model, gaps) if model is not None else 0
    f = _grouped_gap_warning(
        "OM305", gaps, stage, f"node(s) are not taken by TensorRT {tensorrt_table()['tensorrt']} "
        f"as typed; ONNX Runtime runs them on CUDA, and the graph splits into {parts} TensorRT "
        "engine(s) with copies between them",
        "Rewrite or cast those ops to ones ONNX-TensorRT supports (its docs/operators.md, in "
        "the finding's details), or accept the split; each reason is in details.reasons.")
    f.details["reasons"] = {g.node: g.detail for g in gaps}
    f.details["engines"] = parts
    return f


def soft_kernel_finding(gaps: list[Any], stage: str) -> Finding:
    """One OM302 warning for all float16 nodes ONNX Runtime will wrap in casts on the CPU."""
    return _grouped_gap_warning(
        "OM302", gaps, stage, "float16 node(s) have no CPU kernel; ONNX Runtime inserts "
        "float32 casts around them itself (slower)",
        "dtype_policy='boundary' (--dtype-policy boundary) computes the graph in float32 with "
        "casts only at its inputs and outputs.")


def _ort_version_lint(proto: Any, ort: tuple[int, int] | None) -> list[Finding]:
    """doctor --ort-version: opset and IR version against that release's compatibility row."""
    from onnxmedic.fixes.opset import limits

    if ort is None:
        return []
    name = f"ONNX Runtime {ort[0]}.{ort[1]}"
    lim = limits(ort)
    if lim is None:
        return [error("OM322", "lint", f"{name} is older than 1.0; onnxmedic has no data on it.")]
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    found = []
    if opset is not None and opset > lim[0]:
        found.append(error("OM322", "lint", f"the model uses opset {opset}; {name} loads opsets "
                           f"up to {lim[0]}.", suggestion=f"Re-export with onnxmedic export "
                           f"--ort-version {ort[0]}.{ort[1]} (or --opset {lim[0]})."))
    if proto.ir_version > lim[1]:
        found.append(error("OM322", "lint", f"the model has IR version {proto.ir_version}; "
                           f"{name} loads IR versions up to {lim[1]}.",
                           suggestion=f"Re-export with onnxmedic export --ort-version "
                           f"{ort[0]}.{ort[1]}, which lowers it and verifies the result."))
    return found


def _kernel_lint(proto: Any, target: str) -> list[Finding]:
    """doctor: every node without a kernel on ``target`` as typed (nothing is changed)."""
    from onnxmedic.fixes import dtypes as fx

    gaps = fx.kernel_gaps(proto, target) or []
    nodes = {n.name: n for n in proto.graph.node}
    found = [kernel_gap_finding(g, target, nodes.get(g.node), "lint", proto)
             for g in gaps if g.kind not in ("soft", "cpu-fallback", "trt-fallback")]
    soft = [g for g in gaps if g.kind == "soft"]
    moved = [g for g in gaps if g.kind == "cpu-fallback"]
    off_trt = [g for g in gaps if g.kind == "trt-fallback"]
    if target == "tensorrt":
        from onnxmedic.fixes.dtypes import tensorrt_table

        lo, hi = tensorrt_table()["opset"]
        opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
        if opset is not None and not lo <= opset <= hi:
            found.append(warning(
                "OM305", "lint", f"the model uses opset {opset}; TensorRT "
                f"{tensorrt_table()['tensorrt']}'s ONNX parser takes opsets {lo} to {hi}, so "
                "ONNX Runtime runs the whole model on CUDA, without TensorRT.",
                suggestion=f"Re-export with onnxmedic export --target tensorrt (opset {hi} or "
                "lower).", details={"opset": opset, "tensorrt_opsets": [lo, hi]}))
    return (found + ([soft_kernel_finding(soft, "lint")] if soft else [])
            + ([cpu_fallback_finding(moved, target, "lint")] if moved else [])
            + ([trt_fallback_finding(off_trt, proto, "lint")] if off_trt else []))


def _cpu_stand_in(result: ExportResult, onnx_path: Path, folder: Path,
                  target: str) -> tuple[Path, Any] | None:
    """For a GPU target on a machine without one: when the model has nodes with no CPU kernel as
    typed (bfloat16 Gemm has a CUDA kernel, none on the CPU), ONNX Runtime falls back to the CPU
    and cannot load it. Verify a copy with those nodes computed in float32 between casts instead
    (OM537; the written model is unchanged). None when not needed or not possible."""
    if target == "cpu":
        return None
    try:
        import onnxruntime as ort

        if "CUDAExecutionProvider" in ort.get_available_providers():
            return None  # a GPU build: the target (or its CUDA fallback) runs it
    except Exception:
        return None
    import onnx_ir as ir

    from onnxmedic.fixes import dtypes as fx

    gaps = [g for g in fx.kernel_gaps(result.onnx_model, "cpu") or [] if g.kind == "no-kernel"]
    if not gaps:
        return None
    copy = ir.load(onnx_path)
    report = fx.apply_policy(copy, gaps, "upcast")
    if not report.fixed or report.not_fixed:
        return None
    path = folder / onnx_path.name
    ir.save(copy, path, external_data=f"{onnx_path.name}.data"
            if any(t.HasField("data_location") and t.data_location == onnx.TensorProto.EXTERNAL
                   for t in result.onnx_model.graph.initializer) else None)
    result.findings.append(warning(
        "OM537", "runtime", f"{_providers(target)[0]} is not available here and "
        f"{len(report.fixed)} node(s) have no CPU kernel as typed "
        f"({', '.join(sorted({g.op for g in report.fixed}))}); verified a CPU stand-in with those "
        "nodes computed in float32 between casts. The written model is unchanged (it has "
        f"kernels on {target}) and was not run as written.",
        suggestion=f"Verify on a machine with the {target} provider (onnxmedic doctor "
        f"--target {target} there) before deploying.",
        details={"nodes": [g.describe() for g in report.fixed]}))
    return path, onnx.load(path)


def _fix_dtypes(result: ExportResult, prog: Any, folder: Path, name: str, target: str,
                policy: str) -> bool:
    """Fix stage: find every node ONNX Runtime has no kernel for on ``target`` (from its own
    kernel registrations) and repair it with casts per ``policy``. False when the model cannot
    run there and was not repaired."""
    from onnxmedic.fixes import dtypes as fx

    with _stage(result, "fix"):
        gaps = fx.kernel_gaps(result.onnx_model, target)
    if not gaps:  # None: this onnxruntime has no kernel table for the target (the runtime
        # stage still loads the model there and reports what fails)
        result.stages["fix"] = PASSED
        return True
    nodes = {n.name: n for n in result.onnx_model.graph.node}
    with _stage(result, "fix"):
        report = fx.apply_policy(prog.model, gaps, policy)
        if report.fixed:
            _save_program(prog, folder, name)
            result.onnx_model = prog.model_proto
    ok = True
    soft = [g for g, _ in report.not_fixed if g.kind == "soft"]
    if soft:
        result.findings.append(soft_kernel_finding(soft, "fix"))
    moved = [g for g, _ in report.not_fixed if g.kind == "cpu-fallback"]
    if moved:
        result.findings.append(cpu_fallback_finding(moved, target, "fix"))
    off_trt = [g for g, _ in report.not_fixed if g.kind == "trt-fallback"]
    if off_trt:
        result.findings.append(trt_fallback_finding(off_trt, result.onnx_model, "fix"))
    for g, reason in report.not_fixed:
        if g.kind in ("soft", "cpu-fallback", "trt-fallback"):
            continue
        ok = False
        f = kernel_gap_finding(g, target, nodes.get(g.node), "fix", result.onnx_model)
        if not reason.startswith("dtype policy"):
            f.code = "OM311"
            f.message += f" Not repaired: {reason}."
        result.findings.append(f)
    if report.fixed:
        ops = sorted({g.op for g in report.fixed})
        result.findings.append(info(
            "OM310", "fix", f"dtype policy {policy!r}: {len(report.fixed)} node(s) "
            f"({', '.join(ops)}) had no {target} kernel as typed; {report.casts_added} cast(s) "
            "inserted" + (" at the graph's inputs and outputs" if policy == "boundary" else
                          " around them") + "; the repaired model is verified below.",
            details={"nodes": [g.describe() for g in report.fixed], "policy": policy,
                     "casts": report.casts_added}))
        check_findings = checks.check_file(folder / name)
        result.findings.extend(check_findings)
        ok &= not any(x.severity == Severity.ERROR for x in check_findings)
    result.stages["fix"] = PASSED if ok else FAILED
    result.ok = result.ok and ok
    return ok


_SPECIALISED = re.compile(r"L\['([A-Za-z_]\w*)'\]\.size\(\)\[(\d+)\] as dynamic but your code "
                          r"specialized it to be a constant \((\d+)\)")


def _specialised_finding(attempts: list[Any]) -> Finding:
    """OM114: capture only worked by specialising data-dependent control flow (draft_export)."""
    cause = classify_capture_error(attempts[:-1])
    where = (f" at {cause.location.file}:{cause.location.line}"
             + (f" (`{cause.location.code}`)" if cause.location.code else "")
             if cause.location is not None and cause.location.file else "")
    return warning(
        "OM114", "capture", f"Python control flow depends on tensor values{where}; the model was "
        "captured with torch.export.draft_export, which follows the branch the example takes. "
        "The ONNX model computes THAT BRANCH FOR EVERY INPUT. Verification adds inputs meant to "
        "take the other branches (negated, zero, scaled); a mismatch there is the divergence.",
        location=cause.location, suggestion=cause.suggestion,
        details={"attempts": [a.summary() for a in attempts]})


def _refined_capture(result: ExportResult, model: Any, args: tuple[Any, ...],
                     kwargs: dict[str, Any], dims: Any, attempts: list[Any]) -> list[Any]:
    """When torch.export rejects the dynamic shapes, apply what it says and capture again:
    its "Suggested fixes" (equal dims, constants, bounds; torch's own
    refine_dynamic_shapes_from_suggested_fixes), and dims it reports the code specialises to a
    constant (made static). Say what changed (OM406). At most three rounds."""
    import copy

    applied: list[str] = []
    extra: list[Any] = []
    for _ in range(3):
        err = attempts[-1].error if attempts else None
        text = str(err or "").split("\n\nThe error above")[0].rstrip()
        refined = None
        if "Suggested fixes:" in text:
            fixes = [ln.strip() for ln in text.split("Suggested fixes:", 1)[1].splitlines()
                     if ln.strip() and " = " in ln]
            try:
                from torch.export.dynamic_shapes import refine_dynamic_shapes_from_suggested_fixes

                refined = refine_dynamic_shapes_from_suggested_fixes(text, dims)
                applied += fixes
            except Exception as e:  # could not be applied: OM401 stands
                logger.debug("could not apply suggested fixes: %s", e)
        if refined is None and isinstance(dims, dict):
            found = _SPECIALISED.findall(text)
            if found:
                refined = copy.copy(dims)
                for name, d, value in found:
                    spec = refined.get(name)
                    if isinstance(spec, dict) and int(d) in spec:
                        refined[name] = {k: v for k, v in spec.items() if k != int(d)} or None
                        applied.append(f"{name}[{d}] = {value} (the model fixes it)")
        if refined is None:
            break
        dims = refined
        attempts = capture(model, args, kwargs, dims)
        for a in attempts:
            a.strategy = f"{a.strategy} (dynamic shapes refined)"
        extra += attempts
        if attempts[-1].program is not None:
            result.findings.append(warning(
                "OM406", "capture", "torch.export rejected the dynamic shapes as given; what it "
                f"said was applied: {'; '.join(applied)}. A dim fixed to a number is static "
                "in the ONNX model.",
                suggestion="Declare these in dynamic_shapes yourself (one Dim shared by equal "
                "dims, no Dim for a dim the model fixes) to silence this.",
                details={"fixes": applied}))
            break
    return extra


def _report_auto_dims(result: ExportResult, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """dynamic_shapes='auto': say which dims stayed dynamic and which the model fixed. Capture
    is size-oblivious, so an example size of 1 does not by itself make a dim static."""
    names, dims, _ = _graph_io(result.onnx_model)
    dynamic, static = [], []
    for name, ds in zip(names, dims):
        for i, d in enumerate(ds):
            (static.append(f"{name}[{i}]={d}") if isinstance(d, int)
             else dynamic.append(f"{name}[{i}]"))
    result.findings.append(info(
        "OM404", "capture", "dynamic_shapes='auto': dynamic: " + (", ".join(dynamic) or "none")
        + "; static (the model fixes them): " + (", ".join(static) or "none") + ".",
        details={"dynamic": dynamic, "static": static}))


def _ort_version(text: str | None, fn: str) -> tuple[int, int] | None:
    if text is None:
        return None
    from onnxmedic.fixes.opset import parse_version

    v = parse_version(str(text))
    if v is None:
        raise ValueError(f"onnxmedic.{fn}: ort_version must look like '1.17' or '1.17.3', not "
                         f"{text!r}")
    return v


def _fit_ir_version(result: ExportResult, prog: Any, ort: tuple[int, int],
                    opset: int | None) -> None:
    """Lower the IR version to what that ONNX Runtime loads (the checker then says whether the
    model used anything newer); say what was fitted."""
    from onnxmedic.fixes.opset import limits

    max_opset, max_ir = limits(ort)  # type: ignore[misc]
    changes = []
    if prog.model.ir_version > max_ir:
        changes.append(f"IR version {prog.model.ir_version} -> {max_ir}")
        prog.model.ir_version = max_ir
    from onnxmedic.fixes.opset import VERIFIED_MAX_OPSET, exporter_max_opset

    unconstrained = min(exporter_max_opset(), VERIFIED_MAX_OPSET)
    if opset is not None and opset < unconstrained:
        changes.append(f"opset {unconstrained} -> {opset}")
    if changes:
        result.findings.append(info(
            "OM323", "translate", f"fitted to ONNX Runtime {ort[0]}.{ort[1]} (opsets up to "
            f"{max_opset}, IR up to {max_ir}): {', '.join(changes)}; verified below.",
            details={"changes": changes}))


def _opset_stage(result: ExportResult, wanted: int, explicit: bool = True,
                 bound: str = "asked for") -> bool:
    """torch.onnx converts its opset-18 translation to the requested opset with the version
    converter and, when that fails, only logs a warning and keeps 18: say so. An opset asked for
    stops the export there (OM321); the default (the highest the target supports) falls back to
    what the converter reached when the target loads that too (OM324)."""
    from onnxmedic.fixes.opset import NATIVE_OPSET as native

    why = "asked for" if explicit else f"the highest the target supports; set by {bound}"
    if result.opset == wanted:
        if wanted != native:
            result.findings.append(info(
                "OM320", "translate", f"opset {wanted} ({why}): converted from opset {native} "
                "with the version converter; the converted model is checked and verified below.",
                details={"opset": wanted, "bound": bound}))
        return True
    if not explicit and result.opset is not None and result.opset < wanted:
        result.findings.append(info(
            "OM324", "translate", f"opset {wanted} is {why}, but the version converter could not "
            f"convert this model to it; it stays at opset {result.opset}, which that target "
            "loads too.", suggestion=f"Nothing to do; --opset {wanted} would stop with the "
            "converter's error instead.", details={"opset": result.opset, "wanted": wanted}))
        return True
    _fail(result, "translate", error(
        "OM321", "translate", f"opset {wanted} was {why}, but the version converter could "
        f"not convert the model (it stayed at opset {result.opset}).",
        suggestion=f"Use an opset the converter supports (about 18 to {onnx.defs.onnx_opset_version()} "
        "with this onnx), or drop --opset to keep 18."))
    return False


def _pytree_findings(result: ExportResult, attempts: list[Any]) -> bool:
    """OM120 naming the classes the capture registered with pytree; OM121 for failures.
    True when something was registered."""
    any_registered = False
    for a in attempts:
        any_registered = any_registered or bool(a.registered)
        if a.registered:
            names = ", ".join(f"{k} (via {v})" for k, v in a.registered.items())
            result.findings.append(info(
                "OM120", "capture", f"registered with torch.utils._pytree so that torch.export "
                f"can flatten them: {names}.", suggestion="Nothing to do; to skip the failed "
                "first attempt, register them yourself before exporting (transformers: "
                "transformers.exporters.exporter_dynamo.register_cache_pytrees_for_model(model)) "
                "or return tensors only (e.g. use_cache=False).",
                details={"registered": dict(a.registered)}))
        bad = [n for n in a.notes if n.startswith("not registered: ")]
        if bad:
            result.findings.append(warning(
                "OM121", "capture", "; ".join(b[len("not registered: "):] for b in bad)))
    return any_registered


def _not_written(result: ExportResult, f: Any) -> None:
    if f is None:
        return
    existed = Path(f).exists()
    result.findings.append(Finding(
        "OM010", "write", Severity.INFO,
        f"{f} was not written because the model is not verified"
        + ("; the existing file was left unchanged." if existed else "."),
        suggestion="Fix the findings above, or pass keep_unverified=True to keep the "
        "unverified model."))


def verify(
    onnx_path: str | os.PathLike[str],
    model: torch.nn.Module | torch.export.ExportedProgram,
    args: tuple[Any, ...] = (),
    *,
    kwargs: dict[str, Any] | None = None,
    report: str | os.PathLike[str] | None = None,
    timeout: float = sandbox.DEFAULT_TIMEOUT,
    tolerance: tuple[float, float] | None = None,
    model_spec: str | None = None,
    input_specs: list[str] | None = None,
    localize: bool = False,
) -> ExportResult:
    """Compare an existing ONNX file with the PyTorch model on the example inputs and further
    seeded input sets, with ONNX Runtime in the sandbox.

    ``localize``: also compare every intermediate value the ONNX file shares (by name) with the
    model's torch.export program, and name the first divergent node (OM610) and the nodes that
    grow the error most (``result.localization``)."""
    args, kwargs = _check_args(model, args, kwargs)
    result = ExportResult(command="verify", path=str(onnx_path),
                          model=model_spec or type(model).__name__,
                          inputs=list(input_specs or []))
    for s in ("capture", "translate", "write"):
        result.stages.pop(s, None)
    if _report_problem(result, report):
        return result
    with _guard(result):
        from onnxmedic.lint import external_data_findings

        with _stage(result, "check"):
            proto, bad = checks.load_onnx(onnx_path)
        ext = external_data_findings(proto, Path(onnx_path), stage="check") if bad is None else []
        if bad is not None or ext:
            _fail(result, "check", *([bad] if bad is not None else ext))
        else:
            result.onnx_model = proto
            result.opset = next((o.version for o in proto.opset_import if o.domain in
                                 ("", "ai.onnx")), None)
            # localisation's worker starts now too: it imports ONNX Runtime while the
            # model is verified, not after (rebuilding the program takes less than that)
            loc_worker = sandbox.Worker() if localize else None
            try:
                with sandbox.Worker() as worker:
                    _verify(result, proto, Path(onnx_path), model, args, kwargs, timeout,
                            tolerance, worker, localize, loc_worker)
            finally:
                if loc_worker is not None:
                    loc_worker.close()
    if report is not None:
        from onnxmedic.report import write_report

        write_report(result, report)
    return result


def _verify(result: ExportResult, proto: Any, path: Path, model: Any, args: tuple[Any, ...],
            kwargs: dict[str, Any], timeout: float, tolerance: tuple[float, float] | None,
            worker: sandbox.Worker, localize: bool = False,
            loc_worker: sandbox.Worker | None = None) -> None:
    check_findings = checks.check_file(path)
    result.findings.extend(check_findings)
    if any(x.severity == Severity.ERROR for x in check_findings):
        result.stages["check"] = FAILED
        return
    result.stages["check"] = PASSED
    program = model
    if isinstance(model, torch.export.ExportedProgram):
        model = model.module()  # unlifted once, not once per input set (slow for big graphs)
    expected = _preflight(result, model, args, kwargs)
    if expected is None:
        return
    _run_and_compare(result, model, path, proto, inputs_mod.Inputs(args, kwargs), expected,
                     timeout, tolerance, worker,
                     localizer=_Localizer(True, lambda: _program_for(program, args, kwargs),
                                          None if program is not model else model,
                                          loc_worker) if localize else None)
    result.ok = result.stages["compare"] == PASSED


def _program_for(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[Any, bool] | None:
    """(ExportedProgram, already decomposed?) of ``model`` for localisation, or None."""
    if isinstance(model, torch.export.ExportedProgram):
        return model, False
    attempts = capture(model, args, kwargs, None)
    program = attempts[-1].program if attempts else None
    return (program, False) if program is not None else None


def doctor(
    onnx_path: str | os.PathLike[str],
    *,
    target: str = "cpu",
    timeout: float = sandbox.DEFAULT_TIMEOUT,
    smoke_test: bool = True,
    report: str | os.PathLike[str] | None = None,
    ort_version: str | None = None,
) -> ExportResult:
    """Lint an ONNX file for a target runtime, without PyTorch: external data, opset against
    the runtime, unused initializers, dynamic dims, shape information, ops and dtypes without
    kernels, and a load-and-run smoke test with random inputs in the sandbox. ``ort_version``
    also checks opset and IR version against that ONNX Runtime release."""
    from onnxmedic import lint as doc

    ort = _ort_version(ort_version, "doctor")

    if target not in TARGETS:
        raise ValueError(f"onnxmedic.doctor: target must be one of {', '.join(TARGETS)}, not "
                         f"{target!r}")
    result = ExportResult(command="doctor", path=str(onnx_path), model=str(onnx_path),
                          stages={"load": NOT_RUN, "check": NOT_RUN, "lint": NOT_RUN,
                                  "runtime": NOT_RUN})
    if _report_problem(result, report):
        return result
    with _guard(result):
        _doctor(result, doc, Path(onnx_path), target, timeout, smoke_test, ort)
    result.ok = not result.errors
    if report is not None:
        from onnxmedic.report import write_report

        write_report(result, report)
    return result


def _providers(target: str) -> list[str]:
    """ONNX Runtime's provider list for a target, most preferred first (each falls back to the
    next for the nodes it does not take)."""
    return {"cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
            "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider",
                         "CPUExecutionProvider"]}.get(target, ["CPUExecutionProvider"])


def _doctor(result: ExportResult, doc: Any, path: Path, target: str, timeout: float,
            smoke_test: bool, ort: tuple[int, int] | None = None) -> None:
    with _stage(result, "load"):
        proto, bad = checks.load_onnx(path, stage="load")
    if bad is not None:
        _fail(result, "load", bad)
        return
    result.onnx_model = proto
    result.opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")),
                        None)
    ext = doc.external_data_findings(proto, path, stage="load")
    if ext:
        _fail(result, "load", *ext)
        return  # never hand a file with escaping or missing external data to anything else
    result.stages["load"] = PASSED
    with _stage(result, "check"):
        found = checks.check_file(path)
    result.findings.extend(found)
    result.stages["check"] = FAILED if any(f.severity == Severity.ERROR for f in found) \
        else PASSED
    feeds, problems = doc.random_feeds(proto)
    sbx = None
    if smoke_test and not problems:
        with _stage(result, "runtime"):
            sbx = sandbox.run_model(path, [feeds], timeout=timeout, providers=_providers(target),
                                    probe_opset=True)
    with _stage(result, "lint"):
        lint = doc.lint(proto, ort_opset=sbx.max_opset if sbx is not None else None)
        lint.extend(_kernel_lint(proto, target))
        lint.extend(_ort_version_lint(proto, ort))
    result.findings.extend(lint)
    result.stages["lint"] = FAILED if any(f.severity == Severity.ERROR for f in lint) \
        else PASSED
    if problems:
        result.findings.append(warning("OM603", "runtime", "no smoke test: " +
                                       "; ".join(problems)))
        return
    if sbx is None:
        return
    if not _runtime_stage(result, sbx, target, timeout):
        return
    shapes = ", ".join(f"{n}{list(a.shape)}" for n, a in zip(sbx.output_names, sbx.outputs[0]))
    result.findings.append(info("OM534", "runtime", f"smoke test ran with random inputs in "
                                f"{sbx.run_seconds[0] * 1000:.1f} ms (ONNX Runtime "
                                f"{sbx.ort_version}); outputs: {shapes}"))


@dataclass
class RunResult(ExportResult):
    """The outcome of run(): ``outputs`` maps output names to arrays."""

    outputs: dict[str, np.ndarray] = field(default_factory=dict)


def run(
    onnx_path: str | os.PathLike[str],
    feeds: dict[str, np.ndarray] | list[np.ndarray],
    *,
    cast: str = "no",
    target: str = "cpu",
    timeout: float = sandbox.DEFAULT_TIMEOUT,
) -> RunResult:
    """Safe inference: check ``feeds`` against the model's input contract (names, dtypes,
    ranks, fixed dims), cast when ``cast`` is "safe" (lossless only) or "all", then run in the
    sandbox with a timeout."""
    from onnxmedic import lint as doc

    if cast not in ("no", "safe", "all"):
        raise ValueError(f"onnxmedic.run: cast must be 'no', 'safe' or 'all', not {cast!r}")
    result = RunResult(command="run", path=str(onnx_path), model=str(onnx_path),
                       stages={"load": NOT_RUN, "inputs": NOT_RUN, "runtime": NOT_RUN})
    with _guard(result):
        _run(result, doc, onnx_path, feeds, cast, target, timeout)
    return result


def _run(result: RunResult, doc: Any, onnx_path: Any, feeds: Any, cast: str, target: str,
         timeout: float) -> None:
    proto, bad = checks.load_onnx(onnx_path, stage="load")
    if bad is not None:
        _fail(result, "load", bad)
        return
    ext = doc.external_data_findings(proto, onnx_path, stage="load")
    if ext:
        _fail(result, "load", *ext)
        return
    result.stages["load"] = PASSED
    if isinstance(feeds, (list, tuple)):
        init = {i.name for i in proto.graph.initializer}
        names = [v.name for v in proto.graph.input if v.name not in init]
        if len(feeds) != len(names):
            _fail(result, "inputs", error(
                "OM008", "inputs", f"the model has {len(names)} input(s) "
                f"({', '.join(names)}) but {len(feeds)} were given."))
            return
        feeds = dict(zip(names, feeds))
    checked, found = doc.check_feeds(proto, {k: np.asarray(v) for k, v in feeds.items()},
                                     cast=cast)
    result.findings.extend(found)
    if any(f.severity == Severity.ERROR for f in found):
        result.stages["inputs"] = FAILED
        return
    result.stages["inputs"] = PASSED
    sbx = sandbox.run_model(onnx_path, [checked], timeout=timeout,
                            providers=_providers(target))
    if not _runtime_stage(result, sbx, target, timeout):
        return
    result.outputs = dict(zip(sbx.output_names, sbx.outputs[0]))
    result.ok = True



def reduce(
    onnx_path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    until: str = "crash",
    timeout: float = 30.0,
    feeds: dict[str, np.ndarray] | str | os.PathLike[str] | None = None,
    reference: dict[str, np.ndarray] | str | os.PathLike[str] | None = None,
    tolerance: tuple[float, float] | None = None,
    max_runs: int = 200,
    seed: int = 0,
) -> ExportResult:
    """Shrink a failing ONNX model to a minimal subgraph that still fails, and write it to
    ``out`` with its inputs (``out``'s stem + .inputs.npz) and a standalone repro script
    (stem + .repro.py).

    ``until``: "crash" (ONNX Runtime dies), "hang" (does not finish within ``timeout``),
    "mismatch" (outputs differ from ``reference``: expected values by ONNX value name, a dict
    or .npz; by default onnx's ReferenceEvaluator), or a shell command containing ``{model}``
    (and optionally ``{inputs}``, an .npz of the feeds) that exits non-zero while the failure
    is there. ``feeds``: the model's inputs (dict or .npz); random ones by default. Every
    candidate runs in the sandbox (or as the command) with ``timeout``; at most ``max_runs``.
    """
    from onnxmedic import lint as doc
    from onnxmedic import reduction as red

    result = ExportResult(command="reduce", path=None, model=str(onnx_path),
                          stages={"load": NOT_RUN, "reduce": NOT_RUN, "write": NOT_RUN})
    with _guard(result):
        mode = red.parse_until(until)
        if mode is None:
            _fail(result, "reduce", error(
                "OM543", "reduce", f"--until {until!r} is not a criterion.",
                suggestion="Use crash, hang, mismatch, or a shell command with {model} in it, "
                "e.g. --until \"python check.py {model}\" (non-zero exit = still failing)."))
            return result
        bad_out = _check_output_path(out)
        if bad_out is not None:
            _fail(result, "write", bad_out)
            return result
        with _stage(result, "load"):
            proto, bad = checks.load_onnx(onnx_path, stage="load")
        if bad is not None:
            _fail(result, "load", bad)
            return result
        ext = doc.external_data_findings(proto, Path(onnx_path), stage="load")
        if ext:
            _fail(result, "load", *ext)
            return result
        if any(i.data_location == 1 for i in proto.graph.initializer):
            import onnx

            proto = onnx.load(str(onnx_path), load_external_data=True)
        result.onnx_model = proto
        result.stages["load"] = PASSED
        if feeds is None:
            feeds, problems = doc.random_feeds(proto, seed=seed)
            if problems:
                _fail(result, "load", error("OM008", "load", "cannot make inputs for the "
                                            "model: " + "; ".join(problems),
                                            suggestion="Pass the inputs (feeds=... or "
                                            "--input inputs.npz)."))
                return result
        elif not isinstance(feeds, dict):
            feeds = _load_npz(feeds)
        if reference is not None and not isinstance(reference, dict):
            reference = _load_npz(reference)
        with _stage(result, "reduce"):
            small, small_feeds, stats, why = red.reduce_model(
                proto, dict(feeds), mode, timeout=timeout, max_runs=max_runs,
                reference=reference, tolerance=tolerance)
        result.timings["reduce_runs"] = float(stats.runs)
        if small is None:
            _fail(result, "reduce", error(
                "OM541", "reduce", f"{onnx_path} does not show the failure asked for "
                f"(--until {until}): {why}.",
                suggestion="Check the criterion on the whole model first (onnxmedic doctor / "
                "run, or the command by hand); raise --timeout for a slow hang."))
            return result
        result.stages["reduce"] = PASSED
        with _stage(result, "write"):
            inputs_path, script = red.write_outputs(
                Path(out), small, small_feeds, until=mode, timeout=timeout,
                source=str(onnx_path), stats=stats, tolerance=tolerance)
        result.stages["write"] = PASSED
        result.path = str(out)
        ops = ", ".join(f"{n.op_type} {n.name!r}" for n in small.graph.node[:8])
        result.findings.append(info(
            "OM540", "reduce", f"reduced {stats.nodes_in} nodes to {stats.nodes_out} ({ops}) in "
            f"{stats.runs} runs, {stats.seconds:.1f} s; still fails (--until {mode}). Wrote "
            f"{out}, {inputs_path.name} and {script.name}.",
            suggestion=f"python {script} reproduces it; attach the three files to a bug "
            "report.", details={"nodes_in": stats.nodes_in, "nodes_out": stats.nodes_out,
                                "runs": stats.runs, "phases": stats.phases}))
        if stats.exhausted:
            result.findings.append(warning(
                "OM542", "reduce", f"stopped after {stats.runs} candidate runs (max_runs); "
                f"{out} still fails but may not be minimal.",
                suggestion="Run reduce again on the written model, or raise --max-runs."))
        result.ok = True
    return result


def localize(
    onnx_path: str | os.PathLike[str],
    model: torch.nn.Module | torch.export.ExportedProgram,
    args: tuple[Any, ...] = (),
    *,
    kwargs: dict[str, Any] | None = None,
    report: str | os.PathLike[str] | None = None,
    timeout: float = sandbox.DEFAULT_TIMEOUT,
    tolerance: tuple[float, float] | None = None,
) -> ExportResult:
    """verify() with localisation: ``result.localization`` holds the first node whose value in
    ONNX Runtime leaves tolerance (also finding OM610) and the top nodes by error growth."""
    return verify(onnx_path, model, args, kwargs=kwargs, report=report, timeout=timeout,
                  tolerance=tolerance, localize=True)


def _load_npz(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as d:
            return {k: d[k] for k in d.files}
    except (OSError, ValueError) as e:
        raise OnnxMedicError(error("OM005", "load", f"cannot read {str(path)!r} as an .npz of "
                                   f"arrays: {e}", suggestion="Give an .npz written by "
                                   "numpy.savez, arrays named after the model's inputs.")) from e
