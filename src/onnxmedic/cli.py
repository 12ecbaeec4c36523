"""The command line: a thin shell over onnxmedic.api. Exit codes: 0 ok, 1 a problem with the
user's model or input, 2 bad command-line usage, 3 an internal error of onnxmedic."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from onnxmedic import __version__
from onnxmedic.isa import target_arg

EPILOG = ("exit codes: 0 verified; 1 a problem with the model or inputs (findings printed); "
          "2 bad command-line usage; 3 internal error of onnxmedic. Finding codes: docs/findings.md")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # exit 2 with a one-paragraph message
        self.print_usage(sys.stderr)
        sys.stderr.write(f"onnxmedic: error: {message}\n")
        sys.exit(2)


def _ort_arg(text: str) -> str:
    from onnxmedic.fixes.opset import parse_version

    if parse_version(text) is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not an ONNX Runtime version like 1.17")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="onnxmedic", description="Get a PyTorch model into ONNX Runtime: "
                "exported, verified, or an exact account of what failed.", epilog=EPILOG)
    p.add_argument("--version", action="version", version=f"onnxmedic {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--input", "-i", action="append", default=[], metavar="SPEC",
                        help="example input: a shape 2x3x224x224:float32 (optionally @LOW,HIGH), "
                        "file.py:make_inputs, inputs.npz or inputs.pt; repeat per argument")
        sp.add_argument("--report", metavar="FILE", help="write a .json or .html report")
        sp.add_argument("--timeout", type=float, default=120.0, metavar="S",
                        help="seconds ONNX Runtime may take to load and run (default 120)")
        sp.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
        sp.add_argument("--rtol", type=float, help="override the relative tolerance")
        sp.add_argument("--atol", type=float, help="override the absolute tolerance")
        sp.add_argument("--seed", type=int, default=0, help="seed for generated inputs")
        sp.add_argument("-v", "--verbose", action="store_true", help="also show info findings")
        sp.add_argument("--repro", metavar="DIR", help="on failure, write a standalone "
                        "reproduction there: repro.py, inputs.pt and model.onnx")

    e = sub.add_parser("export", help="export a model to ONNX and verify it", epilog=EPILOG)
    e.add_argument("model", metavar="MODEL",
                   help="path/file.py:Attr, pkg.module:Attr, model.pt2, or hf:ID_OR_FOLDER (a "
                   "Hugging Face hub id or a folder written by save_pretrained)")
    e.add_argument("--task", metavar="TASK",
                   help="hf: models: the task, by optimum's name (fill-mask, "
                   "text-classification, question-answering, image-classification, "
                   "text-generation-with-past ...); detected from config.architectures if left "
                   "out")
    e.add_argument("--dtype", choices=["fp32", "fp16", "bf16"],
                   help="hf: models: the dtype the checkpoint is loaded in (default fp32)")
    e.add_argument("--trust-remote-code", action="store_true",
                   help="hf: models: allow the checkpoint's own Python code (never implied)")
    e.add_argument("--backend", choices=["auto", "export", "builder"],
                   help="hf: text-generation-with-past: who builds the package (default auto: "
                   "onnxruntime-genai's model builder where it serves the checkpoint, its "
                   "package verified like onnxmedic's own, else onnxmedic's export; export: "
                   "onnxmedic's export; builder: the builder or nothing)")
    e.add_argument("-o", "--output", metavar="OUT.onnx", help="where to write the verified model")
    e.add_argument("--dynamic", action="append", default=[], metavar="SPEC",
                   help="dynamic dims: INPUT:DIM=NAME[,DIM=NAME], e.g. x:0=batch; or "
                   "torch.onnx's dynamic_axes dict, e.g. \"{'x': [0, 1]}\"; or auto (every "
                   "dim dynamic where the model allows it)")
    e.add_argument("--target", type=target_arg, default="cpu",
                   metavar="{cpu,cpu:ISA,cuda,tensorrt}",
                   help="cpu:ISA (avx2, avx-vnni, avx512-vnni, amx, arm64): with --optimize "
                   "--precision int8, int8 settings for that instruction set instead of the "
                   "portable ones (docs/optimize-isa.md)")
    e.add_argument("--ort-version", metavar="X.Y", type=_ort_arg,
                   help="the ONNX Runtime release the model must load in (opset and IR version "
                   "are fitted to it and verified)")
    e.add_argument("--dtype-policy", choices=["upcast", "boundary", "keep"], default="upcast",
                   help="nodes with no kernel on the target for their dtype (bfloat16 Gemm on "
                   "CPU): compute them in float32 between casts (upcast, default), compute the "
                   "whole graph in float32 with casts at its inputs/outputs (boundary), or "
                   "report only (keep)")
    e.add_argument("--opset", type=int, metavar="N", help="ONNX opset (default: torch.onnx's)")
    e.add_argument("--no-verify", action="store_true", help="skip running in ONNX Runtime")
    e.add_argument("--no-progress", action="store_true",
                   help="no live stage display on stderr (shown on a terminal by default)")
    e.add_argument("--keep-unverified", action="store_true",
                   help="write the output even when verification fails")
    e.add_argument("--explain", action="store_true",
                   help="print the op inventory: every ATen op, count, and who translates it")
    common(e)
    from onnxmedic.optimize import cli as optimize_cli  # hook (issue 17)

    optimize_cli.add_export_flags(e)
    optimize_cli.add_parser(sub)
    optimize_cli.add_bench_parser(sub)

    v = sub.add_parser("verify", help="compare an existing ONNX file with the PyTorch model",
                       epilog=EPILOG)
    v.add_argument("onnx", metavar="OUT.onnx")
    v.add_argument("model", metavar="MODEL")
    v.add_argument("--localize", action="store_true",
                   help="compare intermediate values too: name the first node whose value "
                   "leaves tolerance and the nodes that grow the error most")
    common(v)

    d = sub.add_parser("doctor", help="lint an ONNX file for a target runtime (no PyTorch)",
                       epilog=EPILOG)
    d.add_argument("onnx", metavar="OUT.onnx")
    d.add_argument("--target", choices=["cpu", "cuda", "tensorrt"], default="cpu")
    d.add_argument("--ort-version", metavar="X.Y", type=_ort_arg,
                   help="also check opset and IR version against this ONNX Runtime release")
    d.add_argument("--no-smoke-test", action="store_true", help="do not load and run the model")
    d.add_argument("--report", metavar="FILE", help="write a .json or .html report")
    d.add_argument("--timeout", type=float, default=120.0, metavar="S")
    d.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    d.add_argument("-v", "--verbose", action="store_true", help="also show info findings")

    rd = sub.add_parser("reduce", help="shrink a failing ONNX model to a minimal repro",
                        epilog=EPILOG)
    rd.add_argument("onnx", metavar="IN.onnx")
    rd.add_argument("-o", "--output", required=True, metavar="MIN.onnx",
                    help="the reduced model; MIN.inputs.npz and MIN.repro.py go next to it")
    rd.add_argument("--until", default="crash", metavar="CRITERION",
                    help='crash, hang, mismatch (against onnx\'s reference evaluator or '
                    '--reference), or a shell command with {model} (and optionally {inputs}) '
                    'that exits non-zero while the failure is there, e.g. "python check.py '
                    '{model}"')
    rd.add_argument("--input", "-i", metavar="INPUTS.npz",
                    help="the model's inputs by name (random ones by default)")
    rd.add_argument("--reference", metavar="VALUES.npz",
                    help="for --until mismatch: expected values by ONNX value name")
    rd.add_argument("--timeout", type=float, default=30.0, metavar="S",
                    help="seconds per candidate run (default 30); a hang is a run past it")
    rd.add_argument("--max-runs", type=int, default=200, metavar="N")
    rd.add_argument("--rtol", type=float, help="override the relative tolerance")
    rd.add_argument("--atol", type=float, help="override the absolute tolerance")
    rd.add_argument("--seed", type=int, default=0, help="seed for generated inputs")
    rd.add_argument("--report", metavar="FILE", help="write a .json or .html report")
    rd.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    rd.add_argument("-v", "--verbose", action="store_true", help="also show info findings")

    r = sub.add_parser("run", help="safe inference with input-contract checks", epilog=EPILOG)
    r.add_argument("onnx", metavar="OUT.onnx")
    r.add_argument("--input", "-i", action="append", default=[], metavar="SPEC",
                   help="a shape 2x3:float32 (random data), inputs.npz (named after the model's "
                   "inputs, or arr_0..), inputs.pt; repeat per input")
    r.add_argument("--cast", action="store_const", const="safe", default="no",
                   help="cast inputs to the model's dtypes where lossless")
    r.add_argument("--cast-lossy", dest="cast", action="store_const", const="all",
                   help="cast inputs to the model's dtypes even when values may change")
    r.add_argument("--save", metavar="OUT.npz", help="save the outputs to an .npz file")
    r.add_argument("--target", choices=["cpu", "cuda", "tensorrt"], default="cpu")
    r.add_argument("--timeout", type=float, default=120.0, metavar="S")
    r.add_argument("--seed", type=int, default=0, help="seed for generated inputs")
    r.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    r.add_argument("-v", "--verbose", action="store_true", help="also show info findings")
    s = sub.add_parser("sweep", help="export and verify every model of a zoo, in parallel "
                       "worker processes", epilog=EPILOG)
    s.add_argument("zoo", metavar="ZOO", help="a .py file, module or folder defining "
                   "ZOO = {name: factory} (file.py:ATTR for another dict name)")
    s.add_argument("--jobs", "-j", type=int, metavar="N",
                   help="entries at a time (default: the CPU cores)")
    s.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="seconds per entry before its worker is killed (default 600)")
    s.add_argument("--results", metavar="RESULTS.json",
                   help="write every entry's result there, atomically after each entry")
    s.add_argument("--resume", metavar="RESULTS.json",
                   help="skip the entries already in this results file, and add to it")
    s.add_argument("--only", action="append", default=[], metavar="NAME[,NAME]",
                   help="run only these entries")
    s.add_argument("--executor", choices=["local", "ray"], default="local",
                   help="worker processes here (local) or Ray tasks (ray)")
    s.add_argument("--ray-address", metavar="ADDR",
                   help="a running Ray cluster (default: start a local instance)")
    s.add_argument("--keep-models", metavar="DIR", help="write each verified model to DIR")
    s.add_argument("--no-verify", action="store_true", help="skip running in ONNX Runtime")
    s.add_argument("--no-progress", action="store_true", help="no live progress bar")
    s.add_argument("--report", metavar="FILE", help="write a .json or .html summary")
    s.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    s.add_argument("-v", "--verbose", action="store_true", help="also show info findings")
    return p


def _sweep_command(ns: argparse.Namespace) -> Any:
    from onnxmedic.sweep import sweep

    if ns.results and ns.resume and ns.results != ns.resume:
        build_parser().error("give either --results or --resume (which also writes), not both")
    if ns.jobs is not None and ns.jobs < 1:
        build_parser().error("--jobs must be at least 1")
    names = [n for x in ns.only for n in x.split(",") if n]
    return sweep(ns.zoo, jobs=ns.jobs, timeout=ns.timeout, results=ns.resume or ns.results,
                 resume=bool(ns.resume), executor=ns.executor, ray_address=ns.ray_address,
                 names=names or None, verify=not ns.no_verify, out_dir=ns.keep_models,
                 report=ns.report, progress=not ns.no_progress and sys.stderr.isatty())


def _tolerance(ns: argparse.Namespace) -> tuple[float, float] | None:
    if ns.rtol is None and ns.atol is None:
        return None
    return (ns.rtol if ns.rtol is not None else 1e-4, ns.atol if ns.atol is not None else 1e-5)


def _run(ns: argparse.Namespace) -> Any:
    from onnxmedic.findings import OnnxMedicError

    if ns.command == "export" and ns.model.startswith(HF_PREFIX):
        # before onnxmedic.api is imported: export_pretrained starts onnxruntime-genai's
        # builder (a forked child) as soon as the checkpoint's config is read, and imports
        # the rest while it writes
        try:
            _package_output(ns.output)
            return _hf_export(ns)
        except OnnxMedicError as err:
            return _inputs_failed(ns, err)
    from onnxmedic import api, inputs

    if ns.command == "doctor":
        return api.doctor(ns.onnx, target=ns.target, timeout=ns.timeout,
                          smoke_test=not ns.no_smoke_test, report=ns.report,
                          ort_version=ns.ort_version)
    if ns.command == "run":
        return _run_command(ns)
    if ns.command == "reduce":
        return api.reduce(ns.onnx, ns.output, until=ns.until, timeout=ns.timeout,
                          feeds=ns.input, reference=ns.reference, tolerance=_tolerance(ns),
                          max_runs=ns.max_runs, seed=ns.seed, report=ns.report)
    if ns.command == "sweep":
        return _sweep_command(ns)
    try:
        model, _source = inputs.load_model(ns.model)
        ex = inputs.load_inputs(ns.input, seed=ns.seed)
        if ns.command == "export":
            specs = inputs.parse_dynamic_specs(ns.dynamic)
            dyn = specs if specs == inputs.AUTO else inputs.complete_dynamic_shapes(
                model, specs, ex.args, ex.kwargs)
            options = {"dynamic_shapes": dyn, "target": ns.target, "opset": ns.opset,
                       "timeout": ns.timeout, "tolerance": _tolerance(ns),
                       "dtype_policy": ns.dtype_policy, "ort_version": ns.ort_version}
            with stage_display(model, enabled=not ns.no_progress and sys.stderr.isatty()
                                ) as on_stage:
                res = api.export(model, ex.args, ns.output, kwargs=ex.kwargs,
                                 verify=not ns.no_verify, report=ns.report,
                                 keep_unverified=ns.keep_unverified, explain=ns.explain,
                                 model_spec=ns.model, input_specs=ns.input, repro=ns.repro,
                                 optimize=ns.optimize, precision=ns.precision,
                                 accuracy=ns.accuracy, cuda_graph=ns.cuda_graph,
                                 calibration=(inputs.load_calibration(ns.calibration)
                                              if ns.calibration is not None else None),
                                 on_stage=on_stage, **options)
        else:
            res = api.verify(ns.onnx, model, ex.args, kwargs=ex.kwargs, report=ns.report,
                             model_spec=ns.model, input_specs=ns.input,
                             localize=ns.localize, timeout=ns.timeout,
                             tolerance=_tolerance(ns), repro=ns.repro)
        if res.repro is not None:
            sys.stderr.write(f"reproduction written: python {res.repro}\n")
        return res
    except OnnxMedicError as err:
        return _inputs_failed(ns, err)


def _package_output(out: str | None) -> None:
    """OnnxMedicError before anything is loaded when ``-o`` is an existing folder that is not a
    package (OM738: a package replaces the whole folder; a model file's -o cannot be a folder
    either) or a new one whose parent cannot take it (OM006: missing, a file, not writable);
    an existing file is refused where the package is put in place."""
    from onnxmedic.findings import OnnxMedicError
    from onnxmedic.onnxfile import package_output_problem

    if out is not None and (os.path.isdir(out) or not os.path.exists(out)) and (
            bad := package_output_problem(out, stage="inputs")) is not None:
        raise OnnxMedicError(bad)


def _inputs_failed(ns: argparse.Namespace, err: Any) -> Any:
    """The export or verify command's result when its model or inputs cannot be loaded
    (``err``: the OnnxMedicError), its report written."""
    from onnxmedic.api import ExportResult
    from onnxmedic.result import stages_of

    result = ExportResult(command=ns.command, model=ns.model, inputs=list(ns.input),
                          stages=stages_of("inputs"))
    result.fail("inputs", err.finding)
    if ns.report:
        from onnxmedic.report import write_report

        write_report(result, ns.report)
    return result


HF_PREFIX = "hf:"


def _hf_flag_error(ns: argparse.Namespace) -> str | None:
    """Flags that only go with hf: models, and those that do not go with them."""
    if ns.command != "export":
        return None
    if not ns.model.startswith(HF_PREFIX):
        used = [f for f, v in (("--task", ns.task), ("--dtype", ns.dtype),
                               ("--trust-remote-code", ns.trust_remote_code),
                               ("--backend", ns.backend),
                               ("--precision int4", ns.precision == "int4")) if v]
        return (f"{', '.join(used)} {'goes' if len(used) == 1 else 'go'} only with hf: models "
                "(hf:ID_OR_FOLDER)") if used else None
    if ns.input:
        return ("--input is not used with hf: models: the example inputs come from the "
                "checkpoint's tokenizer or processor and its config")
    if ns.repro or ns.calibration is not None:
        return "--repro and --calibration are not available for hf: models"
    if ns.precision == "int4":  # a generation package (hf/transforms/precision.py)
        from onnxmedic.hf.transforms.precision import precision_problem

        if bad := precision_problem("int4", ns.target):
            return bad
        if ns.no_verify:
            return "--precision int4 judges the package against PyTorch: drop --no-verify"
    if ns.target != "cpu" and (task := _package_task(ns)) is not None:
        from onnxmedic.hf.transforms.precision import precision_problem

        return (f"{precision_problem('fp32', ns.target)} ({task}: the package is verified "
                "and served on the CPU; drop --target)")
    return None


def _package_task(ns: argparse.Namespace) -> str | None:
    """The generation task (a package) an hf: export of a local checkpoint folder makes, read
    from --task or the folder's config.json; None for another task, or a hub id (its config
    is not fetched to check flags)."""
    from onnxmedic.hf.checkpoint import strip_prefix

    folder = Path(strip_prefix(ns.model))
    task = ns.task
    if task is None:
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            return None
        from onnxmedic.hf.tasks import detect_task

        task = detect_task(config, folder)
    from onnxmedic.hf.tasks import GENERATION

    return task if task in GENERATION else None


def _hf_export(ns: argparse.Namespace) -> Any:
    """export hf:ID_OR_FOLDER: onnxmedic.export_pretrained with the export command's flags."""
    from onnxmedic import inputs
    from onnxmedic.hf import export_pretrained

    dynamic: Any = True
    if ns.dynamic:
        dynamic = inputs.parse_dynamic_specs(ns.dynamic)
    return export_pretrained(
        ns.model, ns.output, task=ns.task, dtype=ns.dtype or "fp32",
        trust_remote_code=ns.trust_remote_code, dynamic=dynamic, target=ns.target,
        opset=ns.opset, verify=not ns.no_verify, report=ns.report,
        keep_unverified=ns.keep_unverified, timeout=ns.timeout, tolerance=_tolerance(ns),
        explain=ns.explain, dtype_policy=ns.dtype_policy, ort_version=ns.ort_version,
        optimize=ns.optimize, precision=ns.precision, accuracy=ns.accuracy,
        cuda_graph=ns.cuda_graph, backend=ns.backend or "auto")


