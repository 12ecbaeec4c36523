"""ONNX Runtime in a separate process, with a timeout and a memory cap.

A hang, a crash (abort, segfault) or an out-of-memory of ONNX Runtime becomes a
:class:`SandboxResult` with a status, never a hang or a crash of onnxmedic. The child runs in its
own process group and is killed with it; it also dies if onnxmedic dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from onnxmedic.findings import Finding, error

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 120.0
WORKER = Path(__file__).resolve().parent / "_sandbox_worker.py"
# a command the sandbox child runs under (split like a shell line), e.g. QEMU's user-mode
# emulator to run ONNX Runtime as on a CPU this machine is not (docs/optimize-isa.md):
# ``ONNXMEDIC_SANDBOX_WRAPPER="qemu-x86_64 -cpu Haswell-noTSX"`` verifies as on an AVX2 CPU
WRAPPER_ENV = "ONNXMEDIC_SANDBOX_WRAPPER"

# A model whose file and external data take more than this share of the memory available gets
# a memory-lean session (see lean_session). A normal session holds up to twice the weights in
# anonymous memory (bf16 weights folded to float32, or float32 weights packed for MatMul), on
# top of the user's model in onnxmedic's process: lean once that would be a tenth of what is
# available. A 0.5 B bf16 decoder (1.0 GiB) on a machine with 15 GiB available is lean; a model
# of a few hundred MB never is.
LEAN_SHARE = 0.05
# ... and a model of at least this many bytes always is: onnxmedic writes such a model's weights
# as external data (onnxfile.EXTERNAL_DATA_THRESHOLD), which a lean session maps; a default
# session's float32 copies of them would take the export past 2.5x the weights wherever the
# machine has room (bench/peers/big_models.py: 3.7x for the 0.5 B bf16 decoder, 2.8x lean)
LEAN_MIN_BYTES = 1 << 30
# ONNX Runtime folds no constant bigger than this in a lean session (bytes)
LEAN_FOLD_BYTES = 1 << 20
# graph optimizers a lean session leaves out (on top of the extended ones, see lean_session)
LEAN_DISABLED = ("TransposeOptimizer",)


def lean_session(model_bytes: int | None, available: int | None) -> bool:
    """Whether the sandbox loads a model of ``model_bytes`` lean, with ``available`` bytes of
    memory free: when the model is at least LEAN_MIN_BYTES or more than LEAN_SHARE of the
    memory available (False when the model's size is unknown).

    A lean session holds the weights once, memory-mapped from the external data file (file
    pages: resident, but reclaimable), and computes each float32 copy of a bf16 weight just
    before the MatMul that reads it: it folds no constant over LEAN_FOLD_BYTES (folding the
    float32 Cast the dtype fixer puts behind every bf16 weight would hold a float32 copy of the
    whole model, twice the file), packs no MatMul weights (session.disable_prepacking: the
    packed copy is anonymous memory the size of every float32 weight), uses no memory arena
    (freed tensors go back to the system) and runs nodes in priority order (ONNX Runtime's
    topological sort, ties broken by node index: a weight's Cast, which depends on nothing,
    runs when the file's order reaches it, just before its consumer).

    That order holds only while the graph keeps the file's nodes: a node an optimizer creates
    (every fusion of the extended level, and the TransposeOptimizer of the basic one) has a
    higher index than every weight's Cast, which then all run before it - every bf16 weight
    in float32 at once (1.9 GiB instead of 0.25 GiB of anonymous memory for the 0.5 B bf16
    decoder of bench/peers/big_models.py). A lean session therefore runs ONNX Runtime's basic
    optimizations without LEAN_DISABLED: it verifies the graph without the extended fusions
    (SimplifiedLayerNormalization, attention and GELU fusions...) that a default session adds.

    Its outputs are bit-equal to a normal session's except for MatMuls with a constant weight
    (MLAS sums a packed weight in another order than an unpacked one: equal at 64x64, apart by
    float32 rounding from 256x256 on) and for the extended fusions; judged against PyTorch
    like any session. In a bf16 model a float32 difference can flip a bf16 rounding, which
    later layers carry on: on the 0.5 B bf16 decoder the lean and default sessions' logits are
    1.6% apart (normwise), and each is 1.6% from the float32 reference, as PyTorch's own bf16
    run is."""
    if not model_bytes:
        return False
    return model_bytes >= LEAN_MIN_BYTES or bool(available and
                                                 model_bytes > LEAN_SHARE * available)


def _env_lean() -> bool | None:
    """ONNXMEDIC_SANDBOX_LEAN=1/0 forces the lean session on/off (benchmarks compare the two);
    unset or anything else: decided per model (lean_session)."""
    return {"1": True, "0": False}.get(os.environ.get("ONNXMEDIC_SANDBOX_LEAN", ""))


def available_memory() -> int | None:
    """The memory available now, in bytes: the kernel's MemAvailable (free pages undercount:
    page cache is reclaimable), else the free pages; None where neither can be read."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def default_memory_limit() -> int | None:
    """The child's address-space cap, in bytes: 70% of the memory available now (at most 75%
    of the machine's). A cap on total memory alone let a runaway child push the machine into
    the kernel's OOM killer, which may pick onnxmedic itself. None where it cannot be read."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    avail = available_memory()
    return None if avail is None else int(min(total * 0.75, avail * 0.7))


@dataclass
class SandboxResult:
    """What happened in the child. ``status``: ok, load_error, run_error, timeout, crash, oom."""

    status: str
    phase: str = ""
    error: str = ""
    outputs: list[list[np.ndarray]] = field(default_factory=list)  # per feed set
    run_errors: dict[int, str] = field(default_factory=dict)  # optional sets that failed
    output_names: list[str] = field(default_factory=list)
    inputs: list[dict[str, Any]] = field(default_factory=list)
    outputs_meta: list[dict[str, Any]] = field(default_factory=list)
    run_seconds: list[float] = field(default_factory=list)
    load_seconds: float = 0.0  # creating the request's sessions
    session_reused: bool = False  # a kept session served it (keep_session)
    import_seconds: float = 0.0  # the child's import of ONNX Runtime (0 in a reused child)
    signal: str | None = None
    max_opset: int | None = None  # with probe_opset: the highest opset the runtime loads
    ort_version: str | None = None
    providers: list[str] = field(default_factory=list)  # what the session really uses
    wall_seconds: float = 0.0
    stderr: str = ""
    memory_limit: int | None = None  # the child's cap, bytes (set when it ran out)
    model_bytes: int | None = None  # the model file and its external data, bytes (likewise,
    # and for a lean session)
    lean: bool = False  # the session was memory-lean (lean_session)
    timed_seconds: list[float] = field(default_factory=list)  # with timing: the timed runs
    timing_device: str = ""  # with timing: where inputs and outputs were bound (cpu, cuda)
    warmup_runs: int = 0  # with timing: the discarded runs before the timed ones
    timed_outputs: list[np.ndarray] = field(default_factory=list)  # with timing["graph"]: the
    # last timed run's outputs (what the fixed buffers / the CUDA graph's replays compute)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def provider_finding(self, wanted: list[str], stage: str = "runtime") -> Finding | None:
        """OM535 when the session does not use the first provider asked for."""
        if not wanted or not self.providers or wanted[0] in self.providers:
            return None
        from onnxmedic.findings import warning

        on = ("the CPU only" if self.providers[0] == "CPUExecutionProvider"
              else ", ".join(self.providers))
        hint = ("Install onnxruntime-gpu with TensorRT's libraries (its TensorRT execution "
                "provider) on a machine with an NVIDIA GPU" if "Tensorrt" in wanted[0] else
                "Install onnxruntime-gpu matching your CUDA, and run on a machine with a GPU")
        return warning("OM535", stage, f"{wanted[0]} is not available (ONNX Runtime "
                       f"{self.ort_version} uses {', '.join(self.providers)}); the model was "
                       f"run and verified on {on}.",
                       suggestion=f"{hint}, to verify on the target.")

    def _where(self) -> str:
        if self.phase.startswith("run:"):
            return f"running input set {self.phase.split(':')[1]}"
        return "loading the model" if self.phase == "load" else "starting ONNX Runtime"

    def summary(self) -> str:
        """A failed run in one line: "crash: SIGSEGV while loading the model", "timeout while
        running input set 2", else the status and ONNX Runtime's own first lines (a dead
        child's stderr starts with whatever Python warned, so a crash is named by its signal)."""
        if self.status == "crash":
            return f"crash: {self.signal} while {self._where()}"
        if self.status == "timeout":
            return f"timeout while {self._where()}"
        return f"{self.status}: {_first_lines(self.error)}"

    def finding(self, stage: str = "runtime", timeout: float | None = None) -> Finding | None:
        """The finding for a failed run (None when ok)."""
        where = self._where()
        if self.status == "ok":
            return None
        if self.status == "load_error":
            return error("OM510", stage, f"ONNX Runtime could not load the model: "
                         f"{_first_lines(self.error)}",
                         suggestion="A missing kernel for an op/dtype or an opset newer than "
                         "the runtime are the usual causes; run `onnxmedic doctor` on the file.",
                         details={"error": self.error})
        if self.status == "run_error":
            return error("OM511", stage, f"ONNX Runtime failed while {where}: "
                         f"{_first_lines(self.error)}", details={"error": self.error})
        if self.status == "timeout":
            limit = f"{timeout:g} s" if timeout else "the timeout"
            return error("OM512", stage, f"ONNX Runtime did not finish {where} within {limit} "
                         "and was killed.",
                         suggestion="Look for a Loop or Scan with a huge trip count or a "
                         "data-dependent loop; raise --timeout if the model is just slow.",
                         details={"phase": self.phase})
        if self.status == "crash":
            return error("OM513", stage, f"ONNX Runtime crashed ({self.signal}) while {where}.",
                         suggestion="This is a bug of ONNX Runtime or a corrupt model; "
                         "`onnxmedic reduce` can shrink it to a minimal repro for a bug report.",
                         details={"signal": self.signal, "stderr": self.stderr[-2000:]})
        if self.status == "oom":
            cap = (f" under the sandbox's cap of {self.memory_limit / 2**30:.2f} GiB"
                   if self.memory_limit else "")
            size = (f" (the model and its weights: {self.model_bytes / 2**30:.2f} GiB)"
                    if self.model_bytes else "")
            return error("OM514", stage, f"ONNX Runtime ran out of memory{cap} while "
                         f"{where}{size}.",
                         suggestion="The cap is 70% of the memory available when onnxmedic "
                         "started (plus the weights file, for a big model's lean session, "
                         "which maps it): free memory or use a larger machine; otherwise try smaller "
                         "example inputs or check for a shape that explodes (an Expand or "
                         "Tile to a huge size).",
                         details={"error": self.error, "memory_limit": self.memory_limit,
                                  "model_bytes": self.model_bytes})
        return error("OM009", stage, f"the sandbox failed: {self.error}")


def _first_lines(text: str, n: int = 3) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " ".join(lines[:n])[:600]


def _save_feed(path: Path, feed: dict[str, np.ndarray]) -> dict[str, str]:
    saved, dtypes = {}, {}
    for name, arr in feed.items():
        a = np.asarray(arr)
        dtypes[name] = str(a.dtype)
        if a.dtype.kind == "V" or "bfloat16" in str(a.dtype) or "float8" in str(a.dtype):
            a = a.view(np.uint8 if a.dtype.itemsize == 1 else np.uint16)
        saved[name] = a
    np.savez(path, **saved)
    return dtypes


def _unpack(path: Path, meta: list[Any]) -> list[np.ndarray]:
    """The arrays the worker wrote back to back (``_pack``): writable views of one buffer."""
    buf = bytearray(path.read_bytes())
    out = []
    for dtype, shape, offset in meta:
        dt = np.dtype(dtype)
        if dt.kind not in "biufc":
            raise ValueError(f"packed output of dtype {dtype}")
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        out.append(np.frombuffer(buf, dtype=dt, count=count, offset=int(offset))
                   .reshape(shape) if count else np.empty(shape, dt))
    return out


def _restore(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == str(a.dtype):
        return a
    import ml_dtypes

    return a.view(getattr(ml_dtypes, dtype))




class Worker:
    """A sandbox child started ahead of time: it imports ONNX Runtime while the caller is still
    capturing and translating, then waits for one request. Use as a context manager. With
    ``serve`` it serves one request after another (:class:`Server` keeps it while they
    succeed)."""

    def __init__(self, memory_limit: int | None = -1, serve: bool = False) -> None:
        if memory_limit == -1:
            memory_limit = default_memory_limit()
        self.memory_limit = memory_limit
        self.serve = serve
        self.served = 0  # requests sent to it
        self.env = dict(os.environ)  # the environment the child starts in (keep_warm)
        self.dir = Path(tempfile.mkdtemp(prefix="onnxmedic-sbx-"))
        # a serving child's stderr goes to a file: a pipe nobody reads until the child exits
        # would fill up and block it
        self.log = (tempfile.TemporaryFile(prefix="onnxmedic-sbx-", suffix=".log")
                    if serve else None)
        # The worker runs as a plain script (not -m onnxmedic...): importing the onnxmedic
        # package would import torch, which the child never needs and which costs seconds.
        # The child caps its own address space first thing (_sandbox_worker.limit_memory), not
        # a preexec_fn here: that forces a fork of this process, whose page tables (a model of
        # several GiB) are copied and whose pages the child shares until it execs - a
        # multi-GiB resident double in /proc for a moment, and slower.
        self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            shlex.split(os.environ.get(WRAPPER_ENV, ""))
            + [sys.executable, str(WORKER), str(self.dir), str(memory_limit or 0)]
            + (["serve"] if serve else []),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL if serve else subprocess.PIPE,
            stderr=self.log if serve else subprocess.PIPE,
            start_new_session=True,
        )

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.proc is not None:
            _kill_group(self.proc)
            try:
                self.proc.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError, OSError):
                pass
            self.proc = None
        if self.log is not None:
            self.log.close()
            self.log = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def run(
        self,
        model_path: str | os.PathLike[str],
        feeds: list[dict[str, np.ndarray]],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        providers: list[str] | None = None,
        threads: int | None = None,
        disable_optimizations: bool = False,
        probe_opset: bool = False,
        n_required: int | None = None,
        lean: bool | None = None,
        timing: dict[str, Any] | None = None,
        cuda_tf32: bool = False,
        cuda_options: dict[str, str] | None = None,
        keep_session: bool = False, prepack: bool = True, session_config: dict | None = None,
    ) -> SandboxResult:
        """Send the one request and wait for it, at most ``timeout`` seconds. Feeds after the
        first ``n_required`` are optional: a run error there is recorded in ``run_errors`` and
        the other feeds still run. ``lean``: a memory-lean session (lean_session); None
        decides by the model's size and the memory available now. ``timing``: after the
        feeds, time ``repeats`` runs of the first feed after ``warmup`` discarded ones
        (``iobinding``: inputs and outputs bound on the session's device, the GPU for a CUDA
        session; ``warmup_seconds``: warm up at least that long too, ``warmup_runs`` says how
        many runs that took; ``graph``: in a second session, with the outputs bound to buffers
        allocated once - on CUDA captured as a CUDA graph and replayed - the last run's outputs
        in ``timed_outputs``); the seconds are in ``timed_seconds``. ``cuda_tf32``: leave ONNX
        Runtime's CUDA default (TF32 matmuls and convolutions, as deployed; for timing) instead
        of full float32 (for verification: PyTorch computes without TF32). ``cuda_options``:
        more CUDA provider options for every session of the request (``{"prefer_nhwc":
        "1"}``). ``keep_session``: a serving child keeps the session for the next request that
        asks so for the same model files and session options (a generation loop's steps:
        loading a 0.5 B decoder takes seconds, a step milliseconds); ``session_reused`` says
        whether it did. ``prepack=False``: no weight repacking at load (a few runs, big model).
        ``session_config``: session config entries, e.g. isa.PRECISION_CONFIG."""
        proc = self.proc
        if proc is None:
            raise RuntimeError("sandbox worker already used")
        t_start = time.perf_counter()
        req_dir = self.dir
        log_at = 0
        if self.serve:
            _clear(req_dir)  # the previous request's feeds, outputs and result
            log_at = self.log.seek(0, os.SEEK_END) if self.log is not None else 0
        if lean is None:
            lean = _env_lean()
        if lean is None:
            lean = lean_session(model_file_bytes(model_path), available_memory())
        self._send(model_path, feeds, {
            "lean": lean,
            # what a lean session maps of the weights, on top of the memory cap
            "mapped_bytes": _external_bytes(model_path) if lean else 0,
            "providers": providers or ["CPUExecutionProvider"],
            "threads": threads,
            "disable_optimizations": disable_optimizations,
            "probe_opset": probe_opset,
            "n_required": len(feeds) if n_required is None else n_required,
            "timing": timing, "cuda_tf32": cuda_tf32,
            "cuda_options": dict(cuda_options or {}),
            "keep_session": keep_session, "no_prepack": not prepack,
            "session_config": dict(session_config or {})})
        timed_out, stderr = self._await(proc, timeout, log_at)
        phase_file = req_dir / "phase"
        phase = phase_file.read_text() if phase_file.exists() else "start"
        wall = time.perf_counter() - t_start
        if timed_out:
            return SandboxResult("timeout", phase=phase, wall_seconds=wall, stderr=stderr)
        result_file = req_dir / "result.json"
        if proc.returncode and proc.returncode < 0 or not result_file.exists():
            out = _crashed(proc.returncode, phase, wall, stderr)
        else:
            out = _read_result(req_dir, json.loads(result_file.read_text()), phase, wall,
                               stderr)
        if lean:
            out.model_bytes = model_file_bytes(model_path)
        if out.status == "oom":  # what the finding needs to say how far off it was
            out.memory_limit, out.model_bytes = self.memory_limit, model_file_bytes(model_path)
            if lean and out.memory_limit:
                out.memory_limit += _external_bytes(model_path)
        return out

    def _await(self, proc: subprocess.Popen[bytes], timeout: float, log_at: int
               ) -> tuple[bool, str]:
        """Wait for the request's end: (timed out, the child's stderr meanwhile). A one-shot
        child has exited; a serving one is kept while alive (``log_at``: where its stderr
        file stood when the request was sent)."""
        if self.serve:
            timed_out = _await_result(proc, self.dir / "result.json", timeout)
            stderr_b = b""
            if self.log is not None:  # its last 64 KiB since log_at
                self.log.seek(max(log_at, self.log.seek(0, os.SEEK_END) - (1 << 16)))
                stderr_b = self.log.read()
            if proc.poll() is not None:  # dead (killed, crashed): not served again
                self.proc = None
        else:
            timed_out, stderr_b = _wait(proc, timeout)
            self.proc = None
        return timed_out, stderr_b.decode("utf-8", "replace") if stderr_b else ""

    def _send(self, model_path: str | os.PathLike[str], feeds: list[dict[str, np.ndarray]],
              options: dict[str, Any]) -> None:
        """Write the feeds, then request.json, which the waiting worker reads."""
        self.served += 1
        req_dir = self.dir
        feed_dtypes = [_save_feed(req_dir / f"feed_{i}.npz", f) for i, f in enumerate(feeds)]
        request = {
            "model": str(Path(model_path).resolve()),
            "n_feeds": len(feeds),
            "feed_dtypes": feed_dtypes,
            **options,
        }
        tmp = req_dir / "request.json.tmp"
        tmp.write_text(json.dumps(request))
        os.replace(tmp, req_dir / "request.json")  # the worker waits for this name


