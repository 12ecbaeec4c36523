"""The public API: export() and verify(). The CLI is a thin shell over these."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from onnxmedic import checks, preflight, sandbox
from onnxmedic import inputs as inputs_mod
from onnxmedic._tensors import flatten_tensors, to_numpy
from onnxmedic.capture import capture, classify_capture_error
from onnxmedic.findings import Finding, OnnxMedicError, Severity, error, info, warning
from onnxmedic.sweep import SweepResult, ZooCase, sweep  # sweep(): a zoo, in worker processes
from onnxmedic.verify.compare import OutputComparison, compare_outputs

logger = logging.getLogger(__name__)

STAGES = ("preflight", "capture", "translate", "check", "runtime", "compare", "write")
NOT_RUN, PASSED, FAILED = "not run", "passed", "failed"

# Models whose initializers exceed this many bytes are saved with external data (protobuf
# cannot hold more than 2 GiB). A module attribute so tests can lower it.
EXTERNAL_DATA_THRESHOLD = 2 * 1024**3 - 64 * 1024**2

# How many input sets beyond the example verification uses.
EXTRA_INPUT_SETS = 2


@dataclass
class ExportResult:
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

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == Severity.ERROR]

    @property
    def exit_code(self) -> int:
        if self.ok:
            return 0
        codes = [f.exit_code for f in self.errors]
        if 3 in codes:
            return 3
        if 2 in codes:
            return 2
        return 1

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


def _runtime_stage(result: ExportResult, sbx: sandbox.SandboxResult, target: str,
                   timeout: float) -> bool:
    """Record the runtime stage from a sandbox result: failed (with its finding), or passed
    (with OM535 when ONNX Runtime fell back from the target's provider). True when passed."""
    if not sbx.ok:
        _fail(result, "runtime", sbx.finding("runtime", timeout))
        return False
    result.stages["runtime"] = PASSED
    fallback = sbx.provider_finding(_providers(target))
    if fallback is not None:
        result.findings.append(fallback)
    return True


def _run_and_compare(result: ExportResult, model: Any, onnx_path: Path, proto: Any,
                     example: inputs_mod.Inputs, example_expected: list[np.ndarray] | None,
                     timeout: float, tolerance: tuple[float, float] | None,
                     worker: sandbox.Worker | None = None, target: str = "cpu") -> None:
    """runtime + compare stages, in one sandboxed session: the example, two further input sets
    of the same shapes, and - for each dynamic dim of the ONNX model - sizes 1 and 2x."""
    onnx_inputs, onnx_dims, onnx_outputs = _graph_io(proto)
    sets = [example] + inputs_mod.derived_input_sets(example, EXTRA_INPUT_SETS)
    labels = ["example"] + [f"random#{i}" for i in range(1, len(sets))]
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


def _shape_finding(proto: Any, label: str, message: str) -> Finding:
    """OM402 for a run that fails at another size, pointing at the op that baked it in."""
    from onnxmedic._locate import location_from_onnx_node, onnx_node_in_error

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
        details={"error": message[:4000], "input_set": label})


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
) -> ExportResult:
    """Export ``model`` to ONNX, verify it in an isolated ONNX Runtime, and report.

    Problems of the model become findings in the returned :class:`ExportResult` (``ok`` is True
    only when the model was exported *and* verified). With ``f``, the file is written atomically
    and only when verified (or when ``keep_unverified``); an existing file is never replaced by
    an unverified model. ``report`` writes a .json or .html report, whatever the outcome.
    """
    args, kwargs = _check_args(model, args, kwargs)
    if target not in ("cpu", "cuda"):
        raise ValueError(f"onnxmedic.export: target must be 'cpu' or 'cuda', not {target!r}")
    result = ExportResult(command="export", model=model_spec or type(model).__name__,
                          inputs=list(input_specs or []))
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
                        worker=worker, explain=explain)
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
            worker: sandbox.Worker | None, explain: bool = False) -> None:
    from onnxmedic import translate as translate_mod

    bad_out = _check_output_path(f)
    if bad_out is not None:
        _fail(result, "write", bad_out)
        return
    example = inputs_mod.Inputs(args, kwargs)
    example_expected = _preflight(result, model, args, kwargs)
    if example_expected is None:
        return

    str_dims = None
    with _stage(result, "capture"):
        if isinstance(model, torch.export.ExportedProgram):
            program = model
            result.attempts = [{"strategy": "given ExportedProgram", "ok": True,
                                "seconds": 0.0, "error": None}]
        else:
            from torch.onnx._internal.exporter import _dynamic_shapes

            export_dims, need_rename = _dynamic_shapes.convert_str_to_export_dim(dynamic_shapes)
            str_dims = dynamic_shapes if need_rename else None
            attempts = capture(model, args, kwargs, export_dims)
            result.attempts = [a.summary() for a in attempts]
            program = attempts[-1].program
            if program is None:
                _fail(result, "capture", classify_capture_error(attempts))
                return
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
    result.onnx_model = prog.model_proto
    result.opset = next((o.version for o in result.onnx_model.opset_import if o.domain in
                         ("", "ai.onnx")), None)

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
        if verify:
            _run_and_compare(result, model, onnx_path, result.onnx_model, example,
                             example_expected, timeout, tolerance, worker, target)
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
) -> ExportResult:
    """Compare an existing ONNX file with the PyTorch model on the example inputs and further
    seeded input sets, with ONNX Runtime in the sandbox."""
    args, kwargs = _check_args(model, args, kwargs)
    result = ExportResult(command="verify", path=str(onnx_path),
                          model=model_spec or type(model).__name__,
                          inputs=list(input_specs or []))
    for s in ("capture", "translate", "write"):
        result.stages.pop(s, None)
    with _guard(result):
        with _stage(result, "check"):
            proto, bad = checks.load_onnx(onnx_path)
        if bad is not None:
            _fail(result, "check", bad)
        else:
            result.onnx_model = proto
            result.opset = next((o.version for o in proto.opset_import if o.domain in
                                 ("", "ai.onnx")), None)
            with sandbox.Worker() as worker:
                _verify(result, proto, Path(onnx_path), model, args, kwargs, timeout,
                        tolerance, worker)
    if report is not None:
        from onnxmedic.report import write_report

        write_report(result, report)
    return result


