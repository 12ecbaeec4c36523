"""The child side of the sandbox: load an ONNX model in ONNX Runtime, run it, write results.

Run as ``python _sandbox_worker.py REQUEST_DIR [MEMORY_LIMIT [serve]]``: one request, or with
``serve`` one request after another (sandbox.Server) until the parent kills it. Imports only
numpy and onnxruntime (never torch), writes its phase to ``phase`` before each step so the
parent can tell where a hang or crash happened, and outputs as .npz files (no pickles) plus
``result.json``.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
import traceback


def _die_with_parent() -> None:
    """Ask Linux to kill this process when the parent dies: no orphans, whatever happens."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except Exception:
        pass


TF32_OFF = {"use_tf32": "0"}  # ONNX Runtime CUDA provider option
# ONNX Runtime CUDA provider option: the second run captures the kernels in a CUDA graph,
# later runs replay it (one launch) - on the buffers bound at the capture
CUDA_GRAPH = {"enable_cuda_graph": "1"}
MAX_WARMUP_RUNS = 10000  # a timed warm-up (warmup_seconds) stops here however fast the runs
# sandbox.LEAN_FOLD_BYTES and sandbox.LEAN_DISABLED (this script imports nothing of onnxmedic)
LEAN_FOLD_BYTES = 1 << 20
LEAN_DISABLED = ("TransposeOptimizer",)


def _phase(req_dir: str, text: str) -> None:
    with open(os.path.join(req_dir, "phase"), "w") as f:
        f.write(text)


_MODEL = [""]  # the model of the request being served (for _fault's "@" filter)


def _fault(phase: str) -> None:
    """Fault injection for onnxmedic's own tests of the sandbox (ONNXMEDIC_SANDBOX_FAULT:
    ``kind:phase``, or ``kind:phase@text`` - only for models whose path holds ``text``)."""
    want, _, only = os.environ.get("ONNXMEDIC_SANDBOX_FAULT", "").partition("@")
    if not want or not want.endswith(":" + phase) or only and only not in _MODEL[0]:
        return
    kind = want.split(":", 1)[0]
    if kind == "abort":
        os.abort()
    if kind == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if kind == "hang":
        while True:
            time.sleep(1)
    if kind == "oom":
        hog = []
        while True:
            hog.append(bytearray(256 * 1024 * 1024))


def _to_saveable(a):
    import numpy as np

    a = np.asarray(a)
    if a.dtype.kind == "V" or "bfloat16" in str(a.dtype) or "float8" in str(a.dtype):
        return a.view(np.uint8 if a.dtype.itemsize == 1 else np.uint16), str(a.dtype)
    return a, str(a.dtype)


# more outputs than this in one run are written packed (see _pack)
PACK_MIN = 16


def _pack(np, arrays, path):
    """Write ``arrays`` back to back to ``path``; returns [storage dtype, shape, offset] each
    (the reader views them in one buffer)."""
    meta, offset = [], 0
    with open(path, "wb") as f:
        for a in arrays:
            data = a.tobytes()  # C order whatever the strides
            f.write(data)
            meta.append([a.dtype.str, list(a.shape), offset])
            offset += len(data)
    return meta


def _from_saved(a, dtype: str):
    import numpy as np

    if dtype == str(a.dtype):
        return a
    import ml_dtypes

    return a.view(getattr(ml_dtypes, dtype)) if hasattr(ml_dtypes, dtype) else a.astype(np.dtype(dtype))


# numpy dtype name -> (ONNX element type, storage dtype) for types numpy cannot hand to ORT
_ODD = {"bfloat16": (16, "uint16"), "float8_e4m3fn": (17, "uint8"), "float8_e4m3fnuz": (18, "uint8"),
        "float8_e5m2": (19, "uint8"), "float8_e5m2fnuz": (20, "uint8")}
_ODD_BY_ORT = {"tensor(bfloat16)": "bfloat16", "tensor(float8e4m3fn)": "float8_e4m3fn",
               "tensor(float8e4m3fnuz)": "float8_e4m3fnuz", "tensor(float8e5m2)": "float8_e5m2",
               "tensor(float8e5m2fnuz)": "float8_e5m2fnuz"}


