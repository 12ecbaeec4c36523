"""``text-generation-with-past``: a decoder as one ONNX graph serving prefill and decode, in a
folder ONNX Runtime GenAI can load, verified by greedy generation against PyTorch.

The graph (exported and verified by :func:`onnxmedic.export`) takes ``input_ids``,
``attention_mask`` (past and new tokens), ``position_ids`` and ``past_key_values.{i}.key`` /
``.value`` ([batch_size, kv_heads, past_sequence_length, head_size], length 0 at prefill) and
returns ``logits`` and ``present.{i}.key`` / ``.value`` ([..., total_sequence_length, ...]):
the names, layout and dim names of optimum's and the GenAI model builder's decoders. The folder
holds ``model.onnx`` (weights as external data for big models), ``genai_config.json``, the
model's ``config.json`` and ``generation_config.json`` and the tokenizer's files.

The folder is built in a temporary folder beside ``out_dir`` and renamed into place only when
generation is verified (hf/gen_verify.py), unless ``keep_unverified``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import torch

from onnxmedic import sandbox
from onnxmedic.findings import error, info, warning
from onnxmedic.genpackage import (
    INDEXER,
    KINDS,
    LOGITS,
    STATES,
    cache_name,
    cache_names,
    present_of,
)
from onnxmedic.hf.gen_verify import eos_ids, genai_generation, verify_generation
from onnxmedic.hf.genai_files import Layout, write_side_files
from onnxmedic.hf.tasks import accepts
from onnxmedic.onnxfile import EXTERNAL_DATA_THRESHOLD, replace_folder, staged
from onnxmedic.result import STAGES, ExportResult, stages_of

logger = logging.getLogger(__name__)

TASKS = ("text-generation-with-past",)
GRAPH = "model.onnx"
MASK_RULE = "attention_mask must cover the past and the new tokens"
# example shapes of a decoder step's export (the encoder-decoder's too): batch 2 (1 would be
# specialised), 3 new tokens after a past of 4 (a real past: the model's own cache of 4
# tokens; all different: torch.export must not tie them)
EXAMPLE_BATCH, EXAMPLE_NEW, EXAMPLE_PAST = 2, 3, 4


STATE_ATTRS = ("conv_states", "recurrent_states", "ssm_states")  # caches' non-K/V states
# the package's state kinds (genpackage.STATES) -> the attribute of transformers' cache layer
STATE_OF = dict(zip(STATES, STATE_ATTRS))
# cache layers that keep a window, not the whole past: with states, their present would not
# be past + new long (a KV-only cache is a plain DynamicCache instead, GenerationDecoder)
SLIDING = ("DynamicSlidingWindowLayer", "LinearAttentionAndSlidingWindowAttentionLayer")

STATES_NOT_GENAI = (
    "its cache holds convolution or state-space states (past.{i}.conv / .recurrent) and the "
    "graph takes one token per step, while onnxruntime-genai feeds the whole prompt at once")
INDEXER_NOT_GENAI = (
    "its cache holds a sparse attention's indexer keys (past_key_values.{i}.indexer_key), "
    "which onnxruntime-genai's config cannot name")
CacheSpec = list[tuple[int, str]]  # the cache's entries: (layer, kind) in the graph's order


def _layer_states(layer: Any) -> list[tuple[str, list[int]]]:
    """A cache layer's states: (attribute, shape) of each tensor it holds."""
    found = []
    for name in STATE_ATTRS:
        value = getattr(layer, name, None)
        values = value.values() if isinstance(value, dict) else (
            value if isinstance(value, (list, tuple)) else [value])
        found += [(name, list(t.shape)) for t in values if isinstance(t, torch.Tensor)]
    return found


# a cache layer's tensors the package carries or that are bookkeeping (the sliding-window
# layer's window as a tensor); any other is state the package has no entry for
CARRIED_ATTRS = ("keys", "values", "_sliding_window_tensor", "indexer_keys", *STATE_ATTRS)


def _extra_state(layer: Any) -> list[str]:
    """A cache layer's tensors beside its keys, values and states, "name [shape]" (a dict's
    "name[key] [shape]"): a compressed attention's compressor buffers (DeepSeek-V4's
    ``buffer_kv``, ``compressed_kv``...), or any other tensor a layer class keeps beside
    them. Scalars (counters) are left out."""
    found = []
    for name, value in sorted(vars(layer).items()):
        if name in CARRIED_ATTRS:
            continue
        items = value.items() if isinstance(value, dict) else [(None, value)]
        found += [f"{name}{'' if k is None else f'[{k}]'} {list(t.shape)}" for k, t in items
                  if isinstance(t, torch.Tensor) and t.ndim > 0]
    return found


def _linear_state(cache: Any, i: int) -> torch.Tensor | None:
    """Layer ``i``'s linear-attention state where the cache keeps it beside its layers
    (MiniMax's ``MiniMaxCache.linear_cache``), else None."""
    linear = getattr(cache, "linear_cache", None) or []
    state = linear[i] if i < len(linear) else None
    return state if isinstance(state, torch.Tensor) else None


