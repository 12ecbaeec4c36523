"""One task's module (tasks.TaskModule) through :func:`onnxmedic.export`: the task's example
inputs and dynamic dims, the export (retried with the batch dims alone where the model fixed
the others), the graph outputs named as the task names them, the file written atomically,
and the result annotated as the checkpoint's (OM809). The facade (hf/__init__.py) calls
:func:`export_task` for every task but the ``*-with-past`` packages.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx

from onnxmedic.findings import InputError, info
from onnxmedic.hf import checkpoint, report_to, tasks
from onnxmedic.hf.checkpoint import STAGE
from onnxmedic.hf.load import Loaded, spec_name
from onnxmedic.onnxfile import check_output_path, not_written_finding, publish, staged
from onnxmedic.result import ExportResult, stages_of

logger = logging.getLogger(__name__)

# dims the model fixed: the export is retried with the batch dims alone
_DIM_FAILURES = {"OM111", "OM401", "OM402", "OM407"}


def export_task(loaded: Loaded, f: Any, dynamic: Any, report: Any,
                 options: dict[str, Any]) -> ExportResult:
    """One task's module through onnxmedic.export, its outputs named, written atomically."""
    from onnxmedic import api, inputs

    folder = loaded.ckpt.folder if loaded.ckpt is not None else None
    pooling = tasks.Pooling.of_folder(folder) if loaded.task == "sentence-similarity" else None
    module = tasks.TaskModule(loaded.model, loaded.task, pooling)
    ex = tasks.example_inputs(loaded.task, loaded.model, loaded.tokenizer, loaded.processor,
                              checkpoint.preprocessor_config(loaded.ckpt))
    spec = spec_name(loaded.spec) if loaded.ckpt is not None else loaded.spec
    try:  # True: the task's dims as optimum names them
        dyn = (ex.dynamic if dynamic is True else None if not dynamic else
               inputs.complete_dynamic_shapes(module, dynamic, (), ex.kwargs))
    except InputError as e:
        return report_to(ExportResult(command="export", model=spec, stages=stages_of(STAGE)
                                    ).fail(STAGE, e.finding), report)
    dest = Path(f) if f is not None else None
    if dest is not None and (bad := check_output_path(dest)) is not None:
        return report_to(ExportResult(command="export", model=spec).fail("write", bad), report)
    # the file is written in a scratch folder beside dest, then published (_name_outputs)
    with staged(dest) if dest is not None else contextlib.nullcontext() as tmp:
        target = tmp / dest.name if tmp is not None and dest is not None else None
        batch = {k: {d: n for d, n in v.items() if d == 0} for k, v in ex.dynamic.items()}
        retry = dynamic is True and batch != ex.dynamic
        with _quiet_torch(retry):
            res = api.export(module, (), target, kwargs=ex.kwargs, dynamic_shapes=dyn, **options)
        fixed = {x.code for x in res.errors if x.code in _DIM_FAILURES}
        if retry and not res.ok and fixed:
            loaded.notes.append("only the batch dims are dynamic: with the others dynamic too "
                                f"the export failed ({', '.join(sorted(fixed))})")
            res = api.export(module, (), target, kwargs=ex.kwargs, dynamic_shapes=batch,
                             **options)
        _name_outputs(res, module.output_names, target, dest)
    # the export's result as the checkpoint's: its name, the inputs stage, OM809 first
    outputs = module.output_names
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
    return report_to(res, report)


@contextlib.contextmanager
def _quiet_torch(quiet: bool) -> Iterator[None]:
    """torch.export logs each guard it cannot satisfy at ERROR level; a first try whose
    failure is retried with fewer dynamic dims keeps that out of the user's terminal."""
    log = logging.getLogger("torch._guards")
    level = log.level
    log.setLevel(logging.CRITICAL if quiet else level)
    try:
        yield
    finally:
        log.setLevel(level)


def _name_outputs(res: ExportResult, names: list[str], written: Path | None,
                  dest: Path | None) -> None:
    """Name the graph outputs as the task's (Identity nodes: nothing else changes), then
    move the written file (and its external data) to ``dest``, the model file last."""
    renamed = rename_outputs(res.onnx_model, names) if res.onnx_model is not None else {}
    if written is not None and dest is not None and res.path is not None \
            and Path(res.path) == written and written.is_file():
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
