"""The translate stage: the captured program to ONNX with torchlib plus onnxmedic's registry.

On failure, every operator without a translation is collected in one pass (not only the first
one torch.onnx tripped on), each with its module path and the user's line.
"""

from __future__ import annotations

import logging
import operator
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from onnxmedic._locate import location_from_exception, location_from_node
from onnxmedic._torch_compat import (
    bind_program,
    bind_weights,
    core_export,
    default_opset,
    forget_pending_unbacked,
    has_symbolic_inputs,
    prepare_for_export,
    rename_dynamic_axes,
)
from onnxmedic.capture.decomps import symbolic_shape_rules
from onnxmedic.findings import Finding, error, info, warning
from onnxmedic.fixes import opset as opset_fix
from onnxmedic.fixes import try_fix
from onnxmedic.fixes.custom_ops import CustomOpInlining
from onnxmedic.fixes.rewrites import (
    REWRITES,
    constant_outputs_as_tensors,
    storage_order_before_as_strided,
    strides_from_sizes,
)
from onnxmedic.fixes.shapes import static_dim_params
from onnxmedic.onnxfile import graph_proto, opset_of
from onnxmedic.ops import REGISTRY, TranslationRegistry
from onnxmedic.rewrite_speed import sibling_slices
from onnxmedic.stages.capture import declared_dim_findings, report_auto_dims
from onnxmedic.verify.replay import record_removed_nodes

logger = logging.getLogger(__name__)
STAGE = "translate"



@dataclass
class TranslateResult:
    onnx_program: Any = None  # torch.onnx.ONNXProgram
    findings: list[Finding] = field(default_factory=list)
    used_translations: list[str] = field(default_factory=list)
    not_applied: list[tuple[str, str]] = field(default_factory=list)  # (fix, why not)

    @property
    def ok(self) -> bool:
        return self.onnx_program is not None


def onnx_export(program: torch.export.ExportedProgram, args: tuple[Any, ...],
                kwargs: dict[str, Any] | None, *, registry: TranslationRegistry | None,
                opset: int | None = None, weights: dict[str, Any] | None = None) -> Any:
    """torch.onnx.export(program, dynamo=True) with the registry built once, not per call.

    Does what torch.onnx.export's compatibility layer does for an ExportedProgram (default
    opset, registry for that opset) and calls its core exporter; ``registry=None`` gives plain
    torchlib, as torch.onnx.export would.

    ``weights``: the program was captured on fake weights (stages/capture.py); these real
    tensors are bound to the ONNX program after the translation and before the optimizer,
    whose constant folding reads values - the same graph as a translation of the real
    program.
    """
    if opset is None:
        opset = default_opset()
    reg = (registry if registry is not None else _PLAIN).onnx_registry(opset)
    # torch.onnx decomposes the program again: with the shape rules its capture used
    # onnxscript's optimizer without its quadratic Slice-pair matching (rewrite_speed.py)
    with symbolic_shape_rules(has_symbolic_inputs(program)), sibling_slices():
        prog = core_export(program, args, kwargs, registry=reg, opset=opset,
                           optimize=weights is None)
    if weights is not None:
        left = bind_weights(prog, weights)
        if left:
            raise RuntimeError(f"no real value for the fake weight(s) {', '.join(left[:5])}")
        with sibling_slices():
            prog.optimize()
    return prog


def decompose_for_export(program: torch.export.ExportedProgram, reg: Any) -> Any:
    """The program after torch.onnx's decompositions (with capture's shape rules)."""
    with symbolic_shape_rules(has_symbolic_inputs(program)):
        return prepare_for_export(program, reg)


_PLAIN = TranslationRegistry(_loaded=True)  # no onnxmedic entries: plain torchlib


def onnx_registry_plain(opset: int) -> Any:
    """torch.onnx's registry of plain torchlib (no onnxmedic entries) at ``opset``."""
    return _PLAIN.onnx_registry(opset)


def _op_name(target: Any) -> str:
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(
        target, "__name__", str(target))


def _node_signature(node: torch.fx.Node) -> str:
    """'float32[2, 3], float32[3]' from the node's fake-tensor arguments."""
    parts = []
    for a in node.args:
        val = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
        if isinstance(val, torch.Tensor):
            parts.append(f"{str(val.dtype).replace('torch.', '')}{list(val.shape)}")
        elif isinstance(a, torch.fx.Node):
            parts.append(type(val).__name__)
        else:
            parts.append(repr(a)[:40])
    return ", ".join(parts)


