from __future__ import annotations

import logging

import pytest

# torch.onnx logs a warning per torchvision op when torchvision is absent; it is noise here.
logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)



@pytest.fixture
def registry_snapshot():
    """Restore onnxmedic's translation registry after a test registers its own entries."""
    from onnxmedic.ops import REGISTRY

    REGISTRY.load_builtin()
    saved = dict(REGISTRY._entries)
    yield REGISTRY
    REGISTRY._entries.clear()
    REGISTRY._entries.update(saved)
