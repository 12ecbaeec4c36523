"""Pass pipelines for ``onnxmedic.optimize``: each step is a function ``step(in_path, out_path,
**options) -> dict`` that writes a new ONNX file and returns what it did (fused-op counts, node
counts). Steps are named ``"module:function"`` so that a pipeline can run in a child process
(see :func:`run_pipeline`): a step that crashes or hangs becomes a rejected variant.

One pass per module, its test beside it in tests/optimize/passes/: onnxscript_optimizer.py,
fusions.py (onnxscript's ORT fusions), offline.py (ONNX Runtime's saved levels),
transformers_optimizer.py, slim.py, dynamic_int8.py, weight_only_int8.py, static_int8.py. Every
step is named after this package (``onnxmedic.optimize.passes:ort_fusions``), as it was when the
passes shared one file, so the step names in reports and JSON do not change."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onnxmedic.optimize._child import run_request
from onnxmedic.optimize.pass_infra import PassResult, Sequential, StepPass
from onnxmedic.optimize.passes.dynamic_int8 import quantize_int8
from onnxmedic.optimize.passes.fusions import ort_fusions
from onnxmedic.optimize.passes.offline import ort_offline
from onnxmedic.optimize.passes.onnxscript_optimizer import onnxscript_optimize
from onnxmedic.optimize.passes.slim import onnxslim_pass
from onnxmedic.optimize.passes.static_int8 import (
    STATIC_OPS,
    feed_reader,
    is_convolutional,
    quantize_static_int8,
)
from onnxmedic.optimize.passes.transformers_optimizer import ort_model_type, ort_transformers
from onnxmedic.optimize.passes.weight_only_int8 import quantize_weight_only

__all__ = [
    # the steps, named "onnxmedic.optimize.passes:<function>"
    "onnxscript_optimize", "ort_fusions", "ort_offline", "ort_transformers", "onnxslim_pass",
    "quantize_int8", "quantize_weight_only", "quantize_static_int8",
    # what the candidates, the searches and int8.py read of the passes
    "ort_model_type", "STATIC_OPS", "feed_reader", "is_convolutional",
    # the pipelines and how they run
    "DEFAULT_PASS_TIMEOUT", "CHILD", "STATIC_STEP", "QUANTIZE_STEPS", "Pipeline", "PipelineRun",
    "default_pipelines", "is_static", "precision_error", "unused_precision", "calibration_error",
    "run_passes", "run_pipeline", "run_child", "step_error",
]

DEFAULT_PASS_TIMEOUT = 600.0


STATIC_STEP = ":quantize_static_int8"
QUANTIZE_STEPS = (":quantize_int8", ":quantize_weight_only", STATIC_STEP)


def is_static(steps: Iterable[str]) -> bool:
    """Whether the step specs ``steps`` ("module:function") quantize statically (QDQ,
    calibrated activation ranges)."""
    return any(s.endswith(STATIC_STEP) for s in steps)


def precision_error(precision: str, target: str, flags: bool = False) -> str | None:
    """Why ``precision`` cannot be built for ``target`` (None when it can): int8 is CPU-only.
    Worded with the CLI's flags (``flags``) or the API's arguments."""
    if precision != "int8" or target.partition(":")[0] == "cpu":  # cpu:<isa> too
        return None
    p, t, q = ("--precision ", "--target ", str) if flags else ("precision=", "target=", repr)
    return (f"{p}{q('int8')} is for {t}{q('cpu')} (ONNX Runtime's dynamic and weight-only int8 "
            f"kernels run on the CPU); use {p}{q('fp16')} for {t}{q(target)}")


def unused_precision(precision: str, optimize: bool, flags: bool = False) -> str | None:
    """Why export at ``precision`` fp16 or int8 without ``optimize`` is refused (None when it is
    not): the precision is that of optimize's candidates, so the float32 model would be
    written, verified, as if it had been honoured. Worded with the CLI's flags (``flags``) or
    the API's arguments."""
    if optimize or precision not in ("fp16", "int8"):
        return None
    p, o = ("--precision ", "--optimize") if flags else ("precision=", "optimize=True")
    return (f"{p}{precision} takes effect with {o} (the fastest variant at {precision} that "
            f"still verifies); without it the float32 model would be written. A generation "
            f"package (text-generation-with-past) is made at {p}fp32 or {p}int4.")