def _clear(folder: Path) -> None:
    """Remove a serving child's files of the last request (it took request.json itself)."""
    for f in folder.iterdir():
        if f.name != "request.json":
            f.unlink(missing_ok=True)


def _await_result(proc: subprocess.Popen[bytes], result_file: Path, timeout: float) -> bool:
    """Wait until a serving child has written ``result_file`` or died, at most ``timeout``
    seconds, then kill it (its group): whether it timed out. Any exception
    (KeyboardInterrupt) kills the child before it propagates."""
    deadline = time.monotonic() + timeout
    delay = 0.0005
    try:
        while not result_file.exists():
            if proc.poll() is not None:
                return False
            if time.monotonic() > deadline:
                _kill_group(proc)
                proc.wait()
                return True
            time.sleep(delay)
            delay = min(delay * 1.5, 0.01)
    except BaseException:
        _kill_group(proc)
        proc.wait()
        raise
    return False


def _wait(proc: subprocess.Popen[bytes], timeout: float) -> tuple[bool, bytes | None]:
    """Wait for the child at most ``timeout`` seconds, then kill its group: (timed out, its
    stderr). Any exception (KeyboardInterrupt) kills the child before it propagates."""
    timed_out = False
    try:
        _, stderr_b = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
        _, stderr_b = proc.communicate()
    except BaseException:  # KeyboardInterrupt: never leave the child behind
        _kill_group(proc)
        proc.wait()
        raise
    finally:
        _kill_group(proc)  # grandchildren, if any
    return timed_out, stderr_b


