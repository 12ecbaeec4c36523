"""ONNX Runtime's transformer fusions on a generation package's decoder, as a verified candidate.

The decoder graph of a generation package (hf/generation.py: ``model.onnx`` with
``input_ids``, ``attention_mask``, ``position_ids`` and the past in, ``logits`` and the present
out) is rewritten by onnxscript's ORT fusions (``onnxscript.rewriter.ort_fusions``,
``optimize_for_ort``): RMS norms to ``SimplifiedLayerNormalization``, residual + RMS norm to
``SkipSimplifiedLayerNormalization``, the attention core (scaled dot product with its mask) to
``MultiHeadAttention``, scaled MatMuls to ``FusedMatMul``; it fuses the rotary embedding and
the grouped-query attention with ONNX Runtime's in-place KV cache (``GroupQueryAttention``)
only where the graph follows the patterns it knows (the exporter's graphs reach
``MultiHeadAttention``: the rotary fusion is undone when no GQA consumes it).

One step before: the export guards every ``ReduceMean`` with ``Where(False, NaN, mean)`` (the
NaN an empty mean gives in PyTorch: ops/miscompiles.py); a ``Where`` whose condition is one
constant boolean is that branch, so it is folded, and the RMS norm patterns match.

The fused folder is a candidate like every other: generation is verified against PyTorch
token by token with the float32 budget of the export (hf/gen_verify.py) and in
onnxruntime-genai; a fused package outside it is not written (OM735), with the figure. The
folder is built beside ``out`` and renamed into place only when verified.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir  # (loaded by gqa.py, imported below, already)

from onnxmedic.findings import error, info
from onnxmedic.genpackage import context_length, decoder_graph
from onnxmedic.hf.transforms.gqa import const_array, to_gqa
from onnxmedic.hf.transforms.passes import PackageOutcome, PackagePass, copy_side_files, staged
from onnxmedic.onnxfile import replace_folder
from onnxmedic.optimize.files import has_external_data, op_counts
from onnxmedic.optimize.pass_infra import PassResult

logger = logging.getLogger(__name__)

# the ops the fusions produce, counted in the result
FUSED_OPS = ("SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization",
             "MultiHeadAttention", "GroupQueryAttention", "RotaryEmbedding", "FusedMatMul")


@dataclass
class FuseResult(PackageOutcome):
    """The fusion candidate's outcome: ``fusions`` (onnxscript's count per fusion), ``ops``
    (the fused ops in the written graph), ``check`` (gen_verify's GenerationCheck) and
    ``findings``; ``ok`` when the fused package was written."""

    fusions: dict[str, int] = field(default_factory=dict)
    ops: dict[str, int] = field(default_factory=dict)
    folded_where: int = 0
    check: Any = None


def fold_constant_where(model: Any) -> int:
    """Replace each ``Where(c, a, b)`` of the onnx_ir ``model`` whose condition is one
    constant boolean (an initializer of one element) and whose other branch is one element by
    the branch it picks; returns the number folded. (Broadcasting a one-element tensor does
    not change the picked branch's shape unless it is a scalar, which the verification that
    follows would catch.)"""

    def one(value: Any) -> np.ndarray | None:  # a one-element initializer's array
        array = const_array(value)
        return array if array is not None and array.size == 1 else None

    folded = []
    for node in model.graph:
        cond = one(node.inputs[0]) if node.op_type == "Where" and node.domain in (
            "", "ai.onnx") else None
        if cond is None or cond.dtype != np.bool_ \
                or one(node.inputs[2 if cond.ravel()[0] else 1]) is None:
            continue
        out, picked = node.outputs[0], node.inputs[1 if cond.ravel()[0] else 2]
        if out.is_graph_output():  # an Identity keeps the output's name
            kept = ir.Value(name=out.name, type=out.type, shape=out.shape)
            model.graph.insert_after(node, ir.Node("", "Identity", [picked], outputs=[kept]))
            model.graph.outputs[model.graph.outputs.index(out)] = kept
        ir.convenience.replace_all_uses_with(out, picked)  # (chains: the next reads ``picked``)
        folded.append(node)
    model.graph.remove(folded, safe=True)
    return len(folded)


def fuse_graph(src: str | os.PathLike[str], dst: str | os.PathLike[str], *,
               max_positions: int = 4096) -> tuple[dict[str, int], int]:
    """Fuse the decoder graph at ``src`` into ``dst`` (weights over 1 KiB as external data
    ``dst.data`` when the source has external data): onnxscript's ``optimize_for_ort``
    without its FusedMatMul rules (a transposed weight in FusedMatMul is no longer a MatMul
    the int4 quantizer takes; ONNX Runtime folds the constant Transpose itself), then each
    MultiHeadAttention with its KV cache becomes GroupQueryAttention (:func:`to_gqa`, rotary
    caches of ``max_positions``). Returns (the fusion counts, the number of constant Wheres
    folded)."""
    import onnx_ir.passes.common as common_passes
    from onnxscript.rewriter import rewrite
    from onnxscript.rewriter.ort_fusions import _core, softmax
    from onnxscript.rewriter.rules.common import _gemm_to_matmul_add

    from onnxmedic.rewrite_speed import sibling_slices

    src, dst = Path(src), Path(dst)
    model = ir.from_proto(onnx.load(str(src)))
    folded = fold_constant_where(model)
    rewrite(model, [_gemm_to_matmul_add.gemm_to_matmul_add_rule])
    with sibling_slices():  # fuse_xformers runs onnxscript's optimizer twice
        model, counts = _core.fuse_xformers(model)
    rewrite(model, [*softmax.rules.rules])
    ir.passes.Sequential(
        common_passes.LiftConstantsToInitializersPass(lift_all_constants=False, size_limit=1),
        common_passes.RemoveInitializersFromInputsPass(),
        common_passes.ShapeInferencePass())(model)
    counts = {k: int(v) for k, v in counts.items() if v}
    counts["group_query_attention"] = to_gqa(model, max_positions)
    proto = ir.to_proto(model)
    del model
    resave(proto, dst, has_external_data(src))
    return counts, folded


class FusePass(PackagePass):
    """ONNX Runtime's fusions on the package's decoder (fuse_decoder.fuse_graph: with
    GroupQueryAttention, its KV cache updated in place: genai_config.json's
    ``past_present_share_buffer`` on). ``info``: onnxscript's counts (``fusions``) and the
    constant Wheres folded."""

    def call(self, src: Path, dst: Path) -> PassResult:
        graph = decoder_graph(src)
        copy_side_files(src, dst, graph.name)
        counts, folded = fuse_graph(graph, dst / graph.name,
                                    max_positions=context_length(dst) or 4096)
        if counts.get("group_query_attention"):
            share_buffer(dst)
        return PassResult(dst, True, {"fusions": counts, "folded_where": folded})


def fuse_package(folder: str | os.PathLike[str], out: str | os.PathLike[str], model: Any,
                 tokenizer: Any = None, *, steps: int = 8, prompts: Any = None,
                 genai: bool = True, timeout: float | None = None,
                 mutate: Any = None, torch_runs: dict[Any, Any] | None = None,
                 shown: str | None = None) -> FuseResult:
    """Write ``out``: the generation package ``folder`` with its decoder fused (see the module
    docstring), verified against ``model`` (the PyTorch causal LM the package was exported
    from) by greedy generation of ``steps`` tokens per prompt in ONNX Runtime and, with
    ``genai``, onnxruntime-genai. ``mutate(proto)`` (tests) edits the fused graph before it
    is verified. ``torch_runs``: the plain package's check's (gen_verify.GenerationCheck
    ``torch_runs``): PyTorch's tokens, logits and references, not computed again. ``shown``:
    how the verdict (OM734/OM735) names ``out`` (default: its path; a caller that fuses into
    a scratch folder names the package it becomes). Nothing is written at ``out`` unless
    verified."""
    from onnxmedic import sandbox
    from onnxmedic.hf.gen_verify import verify_generation

    folder, out = Path(folder), Path(out)
    with staged(out) as tmp:
        res = FuseResult(**FusePass()(folder, tmp).info)  # its fusions and Wheres folded
        graph = decoder_graph(tmp)
        if mutate is not None:
            proto = onnx.load(str(graph))
            mutate(proto)
            resave(proto, graph)
        res.ops = {k: v for k, v in op_counts(graph).items() if k in FUSED_OPS}
        res.check = verify_generation(tmp, model, tokenizer, steps=steps, prompts=prompts,
                                      genai=genai, timeout=timeout or sandbox.DEFAULT_TIMEOUT,
                                      torch_runs=torch_runs)
        res.findings.extend(res.check.findings)
        shown = shown or str(out)
        if not res.check.ok:
            why = "; ".join(f.message for f in res.check.findings if f.severity == "error")
            res.findings.append(error(
                "OM735", "optimize", f"the fused decoder package was not written to {shown}: "
                f"its generation is outside the float32 budget ({why[:600] or 'no figure'}; "
                f"first divergence: {res.check.divergence})", suggestion="Keep the plain "
                "package; the figures above say which step and position differ."))
            return res
        replace_folder(tmp, out)
        res.ok, res.path = True, str(out)
        ops = ", ".join(f"{n} x{c}" for n, c in sorted(res.ops.items())) or "none"
        res.findings.append(info(
            "OM734", "optimize", f"fused decoder package written to {shown}: ONNX Runtime's "
            f"fusions ({ops}; onnxscript's counts {res.fusions}) verified token by token "
            "against PyTorch within the float32 budget."))
        return res


def share_buffer(folder: Path) -> None:
    """GroupQueryAttention updates the KV cache in place: genai_config.json's
    ``past_present_share_buffer`` on (GenAI then allocates the cache once, at max_length)."""
    cfg = folder / "genai_config.json"
    if cfg.exists():
        data = json.loads(cfg.read_text())
        data.setdefault("search", {})["past_present_share_buffer"] = True
        cfg.write_text(json.dumps(data, indent=2) + "\n")


def resave(proto: onnx.ModelProto, path: Path, big: bool | None = None) -> None:
    """Save ``proto`` at ``path``, its weights over 1 KiB in ``<name>.data`` when ``big``
    (None: when they pass 1 GiB)."""
    if big is None:
        big = sum(len(t.raw_data) for t in proto.graph.initializer) > 2**30
    onnx.save_model(proto, str(path), save_as_external_data=big, all_tensors_to_one_file=True,
                    location=f"{path.name}.data" if big else None, size_threshold=1024)

