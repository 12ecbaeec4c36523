"""The capture stage: dynamic-shape normalisation, the capture strategies, refinement of
rejected dynamic shapes, and the stage's findings."""

from __future__ import annotations

import copy
import inspect
import logging
import re
from typing import Any

import torch
from torch.export import Dim

from onnxmedic import inputs as inputs_mod
from onnxmedic._locate import location_from_stack_text
from onnxmedic._torch_compat import (
    fake_weights,
    is_derived_dim,
    str_dims_to_export_dims,
    unbound_tensors,
)
from onnxmedic.capture.strategies import (
    RegisterPytreeTypes,
    TorchExportNonStrict,
    capture,
    classify_capture_error,
)
from onnxmedic.context import ExportContext
from onnxmedic.findings import Finding, error, info, listed, warning
from onnxmedic.onnxfile import graph_io

logger = logging.getLogger(__name__)
STAGE = "capture"

# The model is captured and translated on fake weights (OM515) when its parameters and buffers
# take more than this share of the memory available. On real weights, capture and translation
# hold no second copy either (torch.export fakes the parameters itself; torch.onnx wraps their
# storage, and its folded transposes are views): measured on a 2 GiB Qwen2 decoder, both add
# under 0.1 GiB. What the fake capture removes is the risk of a copy where a capture path
# needs values, so it is kept for models that could not afford one. A module attribute so
# tests can force it.
FAKE_WEIGHTS_SHARE = 0.5
# the strategies that need no weight values (the others read buffers or propagate real values)
FAKE_STRATEGIES = [TorchExportNonStrict, RegisterPytreeTypes]


def capture_stage(ctx: ExportContext) -> bool:
    """Capture ``ctx.model`` as an ExportedProgram (an ExportedProgram is taken as given)."""
    result = ctx.result
    with result.stage(STAGE) as st:
        if isinstance(ctx.model, torch.export.ExportedProgram):
            ctx.program = ctx.model
            result.attempts = [{"strategy": "given ExportedProgram", "ok": True,
                                "seconds": 0.0, "error": None}]
        elif not _capture_module(ctx):
            return False
    result.program = ctx.program
    return not st.failed


def export_dims(ctx: ExportContext) -> Any:
    """The user's dynamic_shapes as torch.export takes them ("auto" and dynamic_axes completed,
    string dims turned into Dims; ``ctx.str_dims`` keeps the strings for the ONNX axes)."""
    dynamic_shapes = ctx.opts.dynamic_shapes
    ctx.auto_dims = dynamic_shapes == inputs_mod.AUTO
    if ctx.auto_dims or inputs_mod.is_dynamic_axes(dynamic_shapes):
        dynamic_shapes = inputs_mod.complete_dynamic_shapes(
            ctx.model, dynamic_shapes if ctx.auto_dims else
            inputs_mod.dynamic_axes_to_specs(dynamic_shapes), ctx.args, ctx.kwargs)
    ctx.requested_dims = dynamic_shapes
    normalised = normalise_dims(dynamic_shapes)
    if normalised is not None:  # strings and plain Dims: one form, torch.export's DYNAMIC
        dims, ctx.str_dims = normalised
        return dims
    dims, need_rename = str_dims_to_export_dims(dynamic_shapes)
    ctx.str_dims = dynamic_shapes if need_rename else None
    return dims


