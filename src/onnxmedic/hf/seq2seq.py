"""``text2text-generation-with-past`` and ``automatic-speech-recognition-with-past``: an
encoder-decoder (T5, BART, Marian, mBART, Whisper ...) as two ONNX graphs in a folder,
verified by greedy generation against PyTorch (hf/seq2seq_verify.py).

``encoder_model.onnx`` runs once per input: ``input_ids`` and ``attention_mask``
([batch_size, encoder_sequence_length]; Whisper: ``input_features`` [batch_size, feature_size,
encoder_sequence_length]) in, ``last_hidden_state`` and the cross-attention cache
``present.{i}.encoder.key`` / ``.value`` ([batch_size, heads, encoder_sequence_length_out,
head_size]: every decoder layer's keys and values of the encoder output, computed once) out.

``decoder_with_past_model.onnx`` serves every decoder step, the first included (a past of
length 0): ``input_ids`` [batch_size, decoder_sequence_length], ``encoder_attention_mask``
(text models), ``past_key_values.{i}.decoder.key`` / ``.value`` (the self-attention cache,
[batch_size, heads, past_decoder_sequence_length, head_size]) and
``past_key_values.{i}.encoder.key`` / ``.value`` (the encoder's cross-attention cache) in;
``logits`` and ``present.{i}.decoder.key`` / ``.value`` (the grown self-attention cache) out:
the inputs, outputs and dim names of optimum's ``decoder_with_past_model.onnx``. The cross
cache is the encoder graph's output, as onnxruntime-genai's Whisper encoder computes it, so
one decoder graph serves all steps.

The folder also holds the model's ``config.json`` and ``generation_config.json``, the
tokenizer's files and the feature extractor's ``preprocessor_config.json``; for Whisper, the
``genai_config.json`` of onnxruntime-genai's ``whisper`` model type (genai has no T5, BART or
Marian model type: OM825). It is built beside ``out_dir`` and renamed into place only when
verified.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import onnx
import torch

from onnxmedic import sandbox
from onnxmedic.findings import InputError, error, info
from onnxmedic.genpackage import CROSS, KINDS, SELF, cache_name, cache_names
from onnxmedic.hf import report_to
from onnxmedic.hf.genai_files import GENAI_TYPES, Layout
from onnxmedic.hf.generation import (
    EXAMPLE_BATCH,
    EXAMPLE_NEW,
    EXAMPLE_PAST,
    Request,
    build_and_check,
    building,
    merge_graph,
    no_folder,
    package_names,
    package_result,
    rename_graph,
    save_graph,
    step_inputs_blamed,
)
from onnxmedic.hf.seq2seq_modules import (
    CROSS_RULE,
    DECODER,
    ENCODER,
    AudioDecoderWithPast,
    DecoderWithPast,
    EncoderWithCross,
    default_processor,
    encoder_inputs,
    encoder_outputs,
    interleave,
    main_input,
    no_start_token,
    split_cache,
    start_token,
)
from onnxmedic.hf.transforms.gqa import remove_dead
from onnxmedic.result import ExportResult

logger = logging.getLogger(__name__)

TASKS = ("text2text-generation-with-past", "automatic-speech-recognition-with-past")
WHAT = "encoder-decoder package"


def decoder_example(model: torch.nn.Module, enc: dict[str, torch.Tensor], start: int
                    ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The decoder graph's example inputs (a real past of EXAMPLE_PAST tokens and the cross
    cache of ``enc``, the encoder's example) and their dynamic shapes."""
    from torch.export import Dim

    g = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    b = enc[main_input(model)].shape[0]
    ids = torch.randint(min(4, vocab - 1), vocab, (b, EXAMPLE_PAST + EXAMPLE_NEW), generator=g)
    ids[:, 0] = start
    mask = enc.get("attention_mask")
    with torch.no_grad():
        hidden, cross = EncoderWithCross(model, start)(enc[main_input(model)], mask)
        DecoderWithPast(model)(  # the first step, from an empty past, runs
            ids[:, :1], mask, interleave([c[:, :, :0] for c in cross], cross))
        past_out = model(decoder_input_ids=ids[:, :EXAMPLE_PAST],
                         encoder_outputs=encoder_outputs(hidden),
                         attention_mask=mask, use_cache=True).past_key_values
    selfs = [t.detach().clone() for t in split_cache(past_out)[0]]
    past = interleave(selfs, [c.detach().clone() for c in cross])
    bd, s = Dim("batch_size"), Dim("decoder_sequence_length")
    p, e = Dim("past_decoder_sequence_length"), Dim("encoder_sequence_length")
    # audio: the encoder's output length is fixed (Whisper's max_source_positions)
    cross_dims = {0: bd, 2: e} if mask is not None else {0: bd}
    past_dims = [{0: bd, 2: p} if i % 4 < 2 else cross_dims for i in range(len(past))]
    args = (ids[:, EXAMPLE_PAST:].contiguous(), mask, past)
    shapes = ({0: bd, 1: s}, {0: bd, 1: e}, past_dims)
    if mask is None:  # an audio decoder takes no encoder mask: the new tokens and the past
        return args[::2], shapes[::2]
    return args, shapes


