"""The CPU instruction set an int8 file is verified on, and int8 settings that hold on any.

ONNX Runtime picks its int8 kernels by CPU feature at run time. On an x86-64 CPU without VNNI
(AVX2 only: Haswell to Skylake client, many AMD EPYC before Zen 4) its u8s8 kernels add pairs of
uint8 x int8 products in int16 (VPMADDUBSW), which saturates at 32767: two activations near 255
against weights near 127 give 2 x 255 x 127 = 64770. With VNNI (AVX-VNNI, AVX-512 VNNI), AMX or
on arm64 the products are added in int32 and nothing saturates. So an int8 file verified on one
CPU can compute differently, and worse, on another (docs/optimize-isa.md has the measurements).

``--target cpu`` int8 is therefore *portable*: ``reduce_range`` (7-bit weights, |w| <= 64, so
2 x 255 x 64 = 32640 fits int16) - the u8s8 kernels keep their speed and compute the same
integers on every x86-64 CPU. ``--target cpu:<isa>`` (:data:`ISAS`) names the instruction set
the file will run on; where that one does not saturate, full 8-bit weights are used.

The instruction set present (:func:`present_isa`) is told from the CPU's flags and, on x86-64,
by running a model built to saturate: the kernels ONNX Runtime actually picks decide it (an
emulator or a hypervisor can hide a flag). ``ONNXMEDIC_CPU_ISA`` overrides it (tests, and the
question "what would doctor say on that machine").

Whether the CPU multiplies a half type in hardware (:func:`computes_natively`, which picks the
streamed int4 reference's dtype: a matter of speed, not of results) is told from its flags
alone; under an emulator those are the host's.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from typing import Any

logger = logging.getLogger(__name__)

ISAS = ("avx2", "avx-vnni", "avx512-vnni", "amx", "arm64")
# where ONNX Runtime's u8s8 kernels add in int32 (no saturation): full 8-bit weights are safe
NO_SATURATION = ("avx-vnni", "avx512-vnni", "amx", "arm64")
PORTABLE = "portable"
VERIFIED_KEY = "onnxmedic.int8.verified_on"  # metadata_props: the instruction set verified on
SETTINGS_KEY = "onnxmedic.int8.settings"  # metadata_props: "portable" or the named isa
ENV = "ONNXMEDIC_CPU_ISA"
# ONNX Runtime's session config entry kOrtSessionOptionsAvx2PrecisionMode
# (onnxruntime_session_options_config_keys.h): "1" makes its x86-64 graph optimizer turn the
# int8 weights of QLinearConv, MatMulInteger, QGemm, DynamicQuantizeMatMul and QDQ groups into
# uint8 (Avx2WeightS8ToU8Transformer), so the u8u8 kernels run: no pair of products added in
# int16, nothing saturates. It acts on every x86-64 CPU with AVX2 (VNNI or not: u8u8 is slower
# there and computes the same integers), at the default (or extended) optimization level.
PRECISION_CONFIG = {"session.x64quantprecision": "1"}
# metadata_props: the session config entries (JSON) the file was verified with and needs
SESSION_CONFIG_KEY = "onnxmedic.ort.session_config"
PRECISION_LINE = ('opts.add_session_config_entry("session.x64quantprecision", "1")  '
                  "# opts = onnxruntime.SessionOptions()")
INT8_OPS = ("MatMulInteger", "ConvInteger", "QLinearMatMul", "QLinearConv", "QuantizeLinear",
            "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QGemm", "QAttention",
            "MatMulNBits")


def split_target(target: str) -> tuple[str, str | None]:
    """``"cpu:avx2"`` -> ("cpu", "avx2"); ``"cuda"`` -> ("cuda", None). ValueError for an
    instruction set onnxmedic does not know, or one on a GPU target."""
    base, sep, isa = str(target).partition(":")
    if not sep:
        return base, None
    isa = isa.strip().lower().replace("_", "-")
    if base != "cpu" or isa not in ISAS:
        raise ValueError(f"target {target!r}: an instruction set goes with cpu only - "
                         f"cpu:{', cpu:'.join(ISAS)}")
    return base, isa


def reduce_range(isa: str | None) -> bool:
    """Whether int8 for ``isa`` (None: portable) needs 7-bit weights so that the u8s8 kernels
    do not saturate."""
    return isa not in NO_SATURATION


def settings_name(isa: str | None) -> str:
    """What the file's int8 settings were chosen for: "portable" or the named isa."""
    return isa or PORTABLE


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# the CPU flags of a half type's hardware multiply (x86-64's AVX-512 and AMX; arm64's)
HALF_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16", "bf16"),
              "float16": ("avx512_fp16", "amx_fp16", "asimdhp")}


