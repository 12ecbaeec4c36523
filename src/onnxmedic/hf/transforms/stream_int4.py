"""An int4 generation package made and judged streamed: the float32 package's decoder is
quantized one weight at a time, and the int4 package is judged against the checkpoint read one
decoder layer at a time (hf/stream.py) - never the whole model in memory, on either side.

1. **Quantize** (:func:`quantize_streamed`): every MatMul of the decoder with a constant 2-D
   float weight becomes a MatMulNBits through ONNX Runtime's own quantizer
   (``DefaultWeightOnlyQuantizer``: symmetric 4-bit, one float32 scale per ``block_size``
   weights along K, ``accuracy_level`` 4 - the layout optimize/int4.py's RTN candidates and
   the builder's ``-p int4`` write), one weight read from the package's external data, made
   and appended to the new package's data file at a time. The embedding's Gather stays
   float32; the LM head is 4-bit like the rest.
2. **Rounding** (optimize/int4.py's :func:`~onnxmedic.optimize.int4.rounding_problem`, the
   rule the int4 search applies to its RTN candidates, one weight at a time): every
   dequantized weight lies within one step of the float32 weight it was made from. A corrupted
   block or a wrong scale is refused here (OM870) whatever it costs on the task.
3. **Task budget** (optimize/int4.py's :class:`~onnxmedic.optimize.int4.TaskBudget` and
   :func:`~onnxmedic.optimize.int4.judge`): the int4 decoder's greedy tokens from the
   budget's prompts and its perplexity on the built-in text, in ONNX Runtime (a child),
   against PyTorch's, streamed (the budget's reference: in the checkpoint's half type where
   the CPU multiplies it in hardware, else float32, :func:`reference_dtype`): its perplexity
   over the text's windows, and its greedy pick teacher-forced along the int4 decoder's own
   tokens (at each step, PyTorch's pick after the same prefix against the int4 decoder's
   token): one
   streamed pass instead of one per generated token, which a streamed reference without a
   cache would need to force the candidate along PyTorch's own tokens (docs/int4.md); the
   prefix is shared either way, so each step still compares two picks from one context.
   Outside the budget: OM871.
4. **Serving**: onnxruntime-genai generates from the new folder, and its greedy tokens must be
   ONNX Runtime's own for the int4 decoder (OM736, as int4_package.py's check).

Steps 3 and 4 compute each thing once, and what does not wait on another runs beside it
(:func:`judged`):

- PyTorch's perplexity (this process, one thread; it needs nothing of the package) while the
  package is made: beside :func:`int4_written`'s writer (a child); on the float32 package's
  road (:func:`int4_streamed`), beside onnxruntime-genai's generation (one thread each);
- on the writer's road, onnxruntime-genai generating (a child) beside ONNX Runtime scoring
  the text's windows (a child; one thread each) where two int4 sessions fit
  (:func:`sessions_fit`: this process, the scoring child's own and each session
  :data:`SESSION_FACTOR` x the package's files within :data:`PEAK_BOUND` x the checkpoint's
  weights); else genai alone (on the package's threads: the cores), the text scored with
  the confirmation below;
- ONNX Runtime (a child) confirming genai's tokens as its greedy ones (optimize/int4.greedy:
  one prefill per prompt over the prompt and genai's tokens, its pick after every prefix;
  where one differs it decodes that prompt step by step with its cache, as generation does,
  and that decides) while PyTorch's pass runs along genai's tokens.
  Where ONNX Runtime's own tokens are others, PyTorch runs again along those, the budget
  judges them, and genai's differ: OM736. A near tie between the prefill's kernels and the
  decode's is thus never an OM736, a real disagreement always is, and the figures are those
  of the checks run one after the other.

Without onnxruntime-genai (or where it failed) ONNX Runtime decodes greedily on its own
(beside PyTorch's perplexity where that is not known yet), then PyTorch runs along its
tokens. ``seconds`` and ``cpu`` are per phase, named after the sides that overlapped
(``write+torch-windows``, ``genai+onnx-windows`` or ``genai``, ``onnx+torch-picks``; on the
float32 road ``genai+torch-windows``); ``parts``: each side's own CPU seconds. Where the
writer fails, PyTorch's perplexity is dropped (a rounding: OM870; another reason: the
float32 road, which computes its own); where PyTorch's pass raises, the writer's child is
stopped first. Measured at Qwen2.5-1.5B's shape with 14 layers (the embedding's share is
large), genai's session beside ONNX Runtime's would take the process tree's peak over 1.3x
the checkpoint's weights: one int4 session at a time there; with 28 layers, 1.22x (3.52 GiB,
ONNX Runtime's scoring child 1.9 GiB for a 0.91 GiB package). PyTorch's pass (0.5 GiB over
its start since its log-softmax is chunked) beside the writer (one weight at a time) is not
an int4 session.

The package is written at ``out`` only when all of this passed (built beside it, renamed into
place: nothing half-written); the findings say what failed.

Memory: one weight (float32) and its blocks at a time while quantizing and checking (beside
it, on the writer's road, one decoder layer of the checkpoint (float32, or its half type:
:func:`reference_dtype`) and the logits of the
text's windows: PyTorch's perplexity); then onnxruntime-genai's int4 session beside ONNX
Runtime's where they fit (:func:`sessions_fit`), else one at a time; then ONNX Runtime's
int4 session (a child) beside one decoder
layer of the checkpoint, the activations and the logits of the text's windows or
of the prompts' sequences.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

logger = logging.getLogger(__name__)

STAGE = "optimize"
ALIGN = 4096  # offsets of the tensors in the data file (the builder's and onnx's alignment)
INLINE = 1024  # tensors of fewer bytes stay in the graph file


@dataclass
class StreamedInt4:
    """The outcome: ``ok`` when ``path`` was written; ``quantized``: MatMuls made 4-bit;
    ``figures``: the task budget's (optimize/int4.judge's dict); the int4 decoder's own greedy
    tokens and onnxruntime-genai's (``decoded``: the prompts whose tokens ONNX Runtime decoded
    step by step, its prefill not confirming genai's); ``reference``: the dtype PyTorch's
    side ran in (:func:`reference_dtype`); ``seconds`` per phase (wall) and
    ``cpu`` (CPU seconds of this process and of the children it reaped meanwhile: the
    writer's, ONNX Runtime's, onnxruntime-genai's), a phase named after the sides that ran
    beside each other in it; ``parts``: each side's own CPU seconds; ``findings``."""

    ok: bool = False
    path: str | None = None
    quantized: int = 0
    figures: dict[str, Any] = field(default_factory=dict)
    tokens_onnx: list[list[int]] = field(default_factory=list)
    tokens_genai: list[list[int]] | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    findings: list[Any] = field(default_factory=list)
    parts: dict[str, float] = field(default_factory=dict)
    decoded: list[int] = field(default_factory=list)
    reference: str = ""  # the dtype PyTorch's side ran in (reference_dtype)

    def judged_note(self) -> str:
        """What OM819 says of a package written here: its MatMuls made 4-bit, the budget's
        figures and the reference's dtype."""
        return (f"quantized and judged streamed: {self.quantized} MatMuls 4-bit, greedy "
                f"agreement {self.figures['agreement'] * 100:.1f} %, perplexity "
                f"{(self.figures['perplexity_ratio'] - 1) * 100:+.2f} % of PyTorch's, "
                f"{self.reference}")

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the block's wall and CPU seconds to ``phase``'s."""
        t0, c0 = time.perf_counter(), sum(os.times()[:4])
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0
            self.cpu[phase] = self.cpu.get(phase, 0.0) + sum(os.times()[:4]) - c0

    @contextmanager
    def part(self, name: str, *, own: bool) -> Iterator[None]:
        """Add to ``parts[name]`` the block's CPU seconds of this process (``own``) or of the
        children it reaped meanwhile: a phase's pieces that ran beside each other."""
        i = slice(0, 2) if own else slice(2, 4)
        c0 = sum(os.times()[i])
        try:
            yield
        finally:
            self.parts[name] = self.parts.get(name, 0.0) + sum(os.times()[i]) - c0


# ------------------------------------------------------------------------------------------
# 1. the quantization, one weight at a time


def append_external(data: BinaryIO, t: Any, payload: bytes, location: str) -> None:
    """``t`` (a TensorProto) made to point at ``payload``, appended to ``data`` aligned."""
    from onnx import TensorProto

    pad = -data.tell() % ALIGN
    data.write(b"\0" * pad)
    offset = data.tell()
    data.write(payload)
    t.ClearField("raw_data")
    del t.external_data[:]
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(offset)),
                 ("length", str(len(payload)))):
        e = t.external_data.add()
        e.key, e.value = k, v