def calibration_error(precision: str, optimize: bool = True, flags: bool = False) -> str | None:
    """Why calibration sets cannot be used (None when they can): they are static int8's, so
    for ``optimize`` at precision int8 only. Worded with the CLI's flags (``flags``) or the
    API's arguments."""
    if optimize and precision == "int8":
        return None
    if flags:
        return ("--calibration is for --optimize --precision int8" if not optimize else
                f"--calibration is for --precision int8 (static int8's activation ranges), "
                f"not {precision}")
    need, got = "precision='int8'", f"precision={precision!r}"
    if not optimize:
        need, got = f"optimize=True, {need}", f"optimize={optimize}, {got}"
    return f"calibration sets are for {need} (static int8), not {got}"


@dataclass
class Pipeline:
    """A named candidate: steps run in order, each ``(module:function, options)``."""

    name: str
    steps: list[tuple[str, dict[str, Any]]]
    precision: str = "fp32"
    portable: bool = True  # standard ONNX ops only
    note: str = ""
    options: dict[str, Any] = field(default_factory=dict)


_HERE = __name__
# the children's script: it imports this module without onnxmedic's package (torch), which
# cost each pass child 1.9 s here
CHILD = Path(__file__).resolve().parents[1] / "_child.py"


def default_pipelines(target: str = "cpu", precision: str = "fp32",
                      model_type: str | None = None, convolutional: bool = False,
                      isa: str | None = None) -> list[Pipeline]:
    """The candidates for ``target`` and ``precision`` (the plain export is always the baseline);
    ``model_type`` (:func:`ort_model_type`) adds ONNX Runtime's transformers optimizer;
    ``convolutional`` (:func:`is_convolutional`) adds static int8 at precision int8, with
    settings for the instruction set ``isa`` (None: portable, see onnxmedic/isa.py). GPU
    targets drop the CPU-only saved levels; tensorrt keeps the portable pipelines only
    (``com.microsoft`` ops would leave TensorRT for the CUDA provider)."""
    out = [
        Pipeline("onnxscript-optimize", [(f"{_HERE}:onnxscript_optimize", {})],
                 note="constant folding, CSE, dead code"),
        Pipeline("ort-fusions", [(f"{_HERE}:ort_fusions", {})], portable=False,
                 note="onnxscript ORT fusions (com.microsoft ops)"),
        Pipeline("ort-offline-basic", [(f"{_HERE}:ort_offline", {"level": "basic"})],
                 note="ONNX Runtime basic level, saved (portable)"),
    ]
    # a peer's float32 recipe, so a candidate: chosen wherever it beats the plain export beyond
    # noise (CPU, ORT 1.32, 2 threads: 0.99-1.03x on BERT-base and GPT-2, within noise)
    out.append(Pipeline("onnxslim", [(f"{_HERE}:onnxslim_pass", {})],
                        note="onnxslim (folding, MatMul+Add -> Gemm, redundant shape ops; "
                        "portable)"))
    if target == "cpu":
        out += [Pipeline("ort-fusions-attention",
                         [(f"{_HERE}:ort_fusions", {"norm_fusions": False})], portable=False,
                         note="onnxscript ORT fusions without the skip-norm and bias-GELU ones "
                         "(slower on ONNX Runtime's CPU kernels)"),
                Pipeline("ort-offline-extended",
                         [(f"{_HERE}:ort_offline", {"level": "extended"})], portable=False,
                         note="ONNX Runtime extended level, saved: CPU provider only")]
    if model_type:
        out.append(Pipeline(f"ort-transformers-{model_type}",
                            [(f"{_HERE}:ort_transformers", {"model_type": model_type})],
                            portable=False, note="ONNX Runtime's transformers optimizer "
                            f"(model_type {model_type!r}, fusions only)"))
    if precision == "fp16":
        fp16 = "onnxmedic.optimize.fp16:float16"
        out += [Pipeline("fp16", [(f"{_HERE}:onnxscript_optimize", {}), (fp16, {})],
                         precision="fp16", note="onnxscript optimizer + float16 (float32 I/O, "
                         "measured block list)"),
                Pipeline("ort-fusions-fp16", [(f"{_HERE}:ort_fusions", {}), (fp16, {})],
                         precision="fp16", portable=False,
                         note="onnxscript ORT fusions + float16 (measured block list)")]
        if model_type and target != "cpu":  # the recipe optimum's -O4 and ORT's docs give GPUs
            out.append(Pipeline(
                f"ort-transformers-{model_type}-fp16",
                [(f"{_HERE}:ort_transformers", {"model_type": model_type}), (fp16, {})],
                precision="fp16", portable=False,
                note=f"ONNX Runtime's transformers optimizer ({model_type!r}) + float16 "
                "(measured block list)"))
    if target == "tensorrt":  # TensorRT fuses on its own and takes standard ONNX ops only
        out = [p for p in out if p.portable]
    if precision == "int8":
        out += _int8_pipelines(convolutional, isa)
    return out


