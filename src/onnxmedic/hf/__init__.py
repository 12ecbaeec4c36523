"""Hugging Face checkpoints to verified ONNX: :func:`export_pretrained`.

    import onnxmedic
    result = onnxmedic.export_pretrained("path/to/checkpoint", "model.onnx")   # task detected
    result = onnxmedic.export_pretrained("bert-base-uncased", "qa.onnx", task="question-answering")

The checkpoint (a folder written by ``save_pretrained``, a hub id, or a loaded
``PreTrainedModel``) is loaded safely (checkpoint.py), the task's module and example inputs are
built (tasks.py: optimum's task, input, output and dim names), and the export runs through
:func:`onnxmedic.export`, verified like any other. ``*-with-past`` tasks write a generation
package (onnxmedic.hf.generation).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from onnxmedic.findings import InputError, error, info
from onnxmedic.hf import checkpoint, tasks
from onnxmedic.hf.checkpoint import DTYPES, Checkpoint
from onnxmedic.hf.tasks import ALL_TASKS, GENERATION, TASKS, detect_task, supported_tasks
from onnxmedic.result import ExportResult, stages_of

logger = logging.getLogger(__name__)

__all__ = ["ALL_TASKS", "TASKS", "detect_task", "export_pretrained", "supported_tasks"]

STAGE = "inputs"
# export()'s options export_pretrained passes on
EXPORT_OPTIONS = ("timeout", "tolerance", "explain", "dtype_policy", "ort_version", "localize",
                  "on_stage", "optimize", "precision", "accuracy", "cuda_graph")
# dims the model fixed: the export is retried with the batch dims alone
_DIM_FAILURES = {"OM111", "OM401", "OM402", "OM407"}


@dataclass
class Loaded:
    """A checkpoint loaded for one task."""

    model: Any
    task: str
    spec: str
    tokenizer: Any = None
    processor: Any = None
    ckpt: Checkpoint | None = None
    notes: list[str] = field(default_factory=list)
    builder: Any = None  # gen_builder.BuildJob: the genai builder writing the package


def _err(code: str, message: str, suggestion: str | None = None) -> InputError:
    return InputError(error(code, STAGE, message, suggestion=suggestion))


def _check_args(model: Any, task: Any, dtype: Any, dynamic: Any, options: dict[str, Any],
                backend: Any = "auto") -> None:
    if not isinstance(model, (str, os.PathLike, torch.nn.Module)):
        raise TypeError("onnxmedic.export_pretrained: model must be a hub id, a checkpoint "
                        f"folder or a transformers PreTrainedModel, not {type(model).__name__}")
    if isinstance(model, torch.nn.Module) and not hasattr(model, "config"):
        raise TypeError("onnxmedic.export_pretrained: model is a plain nn.Module; use "
                        "onnxmedic.export for it (export_pretrained takes transformers models)")
    if task is not None and not isinstance(task, str):
        raise TypeError(f"onnxmedic.export_pretrained: task must be a str, not {type(task).__name__}")
    if dtype not in DTYPES:
        raise ValueError(f"onnxmedic.export_pretrained: dtype must be one of "
                         f"{', '.join(DTYPES)}, not {dtype!r}")
    if not (isinstance(dynamic, (bool, dict)) or dynamic is None or dynamic == "auto"):
        raise TypeError("onnxmedic.export_pretrained: dynamic must be True, False, 'auto' or a "
                        "dict {input: {dim: name}}")
    from onnxmedic.hf.gen_builder import BACKENDS

    if backend not in BACKENDS:
        raise ValueError(f"onnxmedic.export_pretrained: backend must be one of "
                         f"{', '.join(BACKENDS)}, not {backend!r}")
    unknown = set(options) - set(EXPORT_OPTIONS)
    if unknown:
        raise TypeError(f"onnxmedic.export_pretrained: unexpected keyword argument(s) "
                        f"{', '.join(sorted(unknown))}")


def _spec_name(model: Any) -> str:
    if isinstance(model, torch.nn.Module):
        return type(model).__name__
    text = os.fspath(model)
    return text if text.startswith(checkpoint.PREFIX) else checkpoint.PREFIX + text


def _pick_task(config: dict[str, Any], task: str | None, folder: Path | None,
               known: bool = True) -> tuple[str, str]:
    """(task, how it was chosen): OM804 an unknown name, OM805 one the model cannot serve."""
    supported = supported_tasks(config) if known else []
    if task is None:
        found = detect_task(config, folder)
        if found is None:
            archs = config.get("architectures") or "none"
            raise _err("OM805", f"the task cannot be told from config.architectures ({archs}); "
                       f"the model type {config.get('model_type')!r} serves: "
                       f"{', '.join(supported) or 'no task onnxmedic knows'}.",
                       "Give the task: --task NAME (task=...).")
        return found, f"detected from config.architectures ({config['architectures'][0]})"
    if task not in ALL_TASKS:
        raise _err("OM804", f"unknown task {task!r}.",
                   f"Tasks (optimum's names): {', '.join(ALL_TASKS)}.")
    if known and task not in supported:
        raise _err("OM805", f"a {config.get('model_type')!r} model cannot serve the task "
                   f"{task!r}; it serves: {', '.join(supported) or 'none onnxmedic knows'}.",
                   "Choose one of those tasks, or a checkpoint made for this one.")
    return task, "given"


def _needs_text(task: str, model_type: str) -> bool:
    if task in GENERATION:
        return task.startswith("text")
    modality = TASKS[task].modality
    return modality in ("text", "text+vision") or (
        modality == "any" and tasks.main_input(model_type) in (None, "input_ids"))


def generation_available() -> bool:
    """Whether onnxmedic.hf.generation (the with-past decoder export) is installed."""
    try:
        return importlib.util.find_spec("onnxmedic.hf.generation") is not None
    except (ImportError, ValueError):
        return False


def _check_generation(task: str) -> None:
    if task in GENERATION and (not task.endswith("-with-past") or not generation_available()):
        hint = (f"Export {task}-with-past (a generation package)" if
                f"{task}-with-past" in GENERATION and generation_available() else
                "Use text-generation (one forward pass, logits) for a decoder's single step")
        raise _err("OM807", f"the task {task!r} is not available in this onnxmedic "
                   "(generation packages need onnxmedic.hf.generation"
                   + ("" if generation_available() else ", which is not installed") + ").",
                   hint + ".")


def _load_checkpoint(spec: Any, task: str | None, dtype: str, trust: bool,
                     build: Any = None) -> Loaded:
    ckpt = checkpoint.resolve(os.fspath(spec))
    job = None
    if build is not None and not ckpt.remote_code:
        # the genai builder (a child) starts first: it writes the package while the code is
        # checked, the task too, and the model loads here (a causal LM's task is told from
        # its class alone)
        job = build(ckpt, task if task is not None else detect_task(ckpt.config, ckpt.folder))
    try:
        checkpoint.check_code(ckpt, trust)
        return _load_for_task(ckpt, task, dtype, trust, job)
    except BaseException:
        if job is not None:
            job.discard()
        raise


def _load_for_task(ckpt: Checkpoint, task: str | None, dtype: str, trust: bool,
                   job: Any) -> Loaded:
    task, how = _pick_task(ckpt.config, task, ckpt.folder, known=not ckpt.remote_code)
    _check_generation(task)
    model_type = ckpt.config.get("model_type", "")
    if _needs_text(task, model_type) and not ckpt.has_tokenizer:
        raise _err("OM806", f"{ckpt.spec} has no tokenizer, and the task {task!r} takes text "
                   f"(looked for {', '.join(checkpoint.TOKENIZER_FILES[:4])} ...).",
                   "Save the tokenizer beside the model: tokenizer.save_pretrained(folder).")
    tokenizer = checkpoint.load_tokenizer(ckpt, trust)
    if tokenizer is None and _needs_text(task, model_type):
        raise _err("OM806", f"the tokenizer of {ckpt.spec} cannot be loaded (see the log).",
                   "Save it again with tokenizer.save_pretrained(folder).")
    extra = {"use_cache": False} if task == "text-generation" else {}
    model = checkpoint.load_model(ckpt, tasks.auto_class(task, ckpt.config), dtype, trust, extra)
    kind = {"audio": "audio"}.get(TASKS[task].modality if task in TASKS else "", "")
    if task.startswith("automatic-speech-recognition"):
        kind = "audio"  # the encoder-decoder's feature extractor
    if task in TASKS and TASKS[task].modality == "any" and \
            getattr(model, "main_input_name", "") == "input_values":
        kind = "audio"
    return Loaded(model, task, ckpt.spec, tokenizer, checkpoint.load_processor(ckpt, kind),
                  ckpt, [f"task {task} ({how})", f"loaded in {dtype}"], job)


def _object_tasks(model: torch.nn.Module) -> list[str]:
    name, model_type = type(model).__name__, getattr(model.config, "model_type", "")
    out = [t.name for t in TASKS.values()
           if any(name in tasks.classes_for(m, model_type) for m in t.mappings)]
    out += [g for g, (_a, m) in GENERATION.items() if name in tasks.classes_for(m, model_type)]
    return out


def _load_object(model: torch.nn.Module, task: str | None, dtype: str) -> Loaded:
    """A PreTrainedModel the caller loaded: used as it is (borrowed, not converted)."""
    if dtype != "fp32" and DTYPES[dtype] != getattr(model, "dtype", None):
        raise ValueError("onnxmedic.export_pretrained: dtype sets the dtype a checkpoint is "
                         "loaded in; convert a model object yourself (model.to(dtype))")
    config = model.config.to_dict()
    config["architectures"] = [type(model).__name__]
    can = _object_tasks(model)
    if task is None:
        task = detect_task(config)
        how = f"detected from the class {type(model).__name__}"
    else:
        how = "given"
        if task not in ALL_TASKS:
            raise _err("OM804", f"unknown task {task!r}.",
                       f"Tasks (optimum's names): {', '.join(ALL_TASKS)}.")
    if task is None or task not in can:
        raise _err("OM805", f"a {type(model).__name__} cannot serve the task {task!r}; it "
                   f"serves: {', '.join(can) or 'none onnxmedic knows'}.",
                   "Load the model with the Auto class of the task (e.g. "
                   "AutoModelForSequenceClassification for text-classification).")
    _check_generation(task)
    folder = Path(str(getattr(model, "name_or_path", "") or ""))
    ckpt = None
    if folder.is_dir() and (folder / "config.json").is_file():
        try:
            ckpt = checkpoint.resolve(str(folder))
        except InputError:
            ckpt = None
    tokenizer = checkpoint.load_tokenizer(ckpt, False) if ckpt is not None else None
    return Loaded(model, task, type(model).__name__, tokenizer, None, ckpt,
                  [f"task {task} ({how})", f"the model object as it is ({model.dtype})"])


def _load(model: Any, task: str | None, dtype: str, trust: bool, build: Any = None) -> Loaded:
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise _err("OM808", "transformers is not installed; Hugging Face checkpoints need it.",
                   "pip install 'onnxmedic[hf]'.") from e
    if isinstance(model, torch.nn.Module):
        return _load_object(model, task, dtype)
    return _load_checkpoint(model, task, dtype, trust, build)


def _builder(f: Any, dtype: str, verify: bool, opset: int | None, backend: str) -> Any:
    """The step that starts the genai builder for a checkpoint (hf/gen_builder.py) where it
    builds a text-generation-with-past package: (ckpt, task) -> BuildJob or None (OM838 with
    backend "builder" where it cannot)."""
    from onnxmedic.hf import gen_builder

    def build(ckpt: Checkpoint, task: str) -> Any:
        if task != "text-generation-with-past" or f is None or backend == "export":
            return None
        why = gen_builder.why_not(ckpt.config, backend=backend, folder=ckpt.folder,
                                  dtype=dtype, verify=verify, opset=opset,
                                  remote_code=ckpt.remote_code)
        if why is not None:
            if backend == "builder":
                raise _err("OM838", f"onnxruntime-genai's model builder cannot build "
                           f"{ckpt.spec}: {why}.", "Leave --backend out (auto) for "
                           "onnxmedic's own export.")
            logger.info("the genai builder is not used: %s", why)
            return None
        out = Path(f)
        if not out.parent.is_dir():
            return None  # the package's export reports it (OM006)
        checkpoint.check_pickles(ckpt)  # the builder loads the weights as transformers does
        return gen_builder.start(ckpt.folder, out)

    return build


def export_pretrained(
    model: Any,
    f: str | os.PathLike[str] | None = None,
    *,
    task: str | None = None,
    dtype: str = "fp32",
    trust_remote_code: bool = False,
    dynamic: bool | str | dict[str, dict[int, str]] | None = True,
    target: str = "cpu",
    opset: int | None = None,
    verify: bool = True,
    report: str | os.PathLike[str] | None = None,
    keep_unverified: bool = False,
    backend: str = "auto",
    **options: Any,
) -> ExportResult:
    """Export a Hugging Face model for a task, verified in ONNX Runtime like :func:`export`.

    ``model``: a hub id, a folder written by ``save_pretrained`` (``hf:`` prefix optional), or
    a transformers ``PreTrainedModel`` (borrowed: its mode and weights are left as they were).
    ``task``: optimum's task name (``onnxmedic.hf.ALL_TASKS``), detected from
    config.architectures when None. ``dtype`` (fp32, fp16, bf16): the dtype the checkpoint is
    loaded in. ``trust_remote_code``: allow a checkpoint's own Python code (never implied).
    ``dynamic``: True names the dynamic dims as optimum does (batch_size, sequence_length,
    height, width ...), False exports static shapes, or a dict {input: {dim: name}} / "auto".
    The example inputs are real text through the folder's tokenizer (else ids from the config),
    images from the config and preprocessor_config.json, audio through the folder's feature
    extractor. The outputs are named as optimum names them (last_hidden_state, logits,
    start_logits, sentence_embedding ...). ``*-with-past`` tasks write a generation package
    folder at ``f`` (with ``optimize``, text-generation-with-past's is the fused package when
    it verifies: docs/generation.md). ``backend`` (text-generation-with-past): ``"auto"``
    onnxruntime-genai's model builder where it serves the checkpoint, its package verified
    like onnxmedic's own (else onnxmedic's export: OM837); ``"export"`` onnxmedic's export;
    ``"builder"`` the builder or nothing (OM838): hf/gen_builder.py. Problems of the checkpoint
    are findings (OM800-OM809), as with export();
    ``options``: further :func:`onnxmedic.export` options (timeout, tolerance, ...).
    """
    _check_args(model, task, dtype, dynamic, options, backend)
    result = ExportResult(command="export", model=_spec_name(model), stages=stages_of(STAGE))
    from onnxmedic.report.files import report_path_problem

    if report is not None and (bad := report_path_problem(report)) is not None:
        return result.fail("write", bad)
    try:
        with result.timed(STAGE):
            loaded = _load(model, task, dtype, trust_remote_code,
                           _builder(f, dtype, verify, opset, backend))
    except InputError as e:
        result.fail(STAGE, e.finding)
        return _finish(result, report)
    if loaded.task != "text-generation-with-past" and options.get("precision") == "int4":
        from onnxmedic.hf.transforms.precision import int4_not_for

        result.fail(STAGE, int4_not_for(loaded.task))
        return _finish(result, report)
    if loaded.task in GENERATION:
        if backend == "builder" and loaded.builder is None and \
                loaded.task == "text-generation-with-past":
            why = ("the model is an object, not a checkpoint folder the builder reads"
                   if loaded.ckpt is None or isinstance(model, torch.nn.Module)
                   else "no package folder was given")
            result.fail(STAGE, error("OM838", STAGE, "onnxruntime-genai's model builder "
                                     f"cannot build {loaded.spec}: {why}.",
                                     suggestion="Give a checkpoint folder (hf:FOLDER), or "
                                     "leave backend out (auto)."))
            return _finish(result, report)
        return _export_generation(loaded, f, opset, verify, report, options, backend)
    return _export_task(loaded, f, dynamic, report, dict(
        options, target=target, opset=opset, verify=verify, keep_unverified=keep_unverified))


def _finish(result: ExportResult, report: Any) -> ExportResult:
    if report is not None:
        from onnxmedic.report import write_report

        write_report(result, report)
    return result


def _export_generation(loaded: Loaded, f: Any, opset: Any, verify: bool, report: Any,
                       options: dict[str, Any], backend: str = "auto") -> ExportResult:
    """``*-with-past``: a generation package folder (onnxmedic.hf.generation)."""
    from onnxmedic.hf import generation  # type: ignore[attr-defined]

    if f is None:
        raise ValueError("onnxmedic.export_pretrained: a *-with-past task writes a folder; "
                         "give it as f")
    why = _not_fusable(loaded.task, options)
    if loaded.task != "text-generation-with-past":  # an encoder-decoder (hf/seq2seq.py)
        from onnxmedic.hf import seq2seq

        res = seq2seq.export_seq2seq(
            loaded.model, f, tokenizer=loaded.tokenizer, processor=loaded.processor,
            task=loaded.task, verify=verify, opset=opset, report=None,
            timeout=options.get("timeout"))
    else:
        from onnxmedic.hf.transforms.precision import export_at_precision

        int4 = options.get("precision") == "int4"  # hf/transforms/precision.py: the road
        res = (partial(export_at_precision, precision="int4", budget=options.get("accuracy"))
               if int4 else generation.export_generation)(
            loaded.model, f, tokenizer=loaded.tokenizer, task=loaded.task, verify=verify,
            opset=opset, report=None, timeout=options.get("timeout"),
            optimize=bool(options.get("optimize")) and why is None,
            builder=loaded.builder, strict=backend == "builder")
    if why is not None:
        res.findings.append(generation.not_optimized(why))
    return _finish(res, report)


def _not_fusable(task: str, options: dict[str, Any]) -> str | None:
    """Why ``--optimize`` does not apply to this package (None when it does, or when not
    asked for): a decoder package is fused at float32 (optimize/fuse_decoder.py)."""
    if not options.get("optimize"):
        return None
    if task != "text-generation-with-past":
        return (f"{task} packages have no fused variant (the decoder-only "
                "text-generation-with-past package has)")
    precision = options.get("precision") or "fp32"
    if precision not in ("fp32", "int4"):
        return (f"a generation package is optimized at fp32 here (its decoder fused); "
                f"--precision {precision} for it is `onnxmedic optimize PACKAGE hf:CHECKPOINT "
                "-o OUT --precision int4` (docs/int4.md)")
    return None


def _dynamic(dynamic: Any, module: torch.nn.Module, ex: tasks.Example) -> Any:
    if dynamic is True:
        return ex.dynamic
    if not dynamic:
        return None
    from onnxmedic import inputs

    return inputs.complete_dynamic_shapes(module, dynamic, (), ex.kwargs)


def _export_task(loaded: Loaded, f: Any, dynamic: Any, report: Any,
                 options: dict[str, Any]) -> ExportResult:
    """One task's module through onnxmedic.export, its outputs named, written atomically."""
    from onnxmedic import api
    from onnxmedic.onnxfile import check_output_path

    folder = loaded.ckpt.folder if loaded.ckpt is not None else None
    pooling = tasks.Pooling.of_folder(folder) if loaded.task == "sentence-similarity" else None
    module = tasks.TaskModule(loaded.model, loaded.task, pooling)
    ex = tasks.example_inputs(loaded.task, loaded.model, loaded.tokenizer, loaded.processor,
                              checkpoint.preprocessor_config(loaded.ckpt))
    spec = _spec_name(loaded.spec) if loaded.ckpt is not None else loaded.spec
    try:
        dyn = _dynamic(dynamic, module, ex)
    except InputError as e:
        return _finish(ExportResult(command="export", model=spec, stages=stages_of(STAGE)
                                    ).fail(STAGE, e.finding), report)
    dest = Path(f) if f is not None else None
    if dest is not None and (bad := check_output_path(dest)) is not None:
        return _finish(ExportResult(command="export", model=spec).fail("write", bad), report)
    tmp = Path(tempfile.mkdtemp(prefix=".onnxmedic-hf-", dir=dest.parent)) if dest else None
    try:
        target = tmp / dest.name if tmp is not None and dest is not None else None
        batch = {k: {d: n for d, n in v.items() if d == 0} for k, v in ex.dynamic.items()}
        retry = dynamic is True and batch != ex.dynamic
        with _quiet_torch(retry):
            res = api.export(module, (), target, kwargs=ex.kwargs, dynamic_shapes=dyn, **options)
        if retry and _dims_failed(res):
            loaded.notes.append("only the batch dims are dynamic: with the others dynamic too "
                                f"the export failed ({', '.join(sorted(_dim_codes(res)))})")
            res = api.export(module, (), target, kwargs=ex.kwargs, dynamic_shapes=batch,
                             **options)
        _name_outputs(res, module.output_names, target, dest)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return _finish(_annotate(res, loaded, spec, ex, module.output_names), report)


