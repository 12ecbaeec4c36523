"""The generation package contract: one description of a decoder step, read from any package.

A generation package is a folder of ONNX graphs that a generation loop runs one step at a time
(hf/generation.py and hf/seq2seq.py write them; onnxruntime-genai's model builder and optimum
write the same layout). Its decoder graph takes

- ``input_ids`` [batch_size, sequence_length] (the new tokens),
- ``attention_mask`` [batch_size, total_sequence_length] (ones over the past and the new
  tokens; decoders only) and ``position_ids`` [batch_size, sequence_length] (past .. total-1,
  where the model takes positions),
- ``encoder_attention_mask`` (an encoder-decoder's text models) and optimum's
  ``use_cache_branch`` (its merged decoders: false at the first step),
- the cache: ``past_key_values.{i}.key`` / ``.value`` per layer ``i`` ([batch_size, kv_heads,
  past_sequence_length, head_size], length 0 at the first step); an encoder-decoder has
  ``past_key_values.{i}.decoder.*`` (the self-attention cache) and ``.encoder.*`` (the
  cross-attention cache, the encoder graph's ``present.{i}.encoder.*`` outputs),

- a layer's states other than keys and values (convolution and state-space models: LFM2,
  Mamba, Mamba-2, Falcon-H1, ...), named as onnxruntime-genai's builder names them:
  ``past.{i}.conv`` (the causal convolution's window, [batch_size, channels, kernel]) and
  ``past.{i}.recurrent`` (the state-space state, [batch_size, ...] as the model's own cache
  class holds it); zeros at the first step. A layer may hold keys and values and states
  (Falcon-H1's attention beside its Mamba-2 mixer): each is one entry of the cache, in
  layer order, ``key``, ``value``, ``conv``, ``recurrent`` within a layer,
- a sparse attention's indexer keys (DeepSeek Sparse Attention: AXK2, HY-V4, DeepSeek-V3.2,
  transformers' ``DynamicIndexedLayer``): ``past_key_values.{i}.indexer_key`` after the
  layer's key and value, [batch_size, past_sequence_length, index_head_size] (one head, its
  sequence axis the second), length 0 at the first step, grown by the new tokens as a key,

and returns ``logits`` and ``present.{i}.key`` / ``.value`` (``present.{i}.decoder.*``), the
cache grown by the new tokens (``present.{i}.indexer_key`` too; full length also in
sliding-window layers: they are masked, not truncated), and ``present.{i}.conv`` /
``.recurrent``, the states after the new tokens. A graph whose ``input_ids`` has a fixed
sequence length of 1 takes one token per step (:attr:`StepLayout.step_tokens`; what a
package with states is: the state-space models' own code takes a previous state only one token at a time): the loop feeds a prompt token by
token, its logits being the concatenation of those steps'. A decoder-step file without these
names (bench/zoo/hf.py's ``DecodeStep``: ``input_ids`` and the flat past ``[k0, v0, k1, v1,
...]`` in, ``logits`` and the present in the same order out) is read by position.

The cache's head count and head size may be symbolic in the graph (the builder's
``kv_cache_dim``): they are then taken from the folder's ``genai_config.json``
(``num_key_value_heads``, ``head_size``) or the model's ``config.json``
(``num_key_value_heads`` or ``num_attention_heads``, ``head_dim`` or hidden / heads; MLA's
different key and value sizes ``qk_nope_head_dim + qk_rope_head_dim`` and ``v_head_dim``).

Everything that names, feeds or inspects a package's cache goes through this module
(:func:`read_step`, :meth:`StepLayout.feed`, :meth:`StepLayout.presents`); it imports neither
torch nor the rest of onnxmedic, so the children that score a candidate read it cheaply.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
ENCODER_ATTENTION_MASK = "encoder_attention_mask"
USE_CACHE_BRANCH = "use_cache_branch"  # optimum's merged decoders (if past then ... else ...)
LOGITS = "logits"
PAST, PRESENT = "past_key_values", "present"
KINDS = ("key", "value")
INDEXER = "indexer_key"  # a sparse attention's indexer keys, [batch, past, size] (one head)
STATES = ("conv", "recurrent")  # the kinds of a layer's cache that are states, not K/V
STATE_PAST, STATE_PRESENT = "past", "present"  # onnxruntime-genai's past.%d.conv
SELF, CROSS = "decoder", "encoder"  # the parts of an encoder-decoder's cache
# the decoder graph's file, by who wrote the package: ours and the builder's, optimum's
DECODER_FILES = ("model.onnx", "decoder_with_past_model.onnx", "decoder_model_merged.onnx")
ENCODER_FILE = "encoder_model.onnx"

_CACHE = re.compile(rf"^({PAST}|{PRESENT})\.(\d+)\.(?:({SELF}|{CROSS})\.)?(key|value|{INDEXER})$")
_STATE = re.compile(rf"^({STATE_PAST}|{STATE_PRESENT})\.(\d+)\.({'|'.join(STATES)})$")


class NotAStep(ValueError):
    """The graph is not a decoder step this contract can feed (the message says why)."""


def cache_name(layer: int, kind: str, part: str | None = None, *, present: bool = False
               ) -> str:
    """``past_key_values.{layer}[.{part}].{kind}`` (``present.`` with ``present``); a state
    (``kind`` in STATES): ``past.{layer}.{kind}`` (``present.{layer}.{kind}``)."""
    if kind in STATES:
        return f"{STATE_PRESENT if present else STATE_PAST}.{layer}.{kind}"
    return f"{PRESENT if present else PAST}.{layer}.{f'{part}.' if part else ''}{kind}"


def cache_names(n_layers: int, part: str | None = None, *, present: bool = False
                ) -> list[str]:
    """The flat cache names ``[k0, v0, k1, v1, ...]`` of ``n_layers`` layers."""
    return [cache_name(i, kv, part, present=present) for i in range(n_layers) for kv in KINDS]


def genai_pattern(kind: str, part: str | None = None, *, present: bool = False) -> str:
    """onnxruntime-genai's name pattern of a cache (``past_key_values.%d.key``)."""
    return cache_name(0, kind, part, present=present).replace(".0.", ".%d.", 1)