def normalise_dims(dynamic_shapes: Any) -> tuple[Any, Any] | None:
    """One form for the dims users write: a string ({0: "batch"}) and a plain
    ``torch.export.Dim("batch")`` (bounds kept: ``Dim("n", min=2, max=64)``) both become
    ``Dim.DYNAMIC``, which torch.export may refine (a model that needs batch != 1 narrows the
    range instead of failing with "Constraints violated"); the names are kept for the ONNX
    axes. Returns (dims for torch.export, the same structure with names), or None when there
    is nothing to normalise or derived dims (``2 * seq``) need the Dims as they are."""
    found = {"dims": 0, "derived": 0}

    def walk(v: Any) -> tuple[Any, Any]:
        if isinstance(v, dict):
            pairs = {k: walk(x) for k, x in v.items()}
            return ({k: p[0] for k, p in pairs.items()}, {k: p[1] for k, p in pairs.items()})
        if isinstance(v, (list, tuple)):
            pairs = [walk(x) for x in v]
            return (type(v)(p[0] for p in pairs), type(v)(p[1] for p in pairs))
        if is_derived_dim(v):
            found["derived"] += 1
            return v, v
        if isinstance(v, Dim):
            found["dims"] += 1
            lo, hi = v.min, v.max
            bounded = {**({"min": lo} if lo not in (0, None) else {}),
                       **({"max": hi} if isinstance(hi, int) and hi < 2**62 else {})}
            return (Dim.DYNAMIC(**bounded) if bounded else Dim.DYNAMIC), v.__name__
        if isinstance(v, str):
            found["dims"] += 1
            return Dim.DYNAMIC, v
        return v, v

    if dynamic_shapes is None or isinstance(dynamic_shapes, str):
        return None
    dims, names = walk(dynamic_shapes)
    if found["derived"] or not found["dims"]:
        return None
    return dims, names


def _wants_fake_weights(model: torch.nn.Module) -> tuple[int, int] | None:
    """(weight bytes, available bytes) when the model's weights take more than
    FAKE_WEIGHTS_SHARE of the memory available; None otherwise."""
    from onnxmedic._tensors import tensor_bytes
    from onnxmedic.sandbox import available_memory

    avail = available_memory()
    need = tensor_bytes(model)
    if avail is None or need <= FAKE_WEIGHTS_SHARE * avail:
        return None
    return need, avail


def _fake_capture(ctx: ExportContext, dims: Any, sizes: tuple[int, int]) -> list[Any] | None:
    """Capture on fake weights (the strategies that need no values); the attempts when one
    worked and every tensor of the program has a real counterpart to bind (the real tensors
    are kept in ``ctx.real_weights`` for translation), else None (said why)."""
    result = ctx.result
    try:
        with fake_weights(ctx.model, ctx.args, ctx.kwargs) as (fargs, fkwargs, real):
            attempts = capture(ctx.model, fargs, fkwargs, dims, strategies=FAKE_STRATEGIES)
    except Exception as e:  # a tensor the fake mode cannot take: capture as usual
        logger.debug("fake-weight capture failed", exc_info=True)
        result.skip_reason("capture on fake weights", f"{type(e).__name__}: {e}"[:300])
        return None
    program = attempts[-1].program
    if program is None:
        result.skip_reason("capture on fake weights", str(attempts[-1].summary()["error"])[:300])
        return None
    unbound = unbound_tensors(program, real)
    if unbound:
        result.skip_reason("capture on fake weights", "tensor(s) the model's own cannot be "
                           f"bound to (made while it runs, or complex): {listed(unbound, 5)}")
        return None
    ctx.real_weights = real
    need, avail = sizes
    result.findings.append(info(
        "OM515", STAGE, f"the model's weights take {need / 2**30:.2f} GiB, more than "
        f"{FAKE_WEIGHTS_SHARE:.0%} of the {avail / 2**30:.1f} GiB available; it was captured "
        "and translated on fake weights (shapes only), and its own tensors were bound to the "
        "ONNX model afterwards (written from the model's memory, not copied).",
        details={"weight_bytes": need, "available_bytes": avail}))
    return attempts