def to_ortvalue(ort, np, a):
    # np.ascontiguousarray would turn a 0-d array into shape (1,): copy only when needed
    a = a if a.flags.c_contiguous else a.copy(order="C")
    name = str(a.dtype)
    if name in _ODD:
        code, storage = _ODD[name]
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a.view(storage), code)
    return ort.OrtValue.ortvalue_from_numpy(a)


def from_ortvalue(np, v):
    try:
        return v.numpy()
    except Exception:
        name = _ODD_BY_ORT.get(v.data_type())
        if name is None:
            raise
        import ctypes

        import ml_dtypes

        raw = ctypes.string_at(v.data_ptr(), v.tensor_size_in_bytes())
        return np.frombuffer(raw, dtype=getattr(ml_dtypes, name)).reshape(v.shape()).copy()


def _probe_opset(ort) -> int | None:
    """The highest default-domain opset this ONNX Runtime loads (a one-Relu model per try)."""
    try:
        import onnx
        from onnx import TensorProto, helper
    except ImportError:
        return None
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe", [x], [y])
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    for version in range(onnx.defs.onnx_opset_version() + 2, 6, -1):
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", version)])
        m.ir_version = 10
        try:
            ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
            return version
        except Exception:
            continue
    return None


def _wait_for_request(req_dir: str) -> dict:
    """The parent starts this process early and writes request.json (atomically) later."""
    path = os.path.join(req_dir, "request.json")
    delay = 0.002
    while not os.path.exists(path):
        time.sleep(delay)
        delay = min(delay * 1.5, 0.02)
    with open(path) as f:
        req = json.load(f)
    os.remove(path)  # taken: a serving worker then waits for the next one
    return req


