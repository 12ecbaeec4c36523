"""The int4 candidates of a decoder step, each judged by the task budget and timed; the fastest
within the budget written (``optimize(..., precision="int4")``; see ``optimize/int4.py``)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from onnxmedic.findings import OnnxMedicError, error, info, print_findings, refuse, warning
from onnxmedic.genpackage import StepLayout, read_step
from onnxmedic.optimize import int4, int4_gptq, int4_text
from onnxmedic.optimize.bench import bench
from onnxmedic.optimize.passes import Pipeline, run_pipeline
from onnxmedic.sandbox import model_file_bytes

logger = logging.getLogger(__name__)

# (block_size, accuracy_level, lm_head): every block and level with the builder's 4-bit head,
# then the 8-bit and float32 heads at the builder's CPU level (4)
DEFAULT_GRID: list[tuple[int, int, str]] = (
    [(b, a, "int4") for b in (32, 64, 128) for a in (0, 4)]
    + [(b, 4, h) for b in (32, 128) for h in ("int8", "fp32")])
# with --calibration: GPTQ (optimize/int4_gptq.py) at every block with the 4-bit head, and
# with the 8-bit head at blocks 32 and 128 (a cell's 4th item: the algorithm)
GPTQ_GRID: list[tuple[Any, ...]] = (
    [(b, 4, "int4", "gptq") for b in (32, 64, 128)]
    + [(b, 4, "int8", "gptq") for b in (32, 128)])


@dataclass
class Int4Candidate:
    """One candidate (or the plain float32 file, ``name`` "fp32"): how it was built, its task
    figures, its decode-step latency and size; ``rejected`` says why it may not be written."""

    name: str
    block_size: int | None = None
    accuracy_level: int | None = None
    lm_head: str = ""
    algo: str = "rtn"
    excluded: list[str] = field(default_factory=list)
    perplexity: float | None = None
    perplexity_ratio: float | None = None
    agreement: float | None = None
    free_agreement: float | None = None
    first_divergence: list[int | None] = field(default_factory=list)
    divergence_margins: list[float | None] = field(default_factory=list)
    user_perplexity: float | None = None  # on the held-out part of --calibration's text
    user_perplexity_ratio: float | None = None
    decode_ms: float | None = None
    size_bytes: int | None = None
    rejected: str = ""
    path: str = ""  # the built file, in the work folder (gone after optimize_int4)
    tokens: list[list[int]] = field(default_factory=list)  # its own greedy tokens per prompt

    @property
    def within(self) -> bool:
        """Built, scored and inside the budget."""
        return self.perplexity is not None and not self.rejected

    def figures(self) -> str:
        """Its figures in one line."""
        if self.perplexity is None:
            return f"{self.name}: {self.rejected}"
        ms = f", decode {self.decode_ms:.2f} ms" if self.decode_ms is not None else ""
        user = (f", on your text {self.user_perplexity:.4g} "
                f"({(self.user_perplexity_ratio - 1) * 100:+.2f} %)"
                if self.user_perplexity is not None and self.user_perplexity_ratio else "")
        return (f"{self.name}: perplexity {self.perplexity:.4g} "
                f"({(self.perplexity_ratio - 1) * 100:+.2f} %){user}, greedy agreement "
                f"{self.agreement * 100:.1f} % teacher-forced ({self.free_agreement * 100:.1f} "
                f"% generating on its own){ms}")


@dataclass
class Int4Result:
    """What ``optimize(..., precision="int4")`` built, measured and wrote."""

    budget: int4.TaskBudget
    data_source: str
    reference_perplexity: float
    candidates: list[Int4Candidate]
    chosen: str | None = None
    written: str | None = None  # where the chosen file is (None: nowhere, or not yet)
    message: str = ""  # the verdict and its figures (OM732 adds where it was written)
    seconds: dict[str, float] = field(default_factory=dict)
    user_text: str = ""  # --calibration: where the figures on the user's text come from
    user_reference_perplexity: float | None = None
    median_margin: float | None = None  # PyTorch's median top-2 logit gap over the steps
    prompts: list[list[int]] = field(default_factory=list)  # the task data's prompts

    @property
    def ok(self) -> bool:
        """An int4 candidate was within the budget."""
        return self.chosen is not None

    def findings(self, stage: str = "optimize") -> list[Any]:
        """OM732 (written) or OM731 (none within the budget, nothing written), and OM730 for
        each int4 candidate outside the budget; after OM732, OM743 when the written candidate,
        generating on its own, keeps fewer than the budget's share of PyTorch's greedy tokens
        (the budget reads teacher-forced agreement): where it diverges and how close
        PyTorch's own two best tokens were."""
        out = [info("OM730", stage, f"int4 candidate {c.name} outside the budget "
                    f"({self.budget.describe()}): {c.rejected}",
                    details={k: v for k, v in asdict(c).items() if k != "path"})
               for c in self.candidates if c.name != "fp32" and c.rejected]
        if not self.chosen:
            return [error("OM731", stage, self.message, details=self.to_dict(),
                          suggestion="Keep the float32 file, or loosen the budget "
                          "(--accuracy perplexity=10%,agreement=90%) if the figures above are "
                          "acceptable for your task."), *out]
        where = f"; written to {self.written}" if self.written else ""
        out.insert(0, info("OM732", stage, self.message + where, details=self.to_dict()))
        c = next((c for c in self.candidates if c.name == self.chosen), None)
        if c is None or c.free_agreement is None or c.free_agreement >= self.budget.agreement:
            return out
        where = ", ".join(f"prompt {i + 1} at step {d} (PyTorch's top-2 logit gap there "
                          f"{m:.3g})" for i, (d, m) in enumerate(zip(c.first_divergence,
                                                                     c.divergence_margins))
                          if d is not None and m is not None)
        median = f"{self.median_margin:.3g}" if self.median_margin is not None else "?"
        out.insert(1, warning(
            "OM743", stage, f"the written int4 file {c.name}, generating on its own for "
            f"{self.budget.steps} steps, keeps {c.free_agreement * 100:.1f} % of PyTorch "
            f"float32's greedy tokens (teacher-forced: {c.agreement * 100:.1f} %, the figure the "
            f"budget reads); it first diverges at {where}; PyTorch's median gap over all steps "
            f"is {median}", details={"free_agreement": c.free_agreement,
                                    "first_divergence": c.first_divergence,
                                    "divergence_margins": c.divergence_margins,
                                    "median_margin": self.median_margin},
            suggestion="A divergence where the gap is far below the median is a near tie of "
            "the float32 model itself; if your task needs PyTorch's own text, require it with "
            "--accuracy free=95% (judged like the rest)."))
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("prompts")
        for c in d["candidates"]:
            c.pop("path", None)
            c.pop("tokens", None)
        return d


