"""A generation package of a decoder the onnxruntime-genai builder does not serve (GPT-NeoX),
made without tracing every layer: one decoder layer is exported and verified, then stamped
once per layer of the checkpoint, each copy's weights streamed from the safetensors into the
package's external data (never the whole model in memory).

1. **Three graphs, each exported and verified by :func:`onnxmedic.export`** (PyTorch against
   ONNX Runtime on the example inputs, the float64 budget): the *prelude* (the token
   embedding, the additive causal mask over the past and new tokens, the rotary embedding's
   cos and sin: transformers' own ``rotary_emb``), one *decoder layer* (transformers' own
   layer class, its cache one ``DynamicCache`` layer: hidden, mask, cos, sin, past key and
   value in; hidden, present key and value out) and the *head* (the final norm, the output
   projection). Every weight is an input of its graph (``torch.func.functional_call``), so
   that each graph is a function of its weights: the layer graph is the same for every layer
   and its weights are the checkpoint's tensors, named as in the checkpoint. The examples'
   weights are the checkpoint's (layer 0's; at most :data:`EXAMPLE_ROWS` rows of the
   embedding and the head, whose graphs do not depend on the vocabulary's size).
2. **The package's graph** (:func:`assemble`): the prelude, the layer graph once per layer
   (its values renamed ``layers.{i}/...``, its hidden input the previous copy's output, its
   cache the package contract's ``past_key_values.{i}.*`` / ``present.{i}.*``:
   genpackage.py), the head; each weight input becomes an initializer named as the
   checkpoint's tensor, a weight the graph only transposes (a linear layer's) stored
   transposed (MatMul's constant operand: what the int4 quantizer takes). The weights are
   read one tensor at a time (hf/stream.py's :class:`~onnxmedic.hf.stream.Weights`),
   upcast to float32 and appended to ``model.onnx.data``.
3. **Verification**: the whole package against the checkpoint streamed
   (hf/stream.py's :func:`~onnxmedic.hf.stream.verify_package`: greedy generation token for
   token, each step's logits within the float64 budget, then onnxruntime-genai), or at int4
   the streamed int4 road's judgement (hf/transforms/stream_int4.py's
   :func:`~onnxmedic.hf.transforms.stream_int4.int4_streamed`). A layer stamped with the
   wrong weights (two layers swapped) is caught there.

The package is written at ``out`` only when verified (built beside it, renamed into place).

Memory: one layer's weights (float32) and the example's slices while exporting; one tensor
while stamping; then the verification's (hf/stream.py: one layer, one ONNX Runtime session).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from onnxmedic.findings import error, info
from onnxmedic.genpackage import KINDS, LOGITS, cache_name, cache_names, cache_sizes
from onnxmedic.hf import builder, report_to
from onnxmedic.hf.checkpoint import has_tokenizer
from onnxmedic.hf.genai_files import Layout, write_side_files
from onnxmedic.hf.stream import LAYOUTS, Weights, streamable, verify_package
from onnxmedic.hf.transforms.stream_int4 import (
    append_external,
    int4_streamed,
    large_folder,
    side_files,
    take_verdict,
)

logger = logging.getLogger(__name__)

FAMILIES = frozenset({"gpt_neox"})  # families stamped (their parts: hf/stream.py's LAYOUTS)
EXAMPLE_ROWS = 4096  # rows of the embedding and the head in their graphs' examples
DATA = "model.onnx.data"
STAGE = "export"


# ------------------------------------------------------------------------------------------
# 1. the three graphs


class Prelude(torch.nn.Module):
    """(input_ids, attention_mask, position_ids, embedding) -> (hidden, mask, cos, sin): the
    token embedding, the additive mask [batch, 1, new, total] (a key is seen where it is not
    after the query's position and attention_mask is 1), the rotary embedding's cos and sin
    (the model's own ``rotary_emb``)."""

    def __init__(self, rotary: torch.nn.Module) -> None:
        super().__init__()
        self.rotary = rotary

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor, embedding: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        hidden = torch.nn.functional.embedding(input_ids, embedding)
        new, total = input_ids.shape[1], attention_mask.shape[1]
        query = torch.arange(new) + (total - new)
        allowed = (torch.arange(total)[None, :] <= query[:, None])[None, None] & (
            attention_mask[:, None, None, :] > 0)
        mask = torch.zeros(allowed.shape, dtype=hidden.dtype).masked_fill(
            ~allowed, torch.finfo(hidden.dtype).min)
        cos, sin = self.rotary(hidden, position_ids)
        return hidden, mask, cos, sin


class LayerStep(torch.nn.Module):
    """One decoder layer (transformers' own, its attention's cache index 0) as a function of
    its weights: (hidden, mask, cos, sin, past key, past value, weights in ``names`` order)
    -> (hidden, present key, present value)."""

    def __init__(self, layer: torch.nn.Module, names: list[str]) -> None:
        super().__init__()
        self.layer, self.names = layer, names

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, past_key: torch.Tensor, past_value: torch.Tensor,
                weights: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        from transformers import DynamicCache

        cache = DynamicCache([(past_key, past_value)])
        out = torch.func.functional_call(
            self.layer, dict(zip(self.names, weights)), (hidden,),
            {"attention_mask": mask, "position_embeddings": (cos, sin), "layer_past": cache,
             "use_cache": True})
        out = out[0] if isinstance(out, tuple) else out
        return out, cache.layers[0].keys, cache.layers[0].values


class Head(torch.nn.Module):
    """(hidden, the final norm's weights in ``names`` order, the output projection) ->
    logits."""

    def __init__(self, norm: torch.nn.Module, names: list[str]) -> None:
        super().__init__()
        self.norm, self.names = norm, names

    def forward(self, hidden: torch.Tensor, weights: list[torch.Tensor],
                projection: torch.Tensor) -> torch.Tensor:
        normed = torch.func.functional_call(self.norm, dict(zip(self.names, weights)),
                                            (hidden,))
        return torch.nn.functional.linear(normed, projection)


@dataclass
class Part:
    """A graph exported and verified: its ONNX model, and the checkpoint tensor each weight
    input takes (input name -> checkpoint name, ``{i}`` for the layer)."""

    name: str
    proto: Any
    weights: dict[str, str]


@dataclass
class Stamped:
    """The outcome of :func:`stamp_package`: ``parts`` exported (by name), ``layers`` stamped,
    ``seconds`` per phase, ``findings`` (the parts' exports' where one failed)."""

    ok: bool = False
    parts: dict[str, Part] = field(default_factory=dict)
    layers: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    findings: list[Any] = field(default_factory=list)


def _example(weights: Any, name: str, rows: int | None = None) -> torch.Tensor:
    """The checkpoint's tensor ``name`` (its first ``rows`` rows, read without the rest;
    None: all) in float32."""
    return weights.get(name, None if rows is None else (0, rows)).to(torch.float32).clone()


class Geometry(NamedTuple):
    """The config's layers, cache heads and head size (the package contract's reading:
    genpackage.cache_sizes) and vocabulary."""

    layers: int
    kv_heads: int
    head_size: int
    vocab: int


def geometry(config: Any) -> Geometry:
    """The :class:`Geometry` of a transformers config; ValueError where it gives keys and
    values no one (heads, head size) (MLA: not stamped)."""
    sizes = cache_sizes(config.to_dict())
    if not sizes or sizes["key"] != sizes["value"]:
        raise ValueError(f"onnxmedic.hf.stamp: the config of {config.model_type!r} gives no "
                         f"one (heads, head size) of its cache ({sizes or 'none'})")
    return Geometry(int(config.num_hidden_layers), *sizes["key"], int(config.vocab_size))


def export_parts(folder: Path, config: Any, work: Path, timeout: float,
                 shape: Geometry) -> Stamped:
    """The prelude, one decoder layer and the head of the checkpoint ``folder`` exported and
    verified by onnxmedic.export in ``work`` (see the module docstring, step 1); ``shape``:
    :func:`geometry` of ``config``."""
    from torch.export import Dim
    from transformers import AutoModelForCausalLM


    layout = LAYOUTS[config.model_type]
    config._attn_implementation = "eager"  # the prelude's additive mask, no kernel choice
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    base = getattr(model, layout.base)
    weights = Weights(folder)
    res = Stamped()
    g = torch.Generator().manual_seed(0)
    batch, new, past = 2, 3, 4
    rows = min(shape.vocab, EXAMPLE_ROWS)
    b, s, t, p = (Dim("batch_size"), Dim("sequence_length"), Dim("total_sequence_length"),
                  Dim("past_sequence_length"))
    embed = layout.names("embed") + "weight"
    head = layout.head if layout.head in weights else embed

    rotary = type(base.rotary_emb)(config=config)
    ids = torch.randint(0, rows, (batch, new), generator=g)
    mask = torch.ones(batch, past + new, dtype=torch.int64)
    mask[1, 0] = 0  # a padded key: the mask's rule exercised
    positions = torch.arange(past, past + new).expand(batch, new).contiguous()
    prelude = Prelude(rotary).eval()
    args: tuple[Any, ...] = (ids, mask, positions, _example(weights, embed, rows))
    part = functools.partial(_export_part, res, work=work, timeout=timeout,
                             model=type(model).__name__)
    if not part("prelude", prelude, args, ({0: b, 1: s}, {0: b, 1: t}, {0: b, 1: s}, None),
                {"embedding": embed}):
        return res
    with torch.no_grad():  # the layer's and the head's example inputs (it ran in the export)
        hidden, add_mask, cos, sin = prelude(*args)

    layer = getattr(base, layout.layers)[0]
    prefix = layout.names("layers")
    names = list(layer.state_dict().keys())
    layer_w = [_example(weights, f"{prefix}0.{n}") for n in names]
    layer = type(layer)(config, 0)  # on the CPU: functional_call gives it its weights
    past_kv = [torch.randn(batch, shape.kv_heads, past, shape.head_size, generator=g)
               for _ in range(2)]
    if not part("layer", LayerStep(layer, names).eval(),
                (hidden, add_mask, cos, sin, *past_kv, layer_w),
                ({0: b, 1: s}, {0: b, 2: s, 3: t}, {0: b, 1: s}, {0: b, 1: s}, {0: b, 2: p},
                 {0: b, 2: p}, [None] * len(names)),
                {f"weights_{k}": f"{prefix}{{i}}.{n}" for k, n in enumerate(names)}):
        return res
    del layer_w

    norm = getattr(base, layout.norm)
    norm_names = list(norm.state_dict().keys())
    # on the CPU (functional_call gives it its weights): GPT-NeoX's final norm, a LayerNorm
    norm = torch.nn.LayerNorm(norm.normalized_shape, norm.eps, norm.elementwise_affine)
    if not part("head", Head(norm, norm_names).eval(),
                (hidden, [_example(weights, layout.names("norm") + n) for n in norm_names],
                 _example(weights, head, rows)),
                ({0: b, 1: s}, [None] * len(norm_names), None),
                {**{f"weights_{k}": layout.names("norm") + n for k, n in enumerate(norm_names)},
                 "projection": head}):
        return res
    res.ok = True
    return res


def _export_part(res: Stamped, name: str, module: torch.nn.Module, args: tuple[Any, ...],
                 shapes: Any, bound: dict[str, str], work: Path, timeout: float,
                 model: str) -> bool:
    """One part exported and verified by onnxmedic.export into ``work`` and kept in ``res``
    (True), or its findings and OM850 in ``res`` (False)."""
    from onnxmedic.api import export

    t0 = time.perf_counter()
    f = work / f"{name}.onnx"
    with warnings.catch_warnings():
        # the weights (a list) have no dynamic dims: torch.onnx says it renames none of theirs
        warnings.filterwarnings("ignore", message=".*different number of inputs than")
        sub = export(module, args, f, dynamic_shapes=shapes, timeout=timeout,
                     model_spec=f"{model} {name}")
    res.seconds[f"export {name}"] = time.perf_counter() - t0
    if sub.ok and sub.onnx_model is not None:
        res.parts[name] = Part(name, onnx.load(str(f), load_external_data=True), bound)
        return True
    res.findings.extend(sub.findings)
    res.findings.append(error(
        "OM850", STAGE, f"the {name} graph of {model} (exported once and stamped per "
        "layer) did not export and verify; the export's findings above say why.",
        suggestion="Fix the first error above, or export the model whole: `onnxmedic export "
        "hf:DIR --task text-generation-with-past` on a checkpoint under the stamping size."))
    return False


# ------------------------------------------------------------------------------------------
# 2. the package's graph


@dataclass
class Weight:
    """An initializer of the package: its name, the checkpoint tensor it holds, and whether
    it is stored transposed (the graph only transposed it)."""

    name: str
    source: str
    transposed: bool


def _copy(part: Part, prefix: str, binds: dict[str, str], layer: int | None,
          weights: list[Weight], seen: dict[tuple[str, bool], str]) -> list[Any]:
    """``part``'s nodes renamed for the package: its inputs and outputs by ``binds`` (its
    name -> the package's), each weight input an initializer (``weights``, made once per
    tensor and orientation: ``seen``), a weight only transposed the transposed initializer
    (the Transpose dropped), its constants ``{part.name}/`` (the same for every copy), every
    other value ``prefix``."""
    g = part.proto.graph
    mapping = dict(binds)
    consumers: dict[str, list[Any]] = {}
    for node in g.node:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
               for a in node.attribute):
            raise ValueError(f"onnxmedic.hf.stamp: the {part.name} graph has a control-flow "
                             f"node ({node.op_type}), which is not stamped")
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    dropped = set()
    for arg, source in part.weights.items():
        source = source.format(i=layer)
        uses = consumers.get(arg, [])
        transposed = bool(uses) and all(
            n.op_type == "Transpose" and [list(a.ints) for a in n.attribute
                                          if a.name == "perm"] == [[1, 0]] for n in uses)
        key = (source, transposed)
        if key not in seen:
            seen[key] = source if all(s != source for s, _ in seen) else f"{source}.T"
            weights.append(Weight(seen[key], source, transposed))
        if transposed:
            for n in uses:
                mapping[n.output[0]] = seen[key]
                dropped.add(id(n))
        else:
            mapping[arg] = seen[key]
    for t in g.initializer:
        mapping.setdefault(t.name, f"{part.name}/{t.name}")
    nodes = []
    for node in g.node:
        if id(node) in dropped:
            continue
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = prefix + node.name
        copy.input[:] = [mapping.get(n, prefix + n) if n else n for n in node.input]
        copy.output[:] = [mapping.get(n, prefix + n) if n else n for n in node.output]
        nodes.append(copy)
    return nodes


def _value(name: str, dims: list[Any]) -> Any:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)


