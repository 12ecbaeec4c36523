"""optimize() and its helpers: what ``onnxmedic.optimize`` gives (its __init__.py imports them
on first use, and says what optimize does)."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import numpy as np
import torch

from onnxmedic import inputs as inputs_mod
from onnxmedic.borrow import copy_inputs, module_modes, restore_modes, to_eval
from onnxmedic.inputs import DEFAULT_SEED
from onnxmedic.isa import split_target
from onnxmedic.onnxfile import check_feeds, graph_io, make_feeds
from onnxmedic.optimize.bench import BenchResult, bench
from onnxmedic.optimize.candidates import optimize_file
from onnxmedic.optimize.graphs import GRAPH_SUFFIX
from onnxmedic.optimize.passes import (
    Pipeline,
    calibration_error,
    default_pipelines,
    ort_model_type,
    run_pipeline,
)
from onnxmedic.optimize.timing import time_variants
from onnxmedic.optimize.variant import (
    DEFAULT_COSINE,
    OptimizationResult,
    Rejection,
    Variant,
    Why,
)
from onnxmedic.optimize.verifier import Verifier, judge_reduced
from onnxmedic.stages.verify import expected_outputs
from onnxmedic.verify.input_sets import derived_input_sets, same_shape_sets, shape_variants
from onnxmedic.verify.reference import reference_outputs
from onnxmedic.verify.size_rules import rules_from_metadata

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_COSINE", "BenchResult", "bench", "OptimizationResult", "Pipeline", "Variant",
           "block_list_findings", "calibration_feeds", "default_pipelines",
           "given_calibration_feeds", "judge_reduced", "optimize", "optimize_file",
           "ort_model_type", "parse_accuracy", "reference_sets", "Rejection", "run_pipeline",
           "target_findings", "time_variants", "Verifier", "Why"]



def parse_accuracy(spec: str | float | None) -> float:
    """``"cosine=0.9995"`` (or a float) -> the cosine budget; None -> the default 0.999."""
    if spec is None:
        return DEFAULT_COSINE
    bad = ValueError(f"accuracy {spec!r}: expected cosine=<value> with 0 < value <= 1, "
                     "e.g. cosine=0.9995")
    if isinstance(spec, (int, float)):
        value = float(spec)
    else:
        key, _, val = spec.partition("=")
        try:
            value = float(val) if key.strip() == "cosine" else float("nan")
        except ValueError:
            raise bad from None
    if not 0 < value <= 1:  # also NaN
        raise bad
    return value


def graph_dims(onnx_path: str | os.PathLike[str]) -> tuple[list[str], list[list[Any]]]:
    """ONNX input names and dims of the file (its weights are not loaded)."""
    import onnx

    names, dims, _ = graph_io(onnx.load(str(onnx_path), load_external_data=False))
    return names, dims


CALIBRATION_SETS = 8  # static int8's calibration feeds, drawn apart from the verification sets
CALIBRATION_SEED = DEFAULT_SEED + 7919


def calibration_feeds(onnx_path: str | os.PathLike[str], example: inputs_mod.Inputs,
                      count: int = CALIBRATION_SETS) -> list[dict[str, np.ndarray]]:
    """Feeds for static int8's activation ranges: ``count`` sets derived from the example as the
    verification sets are (its values permuted, or drawn in its range) but from another seed,
    so that a static int8 variant is verified on inputs it was not calibrated on."""
    names, _ = graph_dims(onnx_path)
    return [make_feeds(names, s.args, s.kwargs)
            for s in derived_input_sets(example, count, seed=CALIBRATION_SEED)]


def given_calibration_feeds(onnx_path: str | os.PathLike[str], sets: Any
                            ) -> list[dict[str, np.ndarray]]:
    """The user's calibration sets (``optimize(..., calibration=)``: a spec for
    inputs.load_calibration, or a list of input sets - each a tensor, a tuple of args, a dict
    of keyword args, (args, kwargs) or an Inputs) as ONNX feeds, each checked against the
    file's inputs (OM008: count, rank, fixed dims; other dtypes are cast: a range is all
    calibration reads)."""
    import onnx

    from onnxmedic.findings import OnnxMedicError, error

    if isinstance(sets, (str, os.PathLike)):
        sets = inputs_mod.load_calibration(str(sets))
    elif not isinstance(sets, list):  # a tuple or dict would be one set's arguments
        raise TypeError("calibration must be a spec (str or path) or a list of input sets")
    proto = onnx.load(str(onnx_path), load_external_data=False)
    names, _, _ = graph_io(proto)
    feeds = []
    for i, s in enumerate(sets):
        s = s if isinstance(s, inputs_mod.Inputs) else inputs_mod.as_input_set(
            s, f"calibration set {i}")
        try:
            feed, found = check_feeds(proto, make_feeds(names, s.args, s.kwargs), cast="all")
        except OnnxMedicError as e:
            found = [e.finding]
        bad = next((f for f in found if f.severity == "error"), None)
        if bad is not None:
            raise OnnxMedicError(error("OM008", "optimize", f"calibration set {i}: "
                                       f"{bad.message}", suggestion=bad.suggestion))
        feeds.append(feed)
    if not feeds:
        raise OnnxMedicError(error("OM005", "optimize", "no calibration sets were given."))
    return feeds


def reference_sets(onnx_path: str | os.PathLike[str], model: Any, example: inputs_mod.Inputs
                   ) -> tuple[list[dict[str, np.ndarray]], list[list[np.ndarray]], list[str],
                              list[inputs_mod.Inputs]]:
    """The verification sets of an export (example, derived random sets, each dynamic size -
    sizes the file's size rules allow, where it has some) as ONNX feeds, with PyTorch's outputs
    for each, their labels and the inputs themselves. Sets PyTorch rejects are left out."""
    import onnx

    proto = onnx.load(str(onnx_path), load_external_data=False)
    names, dims, _ = graph_io(proto)
    sets = [("example", example)] + [(s.specs[0], s) for s in same_shape_sets(example, dims)]
    # a dim valid only at some sizes (OM408, in the file's metadata): at those sizes only
    sets += shape_variants(example, dims, rules=rules_from_metadata(proto), only_allowed=True)
    feeds, expected, labels, kept = [], [], [], []
    for label, s in sets:
        # PyTorch's outputs as the export computes them (reference_mode: nn.MultiheadAttention's
        # fast path returns NaN where every key of a query is masked, the exported path 0)
        try:
            exp = expected_outputs(model, [s])[0]
        except Exception as e:  # noqa: BLE001 - out of the model's domain: not checked
            logger.info("optimize: PyTorch rejects %s (%s)", label, e)
            continue
        feeds.append(make_feeds(names, s.args, s.kwargs))
        expected.append(exp)
        labels.append(label)
        kept.append(s)
    return feeds, expected, labels, kept


def optimize(onnx_path: str | os.PathLike[str], model: Any, args: tuple[Any, ...], *,
             kwargs: dict[str, Any] | None = None, out: str | os.PathLike[str] | None = None,
             target: str = "cpu", precision: str = "fp32", accuracy: str | float | None = None,
             timeout: float = 600.0, threads: int = 2, repeats: int = 10, rounds: int = 3,
             pipelines: list[Pipeline] | None = None, cuda_graph: bool | str = True,
             calibration: Any = None) -> OptimizationResult:
    """The fastest variant of ``onnx_path`` that still verifies against ``model`` (PyTorch) on
    ``args``/``kwargs`` and every derived input set; written to ``out`` when given (the plain
    file when no variant beats it beyond noise). ``precision``: fp32, int8 (CPU), int4 (a decoder
    step: returns optimize/int4_search.py's Int4Result, ``accuracy`` its task budget, e.g.
    ``"perplexity=5%,agreement=95%"``; see docs/int4.md) or fp16 (for
    GPU targets; on cpu ONNX Runtime runs most float16 ops in float32 behind Casts, so it is
    built and verified but normally rejected as slower);
    ``accuracy``: the reduced-precision budget, e.g. ``"cosine=0.9995"``. ``target``: cpu,
    cuda or tensorrt - candidates are verified and timed with that target's execution
    providers (on a GPU inputs and outputs bound on the device); where this ONNX Runtime lacks
    the target's provider they are verified on the CPU and the plain export is kept (OM725).
    ``cuda_graph`` (on cuda): ``"auto"``/True - also try the chosen file as a CUDA graph, a
    convolutional one also with the provider's NHWC kernels (``run_settings`` where that is
    faster); ``"deploy"`` - compare every verified file as a CUDA graph (so) and write the
    fastest (for a deployment that runs one); ``"off"``/False.
    ``calibration`` (precision int4: a text file, for GPTQ and a perplexity on it; int8): static int8's calibration sets - real data, as
    :func:`given_calibration_feeds` takes them; static int8 is then a candidate whatever the
    graph (without it: on convolutional graphs, calibrated on sets derived from the example)."""
    if not isinstance(args, tuple):
        raise TypeError("args must be a tuple of example inputs, like torch.onnx.export")
    if precision == "int4":  # a decoder step judged by the task budget (optimize/int4.py)
        from onnxmedic.optimize.int4_search import optimize_decoder

        return optimize_decoder(onnx_path, model, out=out, accuracy=accuracy, threads=threads,
                                timeout=timeout,  # calibration: a text file (GPTQ)
                                calibration=calibration)  # type: ignore[return-value]
    cosine = parse_accuracy(accuracy)
    split_target(target)  # a target or instruction set it does not know: ValueError now
    if calibration is not None and (bad := calibration_error(precision)):
        raise ValueError(bad)
    given = None if calibration is None else given_calibration_feeds(onnx_path, calibration)
    was_training = getattr(model, "training", False)
    modes = module_modes(model) if was_training else []  # each submodule's own flag
    if was_training:
        to_eval(model)
    t0 = time.perf_counter()
    try:
        # a copy: the caller's inputs are borrowed (each run copies it again)
        example = inputs_mod.Inputs(*copy_inputs((args, kwargs or {})))
        feeds, expected, _, sets = reference_sets(onnx_path, model, example)
        fn = model.module() if isinstance(model, torch.export.ExportedProgram) else model
        references = reference_outputs(fn, sets, expected).outputs  # [] when not possible
    finally:
        restore_modes(modes)
    took = time.perf_counter() - t0
    res = optimize_file(onnx_path, feeds, expected, out=out, target=target,
                         precision=precision, cosine=cosine, pipelines=pipelines,
                         threads=threads, repeats=repeats, rounds=rounds, timeout=timeout,
                         references=references, model_type=ort_model_type(fn),
                         cuda_graph=cuda_graph, static_int8=True if given else None,
                         calibration=(given if given else calibration_feeds(onnx_path, example)
                                      if precision == "int8" else None),
                         calibration_source="" if given else
                         f"{CALIBRATION_SETS} sets derived from the example")
    res.seconds = {"references": took, **res.seconds}
    return res


def optimization_finding(res: OptimizationResult, stage: str = "optimize") -> Any:
    """OM720 when a variant was chosen, OM721 when the plain export was kept; each variant's
    outcome is in ``details``."""
    from onnxmedic.findings import info

    lines = [f"{v.name}: " + (f"{v.median_ms:.2f} ms" if v.median_ms is not None else "untimed")
             + (f", {v.speedup:.2f}x" if v.speedup else "")
             + (f" - rejected: {v.rejected}" if v.rejected else
                " - chosen run setting" if GRAPH_SUFFIX in v.name else " - chosen")
             for v in res.variants]
    code = "OM721" if res.chosen == "plain" else "OM720"
    how = ""
    if res.run_settings:
        how = (" Run settings: " + "; ".join(
            f"{k}: {v if isinstance(v, str) else json.dumps(v)}"
            for k, v in res.run_settings.items()) + ".")
    return info(code, stage, f"{res.message} (target {res.target}, {res.threads} intra-op "
                f"threads, median of {res.rounds}x{res.repeats} runs; reduced precision judged "
                f"by cosine >= {res.cosine:g} per output"
                + (f"; static int8 calibrated on {res.calibration}" if res.calibration else "")
                + "). " + "; ".join(lines)
                + how, details=res.to_dict())


def target_findings(res: OptimizationResult, stage: str = "optimize") -> list[Any]:
    """OM725 when the target's execution provider was missing: nothing could be timed; for
    int8 candidates OM729 (their settings, the instruction set verified on) and OM728 (an
    instruction set named in the target that is not this CPU's), see onnxmedic/isa.py."""
    from onnxmedic.findings import warning
    from onnxmedic.isa import optimize_findings

    int8 = optimize_findings(res.target, any(v.precision == "int8" for v in res.variants),
                             stage)
    if not res.target_missing:
        return int8
    return int8 + [warning("OM725", stage, f"--target {res.target}: {res.target_missing}; the "
                    "candidates were verified on the CPU but not timed on the target, so the "
                    "plain export was kept.",
                    suggestion="Run `onnxmedic optimize` on a machine where onnxruntime-gpu "
                    "sees the GPU (`python -c \"import onnxruntime as o; "
                    "print(o.get_available_providers())\"`).")]


def block_list_findings(res: OptimizationResult, stage: str = "optimize") -> list[Any]:
    """OM724 for each float16 variant that kept nodes in float32: which nodes and why; OM727
    for each that left fill values to saturate in float16, or tried to and why it did not."""
    from onnxmedic.findings import info, listed

    out = []
    for v in res.variants:
        if v.precision != "fp16":
            continue
        if v.blocked:
            why = [f"{n} ({r})" for n, r in v.blocked.items()]
            out.append(info("OM724", stage, f"{v.name}: {len(v.blocked)} node(s) kept in "
                            f"float32 - {listed(why, 8, '; ')}",
                            details={"variant": v.name, "nodes": dict(v.blocked)}))
        if v.saturated:
            why = [f"{n} ({r})" for n, r in v.saturated.items()]
            out.append(info("OM727", stage, f"{v.name}: {len(v.saturated)} value(s) left in "
                            "float16 where only fill values exceed its range (they saturate; "
                            f"verified) - {listed(why, 8, '; ')}",
                            details={"variant": v.name, "values": dict(v.saturated)}))
        elif v.saturation_rejected:
            out.append(info("OM727", stage, f"{v.name}: {v.saturation_rejected}; their nodes "
                            "were kept in float32 instead",
                            details={"variant": v.name, "rejected": v.saturation_rejected}))
    return out


def attach_to_export(result: Any, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                     *, precision: str = "fp32", target: str = "cpu",
                     accuracy: str | float | None = None, timeout: float = 600.0,
                     cuda_graph: bool | str = True, calibration: Any = None) -> None:
    """The ``export(..., optimize=True)`` hook: optimize the verified export written at
    ``result.path`` in place (atomically; the plain export stays when nothing beats it), record
    ``result.optimization`` and an OM720/OM721 finding."""
    if not (result.ok and result.path):
        return
    res = optimize(result.path, model, args, kwargs=kwargs, out=result.path, target=target,
                   precision=precision, accuracy=accuracy, timeout=timeout,
                   cuda_graph=cuda_graph, calibration=calibration)
    result.optimization = res
    result.findings.append(optimization_finding(res))
    result.findings += target_findings(res) + block_list_findings(res)