def _capture_module(ctx: ExportContext) -> bool:
    result = ctx.result
    dims = export_dims(ctx)
    skipped: list[tuple[str, str]] = []
    sizes = _wants_fake_weights(ctx.model)
    attempts = _fake_capture(ctx, dims, sizes) if sizes is not None else None
    if attempts is None:
        attempts = capture(ctx.model, ctx.args, ctx.kwargs, dims, skipped=skipped)
    for name, reason in skipped:
        result.skip_reason(f"capture strategy {name}", reason)
    if attempts[-1].program is None and dims is not None:
        attempts += refined_capture(result, ctx.model, ctx.args, ctx.kwargs, dims, attempts)
    result.attempts = [a.summary() for a in attempts]
    ctx.program = attempts[-1].program
    ctx.size_guards = attempts[-1].size_guards
    if ctx.program is None:
        result.fail(STAGE, classify_capture_error(attempts))
        return False
    if attempts[-1].caches:
        result.findings.append(caches_finding(attempts[-1].caches))
    if attempts[-1].rewrites:
        result.findings.append(rewrites_finding(attempts[-1].rewrites))
    neutralised = attempts[-1].neutralised
    if neutralised is not None and (neutralised.switches or neutralised.checks):
        result.findings.append(validation_off_finding(neutralised))
    if neutralised is not None and neutralised.masked:
        result.findings.append(masked_finding(neutralised.masked))
        # the graph runs the body where the model skips it: probe with none, all, some selected
        ctx.branch_probe = ctx.mask_probe = True
    if "draft_export" in attempts[-1].strategy:
        result.findings.append(specialised_finding(attempts))
        ctx.branch_probe = True
    if attempts[-1].packed is not None and attempts[-1].packed.calls:
        result.findings.append(packed_finding(attempts[-1].packed))
    kept = attempts[-1].kept
    if kept is not None and kept.lines:
        result.findings.append(kept_sizes_finding(kept))
    decided = attempts[-1].decided
    if attempts[-1].constants or (decided is not None and decided.guards):
        result.findings.append(constants_finding(attempts))
    if decided is not None and decided.constant:
        result.findings.append(input_free_finding(decided))
    if pytree_findings(result, attempts):
        # the example's outputs were flattened before these types were registered
        ctx.expected = None
    for a in attempts[:-1]:
        result.findings.append(info(
            "OM110", STAGE, f"{a.strategy} failed ({a.summary()['error']}); "
            f"{attempts[-1].strategy} worked."))
    return True


def caches_finding(caches: list[tuple[str, str, str]]) -> Finding:
    """OM118: the capture worked with size-keyed library caches switched off (capture.caches)."""
    return info(
        "OM118", STAGE, "capture failed in a library cache keyed on tensor sizes, which fixes "
        "dynamic dims to the example's (or cannot hash symbolic sizes), and worked with "
        + "; ".join(f"{switch} - {cache}" for _lib, switch, cache in caches)
        + ". The same computation without the cache; the library's settings and the cache's "
        "contents were put back after the capture, and verification compared the ONNX model "
        "with the model as it is (cache on).",
        suggestion="Nothing to do.",
        details={"switches": [switch for _lib, switch, _cache in caches]})


def rewrites_finding(rewrites: list[str]) -> Finding:
    """OM221: torchvision functions captured in a traceable form (capture.detection)."""
    return info(
        "OM221", STAGE, "torchvision's detection code captured with functions written so "
        "that torch.export keeps their data-dependent sizes symbolic: " + "; ".join(rewrites)
        + ". They compute what torchvision's do; torchvision's were put back after the "
        "capture, and verification compared the ONNX model with them.",
        suggestion="Nothing to do.", details={"rewrites": rewrites})


