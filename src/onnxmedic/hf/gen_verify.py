"""Generation verified as it is used: greedy generation of N tokens in ONNX Runtime
(onnxmedic's own loop, each step run in the sandbox, fed its own cache) against PyTorch's
``generate(do_sample=False)``, token for token; each step's logits judged by the float64
budget of verify/budget.py (the reference: the model run in float64 over the whole generated
sequence, verify/reference.py); the first divergent step localised (verify/localize.py); and
onnxruntime-genai generating from the folder, when it is installed (in a child process).

Findings: OM811 tokens differ (logits outside the budget there), OM812 logits outside the
budget with the same tokens, OM813 a greedy tie (tokens differ, logits within the budget),
OM814 onnxruntime-genai's tokens differ, OM815 onnxruntime-genai not installed, OM816
onnxruntime-genai cannot load or run the folder.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from onnxmedic import sandbox
from onnxmedic.findings import Finding, InputError, error, info, warning
from onnxmedic.genpackage import StepLayout, decoder_graph, is_past, read_step
from onnxmedic.hf.tasks import accepts
from onnxmedic.inputs import Inputs
from onnxmedic.verify.budget import judge_output
from onnxmedic.verify.compare import OutputComparison
from onnxmedic.verify.reference import reference_outputs

logger = logging.getLogger(__name__)

STAGE = "generate"
DEFAULT_PROMPTS = ("The quick brown fox jumps over the lazy dog because",
                   "def add(a, b):\n    return")
# the second default prompt only for models up to this size: it is free for them, and for a
# big model it would double the verification (PyTorch's run and its float64 reference, two
# ONNX Runtime generations) for one more prefill length
SECOND_PROMPT_MAX_PARAMS = 100_000_000
CHILD = Path(__file__).resolve().parent / "genai_child.py"


@dataclass
class TorchRun:
    """PyTorch's side of one prompt: its greedy tokens, each step's logits, and their float64
    references (None until computed: only a prompt whose ONNX generation ran needs them)."""

    tokens: list[int]
    logits: list[np.ndarray]
    refs: list[np.ndarray | None] | None = None


@dataclass
class GenerationCheck:
    """The verdict on a package's generation. ``comparisons``: each step's logits judged."""

    ok: bool = True
    findings: list[Finding] = field(default_factory=list)
    comparisons: list[OutputComparison] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    tokens_torch: list[list[int]] = field(default_factory=list)
    tokens_onnx: list[list[int]] = field(default_factory=list)
    tokens_genai: list[list[int]] | None = None
    divergence: dict[str, Any] | None = None  # prompt, step, position, tokens
    seconds: dict[str, float] = field(default_factory=dict)
    # PyTorch's side per (prompt ids, steps): another candidate of the same model (a fused
    # package) is judged against the same runs instead of running the model again
    torch_runs: dict[tuple[Any, ...], TorchRun] = field(default_factory=dict, repr=False)

    def fail(self, *findings: Finding) -> None:
        self.ok = False
        self.findings.extend(findings)


def default_prompts(model: Any) -> list[str]:
    """The prompts verification generates from when the caller gives none: DEFAULT_PROMPTS,
    the second only for a model of at most SECOND_PROMPT_MAX_PARAMS parameters."""
    try:
        n = sum(p.numel() for p in model.parameters())
    except (AttributeError, TypeError):
        n = 0
    return list(DEFAULT_PROMPTS[:2 if n <= SECOND_PROMPT_MAX_PARAMS else 1])


def prompt_ids(tokenizer: Any, prompts: Any, vocab: int) -> list[list[int]]:
    """Token ids of the prompts: through the tokenizer when there is one, else (no tokenizer)
    seeded ids clear of the low special ids; ``prompts`` may also be lists of ids (None:
    DEFAULT_PROMPTS; verify_generation passes default_prompts(model))."""
    if prompts is None:
        prompts = list(DEFAULT_PROMPTS)
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str) and tokenizer is not None:
            ids = [int(t) for t in tokenizer(p)["input_ids"]]
        elif isinstance(p, str):
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(min(4, vocab - 1), vocab, (7 + i,), generator=g).tolist()
        else:
            ids = [int(t) for t in p]
        if tokenizer is not None and isinstance(p, str) and max(ids, default=0) >= vocab:
            raise InputError(error(
                "OM831", "inputs", f"the checkpoint's tokenizer gives the prompt {p!r} the "
                f"ids {sorted({t for t in ids if t >= vocab})[:8]}, at or beyond the model's "
                f"vocab_size {vocab} (the tokenizer has {len(tokenizer)} tokens): the tokenizer "
                "and the weights do not belong together, and PyTorch cannot run these ids.",
                suggestion="Save the tokenizer the model was trained with beside its weights, "
                "or resize the model's embeddings to the tokenizer "
                "(model.resize_token_embeddings(len(tokenizer))) before save_pretrained.",
                details={"vocab_size": vocab, "tokenizer_size": len(tokenizer)}))
        out.append(ids or [0])
    return out


def neutral_config(model: Any, steps: int, **extra: Any) -> Any:
    """The GenerationConfig the verification generates with: greedy search and nothing else,
    no stop at EOS (N tokens always), no logits processor (repetition penalties, suppressed
    tokens) - the graph is verified, not the search. ``extra``: further fields, e.g. an
    encoder-decoder's decoder_start_token_id."""
    from transformers import GenerationConfig

    pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = getattr(model.config, "pad_token_id", None) or 0
    return GenerationConfig(max_new_tokens=steps, min_new_tokens=0, do_sample=False,
                            num_beams=1, eos_token_id=None,
                            pad_token_id=pad[0] if isinstance(pad, (list, tuple)) else pad,
                            bos_token_id=None, repetition_penalty=1.0, no_repeat_ngram_size=0,
                            output_logits=True, return_dict_in_generate=True, **extra)