def unsupported_ops(program: torch.export.ExportedProgram, registry: TranslationRegistry,
                    opset: int | None) -> tuple[list[torch.fx.Node], BaseException | None]:
    """Nodes (after torch.onnx's decompositions) that no translation covers."""
    reg = registry.onnx_registry(opset)
    try:
        decomposed = decompose_for_export(program, reg)
    except Exception as e:
        return [], e
    missing = []
    for node in decomposed.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if target is operator.getitem:
            continue
        if isinstance(target, torch._ops.OpOverload) and not reg.is_registered(target):
            missing.append(node)
    return missing, None


def op_inventory(program: torch.export.ExportedProgram, registry: TranslationRegistry = REGISTRY,
                 opset: int | None = None) -> list[dict[str, Any]]:
    """Every ATen op the ONNX translation will see (after torch.onnx's decompositions), with
    its count, who translates it at ``opset`` (onnxmedic, torchlib or nothing) and where it
    is first used."""
    reg = registry.onnx_registry(opset)
    decomposed = decompose_for_export(program, reg)
    counts: Counter[str] = Counter()
    first: dict[str, torch.fx.Node] = {}
    targets: dict[str, Any] = {}
    for node in decomposed.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        name = _op_name(node.target)
        counts[name] += 1
        first.setdefault(name, node)
        targets[name] = node.target
    rows = []
    for name, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        target = targets[name]
        if registry.get(target) is not None if isinstance(target, torch._ops.OpOverload) \
                else False:
            by = "onnxmedic"
        elif isinstance(target, torch._ops.OpOverload) and reg.is_registered(target):
            by = "torchlib"
        elif not isinstance(target, torch._ops.OpOverload):
            by = "torchlib"  # Python-level helpers torch.onnx handles itself (e.g. sym ops)
        else:
            by = "none"
        loc = location_from_node(first[name])
        rows.append({"op": name, "count": count, "translated_by": by,
                     "first_use": str(loc) if loc is not None else None})
    return rows


def translate(program: torch.export.ExportedProgram, args: tuple[Any, ...],
              kwargs: dict[str, Any], *, opset: int | None = None,
              registry: TranslationRegistry = REGISTRY,
              weights: dict[str, Any] | None = None) -> TranslateResult:
    """The program in ONNX (``weights``: the real tensors of a program captured on fake
    weights; see :func:`onnx_export`)."""
    table = registry.table()
    result = TranslateResult()
    for mod, err in registry.load_errors.items():
        result.findings.append(warning(
            "OM210", STAGE, f"onnxmedic's translations in {mod} failed to load ({err}); the "
            "other translations are used."))
    forget_pending_unbacked(program)  # left by an earlier translation (OM325's second one)
    program, not_inlined = _inline_custom_ops(program, table, result)
    not_contiguous = _strides_from_sizes(program, result)
    _storage_order(program, result)
    _constant_outputs(program, result)
    try:
        prog = onnx_export(program, args, kwargs, registry=registry, opset=opset,
                           weights=weights)
    except Exception as e:
        prog = _retry_with_rewrites(result, program, args, kwargs, registry, opset, e,
                                    weights)
        if prog is None:
            found = _diagnose(program, registry, opset, e)
            for f in found:  # say why a custom op was not inlined
                reason = not_inlined.get((f.op or "").rsplit(".", 1)[0].replace(".", "::", 1))
                if f.code == "OM201" and reason:
                    f.message += (f" Its Python implementation could not be inlined ({reason}), "
                                  "so it needs a translation.")
                if f.code == "OM201" and f.op == "aten.sym_stride.int" and not_contiguous:
                    f.message += (" ONNX tensors have no strides; onnxmedic replaces a stride "
                                  "query by the sizes only where the tensor is provably "
                                  "contiguous, and this one is not.")
                    f.suggestion = ("Make the tensor contiguous before reading its stride "
                                    "(`x = x.contiguous()`), or compute the stride from "
                                    "x.shape.")
            result.findings.extend(found)
            return result
    result.onnx_program = prog
    used = set()
    decomposed = getattr(prog, "exported_program", None) or program
    for node in decomposed.graph.nodes:
        if node.op == "call_function" and node.target in table:
            used.add(_op_name(node.target))
    result.used_translations = sorted(used)
    for name in result.used_translations:
        result.findings.append(info("OM204", STAGE, f"{name} translated by onnxmedic.",
                                    op=name))
    return result