def validation_off_finding(record: Any) -> Finding:
    """OM115: the capture worked with validation off (library switches, check-only guards)."""
    from onnxmedic._locate import is_user_file
    from onnxmedic.findings import Location

    parts = []
    if record.switches:
        parts.append("library validation switched off for the capture: "
                     + ", ".join(record.switches))
    if record.checks:
        parts.append("checks that only raise or warn taken as passing: " + "; ".join(
            f"{f}:{n} (`{c}`)" for f, n, c in record.checks))
    user = next(((f, n, c) for f, n, c in record.checks if is_user_file(f)), None)
    return warning(
        "OM115", STAGE, "; ".join(parts) + ". The ONNX model computes what the model computes "
        "on every input it accepts; it does not raise or warn on an input the checks would "
        "reject. The settings were restored after the capture; verification ran against the "
        "model with validation on.",
        location=Location(file=user[0], line=user[1], code=user[2]) if user else None,
        suggestion="Validate inputs before calling the ONNX model if invalid values can reach "
        "it (e.g. a scale <= 0, an unsorted time grid).",
        details={"switches": list(record.switches),
                 "checks": [f"{f}:{n}" for f, n, _ in record.checks]})


def masked_finding(sites: list[Any]) -> Finding:
    """OM117: ``if torch.any(m):`` guards whose body only writes through ``m``, taken for
    every input (capture.masked)."""
    from onnxmedic.findings import Location

    first = sites[0]
    return info(
        "OM117", STAGE, "Python control flow tests whether a mask selects anything, and the "
        "branch only writes through that mask: " + listed(
            (f"{s} writes and reads every tensor through `{s.mask}`" for s in sites), 4, "; ")
        + ". With nothing selected the branch writes nothing, so the capture took it for every "
        "input: the same values. The ONNX model runs it on zero selected elements where the "
        "model skips it; verification added inputs meant to select none, all or some of them.",
        location=Location(file=first.file, line=first.line, code=first.code),
        suggestion="Nothing to do. In your own code, dropping the `if` (or writing "
        "`torch.where(m, f(x), out)`) exports without this recovery.",
        details={"sites": [{"at": f"{s.file}:{s.line}", "code": s.code, "mask": s.mask}
                           for s in sites]})


def packed_finding(record: Any) -> Finding:
    """OM207: packed-sequence RNN calls captured on the padded batch and its lengths."""
    calls: dict[tuple[str, str], Any] = {}
    for kind, loc in record.calls:
        calls.setdefault((kind, f"{loc.file}:{loc.line}" if loc is not None else "?"), loc)
    where = "; ".join(f"nn.{kind} over pack_padded_sequence at {at}"
                      + (f" (`{loc.code}`)" if loc is not None and loc.code else "")
                      for (kind, at), loc in calls.items())
    return info(
        "OM207", STAGE, f"packed sequences: {where}. torch.export cannot trace a "
        "PackedSequence (its sizes come from the lengths' values) and ONNX has none, so "
        "onnxmedic captured each pack_padded_sequence -> RNN -> pad_packed_sequence on the "
        "padded batch and its lengths (onnxmedic::padded_rnn): in the ONNX file one "
        f"{'/'.join(sorted({k for k, _ in calls}))} node per layer with sequence_lens - each "
        "sequence runs over its own length, h_n/c_n are the states at its last valid step, "
        "outputs past it are padding_value, and pad_packed_sequence's max(lengths) time steps "
        "are sliced at run time. The values are the packed path's; the ONNX model does not "
        "check the lengths as pack_padded_sequence does (each in 1..T, sorted with "
        "enforce_sorted=True).",
        location=next(iter(calls.values())),
        suggestion="Nothing to do. Feed lengths in 1..T (as PyTorch requires).",
        details={"calls": [{"rnn": k, "at": at} for k, at in calls]})