def greedy(model: Any, n: int, steps: int, generate: Callable[..., Any], *args: Any,
           start: int | None = None, **kw: Any) -> tuple[list[int], list[np.ndarray]]:
    """``generate(*args, **kw)`` (the model's, or GenerationMixin's) under
    :func:`neutral_config` (``start``: an encoder-decoder's decoder_start_token_id), that
    config the model's own for the call: transformers fills a passed config's unset fields
    from the model's (its eos_token_id would stop a decoder at EOS, BART's
    forced_eos_token_id would end every sequence with EOS), and the verification wants greedy
    search alone, N tokens always. Returns the tokens after the sequence's first ``n`` and
    each step's logits ([1, 1, vocab])."""
    extra = {} if start is None else {"decoder_start_token_id": start}
    cfg = neutral_config(model, steps, **extra)
    old, model.generation_config = model.generation_config, cfg
    try:
        with torch.no_grad():
            out = generate(*args, generation_config=cfg, **kw)
    finally:
        model.generation_config = old
    return out.sequences[0, n:].tolist(), [lg[:, None, :].float().numpy() for lg in out.logits]


def torch_generation(model: Any, ids: list[int], steps: int
                     ) -> tuple[list[int], list[np.ndarray]]:
    """PyTorch's greedy tokens and, per step, the logits ONNX Runtime's step returns: all the
    prompt's positions at the prefill, the new token's after. The prefill's are those of
    ``generate``'s own first call (every position kept: ``logits_to_keep=0``), not of a second
    forward pass over the prompt."""
    x = torch.tensor([ids])
    mask = torch.ones_like(x)
    first: list[torch.Tensor] = []

    def prefill_logits(_module: Any, _args: Any, out: Any) -> None:
        if not first:
            first.append(out.logits if hasattr(out, "logits") else out[0])

    keep_all = {"logits_to_keep": 0} if accepts(model, "logits_to_keep") else {}
    hook = model.register_forward_hook(prefill_logits)
    try:
        tokens, logits = greedy(model, len(ids), steps, model.generate, x, attention_mask=mask,
                                **keep_all)
    finally:
        hook.remove()
    prefill = first[0] if first and tuple(first[0].shape[:2]) == (1, len(ids)) else None
    if prefill is None:  # a model whose generate calls it otherwise: the prompt again
        with torch.no_grad():
            prefill = model(input_ids=x, attention_mask=mask, use_cache=False).logits
    logits[0] = prefill.float().numpy()
    return tokens, logits


