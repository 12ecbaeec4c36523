"""An encoder-decoder package verified as it is used (the machinery of hf/gen_verify.py): for
each input (a text through the tokenizer, or a waveform through the feature extractor),
ONNX Runtime runs the encoder graph once and the decoder graph step by step, fed its own
self-attention cache and the encoder's cross-attention cache, in the sandbox; its greedy
tokens must be PyTorch's ``generate(do_sample=False)``'s, each step's logits within the
float64 budget.

The encoder's outputs (its hidden states and the cross-attention cache) are judged first: a
wrong cross-attention cache makes every decoder step wrong although the decoder graph is
right, so it is named where it is (OM823, localised in the encoder graph). A failing decoder
step is named and localised like the decoder-only case's (OM811 / OM812, OM610).
"""

from __future__ import annotations

import functools
import json
import logging
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from onnxmedic import sandbox
from onnxmedic.findings import error
from onnxmedic.genpackage import StepLayout, parse_cache_name, read_step
from onnxmedic.hf import gen_verify
from onnxmedic.hf.gen_verify import GenerationCheck, Judged, TorchRun, judge_items
from onnxmedic.hf.seq2seq_modules import (
    DECODER,
    ENCODER,
    TEXTS,
    EncoderWithCross,
    encoder_inputs,
    main_input,
    no_start_token,
    start_token,
)
from onnxmedic.inputs import Inputs
from onnxmedic.verify.budget import judge_output
from onnxmedic.verify.reference import reference_outputs

logger = logging.getLogger(__name__)

STAGE = gen_verify.STAGE


def torch_generation(model: Any, enc: dict[str, torch.Tensor], steps: int, start: int
                     ) -> tuple[list[int], list[np.ndarray]]:
    """PyTorch's greedy tokens (GenerationMixin.generate: plain greedy search, also for
    Whisper, whose own generate() adds language and timestamp logic) and each step's logits
    ([1, 1, vocab])."""
    from transformers import GenerationMixin

    return gen_verify.greedy(model, 1, steps, GenerationMixin.generate, model, start=start,
                             **enc, decoder_input_ids=torch.tensor([[start]]))


def reference_steps(model: Any, enc: dict[str, torch.Tensor], start: int, tokens: list[int],
                    expected: list[np.ndarray]) -> list[np.ndarray | None]:
    """Each step's float64 reference logits, from one float64 run over [start] + tokens."""
    seq = torch.tensor([[start] + tokens[:-1]])
    wrapped = gen_verify.Logits(model, main_input(model)).eval()
    whole = gen_verify.float64_logits(wrapped, (enc[wrapped.main], enc.get("attention_mask"),
                                                seq), (*seq.shape, expected[0].shape[-1]))
    return gen_verify.step_slices(whole, 1, len(expected))


def items(model: Any, tokenizer: Any, processor: Any, prompts: Any
          ) -> list[dict[str, torch.Tensor]]:
    """The encoder inputs generated from, one item each: ``prompts`` (texts, or lists of
    ids; default two texts) through the tokenizer; for audio models, two waveforms through
    the feature extractor (``prompts``: a number of them)."""
    if main_input(model) == "input_features":
        n = prompts if isinstance(prompts, int) else 2
        feats = encoder_inputs(model, tokenizer, processor, batch=n)["input_features"]
        return [{"input_features": feats[i:i + 1]} for i in range(n)]
    prompts = list(TEXTS) if prompts is None else list(prompts)
    return [encoder_inputs(model, tokenizer, batch=1, texts=[p]) if isinstance(p, str) else
            {"input_ids": torch.tensor([list(p)]),
             "attention_mask": torch.ones(1, len(p), dtype=torch.long)} for p in prompts]


def _np(enc: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in enc.items()}


def _args(feed: dict[str, np.ndarray], names: list[str]) -> tuple[Any, ...]:
    """The decoder program's arguments for a step's feed."""
    # an audio decoder (AudioDecoderWithPast) takes no encoder_attention_mask
    fed = [torch.from_numpy(feed[n]) for n in ("input_ids", "encoder_attention_mask") if n in feed]
    return (*fed, [torch.from_numpy(feed[n]) for n in names])