def parse_cache_name(name: str) -> tuple[str, int, str | None, str] | None:
    """(``past_key_values`` or ``present``, layer, part or None, kind) of a cache name (kind:
    ``key``/``value``, or a state's ``conv``/``recurrent``: ``past.{i}.conv`` reads as
    ``past_key_values``); None when ``name`` is not one."""
    m = _CACHE.match(name)
    if m:
        return (m[1], int(m[2]), m[3], m[4])
    m = _STATE.match(name)
    return ((PAST if m[1] == STATE_PAST else PRESENT), int(m[2]), None, m[3]) if m else None


def is_past(name: str) -> bool:
    """Whether ``name`` is a cache input (``past_key_values.*``, or a state's ``past.{i}.*``):
    one that has a ``present`` twin (:func:`present_of`)."""
    return present_of(name) != name


def present_of(past: str) -> str:
    """The output that returns the cache input ``past`` grown (its ``present.*`` twin)."""
    if past.startswith(f"{PAST}."):
        return PRESENT + past[len(PAST):]
    m = _STATE.match(past)
    return f"{STATE_PRESENT}.{m[2]}.{m[3]}" if m and m[1] == STATE_PAST else past


@dataclass
class CacheEntry:
    """One cache input: its name, the output that returns it grown (None: a cross-attention
    cache, which no step grows), its layer, kind, part and its head count and head size (None
    where neither the graph nor the folder's configs say); a state's (``kind`` in STATES)
    ``shape``: its fixed dims after the batch."""

    name: str
    present: str | None
    layer: int
    kind: str
    part: str | None = None
    heads: int | None = None
    head_size: int | None = None
    dtype: str = "float32"
    shape: list[int] | None = None

    @property
    def cross(self) -> bool:
        return self.part == CROSS

    @property
    def state(self) -> bool:
        """Whether the entry is a convolution or state-space state (not keys or values)."""
        return self.kind in STATES

    @property
    def indexer(self) -> bool:
        """Whether the entry is a sparse attention's indexer keys ([batch, past, size])."""
        return self.kind == INDEXER