def computes_natively(dtype: str) -> bool:
    """Whether this CPU multiplies the half type ``dtype`` ("bfloat16", "float16") in
    hardware (:data:`HALF_FLAGS`): where PyTorch's matmul in it is faster than in float32
    (measured: bfloat16 2.5x float32 on an AMD EPYC with AVX-512 BF16, 4096 x 14336 weights,
    300 rows, one thread); elsewhere it is emulated and slower."""
    return bool(_cpu_flags() & set(HALF_FLAGS.get(dtype, ())))


def _probe_model() -> tuple[bytes, dict[str, Any], int]:
    """A MatMulInteger built to saturate u8s8 (2 x 255 x 127 per pair of products): the
    model, its feed and the exact result."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    k = 64
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["A", "B"], ["Y"])], "probe",
        [helper.make_tensor_value_info("A", TensorProto.UINT8, [1, k])],
        [helper.make_tensor_value_info("Y", TensorProto.INT32, [1, 1])],
        [numpy_helper.from_array(np.full((k, 1), 127, np.int8), "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString(), {"A": np.full((1, k), 255, np.uint8)}, 255 * 127 * k


def u8s8_saturates(in_sandbox: bool = False) -> bool:
    """Whether ONNX Runtime's u8s8 MatMulInteger saturates on this CPU: a model built to
    saturate, run in this process, or with ``in_sandbox`` where the sandbox runs ONNX Runtime
    (under sandbox.WRAPPER_ENV's command, e.g. QEMU's Haswell, where one is set)."""
    import tempfile
    from pathlib import Path

    model, feed, exact = _probe_model()
    if not in_sandbox:
        import onnxruntime as ort

        sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        return int(sess.run(None, feed)[0][0, 0]) != exact
    from onnxmedic import sandbox

    with tempfile.TemporaryDirectory(prefix="onnxmedic-probe-") as tmp:
        path = Path(tmp) / "probe.onnx"
        path.write_bytes(model)
        out = sandbox.run_model(path, [feed], fresh=True)
    if not out.ok:
        raise RuntimeError(f"u8s8 probe: {out.summary()}")
    return int(out.outputs[0][0][0, 0]) != exact


def _detected() -> str:
    from onnxmedic.sandbox import WRAPPER_ENV

    return _detected_with(os.environ.get(WRAPPER_ENV, ""))


@functools.lru_cache(maxsize=4)
def _detected_with(wrapper: str) -> str:
    """The instruction set where the sandbox runs ONNX Runtime (in this process when no
    ``wrapper`` command is set: the same CPU)."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return "arm64"
    if machine not in ("x86_64", "amd64"):
        return machine
    try:
        if u8s8_saturates(in_sandbox=bool(wrapper)):
            return "avx2"
        if wrapper:  # an emulated CPU that adds in int32: this machine's flags are not its
            return "avx512-vnni"
    except Exception as e:  # noqa: BLE001 - no runtime: tell by the flags alone
        logger.debug("u8s8 probe failed: %s", e)
    flags = _cpu_flags()
    for flag, name in (("amx_int8", "amx"), ("avx512_vnni", "avx512-vnni"),
                       ("avx_vnni", "avx-vnni")):
        if flag in flags:
            return name
    return "avx2"


def present_isa() -> str:
    """The instruction set ONNX Runtime's int8 kernels use here (:data:`ISAS`; the machine's
    name on other architectures); ``ONNXMEDIC_CPU_ISA`` overrides it."""
    return os.environ.get(ENV) or _detected()