class Logits(torch.nn.Module):
    """The model's logits over whole sequences, no cache: the float64 reference of every step.
    A decoder's (input_ids, attention_mask); an encoder-decoder's (its ``main`` input, that
    input's mask, decoder_input_ids)."""

    def __init__(self, model: torch.nn.Module, main: str | None = None) -> None:
        super().__init__()
        self.model, self.main = model, main

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                decoder_input_ids: torch.Tensor | None = None) -> torch.Tensor:
        kw: dict[str, Any] = {self.main or "input_ids": input_ids, "use_cache": False}
        if self.main is not None:
            kw["decoder_input_ids"] = decoder_input_ids
        if attention_mask is not None:
            kw["attention_mask"] = attention_mask
        return self.model(**kw).logits


def references(model: Any, prompts: list[tuple[list[int], list[int], list[np.ndarray]]]
               ) -> list[list[np.ndarray | None]]:
    """The float64 reference of each step's logits, for several prompts ((ids, tokens,
    expected) each): the model in float64 over each whole sequence (prompt and generated
    tokens), sliced as the steps return them, in one float64 pass: the sequences
    right-padded into one batch (a causal decoder's logits at a sequence's own positions do
    not see the padding after it), so the weights are upcast and read once for all of them -
    per prompt where the batch gets no reference."""
    seqs = [ids + tokens[:-1] for ids, tokens, _ in prompts]
    vocab = prompts[0][2][0].shape[-1] if prompts else 0
    wrapped = Logits(model).eval()
    whole: list[np.ndarray | None] = [None] * len(prompts)
    if len(prompts) > 1:
        n = max(len(q) for q in seqs)
        ids = torch.tensor([q + [q[-1]] * (n - len(q)) for q in seqs])
        mask = torch.tensor([[1] * len(q) + [0] * (n - len(q)) for q in seqs])
        batch = float64_logits(wrapped, (ids, mask), (len(seqs), n, vocab))
        if batch is not None:
            whole = [batch[i:i + 1, :len(q)] for i, q in enumerate(seqs)]
    out = []
    for (ids, _tokens, expected), q, w in zip(prompts, seqs, whole):
        if w is None:
            w = float64_logits(wrapped, (torch.tensor([q]),), (1, len(q), vocab))
        out.append(step_slices(w, len(ids), len(expected)))
    return out


def float64_logits(wrapped: Logits, args: tuple[Any, ...], shape: tuple[int, ...]
                   ) -> np.ndarray | None:
    """The float64 reference of ``wrapped``'s logits on ``args`` (verify/reference.py), None
    where there is none. ``shape``: the float32 logits' shape, which reference_outputs matches
    the reference against (no float32 run: the steps' own logits are the expected ones)."""
    full = np.broadcast_to(np.float32(0), shape)
    ref = reference_outputs(wrapped, [Inputs(args=args)], [[full]]).outputs
    return ref[0][0] if ref and ref[0] else None


def step_slices(whole: np.ndarray | None, n: int, count: int) -> list[np.ndarray | None]:
    """The logits of a whole sequence ([1, length, vocab]) sliced as ``count`` steps return
    them: its first ``n`` positions (a prompt's, an encoder-decoder's start token) at the
    prefill, one position a step after; None each where there is no ``whole``."""
    if whole is None:
        return [None] * count
    return [whole[:, :n]] + [whole[:, n + k - 1:n + k] for k in range(1, count)]


def torch_side(model: Any, prompts: list[list[int]], steps: int
               ) -> dict[tuple[Any, ...], TorchRun]:
    """PyTorch's side of every prompt before any ONNX run (a verification's ``torch_runs``):
    its greedy tokens and logits, and their float64 references in one pass
    (:func:`references`; a prompt given twice is run once). It needs nothing of the package,
    so it can run while the package is built (hf/backends.py)."""
    check = GenerationCheck()
    made = {tuple(ids): _torch_run(check, model, ids, steps) for ids in prompts}
    refs = references(model, [(list(ids), run.tokens, run.logits) for ids, run in made.items()])
    for run, ref in zip(made.values(), refs):
        run.refs = ref
    return check.torch_runs


# ops whose weights are quantized: their kernels compute otherwise once the weights are packed
QUANTIZED_OPS = frozenset({
    "MatMulNBits", "MatMulInteger", "MatMulIntegerToFloat", "QLinearMatMul", "QGemm",
    "DynamicQuantizeMatMul", "QuantizeLinear", "DequantizeLinear", "GatherBlockQuantized",
    "QMoE"})


