"""Hostile inputs against onnxmedic: how many were tried, how many ended in a clear finding, and
how many hung, crashed or leaked an exception (must be 0).

Families: truncated / random / bit-flipped ONNX files (doctor, verify), external data escaping
the model folder, ONNX Runtime hangs / aborts / segfaults / out-of-memory, huge-dimension and
deeply nested models, pickles carrying code, hostile and damaged .pt2 archives, a protobuf over
2 GiB, report paths that are symlinks or folders, and fuzzed spec strings.
Usage: python bench/accuracy/hostile.py [--seed 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import torch  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from onnxmedic import api, inputs  # noqa: E402
from onnxmedic.findings import CODES, InputError  # noqa: E402
from tests import models  # noqa: E402
from tests import onnx_models as om  # noqa: E402

TIME_LIMIT = 60.0  # any single attempt slower than this counts as a hang


class Tally:
    def __init__(self) -> None:
        self.rows: dict[str, Counter[str]] = defaultdict(Counter)
        self.examples: dict[str, str] = {}

    def attempt(self, family: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            outcome = fn()
        except InputError as e:
            outcome = f"finding:{e.finding.code}"
        except Exception as e:  # an exception escaping onnxmedic is a failure of onnxmedic
            outcome = "leaked"
            self.examples.setdefault(family, f"{type(e).__name__}: {e}"[:200])
        if time.perf_counter() - t0 > TIME_LIMIT:
            outcome = "hang"
        self.rows[family][outcome.split(":")[0]] += 1


def _result_outcome(r) -> str:
    errors = [f for f in r.findings if f.severity.value == "error"]
    if errors:
        code = errors[0].code
        assert code in CODES
        return "crashed" if code == "OM009" else f"finding:{code}"
    return "accepted"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    tally = Tally()
    tmp = Path(tempfile.mkdtemp(prefix="onnxmedic-hostile-"))
    good = om.identity_model(tmp / "good.onnx")
    data = good.read_bytes()
    x = (torch.randn(2, 3),)

    # 1. truncated files, 2. random bytes, 3. bit flips (doctor, and verify for some)
    for i in range(25):
        p = tmp / f"trunc{i}.onnx"
        p.write_bytes(data[: rng.randrange(0, len(data))])
        tally.attempt("truncated .onnx (doctor)", lambda p=p: _result_outcome(
            api.doctor(p, timeout=10)))
    for i in range(10):
        p = tmp / f"rand{i}.onnx"
        p.write_bytes(os.urandom(rng.randrange(1, 4096)))
        tally.attempt("random bytes (verify)", lambda p=p: _result_outcome(
            api.verify(p, models.Identity(), x, timeout=10)))
    for i in range(25):
        b = bytearray(data)
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        p = tmp / f"flip{i}.onnx"
        p.write_bytes(bytes(b))
        tally.attempt("bit-flipped .onnx (doctor)", lambda p=p: _result_outcome(
            api.doctor(p, timeout=10)))

    # 4. external data escaping the folder
    os.symlink("/etc/passwd", tmp / "link.bin")
    for loc in ["../../etc/passwd", "/etc/passwd", "a/../../x", "link.bin", "../" * 20 + "etc"]:
        p = _external(tmp, loc)
        tally.attempt("external data escaping (doctor, run, verify)", lambda p=p: _result_outcome(
            api.doctor(p, timeout=10)))
        tally.attempt("external data escaping (doctor, run, verify)", lambda p=p: _result_outcome(
            api.run(p, [np.zeros((2, 3), np.float32)], timeout=10)))
        tally.attempt("external data escaping (doctor, run, verify)", lambda p=p: _result_outcome(
            api.verify(p, models.Identity(), x, timeout=10)))

    # 5. runtime faults: hang, abort, segfault, out of memory
    hang = om.endless_loop_model(tmp / "hang.onnx")
    for _ in range(3):
        tally.attempt("ONNX Runtime hang", lambda: _result_outcome(
            api.verify(hang, models.Identity(), x, timeout=5)))
    for fault in ["abort:run", "segv:run", "abort:load", "segv:load", "oom:run"]:
        def faulty(fault=fault):
            os.environ["ONNXMEDIC_SANDBOX_FAULT"] = fault
            try:
                return _result_outcome(api.doctor(good, timeout=20))
            finally:
                del os.environ["ONNXMEDIC_SANDBOX_FAULT"]
        tally.attempt("ONNX Runtime abort/segfault/OOM", faulty)
    oom = om.huge_expand_model(tmp / "oom.onnx")
    tally.attempt("ONNX Runtime abort/segfault/OOM", lambda: _result_outcome(
        api.doctor(oom, timeout=30)))

    # 6. huge dimensions and deep nesting
    for dims in ([2**40, 3], [2**31, 2**31], [0, 2**62]):
        p = tmp / f"huge{len(dims)}_{dims[0]}.onnx"
        xi = helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)
        yi = helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)
        m = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                                                [xi], [yi]),
                              opset_imports=[helper.make_opsetid("", 18)])
        m.ir_version = 10
        onnx.save(m, p)
        tally.attempt("huge dims / deep nesting (doctor)", lambda p=p: _result_outcome(
            api.doctor(p, timeout=20)))
    for depth in (10, 20):  # protobuf itself refuses to build much deeper messages
        p = _nested_if(tmp / f"nested{depth}.onnx", depth)
        tally.attempt("huge dims / deep nesting (doctor)", lambda p=p: _result_outcome(
            api.doctor(p, timeout=20)))

    # 7. pickles carrying code
    marker = tmp / "pwned"

    class Evil:
        def __init__(self, fn, arg):
            self.fn, self.arg = fn, arg

        def __reduce__(self):
            return (self.fn, (self.arg,))

    for fn, arg in [(os.system, f"touch {marker}"), (eval, f"open('{marker}', 'w')"),
                    (exec, f"open('{marker}', 'w')")]:
        p = tmp / f"evil{rng.random()}.pt"
        with open(p, "wb") as fh:
            pickle.dump(Evil(fn, arg), fh)
        tally.attempt("pickle with code (.pt input)",
                      lambda p=p: (inputs.load_inputs([str(p)]), "accepted")[1])
    if marker.exists():
        tally.rows["pickle with code (.pt input)"]["code ran"] += 1

    # 8. hostile and damaged .pt2 archives (torch.export.load alone would run their code)
    from tests import hostile_files as hf
    pt2_marker = tmp / "pt2-pwned"
    for attack in hf.PT2_ATTACKS:
        bad = hf.hostile_pt2(tmp / f"{attack}.pt2", attack, pt2_marker)
        tally.attempt(".pt2 with code", lambda b=bad: (inputs.load_model(str(b)), "accepted")[1])
    if pt2_marker.exists():
        tally.rows[".pt2 with code"]["code ran"] += 1
    plain = hf.plain_pt2(tmp / "plain.pt2").read_bytes()
    for i in range(10):
        b = bytearray(plain[: rng.randrange(0, len(plain))] if i % 2 else plain)
        if i % 2 == 0:
            for _ in range(rng.randrange(1, 8)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        p = tmp / f"damaged{i}.pt2"
        p.write_bytes(bytes(b))
        tally.attempt("damaged .pt2", lambda p=p: (inputs.load_model(str(p)), "accepted")[1])

    # 9. a single protobuf over 2 GiB (sparse: costs no disk) and report paths that attack
    huge = tmp / "over2gib.onnx"
    with open(huge, "wb") as fh:
        fh.truncate(2**31 + 1)
    for call in (lambda: api.doctor(huge, timeout=10),
                 lambda: api.verify(huge, models.Identity(), x, timeout=10)):
        tally.attempt("over-2 GiB protobuf", lambda call=call: _result_outcome(call()))
    victim = tmp / "victim.txt"
    victim.write_text("precious")
    (tmp / "link.json").symlink_to(victim)
    (tmp / "dir.json").mkdir()
    for rep in [tmp / "link.json", tmp / "dir.json", tmp / "missing" / "r.html", tmp / "r.exe"]:
        tally.attempt("report path attacks", lambda rep=rep: _result_outcome(
            api.doctor(good, timeout=10, report=rep)))
    if victim.read_text() != "precious":
        tally.rows["report path attacks"]["code ran"] += 1

    # 10. fuzzed spec strings
    alphabet = "0123456789x:@,=.-_ abcdefnoprstu/\\\x00é"
    for _ in range(400):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 25)))
        if ":" in s:  # never import-and-call arbitrary module attributes
            s = s.replace(":", "x", s.count(":") - 1) if s.split(":")[0].replace(
                "x", "").isdigit() else s.replace(":", "")
        tally.attempt("fuzzed input specs", lambda s=s: (inputs.load_inputs([s]), "accepted")[1])
        tally.attempt("fuzzed dynamic specs",
                      lambda s=s: (inputs.parse_dynamic_specs([s]), "accepted")[1])

    _print(tally)
    if a.json:
        Path(a.json).write_text(json.dumps({k: dict(v) for k, v in tally.rows.items()},
                                           indent=2))


def _external(tmp: Path, loc: str) -> Path:
    return om.external_data_model(tmp / f"ext{abs(hash(loc))}.onnx", loc)


def _nested_if(path: Path, depth: int) -> Path:
    """If nodes nested ``depth`` deep: each then-branch holds the next If, each else-branch a
    constant (sharing one subgraph for both branches would double the model per level)."""
    def graph(level: int) -> onnx.GraphProto:
        out = helper.make_tensor_value_info(f"o{level}", TensorProto.FLOAT, [1])
        if level == depth:
            c = helper.make_node("Constant", [], [f"o{level}"],
                                 value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0]))
            return helper.make_graph([c], f"leaf{level}", [], [out])
        leaf = helper.make_graph(
            [helper.make_node("Constant", [], [f"o{level}"],
                              value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.0]))],
            f"else{level}", [], [out])
        node = helper.make_node("If", ["cond"], [f"o{level}"], then_branch=graph(level + 1),
                                else_branch=leaf)
        return helper.make_graph([node], f"g{level}", [], [out])

    top = graph(1)
    top.input.append(helper.make_tensor_value_info("cond", TensorProto.BOOL, []))
    m = helper.make_model(top, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    onnx.save(m, path)
    return path


def _print(tally: Tally) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="hostile inputs (bench/accuracy/hostile.py)")
    for col in ("family", "tried", "clear finding", "accepted (valid)", "hung", "crashed",
                "leaked exception"):
        t.add_column(col, justify="left" if col == "family" else "right")
    totals: Counter[str] = Counter()
    for fam, c in tally.rows.items():
        tried = sum(v for k, v in c.items() if k != "code ran")
        row = [c["finding"], c["accepted"], c["hang"], c["crashed"] + c["code ran"], c["leaked"]]
        totals.update({"tried": tried, "finding": row[0], "accepted": row[1], "hang": row[2],
                       "crashed": row[3], "leaked": row[4]})
        t.add_row(fam, str(tried), *map(str, row))
    t.add_row("total", str(totals["tried"]), str(totals["finding"]), str(totals["accepted"]),
              str(totals["hang"]), str(totals["crashed"]), str(totals["leaked"]))
    Console().print(t)
    for fam, ex in tally.examples.items():
        print(f"leaked in {fam}: {ex}")


if __name__ == "__main__":
    main()