def int8_metadata(isa: str | None) -> dict[str, str]:
    """The metadata an int8 file verified here records: the instruction set present and what
    its settings were chosen for."""
    return {VERIFIED_KEY: present_isa(), SETTINGS_KEY: settings_name(isa)}


def _meta(proto: Any) -> dict[str, str]:
    return {p.key: p.value for p in proto.metadata_props}


def int8_findings(proto: Any, stage: str) -> list[Any]:
    """doctor and run: OM544 when an int8 file onnxmedic verified for one instruction set's
    kernels (full 8-bit weights) meets another here; OM545 when a portable one was verified
    on another instruction set than this one (the integers are the same, it was not run
    here)."""
    from onnxmedic.findings import info, warning

    meta = _meta(proto)
    verified, settings = meta.get(VERIFIED_KEY), meta.get(SETTINGS_KEY, PORTABLE)
    here = present_isa()
    if not verified:
        return []
    details = {"verified_on": verified, "settings": settings, "present": here}
    if settings != PORTABLE and settings != here and reduce_range(here):
        return [warning(
            "OM544", stage, f"this int8 file was verified on {verified} with settings for "
            f"{settings} (full 8-bit weights); this CPU is {here}, whose u8s8 int8 kernels "
            "add pairs of products in int16 and can saturate, so its outputs may fall outside "
            "the accuracy budget it was verified to.", details=details,
            suggestion="Re-run `onnxmedic optimize --precision int8 --target cpu` (portable "
            f"settings) or `--target cpu:{here}` on this machine.")]
    if verified != here:
        return [info(
            "OM545", stage, f"this int8 file was verified on {verified}, not on this CPU "
            f"({here}); its settings ({settings}) do not saturate here, but it was not "
            "verified here.", details=details,
            suggestion="`onnxmedic verify` it against the PyTorch model on this machine.")]
    return []


def optimize_findings(target: str, int8: bool, stage: str = "optimize") -> list[Any]:
    """optimize: OM729 (the int8 settings and the instruction set they were verified on) and
    OM728 when the instruction set named in ``target`` is not the one present, so the int8
    candidates could not be verified on it."""
    from onnxmedic.findings import info, warning

    if not int8:
        return []
    _, named = split_target(target)
    here = present_isa()
    how = ("full 8-bit weights" if not reduce_range(named) else
           "reduce_range: 7-bit weights, so ONNX Runtime's u8s8 kernels do not saturate on "
           "x86-64 CPUs without VNNI")
    out = [info("OM729", stage, f"int8 settings for {settings_name(named)} ({how}); verified "
                f"on this CPU ({here}), recorded in the file's metadata ({VERIFIED_KEY}).",
                details={"settings": settings_name(named), "verified_on": here})]
    if named and named != here:
        out.append(warning(
            "OM728", stage, f"--target cpu:{named}: the int8 candidates were verified on this "
            f"CPU ({here}), not on {named}; what {named}'s int8 kernels compute was not checked.",
            details={"named": named, "verified_on": here},
            suggestion=f"Run optimize on a {named} machine, or use --target cpu (portable)."))
    return out


def target_arg(value: str) -> str:
    """argparse ``type`` for a ``--target`` that takes an instruction set (optimize, export):
    cpu, cpu:<isa>, cuda or tensorrt (exit 2 with the choices otherwise)."""
    import argparse

    try:
        base, _ = split_target(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if base not in ("cpu", "cuda", "tensorrt"):
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from cpu, "
                                         f"cpu:{', cpu:'.join(ISAS)}, cuda, tensorrt)")
    return value


def integer_kernels(proto: Any) -> bool:
    """Whether the graph has ops ONNX Runtime may run with its u8s8 integer kernels (QDQ
    groups, QOperator ops, MatMulInteger...; weight-only MatMulNBits saturates nowhere)."""
    ops = set(INT8_OPS) - {"MatMulNBits"}
    return any(n.op_type in ops for n in proto.graph.node)