@contextlib.contextmanager
def _quiet_torch(quiet: bool) -> Iterator[None]:
    """torch.export logs each guard it cannot satisfy at ERROR level; a first try whose
    failure is retried with fewer dynamic dims keeps that out of the user's terminal."""
    log = logging.getLogger("torch._guards")
    level = log.level
    if quiet:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _dim_codes(res: ExportResult) -> set[str]:
    return {x.code for x in res.errors if x.code in _DIM_FAILURES}


def _dims_failed(res: ExportResult) -> bool:
    return not res.ok and bool(_dim_codes(res))


def _annotate(res: ExportResult, loaded: Loaded, spec: str, ex: tasks.Example,
              outputs: list[str]) -> ExportResult:
    """The export's result as the checkpoint's: its name, the inputs stage, OM809 first."""
    res.model = spec
    res.inputs = [f"{k}: {list(v.shape)} {str(v.dtype).replace('torch.', '')}"
                  for k, v in ex.kwargs.items()]
    res.stages = {**stages_of(STAGE), **res.stages}
    res.record(STAGE).passed()
    res.findings.insert(0, info(
        "OM809", STAGE, f"{spec}: " + "; ".join(loaded.notes) + f"; inputs: {ex.source} "
        f"({', '.join(ex.kwargs)}); outputs: {', '.join(outputs) or 'none'}.",
        details={"task": loaded.task, "inputs": list(ex.kwargs), "outputs": outputs,
                 "dynamic": {k: {str(d): n for d, n in v.items()} for k, v in ex.dynamic.items()}}))
    return res