def quantized_weights(proto: onnx.ModelProto) -> bool:
    """Whether an op of the graph has quantized weights (QUANTIZED_OPS). Only then do the
    verification's sessions (the own loop's and onnxruntime-genai's) pack the weights at
    load, as where the package is served: packed, those kernels compute otherwise (int8
    activations). Float weights are not packed: packing copies every one into the MatMul
    kernels' layout (2 GiB and 2 s for a 0.5 B decoder, more than its generation takes) and
    changes only the order the kernels sum in (6e-6 on that decoder's logits: float32
    rounding, what the float64 budget judges)."""
    graphs = [proto.graph.node] + [f.node for f in proto.functions]
    return any(n.op_type in QUANTIZED_OPS for nodes in graphs for n in nodes)


def quantized_file(path: Path) -> bool:
    """Whether the graph at ``path`` has quantized weights (:func:`quantized_weights`)."""
    return quantized_weights(onnx.load(str(path), load_external_data=False))


def run_step(path: Path, feed: dict[str, np.ndarray], what: str, timeout: float,
             check: GenerationCheck, **run_kw: Any) -> dict[str, np.ndarray] | None:
    """One sandbox run of the graph at ``path`` on ``feed``: its outputs by name, or None
    after failing ``check`` with the run's finding (its message led by ``what``)."""
    sbx = sandbox.run_model(path, [feed], timeout=timeout, **run_kw)
    if not sbx.ok:
        f = sbx.finding(STAGE, timeout)
        if f is not None:
            f.message = f"{what}: {f.message}"
            check.fail(f)
        return None
    return dict(zip(sbx.output_names, sbx.outputs[0]))


def greedy_steps(path: Path, layout: StepLayout, first: list[int], steps: int, timeout: float,
                 check: GenerationCheck, cross: dict[str, np.ndarray] | None = None,
                 encoder_mask: np.ndarray | None = None, **run_kw: Any
                 ) -> tuple[list[int], list[np.ndarray], list[dict[str, np.ndarray]]]:
    """Greedy generation with the step graph at ``path`` (a sandbox run per step, its own
    cache fed back; inside :func:`sandbox.reuse` a kept child serves every step), from the
    tokens ``first`` (a decoder's prompt, an encoder-decoder's start token; ``cross`` and
    ``encoder_mask``: the encoder's cross-attention cache and mask): the tokens, each step's
    logits and feeds. Stops at a failed run (a finding in ``check``). ``run_kw``: the
    sandbox run's options."""
    tokens: list[int] = []
    logits: list[np.ndarray] = []
    feeds: list[dict[str, np.ndarray]] = []
    past, new, fed = None, list(first), 0
    for step in range(steps):
        # a graph of one token per step (a cache with states) takes the prompt token by
        # token: the step's logits are theirs concatenated
        parts = []
        for chunk in layout.chunks(new):
            feed = layout.feed(chunk, past, past_length=fed, cross=cross,
                               encoder_mask=encoder_mask)
            out = run_step(path, feed, f"generation step {step}", timeout, check, **run_kw)
            if out is None:
                return tokens, logits, feeds
            parts.append(layout.logits(out))
            past, fed = layout.presents(out), fed + chunk.shape[1]
        feeds.append(feed)
        logits.append(parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1))
        new = [int(np.argmax(logits[-1][0, -1]))]
        tokens.append(new[0])
    return tokens, logits, feeds


def onnx_generation(path: Path, layout: StepLayout, ids: list[int], steps: int,
                    timeout: float, check: GenerationCheck, threads: int | None = None
                    ) -> tuple[list[int], list[np.ndarray], list[dict[str, np.ndarray]]]:
    """A decoder's greedy generation from the prompt ``ids`` (:func:`greedy_steps`), its
    session kept for every step. Float weights are not packed: the loop's few runs do not
    repay packing every weight at load (a 0.5 B decoder loads in 0.9 s instead of 2.4;
    :func:`quantized_weights` says why)."""
    return greedy_steps(path, layout, ids, steps, timeout, check, keep_session=True,
                        prepack=quantized_file(path), threads=threads)


def top2_gap(logits: np.ndarray) -> float:
    """The gap between the two largest logits of the last position."""
    last = np.sort(np.asarray(logits, dtype=np.float64)[0, -1])
    return float(last[-1] - last[-2]) if last.size > 1 else float("inf")


