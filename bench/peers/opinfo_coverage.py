"""OpInfo coverage: plain torch.onnx vs onnxmedic on every float32 op in PyTorch's OpInfo database.

For each op in ``op_db`` that supports float32 on CPU, the first N float32 samples are checked
twice with :func:`onnxmedic.ops.testing.check_call`: (a) through plain torch.onnx
(``registry=None``) and (b) through onnxmedic's registry (whatever translations it holds). Each
sample ends as

* ``passed``   exported, ran in ONNX Runtime, matched PyTorch
* ``capture``  torch.export cannot capture the call (counted for both exporters)
* ``export``   torch.onnx / the translation failed to export
* ``runtime``  ONNX Runtime rejected or failed to run the model
* ``compare``  a **silent mismatch**: exported and ran, but the numbers differ from PyTorch
* ``crash`` / ``timeout``  the worker process died or hung on the sample (recorded, the run goes on)

Ops whose outputs PyTorch defines only up to sign (linalg.eigh, linalg.svd, svd: eigen- and
singular vectors) are compared with the documented per-op comparator of
:func:`onnxmedic.ops.testing.comparator_for` (values elementwise, the vectors through the
reconstruction, orthonormality and each column up to sign), and ops accurate only relative to
the size of their result (the FFTs, stft/istft, matrix_exp) with the absolute tolerance scaled
by the output's largest magnitude, for both exporters alike; the report lists them under
"Per-op comparators". Every other output is compared element by element. A sample
is skipped when PyTorch eager rejects it (``eager``), its eager result differs between two
runs (``nondeterministic``), its graph draws random numbers (``random``: an op tagged
``nondeterministic_seeded``; ONNX Runtime's generator never reproduces torch's) or returns
uninitialised memory (``undefined``: ``empty*``). An op passes if all its checked
samples pass; a failed op is counted under the earliest stage any of its samples failed at.

Samples run in worker subprocesses (``--jobs``, default: the number of cores), one op at a time
per worker; a worker that dies or exceeds ``--timeout`` seconds on one sample is killed and
replaced, and the op resumes at the next sample.

    PYTHONPATH=src python bench/peers/opinfo_coverage.py                      # the whole db
    PYTHONPATH=src python bench/peers/opinfo_coverage.py --ops erfinv,scatter_reduce --json out.json

Python API: :func:`run_coverage` returns a :class:`CoverageResult`.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STAGES = ("capture", "export", "runtime", "compare", "crash", "timeout")
SKIPPED = ("eager", "nondeterministic", "random", "undefined")
# ATen ops whose result is uninitialised memory: any value is right, so nothing to compare.
UNDEFINED_OPS = ("aten.empty.", "aten.empty_like.", "aten.new_empty.", "aten.empty_strided.",
                 "aten.new_empty_strided.", "aten.empty_permuted.")
COLUMNS = ("torch_onnx", "onnxmedic")


# --------------------------------------------------------------------------------------------
# Worker side: runs in a subprocess, reads tasks (JSON lines) on stdin, writes events on a
# private copy of stdout (C-level prints from torch/ORT go to stderr so they cannot corrupt it).
# --------------------------------------------------------------------------------------------


def _patch_registry_cache() -> None:
    """Build torchlib's registry once per worker instead of once per export (~0.6 s each).

    torch.onnx rebuilds ``ONNXRegistry.from_torchlib()`` on every export; the harness hands out
    a fresh copy of a cached one (custom translations are registered into the copy), which
    changes no result and halves the run time.
    """
    from torch.onnx._internal.exporter import _registration

    cls = _registration.ONNXRegistry
    original = cls.from_torchlib.__func__
    cache: dict[int, Any] = {}

    def from_torchlib(klass, opset_version=_registration._constants.TORCHLIB_OPSET):
        if opset_version not in cache:
            cache[opset_version] = original(klass, opset_version)
        base = cache[opset_version]
        fresh = klass()
        fresh._opset_version = base._opset_version
        fresh.functions = {k: list(v) for k, v in base.functions.items()}
        return fresh

    cls.from_torchlib = classmethod(from_torchlib)


def _describe_sample(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    import torch
    import torch.utils._pytree as pytree

    def one(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            return f"{str(x.dtype).replace('torch.', '')}{list(x.shape)}"
        return repr(x)

    parts = [one(a) if not isinstance(a, (list, tuple)) else
             "[" + ", ".join(one(v) for v in pytree.tree_leaves(a)) + "]" for a in args]
    parts += [f"{k}={one(v)}" for k, v in kwargs.items()]
    text = ", ".join(parts)
    return text if len(text) <= 300 else text[:297] + "..."


def _clone(obj: Any) -> Any:
    import torch
    import torch.utils._pytree as pytree

    return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, obj)


def _same_outputs(a: list[Any], b: list[Any]) -> bool:
    import torch

    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.is_floating_point() or x.is_complex():
            if not torch.equal(torch.nan_to_num(x, 0.0, 1.0, -1.0), torch.nan_to_num(y, 0.0, 1.0, -1.0)) \
                    or not torch.equal(x.isnan(), y.isnan()):
                return False
        elif not torch.equal(x, y):
            return False
    return True


def _real_outputs(fn: Any) -> Any:
    """``fn`` with complex outputs as ``view_as_real``: torch.onnx represents a complex tensor
    as a real one with a trailing dimension of 2, so that is what ONNX Runtime returns."""
    import torch
    import torch.utils._pytree as pytree

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        return pytree.tree_map(
            lambda t: torch.view_as_real(t) if isinstance(t, torch.Tensor) and t.is_complex()
            else t, out)

    return wrapped


def _check_sample(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                  comparator: Any = None) -> dict[str, Any]:
    import torch

    from onnxmedic._tensors import flatten_tensors
    from onnxmedic.ops.testing import check_call, wrap_call

    def res(stage: str, error: str = "", check: Any = None) -> dict[str, Any]:
        out = {"stage": stage, "error": error[:400]}
        if check is not None and check.comparisons:
            out["max_abs"], out["max_rel"] = check.max_abs, check.max_rel
        if check is not None and check.comparator:
            out["comparator"] = check.comparator
        return out

    # Eager twice: an op whose result is not reproducible cannot be compared.
    try:
        with torch.no_grad():
            first = flatten_tensors(fn(*_clone(args), **_clone(kwargs)))
            second = flatten_tensors(fn(*_clone(args), **_clone(kwargs)))
    except Exception as e:
        r = res("eager", f"{type(e).__name__}: {e}".splitlines()[0])
        return {"torch_onnx": r, "onnxmedic": r}
    if not _same_outputs(first, second):
        r = res("nondeterministic", "eager results differ between two runs")
        return {"torch_onnx": r, "onnxmedic": r}
    # Capture once: what torch.export cannot capture fails the same for both exporters.
    try:
        module, tensors = wrap_call(fn, _clone(args), _clone(kwargs))
        ep = torch.export.export(module, tensors, strict=False)
    except Exception as e:
        text = f"{type(e).__name__}: {e}".strip().splitlines()
        r = res("capture", text[0] if text else type(e).__name__)
        return {"torch_onnx": r, "onnxmedic": r}
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    if any(torch.Tag.nondeterministic_seeded in getattr(t, "tags", ()) for t in targets):
        r = res("random", "the graph draws random numbers")
        return {"torch_onnx": r, "onnxmedic": r}
    if any(str(t).startswith(UNDEFINED_OPS) for t in targets):
        r = res("undefined", "the result is uninitialised memory")
        return {"torch_onnx": r, "onnxmedic": r}
    out = {}
    for column, registry in (("torch_onnx", None), ("onnxmedic", "default")):
        _emit({"ev": "phase", "phase": column})
        kw = {} if registry == "default" else {"registry": None}
        check = check_call(fn, _clone(args), _clone(kwargs), comparator=comparator, **kw)
        out[column] = res(check.stage, check.error, check)
    return out


_PROTO: Any = None
FAULT_ENV = "OPINFO_COVERAGE_FAULT"  # "crash:KEY:IDX" or "hang:KEY:IDX", for the harness's tests


def _inject_fault(info: Any, idx: int) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    kind, key, at = spec.rsplit(":", 2)[0].split(":", 1)[0], *spec.split(":", 1)[1].rsplit(":", 1)
    name = f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name
    if name == key and idx == int(at):
        if kind == "crash":
            os._exit(3)
        time.sleep(3600)


def _emit(event: dict[str, Any]) -> None:
    _PROTO.write(json.dumps(event) + "\n")
    _PROTO.flush()


def worker_main() -> None:
    """Entry point of a worker subprocess (``opinfo_coverage.py --worker``)."""
    global _PROTO
    proto_fd = os.dup(1)
    os.dup2(2, 1)  # anything printed (Python or C) now goes to the worker log
    sys.stdout = sys.stderr
    _PROTO = os.fdopen(proto_fd, "w", buffering=1)

    import logging
    import warnings

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    import torch

    torch.set_num_threads(1)
    from torch.testing._internal.common_methods_invocations import op_db

    from onnxmedic.ops import REGISTRY
    from onnxmedic.ops.testing import comparator_for

    _patch_registry_cache()
    ops = {(o.name, o.variant_test_name): o for o in op_db}
    _emit({"ev": "ready", "registry": [m.name for m in REGISTRY.entries()],
           "load_errors": REGISTRY.load_errors})
    for line in sys.stdin:
        task = json.loads(line)
        info = ops[(task["op"], task["variant"])]
        start, limit = task["start"], task["limit"]
        _emit({"ev": "start", "idx": -1, "phase": "samples"})
        torch.manual_seed(0)
        n = 0
        try:
            samples = info.sample_inputs("cpu", torch.float32, requires_grad=False)
            for i, s in enumerate(samples):
                if i >= limit:
                    break
                n = i + 1
                if i < start:
                    continue
                args, kwargs = (s.input, *s.args), dict(s.kwargs)
                _emit({"ev": "start", "idx": i, "phase": "eager"})
                _inject_fault(info, i)
                t0 = time.perf_counter()
                result = _check_sample(_real_outputs(info.op), args, kwargs,
                                       comparator_for(info.name, info.variant_test_name))
                _emit({"ev": "sample", "idx": i, "sample": _describe_sample(args, kwargs),
                       "seconds": round(time.perf_counter() - t0, 3), **result})
        except Exception as e:  # the sample generator itself failed
            _emit({"ev": "error", "error": f"{type(e).__name__}: {e}"[:400]})
        _emit({"ev": "done", "n": n})


# --------------------------------------------------------------------------------------------
# Driver side.
# --------------------------------------------------------------------------------------------


@dataclass
class OpResult:
    """One OpInfo entry's samples and its status under each exporter."""

    name: str
    variant: str = ""
    samples: dict[int, dict[str, Any]] = field(default_factory=dict)
    error: str = ""  # the sample generator failed

    @property
    def key(self) -> str:
        return f"{self.name}.{self.variant}" if self.variant else self.name

    def status(self, column: str) -> str:
        """'passed', the earliest failing stage, or 'skipped' (no sample checked)."""
        stages = [s[column]["stage"] for _, s in sorted(self.samples.items())]
        checked = [st for st in stages if st not in SKIPPED]
        if not checked:
            return "skipped"
        failed = [st for st in checked if st != "passed"]
        if not failed:
            return "passed"
        return min(failed, key=STAGES.index)

    def silent(self, column: str) -> list[int]:
        """Indices of samples that exported and ran but gave wrong numbers."""
        return [i for i, s in sorted(self.samples.items()) if s[column]["stage"] == "compare"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "variant": self.variant, "error": self.error,
            **{f"status_{c}": self.status(c) for c in COLUMNS},
            "samples": [{"idx": i, **s} for i, s in sorted(self.samples.items())],
        }


