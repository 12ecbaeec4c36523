"""A zoo of Hugging Face ``transformers`` architectures built from tiny configs (no downloads).

Every entry is a factory returning a :class:`onnxmedic.sweep.ZooCase`: the model (random
weights from ``AutoConfig.for_model`` / ``AutoModel.from_config``), example inputs and
``dynamic_shapes`` (batch and sequence length; batch and image size for convolutional vision
models; batch and length for audio). Configs are tiny (hidden 32, 2 layers, vocabulary 128,
images 32-64 px) so that each export takes seconds.

    onnxmedic sweep bench/zoo/hf.py --jobs 2 --report zoo.html

``ZOO`` holds the stateless forms; ``DECODE`` the decoder-only models in deployment form (one
step with ``past_key_values`` in and out, dynamic past length, checked over a few greedy
decoding steps in ONNX Runtime against PyTorch); ``FAST`` the handful run by the default tests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from onnxmedic.sweep import ZooCase
from onnxmedic.sweep.sizes import with_size_check

logger = logging.getLogger(__name__)

VOCAB = 128
BATCH, SEQ = 2, 8
TEXT_DYN = {0: "batch", 1: "sequence"}

# per family: the config keys for a tiny model (the rest stays at the library's defaults)
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             vocab_size=VOCAB, max_position_embeddings=64)
SMALL_KV = dict(SMALL, num_key_value_heads=1, head_dim=16)


def _config(model_type: str, **kw: Any) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **kw)


def _ids(batch: int = BATCH, seq: int = SEQ, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # ids from 4 up: clear of the special tokens (pad/bos/eos) of the tiny configs
    return torch.randint(4, vocab, (batch, seq), generator=g)


def _base(model_type: str, cfg_kw: dict[str, Any], auto: str = "AutoModel") -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = _config(model_type, **cfg_kw)
    model = getattr(transformers, auto).from_config(cfg)
    return model.eval()


def text(model_type: str, cfg: dict[str, Any] | None = None, *, auto: str = "AutoModel",
         mask: bool = True, stateless: bool = False, seq: int = SEQ,
         dyn: dict[int, str] | None = None, note: str = "") -> Callable[[], ZooCase]:
    """An encoder or decoder taking input_ids (and attention_mask)."""

    def make() -> ZooCase:
        kw = dict(SMALL if cfg is None else cfg)
        if stateless:
            kw["use_cache"] = False  # the stateless form: no cache in the outputs
        m = _base(model_type, kw, auto)
        ids = _ids(seq=seq)
        kwargs: dict[str, Any] = {"input_ids": ids}
        d = dyn or TEXT_DYN
        shapes: dict[str, Any] = {"input_ids": d}
        if mask:
            kwargs["attention_mask"] = torch.ones_like(ids)
            shapes["attention_mask"] = d
        return ZooCase(m, (), kwargs, shapes, note=note)

    return make


def seq2seq(model_type: str, cfg: dict[str, Any], *, stateless: bool = True,
            note: str = "") -> Callable[[], ZooCase]:
    """An encoder-decoder taking input_ids, attention_mask and decoder_input_ids."""

    def make() -> ZooCase:
        m = _base(model_type, dict(cfg, use_cache=not stateless))
        ids = _ids()
        dec = _ids(seq=5, seed=1)
        kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                  "decoder_input_ids": dec}
        shapes = {"input_ids": TEXT_DYN, "attention_mask": TEXT_DYN,
                  "decoder_input_ids": {0: "batch", 1: "decoder_sequence"}}
        return ZooCase(m, (), kwargs, shapes, note=note)

    return make


def image(model_type: str, cfg: dict[str, Any], *, size: int = 32, channels: int = 3,
          dynamic_size: bool = True, square: bool = False, auto: str = "AutoModel",
          note: str = "") -> Callable[[], ZooCase]:
    """A vision model taking pixel_values; dynamic batch, and image size when the model allows."""

    def make() -> ZooCase:
        m = _base(model_type, cfg, auto)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(BATCH, channels, size, size, generator=g)
        dims = {0: "batch", 2: "height", 3: "width"} if dynamic_size else {0: "batch"}
        if dynamic_size and square:
            dims = {0: "batch", 2: "size", 3: "size"}
        return ZooCase(m, (), {"pixel_values": x}, {"pixel_values": dims}, note=note)

    return make


def audio(model_type: str, cfg: dict[str, Any], *, length: int = 1600,
          tolerance: tuple[float, float] | None = None,
          note: str = "") -> Callable[[], ZooCase]:
    """A raw-waveform audio encoder taking input_values (batch, samples)."""

    def make() -> ZooCase:
        m = _base(model_type, cfg)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(BATCH, length, generator=g)
        return ZooCase(m, (), {"input_values": x}, {"input_values": {0: "batch", 1: "samples"}},
                       note=note, tolerance=tolerance)

    return make


def whisper(stateless: bool = True) -> ZooCase:
    cfg = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
               decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
               vocab_size=VOCAB, num_mel_bins=16, max_source_positions=16,
               max_target_positions=32, pad_token_id=1, bos_token_id=2, eos_token_id=3,
               decoder_start_token_id=2, begin_suppress_tokens=None, suppress_tokens=None,
               use_cache=not stateless)
    m = _base("whisper", cfg)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(BATCH, 16, 32, generator=g)  # 2 * max_source_positions frames
    dec = _ids(seq=5, seed=1)
    return ZooCase(m, (), {"input_features": feats, "decoder_input_ids": dec},
                   {"input_features": {0: "batch"},
                    "decoder_input_ids": {0: "batch", 1: "decoder_sequence"}},
                   note="the encoder's length is fixed by the config (2 x max_source_positions)")


def clip_vision() -> ZooCase:
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    cfg = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=32, patch_size=8)
    m = CLIPVisionModel(cfg).eval()
    x = torch.randn(BATCH, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    return ZooCase(m, (), {"pixel_values": x}, {"pixel_values": {0: "batch"}},
                   note="position embeddings are fixed to the config's image size")


def detr() -> ZooCase:
    from transformers import DetrConfig, DetrModel, ResNetConfig

    torch.manual_seed(0)
    backbone = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 32, 64], depths=[1, 1, 1, 1],
                            out_features=["stage4"])
    cfg = DetrConfig(use_timm_backbone=False, backbone_config=backbone, d_model=32,
                     encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                     num_queries=10, use_pretrained_backbone=False)
    m = DetrModel(cfg).eval()
    x = torch.randn(BATCH, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    return ZooCase(m, (), {"pixel_values": x},
                   {"pixel_values": {0: "batch", 2: "height", 3: "width"}},
                   note="DETR with a transformers ResNet backbone (no timm)")


ENC = dict(SMALL)
T5 = dict(d_model=32, d_ff=64, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=2,
          vocab_size=VOCAB, relative_attention_num_buckets=8, decoder_start_token_id=0)
BARTLIKE = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
                eos_token_id=2, decoder_start_token_id=2)
FIXED_SIZE = ("image size static: position embeddings are fixed to the config's size; declared "
              "dynamic, torch.export specialises it (OM401)")
VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
           image_size=32, patch_size=8)
WAV = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
           conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2),
           num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
           vocab_size=VOCAB, do_stable_layer_norm=False)

ZOO: dict[str, Callable[[], ZooCase]] = {
    # encoders
    "bert": text("bert"),
    "roberta": text("roberta", dict(ENC, pad_token_id=1)),
    "distilbert": text("distilbert", dict(dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                          vocab_size=VOCAB, max_position_embeddings=64)),
    "albert": text("albert", dict(ENC, embedding_size=16)),
    "electra": text("electra", dict(ENC, embedding_size=16)),
    "deberta": text("deberta", ENC),
    "deberta-v2": text("deberta-v2", dict(ENC, position_buckets=16)),
    "xlnet": text("xlnet", dict(d_model=32, n_layer=2, n_head=2, d_inner=64, d_head=16,
                                vocab_size=VOCAB, use_mems_eval=False)),
    "big_bird": text("big_bird", dict(ENC, attention_type="original_full"),
                     note="block-sparse attention needs long sequences; original_full here"),
    "mpnet": text("mpnet", ENC),
    "convbert": text("convbert", dict(ENC, embedding_size=32)),
    "mobilebert": text("mobilebert", dict(ENC, embedding_size=16, intra_bottleneck_size=16,
                                          true_hidden_size=16, num_feedforward_networks=1)),
    "roformer": text("roformer", dict(ENC, embedding_size=32)),
    "xlm-roberta": text("xlm-roberta", dict(ENC, pad_token_id=1)),
    # ModernBERT (the dynamic-shapes issue's OM402 at batch 1): global attention in every layer
    "modernbert": text("modernbert", dict(SMALL, global_attn_every_n_layers=1,
                                          local_attention=16, pad_token_id=0, bos_token_id=1,
                                          eos_token_id=2, cls_token_id=1, sep_token_id=2)),
    # decoders (stateless form: use_cache=False)
    "gpt2": text("gpt2", dict(n_embd=32, n_layer=2, n_head=2, n_positions=64,
                              vocab_size=VOCAB), stateless=True),
    "gpt_neo": text("gpt_neo", dict(hidden_size=32, num_layers=2, num_heads=2,
                                    attention_types=[[["global", "local"], 1]],
                                    vocab_size=VOCAB, max_position_embeddings=64,
                                    window_size=16), stateless=True),
    "gpt_neox": text("gpt_neox", SMALL, stateless=True),
    "gptj": text("gptj", dict(n_embd=32, n_layer=2, n_head=2, rotary_dim=8, n_positions=64,
                              vocab_size=VOCAB), stateless=True),
    "llama": text("llama", SMALL_KV, stateless=True),
    "mistral": text("mistral", SMALL_KV, stateless=True),
    "qwen2": text("qwen2", SMALL_KV, stateless=True),
    "qwen3": text("qwen3", SMALL_KV, stateless=True),
    "phi": text("phi", SMALL_KV, stateless=True),
    "phi3": text("phi3", dict(SMALL_KV, pad_token_id=0), stateless=True),
    "gemma": text("gemma", SMALL_KV, stateless=True),
    "gemma2": text("gemma2", dict(SMALL_KV, sliding_window=16), stateless=True),
    "falcon": text("falcon", dict(SMALL, new_decoder_architecture=False), stateless=True),
    "bloom": text("bloom", dict(hidden_size=32, n_layer=2, n_head=2, vocab_size=VOCAB),
                  stateless=True),
    "opt": text("opt", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            ffn_dim=64, word_embed_proj_dim=32, vocab_size=VOCAB,
                            max_position_embeddings=64), stateless=True),
    "codegen": text("codegen", dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=8,
                                    n_positions=64, n_ctx=64, vocab_size=VOCAB), stateless=True),
    "stablelm": text("stablelm", SMALL_KV, stateless=True),
    "starcoder2": text("starcoder2", SMALL_KV, stateless=True),
    "mamba": text("mamba", dict(hidden_size=32, num_hidden_layers=2, state_size=8,
                                vocab_size=VOCAB, expand=2, conv_kernel=4), mask=False,
                  stateless=True, dyn={0: "batch"},
                  note="sequence static: the CPU path loops over time steps in Python, so "
                  "torch.export specialises the length (OM401 when declared dynamic)"),
    "rwkv": text("rwkv", dict(hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                              intermediate_size=64, vocab_size=VOCAB, context_length=64),
                 mask=False, stateless=True, dyn={0: "batch"},
                 note="sequence static: the CPU path loops over time steps in Python, so "
                 "torch.export specialises the length (OM401 when declared dynamic)"),
    # encoder-decoders
    "t5": seq2seq("t5", T5),
    "bart": seq2seq("bart", BARTLIKE),
    "mbart": seq2seq("mbart", BARTLIKE),
    "pegasus": seq2seq("pegasus", dict(BARTLIKE, pad_token_id=0, eos_token_id=1,
                                       decoder_start_token_id=0)),
    "marian": seq2seq("marian", dict(BARTLIKE, decoder_start_token_id=1,
                                     decoder_vocab_size=VOCAB)),
    "whisper": whisper,
    # encoder-decoders returning their cache (EncoderDecoderCache): the case pytree
    # registration of the output types is for
    "t5+cache": seq2seq("t5", T5, stateless=False),
    "bart+cache": seq2seq("bart", BARTLIKE, stateless=False),
    "whisper+cache": lambda: whisper(stateless=False),
    # vision
    "vit": image("vit", VIT, dynamic_size=False, note=FIXED_SIZE),
    "deit": image("deit", VIT, dynamic_size=False, note=FIXED_SIZE),
    "beit": image("beit", dict(VIT, use_relative_position_bias=True), dynamic_size=False,
                  note=FIXED_SIZE),
    "dinov2": image("dinov2", dict(VIT, patch_size=8), size=48,
                    note="example 48 px, config 32 px: at the config's size forward() skips the "
                    "interpolation of the position embeddings (a Python branch), and an "
                    "export there bakes that in (OM402 at other sizes)"),
    "swin": image("swin", dict(embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=4,
                               image_size=32, patch_size=2), dynamic_size=False,
                  note="image size static: at other sizes of this config PyTorch itself fails "
                  "(the attention mask's broadcast), so they cannot be verified (OM403)"),
    "convnext": image("convnext", dict(hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1])),
    "resnet": image("resnet", dict(embedding_size=8, hidden_sizes=[8, 16, 32, 64],
                                   depths=[1, 1, 1, 1])),
    "regnet": image("regnet", dict(embedding_size=8, hidden_sizes=[8, 16, 32, 64],
                                   depths=[1, 1, 1, 1], groups_width=8)),
    "mobilenet_v2": image("mobilenet_v2", dict(depth_multiplier=0.35, image_size=32),
                          dynamic_size=False, note="image size static: TF-style 'same' padding "
                          "is computed from the input size in Python (OM401 when dynamic)"),
    "mobilevit": image("mobilevit", dict(hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64],
                                         image_size=64, num_attention_heads=2),
                       size=64, dynamic_size=False),
    "segformer": image("segformer", dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                                         hidden_sizes=[16, 32], patch_sizes=[7, 3],
                                         strides=[4, 2], num_attention_heads=[1, 2],
                                         mlp_ratios=[2, 2])),
    "levit": image("levit", dict(image_size=64, hidden_sizes=[32, 48, 64], num_attention_heads=[1, 2, 2],
                                 depths=[1, 1, 1], key_dim=[8, 8, 8], patch_size=16),
                   size=64, dynamic_size=False),
    "detr": detr,
    "clip_vision": clip_vision,
    # audio
    "wav2vec2": audio("wav2vec2", WAV),
    "hubert": audio("hubert", WAV),
    "wavlm": audio("wavlm", dict(WAV, num_buckets=16, max_bucket_distance=64)),
    "data2vec-audio": audio("data2vec-audio", WAV, tolerance=(1e-4, 1e-4),
                            note="atol 1e-4: 2 of 10176 outputs of its last layer norm are off "
                            "by 1.4e-5 (float32 rounding), over the default atol 1e-5"),
}


# --------------------------------------------------------------------------------------------
# decoder-only models in deployment form: one step with past_key_values in and out


class DecodeStep(torch.nn.Module):
    """One decoding step over flat tensors: (input_ids, [k0, v0, k1, v1, ...]) -> (logits,
    [new k0, new v0, ...]). The DynamicCache is built inside, so the ONNX model's inputs and
    outputs are plain tensors with a dynamic past length."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, past: list[torch.Tensor]
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        from transformers import DynamicCache

        pairs = [(past[i], past[i + 1]) for i in range(0, len(past), 2)]
        cache = DynamicCache(pairs, config=self.model.config)
        out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True)
        return out.logits, flat_cache(out.past_key_values)