def quantize_streamed(src: str | os.PathLike[str], dst: str | os.PathLike[str], *,
                      block_size: int = 32, accuracy_level: int = 4) -> int:
    """Write the decoder graph file ``dst`` (its weights in ``<dst name>.data``): the decoder
    ``src`` with every MatMul of a constant 2-D float weight made MatMulNBits (see the module
    docstring), one weight in memory at a time. Returns the number of MatMuls quantized."""
    import onnx
    from onnx import helper
    from onnx.external_data_helper import uses_external_data

    from onnxmedic.hf.transforms.int4_writer import rtn_quantizer
    from onnxmedic.onnxfile import tensor_array, tensor_bytes

    src, dst = Path(src), Path(dst)
    model = onnx.load(str(src), load_external_data=False)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    users = Counter(i for n in graph.node for i in n.input)  # the readers of each value
    quantizer = rtn_quantizer(block_size, accuracy_level)
    location = f"{dst.name}.data"
    nodes: list[Any] = []
    made: list[Any] = []  # the quantized initializers, already in the data file
    done = 0
    with open(dst.parent / location, "wb") as data:
        for node in graph.node:
            w = inits.get(node.input[1]) if node.op_type == "MatMul" and \
                len(node.input) == 2 else None
            if w is None or len(w.dims) != 2 or w.data_type not in (
                    onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16):
                nodes.append(node)
                continue
            one = onnx.GraphProto()
            if w.data_type == onnx.TensorProto.FLOAT and uses_external_data(w):
                # the weight's bytes as they are: one copy of it in memory, not three
                t = one.initializer.add()
                t.name, t.data_type = w.name, w.data_type
                t.dims.extend(w.dims)
                t.raw_data = tensor_bytes(w, src.parent)
            else:
                one.initializer.append(onnx.numpy_helper.from_array(
                    tensor_array(w, src.parent).astype(np.float32, copy=False), w.name))
            new = quantizer.quantize_matmul(node, [one])
            nodes.extend(new)
            if new == [node]:  # the quantizer left it (its reason logged)
                continue
            for t in one.initializer[1:]:
                append_external(data, t, t.raw_data, location)
                # a copy: a message of ``one`` would keep ``one`` whole (the weight's
                # bytes) alive with it
                made.append(onnx.TensorProto())
                made[-1].CopyFrom(t)
            del one
            users[w.name] -= 1
            done += 1
        kept = [t for t in graph.initializer if users.get(t.name, 0) > 0]
        for t in kept:  # the initializers left as they were, copied one at a time
            if uses_external_data(t):
                append_external(data, t, tensor_bytes(t, src.parent), location)
            elif t.ByteSize() > INLINE and t.raw_data:
                append_external(data, t, t.raw_data, location)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.ClearField("initializer")
    graph.initializer.extend(kept + made)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.save(model, str(dst))
    return done


