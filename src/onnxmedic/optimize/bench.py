"""``onnxmedic.bench``: latency of an ONNX file in a child process for a target, with node
placement per execution provider and device copies from ONNX Runtime's profiling."""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from onnxmedic.findings import Finding, warning
from onnxmedic.optimize.passes import CHILD

PROVIDERS = {"cpu": ["CPUExecutionProvider"],
             "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
             "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider",
                          "CPUExecutionProvider"]}


@dataclass
class BenchResult:
    """Latency (ms), session-load time (s), the child's peak memory, node placement."""

    target: str
    ok: bool = False
    error: str = ""
    threads: int = 2
    median_ms: float | None = None
    p90_ms: float | None = None
    load_seconds: float | None = None
    peak_rss_mb: float | None = None
    providers: list[str] = field(default_factory=list)
    bound_on: str = ""  # where inputs and outputs were bound while timing (cpu, cuda)
    placement: dict[str, list[str]] = field(default_factory=dict)  # provider -> node names
    profiled_runs: int = 0  # the warm-up runs placement was read from (timed runs unprofiled)
    copies: list[str] = field(default_factory=list)  # Memcpy nodes
    # with cuda_graph: the same file run as a CUDA graph (fixed buffers, enable_cuda_graph)
    graph_median_ms: float | None = None
    graph_p90_ms: float | None = None
    graph_error: str = ""  # why it could not be run as one ("" when it was, or not asked)
    findings: list[Finding] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["findings"] = [f.to_dict() for f in self.findings]
        return d


