"""``--precision int4`` for decoders: weight-only 4-bit MatMulNBits judged by a task budget.

The input is a *decoder step* ONNX file - a generation package's decoder, or ``input_ids`` and
the flat past (``[k0, v0, k1, v1, ...]``, dims ``(batch, heads, past, head_dim)``) in,
``logits`` and the present out, as ``bench/zoo/hf.py``'s ``DecodeStep`` exports; read and fed
as onnxmedic/genpackage.py's contract says - and a PyTorch reference with the same contract
(``reference(input_ids, past) -> (logits, present)``, float32).

Candidates come from ONNX Runtime's own quantizer
(``onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer``, RTN: symmetric 4-bit
weights, one float32 scale per ``block_size`` consecutive weights of a column along K) over a
small grid: block 32/64/128, ``accuracy_level`` 0 (the kernel dequantizes to float32) or 4 (it
quantizes the activations to int8 per block and uses int8 dot products), and the LM head as
onnxruntime-genai's model builder leaves it by default (4-bit like the rest; the embedding's
Gather stays float32), as its ``rtn_last`` option does (8-bit), or float32.

Each candidate is judged by what a user of a decoder sees (:class:`TaskBudget`):

- greedy agreement: from each of a few prompts PyTorch float32 generates ``steps`` tokens
  greedily; the candidate, in ONNX Runtime, is fed the same tokens one at a time (its own
  past: the decode path) and its greedy pick at each step is compared with PyTorch's next
  token - the share of identical picks. Free generation (each fed its own tokens) is reported
  beside it with the first divergence per prompt, but not judged: in a model with near-ties
  one early flip makes every later token differ, so it measures where a tie fell more than
  what quantization cost;
- perplexity on a built-in text (:data:`BUILTIN_TEXT`, through the model's tokenizer), or on
  text sampled from the reference itself where no tokenizer is known, against PyTorch's.

A candidate outside the budget is never written; the fastest one inside it (decode step, one
token after a past of :data:`DECODE_PAST`, timed in the sandbox) is. Where none is, nothing is
written (OM731) and the finding gives each candidate's figures.

This module imports neither torch nor onnxmedic's package at its top (only the package
contract, genpackage.py, which imports neither): its quantize step and its scoring run in
optimize's children (``_child.py``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from onnxmedic.genpackage import StepLayout, read_step
from onnxmedic.optimize._child import run_request

logger = logging.getLogger(__name__)

DECODE_PAST = 128  # the past length a decode step is timed at
SAMPLED_TOKENS = 256  # the text drawn from the reference where no tokenizer is known

BUILTIN_PROMPTS = ['def __init__(self', 'import os\nimport sys\n', '    """Return the',
                   'for i in range(']
# the built-in text perplexity is measured on: Python in the standard library's style, written
# for this module (so in no training set)
BUILTIN_TEXT = '''class Window:
    """A fixed-size window over a stream of numbers.

    The window keeps the last *size* values and reports their mean and
    their largest value. It is used to smooth timings before they are
    compared, so that one slow run does not decide a choice.
    """

    def __init__(self, size=8):
        if size <= 0:
            raise ValueError("size must be positive")
        self.size = size
        self.values = []

    def add(self, value):
        """Add *value* to the window and drop the oldest one if it is full."""
        self.values.append(value)
        if len(self.values) > self.size:
            del self.values[0]

    def mean(self):
        """Return the mean of the values in the window."""
        if not self.values:
            return 0.0
        return sum(self.values) / len(self.values)

    def largest(self):
        """Return the largest value, or None when the window is empty."""
        return max(self.values, default=None)


def read_lines(path, encoding="utf-8"):
    """Return the lines of the file at *path* without their line endings."""
    with open(path, encoding=encoding) as f:
        return [line.rstrip("\\n") for line in f]
'''


# ------------------------------------------------------------------------------------------
# the budget


