"""Models the optimize tests share (tests/optimize/conftest.py exports the ones a session
shares as files)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import onnx
import torch
import torch.nn.functional as F

import onnxmedic


def export_dynamo(model: torch.nn.Module, args: tuple, path: Path) -> Path:
    """``model`` exported by plain torch.onnx (dynamo) to ``path``."""
    torch.onnx.export(model, args, str(path), dynamo=True, verbose=False)
    return path


def op_types(path: Path) -> Counter[str]:
    """How many nodes of each op type the ONNX file at ``path`` has."""
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node)


class NormAttention(torch.nn.Module):
    """An RMSNorm written out by hand and an SDPA call: ort_fusions fuses both."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(32))
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        q, k, v = self.qkv(h).view(1, -1, 3, 4, 8).unbind(2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2))
        return o.sum(1)


class FeedForward(torch.nn.Module):
    """A transformer block's feed-forward half: bias + GELU and residual + LayerNorm, the
    patterns ONNX Runtime's transformers optimizer fuses (BiasGelu, SkipLayerNormalization)."""

    def __init__(self, model_type: str | None = None) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
        self.ln = torch.nn.LayerNorm(32)
        if model_type:
            cnn = model_type in ("resnet", "convnext")  # transformers' CNN configs: no heads
            self.config = type("Config", (), {"model_type": model_type} if cnn else
                               {"model_type": model_type, "num_attention_heads": 4})()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x + self.down(F.gelu(self.up(x))))


class Bags(torch.nn.Module):
    """EmbeddingBag over explicit offsets: torch.onnx writes a Loop carrying a sequence of
    rows, and an If whose empty-bag branch returns a zeros initializer as it is."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bag = torch.nn.EmbeddingBag(20, 8, mode="mean")

    def forward(self, tokens: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.bag(tokens, offsets)


BAG_ARGS = (torch.tensor([1, 4, 7, 2, 9, 11]), torch.tensor([0, 3, 3, 5]))  # bag 1 is empty


def run_bags(path: Path) -> Any:
    """Bags' ONNX file run on BAG_ARGS in the sandbox."""
    return onnxmedic.sandbox.run_model(path, [{"tokens": BAG_ARGS[0].numpy(),
                                               "offsets": BAG_ARGS[1].numpy()}])


class OutlierChannel(torch.nn.Module):
    """Conv a's first output channel is 1000x the others and conv b ignores it: per-tensor
    uint8 ranges (static int8's activations) then round b's input - every channel b reads - to
    a few levels. Harmless in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.b = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.c = torch.nn.Conv2d(8, 4, 1)
        with torch.no_grad():
            self.a.weight[0] *= 1000.0
            self.b.weight[:, 0] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


class SinkMLP(torch.nn.Module):
    """A transformer MLP with a normalised output. Fed a 'massive activation' token (one
    position ~1000x the others, as attention-sink tokens are in LLMs): quantize_dynamic's one
    activation scale per tensor then rounds every other token's activations to zero, while
    MatMulNBits' per-row, per-32-channel blocks keep each token's own scale."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(64, 256)
        self.down = torch.nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.nn.functional.gelu(self.up(x)))
        return torch.nn.functional.layer_norm(h, (64,))


def sink_model(tmp_path: Path) -> tuple[torch.nn.Module, torch.Tensor, Path]:
    """SinkMLP with a massive-activation first token, and its ONNX file in ``tmp_path``."""
    torch.manual_seed(0)
    model = SinkMLP().eval()
    x = torch.randn(1, 16, 64)
    x[0, 0] *= 1000.0
    path = tmp_path / "m.onnx"
    torch.onnx.export(model, (x,), str(path), dynamo=True, verbose=False)
    return model, x, path


def mlp_model(tmp_path: Path, width: int, out_features: int, rows: int
              ) -> tuple[torch.nn.Module, torch.Tensor, Path]:
    """Linear(width, width), ReLU, Linear(width, out_features) (seeded), an input of ``rows``
    rows, and its ONNX file (plain torch.onnx) in ``tmp_path``: two quantizable layers."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, out_features)).eval()
    x = torch.randn(rows, width)
    return model, x, export_dynamo(model, (x,), tmp_path / "mlp.onnx")