# ------------------------------------------------------------------------------------------
# 3. the task budget, streamed


def task_data(checkpoint: Path, prompts: int, vocab: int) -> Any:
    """optimize/int4.py's task data through the checkpoint's tokenizer (the built-in
    prompts and text); without one, seeded random ids (prompts of 4 ids, a text of
    int4.SAMPLED_TOKENS ids)."""
    from onnxmedic.optimize.int4 import SAMPLED_TOKENS, TaskData, builtin_data

    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(checkpoint))
    except (OSError, ValueError):
        rng = np.random.default_rng(0)
        ids = lambda n: [int(t) for t in rng.integers(4, vocab, n)]  # noqa: E731
        return TaskData([ids(4) for _ in range(prompts)], ids(SAMPLED_TOKENS),
                        "random ids (no tokenizer in the checkpoint)")
    data = builtin_data(lambda s: tok.encode(s, add_special_tokens=False), prompts)
    data.prompts = [[min(t, vocab - 1) for t in p] for p in data.prompts]
    data.text = [min(t, vocab - 1) for t in data.text]
    return data


def windows(text: list[int]) -> list[list[int]]:
    """The perplexity windows of ``text`` (optimize/int4.mean_nll's: WINDOW + 1 tokens, each
    from an empty past)."""
    from onnxmedic.optimize.int4 import WINDOW

    return [text[s:s + WINDOW + 1] for s in range(0, max(len(text) - 1, 0), WINDOW)
            if len(text[s:s + WINDOW + 1]) >= 2]


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """PyTorch's intra-op threads set to ``n`` inside, restored after (the caller's setting is
    borrowed, not taken): a streamed pass beside another process (the writer child, ONNX
    Runtime's) takes one core of the two, not both."""
    import torch

    was = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(was)


def reference_dtype(checkpoint: Path) -> Any:
    """The dtype PyTorch's streamed passes run the budget's reference in: the checkpoint's
    own half type (every weight bfloat16, or every weight float16) where this CPU multiplies
    it in hardware (isa.computes_natively: bfloat16 2.5x float32's speed on AVX-512 BF16), as
    transformers runs such a checkpoint, its output projection in float32 (hf/stream.py);
    else float32. Its rounding is far under int4's: at Llama-3.1-8B's shape (2 layers, the
    built-in text's windows) its logits are 0.74 % from float32's, the int4 package's 21.9 %
    (relative distance), so it hides no fault the budget would see in float32; a wrong weight
    is refused by the rounding check (OM870) before any run."""
    import torch

    from onnxmedic.hf.stream import Weights
    from onnxmedic.isa import computes_natively

    kinds = Weights(checkpoint).dtypes()
    half = kinds.pop() if len(kinds) == 1 else None
    if half in (torch.bfloat16, torch.float16) and \
            computes_natively(str(half).removeprefix("torch.")):
        return half
    return torch.float32


def torch_perplexity(checkpoint: Path, text: list[int]) -> float:
    """PyTorch's perplexity on ``text``'s windows (optimize/int4.mean_nll over the logits of
    one streamed pass, hf/stream.py's :func:`~onnxmedic.hf.stream.streamed_batches`, in
    :func:`reference_dtype`): the budget's reference, which needs nothing of the int4
    package."""
    from onnxmedic.hf.stream import streamed_batches
    from onnxmedic.optimize.int4 import mean_nll

    wins = windows(text)
    if not wins:
        return float("nan")
    dtype = reference_dtype(checkpoint)
    got = streamed_batches(checkpoint, [[w[:-1] for w in wins]], (dtype,))
    by_window = {tuple(w[:-1]): got[dtype][0][j] for j, w in enumerate(wins)}
    del got
    nll, n = mean_nll(lambda ids, past: (by_window[tuple(int(i) for i in ids[0])], past), [],
                      text)
    return float(np.exp(nll / n)) if n else float("nan")