def judge_prompt(check: GenerationCheck, p: int, n_prompt: int, torch_tokens: list[int],
                 onnx_tokens: list[int], expected: list[np.ndarray], actual: list[np.ndarray],
                 refs: list[np.ndarray | None]) -> int | None:
    """Judge one prompt's steps in order; returns the first step that fails (OM811, OM812),
    or None. Tokens that differ where the logits are within the budget are a greedy tie
    (OM813, a warning): float32 rounding alone may flip such an argmax."""
    for k, (exp, act, ref) in enumerate(zip(expected, actual, refs)):
        c = judge_output("logits", exp, act, ref, input_set=f"prompt {p} step {k}")
        check.comparisons.append(c)
        position = n_prompt + k - 1  # the prefill's last position, then each new token's
        same = k >= len(torch_tokens) or torch_tokens[k] == onnx_tokens[k]
        where = f"prompt {p}, step {k} (position {position})"
        if not same:
            check.divergence = {"prompt": p, "step": k, "position": position,
                                "torch": torch_tokens[k], "onnx": onnx_tokens[k]}
            if c.ok:
                check.findings.append(warning(
                    "OM813", STAGE, f"greedy generation picks another token at {where}: "
                    f"PyTorch {torch_tokens[k]}, ONNX Runtime {onnx_tokens[k]}, but the logits "
                    f"there are within the float64 budget ({c.rule}; PyTorch's top-2 gap "
                    f"{top2_gap(exp):.3g}, max abs error {c.max_abs:.3g}): a tie that float32 "
                    "rounding decides. The steps after it are not compared.",
                    details={"divergence": check.divergence}))
                return None
            check.fail(error(
                "OM811", STAGE, f"greedy generation diverges at {where}: PyTorch's generate "
                f"chose token {torch_tokens[k]}, ONNX Runtime {onnx_tokens[k]}; the logits "
                f"there are outside the budget ({c.rule}: max abs error {c.max_abs:.3g}, "
                f"{c.mismatched} of {c.total} outside; {c.reason}). Tokens before it match: "
                f"{onnx_tokens[:k]}.", details={"divergence": check.divergence,
                                                 "comparison": c.to_dict()},
                suggestion="The localisation below names the first ONNX node outside its "
                "budget at that step; a wrong cache output shows from the first decode step."))
            return k
        if not c.ok:
            check.divergence = {"prompt": p, "step": k, "position": position}
            check.fail(error(
                "OM812", STAGE, f"the logits of {where} are outside the float64 budget "
                f"({c.rule}: max abs error {c.max_abs:.3g}, {c.mismatched} of {c.total} "
                f"outside; {c.reason}), although the greedy tokens so far match.",
                details={"comparison": c.to_dict()}))
            return k
    return None


def localize_step(check: GenerationCheck, path: Path, program: Any,
                  feed: dict[str, np.ndarray], label: str, timeout: float,
                  args: tuple[Any, ...] | None = None) -> None:
    """Localise the failing step like any other mismatch (OM610: the first ONNX node outside
    its budget, with the user's line), with the step's own feeds (``args``: the program's
    arguments for them; the decoder graph's when None)."""
    from onnxmedic.verify.localize import localize

    if args is None:
        args = (torch.from_numpy(feed["input_ids"]), torch.from_numpy(feed["attention_mask"]),
                torch.from_numpy(feed["position_ids"]) if "position_ids" in feed else None,
                [torch.from_numpy(feed[n]) for n in feed if is_past(n)])
    try:
        loc = localize(onnx.load(str(path), load_external_data=False), program, args,
                       feeds=feed, timeout=timeout, input_set=label, full=False,
                       model_dir=path.parent)
    except Exception:  # localisation is a help, never the verdict
        logger.info("generation: localisation failed", exc_info=True)
        return
    for f in loc.findings:
        f.stage = STAGE
        if f.severity.value == "error":
            check.fail(f)
        else:
            check.findings.append(f)


def genai_spec(folder: Path, prompts: list[list[int]], steps: int,
               threads: int | None = None) -> str:
    """The genai child's JSON spec for ``folder``: its session packs the weights only where
    the graph has quantized ones (:func:`quantized_weights`), like the own loop's;
    ``threads``: its session's intra-op threads (None: the package's genai_config says)."""
    try:
        prepack = quantized_file(decoder_graph(folder))
    except Exception:  # noqa: BLE001 - unreadable here: the child says why, packed as served
        prepack = True
    spec: dict[str, Any] = {"prompts": prompts, "steps": steps, "prepack": prepack}
    if threads is not None:
        spec["threads"] = threads
    return json.dumps(spec)