def kept_sizes_finding(kept: Any) -> Finding:
    """OM127: lines that made a Python number or a constant tensor of a dynamic size, which the
    capture kept symbolic (capture.sizes)."""
    from onnxmedic.findings import Location

    file, line, code, _ = kept.lines[0]
    shown = listed((f"{f}:{n} (`{c}`): {w}" for f, n, c, w in kept.lines), 6, "; ")
    return info(
        "OM127", STAGE, "code turns dynamic sizes into Python numbers or constant tensors, which "
        f"would fix them to the example's values; the capture kept them symbolic: {shown}. "
        "The ONNX model computes these values from the input's shape; verification ran the "
        "dynamic dims at other sizes.",
        location=Location(file=file, line=line, code=code),
        suggestion="Nothing to do. In your own code, `torch.sym_float(n)` instead of "
        "`float(n)`, `n` instead of `int(n)` and `torch.tensor(...)` instead of "
        "`torch.as_tensor(...)` of a size keep it symbolic without this recovery.",
        details={"lines": [{"at": f"{f}:{n}", "code": c, "kept": w} for f, n, c, w in kept.lines],
                 "modules": list(kept.modules)})


def constants_finding(attempts: list[Any]) -> Finding:
    """OM116: capture worked once buffers' values were known: names the buffers, their values,
    the lines whose control flow read them and the branch taken."""
    cause = classify_capture_error(attempts[:-1])
    consts = attempts[-1].constants
    decided = attempts[-1].decided
    parts = []
    if consts:
        parts.append("0-d integer buffers registered non-persistent read as constants: "
                     + listed((f"{k}={v}" for k, v in consts.items()), 8))
    if decided is not None and decided.buffers:
        parts.append("buffers read by the guards: " + ", ".join(
            f"{k}={v}" for k, v in decided.buffers.items()))
    guards = decided.guards if decided is not None else []
    if guards:
        parts.append("lines that read them: " + listed(
            (f"{f}:{n} (`{c}`) {w}" for f, n, c, w in guards), 6, "; "))
    where = (f" ({cause.details.get('raised_at')})" if cause.details.get("raised_at") else "")
    loc = cause.location
    if guards:
        from onnxmedic.findings import Location

        loc = Location(file=guards[0][0], line=guards[0][1], code=guards[0][2])
    return info(
        "OM116", STAGE, f"Python control flow depends on values the model keeps in buffers{where}"
        "; torch.export sees buffers as unknown inputs, but in the ONNX file they are constants "
        "(initializers), so the capture used their current values: " + "; ".join(parts)
        + ". The ONNX model computes the branch these values select, for every input; "
        "verification compared it with the model as it is. The model was left as it was.",
        location=loc,
        suggestion="Nothing to do if these buffers keep their values after export (config "
        "constants, a fixed time grid, an initialised-once flag). If your code changes them "
        "(loads a checkpoint that sets them, re-initialises), export again after the change. "
        "To avoid the failed first attempt, keep such values as Python numbers (attributes, "
        "not buffers).",
        details={"constants": dict(consts),
                 "buffers": dict(decided.buffers) if decided is not None else {},
                 "guards": [{"at": f"{f}:{n}", "code": c, "read": w}
                            for f, n, c, w in guards]})


def input_free_finding(decided: Any) -> Finding:
    """OM119: guards on values that depend on no input (made in forward from constants and
    static sizes, or computed from parameters), decided by those values: names the lines,
    what each read and the parameters."""
    from onnxmedic.findings import Location

    file, line, code, _ = decided.constant[0]
    lines = listed((f"{f}:{n} (`{c}`) {w}" for f, n, c, w in decided.constant), 6, "; ")
    params = ("; parameters read: " + listed(
        (f"{k}={v}" for k, v in decided.parameters.items()), 8) if decided.parameters else "")
    return info(
        "OM119", STAGE, "Python control flow reads tensor values that depend on no input - "
        "tensors made in forward from constants and static sizes, plain tensor attributes, "
        f"values computed from parameters - which torch.export cannot read; the capture decided them by their values: {lines}"
        f"{params}. These values are the same on every call, so the ONNX model takes the "
        "branch (and the loop count) the model takes for every input; a guard that involves an "
        "input was not decided this way.",
        location=Location(file=file, line=line, code=code),
        suggestion="Nothing to do. To export without this recovery, compute such values as "
        "Python numbers (e.g. `n = round((t1 - t0) / h)` from floats, not from a tensor).",
        details={"guards": [{"at": f"{f}:{n}", "code": c, "read": w}
                            for f, n, c, w in decided.constant],
                 "parameters": dict(decided.parameters)})