def _int8_pipelines(convolutional: bool, isa: str | None = None) -> list[Pipeline]:
    """The int8 candidates (CPU): dynamic per tensor and per channel, dynamic behind the
    attention fusions, weight-only MatMulNBits; static QDQ for convolutional graphs. The
    quantize steps' defaults are portable (7-bit weights); an ``isa`` whose u8s8 kernels do
    not saturate gets full 8-bit weights. MatMulNBits saturates nowhere (signed int8 both
    sides), so it is the same for every ``isa``."""
    from onnxmedic.isa import reduce_range

    full = {} if reduce_range(isa) else {"reduce_range": False}
    opt = (f"{_HERE}:onnxscript_optimize", {})
    out = [
        Pipeline("int8-dynamic", [opt, (f"{_HERE}:quantize_int8", dict(full))],
                 precision="int8",
                 note="onnxscript optimizer + quantize_dynamic (MatMul/Gemm int8, one "
                 "weight scale per tensor)"),
        Pipeline("int8-dynamic-per-channel",
                 [opt, (f"{_HERE}:quantize_int8", {"per_channel": True, **full})],
                 precision="int8",
                 note="onnxscript optimizer + quantize_dynamic per_channel (one weight "
                 "scale per output channel)"),
        Pipeline("int8-dynamic-fused",
                 [(f"{_HERE}:ort_fusions", {"norm_fusions": False}),
                  (f"{_HERE}:quantize_int8", {"per_channel": True, **full})],
                 precision="int8", portable=False,
                 note="onnxscript ORT attention fusions (no skip-norm/bias-GELU) + "
                 "quantize_dynamic per channel: the attention that int8 leaves float32 "
                 "runs fused"),
        Pipeline("int8-weight-only",
                 [opt, (f"{_HERE}:quantize_weight_only",
                        {"bits": 8, "block_size": 32, "accuracy_level": 4})],
                 precision="int8", portable=False,
                 note="onnxscript optimizer + MatMulNBits 8-bit weights, blocks of 32, "
                 "int8 compute (accuracy_level 4; com.microsoft op)"),
    ]
    if convolutional:
        out.append(Pipeline(
            "int8-static",
            [opt, (f"{_HERE}:quantize_static_int8", {"per_channel": True, **full})],
            precision="int8", note="onnxscript optimizer + quantize_static, QDQ (Conv, "
            "MatMul, ... int8; weights per channel; activation ranges calibrated on input "
            "sets apart from the verification sets)"))
    return out


@dataclass
class PipelineRun:
    """How a pipeline ran in the pass child: ``ok``, each step's info (``{"step": spec, ...}``,
    the steps that ended), the ``error`` (""), and whether the file written differs from the
    source (``modified``: pass_infra.Sequential; False where it failed or wrote no model)."""

    ok: bool
    steps: list[dict[str, Any]]
    error: str = ""
    modified: bool = False