def genai_available() -> bool:
    return importlib.util.find_spec("onnxruntime_genai") is not None


@dataclass
class ChildRun:
    """An onnxruntime-genai child started (:func:`start_genai_child`), its result not read
    yet (:func:`finish_genai_child`)."""

    proc: subprocess.Popen[str] | None
    folder: Path
    started: float
    why: str = ""

    def stop(self) -> None:
        """Kill the child (its result no longer wanted)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def start_genai_child(folder: Path, spec: str) -> ChildRun:
    """Start the onnxruntime-genai child script (CHILD) on ``folder`` with the JSON ``spec``;
    :func:`finish_genai_child` reads its result."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen([sys.executable, str(CHILD), str(folder), spec],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        return ChildRun(None, folder, t0, f"cannot start it ({e})")
    return ChildRun(proc, folder, t0)


def finish_genai_child(run: ChildRun, timeout: float, check: GenerationCheck
                       ) -> dict[str, Any] | None:
    """The result of the child ``run`` (the last line of its stdout), or None after failing
    ``check`` with OM816 (the child's error, a timeout - ``timeout`` seconds from its start -
    or an unreadable result). Its seconds go in check.seconds."""
    out, why = None, run.why
    if run.proc is not None:
        left = max(1.0, timeout - (time.perf_counter() - run.started))
        try:
            stdout, stderr = run.proc.communicate(timeout=left)
            out = (json.loads(stdout.strip().splitlines()[-1])
                   if run.proc.returncode == 0 else None)
            why = "" if out else " ".join(
                (stderr.strip().splitlines() or [f"exit {run.proc.returncode}"])[-3:])
        except subprocess.TimeoutExpired:
            run.stop()
            out, why = None, f"no result within {timeout:g} s"
        except (ValueError, IndexError) as e:
            out, why = None, f"unreadable result ({e})"
    check.seconds["genai"] = time.perf_counter() - run.started
    if out is None:
        check.fail(error("OM816", STAGE, f"onnxruntime-genai could not generate from the "
                         f"folder {run.folder.name}: {why[:400]}", details={"error": why}))
    return out


def not_installed() -> Finding:
    return info("OM815", STAGE, "onnxruntime-genai is not installed: the package was not "
                "generated from with it.", suggestion="pip install onnxruntime-genai")


def genai_generation(folder: Path, check: GenerationCheck, steps: int, timeout: float,
                     eos: set[int] | None, spec: str | None = None, what: str = "prompt",
                     run: ChildRun | None = None) -> None:
    """onnxruntime-genai generating from ``folder`` (the genai child, a child process) must
    give PyTorch's tokens (up to an EOS of ``eos`` it stops at; :func:`genai_compare`).
    ``spec``: the child's JSON spec (None: check.prompts, :func:`genai_spec`); ``run``: that
    child started already (:func:`genai_beside`), None to start it now."""
    if run is None and not genai_available():
        check.findings.append(not_installed())
        return
    run = run or start_genai_child(folder, spec or genai_spec(folder, check.prompts, steps))
    out = finish_genai_child(run, timeout, check)
    if out is not None:
        genai_compare(check, out, eos, what)


def genai_compare(check: GenerationCheck, out: dict[str, Any], eos: set[int] | None,
                  what: str = "prompt") -> None:
    """The genai child's result ``out`` (:func:`finish_genai_child`'s) against
    check.tokens_torch (OM814 where they differ): fewer tokens are a stop at one of ``eos``
    (None: at any token), ``what`` names the generation's items (prompts, an
    encoder-decoder's inputs)."""
    check.tokens_genai = out["tokens"]
    check.seconds["genai_generate"] = out["seconds"]
    for p, (got, want) in enumerate(zip(out["tokens"], check.tokens_torch)):
        stopped = len(got) < len(want) and got and (eos is None or got[-1] in eos)
        if got != want[:len(got)] or (len(got) < len(want) and not stopped):
            k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(got))
            check.fail(error(
                "OM814", STAGE, f"onnxruntime-genai's greedy tokens differ from PyTorch's "
                f"for {what} {p} at step {k}: {got} vs {want}.",
                details={"prompt": p, "step": k, "genai": got, "torch": want}))
            return