@dataclass(frozen=True)
class TaskBudget:
    """What a reduced-precision decoder may cost: its perplexity at most ``perplexity`` times
    PyTorch float32's, and at least ``agreement`` of the greedy tokens identical over
    ``steps`` steps from each of ``prompts`` prompts (teacher-forced); ``free``: the share
    required when the candidate generates on its own (0: reported, not judged)."""

    perplexity: float = 1.05
    agreement: float = 0.95
    steps: int = 32
    prompts: int = 4
    free: float = 0.0

    def describe(self) -> str:
        """The budget in one line."""
        free = (f" (and >= {self.free * 100:.3g} % generating on its own)" if self.free
                else "")
        return (f"perplexity within +{(self.perplexity - 1) * 100:.3g} % of PyTorch float32's "
                f"and >= {self.agreement * 100:.3g} % of greedy tokens identical over "
                f"{self.steps} steps from {self.prompts} prompts{free}")

    def perplexity_problem(self, got: float, ref: float, what: str = "perplexity") -> str:
        """Why the perplexity ``got`` is outside the budget against PyTorch's ``ref`` ("" when
        within; NaN is outside)."""
        ratio = got / ref
        if ratio <= self.perplexity:
            return ""
        return (f"{what} {got:.4g} is {(ratio - 1) * 100:+.2f} % of PyTorch's {ref:.4g} "
                f"(budget +{(self.perplexity - 1) * 100:.3g} %)")


DEFAULT_BUDGET = TaskBudget()


def parse_budget(spec: str | None) -> TaskBudget:
    """``"perplexity=5%,agreement=95%,steps=32,prompts=4"`` (any subset; ``perplexity`` may also
    be a ratio, 1.05) -> a :class:`TaskBudget`; None -> the default."""
    if not spec:
        return DEFAULT_BUDGET
    kw: dict[str, Any] = {}
    for part in spec.split(","):
        key, _, val = part.strip().partition("=")
        try:
            pct = val.strip().endswith("%")
            num = float(val.strip().rstrip("%"))
            if key == "perplexity":
                kw[key] = 1 + num / 100 if pct or num < 1 else num
            elif key in ("agreement", "free"):
                kw[key] = num / 100 if pct or num > 1 else num
            elif key in ("steps", "prompts") and num == int(num) and num > 0:
                kw[key] = int(num)
            else:
                raise ValueError(key)
        except ValueError:
            raise ValueError(f"int4 budget {spec!r}: expected perplexity=<+%>, agreement=<%>, "
                             "free=<%>, steps=<n>, prompts=<n>, e.g. "
                             "perplexity=5%,agreement=95%") from None
    b = TaskBudget(**{**asdict(DEFAULT_BUDGET), **kw})
    if not (b.perplexity >= 1 and 0 < b.agreement <= 1 and 0 <= b.free <= 1):
        raise ValueError(f"int4 budget {spec!r}: perplexity must be >= +0 % and agreement in "
                         "(0, 100 %]")
    return b


@dataclass
class TaskData:
    """Token ids the budget is measured on: the prompts and the perplexity text."""

    prompts: list[list[int]]
    text: list[int]
    source: str = ""


def encode_ids(encode: Callable[[str], Any], text: str) -> list[int]:
    """``text`` through ``encode`` (a tokenizer's encode: a list of ids or an object with
    ``.ids``, as ``tokenizers`` returns) as a list of ints."""
    e = encode(text)
    return [int(i) for i in getattr(e, "ids", e)]


def builtin_data(encode: Callable[[str], Any], prompts: int = 4) -> TaskData:
    """The built-in prompts and text through ``encode`` (:func:`encode_ids`)."""
    ps = [encode_ids(encode, p) for p in BUILTIN_PROMPTS[:prompts]]
    return TaskData(ps, encode_ids(encode, BUILTIN_TEXT), "the built-in text (a Python class, "
                    f"{len(BUILTIN_TEXT)} characters) and {len(ps)} built-in prompts")


# ------------------------------------------------------------------------------------------
# scoring a step function (PyTorch's or ONNX Runtime's) on the task

Step = Callable[[np.ndarray, list[np.ndarray]], tuple[np.ndarray, list[np.ndarray]]]
WINDOW = 128  # perplexity windows (tokens), each from an empty past


def decode(step: Step, past0: list[np.ndarray], prompt: list[int], feed: Iterable[int]
           ) -> Iterator[np.ndarray]:
    """The decode path: ``step``'s logits after ``prompt``, then after each token of ``feed``
    fed one at a time with its past. ``feed`` is read lazily, so that a caller may append
    the token it picks from the logits just yielded (greedy or sampled generation)."""
    logits, past = step(np.asarray([prompt], np.int64), past0)
    yield logits
    for tok in feed:
        logits, past = step(np.asarray([[tok]], np.int64), past)
        yield logits