_SPECIALISED = re.compile(r"L\['([A-Za-z_]\w*)'\]\.size\(\)\[(\d+)\] as dynamic but your code "
                          r"specialized it to be a constant \((\d+)\)")


def specialised_finding(attempts: list[Any]) -> Finding:
    """OM114: capture only worked by specialising data-dependent control flow (draft_export)."""
    cause = classify_capture_error(attempts[:-1])
    where = (f" at {cause.location.file}:{cause.location.line}"
             + (f" (`{cause.location.code}`)" if cause.location.code else "")
             if cause.location is not None and cause.location.file else "")
    if cause.details.get("guard"):
        where += f", in the library at {cause.details['guard']}"
    equal = attempts[-1].equal
    taken = ("; torch.equal's outcome was taken from the example at " + "; ".join(
        str(e) for e in equal) + " - the ONNX model uses that outcome for every input, so "
        "it differs from the model where the compared tensors are equal on one input and not "
        "on another (e.g. a kernel's fast path for test points equal to the training points)"
        if equal else "")
    return warning(
        "OM114", "capture", f"Python control flow depends on tensor values{where}; the model was "
        "captured with torch.export.draft_export, which follows the branch the example takes"
        f"{taken}. The ONNX model computes THAT BRANCH FOR EVERY INPUT. Verification adds inputs "
        "meant to take the other branches (permuted, negated, zero, scaled); a mismatch there "
        "is the divergence.",
        location=cause.location, suggestion=cause.suggestion,
        details={"attempts": [a.summary() for a in attempts],
                 "equal": [{"at": f"{e.file}:{e.line}", "code": e.code, "value": e.value}
                           for e in equal]})


def refined_capture(result: Any, model: Any, args: tuple[Any, ...],
                     kwargs: dict[str, Any], dims: Any, attempts: list[Any]) -> list[Any]:
    """When torch.export rejects the dynamic shapes, apply what it says and capture again:
    its "Suggested fixes" (equal dims, constants, bounds; torch's own
    refine_dynamic_shapes_from_suggested_fixes), and dims it reports the code specialises to a
    constant (made static). Say what changed (OM406). At most three rounds."""

    applied: list[str] = []
    extra: list[Any] = []
    followed = False
    where: list[Any] = []  # the user's lines that fix a declared dim
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
        if refined is None and isinstance(dims, (dict, list, tuple)):
            found = _SPECIALISED.findall(text)
            lines = specialised_lines(text)
            if found and not followed and isinstance(dims, dict):
                # an input left undeclared (a mask beside its ids) may be what pins the
                # declared dim: let its dims of the same sizes follow (Dim.AUTO) first
                followed = True
                refined, follows = _follow_declared(model, args, kwargs, dims, found, lines)
                applied += follows
                where += [lines.get((n, d)) for n, d, _ in found] if follows else []
            if found and refined is None:
                refined = copy.copy(dims) if isinstance(dims, dict) else list(dims)
                keys = _spec_keys(model, args, kwargs, dims)
                for name, d, value in found:
                    key = keys.get(name)
                    spec = refined[key] if key is not None else None
                    if isinstance(spec, dict) and int(d) in spec and not _eager_runs_at(
                            model, args, kwargs, dims, keys, name, int(d), int(value)):
                        refined[key] = {k: v for k, v in spec.items() if k != int(d)} or None
                        loc = lines.get((name, d))
                        where.append(loc)
                        at = f", at {loc.file}:{loc.line}" if loc is not None else ""
                        applied.append(f"{name}[{d}] = {value} (the model fixes it{at})")
        if refined is not None and not isinstance(dims, dict) and list(refined) == list(dims) \
                or refined == dims:
            refined = None  # nothing the model fixes for good: OM401 (the line) stands
        if refined is None:
            break
        dims = type(dims)(refined) if isinstance(dims, tuple) else refined
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
                location=next((loc for loc in where if loc is not None), None),
                details={"fixes": applied}))
            break
    return extra


