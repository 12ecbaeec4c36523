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

import inspect
import logging
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import onnx
import torch

from onnxmedic import sandbox
from onnxmedic.findings import error, info, warning
from onnxmedic.genpackage import LOGITS, cache_names, present_of
from onnxmedic.hf.gen_config import write_side_files
from onnxmedic.hf.gen_verify import genai_check, verify_generation
from onnxmedic.onnxfile import EXTERNAL_DATA_THRESHOLD, replace_folder
from onnxmedic.result import STAGES, ExportResult, stages_of

logger = logging.getLogger(__name__)

TASKS = ("text-generation-with-past",)
GRAPH = "model.onnx"
MASK_RULE = "attention_mask must cover the past and the new tokens"
# example shapes of the graph's export: batch 2 (1 would be specialised), 3 new tokens after a
# past of 4 (a real past: the model's own cache of 4 tokens)
EXAMPLE_BATCH, EXAMPLE_NEW, EXAMPLE_PAST = 2, 3, 4


def flat_cache(cache: Any) -> list[torch.Tensor]:
    """[k0, v0, k1, v1, ...] of a transformers cache (``DynamicCache`` and its layers)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [t for layer in layers for t in (layer.keys, layer.values)]
    return [t for pair in cache for t in pair[:2]]


class GenerationDecoder(torch.nn.Module):
    """The decoder as the graph's function: (input_ids, attention_mask, position_ids, [k0, v0,
    k1, v1, ...]) -> (logits, [present k0, v0, ...]). The cache is a plain ``DynamicCache``
    (full length in every layer: sliding-window layers are masked, not truncated, so every
    present is past + new tokens long, as GenAI's buffers are)."""

    def __init__(self, model: torch.nn.Module, position_ids: bool = True) -> None:
        super().__init__()
        self.model = model
        self.takes_positions = position_ids

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor | None, past: list[torch.Tensor]
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        from transformers import DynamicCache

        # the graph's total length is past + new: torch.export keeps the relation, and
        # PyTorch rejects sizes that break it (the verification's shape variants)
        torch._check(attention_mask.shape[1] == input_ids.shape[1] + past[0].shape[2],
                     lambda: MASK_RULE)
        cache = DynamicCache([(past[i], past[i + 1]) for i in range(0, len(past), 2)])
        kw: dict[str, Any] = {"position_ids": position_ids} if self.takes_positions else {}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         past_key_values=cache, use_cache=True, **kw)
        return out.logits, flat_cache(out.past_key_values)


def takes_position_ids(model: torch.nn.Module) -> bool:
    try:
        return "position_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


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


def _cannot_serve(why: str) -> Any:
    return error("OM817", "preflight", f"cannot export for text-generation-with-past: {why}.",
                 suggestion="Load the checkpoint with transformers.AutoModelForCausalLM, or "
                 "pick a task the model serves (feature-extraction for an encoder).")


def _no_cache(model: Any) -> str | None:
    """Why ``model`` returns no KV cache when asked for one (None when it does, or when the
    call fails: the export reports that): an encoder loaded with a language-model head (BERT's
    BertLMHeadModel without is_decoder) attends both ways and keeps no cache."""
    ids = torch.full((1, 2), min(4, int(model.config.vocab_size) - 1), dtype=torch.int64)
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
        cache = getattr(out, "past_key_values", None)
        if cache is not None and flat_cache(cache):
            return None
    except Exception:  # noqa: BLE001 - the graph's export says why it fails
        logger.debug("generation: the cache probe failed", exc_info=True)
        return None
    hint = (" (its config has is_decoder=False: an encoder's causal-LM class so configured "
            "attends both ways and keeps no cache)"
            if getattr(model.config, "is_decoder", None) is False else "")
    return (f"{type(model).__name__} returns no KV cache when called with use_cache=True"
            f"{hint}; text-generation-with-past feeds the cache back at each step")


