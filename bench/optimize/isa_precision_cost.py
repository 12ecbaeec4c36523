"""What ONNX Runtime's session.x64quantprecision=1 (isa.PRECISION_CONFIG) costs on this CPU:
BERT-base (random weights, seq 128, batch 1) exported, quantized as `optimize --precision int8`
does for `--target cpu` (quantize_dynamic, 7-bit weights) and as a file users bring (full
8-bit weights), each timed with and without the setting (alternating rounds, median ms, 1
intra-op thread) - and the largest output difference between the two sessions.

    PYTHONPATH=src python bench/optimize/isa_precision_cost.py [--rounds 5] [--runs 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from optimize import bert  # noqa: E402

from onnxmedic import isa  # noqa: E402
from onnxmedic.optimize import passes  # noqa: E402


def session(path: Path, precise: bool) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    if precise:
        for k, v in isa.PRECISION_CONFIG.items():
            opts.add_session_config_entry(k, v)
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def timed(sess: ort.InferenceSession, feed: dict[str, np.ndarray], runs: int) -> float:
    sess.run(None, feed)
    t = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, feed)
        t.append(time.perf_counter() - t0)
    return statistics.median(t) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=20)
    a = ap.parse_args()
    torch.manual_seed(0)
    model, args, _ = bert()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "bert.onnx"
        torch.onnx.export(model, args, str(src), dynamo=True, verbose=False,
                          external_data=False)
        files = {"fp32": src}
        for name, rr in (("int8 7-bit (--target cpu)", True), ("int8 8-bit (user file)", False)):
            out = Path(tmp) / f"{rr}.onnx"
            passes.quantize_int8(str(src), str(out), reduce_range=rr)
            files[name] = out
        feed = {ort.InferenceSession(str(src)).get_inputs()[0].name: args[0].numpy()}
        print(f"ONNX Runtime {ort.__version__}, instruction set {isa.present_isa()}, "
              f"{a.rounds} rounds x {a.runs} runs, 1 thread")
        print("| file | default ms | x64quantprecision=1 ms | ratio | max abs diff |")
        print("|---|---|---|---|---|")
        for name, path in files.items():
            ms: dict[bool, list[float]] = {False: [], True: []}
            sessions = {p: session(path, p) for p in (False, True)}
            for _ in range(a.rounds):
                for p in (False, True):
                    ms[p].append(timed(sessions[p], feed, a.runs))
            d, q = statistics.median(ms[False]), statistics.median(ms[True])
            diff = float(np.abs(sessions[False].run(None, feed)[0]
                                - sessions[True].run(None, feed)[0]).max())
            print(f"| {name} | {d:.1f} | {q:.1f} | {q / d:.2f}x | {diff:.3g} |")


if __name__ == "__main__":
    main()
