"""What optimize records of each candidate: :class:`Variant` (what it ran and measured),
:class:`Rejection` (why it was not chosen, as a typed record) and :class:`OptimizationResult`.

A rejection is a kind, the figures it was decided on and the sentence the report prints. Code
decides by the kind (``v.rejection.kind is Why.OUTSIDE_BUDGET``), never by the wording; the
sentence, with the notes later steps add to it (a search's outcome, a hint), is what the
terminal table, the findings and the JSON show as ``rejected``.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field, fields, replace
from typing import Any

NOISE_FRACTION = 0.03  # the timing noise rule's margin (see timing.py)
DEFAULT_COSINE = 0.999
OUTSIDE_BUDGET = "outside the accuracy budget"  # a reduced-precision variant's rejection
REFUSED = "ONNX Runtime refused it"  # a variant that did not load or run
CHANGED_NOTHING = "the passes changed nothing"
NO_CALIBRATION = ("static int8 needs calibration input sets (optimize() derives them from the "
                  "example); none were given")


class Why(enum.Enum):
    """The kinds of rejection."""

    PASS_FAILED = "pass failed"  # a step raised, crashed or hung in the pass child
    CHANGED_NOTHING = "changed nothing"  # the file the passes wrote is the one they read
    NO_CALIBRATION = "no calibration"  # static int8 without calibration sets
    MEASURING_FAILED = "measuring failed"  # a measuring step (fp16's ranges) failed
    REFUSED = "refused"  # ONNX Runtime did not load or run the file
    FAILED_VERIFICATION = "failed verification"  # float32: outside verify/budget.py's budget
    OUTSIDE_BUDGET = "outside the accuracy budget"  # reduced precision: under the cosine
    GRAPH_REFUSED = "graph refused"  # a CUDA-graph twin ONNX Runtime did not capture or run
    GRAPH_REPLAY = "graph replay"  # a twin whose replays gave no outputs or wrong ones
    NOT_TIMED = "not timed"  # verified, but its timing failed
    NOT_FASTER = "not faster"  # the noise rule: not faster beyond noise (or not every round)
    SLOWER = "slower"  # verified and beyond noise, but another was faster still
    NOT_TIMED_ON_TARGET = "not timed on the target"  # verified on the CPU standing in
    GRAPH_ONLY = "graph only"  # cuda_graph="deploy": compared as its twin only


@dataclass(frozen=True)
class Rejection:
    """Why a variant was not chosen: its ``kind``, the ``figures`` it was decided on, the
    ``text`` the report prints and the ``notes`` later steps added to it."""

    kind: Why
    text: str
    figures: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.text + "".join(self.notes)

    def noted(self, note: str) -> Rejection:
        """This rejection with ``note`` appended to its text ("" adds nothing)."""
        return replace(self, notes=self.notes + (note,)) if note else self

    def prefixed(self, kind: Why, prefix: str) -> Rejection:
        """This rejection as the reason of another of ``kind``: ``prefix`` + its text."""
        return Rejection(kind, prefix + str(self), dict(self.figures))


def text_of(rejection: Rejection | None) -> str:
    """A rejection's text ("" for none: the chosen variant)."""
    return "" if rejection is None else str(rejection)


@dataclass
class Variant:
    """One candidate: what it ran, what it measured, and whether it was chosen or why not."""

    name: str
    precision: str = "fp32"
    passes: list[str] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    fusions: dict[str, int] = field(default_factory=dict)
    nodes: int | None = None
    verified: bool = False
    accuracy: dict[str, dict[str, float]] = field(default_factory=dict)  # output -> metrics
    median_ms: float | None = None
    p90_ms: float | None = None
    round_ms: list[float] = field(default_factory=list)  # median of each timing round
    speedup: float | None = None
    rejection: Rejection | None = None  # why not chosen (None for the chosen one)
    path: str = ""
    blocked: dict[str, str] = field(default_factory=dict)  # fp16: node kept float32 -> why
    # fp16: value left float16 whose fill values (a mask's finfo.min) saturate -> its range
    saturated: dict[str, str] = field(default_factory=dict)
    # fp16: why the variant that saturated them was not kept
    saturation_rejection: Rejection | None = None
    cuda_options: dict[str, str] = field(default_factory=dict)  # a twin's (NHWC_OPTIONS)

    @property
    def rejected(self) -> str:
        """Why not chosen, as the report says it ("" for the chosen one)."""
        return text_of(self.rejection)

    @property
    def saturation_rejected(self) -> str:
        """fp16: why the variant that left fill values to saturate was not kept ("")."""
        return text_of(self.saturation_rejection)

    def is_rejected(self, kind: Why) -> bool:
        """Whether this variant was rejected for ``kind``."""
        return self.rejection is not None and self.rejection.kind is kind

    def reject(self, kind: Why, text: str, **figures: Any) -> None:
        """Record why this variant is not chosen."""
        self.rejection = Rejection(kind, text, figures)

    def note(self, text: str) -> None:
        """Add ``text`` to the rejection's (a search's outcome, a hint)."""
        assert self.rejection is not None, f"{self.name}: a note on no rejection"
        self.rejection = self.rejection.noted(text)

    def worst_cosine(self) -> float | None:
        """The lowest cosine over the outputs (each already the worst over the input sets);
        None when the variant was not judged by the cosine budget (not judged, or float32:
        its accuracy is max abs/rel errors)."""
        cosines = [m["cosine"] for m in self.accuracy.values() if "cosine" in m]
        return min(cosines) if cosines else None

    def to_dict(self) -> dict[str, Any]:
        """The variant as the JSON shows it: the rejections as their text (``rejected``,
        ``saturation_rejected``), in their fields' places."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "rejection":
                out["rejected"] = self.rejected
            elif f.name == "saturation_rejection":
                out["saturation_rejected"] = self.saturation_rejected
            else:
                out[f.name] = copy.deepcopy(getattr(self, f.name))
        return out


@dataclass
class OptimizationResult:
    """Every variant (the plain export first), the chosen one and the timing settings."""

    variants: list[Variant]
    chosen: str
    threads: int
    repeats: int
    warmup: int
    rounds: int
    noise_rule: str = (f"beats plain only if median <= plain median * {1 - NOISE_FRACTION:g} and "
                       "the median of every round is below plain's in the same round")
    written: str | None = None
    message: str = ""
    target: str = "cpu"
    providers: list[str] = field(default_factory=list)  # what the plain file's session used
    target_missing: str = ""  # why the target could not be timed here ("" when it was)
    # how to run the written file at the chosen variant's speed ({}: a default session;
    # GRAPH_SETTINGS for a CUDA-graph twin, also in the file's metadata, RUN_SETTINGS_KEY)
    run_settings: dict[str, Any] = field(default_factory=dict)
    cosine: float = DEFAULT_COSINE  # the reduced-precision budget (worst cosine per output)
    calibration: str = ""  # what static int8 was calibrated on ("" when it was not a candidate)
    # where the time went: "references" (PyTorch's outputs, optimize), "candidates" (built and
    # verified, the plain file's verification included), "timing" (rounds, CUDA-graph twins)
    seconds: dict[str, float] = field(default_factory=dict)
    # runs, the children they took, seconds: importing ONNX Runtime, sessions, runs in all
    sandbox: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The result as JSON shows it (each variant by :meth:`Variant.to_dict`)."""
        return {f.name: ([v.to_dict() for v in self.variants] if f.name == "variants"
                         else copy.deepcopy(getattr(self, f.name))) for f in fields(self)}