@contextlib.contextmanager
def stage_display(model: Any, enabled: bool, console: Any = None) -> Any:
    """A live line on stderr while export runs: the stage, the model's size, time elapsed (a
    silent multi-minute export looks hung). Yields the on_stage callback, or None."""
    from onnxmedic.report.live import live_line

    params = getattr(model, "parameters", None)
    nbytes = (sum(p.numel() * p.element_size() for p in params())
              if enabled and callable(params) else 0)
    size = f"{nbytes / 2**20:,.0f} MiB of weights" if nbytes else "an ExportedProgram"
    with live_line(f"export ({size})", enabled, console=console) as show:
        yield None if show is None else (
            lambda stage: show(f"export: {stage} ({size})"))


def _run_command(ns: argparse.Namespace) -> Any:
    from onnxmedic import api, inputs
    from onnxmedic.findings import OnnxMedicError
    from onnxmedic.onnxfile import check_output_path
    from onnxmedic.result import stages_of

    try:
        if ns.save and (unwritable := check_output_path(ns.save, stage="inputs")) is not None:
            raise OnnxMedicError(unwritable)  # before the model runs
        ex = inputs.load_inputs(ns.input, seed=ns.seed)
    except OnnxMedicError as err:
        result = api.RunResult(command="run", path=ns.onnx, model=ns.onnx,
                               stages=stages_of("inputs"))
        return result.fail("inputs", err.finding)
    from onnxmedic._tensors import to_numpy

    feeds: Any = ({k: to_numpy(v) for k, v in ex.kwargs.items()} if ex.kwargs and not ex.args
                  else [to_numpy(a) for a in ex.args])
    result = api.run(ns.onnx, feeds, cast=ns.cast, target=ns.target, timeout=ns.timeout)
    if result.ok:
        import numpy as np

        if ns.save:
            import io

            from onnxmedic.report.files import atomic_write_bytes

            buf = io.BytesIO()
            np.savez(buf, **result.outputs)
            atomic_write_bytes(ns.save, buf.getvalue())
        elif not ns.json:
            for name, arr in result.outputs.items():
                sys.stdout.write(f"{name}: {arr.dtype}{list(arr.shape)}\n{arr}\n")
    return result


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit code. Every command goes through here, and nothing leaves as
    a traceback: Ctrl-C is exit 130, and an exception onnxmedic did not expect is OM009, exit 3,
    its traceback kept in the command's report (:func:`internal_error`)."""
    ns: argparse.Namespace | None = None
    try:
        ns = build_parser().parse_args(argv)
        return _dispatch(ns)
    except KeyboardInterrupt:
        sys.stderr.write("onnxmedic: interrupted; nothing was written.\n")
        return 130
    except Exception as exc:  # noqa: BLE001 - the last resort of every command
        return internal_error(ns, exc)