# the layer attribute of each kind of entry that a cache layer holds as a tensor
ENTRY_ATTRS = {"key": "keys", "value": "values", INDEXER: "indexer_keys"}


def _cache_entry(cache: Any, i: int, kind: str) -> torch.Tensor | None:
    """Entry (``i``, ``kind``) of ``cache`` (a :func:`cache_spec` entry), None where layer
    ``i`` holds none of that kind: a state is held in a dict at 0; MiniMax's linear-attention
    layer holds its ``recurrent`` state alone, beside the layers (:func:`_linear_state`)."""
    layer = cache.layers[i] if i < len(cache.layers) else None
    linear = _linear_state(cache, i)
    if linear is not None:
        return linear if kind == "recurrent" else None
    if kind in ENTRY_ATTRS:
        value = getattr(layer, ENTRY_ATTRS[kind], None)
    else:
        held = getattr(layer, STATE_OF[kind], None)
        value = held.get(0) if isinstance(held, dict) else None
    return value if isinstance(value, torch.Tensor) else None


def cache_spec(cache: Any) -> CacheSpec:
    """The model's own cache (a transformers ``DynamicCache`` after a forward pass) as the
    package's entries, (layer, kind) in the graph's order: per layer its ``key`` and
    ``value`` where it holds them, its sparse attention's ``indexer_key``, then its ``conv``
    and ``recurrent`` states (MiniMax's own cache keeps a linear-attention layer's state in
    its ``linear_cache``, not in a layer: its ``recurrent``)."""
    layers = getattr(cache, "layers", None)
    if layers is None:  # legacy ((k, v), ...) tuples
        return [(i, kind) for i in range(len(cache)) for kind in KINDS]
    n = max(len(layers), len(getattr(cache, "linear_cache", None) or []))
    return [(i, kind) for i in range(n) for kind in (*KINDS, INDEXER, *STATES)
            if _cache_entry(cache, i, kind) is not None]


def has_states(spec: CacheSpec | None) -> bool:
    """Whether a cache spec holds convolution or state-space states."""
    return bool(spec) and any(kind in STATES for _, kind in spec)


def own_layers(spec: CacheSpec | None) -> bool:
    """Whether a cache spec holds more than keys and values (states, indexer keys): the
    step then rebuilds the model's own cache class (:func:`state_cache`) and names each
    entry by its kind."""
    return bool(spec) and any(kind not in KINDS for _, kind in spec)


def unsupported_states(cache: Any) -> list[str]:
    """The state layers of ``cache`` the package cannot carry ("0 LinearAttentionLayer:
    conv_states [2, 64, 3]", with the reason): several states in one layer, a sliding
    window beside states, a sparse attention's indexer positions (Qwen4-Exp's
    ``indexer_position_ids``: its indexer keys alone are carried, past_key_values.{i}.
    indexer_key), a layer
    holding neither keys nor a state (but transformers' ``DummyLayer``, which a layer keeps
    that needs no cache: an MLP or MoE layer of a hybrid such as Nemotron-H; the package has
    no entry for it), a ``DummyLayer`` in a cache of keys and values only (Gemma 3n's layers
    that read an earlier layer's keys and values), or other tensors beside the keys and values
    (:func:`_extra_state`: DeepSeek-V4's compressor buffers)."""
    said = []
    layers = getattr(cache, "layers", None) or []
    stateful = any(_layer_states(layer) for layer in layers)
    for i, layer in enumerate(layers):
        if _linear_state(cache, i) is not None:  # MiniMax's states, beside its layers
            continue  # a linear-attention layer: its state is the cache's, this layer empty
        if type(layer).__name__ == "DummyLayer":
            if not stateful:  # in a key/value cache: Gemma 3n's layers that share KV
                said.append(f"{i} DummyLayer: no keys and values of its own (a layer that "
                            "reads an earlier layer's, KV sharing), in a cache of keys and "
                            "values, which the package carries one pair per layer")
            continue
        states = _layer_states(layer)
        kv = isinstance(getattr(layer, "keys", None), torch.Tensor)
        head = f"{i} {type(layer).__name__}:"
        what = f"{head} {', '.join(f'{n} {s}' for n, s in states)}"
        positions = getattr(layer, "indexer_position_ids", None)
        if isinstance(positions, torch.Tensor):
            said.append(f"{head} indexer_position_ids {list(positions.shape)} (a sparse "
                        "attention's indexer positions beside its keys)")
        elif getattr(layer, "number_of_states", 1) > 1:
            said.append(f"{what} ({layer.number_of_states} states per layer)")
        elif states and type(layer).__name__ in SLIDING:
            said.append(f"{what} (a sliding-window attention cache beside the states)")
        elif not states and not kv:
            said.append(f"{head} no keys and no state")
        elif extra := _extra_state(layer):
            said.append(f"{head} {', '.join(extra)} (state beside the keys and values that a "
                        "step updates and the package has no entry for)")
    return said


