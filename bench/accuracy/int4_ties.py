"""Would a tie rule separate int4's near-ties from faults? (issue 50, item 7)

    python bench/accuracy/int4_ties.py --preset test

On the trained decoder (bench/accuracy/train_decoder.py), per teacher-forced miss of each
int4 file (optimize/int4.py's task harness: 32 steps from 4 built-in prompts), PyTorch
float32's own top-2 logit gap at that step against the int4 noise there: how much the top-2
difference of the same PyTorch model moves when its Linear weights are rounded as int4 RTN
does (symmetric, one scale per 32 weights along K). A miss whose gap is within that noise
(times 1 or 2) would count as a tie. The files: the clean RTN cells, and the tests' two
injected faults of the clean file (tests/optimize/test_int4.py: one 4-bit block of layer 0's
o_proj filled with 15, one block's scale 16x). Prints one row per file: strict agreement,
ties, tie-aware agreement, perplexity delta, and each miss's (gap, noise).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rtn_copy(model: Any, block: int = 32) -> Any:
    """A copy of ``model`` with every Linear weight rounded as symmetric int4 RTN."""
    import torch

    m = copy.deepcopy(model)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, torch.nn.Linear):
                w = mod.weight.data
                o, i = w.shape
                wp = torch.nn.functional.pad(w, (0, (-i) % block)).reshape(o, -1, block)
                scale = wp.abs().amax(-1, keepdim=True) / 7.0
                scale[scale == 0] = 1
                q = torch.clamp(torch.round(wp / scale), -8, 7)
                mod.weight.data = (q * scale).reshape(o, -1)[:, :i].contiguous()
    return m


def forced_logits(step: Any, past0: list[np.ndarray], prompts: list[list[int]],
                  tokens: list[list[int]]) -> list[list[np.ndarray]]:
    """Per prompt, the last-position logits at each teacher-forced step along ``tokens``."""
    out = []
    for p, toks in zip(prompts, tokens):
        logits, past = step(np.asarray([p], np.int64), past0)
        row = []
        for t in toks:
            row.append(logits[0, -1].astype(np.float64))
            logits, past = step(np.asarray([[t]], np.int64), past)
        out.append(row)
    return out


def gaps_and_noise(ref: list[list[np.ndarray]], sim: list[list[np.ndarray]]
                   ) -> tuple[np.ndarray, np.ndarray]:
    """PyTorch's top-2 gap per step, and how much int4 rounding moves that difference."""
    gaps, noise = [], []
    for rrow, srow in zip(ref, sim):
        g, n = [], []
        for r, s in zip(rrow, srow):
            t2, t1 = np.argsort(r)[-2:]
            g.append(r[t1] - r[t2])
            n.append(abs((r[t1] - r[t2]) - (s[t1] - s[t2])))
        gaps.append(g)
        noise.append(n)
    return np.asarray(gaps), np.asarray(noise)


# the tests' two injected faults (tests/optimize/test_int4.py): (MatMulNBits input, edit)
FAULTS: dict[str, tuple[int, Any]] = {
    "fault: corrupted block": (1, lambda a: a.__setitem__((0, 0, slice(None)), 0xFF)),
    "fault: scale x16": (2, lambda a: a.reshape(-1).__setitem__(0, a.reshape(-1)[0] * 16)),
}


def inject(clean: str, out: str, fault: str) -> str:
    """``clean`` with one of :data:`FAULTS` in its 4th MatMulNBits (layer 0's o_proj in a
    plain decoder step: input 1 its 4-bit blocks, input 2 its scales), saved at ``out``
    (external data beside it when ``clean`` has some); returns the node's name."""
    import onnx
    from onnx import numpy_helper

    which, fn = FAULTS[fault]
    m = onnx.load(clean)
    node = [n for n in m.graph.node if n.op_type == "MatMulNBits"][3]
    t = next(i for i in m.graph.initializer if i.name == node.input[which])
    a = numpy_helper.to_array(t).copy()
    fn(a)
    t.CopyFrom(numpy_helper.from_array(a, t.name))
    external = Path(clean).with_name(Path(clean).name + ".data").exists()
    onnx.save(m, out, save_as_external_data=external, location=Path(out).name + ".data")
    return node.name


def files(path: str, work: str) -> dict[str, str]:
    """The clean cells and the two injected faults of the clean file."""
    from onnxmedic.optimize import int4

    out = {}
    for b, a, head in ((32, 0, "fp32"), (32, 4, "int4"), (128, 4, "int4")):
        out[f"rtn-b{b}-a{a}-head{head}"] = p = os.path.join(work, f"b{b}a{a}{head}.onnx")
        int4.quantize_int4(path, p, b, a, head)
    for name in FAULTS:
        out[name] = os.path.join(work, f"{name}.onnx")
        inject(out["rtn-b32-a0-headfp32"], out[name], name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="test")
    ns = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from onnxmedic.genpackage import read_step
    from onnxmedic.optimize import int4

    td = _load("train_decoder", ROOT / "bench" / "accuracy" / "train_decoder.py")
    step = td.step_model(ns.preset)
    path = str(td.export_step(ns.preset, td.folder(ns.preset) / "step.onnx"))
    data = int4.builtin_data(step.tokenizer.encode)
    past0 = read_step(path).empty_past()
    ref = int4.score(int4.torch_step(step), past0, data, 32)
    gaps, noise = gaps_and_noise(
        forced_logits(int4.torch_step(step), past0, data.prompts, ref["tokens"]),
        forced_logits(int4.torch_step(rtn_copy(step)), past0, data.prompts, ref["tokens"]))
    print(f"preset {ns.preset}: PyTorch's median top-2 gap {np.median(gaps):.3f}; int4 RTN "
          f"noise on it: median {np.median(noise):.3f}, 90th percentile "
          f"{np.quantile(noise, 0.9):.3f}")
    with tempfile.TemporaryDirectory() as work:
        for name, p in files(path, work).items():
            got = int4.score_onnx(p, data, 32, ref["tokens"])
            j = int4.judge(ref, got, int4.DEFAULT_BUDGET)
            misses = [(gaps[i][k], noise[i][k]) for i, (r, g) in
                      enumerate(zip(ref["tokens"], got["picks"]))
                      for k, (a, b) in enumerate(zip(r, g)) if a != b]
            ties = {f: sum(g <= f * n for g, n in misses) for f in (1, 2)}
            print(f"{name}: agreement {j['agreement'] * 100:.1f} %, perplexity "
                  f"{(j['perplexity_ratio'] - 1) * 100:+.2f} %; tie-aware (x1) "
                  f"{(j['agreement'] + ties[1] / gaps.size) * 100:.1f} %, (x2) "
                  f"{(j['agreement'] + ties[2] / gaps.size) * 100:.1f} %; misses (gap, noise) "
                  + ", ".join(f"({g:.3f}, {n:.3f})" for g, n in misses))


if __name__ == "__main__":
    main()
