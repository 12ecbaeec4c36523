"""Regenerate src/onnxmedic/fixes/data/cuda_kernels.json from tools/data/OperatorKernels_cuda.md.

The markdown is the "Operators implemented by CUDAExecutionProvider" section of ONNX Runtime's
docs/OperatorKernels.md (generated upstream from the registered kernels by
tools/python/gen_opkernel_doc.py); its first line names the repository, path and commit it was
copied from. onnxmedic falls back to the JSON when the installed onnxruntime has no CUDA kernels
registered (a CPU-only build), so that ``--target cuda`` still gets a static kernel check.

Usage: python tools/gen_cuda_kernels.py [--check]   (--check: fail if the JSON is out of date)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "tools" / "data" / "OperatorKernels_cuda.md"
OUT = ROOT / "src" / "onnxmedic" / "fixes" / "data" / "cuda_kernels.json"
PROVIDER = "CUDAExecutionProvider"
INT_MAX = 2147483647  # ONNX Runtime's open end of a kernel's version range

_SOURCE = re.compile(r"Source: (\S+) (\S+)@([0-9a-f]{40})")
_DOMAIN = re.compile(r"^\|\*\*Operator Domain:\*\* \*([\w.]+)\*\|\|\|\|$")
_CONSTRAINT = re.compile(r"^\*\*(\w+)\*\* = (.+)$")


def parse_version(cell: str) -> list[int]:
    """``13+`` -> [13, INT_MAX]; ``[6, 12]`` -> [6, 12]; ``13`` -> [13, 13]."""
    cell = cell.strip()
    if m := re.fullmatch(r"(\d+)\+", cell):
        return [int(m[1]), INT_MAX]
    if m := re.fullmatch(r"\[(\d+), (\d+)\]", cell):
        return [int(m[1]), int(m[2])]
    if m := re.fullmatch(r"(\d+)", cell):
        return [int(m[1]), int(m[1])]
    raise ValueError(f"unparsable version cell {cell!r}")


def parse_types(cell: str) -> dict[str, list[str]]:
    """``**T1** = tensor(a), tensor(b)<br/> **T2** = ...`` -> {"T1": [...], "T2": [...]}."""
    types: dict[str, list[str]] = {}
    for part in cell.split("<br/>"):
        m = _CONSTRAINT.match(part.strip())
        if not m:
            raise ValueError(f"unparsable type constraint {part!r}")
        types[m[1]] = [t.strip() for t in m[2].split(", ")]
    return types


def parse(text: str) -> tuple[str, list[dict]]:
    """The source line and one entry per kernel row (continuation rows included)."""
    lines = text.splitlines()
    m = _SOURCE.search(lines[0])
    if not m:
        raise ValueError("the first line must name the source: repo path@commit")
    source = f"{m[1]}/{m[2]}@{m[3]}"
    kernels: list[dict] = []
    domain = op = None
    for n, line in enumerate(lines[1:], start=2):
        if not line.startswith("|") or line.startswith(("| Op Name", "|---")) or line == "| |":
            continue
        if d := _DOMAIN.match(line):
            domain = "" if d[1] == "ai.onnx" else d[1]
            op = None
            continue
        cells = line.split("|")
        if len(cells) != 6 or cells[0] or cells[5]:
            raise ValueError(f"line {n}: not a 4-cell table row: {line[:80]!r}")
        name, _params, version, types = cells[1:5]
        if name:
            op = name
        elif op is None:
            raise ValueError(f"line {n}: a continuation row with no operator above it")
        if domain is None:
            raise ValueError(f"line {n}: a row before any operator domain header")
        kernels.append({"domain": domain, "op": op, "since": parse_version(version),
                        "types": parse_types(types)})
    return source, kernels


def render() -> str:
    source, kernels = parse(SRC.read_text(encoding="utf-8"))
    doc = {"source": source, "provider": PROVIDER, "kernels": kernels}
    return json.dumps(doc, indent=1) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        current = OUT.read_text(encoding="utf-8") if OUT.exists() else ""
        if current != text:
            print(f"{OUT.relative_to(ROOT)} is out of date: run tools/gen_cuda_kernels.py")
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text, encoding="utf-8")
    doc = json.loads(text)
    ops = {(k["domain"], k["op"]) for k in doc["kernels"]}
    print(f"wrote {OUT.relative_to(ROOT)}: {len(doc['kernels'])} kernel rows, {len(ops)} "
          f"(domain, op) pairs, from {doc['source']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