def torch_picks(checkpoint: Path, prompts: list[list[int]], tokens: list[list[int]]
                ) -> list[list[int]]:
    """PyTorch's greedy pick at each step of the int4 decoder's ``tokens`` after the same
    prefix (teacher-forced): one streamed pass (in :func:`reference_dtype`) over the prompts'
    sequences, padded to the longest."""
    from onnxmedic.hf.stream import streamed_batches

    seqs = [p + t[:-1] for p, t in zip(prompts, tokens)]
    if not seqs:
        return []
    dtype = reference_dtype(checkpoint)
    logits = streamed_batches(checkpoint, [seqs], (dtype,))[dtype][0]
    return [[int(np.argmax(logits[i][0, len(p) - 1 + k])) for k in range(len(t))]
            for i, (p, t) in enumerate(zip(prompts, tokens))]


def over_budget(figures: dict[str, Any], budget: Any) -> Any:
    """OM871: the int4 package outside the task budget (nothing written)."""
    from onnxmedic.findings import error

    return error("OM871", STAGE, f"the int4 package was not written: it is outside the task "
                 f"budget ({budget.describe()}): {figures['rejected']}.",
                 suggestion="Keep the float32 package, or give a looser budget with "
                 "--accuracy (docs/int4.md); a real checkpoint's tokens are far less tied "
                 "than a random one's.", details={k: v for k, v in figures.items()
                                                  if k != "rejected"})


def not_rounded(why: str, of: str = "the float32 package's") -> Any:
    """OM870: a 4-bit weight of the written package is not a rounding of its float one."""
    from onnxmedic.findings import error

    return error("OM870", STAGE, f"the int4 package was not written: its 4-bit weights are "
                 f"not a rounding of {of} ({why}).",
                 suggestion="A corrupted block or a wrong scale: rerun the quantization; if it "
                 "persists, report it with the package.")


def int4_streamed(package: str | os.PathLike[str], checkpoint: str | os.PathLike[str],
                  out: str | os.PathLike[str], *, budget: Any = None, block_size: int = 32,
                  accuracy_level: int = 4, genai: bool = True, timeout: float | None = None,
                  tamper: Any = None) -> StreamedInt4:
    """Write ``out``: the float32 generation package ``package`` at int4, judged against the
    checkpoint folder ``checkpoint`` streamed (see the module docstring); ``budget``:
    int4.TaskBudget or its spec (None: the default); ``timeout``: one ONNX Runtime run's
    (sandbox.DEFAULT_TIMEOUT when None). ``tamper(decoder_path)``: called on the
    written int4 decoder before it is checked (the tests' fault injection). Nothing is
    written at ``out`` unless every check passed. Raises ValueError for a checkpoint
    hf/stream.py cannot stream or a budget spec that does not parse."""
    from onnxmedic.genpackage import decoder_graph
    from onnxmedic.hf.transforms.passes import copy_side_files, staged
    from onnxmedic.optimize.int4 import rounding_problem

    checkpoint, config, budget, timeout = begun(checkpoint, budget, timeout)
    package, out, res = Path(package), Path(out), StreamedInt4()
    graph = decoder_graph(package)
    out.parent.mkdir(parents=True, exist_ok=True)
    with staged(out) as tmp:
        with res.timed("quantize"):
            res.quantized = quantize_streamed(graph, tmp / graph.name, block_size=block_size,
                                              accuracy_level=accuracy_level)
            copy_side_files(package, tmp, graph.name)
            if tamper is not None:
                tamper(tmp / graph.name)
        with res.timed("rounding"):
            why = rounding_problem(graph, tmp / graph.name)
        if why is not None:
            res.findings.append(not_rounded(why))
            return res
        judged(res, tmp, tmp / graph.name, checkpoint, config, budget, genai=genai,
               timeout=timeout, into=out)
    return res


def begun(checkpoint: str | os.PathLike[str], budget: Any, timeout: float | None
          ) -> tuple[Path, Any, Any, float]:
    """What :func:`int4_streamed` and :func:`int4_written` start from: (the checkpoint
    folder, its transformers config, the task budget parsed, ``timeout`` or
    sandbox.DEFAULT_TIMEOUT). Raises ValueError for a checkpoint hf/stream.py cannot stream
    (before any work) or a budget spec that does not parse."""
    from onnxmedic import sandbox
    from onnxmedic.hf.stream import checked_config
    from onnxmedic.optimize.int4 import TaskBudget, parse_budget

    if not isinstance(budget, TaskBudget):
        budget = parse_budget(budget)
    timeout = sandbox.DEFAULT_TIMEOUT if timeout is None else float(timeout)
    checkpoint = Path(checkpoint)
    return checkpoint, checked_config(checkpoint), budget, timeout


