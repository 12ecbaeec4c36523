"""transformers 5.x installs its output-capturing hooks on a model's first call that asks for
hidden states or attentions, and marks the model with ``_output_capturing_hooks_installed``.
borrow's restore must put back both: before, it removed the mark and left the hooks, so the
model's next call installed them a second time and recorded every hidden state twice."""

from __future__ import annotations

import pytest
import torch

import onnxmedic
from onnxmedic import borrow


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


def test_restore_removes_the_hooks_a_call_installed_with_their_mark():
    model = _tiny_llama()
    x = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        fresh = model(x, output_hidden_states=True).hidden_states
    model = _tiny_llama()  # the hooks not installed yet
    state = borrow.record_state(model)
    with torch.no_grad():
        model(x, output_hidden_states=True)
    assert _hooks(model) > 0 and model.model._output_capturing_hooks_installed
    restored, _ = borrow.restore_state(state)
    assert "model._output_capturing_hooks_installed" in restored
    assert any(r.startswith("hooks of ") for r in restored)
    # exactly as before the call: no hooks, no mark - consistent for the next call
    assert _hooks(model) == 0
    assert not hasattr(model.model, "_output_capturing_hooks_installed")
    with torch.no_grad():
        again = model(x, output_hidden_states=True).hidden_states
    assert len(again) == len(fresh) == 3  # the embeddings and one per layer, once each
    assert all(torch.equal(a, b) for a, b in zip(again, fresh))


def test_hooks_the_user_registered_stay():
    model = _tiny_llama()
    seen: list[int] = []
    handle = model.lm_head.register_forward_hook(lambda m, a, o: seen.append(1))
    state = borrow.record_state(model)
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 4)), output_hidden_states=True)
    borrow.restore_state(state)
    assert list(model.lm_head._forward_hooks) == [handle.id]
    handle.remove()  # the handle still removes its hook: the same dict, refilled in place
    assert _hooks(model) == 0


class _HiddenStates(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, output_hidden_states=True).hidden_states[-1]


@pytest.mark.slow
def test_export_leaves_no_hooks_behind():
    """An export whose runs installed the hooks: the model comes back without them, and its
    own next call records each hidden state once."""
    model = _tiny_llama()
    x = torch.randint(0, 64, (1, 5))
    res = onnxmedic.export(_HiddenStates(model), (x,), verify=False)
    assert res.program is not None, [f.one_paragraph() for f in res.errors]
    assert _hooks(model) == 0
    assert not hasattr(model.model, "_output_capturing_hooks_installed")
    with torch.no_grad():
        assert len(model(x, output_hidden_states=True).hidden_states) == 3