def _inline_custom_ops(program: torch.export.ExportedProgram, table: Any,
                      result: TranslateResult) -> tuple[torch.export.ExportedProgram, dict[str, str]]:
    """Custom ops without a translation are replaced by their PyTorch implementation."""
    try:
        inl = try_fix(CustomOpInlining(table), program)
    except Exception as e:  # never let the fix break translation
        logger.debug("custom-op inlining failed: %s", e)
        result.not_applied.append(("custom-op inlining", f"{type(e).__name__}: {e}"[:300]))
        return program, {}
    if inl is None:
        return program, {}
    for name in inl.inlined:
        result.findings.append(info(
            "OM205", STAGE, f"custom op {name} has no ONNX translation; its Python implementation "
            "was inlined (traced into PyTorch ops), and those were translated.", op=name,
            suggestion=f"To keep it one node, register a translation: "
            f"@onnxmedic.translation('{name}')."))
    return inl.program, inl.failed


def _guarded(result: TranslateResult, what: str, rewrite: Any,
             program: torch.export.ExportedProgram) -> Any:
    """``rewrite(program)``'s result; None, recorded in ``result.not_applied``, when it raised:
    a rewrite never breaks translation."""
    try:
        return rewrite(program)
    except Exception as e:  # noqa: BLE001 - the program is translated without it
        logger.debug("%s failed: %s", what, e)
        result.not_applied.append((what, f"{type(e).__name__}: {e}"[:300]))
        return None


def _strides_from_sizes(program: torch.export.ExportedProgram,
                        result: TranslateResult) -> int:
    """Stride queries (aten.sym_stride.int) of contiguous tensors become products of sizes
    (OM206); returns how many were left (tensors not provably contiguous)."""
    done = _guarded(result, "stride queries from sizes", strides_from_sizes, program)
    if done is None:
        return 0
    n, left = done
    if n:
        result.findings.append(info(
            "OM206", STAGE, f"{n} stride query(ies) (aten.sym_stride.int, e.g. `x.stride(0)`) "
            "read the strides of contiguous tensors; ONNX tensors have no strides, so onnxmedic "
            "computed them from the sizes (the product of the later dims' sizes).",
            op="aten.sym_stride.int", details={"replaced": n, "left": len(left)}))
    return len(left)


def _storage_order(program: torch.export.ExportedProgram, result: TranslateResult) -> None:
    """as_strided of a view not laid out row-major reads it in its storage order (OM215)."""
    n = _guarded(result, "as_strided inputs in storage order",
                 storage_order_before_as_strided, program)
    if n:
        result.findings.append(info(
            "OM215", STAGE, f"{n} aten.as_strided read a view that is not laid out row-major "
            "(its strides are another order's); ONNX has no storage, so onnxmedic permuted the "
            "view to its storage order and made it contiguous first, as PyTorch reads it.",
            op="aten.as_strided", details={"rewritten": n}))


def _constant_outputs(program: torch.export.ExportedProgram, result: TranslateResult) -> None:
    """Outputs that are Python numbers become 0-d tensors (OM214)."""
    made = _guarded(result, "Python number outputs as tensors", constant_outputs_as_tensors,
                    program)
    if made is None:
        return
    for index, value, dtype in made:
        kind = type(value).__name__
        dt = str(dtype).replace("torch.", "")
        result.findings.append(info(
            "OM214", STAGE, f"output {index} of forward() is a Python {kind} ({value!r}), not "
            f"a tensor; ONNX outputs are tensors, so the file returns it as a 0-d {dt} tensor "
            f"(torch.tensor({value!r})). Its value was fixed at export (computed from sizes "
            "that are static, or from no input at all): the file returns it for every input.",
            suggestion=f"Nothing to do if {value!r} is right for every input. If it depends on "
            "an input's size, declare that dim dynamic (the file then computes it); to keep a "
            f"tensor everywhere, return torch.tensor(...) of it from forward().",
            details={"output": index, "value": value, "dtype": dt}))