@dataclass
class CoverageResult:
    ops: list[OpResult]
    seconds: float
    jobs: int
    limit_samples: int
    registry: list[str] = field(default_factory=list)
    load_errors: dict[str, str] = field(default_factory=dict)

    def op(self, key: str) -> OpResult:
        return next(o for o in self.ops if o.key == key)

    def summary(self, column: str) -> dict[str, int]:
        """Op counts: tested, passed, failed per stage, and ops with any silent mismatch."""
        statuses = Counter(o.status(column) for o in self.ops)
        out = {"tested": sum(n for st, n in statuses.items() if st != "skipped"),
               "passed": statuses.get("passed", 0)}
        for st in STAGES:
            out[st] = statuses.get(st, 0)
        out["skipped"] = statuses.get("skipped", 0)
        out["any_silent"] = sum(1 for o in self.ops if o.silent(column))
        samples = Counter(s[column]["stage"] for o in self.ops for s in o.samples.values())
        out["samples"] = sum(samples.values())
        out["samples_passed"] = samples.get("passed", 0)
        out["samples_compare"] = samples.get("compare", 0)
        return out

    def differing(self) -> list[tuple[str, str, str]]:
        return [(o.key, o.status("torch_onnx"), o.status("onnxmedic")) for o in self.ops
                if o.status("torch_onnx") != o.status("onnxmedic")]

    def silent_mismatches(self, column: str) -> list[OpResult]:
        return [o for o in self.ops if o.silent(column)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds, "jobs": self.jobs, "limit_samples": self.limit_samples,
            "registry": self.registry, "load_errors": self.load_errors,
            "summary": {c: self.summary(c) for c in COLUMNS},
            "differing": self.differing(),
            "ops": [o.to_dict() for o in self.ops],
        }