def _flag_error(ns: argparse.Namespace) -> str | None:
    """What argparse cannot check alone: flags that do not go together."""
    if ns.command == "export" and ns.optimize:
        from onnxmedic.optimize.passes import precision_error

        if bad := precision_error(ns.precision, ns.target, flags=True):
            return bad
    if ns.command == "verify" and ns.model.startswith(HF_PREFIX):
        return ("verify takes the PyTorch model as file.py:Attr, pkg.module:Attr or model.pt2, "
                "not hf:; `onnxmedic export hf:ID_OR_FOLDER` verifies what it writes, and a "
                "generation package is verified against its checkpoint folder with `python -m "
                "onnxmedic.hf.stream PACKAGE_DIR CHECKPOINT_DIR` (docs/generation.md)")
    if ns.command == "export":
        from onnxmedic.optimize.passes import unused_precision

        if bad := unused_precision(ns.precision, ns.optimize, flags=True):
            return bad
    if ns.command == "export":
        from onnxmedic.optimize.cli import calibration_flag_error

        if bad := calibration_flag_error(ns) or _hf_flag_error(ns):
            return bad
    if (ns.command in ("export", "optimize") and getattr(ns, "accuracy", None) is not None
            and getattr(ns, "precision", "") != "int4"):  # int4: a task budget (optimize/int4)
        from onnxmedic.optimize import parse_accuracy

        try:
            parse_accuracy(ns.accuracy)
        except ValueError as e:
            return f"--{e}"
    return None


