"""The command line: exit codes, one-paragraph messages, no tracebacks, no partial output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import onnx_models as om
from tests.test_noise import third_party_lines

ROOT = Path(__file__).resolve().parents[1]
MODELS = "tests/models.py"



def _sigint_default() -> None:
    """In the child: SIGINT as a terminal's Ctrl-C finds it. A parent that ignores SIGINT (a
    background job; here, the test worker once something in the process set SIG_IGN, seen in the
    full xdist run only) passes SIG_IGN on, and Python then never raises KeyboardInterrupt."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)

def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300):
    e = dict(os.environ)
    e.update(env or {})
    p = subprocess.run([sys.executable, "-m", "onnxmedic", *args], cwd=ROOT, env=e,
                       capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in p.stderr, p.stderr
    assert third_party_lines(p.stderr) == [], p.stderr  # onnxmedic's lines only
    return p


def test_export_success_json_and_report(tmp_path):
    out = tmp_path / "m.onnx"
    p = cli("export", f"{MODELS}:Erfinv", "--input", "3x4:float32", "-o", str(out),
            "--report", str(tmp_path / "r.html"), "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["ok"] and d["path"] == str(out) and out.is_file()
    assert d["stages"]["compare"] == "passed"
    assert "aten.special_erfinv.default" in d["used_translations"]
    assert "verified" in p.stderr
    assert (tmp_path / "r.html").read_text().count("OM") >= 1


def test_export_dynamic_batch(tmp_path):
    p = cli("export", f"{MODELS}:PoolView", "--input", "2x3x8x8", "--dynamic", "x:0=batch",
            "-o", str(tmp_path / "m.onnx"), "--json")
    assert p.returncode == 0, p.stderr
    import onnx

    m = onnx.load(tmp_path / "m.onnx")
    assert m.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"


@pytest.mark.parametrize(("args", "code", "exit_code", "words"), [
    (["export", "nope/missing.py:M", "--input", "2"], "OM001", 1, "does not exist"),
    (["export", f"{MODELS}:Missing", "--input", "2"], "OM002", 1, "no attribute"),
    (["export", f"{MODELS}:not_a_model", "--input", "2"], "OM003", 1, "not a model"),
    (["export", f"{MODELS}:ConvLog1p", "--input", "2x:float32"], "OM004", 2, "cannot read"),
    (["export", f"{MODELS}:Raises", "--input", "2"], "OM100", 1, "broken on purpose"),
    (["export", f"{MODELS}:TwoLinear", "--input", "2x10:int32"], "OM101", 1, "int32"),
    (["export", f"{MODELS}:TwoLinear", "--input", "2x10:float16"], "OM101", 1, "float16"),
    (["export", f"{MODELS}:DataDependentIf", "--input", "3"], "OM114", 1, "torch.cond"),
    (["export", f"{MODELS}:PoolView", "--input", "2x3x8x8", "--dynamic", "y:0=b"], "OM004", 2,
     "not among forward"),
])
def test_bad_inputs_give_codes_and_exit_codes(args, code, exit_code, words, tmp_path):
    p = cli(*args, "--json", "--report", str(tmp_path / "r.json"))
    assert p.returncode == exit_code, p.stderr
    d = json.loads(p.stdout)
    codes = [f["code"] for f in d["findings"]]
    assert code in codes
    assert words in p.stderr
    assert code in p.stderr
    assert json.loads((tmp_path / "r.json").read_text())["exit_code"] == exit_code


def test_unwritable_output_path(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if os.access(ro, os.W_OK):
            target = tmp_path / "missing-dir" / "m.onnx"  # running as root: use a missing folder
        else:
            target = ro / "m.onnx"
        p = cli("export", f"{MODELS}:ConvLog1p", "--input", "1x3x8x8", "-o", str(target))
    finally:
        os.chmod(ro, 0o700)
    assert p.returncode == 1
    assert "OM006" in p.stderr
    assert not target.exists()


def test_existing_output_not_clobbered_on_failure(tmp_path):
    out = tmp_path / "m.onnx"
    out.write_bytes(b"keep me")
    p = cli("export", f"{MODELS}:DataDependentIf", "--input", "3", "-o", str(out))
    assert p.returncode == 1
    assert out.read_bytes() == b"keep me"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["m.onnx"]


def test_usage_errors_exit_2():
    p = cli("export")
    assert p.returncode == 2 and "usage" in p.stderr
    p = cli("frobnicate")
    assert p.returncode == 2
    p = cli("export", f"{MODELS}:ConvLog1p", "--target", "tpu")
    assert p.returncode == 2 and "invalid choice" in p.stderr


def test_verify_ok_and_mismatch(tmp_path):
    good = om.identity_model(tmp_path / "id.onnx")
    p = cli("verify", str(good), f"{MODELS}:Identity", "--input", "2x3", "--json")
    assert p.returncode == 0, p.stderr
    bad = om.scaled_model(tmp_path / "sc.onnx", 1.5)
    p = cli("verify", str(bad), f"{MODELS}:Identity", "--input", "2x3", "--json")
    assert p.returncode == 1 and "OM601" in p.stderr
    d = json.loads(p.stdout)
    assert d["verification_summary"]["y"]["max_abs"] > 0


@pytest.mark.parametrize("kind", ["corrupt", "truncated", "missing", "empty"])
def test_verify_bad_onnx_files(tmp_path, kind):
    f = tmp_path / "m.onnx"
    if kind == "corrupt":
        f.write_bytes(os.urandom(64))
    elif kind == "truncated":
        good = om.identity_model(tmp_path / "good.onnx").read_bytes()
        f.write_bytes(good[: len(good) // 2])
    elif kind == "empty":
        f.write_bytes(b"")
    p = cli("verify", str(f), f"{MODELS}:Identity", "--input", "2x3")
    assert p.returncode == 1, p.stderr
    assert "OM007" in p.stderr


def test_verify_hang(tmp_path):
    p = cli("verify", str(om.endless_loop_model(tmp_path / "h.onnx")), f"{MODELS}:Identity",
            "--input", "2x3", "--timeout", "8")
    assert p.returncode == 1
    assert "OM512" in p.stderr and "within 8" in p.stderr


def test_verify_abort(tmp_path):
    p = cli("verify", str(om.identity_model(tmp_path / "id.onnx")), f"{MODELS}:Identity",
            "--input", "2x3", env={"ONNXMEDIC_SANDBOX_FAULT": "abort:run"})
    assert p.returncode == 1
    assert "OM513" in p.stderr and "SIGABRT" in p.stderr


def test_internal_error_exits_3_with_traceback_in_report(tmp_path, monkeypatch, capsys):
    from onnxmedic import cli
    from onnxmedic.stages import translate

    def broken(*a, **k):
        raise RuntimeError("simulated onnxmedic bug")

    monkeypatch.setattr(translate, "translate", broken)
    rc = cli.main(["export", f"{MODELS}:ConvLog1p", "--input", "1x3x8x8",
                   "--report", str(tmp_path / "r.json")])
    assert rc == 3
    err = capsys.readouterr().err
    assert "OM009" in err and "simulated onnxmedic bug" in err and "Traceback" not in err
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["exit_code"] == 3 and "simulated onnxmedic bug" in d["traceback"]


def test_demo_example_is_verified_by_onnxmedic(tmp_path):
    p = cli("export", "examples/gaussian_copula.py:GaussianCopulaHead", "--input",
            "examples/gaussian_copula.py:make_inputs", "-o", str(tmp_path / "d.onnx"), "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["used_translations"] == ["aten.special_erfinv.default"]


def test_ctrl_c_leaves_no_partial_output_or_child(tmp_path):
    """SIGINT while ONNX Runtime runs: exit 130, no output, no temp files, no sandbox child."""
    import signal
    import time

    p = subprocess.Popen(
        [sys.executable, "-m", "onnxmedic", "verify", str(om.endless_loop_model(
            tmp_path / "hang.onnx")), f"{MODELS}:Identity", "--input", "2x3", "--timeout", "120"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_sigint_default)
    try:
        deadline = time.time() + 120
        child = None
        while child is None and time.time() < deadline:  # wait for the sandbox child
            ps = subprocess.run(["ps", "-ww", "-eo", "pid,ppid,args"], capture_output=True,
                                text=True).stdout
            for line in ps.splitlines()[1:]:
                pid, ppid, args = line.split(None, 2)
                if ppid == str(p.pid) and "_sandbox_worker" in args:
                    child = (pid, args.split()[-1])  # its pid and request folder
            time.sleep(0.2)
        assert child is not None
        time.sleep(2)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)  # cleanup is quick; the 2-core CI may be loaded
    finally:
        p.kill()
    assert p.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    time.sleep(0.5)
    ps = subprocess.run(["ps", "-eo", "pid"], capture_output=True, text=True).stdout.split()
    assert child[0] not in ps  # the sandbox child is gone
    assert not os.path.exists(child[1])  # and its request folder
    assert sorted(x.name for x in tmp_path.iterdir()) == ["hang.onnx"]


def test_repro_folder_reproduces_the_failure(tmp_path):
    p = cli("export", f"{MODELS}:DataDependentIf", "--input", "3", "--repro",
            str(tmp_path / "rp"))
    assert p.returncode == 1
    assert "def forward" not in p.stderr  # torch.export's graph dumps are kept out
    # the branch was specialised and the export ran: the ONNX model is part of the repro
    assert sorted(x.name for x in (tmp_path / "rp").iterdir()) == ["inputs.pt", "model.onnx",
                                                                  "repro.py"]
    r = subprocess.run([sys.executable, str(tmp_path / "rp" / "repro.py")], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "OM114" in r.stdout

    bad = om.scaled_model(tmp_path / "sc.onnx", 1.5)
    p = cli("verify", str(bad), f"{MODELS}:Identity", "--input", "2x3", "--repro",
            str(tmp_path / "rv"))
    assert p.returncode == 1 and (tmp_path / "rv" / "model.onnx").is_file()
    r = subprocess.run([sys.executable, str(tmp_path / "rv" / "repro.py")], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "OM601" in r.stdout