def model_file_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes of a model file and the external data files beside it named after it."""
    try:
        return Path(path).stat().st_size + _data_bytes(Path(path))
    except OSError:
        return None


def _external_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of the external data files beside a model (``path``.data*)."""
    try:
        return _data_bytes(Path(path))
    except OSError:
        return 0


def _data_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.parent.glob(f"{p.name}.data*"))


def _crashed(returncode: int | None, phase: str, wall: float, stderr: str) -> SandboxResult:
    """The result of a child that died (a signal) or exited without writing result.json."""
    if returncode is not None and returncode < 0:
        try:
            sig = signal.Signals(-returncode).name
        except ValueError:
            sig = f"signal {-returncode}"
    else:
        sig = f"exit code {returncode}"
    status = "crash"
    if "MemoryError" in stderr or "bad_alloc" in stderr:
        status = "oom"
    return SandboxResult(status, phase=phase, signal=sig, wall_seconds=wall,
                         stderr=stderr, error=_first_lines(stderr[-2000:]))


def _read_result(req_dir: Path, res: dict[str, Any], phase: str, wall: float, stderr: str
                 ) -> SandboxResult:
    """The result the child wrote (``res``: result.json), with each run's outputs read."""
    out = SandboxResult(
        res["status"], phase=res.get("phase", phase), error=res.get("error", ""),
        inputs=res.get("inputs", []), outputs_meta=res.get("outputs", []),
        output_names=[o["name"] for o in res.get("outputs", [])],
        load_seconds=res.get("load_seconds", 0.0), wall_seconds=wall, stderr=stderr,
        import_seconds=res.get("import_seconds", 0.0),
        max_opset=res.get("max_opset"), ort_version=res.get("ort_version"),
        providers=res.get("providers", []), lean=bool(res.get("lean")),
        timed_seconds=res.get("timing", {}).get("seconds", []),
        timing_device=res.get("timing", {}).get("device", ""),
        warmup_runs=res.get("timing", {}).get("warmup_runs", 0),
        session_reused=bool(res.get("session_reused")),
    )
    for i, run in enumerate(res.get("runs", [])):
        if "error" in run:
            out.run_errors[i] = run["error"]
            out.outputs.append([])
            out.run_seconds.append(0.0)
            continue
        out.outputs.append(_read_outputs(req_dir, i, run))
        out.run_seconds.append(run["seconds"])
    if "run" in res.get("timing", {}):
        out.timed_outputs = _read_outputs(req_dir, "timing", res["timing"]["run"])
    return out


