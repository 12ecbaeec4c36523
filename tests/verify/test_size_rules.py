"""Size rules read from torch.export's guards (verify/size_rules.py): which sizes they allow,
the sizes verification picks, the words, and the file's metadata."""

from __future__ import annotations

import onnx
import torch

from onnxmedic.stages.verify import size_pattern
from onnxmedic.verify.size_rules import (
    METADATA_KEY,
    SizeRule,
    append_metadata,
    rules_from_guards,
    rules_from_metadata,
)


class _Two(torch.nn.Module):
    def forward(self, x, y):
        return x


def _rules(guards: list[str], shape=(2, 16), dim=1):
    x, y = torch.randn(*shape), torch.randn(3)
    symbols = {"w": (shape[dim], [(0, dim)])}
    return rules_from_guards(guards, _Two(), (x, y), {}, symbols)


def test_multiple_and_minimum_from_guards():
    even = "L['x'].size()[1] == (2*(L['x'].size()[1] // 2))"
    four = "(L['x'].size()[1] // 2) == (2*(L['x'].size()[1] // 4))"
    assert _rules([even])["w"] == SizeRule("w", multiple=2, minimum=2)
    assert _rules([even, four])["w"] == SizeRule("w", multiple=4, minimum=4)
    assert _rules(["L['x'].size()[1] >= 8"])["w"] == SizeRule("w", minimum=8)
    bounded = _rules([even, "L['x'].size()[1] < 64"])["w"]
    assert bounded.maximum == 62 and bounded.describe() == "a multiple of 2, at most 62"


def test_no_rule_where_the_guards_allow_every_size_or_no_progression():
    assert _rules([]) == {}
    assert _rules(["L['y'].size()[0] == 3"]) == {}  # another input's guard
    assert _rules(["L['x'].size()[1] != 12"]) == {}  # a hole, not a progression
    assert _rules(["L['x'].size()[1] == 16"]) == {}  # static (draft_export): never a rule
    assert _rules(["L['x'].size()[1] >= 15", "L['x'].size()[1] <= 16"]) == {}
    assert _rules(["L['x'].stride()[0] >= 1", "not a guard ("]) == {}  # unjudged: left out


def test_allowed_check_sizes_and_words():
    r = SizeRule("h", multiple=8, minimum=16)
    assert r.describe() == "a multiple of 8, at least 16"
    assert r.check_sizes(32) == [16, 32, 40, 64]  # smallest, n, 2n, 8 * the prime above 4
    assert not r.allows(8) and not r.allows(36) and r.allows(48)
    odd = SizeRule("t", multiple=2, offset=1, minimum=1)
    assert odd.describe() == "1 more than a multiple of 2" and odd.check_sizes(5) == [1, 5, 7, 11]
    assert SizeRule("n", minimum=3).check_sizes(4) == [3, 4, 5, 8]


def test_metadata_round_trip_appends_without_rewriting(tmp_path):
    from onnx import helper

    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["h"])],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["h"])])
    model = helper.make_model(g)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    before = path.read_bytes()
    append_metadata(path, model, {"h": SizeRule("h", multiple=4, minimum=4)})
    assert path.read_bytes().startswith(before)  # appended, the model not written again
    loaded = onnx.load(path)
    onnx.checker.check_model(loaded)
    assert rules_from_metadata(loaded) == {"h": SizeRule("h", multiple=4, minimum=4)}
    assert [p.key for p in model.metadata_props] == [METADATA_KEY]


def test_failing_size_pattern_words():
    tried = [(1, True), (32, False), (37, True), (64, False)]
    assert size_pattern(16, tried, None) == (
        "passes at 16, 32, 64; fails at 1, 37: it works at multiples of 16 only, as far as "
        "checked")
    assert "from 8 up only" in size_pattern(8, [(1, True), (16, False), (17, False)], None)
    assert size_pattern(6, [(1, True), (7, True), (12, True)], None) == (
        "passes at 6; fails at 1, 7, 12")  # the example alone shows no pattern
    assert size_pattern(6, [(1, False)], None) == ""


def test_rule_sizes_run_only_where_the_rule_excludes_a_usual_size():
    """Verification runs a dim at 1 and the first prime above the example; a rule's
    allowed sizes are added only where the rule excludes one of those (only then can it explain
    a failure): a multiple of 4 - all its sizes; a minimum of 2 - one small size; a rule both
    usual sizes satisfy - none (BERT-base's sequence had three more runs for such a rule)."""
    from onnxmedic.inputs import Inputs
    from onnxmedic.verify.input_sets import shape_variants

    ex = Inputs((torch.randn(2, 16),), {})

    def sizes(rule):
        out = shape_variants(ex, [[2, "n"]], rules={"n": rule} if rule else None)
        return sorted(int(label.split("=")[1]) for label, _ in out)

    assert sizes(None) == [1, 17]
    assert sizes(SizeRule("n", multiple=4, minimum=4)) == [1, 4, 17, 20, 32]
    assert sizes(SizeRule("n", minimum=2)) == [1, 2, 17]
    assert sizes(SizeRule("n", maximum=512)) == [1, 17]