def _dispatch(ns: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from onnxmedic import noise

    # first: checking the flags may import transformers (the task of an hf: folder)
    noise.silence(progress=not getattr(ns, "no_progress", False) and sys.stderr.isatty())
    if bad := _flag_error(ns):
        build_parser().error(bad)
    return COMMANDS[ns.command](ns)


def _optimize_command(ns: argparse.Namespace) -> int:  # hook (issue 17): its own table
    from onnxmedic.optimize import cli as optimize_cli

    return optimize_cli.main(ns)


def _bench_command(ns: argparse.Namespace) -> int:  # hook (issue 17)
    from onnxmedic.optimize import cli as optimize_cli

    return optimize_cli.bench_main(ns)


def _result_command(ns: argparse.Namespace) -> int:
    """export, verify, doctor, run, reduce, sweep: a result rendered on the terminal (and as
    JSON with --json); its exit code."""
    # torch.export logs graph dumps and guard warnings for failures onnxmedic reports itself
    logging.getLogger("torch").setLevel(logging.ERROR)
    result = _run(ns)
    if ns.command == "sweep":
        from onnxmedic.report.sweep import render_sweep_terminal

        render_sweep_terminal(result)
    else:
        from onnxmedic.report import render_terminal

        render_terminal(result, verbose=ns.verbose)
    if ns.json:
        sys.stdout.write(json.dumps(result.to_dict(), indent=2, default=str) + "\n")
    return result.exit_code


# every subcommand of build_parser(), and the function that runs it (tests/test_cli_errors.py
# keeps the two in step)
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "optimize": _optimize_command, "bench": _bench_command,
    **dict.fromkeys(("export", "verify", "doctor", "run", "reduce", "sweep"), _result_command)}


