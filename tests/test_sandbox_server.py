"""sandbox.Server / sandbox.reuse: one kept child serves runs one after another, and reuse never
changes a verdict (a failure in a reused child is run again in a fresh one)."""

from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest

from onnxmedic import sandbox
from tests import onnx_models as om

X = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
# the sandbox's own children, one per run as outside the suite (conftest's keep_warm off)
pytestmark = pytest.mark.own_sandbox_children


def _pid(server: sandbox.Server) -> int | None:
    child = server.child
    return child.proc.pid if child is not None and child.proc is not None else None


def _address_cap(pid: int) -> str:
    """The soft 'Max address space' limit of a process, as /proc shows it."""
    text = open(f"/proc/{pid}/limits").read()
    return re.search(r"Max address space\s+(\S+)", text).group(1)


def test_kept_child_serves_runs_one_after_another(tmp_path):
    a = om.scaled_model(tmp_path / "a.onnx", 2.0)
    b = om.scaled_model(tmp_path / "b.onnx", 3.0)
    with sandbox.Server() as server:
        first = server.run(a, [X])
        pid = _pid(server)
        runs = [server.run(b, [X, {"x": X["x"] + 1}]),
                server.run(a, [X], timing={"warmup": 1, "repeats": 3, "graph": True}),
                server.run(b, [X], threads=1)]
        assert _pid(server) == pid  # one process served all four
        folder = server.child.dir
    assert first.ok and all(r.ok for r in runs), [r.summary() for r in runs]
    np.testing.assert_array_equal(first.outputs[0][0], X["x"] * 2)
    np.testing.assert_array_equal(runs[0].outputs[1][0], (X["x"] + 1) * 3)  # no stale files
    np.testing.assert_array_equal(runs[1].timed_outputs[0], X["x"] * 2)
    assert len(runs[1].timed_seconds) == 3 and len(runs[2].outputs) == 1
    assert first.import_seconds > 0 and all(r.import_seconds == 0 for r in runs)
    assert server.stats["runs"] == 4 and server.stats["children"] == 1
    assert not os.path.exists(f"/proc/{pid}") and not folder.exists()  # closed: killed, removed


@pytest.mark.parametrize(("fault", "status"), [("segv:run", "crash"), ("abort:load", "crash"),
                                               ("oom:run", "oom")])
def test_failure_in_a_reused_child_is_run_again_in_a_fresh_one(tmp_path, monkeypatch, fault,
                                                                status):
    """The fault hits only bad.onnx: its verdict in a kept child equals a one-shot child's, the
    run was tried twice (the second time in a fresh child), and the next run still works."""
    monkeypatch.setenv("ONNXMEDIC_SANDBOX_FAULT", f"{fault}@bad.onnx")
    good = om.identity_model(tmp_path / "good.onnx")
    bad = om.identity_model(tmp_path / "bad.onnx")
    alone = sandbox.run_model(bad, [X], memory_limit=2 * 1024**3, timeout=60)
    with sandbox.Server(memory_limit=2 * 1024**3) as server:
        assert server.run(good, [X]).ok
        pid = _pid(server)
        r = server.run(bad, [X], timeout=60)
        assert server.stats == {**server.stats, "runs": 3, "children": 2}
        assert _pid(server) is None and not os.path.exists(f"/proc/{pid}")  # retired
        after = server.run(good, [X])
        assert after.ok and server.stats["children"] == 3
    assert r.status == alone.status == status
    assert r.summary() == alone.summary() and r.signal == alone.signal


def test_run_error_retires_the_child_and_keeps_the_verdict(tmp_path):
    """An error ONNX Runtime raises (it could leave a CUDA context poisoned) retires the child;
    the verdict is the one a one-shot child gives."""
    p = om.identity_model(tmp_path / "m.onnx")
    wrong = {"x": np.zeros((5, 7), np.float32)}
    alone = sandbox.run_model(p, [wrong])
    with sandbox.Server() as server:
        assert server.run(p, [X]).ok
        r = server.run(p, [wrong])
        assert server.stats["runs"] == 3 and server.child is None
        assert server.run(p, [X]).ok and server.stats["children"] == 3
    assert r.status == alone.status == "run_error"
    assert r.finding().code == "OM511" and r.summary() == alone.summary()