def generate(step: Step, past0: list[np.ndarray], prompt: list[int], steps: int,
             pick: Callable[[np.ndarray], int] | None = None) -> list[int]:
    """Decoding: ``steps`` tokens after ``prompt``, each step fed its own token: the greedy
    one, or ``pick(logits)``'s (the last position's logits)."""
    out: list[int] = []
    for logits in decode(step, past0, prompt, out):
        if len(out) == steps:
            break
        out.append(int(np.argmax(logits[0, -1])) if pick is None else pick(logits[0, -1]))
    return out


NLL_ROWS = 16  # positions whose float64 log-softmax is made at a time


def mean_nll(step: Step, past0: list[np.ndarray], text: list[int]) -> tuple[float, int]:
    """(summed negative log-likelihood, tokens) of ``text`` in windows of :data:`WINDOW`.
    Each position's log-softmax is made in float64, :data:`NLL_ROWS` positions at a time (a
    window's whole vocabulary in float64 is ~150 MB per copy at a 152k vocabulary; each
    row's figures are the same either way), the window's log-likelihoods summed at once."""
    total, count = 0.0, 0
    for start in range(0, max(len(text) - 1, 0), WINDOW):
        chunk = text[start:start + WINDOW + 1]  # 2 tokens at least: start < len(text) - 1
        logits, _ = step(np.asarray([chunk[:-1]], np.int64), past0)
        n = len(chunk) - 1
        picked = np.empty(n, np.float64)
        for r in range(0, n, NLL_ROWS):
            k = min(NLL_ROWS, n - r)
            lg = logits[0, r:r + k].astype(np.float64)
            lg -= lg.max(-1, keepdims=True)
            picked[r:r + k] = lg[np.arange(k), chunk[1 + r:1 + r + k]] - np.log(
                np.exp(lg).sum(-1))
        total -= float(picked.sum())
        count += n
    return total, count


def forced(step: Step, past0: list[np.ndarray], prompt: list[int], ref: list[int]
           ) -> list[int]:
    """Teacher-forced greedy picks: after ``prompt``, fed ``ref``'s tokens one at a time (the
    decode path, with its past), the token ``step`` would pick at each position."""
    return [int(np.argmax(logits[0, -1])) for logits in decode(step, past0, prompt, ref[:-1])]


def prefill_picks(step: Step, past0: list[np.ndarray], prompt: list[int],
                  tokens: list[int]) -> list[int]:
    """Teacher-forced greedy picks in one run: ``prompt`` and ``tokens`` (but the last) fed
    at once from ``past0`` (the prefill path), the token ``step`` picks after the prompt and
    after each of ``tokens``' prefixes."""
    if not tokens:
        return []
    logits, _ = step(np.asarray([prompt + tokens[:-1]], np.int64), past0)
    return [int(t) for t in np.argmax(logits[0, len(prompt) - 1:], -1)]


def greedy(step: Step, past0: list[np.ndarray], prompt: list[int], steps: int,
           given: list[int] | None) -> tuple[list[int], bool]:
    """``step``'s greedy ``steps`` tokens after ``prompt``, and whether they were decoded.
    ``given``: tokens that another runtime generated from the same decoder (onnxruntime-genai);
    where ``step``'s prefill picks along them (:func:`prefill_picks`) are those very tokens,
    they are its greedy tokens (each pick follows the same prefix as in :func:`generate`) and
    nothing is decoded; else :func:`generate` decides, one cached step at a time, so that a
    near tie between the prefill's kernels and the decode's is settled by the decode path,
    as generation takes it."""
    if given is not None and len(given) == steps and \
            prefill_picks(step, past0, prompt, given) == given:
        return list(given), False
    return generate(step, past0, prompt, steps), True


def score(step: Step, past0: list[np.ndarray], data: TaskData, steps: int,
          reference: list[list[int]] | None = None,
          given: list[list[int]] | None = None) -> dict[str, Any]:
    """The task figures of ``step``: its own greedy tokens per prompt, its picks along the
    ``reference`` tokens (teacher-forced; its own tokens when None) and its perplexity.
    ``given``: per prompt, tokens to confirm as its greedy ones (:func:`greedy`); ``decoded``:
    the prompts whose tokens were decoded step by step instead."""
    runs = [greedy(step, past0, p, steps, given[i] if given is not None else None)
            for i, p in enumerate(data.prompts)]
    tokens = [t for t, _ in runs]
    picks = ([forced(step, past0, p, r) for p, r in zip(data.prompts, reference)]
             if reference is not None else tokens)
    nll, n = mean_nll(step, past0, data.text)
    return {"tokens": tokens, "picks": picks,
            "perplexity": math.exp(nll / n) if n else float("nan"), "text_tokens": n,
            "decoded": [i for i, (_, d) in enumerate(runs) if d]}