@dataclass
class StepLayout:
    """A decoder step's inputs and outputs as the contract reads them (:func:`read_step`):
    the graph's inputs and outputs in order, its cache in input order, and whether it names
    them as a package does (False: a flat decoder-step file, read by position)."""

    inputs: list[str]
    outputs: list[str]
    cache: list[CacheEntry]
    named: bool = True
    sizes_from: str = ""  # where symbolic head sizes were read (a config file), "" if none
    context: int | None = None  # the longest past + new the package serves (its configs')
    step_tokens: int | None = None  # 1: the graph takes one token per step (None: any number)

    @property
    def past(self) -> list[str]:
        """Every cache input's name, in input order."""
        return [c.name for c in self.cache]

    @property
    def self_cache(self) -> list[CacheEntry]:
        """The cache a step grows (every entry but an encoder-decoder's cross cache)."""
        return [c for c in self.cache if not c.cross]

    @property
    def cross_cache(self) -> list[CacheEntry]:
        return [c for c in self.cache if c.cross]

    @property
    def states(self) -> list[CacheEntry]:
        """The cache's convolution and state-space states (no sequence axis)."""
        return [c for c in self.cache if c.state]

    def unsized(self) -> list[str]:
        """The cache inputs whose head count or head size is unknown."""
        return [c.name for c in self.self_cache if not c.state and not (
            c.head_size if c.indexer else c.heads and c.head_size)]

    def past_length(self, past: Sequence[np.ndarray]) -> int | None:
        """The tokens behind the cache ``past`` (in :attr:`self_cache` order): a key or
        value's length; None when it has none (states only: the loop counts the tokens)."""
        for c, t in zip(self.self_cache, past):
            if not c.state:
                return int(t.shape[1 if c.indexer else 2])
        return None

    def empty_past(self, batch: int = 1) -> list[np.ndarray]:
        """The self-attention cache of the first step: length 0, in input order (see
        :meth:`past_of`)."""
        return self.past_of(0, batch)

    def past_of(self, length: int, batch: int = 1, seed: int | None = None
                ) -> list[np.ndarray]:
        """A self cache of ``length`` positions in :attr:`self_cache` order (random normal
        values from ``seed``; zeros when None): keys, values and indexer keys ``length``
        long, states in their fixed shapes; raises :class:`NotAStep` when a head count or
        size is neither in the graph nor in a config."""
        if self.unsized():
            raise NotAStep(f"the cache inputs {', '.join(self.unsized()[:4])} have a symbolic "
                           "head count or head size and no genai_config.json or config.json "
                           "beside the graph says it")
        rng = np.random.default_rng(seed) if seed is not None else None
        out = []
        for c in self.self_cache:
            shape = ((batch, *c.shape) if c.state else
                     (batch, length, c.head_size) if c.indexer else
                     (batch, c.heads, length, c.head_size))
            out.append(rng.standard_normal(shape).astype(c.dtype) if rng is not None
                       else np.zeros(shape, np.dtype(c.dtype)))
        return out

    def chunks(self, ids: np.ndarray | Sequence[int]) -> list[np.ndarray]:
        """The new tokens ``ids`` ([batch, n] or a list for batch 1) as the graph takes them:
        one step of all of them, or one step per token where the graph takes one
        (:attr:`step_tokens`: a cache with states); a step's logits are its steps'
        concatenated along the sequence, its cache the last step's."""
        ids = np.atleast_2d(np.asarray(ids, np.int64))
        if self.step_tokens == 1:
            return [ids[:, i:i + 1] for i in range(ids.shape[1])]
        return [ids]

    def feed(self, ids: np.ndarray | Sequence[int], past: Sequence[np.ndarray] | None = None,
             *, cross: Mapping[str, np.ndarray] | None = None,
             encoder_mask: np.ndarray | None = None, past_length: int | None = None
             ) -> dict[str, np.ndarray]:
        """The feeds of one step: ``ids`` (the new tokens, [batch, n] or a list for batch 1)
        after ``past`` (the self cache in :attr:`self_cache` order, as :meth:`presents`
        returns it; None: the first step, an empty past); ``cross``: the encoder graph's
        outputs (its ``present.{i}.encoder.*``), ``encoder_mask`` its attention mask;
        ``past_length``: the tokens behind ``past`` (needed where the cache is states only,
        which have no sequence axis; else read from a key's length)."""
        ids = np.atleast_2d(np.asarray(ids, np.int64))
        if self.step_tokens and ids.shape[1] != self.step_tokens:
            raise NotAStep(f"the graph takes {self.step_tokens} token(s) per step, not "
                           f"{ids.shape[1]}: feed a prompt token by token")
        first = past is None
        past = list(past) if past is not None else self.empty_past(ids.shape[0])
        if not self.named:
            return dict(zip(self.inputs, [ids, *past]))
        if past_length is None:
            past_length = 0 if first else self.past_length(past)
        if past_length is None and any(n in self.inputs for n in (ATTENTION_MASK, POSITION_IDS)):
            raise NotAStep("the cache has no sequence axis (states only): pass past_length, "
                           "the tokens behind it")
        total = (past_length or 0) + ids.shape[1]
        feeds: dict[str, np.ndarray] = {INPUT_IDS: ids}
        if ATTENTION_MASK in self.inputs:
            feeds[ATTENTION_MASK] = np.ones((ids.shape[0], total), np.int64)
        if POSITION_IDS in self.inputs:
            feeds[POSITION_IDS] = np.broadcast_to(
                np.arange(total - ids.shape[1], total, dtype=np.int64), ids.shape).copy()
        if ENCODER_ATTENTION_MASK in self.inputs and encoder_mask is not None:
            feeds[ENCODER_ATTENTION_MASK] = encoder_mask
        if USE_CACHE_BRANCH in self.inputs:
            feeds[USE_CACHE_BRANCH] = np.asarray([total > ids.shape[1]])
        feeds.update(zip([c.name for c in self.self_cache], past))
        for c in self.cross_cache:
            if cross is None:
                raise NotAStep(f"{c.name}: an encoder-decoder's step needs the encoder's "
                               "cross-attention cache")
            feeds[c.name] = cross[present_of(c.name)]
        return feeds

    def presents(self, outputs: Mapping[str, np.ndarray] | Sequence[np.ndarray]
                 ) -> list[np.ndarray]:
        """The grown self cache of a step's ``outputs`` (by name, or the run's list in output
        order), in the order :meth:`feed` takes it back."""
        if not isinstance(outputs, Mapping):
            outputs = dict(zip(self.outputs, outputs))
        return [outputs[c.present] for c in self.self_cache if c.present]

    def logits(self, outputs: Mapping[str, np.ndarray] | Sequence[np.ndarray]) -> np.ndarray:
        """The logits of a step's outputs (by name, or the run's list in output order)."""
        if not isinstance(outputs, Mapping):
            return outputs[self.outputs.index(LOGITS) if LOGITS in self.outputs else 0]
        return outputs[LOGITS if LOGITS in outputs else self.outputs[0]]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form (:meth:`from_dict` reads it back): a child scoring a candidate
        file that has no configs beside it reads the sizes from here."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StepLayout:
        return cls(**{**d, "cache": [CacheEntry(**c) for c in d["cache"]]})


