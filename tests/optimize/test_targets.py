"""optimize for GPU targets (issue 17): the sandbox's timing mode (IOBinding on the target's
device), the GPU pipelines, and what happens where the target's provider is missing (OM725).

CI has no GPU: the CUDA path is run here with ``sandbox.providers`` pointed at the CPU provider
(so the code that a CUDA session takes - verification with the target's providers, timing with
inputs and outputs bound on the session's device - runs for real), and on a CPU-only ONNX Runtime
as it is (the plain export is kept and OM725 says why). bench/optimize/optimize.py --target cuda measured
it on a GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import onnxmedic
from onnxmedic import sandbox
from onnxmedic.optimize import optimize, passes

FAST = {"repeats": 3, "rounds": 1}
NO_CUDA = "CUDAExecutionProvider" not in ort.get_available_providers()


class Block(torch.nn.Module):
    """Linear + GELU + LayerNorm: the float32 passes and float16 change it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 64)
        self.b = torch.nn.Linear(64, 32)
        self.n = torch.nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.n(x + self.b(torch.nn.functional.gelu(self.a(x))))


def _export(tmp_path: Path) -> tuple[torch.nn.Module, torch.Tensor, Path]:
    torch.manual_seed(0)
    model = Block().eval()
    x = torch.randn(2, 16, 32)
    path = tmp_path / "m.onnx"
    torch.onnx.export(model, (x,), str(path), dynamo=True, verbose=False)
    return model, x, path


def _fp32_and_fp16(target: str) -> list[passes.Pipeline]:
    """One float32 and one float16 candidate of the target's (the rest cost time, not cover)."""
    return [p for p in passes.default_pipelines(target, "fp16")
            if p.name in ("onnxscript-optimize", "fp16")]


@pytest.mark.parametrize("iobinding", [False, True])
def test_sandbox_timing_runs_the_first_feed_repeatedly(tmp_path: Path, iobinding: bool) -> None:
    _, x, path = _export(tmp_path)
    feed = {"x": x.numpy()}
    sbx = sandbox.run_model(path, [feed], timing={"warmup": 2, "repeats": 5,
                                                  "iobinding": iobinding})
    assert sbx.ok, sbx.error
    assert len(sbx.timed_seconds) == 5 and all(t > 0 for t in sbx.timed_seconds)
    assert sbx.timing_device == "cpu"  # no GPU session: bound on the host
    assert len(sbx.outputs) == 1  # the feed's own run, outputs returned as without timing
    plain = sandbox.run_model(path, [feed])
    assert plain.ok and not plain.timed_seconds
    np.testing.assert_array_equal(sbx.outputs[0][0], plain.outputs[0][0])


