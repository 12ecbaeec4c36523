"""Verification of a generation package that streams the checkpoint: the decoder's weights are
read one layer at a time from the safetensors (plain reads), never the whole model in float32
or float64, and ONNX Runtime's sessions run one at a time.

PyTorch's side is transformers' own decoder layer, built on the meta device and given one
layer's weights at a time (upcast from the checkpoint's dtype as they are read): every
sequence (the prompt and the tokens ONNX Runtime generated, all prompts in one right-padded
batch) runs through it at the package's compute precision (float32: the budget's ``y``) and in
float64 (its reference ``r``), both from the same streamed weights, before the next layer is
read; the logits are made over the vocabulary in slices. Without a cache, one pass over the
ONNX Runtime's sequences gives PyTorch's greedy tokens (the argmax at each step, teacher-forced:
they are ``generate``'s tokens up to the first step where the two differ, which is where the
judging stops) and the logits of every step - each judged by the float64 budget of
verify/budget.py, as gen_verify.verify_generation judges them (gen_verify.judge_prompt).

The budget's ``y`` is a float32 run, not one in the checkpoint's bfloat16: a float32 package is
judged against float32 rounding (a bfloat16 run's error is 2^16 times larger and would hide a
wrong weight); the memory is the same, one layer at a time.

Memory: one decoder layer's weights in float64 (and float32), the activations of the
sequences, the embedding's rows of their tokens, a vocabulary slice of the output projection
(read a slice at a time; none of the checkpoint's pages is mapped: :class:`Weights` reads);
then ONNX Runtime's own loop (a sandbox child) and onnxruntime-genai's check (a child) one
after the other, never beside each other.

Families streamed: decoders of the llama layout (embed_tokens, layers, norm, lm_head, a rotary
embedding, full attention) and GPT-NeoX's (embed_in, layers, final_layer_norm, embed_out; a
partial rotary embedding, parallel residual) - STREAMABLE, their names in :data:`LAYOUTS`;
:func:`streamable` says why another is not.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class Layout:
    """Where a family keeps its parts: the base model's attribute of the causal LM (``base``;
    its checkpoint names start with it), and within it the embedding, the decoder layers and
    the final norm; ``head``: the output projection's weight (the embedding's where tied)."""

    base: str
    embed: str
    layers: str
    norm: str
    head: str

    def names(self, part: str) -> str:
        """A part's prefix in the checkpoint ("gpt_neox.layers.")."""
        return f"{self.base}.{getattr(self, part)}."


LLAMA = Layout("model", "embed_tokens", "layers", "norm", "lm_head.weight")
LAYOUTS = {"llama": LLAMA, "qwen2": LLAMA, "qwen3": LLAMA, "mistral": LLAMA,
           "gpt_neox": Layout("gpt_neox", "embed_in", "layers", "final_layer_norm",
                              "embed_out.weight")}
