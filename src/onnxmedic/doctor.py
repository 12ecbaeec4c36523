"""doctor and run: an ONNX file for a target runtime, without PyTorch.

doctor lints the file (external data, opset against the runtime, unused initializers, dynamic
dims, shape information, ops and dtypes without kernels) and smoke-tests it with random inputs;
run checks feeds against the input contract and runs the model. Both treat the file as
untrusted: external data that leaves the model's folder is refused before any runtime sees it,
and ONNX Runtime only ever runs in the sandbox.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx

from onnxmedic import sandbox
from onnxmedic.findings import Finding, Severity, error, info, warning
from onnxmedic.fixes import dtypes as fx
from onnxmedic.fixes.dtypes import tensorrt_table
from onnxmedic.fixes.kernels import (
    cpu_fallback_finding,
    kernel_gap_finding,
    soft_kernel_finding,
    trt_fallback_finding,
)
from onnxmedic.fixes.opset import limits
from onnxmedic.isa import int8_findings, session_config_finding, session_config_of
from onnxmedic.onnxfile import (
    all_graphs,
    check_feeds,
    input_names,
    load_checked,
    opset_of,
    random_feeds,
    skeleton,
)
from onnxmedic.result import ExportResult, RunResult
from onnxmedic.stages import check as checks
from onnxmedic.stages.verify import record_runtime

STAGE = "lint"


def lint(model: onnx.ModelProto, ort_opset: int | None = None) -> list[Finding]:
    """Static findings about a loaded model (no runtime)."""
    findings: list[Finding] = []
    g = model.graph
    init_names = {i.name for i in g.initializer}
    used: set[str] = set()
    for sub in all_graphs(g):
        for n in sub.node:
            used.update(n.input)
    used.update(o.name for o in g.output)
    unused = sorted(init_names - used)
    if unused:
        nbytes = sum(int(np.prod(i.dims or [1])) for i in g.initializer if i.name in unused)
        findings.append(warning(
            "OM530", STAGE, f"{len(unused)} initializer(s) are never used "
            f"({', '.join(unused[:5])}{'…' if len(unused) > 5 else ''}; ~{nbytes} elements).",
            suggestion="Remove them (onnxscript's optimizer or onnx-ir's "
            "RemoveUnusedNodesPass) to shrink the file.", details={"unused": unused}))
    dyn = []
    for v in list(g.input) + list(g.output):
        if v.name in init_names:
            continue
        dims = v.type.tensor_type.shape.dim if v.type.HasField("tensor_type") else []
        names = [d.dim_param or "?" for d in dims if not d.HasField("dim_value")]
        if names:
            dyn.append(f"{v.name}[{', '.join(names)}]")
    if dyn:
        findings.append(info("OM531", STAGE, "dynamic dimensions: " + "; ".join(dyn),
                             details={"dynamic": dyn}))
    try:
        inferred = onnx.shape_inference.infer_shapes(skeleton(model), data_prop=True)
        known = {v.name for v in inferred.graph.value_info} | {o.name for o in g.output} | {
            i.name for i in g.input} | init_names
        missing = [o for n in g.node for o in n.output if o and o not in known]
        if missing:
            findings.append(info(
                "OM532", STAGE, f"{len(missing)} intermediate value(s) have no type/shape "
                f"information after ONNX shape inference (e.g. {missing[0]!r}).",
                suggestion="Runtimes that plan memory ahead (TensorRT) may need shapes; "
                "onnx.shape_inference or symbolic shape inference can add them.",
                details={"missing": missing[:50]}))
    except Exception:
        pass  # the checker finding covers broken models
    opset = opset_of(model)
    if ort_opset is not None and opset is not None and opset > ort_opset:
        findings.append(error(
            "OM533", STAGE, f"the model uses opset {opset}; this ONNX Runtime supports opsets up "
            f"to {ort_opset}.", suggestion=f"Re-export with --opset {ort_opset} or convert with "
            f"onnx.version_converter.convert_version(model, {ort_opset}), or upgrade ONNX "
            "Runtime."))
    return findings


def ort_version_lint(proto: Any, ort: tuple[int, int] | None) -> list[Finding]:
    """doctor --ort-version: opset and IR version against that release's compatibility row."""
    if ort is None:
        return []
    name = f"ONNX Runtime {ort[0]}.{ort[1]}"
    lim = limits(ort)
    if lim is None:
        return [error("OM322", "lint", f"{name} is older than 1.0; onnxmedic has no data on it.")]
    opset = opset_of(proto)
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


