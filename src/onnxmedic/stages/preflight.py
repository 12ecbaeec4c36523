"""The preflight stage: run the model eagerly on the example inputs.

A model that fails in PyTorch cannot be exported; say so plainly, and recognise the common case
of inputs whose dtype does not match the model's parameters.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any

import torch

from onnxmedic import borrow
from onnxmedic._locate import attribute_writes, location_from_exception
from onnxmedic._tensors import describe, flatten_tensors, reference_mode, to_numpy
from onnxmedic.context import ExportContext
from onnxmedic.findings import Finding, error, info, listed, warning
from onnxmedic.quantized import (
    float_twin,
    quantized_findings,
    quantized_outputs_finding,
    twin_finding,
)

STAGE = "preflight"

_DTYPE_PATTERNS = (
    r"mat1 and mat2 must have the same dtype",
    r"expected (?:scalar type|m1 and m2 to have the same dtype)",
    r"Input type \(.*\) and (?:weight|bias) type \(.*\) should be the same",
    r"expected .* to have the same dtype",
    r"not implemented for '(?:Int|Long|Short|Char|Byte|Bool|Half|BFloat16)'",
    r"found dtype \w+ but expected \w+",
    r"Expected .* dtype",
    r"must have the same dtype",
)


@dataclass
class PreflightResult:
    outputs: Any = None
    finding: Finding | None = None

    @property
    def ok(self) -> bool:
        return self.finding is None


def _param_dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    return {p.dtype for p in model.parameters() if p.is_floating_point()}


def _input_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
    named = [(f"args[{i}]", a) for i, a in enumerate(args)]
    named += [(k, v) for k, v in kwargs.items()]
    return [(n, t) for n, t in named if isinstance(t, torch.Tensor)]


def dtype_suggestion(model: torch.nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[str, str] | None:
    """(what is wrong, the fix) when an input's dtype does not fit the parameters' dtype."""
    pdt = _param_dtypes(model)
    if len(pdt) != 1:
        return None
    want = next(iter(pdt))
    want_name = str(want).replace("torch.", "")
    bad = [(n, t) for n, t in _input_tensors(args, kwargs)
           if t.dtype != want and (t.is_floating_point() or t.dtype in (
               torch.int32, torch.int16, torch.int8, torch.uint8))]
    if not bad:
        return None
    what = ", ".join(f"{n} is {describe(t)}" for n, t in bad)
    cast = {torch.float32: ".float()", torch.float16: ".half()", torch.float64: ".double()",
            torch.bfloat16: ".bfloat16()"}.get(want, f".to(torch.{want_name})")
    fix = (f"the model's parameters are {want_name}: feed {want_name} inputs (e.g. "
           f"`x{cast}` before calling the model, or --input SHAPE:{want_name}), or convert the "
           f"model with `model.to(torch.{str(bad[0][1].dtype).replace('torch.', '')})` if that "
           f"dtype is what you deploy.")
    if any(not t.is_floating_point() for _, t in bad):
        fix += (" Integer tensors fed to a Linear or Conv are usually a bug in the data "
                "pipeline: cast them to float where they enter the model.")
    return what, fix


def run(model: torch.nn.Module | torch.export.ExportedProgram, args: tuple[Any, ...],
        kwargs: dict[str, Any]) -> PreflightResult:
    """Run forward() once as the reference runs (no_grad, no attention fast path: see
    ``reference_mode``); classify a failure."""
    fn = model.module() if isinstance(model, torch.export.ExportedProgram) else model
    try:
        with reference_mode():
            out = fn(*args, **kwargs)
    except Exception as e:
        loc = location_from_exception(e)
        msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        inputs = ", ".join(f"{n}: {describe(t)}" for n, t in _input_tensors(args, kwargs))
        is_dtype = any(re.search(p, str(e), re.IGNORECASE) for p in _DTYPE_PATTERNS)
        sugg = dtype_suggestion(fn, args, kwargs) if isinstance(fn, torch.nn.Module) else None
        if is_dtype or (sugg and isinstance(e, RuntimeError) and "type" in str(e).lower()):
            what = sugg[0] if sugg else inputs
            return PreflightResult(finding=error(
                "OM101", STAGE,
                f"forward() failed in PyTorch because an input's dtype does not match the model "
                f"({what}): {msg}",
                location=loc,
                suggestion=sugg[1] if sugg else "Cast the inputs to the dtype of the model's "
                "parameters.",
                details={"inputs": inputs, "exception": msg},
            ))
        return PreflightResult(finding=error(
            "OM100", STAGE,
            f"forward() raised in PyTorch itself on the example inputs ({inputs or 'no inputs'}): "
            f"{msg}",
            location=loc,
            suggestion="Fix the model or the inputs so that model(*inputs) runs in PyTorch; "
            "check the input shapes the model expects.",
            details={"exception": msg, "inputs": inputs},
        ))
    return PreflightResult(outputs=out)


def preflight_stage(result: Any, model: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any], quantized_ok: bool = False) -> list[Any] | None:
    """The preflight stage on ``result``: the example's outputs (numpy) in PyTorch, or None
    (and the stage failed with its finding)."""
    with result.stage(STAGE) as st:
        quantized = [f for f in quantized_findings(model, args, kwargs)
                     if not (quantized_ok and f.code == "OM211")]
        if quantized:  # torch.ao's quantized kernels: no ONNX form (OM211, OM212)
            st.fail(*quantized)
            return None
        record = borrow.record_inputs(args, kwargs)
        pre = run(model, args, kwargs)
        if not pre.ok:
            st.fail(pre.finding)
            return None
        written = borrow.inputs_written(record)
        outputs = flatten_tensors(pre.outputs)
        if written:
            returned = borrow.returned_as(record, written, outputs)
            result.findings.append(inputs_written_finding(model, written, returned))
        if (bad := quantized_outputs_finding(outputs)) is not None:
            st.fail(bad)
            return None
        odd = [type(t).__name__ for t in outputs if type(t) is not torch.Tensor
               and not isinstance(t, torch.nn.Parameter)]
        if odd:  # a FakeTensor/FunctionalTensor left in the model by an earlier trace
            st.fail(error(
                "OM100", STAGE, f"forward() returned a {odd[0]}, not a plain tensor, on the "
                "example inputs: the model holds tensors left by an earlier trace (an "
                "interrupted torch.export / torch.onnx.export of this model object caches a "
                "traced value in an attribute), so it no longer computes real values.",
                suggestion="Build the model again (or reload it) and export the new object.",
                details={"output_types": odd}))
            return None
    return [to_numpy(t) for t in outputs]


def _parameter_names(model: Any, written: list[str]) -> list[str]:
    """``args[0]`` -> ``args[0] (x)`` where forward()'s signature names the argument."""
    try:
        fn = model.module() if isinstance(model, torch.export.ExportedProgram) else model
        params = [p for p in inspect.signature(fn.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError, AttributeError):
        return written
    out = []
    for w in written:
        m = re.match(r"args\[(\d+)\]", w)
        i = int(m.group(1)) if m else len(params)
        out.append(f"{w} ({params[i].name})" if i < len(params) else w)
    return out


def inputs_written_finding(model: Any, written: list[str],
                           returned: dict[str, int] | None = None) -> Finding:
    """OM013: forward() writes its inputs in place. Every run had its own copy of the example
    inputs (borrow.copy_inputs), so the caller's are unchanged; the ONNX file computes the
    outputs from the values given, and hands back a written input's new value only where
    forward() returns it (``returned``: input path -> output index)."""
    returned = returned or {}
    names = _parameter_names(model, written)
    shown = [f"{n}, returned as output {returned[w]}" if w in returned else n
             for w, n in zip(written, names)]
    kept = [n for w, n in zip(written, names) if w not in returned]
    tail = (" The file returns the new value of each input forward() also returns (the "
            "outputs named above)." if returned else "")
    if kept:
        tail += (f" For {listed(kept, 6)} it cannot: ONNX has no in-place inputs, so the file "
                 "cannot change the caller's input buffer, and torch.onnx does not return an "
                 "input mutation as a graph output - code that reads the input again after "
                 "calling the model sees the new value in PyTorch and the old one with ONNX "
                 "Runtime.")
    return info(
        "OM013", STAGE, f"forward() writes its input(s) in place: {listed(shown, 6)}. Every "
        "run of the model during export had its own copy of the example inputs, so your "
        "tensors are unchanged and each reference was computed on pristine inputs; the ONNX "
        "file computes the outputs from the values it is fed." + tail,
        suggestion=("If the caller needs a written value, return it from forward() (e.g. "
                    "`return out, x`) so that the ONNX file has it as an output; or write "
                    "into a copy (`x = x.clone()` first) to make the model pure.")
        if kept else "Nothing to do: read the new values from the outputs.",
        details={"inputs": written, "returned": returned})


def _shown(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return describe(value)
    text = repr(value)
    return text if len(text) <= 40 else f"{type(value).__name__}"


def _written_items(written: borrow.Written, limit: int = 6) -> tuple[str, list[Any], list[dict[str, Any]]]:
    """'name (what, at file:line `code`)' for each buffer and attribute written, the lines,
    and the details."""
    parts, lines, details = [], [], []
    for qual in [*written.buffers, *written.attributes]:
        mod, name = written.owners[qual]
        kind = "buffer" if qual in written.buffers else "attribute"
        what = kind
        if kind == "attribute":
            now = _shown(vars(mod)[name]) if name in vars(mod) else "deleted"
            what += (f", {_shown(written.before[qual])} -> {now}" if qual in written.before
                     else f", added: {now}")
        at = attribute_writes(mod, name)
        lines += at[:1]
        where = (", written at " + listed((f"{loc.file}:{loc.line} (`{loc.code}`)"
                                            for loc in at), 3)) if at else ""
        parts.append(f"{qual} ({what}{where})")
        details.append({"name": qual, "kind": kind,
                        "written_at": [f"{loc.file}:{loc.line}" for loc in at]})
    text = listed(parts, limit, "; ")
    return text, lines, details


def first_call_state(result: Any, model: Any, state: borrow.State | None) -> None:
    """After the example run: the state the forward wrote, handled so that capture traces
    what a plain call of the model as the user passed it computes.

    * It wrote buffers or attributes only (a cache it filled and the length it is filled to,
      a counter): they are put back as they were before the run, so capture sees the model in
      the state a fresh call sees - a cache filled on the call is traced as computed from the
      inputs, not read as constants the example left in it, which would be wrong at other
      sizes (OM125). The example's outputs came from that same state.
    * It also wrote parameters (first-call, data-dependent initialisation: normflows' ActNorm
      sets its scale and shift from the first batch, and a flag): put back before capture,
      the flag would contradict the parameters (which are not copied), so the model is
      captured as the example run left it, initialised from the example inputs (OM126).
      After export the flag is put back as usual, so the model's next call initialises it
      again from that call's data (borrow.py, OM012)."""
    if state is None or not isinstance(model, torch.nn.Module):
        return
    # the parameters only matter beside written state: their fingerprints are not taken
    # for the usual model that writes nothing
    written = borrow.written_since(state, params=False)
    if not (written.buffers or written.attributes):
        return
    written.params = borrow.params_written(state)
    text, lines, details = _written_items(written)
    if written.params:
        params = listed(written.params, 6)
        result.findings.append(warning(
            "OM126", STAGE, "forward() initialised the model on the example run: it wrote "
            f"parameters ({params}) and the state beside them ({text}). The model was "
            "captured and verified as that run initialised it - from the EXAMPLE INPUTS, not "
            "from your data: the ONNX file carries those values. The state is put back after "
            "export, so the model's next call initialises it again from its own data.",
            location=lines[0] if lines else None,
            suggestion="Run the model on representative data before exporting (its first "
            "call initialises it), then export; or load the trained state first.",
            details={"parameters": list(written.params), "state": details}))
        return
    if not borrow.restorable(state, written):
        result.findings.append(info(
            "OM125", STAGE, f"forward() writes the model's own state when it runs: {text}. "
            "The buffers are too large to copy, so capture reads the state the example run "
            "left; verification at other sizes shows whether that matters.",
            location=lines[0] if lines else None, details={"state": details, "restored": False}))
        return
    borrow.restore_state(state)
    result.findings.append(info(
        "OM125", STAGE, f"forward() writes the model's own state when it runs: {text}. Capture "
        "traced the model as it was before the example run - the state a plain call of the "
        "model you passed sees: what the call fills (a cache) is traced as computed from the "
        "inputs, not read back as constants the example left in it, which would hold only "
        "at the example's sizes.",
        location=lines[0] if lines else None,
        suggestion="Nothing to do. The model is left as it was before export.",
        details={"state": details, "restored": True}))


def export_preflight(ctx: ExportContext) -> bool:
    """Run the model eagerly on the example inputs; its outputs are the reference the later
    stages compare with."""
    twin = float_twin(ctx.model)  # an eager torch.ao quantized model it can export
    ctx.expected = preflight_stage(ctx.result, ctx.model, ctx.args, ctx.kwargs,
                                   quantized_ok=twin is not None)
    if ctx.expected is not None:  # capture sees the state a plain call sees (OM125, OM126)
        first_call_state(ctx.result, ctx.model, ctx.state)
    if ctx.expected is not None and twin is not None:
        ctx.result.findings.append(twin_finding(ctx.model))
        ctx.judged_against, ctx.model = ctx.model, twin
    return ctx.expected is not None
