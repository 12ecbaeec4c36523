"""`onnxmedic reduce`: shrink a failing ONNX model to a minimal subgraph that still fails.

The nodes are taken in topological order. First the shortest prefix that still fails is found
by bisection (a prefix needs only the model's own inputs); then, with intermediate values
recorded from a run of the prefix just before the failing node (or from the reference, for
``mismatch``), the latest start that still fails is bisected, the cut values becoming graph
inputs fed with the recorded values; last, each remaining node is dropped in turn (linear
shrink) where the failure survives it. Every candidate runs in the sandbox (or the user's
command) with a timeout. The result is written atomically with its inputs (.npz) and a
standalone repro script.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

from onnxmedic import sandbox
from onnxmedic.findings import OnnxMedicError, error, info, warning
from onnxmedic.onnxfile import check_output_path, load_checked, random_feeds
from onnxmedic.verify.compare import compare_arrays

logger = logging.getLogger(__name__)

MODES = ("crash", "hang", "mismatch")


def parse_until(until: str) -> str | None:
    """The normalised criterion, or None when ``until`` is not one."""
    u = until.strip()
    if u in MODES:
        return u
    if "{model}" in u:
        return u
    return None


@dataclass
class Outcome:
    """One candidate's run: does it still fail the way the input model fails?"""

    fails: bool
    detail: str = ""


@dataclass
class ReduceStats:
    nodes_in: int = 0
    nodes_out: int = 0
    runs: int = 0
    seconds: float = 0.0
    exhausted: bool = False
    phases: list[str] = field(default_factory=list)


def _subgraph_inputs(node: onnx.NodeProto) -> list[str]:
    """The values a node reads: its inputs and the outer-scope names its subgraphs use."""
    names = [i for i in node.input if i]
    for attr in node.attribute:
        graphs = list(attr.graphs) + ([attr.g] if attr.HasField("g") else [])
        for g in graphs:
            local = {i.name for i in g.input} | {i.name for i in g.initializer}
            for n in g.node:
                local.update(o for o in n.output if o)
            for n in g.node:
                names.extend(x for x in _subgraph_inputs(n) if x not in local)
    return names


