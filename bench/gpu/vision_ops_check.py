"""The CPU reference kernels of bench/zoo/torchvision_cpu.py against torchvision's real ops.

On a machine where torchvision's own extension loads (CUDA torch + torchvision + timm), compares
each reference kernel (nms, roi_align, roi_pool, ps_roi_align, ps_roi_pool, deform_conv2d) with
torchvision's op on CPU and, when there is one, CUDA, on random and edge-case inputs (no boxes,
identical boxes, equal scores, boxes outside the image, degenerate RoIs), and onnxmedic's ONNX
translations (ONNX Runtime CPU) with the real ops. Writes $OUT/vision_ops_check.json.

    OUT=build/out python bench/gpu/vision_ops_check.py
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import torch  # noqa: E402

from bench.zoo import torchvision_cpu as tvc  # noqa: E402


def _boxes(n: int, g: torch.Generator, scale: float = 60.0) -> torch.Tensor:
    xy = torch.rand(n, 2, generator=g) * scale - 5
    wh = torch.rand(n, 2, generator=g) * scale / 3 + 0.2
    return torch.cat([xy, xy + wh], 1)


def nms_cases() -> list[tuple[str, tuple[Any, ...]]]:
    g = torch.Generator().manual_seed(0)
    big = _boxes(2000, g, 400.0)
    same = torch.tensor([[1.0, 2.0, 11.0, 12.0]]).repeat(6, 1)
    ties = torch.tensor([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30], [0, 0, 10, 10.5]])
    out = [("random200", (_boxes(200, g), torch.rand(200, generator=g), 0.5)),
           ("random2000", (big, torch.rand(2000, generator=g), 0.7)),
           ("empty", (torch.zeros(0, 4), torch.zeros(0), 0.5)),
           ("identical", (same, torch.rand(6, generator=g), 0.5)),
           ("equal_scores", (ties, torch.ones(4), 0.3)),
           ("iou_at_threshold", (torch.tensor([[0, 0, 10, 10], [0, 0, 10, 5.0]]),
                                 torch.tensor([0.9, 0.8]), 0.5)),
           ("quantised_scores", (_boxes(300, g), (torch.rand(300, generator=g) * 8).round() / 8,
                                 0.5))]
    return out


def roi_cases() -> list[tuple[str, tuple[Any, ...]]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, 20, 24, generator=g)
    rois = torch.tensor([[0, 2, 2, 20, 14], [1, -6, -4, 9, 7], [0, 30, 10, 50, 36],
                         [1, 28, 18, 30, 22], [0, 60, 60, 80, 70], [1, 5, 5, 5, 9],
                         [0, 12, 8, 4, 2], [1, 0, 0, 48, 40], [0, 3.3, 4.7, 17.2, 9.9]])
    rnd = torch.cat([torch.randint(0, 2, (40, 1), generator=g).float(), _boxes(40, g, 48.0)], 1)
    return [("edges", (x, rois)), ("random", (x, rnd)), ("none", (x, rois[:0]))]


def _compare(a: Any, b: Any) -> dict[str, Any]:
    a = a[0] if isinstance(a, (tuple, list)) else a
    b = b[0] if isinstance(b, (tuple, list)) else b
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.shape != b.shape:
        return {"ok": False, "why": f"shape {tuple(a.shape)} vs {tuple(b.shape)}"}
    if a.dtype in (torch.int64, torch.int32):
        return {"ok": bool(torch.equal(a, b)), "n": a.numel()}
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return {"ok": False, "why": f"NaN at {int((nan_a ^ nan_b).sum())} elements on one side"}
    a, b = a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0)  # NaN where both are NaN: equal
    err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    return {"ok": err <= 1e-4 * max(1.0, b.abs().max().item() if b.numel() else 1.0),
            "max_abs": err, "nan": int(nan_a.sum())}


def run_op(name: str, args: tuple[Any, ...], extra: tuple[Any, ...], devices: list[str]
           ) -> list[dict[str, Any]]:
    rows = []
    ref = tvc.REFERENCE[name](*args, *extra)
    real = getattr(torch.ops.torchvision, name)
    for dev in devices:
        row: dict[str, Any] = {"op": name, "device": dev, "extra": repr(extra)}
        try:
            moved = tuple(a.to(dev) if isinstance(a, torch.Tensor) else a for a in args)
            row.update(_compare(ref, real(*moved, *extra)))
        except Exception as e:  # one failing case never stops the others
            row.update(ok=False, why=f"{type(e).__name__}: {e}"[:400])
        rows.append(row)
    return rows


def deform_cases() -> list[tuple[str, tuple[Any, ...], tuple[Any, ...]]]:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 9, 11, generator=g)
    w = torch.randn(6, 2, 3, 3, generator=g)
    off = torch.randn(2, 36, 5, 6, generator=g) * 4
    mask = torch.rand(2, 18, 5, 6, generator=g)
    bias = torch.randn(6, generator=g)
    return [("mask", (x, w, off, mask, bias), (2, 2, 1, 1, 1, 1, 2, 2, True)),
            ("nomask", (x, w, off, mask, bias), (1, 2, 0, 1, 2, 1, 2, 2, False))]


def onnx_rows() -> list[dict[str, Any]]:
    """onnxmedic's translations (ONNX Runtime CPU) against the real ops on CPU."""
    from onnxmedic.ops.testing import check_call

    tv = torch.ops.torchvision
    calls = [("nms", lambda b, s: tv.nms(b, s, 0.5), nms_cases()[0][1][:2]),
             ("roi_align", lambda x, r: tv.roi_align(x, r, 0.5, 3, 4, -1, False),
              roi_cases()[0][1]),
             ("roi_align_aligned", lambda x, r: tv.roi_align(x, r, 0.5, 3, 4, 2, True),
              roi_cases()[0][1]),
             ("roi_pool", lambda x, r: tv.roi_pool(x, r, 0.5, 3, 4)[0], roi_cases()[0][1])]
    rows = []
    for name, fn, args in calls:
        res = check_call(fn, args)
        rows.append({"op": name, "onnx": res.stage, "error": res.error[:300]})
    return rows