def _read_outputs(req_dir: Path, i: int | str, run: dict[str, Any]) -> list[np.ndarray]:
    """The outputs the child saved for run ``i`` (out_i.bin or out_i.npz)."""
    if "packed" in run:
        return [_restore(a, dt) for a, dt in zip(
            _unpack(req_dir / f"out_{i}.bin", run["packed"]), run["dtypes"])]
    with np.load(req_dir / f"out_{i}.npz", allow_pickle=False) as data:
        return [_restore(data[f"o{j}"], dt) for j, dt in enumerate(run["dtypes"])]


def providers(target: str) -> list[str]:
    """ONNX Runtime's provider list for a target, most preferred first (each falls back to the
    next for the nodes it does not take)."""
    return {"cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
            "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider",
                         "CPUExecutionProvider"]}.get(target, ["CPUExecutionProvider"])


class Server:
    """Sandbox runs one after another in a child kept between them (optimize's dozens of
    runs): the child is started on the first request and kept while its requests succeed, so
    that a run does not pay a child's start - importing ONNX Runtime and, on a GPU, loading its
    CUDA provider's libraries and creating a CUDA context, seconds each. A failed request
    retires the child (a crashed, hung or out-of-memory one is dead anyway; a CUDA error can
    poison the process), and a failure in a child that served before is run again in a fresh
    one - a timeout excepted - so that reuse never changes a verdict. ``stats``: runs,
    children started, their import seconds, the sessions' load seconds, the runs' wall
    seconds."""

    def __init__(self, memory_limit: int | None = -1) -> None:
        self.memory_limit = memory_limit
        self.child: Worker | None = None
        self.unused = False  # the child was started ahead (start) and has served nothing yet
        self.stats = {"runs": 0, "children": 0, "import_seconds": 0.0, "load_seconds": 0.0,
                      "wall_seconds": 0.0}

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill the kept child and remove its folder - or, inside :func:`keep_warm`, keep a
        healthy child with the default cap idle for the next Server."""
        child, self.child, self.unused = self.child, None, False
        if child is not None and not (self.memory_limit == -1 and _POOL.give(child)):
            child.close()

    def retire(self) -> None:
        """Kill the kept child (a failed request's: never kept for another run)."""
        child, self.child, self.unused = self.child, None, False
        if child is not None:
            child.close()

    def start(self, fresh: bool = False) -> None:
        """Start the kept child now, where there is none (a run does so first): a caller
        with time to wait before its first run (the genai builder writing the package) has
        the child import ONNX Runtime meanwhile. Inside :func:`keep_warm`, its idle child is
        taken instead of starting one (``fresh``: never taken)."""
        if self.child is None or self.child.proc is None:
            self.retire()
            self.child = (_POOL.take() if self.memory_limit == -1 and not fresh else None) \
                or Worker(self.memory_limit, serve=True)
            self.unused = True

    def count(self, out: SandboxResult, child: bool = False) -> None:
        """Add a run to ``stats`` (``child``: it started a child - a kept one, or its own:
        run_model's ``fresh``)."""
        self.stats["runs"] += 1
        self.stats["children"] += int(child)
        self.stats["import_seconds"] += out.import_seconds
        self.stats["load_seconds"] += out.load_seconds
        self.stats["wall_seconds"] += out.wall_seconds

    def mark(self) -> dict[str, Any]:
        """The stats now, for :meth:`since` (a caller inside an outer reuse() block)."""
        return {**self.stats, "alive": self.child is not None and self.child.proc is not None}

    def since(self, mark: dict[str, Any]) -> dict[str, Any]:
        """Since ``mark``: the runs, the children they took (the child alive at ``mark``
        counts when it served one) and the seconds (import, load, wall) - stats' keys."""
        out: dict[str, Any] = {k: v - mark[k] for k, v in self.stats.items()}
        out["children"] += int(bool(mark["alive"] and out["runs"]))
        return out

    def run(self, model_path: str | os.PathLike[str], feeds: list[dict[str, np.ndarray]],
            **options: Any) -> SandboxResult:
        """:meth:`Worker.run` in the kept child (a fresh one where there is none)."""
        self.start()
        assert self.child is not None
        reused = self.child.served > 0  # a failure in a fresh child is the fresh verdict
        out = self._once(model_path, feeds, options)
        if not out.ok and reused and out.status != "timeout":
            logger.info("sandbox: %s in a reused child; run again in a fresh one",
                        out.summary())
            out = self._once(model_path, feeds, options, fresh=True)
        return out

    def _once(self, model_path: str | os.PathLike[str], feeds: list[dict[str, np.ndarray]],
              options: dict[str, Any], fresh: bool = False) -> SandboxResult:
        self.start(fresh)  # where there is no child (or a dead one)
        started, self.unused = self.unused, False  # this run takes the child start() made
        assert self.child is not None
        out = self.child.run(model_path, feeds, **options)
        self.count(out, child=started)
        if not out.ok:
            self.retire()
        return out


_SERVER: contextvars.ContextVar[Server | None] = contextvars.ContextVar("onnxmedic_sandbox",
                                                                        default=None)


@contextlib.contextmanager
def reuse(memory_limit: int | None = -1) -> Iterator[Server]:
    """Within the block, :func:`run_model` calls with the default memory cap run in one kept
    child (:class:`Server`) instead of a child each; nested blocks share the outer one."""
    outer = _SERVER.get()
    if outer is not None:
        yield outer
        return
    server = Server(memory_limit)
    token = _SERVER.set(server)
    try:
        yield server
    finally:
        _SERVER.reset(token)
        server.close()


# os.environ's variables a keep_warm child does not start again for: pytest's name of the test
# running (set for each test) and torch's compile cache folder (set on a process's first
# export): neither numpy nor ONNX Runtime reads them
WARM_ENV_IGNORED = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"})
# keep_warm's idle child serves at most this many requests, then a fresh one takes over (what
# ONNX Runtime and the allocator keep of earlier sessions does not pile up)
WARM_MAX_RUNS = 100


class _Pool:
    """:func:`keep_warm`'s idle child: at most one serving Worker with the default cap, which
    a Server with the default cap takes on its first run and gives back when it closes. Only
    the process and thread that entered keep_warm use it (a forked child, a worker thread
    start children of their own)."""

    def __init__(self) -> None:
        self.blocks: list[bool] = []  # the keep_warm blocks entered, innermost last
        self.pid = 0
        self.idle: Worker | None = None

    def usable(self) -> bool:
        return (bool(self.blocks) and self.blocks[-1] and self.pid == os.getpid()
                and threading.current_thread() is threading.main_thread())

    def take(self) -> Worker | None:
        """The idle child (None where there is none or the pool is not in use here); one
        started in another environment than os.environ's now (a variable the child reads:
        the fault injection of the tests, ONNX Runtime's), or dead, is killed instead: a
        one-shot child would start in the new environment."""
        if not self.usable() or self.idle is None:
            return None
        child, self.idle = self.idle, None
        if child.proc is None or child.proc.poll() is not None or not _same_env(child.env):
            child.close()
            return None
        return child

    def give(self, child: Worker) -> bool:
        """Keep ``child`` idle for the next Server: False (the caller kills it) where the pool
        is not in use here, already keeps one, or the child is dead, started in another
        environment or served WARM_MAX_RUNS requests."""
        if (not self.usable() or self.idle is not None or child.proc is None
                or child.proc.poll() is not None or not _same_env(child.env)
                or child.served >= WARM_MAX_RUNS):
            return False
        self.idle = child
        return True

    def drop(self) -> None:
        """Kill the idle child (in the process that started it only)."""
        child, self.idle = self.idle, None
        if child is not None and self.pid == os.getpid():
            child.close()


_POOL = _Pool()


def _same_env(env: dict[str, str]) -> bool:
    """Whether ``env`` (a child's at its start) is os.environ now, WARM_ENV_IGNORED aside."""
    now = os.environ
    return all(env.get(k) == now.get(k) for k in env.keys() | now.keys()
               if k not in WARM_ENV_IGNORED)


@contextlib.contextmanager
def keep_warm(enabled: bool = True) -> Iterator[None]:
    """Within the block, in this process's main thread, the sandbox runs that would each start
    a child with the default memory cap - export's and verify's (:func:`worker`),
    :func:`run_model`'s outside :func:`reuse` (unless ``fresh``), and each reuse() block's
    first - take one idle child instead, which goes back idle after a run that succeeded: a
    process that verifies many small models one after another (onnxmedic's test suite) pays
    one child's start (a Python and ONNX Runtime's import) instead of one per run. It is what
    :class:`Server` does within reuse(), across them: a failed run retires the child, a
    failure in a child that served before is run again in a fresh one (a timeout excepted),
    and a child is replaced when os.environ changed since it started - the verdicts are a
    one-shot child's. Runs with a cap of their own, timings (``fresh``) and
    :class:`Worker` s made directly start their own child as always. The innermost block
    decides: ``keep_warm(False)`` inside one, the idle child is not used meanwhile (tests of
    the sandbox's own children); nested blocks share one idle child, killed when the last
    ``keep_warm(True)`` block ends."""
    if _POOL.blocks and _POOL.pid != os.getpid():  # a forked child: a pool of its own
        _POOL.__init__()
    _POOL.pid = os.getpid()
    _POOL.blocks.append(enabled)
    try:
        yield
    finally:
        _POOL.blocks.pop()
        if not any(_POOL.blocks):
            _POOL.drop()


class Leased:
    """A :class:`Worker`'s one run, served inside :func:`keep_warm` by the idle kept child (a
    Server of its own, that takes it on the run and gives it back after). Same use as a
    Worker: run once, close (or a ``with`` block)."""

    def __init__(self) -> None:
        self.server: Server | None = Server()

    def __enter__(self) -> Leased:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    def run(self, model_path: str | os.PathLike[str], feeds: list[dict[str, np.ndarray]],
            **options: Any) -> SandboxResult:
        """:meth:`Worker.run`'s request, in the kept child; the lease ends with it."""
        if self.server is None:
            raise RuntimeError("sandbox worker already used")
        try:
            return self.server.run(model_path, feeds, **options)
        finally:
            self.close()


def worker() -> Worker | Leased:
    """The sandbox child for one run, started now so that it imports ONNX Runtime while the
    caller captures and translates (:class:`Worker`); inside :func:`keep_warm`, a
    :class:`Leased` run of the idle kept child."""
    return Leased() if _POOL.usable() else Worker()


# what worker() gives: a child of its own or keep_warm's lease, used alike (run once, close)
Runner = Worker | Leased


def active_server() -> Server | None:
    """The Server a surrounding :func:`reuse` keeps in this context (None outside one)."""
    return _SERVER.get()


def run_model(
    model_path: str | os.PathLike[str],
    feeds: list[dict[str, np.ndarray]],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    memory_limit: int | None = -1,
    providers: list[str] | None = None,
    threads: int | None = None,
    disable_optimizations: bool = False,
    probe_opset: bool = False,
    lean: bool | None = False,
    timing: dict[str, Any] | None = None,
    cuda_tf32: bool = False,
    cuda_options: dict[str, str] | None = None,
    fresh: bool = False,
    keep_session: bool = False,
    prepack: bool = True,
    session_config: dict[str, str] | None = None,
) -> SandboxResult:
    """Load ``model_path`` in a child ONNX Runtime and run each feed dict; never raises for
    failures of the model or of ONNX Runtime. ``lean``, ``timing``, ``cuda_tf32``,
    ``cuda_options``, ``keep_session`` (only inside :func:`reuse`), ``prepack``,
    ``session_config``: see
    :meth:`Worker.run`; a default session unless asked (timings, as optimize's, are of the
    session users deploy). Inside :func:`reuse`, a kept child serves it (the default cap)
    unless ``fresh``: timings take a child of their own, as a deployment loads its model into
    a fresh process - in a kept one the memory earlier sessions left changes a memory-bound
    model's speed (the Llama step's float32 decoder step: 7.6 ms there, 10.4 ms fresh)."""
    options = {"timeout": timeout, "providers": providers, "threads": threads,
               "disable_optimizations": disable_optimizations, "probe_opset": probe_opset,
               "lean": lean, "timing": timing, "cuda_tf32": cuda_tf32,
               "cuda_options": cuda_options, "keep_session": keep_session,
               "prepack": prepack, "session_config": session_config}
    server = active_server()
    if server is not None and memory_limit == -1 and not fresh:
        return server.run(model_path, feeds, **options)
    if server is None and memory_limit == -1 and not fresh and _POOL.usable():
        with Leased() as leased:  # keep_warm's idle child
            return leased.run(model_path, feeds, **options)
    with Worker(memory_limit) as w:
        out = w.run(model_path, feeds, **options)
    if server is not None:  # a fresh child inside reuse(): counted all the same
        server.count(out, child=True)
    return out


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass
