"""The vision tests run in .venv-vision (`make test-vision`), where torchvision and timm are
installed: torchvision's ops are defined first (bench/zoo/torchvision_cpu.py), before anything
imports torchvision. Elsewhere every test here skips, saying so."""

from __future__ import annotations

import importlib.util

import pytest

HAVE_VISION = all(importlib.util.find_spec(m) is not None for m in ("torchvision", "timm"))
SKIP_REASON = ("needs torchvision and timm: run `make test-vision` (the .venv-vision venv; "
               "they are never installed in .venv)")

if HAVE_VISION:
    from bench.zoo.torchvision_cpu import install

    install()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = str(config.rootpath / "tests" / "vision")
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.vision)
            if not HAVE_VISION:
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))
