"""Benchmark for issue 17: onnxmedic optimize against its peers, same run, one table.

    PYTHONPATH=src python bench/optimize.py [--models bert,gpt2,resnet50,...] [--threads 2]

Columns per model: PyTorch eager; the plain torch.onnx.export (dynamo=True); ONNX Runtime's
transformers optimizer on the same export (model types it knows); blind quantize_dynamic on the
same export; onnxmedic optimize fp32 and int8. Every ONNX variant is timed with the same sandbox
timer (alternating rounds, medians, 2 intra-op threads) and judged on the same input sets as
onnxmedic's own candidates (fp32: the float32 comparison; int8: cosine >= 0.999 per output).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from onnxmedic import inputs as inputs_mod
from onnxmedic import sandbox
from onnxmedic.optimize import judge_reduced, optimize, reference_sets, time_variants


def bert() -> tuple[Any, tuple[Any, ...], str | None]:
    from transformers import BertConfig, BertModel

    m = BertModel(BertConfig()).eval()
    return m, (torch.randint(0, 30000, (1, 128)),), "bert"


def gpt2() -> tuple[Any, tuple[Any, ...], str | None]:
    from transformers import GPT2Config, GPT2Model

    m = GPT2Model(GPT2Config(use_cache=False)).eval()
    return m, (torch.randint(0, 50000, (1, 128)),), "gpt2"


def resnet50() -> tuple[Any, tuple[Any, ...], str | None]:
    from transformers import ResNetConfig, ResNetModel

    m = ResNetModel(ResNetConfig()).eval()
    return m, (torch.randn(1, 3, 224, 224),), None


def vit() -> tuple[Any, tuple[Any, ...], str | None]:
    from transformers import ViTConfig, ViTModel

    m = ViTModel(ViTConfig()).eval()
    return m, (torch.randn(1, 3, 224, 224),), "vit"


MODELS = {"bert": bert, "gpt2": gpt2, "resnet50": resnet50, "vit": vit}


class _Wrap(torch.nn.Module):
    def __init__(self, m: Any) -> None:
        super().__init__()
        self.m = m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.m(x).last_hidden_state


def _eager_ms(model: Any, args: tuple[Any, ...], threads: int, n: int = 10) -> float:
    torch.set_num_threads(threads)
    with torch.no_grad():
        for _ in range(3):
            model(*args)
        t = []
        for _ in range(n):
            s = time.perf_counter()
            model(*args)
            t.append((time.perf_counter() - s) * 1000)
    return statistics.median(t)


def run_one(name: str, threads: int, folder: Path) -> list[dict[str, Any]]:
    raw, args, ort_type = MODELS[name]()
    model = _Wrap(raw).eval()
    plain = folder / f"{name}.onnx"
    torch.onnx.export(model, args, str(plain), dynamo=True, verbose=False)
    feeds, expected, _, _ = reference_sets(plain, model, inputs_mod.Inputs(args))
    rows: list[dict[str, Any]] = [{"variant": "pytorch eager",
                                   "ms": _eager_ms(model, args, threads), "verified": "-"}]
    paths = {"plain export": plain}
    if ort_type:
        from onnxruntime.transformers.optimizer import optimize_model

        opt = optimize_model(str(plain), model_type=ort_type, opt_level=1)
        opt.save_model_to_file(str(folder / f"{name}-ortopt.onnx"))
        paths["ORT transformers optimizer"] = folder / f"{name}-ortopt.onnx"
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(plain), str(folder / f"{name}-q.onnx"), weight_type=QuantType.QInt8)
    paths["blind quantize_dynamic"] = folder / f"{name}-q.onnx"
    for prec in ("fp32", "int8"):
        out = folder / f"{name}-om-{prec}.onnx"
        t0 = time.perf_counter()
        res = optimize(plain, model, args, out=out, precision=prec, threads=threads)
        paths[f"onnxmedic optimize {prec} ({res.chosen})"] = out
        print(f"  {name} optimize {prec}: {res.message} [{time.perf_counter() - t0:.0f} s]",
              file=sys.stderr)
    times = time_variants(paths, feeds[0], threads=threads, repeats=10, rounds=3)
    for label, path in paths.items():
        sbx = sandbox.run_model(path, feeds)
        if not sbx.ok:
            ver = f"no ({sbx.status})"
        else:
            ok, acc, why = judge_reduced([f"o{i}" for i in range(9)], expected, sbx.outputs)
            cos = min(m["cosine"] for m in acc.values())
            ver = f"{'yes' if ok else 'no'} (cos {cos:.5f})"
        rows.append({"variant": label, "ms": times.get(label, (float("nan"),))[0],
                     "verified": ver})
    base = next(r["ms"] for r in rows if r["variant"] == "plain export")
    for r in rows:
        r["model"] = name
        r["speedup"] = base / r["ms"] if r["ms"] == r["ms"] else float("nan")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="bert,gpt2,resnet50")
    ap.add_argument("--threads", type=int, default=2)
    ns = ap.parse_args()
    print(f"{'model':10} {'variant':48} {'median ms':>10} {'vs plain':>9}  verified (accuracy)")
    for name in ns.models.split(","):
        with tempfile.TemporaryDirectory(prefix="onnxmedic-bench-opt-") as tmp:
            try:
                rows = run_one(name, ns.threads, Path(tmp))
            except Exception as e:  # noqa: BLE001 - report and go on with the next model
                print(f"{name:10} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
        for r in rows:
            print(f"{r['model']:10} {r['variant']:48} {r['ms']:10.2f} {r['speedup']:8.2f}x  "
                  f"{r['verified']}", flush=True)


if __name__ == "__main__":
    main()