def decode_feeds(layout: StepLayout, past: int = int4.DECODE_PAST, seed: int = 0
                 ) -> dict[str, np.ndarray]:
    """One token after a past of ``past`` positions (random values; fewer where the package's
    context is shorter): a decode step's feeds."""
    if layout.context:
        past = max(1, min(past, layout.context - 1))
    return layout.feed(np.asarray([[5]], np.int64), layout.past_of(past, seed=seed),
                       past_length=past)


def measure(c: Int4Candidate, ref: dict[str, Any], data: int4.TaskData, budget: int4.TaskBudget,
            *, threads: int, timeout: float, user: int4_text.UserText | None,
            layout: StepLayout) -> Int4Candidate:
    """Score ``c.path`` on the task (and its perplexity on the held-out part of the ``user``'s
    text, judged by the same budget), judge it, and time its decode step; ``layout``: the
    step's contract (the source file's: a candidate keeps its inputs and outputs)."""
    got = int4.score_onnx(c.path, data, budget.steps, ref["tokens"], threads=threads,
                          timeout=timeout, layout=layout)
    if not got.get("ok"):
        c.rejected = got.get("error", "scoring failed")
        return c
    for figure, value in int4.judge(ref, got, budget).items():  # named as c's fields
        setattr(c, figure, value)
    c.tokens = got["tokens"]
    c.divergence_margins = int4_text.divergence_margins(ref["margins"], c.first_divergence)
    if user is not None:
        mine = int4.score_onnx(c.path, int4.TaskData([], user.held), 0, [], threads=threads,
                               timeout=timeout, layout=layout)
        why = [c.rejected]
        if not mine.get("ok"):
            why.append(mine.get("error", "scoring failed"))
        else:
            c.user_perplexity = mine["perplexity"]
            c.user_perplexity_ratio = mine["perplexity"] / user.reference_perplexity
            why.append(budget.perplexity_problem(mine["perplexity"], user.reference_perplexity,
                                                 "perplexity on your text"))
        c.rejected = "; ".join(filter(None, why))
    c.size_bytes = model_file_bytes(c.path)  # its size with its external data
    b = bench(c.path, decode_feeds(layout), threads=threads, repeats=20, timeout=timeout)
    c.decode_ms = b.median_ms if b.ok else None
    return c