STREAMABLE = frozenset(LAYOUTS)
# rows of the output projection read and upcast at a time (4096: 24 MiB in float32 at
# hidden 1536; the logits are the same bit for bit as with the whole table at once)
VOCAB_SLICE = 4096
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
              "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class Weights:
    """A checkpoint folder's safetensors: tensors read by name, in the checkpoint's own dtype,
    with plain reads of their bytes (a copy of that tensor only, in the process's own memory
    and freed with it: no memory map, so none of the checkpoint's pages stay resident as the
    reads go on, whatever the size of its shards)."""

    def __init__(self, folder: Path) -> None:
        import struct

        self.folder = Path(folder)
        if (self.folder / INDEX).is_file():  # its files only (not a consolidated copy beside)
            files = [self.folder / f for f in sorted(set(json.loads(
                (self.folder / INDEX).read_text())["weight_map"].values()))]
        elif (self.folder / SINGLE).is_file():
            files = [self.folder / SINGLE]
        else:
            raise FileNotFoundError(f"{self.folder} has no safetensors weights ({INDEX} or "
                                    f"{SINGLE})")
        # name -> (file, dtype, shape, offset, length), from each file's header
        self.index: dict[str, tuple[Path, str, list[int], int, int]] = {}
        for path in files:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            for name, meta in header.items():
                if name != "__metadata__":
                    start, end = meta["data_offsets"]
                    self.index[name] = (path, meta["dtype"], list(meta["shape"]),
                                        8 + n + start, end - start)

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def get(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor ``name``; ``rows``: only its rows ``[start, stop)`` along the first
        dimension (a slice of the output projection, read without the rest)."""
        path, dtype, shape, offset, length = self.index[name]
        if dtype not in _ST_DTYPES:
            raise ValueError(f"{path.name}: {name} is of dtype {dtype}, which is not read here")
        if rows is not None and shape and shape[0]:
            row = length // shape[0]
            start, stop = max(0, rows[0]), min(shape[0], rows[1])
            offset, length = offset + start * row, max(0, stop - start) * row
            shape = [max(0, stop - start), *shape[1:]]
        if not length:
            return torch.empty(shape, dtype=_ST_DTYPES[dtype])
        buf = bytearray(length)
        with open(path, "rb") as f:
            f.seek(offset)
            got = f.readinto(memoryview(buf))
        if got != length:
            raise OSError(f"{path.name}: {name} is cut short ({got} of {length} bytes)")
        return torch.frombuffer(buf, dtype=_ST_DTYPES[dtype]).reshape(shape)

    def dtypes(self) -> set[Any]:
        """The dtypes its tensors are stored in (torch's; None for one not read here)."""
        return {_ST_DTYPES.get(meta[1]) for meta in self.index.values()}

    def shape(self, name: str) -> list[int]:
        return list(self.index[name][2])

    def take(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``ids`` (any shape) of the 2-D tensor ``name`` - an embedding's lookup -
        each distinct row read once: (*ids.shape, dim), without reading the whole table."""
        rows, inverse = torch.unique(ids, return_inverse=True)
        table = torch.stack([self.get(name, (int(r), int(r) + 1))[0] for r in rows]) \
            if rows.numel() else torch.empty((0, *self.shape(name)[1:]))
        return table[inverse]

    def prefixed(self, prefix: str) -> dict[str, torch.Tensor]:
        """The tensors under ``prefix`` (their names without it)."""
        return {k[len(prefix):]: self.get(k) for k in self.index if k.startswith(prefix)}

    def close(self) -> None:
        """Nothing is held open between reads (kept for the callers' ``finally``)."""


def streamable(config: Any) -> str | None:
    """Why the checkpoint of ``config`` (a transformers config) cannot be streamed, or None."""
    kind = getattr(config, "model_type", "")
    if kind not in STREAMABLE:
        return f"the family {kind!r} is not one streamed ({', '.join(sorted(STREAMABLE))})"
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        return f"its layers' attention is {', '.join(sorted(types))}, not full attention only"
    return None


def _mask(lengths: list[int], n: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive 4-D mask of right-padded sequences: causal, the padding's keys hidden."""
    pos = torch.arange(n)
    allowed = (pos[None, :] <= pos[:, None])[None] & (
        pos[None, :] < torch.tensor(lengths)[:, None])[:, None, :]
    out = torch.zeros(allowed.shape, dtype=dtype)
    out[~allowed] = torch.finfo(dtype).min
    return out[:, None]


def rotary_embedding(rotary: torch.nn.Module, position_ids: torch.Tensor, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding's (cos, sin) computed in ``dtype``: transformers' own computes
    them in float32 whatever its input, which would put float32 rounding into the float64
    reference (its frequencies, inv_freq, are the model's as they are). A half type's (bfloat16,
    float16) are transformers' own: made in float32, then rounded (positions past 256 are not
    even representable in bfloat16)."""
    if dtype.itemsize < 4:  # as transformers: made in float32, rounded to the half type
        cos, sin = rotary_embedding(rotary, position_ids, torch.float32)
        return cos.to(dtype), sin.to(dtype)
    freqs = rotary.inv_freq.to(dtype)[None, :, None] * position_ids[:, None, :].to(dtype)
    emb = torch.cat((freqs, freqs), dim=1).transpose(1, 2)
    scale = float(getattr(rotary, "attention_scaling", 1.0))
    return emb.cos() * scale, emb.sin() * scale


def _layer_out(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


@contextmanager
def _loaded(module: torch.nn.Module, weights: dict[str, torch.Tensor], dtype: torch.dtype,
            consume: bool = False) -> Iterator[torch.nn.Module]:
    """``module`` (on the meta device) with ``weights`` upcast to ``dtype`` while inside;
    back on the meta device after (the upcast copy freed). Tensors the module does not hold
    (an old GPT-NeoX checkpoint's ``attention.bias`` mask) are left out; one it holds and
    ``weights`` lacks is an error. ``consume``: each tensor taken out of ``weights`` as it is
    upcast (the last dtype's pass: the checkpoint's copy freed one tensor at a time, not held
    beside the whole upcast layer)."""
    own = module.state_dict().keys()
    take = weights.pop if consume else weights.__getitem__
    module.load_state_dict({k: take(k).to(dtype) for k in list(weights) if k in own},
                           assign=True, strict=True)
    try:
        yield module
    finally:
        module.to("meta")


def streamed_logits(folder: str | Path, seqs: list[list[int]],
                    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64)
                    ) -> dict[torch.dtype, list[np.ndarray]]:
    """The logits of the checkpoint at ``folder`` over each of ``seqs`` (no cache, all
    positions), in each of ``dtypes``, the weights streamed one decoder layer at a time
    (see the module docstring): per dtype, per sequence, an array (1, len, vocab)."""
    return {d: got[0] for d, got in streamed_batches(folder, [seqs], dtypes).items()}


def streamed_batches(folder: str | Path, batches: list[list[list[int]]],
                     dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64)
                     ) -> dict[torch.dtype, list[list[np.ndarray]]]:
    """:func:`streamed_logits` of several batches of sequences (each padded to its own
    longest) in one streamed pass: each decoder layer's weights are read and upcast once
    and run on every batch in turn, so a batch's logits are those it gets alone. Per dtype,
    per batch, per sequence, an array (1, len, vocab). A half type's pass (bfloat16, float16)
    runs its output projection in float32, and its logits are float32: rounded to 8 bits,
    its top picks would tie."""
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    config = checked_config(folder)
    config._attn_implementation = "eager"  # the additive mask below, no kernel choice
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layout = LAYOUTS[config.model_type]
    base = getattr(model, layout.base)
    rotary = type(base.rotary_emb)(config=config)  # its buffers made on the CPU
    weights = Weights(folder)
    lengths = [[len(s) for s in seqs] for seqs in batches]
    ids, positions = [], []
    for seqs, ls in zip(batches, lengths):
        n = max(ls)
        ids.append(torch.tensor([s + [s[-1]] * (n - len(s)) for s in seqs]))
        positions.append(torch.arange(n)[None].expand(len(seqs), n))
    # the embedding's rows of the sequences' tokens only, not its whole table
    hidden = {d: [weights.take(layout.names("embed") + "weight", i).to(d) for i in ids]
              for d in dtypes}
    state = {d: [(_mask(ls, int(i.shape[1]), d), rotary_embedding(rotary, pos, d))
                 for ls, i, pos in zip(lengths, ids, positions)] for d in dtypes}
    with torch.no_grad():
        for i, layer in enumerate(getattr(base, layout.layers)):
            w = weights.prefixed(f"{layout.names('layers')}{i}.")
            for d in dtypes:
                with _loaded(layer, w, d, consume=d == dtypes[-1]) as run:
                    hidden[d] = [_layer_out(run(h, attention_mask=mask, position_ids=pos,
                                                position_embeddings=pe, use_cache=False))
                                 for h, (mask, pe), pos in zip(hidden[d], state[d], positions)]
            del w
        norm_w = weights.prefixed(layout.names("norm"))
        for d in dtypes:
            with _loaded(getattr(base, layout.norm), norm_w, d) as run:
                hidden[d] = [_layer_out(run(h)) for h in hidden[d]]
        name = layout.head if layout.head in weights else layout.names("embed") + "weight"
        vocab = weights.shape(name)[0]
        out = {d: d if d.itemsize >= 4 else torch.float32 for d in dtypes}
        hidden = {d: [h.to(out[d]) for h in hidden[d]] for d in dtypes}
        logits = {d: [torch.empty((*h.shape[:2], vocab), dtype=out[d]) for h in hidden[d]]
                  for d in dtypes}
        for c in range(0, vocab, VOCAB_SLICE):  # the head read a slice at a time
            part_w = weights.get(name, (c, c + VOCAB_SLICE))
            for d in dtypes:
                part = part_w.to(out[d]).T
                for h, lg in zip(hidden[d], logits[d]):
                    lg[..., c:c + VOCAB_SLICE] = h @ part
            del part_w
    return {d: [[lg[j:j + 1, :k].numpy() for j, k in enumerate(ls)]
                for lg, ls in zip(logits[d], lengths)] for d in dtypes}


def checked_config(checkpoint: str | Path) -> Any:
    """The transformers config of the checkpoint folder ``checkpoint``; ValueError where it
    cannot be streamed (:func:`streamable`), FileNotFoundError where it has no safetensors."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(checkpoint))
    why = streamable(config)
    if why is not None:
        raise ValueError(f"onnxmedic.hf.stream: {checkpoint} cannot be streamed: {why}")
    Weights(Path(checkpoint)).close()
    return config


def verify_package(package: str | Path, checkpoint: str | Path, prompts: list[list[int]],
                   *, steps: int = 8, timeout: float | None = None, genai: bool = True
                   ) -> Any:
    """Verify the generation package in ``package`` against the checkpoint folder
    ``checkpoint``, streamed (see the module docstring): onnxmedic's own greedy loop in ONNX
    Runtime (one session), then PyTorch's side and its float64 reference in one streamed pass
    over the loop's sequences, each step judged (OM811-OM813, as
    gen_verify.verify_generation), then onnxruntime-genai generating from the folder (OM814-
    OM816). ``prompts``: token ids. Returns gen_verify.GenerationCheck."""
    from onnxmedic import sandbox
    from onnxmedic.hf.gen_verify import (
        GenerationCheck,
        genai_available,
        genai_generation,
        judge_prompt,
        not_installed,
        onnx_side,
        step_slices,
    )

    package, checkpoint = Path(package), Path(checkpoint)
    timeout = sandbox.DEFAULT_TIMEOUT if timeout is None else timeout
    config = checked_config(checkpoint)  # before ONNX Runtime's generation is paid for
    check = GenerationCheck(prompts=[list(p) for p in prompts])
    ahead = onnx_side(package, check.prompts, steps, timeout)  # its session closed after
    check.seconds["onnx"] = ahead.seconds
    ran = [r for r in ahead.runs if len(r[0]) == steps]
    t0 = time.perf_counter()
    seqs = [ids + tokens[:-1] for ids, (tokens, _a, _f) in zip(check.prompts, ran)]
    logits = streamed_logits(checkpoint, seqs) if seqs else {}
    check.seconds["torch"] = time.perf_counter() - t0
    for p, (ids, (tokens, actual, _feeds)) in enumerate(zip(check.prompts, ran)):
        n = len(ids)
        expected = step_slices(logits[torch.float32][p], n, steps)
        refs = step_slices(logits[torch.float64][p], n, steps)
        torch_tokens = [int(np.argmax(e[0, -1])) for e in expected]
        check.tokens_torch.append(torch_tokens)
        check.tokens_onnx.append(tokens)
        if judge_prompt(check, p, n, torch_tokens, tokens, expected, actual, refs) is not None:
            return check
    if len(ran) < len(check.prompts):  # a failed run: its finding
        for f in ahead.findings:
            check.fail(f)
        return check
    if genai and check.ok:
        if not genai_available():
            check.findings.append(not_installed())
        else:
            eos = config.eos_token_id
            genai_generation(package, check, steps, timeout,
                             set(eos) if isinstance(eos, list) else
                             {eos} if eos is not None else set())
    return check


def main(argv: list[str] | None = None) -> int:
    """``python -m onnxmedic.hf.stream PACKAGE CHECKPOINT [--steps N]``: the streamed
    verification of a package (the prompt: the checkpoint's tokenizer on the first of
    gen_verify.DEFAULT_PROMPTS); prints its verdict as JSON, exit 0 when it verifies, 1 when
    not."""
    import argparse

    from onnxmedic.hf.gen_verify import DEFAULT_PROMPTS, prompt_ids

    ap = argparse.ArgumentParser(prog="python -m onnxmedic.hf.stream")
    ap.add_argument("package")
    ap.add_argument("checkpoint")
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args(argv)
    from onnxmedic import noise
    from onnxmedic.findings import OnnxMedicError
    from onnxmedic.hf.checkpoint import resolve

    noise.silence()  # before transformers is imported: no third-party lines on stderr
    from transformers import AutoTokenizer

    try:
        resolve(a.checkpoint)  # OM800/OM801 before anything is loaded
    except OnnxMedicError as e:
        print(f"{e.finding.code} {e.finding.message}", file=sys.stderr)
        return 1
    try:
        vocab = int(checked_config(a.checkpoint).vocab_size)
        tok = AutoTokenizer.from_pretrained(a.checkpoint)
        check = verify_package(a.package, a.checkpoint,
                               prompt_ids(tok, list(DEFAULT_PROMPTS[:1]), vocab),
                               steps=a.steps)
    except (OSError, ValueError) as e:  # a folder that is not a streamable checkpoint
        said = str(e)
        prog = "onnxmedic.hf.stream: "
        print(said if said.startswith(prog) else prog + said, file=sys.stderr)
        return 1
    print(json.dumps({"ok": check.ok, "findings": [f"{f.code} {f.message}" for f in
                                                   check.findings],
                      "tokens_onnx": check.tokens_onnx, "tokens_genai": check.tokens_genai,
                      "seconds": {k: round(v, 1) for k, v in check.seconds.items()}}))
    return 0 if check.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
