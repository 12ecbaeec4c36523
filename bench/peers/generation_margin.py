"""The greedy picks' margin of generation_scale.py's random checkpoints, and what int4 does to
them, on a few-layer checkpoint (so that a bench init is chosen by measurement before a full
run): float32 logits along greedy sequences from the task budget's prompts (4 prompts, 32
steps each, teacher-forced), against the same model with every Linear's weight rounded to
symmetric 4-bit blocks of 32 along K and its inputs to int8 blocks of 32 (MatMulNBits at
accuracy level 4, the int4 road's layout; the sequences are the int4 model's own, as the task
budget's are the int4 decoder's).

    python bench/peers/generation_margin.py --shape llama-3.1-8b --layers 2 --init scaled
        [--embed-norm 4.9] [--root /tmp/lane75/probe]

Prints one JSON line: the greedy agreement, the share of picks that are the input token, the
perplexity of the built-in text (float32) and int4's ratio to it, the top-2 gap's 5th
percentile and median (logits, and in deviations of the position's logits), the distinct
tokens picked. Memory: the model in float32 (llama-3.1-8b at 2 layers: ~12 GiB peak).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

BLOCK = 32


def q4(w: Any) -> Any:
    """``w`` [N, K] rounded to symmetric 4-bit blocks of BLOCK along K (ONNX Runtime's
    blockwise quantizer: the block's largest magnitude maps to -8)."""
    import torch

    n, k = w.shape
    b = w.reshape(n, k // BLOCK, BLOCK)
    mx = torch.gather(b, -1, b.abs().argmax(-1, keepdim=True))
    sc = mx / -8
    sc = torch.where(sc == 0, torch.ones_like(sc), sc)
    return (torch.clamp(torch.round(b / sc), -8, 7) * sc).reshape(n, k)


def q8_input(mod: Any, inp: tuple[Any, ...]) -> Any:
    """A Linear's input rounded to symmetric int8 blocks of BLOCK (a forward pre-hook)."""
    import torch

    x = inp[0]
    s = x.shape
    b = x.reshape(*s[:-1], s[-1] // BLOCK, BLOCK)
    sc = b.abs().amax(-1, keepdim=True) / 127
    sc = torch.where(sc == 0, torch.ones_like(sc), sc)
    return (torch.round(b / sc) * sc).reshape(s)


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    import bench.peers.generation_scale as gs
    from onnxmedic.hf.transforms.stream_int4 import task_data, windows
    from onnxmedic.optimize.int4 import mean_nll

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(gs.SHAPES), required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--init", choices=gs.INITS, default="scaled")
    ap.add_argument("--embed-norm", type=float, default=gs.EMBED_NORM)
    ap.add_argument("--root", default="/tmp/generation_margin")
    a = ap.parse_args()
    gs.EMBED_NORM = a.embed_norm
    t0 = time.time()
    ck = gs.make_checkpoint(a.shape, Path(a.root), a.layers, init=a.init)
    m = AutoModelForCausalLM.from_pretrained(str(ck), dtype=torch.float32).eval()
    data = task_data(ck, 4, int(m.config.vocab_size))
    lins = [mod for mod in m.modules() if isinstance(mod, torch.nn.Linear)]
    orig = {id(lin): lin.weight.data.to(torch.bfloat16) for lin in lins}  # the checkpoint's

    def logits_of(seqs: list[list[int]]) -> list[Any]:
        with torch.no_grad():
            return [m(torch.tensor([s])).logits[0].float() for s in seqs]

    wins = windows(data.text)

    def perplexity(seq_logits: list[Any]) -> float:
        by = {tuple(w[:-1]): x.unsqueeze(0).numpy() for w, x in zip(wins, seq_logits)}
        nll, n = mean_nll(lambda ids, past: (by[tuple(int(i) for i in ids[0])], past), [],
                          data.text)
        return float(np.exp(nll / n))

    hooks = [lin.register_forward_pre_hook(q8_input) for lin in lins]
    for lin in lins:
        lin.weight.data = q4(lin.weight.data)
    seqs = []
    with torch.no_grad():
        for p in data.prompts:
            ids = list(p)
            for _ in range(32):
                ids.append(int(m(torch.tensor([ids])).logits[0, -1].argmax()))
            seqs.append(ids)
    ppl_q = perplexity(logits_of([w[:-1] for w in wins]))
    for h in hooks:
        h.remove()
    for lin in lins:
        lin.weight.data = orig[id(lin)].float()
    ref = logits_of([s[:-1] for s in seqs])
    ppl_f = perplexity(logits_of([w[:-1] for w in wins]))
    agree = same_input = n = 0
    gaps, rel = [], []
    for p, s, x in zip(data.prompts, seqs, ref):
        for k in range(32):
            row = x[len(p) - 1 + k]
            top = torch.topk(row, 2).values
            gaps.append(float(top[0] - top[1]))
            rel.append(float((top[0] - top[1]) / row.std()))
            pick = int(row.argmax())
            n += 1
            agree += pick == s[len(p) + k]
            same_input += pick == s[len(p) - 1 + k]
    print(json.dumps({
        "checkpoint": ck.name, "embed_norm": a.embed_norm, "hidden": m.config.hidden_size,
        "agreement": agree / n, "pick_is_input": same_input / n, "perplexity": ppl_f,
        "int4_perplexity_ratio": ppl_q / ppl_f,
        "gap_p5_p50": [float(np.percentile(gaps, 5)), float(np.median(gaps))],
        "gap_over_std_p5_p50": [float(np.percentile(rel, 5)), float(np.median(rel))],
        "distinct_picks": len({t for s in seqs for t in s[-32:]}),
        "seconds": round(time.time() - t0)}))


if __name__ == "__main__":
    main()