def _finish(req_dir: str, result: dict, code: int = 0) -> int:
    """Write ``result`` to result.json (atomically); returns ``code``."""
    tmp = os.path.join(req_dir, "result.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(req_dir, "result.json"))
    return code


def limit_memory(limit: int) -> None:
    """Cap this process's address space at ``limit`` bytes (0: no cap), as the first thing it
    does: the soft limit; the hard one stays as it was, so that a lean session can add its
    memory-mapped weights (_map_allowance)."""
    if not limit:
        return
    try:
        import resource

        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        soft = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    except (ImportError, ValueError, OSError):
        pass


def _map_allowance(req: dict) -> None:
    """A lean session memory-maps the external data file: file pages the kernel can drop, not
    allocations. The address-space cap (the soft RLIMIT_AS limit_memory set) grows by the
    mapped bytes so that it still bounds what ONNX Runtime allocates."""
    extra = int(req.get("mapped_bytes") or 0)
    if not (req.get("lean") and extra):
        return
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY:
            return
        soft += extra
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    except (ImportError, ValueError, OSError):
        pass


def load_session(ort, req_dir: str, req: dict, result: dict):
    """The InferenceSession for the request's model, or None with the failure in ``result``."""
    _phase(req_dir, "load")
    _fault("load")
    t0 = time.perf_counter()
    try:
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if req.get("threads"):
            opts.intra_op_num_threads = int(req["threads"])
        if req.get("disable_optimizations"):
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        for key, value in (req.get("session_config") or {}).items():
            opts.add_session_config_entry(str(key), str(value))
        disabled = []
        if req.get("no_prepack"):
            opts.add_session_config_entry("session.disable_prepacking", "1")
        if req.get("lean"):  # sandbox.lean_session says why each
            opts.add_session_config_entry(
                "optimization.constant_folding_max_output_size_in_bytes", str(LEAN_FOLD_BYTES))
            opts.add_session_config_entry("session.disable_prepacking", "1")
            opts.enable_cpu_mem_arena = False
            opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED
            if not req.get("disable_optimizations"):
                opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
                disabled = list(LEAN_DISABLED)
        providers = req.get("providers") or ["CPUExecutionProvider"]
        cuda: dict = {}
        # verification compares with PyTorch, whose CUDA matmuls and convolutions are full
        # float32 by default (torch.backends.cuda.matmul.allow_tf32 = False); ONNX Runtime's
        # CUDA provider uses TF32 by default, 1e-4..1e-3 relative off (bench/gpu/gpu_check.py)
        if not req.get("cuda_tf32"):  # timings ask for the deployed default instead
            cuda.update(TF32_OFF)
        cuda.update(req.get("cuda_options") or {})  # e.g. prefer_nhwc (optimize's twins)
        if req.get("graph"):  # the session that times with fixed buffers (_time_runs)
            cuda.update(CUDA_GRAPH)
        if cuda:
            providers = [(p, dict(cuda)) if p == "CUDAExecutionProvider" else p
                         for p in providers]
        sess = ort.InferenceSession(req["model"], opts, providers=providers,
                                    disabled_optimizers=disabled or None)
    except MemoryError:
        result.update(status="oom", phase="load", error="MemoryError while loading")
        return None
    except Exception as e:
        msg = f"{type(e).__name__}: {e}"
        oom = "bad_alloc" in msg or "Failed to allocate" in msg
        result.update(status="oom" if oom else "load_error", phase="load", error=msg[:4000])
        return None
    # the request's sessions together (a CUDA-graph timing loads a second one)
    result["load_seconds"] = result.get("load_seconds", 0.0) + time.perf_counter() - t0
    return sess


def _value_infos(values) -> list:
    """Name, type and shape (symbolic dimensions as strings) of session inputs or outputs."""
    return [
        {"name": v.name, "type": v.type, "shape": [d if isinstance(d, int) else str(d)
                                                   for d in (v.shape or [])]}
        for v in values
    ]


def _save_outputs(np, req_dir: str, i: int, outs: list, elapsed: float) -> dict:
    """Write run ``i``'s outputs (out_i.npz, or packed in out_i.bin); returns the run's
    record."""
    saved, dts = {}, []
    for j, o in enumerate(outs):
        arr, dt = _to_saveable(o)
        saved[f"o{j}"] = arr
        dts.append(dt)
    run = {"seconds": elapsed, "dtypes": dts}
    if len(saved) > PACK_MIN and all(a.dtype.kind in "biufc" for a in saved.values()):
        # many outputs (localisation exposes thousands): one raw file, not a zip member
        # per array (about 0.2 ms each to write and as much to read)
        run["packed"] = _pack(np, list(saved.values()),
                              os.path.join(req_dir, f"out_{i}.bin"))
    else:
        np.savez(os.path.join(req_dir, f"out_{i}.npz"), **saved)
    return run


def _run_feeds(np, ort, sess, req_dir: str, req: dict, result: dict,
               first: list | None = None) -> bool:
    """Run the session on each feed file, recording the runs in ``result``; False when a
    failure (out of memory, or an error on a required input set) ended them, its status in
    ``result``. An optional input set's error is recorded in its run and the rest go on.
    ``first`` receives feed 0's outputs."""
    runs = []
    n_required = int(req.get("n_required", req.get("n_feeds", 0)))
    for i in range(int(req.get("n_feeds", 0))):
        _phase(req_dir, f"run:{i}")
        _fault("run")
        with np.load(os.path.join(req_dir, f"feed_{i}.npz"), allow_pickle=False) as data:
            dtypes = req["feed_dtypes"][i]
            feeds = {k: _from_saved(data[k], dtypes[k]) for k in data.files}
        t0 = time.perf_counter()
        try:
            ort_feeds = {k: to_ortvalue(ort, np, v) for k, v in feeds.items()}
            outs = [from_ortvalue(np, v) for v in sess.run_with_ort_values(None, ort_feeds)]
        except MemoryError:
            result.update(status="oom", phase=f"run:{i}", error="MemoryError while running")
            result["runs"] = runs
            return False
        except Exception as e:
            msg = f"{type(e).__name__}: {e}"
            oom = "bad_alloc" in msg or "Failed to allocate" in msg
            if oom or i < n_required:
                result.update(status="oom" if oom else "run_error", phase=f"run:{i}",
                              error=msg[:4000])
                result["runs"] = runs
                return False
            # an optional input set (another shape): record its error and go on
            runs.append({"seconds": 0.0, "dtypes": [], "error": msg[:4000]})
            continue
        runs.append(_save_outputs(np, req_dir, i, outs, time.perf_counter() - t0))
        if i == 0 and first is not None:
            first.extend(outs)
    result["runs"] = runs
    return True


def bind_io(ort, np, sess, feeds: dict, outputs: list | None = None):
    """An IOBinding of ``feeds`` on the session's device: on a CUDA session the inputs are
    copied to the GPU once and the outputs stay there, so a run's time is the GPU's work, not
    host copies (bfloat16/float8 inputs stay host values: numpy cannot hand them to the GPU,
    ONNX Runtime copies them per run). ``outputs`` (arrays shaped as the session's outputs):
    the outputs are bound to buffers allocated once, like the inputs - every run reads and
    writes the same addresses, as a CUDA graph's replay needs. Returns (binding, device)."""
    device = "cuda" if "CUDAExecutionProvider" in sess.get_providers() else "cpu"
    binding = sess.io_binding()

    def placed(v, copy: bool = False):
        if device == "cuda" and str(v.dtype) not in _ODD:
            v = v if v.flags.c_contiguous else v.copy(order="C")  # keeps a 0-d array 0-d
            return ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0)
        # a host value; it shares the array's memory, so an output buffer gets its own copy
        return to_ortvalue(ort, np, np.array(v, order="C") if copy else v)

    for k, v in feeds.items():
        binding.bind_ortvalue_input(k, placed(v))
    for j, o in enumerate(sess.get_outputs()):
        arr = outputs[j] if outputs is not None and j < len(outputs) else None
        if arr is not None and str(arr.dtype) not in _ODD:
            binding.bind_ortvalue_output(o.name, placed(arr, copy=True))
        else:
            binding.bind_output(o.name, device)
    return binding, device


