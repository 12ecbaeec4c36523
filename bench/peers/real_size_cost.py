"""Export + verify wall time of onnxmedic against torch.onnx.export(dynamo=True, verify=True) on
real-size models from default configs (random weights), each run in a fresh process, the two
tools alternated; onnxmedic's stage timings and both tools' peak resident memory (the process, and its children:
onnxmedic's ONNX Runtime sandbox) beside. Goal (issue 14): ratio <= 1.3.

    python bench/peers/real_size_cost.py [--models bert resnet] [--repeat 2] [--json out.json]

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

ROOT = Path(__file__).resolve().parents[2]

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
import resource
rss = {who: resource.getrusage(w).ru_maxrss / 1024 for who, w in
       (("self", resource.RUSAGE_SELF), ("children", resource.RUSAGE_CHILDREN))}
print(json.dumps({"seconds": time.perf_counter() - t, "stages": stages, "rss_mb": rss}))
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
        peak: dict[str, dict[str, float]] = {}
        stages = {}
        for _ in range(a.repeat):
            for which in times:
                got = _run(which, name)
                times[which].append(got["seconds"])
                peak[which] = got["rss_mb"]  # the process's and its children's (the sandbox)
                stages = got["stages"] or stages
        t, o = statistics.median(times["torch.onnx"]), statistics.median(times["onnxmedic"])
        rows.append({"model": name, "torch_onnx_s": round(t, 1), "onnxmedic_s": round(o, 1),
                     "ratio": round(o / t, 2), "peak_rss_mb": peak, "onnxmedic_stages": stages})
        mem = ", ".join(f"{w} {p['self']:.0f}+{p['children']:.0f} MB" for w, p in peak.items())
        print(f"{name:8s} torch.onnx {t:6.1f} s  onnxmedic {o:6.1f} s  ratio {o / t:.2f}  "
              f"peak RSS (process + children) {mem}  stages {stages}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