class _Graph:
    """The input model, flattened for cutting: nodes in order and where each value comes from."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.nodes = list(model.graph.node)
        self.inits = {i.name: i for i in model.graph.initializer}
        self.graph_inputs = {v.name: v for v in model.graph.input if v.name not in self.inits}
        self.graph_outputs = [o.name for o in model.graph.output]
        self.reads = [_subgraph_inputs(n) for n in self.nodes]
        self.producer = {o: k for k, n in enumerate(self.nodes) for o in n.output if o}
        self.consumers: dict[str, list[int]] = {}
        for k, names in enumerate(self.reads):
            for x in names:
                self.consumers.setdefault(x, []).append(k)
        try:
            inferred = onnx.shape_inference.infer_shapes(model)
        except Exception:
            inferred = model
        self.vinfo = {v.name: v for v in list(inferred.graph.value_info)
                      + list(inferred.graph.output) + list(inferred.graph.input)}

    def outputs_of(self, keep: list[int]) -> list[str]:
        """Values the kept nodes produce that something outside them needs (later nodes,
        the model's outputs); the last node's outputs when nothing does."""
        kept = set(keep)
        outs = []
        for k in keep:
            for o in self.nodes[k].output:
                if not o:
                    continue
                used_outside = any(c not in kept for c in self.consumers.get(o, []))
                if used_outside or o in self.graph_outputs:
                    outs.append(o)
        if not outs and keep:
            outs = [o for o in self.nodes[keep[-1]].output if o]
        return outs

    def build(self, keep: list[int], values: dict[str, np.ndarray]
              ) -> tuple[onnx.ModelProto, dict[str, np.ndarray]] | None:
        """The model of nodes ``keep`` (indices, in order) and its feeds; None when a value it
        needs is neither an initializer, a model input nor recorded."""
        produced = {o for k in keep for o in self.nodes[k].output if o}
        needed: list[str] = []
        for k in keep:
            for x in self.reads[k]:
                if x not in produced and x not in needed:
                    needed.append(x)
        inputs, feeds, inits = [], {}, []
        for x in needed:
            if x in self.inits:
                inits.append(self.inits[x])
            elif x in values:
                a = np.asarray(values[x])
                if x in self.graph_inputs:
                    inputs.append(self.graph_inputs[x])
                else:
                    inputs.append(helper.make_tensor_value_info(
                        x, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape)))
                feeds[x] = a
            else:
                return None
        outputs = []
        for o in self.outputs_of(keep):
            v = self.vinfo.get(o)
            if v is not None:
                outputs.append(v)
            else:
                outputs.append(helper.make_tensor_value_info(o, 0, None))
        g = helper.make_graph([self.nodes[k] for k in keep], self.model.graph.name or "reduced",
                              inputs, outputs, inits)
        m = helper.make_model(g, opset_imports=list(self.model.opset_import))
        m.ir_version = self.model.ir_version
        m.functions.extend(self.model.functions)
        return m, feeds


def _reference_values(model: onnx.ModelProto, feeds: dict[str, np.ndarray], timeout: float,
                      tmp: Path) -> tuple[dict[str, np.ndarray] | None, str]:
    """Every intermediate value by onnx's ReferenceEvaluator, in a child process with a
    timeout (it is plain Python: a huge Loop would hang onnxmedic itself)."""
    mpath, fpath, opath = tmp / "ref.onnx", tmp / "ref_in.npz", tmp / "ref_out.npz"
    onnx.save(model, mpath)
    np.savez(fpath, **feeds)
    code = ("import sys, numpy as np, onnx\n"
            "from onnx.reference import ReferenceEvaluator\n"
            "m = onnx.load(sys.argv[1])\n"
            "feeds = dict(np.load(sys.argv[2]))\n"
            "ref = ReferenceEvaluator(m)\n"
            "res = ref.run(None, feeds, intermediate=True)\n"
            "np.savez(sys.argv[3], **{k: np.asarray(v) for k, v in res.items()"
            " if isinstance(v, np.ndarray) or np.isscalar(v)})\n")
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(mpath), str(fpath), str(opath)],
                              capture_output=True, timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired:
        return None, f"onnx's ReferenceEvaluator did not finish within {timeout:g} s"
    if proc.returncode != 0 or not opath.exists():
        err = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        return None, f"onnx's ReferenceEvaluator failed: {err[-1] if err else proc.returncode}"
    with np.load(opath, allow_pickle=False) as d:
        return {k: d[k] for k in d.files}, ""


class _Runner:
    """Runs candidates against the criterion, counting runs against the budget."""

    def __init__(self, until: str, timeout: float, tmp: Path, max_runs: int,
                 reference: dict[str, np.ndarray] | None,
                 tolerance: tuple[float, float] | None, crash_signal: str | None = None
                 ) -> None:
        self.until, self.timeout, self.tmp = until, timeout, tmp
        self.max_runs, self.runs = max_runs, 0
        self.reference, self.tolerance = reference, tolerance
        self.crash_signal = crash_signal

    @property
    def exhausted(self) -> bool:
        return self.runs >= self.max_runs

    def __call__(self, model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> Outcome:
        self.runs += 1
        path = self.tmp / f"cand{self.runs}.onnx"
        onnx.save(model, path)
        try:
            if self.until in MODES:
                return self._sandbox(path, model, feeds)
            return self._command(path, feeds)
        finally:
            for p in (path, path.with_suffix(".npz")):
                p.unlink(missing_ok=True)

    def _sandbox(self, path: Path, model: onnx.ModelProto, feeds: dict[str, np.ndarray]
                 ) -> Outcome:
        sbx = sandbox.run_model(path, [feeds], timeout=self.timeout)
        if self.until == "hang":
            return Outcome(sbx.status == "timeout", sbx.status)
        if self.until == "crash":
            same = self.crash_signal is None or sbx.signal == self.crash_signal
            return Outcome(sbx.status == "crash" and same, f"{sbx.status} {sbx.signal or ''}")
        if not sbx.ok:
            return Outcome(False, sbx.status)
        assert self.reference is not None
        for name, act in zip(sbx.output_names, sbx.outputs[0]):
            exp = self.reference.get(name)
            if exp is None:
                continue
            c = compare_arrays(name, exp, act, tolerance=self.tolerance, check_dtype=False)
            if not c.ok:
                return Outcome(True, f"{name}: {c.reason} (max abs {c.max_abs:.3g})")
        return Outcome(False, "matches")

    def _command(self, path: Path, feeds: dict[str, np.ndarray]) -> Outcome:
        npz = path.with_suffix(".npz")
        np.savez(npz, **feeds)
        cmd = (self.until.replace("{model}", shlex.quote(str(path)))
               .replace("{inputs}", shlex.quote(str(npz))))
        proc = subprocess.Popen(cmd, shell=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            _killpg(proc)
            proc.communicate()
            return Outcome(False, "command timed out")
        return Outcome(proc.returncode != 0, f"exit code {proc.returncode}")


def _killpg(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass


def _record(graph: _Graph, end: int, feeds: dict[str, np.ndarray], timeout: float,
            tmp: Path) -> dict[str, np.ndarray]:
    """Values produced by nodes [0, end) that nodes up to ``end`` read, from one sandbox run
    of that prefix (which does not fail: the failure needs node ``end``)."""
    keep = list(range(end))
    if not keep:
        return dict(feeds)
    wanted = []
    for k in keep:
        for o in graph.nodes[k].output:
            if o and any(c <= end for c in graph.consumers.get(o, [])):
                wanted.append(o)
    built = graph.build(keep, feeds)
    if built is None:
        return dict(feeds)
    m, f = built
    del m.graph.output[:]
    for o in wanted:
        v = graph.vinfo.get(o)
        et = v.type.tensor_type.elem_type if v is not None and v.type.HasField(
            "tensor_type") else 0
        m.graph.output.append(helper.make_tensor_value_info(o, et, None))
    path = tmp / "record.onnx"
    onnx.save(m, path)
    sbx = sandbox.run_model(path, [f], timeout=timeout)
    values = dict(feeds)
    if sbx.ok:
        values.update(zip(sbx.output_names, sbx.outputs[0]))
    else:
        logger.debug("recording the prefix failed: %s", sbx.status)
    return values


def _kept_child(until: str) -> contextlib.ExitStack:
    """For ``mismatch`` (candidates that run), one kept sandbox child serves every run
    (sandbox.reuse: 10 runs 1.2 -> 0.2 s); a crash or a hang would retire it each time."""
    kept = contextlib.ExitStack()
    if until == "mismatch":
        kept.enter_context(sandbox.reuse())
    return kept


def reduce_model(model: onnx.ModelProto, feeds: dict[str, np.ndarray], until: str, *,
                 timeout: float, max_runs: int = 200,
                 reference: dict[str, np.ndarray] | None = None,
                 tolerance: tuple[float, float] | None = None
                 ) -> tuple[onnx.ModelProto | None, dict[str, np.ndarray], ReduceStats, str]:
    """The minimal failing model, its feeds, statistics and (when nothing fails) why.

    ``reference`` (for ``mismatch``): expected values by ONNX value name; by default every
    intermediate value from onnx's ReferenceEvaluator."""
    t0 = time.perf_counter()
    graph = _Graph(model)
    stats = ReduceStats(nodes_in=len(graph.nodes))
    tmp = Path(tempfile.mkdtemp(prefix="onnxmedic-reduce-"))
    kept = _kept_child(until)
    try:
        if until == "mismatch" and reference is None:
            reference, why = _reference_values(model, feeds, timeout, tmp)
            if reference is None:
                return None, {}, stats, why
        run = _Runner(until, timeout, tmp, max_runs, reference, tolerance)
        all_nodes = list(range(len(graph.nodes)))
        built = graph.build(all_nodes, feeds)
        if built is None:
            return None, {}, stats, "the feeds do not cover the model's inputs"
        first = run(*built)
        if not first.fails:
            return None, {}, stats, f"the input model does not fail that way ({first.detail})"
        if until == "crash":  # stay on the same crash: a smaller model may crash otherwise
            sbx_sig = first.detail.split(" ", 1)[1].strip() if " " in first.detail else None
            run.crash_signal = sbx_sig or None
        values: dict[str, np.ndarray] = dict(feeds)
        if reference is not None:
            values.update(reference)

        def fails(keep: list[int]) -> bool:
            if run.exhausted:
                return False
            b = graph.build(keep, values)
            return b is not None and run(*b).fails

        # 1. the shortest failing prefix [0, end]
        lo, hi = 0, len(graph.nodes) - 1  # the prefix ending at hi fails
        while lo < hi and not run.exhausted:
            mid = (lo + hi) // 2
            if fails(list(range(mid + 1))):
                hi = mid
            else:
                lo = mid + 1
        end = hi
        stats.phases.append(f"prefix: nodes 0..{end}")
        # 2. the latest start that still fails, cut values recorded from the prefix before
        if reference is None:
            values = _record(graph, end, feeds, timeout, tmp)
        lo, hi = 0, end  # [lo, end] fails
        while lo < hi and not run.exhausted:
            mid = (lo + hi + 1) // 2
            if fails(list(range(mid, end + 1))):
                lo = mid
            else:
                hi = mid - 1
        keep = list(range(lo, end + 1))
        stats.phases.append(f"window: nodes {lo}..{end}")
        # 3. linear shrink: drop single nodes while the failure stays
        for k in list(keep):
            if len(keep) == 1 or run.exhausted:
                break
            trial = [x for x in keep if x != k]
            if fails(trial):
                keep = trial
        stats.phases.append(f"shrunk to {len(keep)} node(s)")
        final = graph.build(keep, values)
        assert final is not None
        stats.nodes_out = len(keep)
        stats.runs = run.runs
        stats.exhausted = run.exhausted
        return final[0], final[1], stats, ""
    finally:
        kept.close()
        stats.seconds = time.perf_counter() - t0
        shutil.rmtree(tmp, ignore_errors=True)


def write_outputs(out: Path, model: onnx.ModelProto, feeds: dict[str, np.ndarray], *,
                  until: str, timeout: float, source: str, stats: ReduceStats,
                  tolerance: tuple[float, float] | None) -> tuple[Path, Path]:
    """MIN.onnx, MIN.inputs.npz and MIN.repro.py, each written atomically."""
    from onnxmedic.report.files import atomic_write_bytes, atomic_write_text
    from onnxmedic.report.repro import REDUCE_SCRIPT

    inputs = out.with_name(out.stem + ".inputs.npz")
    script = out.with_name(out.stem + ".repro.py")
    buf = io.BytesIO()
    np.savez(buf, **feeds)
    atomic_write_bytes(inputs, buf.getvalue())
    rtol, atol = tolerance or (1e-4, 1e-5)
    ops = ", ".join(f"{n.op_type} {n.name!r}" for n in model.graph.node[:10])
    atomic_write_text(script, REDUCE_SCRIPT.format(
        until=until, source=source, nodes_in=stats.nodes_in, nodes_out=stats.nodes_out,
        ops=ops.replace('"""', "'''"), script=script.name, model=out.name, inputs=inputs.name,
        timeout=timeout, rtol=rtol, atol=atol))
    atomic_write_bytes(out, model.SerializeToString())  # the model last: it marks success
    return inputs, script


def reduce_stages(result: Any, onnx_path: str | os.PathLike[str], out: str | os.PathLike[str], *,
                  until: str, timeout: float, feeds: Any, reference: Any,
                  tolerance: tuple[float, float] | None, max_runs: int, seed: int) -> None:
    """reduce's stages on ``result``: load, reduce, write (see api.reduce)."""
    mode = parse_until(until)
    if mode is None:
        result.fail("reduce", error(
            "OM543", "reduce", f"--until {until!r} is not a criterion.",
            suggestion="Use crash, hang, mismatch, or a shell command with {model} in it, "
            "e.g. --until \"python check.py {model}\" (non-zero exit = still failing)."))
        return
    bad_out = check_output_path(out)
    if bad_out is not None:
        result.fail("write", bad_out)
        return
    loaded = _load_stage(result, onnx_path, feeds, reference, seed)
    if loaded is None:
        return
    proto, feeds, reference = loaded
    with result.stage("reduce") as st:
        small, small_feeds, stats, why = reduce_model(
            proto, dict(feeds), mode, timeout=timeout, max_runs=max_runs,
            reference=reference, tolerance=tolerance)
        result.timings["reduce_runs"] = float(stats.runs)
        if small is None:
            st.fail(error(
                "OM541", "reduce", f"{onnx_path} does not show the failure asked for "
                f"(--until {until}): {why}.",
                suggestion="Check the criterion on the whole model first (onnxmedic doctor / "
                "run, or the command by hand); raise --timeout for a slow hang."))
            return
    with result.stage("write"):
        inputs_path, script = write_outputs(
            Path(out), small, small_feeds, until=mode, timeout=timeout,
            source=str(onnx_path), stats=stats, tolerance=tolerance)
    result.path = str(out)
    result.findings.extend(_reduced_findings(out, mode, stats, small, inputs_path, script))
    result.ok = True


def _load_stage(result: Any, onnx_path: Any, feeds: Any, reference: Any, seed: int
                ) -> tuple[onnx.ModelProto, dict[str, np.ndarray], Any] | None:
    """The model (with its external data), the feeds (random by default) and the reference."""
    with result.stage("load") as st:
        proto, bad = load_checked(onnx_path, stage="load")
        if proto is None:
            st.fail(*bad)
            return None
        if any(i.data_location == 1 for i in proto.graph.initializer):
            proto = onnx.load(str(onnx_path), load_external_data=True)
        result.onnx_model = proto
        if feeds is None:
            feeds, problems = random_feeds(proto, seed=seed)
            if problems:
                st.fail(error("OM008", "load", "cannot make inputs for the model: "
                              + "; ".join(problems), suggestion="Pass the inputs (feeds=... "
                              "or --input inputs.npz)."))
                return None
        elif not isinstance(feeds, dict):
            feeds = load_npz(feeds)
        if reference is not None and not isinstance(reference, dict):
            reference = load_npz(reference)
    return proto, feeds, reference


def _reduced_findings(out: Any, mode: str, stats: ReduceStats, small: onnx.ModelProto,
                      inputs_path: Path, script: Path) -> list[Any]:
    ops = ", ".join(f"{n.op_type} {n.name!r}" for n in small.graph.node[:8])
    found = [info(
        "OM540", "reduce", f"reduced {stats.nodes_in} nodes to {stats.nodes_out} ({ops}) in "
        f"{stats.runs} runs, {stats.seconds:.1f} s; still fails (--until {mode}). Wrote "
        f"{out}, {inputs_path.name} and {script.name}.",
        suggestion=f"python {script} reproduces it; attach the three files to a bug "
        "report.", details={"nodes_in": stats.nodes_in, "nodes_out": stats.nodes_out,
                            "runs": stats.runs, "phases": stats.phases})]
    if stats.exhausted:
        found.append(warning(
            "OM542", "reduce", f"stopped after {stats.runs} candidate runs (max_runs); "
            f"{out} still fails but may not be minimal.",
            suggestion="Run reduce again on the written model, or raise --max-runs."))
    return found


def load_npz(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as d:
            return {k: d[k] for k in d.files}
    except (OSError, ValueError) as e:
        raise OnnxMedicError(error("OM005", "load", f"cannot read {str(path)!r} as an .npz of "
                                   f"arrays: {e}", suggestion="Give an .npz written by "
                                   "numpy.savez, arrays named after the model's inputs.")) from e