def example_inputs(model: torch.nn.Module, vocab: int | None = None
                   ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The graph's example inputs (a real past of EXAMPLE_PAST tokens) and dynamic shapes."""
    from torch.export import Dim

    vocab = vocab or int(model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    total = EXAMPLE_PAST + EXAMPLE_NEW
    ids = torch.randint(min(4, vocab - 1), vocab, (EXAMPLE_BATCH, total), generator=g)
    mask = torch.ones(EXAMPLE_BATCH, total, dtype=torch.int64)
    with torch.no_grad():
        out = model(input_ids=ids[:, :EXAMPLE_PAST], attention_mask=mask[:, :EXAMPLE_PAST],
                    use_cache=True)
    past = [t.detach().clone() for t in flat_cache(out.past_key_values)]
    pos = torch.arange(EXAMPLE_PAST, total).expand(EXAMPLE_BATCH, EXAMPLE_NEW).contiguous()
    b, s = Dim("batch_size"), Dim("sequence_length")
    p = Dim("past_sequence_length")
    args = (ids[:, EXAMPLE_PAST:].contiguous(), mask, pos, past)
    shapes = ({0: b, 1: s}, {0: b, 1: Dim.AUTO}, {0: b, 1: s}, [{0: b, 2: p} for _ in past])
    return args, shapes


def io_names(n_cache: int) -> tuple[list[str], list[str]]:
    """GenAI's and optimum's names: the cache inputs and the outputs, in the graph's order."""
    past = cache_names((n_cache + 1) // 2)[:n_cache]
    present = [LOGITS] + [present_of(n) for n in past]
    return past, present


def _rename_dims(value: Any) -> None:
    for d in value.type.tensor_type.shape.dim:
        if d.dim_param and "past_sequence_length" in d.dim_param and "+" in d.dim_param:
            d.dim_param = "total_sequence_length"


def rename_io(proto: onnx.ModelProto, positions: bool) -> dict[str, str]:
    """Rename the graph's inputs and outputs (and their uses) to GenAI's names; returns
    {new name: old name}."""
    g = proto.graph
    fixed = ["input_ids", "attention_mask"] + (["position_ids"] if positions else [])
    n_cache = len(g.output) - 1
    past, present = io_names(n_cache)
    mapping: dict[str, str] = {}
    inputs = [i.name for i in g.input]
    for old, new in zip(inputs[len(inputs) - n_cache:], past):
        mapping[old] = new
    for old, new in zip([o.name for o in g.output], present):
        mapping[old] = new
    for name in fixed:
        mapping.setdefault(name, name)
    for node in g.node:
        node.input[:] = [mapping.get(n, n) for n in node.input]
        node.output[:] = [mapping.get(n, n) for n in node.output]
    for v in list(g.input) + list(g.output) + list(g.value_info):
        v.name = mapping.get(v.name, v.name)
        _rename_dims(v)
    return {new: old for old, new in mapping.items()}


def save_graph(proto: onnx.ModelProto, folder: Path) -> Path:
    """``folder/model.onnx``; weights over EXTERNAL_DATA_THRESHOLD in ``model.onnx.data``."""
    path = folder / GRAPH
    big = sum(len(t.raw_data) for t in proto.graph.initializer) > EXTERNAL_DATA_THRESHOLD
    onnx.save_model(proto, path, save_as_external_data=big, all_tensors_to_one_file=True,
                    location=f"{GRAPH}.data" if big else None, size_threshold=1024)
    return path


def package_graph(raw: Path, folder: Path, positions: bool) -> dict[str, str]:
    """The verified graph at ``raw`` as ``folder/model.onnx`` with GenAI's names (rename_io;
    returns its {new name: old name}). Weights the export wrote as external data are moved,
    not read and written again (2 GiB at 0.5 B): only the graph is rewritten, its initializers
    pointing at ``model.onnx.data``."""
    proto = onnx.load(str(raw), load_external_data=False)
    names = rename_io(proto, positions)
    located = [e for t in proto.graph.initializer for e in t.external_data
               if e.key == "location"]
    files = {e.value for e in located}
    if len(files) != 1 or not (raw.parent / next(iter(files))).is_file():
        if files:  # several files (not what the export writes): the weights read and saved
            onnx.load_external_data_for_model(proto, str(raw.parent))
        save_graph(proto, folder)
        return names
    os.replace(raw.parent / files.pop(), folder / f"{GRAPH}.data")
    for e in located:
        e.value = f"{GRAPH}.data"
    onnx.save_model(proto, folder / GRAPH)
    return names


def _graph(result: ExportResult, model: torch.nn.Module, tmp: Path, opset: int | None,
           timeout: float) -> tuple[Any, dict[str, Any]] | None:
    """Export and verify the decoder graph with onnxmedic.export, then give it GenAI's names
    in ``tmp/model.onnx``; returns (the graph's ExportedProgram, its layout) or None (OM810)."""
    from onnxmedic.api import export

    positions = takes_position_ids(model)
    with result.stage("capture", conclude=False) as st:
        args, shapes = example_inputs(model)
        if not positions:
            args, shapes = args[:2] + (None,) + args[3:], shapes[:2] + (None,) + shapes[3:]
        raw = tmp / "graph" / "decoder.onnx"
        raw.parent.mkdir()
        sub = export(GenerationDecoder(model, positions).eval(), args, raw,
                     dynamic_shapes=shapes, opset=opset, timeout=timeout,
                     model_spec=type(model).__name__)
    if sub.onnx_model is not None:  # a failure is reported in the package's names too
        outputs = [o.name for o in sub.onnx_model.graph.output]
        package_names(sub, dict(zip(outputs, io_names(len(outputs) - 1)[1])))
    result.stages.update(sub.stages)  # the graph's own stages, as its export recorded them
    # and their seconds; "capture" was the whole block (the example cache, the graph's export)
    whole = result.timings.pop("capture", 0.0)
    result.timings.update(sub.timings)
    result.timings["graph example"] = max(0.0, whole - sum(sub.timings.values()))
    # the shape variants that break past + new = total are rejected by the wrapper (OM403):
    # generation below runs the graph at past 0 and 1..N instead
    result.findings.extend(f for f in sub.findings
                           if not (f.code == "OM403" and MASK_RULE in f.message))
    result.verification.extend(sub.verification)
    result.opset = sub.opset
    if not sub.ok:
        st.fail(error("OM810", "capture", f"the decoder graph of {type(model).__name__} "
                      "(one step with its cache) did not export and verify; the export's "
                      "findings above say why.", suggestion="Fix the first error above; "
                      "`onnxmedic.export` on GenerationDecoder(model) reproduces it."))
        return None
    with result.timed("package graph"):
        names = package_graph(raw, tmp, positions)
        shutil.rmtree(raw.parent)
    past = args[3]
    layout = {"filename": GRAPH, "layers": len(past) // 2, "kv_heads": int(past[0].shape[1]),
              "head_size": int(past[0].shape[3]), "position_ids": positions, "names": names,
              "genai_problem": genai_problem(past)}
    return sub.program, layout


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




def export_generation(model: torch.nn.Module, out_dir: str | os.PathLike[str], *,
                      tokenizer: Any = None, task: str = "text-generation-with-past",
                      verify: bool = True, steps: int = 8, prompts: Any = None,
                      opset: int | None = None, report: str | os.PathLike[str] | None = None,
                      timeout: float | None = None, keep_unverified: bool = False,
                      optimize: bool = False, builder: Any = None,
                      strict: bool = False) -> ExportResult:
    """Write a generation package for ``model`` (a loaded transformers causal LM) at
    ``out_dir``: one decoder graph with its KV cache serving prefill and decode,
    genai_config.json, the model's configs and the tokenizer's files (see the module
    docstring). With ``verify``, greedy generation of ``steps`` tokens from each of
    ``prompts`` (strings through ``tokenizer``, or lists of ids) in ONNX Runtime and in
    onnxruntime-genai must match PyTorch's ``generate(do_sample=False)``, each step's logits
    within the float64 budget. The folder is written only when verified (or with
    ``keep_unverified``); an existing folder is replaced only then. With ``optimize``, the
    verified package's decoder fused by ONNX Runtime's transformer fusions
    (hf/transforms/fuse_decoder.py) is written instead when its generation verifies against the
    same PyTorch runs (OM734); else the plain package is (OM735, a warning). ``builder``: a
    gen_builder.BuildJob writing the package (hf/gen_builder.py): its package, verified the
    same way, is written when it verifies (OM836; it is fused already); else this export's
    (OM837), or nothing with ``strict`` (OM838). Problems of the model are findings of the
    returned ExportResult."""
    if task not in TASKS:
        raise ValueError(f"onnxmedic.export_generation: task must be one of "
                         f"{', '.join(TASKS)}, not {task!r}")
    timeout = sandbox.DEFAULT_TIMEOUT if timeout is None else timeout
    out = Path(out_dir)
    result = ExportResult(command="export", path=None, model=type(model).__name__,
                          stages=stages_of(*(("build",) if builder is not None else ()),
                                           *STAGES, "generate"))
    result.generation = None  # type: ignore[attr-defined]  # gen_verify.GenerationCheck
    with result.guard():
        try:
            runs = None
            if builder is not None:  # None: the builder's package is written (or, strict,
                # failed); else PyTorch's runs for the export below
                runs = _from_builder(result, builder, model, out, tokenizer,
                                     (steps, prompts, timeout, keep_unverified, strict))
            if builder is None or runs is not None:
                _export_package(result, model, out, tokenizer, verify, steps, prompts, opset,
                                timeout, keep_unverified, optimize, runs)
        finally:
            if builder is not None:
                builder.discard()
    if report is not None:
        from onnxmedic.report import write_report

        write_report(result, report)
    return result


def _from_builder(result: ExportResult, job: Any, model: Any, out: Path, tokenizer: Any,
                  how: tuple[int, Any, float, bool, bool]) -> dict[Any, Any] | None:
    """The genai builder's package (``job``, writing in a child) verified and written; None
    when it is (or, ``strict``, when it fails: OM838), else PyTorch's runs for the export that
    writes the package instead (OM837). PyTorch's side of the verification runs here while
    the builder writes."""
    from onnxmedic.hf.gen_verify import default_prompts, prompt_ids, torch_side

    steps, prompts, timeout, keep_unverified, strict = how
    was_training = model.training
    model.eval()
    ids = prompt_ids(tokenizer, default_prompts(model) if prompts is None else prompts,
                     int(model.config.vocab_size))
    # onnxruntime-genai's check starts as soon as the package is there, while PyTorch's side
    # may still run here
    watch = _BuildWatch(job, timeout, ids, steps, (model, tokenizer))
    watch.start()
    try:
        # one core each: the builder's child and PyTorch here (two threads here would take
        # turns with the child on two cores)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with result.timed("generate: torch"):
                runs = torch_side(model, ids, steps)
        finally:
            torch.set_num_threads(threads)
        with result.timed("build wait"):
            watch.join()
        return _builder_verdict(result, job, watch, (model, tokenizer, out),
                                (steps, ids, timeout, keep_unverified, strict), runs)
    finally:
        if watch.is_alive():  # given up on (an error here): the builder is stopped
            job.kill()
        watch.join()
        if watch.genai is not None:
            watch.genai.stop()
        model.train(was_training)


class _BuildWatch(threading.Thread):
    """Waits for the builder's ``job``; once its package is there, starts onnxruntime-genai's
    check of it (gen_verify.genai_beside: ``genai``) and runs onnxmedic's own loop's ONNX
    Runtime side (gen_verify.onnx_side: ``onnx``), while PyTorch's side may still run in the
    caller's thread: both judged there after. ``why``: the builder's failure, or None."""

    def __init__(self, job: Any, timeout: float, ids: list[list[int]], steps: int,
                 side: tuple[Any, Any]) -> None:
        super().__init__(daemon=True)
        self.job, self.timeout, self.ids, self.steps = job, timeout, ids, steps
        self.side = side  # (model, tokenizer): their files complete the package (finish)
        self.why: str | None = "not waited for"
        self.files: list[str] = []
        self.genai: Any = None
        self.onnx: Any = None

    def run(self) -> None:
        with sandbox.reuse() as server:
            server.start()  # the own loop's child imports ONNX Runtime while the builder writes
            self._run()

    def _run(self) -> None:
        from onnxmedic.hf import gen_builder
        from onnxmedic.hf.gen_verify import OWN_LOOP_THREADS, genai_beside, onnx_side

        self.why = self.job.wait(self.timeout)
        if self.why is None:
            try:  # the package complete before anything runs it
                self.files = gen_builder.finish(self.job, *self.side)
            except Exception as e:  # noqa: BLE001 - said as the builder's failure
                logger.info("generation: completing the builder's package", exc_info=True)
                self.why = f"its package could not be completed ({type(e).__name__}: {e})"
                return
            self.genai = genai_beside(self.job.out, self.ids, self.steps)
            try:
                self.onnx = onnx_side(self.job.out, self.ids, self.steps, self.timeout,
                                      OWN_LOOP_THREADS if self.genai is not None else None)
            except Exception:  # noqa: BLE001 - the caller's own loop runs it again
                logger.info("generation: the own loop ahead failed", exc_info=True)


def _builder_verdict(result: ExportResult, job: Any, watch: _BuildWatch,
                     what: tuple[Any, Any, Path], how: tuple[int, Any, float, bool, bool],
                     runs: dict[Any, Any]) -> dict[Any, Any] | None:
    """The builder's package (``watch`` waited for it) verified against PyTorch's ``runs``
    and written (OM836), or failed (``strict``: OM838), or PyTorch's runs returned for the
    export that writes the package instead (OM837): _from_builder's verdict."""
    model, tokenizer, out = what
    steps, ids, timeout, keep_unverified, strict = how
    why = watch.why
    result.timings["build"] = job.seconds
    check = None
    if why is None:
        result.record("build").passed()
        with result.timed("generate"):
            check = verify_generation(job.out, model, tokenizer, steps=steps, prompts=ids,
                                      timeout=timeout, torch_runs=runs,
                                      genai_run=watch.genai, onnx_ahead=watch.onnx)
            watch.genai = None
        result.timings.update({f"generate: {k}": v for k, v in check.seconds.items()})
        if check.ok or strict:
            result.generation = check  # type: ignore[attr-defined]
            result.verification.extend(check.comparisons)
            result.findings.extend(check.findings)
        if check.ok:
            result.record("generate").passed()
            result.stages = {k: v for k, v in result.stages.items()
                             if k in ("build", "write", "generate")}
            result.findings.append(info(
                "OM836", "build", f"the package was built by onnxruntime-genai's model "
                f"builder in {job.seconds:.1f} s (its decoder fused: {_fused_ops(job.out)}) "
                "and verified by onnxmedic: greedy generation token for token against "
                "PyTorch, each step's logits within the float64 budget, and in "
                "onnxruntime-genai.", details={"seconds": job.seconds}))
            finish_package(result, job.out, out, watch.files, True, keep_unverified)
            return None
        errors = [f for f in check.findings if f.severity.value == "error"]
        why = "its package does not verify: " + (errors[0].message if errors else "?")
    if strict:
        result.fail("build", error(
            "OM838", "build", f"onnxruntime-genai's model builder did not give a verified "
            f"package: {why}", suggestion="Leave --backend out (auto): onnxmedic's own "
            "export writes the package where the builder's does not verify."))
        result.findings.append(not_written(out))
        return None
    # the export writes the package: its stages as without the builder, whose verdict stays
    # as a warning
    result.stages.pop("build", None)
    result.timings = {("builder " + k if k.startswith("generate") else k): v
                      for k, v in result.timings.items()}
    result.findings.append(warning(
        "OM837", "build", f"onnxruntime-genai's model builder did not give a verified package "
        f"({why}); onnxmedic's own export writes it instead.",
        details={"builder_seconds": job.seconds, "log": job.log_tail()}))
    return runs


def _fused_ops(folder: Path) -> str:
    """The contrib ops of a package's graph (what the builder fused), for OM836."""
    from collections import Counter

    try:
        proto = onnx.load(str(folder / GRAPH), load_external_data=False)
    except Exception:  # noqa: BLE001 - a help in a message
        return "?"
    ops = Counter(n.op_type for n in proto.graph.node if n.domain == "com.microsoft")
    return ", ".join(f"{k} x{v}" for k, v in sorted(ops.items())) or "none"


def _export_package(result: ExportResult, model: Any, out: Path, tokenizer: Any, verify: bool,
                    steps: int, prompts: Any, opset: int | None, timeout: float,
                    keep_unverified: bool, optimize: bool,
                    torch_runs: dict[Any, Any] | None = None) -> None:
    why = _not_a_decoder(model)
    if why is not None:
        result.fail("preflight", _cannot_serve(why))
        return
    if not out.parent.is_dir():
        result.fail("write", error("OM006", "write", f"cannot write {out}: the folder "
                                   f"{out.parent} does not exist."))
        return
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        was_training = model.training
        model.eval()
        try:
            why = _no_cache(model)
            if why is not None:
                result.fail("preflight", _cannot_serve(why))
                return
            _build_and_check(result, model, out, tmp, tokenizer, verify, steps, prompts, opset,
                             timeout, keep_unverified, optimize, torch_runs)
        finally:
            model.train(was_training)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _build_and_check(result: ExportResult, model: Any, out: Path, tmp: Path, tokenizer: Any,
                     verify: bool, steps: int, prompts: Any, opset: int | None,
                     timeout: float, keep_unverified: bool, optimize: bool,
                     torch_runs: dict[Any, Any] | None = None) -> None:
    built = _graph(result, model, tmp, opset, timeout)
    if built is None:
        result.findings.append(not_written(out))
        return
    program, layout = built
    result.program = program
    genai = layout["genai_problem"] is None
    if not genai:
        result.findings.append(warning(
            "OM820", "write", f"no genai_config.json: {layout['genai_problem']}. The package "
            "serves ONNX Runtime (onnxmedic's generation loop verifies it) but not "
            "onnxruntime-genai.", suggestion="Use the graph with your own generation loop "
            "(past_key_values.{i}.key/value in, present.{i}.key/value out)."))
    with result.stage("write", conclude=False):
        files = write_side_files(model, tokenizer, tmp, layout, genai=genai)
    verified = True
    if verify:
        with result.stage("generate") as st:
            # with optimize, onnxruntime-genai generates from the package that is written:
            # the fused one, or this one where the fused one does not verify (_fused)
            check = verify_generation(tmp, model, tokenizer, steps=steps, prompts=prompts,
                                      program=program, timeout=timeout,
                                      genai=genai and not optimize, torch_runs=torch_runs)
            result.verification.extend(check.comparisons)
            result.findings.extend(check.findings)
            result.generation = check  # type: ignore[attr-defined]
            if check.ok and optimize:
                tmp = _fused(result, model, tokenizer, (tmp, out), (steps, prompts, genai),
                             timeout, check)
            result.timings.update({f"generate: {k}": v for k, v in check.seconds.items()})
            if not check.ok:
                st.fail()
        verified = check.ok
    elif optimize:
        result.findings.append(not_optimized("the package is not verified (verify=False), and "
                                             "a fused package is written only when verified"))
    finish_package(result, tmp, out, files, verified, keep_unverified)


def _fused(result: ExportResult, model: Any, tokenizer: Any, folders: tuple[Path, Path],
           how: tuple[int, Any, bool], timeout: float, check: Any) -> Path:
    """The verified package in ``tmp`` (``folders``: tmp, and the package's folder ``out``)
    fused (hf/transforms/fuse_decoder.py), verified as it was (``how``: steps, prompts, whether in
    onnxruntime-genai) against the PyTorch runs ``check`` made: the folder to write
    (``tmp/fused``), or ``tmp`` when the fused one does not verify (its OM735 a warning: the
    plain package is written)."""
    from onnxmedic.hf.transforms.fuse_decoder import fuse_package

    tmp, out = folders
    steps, prompts, genai = how
    with result.timed("optimize"):
        fused = fuse_package(tmp, tmp / "fused", model, tokenizer, steps=steps,
                             prompts=prompts, genai=genai, timeout=timeout,
                             torch_runs=check.torch_runs)
    if fused.ok:
        for f in fused.findings:
            if f.code == "OM734":  # the folder it names is the package's, once in place
                f.message = f.message.replace(str(tmp / "fused"), str(out))
                result.findings.append(f)
        return tmp / "fused"
    for f in fused.findings:
        if f.code == "OM735":
            result.findings.append(warning(
                "OM735", "optimize", f.message.replace(str(tmp / "fused"), str(out))
                + "; the plain package is written instead.",
                suggestion="Nothing to do: the plain package is verified. Report the figures "
                "above if the fused decoder should match."))
    if genai:  # the plain package is the one written: onnxruntime-genai generates from it
        known = len(check.findings)
        genai_check(tmp, check, model, steps, timeout)
        result.findings.extend(check.findings[known:])
    return tmp


def not_optimized(why: str) -> Any:
    """OM835: ``--optimize`` asked for a package it does not apply to; the plain package is
    exported as without it."""
    return warning("OM835", "optimize", f"the package is not optimized: {why}; it is "
                   "exported as without --optimize.")


def finish_package(result: ExportResult, tmp: Path, out: Path, files: list[str], verified: bool,
                   keep_unverified: bool, what: str = "generation package") -> None:
    """The write stage's end for a package built in ``tmp``: put in place as ``out`` when
    verified (or kept unverified on request, said in OM819), else nothing written (OM818)."""
    if not verified and not keep_unverified:
        result.fail("write", not_written(out, what))
        return
    replace_folder(tmp, out)
    result.record("write").passed()
    result.path = str(out)
    result.ok = verified and not result.errors
    result.findings.append(info(
        "OM819", "write", f"{what} written to {out}: {', '.join(files)}"
        + ("" if verified else " (NOT verified: keep_unverified)") + "."))


def not_written(out: Path, what: str = "generation package") -> Any:
    """OM818: the package ``out`` was not written because it is not verified."""
    return error("OM818", "write", f"the {what} was not written to {out} because it is not "
                 "verified" + (" (the existing folder is left as it was)"
                               if out.exists() else "") + ".",
                 suggestion="Fix the findings above, or pass keep_unverified=True to keep the "
                 "unverified package.")