def agreement(ref: list[list[int]], got: list[list[int]]) -> float:
    """Share of positions where two sets of token sequences hold the same token."""
    pairs = [(a, b) for r, g in zip(ref, got) for a, b in zip(r, g)]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else 0.0


def first_divergence(ref: list[list[int]], got: list[list[int]]) -> list[int | None]:
    """Per prompt, the first step whose token differs (None: none does)."""
    return [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), None)
            for r, g in zip(ref, got)]


def judge(ref: dict[str, Any], got: dict[str, Any], budget: TaskBudget) -> dict[str, Any]:
    """The candidate's figures against the reference's and the budget: perplexity ratio,
    greedy agreement (teacher-forced picks against PyTorch's greedy tokens), free-running
    agreement and first divergence per prompt, and ``rejected`` (why; "" when within)."""
    ratio = got["perplexity"] / ref["perplexity"]
    agree = agreement(ref["tokens"], got["picks"])
    free = agreement(ref["tokens"], got["tokens"])
    div = first_divergence(ref["tokens"], got["tokens"])
    why = [budget.perplexity_problem(got["perplexity"], ref["perplexity"])]
    if not agree >= budget.agreement:
        why.append(f"greedy agreement {agree * 100:.1f} % (budget {budget.agreement * 100:.3g} "
                   f"%; generating on its own, {free * 100:.1f} % of tokens identical, first "
                   f"divergence per prompt at step {div})")
    if not free >= budget.free:
        why.append(f"generating on its own, {free * 100:.1f} % of greedy tokens identical "
                   f"(budget {budget.free * 100:.3g} %; first divergence per prompt at step "
                   f"{div})")
    return {"perplexity": got["perplexity"], "perplexity_ratio": ratio, "agreement": agree,
            "free_agreement": free, "first_divergence": div,
            "rejected": "; ".join(filter(None, why))}


# ------------------------------------------------------------------------------------------
# the two sides: PyTorch in this process, ONNX Runtime in a child


def torch_step(reference: Callable[..., Any]) -> Step:
    """A :data:`Step` over a PyTorch reference ``(input_ids, past) -> (logits, present)``."""
    import torch

    def step(ids: np.ndarray, past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        with torch.no_grad():
            logits, present = reference(torch.from_numpy(ids),
                                        [torch.from_numpy(np.ascontiguousarray(p))
                                         for p in past])
        return logits.float().numpy(), [t.detach().numpy() for t in present]

    return step


def ort_step(onnx_path: str, threads: int = 2, layout: StepLayout | None = None) -> Step:
    """A :data:`Step` over an ONNX Runtime CPU session of the step file, fed as the package
    contract says (``layout``: read from the file when None)."""
    import onnxruntime as ort

    layout = layout or read_step(onnx_path)

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    # no spinning: the scoring is a Python loop of small runs (a decode step's ops are short)
    # and the other cores may be busy; spinning workers cost ~30 % more CPU and time there
    # (measured: 32 greedy steps of Qwen2.5-1.5B's 14-layer int4 package on 2 shared cores)
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(onnx_path, so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]

    def step(ids: np.ndarray, past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        logits = []
        for chunk in layout.chunks(ids):  # one run per token where the graph takes one
            out = dict(zip(names, sess.run(None, layout.feed(chunk, past))))
            logits.append(layout.logits(out))
            past = layout.presents(out)
        return np.concatenate(logits, axis=1) if len(logits) > 1 else logits[0], past

    return step


def score_child(req_path: str, res_path: str) -> None:
    """The scoring child (run by _child.py): the request's file scored on its task data."""
    req = json.loads(Path(req_path).read_text())
    try:
        layout = (StepLayout.from_dict(req["layout"]) if req.get("layout")
                  else read_step(req["path"]))
        out = {"ok": True, **score(ort_step(req["path"], req["threads"], layout),
                                   layout.empty_past(), TaskData(req["prompts"], req["text"]),
                                   req["steps"], req["reference"], req.get("given"))}
    except Exception as e:  # noqa: BLE001 - reported as a rejected candidate
        out = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:400]}"}
    Path(res_path).write_text(json.dumps(out))


