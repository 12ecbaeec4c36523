from __future__ import annotations

import logging

import pytest

# torch.onnx logs a warning per torchvision op when torchvision is absent; it is noise here.
logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "own_sandbox_children: the test starts a sandbox child per run, as outside "
        "the suite (sandbox.keep_warm off): tests of the sandbox's children themselves")


@pytest.fixture(scope="session", autouse=True)
def warm_sandbox():
    """One kept sandbox child per test process (sandbox.keep_warm) serves the exports and
    verifications of its tests one after another: a child's start (a Python, numpy and ONNX
    Runtime imported: about 0.25 s of CPU) once instead of once per run. Verdicts are a
    one-shot child's (a failure in a child that served before is run again in a fresh one, a
    changed os.environ starts a new child)."""
    from onnxmedic import sandbox

    with sandbox.keep_warm():
        yield


@pytest.fixture(autouse=True)
def _own_sandbox_children(request: pytest.FixtureRequest):
    """Tests marked own_sandbox_children run with keep_warm off."""
    if request.node.get_closest_marker("own_sandbox_children") is None:
        yield
        return
    from onnxmedic import sandbox

    with sandbox.keep_warm(False):
        yield


@pytest.fixture
def registry_snapshot():
    """Restore onnxmedic's translation registry after a test registers its own entries."""
    from onnxmedic.ops import REGISTRY

    REGISTRY.load_builtin()
    saved = dict(REGISTRY._entries)
    yield REGISTRY
    REGISTRY._entries.clear()
    REGISTRY._entries.update(saved)