def _name_outputs(res: ExportResult, names: list[str], written: Path | None,
                  dest: Path | None) -> None:
    """Name the graph outputs as the task's (Identity nodes: nothing else changes), then
    move the written file (and its external data) to ``dest``, the model file last."""
    from onnxmedic.onnxfile import not_written_finding, publish

    renamed: dict[str, str] = {}
    if res.onnx_model is not None:
        renamed = rename_outputs(res.onnx_model, names)
    if written is not None and dest is not None and res.path is not None \
            and Path(res.path) == written and written.is_file():
        import onnx

        proto = onnx.load(str(written), load_external_data=False)
        rename_outputs(proto, names)
        onnx.save(proto, str(written))
        publish(written.parent, written.name, dest)
        res.path = str(dest)
    elif dest is not None:
        res.findings = [x for x in res.findings if x.code != "OM010"] + \
            [not_written_finding(dest)]
    for c in res.verification:
        c.name = renamed.get(c.name, c.name)


def rename_outputs(proto: Any, names: list[str]) -> dict[str, str]:
    """Give the graph outputs of ``proto`` the ``names`` (in order) with Identity nodes; a name
    already taken inside the graph is left as it was. Returns old -> new."""
    import onnx

    graph = proto.graph
    if len(graph.output) != len(names):
        logger.warning("the graph has %d outputs, the task %d names; left unnamed",
                       len(graph.output), len(names))
        return {}
    taken = {v for n in graph.node for v in n.output} | {i.name for i in graph.input} | \
        {t.name for t in graph.initializer}
    renamed = {}
    for out, new in zip(graph.output, names):
        if out.name == new or new in taken:
            continue
        graph.node.append(onnx.helper.make_node("Identity", [out.name], [new],
                                                name=f"onnxmedic_output_{new}"))
        renamed[out.name] = new
        out.name = new
        taken.add(new)
    return renamed