def judged(res: StreamedInt4, folder: Path, decoder: Path, checkpoint: Path, config: Any,
           budget: Any, *, genai: bool, timeout: float, into: Path, data: Any = None,
           perplexity: float | None = None) -> None:
    """Steps 3 and 4 of the module docstring on the int4 package ``folder`` (its decoder
    graph ``decoder``): the task budget against the checkpoint streamed, then
    onnxruntime-genai's tokens; where both held, ``folder`` renamed into place at ``into``
    (``res``: figures, tokens, seconds and findings recorded; ``ok`` and ``path`` once
    written).

    With onnxruntime-genai: it generates (a child, one thread) while PyTorch computes its
    perplexity (this process, one thread) or, where that is known already and two int4
    sessions fit (:func:`sessions_fit`), while ONNX Runtime (a child, one thread) scores the
    text; then ONNX Runtime (a child) scores the text (where not scored yet) and
    confirms genai's tokens as its own greedy ones (optimize/int4.greedy: one prefill per
    prompt, decoding step by step only where a pick differs) while PyTorch's streamed pass
    runs along them. Without it (or where it failed), ONNX Runtime decodes on its own while
    PyTorch computes its perplexity, then PyTorch runs along its tokens. ``data`` and
    ``perplexity``: the task data and PyTorch's perplexity on its text where they are known
    already (:func:`int4_written` computes them beside its writer); genai then generates
    beside ONNX Runtime's scoring of the text (one thread each), or alone, on the package's
    threads (the cores)."""
    from onnxmedic.genpackage import read_package
    from onnxmedic.hf.gen_verify import GenerationCheck, genai_available
    from onnxmedic.hf.transforms.int4_package import genai_agrees
    from onnxmedic.onnxfile import replace_folder
    from onnxmedic.optimize.int4 import judge

    if data is None:
        data = task_data(checkpoint, budget.prompts, int(config.vocab_size))
    # ``timeout`` is a run's: the scoring makes a run per generated token and window
    runs = budget.prompts * (budget.steps + 1) + len(windows(data.text))
    layout = read_package(folder)
    served = genai and genai_available()
    check, out, text = GenerationCheck(prompts=data.prompts), None, None
    if served:
        # ONNX Runtime's scoring of the text beside genai where PyTorch's perplexity is known
        # and two int4 sessions fit (:func:`sessions_fit`)
        beside = (decoder, layout) if perplexity is not None and sessions_fit(
            folder, checkpoint) else None
        out, perplexity, text = genai_phase(res, folder, checkpoint, data, budget, check,
                                            timeout * runs, perplexity, beside)
    given = out["tokens"] if out is not None else None
    got, picks, perplexity = onnx_phase(res, decoder, checkpoint, data, budget, layout, given,
                                        timeout * runs, perplexity, text)
    if not got.get("ok"):
        res.figures = {"rejected": got.get("error", "the scoring failed")}
        res.findings.append(over_budget(res.figures, budget))
        return
    res.tokens_onnx, res.decoded = got["tokens"], got["decoded"]
    if picks is None or got["tokens"] != given:  # PyTorch along ONNX Runtime's own tokens
        with res.timed("torch-picks"), res.part("torch-picks", own=True):
            picks = torch_picks(checkpoint, data.prompts, got["tokens"])
    res.figures = judge({"tokens": picks, "perplexity": perplexity},
                        {**got, "picks": got["tokens"]}, budget)
    res.reference = str(reference_dtype(checkpoint)).removeprefix("torch.")
    if res.figures["rejected"]:
        res.findings.append(over_budget({**res.figures, "reference": res.reference}, budget))
        return
    if genai:
        ok, res.tokens_genai, found = genai_agrees(folder, data.prompts, res.tokens_onnx,
                                                   budget.steps, timeout * runs,
                                                   ran=(check, out) if served else None)
        res.findings.extend(found)
        if not ok:
            return
    replace_folder(folder, into)
    res.ok, res.path = True, str(into)


def genai_phase(res: StreamedInt4, folder: Path, checkpoint: Path, data: Any, budget: Any,
                check: Any, timeout: float, perplexity: float | None,
                beside: tuple[Path, Any] | None = None
                ) -> tuple[dict[str, Any] | None, float | None, dict[str, Any] | None]:
    """onnxruntime-genai generating from ``folder`` (a child: its run's output, None where it
    failed, ``check`` said why), with PyTorch's perplexity beside it unless it is known
    already (``perplexity``; returned either way), else with ONNX Runtime (a child) scoring
    the text's windows where ``beside`` (the decoder graph and its layout) says so: its
    result, else None."""
    from onnxmedic.hf.gen_verify import finish_genai_child, genai_spec, start_genai_child
    from onnxmedic.optimize.int4 import TaskData, score_onnx

    side = "torch-windows" if perplexity is None else "onnx-windows" if beside else ""
    text = None
    with res.timed("+".join(["genai"] + [side] * bool(side))):
        # one thread beside the other side; alone, the package's own setting (the cores)
        run = start_genai_child(folder, genai_spec(folder, data.prompts, budget.steps,
                                                   threads=1 if side else None))
        try:
            if perplexity is None:
                with res.part(side, own=True), torch_threads(1):
                    perplexity = torch_perplexity(checkpoint, data.text)
            elif beside is not None:
                with res.part(side, own=False):  # the scoring's child, reaped here
                    text = score_onnx(beside[0], TaskData([], data.text), budget.steps, None,
                                      threads=1, timeout=timeout, layout=beside[1])
        except BaseException:
            run.stop()
            raise
        with res.part("genai", own=False):
            return finish_genai_child(run, timeout, check), perplexity, text


