"""Who builds a generation package: the one place ``backend`` is read, and where
``export_pretrained`` picks the road of a ``*-with-past`` task (:func:`package_for_task`: the
encoder-decoder's export, the int4 road, or :func:`export_generation`).

Two backends write the package, and the same verification judges either (hf/gen_verify.py):
onnxmedic's own export (hf/generation.py) and onnxruntime-genai's model builder (hf/builder.py
runs it in a child process; its package is written only when it verifies, OM836).
``backend``: ``"auto"`` the builder where it serves (:func:`why_not`), else the export, which
also writes the package where the builder fails or its package does not verify (OM837);
``"export"`` the export alone; ``"builder"`` the builder or nothing (OM838).

The builder starts as soon as the checkpoint is resolved (:meth:`Backend.starter`); PyTorch's
side of the verification runs while it writes, onnxruntime-genai's check and the own loop's
ONNX Runtime side as soon as its package is there, then the judging
(:func:`export_generation`).
Nothing heavy is imported at this module's top: the builder forks before the exporter loads.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onnxmedic.findings import Finding, InputError, error, info, warning
from onnxmedic.hf import builder

if TYPE_CHECKING:
    from onnxmedic.hf.builder import BuildJob
    from onnxmedic.hf.checkpoint import Checkpoint
    from onnxmedic.hf.generation import Request
    from onnxmedic.hf.load import Loaded
    from onnxmedic.result import ExportResult

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "export", "builder")
TASK = "text-generation-with-past"  # the one task the builder serves
STAGE = "inputs"  # checkpoint.STAGE: the builder is refused before the model loads


def why_not(config: dict[str, Any], *, backend: str, folder: Path | None, dtype: str,
            verify: bool, opset: int | None, remote_code: bool) -> str | None:
    """Why the builder does not build this package (None when it does): for ``"auto"`` any
    reason; for ``"builder"`` only those it cannot be tried with (the caller's OM838)."""
    if backend == "export":
        return "backend='export'"
    arch = (config.get("architectures") or ["?"])[0]
    hard = [
        (not builder.available(), "onnxruntime-genai's model builder is not installed "
                                  "(pip install onnxruntime-genai)"),
        (folder is None, "the model is an object, not a checkpoint folder the builder reads"),
        (dtype != "fp32", f"dtype {dtype}: the builder's CPU package is float32 here"),
        (remote_code, "the checkpoint's architecture is its own code (trust_remote_code)"),
        (opset is not None, "an opset was asked for; the builder picks its own"),
    ]
    soft = [
        (not verify, "verification is off, and the builder's package is written only when it "
                     "verifies"),
        (arch not in builder.served(),
         f"the installed onnxruntime-genai builder has no model class for {arch}"),
    ]
    for bad, why in hard + (soft if backend == "auto" else []):
        if bad:
            return why
    return None


def _om838(spec: str, why: str, suggestion: str) -> Finding:
    return error("OM838", STAGE, f"onnxruntime-genai's model builder cannot build {spec}: "
                 f"{why}.", suggestion=suggestion)


@dataclass(frozen=True)
class Backend:
    """The backend asked for (one of BACKENDS; a ValueError names them otherwise)."""

    name: str = "auto"

    def __post_init__(self) -> None:
        if self.name not in BACKENDS:
            raise ValueError(f"onnxmedic.export_pretrained: backend must be one of "
                             f"{', '.join(BACKENDS)}, not {self.name!r}")

    @property
    def strict(self) -> bool:
        """The builder's verified package or nothing (no fall back to the export)."""
        return self.name == "builder"

    def starter(self, f: Any, dtype: str, verify: bool, opset: int | None
                ) -> Callable[[Checkpoint, str], BuildJob | None]:
        """The step that starts the builder for a checkpoint where it builds this
        text-generation-with-past package at ``f``: (ckpt, task) -> its BuildJob, or None
        (the export builds it); an InputError (OM838) where ``"builder"`` cannot."""

        def start(ckpt: Checkpoint, task: str) -> BuildJob | None:
            if task != TASK or f is None or self.name == "export":
                return None
            why = why_not(ckpt.config, backend=self.name, folder=ckpt.folder, dtype=dtype,
                          verify=verify, opset=opset, remote_code=ckpt.remote_code)
            if why is not None:
                if self.strict:
                    raise InputError(_om838(ckpt.spec, why, "Leave --backend out (auto) for "
                                            "onnxmedic's own export."))
                logger.info("the genai builder is not used: %s", why)
                return None
            out = Path(f)
            if not out.parent.is_dir():
                return None  # the package's export reports it (OM006)
            from onnxmedic.hf import checkpoint

            checkpoint.check_pickles(ckpt)  # the builder loads the weights as transformers does
            return builder.start(ckpt.folder, out)

        return start

    def refusal(self, task: str, job: BuildJob | None, spec: str, from_folder: bool
                ) -> Finding | None:
        """OM838 where ``"builder"`` was asked for a package it was not started on: a model
        object (``from_folder`` False), or no package folder given."""
        if not self.strict or job is not None or task != TASK:
            return None
        why = ("the model is an object, not a checkpoint folder the builder reads"
               if not from_folder else "no package folder was given")
        return _om838(spec, why, "Give a checkpoint folder (hf:FOLDER), or leave backend "
                      "out (auto).")


def export_generation(model: Any, out_dir: str | os.PathLike[str], *,
                      tokenizer: Any = None, task: str = "text-generation-with-past",
                      verify: bool = True, steps: int = 8, prompts: Any = None,
                      opset: int | None = None, report: str | os.PathLike[str] | None = None,
                      timeout: float | None = None, keep_unverified: bool = False,
                      optimize: bool = False, build_job: Any = None,
                      strict: bool = False) -> ExportResult:
    """Write a generation package for ``model`` (a loaded transformers causal LM) at
    ``out_dir``: one decoder graph with its KV cache serving prefill and decode,
    genai_config.json, the model's configs and the tokenizer's files (see the module
    docstring of hf/generation.py). With ``verify``, greedy generation of ``steps`` tokens from each of
    ``prompts`` (strings through ``tokenizer``, or lists of ids) in ONNX Runtime and in
    onnxruntime-genai must match PyTorch's ``generate(do_sample=False)``, each step's logits
    within the float64 budget. The folder is written only when verified (or with
    ``keep_unverified``); an existing folder is replaced only then. With ``optimize``, the
    verified package's decoder fused by ONNX Runtime's transformer fusions
    (hf/transforms/fuse_decoder.py) is written instead when its generation verifies against
    the same PyTorch runs (OM734); else the plain package is (OM735, a warning).
    ``build_job``: a builder.BuildJob writing the package (onnxruntime-genai's model builder,
    hf/backends.py): its package, verified the same way, is written when it verifies (OM836;
    it is fused already); else this export's (OM837), or nothing with ``strict`` (OM838).
    Problems of the model are findings of the returned ExportResult."""
    from onnxmedic import sandbox
    from onnxmedic.hf import generation, report_to
    from onnxmedic.hf.generation import TASKS, Request, package_result

    if task not in TASKS:
        raise ValueError(f"onnxmedic.export_generation: task must be one of "
                         f"{', '.join(TASKS)}, not {task!r}")
    req = Request(model, Path(out_dir), tokenizer, steps=steps, prompts=prompts,
                  timeout=sandbox.DEFAULT_TIMEOUT if timeout is None else timeout,
                  verify=verify, opset=opset, keep_unverified=keep_unverified,
                  optimize=optimize, strict=strict)
    result = package_result(model, *(("build",) if build_job is not None else ()))
    with result.guard():
        try:
            # the builder's package verified and written; else, where there is no job or (not
            # strict) its package fails, onnxmedic's own export, judged against the PyTorch
            # runs made meanwhile. A model whose own generate() cannot run is not handed to the
            # builder: PyTorch's side of its check would raise; the own export names the
            # problem (OM830)
            built = build_job is not None and generation.cache_problem(model) is None
            runs = _from_builder(result, build_job, req) if built else None
            if not built or runs is not None:  # (None: written, or (strict) failed)
                generation.export_package(result, req, runs)
        finally:
            if build_job is not None:
                build_job.discard()
    return report_to(result, report)


def _from_builder(result: ExportResult, job: BuildJob, req: Request) -> dict[Any, Any] | None:
    """The builder's package verified and written; None when it is (or, ``req.strict``, when
    it fails: OM838), else PyTorch's runs for the export that writes the package instead
    (OM837). PyTorch's side of the verification runs here while the builder writes."""
    from onnxmedic.hf.gen_verify import default_prompts, prompt_ids, torch_side
    from onnxmedic.hf.transforms.stream_int4 import torch_threads

    model = req.model
    was_training = model.training
    model.eval()
    ids = prompt_ids(req.tokenizer, default_prompts(model) if req.prompts is None
                     else req.prompts, int(model.config.vocab_size))
    # onnxruntime-genai's check starts as soon as the package is there, while PyTorch's side
    # may still run here
    watch = BuildWatch(job, req, ids)
    watch.start()
    try:
        # one core each: the builder's child and PyTorch here (two threads here would take
        # turns with the child on two cores)
        with torch_threads(1), result.timed("generate: torch"):
            runs = torch_side(model, ids, req.steps)
        with result.timed("build wait"):
            watch.join()
        return _verdict(result, job, watch, req, runs)
    finally:
        if watch.is_alive():  # given up on (an error here): the builder is stopped
            job.kill()
        watch.join()
        if watch.genai is not None:
            watch.genai.stop()
        model.train(was_training)


class BuildWatch(threading.Thread):
    """Waits for the builder's ``job``; once its package is there, starts onnxruntime-genai's
    check of it (gen_verify.genai_beside: ``genai``) and runs onnxmedic's own loop's ONNX
    Runtime side (gen_verify.onnx_side: ``onnx``), while PyTorch's side may still run in the
    caller's thread: both judged there after. ``why``: the builder's failure, or None."""

    def __init__(self, job: BuildJob, req: Request, ids: list[list[int]]) -> None:
        super().__init__(daemon=True)
        self.job, self.req, self.ids = job, req, ids
        self.why: str | None = "not waited for"
        self.files: list[str] = []
        self.genai: Any = None
        self.onnx: Any = None

    def run(self) -> None:
        from onnxmedic import sandbox

        with sandbox.reuse() as server:
            server.start()  # the own loop's child imports ONNX Runtime while the builder writes
            self._run()

    def _run(self) -> None:
        from onnxmedic.hf.gen_verify import OWN_LOOP_THREADS, genai_beside, onnx_side

        req = self.req
        self.why = self.job.wait(req.timeout)
        if self.why is None:
            try:  # the package complete before anything runs it
                self.files = builder.finish(self.job, req.model, req.tokenizer)
            except Exception as e:  # noqa: BLE001 - said as the builder's failure
                logger.info("generation: completing the builder's package", exc_info=True)
                self.why = f"its package could not be completed ({type(e).__name__}: {e})"
                return
            if (unfed := unfed_cache(self.job.out)) is not None:
                self.why = f"onnxmedic's own loop cannot verify its package: {unfed}"
                return
            self.genai = genai_beside(self.job.out, self.ids, req.steps)
            try:
                self.onnx = onnx_side(self.job.out, self.ids, req.steps, req.timeout,
                                      OWN_LOOP_THREADS if self.genai is not None else None)
            except Exception:  # noqa: BLE001 - the caller's own loop runs it again
                logger.info("generation: the own loop ahead failed", exc_info=True)


def _verdict(result: ExportResult, job: BuildJob, watch: BuildWatch, req: Request,
             runs: dict[Any, Any]) -> dict[Any, Any] | None:
    """The builder's package (``watch`` waited for it) verified against PyTorch's ``runs``
    and written (OM836), or failed (``req.strict``: OM838), or PyTorch's runs returned for
    the export that writes the package instead (OM837): _from_builder's verdict."""
    from onnxmedic.hf.gen_verify import verify_generation
    from onnxmedic.hf.generation import add_check, finish_package, not_written

    why = watch.why
    result.timings["build"] = job.seconds
    if why is None:
        result.record("build").passed()
        with result.timed("generate"):
            check = verify_generation(job.out, req.model, req.tokenizer, steps=req.steps,
                                      prompts=watch.ids, timeout=req.timeout, torch_runs=runs,
                                      genai_run=watch.genai, onnx_ahead=watch.onnx)
            watch.genai = None
        result.timings.update({f"generate: {k}": v for k, v in check.seconds.items()})
        if check.ok or req.strict:
            add_check(result, check)
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
            finish_package(result, req, job.out, watch.files, True)
            return None
        errors = [f for f in check.findings if f.severity.value == "error"]
        why = "its package does not verify: " + (errors[0].message if errors else "?")
    if req.strict:
        result.fail("build", error(
            "OM838", "build", f"onnxruntime-genai's model builder did not give a verified "
            f"package: {why}", suggestion="Leave --backend out (auto): onnxmedic's own "
            "export writes the package where the builder's does not verify."), not_written(req.out))
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


def unfed_cache(folder: Path) -> str | None:
    """Why onnxmedic's own loop cannot feed the builder's package at ``folder`` (None when
    it can): a GroupQueryAttention with ``sliding_window_cache`` keeps its sliding window's
    keys and values in a buffer of the window's capacity, shared between past and present,
    that onnxruntime-genai manages; the own loop feeds a cache that grows from empty, which
    ONNX Runtime refuses at the first step (the builder's Gemma 2 and gpt-oss packages)."""
    import onnx

    for node in _graph_nodes(folder) or []:  # (unreadable: the verification says why)
        if node.op_type != "GroupQueryAttention":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("sliding_window_cache"):
            return (f"its sliding-window layers ({node.name or 'GroupQueryAttention'}, window "
                    f"{attrs.get('local_window_size', '?')}) keep their keys and values in a "
                    "buffer of the window's capacity shared between past and present "
                    "(GroupQueryAttention sliding_window_cache), which onnxruntime-genai "
                    "manages and onnxmedic's loop does not feed")
    return None


def _fused_ops(folder: Path) -> str:
    """The contrib ops of a package's graph (what the builder fused), for OM836."""
    from collections import Counter

    nodes = _graph_nodes(folder)
    if nodes is None:
        return "?"
    ops = Counter(n.op_type for n in nodes if n.domain == "com.microsoft")
    return ", ".join(f"{k} x{v}" for k, v in sorted(ops.items())) or "none"


def _graph_nodes(folder: Path) -> Any:
    """The nodes of the builder's package graph at ``folder`` (not its weights), or None when
    it cannot be read."""
    import onnx

    try:
        return onnx.load(str(folder / builder.GRAPH), load_external_data=False).graph.node
    except Exception:  # noqa: BLE001 - the callers say what an unreadable graph means
        return None


def package_for_task(loaded: Loaded, f: Any, opset: Any, verify: bool,
                     options: dict[str, Any], chosen: Backend) -> ExportResult:
    """``export_pretrained`` of a ``*-with-past`` task: the generation package folder at ``f``
    by the road the task, ``options["precision"]`` and the backend ``chosen`` pick (the
    encoder-decoder's export, hf/transforms/precision.py's int4 road, or
    :func:`export_generation`); ``options``: export_pretrained's."""
    from functools import partial

    from onnxmedic.hf import generation

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
               if int4 else export_generation)(
            loaded.model, f, tokenizer=loaded.tokenizer, task=loaded.task, verify=verify,
            opset=opset, report=None, timeout=options.get("timeout"),
            optimize=bool(options.get("optimize")) and why is None,
            build_job=loaded.build_job, strict=chosen.strict)
    if why is not None:
        res.findings.append(generation.not_optimized(why))
    return res


def _not_fusable(task: str, options: dict[str, Any]) -> str | None:
    """Why ``--optimize`` does not apply to this package (None when it does, or when not
    asked for): a decoder package is fused at float32 (hf/transforms/fuse_decoder.py)."""
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
