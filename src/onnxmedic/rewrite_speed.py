"""onnxscript's optimizer (what torch.onnx runs after its translation) without its quadratic
matching of ``Slice, Slice -> Split``, and without trying a rule on nodes its pattern cannot
match.

onnxscript's default rewrite rules include ``SlicesSplit``: two ``Slice`` nodes reading the
same tensor that take its last dim's first and second halves become one ``Split``. Its pattern
has two output nodes, and onnxscript's matcher finds the second one by listing the whole graph
by op type and trying every ``Slice`` of it, for every ``Slice`` of the graph: O(nodes x slices)
per pass. On a 24-layer decoder (the rotary embedding's halves, the cache's slices) that was
about 20 s of the 0.5 B decoder's 45 s translation, on 2 cores.

:func:`sibling_slices` swaps in the same rule (same pattern, check and replacement) whose
matcher tries, as the second ``Slice``, only those reading the first one's input - the only
ones the pattern can match (it binds both to one ``x``), in the graph's order, returning the
first pattern match as onnxscript's matcher does (tests/test_rewrite_speed.py: the optimized
graphs are the same).

It also puts each rule behind a test of the node's op: onnxscript's rule set tries each of its
46 rules on every node of the graph in turn, and each try builds a match record, a failure
reason and a pattern walk before the pattern's first check - the op type and domain of the
node the pattern's (first) output node is matched against - turns it down: for a graph of a few
thousand nodes (a linear-algebra op's unrolled sweeps) that was about half of the optimizer's
time. :class:`RootFiltered` answers "no match" at once where that first check would: the
same op type and domain comparison (a rule whose pattern names its op by a constant string,
with onnxscript's simple matcher), so every rule that can match is tried as before, in the
same order. Only when onnxscript is asked to trace or print its matching is every rule tried
in full (its trace lists the failures too). Anything unexpected in onnxscript's module (a
release without the rule, another matcher API) leaves its rules as they are.

Within the same block the no-op rules (``x * 1``, ``1 * x``, ``x + 0``, ``0 + x``, ``x - 0``,
``x / 1`` -> ``x``) match only an exact 0 or 1: onnxscript's constant patterns take a value
within ``math.isclose(rel_tol=1e-5, abs_tol=1e-8)`` of 0 or 1 as that value, so its optimizer
dropped an RMSNorm's ``variance + 1e-08`` (Helium's ``rms_norm_eps``: ONNX Runtime's logits
35x PyTorch's float32 error, refused OM402) and would drop a scale of 1.000005.
:func:`exact_no_ops` swaps them for the same rules on exact constants.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

RULE = "SlicesSplit"


def _matcher_class() -> Any:
    import onnx_ir as ir
    from onnxscript.rewriter import _basics, _matcher

    class SiblingMatcher(_matcher.SimplePatternMatcher):
        """A two-output pattern whose output nodes read one value through their first input:
        the second node is looked for among that value's readers only, in the graph's order
        (positions listed once per graph, again only when a reader is not in the list:
        removing or inserting other nodes keeps the order of those listed; the list holds
        its nodes, so no id is reused)."""

        # the node a match starts from is the pattern's first output node (root_filtered)
        ROOT_IS_FIRST_OUTPUT = True

        def __init__(self, pattern: Any) -> None:
            super().__init__(pattern)
            self._order: tuple[Any, dict[int, tuple[Any, int]]] = (None, {})

        def _positions(self, graph: Any, nodes: list[Any]) -> dict[int, tuple[Any, int]]:
            seen, pos = self._order
            if seen is not graph or any(pos.get(id(n), (None,))[0] is not n for n in nodes):
                pos = {id(n): (n, i) for i, n in enumerate(graph)}
                self._order = (graph, pos)
            return pos

        def match(self, model: Any, graph_or_function: Any, node: Any, *, verbose: int = 0,
                  remove_nodes: bool = True, tracer: Any = None) -> Any:
            self._tracer = tracer
            graph = (graph_or_function if isinstance(graph_or_function, ir.Graph)
                     else graph_or_function.graph)
            self._graph = graph
            want = self.pattern.output_nodes[1].op_identifier()
            x = node.inputs[0] if node.inputs else None
            readers = list({id(u.node): u.node for u in (x.uses() if x is not None else ())
                            if u.node.graph is graph and u.node.op_identifier() == want
                            }.values())
            pos = self._positions(graph, readers)
            match = None
            # onnxscript's matcher tries every node of the op in the graph's order and
            # returns the first pattern match (the rule's check comes after): a node not
            # reading x cannot bind the pattern's x, so these are the ones it could return
            for other in sorted(readers, key=lambda n: pos[id(n)][1]):
                self._init_match(verbose)
                match = self._multi_match((node, other), check_removable=remove_nodes)
                if match:
                    return match
            return match if match is not None else _basics.MatchResult().fail(
                "No match found.")

    return SiblingMatcher


class RootFiltered:
    """A rewrite rule tried only on nodes of its pattern's root op: ``try_rewrite`` answers
    None (no match) at once for a node of another op type or domain - what the rule's own
    matcher answers there after building its match record - and hands every other node, and
    every call that traces or prints the matching, to the rule. Everything else (name,
    remove_nodes, the graph visitors...) is the rule's."""

    __slots__ = ("rule", "op_type", "domain")

    def __init__(self, rule: Any, op_type: str, domain: str) -> None:
        self.rule = rule
        self.op_type = op_type
        self.domain = domain

    def try_rewrite(self, model: Any, graph_or_function: Any, node: Any, *,
                    verbose: int | None = None, tracer: Any = None) -> Any:
        if (tracer is None and not verbose
                and (node.op_type != self.op_type or node.domain != self.domain)):
            return None
        return self.rule.try_rewrite(model, graph_or_function, node, verbose=verbose,
                                     tracer=tracer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.rule, name)

    def __repr__(self) -> str:
        return f"RootFiltered({self.rule!r})"