def _retry_with_rewrites(result: TranslateResult, program: torch.export.ExportedProgram,
                         args: tuple[Any, ...], kwargs: dict[str, Any],
                         registry: TranslationRegistry, opset: int | None,
                         exc: BaseException, weights: dict[str, Any] | None = None) -> Any:
    """When torch's decompositions crash in a way a rewrite of fixes/rewrites.py avoids,
    rewrite the program (in place: the rewrites change no value) and translate again, up to
    once per rewrite. The ONNX program, with one finding per rewrite, or None."""
    found: list[Finding] = []
    used: set[str] = set()
    for _ in range(len(REWRITES)):
        cause = exc
        todo = [r for r in REWRITES if r.code not in used and r.check(cause) is None]
        if not todo:  # the export error may hide the decomposition's: run that alone (slow)
            _, decomp_error = unsupported_ops(program, registry, opset)
            cause = decomp_error if decomp_error is not None else exc
            todo = [r for r in REWRITES if r.code not in used and r.check(cause) is None]
        if not todo:
            result.not_applied.extend((r.name, str(r.check(cause))[:300]) for r in REWRITES
                                      if r.code not in used)
            return None
        rewrite = todo[0]
        used.add(rewrite.code)
        n = rewrite.apply(program)
        inner = _innermost(cause)
        first = (str(inner).strip().splitlines() or [""])[0][:300]
        found.append(info(
            rewrite.code, STAGE, f"torch's decompositions crashed ({type(inner).__name__}: "
            f"{first}); onnxmedic {rewrite.what.format(n=n)} and translated again.",
            location=location_from_exception(cause),
            suggestion="Nothing to do: the rewrite keeps every value. The crash is a PyTorch "
            "limitation; the line shown is where it came from.", details={"rewritten": n}))
        try:
            prog = onnx_export(program, args, kwargs, registry=registry, opset=opset,
                               weights=weights)
        except Exception as e2:
            logger.debug("translation after %s failed: %s", rewrite.name, e2)
            result.not_applied.append((rewrite.name, f"translation still failed: {e2}"[:300]))
            exc = e2
            continue
        result.findings.extend(found)
        return prog
    return None


_NO_FUNCTION = re.compile(r"No ONNX function found for <OpOverload\(op='([^']+)', "
                          r"overload='([^']+)'\)>")


# torchvision ops ONNX has no operator for: (why, what to do)
_NO_ONNX_FORM: dict[str, tuple[str, str]] = {
    name: ("ONNX has no position-sensitive RoI pooling (each output bin reads its own group of "
           "channels)",
           "Run the position-sensitive pooling and what follows it outside the ONNX model "
           "(export the backbone up to its input), or write it with torchvision.ops.roi_align "
           "per output bin on that bin's channel slice (roi_align translates to RoiAlign).")
    for name in ("torchvision.ps_roi_align", "torchvision.ps_roi_pool")
} | {
    "torchvision.box_iou_rotated": (
        "ONNX has no rotated-box (polygon) intersection",
        "Compute rotated IoU outside the ONNX model, or with axis-aligned boxes "
        "(torchvision.ops.box_iou, plain tensor arithmetic)."),
}


def _innermost(e: BaseException) -> BaseException:
    seen = set()
    while e.__cause__ is not None and id(e) not in seen:
        seen.add(id(e))
        e = e.__cause__
    return e


def _diagnose(program: torch.export.ExportedProgram, registry: TranslationRegistry,
              opset: int | None,
              exc: BaseException) -> list[Finding]:
    """Findings for a failed torch.onnx translation."""
    text = str(exc)
    missing, decomp_error = unsupported_ops(program, registry, opset)
    if decomp_error is not None:
        inner = _innermost(decomp_error)
        return [error(
            "OM203", STAGE, f"torch's decompositions failed on the captured program: "
            f"{type(inner).__name__}: {str(inner).strip().splitlines()[0][:400] if str(inner).strip() else ''}",
            location=location_from_exception(decomp_error),
            suggestion="A `view` on a non-contiguous tensor inside a decomposition is the usual "
            "cause: replace `.view(...)` with `.reshape(...)` at the line shown.",
        )]
    if missing:
        by_op: dict[str, list[torch.fx.Node]] = {}
        for node in missing:
            by_op.setdefault(_op_name(node.target), []).append(node)
        findings = []
        for name, nodes in by_op.items():
            node = nodes[0]
            loc = location_from_node(node)
            ns = name.split(".")[0]
            no_form = _NO_ONNX_FORM.get(name.rsplit(".", 1)[0])
            if no_form is not None:
                findings.append(error(
                    "OM220", STAGE,
                    f"{name} has no ONNX form: {no_form[0]}; used {len(nodes)} time(s), first "
                    f"with ({_node_signature(node)}).",
                    op=name, location=loc, suggestion=no_form[1],
                    details={"count": len(nodes), "signature": _node_signature(node)}))
                continue
            if ns == "aten" or ns == "prims":
                sugg = (f"onnxmedic has no translation for {name} yet. Register one with "
                        f"@onnxmedic.translation(torch.ops.{name}) (an ONNX Script function), "
                        "or rewrite the line shown with ops ONNX supports.")
            else:
                sugg = (f"{name} is a custom operator. Register its ONNX translation with "
                        f"@onnxmedic.translation('{ns}::{name.split('.')[1]}'), e.g.\n"
                        f"    from onnxscript import opset18 as op\n"
                        f"    @onnxmedic.translation('{ns}::{name.split('.')[1]}')\n"
                        f"    def {name.split('.')[1]}(x):\n"
                        f"        return op.Identity(x)  # build the op from ONNX ops here")
            findings.append(error(
                "OM201", STAGE,
                f"{name} has no ONNX translation (torchlib and onnxmedic lack one); used "
                f"{len(nodes)} time(s), first with ({_node_signature(node)}).",
                op=name, location=loc, suggestion=sugg,
                details={"count": len(nodes), "signature": _node_signature(node)},
            ))
        return findings
    inner = _innermost(exc)
    m = _NO_FUNCTION.search(text)
    op = f"{m.group(1)}.{m.group(2)}" if m else None
    node_m = re.search(r"call_function\[target=([\w.]+)\]", text)
    if op is None and node_m:
        op = node_m.group(1).replace("torch.ops.", "")
    return [error(
        "OM202", STAGE,
        f"translating {op or 'the program'} to ONNX failed: {type(inner).__name__}: "
        f"{str(inner).strip().splitlines()[0][:400] if str(inner).strip() else ''}",
        op=op, location=location_from_exception(exc),
        suggestion="The op's arguments (dtype, rank or an attribute) are outside what its "
        "translation supports; the details hold the full error.",
        details={"error": text[-4000:]},
    )]


