"""A child process's entry point for optimize's own children: ``python _child.py
MODULE:FUNCTION ARG...`` calls ``FUNCTION(*ARGS)`` of ``MODULE`` (the pass child,
passes.run_child; bench's timing child, bench.run_child).

Run as a script so that the onnxmedic and onnxmedic.optimize packages are set up as bare
namespaces instead of being imported: their ``__init__`` modules import torch and the exporter
(1.9 s a child here, more with a CUDA build of torch), which no pass needs; a step that needs
torch imports it itself.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHILD = os.path.abspath(__file__)


@dataclass
class ChildRun:
    """How a :func:`run_request` child ended: its result (None where it wrote none), whether
    it was killed at the timeout, its exit code and the last three lines of its stderr."""

    result: dict[str, Any] | None
    timed_out: bool = False
    returncode: int | None = None
    stderr_tail: list[str] = field(default_factory=list)


def run_request(target: str, request: dict[str, Any], folder: str | os.PathLike[str], *,
                cwd: str | os.PathLike[str], timeout: float) -> ChildRun:
    """Run ``target`` ("module:function", called as ``function(request_path, result_path)``)
    in a child started from this file, in its own process group with ``cwd``; the request and
    result are JSON files in ``folder``. A hang past ``timeout`` kills the group."""
    req, res = Path(folder) / "request.json", Path(folder) / "result.json"
    req.write_text(json.dumps(request))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd()] + [p for p in sys.path if p])
    proc = subprocess.Popen([sys.executable, CHILD, target, str(req), str(res)], env=env,
                            cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        return ChildRun(None, timed_out=True)
    if not res.exists():
        tail = err.decode("utf-8", "replace").strip().splitlines()[-3:]
        return ChildRun(None, returncode=proc.returncode, stderr_tail=tail)
    return ChildRun(json.loads(res.read_text()), returncode=proc.returncode)


def main() -> None:
    here = os.path.dirname(CHILD)  # .../onnxmedic/optimize
    # none of this folder's module names may shadow what the child imports
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    for name, path in (("onnxmedic", os.path.dirname(here)), ("onnxmedic.optimize", here)):
        package = types.ModuleType(name)
        package.__path__ = [path]
        sys.modules[name] = package
    module, _, function = sys.argv[1].partition(":")
    getattr(importlib.import_module(module), function)(*sys.argv[2:])


if __name__ == "__main__":
    main()