def session_config_of(proto: Any) -> dict[str, str]:
    """The session config entries the file records (SESSION_CONFIG_KEY), {} when none (or
    unreadable)."""
    import json

    text = _meta(proto).get(SESSION_CONFIG_KEY)
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        logger.warning("metadata %s is not JSON: %r", SESSION_CONFIG_KEY, text[:200])
        return {}
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}


def precision_findings(stage: str, default: dict[str, Any], precise: dict[str, Any],
                       verified: bool) -> list[Any]:
    """verify: the file's outputs with ONNX Runtime's default int8 kernels and with
    PRECISION_CONFIG differ on this CPU, so its u8s8 kernels saturate (AVX2 without VNNI).
    ``default`` / ``precise``: the worst output's figures each way (output, max_abs, steps:
    in quantization steps of its DequantizeLinear or None, ok). OM546 when the default fails
    and the setting verifies it (the setting is then part of the file: its metadata and
    ``onnxmedic run`` carry it); OM547 (with OM601) when it fails both ways (the instruction set
    is not all that is wrong)."""
    from onnxmedic.findings import info, warning

    def fig(f: dict[str, Any]) -> str:
        steps = f" ({f['steps']:.3g} quantization steps)" if f.get("steps") is not None else ""
        return f"max abs error {f['max_abs']:.3g}{steps} on output {f['output']}"

    key, value = next(iter(PRECISION_CONFIG.items()))
    details = {"isa": "avx2", "setting": f"{key}={value}", "session_config": PRECISION_CONFIG,
               "default": default, "with_setting": precise, "present": present_isa()}
    both = (f"With ONNX Runtime's default int8 kernels: {fig(default)}; with the session "
            f"setting {key}={value} (u8u8 kernels, nothing saturates): {fig(precise)}.")
    why = ("ONNX Runtime's u8s8 integer kernels compute this file differently with and without "
           f"{key}, so on this CPU they add pairs of uint8 x int8 products in int16 and "
           "saturate: an x86-64 CPU with AVX2 and without VNNI (Haswell to Skylake client, AMD "
           "before Zen 4).")
    if verified:
        return [warning(
            "OM546", stage, f"{why} {both} The file is correct and verifies with the setting; "
            "it is verified with it, its metadata records it "
            f"({SESSION_CONFIG_KEY}), and `onnxmedic run` uses it.",
            suggestion=f"Deploy it with the setting in your own session options: {PRECISION_LINE}"
            " (it is needed on AVX2 CPUs without VNNI; on others it only slows the int8 "
            "kernels: docs/optimize-isa.md). Or quantize with 7-bit weights (reduce_range), "
            "which do not saturate.", details=details)]
    return [info(
        "OM547", stage, f"{why} {both} The file fails both ways: besides the saturation, "
        "its values are wrong (OM601).", details=details,
        suggestion="Check the quantization parameters (scales, zero points) and the "
        "translation: `onnxmedic verify --localize`.")]


def record_session_config(path: Any, proto: Any, findings: list[Any]) -> None:
    """A file verified with the setting (OM546) records it in its metadata
    (SESSION_CONFIG_KEY), for ``onnxmedic run``, verify and the user's own sessions."""
    import json

    from onnxmedic.onnxfile import append_metadata

    needed = next((f.details["session_config"] for f in findings if f.code == "OM546"), None)
    if needed and session_config_of(proto) != needed:
        append_metadata(path, SESSION_CONFIG_KEY, json.dumps(needed, sort_keys=True), proto)


def session_config_finding(proto: Any, stage: str) -> list[Any]:
    """doctor and run: OM548 when the file records session config entries it was verified with
    (SESSION_CONFIG_KEY); run and doctor's smoke test use them."""
    from onnxmedic.findings import info

    config = session_config_of(proto)
    if not config:
        return []
    lines = "; ".join(f'opts.add_session_config_entry("{k}", "{v}")'
                      for k, v in config.items())
    return [info(
        "OM548", stage, f"the file records the ONNX Runtime session settings it was verified "
        f"with ({SESSION_CONFIG_KEY}: {', '.join(f'{k}={v}' for k, v in config.items())}); "
        "onnxmedic runs it with them.", details={"session_config": config},
        suggestion=f"Your own sessions need them too: {lines} (docs/optimize-isa.md).")]
