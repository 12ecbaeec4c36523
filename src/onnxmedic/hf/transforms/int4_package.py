"""``--precision int4`` on a generation package: an int4 package folder onnxruntime-genai serves.

:class:`Int4Pass` (a package pass, passes.py: any backend's package, read through the
contract) takes the package's decoder through optimize/int4_search.py's candidates and task
budget unchanged: each candidate (MatMulNBits through ONNX Runtime's quantizer) is judged
against the PyTorch model the package was exported from (greedy agreement over N steps from
several prompts, perplexity on the built-in text) and timed; the fastest within the budget
becomes the new folder's ``model.onnx``, the other files copied (``genai_config.json`` as it
is: MatMulNBits keeps the graph's inputs, outputs and cache, which the pass ensures).
onnxruntime-genai then generates from the new folder, and its greedy tokens must be ONNX
Runtime's own for the chosen file (OM736 when they are not). The folder is built beside
``out`` and renamed into place only when all of this passed: nothing half-written on failure
(OM731 when no candidate is within the budget).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onnxmedic.findings import error
from onnxmedic.genpackage import NotAStep, StepLayout, decoder_graph, read_step
from onnxmedic.hf.transforms.passes import PackageOutcome, PackagePass, copy_side_files, staged
from onnxmedic.onnxfile import replace_folder
from onnxmedic.optimize.pass_infra import PassResult, PreconditionError

logger = logging.getLogger(__name__)


class PackageReference:
    """The PyTorch side of int4's step contract for a generation package's model:
    ``(input_ids, past) -> (logits, present)``, ``past`` the package's self cache as its
    contract (genpackage.py's :class:`StepLayout`) feeds it: its entries in the graph's order,
    keys and values ``(batch, heads, past, head_size)`` and convolution and state-space
    states in the package's fixed shapes, held by the model's own cache class as the export's
    step holds them (hf/generation.py's ``GenerationDecoder`` over the layout's entries); the
    attention mask and the positions the package's loop feeds (all ones; past .. total - 1).
    A convolution state narrower than the model's kernel (the builder's: the kernel - 1
    inputs the next step needs) is what the model's own update keeps of it: transformers'
    ``causal_conv1d_update`` and its prefill take a previous window of any width."""

    def __init__(self, model: Any, layout: StepLayout) -> None:
        from onnxmedic.hf.generation import GenerationDecoder
        from onnxmedic.hf.tasks import accepts

        self.layout = layout
        spec = [(c.layer, c.kind) for c in layout.self_cache]
        self.decoder = GenerationDecoder(model, accepts(model, "position_ids"), spec).eval()

    def __call__(self, input_ids: Any, past: list[Any]) -> tuple[Any, list[Any]]:
        import torch

        logits = []
        for chunk in self.layout.chunks(input_ids.numpy()):  # a step per token where the
            # package takes one
            n = chunk.shape[1]
            behind = self.layout.past_length(past)
            if behind is None:  # states only: no length in them (GenerationDecoder masks the
                if self.decoder.takes_positions:  # new tokens alone), but positions need it
                    raise NotAStep("the cache is states only and the model takes positions: "
                                   "the tokens behind it are not in the cache")
                behind = 0
            mask = torch.ones(chunk.shape[0], behind + n, dtype=torch.int64)
            pos = torch.arange(behind, behind + n).expand(chunk.shape[0], n)
            out, past = self.decoder(torch.from_numpy(chunk), mask, pos, list(past))
            logits.append(out)
        return (torch.cat(logits, dim=1) if len(logits) > 1 else logits[0]), past


@dataclass
class Int4PackageResult(PackageOutcome):
    """The int4 search (``search``: int4_search.Int4Result), the genai check, findings."""

    search: Any = None
    tokens_onnx: list[list[int]] = field(default_factory=list)
    tokens_genai: list[list[int]] | None = None


class Int4Pass(PackagePass):
    """optimize/int4_search.py's candidates on the package's decoder, judged against
    ``model`` by the task budget (``search``: optimize_int4's arguments, ``tokenizer``,
    ``budget``, ``grid``, ``search``, ``threads``, ``timeout``); the fastest within it
    becomes the new package's decoder, its weights in ``<graph>.data``
    (:func:`save_external`), the other files copied.
    ``modified`` is False, and nothing is written, when no candidate is within the budget;
    ``info["search"]``: int4_search.Int4Result either way."""

    def __init__(self, model: Any, **search: Any) -> None:
        self.model, self.search = model, search

    def call(self, src: Path, dst: Path) -> PassResult:
        from onnxmedic.optimize.int4_search import optimize_int4

        graph = decoder_graph(src)
        dst.mkdir(parents=True, exist_ok=True)
        reference = PackageReference(self.model, read_step(graph, src))
        search = optimize_int4(graph, reference, out=dst / graph.name, **self.search)
        if search.ok:
            save_external(dst / graph.name)
            copy_side_files(src, dst, graph.name)
        return PassResult(dst, search.ok, {"search": search})


def int4_package(folder: str | os.PathLike[str], out: str | os.PathLike[str], model: Any,
                 tokenizer: Any = None, *, budget: Any = None, grid: Any = None,
                 search: bool = True, threads: int = 2, timeout: float = 600.0,
                 shown: str | None = None) -> Int4PackageResult:
    """Write ``out``: the generation package ``folder`` at int4 (see the module docstring),
    judged against ``model`` (the PyTorch causal LM) with ``budget`` (int4.TaskBudget;
    default +5 % perplexity, 95 % greedy agreement) over ``grid`` (int4_search's default
    grid when None; ``search``: its per-layer search where no cell is within the budget).
    Nothing is written at ``out`` unless a candidate is within the budget and
    onnxruntime-genai generates its tokens. ``shown``: how a refusal names ``folder``
    (default: its path)."""
    folder, out = Path(folder), Path(out)
    with staged(out) as tmp:
        try:
            done = Int4Pass(model, tokenizer=tokenizer, budget=budget, grid=grid, search=search,
                            threads=threads, timeout=timeout)(folder, tmp)
        except PreconditionError as e:
            return Int4PackageResult(findings=[not_fed(folder, e.__cause__ or e, shown)])
        res = Int4PackageResult(**done.info)  # its search
        # the chosen file is in the scratch folder, gone on the way out: it is written only
        # once the package is in place, and then named where it is (OM732, --json, --report)
        chosen, res.search.written = res.search.written, None
        found: list[Any] = []
        if done.modified:
            # the chosen file's own greedy tokens in ONNX Runtime, as the search scored it
            res.tokens_onnx = next(c.tokens for c in res.search.candidates
                                   if c.name == res.search.chosen)
            ok, res.tokens_genai, found = genai_agrees(
                tmp, res.search.prompts, res.tokens_onnx, res.search.budget.steps, timeout)
            if ok:
                replace_folder(tmp, out)
                res.search.written = str(out / Path(chosen).name)
                res.ok, res.path = True, str(out)
        res.findings = [*res.search.findings(), *found]
        return res


def not_fed(folder: Path, e: Exception, shown: str | None = None) -> Any:
    """OM839: the package's decoder cannot be fed a step (the contract says why, its files
    named within the package). ``shown``: how it names the package (default: ``the package
    <folder>``)."""
    why = str(e).replace(f"{folder}{os.sep}", "").removeprefix(f"{folder}: ")
    return error("OM839", "optimize", f"cannot transform {shown or f'the package {folder}'}: "
                 f"its decoder cannot be fed a step: {why}", suggestion="Give a package folder "
                 "onnxmedic or onnxruntime-genai's builder wrote (model.onnx with "
                 "past_key_values.* inputs and genai_config.json beside it).")


def save_external(path: str | os.PathLike[str]) -> None:
    """Rewrite the ONNX file at ``path`` with its weights in ``<name>.data`` beside it, as
    the GenAI builder writes its packages: ONNX Runtime then reads the weights without holding
    the whole protobuf while it builds the session (at Qwen2.5-0.5B's shape, int4, the
    session's peak RSS is 635 MB instead of 788 MB, the builder's package 634 MB)."""
    import onnx

    from onnxmedic.hf.transforms.fuse_decoder import resave

    path = Path(path)
    proto = onnx.load(str(path))
    data = path.with_name(f"{path.name}.data")
    data.unlink(missing_ok=True)  # onnx appends to an existing data file
    resave(proto, path, big=True)
    data.chmod(path.stat().st_mode & 0o777)


def genai_agrees(folder: Path, prompts: list[list[int]], tokens: list[list[int]], steps: int,
                 timeout: float, ran: tuple[Any, dict[str, Any] | None] | None = None
                 ) -> tuple[bool, list[list[int]] | None, list[Any]]:
    """Whether onnxruntime-genai generating from the int4 package ``folder`` (``prompts``,
    ``steps``) gives ONNX Runtime's own greedy ``tokens`` for its decoder: (agrees, genai's
    tokens, findings: OM736 when not; OM815 when genai is not installed). ``ran``: a genai
    child that generated already, as (its gen_verify.GenerationCheck, gen_verify's
    finish_genai_child result: None where it failed, OM816 in the check), judged instead of
    generating now."""
    from onnxmedic.hf.gen_verify import GenerationCheck, genai_compare, genai_generation

    if ran is None:
        check = GenerationCheck(prompts=prompts, tokens_torch=tokens)
        genai_generation(folder, check, steps, timeout, eos=set())
    else:
        check, out = ran
        check.tokens_torch = tokens
        if out is not None:
            genai_compare(check, out, eos=set())
    if check.ok:
        return True, check.tokens_genai, list(check.findings)
    why = " ".join(f.message for f in check.findings)[:500]
    return False, check.tokens_genai, [error(
        "OM736", "optimize", f"the int4 package was not written: onnxruntime-genai did not "
        f"generate ONNX Runtime's tokens for the chosen int4 decoder ({why}).",
        suggestion="Keep the float32 package; run onnxruntime-genai on the folder to see "
        "why it differs.")]