def select_ops(names: Iterable[str] | None = None) -> list[tuple[str, str]]:
    """(name, variant) of every OpInfo supporting float32 on CPU; ``names`` selects some.

    A selector matches an OpInfo name (all its variants) or ``name.variant``.
    """
    import torch
    from torch.testing._internal.common_methods_invocations import op_db

    wanted = set(names) if names else None
    out = []
    for o in op_db:
        key = f"{o.name}.{o.variant_test_name}" if o.variant_test_name else o.name
        if wanted is not None and o.name not in wanted and key not in wanted:
            continue
        try:
            if torch.float32 not in o.supported_dtypes("cpu"):
                continue
        except Exception:
            continue
        out.append((o.name, o.variant_test_name))
    if wanted is not None:
        known = {n for n, _ in out} | {f"{n}.{v}" for n, v in out if v}
        missing = sorted(w for w in wanted if w not in known)
        if missing:
            raise KeyError(f"no float32 OpInfo named {', '.join(missing)}")
    return out


class _Worker:
    """One worker subprocess with a reader thread feeding its events to a queue."""

    def __init__(self, wid: int, events: queue.Queue, log_dir: Path):
        self.wid = wid
        self.log_path = log_dir / f"worker{wid}.log"
        src = Path(__import__("onnxmedic").__file__).resolve().parent.parent
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env.setdefault("OMP_NUM_THREADS", "1")
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env,
            text=True, bufsize=1,
        )
        self.task: tuple[str, str] | None = None
        self.idx = -1
        self.phase = "startup"
        self.since = time.monotonic()
        self.ready = False
        self.ops_done = 0
        threading.Thread(target=self._read, args=(events,), daemon=True).start()

    def _read(self, events: queue.Queue) -> None:
        for line in self.proc.stdout:
            try:
                events.put((self, json.loads(line)))
            except json.JSONDecodeError:
                continue
        events.put((self, {"ev": "eof"}))

    def send(self, task: tuple[str, str], start: int, limit: int) -> None:
        self.task, self.idx, self.phase, self.since = task, -1, "samples", time.monotonic()
        self.proc.stdin.write(json.dumps(
            {"op": task[0], "variant": task[1], "start": start, "limit": limit}) + "\n")
        self.proc.stdin.flush()

    def log_tail(self) -> str:
        try:
            lines = self.log_path.read_bytes().decode(errors="replace").strip().splitlines()
            return lines[-1][:300] if lines else ""
        except OSError:
            return ""

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(timeout=10)
        except Exception:
            pass
        self.log.close()