def onnx_phase(res: StreamedInt4, decoder: Path, checkpoint: Path, data: Any, budget: Any,
               layout: Any, given: list[list[int]] | None, timeout: float,
               perplexity: float | None, text: dict[str, Any] | None = None
               ) -> tuple[dict[str, Any], Any, float | None]:
    """ONNX Runtime scoring the int4 ``decoder`` (a child: the text unless ``text`` is its
    scoring already, and its greedy tokens, confirming genai's ``given`` where there are some)
    beside PyTorch's side: its perplexity where it is not known yet, else its picks along
    ``given``. (the scoring's result, PyTorch's picks or None, the perplexity)."""
    from onnxmedic.optimize.int4 import TaskData, score_onnx

    picks = None
    side = "torch-windows" if perplexity is None else "torch-picks" if given else ""
    asked = data if text is None else TaskData(data.prompts, [])
    with res.timed("+".join(["onnx"] + [side] * bool(side))), res.part("onnx", own=False), \
            (res.part(side, own=True) if side else nullcontext()):
        # the scoring waits on its child in a thread (the GIL is free meanwhile)
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(score_onnx, decoder, asked, budget.steps, None, given=given,
                                  timeout=timeout, layout=layout)
            with torch_threads(1):
                if perplexity is None:
                    perplexity = torch_perplexity(checkpoint, data.text)
                elif given is not None:
                    picks = torch_picks(checkpoint, data.prompts, given)
            got = pending.result()
    if text is not None:  # the text's figures from its own scoring (its error where it failed)
        got = text if not text.get("ok") else got if not got.get("ok") else {
            **got, "perplexity": text["perplexity"], "text_tokens": text["text_tokens"]}
    return got, picks, perplexity


# an int4 session's resident bytes per byte of its package's files (ONNX Runtime's, one
# thread, MatMulNBits prepacked: measured 1.55 at Qwen2.5-1.5B's shape, 28 layers, 1.64 at 14)
SESSION_FACTOR = 1.5
# the scoring child's own: its interpreter and ONNX Runtime (0.27 GiB), the windows'
# activations and logits (0.22 GiB at a 152k vocabulary)
CHILD_BASE = 2**29
PEAK_BOUND = 1.3  # the process tree's peak the overlap keeps within, x the checkpoint's weights


def release_heap() -> None:
    """Hand the heap this process freed back to the system (glibc's malloc_trim; PyTorch's
    streamed pass frees a layer's weights at a time, which glibc keeps); nothing elsewhere."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def resident() -> int:
    """This process's resident bytes; its peak where the current figure is not readable."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGESIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def sessions_fit(folder: Path, checkpoint: Path) -> bool:
    """Whether onnxruntime-genai's int4 session and ONNX Runtime's side by side (each
    :data:`SESSION_FACTOR` x the package's files, the scoring child's own
    :data:`CHILD_BASE`), with this process, stay within :data:`PEAK_BOUND` x the
    checkpoint's weight bytes. Where not, one int4 session at a time."""
    package = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    release_heap()  # what PyTorch's pass freed is not this process's any more
    here = resident()
    need = here + CHILD_BASE + 2 * SESSION_FACTOR * package
    fit = need <= PEAK_BOUND * weight_bytes(checkpoint)
    logger.info("two int4 sessions side by side: ~%.2f GiB (this process %.2f GiB, the "
                "package %.2f GiB), bound %.2f GiB: %s", need / 2**30, here / 2**30,
                package / 2**30, PEAK_BOUND * weight_bytes(checkpoint) / 2**30,
                "beside each other" if fit else "one after the other")
    return fit