def build(src: str, work: str, cell: tuple[Any, ...], exclude: Sequence[str] = (),
          timeout: float = 600.0, calibration: str | None = None) -> Int4Candidate:
    """Quantize ``src`` at one grid cell (block, accuracy_level, lm_head[, algo]) in the pass
    child; ``calibration``: the windows file GPTQ reads (int4_text.UserText.windows_path)."""
    block, level, head = cell[:3]
    algo = cell[3] if len(cell) > 3 else "rtn"
    name = f"int4-b{block}-a{level}-head{head}" + (f"-{algo}" if algo != "rtn" else "")
    if exclude:
        name += f"-keep{len(exclude)}"
    c = Int4Candidate(name, block, level, head, algo, list(exclude),
                      path=str(Path(work) / f"{name}.onnx"))
    opts = {"block_size": block, "accuracy_level": level, "lm_head": head, "algo": algo,
            "nodes_to_exclude": list(exclude), "calibration": calibration}  # GPTQ reads it
    ok, _, err = run_pipeline(Pipeline(name, [("onnxmedic.optimize.int4:quantize_int4", opts)],
                                       precision="int4"), src, c.path, timeout=timeout)
    if not ok:
        c.rejected = f"not built: {err}"
    elif algo == "rtn" and (why := int4.rounding_problem(src, c.path)) is not None:
        c.rejected = f"not a rounding of the float32 weights: {why}"
    return c


def task_data(onnx_path: str, ref_step: int4.Step, past0: list[np.ndarray], tokenizer: Any,
              budget: int4.TaskBudget) -> int4.TaskData:
    """The built-in text through the tokenizer, or text sampled from the reference."""
    encode = getattr(tokenizer, "encode", None)
    if encode is not None:
        return int4.builtin_data(encode, budget.prompts)
    import onnx

    out = onnx.load(onnx_path, load_external_data=False).graph.output[0]
    vocab = out.type.tensor_type.shape.dim[-1].dim_value
    if not vocab:
        raise ValueError(f"{onnx_path}: the logits' last dim (the vocabulary) is not fixed")
    return int4.sampled_data(ref_step, past0, vocab, budget.prompts)


def choose(res: Int4Result, out: str | os.PathLike[str] | None) -> None:
    """Pick the fastest int4 candidate within the budget; write it to ``out`` atomically."""
    ok = [c for c in res.candidates if c.name != "fp32" and c.within]
    fp32 = next((c for c in res.candidates if c.name == "fp32"), None)
    if not ok:
        res.message = (f"no int4 candidate is within the budget ({res.budget.describe()}); "
                       "nothing was written. " + "; ".join(c.figures() for c in res.candidates))
        return
    best = min(ok, key=lambda c: (c.decode_ms is None, c.decode_ms or 0.0))
    res.chosen = best.name
    speed = (f", {fp32.decode_ms / best.decode_ms:.2f}x the float32 file's decode step"
             if fp32 and fp32.decode_ms and best.decode_ms else "")
    res.message = (f"int4 candidate {best.figures()}{speed}; {len(ok)} of "
                   f"{len(res.candidates) - 1} int4 candidates within the budget "
                   f"({res.budget.describe()}; PyTorch float32 perplexity "
                   f"{res.reference_perplexity:.4g} on {res.data_source})")
    if out is not None:
        tmp = f"{out}.tmp-int4"
        shutil.copyfile(best.path, tmp)
        os.replace(tmp, out)
        res.written = str(out)  # OM732 says where (findings())


