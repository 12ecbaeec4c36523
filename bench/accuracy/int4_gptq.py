"""GPTQ against RTN on the trained decoder, cell by cell (optimize/int4_gptq.py, issue 40).

    python bench/accuracy/int4_gptq.py --preset figures

For each (block, accuracy_level 0, LM head int4) cell, the RTN file (ONNX Runtime's
MatMulNBitsQuantizer) and the GPTQ file calibrated on bench/peers/int4.py's TEXT (the last six
standard-library modules by name, not trained on; its last quarter held out) are scored by
optimize/int4.py's task harness against PyTorch float32: perplexity delta on the built-in text
and on the held-out TEXT, greedy agreement teacher-forced and free-running over 32 steps from
4 prompts, and PyTorch's top-2 logit gap at each prompt's first divergence.
Results: bench/results/int4_gptq.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import math
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(preset: str, blocks: list[int]) -> list[str]:
    """The table's rows, one per (block, algorithm)."""
    from onnxmedic.genpackage import read_step
    from onnxmedic.optimize import int4, int4_text

    td = _load("train_decoder", ROOT / "bench" / "accuracy" / "train_decoder.py")
    peers = _load("int4_peers", ROOT / "bench" / "peers" / "int4.py")
    step, folder = td.step_model(preset), td.folder(preset)
    path = str(td.export_step(preset, folder / "step.onnx"))
    data = int4.builtin_data(step.tokenizer.encode)
    past0, ts = read_step(path).empty_past(), int4.torch_step(step)
    ref = int4.score(ts, past0, data, 32)
    user = int4_text.load_user_text(peers.calibration_text(folder), step.tokenizer, folder)
    nll, n = int4.mean_nll(ts, past0, user.held)
    user_ref = math.exp(nll / n)
    margins = int4_text.reference_margins(ts, past0, data.prompts, ref["tokens"])
    rows = [f"PyTorch float32: perplexity {ref['perplexity']:.4g} (built-in), {user_ref:.4g} "
            f"(TEXT: {user.describe()}); median top-2 logit gap "
            f"{int4_text.median_margin(margins):.3g}", "",
            "| cell | algorithm | quantize s | perplexity delta | on TEXT | teacher-forced | "
            "free-running | gap at first divergence |", "|---|---|---|---|---|---|---|---|"]
    for block in blocks:
        for algo in ("rtn", "gptq"):
            out = str(folder / f"cmp_{algo}_{block}.onnx")
            t = time.perf_counter()
            int4.quantize_int4(path, out, block, 0, "int4", algo=algo,
                               calibration=user.windows_path if algo == "gptq" else None)
            secs = time.perf_counter() - t
            j = int4.judge(ref, int4.score_onnx(out, data, 32, ref["tokens"]),
                           int4.DEFAULT_BUDGET)
            mine = int4.score_onnx(out, int4.TaskData([], user.held), 0, [])["perplexity"]
            gaps = int4_text.divergence_margins(margins, j["first_divergence"])
            rows.append(f"| b{block} a0 head int4 | {algo.upper()} | {secs:.1f} | "
                        f"{(j['perplexity_ratio'] - 1) * 100:+.2f} % | "
                        f"{(mine / user_ref - 1) * 100:+.2f} % | {j['agreement'] * 100:.1f} % | "
                        f"{j['free_agreement'] * 100:.1f} % | "
                        f"{', '.join('-' if g is None else f'{g:.2g}' for g in gaps)} |")
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="figures")
    ap.add_argument("--blocks", default="32,64,128")
    ns = ap.parse_args()
    rows = run(ns.preset, [int(b) for b in ns.blocks.split(",")])
    cpu = next((ln.split(":", 1)[1].strip() for ln in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines()
        if ln.startswith("Model name")), platform.processor())
    head = (f"`python bench/accuracy/int4_gptq.py --preset {ns.preset} --blocks {ns.blocks}` - "
            f"{datetime.date.today()} - {cpu}, {os.cpu_count()} cores, ONNX Runtime CPU")
    out = ROOT / "bench" / "results" / "int4_gptq.md"
    old = out.read_text() if out.exists() else ""
    keep = "\n\n".join(p for p in old.split("\n\n\n") if p and f"--preset {ns.preset} " not in p)
    out.write_text("\n\n\n".join(filter(None, [keep, "\n".join([head, "", *rows])])) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
