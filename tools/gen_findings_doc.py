"""Regenerate the code tables of docs/findings.md from onnxmedic.findings.CODES."""

from __future__ import annotations

from pathlib import Path

from onnxmedic.findings import CODES

GROUPS = {"OM0": "Inputs, usage and onnxmedic itself", "OM1": "Preflight and capture",
          "OM2": "Operators", "OM3": "Dtypes", "OM4": "Dynamic shapes",
          "OM5": "ONNX checks and ONNX Runtime", "OM6": "Numbers", "OM7": "Sweeps over a model zoo",
          "OM72": "Optimization (`onnxmedic optimize`, `export --optimize`)",
          "OM8": "Hugging Face checkpoints and generation"}
# the optimization section runs on past OM729 (OM73x: int4)
SECTION = {"OM73": "OM72", "OM74": "OM72"}

doc = Path(__file__).resolve().parents[1] / "docs" / "findings.md"
head = doc.read_text().split("\n## ")[0].rstrip()
lines = [head]
current = None
for code, info in CODES.items():
    group = SECTION.get(code[:4], code[:4] if code[:4] in GROUPS else code[:3])
    if group != current:
        current = group
        lines += ["", f"## {current}{'x' if len(current) == 4 else 'xx'} — {GROUPS[current]}", "",
                  "| code | title | exit | meaning |", "|---|---|---|---|"]
    lines.append(f"| `{code}` | {info.title} | {info.exit_code} | {info.doc} |")
doc.write_text("\n".join(lines) + "\n")
