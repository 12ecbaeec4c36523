"""Build, verify and time candidate variants of an ONNX file; keep the fastest verified one
(:func:`optimize_file`).

Every candidate runs through the same sandbox as an export's verification (a separate ONNX
Runtime process), on every input set given (verifier.py); timing is in the sandbox too, under
the noise rule of timing.py. The searches live beside this module: int8_search.py (layers kept
float32), fp16_search.py (the measured block list), graphs.py (CUDA-graph twins); maker.py
runs the passes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from onnxmedic import sandbox
from onnxmedic.isa import int8_metadata, split_target
from onnxmedic.optimize.files import has_external_data
from onnxmedic.optimize.fp16_search import fp16_with_block_list
from onnxmedic.optimize.graphs import (
    GRAPH_SETTINGS,
    GRAPH_TARGETS,
    NHWC_OPTIONS,
    RUN_SETTINGS_KEY,
    auto_graph,
    deploy_graphs,
    graph_mode,
    twin_layouts,
    twin_options,
    twin_settings,
)
from onnxmedic.optimize.int8_search import coverage_hint, int8_with_sensitivity
from onnxmedic.optimize.maker import CandidateMaker
from onnxmedic.optimize.passes import (
    Pipeline,
    default_pipelines,
    is_convolutional,
    is_static,
    precision_error,
)
from onnxmedic.optimize.timing import (
    GPU_WARMUP_SECONDS,
    NOISE_FRACTION,
    choose,
    record_times,
    time_variants,
)
from onnxmedic.optimize.variant import (
    DEFAULT_COSINE,
    OUTSIDE_BUDGET,
    REFUSED,
    OptimizationResult,
    Variant,
    Why,
)
from onnxmedic.optimize.verifier import Verifier, judge_reduced

logger = logging.getLogger(__name__)

# what other modules imported from here before the searches moved out (kept importable)
__all__ = ["DEFAULT_COSINE", "GPU_WARMUP_SECONDS", "GRAPH_SETTINGS", "NHWC_OPTIONS",
           "NOISE_FRACTION", "OUTSIDE_BUDGET", "REFUSED", "RUN_SETTINGS_KEY", "TARGETS",
           "OptimizationResult", "Variant", "budget_hint", "candidate", "graph_mode", "judge_reduced",
           "outcome",
           "optimize_file", "time_variants", "twin_options", "twin_settings", "write"]

# ONNX Runtime's words for a graph it rejects before any provider is chosen (its type and
# shape checks, a malformed file): no provider would run it
INVALID_GRAPH = ("Type Error", "TypeInferenceError", "ShapeInferenceError", "INVALID_GRAPH",
                 "INVALID_PROTOBUF")
TARGETS = ("cpu", "cuda", "tensorrt")


def _checked_mode(precision: str, target: str, cuda_graph: bool | str) -> str:
    """ValueError for a precision, target or cuda_graph optimize_file does not take (or an
    int8-on-a-GPU request); the graph mode for ``target`` ("off" where it has no graphs)."""
    if precision not in ("fp32", "fp16", "int8"):
        raise ValueError(f"precision {precision!r}: choose fp32, fp16 or int8")
    if target not in TARGETS:
        raise ValueError(f"target {target!r}: choose {', '.join(TARGETS)}")
    mode = graph_mode(cuda_graph)  # a wrong value is refused on every target
    if bad := precision_error(precision, target):
        raise ValueError(bad)
    return mode if target in GRAPH_TARGETS else "off"


def _time_and_choose(plain: Variant, variants: list[Variant], paths: dict[str, Path],
                     verifier: Verifier, timing: dict[str, int], timed: bool = True,
                     near: dict[str, Path] | None = None) -> Variant:
    """Time the verified files (``paths``) in paired rounds, pruned against the plain one, and
    choose by the noise rule (timing.choose); untimed where the target is absent. ``near``:
    files outside only the accuracy budget (:func:`_near_miss`), timed beside them so that the
    report gives their speed too - never chosen - and says which budget would admit them."""
    per_round: dict[str, list[float]] = {}
    times = time_variants({**paths, **(near or {})}, verifier.feeds[0],
                          timeout=verifier.timeout, target=verifier.target, per_round=per_round,
                          baseline="plain", **timing) if timed else {}
    record_times(variants, times, per_round)
    chosen = choose(plain, variants)
    for v in variants:
        if v.name in (near or {}):
            v.note(budget_hint(v))
    return chosen


def _calibrated(variants: list[Variant], source: str,
                calibration: list[dict[str, np.ndarray]] | None) -> str:
    """What static int8 was calibrated on, for the report ("" where it was no candidate)."""
    if not calibration or not any(is_static(v.passes) for v in variants):
        return ""
    return source or f"{len(calibration)} given set(s)"


def _near_miss(v: Variant) -> bool:
    """A reduced-precision variant that ran and failed only its cosine budget (its speed is
    worth reporting: the user may accept a looser budget)."""
    return (not v.verified and v.precision != "fp32" and v.is_rejected(Why.OUTSIDE_BUDGET)
            and (v.worst_cosine() or 0.0) > 0)


def budget_hint(v: Variant) -> str:
    """For a near miss faster than the plain file: the loosest budget (three decimals, rounded
    down from its worst cosine) under which it would have competed ("" otherwise)."""
    worst = v.worst_cosine()
    if not v.speedup or v.speedup <= 1 or worst is None:
        return ""
    need = math.floor(worst * 1000) / 1000
    if need <= 0:
        return ""
    return (f"; it ran {v.speedup:.2f}x faster than the plain export: `--accuracy "
            f"cosine={need:g}` would let it compete (worst cosine {worst:.5f})")


def _stand_in(refusal: str, target: str) -> str:
    """What to add to a refusal on the CPU provider standing in for ``target``'s: a CPU kernel
    gap says nothing of the target; a graph ONNX Runtime rejects while typing it fails on any."""
    if any(w in refusal for w in INVALID_GRAPH):
        return " - the graph itself is invalid, on any provider"
    return f" - on the CPU, standing in for {target}, whose provider may run it"


def outcome(plain: Variant, chosen: Variant, variants: list[Variant], target: str,
             absent: str | None, deployed: Variant | None = None) -> str:
    """The result's message (and the plain variant's and, where the target could not be timed,
    the verified ones' reasons). ``deployed``: the CUDA-graph twin ``cuda_graph="deploy"``
    kept, ``chosen`` its file."""
    if deployed is not None:
        chosen.rejection = None
        if chosen is not plain:
            plain.reject(Why.SLOWER, f"slower than {deployed.name}", than=deployed.name)
        else:
            plain.rejection = None
        return (f"{deployed.name} is {deployed.speedup:.2f}x faster than the plain export "
                f"(the file {chosen.name}, run as a CUDA graph - see run_settings)")
    if absent:
        for v in variants[1:]:
            if v.verified:
                v.reject(Why.NOT_TIMED_ON_TARGET,
                         f"verified on the CPU, not timed on {target}: {absent}")
            elif v.is_rejected(Why.REFUSED):
                v.note(_stand_in(v.rejected, target))
            if v.saturation_rejection and v.saturation_rejection.kind is Why.REFUSED:
                v.saturation_rejection = v.saturation_rejection.noted(
                    _stand_in(v.saturation_rejected, target))
        plain.rejection = None
        return f"no variant could be timed on {target} ({absent}); the plain export is kept"
    if chosen is plain:
        plain.rejection = None
        return "no variant beat the plain export beyond noise; the plain export is kept"
    plain.reject(Why.SLOWER, f"slower than {chosen.name}", than=chosen.name)
    return f"{chosen.name} is {chosen.speedup:.2f}x faster than the plain export"


def write(src: Path, out: Path, run_settings: dict[str, Any] | None = None,
           metadata: dict[str, str] | None = None) -> None:
    """Copy ``src`` to ``out`` atomically; a file with external weights (torch.onnx.export
    writes ``<name>.data`` beside the model) is saved again with ``<out>.data`` beside ``out``.
    ``run_settings``: recorded in the file's metadata (RUN_SETTINGS_KEY), and ``metadata``
    (an int8 file: the instruction set it was verified on, isa.int8_metadata)."""
    import onnx

    from onnxmedic.onnxfile import append_metadata

    if src.resolve() == out.resolve() and not run_settings and not metadata:
        return
    tmp = out.with_name(out.name + ".tmp")
    if has_external_data(src):
        proto = onnx.load(str(src))  # weights in memory
        out.with_name(out.name + ".data").unlink(missing_ok=True)  # onnx.save appends to it
        onnx.save(proto, str(tmp), save_as_external_data=True, location=out.name + ".data")
    else:
        shutil.copyfile(src, tmp)
    if run_settings:
        append_metadata(tmp, RUN_SETTINGS_KEY, json.dumps(run_settings))
    for key, value in (metadata or {}).items():
        append_metadata(tmp, key, value)
    os.replace(tmp, out)


def candidate(pipe: Pipeline, src: Path, maker: CandidateMaker, verifier: Verifier,
               calibration: list[dict[str, np.ndarray]] | None = None
               ) -> tuple[Variant, Path]:
    """Build and verify one pipeline's variant (int8 with its sensitivity search, float16 with
    its measured block list)."""
    if pipe.precision == "int8":
        v, path = int8_with_sensitivity(pipe, src, maker, verifier, calibration=calibration)
        static = is_static(s for s, _ in pipe.steps)
        if static and calibration and v.is_rejected(Why.OUTSIDE_BUDGET):
            v.note(coverage_hint(calibration, verifier.feeds))
        return v, path
    if pipe.precision == "fp16":
        return fp16_with_block_list(pipe, src, maker, verifier)
    v, path = maker.build(pipe, src)
    if v.rejection is None:
        verifier.verify(v, path)
    return v, path


def _plan(src: Path, pipelines: list[Pipeline] | None, target: str, precision: str,
          model_type: str | None, static_int8: bool | None, isa: str | None = None
          ) -> tuple[list[str], list[Pipeline]]:
    """The file's output names and the candidates: ``pipelines``, or the defaults for the
    target and precision (static int8 where ``static_int8``, None: convolutional graphs;
    int8 settings for the instruction set ``isa``, None: portable)."""
    import onnx

    names = [o.name for o in onnx.load(str(src), load_external_data=False).graph.output]
    if pipelines is not None:
        return names, pipelines
    static = is_convolutional(src) if static_int8 is None else static_int8
    return names, default_pipelines(target, precision, model_type, static, isa=isa)


def optimize_file(onnx_path: str | os.PathLike[str], feeds: list[dict[str, np.ndarray]],
                  expected: list[list[np.ndarray]], *, out: str | os.PathLike[str] | None = None,
                  target: str = "cpu", precision: str = "fp32", cosine: float = DEFAULT_COSINE,
                  pipelines: list[Pipeline] | None = None, threads: int = 2, warmup: int = 3,
                  repeats: int = 10, rounds: int = 3, timeout: float = 600.0,
                  references: list[list[np.ndarray | None]] | None = None,
                  model_type: str | None = None, cuda_graph: bool | str = True,
                  calibration: list[dict[str, np.ndarray]] | None = None,
                  static_int8: bool | None = None, calibration_source: str = ""
                  ) -> OptimizationResult:
    """Build each candidate pipeline on ``onnx_path``, verify it on every feed against
    ``expected`` (PyTorch's outputs, one list per feed; ``feeds[0]`` is the example), time the
    verified ones in the sandbox, and write the fastest one that beats the plain file beyond
    the noise rule to ``out`` (the plain file otherwise). Never raises for a failing pass.
    ``references``: float64 outputs per feed (verify/reference.py), for the fp32 budget;
    ``model_type``: adds ONNX Runtime's transformers optimizer as a candidate
    (:func:`~onnxmedic.optimize.passes.ort_model_type`). ``cuda_graph`` (GRAPH_TARGETS,
    GRAPH_MODES): auto - the chosen file is also tried as a CUDA graph (graphs.try_graph) and
    where that is faster beyond noise ``run_settings`` says how to run it so (the file written
    is the same); deploy - every verified file is compared as a CUDA graph
    (graphs.deploy_graphs). ``calibration``: feeds apart from ``feeds`` for static int8
    (``calibration_source`` says where from); ``static_int8``: whether it is a candidate at
    precision int8 (None: where the graph is convolutional, passes.is_convolutional)."""
    named, (target, isa) = target, split_target(target)  # "cpu:avx2": int8 settings for it
    mode = _checked_mode(precision, target, cuda_graph)
    src = Path(onnx_path)
    names, pipes = _plan(src, pipelines, target, precision, model_type, static_int8, isa)
    t0 = time.perf_counter()
    verifier = Verifier(names, feeds, expected, cosine, timeout, references, target)
    with sandbox.reuse() as server, _scratch() as folder:
        mark = server.mark()  # an outer reuse() block may have served runs before
        plain = Variant("plain", passes=[], path=str(src))
        used = verifier.verify(plain, src)
        wanted = sandbox.providers(target)[0]
        # None: the target can be timed here; else why not (the CPU stood in for it)
        absent = (None if target == "cpu" or wanted in used else
                  f"{wanted} is not available in this ONNX Runtime "
                  f"({', '.join(used) or 'no session'} used instead)")
        variants, paths, near = _candidates(plain, pipes, src, CandidateMaker(folder, timeout),
                                            verifier, calibration)
        t_built = time.perf_counter()
        timing = {"threads": threads, "warmup": warmup, "repeats": repeats, "rounds": rounds}
        layouts = twin_layouts(src, target) if mode != "off" and not absent else []
        deployed = (deploy_graphs(plain, variants, paths, verifier, timing, layouts)
                    if mode == "deploy" and not absent else None)
        if deployed is not None:
            chosen, twin = deployed
        else:
            chosen, twin = _time_and_choose(plain, variants, paths, verifier, timing,
                                            timed=not absent, near=near), None
        result = OptimizationResult(variants, chosen.name, threads, repeats, warmup, rounds,
                                    message=outcome(plain, chosen, variants, target, absent,
                                                     twin),
                                    target=named, providers=used, target_missing=absent or "",
                                    cosine=cosine, calibration=_calibrated(
                                        variants, calibration_source, calibration))
        if mode == "auto" and not absent:
            twin = auto_graph(result, chosen, plain, verifier, layouts, timing)
        if twin is not None and twin.rejection is None:
            result.run_settings = twin_settings(twin.cuda_options)
        result.seconds = {"candidates": t_built - t0, "timing": time.perf_counter() - t_built}
        result.sandbox = server.since(mark)
        if out is not None:
            write(Path(chosen.path), Path(out), result.run_settings,
                   int8_metadata(isa) if chosen.precision == "int8" else None)
            result.written = str(out)
        for v in variants:
            if v is not plain:
                v.path = ""  # temp files are removed
        return result


@contextlib.contextmanager
def _scratch() -> Iterator[Path]:
    """optimize_file's folder for its candidates' files, removed after it."""
    folder = Path(tempfile.mkdtemp(prefix="onnxmedic-opt-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _candidates(plain: Variant, pipes: list[Pipeline], src: Path, maker: CandidateMaker,
                verifier: Verifier, calibration: list[dict[str, np.ndarray]] | None
                ) -> tuple[list[Variant], dict[str, Path], dict[str, Path]]:
    """Each pipeline's variant built and verified (:func:`candidate`), after ``plain``: the
    variants, the verified files and those outside only the accuracy budget (_near_miss)."""
    variants, paths, near = [plain], {"plain": src}, {}
    for pipe in pipes:
        v, path = candidate(pipe, src, maker, verifier, calibration)
        variants.append(v)
        if v.verified or _near_miss(v):
            (paths if v.verified else near)[v.name] = path
    return variants, paths, near