def run_passes(pipe: Pipeline, src: str | os.PathLike[str], dst: str | os.PathLike[str], *,
               timeout: float = DEFAULT_PASS_TIMEOUT, writes: bool = True) -> PipelineRun:
    """Run ``pipe`` on ``src`` in a child process, writing ``dst`` (``writes=False``: measuring
    steps, which write no model). A crash, a hang past ``timeout`` or an exception is
    ``ok=False`` with the reason. The child works in a scratch directory, removed after it:
    some tools dump files into the current one (ONNX Runtime's symbolic shape inference, when
    incomplete)."""
    request = {"src": str(Path(src).absolute()), "dst": str(Path(dst).absolute()),
               "steps": pipe.steps, "writes": writes}
    with tempfile.TemporaryDirectory(prefix="onnxmedic-pass-") as tmp:
        work = Path(tmp) / "cwd"
        work.mkdir()
        run = run_request(f"{_HERE}:run_child", request, tmp, cwd=work, timeout=timeout)
    if run.timed_out:
        return PipelineRun(False, [], f"the pass did not finish within {timeout:g} s and was "
                                      "killed")
    if run.result is None:
        how = (f"signal {-run.returncode}" if run.returncode < 0
               else f"exit code {run.returncode}")
        return PipelineRun(False, [], f"the pass crashed ({how}): "
                                      f"{' '.join(run.stderr_tail)[:300]}")
    return PipelineRun(run.result["ok"], run.result["steps"], run.result.get("error", ""),
                       run.result.get("modified", False))


def run_pipeline(pipe: Pipeline, src: str | os.PathLike[str], dst: str | os.PathLike[str], *,
                 timeout: float = DEFAULT_PASS_TIMEOUT) -> tuple[bool, list[dict[str, Any]], str]:
    """:func:`run_passes` as (ok, per-step info, error)."""
    run = run_passes(pipe, src, dst, timeout=timeout)
    return run.ok, run.steps, run.error


def run_child(req_path: str, res_path: str) -> None:
    """The pass child (run by _child.py): the request's steps, one after another, as passes
    (pass_infra.StepPass in a pass_infra.Sequential)."""
    req = json.loads(Path(req_path).read_text())
    writes = req.get("writes", True)
    infos: list[dict[str, Any]] = []

    def ended(p: StepPass, result: PassResult) -> None:
        infos.append({"step": p.spec, **result.info})

    try:
        with tempfile.TemporaryDirectory(prefix="onnxmedic-step-") as tmp:
            steps = [StepPass(spec, opts, writes=writes) for spec, opts in req["steps"]]
            done = Sequential(*steps, scratch=Path(tmp), on_pass=ended)(req["src"], req["dst"])
        out = {"ok": True, "steps": infos, "modified": done.modified}
    except Exception as e:  # noqa: BLE001 - reported as a rejected variant
        spec = req["steps"][len(infos)][0] if len(infos) < len(req["steps"]) else ""
        out = {"ok": False, "steps": infos, "error": step_error(spec, e)}
    Path(res_path).write_text(json.dumps(out))


def step_error(spec: str, e: BaseException) -> str:
    """What a failed step says: the exception, the step, and where it was raised (the last
    frame, its path from the installed package or the outermost import root) - "TypeError:
    'method' object is not iterable (in onnxmedic.optimize.passes:ort_transformers, raised
    at onnxruntime/transformers/onnx_model_phi.py:450 in preprocess_onnx)"."""
    import traceback

    where = ""
    frames = traceback.extract_tb(e.__traceback__)
    if frames:
        f = frames[-1]
        path = os.path.abspath(f.filename)
        roots = sorted({os.path.abspath(p) for p in sys.path if p}, key=len)
        root = next((r for r in roots if path.startswith(r + os.sep)), None)
        path = (path[len(root) + 1:] if root else path).replace(os.sep, "/")
        for packages in ("/site-packages/", "/dist-packages/"):  # an installed package
            path = path.rsplit(packages, 1)[-1]
        where = f", raised at {path}:{f.lineno} in {f.name}"
    step = f" (in {spec}{where})" if spec else ""
    return f"{type(e).__name__}: {str(e)[:400]}{step}"