def flat_cache(cache: Any, spec: CacheSpec | None = None) -> list[torch.Tensor]:
    """[k0, v0, k1, v1, ...] of a transformers cache (``DynamicCache`` and its layers); with
    ``spec`` (:func:`cache_spec`), its entries in that order, states included."""
    layers = getattr(cache, "layers", None)
    if spec is not None and layers is not None:
        return [_cache_entry(cache, i, kind) for i, kind in spec]
    if layers is not None:
        return [t for layer in layers for t in (layer.keys, layer.values)]
    return [t for pair in cache for t in pair[:2]]


def cache_arg(model: torch.nn.Module) -> str:
    """The keyword ``model``'s forward takes its cache by: ``past_key_values``, or Mamba's
    ``cache_params``."""
    return ("cache_params" if accepts(model, "cache_params")
            and not accepts(model, "past_key_values") else "past_key_values")


def own_cache(out: Any) -> Any:
    """The cache a forward pass returned (``past_key_values``, or Mamba's ``cache_params``)."""
    cache = getattr(out, "past_key_values", None)
    return cache if cache is not None else getattr(out, "cache_params", None)


def linear_cache_class(model: torch.nn.Module) -> type | None:
    """The cache class of ``model``'s own module that keeps linear-attention states beside
    its layers (MiniMax's ``MiniMaxCache``, ``set_linear_cache``: its forward takes no other
    cache); None for the others."""
    from transformers import DynamicCache

    module = inspect.getmodule(type(model))
    return next((c for c in vars(module).values() if isinstance(c, type)
                 and issubclass(c, DynamicCache) and hasattr(c, "set_linear_cache")), None)


def state_cache(model: torch.nn.Module, spec: CacheSpec, past: list[torch.Tensor]) -> Any:
    """The model's own cache class (``DynamicCache(config=...)``, as its forward builds one)
    holding ``past`` (entries in ``spec`` order): keys and values as a full-length layer's
    (sliding-window layers without states become plain ones: masked, not truncated), states
    as after a previous step (copies: the step updates them in place, and a graph input is
    not written), indexer keys as its ``DynamicIndexedLayer``'s (grown by concatenation);
    MiniMax's (:func:`linear_cache_class`) its layers' keys and values and its linear
    attention's states."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    linear = linear_cache_class(model)
    # MiniMax's cache is made without a config: its layers are added as they are updated
    cache = linear() if linear is not None else DynamicCache(config=model.config)
    pending: dict[int, torch.Tensor] = {}
    for (i, kind), t in zip(spec, past):
        layer = cache.layers[i] if i < len(cache.layers) else None
        if type(layer).__name__ == "DynamicSlidingWindowLayer":
            layer = cache.layers[i] = DynamicLayer()
        if kind == "key":
            pending[i] = t
        elif kind == "value":
            cache.update(pending.pop(i), t, i)
        elif linear is not None:  # a linear-attention layer's state, beside the layers
            cache.set_linear_cache(i, t.clone())
        elif kind == INDEXER:
            layer.lazy_initialization_indexer(t)
            layer.indexer_keys = t
        else:
            attr = STATE_OF[kind]
            getattr(layer, attr)[0] = t.clone()
            getattr(layer, f"is_{attr}_initialized")[0] = True
            layer.has_previous_state[0] = True
            if kind == "conv":
                layer.conv_kernel_size[0] = int(t.shape[-1])
            if layer.dtype is None:
                layer.dtype, layer.device = t.dtype, t.device
    return cache


class GenerationDecoder(torch.nn.Module):
    """The decoder as the graph's function: (input_ids, attention_mask, position_ids, [k0, v0,
    k1, v1, ...]) -> (logits, [present k0, v0, ...]). The cache is a plain ``DynamicCache``
    (full length in every layer: sliding-window layers are masked, not truncated, so every
    present is past + new tokens long, as GenAI's buffers are)."""

    def __init__(self, model: torch.nn.Module, position_ids: bool = True,
                 spec: CacheSpec | None = None) -> None:
        super().__init__()
        self.model = model
        self.takes_positions = position_ids
        # with states or indexer keys (own_layers), the model's own cache class holds the
        # past (state_cache)
        self.spec = spec if own_layers(spec) else None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor | None, past: list[torch.Tensor]
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        from transformers import DynamicCache

        # the graph's total length is past + new: torch.export keeps the relation, and
        # PyTorch rejects sizes that break it (the verification's shape variants)
        kv = next((k for k, (_, kind) in enumerate(self.spec or [(0, "key")])
                   if kind in KINDS), None)
        if kv is not None:
            torch._check(attention_mask.shape[1] == input_ids.shape[1] + past[kv].shape[2],
                         lambda: MASK_RULE)
        else:  # states only (Mamba): no attention over the past, the mask is the new tokens'
            attention_mask = attention_mask[:, -input_ids.shape[1]:]
        cache = (DynamicCache([(past[i], past[i + 1]) for i in range(0, len(past), 2)])
                 if self.spec is None else state_cache(self.model, self.spec, past))
        kw: dict[str, Any] = {"position_ids": position_ids} if self.takes_positions else {}
        kw[cache_arg(self.model)] = cache
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True,
                         **kw)
        return out.logits, flat_cache(own_cache(out), self.spec)