def _time_runs(np, ort, sess, req_dir: str, req: dict, result: dict,
               first: list | None = None) -> bool:
    """Time the session on feed 0 (``req["timing"]``: warmup, repeats, iobinding, graph): the
    inputs are converted once, with ``iobinding`` bound on the session's device
    (:func:`bind_io`). ``graph``: outputs bound to fixed buffers shaped as ``first`` (feed 0's
    outputs), on a CUDA session captured as a CUDA graph (``sess`` was loaded so); the outputs
    of the last timed run are saved (out_timing), to check what the replays compute.
    ``result["timing"]``: the timed runs' seconds, after ``warmup`` discarded ones - and more
    until ``warmup_seconds`` have passed (a GPU's clocks rise from idle over such a time)."""
    _phase(req_dir, "timing")
    _fault("timing")
    t = req["timing"]
    graph = bool(t.get("graph"))
    with np.load(os.path.join(req_dir, "feed_0.npz"), allow_pickle=False) as data:
        dtypes = req["feed_dtypes"][0]
        feeds = {k: _from_saved(data[k], dtypes[k]) for k in data.files}
    device = "cpu"
    seconds = []
    binding = None
    try:
        if t.get("iobinding") or graph:
            binding, device = bind_io(ort, np, sess, feeds, first if graph else None)

            def once():
                # Run synchronises the providers' streams before it returns
                sess.run_with_iobinding(binding)
        else:
            ort_feeds = {k: to_ortvalue(ort, np, v) for k, v in feeds.items()}

            def once():
                sess.run_with_ort_values(None, ort_feeds)
        warm, until = 0, time.perf_counter() + float(t.get("warmup_seconds") or 0)
        while warm < int(t.get("warmup", 0)) or (time.perf_counter() < until
                                                  and warm < MAX_WARMUP_RUNS):
            once()
            warm += 1
        for _ in range(int(t.get("repeats", 1))):
            t0 = time.perf_counter()
            once()
            seconds.append(time.perf_counter() - t0)
        timing = {"seconds": seconds, "device": device, "iobinding": binding is not None,
                  "graph": graph, "warmup_runs": warm}
        if graph:
            outs = [from_ortvalue(np, v) for v in binding.get_outputs()]
            if os.environ.get("ONNXMEDIC_SANDBOX_FAULT") == "corrupt:timing":
                outs = [o + 1 if o.dtype.kind == "f" else o for o in outs]  # tests' fault
            timing["run"] = _save_outputs(np, req_dir, "timing", outs, 0.0)
    except Exception as e:
        msg = f"{type(e).__name__}: {e}"
        oom = "bad_alloc" in msg or "Failed to allocate" in msg
        result.update(status="oom" if oom else "run_error", phase="timing", error=msg[:4000])
        return False
    result["timing"] = timing
    return True