def assemble(parts: dict[str, Part], layers: int, kv_heads: int, head_size: int, vocab: int,
             order: list[int] | None = None) -> tuple[Any, list[Weight]]:
    """The package's decoder graph (no weights: they are :class:`Weight` records, in the
    order the data file holds them) from the parts :func:`export_parts` exported: the
    prelude, the layer once per layer (copy ``i`` takes the checkpoint's layer ``order[i]``:
    the tests' wrong stamp), the head; its inputs and outputs the package contract's
    (genpackage.py)."""
    order = list(range(layers)) if order is None else order
    pre, layer, head = (parts[name].proto.graph for name in ("prelude", "layer", "head"))
    weights: list[Weight] = []
    seen: dict[tuple[str, bool], str] = {}
    fixed = [i.name for i in pre.input[:3]]  # input_ids, attention_mask, position_ids
    shared = ["prelude/hidden", "prelude/mask", "prelude/cos", "prelude/sin"]
    nodes = _copy(parts["prelude"], "prelude/", {
        **{n: n for n in fixed}, **dict(zip([o.name for o in pre.output], shared))},
        None, weights, seen)
    hidden = shared[0]
    layer_in = [i.name for i in layer.input[:6]]
    layer_out = [o.name for o in layer.output]
    for i in range(layers):
        out = f"layers.{i}/hidden"
        nodes += _copy(parts["layer"], f"layers.{i}/", {
            **dict(zip(layer_in, [hidden, *shared[1:], *(cache_name(i, k) for k in KINDS)])),
            **dict(zip(layer_out, [out, *(cache_name(i, k, present=True) for k in KINDS)]))},
            order[i], weights, seen)
        hidden = out
    nodes += _copy(parts["head"], "head/", {head.input[0].name: hidden,
                                             head.output[0].name: LOGITS}, None, weights, seen)
    consts = {}
    for part in parts.values():
        for t in part.proto.graph.initializer:
            c = onnx.TensorProto()
            c.CopyFrom(t)
            c.name = f"{part.name}/{t.name}"
            consts[c.name] = c
    past = ["batch_size", kv_heads, "past_sequence_length", head_size]
    total = ["batch_size", kv_heads, "total_sequence_length", head_size]
    inputs = list(pre.input[:3]) + [_value(n, past) for n in cache_names(layers)]
    outputs = [_value(LOGITS, ["batch_size", "sequence_length", vocab])] + [
        _value(n, total) for n in cache_names(layers, present=True)]
    graph = helper.make_graph(nodes, "decoder", inputs, outputs, list(consts.values()))
    functions = {(f.domain, f.name): f for p in parts.values() for f in p.proto.functions}
    model = helper.make_model(graph, opset_imports=list(parts["prelude"].proto.opset_import),
                              functions=list(functions.values()))
    model.ir_version = parts["prelude"].proto.ir_version
    return model, weights