def run_coverage(
    ops: Iterable[str] | None = None,
    *,
    limit_samples: int = 4,
    jobs: int | None = None,
    timeout: float = 120.0,
    startup_timeout: float = 300.0,
    max_ops_per_worker: int = 150,
    progress: bool = False,
    partial: Path | None = None,
) -> CoverageResult:
    """Run the harness over the selected OpInfo entries (all float32 ones when ``ops`` is None).

    ``partial``: a JSON-lines file that gets each op's record as soon as it finishes, so a long
    run that is interrupted still leaves its results.
    """
    t_start = time.monotonic()
    todo = select_ops(ops)
    results = {t: OpResult(*t) for t in todo}
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(todo) or 1))
    pending: list[tuple[tuple[str, str], int]] = [(t, 0) for t in todo]
    pending.reverse()  # pop() from the end keeps op_db order
    events: queue.Queue = queue.Queue()
    log_dir = Path(tempfile.mkdtemp(prefix="opinfo_coverage_"))
    info: dict[str, Any] = {}
    workers: dict[int, _Worker] = {}
    next_id = 0
    done_ops = 0

    def spawn() -> None:
        nonlocal next_id
        w = _Worker(next_id, events, log_dir)
        workers[w.wid] = w
        next_id += 1

    def assign(w: _Worker) -> None:
        if pending:
            task, start = pending.pop()
            w.send(task, start, limit_samples)
        else:
            w.task = None

    def fail_current(w: _Worker, stage: str, why: str) -> None:
        """Record the sample the worker was on as crashed/hung; resume its op after it."""
        if w.task is None:
            return
        r = results[w.task]
        if w.idx < 0:  # died while generating samples
            r.error = f"{stage} while generating samples: {why}"
            _finish(w.task)
        else:
            rec = {"stage": stage, "error": f"{stage} in {w.phase}: {why}"[:400]}
            r.samples[w.idx] = {"sample": "", "seconds": None,
                                "torch_onnx": dict(rec), "onnxmedic": dict(rec)}
            pending.append((w.task, w.idx + 1))
        w.task = None

    def _finish(task: tuple[str, str]) -> None:
        nonlocal done_ops
        done_ops += 1
        if partial is not None:
            with open(partial, "a") as f:
                f.write(json.dumps(results[task].to_dict(), default=str) + "\n")
        if progress:
            r = results[task]
            print(f"[{done_ops}/{len(todo)} {time.monotonic() - t_start:6.0f}s] {r.key}: "
                  f"torch.onnx {r.status('torch_onnx')}, onnxmedic {r.status('onnxmedic')}",
                  file=sys.stderr, flush=True)

    def replace(w: _Worker) -> None:
        w.kill()
        del workers[w.wid]
        if pending or any(x.task for x in workers.values()):
            spawn()

    for _ in range(jobs):
        spawn()
    try:
        while done_ops < len(todo):
            try:
                w, ev = events.get(timeout=1.0)
            except queue.Empty:
                w, ev = None, None
            if w is not None and w.wid in workers:
                kind = ev["ev"]
                if kind == "ready":
                    w.ready = True
                    info.setdefault("registry", ev["registry"])
                    info.setdefault("load_errors", ev["load_errors"])
                    if ev["registry"] != info["registry"]:  # the source changed mid-run
                        info.setdefault("registry_changes", []).append(ev["registry"])
                        print("warning: a restarted worker loaded a different onnxmedic "
                              "registry; results of later ops use it", file=sys.stderr)
                    assign(w)
                elif kind == "start":
                    w.idx, w.phase, w.since = ev["idx"], ev["phase"], time.monotonic()
                elif kind == "phase":
                    w.phase = ev["phase"]
                elif kind == "sample":
                    results[w.task].samples[ev["idx"]] = {
                        k: ev[k] for k in ("sample", "seconds", *COLUMNS)}
                elif kind == "error":
                    results[w.task].error = ev["error"]
                elif kind == "done":
                    _finish(w.task)
                    w.ops_done += 1
                    if w.ops_done >= max_ops_per_worker and pending:
                        w.task = None
                        replace(w)  # bound the memory a long-lived worker collects
                    else:
                        assign(w)
                elif kind == "eof":
                    try:
                        code = w.proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        code = None
                    fail_current(w, "crash", f"worker exited with {code}; "
                                 f"last log line: {w.log_tail()}")
                    if not w.ready:
                        raise RuntimeError(f"harness worker failed to start; see {w.log_path}: "
                                           f"{w.log_tail()}")
                    replace(w)
            now = time.monotonic()
            for w in list(workers.values()):
                limit = timeout if w.ready else startup_timeout
                if (w.task is not None or not w.ready) and now - w.since > limit:
                    if not w.ready:
                        raise RuntimeError(f"harness worker did not start in {limit}s; "
                                           f"see {w.log_path}")
                    fail_current(w, "timeout", f"no result after {limit:.0f}s")
                    replace(w)
    finally:
        for w in list(workers.values()):
            try:
                w.proc.stdin.close()
            except Exception:
                pass
            w.kill()
    return CoverageResult(
        ops=[results[t] for t in todo], seconds=time.monotonic() - t_start, jobs=jobs,
        limit_samples=limit_samples, registry=info.get("registry", []),
        load_errors=info.get("load_errors", {}),
    )


