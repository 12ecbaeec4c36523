"""Build, verify and time candidate variants of an ONNX file; keep the fastest verified one.

Every candidate runs through the same sandbox as an export's verification (a separate ONNX
Runtime process), on every input set given. Timing is in the sandbox too: the example feed is
run ``warmup + repeats`` times per round, rounds alternate between variants (so that load on a
shared machine hits all of them alike), and the median/p90 of the kept runs are reported.

Noise rule (paired rounds): a variant beats the plain export only when its median is at least
``NOISE_FRACTION`` (3 %) below the plain median *and* its median is below the plain one's in
every round (the two ran back to back in each round, so load that comes and goes hits both
alike); otherwise the plain export is written and the result says so. An earlier rule asked for
the median to be below plain's p90 spread too: under load (a GPU's launch jitter, a shared CPU)
that spread alone rejected variants 10 % faster in every round.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from onnxmedic import sandbox
from onnxmedic.findings import listed
from onnxmedic.isa import int8_metadata, split_target
from onnxmedic.optimize.files import has_external_data, save_feeds
from onnxmedic.optimize.int8 import SEARCH_SETS, exclusion_cap, next_count
from onnxmedic.optimize.int8 import cosine as cosine_of
from onnxmedic.optimize.passes import (
    QUANTIZE_STEPS,
    Pipeline,
    default_pipelines,
    is_convolutional,
    is_static,
    precision_error,
    run_pipeline,
)
from onnxmedic.verify.budget import RULE_PENDING, judge_output
from onnxmedic.verify.compare import compare_outputs

logger = logging.getLogger(__name__)

NOISE_FRACTION = 0.03
# a GPU target's timing warms up at least this long (besides its warm-up runs): the GPU's clocks
# rise from idle (an H200 here: SM 345 MHz idle, 1980 MHz under load) while a batch-1 model's
# few warm-up runs take milliseconds
GPU_WARMUP_SECONDS = 0.2
DEFAULT_COSINE = 0.999
OUTSIDE_BUDGET = "outside the accuracy budget"  # a reduced-precision variant's rejection
REFUSED = "ONNX Runtime refused it"  # a variant that did not load or run
# ONNX Runtime's words for a graph it rejects before any provider is chosen (its type and
# shape checks, a malformed file): no provider would run it
INVALID_GRAPH = ("Type Error", "TypeInferenceError", "ShapeInferenceError", "INVALID_GRAPH",
                 "INVALID_PROTOBUF")
TARGETS = ("cpu", "cuda", "tensorrt")
# Targets whose files are also tried as CUDA graphs (a "twin": the same file run with the
# settings below): at small batch a GPU waits on kernel launches, a graph replay is one launch
GRAPH_TARGETS = ("cuda",)
GRAPH_SUFFIX = "+cuda-graph"
GRAPH_SETTINGS = {
    "provider_options": {"CUDAExecutionProvider": {"enable_cuda_graph": "1"}},
    "session": "onnxruntime.InferenceSession(path, providers=[('CUDAExecutionProvider', "
               "{'enable_cuda_graph': '1'}), 'CPUExecutionProvider'])",
    "io_binding": "inputs and outputs bound to buffers allocated once on the GPU; refill the "
                  "inputs in place (OrtValue.update_inplace), then run_with_iobinding",
    "shapes": "fixed: a captured graph replays the input shapes of its capture (another shape: "
              "another session, or a graph per shape with the run option gpu_graph_id)",
}
# Convolutional files are also tried as CUDA graphs with the provider computing channels-last
# (prefer_nhwc: ONNX Runtime's layout transformer moves Conv, pooling and normalisation to its
# NHWC kernels, the layout cuDNN's float16 tensor-core convolutions work in, instead of
# transposing around each one): twins named "<file>+cuda-graph+nhwc"
NHWC_SUFFIX = "+nhwc"
NHWC_OPTIONS = {"prefer_nhwc": "1"}
RUN_SETTINGS_KEY = "onnxmedic.run_settings"  # metadata_props key: twin_settings() as JSON
# cuda_graph: "auto" - the best file, and a CUDA graph recommended for it where that is faster;
# "deploy" - every verified file compared as a CUDA graph (for a deployment that runs one);
# "off" - no graphs
GRAPH_MODES = ("auto", "deploy", "off")


def twin_settings(cuda_options: dict[str, str] | None = None) -> dict[str, Any]:
    """How to run a twin: GRAPH_SETTINGS, with ``cuda_options`` (NHWC_OPTIONS) added to its
    provider options and session line."""
    if not cuda_options:
        return dict(GRAPH_SETTINGS)
    opts = {**GRAPH_SETTINGS["provider_options"]["CUDAExecutionProvider"], **cuda_options}
    return dict(GRAPH_SETTINGS, provider_options={"CUDAExecutionProvider": opts},
                session="onnxruntime.InferenceSession(path, providers=[('CUDAExecutionProvider'"
                        f", {opts!r}), 'CPUExecutionProvider'])")


def twin_options(settings: dict[str, Any]) -> dict[str, str] | None:
    """:func:`twin_settings` read back: where ``settings`` enable a CUDA graph, the other CUDA
    provider options they set ({} for none); None where they enable none."""
    opts = settings.get("provider_options", {}).get("CUDAExecutionProvider")
    if not isinstance(opts, dict) or opts.get("enable_cuda_graph") != "1":
        return None
    return {str(k): str(v) for k, v in opts.items() if k != "enable_cuda_graph"}


def twin_layouts(path: Path, target: str) -> list[dict[str, str]]:
    """The CUDA options each file's twins run with: the provider's defaults, and for a
    convolutional graph NHWC_OPTIONS too."""
    return [{}] + ([dict(NHWC_OPTIONS)] if target in GRAPH_TARGETS and is_convolutional(path)
                   else [])


def graph_mode(value: bool | str | None) -> str:
    """``cuda_graph`` as one of GRAPH_MODES (True: auto, False/None: off)."""
    if value is True:
        return "auto"
    if value is False or value is None:
        return "off"
    if value in GRAPH_MODES:
        return str(value)
    raise ValueError(f"cuda_graph {value!r}: choose {', '.join(GRAPH_MODES)} (or True/False)")


@dataclass
class Variant:
    """One candidate: what it ran, what it measured, and whether it was chosen or why not."""

    name: str
    precision: str = "fp32"
    passes: list[str] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    fusions: dict[str, int] = field(default_factory=dict)
    nodes: int | None = None
    verified: bool = False
    accuracy: dict[str, dict[str, float]] = field(default_factory=dict)  # output -> metrics
    median_ms: float | None = None
    p90_ms: float | None = None
    round_ms: list[float] = field(default_factory=list)  # median of each timing round
    speedup: float | None = None
    rejected: str = ""  # why not chosen ("" for the chosen one)
    path: str = ""
    blocked: dict[str, str] = field(default_factory=dict)  # fp16: node kept float32 -> why
    # fp16: value left float16 whose fill values (a mask's finfo.min) saturate -> its range
    saturated: dict[str, str] = field(default_factory=dict)
    saturation_rejected: str = ""  # fp16: why the variant that saturated them was not kept
    cuda_options: dict[str, str] = field(default_factory=dict)  # a twin's (NHWC_OPTIONS)

    def worst_cosine(self) -> float | None:
        """The lowest cosine over the outputs (each already the worst over the input sets);
        None when the variant was not judged by the cosine budget (not judged, or float32:
        its accuracy is max abs/rel errors)."""
        cosines = [m["cosine"] for m in self.accuracy.values() if "cosine" in m]
        return min(cosines) if cosines else None


@dataclass
class OptimizationResult:
    """Every variant (the plain export first), the chosen one and the timing settings."""

    variants: list[Variant]
    chosen: str
    threads: int
    repeats: int
    warmup: int
    rounds: int
    noise_rule: str = (f"beats plain only if median <= plain median * {1 - NOISE_FRACTION:g} and "
                       "the median of every round is below plain's in the same round")
    written: str | None = None
    message: str = ""
    target: str = "cpu"
    providers: list[str] = field(default_factory=list)  # what the plain file's session used
    target_missing: str = ""  # why the target could not be timed here ("" when it was)
    # how to run the written file at the chosen variant's speed ({}: a default session;
    # GRAPH_SETTINGS for a CUDA-graph twin, also in the file's metadata, RUN_SETTINGS_KEY)
    run_settings: dict[str, Any] = field(default_factory=dict)
    cosine: float = DEFAULT_COSINE  # the reduced-precision budget (worst cosine per output)
    calibration: str = ""  # what static int8 was calibrated on ("" when it was not a candidate)
    # where the time went: "references" (PyTorch's outputs, optimize), "candidates" (built and
    # verified, the plain file's verification included), "timing" (rounds, CUDA-graph twins)
    seconds: dict[str, float] = field(default_factory=dict)
    # runs, the children they took, seconds: importing ONNX Runtime, sessions, runs in all
    sandbox: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def judge_reduced(names: list[str], expected: list[list[np.ndarray]],
                  actual: list[list[np.ndarray]], cosine: float = DEFAULT_COSINE
                  ) -> tuple[bool, dict[str, dict[str, float]], str]:
    """The reduced-precision budget: per output, the worst cosine similarity over the input sets
    must be >= ``cosine``; max/mean absolute error reported; for outputs whose last axis looks
    like class scores (float, >= 2 wide), argmax agreement is reported - not judged: hidden
    states are >= 2 wide too, and the argmax of near-equal features flips under any rounding."""
    acc: dict[str, dict[str, float]] = {}
    why = ""
    for s, (exp, act) in enumerate(zip(expected, actual)):
        for i, e in enumerate(exp):
            name = names[i] if i < len(names) else f"output_{i}"
            a = act[i] if i < len(act) else None
            m = acc.setdefault(name, {"cosine": 1.0, "max_abs": 0.0, "mean_abs": 0.0})
            if a is None or np.shape(a) != np.shape(e):
                m["cosine"] = 0.0
                why = why or f"{name}: shape {np.shape(a)} != {np.shape(e)} at set {s}"
                continue
            if not np.issubdtype(np.asarray(e).dtype, np.floating):
                if not np.array_equal(a, e):
                    m["cosine"] = 0.0
                    why = why or f"{name}: integer output differs at set {s}"
                continue
            bad = ~np.isfinite(np.asarray(a)) & np.isfinite(np.asarray(e))
            if bad.any():  # inf/nan where PyTorch has numbers: cosine is undefined
                m["cosine"] = 0.0
                m["nonfinite"] = max(m.get("nonfinite", 0), int(bad.sum()))
                why = why or (f"{name}: {int(bad.sum())} non-finite value(s) where PyTorch's "
                              f"are finite at set {s}")
                continue
            d = np.abs(np.asarray(a, np.float64) - np.asarray(e, np.float64))
            m["cosine"] = min(m["cosine"], cosine_of(e, a))
            m["max_abs"] = max(m["max_abs"], float(d.max()) if d.size else 0.0)
            m["mean_abs"] = max(m["mean_abs"], float(d.mean()) if d.size else 0.0)
            if np.ndim(e) >= 2 and np.shape(e)[-1] >= 2:
                agree = float(np.mean(np.argmax(e, -1) == np.argmax(a, -1)))
                m["argmax_agreement"] = min(m.get("argmax_agreement", 1.0), agree)
    for name, m in acc.items():
        if not m["cosine"] >= cosine:  # nan fails too
            why = why or f"{name}: cosine {m['cosine']:.6f} < {cosine:g}"
    return not why, acc, why


def _verify(variant: Variant, path: Path, names: list[str], feeds: list[dict[str, np.ndarray]],
            expected: list[list[np.ndarray]], cosine: float, timeout: float,
            references: list[list[np.ndarray | None]] | None = None, target: str = "cpu"
            ) -> list[str]:
    """fp32 variants are judged like the export itself (verify/budget.py: float32 agreement,
    else the float64 budget with ``references``, else the scaled normwise rule); reduced
    precision by the cosine budget. Runs on ``target``'s providers (a CUDA session computes
    float32 without TF32, as PyTorch does); returns the providers the session used."""
    sbx = sandbox.run_model(path, feeds, timeout=timeout, providers=sandbox.providers(target))
    if not sbx.ok:
        variant.rejected = f"{REFUSED} ({sbx.summary()[:200]})"
        return sbx.providers
    _judge(variant, names, expected, sbx.outputs, cosine, references)
    return sbx.providers


def _judge(variant: Variant, names: list[str], expected: list[list[np.ndarray]],
           actual: list[list[np.ndarray]], cosine: float,
           references: list[list[np.ndarray | None]] | None) -> None:
    """Judge ``actual`` (per input set) against ``expected`` by the variant's precision's
    rule (see :func:`_verify`): sets ``verified``, ``accuracy`` and, when it fails,
    ``rejected``."""
    if variant.precision == "fp32":
        acc: dict[str, dict[str, float]] = {}
        bad = ""
        for s, (exp, act) in enumerate(zip(expected, actual)):
            refs = references[s] if references and s < len(references) else []
            for c in compare_outputs(names, exp, act, input_set=f"set {s}",
                                     judge=_budget_judge(refs, f"set {s}")):
                m = acc.setdefault(c.name, {"max_abs": 0.0, "max_rel": 0.0})
                m["max_abs"] = max(m["max_abs"], c.max_abs)
                m["max_rel"] = max(m["max_rel"], c.max_rel)
                if not c.ok and not bad:
                    bad = (f"{c.name} at {c.input_set}: {c.reason or ''} max abs error "
                           f"{c.max_abs:.3g} ({c.rule})")
        variant.accuracy = acc
        if bad:
            variant.rejected = f"failed verification: {bad}"
            return
    else:
        ok, acc, why = judge_reduced(names, expected, actual, cosine)
        variant.accuracy = acc
        if not ok:
            variant.rejected = f"{OUTSIDE_BUDGET}: {why}"
            return
    variant.verified = True


def _graph_twin(base: Variant, path: Path, names: list[str], feed: dict[str, np.ndarray],
                expected: list[np.ndarray], cosine: float, timeout: float,
                references: list[np.ndarray | None] | None, target: str,
                cuda_options: dict[str, str] | None = None) -> Variant:
    """``base``'s file run as a CUDA graph (GRAPH_SETTINGS): a session whose second run
    captures the kernels and whose later runs replay them on the same buffers; with
    ``cuda_options`` (NHWC_OPTIONS) set too. Judged like ``base`` on the replays' outputs for
    the example feed - the one shape a captured graph runs (the file itself was verified at
    every size)."""
    nhwc = bool(cuda_options)
    twin = Variant(base.name + GRAPH_SUFFIX + (NHWC_SUFFIX if nhwc else ""),
                   precision=base.precision,
                   passes=base.passes + ["cuda-graph"] + (["nhwc"] if nhwc else []),
                   steps=base.steps, fusions=base.fusions, nodes=base.nodes, path=str(path),
                   blocked=base.blocked, saturated=base.saturated,
                   cuda_options=dict(cuda_options or {}))
    sbx = sandbox.run_model(path, [feed], timeout=timeout, providers=sandbox.providers(target),
                            timing={"warmup": 2, "repeats": 1, "graph": True},
                            cuda_options=twin.cuda_options)
    if not sbx.ok:
        twin.rejected = (f"ONNX Runtime refused the CUDA graph{' in NHWC' if nhwc else ''} "
                         f"({sbx.summary()[:200]})")
    elif not sbx.timed_outputs:
        twin.rejected = "ONNX Runtime returned no outputs from the CUDA graph's replay"
    else:
        _judge(twin, names, [expected], [sbx.timed_outputs], cosine,
               [references] if references is not None else None)
        if twin.rejected:
            twin.rejected = "the CUDA graph's replay " + twin.rejected
    return twin


def _budget_judge(refs: list[np.ndarray | None], label: str) -> Any:
    def one(name: str, exp: np.ndarray, act: np.ndarray | None, i: int) -> Any:
        c = judge_output(name, exp, act, None, input_set=label, fast=True)
        if c.rule == RULE_PENDING:
            c = judge_output(name, exp, act, refs[i] if i < len(refs) else None,
                             input_set=label)
        return c
    return one


def time_variants(paths: dict[str, Path], feed: dict[str, np.ndarray], *, threads: int = 2,
                  warmup: int = 3, repeats: int = 10, rounds: int = 3,
                  timeout: float = 600.0, target: str = "cpu",
                  per_round: dict[str, list[float]] | None = None,
                  baseline: str | None = None,
                  graphs: Collection[str] = (),
                  cuda_options: dict[str, dict[str, str]] | None = None
                  ) -> dict[str, tuple[float, float]]:
    """Median and p90 latency (ms) of each file, in the sandbox with ``threads`` intra-op
    threads: ``rounds`` alternating rounds of ``warmup`` discarded + ``repeats`` timed runs, each
    round one session with ONNX Runtime's default options (on a GPU target CUDA's TF32 math
    included, as deployed) and the inputs and outputs bound on the target's device
    (IOBinding: a GPU run's time is the GPU's work, not host copies); on a GPU target the
    warm-up lasts GPU_WARMUP_SECONDS at least. ``per_round``, when
    given, receives each file's median per round (nan for a round it failed). ``baseline``
    (a key of ``paths``): a file whose round median is not below the baseline's in the same
    round is not timed in later rounds - under the paired noise rule it can no longer win.
    ``graphs``: keys timed as CUDA graphs (fixed buffers, ``enable_cuda_graph``; see
    GRAPH_SETTINGS); ``cuda_options``: more CUDA provider options by key (NHWC_OPTIONS)."""
    samples: dict[str, list[float]] = {k: [] for k in paths}
    rounds_ms: dict[str, list[float]] = {k: [] for k in paths}
    live = list(paths)
    gpu = target != "cpu"
    for r in range(rounds):
        for name in live if r % 2 == 0 else live[::-1]:
            sbx = sandbox.run_model(paths[name], [feed], timeout=timeout, threads=threads,
                                    providers=sandbox.providers(target), cuda_tf32=True,
                                    timing={"warmup": warmup, "repeats": repeats,
                                            "iobinding": gpu, "graph": name in graphs,
                                            "warmup_seconds": GPU_WARMUP_SECONDS if gpu else 0},
                                    cuda_options=(cuda_options or {}).get(name),
                                    fresh=True)  # as deployed: a process of its own
            ms = [s * 1000 for s in sbx.timed_seconds] if sbx.ok else []
            samples[name] += ms
            rounds_ms[name].append(statistics.median(ms) if ms else float("nan"))
        if baseline in paths:
            base = rounds_ms[baseline][-1]
            live = [k for k in live if k == baseline or rounds_ms[k][-1] < base]  # nan: out
    if per_round is not None:
        per_round.update(rounds_ms)
    out = {}
    for name, s in samples.items():
        if s:
            s.sort()
            out[name] = (statistics.median(s), s[min(len(s) - 1, int(0.9 * len(s)))])
    return out


# folder -> (source, steps) -> (variant, file) of every pipeline built there (a prefix too)
_BUILT: dict[str, dict[str, tuple[Variant, Path]]] = {}
NAME_NODES = ("onnxmedic.optimize.fp16:name_nodes", {})
CHANGED_NOTHING = "the passes changed nothing"


def _steps_key(src: Path, steps: list[Any]) -> str:
    return json.dumps([str(src), steps], sort_keys=True, default=str)


def _prefix(base: Pipeline, last: str, src: Path, folder: Path, timeout: float
            ) -> tuple[Variant, Path, int]:
    """Run the steps of ``base`` before its ``last`` step, plus node naming (the quantizer's
    exclusions and the converter's block list are by node name): the graph that step will see.
    Returns the variant so far, that graph's file (``src`` when nothing changed) and the index
    of the ``last`` step. Candidates with the same leading steps share that graph (built once
    per ``folder``)."""
    import copy

    at = next(i for i, (s, _) in enumerate(base.steps) if s.endswith(last))
    pre_steps = list(base.steps[:at]) + [NAME_NODES]
    key = _steps_key(src, pre_steps)
    cache = _BUILT.setdefault(str(folder), {})
    if key not in cache:  # _build records it under ``key``; _named's result is recorded here
        cache[key] = (_named(base, at, src, folder, timeout)
                      or _build(Pipeline(f"{base.name}-pre", pre_steps), src, folder, timeout))
    v, pre = copy.deepcopy(cache[key][0]), cache[key][1]
    v.name, v.precision = base.name, base.precision
    v.passes = [s for s, _ in base.steps]
    if v.rejected.startswith(CHANGED_NOTHING):  # already folded and named
        v.rejected, pre = "", src
    return v, pre, at


def _named(base: Pipeline, at: int, src: Path, folder: Path, timeout: float
           ) -> tuple[Variant, Path] | None:
    """The prefix of ``base`` (its steps before ``at``) from the candidate that ran exactly
    those steps already (ort-fusions for ort-fusions-fp16): node naming on its file, not
    the passes again (Llama's fusions took about 12 s on this CPU). None when no candidate
    did, or its passes failed."""
    done = _BUILT.get(str(folder), {}).get(_steps_key(src, list(base.steps[:at])))
    if done is None or done[0].rejected and not done[0].rejected.startswith(CHANGED_NOTHING):
        return None
    first, built = done
    start = src if first.rejected else built
    v, path = _build(Pipeline(f"{base.name}-pre", [NAME_NODES]), start, folder, timeout)
    if v.rejected.startswith(CHANGED_NOTHING) and start is built:
        v.rejected, path = "", built  # named already, but not src
    v.steps = first.steps + v.steps
    v.fusions, v.nodes = {**first.fusions, **v.fusions}, first.nodes
    v.passes = [s for s, _ in base.steps[:at]] + v.passes
    return v, path


def _measure(step: str, pre: Path, feeds: list[dict[str, np.ndarray]], folder: Path,
             timeout: float, options: dict[str, Any] | None = None
             ) -> tuple[dict[str, Any] | None, str]:
    """Run a measuring step (``module:function(src, dst, feeds=..., **options)``) in the pass
    child."""
    npz = folder / "feeds.npz"
    if not npz.exists():
        save_feeds(feeds, npz)
    ok, info, err = run_pipeline(Pipeline("measure", [(step, {"feeds": str(npz),
                                                              **(options or {})})]), pre,
                                 folder / "unused.onnx", timeout=timeout)
    return (info[0] if ok else None), err


NO_CALIBRATION = ("static int8 needs calibration input sets (optimize() derives them from the "
                  "example); none were given")


def _int8_with_sensitivity(base: Pipeline, src: Path, folder: Path, names: list[str],
                           feeds: list[dict[str, np.ndarray]], expected: list[list[np.ndarray]],
                           cosine: float, timeout: float, max_excluded: int | None = None,
                           search_seconds: float = 600.0,
                           calibration: list[dict[str, np.ndarray]] | None = None
                           ) -> tuple[Variant, Path]:
    """Quantize (``base``'s quantize step: passes.QUANTIZE_STEPS); when the budget fails, keep
    the layers that lose most to quantization (:class:`_Search`: ranked on the whole model, or
    by their own errors) in float32 and retry - up to ``max_excluded`` layers
    (int8.exclusion_cap: by default a quarter, at least 4, never all) and ``search_seconds``:
    the count the switch search predicts, else 1, 2, 4 ...; when k layers pass and k/2
    failed, the gap is halved until it is one layer or an eighth of k
    (:func:`_fewest_excluded`). A failed search reports its all-layers variant (the fastest
    file) with its tries (:func:`_search_end`)."""
    deadline = time.monotonic() + search_seconds
    qstep, qopts = next((s, o) for s, o in base.steps if s.endswith(QUANTIZE_STEPS))
    search = _Search(qstep, dict(qopts), folder, feeds, calibration, cosine, max_excluded)
    if not search.step:
        return Variant(base.name, precision=base.precision, passes=[s for s, _ in base.steps],
                       rejected=NO_CALIBRATION), src
    suffix = qstep[qstep.index(":"):]
    v, pre, at = _prefix(base, suffix, src, folder, timeout)
    if v.rejected:
        return v, pre
    pre_steps = list(v.steps)

    def attempt(k: int) -> tuple[Variant, Path, bool]:
        """Quantize with the ``k`` most sensitive layers kept; (variant, file, built)."""
        pipe = Pipeline(base.name, [(s, dict(o, nodes_to_exclude=search.kept(k), **search.extra)
                                     if s.endswith(QUANTIZE_STEPS) else o)
                                    for s, o in base.steps[at:]], precision="int8")
        cv, path = _build(pipe, pre, folder, timeout, suffix=f"-keep{k}")
        cv.name, cv.passes = base.name, v.passes
        cv.steps = pre_steps + search.report(k) + cv.steps
        if cv.rejected:
            return cv, path, False
        _verify(cv, path, names, feeds, expected, cosine, timeout)
        return cv, path, True

    k = failed = 0
    tries: list[tuple[int | str, float | None]] = []  # (layers float32, worst cosine): failed
    while True:
        cv, path, built = attempt(k)
        if not built:
            return cv, path
        if cv.verified:
            return _fewest_excluded(attempt, failed, k, (cv, path), deadline)
        tries.append((f"{k} (predicted)" if k and k == search.predicted else k,
                      cv.worst_cosine()))
        if not k:  # every layer int8: the fastest file, the one a failed search reports
            first = (cv, path)
            why = search.rank(pre, path, feeds, folder, timeout, deadline)
            if why is not None:  # no ranking, or no count predicted to reach the budget
                cv.rejected += why
                cv.steps[len(pre_steps):len(pre_steps)] = search.report(0)
                return cv, path
        elif k == search.predicted:  # refuted: the layers' own errors rank, from one layer
            why = search.own_errors(pre, feeds, folder, timeout, cv.worst_cosine())
            if why is not None:
                first[0].rejected += why
                return first
            k = 0
        if not k and search.predicted:  # the switch search: one layer fewer failed there
            failed, k = search.predicted - 1, search.predicted
        else:
            nxt = next_count(k, exclusion_cap(len(search.ranking), max_excluded))
            if nxt is None or time.monotonic() > deadline:
                first[0].rejected += _search_end(k, nxt, tries, search_seconds)
                first[0].steps[len(pre_steps):len(pre_steps)] = search.report(0)
                return first
            failed, k = k, nxt
        logger.info("int8 (%s): keeping %d layer(s) in float32: %s", base.name, k,
                    ", ".join(search.kept(k)))


FLOAT_GAINS = "onnxmedic.optimize.int8:float_gains"
LAYER_ERRORS = "onnxmedic.optimize.int8:layer_errors"


class _Search:
    """The int8 search's ranking of the layers: how the quantize step ``qstep`` (options
    ``qopts``) measures it, run once after the all-layers try failed, and what it found.
    ``step``: the measuring step ("" where static int8 has no ``calibration``); ``options``:
    its options; ``extra``: options the quantize step needs too (static int8's calibration
    file).

    Dynamic and weight-only int8 rank the layers on the whole model and predict the fewest the
    budget needs (int8.float_gains: one file with each layer switchable between its int8 and
    its float32 node, run on ``feeds``, the verification sets); only that count is built and
    verified. Where no count within the cap is predicted to pass, the search ends without
    building one. A count the verification refutes (a model whose int8 error turns on
    rounding, where the built file and the switch part ways: ONNX Runtime fuses a float32
    layer's bias in the built file, not behind a switch) hands the search to the layers' own
    errors (int8.layer_errors of the step's scheme, from one layer) - as where the switch
    search finds no layer to switch. On torchcde's CDE the switch predicted one layer at
    cosine 0.99923 and the built file gave 0.99900; along the switch's ranking 2, 4 and 8
    layers gave 0.99224, 0.99858 and 0.99753, by own errors 5 layers verify. Static int8
    ranks by int8.static_errors (each layer's own error in the QDQ graph, calibrated on
    ``calibration``)."""

    def __init__(self, qstep: str, qopts: dict[str, Any], folder: Path,
                 feeds: list[dict[str, np.ndarray]],
                 calibration: list[dict[str, np.ndarray]] | None, cosine: float,
                 max_excluded: int | None) -> None:
        self.ranking: list[tuple[str, float]] = []
        self.found: dict[str, Any] = {}  # the switch search's prediction, for the report
        self.predicted: int | None = None
        self.extra: dict[str, Any] = {}
        self.scheme = {k: qopts[k] for k in ("per_channel", "block_size", "accuracy_level")
                       if k in qopts}
        self.scheme["reduce_range"] = qopts.get("reduce_range", True)  # quantize_int8's
        if not is_static([qstep]):  # on the sets the budget is judged on (see float_gains)
            self.sets = f"{min(len(feeds), SEARCH_SETS)} verification set(s)"
            self.step = FLOAT_GAINS  # _measure gives it the verification sets' file
            self.options = {"cosine": cosine, "max_excluded": max_excluded}
            return
        self.step, self.options = "", {}
        if calibration:
            npz = folder / "calibration.npz"
            if not npz.exists():
                save_feeds(calibration, npz)
            self.extra = {"calibration": str(npz)}
            self.step = "onnxmedic.optimize.int8:static_errors"
            self.options = {"per_channel": qopts.get("per_channel", True), **self.extra}

    def kept(self, k: int) -> list[str]:
        """The ``k`` most sensitive layers."""
        return [n for n, _ in self.ranking[:k]]

    def report(self, k: int) -> list[dict[str, Any]]:
        """The ranking step as reported beside a try with ``k`` layers float32."""
        if not self.ranking:
            return []
        return [{"step": self.step, **{key: o for key, o in self.options.items()
                                       if key not in self.extra},
                 **self.found, "ranking": [[n, e] for n, e in self.ranking[:max(8, k)]]}]

    def rank(self, pre: Path, quantized: Path, feeds: list[dict[str, np.ndarray]],
             folder: Path, timeout: float, deadline: float) -> str | None:
        """Rank the layers of ``pre`` (``quantized``: every layer int8, which failed). None to
        go on; else why the search ends, for the all-layers variant's rejection."""
        options = dict(self.options, quantized=str(quantized))
        if self.step == FLOAT_GAINS:
            options["seconds"] = max(1.0, min(deadline - time.monotonic(), 0.8 * timeout))
        measured, err = _measure(self.step, pre, feeds, folder, timeout, options)
        if self.step == FLOAT_GAINS and not (measured or {}).get("errors"):
            logger.info("int8: the switch search gave no ranking (%s); ranking by each "
                        "layer's own error", err or "no layer it could switch")
            return self.own_errors(pre, feeds, folder, timeout)
        if measured is None:
            return f" (measuring the layers' quantization error failed: {err})"
        self.ranking = sorted(measured["errors"].items(), key=lambda kv: -kv[1])
        if not self.ranking:
            return ""
        if self.step != FLOAT_GAINS:
            return None
        self.predicted = measured["predicted"]
        self.found = {"search_sets": self.sets, "predicted": self.predicted,
                      "curve": measured["curve"]}
        return None if self.predicted else _predicted_end(measured, self.sets)

    def own_errors(self, pre: Path, feeds: list[dict[str, np.ndarray]], folder: Path,
                   timeout: float, refuted: float | None = None) -> str | None:
        """Rank by each layer's own error (int8.layer_errors of the quantize step's scheme):
        where the switch search gave no ranking, or its prediction failed verification (with
        worst cosine ``refuted``: a model whose int8 error turns on rounding, where the built
        file and the switch part ways). As :meth:`rank` returns."""
        if refuted is not None:
            self.found = {"switch_search": {**self.found, "verified_cosine": refuted}}
        self.step, self.options, self.predicted = LAYER_ERRORS, {"scheme": self.scheme}, None
        measured, err = _measure(self.step, pre, feeds, folder, timeout, self.options)
        if measured is None:
            return f" (measuring the layers' quantization error failed: {err})"
        self.ranking = sorted(measured["errors"].items(), key=lambda kv: -kv[1])
        return None if self.ranking else ""


def _predicted_end(measured: dict[str, Any], sets: str) -> str:
    """Why the switch search (int8.float_gains' result ``measured``, on ``sets``) predicts
    that no count of float32 layers within its cap reaches the budget."""
    curve = ", ".join(f"{int(k)} -> {c:.5f}" for k, c in measured["curve"])
    why = (f"the search ran out of time after {measured['seconds']:.0f} s"
           if measured["stopped"] else f"keeping up to the {measured['cap']} most sensitive "
           "layer(s) in float32 did not reach the budget either")
    return (f" (every layer int8; {why}, predicted on {sets} by one file with each layer "
            f"switchable; worst cosine by layers kept float32: {curve})")


def _search_end(k: int, nxt: int | None, tries: list[tuple[int | str, float | None]],
                search_seconds: float) -> str:
    """For the all-layers variant a failed int8 search reports (the fastest file it built, the
    one a looser budget would admit as it is): the search's outcome - up to ``k`` float32
    layers tried (``nxt``: the count it would have tried next, None at its cap) - and how the
    worst cosine moved over its tries: whether more float32 layers would help, or the error
    is spread out."""
    if nxt is None and not k:
        return " (its only layer int8)"
    why = "every layer int8; " + (
        f"keeping up to the {k} most sensitive layer(s) in float32 did not reach the budget "
        "either" if nxt is None else f"sensitivity search stopped after {search_seconds:g} s")
    if len(tries) > 1 and all(c is not None for _, c in tries):
        why += "; worst cosine by layers kept float32: " + ", ".join(
            f"{n} -> {c:.5f}" for n, c in tries)
    return f" ({why})"


def _fewest_excluded(attempt: Any, failed: int, passed: int, best: tuple[Variant, Path],
                     deadline: float) -> tuple[Variant, Path]:
    """Between ``failed`` layers in float32 (outside the budget) and ``passed`` (within it),
    halve the gap while it is over one in eight of ``passed`` (and time is left): the verified
    variant with the fewest float32 layers found."""
    while passed - failed > max(1, passed // 8) and time.monotonic() < deadline:
        mid = (failed + passed) // 2
        cv, path, _ = attempt(mid)
        if cv.verified:
            passed, best = mid, (cv, path)
        else:
            failed = mid
    return best


def _fp16_with_block_list(base: Pipeline, src: Path, folder: Path, names: list[str],
                          feeds: list[dict[str, np.ndarray]], expected: list[list[np.ndarray]],
                          cosine: float, timeout: float, target: str = "cpu"
                          ) -> tuple[Variant, Path]:
    """The steps before the float16 step (and node naming) run first; the float32 values of
    that graph are measured on every feed (fp16.range_stats, in the pass child); the nodes that
    compute or read a value float16 cannot hold stay float32 (fp16.block_list); then float16.
    Values that overflow only in fill values (an attention mask's finfo.min: keeping them
    float32 keeps every fused attention reading the mask in float32) are first left in
    float16 to saturate (fp16.saturated); where that variant is not verified, the strict
    block list is built instead and says why (``saturation_rejected``)."""
    import copy

    from onnxmedic.optimize import fp16

    v, pre, at = _prefix(base, ":float16", src, folder, timeout)
    if v.rejected:
        return v, pre
    measured, err = _measure("onnxmedic.optimize.fp16:range_stats", pre, feeds, folder, timeout)
    if measured is None:
        v.rejected = f"measuring float32 ranges failed: {err}"
        return v, pre
    values = measured["values"]

    def convert(blocked: dict[str, str], suffix: str) -> tuple[Variant, Path]:
        cv = copy.deepcopy(v)
        cv.blocked = blocked
        if blocked:
            logger.info("fp16 (%s): keeping %d node(s) in float32: %s", base.name,
                        len(blocked), ", ".join(blocked))
        conv = Pipeline(base.name, [(s, dict(o, node_block_list=sorted(blocked)))
                                    for s, o in base.steps[at:]], precision="fp16")
        built, path = _build(conv, pre, folder, timeout, suffix=suffix)
        cv.steps += built.steps
        cv.fusions.update(built.fusions)
        cv.nodes, cv.rejected, cv.path = built.nodes, built.rejected, built.path
        if not cv.rejected:
            _verify(cv, path, names, feeds, expected, cosine, timeout, target=target)
        return cv, path

    strict = fp16.block_list(pre, values)
    fills = fp16.saturated(values)
    lean = fp16.block_list(pre, values, saturate=True) if fills else strict
    if lean == strict:
        cv, path = convert(strict, "")
    else:
        sv, spath = convert(lean, "-saturated")
        sv.saturated = fills
        if sv.verified:
            return sv, spath
        cv, path = convert(strict, "")
        cv.saturation_rejected = (f"leaving {listed(sv.saturated, 4)} in float16 to saturate "
                                  f"was rejected: {sv.rejected}")
    if cv.rejected.startswith(OUTSIDE_BUDGET):
        return _keep_amplifiers(cv, path, pre, convert, feeds, folder, timeout, target)
    return cv, path


AMPLIFIERS = "onnxmedic.optimize.fp16:amplifiers"


def _keep_amplifiers(failed: Variant, path: Path, pre: Path, convert: Any,
                     feeds: list[dict[str, np.ndarray]], folder: Path, timeout: float,
                     target: str) -> tuple[Variant, Path]:
    """The float16 block list's second rule, where ``failed`` (its file ``path``, built from
    ``pre`` by ``convert(blocked, suffix)``) is outside the budget: rank the nodes that add
    most error in float16 (fp16.amplifiers, in the pass child on ``target``'s providers, on
    the verification sets) and keep the top 1, 2, 4 ... float32 with what they read from,
    each try built and verified. Returns the first try verified; else ``failed``, its
    rejection saying what the search tried."""
    from onnxmedic.optimize import fp16

    measured, err = _measure(AMPLIFIERS, pre, feeds, folder, timeout,
                             {"float16": str(path), "providers": sandbox.providers(target)})
    if measured is None:
        failed.rejected += f" (measuring where float16 adds error failed: {err})"
        return failed, path
    ranked = measured["ranked"]
    if not ranked:
        failed.rejected += (f" (no node adds float16 error of {fp16.ADDED_MIN:g} or more to "
                            "its inputs': no float32 node would help)")
        return failed, path
    report = {"step": AMPLIFIERS, "seconds": measured["seconds"],
              "ranked": [[e["node"], e["added"]] for e in ranked], "tries": []}
    blocked, k = dict(failed.blocked), 0
    while (k := next_count(k, len(ranked))) is not None:
        for e in ranked[:k]:
            blocked.setdefault(e["node"], (
                f"adds float16 error: its output is {e['output_err']:.2g} off (relative), "
                f"its inputs {e['input_err']:.2g}"))
            for name in e["keep"][1:]:
                blocked.setdefault(name, f"feeds {e['node']}, which amplifies float16's error")
        cv, cpath = convert(dict(blocked), f"-amplified{k}")
        report["tries"].append([k, len(blocked), cv.worst_cosine()])
        cv.steps.append({**report, "tries": list(report["tries"])})
        cv.saturation_rejected = failed.saturation_rejected
        if cv.verified:
            break
    if cv.verified:
        return cv, cpath
    curve = ", ".join(f"{n} -> {c:.5f}" if c is not None else f"{n} -> not judged"
                      for _, n, c in report["tries"])
    failed.rejected += (f" (keeping float32 up to the {len(ranked)} node(s) that add most "
                        f"float16 error, with what they read from, did not reach the budget "
                        f"either; worst cosine by nodes kept float32: {curve})")
    failed.steps.append(report)
    return failed, path


def _build(pipe: Pipeline, src: Path, folder: Path, timeout: float, suffix: str = ""
           ) -> tuple[Variant, Path]:
    path = folder / f"{pipe.name}{suffix}.onnx"
    v = Variant(pipe.name, precision=pipe.precision, passes=[s for s, _ in pipe.steps],
                path=str(path))
    ok, steps, err = run_pipeline(pipe, src, path, timeout=timeout)
    v.steps = steps
    for st in steps:
        v.fusions.update(st.get("fusions", {}))
        v.nodes = st.get("nodes_after", v.nodes)
    if not ok:
        v.rejected = f"the pass failed: {err}"
    elif _same_graph(src, path):
        v.rejected = CHANGED_NOTHING
    # as built (verification later marks the variant itself)
    _BUILT.setdefault(str(folder), {})[_steps_key(src, list(pipe.steps))] = (replace(v), path)
    return v, path


def _same_graph(a: Path, b: Path) -> bool:
    """Same nodes (with their attributes) and the same initializers (values included): a pass
    that only rewrote a weight or an attribute did change the model."""
    import hashlib

    import onnx

    def key(path: Path) -> list[Any]:
        g = onnx.load(str(path), load_external_data=False).graph
        nodes = [(n.op_type, n.domain, list(n.input), list(n.output),
                  [x.SerializeToString() for x in n.attribute]) for n in g.node]
        inits = sorted((t.name, hashlib.sha256(t.SerializeToString()).hexdigest())
                       for t in g.initializer)
        return [nodes, inits]

    return key(a) == key(b)


def _slower_round(v: list[float], base: list[float]) -> int | None:
    """The first round (1-based) in which ``v``'s median was not below ``base``'s."""
    for i, (a, b) in enumerate(zip(v, base)):
        if not a < b:  # nan (a failed round) counts as not faster
            return i + 1
    return None


def _beats(v: Variant, base_ms: float | None, base_rounds: list[float]
           ) -> tuple[bool, int | None, float]:
    """The noise rule: ``v`` beats a base of median ``base_ms`` when its median is at most
    ``1 - NOISE_FRACTION`` of it and it was faster in every round (``base_rounds``). Returns
    (beats, the first round it was not faster in, the median it needed)."""
    limit = base_ms * (1 - NOISE_FRACTION) if base_ms is not None else float("nan")
    lost = _slower_round(v.round_ms, base_rounds)
    return v.median_ms is not None and v.median_ms <= limit and lost is None, lost, limit


def _record_times(variants: list[Variant], times: dict[str, tuple[float, float]],
                  per_round: dict[str, list[float]]) -> None:
    """Each timed variant's median, p90 and round medians (from :func:`time_variants`)."""
    for v in variants:
        if v.name in times:
            v.median_ms, v.p90_ms = times[v.name]
            v.round_ms = per_round.get(v.name, [])


def _choose(plain: Variant, variants: list[Variant]) -> Variant:
    """The fastest verified variant that beats the plain file beyond the noise rule (the
    plain one otherwise; each variant's ``round_ms`` for the paired check); every other
    verified variant gets its reason."""
    if plain.median_ms is None:
        return plain
    base, chosen = plain, plain
    for v in variants[1:]:
        if v.median_ms is not None:
            v.speedup = base.median_ms / v.median_ms
        if not v.verified:
            continue
        _, lost, limit = _beats(v, base.median_ms, base.round_ms)
        pruned = lost is not None and len(v.round_ms) < len(base.round_ms)
        if v.median_ms is None:
            v.rejected = "could not be timed"
        elif v.median_ms > limit:
            v.rejected = (f"not faster beyond noise ({v.median_ms:.2f} ms vs {base.name} "
                          f"{base.median_ms:.2f} ms, needs <= {limit:.2f} ms)")
            if pruned:
                v.rejected += f"; slower in round {lost}, not timed further"
        elif lost is not None:
            v.rejected = (f"not faster beyond noise ({v.median_ms:.2f} ms vs {base.name} "
                          f"{base.median_ms:.2f} ms overall, but not faster in round {lost}"
                          f"{', not timed further' if pruned else ''})")
        elif chosen is plain or v.median_ms < (chosen.median_ms or float("inf")):
            chosen = v
    for v in variants[1:]:
        if v.verified and v is not chosen and not v.rejected:
            v.rejected = f"slower than {chosen.name}"
    base.speedup = 1.0
    return chosen


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
                     feed: dict[str, np.ndarray], timeout: float, target: str,
                     timing: dict[str, int], timed: bool = True,
                     near: dict[str, Path] | None = None) -> Variant:
    """Time the verified files (``paths``) in paired rounds, pruned against the plain one, and
    choose by the noise rule (:func:`_choose`); untimed where the target is absent. ``near``:
    files outside only the accuracy budget (:func:`_near_miss`), timed beside them so that the
    report gives their speed too - never chosen - and says which budget would admit them."""
    per_round: dict[str, list[float]] = {}
    times = time_variants({**paths, **(near or {})}, feed, timeout=timeout, target=target,
                          per_round=per_round, baseline="plain", **timing) if timed else {}
    _record_times(variants, times, per_round)
    chosen = _choose(plain, variants)
    for v in variants:
        if v.name in (near or {}):
            v.rejected += _budget_hint(v)
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
    return (not v.verified and v.precision != "fp32" and v.rejected.startswith(OUTSIDE_BUDGET)
            and (v.worst_cosine() or 0.0) > 0)


def _budget_hint(v: Variant) -> str:
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


def _deploy_graphs(plain: Variant, variants: list[Variant], paths: dict[str, Path],
                   names: list[str], feeds: list[dict[str, np.ndarray]],
                   expected: list[list[np.ndarray]], cosine: float, timeout: float,
                   references: list[list[np.ndarray | None]] | None, target: str,
                   timing: dict[str, int], layouts: list[dict[str, str]]
                   ) -> tuple[Variant, Variant | None] | None:
    """``cuda_graph="deploy"``: every verified file runs as a CUDA graph (:func:`_graph_twin`,
    its replays verified; one twin per ``layouts`` entry, twin_layouts), the twins are timed in
    paired rounds beside the plain file without one, and the fastest twin that beats the plain
    file's own default twin by the noise rule - and the plain file without a graph too - is
    kept: (its file's variant, the twin). The plain file with no twin kept: (plain, None).
    None when the plain file cannot run as a graph at all (the files are then compared without
    graphs)."""
    refs = references[0] if references else None
    twins = [(v, _graph_twin(v, paths[v.name], names, feeds[0], expected[0], cosine, timeout,
                             refs, target, o)) for v in variants if v.verified for o in layouts]
    base = next((t for v, t in twins if v is plain and not t.cuda_options), None)
    if base is None or not base.verified:
        variants += [t for _, t in twins]
        return None
    ok = [(v, t) for v, t in twins if t.verified]
    per_round: dict[str, list[float]] = {}
    times = time_variants({"plain": paths["plain"]} | {t.name: paths[v.name] for v, t in ok},
                          feeds[0], timeout=timeout, target=target, per_round=per_round,
                          baseline=base.name, graphs={t.name for _, t in ok},
                          cuda_options={t.name: t.cuda_options for _, t in ok}, **timing)
    _record_times([plain] + [t for _, t in ok], times, per_round)
    best = _choose(base, [base] + [t for _, t in ok if t is not base])
    if best is not base:
        base.rejected = f"slower than {best.name}"
    for v, t in twins:
        if v is not plain:
            v.rejected = v.rejected or f"timed as a CUDA graph only (see {t.name})"
        if t.median_ms and plain.median_ms:
            t.speedup = plain.median_ms / t.median_ms
    variants += [t for _, t in twins]
    beats, lost, _ = _beats(best, plain.median_ms, plain.round_ms)
    if not beats:
        best.rejected = best.rejected or (
            "not faster than the plain export without a graph beyond noise"
            + (f" (not faster in round {lost})" if lost is not None else ""))
        return plain, None
    return next(v for v, t in ok if t is best), best


def _stand_in(refusal: str, target: str) -> str:
    """What to add to a refusal on the CPU provider standing in for ``target``'s: a CPU kernel
    gap says nothing of the target; a graph ONNX Runtime rejects while typing it fails on any."""
    if any(w in refusal for w in INVALID_GRAPH):
        return " - the graph itself is invalid, on any provider"
    return f" - on the CPU, standing in for {target}, whose provider may run it"


def _outcome(plain: Variant, chosen: Variant, variants: list[Variant], target: str,
             absent: str | None, deployed: Variant | None = None) -> str:
    """The result's message (and the plain variant's and, where the target could not be timed,
    the verified ones' reasons). ``deployed``: the CUDA-graph twin ``cuda_graph="deploy"``
    kept, ``chosen`` its file."""
    if deployed is not None:
        chosen.rejected = ""
        plain.rejected = "" if chosen is plain else f"slower than {deployed.name}"
        return (f"{deployed.name} is {deployed.speedup:.2f}x faster than the plain export "
                f"(the file {chosen.name}, run as a CUDA graph - see run_settings)")
    if absent:
        for v in variants[1:]:
            if v.verified:
                v.rejected = f"verified on the CPU, not timed on {target}: {absent}"
            elif v.rejected.startswith(REFUSED):
                v.rejected += _stand_in(v.rejected, target)
            if REFUSED in v.saturation_rejected:
                v.saturation_rejected += _stand_in(v.saturation_rejected, target)
        plain.rejected = ""
        return f"no variant could be timed on {target} ({absent}); the plain export is kept"
    if chosen is plain:
        plain.rejected = ""
        return "no variant beat the plain export beyond noise; the plain export is kept"
    plain.rejected = f"slower than {chosen.name}"
    return f"{chosen.name} is {chosen.speedup:.2f}x faster than the plain export"


def _try_graph(chosen: Variant, plain: Variant, names: list[str],
               feeds: list[dict[str, np.ndarray]], expected: list[list[np.ndarray]],
               cosine: float, timeout: float,
               references: list[list[np.ndarray | None]] | None, target: str, *,
               layouts: list[dict[str, str]], threads: int, warmup: int, repeats: int,
               rounds: int) -> list[Variant]:
    """The chosen file as a CUDA graph, one twin per ``layouts`` entry (:func:`_graph_twin`),
    verified, then timed in rounds of their own beside the chosen file run without one (and the
    plain file, for their speed-up): the fastest twin that beats the chosen file by the noise
    rule, every round, is kept (``rejected`` empty), the others say why not. The file written
    never depends on them: without graphs it is the best one still."""
    twins = [_graph_twin(chosen, Path(chosen.path), names, feeds[0], expected[0], cosine,
                         timeout, references[0] if references else None, target, o)
             for o in layouts]
    ok = [t for t in twins if t.verified]
    if not ok:
        return twins
    paths = {"plain": Path(plain.path), chosen.name: Path(chosen.path)}
    paths |= {t.name: Path(chosen.path) for t in ok}
    per_round: dict[str, list[float]] = {}
    times = time_variants(paths, feeds[0], threads=threads, warmup=warmup, repeats=repeats,
                          rounds=rounds, timeout=timeout, target=target, per_round=per_round,
                          baseline=chosen.name, graphs={t.name for t in ok},
                          cuda_options={t.name: t.cuda_options for t in ok})
    base = times.get(chosen.name, (None,))[0]
    for twin in ok:
        if twin.name not in times or base is None:
            twin.rejected = "could not be timed"
            continue
        _record_times([twin], times, per_round)
        if "plain" in times:
            twin.speedup = times["plain"][0] / twin.median_ms
        beats, lost, limit = _beats(twin, base, per_round.get(chosen.name, []))
        if not beats:
            twin.rejected = (f"not faster than {chosen.name} without a CUDA graph beyond noise "
                             f"({twin.median_ms:.3f} ms vs {base:.3f} ms, needs <= "
                             f"{limit:.3f} ms"
                             + (f", not faster in round {lost}" if lost is not None else "")
                             + ")")
    kept = sorted((t for t in ok if not t.rejected), key=lambda t: t.median_ms or math.inf)
    for twin in kept[1:]:
        twin.rejected = f"slower than {kept[0].name}"
    return twins


def _write(src: Path, out: Path, run_settings: dict[str, Any] | None = None,
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


def _candidate(pipe: Pipeline, src: Path, folder: Path, names: list[str],
               feeds: list[dict[str, np.ndarray]], expected: list[list[np.ndarray]],
               cosine: float, timeout: float,
               references: list[list[np.ndarray | None]] | None, target: str,
               calibration: list[dict[str, np.ndarray]] | None = None
               ) -> tuple[Variant, Path]:
    """Build and verify one pipeline's variant (int8 with its sensitivity search, float16 with
    its measured block list)."""
    if pipe.precision == "int8":
        v, path = _int8_with_sensitivity(pipe, src, folder, names, feeds, expected, cosine,
                                         timeout, calibration=calibration)
        static = is_static(s for s, _ in pipe.steps)
        if static and calibration and v.rejected.startswith(OUTSIDE_BUDGET):
            v.rejected += _coverage_hint(calibration, feeds)
        return v, path
    if pipe.precision == "fp16":
        return _fp16_with_block_list(pipe, src, folder, names, feeds, expected, cosine,
                                     timeout, target)
    v, path = _build(pipe, src, folder, timeout)
    if not v.rejected:
        _verify(v, path, names, feeds, expected, cosine, timeout, references, target)
    return v, path


def _coverage_hint(calibration: list[dict[str, np.ndarray]],
                   feeds: list[dict[str, np.ndarray]]) -> str:
    """Where the verification sets reach beyond the calibration sets' range (by over 1 % of
    that range) on a float input: static int8 clips what lies outside the calibrated
    activation ranges - say so ("" otherwise)."""
    out = []
    for name, first in feeds[0].items():
        if not np.issubdtype(first.dtype, np.floating) or any(name not in c for c in calibration):
            continue
        clo = min(float(np.min(c[name])) for c in calibration)
        chi = max(float(np.max(c[name])) for c in calibration)
        vlo = min(float(np.min(f[name])) for f in feeds if name in f)
        vhi = max(float(np.max(f[name])) for f in feeds if name in f)
        slack = 0.01 * max(chi - clo, 1e-12)
        if vlo < clo - slack or vhi > chi + slack:
            out.append(f"{name}: [{vlo:.3g}, {vhi:.3g}] against [{clo:.3g}, {chi:.3g}]")
    if not out:
        return ""
    return ("; the verification inputs reach beyond the calibration sets' range ("
            + "; ".join(out[:4]) + "): static int8 clips activations outside the calibrated "
            "ranges - calibrate on sets that cover the inputs the model will see")


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
    GRAPH_MODES): auto - the chosen file is also tried as a CUDA graph (:func:`_try_graph`) and
    where that is faster beyond noise ``run_settings`` says how to run it so (the file written
    is the same); deploy - every verified file is compared as a CUDA graph
    (:func:`_deploy_graphs`). ``calibration``: feeds apart from ``feeds`` for static int8
    (``calibration_source`` says where from); ``static_int8``: whether it is a candidate at
    precision int8 (None: where the graph is convolutional, passes.is_convolutional)."""
    named, (target, isa) = target, split_target(target)  # "cpu:avx2": int8 settings for it
    mode = _checked_mode(precision, target, cuda_graph)
    src = Path(onnx_path)
    names, pipes = _plan(src, pipelines, target, precision, model_type, static_int8, isa)
    t0 = time.perf_counter()
    with sandbox.reuse() as server, _scratch() as folder:
        mark = server.mark()  # an outer reuse() block may have served runs before
        plain = Variant("plain", passes=[], path=str(src))
        used = _verify(plain, src, names, feeds, expected, cosine, timeout, references, target)
        wanted = sandbox.providers(target)[0]
        # None: the target can be timed here; else why not (the CPU stood in for it)
        absent = (None if target == "cpu" or wanted in used else
                  f"{wanted} is not available in this ONNX Runtime "
                  f"({', '.join(used) or 'no session'} used instead)")
        variants, paths, near = _candidates(plain, pipes, src, folder, names, feeds, expected,
                                            cosine, timeout, references, target, calibration)
        t_built = time.perf_counter()
        timing = {"threads": threads, "warmup": warmup, "repeats": repeats, "rounds": rounds}
        layouts = twin_layouts(src, target) if mode != "off" and not absent else []
        deployed = (_deploy_graphs(plain, variants, paths, names, feeds, expected, cosine,
                                   timeout, references, target, timing, layouts)
                    if mode == "deploy" and not absent else None)
        if deployed is not None:
            chosen, twin = deployed
        else:
            chosen, twin = _time_and_choose(plain, variants, paths, feeds[0], timeout, target,
                                            timing, timed=not absent, near=near), None
        result = OptimizationResult(variants, chosen.name, threads, repeats, warmup, rounds,
                                    message=_outcome(plain, chosen, variants, target, absent,
                                                     twin),
                                    target=named, providers=used, target_missing=absent or "",
                                    cosine=cosine, calibration=_calibrated(
                                        variants, calibration_source, calibration))
        if mode == "auto" and not absent:
            twin = _auto_graph(result, chosen, plain, names, feeds, expected, cosine, timeout,
                               references, target, layouts, timing)
        if twin is not None and not twin.rejected:
            result.run_settings = twin_settings(twin.cuda_options)
        result.seconds = {"candidates": t_built - t0, "timing": time.perf_counter() - t_built}
        result.sandbox = server.since(mark)
        if out is not None:
            _write(Path(chosen.path), Path(out), result.run_settings,
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
        _BUILT.pop(str(folder), None)
        shutil.rmtree(folder, ignore_errors=True)


def _candidates(plain: Variant, pipes: list[Pipeline], src: Path, folder: Path,
                names: list[str], feeds: list[dict[str, np.ndarray]],
                expected: list[list[np.ndarray]], cosine: float, timeout: float,
                references: list[list[np.ndarray | None]] | None, target: str,
                calibration: list[dict[str, np.ndarray]] | None
                ) -> tuple[list[Variant], dict[str, Path], dict[str, Path]]:
    """Each pipeline's variant built and verified (:func:`_candidate`), after ``plain``: the
    variants, the verified files and those outside only the accuracy budget (_near_miss)."""
    variants, paths, near = [plain], {"plain": src}, {}
    for pipe in pipes:
        v, path = _candidate(pipe, src, folder, names, feeds, expected, cosine, timeout,
                             references, target, calibration)
        variants.append(v)
        if v.verified or _near_miss(v):
            (paths if v.verified else near)[v.name] = path
    return variants, paths, near


def _auto_graph(result: OptimizationResult, chosen: Variant, plain: Variant, names: list[str],
                feeds: list[dict[str, np.ndarray]], expected: list[list[np.ndarray]],
                cosine: float, timeout: float,
                references: list[list[np.ndarray | None]] | None, target: str,
                layouts: list[dict[str, str]], timing: dict[str, int]) -> Variant | None:
    """``cuda_graph="auto"``: the chosen file tried as a CUDA graph (:func:`_try_graph`), its
    twins added to the result's variants; the kept twin (None when none is faster)."""
    tried = _try_graph(chosen, plain, names, feeds, expected, cosine, timeout, references,
                       target, layouts=layouts, **timing)
    result.variants += tried
    twin = next((t for t in tried if not t.rejected), None)
    if twin is not None:
        result.message += (f"; run as a CUDA graph ({twin.name}) it takes "
                           f"{twin.median_ms:.3f} ms"
                           + (f", {twin.speedup:.2f}x faster than the plain export"
                              if twin.speedup else "") + " - see run_settings")
    return twin