def write_weights(model: Any, weights: list[Weight], folder: Path, checkpoint: Path) -> int:
    """``weights`` read from ``checkpoint`` one tensor at a time, in float32 (transposed where
    so recorded), appended to ``folder/model.onnx.data`` and added to ``model``'s graph as
    external initializers; returns the bytes written."""
    source = Weights(checkpoint)
    with open(folder / DATA, "wb") as data:
        for w in weights:
            t = source.get(w.source).to(torch.float32)
            if w.transposed:
                t = t.T
            arr = np.ascontiguousarray(t.numpy())
            del t
            proto = TensorProto(name=w.name, data_type=TensorProto.FLOAT, dims=arr.shape)
            append_external(data, proto, arr.reshape(-1).view(np.uint8).data, DATA)
            model.graph.initializer.append(proto)
            del arr
        return data.tell()


# ------------------------------------------------------------------------------------------
# 3. the package, verified


def stamp_problem(config: Any) -> str | None:
    """Why the checkpoint of ``config`` (a transformers config) is not stamped (None when it
    is): a family of :data:`FAMILIES` that hf/stream.py streams."""
    kind = getattr(config, "model_type", "")
    if kind not in FAMILIES:
        return f"the family {kind!r} is not one stamped ({', '.join(sorted(FAMILIES))})"
    return streamable(config)


