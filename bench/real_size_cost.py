"""Export + verify wall time of onnxmedic against torch.onnx.export(dynamo=True, verify=True) on
real-size models from default configs (random weights), each run in a fresh process, the two
tools alternated; onnxmedic's stage timings beside. Goal (issue 14): ratio <= 1.3.

    python bench/real_size_cost.py [--models bert resnet] [--repeat 2] [--json out.json]

torch.onnx runs with its defaults (weights in external data) and the same dynamic shapes;
onnxmedic with its defaults (verification on the example, two further sets and each dynamic dim
at two other sizes, float64 budget).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, sys, tempfile, time, warnings, logging
warnings.simplefilter("ignore"); logging.disable(logging.WARNING)
import torch, transformers
which, name = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
if name == "bert":
    m = transformers.AutoModel.from_config(transformers.AutoConfig.for_model("bert")).eval()
    ids = torch.randint(4, 30000, (2, 128))
    kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    dyn = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
else:
    m = transformers.ResNetModel(transformers.AutoConfig.for_model("resnet")).eval()
    kw = {"pixel_values": torch.randn(2, 3, 224, 224)}
    dyn = {"pixel_values": {0: "batch"}}
out = tempfile.mkdtemp() + "/m.onnx"
t = time.perf_counter()
if which == "torch.onnx":
    torch.onnx.export(m, (), out, kwargs=kw, dynamic_shapes=dyn, dynamo=True, verify=True,
                      verbose=False)
    stages = {}
else:
    import onnxmedic
    r = onnxmedic.export(m, (), out, kwargs=kw, dynamic_shapes=dyn)
    assert r.ok, [f.one_paragraph() for f in r.findings]
    stages = {k: round(v, 2) for k, v in r.timings.items()}
print(json.dumps({"seconds": time.perf_counter() - t, "stages": stages}))
"""


def _run(which: str, name: str) -> dict:
    p = subprocess.run([sys.executable, "-c", _CHILD, which, name], capture_output=True,
                       text=True, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"{which} on {name} failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["bert", "resnet"],
                    choices=["bert", "resnet"])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    for name in a.models:
        times: dict[str, list[float]] = {"torch.onnx": [], "onnxmedic": []}
        stages = {}
        for _ in range(a.repeat):
            for which in times:
                got = _run(which, name)
                times[which].append(got["seconds"])
                stages = got["stages"] or stages
        t, o = statistics.median(times["torch.onnx"]), statistics.median(times["onnxmedic"])
        rows.append({"model": name, "torch_onnx_s": round(t, 1), "onnxmedic_s": round(o, 1),
                     "ratio": round(o / t, 2), "onnxmedic_stages": stages})
        print(f"{name:8s} torch.onnx {t:6.1f} s  onnxmedic {o:6.1f} s  ratio {o / t:.2f}  "
              f"stages {stages}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
