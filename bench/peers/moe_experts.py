"""MoE experts in ONNX: onnxmedic's grouped_mm translation vs transformers' ``batched_mm``
experts implementation (the exportable alternative), same layer, same run.

One Mixtral decoder layer (random weights) exported both ways with a dynamic sequence; each
ONNX file is then run by ONNX Runtime in a fresh process at several token counts, and the
table gives the RSS of the loaded session (and its peak while loading), the peak RSS a run adds
above it, and the median run time.
``batched_mm`` gathers one full expert weight per (token, expert) pair ([S, 2I, H] and
[S, H, I], S = tokens x top_k), so its memory grows by 3 * H * I * 4 bytes per pair; the
grouped translation multiplies each expert's rows by that expert's weight in place.

    python bench/peers/moe_experts.py [--hidden 1024 --intermediate 3584 --tokens 1 16 64]

The real Mixtral size is hidden 4096, intermediate 14336: 5.6 GB of float32 expert weights per
layer, and batched_mm's gathers 704 MB per pair (1.4 GB for one token, 45 GB for 32 tokens).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

_RUN = r"""
import json, statistics, sys, time
import numpy as np, onnxruntime as ort

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024

path, tokens = sys.argv[1], int(sys.argv[2])
sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
load_peak, base = status("VmHWM"), status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current RSS
ids = np.random.default_rng(0).integers(4, 128, size=(1, tokens), dtype=np.int64)
name = sess.get_inputs()[0].name
times = []
for _ in range(3):
    t = time.perf_counter(); sess.run(None, {name: ids}); times.append(time.perf_counter() - t)
print(json.dumps({"load_peak_mb": load_peak, "session_mb": base,
                  "extra_mb": status("VmHWM") - base, "ms": 1000 * statistics.median(times)}))
"""


def _export(implementation: str, hidden: int, intermediate: int, out: Path) -> Path:
    import torch
    import transformers

    import onnxmedic

    class LastHidden(torch.nn.Module):
        def __init__(self, m: torch.nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.m(input_ids=input_ids, use_cache=False).last_hidden_state

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(
        "mixtral", hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=2, vocab_size=128, num_local_experts=8,
        num_experts_per_tok=2)
    hf = transformers.AutoModel.from_config(cfg).eval()
    hf.set_experts_implementation(implementation)
    path = out / f"{implementation}.onnx"
    res = onnxmedic.export(LastHidden(hf).eval(), (torch.randint(4, 128, (1, 8)),), path,
                           dynamic_shapes=({1: "seq"},), verify=False)
    if not path.exists():
        raise SystemExit(f"{implementation}: export failed: "
                         + "; ".join(f.one_paragraph() for f in res.findings)[:2000])
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=3584)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for impl, label in [("grouped_mm", "grouped_mm (onnxmedic translation)"),
                            ("batched_mm", "batched_mm (per-pair weight gather)")]:
            path = _export(impl, a.hidden, a.intermediate, Path(tmp))
            for t in a.tokens:
                out = subprocess.run([sys.executable, "-c", _RUN, str(path), str(t)],
                                     capture_output=True, text=True, check=True).stdout
                rows.append((label, t, json.loads(out.strip().splitlines()[-1])))
    weights = 8 * 3 * a.hidden * a.intermediate * 4 / 2**20
    print(f"Mixtral layer, hidden {a.hidden}, intermediate {a.intermediate}, 8 experts, top-2: "
          f"{weights:.0f} MiB of float32 expert weights; ONNX Runtime CPU")
    print(f"{'experts':38} {'tokens':>6} {'load peak MiB':>14} {'session MiB':>12} "
          f"{'run +MiB':>9} {'ms':>8}")
    for label, t, r in rows:
        print(f"{label:38} {t:>6} {r['load_peak_mb']:>14.0f} {r['session_mb']:>12.0f} "
              f"{r['extra_mb']:>9.0f} {r['ms']:>8.1f}")


if __name__ == "__main__":
    main()