def _side_files(checkpoint: Path) -> tuple[Any, Any]:
    """The checkpoint's config and generation config (as a model's ``config`` and
    ``generation_config``) and its tokenizer, None where the folder has no tokenizer's file
    (transformers would make an empty one of the family's class, whose ids are no prompt)."""
    like, tokenizer = side_files(checkpoint)
    if not has_tokenizer(checkpoint):
        tokenizer = None
    return like, tokenizer


def stamp_package(checkpoint: str | os.PathLike[str], folder: str | os.PathLike[str], *,
                  timeout: float = 600.0, order: list[int] | None = None) -> Stamped:
    """Write the float32 generation package of the checkpoint folder ``checkpoint`` into
    ``folder`` (steps 1 and 2 of the module docstring; not verified as a whole: see
    :func:`export_stamped`): ``model.onnx``, ``model.onnx.data``, genai_config.json, the
    configs and the tokenizer's files. ``order``: the checkpoint's layer each stamped copy
    takes (the tests' wrong stamp; None: its own). Raises ValueError for a checkpoint not
    stamped (:func:`stamp_problem`)."""
    from transformers import AutoConfig

    from onnxmedic.hf.generation import GRAPH

    checkpoint, folder = Path(checkpoint), Path(folder)
    config = AutoConfig.from_pretrained(str(checkpoint))  # read once
    if (why := stamp_problem(config)) is not None:  # the family, then streamable()
        raise ValueError(f"onnxmedic.hf.stamp: {checkpoint} is not stamped: {why}")
    Weights(checkpoint).close()  # FileNotFoundError without safetensors, as checked_config
    shape = geometry(config)
    folder.mkdir(parents=True, exist_ok=True)
    work = folder / "parts"
    work.mkdir()
    res = export_parts(checkpoint, config, work, timeout, shape)
    if not res.ok:
        return res
    t0 = time.perf_counter()
    model, weights = assemble(res.parts, *shape, order)
    res.parts.clear()
    shutil.rmtree(work)
    write_weights(model, weights, folder, checkpoint)
    onnx.save_model(model, str(folder / GRAPH))
    res.seconds["stamp"] = time.perf_counter() - t0
    like, tokenizer = _side_files(checkpoint)
    write_side_files(like, tokenizer, folder, Layout(GRAPH, *shape[:3], position_ids=True))
    res.layers, res.ok = shape.layers, True
    return res