def _verify(result: ExportResult, proto: Any, path: Path, model: Any, args: tuple[Any, ...],
            kwargs: dict[str, Any], timeout: float, tolerance: tuple[float, float] | None,
            worker: sandbox.Worker) -> None:
    check_findings = checks.check_file(path)
    result.findings.extend(check_findings)
    if any(x.severity == Severity.ERROR for x in check_findings):
        result.stages["check"] = FAILED
        return
    result.stages["check"] = PASSED
    expected = _preflight(result, model, args, kwargs)
    if expected is None:
        return
    _run_and_compare(result, model, path, proto, inputs_mod.Inputs(args, kwargs), expected,
                     timeout, tolerance, worker)
    result.ok = result.stages["compare"] == PASSED


def doctor(
    onnx_path: str | os.PathLike[str],
    *,
    target: str = "cpu",
    timeout: float = sandbox.DEFAULT_TIMEOUT,
    smoke_test: bool = True,
    report: str | os.PathLike[str] | None = None,
) -> ExportResult:
    """Lint an ONNX file for a target runtime, without PyTorch: external data, opset against
    the runtime, unused initializers, dynamic dims, shape information, and a load-and-run smoke
    test with random inputs in the sandbox."""
    from onnxmedic import lint as doc

    if target not in ("cpu", "cuda"):
        raise ValueError(f"onnxmedic.doctor: target must be 'cpu' or 'cuda', not {target!r}")
    result = ExportResult(command="doctor", path=str(onnx_path), model=str(onnx_path),
                          stages={"load": NOT_RUN, "check": NOT_RUN, "lint": NOT_RUN,
                                  "runtime": NOT_RUN})
    with _guard(result):
        _doctor(result, doc, Path(onnx_path), target, timeout, smoke_test)
    result.ok = not result.errors
    if report is not None:
        from onnxmedic.report import write_report

        write_report(result, report)
    return result


def _providers(target: str) -> list[str]:
    return (["CUDAExecutionProvider", "CPUExecutionProvider"] if target == "cuda"
            else ["CPUExecutionProvider"])


def _doctor(result: ExportResult, doc: Any, path: Path, target: str, timeout: float,
            smoke_test: bool) -> None:
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

