"""ONNX Runtime latency of onnxmedic-exported models vs PyTorch eager, and the cost of the casts
the dtype policy inserts (issue: "casts cost less than 10% latency").

For each small model: eager PyTorch (float32), ORT on the float32 export, and the bfloat16
version of the same model -- which torch.onnx exports unloadable on CPU -- repaired with
--dtype-policy upcast and boundary. "cast cost" = latency of the repaired bf16 model / latency
of the float32 export, minus 1 (the repaired model computes in float32, so the difference is
what the casts cost).
Usage: python bench/latency/latency_models.py [--repeat 200] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench" / "latency"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _oplatency import _median_time  # noqa: E402

import onnxmedic  # noqa: E402


class MLP(torch.nn.Module):
    def __init__(self, width: int = 256, depth: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*[m for _ in range(depth) for m in
                                            (torch.nn.Linear(width, width), torch.nn.GELU())])

    def forward(self, x):
        return self.layers(x)


class ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10))

    def forward(self, x):
        return self.body(x)


class Attention(torch.nn.Module):
    def __init__(self, d: int = 128) -> None:
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(d, 4, batch_first=True)
        self.ff = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                      torch.nn.Linear(4 * d, d))
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x):
        h = self.norm(x + self.attn(x, x, x, need_weights=False)[0])
        return self.norm(h + self.ff(h))


CASES = [
    ("mlp 4x256", MLP, (16, 256)),
    ("convnet 32ch", ConvNet, (4, 3, 32, 32)),
    ("attention d128", Attention, (4, 32, 128)),
]


def _session(path: Path, threads: int):
    import onnxruntime as ort

    o = ort.SessionOptions()
    o.intra_op_num_threads = threads
    o.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), o, providers=["CPUExecutionProvider"])


def measure(name: str, make, shape, repeat: int, threads: int) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    model = make().eval()
    x = torch.randn(*shape)
    row: dict = {"model": name}
    with tempfile.TemporaryDirectory() as d:
        f32 = Path(d) / "f32.onnx"
        assert onnxmedic.export(model, (x,), f32).ok
        import onnxruntime as ort

        s = _session(f32, threads)
        feed = {s.get_inputs()[0].name: ort.OrtValue.ortvalue_from_numpy(x.numpy())}
        row["ort_us"] = _median_time(lambda: s.run_with_ort_values(None, feed), repeat) * 1e6
        with torch.no_grad():
            row["eager_us"] = _median_time(lambda: model(x), repeat) * 1e6
        bf = make().eval()
        bf.load_state_dict(model.state_dict())
        bf = bf.to(torch.bfloat16)
        xb = x.to(torch.bfloat16)
        with torch.no_grad():
            row["eager_bf16_us"] = _median_time(lambda: bf(xb), repeat) * 1e6
        plain = Path(d) / "plain.onnx"
        try:
            torch.onnx.export(bf, (xb,), dynamo=True, verbose=False).save(plain)
            _session(plain, threads)
            row["plain_bf16"] = "loads"
        except Exception as e:
            row["plain_bf16"] = "NOT_IMPLEMENTED" if "implementation" in str(e) else \
                type(e).__name__
        for policy in ("upcast", "boundary"):
            p = Path(d) / f"{policy}.onnx"
            r = onnxmedic.export(bf, (xb,), p, dtype_policy=policy)
            if not r.ok:
                row[f"{policy}_us"] = None
                continue
            s = _session(p, threads)
            # pre-made OrtValues on both sides: numpy bf16 conversion in the Python binding
            # is not what the casts cost
            ov = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                xb.view(torch.int16).numpy().view(np.uint16), 16)
            fo = {s.get_inputs()[0].name: ov}
            row[f"{policy}_us"] = _median_time(lambda: s.run_with_ort_values(None, fo),
                                               repeat) * 1e6
            row[f"{policy}_casts"] = next(f.details["casts"] for f in r.findings
                                          if f.code == "OM310")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = [measure(n, m, s, a.repeat, a.threads) for n, m, s in CASES]
    if a.json:
        print(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"ORT latency vs eager, and dtype-policy cast cost (threads={a.threads}, "
              f"median of {a.repeat})")
    for col in ("model", "eager f32 µs", "ORT f32 µs", "ORT/eager", "plain bf16 export",
                "upcast µs (casts)", "upcast cost", "boundary µs (casts)", "boundary cost"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        def cost(p):
            return f"{r[p + '_us'] / r['ort_us'] - 1:+.1%}" if r.get(p + "_us") else "-"

        def us(p):
            return f"{r[p + '_us']:.0f} ({r[p + '_casts']})" if r.get(p + "_us") else "failed"

        t.add_row(r["model"], f"{r['eager_us']:.0f}", f"{r['ort_us']:.0f}",
                  f"{r['ort_us'] / r['eager_us']:.2f}", r["plain_bf16"], us("upcast"),
                  cost("upcast"), us("boundary"), cost("boundary"))
    Console().print(t)


if __name__ == "__main__":
    main()