def export_stamped(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], *,
                   precision: str = "fp32", budget: Any = None, steps: int = 8,
                   timeout: float | None = None, spec: str | None = None,
                   report: str | os.PathLike[str] | None = None,
                   order: list[int] | None = None) -> Any:
    """``export hf:CHECKPOINT --task text-generation-with-past [--precision int4]`` on the
    stamped road (see the module docstring): the package of :func:`stamp_package`, verified
    against the checkpoint streamed - at ``precision`` fp32 by hf/stream.py's
    verify_package (``steps`` greedy tokens from the first default prompt), at int4 made and
    judged by stream_int4.int4_streamed (``budget``: its task budget) - and written at
    ``out`` only then. Returns the ExportResult (its ``generation`` the fp32 check, its
    ``int4`` the int4 outcome). ``order``: :func:`stamp_package`'s (the tests' wrong stamp)."""
    from onnxmedic import sandbox
    from onnxmedic.hf.gen_verify import DEFAULT_PROMPTS, prompt_ids
    from onnxmedic.hf.generation import add_check, not_written
    from onnxmedic.hf.transforms.passes import staged
    from onnxmedic.onnxfile import replace_folder
    from onnxmedic.result import ExportResult, stages_of

    checkpoint, out = Path(checkpoint), Path(out)
    wait = sandbox.DEFAULT_TIMEOUT if timeout is None else float(timeout)
    last = "generate" if precision == "fp32" else "optimize"
    result = ExportResult(command="export", model=spec or str(checkpoint),
                          stages=stages_of(STAGE, last))
    result.generation = None  # type: ignore[attr-defined]
    out.parent.mkdir(parents=True, exist_ok=True)
    with result.guard(), staged(out) as stage:
        pkg = stage / "pkg"
        with result.stage(STAGE) as st:
            made = stamp_package(checkpoint, pkg, timeout=wait, order=order)
            result.timings.update(made.seconds)
            if not made.ok:  # the parts' findings, then OM818
                st.fail(*made.findings, not_written(out))
                return report_to(result, report)
            result.findings.append(info(
                "OM851", STAGE, f"the decoder graph was stamped: its prelude, one decoder "
                f"layer and its head exported and verified once, the layer copied "
                f"{made.layers} times, each copy's weights streamed from {checkpoint}'s "
                "safetensors into model.onnx.data.", details={"layers": made.layers}))
        if precision == "int4":
            with result.stage(last) as st:
                done = int4_streamed(pkg, checkpoint, out, budget=budget, timeout=wait)
                take_verdict(result, done, st)
        else:
            with result.stage(last) as st:
                like, tokenizer = _side_files(checkpoint)
                vocab = int(like.config.vocab_size)
                check = verify_package(pkg, checkpoint,
                                       prompt_ids(tokenizer, list(DEFAULT_PROMPTS[:1]), vocab),
                                       steps=steps, timeout=wait)
                add_check(result, check)
                result.timings.update({f"generate: {k}": v for k, v in check.seconds.items()})
                if not check.ok:
                    st.fail()
            if check.ok:
                replace_folder(pkg, out)
            result.ok = check.ok
    result.path = str(out) if result.ok else None
    if result.ok:
        judged = "" if precision != "int4" else f" ({done.judged_note()})"
        result.findings.append(info(
            "OM819", "write", f"{precision} generation package written to {out}{judged}: "
            f"{', '.join(sorted(p.name for p in out.iterdir()))}."))
    else:
        result.findings.append(not_written(out))
    return report_to(result, report)


def stamp_road(model: Any, task: str | None, *, dtype: str, verify: bool, opset: Any,
               backend: str, remote_code: bool, options: dict[str, Any]) -> Path | None:
    """The checkpoint folder ``export_pretrained(model, ...)`` takes the stamped road for, or
    None (the whole-model road): a folder of safetensors of at least
    stream_int4.STREAM_FROM bytes with its tokenizer (else the whole-model road says OM806), a
    causal LM of a family stamped (:data:`FAMILIES`) that onnxruntime-genai's builder does not
    serve, at fp32, verified, at ``precision`` fp32 or
    int4 without ``optimize``, with no opset asked for, no remote code and a backend other
    than ``"builder"`` (which refuses such a family: OM838)."""
    if not isinstance(model, (str, os.PathLike)) or dtype != "fp32" or not verify or \
            opset is not None or backend == "builder" or remote_code or \
            options.get("optimize") or options.get("precision") not in (None, "fp32", "int4"):
        return None
    return large_folder(model, task, lambda config, folder: config.get("model_type") in FAMILIES
                        and has_tokenizer(folder)
                        and (config.get("architectures") or ["?"])[0] not in builder.served(),
                        stamp_problem, "export does not stamp")