def run_child(req_path: str, res_path: str) -> None:
    """bench's timing child (run by _child.py, without torch)."""
    import time

    import onnxruntime as ort

    req = json.loads(Path(req_path).read_text())
    with np.load(req["feed"], allow_pickle=False) as data:
        feed = {k: data[k] for k in data.files}
    so = ort.SessionOptions()
    so.intra_op_num_threads = req["threads"]
    so.enable_profiling = True
    so.profile_file_prefix = str(Path(res_path).parent / "prof")
    avail = set(ort.get_available_providers())
    providers = [p for p in req["providers"] if p in avail] or ["CPUExecutionProvider"]
    t0 = time.perf_counter()
    sess = ort.InferenceSession(req["model"], so, providers=providers)
    load = time.perf_counter() - t0
    # inputs and outputs on the session's device, as optimize's timing binds them
    from onnxmedic._sandbox_worker import bind_io

    binding, device = bind_io(ort, np, sess, feed)
    # the warm-up runs are profiled (where each node ran), the timed ones not: ONNX Runtime's
    # profiler records every node of every run - a 400-node chain ran 65x slower with it on
    until = time.perf_counter() + req.get("warmup_seconds", 0)
    for _ in range(max(1, req["warmup"])):
        sess.run_with_iobinding(binding)  # synchronises the provider's stream before returning
    prof = sess.end_profiling()  # and stops profiling the runs below
    while time.perf_counter() < until:  # a GPU's clocks rise from idle (GPU_WARMUP_SECONDS)
        sess.run_with_iobinding(binding)
    times = []
    for _ in range(req["repeats"]):
        t = time.perf_counter()
        sess.run_with_iobinding(binding)
        times.append((time.perf_counter() - t) * 1000)
    placement: dict[str, set[str]] = {}
    runs: dict[str, int] = {}  # kernel events per node: the runs the profile saw
    for ev in json.loads(Path(prof).read_text()):
        args = ev.get("args", {})
        if ev.get("cat") == "Node" and "provider" in args:
            name = ev["name"].rsplit("_kernel_time", 1)[0]
            placement.setdefault(args["provider"], set()).add(name)
            runs[name] = runs.get(name, 0) + 1
    Path(res_path).write_text(json.dumps({
        "times": times, "load": load, "providers": sess.get_providers(), "bound_on": device,
        "placement": {k: sorted(v) for k, v in placement.items()},
        "profiled_runs": max(runs.values(), default=0),
        "peak_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))


def bench(onnx_path: str | os.PathLike[str], feeds: dict[str, np.ndarray], *,
          target: str = "cpu", threads: int = 2, warmup: int = 3, repeats: int = 20,
          timeout: float = 600.0, cuda_graph: bool | None = None) -> BenchResult:
    """Time ``onnx_path`` on ``feeds`` in a child ONNX Runtime for ``target`` (cpu, cuda,
    tensorrt): median/p90 latency, session-load time, peak memory of the child, the nodes each
    execution provider ran (from ONNX Runtime's profiling) and the device copies. Findings:
    OM722 for nodes that fell back to the CPU on a GPU target, OM723 for device copies.
    ``cuda_graph`` (target cuda): also time the file run as a CUDA graph (``graph_*``); None:
    when the file's metadata says to run it so (optimize's ``run_settings``, whose other CUDA
    provider options - prefer_nhwc - the graph's session then takes too)."""
    if target not in PROVIDERS:
        raise ValueError(f"target {target!r}: choose one of {', '.join(PROVIDERS)}")
    if cuda_graph and target != "cuda":
        raise ValueError(f"cuda_graph is for target='cuda', not {target!r}")
    settings = (graph_options(onnx_path) if target == "cuda" and cuda_graph is not False
                else None)
    if cuda_graph is None:
        cuda_graph = settings is not None
    res = BenchResult(target, threads=threads)
    with tempfile.TemporaryDirectory(prefix="onnxmedic-bench-") as tmp:
        feed = Path(tmp) / "feed.npz"
        np.savez(feed, **feeds)
        req, out = Path(tmp) / "req.json", Path(tmp) / "res.json"
        req.write_text(json.dumps({"model": str(Path(onnx_path).resolve()), "feed": str(feed),
                                   "threads": threads, "warmup": warmup, "repeats": repeats,
                                   "warmup_seconds": _warmup_seconds(target),
                                   "providers": PROVIDERS[target]}))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        try:
            proc = subprocess.run([sys.executable, str(CHILD), f"{__name__}:run_child",
                                   str(req), str(out)],
                                  env=env, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            res.error = f"did not finish within {timeout:g} s"
            return res
        if not out.exists():
            res.error = proc.stderr.decode("utf-8", "replace").strip()[-400:]
            return res
        data = json.loads(out.read_text())
    t = sorted(data["times"])
    res.ok = True
    res.median_ms = statistics.median(t)
    res.p90_ms = t[min(len(t) - 1, int(0.9 * len(t)))]
    res.load_seconds = data["load"]
    res.peak_rss_mb = data["peak_kb"] / 1024
    res.providers = data["providers"]
    res.bound_on = data.get("bound_on", "")
    res.placement = data["placement"]
    res.profiled_runs = data.get("profiled_runs", 0)
    res.copies = [n for nodes in res.placement.values() for n in nodes if "Memcpy" in n]
    if cuda_graph:
        _time_graph(res, onnx_path, feeds, warmup, repeats, timeout, settings or {})
    if res.graph_error:
        res.findings.append(warning(
            "OM726", "bench", f"not timed as a CUDA graph: {res.graph_error}",
            suggestion="Run it without one (a default CUDA session), or move what runs on "
            "the CPU (OM722) onto the GPU; optimize --target cuda only recommends a graph it "
            "ran."))
    wanted = PROVIDERS[target][0]
    if target != "cpu":
        cpu = res.placement.get("CPUExecutionProvider", [])
        if cpu:
            why = ("" if wanted in res.providers else
                   f" ({wanted} is not available in this ONNX Runtime)")
            res.findings.append(warning(
                "OM722", "bench", f"{len(cpu)} node(s) ran on the CPU instead of {wanted}"
                f"{why}: {', '.join(cpu[:10])}{' ...' if len(cpu) > 10 else ''}.",
                suggestion="Check `onnxmedic doctor --target` for ops/dtypes without a kernel "
                "on the target; install onnxruntime-gpu for a GPU target.",
                details={"nodes": cpu}))
    if res.copies:
        res.findings.append(warning(
            "OM723", "bench", f"{len(res.copies)} device copies: {', '.join(res.copies[:10])}.",
            suggestion="Each copy moves a tensor between host and device; the nodes next to "
            "them fell back to the CPU.", details={"nodes": res.copies}))
    return res


def _time_graph(res: BenchResult, onnx_path: str | os.PathLike[str],
                feeds: dict[str, np.ndarray], warmup: int, repeats: int, timeout: float,
                cuda_options: dict[str, str]) -> None:
    """The file run as a CUDA graph, timed by the sandbox as optimize times one (a session with
    ``enable_cuda_graph`` and ``cuda_options``, inputs and outputs bound to buffers allocated
    once): ``graph_*`` of ``res``, or ``graph_error`` with why not (no CUDA provider, ONNX
    Runtime's refusal)."""
    from onnxmedic import sandbox

    wanted = PROVIDERS[res.target][0]
    sbx = sandbox.run_model(onnx_path, [feeds], timeout=timeout, providers=PROVIDERS[res.target],
                            threads=res.threads, cuda_tf32=True, cuda_options=cuda_options,
                            timing={"warmup": warmup, "repeats": repeats, "graph": True,
                                    "warmup_seconds": _warmup_seconds(res.target)})
    if wanted not in sbx.providers:
        res.graph_error = ("a CUDA graph needs ONNX Runtime's CUDA provider, which this session "
                           f"does not use ({', '.join(sbx.providers) or sbx.error[:200]})")
    elif not sbx.ok:
        res.graph_error = sbx.summary()[:400]
    else:
        g = sorted(t * 1000 for t in sbx.timed_seconds)
        res.graph_median_ms = statistics.median(g)
        res.graph_p90_ms = g[min(len(g) - 1, int(0.9 * len(g)))]


def _warmup_seconds(target: str) -> float:
    """How long the timing warms up at least: optimize's GPU_WARMUP_SECONDS on a GPU target."""
    from onnxmedic.optimize.timing import GPU_WARMUP_SECONDS

    return GPU_WARMUP_SECONDS if target != "cpu" else 0.0


def graph_options(onnx_path: str | os.PathLike[str]) -> dict[str, str] | None:
    """Where the file's run settings (optimize's metadata) enable a CUDA graph: the other CUDA
    provider options they set ({} for none); None where they enable no graph."""
    import onnx

    from onnxmedic.optimize.graphs import RUN_SETTINGS_KEY, twin_options

    try:
        proto = onnx.load(str(onnx_path), load_external_data=False)
        value = next((p.value for p in proto.metadata_props if p.key == RUN_SETTINGS_KEY), "")
        return twin_options(json.loads(value)) if value else None
    except Exception:  # noqa: BLE001 - the child reports an unreadable file; odd settings: none
        return None
