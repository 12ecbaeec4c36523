"""CUDA-graph twins: a verified file run as a CUDA graph (the same file with the settings
below), verified on its replays and timed against the file without one. At small batch a GPU
waits on kernel launches; a graph replay is one launch."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from onnxmedic import sandbox
from onnxmedic.optimize.passes import is_convolutional
from onnxmedic.optimize.timing import beats, choose, record_times, time_variants
from onnxmedic.optimize.variant import OptimizationResult, Variant, Why
from onnxmedic.optimize.verifier import Verifier

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


def graph_twin(base: Variant, path: Path, verifier: Verifier,
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
    sbx = sandbox.run_model(path, verifier.feeds[:1], timeout=verifier.timeout,
                            providers=sandbox.providers(verifier.target),
                            timing={"warmup": 2, "repeats": 1, "graph": True},
                            cuda_options=twin.cuda_options)
    if not sbx.ok:
        twin.reject(Why.GRAPH_REFUSED, f"ONNX Runtime refused the CUDA graph"
                    f"{' in NHWC' if nhwc else ''} ({sbx.summary()[:200]})")
    elif not sbx.timed_outputs:
        twin.reject(Why.GRAPH_REPLAY,
                    "ONNX Runtime returned no outputs from the CUDA graph's replay")
    else:
        verifier.judge(twin, [sbx.timed_outputs])
        if twin.rejection:
            twin.rejection = twin.rejection.prefixed(Why.GRAPH_REPLAY,
                                                     "the CUDA graph's replay ")
    return twin


def deploy_graphs(plain: Variant, variants: list[Variant], paths: dict[str, Path],
                  verifier: Verifier, timing: dict[str, int], layouts: list[dict[str, str]]
                  ) -> tuple[Variant, Variant | None] | None:
    """``cuda_graph="deploy"``: every verified file runs as a CUDA graph (:func:`graph_twin`,
    its replays verified; one twin per ``layouts`` entry, twin_layouts), the twins are timed in
    paired rounds beside the plain file without one, and the fastest twin that beats the plain
    file's own default twin by the noise rule - and the plain file without a graph too - is
    kept: (its file's variant, the twin). The plain file with no twin kept: (plain, None).
    None when the plain file cannot run as a graph at all (the files are then compared without
    graphs)."""
    twins = [(v, graph_twin(v, paths[v.name], verifier, o))
             for v in variants if v.verified for o in layouts]
    base = next((t for v, t in twins if v is plain and not t.cuda_options), None)
    if base is None or not base.verified:
        variants += [t for _, t in twins]
        return None
    ok = [(v, t) for v, t in twins if t.verified]
    per_round: dict[str, list[float]] = {}
    times = time_variants({"plain": paths["plain"]} | {t.name: paths[v.name] for v, t in ok},
                          verifier.feeds[0], timeout=verifier.timeout, target=verifier.target,
                          per_round=per_round, baseline=base.name,
                          graphs={t.name for _, t in ok},
                          cuda_options={t.name: t.cuda_options for _, t in ok}, **timing)
    record_times([plain] + [t for _, t in ok], times, per_round)
    best = choose(base, [base] + [t for _, t in ok if t is not base])
    if best is not base:
        base.reject(Why.SLOWER, f"slower than {best.name}", than=best.name)
    for v, t in twins:
        if v is not plain and v.rejection is None:
            v.reject(Why.GRAPH_ONLY, f"timed as a CUDA graph only (see {t.name})", twin=t.name)
        if t.median_ms and plain.median_ms:
            t.speedup = plain.median_ms / t.median_ms
    variants += [t for _, t in twins]
    won, lost, _ = beats(best, plain.median_ms, plain.round_ms)
    if not won:
        if best.rejection is None:
            best.reject(Why.NOT_FASTER,
                        "not faster than the plain export without a graph beyond noise"
                        + (f" (not faster in round {lost})" if lost is not None else ""),
                        round=lost)
        return plain, None
    return next(v for v, t in ok if t is best), best


def try_graph(chosen: Variant, plain: Variant, verifier: Verifier, *,
              layouts: list[dict[str, str]], threads: int, warmup: int, repeats: int,
              rounds: int) -> list[Variant]:
    """The chosen file as a CUDA graph, one twin per ``layouts`` entry (:func:`graph_twin`),
    verified, then timed in rounds of their own beside the chosen file run without one (and the
    plain file, for their speed-up): the fastest twin that beats the chosen file by the noise
    rule, every round, is kept (no rejection), the others say why not. The file written
    never depends on them: without graphs it is the best one still."""
    twins = [graph_twin(chosen, Path(chosen.path), verifier, o) for o in layouts]
    ok = [t for t in twins if t.verified]
    if not ok:
        return twins
    paths = {"plain": Path(plain.path), chosen.name: Path(chosen.path)}
    paths |= {t.name: Path(chosen.path) for t in ok}
    per_round: dict[str, list[float]] = {}
    times = time_variants(paths, verifier.feeds[0], threads=threads, warmup=warmup,
                          repeats=repeats, rounds=rounds, timeout=verifier.timeout,
                          target=verifier.target, per_round=per_round, baseline=chosen.name,
                          graphs={t.name for t in ok},
                          cuda_options={t.name: t.cuda_options for t in ok})
    base = times.get(chosen.name, (None,))[0]
    for twin in ok:
        if twin.name not in times or base is None:
            twin.reject(Why.NOT_TIMED, "could not be timed")
            continue
        record_times([twin], times, per_round)
        if "plain" in times:
            twin.speedup = times["plain"][0] / twin.median_ms
        won, lost, limit = beats(twin, base, per_round.get(chosen.name, []))
        if not won:
            twin.reject(Why.NOT_FASTER,
                        f"not faster than {chosen.name} without a CUDA graph beyond noise "
                        f"({twin.median_ms:.3f} ms vs {base:.3f} ms, needs <= {limit:.3f} ms"
                        + (f", not faster in round {lost}" if lost is not None else "") + ")",
                        median_ms=twin.median_ms, base_ms=base, limit_ms=limit, round=lost)
    kept = sorted((t for t in ok if t.rejection is None), key=lambda t: t.median_ms or math.inf)
    for twin in kept[1:]:
        twin.reject(Why.SLOWER, f"slower than {kept[0].name}", than=kept[0].name)
    return twins


def auto_graph(result: OptimizationResult, chosen: Variant, plain: Variant,
               verifier: Verifier, layouts: list[dict[str, str]], timing: dict[str, int]
               ) -> Variant | None:
    """``cuda_graph="auto"``: the chosen file tried as a CUDA graph (:func:`try_graph`), its
    twins added to the result's variants; the kept twin (None when none is faster)."""
    tried = try_graph(chosen, plain, verifier, layouts=layouts, **timing)
    result.variants += tried
    twin = next((t for t in tried if t.rejection is None), None)
    if twin is not None:
        result.message += (f"; run as a CUDA graph ({twin.name}) it takes "
                           f"{twin.median_ms:.3f} ms"
                           + (f", {twin.speedup:.2f}x faster than the plain export"
                              if twin.speedup else "") + " - see run_settings")
    return twin