def io_names(n_layers: int, mask: bool, main: str) -> dict[str, tuple[list[str], list[str]]]:
    """The graphs' input and output names (optimum's), in the wrappers' order."""
    cross = cache_names(n_layers, CROSS, present=True)
    past = [cache_name(i, kv, part) for i in range(n_layers) for part in (SELF, CROSS)
            for kv in KINDS]
    present = cache_names(n_layers, SELF, present=True)
    enc_in = [main] + (["attention_mask"] if mask else [])
    dec_in = ["input_ids"] + (["encoder_attention_mask"] if mask else []) + past
    return {"encoder": (enc_in, ["last_hidden_state"] + cross),
            "decoder": (dec_in, ["logits"] + present)}


def _not_a_seq2seq(model: Any, task: str) -> str | None:
    """Why ``model`` cannot serve ``task`` (None when it can)."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        return f"{type(model).__name__} is not a transformers PreTrainedModel"
    fed = next((kind for kind in ("audio", "vision") if hasattr(model.config, f"{kind}_config")
                and hasattr(model.config, "text_config")), None)
    if fed and not getattr(model.config, "is_encoder_decoder", False):
        # transformers maps some of these among the seq-to-seq LMs (AudioFlamingo3, Voxtral),
        # the mapping the task was detected from
        article = "an" if fed == "audio" else "a"
        return (f"{type(model).__name__} is a text decoder fed by {article} {fed} encoder (its "
                f"{fed} features spliced into the decoder's inputs; is_encoder_decoder is "
                "false), not an encoder-decoder, although transformers lists it among the "
                f"seq-to-seq LMs (where a detected {task} comes from); onnxmedic's generation "
                f"packages serve text decoders and encoder-decoders, none a decoder fed {fed}")
    if not getattr(model.config, "is_encoder_decoder", False) or \
            not hasattr(model, "get_encoder"):
        return (f"{type(model).__name__} is not an encoder-decoder; {task} takes one "
                "(AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq)")
    if not getattr(model, "can_generate", lambda: False)():
        return f"{type(model).__name__} has no language-model head: it cannot generate"
    audio = main_input(model) == "input_features"
    if audio != task.startswith("automatic-speech"):
        other = TASKS[1] if audio else TASKS[0]
        return (f"{type(model).__name__} takes {main_input(model)}: it serves {other}, "
                f"not {task}")
    return None


def _export_one(result: ExportResult, which: str, module: torch.nn.Module, args: tuple[Any, ...],
                shapes: tuple[Any, ...], path: Path, opset: int | None, timeout: float) -> Any:
    """One graph through onnxmedic.export (captured, translated, verified); its findings and
    comparisons join ``result``; returns the export's result."""
    from onnxmedic.api import export

    sub = export(module.eval(), args, path, dynamic_shapes=shapes, opset=opset,
                 timeout=timeout, model_spec=f"{type(module.model).__name__} {which}")
    if which == "decoder":
        sub.findings[:] = [our_step_inputs(f, module.model) for f in sub.findings]
    merge_graph(result, sub, CROSS_RULE, which)
    return sub