def score_onnx(onnx_path: str | os.PathLike[str], data: TaskData, steps: int,
               reference: list[list[int]] | None, *, threads: int = 2,
               timeout: float = 600.0, layout: StepLayout | None = None,
               given: list[list[int]] | None = None) -> dict[str, Any]:
    """:func:`score` of the step file in ONNX Runtime (its picks along ``reference``, the
    PyTorch model's greedy tokens; ``given``: tokens to confirm as its greedy ones), in a
    child process (a crash or a hang past ``timeout`` is ``ok=False`` with the reason).
    ``layout``: the step's contract where the file alone does not say it (a candidate
    written away from its package's configs)."""
    request = {"path": str(Path(onnx_path).absolute()), "threads": threads,
               "prompts": data.prompts, "text": data.text, "steps": steps,
               "reference": reference, "layout": layout.to_dict() if layout else None,
               "given": given}
    with tempfile.TemporaryDirectory(prefix="onnxmedic-int4-") as tmp:
        run = run_request(f"{__name__}:score_child", request, tmp, cwd=tmp, timeout=timeout)
    if run.timed_out:
        return {"ok": False, "error": f"scoring did not finish within {timeout:g} s"}
    if run.result is None:
        return {"ok": False, "error": f"scoring crashed (exit {run.returncode}): "
                f"{' '.join(run.stderr_tail)[:300]}"}
    return run.result


def sampled_data(reference: Step, past0: list[np.ndarray], vocab: int, prompts: int = 4,
                 seed: int = 0) -> TaskData:
    """Task data without a tokenizer: ``prompts`` prompts of 4 random ids, and a text of
    :data:`SAMPLED_TOKENS` tokens sampled (temperature 1, seeded) from the reference itself."""
    rng = np.random.default_rng(seed)
    ps = [[int(t) for t in rng.integers(4, vocab, 4)] for _ in range(prompts)]

    def sample(logits: np.ndarray) -> int:  # temperature 1
        lg = logits.astype(np.float64)
        p = np.exp(lg - lg.max())
        return int(rng.choice(len(p), p=p / p.sum()))

    text = ps[0] + generate(reference, past0, ps[0], SAMPLED_TOKENS - len(ps[0]), sample)
    return TaskData(ps, text, f"{prompts} random prompts and {SAMPLED_TOKENS} tokens sampled "
                    "from the PyTorch model (no tokenizer known: give the model a `tokenizer`)")


# ------------------------------------------------------------------------------------------
# the quantize step (a pass: run in optimize's pass child)

LM_HEADS = ("int4", "int8", "fp32")


def lm_head_node(graph: Any) -> str | None:
    """The MatMul with a constant weight that computes the first output (the logits), found
    by walking back from it through single-producer nodes; None when there is none."""
    inits = {i.name for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    name, seen = graph.output[0].name, 0
    while name in producer and seen < 16:
        node = producer[name]
        if node.op_type == "MatMul" and any(i in inits for i in node.input[1:]):
            return node.name or None
        name = next((i for i in node.input if i in producer), "")
        seen += 1
    return None


def fold_weight_transposes(graph: Any) -> int:
    """``MatMul(x, Transpose(W))`` with a constant 2-D ``W`` -> ``MatMul(x, W.T)`` (a new
    initializer), so that the quantizer, which takes constant weights only, sees it: a tied
    LM head reads the embedding's table transposed. Returns the number folded."""
    from onnx import numpy_helper

    inits = {i.name: i for i in graph.initializer}
    prod = {o: n for n in graph.node for o in n.output}
    users = Counter(i for n in graph.node for i in n.input)
    folded = 0
    for n in graph.node:
        t = prod.get(n.input[1]) if n.op_type == "MatMul" and len(n.input) == 2 else None
        if t is None or t.op_type != "Transpose" or t.input[0] not in inits \
                or len(inits[t.input[0]].dims) != 2 or users[t.output[0]] != 1:
            continue
        w = numpy_helper.to_array(inits[t.input[0]])
        name = f"{t.input[0]}.T"
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w.T), name))
        n.input[1] = name
        graph.node.remove(t)
        folded += 1
    return folded


