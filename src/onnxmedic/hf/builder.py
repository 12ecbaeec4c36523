"""onnxruntime-genai's model builder (``python -m onnxruntime_genai.models.builder``) in a child
process: :func:`start` it on a checkpoint folder, :meth:`BuildJob.wait` for its package,
:func:`finish` the package with the files it does not write. Whether it builds, and what is
done with its package, is hf/backends.py's. The child is forked as soon as the checkpoint is
resolved (it shares torch and transformers, imported already; this module imports nothing
heavy) and writes while the model loads in the parent.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger(__name__)

# what the builder writes for every architecture it serves
GRAPH, CONFIG = "model.onnx", "genai_config.json"
# the architectures whose builder package generates PyTorch's tokens (bench/peers/generation.py
# over the decoder families: bench/results/generation_peers.md): what served() says where the
# installed builder's source cannot be read
ARCHITECTURES = frozenset({
    "GemmaForCausalLM", "Gemma2ForCausalLM", "GraniteForCausalLM", "LlamaForCausalLM",
    "Qwen2ForCausalLM", "Qwen3ForCausalLM", "SmolLM3ForCausalLM"})
LOG_TAIL = 6  # lines of the builder's log a finding quotes


def available() -> bool:
    """Whether onnxruntime-genai's model builder is installed."""
    try:
        return importlib.util.find_spec("onnxruntime_genai.models.builder") is not None
    except (ImportError, ValueError):
        return False


# the builder's dispatch (create_model): `elif config.architectures[0] == "LlamaForCausalLM":`
_DISPATCH = re.compile(r"config\.architectures\[0\]\s*==\s*[\"'](\w+)[\"']")


@functools.lru_cache(maxsize=1)
def served() -> frozenset[str]:
    """The architectures the installed builder has a model class for, read from its source
    (``create_model``'s dispatch on ``config.architectures[0]``) without importing it (it
    imports torch and transformers); ARCHITECTURES where the source cannot be read or names
    none (another layout of the builder)."""
    try:
        spec = importlib.util.find_spec("onnxruntime_genai.models.builder")
        text = Path(spec.origin).read_text() if spec and spec.origin else ""
    except (ImportError, ValueError, OSError, UnicodeDecodeError):
        text = ""
    found = frozenset(_DISPATCH.findall(text))
    if not found:
        logger.debug("builder: no architectures read from its source; the fixed list")
    return found or ARCHITECTURES


@dataclass
class BuildJob:
    """The builder writing a package into ``root/package`` (:func:`start`); :meth:`wait` for
    it, :meth:`discard` it."""

    root: Path
    started: float
    pid: int | None = None  # a forked child
    proc: subprocess.Popen[bytes] | None = None  # a child of its own (no fork here)
    seconds: float = 0.0
    code: int | None = field(default=None, repr=False)
    # _poll and kill from two threads (a watcher waits while the caller may give up)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def out(self) -> Path:
        return self.root / "package"

    @property
    def log(self) -> Path:
        return self.root / "builder.log"

    def discard(self) -> None:
        """Stop the builder and remove what it wrote."""
        self.kill()
        shutil.rmtree(self.root, ignore_errors=True)

    def _poll(self) -> int | None:
        with self.lock:
            if self.code is not None:
                return self.code
            if self.proc is not None:
                self.code = self.proc.poll()
            elif self.pid is not None:
                done, status = os.waitpid(self.pid, os.WNOHANG)
                if done:
                    self.code = os.waitstatus_to_exitcode(status)
            return self.code

    def wait(self, timeout: float) -> str | None:
        """Wait for the builder, at most ``timeout`` seconds from its start: None when it
        wrote a package, else why not (its log's last lines, or the timeout)."""
        while self._poll() is None:
            if time.perf_counter() - self.started > timeout:
                self.kill()
                return f"no package within {timeout:g} s"
            time.sleep(0.05)
        self.seconds = time.perf_counter() - self.started
        missing = [n for n in (GRAPH, CONFIG) if not (self.out / n).is_file()]
        if self.code == 0 and not missing:
            return None
        tail = self.log_tail()
        why = f"it exited with {self.code}" if self.code else f"it wrote no {', '.join(missing)}"
        return why + (f": {tail}" if tail else "")

    def log_tail(self) -> str:
        """The builder's last log lines; when it ended in a Python traceback, the exception's
        own lines only (its frames are not the user's to read)."""
        try:
            raw = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        heads = [i for i, ln in enumerate(raw) if ln.startswith("Traceback (most recent call")]
        if heads:  # frames and their source lines are indented; the exception is not
            raw = [ln for ln in raw[heads[-1] + 1:] if ln[:1] not in ("", " ", "\t")]
        lines = [ln.strip() for ln in raw if ln.strip()]
        return " | ".join(lines[-LOG_TAIL:])[:600]

    def kill(self) -> None:
        """Stop the builder (its package no longer wanted, or too late)."""
        if self._poll() is not None:
            return
        with self.lock:
            if self.code is not None:
                return
            if self.proc is not None:
                self.proc.kill()
                self.proc.wait()
            elif self.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            self.code = -signal.SIGKILL