def our_step_inputs(finding: Any, model: Any) -> Any:
    """The decoder graph's finding, blaming onnxmedic's step inputs (generation's
    :func:`~onnxmedic.hf.generation.step_inputs_blamed`): the encoder ran before (ProphetNet's
    decoder takes one token per step with its cache)."""
    return step_inputs_blamed(
        finding, model, f"{EXAMPLE_NEW} new decoder tokens after a past of {EXAMPLE_PAST} "
        "with the encoder's cross-attention cache (", "These inputs are onnxmedic's, not "
        "yours: its encoder-decoder package takes several tokens per decoder step.",
        "Report the family to onnxmedic with this finding; serve the model with PyTorch "
        "meanwhile.")


def build_graphs(result: ExportResult, model: Any, tmp: Path, tokenizer: Any, processor: Any,
                 opset: int | None, timeout: float) -> Layout | None:
    """Export and verify both graphs into ``tmp`` with optimum's names; returns the layout
    (file names, programs, heads, sizes) or None (OM821, the export's findings say why)."""
    from torch.export import Dim

    start = start_token(model)
    with result.stage("capture", conclude=False) as st:
        enc = encoder_inputs(model, tokenizer, processor, batch=EXAMPLE_BATCH)
        main = main_input(model)
        mask = "attention_mask" in enc
        raw = tmp / "graphs"
        raw.mkdir()
        args = tuple(enc[k] for k in (main, "attention_mask") if k in enc)
        # text and its mask [batch_size, encoder_sequence_length]; audio features [batch_size,
        # feature_size, frames] with the frames fixed (Whisper's encoder takes exactly 2 x
        # max_source_positions of them)
        dims = {0: Dim("batch_size")}
        if main == "input_ids":
            dims[1] = Dim("encoder_sequence_length")
        subs = {"encoder": _export_one(result, "encoder", EncoderWithCross(model, start), args,
                                       (dims,) * len(args), raw / ENCODER, opset, timeout)}
        if subs["encoder"].ok:
            dargs, dshapes = decoder_example(model, enc, start)
            # the step with the encoder mask (text), or without (audio)
            step = DecoderWithPast(model) if mask else AudioDecoderWithPast(model)
            subs["decoder"] = _export_one(result, "decoder", step, dargs, dshapes, raw / DECODER,
                                          opset, timeout)
    failed = next((k for k, v in subs.items() if not v.ok), None)
    if failed is not None:
        st.fail(error("OM821", "capture", f"the {failed} graph of {type(model).__name__} ("
                      + ("the encoder and the cross-attention cache of its output"
                         if failed == "encoder" else "one decoder step with its caches")
                      + ") did not export and verify; the export's findings above say why.",
                      suggestion="Fix the first error above; onnxmedic.export on "
                      f"onnxmedic.hf.seq2seq.{'EncoderWithCross' if failed == 'encoder' else 'DecoderWithPast'}"
                      "(model) reproduces it."))
        return None
    past = dargs[-1]
    names = io_names(len(past) // 4, mask, main)
    for which, fname in (("encoder", ENCODER), ("decoder", DECODER)):
        proto = onnx.load(str(raw / fname))
        ins, outs = names[which]
        renamed = dict(zip([o.name for o in proto.graph.output], outs))
        rename_graph(proto, {**dict(zip([i.name for i in proto.graph.input], ins)), **renamed},
                     "past_decoder_sequence_length", "total_decoder_sequence_length")
        package_names(subs[which], renamed)  # its comparisons and findings in these names
        remove_dead(proto.graph)  # the encoder graph's copy of the decoder's weights
        save_graph(proto, tmp, fname)
    shutil.rmtree(raw)
    return Layout(DECODER, len(past) // 4, int(past[0].shape[1]), int(past[0].shape[3]),
                  encoder=ENCODER, main=main, start=start,
                  programs={k: v.program for k, v in subs.items()})


def export_seq2seq(model: torch.nn.Module, out_dir: str | os.PathLike[str], *,
                   tokenizer: Any = None, processor: Any = None,
                   task: str | None = None, verify: bool = True, steps: int = 8,
                   prompts: Any = None, opset: int | None = None,
                   report: str | os.PathLike[str] | None = None, timeout: float | None = None,
                   keep_unverified: bool = False) -> ExportResult:
    """Write an encoder-decoder package for ``model`` (a loaded transformers
    ``...ForConditionalGeneration``) at ``out_dir``: the encoder graph (with the
    cross-attention cache), one decoder graph with its caches, the configs, the tokenizer's
    and feature extractor's files (see the module docstring). ``task``: detected from the
    model's main input when None. With ``verify``, greedy generation of ``steps`` tokens
    from each of ``prompts`` (texts or lists of ids; audio models: a number of synthetic
    waveforms) in ONNX Runtime must match PyTorch's ``generate(do_sample=False)``, each
    step's logits within the float64 budget (hf/seq2seq_verify.py). The folder is written
    only when verified (or with ``keep_unverified``)."""
    if task is None:
        task = TASKS[1] if isinstance(model, torch.nn.Module) and \
            main_input(model) == "input_features" else TASKS[0]
    if task not in TASKS:
        raise ValueError(f"onnxmedic.export_seq2seq: task must be one of {', '.join(TASKS)}, "
                         f"not {task!r}")
    req = Request(model, Path(out_dir), tokenizer, processor, steps=steps, prompts=prompts,
                  timeout=sandbox.DEFAULT_TIMEOUT if timeout is None else timeout,
                  verify=verify, opset=opset, keep_unverified=keep_unverified)
    result = package_result(model)
    with result.guard():
        if preflight_refused(result, req, task):
            with building(req) as tmp:
                _seq2seq_package(result, req, tmp)
    return report_to(result, report)


def preflight_refused(result: ExportResult, req: Request, task: str) -> bool:
    model = req.model
    why = _not_a_seq2seq(model, task)
    if why is not None:
        result.fail("preflight", error(
            "OM822", "preflight", f"cannot export for {task}: {why}.",
            suggestion="Export its parts apart: the text decoder (config.text_config, "
            "AutoModelForCausalLM: text-generation-with-past) and the encoder as a module; "
            "or serve it with PyTorch." if " encoder (its " in why else
            "Load the checkpoint with AutoModelForSeq2SeqLM (text) or "
            "AutoModelForSpeechSeq2Seq (audio), or pick a task the model serves "
            "(text-generation-with-past for a decoder-only model)."))
        return False
    if start_token(model) is None:
        result.fail("preflight", no_start_token(model, "preflight"))
        return False
    if not req.out.parent.is_dir():
        result.fail("write", no_folder(req.out))
        return False
    try:  # the inputs the task takes (OM826: audio features the encoder cannot take)
        encoder_inputs(model, req.tokenizer, req.processor, batch=EXAMPLE_BATCH)
    except InputError as e:
        e.finding.stage = "preflight"
        result.fail("preflight", e.finding)
        return False
    return True


def _seq2seq_package(result: ExportResult, req: Request, tmp: Path) -> None:
    """The encoder-decoder's package (generation.build_and_check): both graphs, verified by
    hf/seq2seq_verify.py."""
    from onnxmedic.hf.seq2seq_verify import verify_seq2seq

    model, processor = req.model, req.processor
    if processor is None and main_input(model) == "input_features":
        processor = default_processor(model)
    genai = getattr(model.config, "model_type", "") in GENAI_TYPES

    def build(result: ExportResult) -> tuple[Layout | None, bool]:
        layout = build_graphs(result, model, tmp, req.tokenizer, processor, req.opset,
                              req.timeout)
        if layout is not None:
            result.programs = layout.programs  # type: ignore[attr-defined]  # both graphs
            if not genai:  # OM825: onnxruntime-genai has no model type for it
                result.findings.append(info(
                    "OM825", "write", "no genai_config.json: onnxruntime-genai has no model "
                    f"type for the encoder-decoder {getattr(model.config, 'model_type', '')!r} "
                    "(it serves Whisper alone among them). The package serves ONNX Runtime "
                    "(encoder_model.onnx once, decoder_with_past_model.onnx per token), "
                    "verified by onnxmedic's generation loop.",
                    suggestion="Run the two graphs with your own loop, or with optimum's "
                    "ORTModelForSeq2SeqLM-style code: the names are optimum's."))
        return layout, genai

    build_and_check(result, req, tmp, build, lambda folder, layout, genai: verify_seq2seq(
        folder, model, req.tokenizer, processor, steps=req.steps, prompts=req.prompts,
        programs=layout.programs, timeout=req.timeout, genai=genai), WHAT, processor)

