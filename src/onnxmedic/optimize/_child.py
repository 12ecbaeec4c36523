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
import os
import sys
import types

CHILD = os.path.abspath(__file__)


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