def start(folder: Path, dest: Path, work: Callable[[Path, Path, Path], None] | None = None
          ) -> BuildJob:
    """Start the builder on the checkpoint ``folder``, writing the package for ``dest`` into
    a temporary folder beside it (with its log and cache): forked where the platform forks -
    the child has torch and transformers imported already - else a ``python -m`` child.
    ``work(folder, out, cache)``: what the forked child runs instead of the float32 builder
    (hf/transforms/int4_writer.build); ValueError where the platform does not fork."""
    import tempfile

    if work is not None and not hasattr(os, "fork"):
        raise ValueError("a builder child with work of its own needs os.fork")
    job = BuildJob(Path(tempfile.mkdtemp(prefix=f".{dest.name}.builder-", dir=dest.parent)),
                   time.perf_counter())
    job.out.mkdir()
    cache = job.root / "cache"
    if not hasattr(os, "fork"):
        with open(job.log, "wb") as f:
            job.proc = subprocess.Popen(
                [sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(folder),
                 "-i", str(folder), "-o", str(job.out), "-p", "fp32", "-e", "cpu",
                 "-c", str(cache)], stdout=f, stderr=subprocess.STDOUT)
        return job
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        _child(folder, job.out, cache, job.log, work)
    job.pid = pid
    return job


def _child(folder: Path, out: Path, cache: Path, log: Path,
           work: Callable[[Path, Path, Path], None] | None = None) -> None:
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)  # what native code prints
        os.dup2(fd, 2)
        # and Python's prints: sys.stdout may not be fd 1 here (a caller's capture)
        sys.stdout = sys.stderr = os.fdopen(fd, "w", buffering=1)
        import torch

        # one thread: the parent computes PyTorch's side meanwhile; and no OpenMP team the
        # parent may have started is used after the fork
        torch.set_num_threads(1)
        (work or _build)(folder, out, cache)
        code = 0
    except BaseException:  # noqa: BLE001 - the log says why; the parent reads it
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _build(folder: Path, out: Path, cache: Path) -> None:
    """The float32 CPU package of onnxruntime-genai's model builder (the options of
    :func:`start`'s ``python -m`` command, called in the process): the child's work unless it
    is given another."""
    from onnxruntime_genai.models import builder

    where = (str(folder), str(folder), str(out), "fp32", "cpu", str(cache))
    builder.create_model(*where, **builder.parse_extra_options(*where, []))


def finish(job: BuildJob, model: Any, tokenizer: Any) -> list[str]:
    """The builder's folder completed as a package: its cache removed, and the model's
    config.json and generation_config.json and the tokenizer's files it did not write (its
    own genai_config.json and tokenizer files are kept). Returns the folder's file names."""
    shutil.rmtree(job.root / "cache", ignore_errors=True)
    side = job.root / "side"
    side.mkdir()
    try:
        from onnxmedic.hf.genai_files import write_side_files

        write_side_files(model, tokenizer, side)
        for f in side.iterdir():
            if not (job.out / f.name).exists():
                os.replace(f, job.out / f.name)
    finally:
        shutil.rmtree(side, ignore_errors=True)
    return sorted(p.name for p in job.out.iterdir())