def int4_written(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], *,
                 budget: Any = None, genai: bool = True, timeout: float | None = None,
                 tamper: Any = None) -> StreamedInt4 | None:
    """Write ``out``: the int4 package of the checkpoint folder ``checkpoint`` made by
    hf/transforms/int4_writer.py (onnxruntime-genai's builder in a child, each weight read,
    quantized, written and checked against its rounding as the builder makes it: no float32
    package), then judged as :func:`int4_streamed` judges (steps 3 and 4), PyTorch's
    perplexity computed in this process (one thread) while the writer's child runs: it needs
    nothing of the package; dropped where the writer fails, and an error in it stops the
    writer before it goes on. ``tamper(weight,
    blocks, scales)``: called in the child on each slice of 4-bit blocks before it is written
    (the tests' faulty quantizer). ``timeout``: one ONNX Runtime run's, and the writer's per
    GiB of the checkpoint's weights. None when the writer failed for another reason than a
    rounding (its log's reason logged): the caller takes the float32 package's road. Nothing
    is written at ``out`` unless every check passed."""
    from functools import partial

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from onnxmedic.hf import builder
    from onnxmedic.hf.transforms import int4_writer
    from onnxmedic.hf.transforms.passes import staged

    checkpoint, config, budget, timeout = begun(checkpoint, budget, timeout)
    out, res = Path(out), StreamedInt4()
    out.parent.mkdir(parents=True, exist_ok=True)
    # PyTorch's perplexity (this process, one thread) beside the writer (a child): it needs
    # nothing of the package
    phase = "write+torch-windows"
    with staged(out) as stage:
        with res.timed(phase):
            # the family's modeling module imported before the fork: the writer child's model
            # (on the meta device) and PyTorch's streamed side share one import of it
            MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
            job = builder.start(checkpoint, stage / "pkg",
                                work=partial(int4_writer.build, tamper=tamper))
        try:
            with res.timed(phase), res.part("write", own=False):
                # after the fork: the child has no tokenizer's nor PyTorch's threads
                with res.part("torch-windows", own=True), torch_threads(1):
                    data = task_data(checkpoint, budget.prompts, int(config.vocab_size))
                    perplexity = torch_perplexity(checkpoint, data.text)
                # the writer reads, quantizes and checks every weight: ``timeout`` per GiB
                # (from its start, PyTorch's pass included)
                why = job.wait(timeout * max(1.0, weight_bytes(checkpoint) / 2**30))
            said = int4_writer.verdict(job.root)
            if "not_rounded" in said:
                res.findings.append(not_rounded(said["not_rounded"], "the checkpoint's"))
                return res
            if why is not None or "quantized" not in said:
                logger.warning("the streamed int4 writer failed (%s): the float32 package's "
                               "road", why or "it said nothing")
                return None
            res.quantized = int(said["quantized"])
            with res.timed(phase):
                builder.finish(job, *side_files(checkpoint))
            judged(res, job.out, job.out / builder.GRAPH, checkpoint, config, budget,
                   genai=genai, timeout=timeout, into=out, data=data, perplexity=perplexity)
        finally:
            job.discard()
    return res


# ------------------------------------------------------------------------------------------
# export hf:DIR --precision int4 at size: the builder's float32 package, then the above

STREAM_FROM = 2**30  # the checkpoint's weight bytes from which export's int4 streams
TASK = "text-generation-with-past"


def weight_bytes(folder: Path) -> int:
    """The bytes of the checkpoint folder's safetensors files."""
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def streamed_road(model: Any, task: str | None, *, dtype: str, verify: bool, opset: Any,
                  backend: str, remote_code: bool) -> Path | None:
    """The checkpoint folder ``export_pretrained(model, precision="int4", ...)`` takes the
    streamed road for, or None (the whole-model road, hf/transforms/precision.py): a folder
    of safetensors of at least :data:`STREAM_FROM` bytes, a causal LM of a family
    hf/stream.py streams and onnxruntime-genai's builder serves, at fp32, verified, with no
    opset asked for, no remote code and a backend other than ``"export"``."""
    from onnxmedic.hf import builder
    from onnxmedic.hf.stream import streamable

    if not isinstance(model, (str, os.PathLike)) or dtype != "fp32" or not verify or \
            opset is not None or backend == "export" or remote_code:
        return None
    return large_folder(model, task, lambda config, folder: builder.available() and (
        config.get("architectures") or ["?"])[0] in builder.served(), streamable,
        "export's int4 does not stream")


def large_folder(model: Any, task: str | None, takes: Any, problem: Any,
                 why_not: str) -> Path | None:
    """The checkpoint folder that ``model`` (a folder, ``hf:`` prefix optional) names, where
    its safetensors hold at least :data:`STREAM_FROM` bytes, it is a causal LM for ``task``
    (None or :data:`TASK`), ``takes(config_dict, folder)`` holds and ``problem(config)`` (its
    transformers config) says None; else None (``why_not``: the log line's start)."""
    from onnxmedic.hf.tasks import detect_task

    name = str(model)
    folder = Path(name[3:] if name.startswith("hf:") else name)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if weight_bytes(folder) < STREAM_FROM or task not in (None, TASK) or \
            detect_task(config, folder) != TASK or not takes(config, folder):
        return None
    from transformers import AutoConfig

    try:
        why = problem(AutoConfig.from_pretrained(str(folder)))
    except (OSError, ValueError) as e:
        why = str(e)
    if why is not None:
        logger.info("%s %s: %s", why_not, folder, why)
        return None
    return folder


def side_files(folder: Path) -> tuple[Any, Any]:
    """What builder.finish writes the package's side files from, without the model: the
    checkpoint's config and generation config (as ``model.config`` and
    ``model.generation_config``), and its tokenizer (None without one)."""
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    try:
        gen = GenerationConfig.from_pretrained(str(folder))
    except OSError:
        gen = None
    try:
        tok = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError):
        tok = None
    return SimpleNamespace(config=AutoConfig.from_pretrained(str(folder)),
                           generation_config=gen), tok


