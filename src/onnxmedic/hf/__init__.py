"""Hugging Face checkpoints to verified ONNX: :func:`export_pretrained`.

    import onnxmedic
    result = onnxmedic.export_pretrained("path/to/checkpoint", "model.onnx")   # task detected
    result = onnxmedic.export_pretrained("bert-base-uncased", "qa.onnx", task="question-answering")

The checkpoint (a folder written by ``save_pretrained``, a hub id, or a loaded
``PreTrainedModel``) is loaded safely (load.py, checkpoint.py), the task's module and example
inputs are built (tasks.py: optimum's task, input, output and dim names), and the export runs
through :func:`onnxmedic.export`, verified like any other (task_export.py). ``*-with-past``
tasks write a generation package (generation.py, seq2seq.py), by the backend chosen
(backends.py: onnxmedic's export or onnxruntime-genai's model builder).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from onnxmedic.findings import InputError
from onnxmedic.hf.backends import Backend, export_generation, package_for_task
from onnxmedic.hf.checkpoint import DTYPES, STAGE
from onnxmedic.hf.load import load_for_task, spec_name
from onnxmedic.hf.tasks import ALL_TASKS, GENERATION, TASKS, detect_task, supported_tasks
from onnxmedic.result import ExportResult, stages_of

logger = logging.getLogger(__name__)

__all__ = ["ALL_TASKS", "TASKS", "detect_task", "export_generation", "export_pretrained",
           "supported_tasks"]

# export()'s options export_pretrained passes on
EXPORT_OPTIONS = ("timeout", "tolerance", "explain", "dtype_policy", "ort_version", "localize",
                  "on_stage", "optimize", "precision", "accuracy", "cuda_graph")


def _check_args(model: Any, task: Any, dtype: Any, dynamic: Any, options: dict[str, Any]
                ) -> None:
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
    unknown = set(options) - set(EXPORT_OPTIONS)
    if unknown:
        raise TypeError(f"onnxmedic.export_pretrained: unexpected keyword argument(s) "
                        f"{', '.join(sorted(unknown))}")
    from onnxmedic.hf.transforms.precision import unhonoured_precision

    if bad := unhonoured_precision(options):
        raise ValueError(f"onnxmedic.export_pretrained: {bad}")


def _cpu_package(task: str | None, target: str) -> None:
    """A generation package is a CPU package here: ValueError for another ``target`` (the
    package written would not be one for it)."""
    if task in GENERATION and target != "cpu":
        raise ValueError(f"onnxmedic.export_pretrained: a generation package ({task}) is made "
                         f"for target='cpu' here, not {target!r}")


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
    ``"builder"`` the builder or nothing (OM838): hf/backends.py. Problems of the checkpoint
    are findings (OM800-OM809), as with export();
    ``options``: further :func:`onnxmedic.export` options (timeout, tolerance, ...).
    """
    _check_args(model, task, dtype, dynamic, options)
    _cpu_package(task, target)
    chosen = Backend(backend)
    result = ExportResult(command="export", model=spec_name(model), stages=stages_of(STAGE))
    from onnxmedic.report.files import report_path_problem

    if report is not None and (bad := report_path_problem(report)) is not None:
        return result.fail("write", bad)
    if f is not None:
        done, chosen = _at_size(model, f, task, dtype, verify, opset, chosen,
                                trust_remote_code, report, options)
        if done is not None:
            return done
    try:
        with result.timed(STAGE):
            loaded = load_for_task(model, task, dtype, trust_remote_code,
                                   chosen.starter(f, dtype, verify, opset))
    except InputError as e:
        return report_to(result.fail(STAGE, e.finding), report)
    if loaded.task != "text-generation-with-past" and options.get("precision") == "int4":
        from onnxmedic.hf.transforms.precision import int4_not_for

        return report_to(result.fail(STAGE, int4_not_for(loaded.task)), report)
    if loaded.task in GENERATION:
        _cpu_package(loaded.task, target)
        from_folder = loaded.ckpt is not None and not isinstance(model, torch.nn.Module)
        refused = chosen.refusal(loaded.task, loaded.build_job, loaded.spec, from_folder)
        if refused is not None:
            return report_to(result.fail(STAGE, refused), report)
        return report_to(package_for_task(loaded, f, opset, verify, options, chosen), report)
    from onnxmedic.hf.task_export import export_task

    return export_task(loaded, f, dynamic, report, dict(
        options, target=target, opset=opset, verify=verify, keep_unverified=keep_unverified))


def _at_size(model: Any, f: str | os.PathLike[str], task: str | None, dtype: str, verify: bool,
             opset: int | None, chosen: Backend, remote_code: bool,
             report: str | os.PathLike[str] | None,
             options: dict[str, Any]) -> tuple[ExportResult | None, Backend]:
    """The roads that stream a large checkpoint (hf/stamp.py: a family the builder does not
    serve; transforms/stream_int4: int4 through the builder's graph): their result, or None
    where neither takes ``model``, with the backend the whole-model road goes on with (the
    builder's failure at size hands over to onnxmedic's own export)."""
    from onnxmedic.hf import stamp

    folder = stamp.stamp_road(model, task, dtype=dtype, verify=verify, opset=opset,
                              backend=chosen.name, remote_code=remote_code, options=options)
    if folder is not None:
        return stamp.export_stamped(
            folder, f, precision=options.get("precision") or "fp32",
            budget=options.get("accuracy"), timeout=options.get("timeout"),
            spec=spec_name(model), report=report), chosen
    if options.get("precision") != "int4":
        return None, chosen
    from onnxmedic.hf.transforms import stream_int4

    folder = stream_int4.streamed_road(model, task, dtype=dtype, verify=verify, opset=opset,
                                       backend=chosen.name, remote_code=remote_code)
    if folder is None:
        return None, chosen
    done = stream_int4.export_streamed(
        folder, f, spec=spec_name(model), budget=options.get("accuracy"),
        timeout=options.get("timeout"), strict=chosen.strict, report=report)
    return done, chosen if done is not None else Backend("export")


def report_to(result: ExportResult, report: str | os.PathLike[str] | None) -> ExportResult:
    """``result`` with its report written to ``report`` (none when None)."""
    if report is not None:
        from onnxmedic.report import write_report

        write_report(result, report)
    return result
