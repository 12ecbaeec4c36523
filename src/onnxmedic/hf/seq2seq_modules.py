"""The encoder-decoder wrappers that are exported (an encoder that also returns every layer's
cross-attention cache; a decoder step with past) and the names of the package's files, shared by
the export (hf/seq2seq.py) and its verification (hf/seq2seq_verify.py)."""

from __future__ import annotations

from typing import Any

import torch

from onnxmedic.hf.generation import flat_cache

TASKS = ("text2text-generation-with-past", "automatic-speech-recognition-with-past")
ENCODER = "encoder_model.onnx"
DECODER = "decoder_with_past_model.onnx"
CROSS_RULE = "the encoder attention mask and the cross-attention cache cover the same positions"
# example shapes of the decoder's export: batch 2, 3 new tokens after a past of 4, an encoder
# output of 9 positions (all different: torch.export must not tie them)
EXAMPLE_BATCH, EXAMPLE_NEW, EXAMPLE_PAST, EXAMPLE_ENCODER = 2, 3, 4, 9


def split_cache(cache: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The self-attention and the cross-attention caches of an ``EncoderDecoderCache`` as
    flat [k0, v0, k1, v1, ...] lists."""
    return flat_cache(cache.self_attention_cache), flat_cache(cache.cross_attention_cache)


def interleave(selfs: list[torch.Tensor], cross: list[torch.Tensor]) -> list[torch.Tensor]:
    """optimum's order: per layer decoder key, decoder value, encoder key, encoder value."""
    out: list[torch.Tensor] = []
    for i in range(0, len(selfs), 2):
        out += [selfs[i], selfs[i + 1], cross[i], cross[i + 1]]
    return out


def main_input(model: torch.nn.Module) -> str:
    """The encoder's main input: input_ids (text) or input_features (Whisper)."""
    return str(getattr(model, "main_input_name", "input_ids") or "input_ids")


def start_token(model: Any) -> int | None:
    """The decoder's first token (decoder_start_token_id of the generation config or the
    config), or None when neither says."""
    for cfg in (getattr(model, "generation_config", None), model.config):
        value = getattr(cfg, "decoder_start_token_id", None) if cfg is not None else None
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return None


def no_start_token(model: Any, stage: str) -> Any:
    """OM824: the model names no first decoder token (start_token is None)."""
    from onnxmedic.findings import error

    return error("OM824", stage, f"{type(model).__name__} names no first decoder token "
                 "(decoder_start_token_id in generation_config.json or config.json): "
                 "generation cannot start.", suggestion="Set decoder_start_token_id in the "
                 "checkpoint's config (the model card says which token its decoder starts "
                 "from).")


def hidden_size(model: Any) -> int:
    cfg = model.config
    return int(getattr(cfg, "d_model", None) or getattr(cfg, "hidden_size"))


class EncoderWithCross(torch.nn.Module):
    """The encoder and the decoder's cross-attention cache of its output: (input, mask) ->
    (last_hidden_state, [cross k0, v0, k1, v1, ...]). The cache is what the model's own
    cross-attention layers store on their first call (the decoder's token path feeds no
    output, so the exported graph holds only the key and value projections)."""

    def __init__(self, model: torch.nn.Module, start: int) -> None:
        super().__init__()
        self.model = model
        self.start = start
        self.main = main_input(model)

    def forward(self, features: torch.Tensor, attention_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        kw: dict[str, Any] = {self.main: features}
        if attention_mask is not None:
            kw["attention_mask"] = attention_mask
        hidden = self.model.get_encoder()(**kw).last_hidden_state
        first = torch.full((features.shape[0], 1), self.start, dtype=torch.long,
                           device=features.device)
        out = self.model(decoder_input_ids=first, encoder_outputs=(hidden,),
                         attention_mask=attention_mask, use_cache=True)
        return hidden, split_cache(out.past_key_values)[1]


class DecoderWithPast(torch.nn.Module):
    """One decoder step: (input_ids, encoder_attention_mask, [dec k0, dec v0, enc k0, enc v0,
    ...]) -> (logits, [present dec k0, v0, ...]). The encoder output is not an input: the
    cross-attention layers read the cache (a placeholder of the encoder output's shape tells
    the model that cross-attention runs; no value of it is read)."""

    def __init__(self, model: torch.nn.Module, mask: bool = True) -> None:
        super().__init__()
        self.model = model
        self.takes_mask = mask
        self.hidden = hidden_size(model)

    def forward(self, input_ids: torch.Tensor, encoder_attention_mask: torch.Tensor | None,
                past: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.step(input_ids, encoder_attention_mask, past)

    def step(self, input_ids: torch.Tensor, encoder_attention_mask: torch.Tensor | None,
             past: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The step itself (forward's, with or without the encoder's mask)."""
        from transformers import DynamicCache, EncoderDecoderCache

        if encoder_attention_mask is not None:
            torch._check(encoder_attention_mask.shape[1] == past[2].shape[2],
                         lambda: CROSS_RULE)
        selfs = [(past[i], past[i + 1]) for i in range(0, len(past), 4)]
        cross = [(past[i + 2], past[i + 3]) for i in range(0, len(past), 4)]
        cache = EncoderDecoderCache(DynamicCache(selfs), DynamicCache(cross))
        placeholder = past[2].new_zeros(input_ids.shape[0], past[2].shape[2], self.hidden)
        kw: dict[str, Any] = {}
        if self.takes_mask:
            kw["attention_mask"] = encoder_attention_mask
        out = self.model(decoder_input_ids=input_ids, encoder_outputs=(placeholder,),
                         past_key_values=cache, use_cache=True, **kw)
        return out.logits, split_cache(out.past_key_values)[0]


class AudioDecoderWithPast(DecoderWithPast):
    """An audio encoder-decoder's step (Whisper): no encoder mask among the inputs - the
    encoder's output has a fixed length and no padding."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model, mask=False)

    def forward(self, input_ids: torch.Tensor,  # type: ignore[override]
                past: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.step(input_ids, None, past)


def decoder_module(model: torch.nn.Module, mask: bool) -> DecoderWithPast:
    """The decoder step's module: with the encoder mask (text), or without (audio)."""
    return DecoderWithPast(model, True) if mask else AudioDecoderWithPast(model)