def main(req_dir: str, serve: bool = False) -> int:
    """Serve one request in ``req_dir`` (with ``serve``, one after another until killed): load
    the model, run it on each feed, write result.json (and the outputs). Returns the exit
    code."""
    _die_with_parent()
    _phase(req_dir, "import")
    t0 = time.perf_counter()
    import numpy as np
    import onnxruntime as ort

    started = time.perf_counter() - t0
    while True:
        _phase(req_dir, "wait")
        req = _wait_for_request(req_dir)
        cap = _address_cap()
        code = _serve(np, ort, req_dir, req, started)
        if not serve:
            return code
        started = 0.0
        _restore_cap(cap)  # a lean request raised it by its mapped weights (_map_allowance)
        gc.collect()


# what decides a session: a request with ``keep_session`` whose key is the kept one's reuses it
_SESSION_KEYS = ("model", "lean", "providers", "threads", "disable_optimizations", "cuda_tf32",
                 "cuda_options", "no_prepack", "session_config")
_KEPT: dict = {}  # a serving worker's kept session: {"key": ..., "sess": ...}


def _session_key(req: dict):
    """The request's session: its options and the model's files (path, size, mtime - a file
    written again is loaded again)."""
    files = []
    model = str(req.get("model", ""))
    folder = os.path.dirname(model)
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        if path == model or name.startswith(os.path.basename(model)) or name.endswith(".data"):
            st = os.stat(path)
            files.append((name, st.st_size, st.st_mtime_ns))
    return json.dumps([req.get(k) for k in _SESSION_KEYS] + [files], sort_keys=True)


def _session(ort, req_dir: str, req: dict, result: dict):
    """The request's session: the kept one when the request asks to keep it and it is the
    same (_session_key), else a new one - kept for the next request with ``keep_session``."""
    key = _session_key(req) if req.get("keep_session") else None
    if key is not None and _KEPT.get("key") == key:
        _phase(req_dir, "load")
        result["session_reused"] = True
        return _KEPT["sess"]
    _KEPT.clear()  # one copy of the weights at a time
    sess = load_session(ort, req_dir, req, result)
    if sess is not None and key is not None:
        _KEPT.update(key=key, sess=sess)
    return sess


def _serve(np, ort, req_dir: str, req: dict, started: float) -> int:
    """One request: the session, each feed, the timing; result.json last."""
    _MODEL[0] = str(req.get("model", ""))
    result: dict = {"status": "ok", "phase": "import", "import_seconds": started}
    result["ort_version"] = ort.__version__
    result["lean"] = bool(req.get("lean"))
    if req.get("probe_opset"):
        result["max_opset"] = _probe_opset(ort)
    _map_allowance(req)
    sess = _session(ort, req_dir, req, result)
    if sess is None:
        return _finish(req_dir, result)
    result["inputs"] = _value_infos(sess.get_inputs())
    result["outputs"] = _value_infos(sess.get_outputs())
    result["providers"] = sess.get_providers()
    first: list = []
    if not _run_feeds(np, ort, sess, req_dir, req, result, first):
        _KEPT.clear()  # a failed run retires the child (sandbox.Server) and its session
        return _finish(req_dir, result)
    timing = req.get("timing") or {}
    if timing.get("graph"):
        # a second session, loaded for the fixed-buffer (CUDA graph) timing: a captured
        # graph replays the buffers of its capture, so the feeds above ran without one
        sess = None  # one copy of the weights at a time
        _KEPT.clear()
        sess = load_session(ort, req_dir, dict(req, graph=True), result)
        if sess is None:
            return _finish(req_dir, result)
    if timing and not _time_runs(np, ort, sess, req_dir, req, result, first):
        return _finish(req_dir, result)
    sess = None  # released before the parent reads the result (a serving worker's next)
    result["phase"] = "done"
    _phase(req_dir, "done")
    return _finish(req_dir, result)


def _address_cap():
    """The address-space limits now (None where they cannot be read)."""
    try:
        import resource

        return resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, ValueError, OSError):
        return None


def _restore_cap(cap) -> None:
    if cap is None:
        return
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, cap)
    except (ImportError, ValueError, OSError):
        pass


if __name__ == "__main__":
    # Run as a script: drop this package's folder from the path so that none of onnxmedic's
    # module names (inputs, report, ...) can shadow what numpy or onnxruntime import.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    limit_memory(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    try:
        sys.exit(main(sys.argv[1], serve=sys.argv[3:4] == ["serve"]))
    except Exception:
        traceback.print_exc()
        sys.exit(70)