def take_verdict(result: Any, made: StreamedInt4, stage: Any) -> None:
    """``made``'s findings, timings and verdict into the export ``result``'s int4 stage, and
    ``result.ok``: ``made.ok``."""
    result.findings.extend(made.findings)
    result.timings.update({f"int4 {k}": v for k, v in made.seconds.items()})
    result.timings.update({f"int4 {k} cpu": v for k, v in made.cpu.items()})
    # each side's own CPU seconds, where a phase ran several beside each other
    result.timings.update({f"int4 {k} own cpu": v for k, v in made.parts.items()})
    result.int4 = made
    result.ok = made.ok
    if not made.ok:
        stage.fail()


def export_streamed(folder: Path, f: str | os.PathLike[str], *, spec: str, budget: Any = None,
                    timeout: float | None = None, strict: bool = False,
                    report: str | os.PathLike[str] | None = None) -> Any:
    """``export hf:FOLDER --precision int4`` on the streamed road (``folder``:
    :func:`streamed_road`'s): :func:`int4_written` (the builder's graph, each weight quantized
    from the checkpoint as it is made, no float32 package), or where that writer fails for
    another reason than a rounding, onnxruntime-genai's builder's float32 package (a child)
    made int4 by :func:`int4_streamed`; either way judged against the checkpoint streamed,
    the PyTorch model never loaded. Returns the ExportResult, or None where the builder
    failed and ``strict`` is off (the caller takes the whole-model road, which loads the
    model). ``timeout``: the builder's and one ONNX Runtime run's."""
    from onnxmedic.findings import error, info
    from onnxmedic.hf import builder, report_to
    from onnxmedic.hf.transforms.passes import staged
    from onnxmedic.result import ExportResult, stages_of

    out = Path(f)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = ExportResult(command="export", model=spec, stages=stages_of("export", STAGE))
    from onnxmedic import sandbox

    wait = sandbox.DEFAULT_TIMEOUT if timeout is None else float(timeout)  # as backends.py
    made: StreamedInt4 | None = None
    with result.guard():
        if hasattr(os, "fork"):
            with result.stage("export", conclude=False):
                made = int4_written(folder, out, budget=budget, timeout=wait)
        if made is not None:
            result.record("export").passed()
            with result.stage(STAGE) as st:
                take_verdict(result, made, st)
    if made is None and not result.findings:  # (a finding here: the guard caught an error)
        with result.guard(), staged(out) as stage:
            with result.stage("export") as st:
                job = builder.start(folder, stage / "pkg")
                why = job.wait(wait)
                if why is not None:
                    job.discard()
                    if not strict:
                        logger.warning("the builder failed (%s): the whole-model road", why)
                        return None
                    st.fail(error("OM838", "export", f"onnxruntime-genai's model builder "
                                  f"cannot build {spec}: {why}.", suggestion="Leave "
                                  "--backend out (auto) for onnxmedic's own export."))
            if why is None:
                builder.finish(job, *side_files(folder))
                with result.stage(STAGE) as st:
                    made = int4_streamed(job.out, folder, out, budget=budget,
                                         timeout=wait)
                    job.discard()
                    take_verdict(result, made, st)
    result.path = str(out) if result.ok else None
    if result.ok:
        result.findings.append(info(
            "OM819", "write", f"int4 generation package written to {out} "
            f"({made.judged_note()}): {', '.join(sorted(p.name for p in out.iterdir()))}."))
    return report_to(result, report)


def main(argv: list[str] | None = None) -> int:
    """``python -m onnxmedic.hf.transforms.stream_int4 PACKAGE CHECKPOINT -o OUT [--accuracy SPEC]``:
    the float32 package at int4, judged streamed against the checkpoint; prints the verdict
    as JSON, exit 0 when written, 1 when not."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m onnxmedic.hf.transforms.stream_int4")
    ap.add_argument("package")
    ap.add_argument("checkpoint")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--accuracy", default=None, help="the task budget (docs/int4.md)")
    ap.add_argument("--no-genai", action="store_true")
    a = ap.parse_args(argv)
    try:
        res = int4_streamed(a.package, a.checkpoint, a.out, budget=a.accuracy,
                            genai=not a.no_genai)
    except (OSError, ValueError) as e:  # a folder that is not a package or a checkpoint
        print(f"onnxmedic.hf.transforms.stream_int4: {e}", file=sys.stderr)
        return 1
    figs = {k: v for k, v in res.figures.items() if k != "rejected"}
    print(json.dumps({"ok": res.ok, "path": res.path, "quantized": res.quantized,
                      "findings": [f"{f.code} {f.message}" for f in res.findings],
                      "figures": figs, "tokens_onnx": res.tokens_onnx,
                      "tokens_genai": res.tokens_genai,
                      "seconds": {k: round(v, 1) for k, v in res.seconds.items()}}))
    return 0 if res.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