def kernel_lint(proto: Any, target: str) -> list[Finding]:
    """doctor: every node without a kernel on ``target`` as typed (nothing is changed)."""
    gaps = fx.kernel_gaps(proto, target) or []
    nodes = {n.name: n for n in proto.graph.node}
    found = [kernel_gap_finding(g, target, nodes.get(g.node), "lint", proto)
             for g in gaps if g.kind not in ("soft", "cpu-fallback", "trt-fallback")]
    soft = [g for g in gaps if g.kind == "soft"]
    moved = [g for g in gaps if g.kind == "cpu-fallback"]
    off_trt = [g for g in gaps if g.kind == "trt-fallback"]
    if target == "tensorrt":
        lo, hi = tensorrt_table()["opset"]
        opset = opset_of(proto)
        if opset is not None and not lo <= opset <= hi:
            found.append(warning(
                "OM305", "lint", f"the model uses opset {opset}; TensorRT "
                f"{tensorrt_table()['tensorrt']}'s ONNX parser takes opsets {lo} to {hi}, so "
                "ONNX Runtime runs the whole model on CUDA, without TensorRT.",
                suggestion=f"Re-export with onnxmedic export --target tensorrt (opset {hi} or "
                "lower).", details={"opset": opset, "tensorrt_opsets": [lo, hi]}))
    return (found + ([soft_kernel_finding(soft, "lint")] if soft else [])
            + ([cpu_fallback_finding(moved, target, "lint")] if moved else [])
            + ([trt_fallback_finding(off_trt, proto, "lint", off_trt + moved)]
               if off_trt else []))


def smoke_feeds(proto: onnx.ModelProto, path: Path) -> tuple[dict[str, Any], list[str]]:
    """The smoke test's inputs: random ones (dynamic dims at 2), except for a generation
    package's decoder step, whose cache is fed as the package contract says (genpackage: a
    prefill of 3 tokens after an empty past, a symbolic head size read from the folder's
    config): random sizes there break the graph's own contract (a builder package's
    ``kv_cache_dim`` at 2), and the run's failure would blame the file for doctor's inputs."""
    feeds, problems = random_feeds(proto)
    from onnxmedic.genpackage import NotAStep, is_past, read_step

    if not any(is_past(v.name) for v in proto.graph.input):
        return feeds, problems
    try:
        layout = read_step(path)
        step = layout.feed(np.arange(1, (layout.step_tokens or 3) + 1, dtype=np.int64))
    except (NotAStep, ValueError, KeyError, OSError):  # not a step it can feed: random inputs
        return feeds, problems
    feeds.update(step)
    return feeds, [p for p in problems if p.partition(":")[0] not in step]


def doctor_stages(result: ExportResult, path: Path, target: str, timeout: float,
                  smoke_test: bool, ort: tuple[int, int] | None = None) -> None:
    """doctor's stages: load, check, runtime (the smoke test), lint."""
    with result.stage("load") as st:
        proto, bad = load_checked(path, stage="load")
        if proto is None:
            # never hand a file with escaping or missing external data to anything else
            st.fail(*bad)
            return
        result.onnx_model = proto
        result.opset = opset_of(proto)
    with result.stage("check") as st:
        found = checks.check_model(proto)
        st.add(*found)
        if any(f.severity == Severity.ERROR for f in found):
            st.fail()
    feeds, problems = smoke_feeds(proto, path)
    sbx = None
    if smoke_test and not problems:
        with result.timed("runtime"):
            sbx = sandbox.run_model(path, [feeds], timeout=timeout,
                                    providers=sandbox.providers(target), probe_opset=True,
                                    session_config=session_config_of(proto))
    with result.stage("lint") as st:
        found = lint(proto, ort_opset=sbx.max_opset if sbx is not None else None)
        found += kernel_lint(proto, target) + ort_version_lint(proto, ort)
        found += int8_findings(proto, "lint") if target == "cpu" else []
        found += session_config_finding(proto, "lint")
        st.add(*found)
        if any(f.severity == Severity.ERROR for f in found):
            st.fail()
    if problems:
        result.findings.append(warning("OM603", "runtime", "no smoke test: " +
                                       "; ".join(problems)))
        return
    if sbx is None or not record_runtime(result, sbx, target, timeout):
        return
    shapes = ", ".join(f"{n}{list(a.shape)}" for n, a in zip(sbx.output_names, sbx.outputs[0]))
    result.findings.append(info("OM534", "runtime", f"smoke test ran with random inputs in "
                                f"{sbx.run_seconds[0] * 1000:.1f} ms (ONNX Runtime "
                                f"{sbx.ort_version}); outputs: {shapes}"))


def run_stages(result: RunResult, onnx_path: Any, feeds: Any, cast: str, target: str,
               timeout: float) -> None:
    """run's stages: load, inputs (the contract check), runtime."""
    with result.stage("load") as st:
        proto, bad = load_checked(onnx_path, stage="load")
        if proto is None:
            st.fail(*bad)
            return
        if target == "cpu":  # an int8 file verified on another instruction set
            st.add(*int8_findings(proto, "load"))
        st.add(*session_config_finding(proto, "load"))
    with result.stage("inputs") as st:
        if isinstance(feeds, (list, tuple)):
            names = input_names(proto)
            if len(feeds) != len(names):
                st.fail(error("OM008", "inputs", f"the model has {len(names)} input(s) "
                              f"({', '.join(names)}) but {len(feeds)} were given."))
                return
            feeds = dict(zip(names, feeds))
        checked, found = check_feeds(proto, {k: np.asarray(v) for k, v in feeds.items()},
                                     cast=cast)
        st.add(*found)
        if any(f.severity == Severity.ERROR for f in found):
            st.fail()
            return
    sbx = sandbox.run_model(onnx_path, [checked], timeout=timeout,
                            providers=sandbox.providers(target),
                            session_config=session_config_of(proto))
    if not record_runtime(result, sbx, target, timeout):
        return
    result.outputs = dict(zip(sbx.output_names, sbx.outputs[0]))
    result.ok = True