def test_a_gpu_targets_timing_warms_up_for_a_time_not_only_a_count(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU's clocks rise from idle over longer than a batch-1 model's few warm-up runs: the
    sandbox warms up for ``warmup_seconds`` too (counted in ``warmup_runs``), and optimize's
    timing asks for GPU_WARMUP_SECONDS on a GPU target only."""
    from onnxmedic.optimize.timing import GPU_WARMUP_SECONDS, time_variants

    _, x, path = _export(tmp_path)
    feed = {"x": x.numpy()}
    counted = sandbox.run_model(path, [feed], timing={"warmup": 2, "repeats": 3})
    assert counted.ok and counted.warmup_runs == 2
    timed = sandbox.run_model(path, [feed], timing={"warmup": 2, "repeats": 3,
                                                    "warmup_seconds": 0.3})
    assert timed.ok and len(timed.timed_seconds) == 3
    assert timed.warmup_runs > 10  # the time, not the count of 2, ended the warm-up
    asked: list[dict] = []

    def fake_run(p, feeds, **kw):
        asked.append(kw["timing"])
        return sandbox.SandboxResult(status="ok", timed_seconds=[0.001])

    monkeypatch.setattr(sandbox, "run_model", fake_run)
    for target in ("cuda", "cpu"):
        time_variants({"a": path}, feed, rounds=1, target=target)
    assert [t["warmup_seconds"] for t in asked] == [GPU_WARMUP_SECONDS, 0]
    assert GPU_WARMUP_SECONDS >= 0.1


@pytest.mark.parametrize("fault,status", [("segv", "crash"), ("hang", "timeout")])
def test_sandbox_timing_that_crashes_or_hangs_is_reported(tmp_path: Path, fault: str,
                                                           status: str,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    _, x, path = _export(tmp_path)
    monkeypatch.setenv("ONNXMEDIC_SANDBOX_FAULT", f"{fault}:timing")
    sbx = sandbox.run_model(path, [{"x": x.numpy()}], timeout=10,
                            timing={"warmup": 0, "repeats": 1, "iobinding": True})
    assert sbx.status == status and sbx.phase == "timing"


def test_gpu_pipelines() -> None:
    names = [p.name for p in passes.default_pipelines("cuda", "fp16", "bert")]
    assert "ort-transformers-bert-fp16" in names and "ort-fusions-fp16" in names
    assert "ort-offline-extended" not in names  # saved CPU-provider layouts
    cpu = [p.name for p in passes.default_pipelines("cpu", "fp16", "bert")]
    assert "ort-transformers-bert-fp16" not in cpu and "ort-offline-extended" in cpu
    trt = passes.default_pipelines("tensorrt", "fp16", "bert")
    assert trt and all(p.portable for p in trt)
    assert {p.name for p in trt} == {"onnxscript-optimize", "ort-offline-basic", "onnxslim",
                                     "fp16"}


@pytest.mark.skipif(not NO_CUDA, reason="a CUDA ONNX Runtime times the target itself")
def test_cuda_target_without_a_gpu_keeps_plain_and_says_why(tmp_path: Path) -> None:
    model, x, path = _export(tmp_path)
    out = tmp_path / "o.onnx"
    res = optimize(path, model, (x,), out=out, target="cuda", precision="fp16",
                   pipelines=_fp32_and_fp16("cuda"), **FAST)
    assert res.chosen == "plain" and res.target == "cuda"
    assert "CUDAExecutionProvider is not available" in res.target_missing
    assert res.providers == ["CPUExecutionProvider"]
    verified = [v for v in res.variants[1:] if v.verified]
    assert verified, [v.rejected for v in res.variants]  # built and verified on the CPU...
    assert all(v.median_ms is None and "not timed on cuda" in v.rejected for v in verified)
    assert onnx.load(str(out)).graph == onnx.load(str(path)).graph  # ...and plain written
    from onnxmedic.optimize import target_findings

    f = target_findings(res)
    assert [x.code for x in f] == ["OM725"] and "not timed on the target" in f[0].message
    from dataclasses import replace

    timed = replace(res, target_missing="")  # the target was there: nothing to say
    assert not target_findings(timed)


@pytest.mark.slow  # the suite's 20-minute budget: a CUDA path; the CPU fallback is checked by test_cuda_target_without_a_gpu_keeps_plain_and_says_why
def test_cuda_target_times_with_iobinding_where_its_provider_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The path a GPU takes, on the CPU provider: verified with the target's providers, timed
    in sessions with inputs and outputs bound on the session's device."""
    calls: list[dict] = []
    real = sandbox.run_model

    def spy(*a, **kw):
        calls.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(sandbox, "providers", lambda target: ["CPUExecutionProvider"])
    monkeypatch.setattr(sandbox, "run_model", spy)
    model, x, path = _export(tmp_path)
    res = optimize(path, model, (x,), target="cuda", precision="fp16",
                   pipelines=_fp32_and_fp16("cuda"), **FAST)
    assert not res.target_missing
    timed = [kw for kw in calls if kw.get("timing") and kw["timing"].get("repeats", 1) > 1]
    assert timed and all(kw["timing"]["iobinding"] and kw["cuda_tf32"] for kw in timed)
    # the chosen file's CUDA-graph twin: verified on its replays' outputs, without TF32
    twin = [kw for kw in calls if kw.get("timing") and kw["timing"].get("repeats") == 1]
    assert len(twin) == 1 and twin[0]["timing"]["graph"] and not twin[0].get("cuda_tf32")
    verifying = [kw for kw in calls if not kw.get("timing")]
    assert all(kw.get("providers") == ["CPUExecutionProvider"] and not kw.get("cuda_tf32")
               for kw in verifying)
    assert all(v.median_ms is not None for v in res.variants if v.verified)
    fp16 = [v for v in res.variants if v.precision == "fp16"]
    assert fp16 and any(v.verified for v in fp16), [v.rejected for v in fp16]


def test_int8_on_a_gpu_target_is_refused(tmp_path: Path) -> None:
    model, x, path = _export(tmp_path)
    with pytest.raises(ValueError, match="precision='int8' is for target='cpu'"):
        optimize(path, model, (x,), target="cuda", precision="int8")
    with pytest.raises(ValueError, match="target 'npu'"):
        optimize(path, model, (x,), target="npu")
    with pytest.raises(ValueError, match="precision='int8' is for target='cpu'"):
        onnxmedic.export(model, (x,), tmp_path / "e.onnx", optimize=True, precision="int8",
                         target="cuda")


def test_cli_int8_on_a_gpu_target_exits_2(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from onnxmedic.cli import main

    _, _, path = _export(tmp_path)
    rc = main(["optimize", str(path), "x.py:M", "--input", "2x16x32:float32", "--target",
               "cuda", "--precision", "int8"])
    assert rc == 2 and "--precision int8 is for --target cpu" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["export", "x.py:M", "--input", "2x16x32:float32", "-o", str(tmp_path / "e.onnx"),
              "--optimize", "--precision", "int8", "--target", "cuda"])
    assert e.value.code == 2


def _timed(name: str, median: float, p90: float, rounds: list[float]):
    from onnxmedic.optimize import Variant

    return Variant(name, verified=True, median_ms=median, p90_ms=p90, round_ms=rounds)


def test_noise_rule_pairs_rounds_instead_of_plain_spread() -> None:
    """A variant 10 % faster in every round wins although plain's p90 spread is wide (a GPU's
    launch jitter: the old rule asked for < median - (p90 - median) and kept plain); one that is
    faster overall but lost a round does not; one within 3 % never does."""
    from onnxmedic.optimize import Why
    from onnxmedic.optimize.timing import choose as choose_fastest

    def choose(*variants):
        plain = _timed("plain", 1.00, 1.30, [1.02, 0.99, 1.00])
        vs = [plain, *variants]
        return choose_fastest(plain, vs), vs

    steady = _timed("steady", 0.90, 0.95, [0.91, 0.89, 0.90])
    chosen, _ = choose(steady)
    assert chosen is steady and steady.speedup == pytest.approx(1 / 0.9)
    lucky = _timed("lucky", 0.90, 1.20, [0.80, 1.05, 0.90])  # slower than plain in round 2
    chosen, _ = choose(lucky)
    assert chosen.name == "plain" and "not faster in round 2" in lucky.rejected
    assert lucky.is_rejected(Why.NOT_FASTER) and lucky.rejection.figures["round"] == 2
    close = _timed("close", 0.98, 0.99, [0.99, 0.97, 0.98])  # faster each round, by < 3 %
    chosen, _ = choose(close)
    assert chosen.name == "plain" and "needs <= 0.97 ms" in close.rejected
    failed = _timed("failed", 0.90, 0.95, [0.90, float("nan"), 0.90])  # a round not timed
    chosen, _ = choose(failed)
    assert chosen.name == "plain" and "round 2" in failed.rejected
    chosen, vs = choose(lucky, steady, close)
    assert chosen is steady and all(v.rejected for v in vs[1:] if v is not steady)
    assert [v.rejection.kind for v in (vs[1], vs[3])] == [Why.NOT_FASTER, Why.NOT_FASTER]


def test_sandbox_timing_binds_a_bfloat16_input(tmp_path: Path) -> None:
    """numpy cannot hand a bfloat16 array to ONNX Runtime: the timing binds it as the feeds'
    run does (an OrtValue of the raw bits) instead of failing the variant's timing."""
    import ml_dtypes
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["c"], to=TensorProto.FLOAT),
         helper.make_node("Relu", ["c"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    path = tmp_path / "bf16.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)]), path)
    x = np.array([-1.0, 0.5, 2.0, -3.0], dtype=ml_dtypes.bfloat16)
    sbx = sandbox.run_model(path, [{"x": x}], timing={"warmup": 1, "repeats": 3,
                                                      "iobinding": True})
    assert sbx.ok, sbx.error
    assert len(sbx.timed_seconds) == 3
    np.testing.assert_array_equal(sbx.outputs[0][0], [0.0, 0.5, 2.0, 0.0])


def test_timing_drops_a_variant_once_it_loses_a_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a baseline, a file slower than (or failing beside) the baseline in a round is not
    timed again - it can no longer win under the paired rule - and _choose still names the
    round it lost; without one (the benchmark's peers) every file is timed every round."""
    from onnxmedic.optimize.timing import choose, time_variants

    ms = {"plain": [10, 10, 10], "fast": [9, 9, 9], "slow": [11, 9, 9], "late": [9, 11, 9],
          "broken": [None, 9, 9]}
    calls: list[str] = []

    def fake_run(path, feeds, **kw):
        name = Path(path).stem
        t = ms[name][sum(c == name for c in calls)]
        calls.append(name)
        if t is None:
            return sandbox.SandboxResult(status="run_error", phase="timing")
        return sandbox.SandboxResult(status="ok", timed_seconds=[t / 1000] * 3)

    monkeypatch.setattr(sandbox, "run_model", fake_run)
    paths = {k: Path(f"{k}.onnx") for k in ms}
    rounds: dict[str, list[float]] = {}
    times = time_variants(paths, {}, rounds=3, per_round=rounds, baseline="plain")
    assert [calls.count(k) for k in ms] == [3, 3, 1, 2, 1]
    assert rounds["slow"] == [11.0] and rounds["late"] == [9.0, 11.0]
    assert np.isnan(rounds["broken"][0]) and "broken" not in times
    variants = [_timed(k, *times[k], rounds[k]) if k in times else _timed(k, None, None, [])
                for k in ms]
    chosen = choose(variants[0], variants)
    assert chosen.name == "fast"
    assert "round 1" in variants[2].rejected and "round 2" in variants[3].rejected
    calls.clear()
    time_variants(paths, {}, rounds=2, per_round={})
    assert calls.count("slow") == 2 and calls.count("broken") == 2


def test_sandbox_graph_timing_returns_what_the_fixed_buffers_computed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """timing["graph"]: a second session with inputs and outputs bound to buffers allocated
    once (on CUDA, captured and replayed as a CUDA graph); the last run's outputs come back so
    that what the replays compute is checked - a corrupted one differs."""
    _, x, path = _export(tmp_path)
    feeds = [{"x": x.numpy()}, {"x": np.ones((2, 16, 32), np.float32)}]
    sbx = sandbox.run_model(path, feeds, timing={"warmup": 2, "repeats": 3, "graph": True})
    assert sbx.ok, sbx.error
    assert len(sbx.timed_seconds) == 3 and len(sbx.outputs) == 2
    assert [o.shape for o in sbx.timed_outputs] == [(2, 16, 32)]
    np.testing.assert_array_equal(sbx.timed_outputs[0], sbx.outputs[0][0])
    assert not sandbox.run_model(path, feeds[:1], timing={"repeats": 2}).timed_outputs
    monkeypatch.setenv("ONNXMEDIC_SANDBOX_FAULT", "corrupt:timing")
    bad = sandbox.run_model(path, feeds[:1], timing={"warmup": 1, "repeats": 1, "graph": True})
    assert bad.ok and np.abs(bad.timed_outputs[0] - sbx.outputs[0][0]).min() > 0.99


def _fake_times(ms: dict[str, list[float]], calls: list[tuple[str, bool]]):
    """A time_variants stand-in: per-round medians by variant name (graph twins by theirs)."""
    from onnxmedic.optimize import candidates

    def fake(paths, feed, *, per_round=None, graphs=(), **kw):
        calls.extend((k, k in graphs) for k in paths)
        if per_round is not None:
            per_round.update({k: list(ms[k]) for k in paths})
        return {k: (float(np.median(ms[k])), max(ms[k])) for k in paths}

    return candidates, fake


def _patch_times(monkeypatch: pytest.MonkeyPatch, fake) -> None:
    """Time with ``fake`` wherever optimize times files: the candidates and the graph twins."""
    from onnxmedic.optimize import candidates, graphs

    for module in (candidates, graphs):
        monkeypatch.setattr(module, "time_variants", fake)


def test_cuda_graph_twin_faster_every_round_becomes_the_run_setting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """On cuda the chosen file is also run as a CUDA graph: verified on its replays, timed in
    rounds of its own beside the file without a graph; faster beyond noise in every round, it
    becomes ``run_settings`` (the result, the finding, the CLI, the written file's metadata) -
    the file written is still the chosen one."""
    import json

    from onnxmedic.optimize import optimization_finding
    from onnxmedic.optimize.graphs import GRAPH_SETTINGS, RUN_SETTINGS_KEY

    monkeypatch.setattr(sandbox, "providers", lambda target: ["CPUExecutionProvider"])
    calls: list[tuple[str, bool]] = []
    candidates, fake = _fake_times({"plain": [1.0, 1.0, 1.0],
                                    "plain+cuda-graph": [0.5, 0.52, 0.49]}, calls)
    _patch_times(monkeypatch, fake)
    model, x, path = _export(tmp_path)
    out = tmp_path / "o.onnx"
    res = optimize(path, model, (x,), out=out, target="cuda", pipelines=[], **FAST)
    assert res.chosen == "plain" and res.run_settings == GRAPH_SETTINGS
    twin = res.variants[-1]
    assert twin.name == "plain+cuda-graph" and twin.verified and not twin.rejected
    assert twin.speedup == pytest.approx(2.0) and twin.round_ms == [0.5, 0.52, 0.49]
    assert ("plain+cuda-graph", True) in calls and ("plain", False) in calls
    assert ("run as a CUDA graph (plain+cuda-graph) it takes 0.500 ms, 2.00x faster than the "
            "plain export") in res.message
    f = optimization_finding(res)
    assert "plain+cuda-graph: 0.50 ms, 2.00x - chosen run setting" in f.message
    assert "enable_cuda_graph" in f.message
    proto = onnx.load(str(out))
    meta = {p.key: p.value for p in proto.metadata_props}
    assert json.loads(meta[RUN_SETTINGS_KEY]) == GRAPH_SETTINGS
    assert proto.graph == onnx.load(str(path)).graph  # the same file, plus its settings
    s = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(s.run(None, {"x": x.numpy()})[0],
                               model(x).detach().numpy(), rtol=1e-4, atol=1e-5)
    from onnxmedic.cli import main

    seen: dict = {}

    def same(*a, **kw):
        seen.update(kw)
        return res

    monkeypatch.setattr("onnxmedic.inputs.load_model", lambda spec: (model, None))
    import sys

    monkeypatch.setattr(sys.modules["onnxmedic.optimize"], "optimize", same)
    assert main(["optimize", str(path), "m.py:Block", "--input", "2x16x32:float32",
                 "--target", "cuda"]) == 0
    assert seen["cuda_graph"] == "auto"
    text = capsys.readouterr().out
    assert ('run setting provider_options: {"CUDAExecutionProvider": {"enable_cuda_graph": '
            '"1"}}') in text
    assert "run setting session: onnxruntime.InferenceSession(path, providers=[(" in text
    assert "plain+cuda-graph" in text


@pytest.mark.parametrize("why", ["slower", "lost a round", "wrong replay", "crash",
                                 pytest.param("off", marks=pytest.mark.slow)])  # 20-minute budget
def test_cuda_graph_twin_is_rejected_with_its_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    """A twin within noise, one that lost a round, one whose replays compute something else, one
    whose session dies: each is listed with its reason and no run setting is recorded;
    ``cuda_graph=False`` tries none."""
    from onnxmedic.optimize.graphs import RUN_SETTINGS_KEY

    monkeypatch.setattr(sandbox, "providers", lambda target: ["CPUExecutionProvider"])
    twin_ms = {"slower": [0.99, 0.98, 0.98], "lost a round": [0.6, 1.1, 0.6]}.get(
        why, [0.5, 0.5, 0.5])
    candidates, fake = _fake_times({"plain": [1.0, 1.0, 1.0], "plain+cuda-graph": twin_ms}, [])
    _patch_times(monkeypatch, fake)
    if why == "wrong replay":
        monkeypatch.setenv("ONNXMEDIC_SANDBOX_FAULT", "corrupt:timing")
    if why == "crash":
        monkeypatch.setenv("ONNXMEDIC_SANDBOX_FAULT", "segv:timing")
    model, x, path = _export(tmp_path)
    out = tmp_path / "o.onnx"
    res = optimize(path, model, (x,), out=out, target="cuda", pipelines=[],
                   cuda_graph=why != "off", **FAST)
    assert res.chosen == "plain" and not res.run_settings
    assert RUN_SETTINGS_KEY not in {p.key for p in onnx.load(str(out)).metadata_props}
    if why == "off":
        assert [v.name for v in res.variants] == ["plain"]
        return
    twin = res.variants[-1]
    expect = {"slower": "needs <= 0.970 ms", "lost a round": "not faster in round 2",
              "wrong replay": "the CUDA graph's replay failed verification",
              "crash": "ONNX Runtime refused the CUDA graph (crash"}[why]
    assert twin.name == "plain+cuda-graph" and expect in twin.rejected, twin.rejected


@pytest.mark.parametrize("case", ["graph wins", "no graph beats plain", "plain refuses graphs"])
def test_cuda_graph_deploy_compares_every_file_as_a_graph(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """cuda_graph="deploy" (a deployment that runs CUDA graphs): every verified file is run as
    a graph, its replays verified, the twins timed beside the plain file without one; the
    fastest twin beating the plain file's twin - and the plain file itself - is written with its
    run settings. Where no twin beats the plain file nothing is recommended; where the plain
    file cannot run as a graph the files are compared without graphs."""
    from onnxmedic.optimize.graphs import GRAPH_SETTINGS, RUN_SETTINGS_KEY

    monkeypatch.setattr(sandbox, "providers", lambda target: ["CPUExecutionProvider"])
    ms = {"plain": [1.0, 1.0, 1.0], "plain+cuda-graph": [0.6, 0.6, 0.6],
          "onnxscript-optimize+cuda-graph": [0.4, 0.41, 0.4],
          "onnxscript-optimize": [0.9, 0.9, 0.9]}
    if case == "no graph beats plain":
        ms["plain"] = [0.45, 0.39, 0.45]  # the best twin loses round 2 to the plain file
    if case == "plain refuses graphs":
        monkeypatch.setenv("ONNXMEDIC_SANDBOX_FAULT", "segv:timing")
    calls: list[tuple[str, bool]] = []
    _, fake = _fake_times(ms, calls)
    _patch_times(monkeypatch, fake)
    model, x, path = _export(tmp_path)
    out = tmp_path / "o.onnx"
    pipes = [p for p in passes.default_pipelines("cuda") if p.name == "onnxscript-optimize"]
    res = optimize(path, model, (x,), out=out, target="cuda", pipelines=pipes,
                   cuda_graph="deploy", **FAST)
    by = {v.name: v for v in res.variants}
    meta = {p.key for p in onnx.load(str(out)).metadata_props}
    if case == "graph wins":
        assert res.chosen == "onnxscript-optimize" and res.run_settings == GRAPH_SETTINGS
        twin = by["onnxscript-optimize+cuda-graph"]
        assert not twin.rejected and twin.speedup == pytest.approx(1 / 0.4)
        assert by["plain+cuda-graph"].rejected == "slower than onnxscript-optimize+cuda-graph"
        assert not by["onnxscript-optimize"].rejected  # the file written
        assert res.message.startswith("onnxscript-optimize+cuda-graph is 2.50x faster")
        assert RUN_SETTINGS_KEY in meta
        assert ("onnxscript-optimize", False) not in calls  # files timed as graphs only
    elif case == "no graph beats plain":
        assert res.chosen == "plain" and not res.run_settings and RUN_SETTINGS_KEY not in meta
        assert "not faster than the plain export without a graph" in by[
            "onnxscript-optimize+cuda-graph"].rejected
    else:
        assert res.chosen == "onnxscript-optimize" and not res.run_settings
        assert all("refused the CUDA graph" in v.rejected for k, v in by.items()
                   if k.endswith("+cuda-graph"))
        assert ("onnxscript-optimize", False) in calls  # compared without graphs
    with pytest.raises(ValueError, match="cuda_graph 'always'"):
        optimize(path, model, (x,), target="cuda", cuda_graph="always")


class ConvNet(torch.nn.Module):
    """Conv + BatchNorm + ReLU + pooling: a convolutional graph (passes.is_convolutional)."""

    def __init__(self) -> None:
        super().__init__()
        self.c = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.n = torch.nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.adaptive_avg_pool2d(torch.relu(self.n(self.c(x))), 1)


@pytest.mark.parametrize("mode", ["auto", "deploy"])
def test_a_convolutional_file_is_also_tried_as_an_nhwc_cuda_graph(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """cuDNN's float16 tensor-core convolutions work channels-last: a convolutional file's
    twins include one whose session asks ONNX Runtime's CUDA provider for NHWC kernels
    (prefer_nhwc), verified on its replays and timed with that option; where it is the fastest
    it becomes the run setting with both options (result, finding, written file, bench). A
    graph without convolutions gets no such twin, and a refused NHWC twin says so."""
    import json

    from onnxmedic.optimize import optimization_finding
    from onnxmedic.optimize.bench import graph_options
    from onnxmedic.optimize.graphs import NHWC_OPTIONS, RUN_SETTINGS_KEY, twin_settings

    monkeypatch.setattr(sandbox, "providers", lambda target: ["CPUExecutionProvider"])
    asked: list[tuple[str, dict]] = []
    real = sandbox.run_model

    def spy(path, feeds, **kw):
        asked.append((Path(path).name, dict(kw.get("cuda_options") or {})))
        return real(path, feeds, **kw)

    monkeypatch.setattr(sandbox, "run_model", spy)
    ms = {"plain": [1.0, 1.0, 1.0], "plain+cuda-graph": [0.6, 0.6, 0.6],
          "plain+cuda-graph+nhwc": [0.4, 0.41, 0.4]}
    timed: list[dict] = []
    _, fake = _fake_times(ms, [])

    def fake_times(paths, feed, **kw):
        timed.append(dict(kw.get("cuda_options") or {}))
        return fake(paths, feed, **kw)

    _patch_times(monkeypatch, fake_times)
    torch.manual_seed(0)
    model, x = ConvNet().eval(), torch.randn(1, 3, 16, 16)
    path = tmp_path / "c.onnx"
    torch.onnx.export(model, (x,), str(path), dynamo=True, verbose=False)
    out = tmp_path / "o.onnx"
    res = optimize(path, model, (x,), out=out, target="cuda", pipelines=[], cuda_graph=mode,
                   **FAST)
    by = {v.name: v for v in res.variants}
    nhwc = by["plain+cuda-graph+nhwc"]
    assert nhwc.verified and not nhwc.rejected and nhwc.cuda_options == NHWC_OPTIONS
    assert nhwc.passes == ["cuda-graph", "nhwc"] and nhwc.speedup == pytest.approx(2.5)
    assert by["plain+cuda-graph"].rejected == "slower than plain+cuda-graph+nhwc"
    assert (path.name, NHWC_OPTIONS) in asked  # its replays verified with the option
    assert timed[-1]["plain+cuda-graph+nhwc"] == NHWC_OPTIONS  # and timed with it
    assert not timed[-1].get("plain+cuda-graph")
    settings = twin_settings(NHWC_OPTIONS)
    assert res.run_settings == settings
    assert settings["provider_options"] == {
        "CUDAExecutionProvider": {"enable_cuda_graph": "1", "prefer_nhwc": "1"}}
    assert "'prefer_nhwc': '1'" in settings["session"]
    assert "plain+cuda-graph+nhwc: 0.40 ms, 2.50x - chosen run setting" in (
        optimization_finding(res).message)
    meta = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert json.loads(meta[RUN_SETTINGS_KEY]) == settings
    assert graph_options(out) == NHWC_OPTIONS  # what bench then times the graph with
    # refused in NHWC (here: the fault injected into every graph session) - said so
    monkeypatch.setenv("ONNXMEDIC_SANDBOX_FAULT", "segv:timing")
    res = optimize(path, model, (x,), target="cuda", pipelines=[], cuda_graph=mode, **FAST)
    by = {v.name: v for v in res.variants}
    assert "refused the CUDA graph in NHWC" in by["plain+cuda-graph+nhwc"].rejected
    assert not res.run_settings
    monkeypatch.delenv("ONNXMEDIC_SANDBOX_FAULT")
    _, x2, p2 = _export(tmp_path)  # no convolution: no NHWC twin
    res = optimize(p2, Block().eval(), (x2,), target="cuda", pipelines=[], cuda_graph=mode,
                   **FAST)
    assert not [v for v in res.variants if v.name.endswith("+nhwc")]


def test_the_worker_passes_cuda_options_to_every_session_of_the_request() -> None:
    """The sandbox request's cuda_options join TF32 off (verification) and enable_cuda_graph
    (the graph session) in the CUDA provider's options; a CPU provider gets none."""
    from onnxmedic import _sandbox_worker

    made: list = []

    class Opts:
        def add_session_config_entry(self, *a: str) -> None:
            pass

    class FakeOrt:
        SessionOptions = Opts
        GraphOptimizationLevel = ExecutionOrder = None

        @staticmethod
        def InferenceSession(model, opts, providers, disabled_optimizers):  # noqa: N802
            made.append(providers)
            return object()

    req = {"model": "m.onnx", "providers": ["CUDAExecutionProvider", "CPUExecutionProvider"],
           "cuda_options": {"prefer_nhwc": "1"}}
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for r in (req, dict(req, graph=True), dict(req, cuda_tf32=True, cuda_options={})):
            assert _sandbox_worker.load_session(FakeOrt, d, r, {}) is not None
    assert made[0] == [("CUDAExecutionProvider", {"use_tf32": "0", "prefer_nhwc": "1"}),
                       "CPUExecutionProvider"]
    assert made[1][0] == ("CUDAExecutionProvider", {"use_tf32": "0", "prefer_nhwc": "1",
                                                    "enable_cuda_graph": "1"})
    assert made[2] == ["CUDAExecutionProvider", "CPUExecutionProvider"]  # nothing asked


def test_a_file_the_cpu_stand_in_refuses_is_not_blamed_on_the_target() -> None:
    """Where the target's provider is missing, candidates run on the CPU provider: one it
    refuses (float16 ScatterElements-add has no CPU kernel: transformers' MoE routing) says
    that it was the CPU - the target's provider may run it; one its type checks reject is
    invalid on any provider. Other rejections stay as they are, and with the target present
    nothing is added."""
    from onnxmedic.optimize import Rejection, Variant, Why
    from onnxmedic.optimize.candidates import REFUSED, outcome

    def variants() -> list[Variant]:
        return [Variant("plain", verified=True), Variant("ok", verified=True),
                Variant("fp16", "fp16", rejection=Rejection(
                    Why.REFUSED, f"{REFUSED} (run_error: ScatterElements)")),
                Variant("wrong", rejection=Rejection(Why.FAILED_VERIFICATION,
                                                     "failed verification: y at set 0")),
                Variant("typed", "fp16", rejection=Rejection(
                    Why.REFUSED, f"{REFUSED} (load_error: Fail: Load model from m.onnx "
                    "failed:Type Error: Type (tensor(float16)) of output arg (t) of node "
                    "(transpose) does not match expected type (tensor(float)).)"))]

    vs = variants()
    outcome(vs[0], vs[0], vs, "cuda", "CUDAExecutionProvider is not available")
    # a graph ONNX Runtime rejects while typing it is no provider's gap
    assert vs[4].rejected.endswith("(tensor(float)).) - the graph itself is invalid, on any "
                                   "provider")
    assert vs[2].rejected == (f"{REFUSED} (run_error: ScatterElements) - on the CPU, standing "
                              "in for cuda, whose provider may run it")
    assert vs[3].rejected == "failed verification: y at set 0"
    assert vs[1].rejected.startswith("verified on the CPU, not timed on cuda")
    vs = variants()
    outcome(vs[0], vs[0], vs, "cpu", None)
    assert vs[2].rejected == f"{REFUSED} (run_error: ScatterElements)"