def _eager_runs_at(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dims: Any,
                   keys: dict[str, Any], name: str, dim: int, value: int) -> bool:
    """Whether the model runs in PyTorch with input ``name``'s ``dim`` at ``value + 1`` -
    together with every other declared dim of that example size (a mask's batch and sequence
    beside its ids'), values drawn in each input's range. A dim torch.export finds fixed is
    made static only where the model itself cannot take another size (a weight's shape: eager
    fails too); where eager runs, the capture specialised Python code (a loop over the size, a
    branch on it) and making the dim static would silently drop what the user declared: OM401
    names that line instead. The model's state is put back after the call."""
    from onnxmedic._tensors import reference_mode, tensor_like
    from onnxmedic.borrow import copy_inputs, record_state, restore_state

    args, kwargs = copy_inputs((args, kwargs))  # the model may write its inputs
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return False
    t = bound.arguments.get(name)
    if not isinstance(t, torch.Tensor) or dim >= t.dim():
        return False
    gen = torch.Generator().manual_seed(0)
    for arg, key in keys.items():
        x = bound.arguments.get(arg)
        spec = dims[key] if isinstance(x, torch.Tensor) else None
        axes = [a for a in (spec or {}) if isinstance(a, int) and a < x.dim()
                and int(x.shape[a]) == value] if isinstance(spec, dict) else []
        if arg == name and dim not in axes:
            axes.append(dim)
        if axes:
            shape = [value + 1 if a in axes else n for a, n in enumerate(x.shape)]
            bound.arguments[arg] = tensor_like(x, tuple(shape), gen)
    state = record_state(model)
    try:
        with reference_mode():
            model(*bound.args, **bound.kwargs)
        return True
    except Exception:  # noqa: BLE001 - any failure means the size is not the model's
        return False
    finally:
        restore_state(state)


def _spec_keys(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
               dims: Any) -> dict[str, Any]:
    """forward's argument name -> its key in ``dims``: the name itself for a dict, the position
    for a tuple or list (torch.export names inputs by forward's parameters: ``L['x']``)."""
    if isinstance(dims, dict):
        return {k: k for k in dims}
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return {}
    return {name: i for i, name in enumerate(bound) if i < len(dims)}


def specialised_lines(text: str) -> dict[tuple[str, str], Any]:
    """(input, dim) -> the user's line torch.export's constraint message blames for
    specialising it ("You marked L['x'].size()[0] as dynamic but your code specialized it ...
    User stack: ...")."""
    out = {}
    for bullet in text.split("\n  - ")[1:]:
        m = _SPECIALISED.search(bullet)
        loc = location_from_stack_text(bullet) if m else None
        if m and loc is not None:
            out[(m.group(1), m.group(2))] = loc
    return out


def _follow_declared(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                     dims: dict[str, Any], found: list[tuple[str, str, str]],
                     lines: dict[tuple[str, str], Any]) -> tuple[dict[str, Any] | None, list[str]]:
    """``dims`` where every tensor input the user left undeclared has its dims of a size a
    declared dim was specialised to marked ``Dim.AUTO`` (torch.export then makes them equal to
    the declared dim, or static where the model fixes them), and what changed; (None, []) when
    there is no such dim."""
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return None, []
    sizes = {int(value): (f"{name}[{d}]", lines.get((name, d))) for name, d, value in found}
    refined, follows = copy.copy(dims), []
    for name, value in bound.items():
        if dims.get(name) is not None or not isinstance(value, torch.Tensor):
            continue
        auto = {d: Dim.AUTO for d, n in enumerate(value.shape) if int(n) in sizes}
        if auto:
            refined[name] = auto
            for d in auto:
                label, loc = sizes[int(value.shape[d])]
                at = f", at {loc.file}:{loc.line}" if loc is not None else ""
                follows.append(f"{name}[{d}] follows {label} (undeclared, same size: made "
                               f"dynamic where the model needs them equal{at})")
    return (refined, follows) if follows else (None, [])