def load_result(path: Path) -> CoverageResult:
    """A result back from ``--json`` output, or from its ``.partial.jsonl`` (an unfinished run)."""
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".jsonl":
        records, meta = [json.loads(line) for line in text.splitlines() if line.strip()], {}
    else:
        meta = json.loads(text)
        records = meta["ops"]
    ops = []
    for rec in records:
        o = OpResult(rec["name"], rec["variant"], error=rec.get("error", ""))
        for s in rec["samples"]:
            o.samples[s["idx"]] = {k: s[k] for k in ("sample", "seconds", *COLUMNS)}
        ops.append(o)
    return CoverageResult(ops=ops, seconds=meta.get("seconds", 0.0), jobs=meta.get("jobs", 0),
                          limit_samples=meta.get("limit_samples", 0),
                          registry=meta.get("registry", []),
                          load_errors=meta.get("load_errors", {}))


def print_report(result: CoverageResult, console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    a, b = (result.summary(c) for c in COLUMNS)
    table = Table(title=f"OpInfo float32 coverage ({len(result.ops)} OpInfo entries, "
                        f"<= {result.limit_samples} samples each, {result.seconds:.0f}s "
                        f"on {result.jobs} workers)")
    table.add_column("ops")
    table.add_column("torch.onnx", justify="right")
    table.add_column("onnxmedic", justify="right")
    rows = [("tested", "tested"), ("passed", "passed"),
            ("failed: capture (torch.export)", "capture"), ("failed: export", "export"),
            ("failed: runtime (ORT)", "runtime"), ("failed: silent mismatch", "compare"),
            ("crash", "crash"), ("timeout", "timeout"),
            ("skipped (eager rejects / random / undefined)", "skipped"),
            ("ops with any silent-mismatch sample", "any_silent"),
            ("samples run", "samples"), ("samples passed", "samples_passed"),
            ("samples silently wrong", "samples_compare")]
    for label, k in rows:
        table.add_row(label, str(a[k]), str(b[k]))
    console.print(table)
    reg = result.registry
    console.print(f"onnxmedic registry: {len(reg)} translations"
                  + (f"; load errors: {result.load_errors}" if result.load_errors else ""))
    from onnxmedic.ops.testing import comparator_for

    up_to_sign = [(o.key, comparator_for(o.name, o.variant)) for o in result.ops
                  if comparator_for(o.name, o.variant) is not None]
    if up_to_sign:
        console.print(f"\n[bold]Per-op comparators ({len(up_to_sign)} ops; outputs defined only "
                      f"up to sign, or accurate only normwise; both exporters alike):[/bold]")
        for key, comp in up_to_sign:
            console.print(f"  {key}: {comp.name}: {comp.description}", markup=False,
                          highlight=False)
    diff = result.differing()
    console.print(f"\n[bold]Ops whose status differs ({len(diff)}):[/bold]")
    for key, before, after in diff:
        console.print(f"  {key}: {before} -> {after}")
    for column in COLUMNS:
        silent = result.silent_mismatches(column)
        console.print(f"\n[bold]Silent mismatches under {column} ({len(silent)} ops):[/bold]")
        for o in silent:
            idx = o.silent(column)
            s = o.samples[idx[0]]
            console.print(f"  {o.key}: samples {idx}: {s[column]['error']}  [{s['sample']}]",
                          markup=False, highlight=False)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker_main()
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write every sample's result here (and each op's "
                   "as it finishes to OUT.partial.jsonl)")
    p.add_argument("--ops", help="comma-separated OpInfo names (or name.variant)")
    p.add_argument("--limit-samples", type=int, default=4)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per sample")
    p.add_argument("--quiet", action="store_true", help="no per-op progress lines")
    p.add_argument("--report", type=Path, metavar="JSON",
                   help="only print the report of an earlier run (its --json file or "
                        ".partial.jsonl)")
    ns = p.parse_args(argv)
    if ns.report:
        print_report(load_result(ns.report))
        return 0
    ops = [s.strip() for s in ns.ops.split(",") if s.strip()] if ns.ops else None
    partial = None
    if ns.json:
        partial = ns.json.with_suffix(".partial.jsonl")
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.unlink(missing_ok=True)
    result = run_coverage(ops, limit_samples=ns.limit_samples, jobs=ns.jobs,
                          timeout=ns.timeout, progress=not ns.quiet, partial=partial)
    print_report(result)
    if ns.json:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(result.to_dict(), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
