"""onnxmedic.export_pretrained against transformers.exporters (OnnxExporter, shipped with
transformers 5.x), task by task, on the same tiny checkpoint folders (tests/hf/checkpoints.py:
configs saved with save_pretrained, tokenizers trained here; no downloads).

For each task: does it export, and does the exported file compute what PyTorch computes?
onnxmedic: ``result.ok`` (its own verification: the example, further seeded input sets and
other sizes of each dynamic dim, within its float64-anchored budget). transformers.exporters
has no check of its own, so the same example inputs (the folder's tokenizer, through
onnxmedic.hf.tasks.example_inputs) are run through its ONNX Runtime runner, at the example's
batch and at batch 1 (its dims are dynamic), and compared with PyTorch output by output
(np.allclose, rtol 1e-3, atol 1e-4). sentence-similarity has no pooling in
transformers.exporters, so its plain model (last_hidden_state) is what is compared there.

    PYTHONPATH=src:. python bench/peers/hf_tasks.py --out bench/results/hf_tasks.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

# (checkpoint of tests/hf/checkpoints.py, task)
CASES = [("bert-base", "feature-extraction"), ("bert-base", "sentence-similarity"),
         ("bert", "fill-mask"), ("bert-cls", "text-classification"),
         ("bert-tok", "token-classification"), ("bert-qa", "question-answering"),
         ("bert-mc", "multiple-choice"), ("distilbert", "text-classification"),
         ("roberta", "fill-mask"), ("gpt2", "text-generation"),
         ("vit", "image-classification"), ("segformer", "image-segmentation"),
         ("wav2vec2", "audio-classification"), ("yolos", "object-detection"),
         ("clip", "zero-shot-image-classification")]
TOKENIZER = {"gpt2": "bpe", "vit": None, "segformer": None, "wav2vec2": None, "yolos": None}


def make_folder(root: Path, name: str) -> Path:
    from tests.hf import checkpoints

    folder = root / name
    if not folder.exists():
        checkpoints.save(folder, name, tok=TOKENIZER.get(name, "wordpiece"))
        if name == "segformer":
            (folder / "preprocessor_config.json").write_text(json.dumps(
                {"image_processor_type": "SegformerImageProcessor",
                 "size": {"height": 64, "width": 64}}))
    return folder


def ours(folder: Path, task: str, out: Path) -> dict[str, Any]:
    import onnxmedic

    t0 = time.perf_counter()
    res = onnxmedic.export_pretrained(folder, out, task=task)
    return {"ok": res.ok, "seconds": round(time.perf_counter() - t0, 1),
            "errors": [f.code for f in res.errors]}


def _inputs(folder: Path, task: str) -> tuple[Any, dict[str, torch.Tensor], list[str]]:
    import transformers

    from onnxmedic.hf import checkpoint, tasks

    ckpt = checkpoint.resolve(str(folder))
    model = getattr(transformers, tasks.auto_class(task, ckpt.config)).from_pretrained(
        folder).eval()
    tok = checkpoint.load_tokenizer(ckpt, False)
    ex = tasks.example_inputs(task, model, tok, None, checkpoint.preprocessor_config(ckpt))
    names = (["last_hidden_state"] if task == "sentence-similarity"
             else tasks.TaskModule(model, task).output_names)
    return model, ex.kwargs, names


def _matches(model: Any, exported: Any, kwargs: dict[str, torch.Tensor],
             names: list[str]) -> tuple[bool, float]:
    with torch.no_grad():
        want = model(**kwargs)
    got = exported(**kwargs)
    worst = 0.0
    ok = True
    for k in names:
        a, b = np.asarray(got[k].detach().cpu()), want[k].detach().numpy()
        if a.shape != b.shape:
            return False, float("inf")
        worst = max(worst, float(np.abs(a - b).max()))
        ok = ok and bool(np.allclose(a, b, rtol=1e-3, atol=1e-4))
    return ok, worst


def theirs(folder: Path, task: str) -> dict[str, Any]:
    from transformers.exporters import OnnxConfig, OnnxExporter

    model, kwargs, names = _inputs(folder, task)
    if task == "text-generation":
        kwargs = dict(kwargs, use_cache=False)
    t0 = time.perf_counter()
    try:
        exported = OnnxExporter().export(model, kwargs, OnnxConfig(dynamic=True))
    except Exception as e:
        return {"ok": False, "seconds": round(time.perf_counter() - t0, 1),
                "errors": [f"export: {type(e).__name__}: {str(e)[:160]}"]}
    seconds = round(time.perf_counter() - t0, 1)
    one = {k: (v[:1] if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    try:
        ok_full, err_full = _matches(model, exported, kwargs, names)
        ok_one, err_one = _matches(model, exported, one, names)
    except Exception as e:
        return {"ok": False, "seconds": seconds,
                "errors": [f"run: {type(e).__name__}: {str(e)[:160]}"]}
    return {"ok": ok_full and ok_one, "seconds": seconds,
            "max_abs": max(err_full, err_one),
            "errors": [] if ok_full and ok_one else
            [f"mismatch (max abs {max(err_full, err_one):.3g})"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the results there (JSON)")
    ap.add_argument("--only", nargs="*", help="checkpoint names to run")
    ns = ap.parse_args()
    logging.getLogger("torch").setLevel(logging.CRITICAL)
    import transformers

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, task in CASES:
            if ns.only and name not in ns.only:
                continue
            folder = make_folder(root, name)
            row = {"checkpoint": name, "task": task,
                   "onnxmedic": ours(folder, task, root / f"{name}-{task}.onnx"),
                   "transformers.exporters": theirs(folder, task)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {tool: sum(r[tool]["ok"] for r in rows)
               for tool in ("onnxmedic", "transformers.exporters")}
    result = {"command": "PYTHONPATH=src:. python bench/peers/hf_tasks.py",
              "date": time.strftime("%Y-%m-%d", time.gmtime()),
              "machine": platform.processor() or platform.machine(),
              "transformers": transformers.__version__, "torch": torch.__version__,
              "cases": len(rows), "verified": summary, "rows": rows}
    print(json.dumps(summary))
    if ns.out:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