def test_timeout_in_a_kept_child_is_not_run_again(tmp_path):
    """A hang is killed at the timeout once (a second try would double the wait); the next run
    gets a fresh child."""
    good = om.identity_model(tmp_path / "good.onnx")
    hang = om.endless_loop_model(tmp_path / "hang.onnx")
    with sandbox.Server() as server:
        assert server.run(good, [X]).ok
        pid = _pid(server)
        t0 = time.perf_counter()
        r = server.run(hang, [X], timeout=4)
        elapsed = time.perf_counter() - t0
        assert r.status == "timeout" and r.finding(timeout=4).code == "OM512"
        assert r.phase == "run:0"
        assert elapsed < 4 + 20 and server.stats["runs"] == 2
        assert not os.path.exists(f"/proc/{pid}")  # killed and reaped
        assert server.run(good, [X]).ok and server.stats["children"] == 2


def test_a_lean_run_leaves_the_kept_childs_cap_as_it_was(tmp_path):
    """A lean session raises the child's address-space cap by its mapped weights
    (_map_allowance); a kept child puts it back before the next request."""
    p = om.external_data_model(tmp_path / "w.onnx", "w.onnx.data")
    (tmp_path / "w.onnx.data").write_bytes(np.ones(6, np.float32).tobytes() * 2**14)
    with sandbox.Server(memory_limit=4 * 1024**3) as server:
        assert server.run(p, [X]).ok
        pid = _pid(server)
        before = _address_cap(pid)
        assert server.run(p, [X], lean=True).ok and _pid(server) == pid
        time.sleep(0.05)  # the child restores the cap right after writing its result
        assert _address_cap(pid) == before == str(4 * 1024**3)


def test_reuse_routes_run_model_and_nests(tmp_path):
    p = om.scaled_model(tmp_path / "m.onnx", 2.0)
    with sandbox.reuse() as outer:
        with sandbox.reuse() as inner:
            assert inner is outer
            assert sandbox.run_model(p, [X]).ok
        assert sandbox.run_model(p, [X]).ok
        assert outer.stats["runs"] == 2 and outer.stats["children"] == 1
        assert sandbox.run_model(p, [X], memory_limit=2 * 1024**3).ok  # its own cap: one-shot
        assert sandbox.run_model(p, [X], fresh=True).ok  # asked for a child of its own
        assert outer.stats["runs"] == 4 and outer.stats["children"] == 3  # counted all the same
        mark = outer.mark()  # what a nested caller (optimize in bench/optimize/optimize.py) reports
        assert sandbox.run_model(p, [X]).ok
        since = outer.since(mark)
        assert (since["runs"], since["children"], since["import_seconds"]) == (1, 1, 0)
        assert 0 < since["load_seconds"] < since["wall_seconds"]
    assert outer.child is None and sandbox.active_server() is None


