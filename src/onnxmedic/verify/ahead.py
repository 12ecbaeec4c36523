"""PyTorch's outputs on the verification input sets, computed ahead while the model translates.

Verification runs the model in PyTorch on several input sets besides the example (a further
set of the example's shapes, each dynamic dim at two other sizes: verify/input_sets.py). At
real size those runs are most of verification's time, and they used to start only after
translation, while translation - single-threaded Python - left the other cores idle.

Once capture has given the program, its dynamic dims are known, so the input sets
verification will draw are too. ``start`` forks a child that computes PyTorch's outputs on
them, one after another, while the parent translates, checks and saves the model. The child is
a copy of the process at that moment (the model, its state, the inputs): nothing it does
reaches the parent. The verify stage then asks ``Ahead.take`` for each set it drew: a set
equal, value for value, to one the child planned comes from the child; any other set (a size a
guard rule added, a planned set the child did not reach or failed on) is computed by the
parent as before. The two share the work through claim files, so whichever is free takes the
next set and nothing runs twice. Verification itself is unchanged: the same sets, compared the
same way.

The child runs with one intra-op thread: a forked child cannot use the parent's OpenMP thread
pool (libgomp hangs), and one thread is what is idle during translation anyway. It is used only
on Linux, for a CPU model and inputs, with no other Python thread running a CUDA context, and
not for models of more than ``MAX_BYTES`` of weights (their activations would double the peak
memory). It is off unless ``ONNXMEDIC_AHEAD=1``: the child's one-thread float32 outputs can
differ from a two-thread run enough that fewer input sets are accepted by the example's
measured error, and the extra float64 runs cost more than the overlap saved
(tv/mobilenet_v3_large: 16.7 s against 7.8 s, bench/results/vision_time.md).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from onnxmedic.inputs import Inputs
from onnxmedic.verify.input_sets import same_shape_sets, shape_variants

logger = logging.getLogger(__name__)

ENV = "ONNXMEDIC_AHEAD"
MAX_BYTES = 2 * 2**30  # weights; above this the child's activations risk the memory budget
REFERENCE_BYTES = 2**29  # weights up to which the child also runs the float64 reference
POLL = 0.005  # seconds between looks for the child's result


def program_dims(program: Any) -> list[list[int | str]]:
    """Per tensor user input of an ExportedProgram, its dims: an int where static, the symbol's
    text where dynamic (the ONNX graph's inputs, as onnxfile.graph_io lists them, before the
    model is translated). [] when the program does not say."""
    try:
        vals = {n.name: n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"}
        out: list[list[int | str]] = []
        for name in program.graph_signature.user_inputs:
            v = vals.get(name)
            if isinstance(v, torch.Tensor):
                out.append([d if isinstance(d, int) else str(d) for d in v.shape])
        return out
    except Exception:  # a reading ahead must never fail the export
        logger.debug("no dims from the program", exc_info=True)
        return []


def planned_sets(example: Inputs, dims: list[list[int | str]]) -> list[Inputs]:
    """The sets verification draws for an ONNX model with graph input dims ``dims`` (before
    any guard rule adds sizes): the further sets of the example's shapes, then the shape
    variants - in the order verify.stage.input_sets asks for them."""
    return same_shape_sets(example, dims) + [s for _, s in shape_variants(example, dims)]


def same_inputs(a: Inputs, b: Inputs) -> bool:
    """Whether two input sets are the same structure and values (tensors: dtype, shape and
    every element)."""
    la, sa = torch.utils._pytree.tree_flatten((a.args, a.kwargs))
    lb, sb = torch.utils._pytree.tree_flatten((b.args, b.kwargs))
    if sa != sb or len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                    and x.dtype == y.dtype and x.shape == y.shape
                    and torch.equal(x, y)):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def why_not(model: Any, example: Inputs) -> str | None:
    """Why the sets cannot be computed ahead here, or None when they can."""
    if os.environ.get(ENV, "0") != "1":
        return f"off ({ENV}=1 turns it on)"
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return "not Linux"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return "a CUDA context (a forked child cannot use it)"
    fn = model.module() if isinstance(model, torch.export.ExportedProgram) else model
    if not isinstance(fn, torch.nn.Module):
        return "not an nn.Module"
    tensors = [*fn.parameters(), *fn.buffers(),
               *(t for t in torch.utils._pytree.tree_leaves((example.args, example.kwargs))
                 if isinstance(t, torch.Tensor))]
    if any(t.device.type != "cpu" for t in tensors):
        return "a tensor not on the CPU"
    if sum(t.numel() * t.element_size() for t in tensors) > MAX_BYTES:
        return "weights too big to run twice at once"
    return None


@dataclass
class Ahead:
    """The child computing the planned sets; its results are taken by the parent."""

    pid: int
    folder: Path
    sets: list[Inputs]
    timeout: float
    used: set[int] = field(default_factory=set)
    reference: bool = False  # the child runs the example's float64 reference after the sets

    def take(self, sets: list[Inputs]) -> list[tuple[list[np.ndarray], float] | None]:
        """(outputs, seconds) for each of ``sets`` the child computed; None for a set the
        parent computes itself (not planned, claimed by the parent now, or failed)."""
        out: list[tuple[list[np.ndarray], float] | None] = []
        for s in sets:
            j = next((j for j, p in enumerate(self.sets)
                      if j not in self.used and same_inputs(s, p)), None)
            if j is None:
                out.append(None)
                continue
            self.used.add(j)
            out.append(None if _claim(self.folder, j) else self._wait(j))
        return out

    def take_reference(self) -> Any:
        """The example's float64 reference (verify.reference.Reference) from the child, or None
        where the parent runs it itself (not planned, claimed by the parent now, or
        failed)."""
        j = len(self.sets)
        if not self.reference or j in self.used:
            return None
        self.used.add(j)
        if _claim(self.folder, j):
            return None
        res = self.folder / f"{j}.pkl"
        if not res.is_file():
            # still running: on one thread a float64 run can take far longer than the
            # parent's own on all of them (a model of depthwise convolutions: a minute), so
            # the parent does not wait for it
            self.close()
            return None
        with open(res, "rb") as f:
            return pickle.load(f)

    def _wait(self, j: int) -> Any:
        """The child's result for set ``j`` (it claimed it), once written; None where it
        failed there, died, or took longer than the timeout."""
        res = self.folder / f"{j}.pkl"
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if res.is_file():
                with open(res, "rb") as f:
                    return pickle.load(f)
            if (self.folder / f"{j}.err").is_file() or not self._alive():
                return None
            time.sleep(POLL)
        logger.debug("set %d not computed ahead within %.0f s", j, self.timeout)
        return None

    def _alive(self) -> bool:
        if not self.pid:
            return False
        try:
            pid, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid:
            self.pid = 0  # reaped: its results are all written
        return pid == 0

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the child to finish every set (at most ``timeout`` s, default the
        Ahead's); whether it did."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while self._alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL)
        return True

    def close(self) -> None:
        """Stop the child (if it still runs) and remove its folder."""
        if self.pid:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            self.pid = 0
        shutil.rmtree(self.folder, ignore_errors=True)


def _claim(folder: Path, j: int) -> bool:
    """Claim set ``j`` (atomically); False when the other side has. (True once the folder is
    gone: the child was stopped, so the parent computes.)"""
    try:
        os.close(os.open(folder / f"{j}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
    except OSError:
        return True


def _child(run: Callable[[Inputs], list[np.ndarray]], sets: list[Inputs], folder: Path,
           reference: Callable[[float], Any] | None) -> None:
    """In the forked child: each set not claimed by the parent, computed and written; then
    ``reference(seconds of one set)`` (the example's float64 reference), unless claimed."""
    torch.set_num_threads(1)  # the parent's OpenMP pool does not exist here
    devnull = os.open(os.devnull, os.O_WRONLY)  # the model's prints and warnings: said once,
    os.dup2(devnull, 1)  # by the parent's own runs, not twice
    os.dup2(devnull, 2)
    first = 0.0
    for j, s in enumerate(sets):
        if _claim(folder, j):
            t0 = time.perf_counter()
            _write(folder, j, lambda s=s: run(s), with_seconds=True)
            first = first or time.perf_counter() - t0
    if reference is not None and _claim(folder, len(sets)):
        _write(folder, len(sets), lambda: reference(first), with_seconds=False)


def _write(folder: Path, j: int, fn: Callable[[], Any], with_seconds: bool) -> None:
    """``fn()`` (with its seconds) pickled as ``j.pkl``, or ``j.err`` where it raised: the
    parent then computes it and reports why."""
    t0 = time.perf_counter()
    try:
        value = fn()
    except BaseException:
        (folder / f"{j}.err").touch()
        return
    tmp = folder / f"{j}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump((value, time.perf_counter() - t0) if with_seconds else value, f)
    os.replace(tmp, folder / f"{j}.pkl")


def start(model: Any, example: Inputs, program: Any,
          run: Callable[[Inputs], list[np.ndarray]], timeout: float,
          reference: Callable[[float], Any] | None = None) -> Ahead | None:
    """Fork the child computing ``run`` on the sets verification will draw for ``program``'s
    dims, then ``reference`` (the example's float64 reference, given the seconds one set took;
    only for models up to REFERENCE_BYTES of weights); None where that is not possible here
    (see :func:`why_not`) or nothing to plan."""
    reason = why_not(model, example)
    if reason is not None:
        logger.debug("input sets not computed ahead: %s", reason)
        return None
    sets = planned_sets(example, program_dims(program))
    if not sets:
        return None
    fn = model.module() if isinstance(model, torch.export.ExportedProgram) else model
    if sum(t.numel() * t.element_size() for t in [*fn.parameters(), *fn.buffers()]) \
            > REFERENCE_BYTES:
        reference = None  # its float64 copy beside the parent's memory: left to the parent
    folder = Path(tempfile.mkdtemp(prefix="onnxmedic-ahead-"))
    sys.stdout.flush()
    sys.stderr.flush()
    with warnings.catch_warnings():  # 3.12 warns about forking a process with threads
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        try:
            _child(run, sets, folder, reference)
        finally:
            os._exit(0)
    return Ahead(pid, folder, sets, timeout, reference=reference is not None)
