"""One command for a deployment package: ``export hf:X --precision int4`` builds the package
with either backend (onnxmedic's export, onnxruntime-genai's builder), fuses it and makes it
int4 through the same road as ``optimize PACKAGE`` (hf/transforms/precision.py), each step
verified; tasks and flags it does not serve are refused with a finding or a usage error."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import onnx
import pytest

pytest.importorskip("transformers")

from onnxmedic.cli import main  # noqa: E402
from onnxmedic.hf import builder  # noqa: E402
from onnxmedic.optimize import int4_search  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.zoo.generation import FAMILIES, save_family  # noqa: E402

TASK = "text-generation-with-past"
# the road is what is judged here, not 4-bit accuracy on random weights: a loose budget, short
LOOSE = "perplexity=10000%,agreement=1%,steps=4,prompts=1"
ONE_CELL = [(32, 4, "int4")]
# the whole zoo (bench/zoo/generation.py FAMILIES) with both backends (the builder where the
# installed builder serves the family, builder.served(): what backend auto hands it to) on
# both roads; a subset with -k, e.g. -k "qwen3 or phi3"
ROADS = ("export-int4", "optimize-int4")  # export hf:X --precision int4; export, then optimize
# the families the builder serves whose builder package does not verify here (family ->
# what the refusal says: the verification's finding, the builder's error; and why): the
# export with --backend builder refuses (OM838, exit 1), so does its int4 road, nothing
# written; auto, the default, falls back to onnxmedic's export (OM837), which both roads take
BUILDER_UNVERIFIED: dict[str, tuple[str, str]] = {
    "llama": ("OM812", "linear rope scaling (factor 2): its logits are outside the float64 "
                       "budget at the first step"),
    "mistral": ("OM811", "its sliding window (8) is not applied to a longer prompt: the "
                         "first token differs"),
    "olmo": ("OM811", "its q/k/v are not clipped (clip_qkv): the first token differs"),
    "phi": ("OM511", "partial rotary (8 of 16): ONNX Runtime's GroupQueryAttention refuses "
                     "its cos_cache (a multiple of 8 at most head_size / 2)"),
    "phi3": ("KeyError: 'multi_cache'", "the builder exits 1 on the config without rope "
                                        "scaling"),
    "gemma3_text": ("KeyError: 'rope_type'", "the builder exits 1 on the config"),
    # onnxruntime-genai generates PyTorch's tokens from these, but their sliding layers'
    # cache is a buffer of the window's capacity shared between past and present, which
    # onnxmedic's own loop does not feed (backends.unfed_cache): not run, said so
    "gemma2": ("own loop cannot verify", "a shared sliding-window cache buffer"),
    "gpt_oss": ("own loop cannot verify", "a shared sliding-window cache buffer"),
}
# our export's packages with no genai_config.json (onnxruntime-genai cannot load them: MLA's
# different key and value head sizes, OM820; convolution/state-space states taken one token
# per step, OM829): every transform is judged by genai, so both roads refuse them before any
# work (OM741), nothing written. The builder's LFM2 package (a convolution state, served by
# genai) goes through both roads (its int4 reference feeds the state; tests/hf/
# test_int4_states.py); the builder builds neither Falcon-H1 nor Mamba
NO_GENAI = ("deepseek_v3", "lfm2", "falcon_h1", "mamba")
CASES = [pytest.param(road, f, b, id=f"{road}-{f}-{b}")
         for road in ROADS for f in FAMILIES for b in ("export", "builder")]


def _ops(folder: Path) -> set[str]:
    return {n.op_type for n in onnx.load(str(folder / "model.onnx"),
                                         load_external_data=False).graph.node}


def _failure(out: str) -> str:
    """Every error and warning finding of a ``--json`` run, whole (a tail cuts the one that
    failed); the raw text where it is not JSON."""
    try:
        findings = json.loads(out)["findings"]
    except (ValueError, KeyError, TypeError):
        return out[-3000:]
    return "\n".join(json.dumps(f) for f in findings if f.get("severity") != "info")


def _codes(printed: str) -> set[str]:
    """The finding codes of a run: its ``--json`` findings, else the ``OMnnn`` lines printed."""
    try:
        return {f["code"] for f in json.loads(printed)["findings"]}
    except (ValueError, KeyError, TypeError):
        return set(re.findall(r"^(OM\d{3})\b", printed, re.M))


def _int4(family: str, backend: str, tmp_path: Path, monkeypatch, capsys,
          road: str = "export-int4") -> None:
    """``family``'s package made int4 by ``road``, the package built by ``backend``: exit 0,
    no traceback, the fusion judged (OM734 fused, OM735 the plain package kept), int4
    (MatMulNBits, OM732) that onnxruntime-genai generates ONNX Runtime's tokens from, written
    as a package (genai_config.json), and nothing left beside it."""
    from onnxmedic.hf.transforms import precision

    if backend == "builder" and not builder.available():
        pytest.skip("onnxruntime-genai's model builder not installed")
    folder = save_family(family, tmp_path / "ckpt")
    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    if backend == "builder" and arch not in builder.served():
        pytest.skip(f"the installed builder does not build {arch}")
    monkeypatch.setattr(int4_search, "DEFAULT_GRID", ONE_CELL)
    made = []  # the road's PackagePrecision (both roads go through package_precision)
    real = precision.package_precision
    monkeypatch.setattr(precision, "package_precision",
                        lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
    out = tmp_path / "int4"
    export = ["export", f"hf:{folder}", "--task", TASK, "--no-progress"]
    int4 = ["--precision", "int4", "--accuracy", LOOSE, "-o", str(out)]
    left = ["ckpt", "int4"]
    fallback = backend == "builder" and family in BUILDER_UNVERIFIED
    if fallback and road == "export-int4":  # --backend builder: its refusal, then auto's road
        rc = main([*export, "--backend", "builder", *int4, "--json"])
        printed = capsys.readouterr()
        codes = _codes(printed.out)
        assert rc == 1 and "OM838" in codes, _failure(printed.out) + printed.err[-2000:]
        said = BUILDER_UNVERIFIED[family][0]
        assert said in codes or said in printed.out, _failure(printed.out)
        assert "Traceback" not in printed.out + printed.err and not made
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing written
    export += ["--backend", "auto" if fallback else backend]
    if road == "optimize-int4":  # the package on disk first, then optimize PACKAGE hf:X
        pkg = tmp_path / "pkg"
        rc = main([*export, "-o", str(pkg), "--json"])
        printed = capsys.readouterr()
        assert rc == 0, _failure(printed.out) + printed.err[-2000:]
        assert (pkg / "model.onnx").is_file() and not made
        assert not fallback or "OM837" in _codes(printed.out)  # auto fell back to the export
        argv, left = ["optimize", str(pkg), f"hf:{folder}", "--no-progress", *int4], left + ["pkg"]
    else:
        report = tmp_path / "report.json"
        argv, left = [*export, *int4, "--json", "--report", str(report)], left + [report.name]
    rc = main(argv)
    printed = capsys.readouterr()
    assert "Traceback" not in printed.out + printed.err
    # the folder written is named as OUT, never the scratch folder it was built in
    said = printed.out + (report.read_text() if road == "export-int4" else "")
    assert ".tmp-" not in said, re.findall(r"\S*\.tmp-\S*", said)
    if backend == "export" and family in NO_GENAI:  # refused before any work, said why
        said = printed.out + printed.err
        assert rc == 1 and "OM741" in said and "int4 here: it has no genai_config.json" in said, said[-3000:]
        assert "OM009" not in printed.out + printed.err and not out.exists()
        return
    assert rc == 0, _failure(printed.out) + printed.err[-2000:]
    assert len(made) == 1 and made[0].ok and made[0].path == str(out)
    found = {f.code for f in made[0].findings}
    assert "OM732" in found and "OM732" in _codes(printed.out)
    assert f"written to {out / 'model.onnx'}" in printed.out, printed.out[-3000:]
    assert found & {"OM734", "OM735"}, found  # the fusion judged, said before int4 ran
    if road == "export-int4":
        assert "OM819" in _codes(printed.out)
        assert not fallback or "OM837" in _codes(printed.out)  # auto fell back to the export
    else:
        assert re.search(r"^int4 of the (fused|plain) package", printed.out, re.M)
    assert "MatMulNBits" in _ops(out) and (out / "genai_config.json").is_file()
    r = made[0].int4
    assert r.tokens_genai is not None and r.tokens_genai == r.tokens_onnx  # genai serves it
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(left)  # no staging left


@pytest.mark.slow  # 35 s of CPU: the export, its fusion and an int4 candidate, each verified
def test_export_precision_int4_in_one_command(tmp_path, monkeypatch, capsys):
    _int4("qwen2", "export", tmp_path, monkeypatch, capsys)


@pytest.mark.slow  # the whole zoo: ~15-60 s a case; a subset with -k "qwen3 or phi3"
@pytest.mark.parametrize("road, family, backend", CASES)
def test_int4_over_the_zoo_both_backends_both_roads(road, family, backend, tmp_path,
                                                    monkeypatch, capsys):
    _int4(family, backend, tmp_path, monkeypatch, capsys, road)


def test_int4_is_for_decoder_packages_om840(hf_folder, tmp_path):
    import onnxmedic

    r = onnxmedic.export_pretrained(hf_folder("bert-cls"), tmp_path / "m.onnx", precision="int4")
    assert not r.ok and [f.code for f in r.errors] == ["OM840"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, said", [
    (["export", "model.py:Net", "--precision", "int4"], "only with hf: models"),
    (["export", "hf:x", "--precision", "int4", "--target", "cuda"], "--target cpu"),
    (["export", "hf:x", "--precision", "int4", "--no-verify"], "drop --no-verify"),
])
def test_export_int4_flags_that_do_not_go(argv, said, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, said", [
    ({"precision": "fp16"}, "precision=fp16 takes effect with optimize=True"),
    ({"precision": "int8"}, "precision=int8 takes effect with optimize=True"),
    ({"task": "text-generation-with-past", "target": "cuda"}, "target='cpu' here, not 'cuda'"),
])
def test_export_pretrained_refuses_what_it_would_not_honour(kwargs, said, tmp_path):
    """The API refuses, before loading anything, a precision without optimize (the float32
    package would be written as if honoured) and a generation package for another target
    (it would be a CPU one): the CLI's usage errors, for API callers."""
    import onnxmedic

    with pytest.raises(ValueError, match=re.escape(said)):
        onnxmedic.export_pretrained(str(tmp_path / "missing"), tmp_path / "out", **kwargs)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_a_package_at_fp16_or_int8_is_refused_before_any_work(precision, tmp_path, capsys):
    """fp16 and int8 generation packages are not made (only fp32 and int4 are, on the CPU):
    ``optimize PACKAGE hf:X --precision fp16|int8`` is a usage error that says so, before the
    package or the checkpoint is read; nothing is written."""
    (tmp_path / "pkg").mkdir()
    rc = main(["optimize", str(tmp_path / "pkg"), "hf:missing", "--precision", precision,
               "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and f"--precision fp32 or int4 here, not {precision}" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg"]


# ------------------------------------------------------------------------------------------
# the package passes: the contract as their pre- and postcondition


@pytest.mark.parametrize("kind", ["fuse", "int4"])
def test_a_package_pass_requires_a_package_the_contract_feeds(tmp_path, kind):
    """Every package pass (fusion, int4) refuses, before any work, a package whose decoder
    the contract cannot feed."""
    from onnxmedic.genpackage import cache_names
    from onnxmedic.hf.transforms.fuse_decoder import FusePass
    from onnxmedic.hf.transforms.int4_package import Int4Pass
    from onnxmedic.optimize.pass_infra import PreconditionError
    from tests.test_genpackage import _cache_graph

    _cache_graph(tmp_path / "pkg" / "model.onnx", cache_names(1), cache_names(1, present=True),
                 size="kv_cache_dim")  # the builder's symbolic head size, no config
    pass_ = FusePass() if kind == "fuse" else Int4Pass(model=None)
    with pytest.raises(PreconditionError, match="kv_cache_dim|symbolic head"):
        pass_(tmp_path / "pkg", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_package_pass_ensures_the_interface_is_kept(tmp_path):
    """A pass that renames the logits (a package genai_config.json no longer describes) is
    caught by its postcondition; the same pass keeping the names passes."""
    from onnxmedic.genpackage import cache_names
    from onnxmedic.hf.transforms.passes import PackagePass, copy_side_files
    from onnxmedic.optimize.pass_infra import PassResult, PostconditionError
    from tests.test_genpackage import _cache_graph

    src = tmp_path / "pkg"
    _cache_graph(src / "model.onnx", cache_names(1), cache_names(1, present=True))
    (src / "genai_config.json").write_text("{}")

    class Rename(PackagePass):
        def __init__(self, new: str) -> None:
            self.new = new

        def call(self, s: Path, d: Path) -> PassResult:
            copy_side_files(s, d, "model.onnx")
            proto = onnx.load(str(s / "model.onnx"))
            for n in proto.graph.node:
                n.output[:] = [self.new if o == "logits" else o for o in n.output]
            proto.graph.output[0].name = self.new
            onnx.save(proto, str(d / "model.onnx"))
            return PassResult(d, True)

    assert Rename("logits")(src, tmp_path / "same").modified
    assert (tmp_path / "same" / "genai_config.json").is_file()
    with pytest.raises(PostconditionError, match="changed its decoder's interface"):
        Rename("scores")(src, tmp_path / "renamed")


def test_a_staged_package_folder_has_a_new_folders_mode(tmp_path):
    """The scratch folder a package is verified in becomes the package (replace_folder, as
    every package writer does, over an existing package too): it has a new folder's mode, not
    mkdtemp's 0700."""
    from onnxmedic.hf.transforms.passes import staged
    from onnxmedic.onnxfile import replace_folder

    (tmp_path / "new").mkdir()
    (tmp_path / "out").mkdir()
    with staged(tmp_path / "out") as tmp:
        assert tmp.parent == tmp_path and tmp.stat().st_mode & 0o777 == 0o700
        (tmp / "model.onnx").write_bytes(b"")
        replace_folder(tmp, tmp_path / "out")
    assert (tmp_path / "out" / "model.onnx").is_file()
    assert (tmp_path / "out").stat().st_mode == (tmp_path / "new").stat().st_mode


def test_constant_wheres_are_folded_through_chains_and_graph_outputs():
    """The fusion's first step folds ``Where`` on a one-element constant condition: a chain
    of them reads the branch at its end, a folded graph output keeps its name (an Identity),
    a ``Where`` on a computed condition stays; ONNX Runtime gives the same outputs."""
    import numpy as np
    import onnx_ir as ir
    import onnxruntime as ort
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    from onnxmedic.hf.transforms.fuse_decoder import fold_constant_where

    graph = h.make_graph([
        h.make_node("Relu", ["x"], ["r"]),
        h.make_node("Where", ["no", "nan", "r"], ["w1"]),  # picks r
        h.make_node("Where", ["yes", "w1", "zero"], ["w2"]),  # picks w1, so r
        h.make_node("Add", ["w2", "x"], ["y"]),
        h.make_node("Where", ["no", "nan", "w2"], ["out"]),  # a graph output
        h.make_node("Where", ["c", "nan", "r"], ["kept"]),  # a computed condition
    ], "g", [h.make_tensor_value_info("x", T.FLOAT, [2]),
             h.make_tensor_value_info("c", T.BOOL, [2])],
        [h.make_tensor_value_info(n, T.FLOAT, [2]) for n in ("y", "out", "kept")],
        [nh.from_array(np.array([False]), "no"), nh.from_array(np.array([True]), "yes"),
         nh.from_array(np.array([np.nan], np.float32), "nan"),
         nh.from_array(np.array([0.0], np.float32), "zero")])
    proto = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model = ir.from_proto(proto)
    assert fold_constant_where(model) == 3
    folded = ir.to_proto(model)
    onnx.checker.check_model(folded)
    assert sorted(n.op_type for n in folded.graph.node) == ["Add", "Identity", "Relu", "Where"]
    assert [o.name for o in folded.graph.output] == ["y", "out", "kept"]
    feeds = {"x": np.array([-1.0, 2.0], np.float32), "c": np.array([True, False])}
    runs = [ort.InferenceSession(p.SerializeToString(), providers=["CPUExecutionProvider"])
            .run(None, feeds) for p in (proto, folded)]
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("code", ["OM741", "OM839"])
def test_export_int4_refusal_names_the_package_not_its_staging_folder(tmp_path, monkeypatch,
                                                                      code):
    """``export --precision int4`` exports the float32 package into a staging folder that is
    removed: a refusal of that package (OM741: no genai_config.json; OM839: a decoder the
    contract cannot feed, whose reason names the graph file) names the package asked for,
    not the staging folder; nothing is written."""
    from onnxmedic import hf
    from onnxmedic.genpackage import cache_names
    from onnxmedic.hf.generation import package_result
    from onnxmedic.hf.transforms import precision
    from tests.test_genpackage import _cache_graph

    def export(model, out, **kw):  # a verified float32 package the transforms refuse
        if code == "OM741":
            _cache_graph(Path(out) / "model.onnx", cache_names(1), cache_names(1, present=True))
        else:  # a graph that is not a decoder step
            Path(out).mkdir(parents=True)
            g = onnx.helper.make_graph(
                [onnx.helper.make_node("Relu", ["x"], ["y"])], "g",
                [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
                [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])])
            onnx.save(onnx.helper.make_model(g), str(Path(out) / "model.onnx"))
        result = package_result(model)
        result.ok = True
        return result

    monkeypatch.setattr(hf, "export_generation", export)
    r = precision.export_at_precision(object(), tmp_path / "int4")
    said = [f.message for f in r.findings if f.code == code]
    assert not r.ok and said and ".tmp" not in said[0], [f.message for f in r.findings]
    named = f"the float32 package exported for {tmp_path / 'int4'}"
    if code == "OM741":
        assert said[0].startswith(f"{named} cannot be made"), said[0]
    else:  # the graph named within the package, the package by what it stands for
        assert said[0].startswith(f"cannot transform {named}: its decoder cannot be fed a "
                                  "step: model.onnx: not a decoder step"), said[0]
    assert list(tmp_path.iterdir()) == []
