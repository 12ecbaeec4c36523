"""onnxmedic sweep: entries in their own processes; a crash, a hang or a broken factory of one
entry is a finding and never stops the sweep; results file, --resume, reports, executors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from onnxmedic.sweep import load_zoo, sweep
from tests.test_cli import _sigint_default, cli

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "tests" / "sweep_zoo" / "tiny.py")



def test_crash_hang_and_broken_factory_do_not_stop_the_sweep(tmp_path):
    results = tmp_path / "results.json"
    seen = []
    res = sweep(TINY, names=["mlp", "aborts", "hangs", "broken"], jobs=2, timeout=25,
                results=results, report=tmp_path / "sweep.html", on_entry=seen.append)
    by = {e["name"]: e for e in res.entries}
    assert sorted(by) == ["aborts", "broken", "hangs", "mlp"]
    assert [e["name"] for e in seen] == [e["name"] for e in res.entries]
    assert by["mlp"]["status"] == "verified" and by["mlp"]["ok"]
    assert by["mlp"]["stages"]["compare"] == "passed"
    assert by["mlp"]["max_abs"] is not None and by["mlp"]["max_abs"] < 1e-4
    assert by["mlp"]["export_seconds"] > 0 and by["mlp"]["peak_rss_mb"] > 50
    assert by["mlp"]["note"] == "tiny"
    assert by["aborts"]["status"] == "crashed"
    crash = by["aborts"]["findings"][0]
    assert crash["code"] == "OM701" and "SIGABRT" in crash["message"]
    assert by["hangs"]["status"] == "timeout"
    assert by["hangs"]["findings"][0]["code"] == "OM702"
    assert 25 <= by["hangs"]["seconds"] < 60
    assert by["broken"]["status"] == "factory-failed"
    assert "this config is wrong" in by["broken"]["findings"][0]["message"]
    assert not res.ok and res.exit_code == 1
    codes = [f.code for f in res.findings]
    assert {"OM701", "OM702", "OM703", "OM708"} <= set(codes)
    assert "1 of 4 entries" in res.findings[-1].message
    saved = json.loads(results.read_text())
    assert saved["format"] == "onnxmedic-sweep/1"
    assert {e["name"]: e["status"] for e in saved["entries"]} == {
        n: e["status"] for n, e in by.items()}
    html = (tmp_path / "sweep.html").read_text()
    assert 'id="summary"' in html and "SIGABRT" in html and html.count("<tr") == 5


def test_resume_skips_done_entries_and_adds_to_the_file(tmp_path):
    results = tmp_path / "results.json"
    first = sweep(TINY, names=["broken"], jobs=1, timeout=60, results=results)
    assert [e["status"] for e in first.entries] == ["factory-failed"]
    before = json.loads(results.read_text())["entries"][0]
    p = cli("sweep", TINY, "--resume", str(results), "--only", "broken,aborts", "--jobs", "1",
            "--timeout", "60", "--json", "--report", str(tmp_path / "s.json"))
    assert p.returncode == 1, p.stderr
    d = json.loads(p.stdout)
    assert [e["name"] for e in d["entries"]] == ["broken", "aborts"]
    assert d["entries"][0] == before  # skipped, not re-run
    assert d["counts"]["crashed"] == 1 and d["counts"]["factory-failed"] == 1
    assert any(f["code"] == "OM707" and "1 entries already done" in f["message"]
               for f in d["findings"])
    assert json.loads(results.read_text())["entries"] == d["entries"]
    assert json.loads((tmp_path / "s.json").read_text())["counts"] == d["counts"]
    assert "OM701" in p.stderr and "aborts" in p.stderr


def test_unusable_zoo_and_results_are_findings(tmp_path):
    (tmp_path / "nozoo.py").write_text("X = 1\n")
    (tmp_path / "empty.py").write_text("ZOO = {}\n")
    folder = tmp_path / "dup"
    folder.mkdir()
    for n in ("a.py", "b.py"):
        (folder / n).write_text("ZOO = {'same': lambda: None}\n")
    for spec, text in [(str(tmp_path / "missing.py"), "does not exist"),
                       (str(tmp_path / "nozoo.py"), "no dict named ZOO"),
                       (str(folder), "defined twice"),
                       (str(tmp_path / "empty.py"), "has no entries")]:
        res = sweep(spec)
        assert res.exit_code == 1 and res.findings[0].code == "OM704", spec
        assert text in res.findings[0].message
    res = sweep(TINY, names=["nope"])
    assert res.findings[0].code == "OM704" and "mlp" in res.findings[0].message
    bad = tmp_path / "bad.json"
    bad.write_text("{\"format\": \"other\"}")
    res = sweep(TINY, results=bad, resume=True)
    assert res.findings[0].code == "OM706" and not res.entries
    assert sorted(e.name for e in load_zoo(TINY)) == sorted(
        ["mlp", "scale", "aborts", "hangs", "broken"])
    assert [e.name for e in load_zoo(TINY + ":GOOD")] == ["mlp", "scale"]


def test_cli_usage_errors_exit_2(tmp_path):
    p = cli("sweep", TINY, "--jobs", "0")
    assert p.returncode == 2 and "--jobs" in p.stderr
    p = cli("sweep", TINY, "--executor", "spark")
    assert p.returncode == 2


def test_ray_missing_is_a_finding(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    res = sweep(TINY, names=["broken"], executor="ray")
    assert res.findings[0].code == "OM705" and res.exit_code == 2
    assert "pip install" in res.findings[0].suggestion and not res.entries


@pytest.mark.slow
def test_ray_executor_on_a_local_instance(tmp_path):
    pytest.importorskip("ray")
    res = sweep(TINY, names=["scale", "aborts", "broken"], jobs=2, timeout=120,
                executor="ray", results=tmp_path / "r.json")
    by = {e["name"]: e["status"] for e in res.entries}
    assert by == {"scale": "verified", "aborts": "crashed", "broken": "factory-failed"}
    assert res.executor == "ray" and "executor ray" in res.findings[-1].message


def test_results_in_a_missing_folder_is_a_finding(tmp_path):
    res = sweep(TINY, names=["broken"], results=tmp_path / "no" / "r.json")
    assert res.findings[0].code == "OM006" and res.exit_code == 1 and not res.entries


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as fh:
            out += [int(x) for x in fh.read().split()]
    return out


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc")
def test_ctrl_c_stops_the_sweep_and_its_workers(tmp_path):
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    p = subprocess.Popen([sys.executable, "-m", "onnxmedic", "sweep", TINY, "--only", "hangs",
                          "--timeout", "300", "--no-progress"], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=_sigint_default)
    workers: list[int] = []
    deadline = time.monotonic() + 60
    while not workers and time.monotonic() < deadline:
        time.sleep(0.5)
        workers = _children(p.pid)
    assert workers, "the worker never started"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)  # cleanup is quick; the 2-core CI may be loaded
    assert p.returncode == 130 and "Traceback" not in err, err
    time.sleep(1)
    for w in workers:
        try:
            with open(f"/proc/{w}/stat") as fh:
                state = fh.read().split(")")[-1].split()[0]
        except FileNotFoundError:
            continue
        assert state == "Z", f"worker {w} still running after Ctrl-C"


def test_worker_started_as_the_sweep_stops_kills_itself(monkeypatch):
    """Ctrl-C can land while a pool thread's Popen is returning: the stop's sweep of the live
    workers misses it, and it used to run to its --timeout (the Ctrl-C test hung under load).
    Once stopping, a worker that registers is killed at once."""
    import time

    from onnxmedic.sweep import executors

    entry = next(e for e in load_zoo(TINY) if e.name == "hangs")
    monkeypatch.setattr(executors, "STOPPING", executors.threading.Event())
    executors.STOPPING.set()
    t0 = time.monotonic()
    rec = executors.run_entry(entry, executors.Options(timeout=30, verify=False))
    assert time.monotonic() - t0 < 20 and rec["status"] == "crashed"  # not "timeout"
    assert not executors.LIVE_WORKERS


def test_unverified_entry_and_failed_check_are_findings(tmp_path):
    res = sweep(TINY + ":FAILING", jobs=1, timeout=300, results=tmp_path / "r.json")
    by = {e["name"]: e for e in res.entries}
    assert by["wrong"]["status"] == "failed" and not by["wrong"]["ok"]
    assert by["check_fails"]["status"] == "failed"
    assert by["check_fails"]["check"] == {"ok": False, "message": "decoded tokens differ",
                                          "steps": 4}
    codes = [f.code for f in res.findings]
    assert codes.count("OM700") == 2, codes
    om710 = [c for e in res.entries for c in (e.get("findings") or [])
             if c["code"] == "OM710"]
    assert len(om710) == 1 and "decoded tokens differ" in om710[0]["message"]
    assert res.exit_code == 1