def flat_cache(cache: Any) -> list[torch.Tensor]:
    """[k0, v0, k1, v1, ...] of a DynamicCache."""
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def greedy_check(steps: int = 4, prompt: int = 5) -> Callable[[str, ZooCase], dict[str, Any]]:
    """Greedy decoding for ``steps`` tokens: PyTorch (the model with its own cache) against the
    ONNX step model in ONNX Runtime, fed its own past; tokens must match, logits be close."""

    def check(onnx_path: str, case: ZooCase) -> dict[str, Any]:
        import numpy as np
        import onnxruntime as ort

        model = case.model.model
        sess = ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
        names = [i.name for i in sess.get_inputs()]
        ids = _ids(seq=prompt, seed=3)
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
        cache = out.past_key_values
        past = [t.numpy() for t in flat_cache(cache)]
        tok_t = tok_o = out.logits[:, -1].argmax(-1, keepdim=True)
        worst, tokens_t, tokens_o = 0.0, [], []
        for _ in range(steps):
            with torch.no_grad():
                out = model(input_ids=tok_t, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            res = sess.run(None, dict(zip(names, [tok_o.numpy()] + past)))
            logits_o, past = res[0], res[1:]
            worst = max(worst, float(np.abs(logits_o - out.logits.numpy()).max()))
            tok_t = out.logits[:, -1].argmax(-1, keepdim=True)
            tok_o = torch.from_numpy(logits_o[:, -1].argmax(-1)[:, None].astype(np.int64))
            tokens_t.append(tok_t[:, 0].tolist())
            tokens_o.append(tok_o[:, 0].tolist())
        ok = tokens_t == tokens_o and worst < 1e-3
        return {"ok": ok, "steps": steps, "past_length_end": int(past[0].shape[2]),
                "max_abs_logits": worst, "tokens_torch": tokens_t, "tokens_onnx": tokens_o,
                "message": "" if ok else f"greedy decoding diverges (tokens {tokens_t} vs "
                f"{tokens_o}, max abs logits error {worst:.3g})"}

    return check


def decode(model_type: str, cfg: dict[str, Any], note: str = "") -> Callable[[], ZooCase]:
    """A causal LM as one decoding step with its past, checked by greedy decoding."""

    def make() -> ZooCase:
        lm = _base(model_type, dict(cfg, use_cache=True), auto="AutoModelForCausalLM")
        ids = _ids(seq=3, seed=2)
        with torch.no_grad():
            past = flat_cache(lm(input_ids=_ids(seq=5, seed=4), use_cache=True).past_key_values)
        dims = [{0: "batch", 2: "past"} for _ in past]
        return ZooCase(DecodeStep(lm).eval(), (ids, past), {},
                       ({0: "batch", 1: "sequence"}, dims), note=note or
                       "one step with past_key_values in/out; greedy decoding checked",
                       check=greedy_check())

    return make


DECODE: dict[str, Callable[[], ZooCase]] = {
    "gpt2+past": decode("gpt2", dict(n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                     vocab_size=VOCAB)),
    "llama+past": decode("llama", SMALL_KV),
    "mistral+past": decode("mistral", SMALL_KV),
    "qwen2+past": decode("qwen2", SMALL_KV),
    "phi3+past": decode("phi3", dict(SMALL_KV, pad_token_id=0)),
    "gemma+past": decode("gemma", SMALL_KV),
    "opt+past": decode("opt", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   ffn_dim=64, word_embed_proj_dim=32, vocab_size=VOCAB,
                                   max_position_embeddings=64)),
    "gpt_neox+past": decode("gpt_neox", SMALL),
    "falcon+past": decode("falcon", dict(SMALL, new_decoder_architecture=False)),
    "bloom+past": decode("bloom", dict(hidden_size=32, n_layer=2, n_head=2, vocab_size=VOCAB)),
}

# the handful the default test run exports: an encoder, a decoder step with its past (greedy
# decoding checked), an encoder-decoder returning its cache (pytree registration)
FAST = ["bert", "bert@Dim", "llama+past", "whisper+cache"]
# every entry twice: dynamic dims as strings, and as torch.export.Dim objects ("@Dim"); each
# written file is also run at its declared dims' sizes 1, the example's, 2x and a prime, apart
# from the export's own verification (onnxmedic.sweep.sizes)
ALL: dict[str, Callable[[], ZooCase]] = {
    **{name: with_size_check(make) for name, make in {**ZOO, **DECODE}.items()},
    **{f"{name}@Dim": with_size_check(make, dims=True)
       for name, make in {**ZOO, **DECODE}.items()}}