def _dims(value: Any) -> list[int | None]:
    return [d.dim_value if d.HasField("dim_value") else None
            for d in value.type.tensor_type.shape.dim]


def read_step(path: str | os.PathLike[str], config_dir: str | os.PathLike[str] | None = None
              ) -> StepLayout:
    """The :class:`StepLayout` of the decoder-step graph at ``path`` (only its graph is read,
    not its weights), symbolic head sizes taken from ``config_dir``'s (default: the graph's
    folder) genai_config.json or config.json; raises :class:`NotAStep` when the graph is
    neither a package's decoder nor a flat decoder step."""
    import onnx
    from onnx import helper

    path = Path(path)
    graph = onnx.load(str(path), load_external_data=False).graph
    inits = {i.name for i in graph.initializer}
    ins = [i for i in graph.input if i.name not in inits]
    outs = [o.name for o in graph.output]
    pasts = [i for i in ins if is_past(i.name)]
    named = bool(pasts)
    if not named:  # a flat decoder step: input_ids, then the cache; logits, then the present
        if len(ins) < 2 or len(outs) != len(ins):
            raise NotAStep(f"{path}: not a decoder step (input_ids + past -> logits + "
                           f"present): {len(ins)} inputs, {len(outs)} outputs")
        pasts = ins[1:]
    cache = []
    for k, i in enumerate(pasts):
        dims = _dims(i)
        parsed = parse_cache_name(i.name)
        layer, part, kind = parsed[1:] if parsed else (k // 2, None, KINDS[k % 2])
        entry = CacheEntry(i.name, present_of(i.name) if named else outs[k + 1], layer, kind,
                           dtype=np.dtype(helper.tensor_dtype_to_np_dtype(
                               i.type.tensor_type.elem_type)).name)
        if kind in STATES:
            if any(d is None for d in dims[1:]):
                raise NotAStep(f"{path}: the state input {i.name!r} has symbolic dims after "
                               f"the batch ({dims}): a state's size is fixed")
            entry.shape = [int(d) for d in dims[1:]]
        elif kind == INDEXER:
            if len(dims) != 3:
                raise NotAStep(f"{path}: the indexer key input {i.name!r} has {len(dims)} "
                               "dims, not (batch, past, size)")
            entry.head_size = dims[2]
        elif len(dims) != 4:
            raise NotAStep(f"{path}: cache input {i.name!r} has {len(dims)} dims, not (batch, "
                           "heads, past, head_size)")
        else:
            entry.part, entry.heads, entry.head_size = part, dims[1], dims[3]
            entry.present = entry.present if part != CROSS else None
        cache.append(entry)
    missing = [c.present for c in cache if c.present and c.present not in outs]
    if missing:
        raise NotAStep(f"{path}: the cache inputs have no present outputs ({missing[:2]})")
    ids = next((i for i in ins if i.name == INPUT_IDS), ins[0])  # (ins: two at least)
    layout = StepLayout([i.name for i in ins], outs, cache, named,
                        step_tokens=1 if _dims(ids)[1:] == [1] else None)
    folder = Path(config_dir) if config_dir else path.parent
    sizes, source = config_sizes(folder) if layout.unsized() else ({}, "")
    if sizes:
        layout.sizes_from = str(folder / source)
        logger.debug("package: the cache's head sizes from %s", layout.sizes_from)
    for c in layout.self_cache:
        # a state's shape is fixed in the graph, as is an indexer's size (no config names it)
        if sizes and not (c.state or c.indexer):
            heads, size = sizes[c.kind]
            c.heads, c.head_size = c.heads or heads, c.head_size or size
    layout.context = context_length(folder)
    return layout


def decoder_graph(folder: str | os.PathLike[str]) -> Path:
    """The decoder graph of the package ``folder`` (ours and the builder's ``model.onnx``,
    optimum's ``decoder_with_past_model.onnx`` or ``decoder_model_merged.onnx``; the
    ``decoder.filename`` of its genai_config.json first)."""
    folder = Path(folder)
    cfg = read_json(folder, "genai_config.json", "model", "decoder")
    names = ([cfg["filename"]] if cfg and cfg.get("filename") else []) + list(DECODER_FILES)
    for name in names:
        if (folder / name).is_file():
            return folder / name
    raise NotAStep(f"{folder}: no decoder graph ({', '.join(DECODER_FILES)})")


def read_package(folder: str | os.PathLike[str]) -> StepLayout:
    """The :class:`StepLayout` of the package ``folder``'s decoder (:func:`decoder_graph`)."""
    return read_step(decoder_graph(folder), folder)


def read_json(folder: Path, name: str, *keys: str) -> Any:
    """``folder / name``'s JSON, down ``keys``; None when the file, a key or the JSON is
    missing."""
    try:
        value = json.loads((folder / name).read_text())
        for key in keys:
            value = value[key]
        return value
    except (OSError, KeyError, TypeError, ValueError):
        return None


def context_length(folder: str | os.PathLike[str]) -> int | None:
    """The longest sequence the package serves: its genai_config.json's ``context_length``,
    else config.json's ``max_position_embeddings``; None when neither says."""
    folder = Path(folder)
    with contextlib.suppress(TypeError, ValueError):
        return int(read_json(folder, "genai_config.json", "model", "context_length"))
    try:
        cfg = read_json(folder, "config.json")
        cfg = cfg.get("text_config") or cfg
        n = cfg.get("max_position_embeddings") or cfg.get("n_positions")
        return int(n) if n else None
    except (AttributeError, ValueError, TypeError):
        return None


def config_sizes(folder: str | os.PathLike[str]) -> tuple[dict[str, tuple[int, int]], str]:
    """The cache's (heads, head size) per kind (``key``, ``value``) from ``folder``'s
    genai_config.json, else its config.json (the text config of a multimodal one; MLA's
    key and value sizes), and the file they came from; ({}, "") when neither says."""
    folder = Path(folder)
    with contextlib.suppress(KeyError, TypeError, ValueError):
        dec = read_json(folder, "genai_config.json", "model", "decoder")
        heads, size = int(dec["num_key_value_heads"]), int(dec["head_size"])
        return dict.fromkeys(KINDS, (heads, size)), "genai_config.json"
    cfg = read_json(folder, "config.json")
    sizes = cache_sizes(cfg) if cfg is not None else {}
    return sizes, "config.json" if sizes else ""


def cache_sizes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """The cache's (heads, head size) per kind (``key``, ``value``) of a model's config (the
    ``config.json`` dict; a multimodal one's text config): ``num_key_value_heads`` or the
    attention heads, ``head_dim`` (``d_kv``) or hidden / heads; MLA's key and value sizes.
    {} when the config does not say."""
    cfg = config.get("text_config") or config
    heads = (cfg.get("num_attention_heads") or cfg.get("n_head") or cfg.get("num_heads")
             or cfg.get("decoder_attention_heads"))
    kv = cfg.get("num_key_value_heads") or heads
    if not kv:
        return {}
    if cfg.get("v_head_dim") and cfg.get("qk_rope_head_dim") is not None:  # MLA
        key = int(cfg.get("qk_nope_head_dim") or 0) + int(cfg["qk_rope_head_dim"])
        value = cfg["v_head_dim"]
    else:
        hidden = cfg.get("hidden_size") or cfg.get("n_embd") or cfg.get("d_model")
        key = value = (cfg.get("head_dim") or cfg.get("d_kv")
                       or (hidden // heads if hidden and heads else None))
    if not value:
        return {}
    return {"key": (int(kv), int(key)), "value": (int(kv), int(value))}

