"""onnxmedic's own ATen -> ONNX translations, one module per op family.

Register with :func:`translation`; the registry becomes torch.onnx's custom translation table.
"""

from __future__ import annotations

from onnxmedic.ops._registry import (
    REGISTRY,
    RegistrationError,
    TranslationMeta,
    TranslationRegistry,
    resolve_target,
    translation,
)

__all__ = [
    "REGISTRY",
    "RegistrationError",
    "TranslationMeta",
    "TranslationRegistry",
    "resolve_target",
    "translation",
]