def _items(check: GenerationCheck, folder: Path, model: Any, layout: StepLayout,
           inputs: list[dict[str, torch.Tensor]], start: int, steps: int, programs: Any,
           timeout: float) -> Iterator[Judged]:
    """Each input generated from in both runtimes, as gen_verify.judge_items judges it: the
    encoder's outputs first (:func:`_encoder_ok`), then the decoder's steps. ONNX Runtime
    runs the encoder graph once, then greedy decoding with the decoder graph fed the encoder's
    cross-attention cache (gen_verify.greedy_steps); a failed run stops it (its finding in
    ``check``)."""
    programs = programs or {}
    for p, enc in enumerate(inputs):
        tt = time.perf_counter()
        run = TorchRun(*torch_generation(model, enc, steps, start))
        check.seconds["torch"] = check.seconds.get("torch", 0.0) + time.perf_counter() - tt
        tt = time.perf_counter()
        feed = _np(enc)
        encoder = gen_verify.run_step(folder / ENCODER, feed, "the encoder", timeout, check)
        tokens, actual, feeds = [], [], []
        if encoder is not None:  # its outputs by name: the hidden states, the cross cache
            cross = {n: v for n, v in encoder.items() if parse_cache_name(n)}
            tokens, actual, feeds = gen_verify.greedy_steps(
                folder / DECODER, layout, [start], steps, timeout, check, cross=cross,
                encoder_mask=feed.get("attention_mask"))
        check.seconds["onnx"] = check.seconds.get("onnx", 0.0) + time.perf_counter() - tt
        yield Judged(run, tokens, actual, feeds, 1, encoder is None or len(tokens) < steps,
                     functools.partial(reference_steps, model, enc, start, run.tokens,
                                       run.logits),
                     folder / DECODER, programs.get("decoder"),
                     functools.partial(_args, names=layout.past),
                     functools.partial(_encoder_ok, check, folder, model, enc, encoder, p,
                                       start, programs.get("encoder"), timeout))


def _encoder_ok(check: GenerationCheck, folder: Path, model: Any, enc: dict[str, torch.Tensor],
                encoder: dict[str, np.ndarray], p: int, start: int, program: Any, timeout: float
                ) -> bool:
    """The encoder graph's outputs for input ``p`` (``encoder``: hidden states, cross-attention
    cache, by name) against PyTorch's, by the float64 budget; the first one outside it (OM823)
    localised in the encoder graph, and then False."""
    module = EncoderWithCross(model, start).eval()
    args = tuple(enc[k] for k in (module.main, "attention_mask") if k in enc)
    with torch.no_grad():
        hidden, cross = module(*args)
    expected = [t.float().numpy() for t in [hidden, *cross]]
    refs = reference_outputs(module, [Inputs(args=args)], [expected]).outputs
    ref = refs[0] if refs and refs[0] else [None] * len(expected)
    for (name, act), exp, r in zip(encoder.items(), expected, ref):
        c = judge_output(name, exp, act, r, input_set=f"input {p} encoder")
        check.comparisons.append(c)
        if c.ok:
            continue
        check.divergence = {"prompt": p, "graph": "encoder", "output": name}
        check.fail(error(
            "OM823", STAGE, f"the encoder graph's output {name} for input {p} is outside "
            f"the float64 budget ({c.rule}: max abs error {c.max_abs:.3g}, {c.mismatched} "
            f"of {c.total} outside; {c.reason}): every decoder step reads it, so the "
            "decoder's steps were not judged.", details={"comparison": c.to_dict()},
            suggestion="The localisation below names the first ONNX node of the encoder "
            "graph outside its budget."))
        if program is not None:
            gen_verify.localize_step(check, folder / ENCODER, program, _np(enc),
                                     f"input {p} encoder", timeout, args=args)
        return False
    return True


def verify_seq2seq(folder: str | Path, model: Any, tokenizer: Any = None, processor: Any = None,
                   *, steps: int = 8, prompts: Any = None, programs: dict[str, Any] | None = None,
                   timeout: float = sandbox.DEFAULT_TIMEOUT, genai: bool = True
                   ) -> GenerationCheck:
    """Verify the encoder-decoder package in ``folder`` against ``model`` (see the module
    docstring). ``prompts``: texts or lists of ids (text models), a number of waveforms
    (audio models). ``programs``: the graphs' ExportedPrograms by "encoder" / "decoder", for
    localising a divergence. ``genai``: generate with onnxruntime-genai too, where the folder
    has a genai_config.json."""
    folder = Path(folder)
    check = GenerationCheck()
    start = start_token(model)
    if start is None:
        check.fail(no_start_token(model, STAGE))
        return check
    layout = read_step(folder / DECODER, folder)
    inputs = items(model, tokenizer, processor, prompts)
    check.prompts = [e["input_ids"][0].tolist() for e in inputs if "input_ids" in e]
    t0 = time.perf_counter()
    with sandbox.reuse():
        judge_items(check, _items(check, folder, model, layout, inputs, start, steps, programs,
                                  timeout), timeout)
    check.seconds["verify"] = time.perf_counter() - t0
    if genai and check.ok and (folder / "genai_config.json").is_file():
        # onnxruntime-genai generating from the Whisper package (the genai child,
        # hf/genai_child.py), fed each input's features as ONNX Runtime and PyTorch were, must
        # give PyTorch's tokens (OM814; OM816 where genai cannot load or run the folder)
        with tempfile.TemporaryDirectory(prefix="onnxmedic-genai-") as tmp:
            files = []
            for i, enc in enumerate(inputs):
                np.save(path := Path(tmp) / f"features{i}.npy", enc["input_features"].numpy())
                files.append(str(path))
            spec = json.dumps({"features": files, "input": "input_features", "start": start,
                               "steps": steps})
            gen_verify.genai_generation(folder, check, steps, timeout, None, spec, "input")
    return check