def translate_stage(ctx: Any) -> bool:
    """The translate stage: the captured program to ONNX at ``ctx.opset``, the ONNX axes named
    after the user's string dims, the IR version fitted to the ONNX Runtime asked for, the FX
    nodes the optimizer removed recorded (for localisation), and the opset reached checked."""
    result = ctx.result
    opset_fix.resolve_opset(ctx)
    if ctx.opts.explain:
        with result.timed("explain"):
            try:
                result.inventory = op_inventory(ctx.program, opset=ctx.opset)
            except Exception as e:  # the translate stage reports decomposition failures
                logger.debug("op inventory failed: %s", e)
    weights = ctx.real_weights
    with result.stage(STAGE) as st:
        try:
            tr = translate(ctx.program, ctx.args, ctx.kwargs, opset=ctx.opset, weights=weights)
        finally:
            if weights is not None:  # the captured program gets the model's own tensors too
                bind_program(ctx.program, weights)
        for what, why in tr.not_applied:
            result.skip_reason(what, why)
        st.add(*tr.findings)
        if not tr.ok:
            st.fail()
            return False
    result.used_translations = tr.used_translations
    prog = ctx.onnx_program = tr.onnx_program
    if ctx.str_dims is not None:
        try:
            rename_dynamic_axes(prog, ctx.str_dims)
        except Exception as e:
            logger.debug("could not rename dynamic axes", exc_info=True)
            result.skip_reason("renaming the ONNX axes after the string dims", str(e)[:300])
    if static_dim_params(prog.model):
        logger.debug("numeric dim_params made static")
    if ctx.opts.ort_version is not None:
        opset_fix.fit_ir_version(result, prog, ctx.opts.ort_version, ctx.opset)
    try:  # what localisation needs to rebuild the program from the file (verify --localize)
        record_removed_nodes(prog)
    except Exception as e:
        logger.debug("the FX nodes the optimizer removed were not recorded", exc_info=True)
        result.skip_reason("recording the FX nodes the optimizer removed", str(e)[:300])
    # over the external-data threshold the weights are not serialised here (a full copy):
    # the check stage reads the graph and references back from the file it writes
    result.onnx_model = graph_proto(prog.model)
    result.opset = opset_of(result.onnx_model)
    if not opset_fix.check_opset(result, ctx.opset, ctx.opts.opset is not None,
                                 ctx.opset_bound):
        return False
    if ctx.auto_dims:
        report_auto_dims(result)
    # (dims the refinement made static are said by OM406 already; "auto" says which by OM404)
    refined = any(f.code == "OM406" for f in result.findings)
    found = [] if ctx.auto_dims or refined else declared_dim_findings(ctx.requested_dims,
                                                                      result.onnx_model)
    result.findings.extend(f for f in found if f.code != "OM407")
    static = [f for f in found if f.code == "OM407"]
    if static:
        result.fail(STAGE, *static)
        return False
    return True