def test_ctrl_c_while_a_kept_child_runs_leaves_no_child_or_folder(tmp_path):
    """KeyboardInterrupt while a kept child serves (a hang here): the child is killed and its
    request folder removed before the interrupt propagates."""
    import signal
    import subprocess
    import sys

    hang = om.endless_loop_model(tmp_path / "hang.onnx")
    script = tmp_path / "run.py"
    script.write_text(
        "import signal, sys, numpy as np\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from onnxmedic import sandbox\n"
        "x = {'x': np.zeros((2, 3), np.float32)}\n"
        "try:\n"
        "    with sandbox.reuse() as s:\n"
        "        sandbox.run_model(sys.argv[1], [x], timeout=120)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
        "    sys.exit(130)\n")
    p = subprocess.Popen([sys.executable, str(script), str(hang)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        child = None
        deadline = time.time() + 60
        while child is None and time.time() < deadline:
            ps = subprocess.run(["ps", "-ww", "-eo", "pid,ppid,args"], capture_output=True,
                                text=True).stdout
            for line in ps.splitlines()[1:]:
                pid, ppid, args = line.split(None, 2)
                if ppid == str(p.pid) and "_sandbox_worker" in args and "serve" in args:
                    child = (pid, args.split()[-3])  # its pid and request folder
            time.sleep(0.2)
        assert child is not None
        phase = os.path.join(child[1], "phase")
        while time.time() < deadline and not (os.path.exists(phase)
                                              and open(phase).read() == "run:0"):
            time.sleep(0.1)  # the kept child is running the hanging model
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130 and "interrupted" in out, err
    time.sleep(0.5)
    assert child[0] not in subprocess.run(["ps", "-eo", "pid"], capture_output=True,
                                          text=True).stdout.split()
    assert not os.path.exists(child[1])


def test_timings_take_a_fresh_child_inside_reuse(tmp_path):
    """optimize's timing runs (time_variants) never run in the kept child: a model loaded into a
    process earlier sessions used runs at another speed than in the fresh process a deployment
    loads it into."""
    from onnxmedic.optimize import time_variants

    p = om.scaled_model(tmp_path / "m.onnx", 2.0)
    with sandbox.reuse() as server:
        assert sandbox.run_model(p, [X]).ok  # a kept child now serves
        kept = _pid(server)
        times = time_variants({"a": p, "b": p}, X, repeats=2, rounds=2)
        assert set(times) == {"a", "b"} and _pid(server) == kept
        assert server.stats["runs"] == 5 and server.stats["children"] == 5  # 1 kept + 4 fresh


def test_a_kept_session_serves_the_steps_of_a_loop(tmp_path):
    """keep_session: the session of the first run serves the next runs of the same file with
    the same options (a generation loop's steps); another file, other options or the file
    written again load a new session, and the outputs are the same either way."""
    a = om.scaled_model(tmp_path / "a.onnx", 2.0)
    b = om.scaled_model(tmp_path / "b.onnx", 3.0)
    with sandbox.reuse():
        runs = [sandbox.run_model(a, [X], keep_session=True) for _ in range(3)]
        other = sandbox.run_model(b, [X], keep_session=True)
        threads = sandbox.run_model(b, [X], keep_session=True, threads=1)
        plain = sandbox.run_model(b, [X], threads=1)
        om.scaled_model(tmp_path / "a.onnx", 5.0)  # the same path, written again
        again = sandbox.run_model(a, [X], keep_session=True)
    assert [r.session_reused for r in runs] == [False, True, True]
    assert runs[1].load_seconds == 0 < runs[0].load_seconds
    assert not other.session_reused and not threads.session_reused
    assert not plain.session_reused and not again.session_reused
    for r in runs:
        np.testing.assert_array_equal(r.outputs[0][0], X["x"] * 2)
    np.testing.assert_array_equal(plain.outputs[0][0], X["x"] * 3)
    np.testing.assert_array_equal(again.outputs[0][0], X["x"] * 5)


def test_a_child_started_ahead_serves_the_first_run(tmp_path):
    """start(): the kept child is started before any run (its ONNX Runtime imported while the
    caller waits for something else); the first run goes to it and is counted as the run
    that took a child; closing without a run leaves no child or folder."""
    p = om.scaled_model(tmp_path / "m.onnx", 2.0)
    with sandbox.reuse() as server:
        server.start()
        pid = _pid(server)
        assert pid is not None and os.path.exists(f"/proc/{pid}")
        server.start()  # already there: the same child
        assert _pid(server) == pid
        out = sandbox.run_model(p, [X])
        assert out.ok and _pid(server) == pid and out.import_seconds > 0
        assert server.stats["runs"] == 1 and server.stats["children"] == 1
        folder = server.child.dir
    assert not os.path.exists(f"/proc/{pid}") and not folder.exists()
    idle = sandbox.Server()
    idle.start()
    pid, folder = _pid(idle), idle.child.dir
    idle.close()
    assert not os.path.exists(f"/proc/{pid}") and not folder.exists()


def _serving() -> set[int]:
    """The pids of this process's serving sandbox children (kept ones: keep_warm's, a
    Server's)."""
    me, out = os.getpid(), set()
    for tid in os.listdir(f"/proc/{me}/task"):
        with open(f"/proc/{me}/task/{tid}/children") as fh:
            for pid in fh.read().split():
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as c:
                        args = c.read().split(b"\0")
                except OSError:  # gone meanwhile
                    continue
                if any(a.endswith(b"_sandbox_worker.py") for a in args) and b"serve" in args:
                    out.add(int(pid))
    return out


def test_keep_warm_serves_runs_and_exports_in_one_idle_child(tmp_path, monkeypatch):
    """Inside keep_warm, run_model outside reuse() and export's verification (sandbox.worker:
    a Leased run) take the one idle child and give it back; a changed os.environ starts a
    new one, as a one-shot child would start in it."""
    import torch

    import onnxmedic
    from tests.models import TwoLinear

    a = om.scaled_model(tmp_path / "a.onnx", 2.0)
    own = sandbox.worker()
    assert isinstance(own, sandbox.Worker)  # outside keep_warm: a child of its own
    own.close()
    model = TwoLinear()
    with sandbox.keep_warm():
        leased = sandbox.worker()
        assert isinstance(leased, sandbox.Leased)
        leased.close()
        # (torch sets TORCHINDUCTOR_CACHE_DIR in os.environ on a process's first export)
        r = onnxmedic.export(model, (torch.randn(2, 10),), tmp_path / "m.onnx")
        kept = _serving()
        assert r.ok and r.stages["runtime"] == "passed" and len(kept) == 1
        first = sandbox.run_model(a, [X])
        assert first.ok and _serving() == kept
        np.testing.assert_array_equal(first.outputs[0][0], X["x"] * 2)
        v = onnxmedic.verify(tmp_path / "m.onnx", model, (torch.randn(2, 10),))
        assert v.ok and _serving() == kept
        with sandbox.reuse() as server:  # a reuse() block's first run takes it too
            assert sandbox.run_model(a, [X]).ok and _serving() == kept
            assert server.stats["children"] == 1
        monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test (call)")  # set per test
        assert sandbox.run_model(a, [X]).ok and _serving() == kept
        monkeypatch.setenv("ONNXMEDIC_TEST_ENV", "changed")
        again = sandbox.run_model(a, [X])
        assert again.ok and len(_serving()) == 1 and not _serving() & kept
        (old,) = kept
        assert not os.path.exists(f"/proc/{old}")  # killed and reaped


def test_keep_warm_keeps_a_one_shot_childs_verdict(tmp_path, monkeypatch):
    """A crash in the idle child, which served before, is run again in a fresh one (the
    verdict is the one-shot child's); the next run still works. A run with a cap of its own
    and a run in another thread start children of their own."""
    import threading

    monkeypatch.setenv("ONNXMEDIC_SANDBOX_FAULT", "segv:run@bad.onnx")
    good = om.identity_model(tmp_path / "good.onnx")
    bad = om.identity_model(tmp_path / "bad.onnx")
    alone = sandbox.run_model(bad, [X], memory_limit=2 * 1024**3, timeout=60)
    with sandbox.keep_warm():
        assert sandbox.run_model(good, [X]).ok
        kept = _serving()
        with sandbox.reuse() as server:
            r = sandbox.run_model(bad, [X], timeout=60)
            assert server.stats["runs"] == 2 and server.stats["children"] == 2
        assert r.status == alone.status == "crash" and r.summary() == alone.summary()
        assert sandbox.run_model(good, [X]).ok
        idle = _serving()
        assert len(idle) == 1 and not idle & kept
        with sandbox.Server(memory_limit=2 * 1024**3) as capped:
            assert capped.run(good, [X]).ok and capped.child.proc.pid not in idle
            assert _serving() == idle | {capped.child.proc.pid}
        kinds = []

        def in_a_thread():
            w = sandbox.worker()
            kinds.append(type(w))
            w.close()

        t = threading.Thread(target=in_a_thread)
        t.start()
        t.join()
        assert kinds == [sandbox.Worker] and _serving() == idle