def eos_ids(model: Any) -> set[int]:
    """The model's EOS token ids (its generation config's, else its config's)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    return set(eos) if isinstance(eos, (list, tuple)) else {eos} if eos is not None else set()


def _torch_run(check: GenerationCheck, model: Any, ids: list[int], steps: int) -> TorchRun:
    """PyTorch's side of a prompt, from ``check.torch_runs`` or run now (and kept there)."""
    key = (tuple(ids), steps)
    run = check.torch_runs.get(key)
    if run is None:
        tt = time.perf_counter()
        run = check.torch_runs[key] = TorchRun(*torch_generation(model, ids, steps))
        check.seconds["torch"] = check.seconds.get("torch", 0.0) + time.perf_counter() - tt
    return run


# onnxruntime-genai runs beside onnxmedic's own loop when the memory holds both sessions
# (with the model already loaded): this many times the package's weights
CONCURRENT_MEMORY = 4
OWN_LOOP_THREADS = 1  # the own loop's session threads then


def genai_beside(folder: Path, prompts: list[list[int]], steps: int) -> ChildRun | None:
    """onnxruntime-genai's child generating from ``folder``, started now to run beside the
    own loop (verify_generation's ``genai_run``), or None where it is not installed or the
    memory would not hold both sessions (CONCURRENT_MEMORY)."""
    avail = sandbox.available_memory()
    if not genai_available() or avail is None or \
            avail <= CONCURRENT_MEMORY * sandbox.model_file_bytes(folder / "model.onnx"):
        return None
    return start_genai_child(folder, genai_spec(folder, prompts, steps))


def verify_generation(folder: str | Path, model: Any, tokenizer: Any = None, *, steps: int = 8,
                      prompts: Any = None, program: Any = None,
                      timeout: float = sandbox.DEFAULT_TIMEOUT, genai: bool = True,
                      torch_runs: dict[tuple[Any, ...], TorchRun] | None = None,
                      genai_run: ChildRun | None = None,
                      onnx_ahead: OnnxSide | None = None) -> GenerationCheck:
    """Verify the generation package in ``folder`` against ``model`` (see the module
    docstring). ``program``: the graph's ExportedProgram, for localising a divergence.
    ``torch_runs``: an earlier check's ``torch_runs`` for the same model (PyTorch's tokens,
    logits and references reused, not computed again; :func:`torch_side` makes them ahead),
    filled in place. onnxruntime-genai's child generates while the own loop runs where the
    memory holds both (:func:`genai_beside`); its verdict counts only when the own loop's is
    good. ``genai_run``: that child started already (:func:`genai_beside`), on the same
    prompts and steps; ``onnx_ahead``: the own loop's ONNX Runtime side run already
    (:func:`onnx_side`), used when it ran the same prompts and steps, else run now. Each
    prompt is judged by :func:`judge_items`; onnxruntime-genai's verdict is asked only where
    every run and judgement passed (a failure's finding is in the check)."""
    folder = Path(folder)
    path = folder / "model.onnx"
    check = GenerationCheck(torch_runs={} if torch_runs is None else torch_runs)
    check.prompts = prompt_ids(tokenizer, default_prompts(model) if prompts is None else prompts,
                               int(model.config.vocab_size))
    if genai and not genai_available():
        check.findings.append(not_installed())
        genai = False
    if genai_run is not None and not genai:
        genai_run.stop()
    early = (genai_run or genai_beside(folder, check.prompts, steps)) if genai else None
    # the own loop on one thread beside onnxruntime-genai's session (ONNX Runtime's threads
    # spin while they wait: more threads than cores take turns)
    threads = OWN_LOOP_THREADS if early is not None else None

    def items(ahead: OnnxSide) -> Iterator[Judged]:
        for ids, (tokens, actual, feeds) in zip(check.prompts, ahead.runs):
            run = _torch_run(check, model, ids, steps)
            failed = len(tokens) < steps
            if failed:  # a failed run: its finding
                for f in ahead.findings:
                    check.fail(f)
            yield Judged(run, tokens, actual, feeds, len(ids), failed,
                         functools.partial(_decoder_refs, check, model, ids, run), path, program)

    try:
        t0 = time.perf_counter()
        with sandbox.reuse():
            ahead = onnx_ahead
            if ahead is None or (ahead.prompts, ahead.steps) != (check.prompts, steps):
                ahead = onnx_side(folder, check.prompts, steps, timeout, threads)
            check.seconds["onnx"] = ahead.seconds
            ran = judge_items(check, items(ahead), timeout)
        check.seconds["verify"] = time.perf_counter() - t0
        if genai and ran and check.ok:  # the child beside it, or one started now
            run, early = early, None
            genai_generation(folder, check, steps, timeout, eos_ids(model), run=run)
    finally:
        if early is not None:
            early.stop()
    return check