def internal_error(ns: argparse.Namespace | None, exc: BaseException) -> int:
    """OM009, exit 3, for an exception no command expected (called in its ``except``): one
    paragraph on stderr; the traceback in the command's ``--report`` when it has one that can
    be written, else in a file of the temp folder; the result on stdout with ``--json``."""
    import tempfile

    from onnxmedic.findings import error
    from onnxmedic.result import ExportResult

    command = ns.command if ns is not None else "onnxmedic"
    tb = traceback.format_exc()
    result = ExportResult(command=command, model=getattr(ns, "model", getattr(ns, "onnx", None)),
                          traceback=tb, stages={})
    finding = error("OM009", command, f"`onnxmedic {command}` failed internally: "
                    f"{type(exc).__name__}: {exc}")
    result.findings.append(finding)
    bug = "This is a bug in onnxmedic; please report it with the traceback saved in "
    report = getattr(ns, "report", None)
    written = False
    if report:
        from onnxmedic.report import write_report

        finding.suggestion = bug + f"the report {report}"
        try:
            write_report(result, report)  # a path it cannot write: OM006 added, not raised
            written = len(result.findings) == 1
        except Exception:  # noqa: BLE001 - the report's own bug: the temp file keeps it
            logging.getLogger(__name__).debug("report not written", exc_info=True)
    if not written:
        fd, where = tempfile.mkstemp(prefix="onnxmedic-internal-error-", suffix=".txt")
        with os.fdopen(fd, "w") as fh:
            fh.write(tb)
        finding.suggestion = bug + where
    sys.stderr.write(finding.one_paragraph() + "\n")
    if getattr(ns, "json", False):
        sys.stdout.write(json.dumps(result.to_dict(), indent=2, default=str) + "\n")
    return 3


def entry() -> None:
    """The ``onnxmedic`` command and ``python -m onnxmedic``: :func:`main`, then the process
    exits. What main made stays until then, so it is frozen first: the interpreter's final
    garbage collections would walk every object of torch, transformers and the model (a
    second after a 0.5 B checkpoint's export)."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()
