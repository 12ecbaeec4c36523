"""When verification localises, and on which program: the one rebuilt from the ONNX file's
own metadata (verify/replay.py: no capture) where it can be, else a captured one."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnxmedic import borrow, sandbox
from onnxmedic.findings import Severity, warning
from onnxmedic.inputs import Inputs
from onnxmedic.result import PASSED, ExportResult
from onnxmedic.verify import localize as loc_mod
from onnxmedic.verify.replay import NotReplayable, replay_program

logger = logging.getLogger(__name__)
STAGE = "localize"


@dataclass
class Localizer:
    """Localisation for one verification: on a value mismatch (OM601), or always when
    ``always``. ``get_program()`` gives (ExportedProgram, already decomposed?) or None (no
    capture possible). With ``module`` (the nn.Module verified), the program is first rebuilt
    from the ONNX file, and captured only where that fails. ``worker``: a sandbox worker
    started ahead (closed here, used or not)."""

    always: bool
    get_program: Callable[[], tuple[Any, bool] | None]
    module: Any = None
    worker: sandbox.Runner | None = None

    def run(self, result: ExportResult, proto: Any, inputs: Inputs,
            feeds: dict[str, np.ndarray], timeout: float,
            tolerance: tuple[float, float] | None, label: str,
            reference: list[np.ndarray] | None = None, model_dir: Any = None) -> None:
        """Localise the divergence on one input set; its findings join the result's.
        ``model_dir``: where the model's external data lies, if it has any."""
        job = _Job(proto, inputs, feeds, timeout, tolerance, label, model_dir)
        with result.timed(STAGE):
            # it imports ONNX Runtime while the program is rebuilt or captured
            worker = self.worker if self.worker is not None else sandbox.worker()
            if self.module is not None and reference is not None:
                loc, worker = job.replayed(self.module, reference, worker)
                if loc is not None:
                    add_localization(result, loc)
                    return
            loc = job.captured(result, self.get_program, worker)
        if loc is not None:
            add_localization(result, loc)


@dataclass
class _Job:
    proto: Any
    inputs: Inputs
    feeds: dict[str, np.ndarray]
    timeout: float
    tolerance: tuple[float, float] | None
    label: str
    model_dir: Any = None

    def localize(self, program: Any, worker: sandbox.Runner, **kw: Any) -> Any:
        # a copy of its own: a model that writes an input must not change the set's values
        args, kwargs = borrow.copy_inputs((self.inputs.args, self.inputs.kwargs))
        return loc_mod.localize(self.proto, program, args, kwargs,
                                feeds=self.feeds, tolerance=self.tolerance,
                                timeout=self.timeout, input_set=self.label, worker=worker,
                                model_dir=self.model_dir, **kw)

    def replayed(self, module: Any, reference: list[np.ndarray], worker: sandbox.Runner
                 ) -> tuple[Any, sandbox.Runner]:
        """Localisation on the program rebuilt from the ONNX file, or None (and a live worker
        for the capture that follows) where it cannot be rebuilt or does not compute the
        model's outputs."""
        try:
            replayed = replay_program(self.proto, module, self.feeds)
        except NotReplayable as e:
            logger.debug("localisation captures: the ONNX file's program is incomplete: %s", e)
            return None, worker
        except Exception as e:  # a bug of the rebuild must not cost the localisation
            logger.debug("localisation captures: rebuilding failed: %s", e, exc_info=True)
            return None, worker
        try:
            loc = self.localize(replayed, worker, reference=reference)
        except Exception as e:  # NotReplayable, or a bug: capture as before
            logger.debug("localisation captures: the rebuilt program failed: %s", e)
            worker.close()  # used (or closed) by localize(): a fresh one for the capture path
            return None, sandbox.worker()
        return loc, worker

    def captured(self, result: ExportResult, get_program: Callable[[], Any],
                 worker: sandbox.Runner) -> Any:
        """Localisation on a captured program, or None with an OM611 warning."""
        try:
            got = get_program()
        except BaseException:
            worker.close()
            raise
        if got is None:
            worker.close()
            result.findings.append(warning(
                "OM611", STAGE, "no localisation: the model could not be captured with "
                "torch.export, so there are no FX nodes to compare with.",
                suggestion="Fix the capture findings first (onnxmedic export MODEL)."))
            return None
        program, decomposed = got
        try:
            return self.localize(program, worker, decomposed=decomposed)
        except Exception as e:  # localisation explains; it must never break the verdict
            worker.close()
            logger.debug("localisation failed", exc_info=True)
            result.findings.append(warning(
                "OM611", STAGE, f"localisation failed ({type(e).__name__}: "
                f"{str(e)[:300]}); the verification result stands.",
                suggestion="Please report it to onnxmedic with the model."))
            return None


def add_localization(result: ExportResult, loc: Any) -> None:
    result.localization = loc
    # OM610 is an error only where the result already failed: it explains the mismatch
    for f in loc.findings:
        if f.code == "OM610" and result.stages.get("compare") == PASSED:
            f.severity = Severity.WARNING
        result.findings.append(f)