@dataclass
class OnnxSide:
    """onnxmedic's own loop in ONNX Runtime for every prompt, run ahead of the judging
    (:func:`onnx_side`): per prompt its (tokens, logits, feeds), up to a failed run (whose
    findings are in ``findings``)."""

    prompts: list[list[int]]
    steps: int
    runs: list[tuple[list[int], list[np.ndarray], list[dict[str, np.ndarray]]]] = field(
        default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0


def onnx_side(folder: Path, prompts: list[list[int]], steps: int, timeout: float,
              threads: int | None = None) -> OnnxSide:
    """The own loop's ONNX Runtime generation of ``prompts`` from the package in ``folder``,
    with nothing of PyTorch's: it can run while PyTorch's side still does
    (verify_generation's ``onnx_ahead``)."""
    path = decoder_graph(folder)
    layout = read_step(path, folder)
    scratch, out = GenerationCheck(), OnnxSide([list(p) for p in prompts], steps)
    t0 = time.perf_counter()
    with sandbox.reuse():
        for ids in out.prompts:
            out.runs.append(onnx_generation(path, layout, ids, steps, timeout, scratch,
                                            threads))
            if len(out.runs[-1][0]) < steps:
                break
    out.findings, out.seconds = scratch.findings, time.perf_counter() - t0
    return out


def _decoder_refs(check: GenerationCheck, model: Any, ids: list[int], run: TorchRun
                  ) -> list[np.ndarray | None]:
    """The float64 references of a decoder prompt's ``run`` (computed once, kept in it)."""
    if run.refs is None:
        tt = time.perf_counter()
        run.refs = references(model, [(ids, run.tokens, run.logits)])[0]
        check.seconds["reference"] = (check.seconds.get("reference", 0.0)
                                      + time.perf_counter() - tt)
    return run.refs


@dataclass
class Judged:
    """One generation :func:`judge_items` judges, of either domain: PyTorch's ``run``, ONNX
    Runtime's ``tokens``, step ``logits`` and ``feeds`` (``failed``: its run stopped); the
    positions before the first new token; the float64 ``refs`` (computed when judged); the
    step graph at ``path``, its ``program`` and the program's ``args`` of a feed, to localise a
    failing step; ``before``: a judgement first (an encoder's outputs), False when it fails."""

    run: TorchRun
    tokens: list[int]
    logits: list[np.ndarray]
    feeds: list[dict[str, np.ndarray]]
    n_prompt: int
    failed: bool
    refs: Callable[[], list[np.ndarray | None]]
    path: Path
    program: Any = None
    args: Callable[[dict[str, np.ndarray]], tuple[Any, ...]] | None = None
    before: Callable[[], bool] | None = None


def judge_items(check: GenerationCheck, items: Iterable[Judged], timeout: float) -> bool:
    """The one verification loop of every package, decoder and encoder-decoder: each item's
    tokens recorded in ``check``, its steps judged in order (:func:`judge_prompt`), the first
    failing step localised (:func:`localize_step`); stops at the first item whose run or
    judgement failed, and then returns False."""
    for p, item in enumerate(items):
        check.tokens_torch.append(item.run.tokens)
        check.tokens_onnx.append(item.tokens)
        if item.failed or (item.before is not None and not item.before()):
            return False
        bad = judge_prompt(check, p, item.n_prompt, item.run.tokens, item.tokens,
                           item.run.logits, item.logits, item.refs())
        if bad is not None:
            if item.program is not None:
                feed = item.feeds[bad]
                localize_step(check, item.path, item.program, feed, f"prompt {p} step {bad}",
                              timeout, args=item.args(feed) if item.args else None)
            return False
    return True
