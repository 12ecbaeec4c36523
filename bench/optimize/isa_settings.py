"""What the portable int8 settings cost and keep (issue 38): the two test models that failed on
an AVX2 EPYC, quantized with full 8-bit u8s8, 7-bit weights (reduce_range) and u8u8, run
natively and under ``qemu-x86_64 -cpu Haswell`` (AVX2, no VNNI).

    PYTHONPATH=src python bench/optimize/isa_settings.py [--md bench/results/isa_settings.md]

Models: ``PaddedMHA`` of tests/optimize/test_optimize.py (nn.MultiheadAttention(16, 2),
input 2x5x16, seed 0) with quantize_dynamic (per tensor and per channel), and the ReLU CNN of
tests/optimize/test_static_int8.py (three Conv2d, input 1x3x24x24, seed 0) with quantize_static
(QDQ, per channel, MinMax on 4 random sets). Score: cosine of the output against the float32
file's, natively (over the finite values: the fully masked rows are NaN in ORT's float run).
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch

QEMU_CPU = "Haswell-noTSX,-pcid,-x2apic,-tsc-deadline,-invpcid"
RUNNER = """
import sys, numpy as np, onnxruntime as ort
feeds = dict(np.load(sys.argv[1]))
outs = []
for p in sys.argv[3:]:
    s = ort.InferenceSession(p, providers=["CPUExecutionProvider"])
    outs.append(s.run(None, {i.name: feeds[i.name] for i in s.get_inputs()})[0])
np.savez(sys.argv[2], *outs)
"""


class PaddedMHA(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.mha(x, x, x, key_padding_mask=pad, need_weights=False)[0]


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    k = np.isfinite(a) & np.isfinite(b)
    a, b = a[k], b[k]
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _models(tmp: Path) -> dict[str, tuple[list[Path], Path]]:
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    from onnxmedic.optimize.passes import feed_reader

    torch.manual_seed(0)
    mha = PaddedMHA().eval()
    x, pad = torch.randn(2, 5, 16), torch.zeros(2, 5, dtype=torch.bool)
    pad[0] = True
    torch.onnx.export(mha, (x, pad), str(tmp / "mha.onnx"), dynamo=True, verbose=False)
    np.savez(tmp / "mha.npz", x=x.numpy(), pad=pad.numpy())
    torch.manual_seed(0)
    cnn = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Conv2d(16, 8, 1)).eval()
    xc = torch.randn(1, 3, 24, 24)
    torch.onnx.export(cnn, (xc,), str(tmp / "cnn.onnx"), dynamo=True, verbose=False)
    name = onnx.load(str(tmp / "cnn.onnx")).graph.input[0].name
    np.savez(tmp / "cnn.npz", **{name: xc.numpy()})
    gen = torch.Generator().manual_seed(1)
    cal = [{name: torch.randn(1, 3, 24, 24, generator=gen).numpy()} for _ in range(4)]
    settings = {"full 8-bit u8s8": {}, "7-bit (reduce_range)": {"reduce_range": True},
                "u8u8": {"weight_type": QuantType.QUInt8}}
    out: dict[str, tuple[list[Path], Path]] = {}
    for pc in (False, True):
        row = f"PaddedMHA, quantize_dynamic {'per channel' if pc else 'per tensor'}"
        paths = [tmp / "mha.onnx"]
        for i, kw in enumerate(settings.values()):
            p = tmp / f"mha-{pc}-{i}.onnx"
            quantize_dynamic(tmp / "mha.onnx", p, op_types_to_quantize=["MatMul", "Gemm"],
                             per_channel=pc, **{"weight_type": QuantType.QInt8, **kw})
            paths.append(p)
        out[row] = (paths, tmp / "mha.npz")
    paths = [tmp / "cnn.onnx"]
    for i, kw in enumerate(settings.values()):
        p = tmp / f"cnn-{i}.onnx"
        quantize_static(tmp / "cnn.onnx", p, feed_reader(cal), quant_format=QuantFormat.QDQ,
                        per_channel=True, calibrate_method=CalibrationMethod.MinMax,
                        **{"weight_type": QuantType.QInt8,
                           "activation_type": QuantType.QUInt8, **kw})
        paths.append(p)
    out["ReLU CNN, quantize_static QDQ per channel"] = (paths, tmp / "cnn.npz")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--md", default="bench/results/isa_settings.md")
    ns = ap.parse_args()
    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        sys.exit("needs qemu-x86_64 (apt-get install qemu-user)")
    tmp = Path(tempfile.mkdtemp(prefix="isa-settings-"))
    lines = []
    try:
        (tmp / "runner.py").write_text(RUNNER)
        for row, (paths, feeds) in _models(tmp).items():
            got = {}
            for how, prefix in (("native", []), ("haswell", [qemu, "-cpu", QEMU_CPU])):
                npz = tmp / f"{how}.npz"
                subprocess.run(prefix + [sys.executable, str(tmp / "runner.py"), str(feeds),
                                         str(npz), *map(str, paths)], check=True)
                z = np.load(npz)
                got[how] = [z[f"arr_{i}"] for i in range(len(paths))]
            ref = got["native"][0]
            cells = [f"{_cos(got['native'][i], ref):.6f} / {_cos(got['haswell'][i], ref):.6f}"
                     for i in range(1, len(paths))]
            lines.append(f"| {row} | " + " | ".join(cells) + " |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    import onnxruntime as ort

    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), "?")
    text = "\n".join([f"`PYTHONPATH=src python bench/optimize/isa_settings.py` - {when} - {cpu},"
                      f" ONNX Runtime {ort.__version__}; cosine native / QEMU Haswell", "",
                      "| model | full 8-bit u8s8 | 7-bit (reduce_range) | u8u8 |",
                      "|---|---|---|---|", *lines]) + "\n"
    Path(ns.md).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