def main() -> int:
    warnings.simplefilter("ignore")
    how = tvc.install()
    out_dir = Path(os.environ.get("OUT", "build/vision_ops_check"))
    out_dir.mkdir(parents=True, exist_ok=True)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    t0 = time.time()
    rows: list[dict[str, Any]] = []
    for case, args in nms_cases():
        for r in run_op("nms", args[:2], (args[2],), devices):
            rows.append({"case": case, **r})
    for case, args in roi_cases():
        for extra_ra in [(0.5, 3, 4, -1, False), (0.5, 3, 4, 2, True), (0.25, 2, 2, 1, False)]:
            rows += [{"case": case, **r} for r in run_op("roi_align", args, extra_ra, devices)]
        rows += [{"case": case, **r} for r in run_op("roi_pool", args, (0.5, 3, 4), devices)]
        rows += [{"case": case, **r}
                 for r in run_op("ps_roi_align", args, (0.5, 2, 2, 2), devices)]
        rows += [{"case": case, **r}
                 for r in run_op("ps_roi_align", args, (0.5, 2, 2, -1), devices)]
        rows += [{"case": case, **r} for r in run_op("ps_roi_pool", args, (0.5, 2, 2), devices)]
    for case, args, extra in deform_cases():
        rows += [{"case": case, **r} for r in run_op("deform_conv2d", args, extra, devices)]
    try:
        onnx = onnx_rows()
    except Exception:
        onnx = [{"error": traceback.format_exc()[-1500:]}]
    result = {"install": how, "real_ops": tvc.real_ops(), "devices": devices,
              "torch": torch.__version__, "seconds": round(time.time() - t0, 1),
              "failed": [r for r in rows if not r.get("ok")], "rows": rows, "onnx": onnx}
    (out_dir / "vision_ops_check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1)[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
