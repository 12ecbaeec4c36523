"""Regenerate src/onnxmedic/fixes/data/tensorrt_ops.json from tools/data/onnx_tensorrt_operators.md.

The markdown is ONNX-TensorRT's operator support matrix (docs/operators.md in onnx/onnx-tensorrt,
the parser TensorRT and ONNX Runtime's TensorrtExecutionProvider use); its first line names where
and when it was copied. TensorRT publishes no kernel registry to query, so ``--target tensorrt``
checks models against this table: which ops the parser takes, for which types, the opset range,
and the restrictions in words.

Usage: python tools/gen_trt_ops.py [--check]   (--check: fail if the JSON is out of date)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "tools" / "data" / "onnx_tensorrt_operators.md"
OUT = ROOT / "src" / "onnxmedic" / "fixes" / "data" / "tensorrt_ops.json"

# the matrix's type names -> ONNX type strings as ONNX Runtime and onnx.defs spell them
TYPES = {"FP32": "tensor(float)", "FP16": "tensor(float16)", "BF16": "tensor(bfloat16)",
         "INT32": "tensor(int32)", "INT64": "tensor(int64)", "INT8": "tensor(int8)",
         "UINT8": "tensor(uint8)", "BOOL": "tensor(bool)", "FP8": "tensor(float8e4m3fn)",
         "FP4": "tensor(float4e2m1)", "INT4": "tensor(int4)", "DOUBLE": "tensor(double)"}
_SOURCE = re.compile(r"<!-- Source: (.+?) -->")
_HEADER = re.compile(r"TensorRT ([\d.]+) supports operators in the inclusive range of opset (\d+) "
                     r"to opset (\d+)")


def parse(text: str) -> dict:
    source = _SOURCE.search(text)
    header = _HEADER.search(text)
    if not source or not header:
        raise ValueError(f"{SRC.name}: no source line or no 'TensorRT X supports ... opset' line")
    ops: dict[str, dict] = {}
    in_table = False
    for line in text.splitlines():
        if line.startswith("| Operator"):
            in_table = True
            continue
        if not in_table or not line.startswith("|") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name, supported = cells[0], cells[1].startswith("Y")
        types = [t.strip() for t in (cells[2] if len(cells) > 2 else "").split(",") if t.strip()]
        unknown = [t for t in types if t not in TYPES] if supported else []
        if unknown:
            raise ValueError(f"{name}: unknown type name(s) {unknown}")
        ops[name] = {"supported": supported,
                     "types": sorted(TYPES[t] for t in types) if supported else [],
                     "restrictions": re.sub(r"<br\s*/?>", " ", cells[3]).strip()
                     if supported and len(cells) > 3 else ""}
    if len(ops) < 100:
        raise ValueError(f"{SRC.name}: only {len(ops)} operators parsed")
    return {"source": source.group(1), "tensorrt": header.group(1),
            "opset": [int(header.group(2)), int(header.group(3))], "ops": ops}


def main(argv: list[str]) -> int:
    doc = parse(SRC.read_text(encoding="utf-8"))
    text = json.dumps(doc, indent=1, sort_keys=True) + "\n"
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT} is out of date: run python tools/gen_trt_ops.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}: {len(doc['ops'])} operators, TensorRT {doc['tensorrt']}, "
          f"opsets {doc['opset'][0]}-{doc['opset'][1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