def rounding_problem(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> str | None:
    """Where the symmetric block quantization in ``dst`` (MatMulNBits without zero points, as
    quantize_int4's RTN writes it) is not a rounding of ``src``'s float32 weights: every
    dequantized weight must lie within one step (its block's scale) of the weight it was made
    from (rounding to the nearest level: half a step; the clamp of the top level: one). A
    corrupted block or a wrong scale is caught here whatever it costs on the task. None when
    every such node whose MatMul has a constant weight in ``src`` holds (a weight the quantizer
    derived, as a folded tied head, is not checked). One weight is read at a time (its
    float32 copy, checked :data:`CHECK_WEIGHTS` weights at a time): the memory is one weight's,
    not the model's."""
    import onnx

    # onnxfile's reader is the one reader of external data (imported on use: onnxfile imports
    # torch)
    from onnxmedic.onnxfile import tensor_array

    src, dst = Path(src), Path(dst)
    sm = onnx.load(str(src), load_external_data=False)
    dm = onnx.load(str(dst), load_external_data=False)
    sinit = {i.name: i for i in sm.graph.initializer}
    dinit = {i.name: i for i in dm.graph.initializer}
    # a MatMulNBits is paired with its MatMul by the output it keeps (the quantizer names it
    # "<name>_Q4" only where the MatMul has a name, and writes "<output>_pre_reshape" where
    # it reshapes after): node names may be empty, and several empty ones are not one node
    weights = {n.output[0]: n.input[1] for n in sm.graph.node if n.op_type == "MatMul"}
    for node in dm.graph.node:
        w_name = weights.get(node.output[0].removesuffix("_pre_reshape")) if node.output \
            else None
        if node.op_type != "MatMulNBits" or w_name not in sinit or (
                len(node.input) > 3 and node.input[3]):
            continue
        at = {a.name: a.i for a in node.attribute}
        why = block_problem(node.name or f"the MatMulNBits of {node.output[0]}",
                            tensor_array(sinit[w_name], src.parent),
                            tensor_array(dinit[node.input[1]], dst.parent),
                            tensor_array(dinit[node.input[2]], dst.parent), at)
        if why is not None:
            return why
    return None


# weights checked at a time (whole output columns): the float32 temporaries stay in the
# cache (~15 % faster than 4096 columns at once)
CHECK_WEIGHTS = 1 << 18


def _levels(bits: int) -> np.ndarray:
    """Each byte's signed levels (its low nibble first for 4 bits), float32: (256, 8 // bits)."""
    b = np.arange(256)
    if bits == 4:
        return np.stack([(b & 15) - 8, (b >> 4) - 8], -1).astype(np.float32)
    return (b - 2 ** (bits - 1)).astype(np.float32)[:, None]


def block_problem(name: str, w: np.ndarray, q: np.ndarray, scales: np.ndarray,
                  at: dict[str, int]) -> str | None:
    """:func:`rounding_problem`'s rule for one MatMulNBits ``name``: ``w`` its float weight
    (K, N) (a transposed view of an (N, K) array is read without a copy), ``q`` and
    ``scales`` its quantized blocks and their scales, ``at`` its attributes (K, N, bits,
    block_size); why a weight is not a rounding of ``w``, or None."""
    n_out, k_in, bits, block = at["N"], at["K"], at["bits"], at["block_size"]
    q = q.reshape(n_out, -1)
    scales = scales.reshape(n_out, -1)
    nb = scales.shape[1]
    lut = _levels(bits)
    # float32 arithmetic: its rounding (2^-24 of a step) is far inside the 1e-3 margin
    cols = max(1, CHECK_WEIGHTS // max(k_in, 1))
    for r in range(0, n_out, cols):
        rows = min(cols, n_out - r)
        if k_in == nb * block:
            wr = np.ascontiguousarray(w[:, r:r + rows].T, np.float32)  # a view where w is one
        else:
            wr = np.zeros((rows, nb * block), np.float32)
            wr[:, :k_in] = w[:, r:r + rows].T  # the padding of the last block: 0
        wr = wr.reshape(rows, nb, block)
        step = scales[r:r + rows].astype(np.float32)[:, :, None]
        # the dequantized weight minus the float one, in place: |level * step - w| (take:
        # lut[q]'s fancy indexing of a 2-D table costs several times the arithmetic below)
        off = np.take(lut, q[r:r + rows, :nb * block * bits // 8], axis=0).reshape(
            rows, nb, block)
        off *= step
        off -= wr
        np.abs(off, out=off)
        bad = (off > np.abs(step) * np.float32(1 + 1e-3) + np.float32(1e-12)).reshape(
            rows, -1)[:, :k_in]
        if bad.any():
            n, k = np.argwhere(bad)[0]
            b, i = divmod(int(k), block)
            return (f"{name}: weight ({k}, {n + r}) is {off[n, b, i]:.3g} from its float32 "
                    f"value {wr[n, b, i]:.3g}, "
                    f"{off[n, b, i] / max(abs(step[n, b, 0]), 1e-30):.3g} "
                    f"steps of its block ({b}) where rounding keeps it within one; "
                    f"{int(bad.sum())} weights so in columns {r}-{r + rows - 1}")
    return None


def quantize_int4(src: str, dst: str, block_size: int = 32, accuracy_level: int = 4,
                  lm_head: str = "int4", algo: str = "rtn",
                  nodes_to_exclude: Sequence[str] = (), calibration: str | None = None,
                  tied_embedding: bool = True) -> dict[str, Any]:
    """Weight-only 4-bit MatMulNBits with ONNX Runtime's ``MatMulNBitsQuantizer``: every MatMul
    with a constant 2-D weight except ``nodes_to_exclude`` (``algo`` "rtn": symmetric,
    one scale per ``block_size`` weights along K; "hqq": its HQQ config, asymmetric with zero
    points; "gptq": optimize/int4_gptq.py against the Hessians of the ``calibration`` windows,
    stored as RTN's). ``lm_head`` (the MatMul computing the logits): "int4" like the rest, "int8"
    (8-bit MatMulNBits, the genai builder's ``rtn_last``) or "fp32" (left as it is). The
    embedding's Gather is left float32, except where the checkpoint ties it to a 4-bit
    symmetric head (``tied_embedding``): then it reads the head's 4-bit weights
    (optimize/int4_embed.py, as the builder shares them)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        HQQWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    from onnxmedic.optimize import int4_embed
    from onnxmedic.optimize.files import op_count_diff, op_counts, save_proto

    def nbits(m: Any, bits: int, exclude: list[str], cfg: Any = None) -> Any:
        q = MatMulNBitsQuantizer(m, bits=bits, block_size=block_size, is_symmetric=True,
                                 accuracy_level=accuracy_level or None,
                                 nodes_to_exclude=exclude, algo_config=cfg)
        with warnings.catch_warnings():  # HQQ's torch.from_numpy of a read-only weight,
            # which it only reads: torch's "not writable" warning is noise on stderr
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            q.process()
        return q.model.model

    if lm_head not in LM_HEADS:
        raise ValueError(f"lm_head {lm_head!r}: choose one of {', '.join(LM_HEADS)}")
    before = op_counts(src)
    model = onnx.load(src)
    fold_weight_transposes(model.graph)
    head = lm_head_node(model.graph)
    tie = (int4_embed.tied_embedding(model.graph, head)
           if tied_embedding and lm_head == "int4" and head not in nodes_to_exclude else None)
    exclude = list(nodes_to_exclude) + ([head] if head and lm_head != "int4" else [])
    if algo == "gptq":
        from onnxmedic.optimize import int4_gptq

        if not calibration:
            raise ValueError("algo gptq needs calibration windows (--calibration TEXT)")
        hs = int4_gptq.cached_hessians(model, src, calibration)
        out = int4_gptq.gptq_model(model, hs, block_size, accuracy_level, exclude)
    elif algo in ("rtn", "hqq"):  # rtn: the quantizer's default config (from its arguments)
        hqq = HQQWeightOnlyQuantConfig(block_size=block_size, bits=4) if algo == "hqq" else None
        out = nbits(model, 4, exclude, hqq)
    else:
        raise ValueError(f"algo {algo!r}: choose rtn, hqq or gptq")
    if head and lm_head == "int8":  # only the head still has a constant-weight MatMul
        out = nbits(out, 8, list(nodes_to_exclude))
    shared = int4_embed.share_with_head(out.graph, *tie) if tie else None
    save_proto(out, dst)
    info = op_count_diff(before, op_counts(dst))
    info.update(lm_head_node=head, lm_head=lm_head, excluded=list(nodes_to_exclude),
                embedding=(shared or {}).get("embedding", "float32"))
    return info