def optimize_int4(onnx_path: str | os.PathLike[str], reference: Callable[..., Any], *,
                  out: str | os.PathLike[str] | None = None, tokenizer: Any = None,
                  data: int4.TaskData | None = None, budget: int4.TaskBudget | None = None,
                  grid: Sequence[tuple[Any, ...]] | None = None, threads: int = 2,
                  timeout: float = 600.0, reference_scores: dict[str, Any] | None = None,
                  search: bool = True, calibration: str | os.PathLike[str] | None = None,
                  gptq_grid: Sequence[tuple[Any, ...]] | None = None) -> Int4Result:
    """Weight-only int4 candidates of the decoder step ``onnx_path`` (see optimize/int4.py),
    each judged against ``reference`` (PyTorch, ``(input_ids, past) -> (logits, present)``)
    by ``budget`` on ``data`` (default: the built-in text through ``tokenizer``, or text
    sampled from the reference) and timed; the fastest within the budget is written to
    ``out``. ``reference_scores``: PyTorch's :func:`int4.score` on ``data``, when already
    computed. ``search``: where no candidate is within the budget, the per-layer search
    (:func:`layer_search`) on the best of them. ``calibration``: a text file (through
    ``tokenizer``) that adds the GPTQ candidates of ``gptq_grid`` (default :data:`GPTQ_GRID`)
    and a perplexity on its held-out part, judged like the built-in text's (int4_text.py).
    Raises ValueError when the file is not a decoder step, OnnxMedicError (OM742) when the
    calibration text cannot be used."""
    budget = budget or int4.DEFAULT_BUDGET
    src = str(onnx_path)
    t0 = time.perf_counter()
    layout = read_step(src)
    past0 = layout.empty_past()
    ref_step = int4.torch_step(reference)
    data = data or task_data(src, ref_step, past0, tokenizer, budget)
    data = int4.TaskData(data.prompts[:budget.prompts], data.text, data.source)
    ref = dict(reference_scores or int4.score(ref_step, past0, data, budget.steps))
    ref.setdefault("margins", int4_text.reference_margins(ref_step, past0, data.prompts,
                                                          ref["tokens"]))
    res = Int4Result(budget, data.source, ref["perplexity"], [],
                     median_margin=int4_text.median_margin(ref["margins"]),
                     prompts=data.prompts)
    with tempfile.TemporaryDirectory(prefix="onnxmedic-int4-") as work:
        user = None
        cells = list(grid or DEFAULT_GRID)
        if calibration is not None:
            user = int4_text.load_user_text(calibration, tokenizer, work)
            nll, n = int4.mean_nll(ref_step, past0, user.held)
            user.reference_perplexity = float(np.exp(nll / n))
            res.user_text, res.user_reference_perplexity = (user.describe(),
                                                            user.reference_perplexity)
            cells += list(GPTQ_GRID if gptq_grid is None else gptq_grid)
        res.seconds["reference"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        kw: dict[str, Any] = {"threads": threads, "timeout": timeout, "user": user,
                              "layout": layout}
        res.candidates.append(measure(Int4Candidate("fp32", path=src), ref, data, budget, **kw))

        def trial(cell: tuple[Any, ...], exclude: Sequence[str] = ()) -> Int4Candidate:
            c = build(src, work, cell, exclude, timeout=timeout,
                      calibration=user.windows_path if user else None)
            return c if c.rejected else measure(c, ref, data, budget, **kw)

        for cell in cells:
            res.candidates.append(trial(cell))
            logger.info("int4: %s", res.candidates[-1].figures())
        tried = [c for c in res.candidates[1:] if c.perplexity is not None]
        if search and tried and not any(c.within for c in tried):
            res.candidates += layer_search(src, max(tried, key=_merit), trial)
        res.seconds["candidates"] = time.perf_counter() - t1
        choose(res, out)
    return res


def optimize_decoder(onnx_path: str | os.PathLike[str], model: Any, *,
                     out: str | os.PathLike[str] | None = None, accuracy: Any = None,
                     threads: int = 2, timeout: float = 600.0,
                     calibration: str | os.PathLike[str] | None = None) -> Int4Result:
    """``optimize(..., precision="int4")``: :func:`optimize_int4` with the budget parsed from
    ``accuracy`` (:func:`int4.parse_budget`) and the model's own ``tokenizer`` attribute, where
    it has one; ``calibration``: a text file for GPTQ and a perplexity on the user's text. A
    file that is not a decoder step raises OnnxMedicError (OM733), an unusable calibration
    text OnnxMedicError (OM742)."""
    budget = accuracy if isinstance(accuracy, int4.TaskBudget) else int4.parse_budget(accuracy)
    try:
        read_step(onnx_path).empty_past()
    except ValueError as e:
        raise OnnxMedicError(error("OM733", "optimize", str(e), suggestion="Export one "
                                   "decoding step with its past as bench/zoo/hf.py's DecodeStep "
                                   "does, and give that module as the model.")) from e
    was_training = getattr(model, "training", False)
    if was_training:
        model.eval()
    try:
        return optimize_int4(onnx_path, model, out=out, tokenizer=getattr(model, "tokenizer", None),
                             budget=budget, threads=threads, timeout=timeout,
                             calibration=calibration)
    finally:
        if was_training:
            model.train()


def _row(c: Int4Candidate, user: bool) -> str:
    """One candidate's line of the table."""
    if c.perplexity is None:
        return f"{c.name:30} {'-':>10} {'-':>8} " + ("- " * 6 if user else "- " * 5) + c.rejected
    ms = f"{c.decode_ms:.3f}" if c.decode_ms is not None else "-"
    mib = f"{c.size_bytes / 2**20:.2f}" if c.size_bytes else "-"
    yours = ""
    if user:
        yours = (f"{(c.user_perplexity_ratio - 1) * 100:+7.2f}% " if c.user_perplexity_ratio
                 else f"{'-':>8} ")
    return (f"{c.name:30} {c.perplexity:10.4g} {(c.perplexity_ratio - 1) * 100:+7.2f}% "
            f"{yours}{c.agreement * 100:6.1f}% {c.free_agreement * 100:6.1f}% {ms:>9} "
            f"{mib:>7}  {c.rejected}").rstrip()


def print_result(res: Int4Result, findings: list[Any] | None = None) -> None:
    """The int4 candidate table (``onnxmedic optimize --precision int4``): per candidate the
    perplexity and its delta (built-in text; the user's held-out text with --calibration),
    greedy agreement teacher-forced (``forced``: the budget's figure) and generating on its own
    (``own``), decode-step time and size; then ``findings`` (``res.findings()`` when None)
    but OM730, whose rejections the table shows."""
    print(f"int4 judged by the task budget: {res.budget.describe()} (--accuracy); text: "
          f"{res.data_source}; PyTorch float32 perplexity {res.reference_perplexity:.4g}")
    user = bool(res.user_text)
    if user:
        print(f"your text (--calibration): {res.user_text}; PyTorch float32 perplexity "
              f"{res.user_reference_perplexity:.4g}")
    yours = f"{'yours':>8} " if user else ""
    print(f"{'candidate':30} {'perplexity':>10} {'delta':>8} {yours}{'forced':>7} {'own':>7} "
          f"{'decode ms':>9} {'MiB':>7}  why rejected")
    for c in res.candidates:
        print(_row(c, user))
    print_findings([f for f in (res.findings() if findings is None else findings)
                    if f.code != "OM730"])


def cli_main(ns: Any) -> int:
    """``onnxmedic optimize --precision int4``: 0 when an int4 file is within the budget
    (written with -o), 1 when none is (OM731) or the file is not a decoder step (OM733), 2 for
    a bad budget or target."""
    import json
    import sys

    from onnxmedic import inputs

    if ns.target != "cpu":
        sys.stderr.write("onnxmedic optimize: error: --precision int4 is for --target cpu\n")
        return 2
    try:
        budget = int4.parse_budget(ns.accuracy)
    except ValueError as e:
        sys.stderr.write(f"onnxmedic optimize: error: {e}\n")
        return 2
    try:
        model, _ = inputs.load_model(ns.model)
        res = optimize_decoder(ns.onnx, model, out=ns.output, accuracy=budget,
                               threads=ns.threads, timeout=ns.timeout,
                               calibration=ns.calibration)
    except OnnxMedicError as err:
        return refuse(err.finding)
    if ns.json:
        sys.stdout.write(json.dumps(res.to_dict(), indent=2, default=str) + "\n")
    else:
        print_result(res)
    return 0 if res.ok else 1


def _merit(c: Int4Candidate) -> float:
    """One number to rank by: agreement minus the perplexity's relative rise."""
    if c.perplexity is None:
        return float("-inf")
    return (c.agreement or 0.0) - ((c.perplexity_ratio or 1.0) - 1.0)


def layer_search(src: str, base: Int4Candidate,
                 trial: Callable[[tuple[Any, ...], Sequence[str]], Int4Candidate],
                 max_keep: int = 16) -> list[Int4Candidate]:
    """The per-layer search of an int4 candidate outside the budget: each layer it quantized
    kept float32 alone ranks the layers by what that buys (agreement minus the perplexity's
    rise); then the top 1, 2, 4, ... stay float32 (their original MatMul) until a candidate is
    within the budget or ``max_keep`` is reached. ``trial(cell, exclude)``: the candidate
    built at ``base``'s grid cell with ``exclude`` left float32, and measured. Returns that
    curve's candidates."""
    import onnx

    cell = (base.block_size or 32, base.accuracy_level or 0, base.lm_head or "int4", base.algo)
    graph = onnx.load(src, load_external_data=False).graph
    # what the quantizer turns into MatMulNBits, in graph order (the head only at 4 bits)
    head = int4.lm_head_node(graph) if cell[2] != "int4" else None
    layers = [n.name for n in int4_gptq.quantizable_layers(graph) if n.name and n.name != head]
    gains = {name: _merit(trial(cell, [name])) - _merit(base) for name in layers}
    ranked = sorted(layers, key=lambda n: -gains[n])
    curve, k = [], 1
    while k <= min(max_keep, len(ranked)):
        curve.append(trial(cell, ranked[:k]))
        logger.info("int4 layer search: %s", curve[-1].figures())
        if curve[-1].within:
            break
        k *= 2
    return curve
