"""timm's attention with non-4-D scaled_dot_product_attention (NesT: 5-D [B, heads, blocks, N,
d]; Hiera: 5-D mask units; SAM-ViT: 3-D windows with relative positions), small configs with a
dynamic batch: torchlib's translation asserts "only 4D" (torch.onnx fails on every one); onnxmedic
folds the leading dims (ops/miscompiles.py)."""

from __future__ import annotations

import pytest
import torch

import onnxmedic
from tests.vision.conftest import SKIP_REASON

timm = pytest.importorskip("timm", reason=SKIP_REASON)


def _nest() -> torch.nn.Module:
    from timm.models import nest

    return nest.Nest(img_size=64, patch_size=4, num_levels=3, embed_dims=(16, 32, 64),
                     num_heads=(1, 2, 4), depths=(1, 1, 1), num_classes=10)


def _hiera() -> torch.nn.Module:
    from timm.models import hiera

    return hiera.Hiera(img_size=(64, 64), embed_dim=16, num_heads=1, stages=(1, 1, 1, 1),
                       num_classes=10)


def _samvit() -> torch.nn.Module:
    from timm.models import vision_transformer_sam as sam

    return sam.VisionTransformerSAM(img_size=64, patch_size=16, embed_dim=32, depth=2,
                                    num_heads=2, global_attn_indexes=(1,), window_size=2,
                                    use_rel_pos=True, num_classes=0, neck_chans=16)


@pytest.mark.parametrize("build", [_nest, _hiera, _samvit], ids=["nest", "hiera", "samvit"])
def test_non_4d_attention_models_export_and_verify(build) -> None:
    torch.manual_seed(0)
    model = build().eval()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    res = onnxmedic.export(model, (x,), dynamic_shapes=({0: "batch"},))
    assert res.ok, [(f.code, f.message[:300]) for f in res.findings]