def _declared(requested: Any, proto: Any) -> list[tuple[str, int, str, Any]]:
    """(input, axis, declared name, the ONNX dim) for every dim declared dynamic, by input
    name (a dict) or position (a tuple) - a string or a Dim."""
    if not isinstance(requested, (dict, list, tuple)):
        return []
    names, dims, _ = graph_io(proto)
    by_name = dict(zip(names, dims))
    pairs = (requested.items() if isinstance(requested, dict)
             else zip(names, requested) if len(requested) == len(names) else [])
    out = []
    for name, spec in pairs:
        onnx_dims = by_name.get(name)
        axes = (spec.items() if isinstance(spec, dict) else enumerate(spec)
                if isinstance(spec, (list, tuple)) else [])
        for axis, want in axes:
            if want is None or onnx_dims is None or not isinstance(axis, int) \
                    or axis >= len(onnx_dims):
                continue
            label = want if isinstance(want, str) else getattr(want, "__name__", str(want))
            out.append((name, axis, label, onnx_dims[axis]))
    return out


def declared_dim_findings(requested: Any, proto: Any) -> list[Finding]:
    """What became of the dims declared dynamic: OM407 (an error) for each that is a fixed
    size in the ONNX model - the file would reject other sizes; one OM406 warning for dims
    torch.export found equal to another (``b = a``: the ONNX model names them alike)."""
    found, merged = [], []
    for name, axis, label, got in _declared(requested, proto):
        if isinstance(got, int):
            found.append(error(
                "OM407", "translate", f"input {name!r} dim {axis} was declared dynamic "
                f"({label}) but is fixed to {got} in the ONNX model: the file would reject "
                "every other size, so it is not written.",
                suggestion="The model specialises this dim (torch.export's guards in the "
                "capture attempts say where): compute sizes with x.shape[...] instead of "
                "Python ints, or declare the dim static.",
                details={"input": name, "dim": axis, "fixed_to": got}))
        elif got and got != label and f"{label} = {got}" not in merged:
            merged.append(f"{label} = {got}")
    if merged:
        found.append(warning(
            "OM406", "capture", f"the model requires dims declared apart to be equal: "
            f"{'; '.join(merged)}; the ONNX model names each pair alike.",
            suggestion="Declare them with one Dim (or one name) to silence this.",
            details={"fixes": merged}))
    return found


def static_declared_dims(requested: Any, proto: Any) -> list[Finding]:
    """The OM407 findings of declared_dim_findings."""
    return [f for f in declared_dim_findings(requested, proto) if f.code == "OM407"]


def report_auto_dims(result: Any) -> None:
    """dynamic_shapes='auto': say which dims stayed dynamic and which the model fixed. Capture
    is size-oblivious, so an example size of 1 does not by itself make a dim static."""
    names, dims, _ = graph_io(result.onnx_model)
    dynamic, static = [], []
    for name, ds in zip(names, dims):
        for i, d in enumerate(ds):
            (static.append(f"{name}[{i}]={d}") if isinstance(d, int)
             else dynamic.append(f"{name}[{i}]"))
    result.findings.append(info(
        "OM404", "capture", "dynamic_shapes='auto': dynamic: " + (", ".join(dynamic) or "none")
        + "; static (the model fixes them): " + (", ".join(static) or "none") + ".",
        details={"dynamic": dynamic, "static": static}))


def pytree_findings(result: Any, attempts: list[Any]) -> bool:
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
