"""The PyTorch side of a generation package's verification (hf/gen_verify.py) on the 0.5 B
decoder, per prompt: greedy generation with each step's logits, and the float64 reference of
those logits; as before (a second forward pass over the prompt for the prefill's logits, a
float32 forward pass over the whole sequence beside the reference) and now (the prefill's
logits from generate's own first call; the reference alone). Seconds (median of 3) and the
largest difference between the two ways' logits and references.

    python bench/peers/generation_torch_side.py [--model /work/coord/models/qwen2-0.5b]

About a minute and 4 GiB: run it through the shared lock.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from onnxmedic.hf import gen_verify  # noqa: E402
from onnxmedic.inputs import Inputs  # noqa: E402
from onnxmedic.verify.reference import reference_outputs  # noqa: E402


def before_generation(model, ids, steps):  # the prefill's logits from a second pass
    x = torch.tensor([ids])
    mask = torch.ones_like(x)
    with torch.no_grad():
        out = model.generate(x, attention_mask=mask,
                             generation_config=gen_verify.neutral_config(model, steps))
        prefill = model(input_ids=x, attention_mask=mask, use_cache=False).logits
    return (out.sequences[0, len(ids):].tolist(),
            [prefill.float().numpy()] + [lg[:, None, :].float().numpy() for lg in out.logits[1:]])


def before_reference(model, ids, tokens, expected):  # a float32 pass beside the reference
    seq = torch.tensor([ids + tokens[:-1]])
    wrapped = gen_verify.Logits(model).eval()
    with torch.no_grad():
        full = wrapped(seq).float().numpy()
    whole = reference_outputs(wrapped, [Inputs(args=(seq,))], [[full]]).outputs[0][0]
    n = len(ids)
    return [whole[:, :n]] + [whole[:, n + k - 1:n + k] for k in range(1, len(expected))]


def timed(fn, *args):
    times, out = [], None
    for _ in range(3):
        t0 = time.perf_counter()
        out = fn(*args)
        times.append(time.perf_counter() - t0)
    return sorted(times)[1], out


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/work/coord/models/qwen2-0.5b")
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    model = AutoModelForCausalLM.from_pretrained(a.model).eval()
    tok = AutoTokenizer.from_pretrained(a.model)
    for p, ids in enumerate(gen_verify.prompt_ids(tok, None, model.config.vocab_size)):
        tb, (tokens_b, logits_b) = timed(before_generation, model, ids, a.steps)
        ta, (tokens_a, logits_a) = timed(gen_verify.torch_generation, model, ids, a.steps)
        rb, refs_b = timed(before_reference, model, ids, tokens_b, logits_b)
        ra, refs_a = timed(lambda *prompt: gen_verify.references(model, [prompt])[0], ids,
                           tokens_a, logits_a)
        dl = max(float(np.abs(x - y).max()) for x, y in zip(logits_a, logits_b))
        dr = max(float(np.abs(x - y).max()) for x, y in zip(refs_a, refs_b))
        print(f"| {p} | {len(ids)} | {tb:.2f} | {ta:.2f} | {rb:.2f} | {ra:.2f} | "
              f"{tokens_a == tokens_b} | {dl:.2g} | {dr:.2g} |", flush=True)


if __name__ == "__main__":
    main()