def root_filtered(rule: Any) -> Any:
    """``rule`` behind :class:`RootFiltered` where its matcher matches the node it is tried on
    against the pattern's first output node with the pattern's own op test (onnxscript's
    simple matcher, or the sibling matcher of this module) and that node's op type and domain
    are constant strings; else ``rule`` itself."""
    from onnxscript.rewriter import _matcher, _pattern_ir

    matcher = getattr(rule, "_matcher", None)
    if type(matcher) is not _matcher.SimplePatternMatcher and not getattr(
            matcher, "ROOT_IS_FIRST_OUTPUT", False):
        return rule
    if getattr(rule, "_verbose", 0):  # it prints each try: tried in full
        return rule
    root = rule._target_pattern.output_nodes[0]
    const = _pattern_ir.StringConstantPattern
    if type(root.op) is not const or type(root.domain) is not const:
        return rule
    return RootFiltered(rule, root.op.value(), root.domain.value())


def _sibling_rule(rules: tuple[Any, ...]) -> tuple[Any, ...]:
    """``rules`` with SlicesSplit's rule rebuilt on the sibling matcher (as they are where
    there is not exactly one)."""
    from onnxscript.rewriter import _rewrite_rule
    from onnxscript.rewriter.rules.common import _basic_rules

    found = [i for i, r in enumerate(rules) if getattr(r, "name", None) == RULE]
    if len(found) != 1:
        return rules
    inst = _basic_rules.SlicesSplit()
    fast = _rewrite_rule.RewriteRule(
        inst.pattern, inst.rewrite, inst.check, name=inst.name, remove_nodes=inst.remove_nodes,
        graph_pre_visitor=inst.setup, graph_post_visitor=inst.cleanup,
        as_function=inst.as_function, matcher=_matcher_class())
    out = list(rules)
    out[found[0]] = fast
    return tuple(out)


NO_OPS = ("Mul", "Add", "Sub", "Div")  # the arithmetic no-op rules' root ops


def exact_no_ops(rules: tuple[Any, ...]) -> tuple[Any, ...]:
    """``rules`` with onnxscript's arithmetic no-op rules (its ``_no_op`` module's on Mul,
    Add, Sub, Div) replaced, in place of the first, by the same rules whose constant matches
    only exactly 0 or 1 (as they are where ``rules`` has not the six)."""
    from onnxscript.rewriter import _pattern_ir, _rewrite_rule
    from onnxscript.rewriter.rules.common import _no_op

    def exact(value: int) -> Any:
        return _pattern_ir.Constant(value, rel_tol=0.0, abs_tol=0.0)

    def mul_by_1(op: Any, x: Any) -> Any:
        return op.Mul(x, exact(1))

    def add_0(op: Any, x: Any) -> Any:
        return op.Add(x, exact(0))

    def sub_0(op: Any, x: Any) -> Any:
        return op.Sub(x, exact(0))

    def div_by_1(op: Any, x: Any) -> Any:
        return op.Div(x, exact(1))

    loose = [r for r in _no_op.rules.rules
             if r._target_pattern.output_nodes[0].op.value() in NO_OPS]
    at = [i for i, r in enumerate(rules) if any(r is lo for lo in loose)]
    if len(loose) != 6 or len(at) != 6:
        return rules
    rule = _rewrite_rule.RewriteRule
    strict = [*rule(mul_by_1, _no_op.identity).commute(),
              *rule(add_0, _no_op.identity).commute(),
              rule(sub_0, _no_op.identity), rule(div_by_1, _no_op.identity)]
    out = [r for i, r in enumerate(rules) if i not in at]
    out[at[0]:at[0]] = strict
    return tuple(out)


def _fast_rules(rules: tuple[Any, ...]) -> tuple[Any, ...]:
    """``rules`` with SlicesSplit's rule on the sibling matcher, the no-op rules on exact
    constants (:func:`exact_no_ops`) and each rule that can be behind :class:`RootFiltered`."""
    return tuple(root_filtered(r) for r in _sibling_rule(exact_no_ops(rules)))


@contextlib.contextmanager
def sibling_slices() -> Iterator[None]:
    """Within the block, onnxscript's optimizer (``optimize_ir``, which reads its default
    rules when called) matches SlicesSplit among the readers of one value, removes ``x + 0``
    and its kin only for an exact 0 or 1, and tries each rule only on nodes of its pattern's
    root op (see the module docstring)."""
    try:
        from onnxscript import rewriter

        rules = rewriter._DEFAULT_REWRITE_RULES
        fast = _fast_rules(rules)
    except Exception as e:  # noqa: BLE001 - another onnxscript: its own rules, slower
        logger.debug("onnxscript's rewrite rules not swapped: %s", e)
        yield
        return
    rewriter._DEFAULT_REWRITE_RULES = fast
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = rules