def _not_a_decoder(model: Any) -> str | None:
    """Why ``model`` cannot serve text-generation-with-past (None when it can)."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        return f"{type(model).__name__} is not a transformers PreTrainedModel"
    if getattr(model.config, "is_encoder_decoder", False):
        return (f"{type(model).__name__} is an encoder-decoder; text-generation-with-past "
                "takes a decoder-only model (AutoModelForCausalLM)")
    if not hasattr(model, "generate") or not getattr(model, "can_generate", lambda: False)():
        return (f"{type(model).__name__} cannot generate (it has no language-model head); "
                "load it with AutoModelForCausalLM")
    return None


NO_CACHE_SUGGESTION = (
    "Export it without a cache: --task text-generation (task='text-generation': the logits of "
    "the whole sequence, which each generation step recomputes), as PyTorch's generate() runs "
    "a model that keeps none; or, if it was trained as a decoder, set is_decoder=True in its "
    "config so that it attends causally and keeps a cache.")


def _cannot_serve(why: str, suggestion: str | None = None) -> Any:
    return error("OM817", "preflight", f"cannot export for text-generation-with-past: {why}.",
                 suggestion=suggestion or "Load the checkpoint with "
                 "transformers.AutoModelForCausalLM, or pick a task the model serves "
                 "(feature-extraction for an encoder).")


def cache_problem(model: Any) -> Any:
    """The finding when ``model``'s own cache cannot be the package's (None when it can): the
    model's own forward with its cache raises (OM830), no KV cache at all (OM817: an encoder
    loaded with a language-model head, BERT's BertLMHeadModel without is_decoder, attends both
    ways and keeps none), or layers the package cannot carry (OM827, indexer keys included:
    :func:`unsupported_states`). Convolution and state-space states are carried
    (past.{i}.conv / .recurrent, one token per step)."""
    ids = torch.full((1, 2), min(4, int(model.config.vocab_size) - 1), dtype=torch.int64)
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
        cache = own_cache(out)
        states = unsupported_states(cache)  # none in no cache
        if states:
            return error(
                "OM827", "preflight", f"cannot export {type(model).__name__} for "
                "text-generation-with-past: its own cache "
                f"({type(cache).__name__}) holds layers the package cannot carry: "
                f"{'; '.join(states)}. The package carries per layer keys and values "
                "(past_key_values.{i}.key/value) and one convolution and one state-space "
                "state (past.{i}.conv / past.{i}.recurrent), fed one token per step.",
                suggestion="Export the model without its cache (--task text-generation: "
                "every step recomputes the whole sequence), or serve it with PyTorch.",
                details={"cache": type(cache).__name__, "layers": states})
        if cache is not None and cache_spec(cache):
            return None
    except Exception as e:  # noqa: BLE001 - the model's own forward with its cache raised
        logger.debug("generation: the cache probe failed", exc_info=True)
        return error(
            "OM830", "preflight", f"{type(model).__name__} raised in PyTorch itself when "
            "called as generate() first calls it (a prompt of 2 tokens, attention_mask, "
            f"use_cache=True, its own cache created by the model): {type(e).__name__}: "
            f"{str(e)[:400]}. No package can be verified against a model that cannot keep a "
            "cache.", suggestion="Check the checkpoint's config (e.g. a hybrid model whose "
            "layer pattern leaves no attention layer: transformers' cache then cannot say "
            "its length); model.generate() on a short prompt raises the same error.",
            details={"exception": f"{type(e).__name__}: {e}"})
    hint = (" (its config has is_decoder=False: an encoder's causal-LM class so configured "
            "attends both ways and keeps no cache)"
            if getattr(model.config, "is_decoder", None) is False else "")
    return _cannot_serve(f"{type(model).__name__} returns no KV cache when called with "
                         f"use_cache=True{hint}; text-generation-with-past feeds the cache "
                         "back at each step", NO_CACHE_SUGGESTION)


def example_step(model: torch.nn.Module) -> tuple[tuple[Any, ...], tuple[Any, ...], CacheSpec]:
    """The graph's example inputs, dynamic shapes and cache spec (:func:`cache_spec`): new
    tokens after a real past of EXAMPLE_PAST tokens (the model's own cache of them). A cache
    with states takes one new token (the state-space models' code takes a previous state
    only one token at a time: the graph's sequence length is 1), a key/value cache
    EXAMPLE_NEW (any number)."""
    from torch.export import Dim

    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        probe = torch.randint(min(4, vocab - 1), vocab, (EXAMPLE_BATCH, EXAMPLE_PAST),
                              generator=g)
        out = model(input_ids=probe, attention_mask=torch.ones_like(probe), use_cache=True)
    cache = own_cache(out)
    spec = cache_spec(cache)
    states = has_states(spec)
    new = 1 if states else EXAMPLE_NEW
    total = EXAMPLE_PAST + new
    ids = torch.randint(min(4, vocab - 1), vocab, (EXAMPLE_BATCH, new), generator=g)
    mask = torch.ones(EXAMPLE_BATCH, total, dtype=torch.int64)
    past = [t.detach().clone() for t in flat_cache(cache, spec if own_layers(spec) else None)]
    pos = torch.arange(EXAMPLE_PAST, total).expand(EXAMPLE_BATCH, new).contiguous()
    b, s = Dim("batch_size"), Dim("sequence_length")
    p = Dim("past_sequence_length")
    tokens = {0: b} if states else {0: b, 1: s}
    shapes = (tokens, {0: b, 1: Dim.AUTO}, tokens,
              [{0: b} if kind in STATES else {0: b, 1: p} if kind == INDEXER else {0: b, 2: p}
               for _, kind in spec])
    return (ids, mask, pos, past), shapes, spec


def io_names(n_cache: int, spec: CacheSpec | None = None) -> tuple[list[str], list[str]]:
    """GenAI's and optimum's names: the cache inputs and the outputs, in the graph's order
    (with ``spec``, its entries' names: a state's ``past.{i}.conv``)."""
    past = ([cache_name(i, kind) for i, kind in spec] if own_layers(spec) else
            cache_names((n_cache + 1) // 2)[:n_cache])
    return past, [LOGITS] + [present_of(n) for n in past]


def rename_graph(proto: onnx.ModelProto, mapping: dict[str, str],
                 past: str = "past_sequence_length", total: str = "total_sequence_length"
                 ) -> None:
    """Rename the graph's values by ``mapping`` (old -> new: its inputs and outputs, and
    their uses); a dim of ``past`` plus the new tokens (two symbols) is GenAI's ``total``. Any
    other sum keeps its expression (a different size: gpt-oss's attention-sink column makes
    past + new + 1, which named total let ONNX Runtime reuse a buffer one column short, OM511
    at step 0)."""
    g = proto.graph
    for node in g.node:
        node.input[:] = [mapping.get(n, n) for n in node.input]
        node.output[:] = [mapping.get(n, n) for n in node.output]
    for v in list(g.input) + list(g.output) + list(g.value_info):
        v.name = mapping.get(v.name, v.name)
        for d in v.type.tensor_type.shape.dim:
            terms = [t.strip() for t in d.dim_param.split("+")] if d.dim_param else []
            if len(terms) == 2 and past in terms and not any(t.isdigit() for t in terms):
                d.dim_param = total


def rename_io(proto: onnx.ModelProto, spec: CacheSpec | None = None) -> None:
    """Rename the graph's cache inputs and its outputs (and their uses) to GenAI's names
    (``spec``: the cache's entries, :func:`io_names`); input_ids, attention_mask and
    position_ids keep theirs."""
    g = proto.graph
    n_cache = len(g.output) - 1
    past, present = io_names(n_cache, spec)
    inputs = [i.name for i in g.input]
    rename_graph(proto, {**dict(zip(inputs[len(inputs) - n_cache:], past)),
                         **dict(zip([o.name for o in g.output], present))})


def save_graph(proto: onnx.ModelProto, folder: Path, name: str = GRAPH) -> Path:
    """A package's graph as ``folder/name``; weights over EXTERNAL_DATA_THRESHOLD in
    ``name.data``."""
    path = folder / name
    big = sum(len(t.raw_data) for t in proto.graph.initializer) > EXTERNAL_DATA_THRESHOLD
    onnx.save_model(proto, path, save_as_external_data=big, all_tensors_to_one_file=True,
                    location=f"{name}.data" if big else None, size_threshold=1024)
    return path


def package_graph(raw: Path, folder: Path, spec: CacheSpec | None = None) -> None:
    """The verified graph at ``raw`` as ``folder/model.onnx`` with GenAI's names
    (:func:`rename_io`). Weights the export wrote as external data are moved,
    not read and written again (2 GiB at 0.5 B): only the graph is rewritten, its initializers
    pointing at ``model.onnx.data``."""
    proto = onnx.load(str(raw), load_external_data=False)
    rename_io(proto, spec)
    located = [e for t in proto.graph.initializer for e in t.external_data
               if e.key == "location"]
    files = {e.value for e in located}
    if len(files) != 1 or not (raw.parent / next(iter(files))).is_file():
        if files:  # several files (not what the export writes): the weights read and saved
            onnx.load_external_data_for_model(proto, str(raw.parent))
        save_graph(proto, folder)
        return
    os.replace(raw.parent / files.pop(), folder / f"{GRAPH}.data")
    for e in located:
        e.value = f"{GRAPH}.data"
    onnx.save_model(proto, folder / GRAPH)


def _decoder_graph(result: ExportResult, req: Request, tmp: Path) -> tuple[Layout | None, bool]:
    """Export and verify the decoder graph with onnxmedic.export, then give it GenAI's names
    in ``tmp/model.onnx``: its layout (its ExportedProgram as programs["decoder"]) or None
    (OM810), and whether onnxruntime-genai serves it (OM829 / OM820 where not: its cache is
    one genai_config.json cannot describe)."""
    from onnxmedic.api import export

    model = req.model
    positions = accepts(model, "position_ids")
    with result.stage("capture", conclude=False) as st:
        args, shapes, spec = example_step(model)
        if not positions:
            args, shapes = args[:2] + (None,) + args[3:], shapes[:2] + (None,) + shapes[3:]
        raw = tmp / "graph" / "decoder.onnx"
        raw.parent.mkdir()
        with warnings.catch_warnings():
            # a model without position_ids (Mamba) has a None among the example inputs, and
            # torch.onnx says its dynamic axes are not renamed: rename_io names them
            warnings.filterwarnings("ignore", message=".*different number of inputs than")
            sub = export(GenerationDecoder(model, positions, spec).eval(), args, raw,
                         dynamic_shapes=shapes, opset=req.opset, timeout=req.timeout,
                         model_spec=type(model).__name__)
    if sub.onnx_model is not None:  # a failure is reported in the package's names too
        outputs = [o.name for o in sub.onnx_model.graph.output]
        package_names(sub, dict(zip(outputs, io_names(len(outputs) - 1, spec)[1])))
    sub.findings[:] = [step_inputs_blamed(
        f, model, f"{EXAMPLE_NEW} new tokens after a past of {EXAMPLE_PAST} (the "
        "model's own cache of those tokens, fed back as a plain DynamicCache of keys and "
        "values; ", "generate() takes other steps (the prompt, then one token at a time); "
        "these inputs are onnxmedic's, not yours.", "Export the model without its cache "
        "(--task text-generation), and report the family to onnxmedic with this finding.")
        for f in sub.findings]
    merge_graph(result, sub, MASK_RULE)
    # the graph's stages' seconds; "capture" was the whole block (the example cache, the
    # graph's export)
    whole = result.timings.pop("capture", 0.0)
    result.timings.update(sub.timings)
    result.timings["graph example"] = max(0.0, whole - sum(sub.timings.values()))
    if not sub.ok:
        st.fail(error("OM810", "capture", f"the decoder graph of {type(model).__name__} "
                      "(one step with its cache) did not export and verify; the export's "
                      "findings above say why.", suggestion="Fix the first error above; "
                      "`onnxmedic.export` on GenerationDecoder(model) reproduces it."))
        return None, False
    with result.timed("package graph"):
        package_graph(raw, tmp, spec)
        shutil.rmtree(raw.parent)
    kv = [t for t, (_, kind) in zip(args[3], spec) if kind in KINDS]
    first = kv[0] if kv else torch.zeros(1, 0, 0, 0)
    problem = (STATES_NOT_GENAI if has_states(spec) else INDEXER_NOT_GENAI if own_layers(spec)
               else genai_problem(kv))
    layout = Layout(GRAPH, len({i for i, _ in spec}), int(first.shape[1]), int(first.shape[3]),
                    position_ids=positions, programs={"decoder": sub.program})
    if problem is None:
        return layout, True
    result.findings.append(warning(
        "OM829" if problem == STATES_NOT_GENAI else "OM820", "write", f"no genai_config.json: "
        f"{problem}. The package serves ONNX Runtime (onnxmedic's generation "
        "loop verifies it) but not onnxruntime-genai.",
        suggestion="Use the graph with your own generation loop ("
        + ("one token per step, the prompt too; past.{i}.conv / .recurrent in (zeros at "
           "the first token), present.{i}.conv / .recurrent out; "
           if problem == STATES_NOT_GENAI else "") + "past_key_values.{i}.key/value in, "
        "present.{i}.key/value out)."))
    return layout, False


def merge_graph(result: ExportResult, sub: ExportResult, rule: str, which: str = "") -> None:
    """A package graph's export (``sub``) in the package's result: its stages as its export
    recorded them (a stage failed in another graph stays failed), its findings but the shape
    variants that break the wrapper's ``rule`` (OM403: generation runs the graph at the
    shapes it serves instead), its comparisons (named with the graph, ``which``), its opset."""
    result.stages.update({k: v for k, v in sub.stages.items()
                          if result.stages.get(k) != "failed"})
    result.findings.extend(f for f in sub.findings
                           if not (f.code == "OM403" and rule in f.message))
    for c in sub.verification:
        c.input_set = f"{which}: {c.input_set}" if which else c.input_set
    result.verification.extend(sub.verification)
    result.opset = sub.opset


def step_inputs_blamed(finding: Any, model: Any, steps: str, why: str, suggestion: str) -> Any:
    """A graph export's finding, blaming onnxmedic's step inputs where PyTorch raised on them
    (OM100 -> OM828): the model ran before (the decoder with its own cache in the probe, an
    encoder-decoder's encoder); the inputs that fail are the example step onnxmedic built.
    ``steps`` says which inputs (the exported graph's names follow in parentheses), ``why``
    what generation takes instead."""
    if finding.code != "OM100":
        return finding
    exception = finding.details.get("exception", finding.message)
    return error(
        "OM828", finding.stage, "PyTorch raised on the decoder step's example inputs that "
        f"onnxmedic built for {type(model).__name__}: {steps}"
        f"{finding.details.get('inputs', '')}): {exception}. {why}",
        location=finding.location, suggestion=suggestion, details=dict(finding.details))


def package_names(sub: ExportResult, renamed: dict[str, str]) -> None:
    """The graph's verification and findings in the package's names (``present.0.key``, not
    the exported graph's ``cat_11``): ``renamed`` is {graph name: package name}."""
    renamed = {k: v for k, v in renamed.items() if k != v}
    if not renamed:
        return
    pattern = re.compile(r"(?<![\w.])(" + "|".join(
        re.escape(k) for k in sorted(renamed, key=len, reverse=True)) + r")(?![\w.])")
    for c in sub.verification:
        c.name = renamed.get(c.name, c.name)
    for f in sub.findings:
        f.message = pattern.sub(lambda m: renamed[m.group(1)], f.message)


def genai_problem(past: list[torch.Tensor]) -> str | None:
    """Why genai_config.json cannot describe this cache (None when it can): GenAI sizes every
    key and value buffer by one head count and one head size."""
    shapes = {(int(t.shape[1]), int(t.shape[3])) for t in past}
    if len(shapes) == 1:
        return None
    keys = sorted({(int(t.shape[1]), int(t.shape[3])) for t in past[0::2]})
    values = sorted({(int(t.shape[1]), int(t.shape[3])) for t in past[1::2]})
    return (f"its cache's (heads, head size) differ between keys {keys} and values {values} "
            "or between layers (e.g. DeepSeek's compressed attention cache), and "
            "genai_config.json has one head count and one head size for all of them")


@dataclass
class Request:
    """What export_generation was asked for: the package of ``model`` at ``out``, how it is
    made and judged. Every backend reads it (hf/backends.py)."""

    model: Any
    out: Path
    tokenizer: Any = None
    processor: Any = None  # an encoder-decoder's feature extractor (Whisper)
    steps: int = 8
    prompts: Any = None  # strings, or lists of ids (None: gen_verify.default_prompts)
    timeout: float = sandbox.DEFAULT_TIMEOUT
    verify: bool = True
    opset: int | None = None
    keep_unverified: bool = False
    optimize: bool = False  # the decoder fused where it verifies (hf/transforms/fuse_decoder.py)
    strict: bool = False  # the builder's verified package or nothing (backend "builder")


def package_result(model: Any, *before: str) -> ExportResult:
    """The result of a package's export: the stages ``before`` the export's, then
    "generate"; ``result.generation`` (gen_verify.GenerationCheck) None until verified."""
    result = ExportResult(command="export", path=None, model=type(model).__name__,
                          stages=stages_of(*before, *STAGES, "generate"))
    result.generation = None  # type: ignore[attr-defined]
    return result


def add_check(result: ExportResult, check: Any) -> None:
    """A package's generation check (gen_verify.GenerationCheck) as the result's: its
    comparisons, findings, and ``result.generation``."""
    result.verification.extend(check.comparisons)
    result.findings.extend(check.findings)
    result.generation = check  # type: ignore[attr-defined]


def export_package(result: ExportResult, req: Request,
                   torch_runs: dict[Any, Any] | None = None) -> None:
    """onnxmedic's own export of the package (the ``export`` backend), judged against
    ``torch_runs`` where PyTorch's side ran already (gen_verify.torch_side)."""
    why = _not_a_decoder(req.model)
    if why is not None:
        result.fail("preflight", _cannot_serve(why))
        return
    if not req.out.parent.is_dir():
        result.fail("write", no_folder(req.out))
        return
    with building(req) as tmp:
        problem = cache_problem(req.model)
        if problem is not None:
            result.fail("preflight", problem)
            return
        build_and_check(result, req, tmp, functools.partial(_decoder_graph, req=req, tmp=tmp),
                        lambda folder, layout, genai: verify_generation(
                            folder, req.model, req.tokenizer, steps=req.steps,
                            prompts=req.prompts, program=layout.programs["decoder"],
                            timeout=req.timeout, genai=genai, torch_runs=torch_runs))


@contextlib.contextmanager
def building(req: Request) -> Iterator[Path]:
    """A temporary folder beside the package's to build it in (removed after), the model in
    eval mode meanwhile (its mode restored after)."""
    was_training = req.model.training
    try:
        with staged(req.out) as tmp:
            req.model.eval()
            yield tmp
    finally:
        req.model.train(was_training)


def no_folder(out: Path) -> Any:
    """OM006: the package's parent folder does not exist."""
    return error("OM006", "write", f"cannot write {out}: the folder {out.parent} does not "
                 "exist.")


def build_and_check(result: ExportResult, req: Request, tmp: Path,
                    build: Callable[[ExportResult], tuple[Layout | None, bool]],
                    verify: Callable[[Path, Layout, bool], Any],
                    what: str = "generation package", processor: Any = None) -> None:
    """A package of either domain (the decoder's; the encoder-decoder's, hf/seq2seq.py) built
    in ``tmp`` and judged: ``build(result)`` exports its graphs (their layout, or None after
    its findings) and says whether onnxruntime-genai serves it; then its side files
    (``processor``'s too), ``verify(folder, layout, genai)`` (a GenerationCheck; with
    ``req.optimize``, onnxruntime-genai generates from the package that is written: the fused
    one, or this one where the fused one does not verify, :func:`_fused`), and the folder
    written when verified (:func:`finish_package`)."""
    layout, genai = build(result)
    if layout is None:
        result.findings.append(not_written(req.out, what))
        return
    result.program = layout.programs["decoder"]
    with result.stage("write", conclude=False):
        files = write_side_files(req.model, req.tokenizer, tmp, layout if genai else None,
                                 processor)
    verified = True
    if req.verify:
        with result.stage("generate") as st:
            check = verify(tmp, layout, genai and not req.optimize)
            add_check(result, check)
            if check.ok and req.optimize:
                tmp = _fused(result, req, tmp, genai, check)
            result.timings.update({f"generate: {k}": v for k, v in check.seconds.items()})
            if not check.ok:
                st.fail()
        verified = check.ok
    elif req.optimize:
        result.findings.append(not_optimized("the package is not verified (verify=False), and "
                                             "a fused package is written only when verified"))
    finish_package(result, req, tmp, files, verified, what)


def _fused(result: ExportResult, req: Request, tmp: Path, genai: bool, check: Any) -> Path:
    """The verified package in ``tmp`` fused (hf/transforms/fuse_decoder.py), verified as it
    was (in onnxruntime-genai too with ``genai``) against the PyTorch runs ``check`` made: the
    folder to write (``tmp/fused``), or ``tmp`` when the fused one does not verify (its OM735
    a warning: the plain package is written)."""
    from onnxmedic.hf.transforms.fuse_decoder import fuse_package

    with result.timed("optimize"):
        # the verdict names the package at req.out, where it is once in place
        fused = fuse_package(tmp, tmp / "fused", req.model, req.tokenizer, steps=req.steps,
                             prompts=req.prompts, genai=genai, timeout=req.timeout,
                             torch_runs=check.torch_runs, shown=str(req.out))
    if fused.ok:
        result.findings.extend(f for f in fused.findings if f.code == "OM734")
        return tmp / "fused"
    for f in fused.findings:
        if f.code == "OM735":
            result.findings.append(warning(
                "OM735", "optimize", f.message + "; the plain package is written instead.",
                suggestion="Nothing to do: the plain package is verified. Report the figures "
                "above if the fused decoder should match."))
    if genai:  # the plain package is the one written: onnxruntime-genai generates from it
        known = len(check.findings)
        genai_generation(tmp, check, req.steps, req.timeout, eos_ids(req.model))
        result.findings.extend(check.findings[known:])
    return tmp


def not_optimized(why: str) -> Any:
    """OM835: ``--optimize`` asked for a package it does not apply to; the plain package is
    exported as without it."""
    return warning("OM835", "optimize", f"the package is not optimized: {why}; it is "
                   "exported as without --optimize.")


def finish_package(result: ExportResult, req: Request, tmp: Path, files: list[str],
                   verified: bool, what: str = "generation package") -> None:
    """The write stage's end for a package built in ``tmp``: put in place as ``req.out`` when
    verified (or kept unverified on request, said in OM819), else nothing written (OM818)."""
    if not verified and not req.keep_unverified:
        result.fail("write", not_written(req.out, what))
        return
    replace_folder(tmp, req.out)
    result.record("write").passed()
    result.path = str(req.out)
    result.ok = verified and not result.errors
    result.findings.append(info(
        "OM819", "write", f"{what} written to {req.out}: {', '.join(files)}"
        + ("" if verified else " (NOT verified: keep_unverified)") + "."))


def not_written(out: Path, what: str = "generation package") -> Any:
    """OM818: the package ``out`` was not written because it is not verified."""
    return error("OM818", "write", f"the {what} was not written to {out} because it is not "
                 "verified" + (" (the existing folder is left as it was)"
                               if out.exists() else "") + ".",
                 suggestion="Fix the findings above, or pass keep_unverified=True to keep the "
                 "unverified package.")
