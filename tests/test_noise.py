"""A normal run's stderr holds onnxmedic's lines only: the third-party messages it would carry
(torchao's "Failed to load", torch's pytree deprecation, torch.onnx's axis-name warning,
transformers' "Loading weights" bar) are dropped where they are emitted, each by its message,
and every other message of the same library still shows; what torch logs during a capture
attempt (torch.export's guard warnings, draft_export's summary) goes with the attempt."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from onnxmedic import noise

ROOT = Path(__file__).resolve().parents[1]

# what the libraries print when they are let (torchao 0.18, torch 2.13)
SEEN = {
    "torchao": "Failed to load /venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-"
               "gnu.so: Could not load this library: /venv/site-packages/torchao/_C_mxfp8.so",
    "torchao.kernel.intmm": "Warning: Detected no triton, on systems without Triton certain "
                            "kernels will not work",
    "torch.utils._pytree": "<enum 'KernelPreference'> is an Enum subclass and is now natively "
                           "supported by torch.compile as an opaque value type. Calling "
                           "register_constant() on Enum subclasses is deprecated and will be "
                           "an error in a future release.",
}
THIRD_PARTY = re.compile(r"^(WARNING|ERROR) (?!onnxmedic)\S+: |^[WEI]\d{4} \d\d:\d\d:\d\d|"
                         r"\w+Warning: |Loading weights|^Failed to load ")


def third_party_lines(stderr: str) -> list[str]:
    """The lines of ``stderr`` that a library other than onnxmedic printed."""
    return [ln for ln in stderr.splitlines() if THIRD_PARTY.search(ln)]


def test_each_known_message_is_dropped_and_nothing_else():
    assert set(SEEN) == {name for name, _, _ in noise.KNOWN}
    noise.silence(progress=True)
    noise.silence(progress=True)  # idempotent: one filter per message
    shown: list[str] = []
    for name, message in SEEN.items():
        log = logging.getLogger(name)
        assert len(log.filters) == 1
        # a handler of its own, at WARNING: torch's loggers do not propagate, and a command
        # run earlier in this process may have raised their level
        handler, level = logging.Handler(), log.level
        handler.emit = lambda record: shown.append(record.getMessage())  # type: ignore
        log.addHandler(handler)
        log.setLevel(logging.WARNING)
        try:
            log.warning(message)
            log.warning("something else went wrong: %s", name)
        finally:
            log.removeHandler(handler)
            log.setLevel(level)
    assert shown == [f"something else went wrong: {name}" for name in SEEN]


def test_torchs_own_handlers_write_into_the_stream_during_a_capture_only():
    """torch's loggers have their own stderr handlers (redirect_stderr misses them): inside
    torch_logs_to their lines go to the given stream (a capture attempt's notes), after it
    to the handler again."""
    import io

    handler_out, notes = io.StringIO(), io.StringIO()
    log = logging.getLogger("torch.onnxmedic_test_noise")
    handler = logging.StreamHandler(handler_out)
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.WARNING)  # whatever "torch"'s level was left at
    try:
        with noise.torch_logs_to(notes):
            log.warning("Unable to find user code corresponding to {u0}")
        log.warning("after the capture")
    finally:
        log.removeHandler(handler)
    assert notes.getvalue() == ("W torch.onnxmedic_test_noise: Unable to find user code "
                                "corresponding to {u0}\n")
    assert handler_out.getvalue() == "after the capture\n" and not handler.filters


def test_progress_bars_off_unless_the_user_set_them(monkeypatch):
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    noise.silence(progress=True)
    assert "HF_HUB_DISABLE_PROGRESS_BARS" not in __import__("os").environ
    noise.silence(progress=False)
    assert __import__("os").environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")
    noise.silence(progress=False)
    assert __import__("os").environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "0"


def test_an_axis_named_twice_alike_is_quiet_and_two_names_still_warn(tmp_path):
    """torch.onnx warns when two inputs name one axis: said when the names differ, dropped
    when they are the same (a tokenizer's input_ids and attention_mask, both "batch")."""
    import torch

    import onnxmedic
    from onnxmedic._torch_compat import SAME_AXIS_NAME

    class Add(torch.nn.Module):
        def forward(self, x, y):
            return x + y

    x = torch.randn(2, 3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        r = onnxmedic.export(Add(), (x, x.clone()), tmp_path / "m.onnx", verify=False,
                             dynamic_shapes={"x": {0: "batch"}, "y": {0: "batch"}})
    assert r.path and r.onnx_model is not None, [f.code for f in r.findings]
    assert not [w for w in seen if "will not be used" in str(w.message)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message=SAME_AXIS_NAME, category=UserWarning)
        for a, b in (("batch", "batch"), ("rows", "batch")):
            warnings.warn(f"# The axis name: {a} will not be used, since it shares the same "
                          f"shape constraints with another axis: {b}.", UserWarning)
    assert [str(w.message).split()[4] for w in seen] == ["rows"]


@pytest.mark.slow
def test_a_normal_hf_export_and_optimize_print_onnxmedics_lines_only(tmp_path):
    """The real commands in a fresh interpreter (torchao not imported yet): export hf: of a
    tiny checkpoint (transformers loads torchao; torch.onnx names the shared axes), then
    optimize of the written file."""
    sys.path.insert(0, str(ROOT))
    from tests.hf.checkpoints import save

    save(tmp_path / "ckpt", "bert-cls")
    (tmp_path / "m.py").write_text(
        "from transformers import AutoModelForSequenceClassification\n"
        f"M = AutoModelForSequenceClassification.from_pretrained({str(tmp_path / 'ckpt')!r})\n")
    for args in (["export", f"hf:{tmp_path / 'ckpt'}", "-o", str(tmp_path / "m.onnx")],
                 ["optimize", str(tmp_path / "m.onnx"), f"{tmp_path / 'm.py'}:M",
                  "--input", "2x3:int64@0,100", "--input", "2x3:int64@1,2",
                  "--input", "2x3:int64@0,1",
                  "-o", str(tmp_path / "o.onnx")]):
        p = subprocess.run([sys.executable, "-m", "onnxmedic", *args], cwd=ROOT,
                           capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stderr[-3000:]
        assert third_party_lines(p.stderr) == [], p.stderr[-3000:]


def test_a_message_onnxmedic_says_instead_is_dropped_in_its_block_only():
    """transformers' "add `is_decoder=True`" comes from ~17 module loggers and reaches stderr
    through the handler on transformers' own root logger: dropped there while the block runs
    (the with-past load, which OM817 then refuses in its own words); every other transformers
    warning still shows, and the same line outside the block (--task text-generation, where
    nothing of onnxmedic repeats it)."""
    import io

    said = io.StringIO()
    root, handler = logging.getLogger("transformers"), logging.StreamHandler(said)
    root.addHandler(handler)
    level, root.level = root.level, logging.WARNING
    bert = logging.getLogger("transformers.models.bert.modeling_bert")
    standalone = "If you want to use `BertLMHeadModel` as a standalone, add `is_decoder=True.`"
    try:
        with noise.said_instead("is_decoder"):
            bert.warning(standalone)
            bert.warning("Some weights of BertLMHeadModel were not initialized")
        assert not handler.filters
        bert.warning(standalone)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    assert said.getvalue().splitlines() == [
        "Some weights of BertLMHeadModel were not initialized", standalone]
