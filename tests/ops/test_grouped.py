"""Grouped matmul of MoE experts: transformers::grouped_mm_fallback (no OpInfo: edge tables),
and tiny transformers MoE models exported, verified at several token counts (1 included) and
left as they were."""

from __future__ import annotations

import pytest
import torch

import onnxmedic
from onnxmedic.borrow import module_modes
from tests.ops._table import OpEntry, make_tests

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")  # defines transformers::grouped_mm_fallback


def _grouped(dtype):
    """(input [S, K] sorted by expert, weight [E, K, N], int32 cumulative ends): a random
    routing, one row, experts without rows (first, middle, last), one expert taking every row,
    and rows past the last end (zeros in transformers' fallback)."""
    g = torch.Generator().manual_seed(0)

    def sample(counts: list[int], rows: int | None = None, k: int = 8, n: int = 5):
        rows = sum(counts) if rows is None else rows
        x = torch.randn(rows, k, generator=g, dtype=dtype)
        w = torch.randn(len(counts), k, n, generator=g, dtype=dtype)
        return ((x, w, torch.tensor(counts).cumsum(0).to(torch.int32)), {})

    ids = torch.randint(0, 6, (23,), generator=g)
    return [sample(torch.bincount(ids, minlength=6).tolist()), sample([0, 1, 0, 0]),
            sample([0, 2, 0, 3]), sample([2, 0, 0, 1]), sample([0, 0, 4]), sample([7]),
            sample([1, 2, 0, 1], rows=6)]


ENTRIES = [
    OpEntry("grouped_mm_fallback", fn=torch.ops.transformers.grouped_mm_fallback.default,
            dtypes=(torch.float32,), use_opinfo=False, edge=_grouped),
]
make_tests(ENTRIES, globals())


class LastHidden(torch.nn.Module):
    def __init__(self, m: torch.nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=input_ids, use_cache=False).last_hidden_state


TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
            vocab_size=128, max_position_embeddings=64, num_key_value_heads=1, head_dim=16)
MOE = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
       "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=32)}


def _ids(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(4, 128, (batch, seq), generator=torch.Generator().manual_seed(batch))


# qwen2_moe with -m slow only (the suite's 20-minute budget): mixtral runs the same experts loop
@pytest.mark.parametrize("model_type", [pytest.param(m, marks=[pytest.mark.slow] if m == "qwen2_moe" else [])
                                        for m in sorted(MOE)])
def test_tiny_moe_exports_and_verifies_at_several_token_counts(tmp_path, model_type):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **TINY, **MOE[model_type])
    hf_model = transformers.AutoModel.from_config(config).eval()
    model = LastHidden(hf_model).eval()
    implementation = hf_model.get_experts_implementation()
    modes = [flag for _, flag in module_modes(model)]
    state = {k: v.clone() for k, v in model.state_dict().items()}

    path = tmp_path / f"{model_type}.onnx"
    res = onnxmedic.export(model, (_ids(2, 5),), path,
                           dynamic_shapes=({0: "batch", 1: "seq"},))
    assert res.ok, [f.one_paragraph() for f in res.findings]
    assert any(f.code == "OM204" and "grouped_mm_fallback" in (f.op or "")
               for f in res.findings), "the experts ran through another path"
    for batch, seq in [(1, 1), (1, 3), (3, 17)]:  # 1, 3 and 51 tokens: most experts empty at 1
        ver = onnxmedic.verify(path, model, (_ids(batch, seq),))
        assert ver.ok, (batch, seq, [f.one_paragraph() for f in ver.findings])

    # borrowed, not taken: the experts implementation, the modes and the weights as they were
    assert hf_model.get_experts_implementation() == implementation
    assert [flag for _, flag in module_modes(model)] == modes
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
