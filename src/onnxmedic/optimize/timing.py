"""Timing candidates in the sandbox, and the noise rule that decides whether one beats another.

The example feed is run ``warmup + repeats`` times per round, rounds alternate between files (so
that load on a shared machine hits all of them alike), and the median/p90 of the kept runs are
reported.

Noise rule (paired rounds): a variant beats the plain export only when its median is at least
``NOISE_FRACTION`` (3 %) below the plain median *and* its median is below the plain one's in
every round (the two ran back to back in each round, so load that comes and goes hits both
alike); otherwise the plain export is written and the result says so. An earlier rule asked for
the median to be below plain's p90 spread too: under load (a GPU's launch jitter, a shared CPU)
that spread alone rejected variants 10 % faster in every round.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection
from pathlib import Path

import numpy as np

from onnxmedic import sandbox
from onnxmedic.optimize.variant import NOISE_FRACTION, Variant, Why

# a GPU target's timing warms up at least this long (besides its warm-up runs): the GPU's clocks
# rise from idle (an H200 here: SM 345 MHz idle, 1980 MHz under load) while a batch-1 model's
# few warm-up runs take milliseconds
GPU_WARMUP_SECONDS = 0.2

__all__ = ["GPU_WARMUP_SECONDS", "NOISE_FRACTION", "beats", "choose", "record_times",
           "slower_round", "time_variants"]


def time_variants(paths: dict[str, Path], feed: dict[str, np.ndarray], *, threads: int = 2,
                  warmup: int = 3, repeats: int = 10, rounds: int = 3,
                  timeout: float = 600.0, target: str = "cpu",
                  per_round: dict[str, list[float]] | None = None,
                  baseline: str | None = None,
                  graphs: Collection[str] = (),
                  cuda_options: dict[str, dict[str, str]] | None = None
                  ) -> dict[str, tuple[float, float]]:
    """Median and p90 latency (ms) of each file, in the sandbox with ``threads`` intra-op
    threads: ``rounds`` alternating rounds of ``warmup`` discarded + ``repeats`` timed runs, each
    round one session with ONNX Runtime's default options (on a GPU target CUDA's TF32 math
    included, as deployed) and the inputs and outputs bound on the target's device
    (IOBinding: a GPU run's time is the GPU's work, not host copies); on a GPU target the
    warm-up lasts GPU_WARMUP_SECONDS at least. ``per_round``, when
    given, receives each file's median per round (nan for a round it failed). ``baseline``
    (a key of ``paths``): a file whose round median is not below the baseline's in the same
    round is not timed in later rounds - under the paired noise rule it can no longer win.
    ``graphs``: keys timed as CUDA graphs (fixed buffers, ``enable_cuda_graph``; see
    graphs.GRAPH_SETTINGS); ``cuda_options``: more CUDA provider options by key
    (graphs.NHWC_OPTIONS)."""
    samples: dict[str, list[float]] = {k: [] for k in paths}
    rounds_ms: dict[str, list[float]] = {k: [] for k in paths}
    live = list(paths)
    gpu = target != "cpu"
    for r in range(rounds):
        for name in live if r % 2 == 0 else live[::-1]:
            sbx = sandbox.run_model(paths[name], [feed], timeout=timeout, threads=threads,
                                    providers=sandbox.providers(target), cuda_tf32=True,
                                    timing={"warmup": warmup, "repeats": repeats,
                                            "iobinding": gpu, "graph": name in graphs,
                                            "warmup_seconds": GPU_WARMUP_SECONDS if gpu else 0},
                                    cuda_options=(cuda_options or {}).get(name),
                                    fresh=True)  # as deployed: a process of its own
            ms = [s * 1000 for s in sbx.timed_seconds] if sbx.ok else []
            samples[name] += ms
            rounds_ms[name].append(statistics.median(ms) if ms else float("nan"))
        if baseline in paths:
            base = rounds_ms[baseline][-1]
            live = [k for k in live if k == baseline or rounds_ms[k][-1] < base]  # nan: out
    if per_round is not None:
        per_round.update(rounds_ms)
    out = {}
    for name, s in samples.items():
        if s:
            s.sort()
            out[name] = (statistics.median(s), s[min(len(s) - 1, int(0.9 * len(s)))])
    return out


def slower_round(v: list[float], base: list[float]) -> int | None:
    """The first round (1-based) in which ``v``'s median was not below ``base``'s."""
    for i, (a, b) in enumerate(zip(v, base)):
        if not a < b:  # nan (a failed round) counts as not faster
            return i + 1
    return None


def beats(v: Variant, base_ms: float | None, base_rounds: list[float]
          ) -> tuple[bool, int | None, float]:
    """The noise rule: ``v`` beats a base of median ``base_ms`` when its median is at most
    ``1 - NOISE_FRACTION`` of it and it was faster in every round (``base_rounds``). Returns
    (beats, the first round it was not faster in, the median it needed)."""
    limit = base_ms * (1 - NOISE_FRACTION) if base_ms is not None else float("nan")
    lost = slower_round(v.round_ms, base_rounds)
    return v.median_ms is not None and v.median_ms <= limit and lost is None, lost, limit


def record_times(variants: list[Variant], times: dict[str, tuple[float, float]],
                 per_round: dict[str, list[float]]) -> None:
    """Each timed variant's median, p90 and round medians (from :func:`time_variants`)."""
    for v in variants:
        if v.name in times:
            v.median_ms, v.p90_ms = times[v.name]
            v.round_ms = per_round.get(v.name, [])


def choose(plain: Variant, variants: list[Variant]) -> Variant:
    """The fastest verified variant that beats the plain file beyond the noise rule (the
    plain one otherwise; each variant's ``round_ms`` for the paired check); every other
    verified variant gets its reason."""
    if plain.median_ms is None:
        return plain
    base, chosen = plain, plain
    for v in variants[1:]:
        if v.median_ms is not None:
            v.speedup = base.median_ms / v.median_ms
        if not v.verified:
            continue
        _, lost, limit = beats(v, base.median_ms, base.round_ms)
        pruned = lost is not None and len(v.round_ms) < len(base.round_ms)
        figures = {"median_ms": v.median_ms, "base_ms": base.median_ms, "limit_ms": limit,
                   "round": lost}
        if v.median_ms is None:
            v.reject(Why.NOT_TIMED, "could not be timed")
        elif v.median_ms > limit:
            v.reject(Why.NOT_FASTER, f"not faster beyond noise ({v.median_ms:.2f} ms vs "
                     f"{base.name} {base.median_ms:.2f} ms, needs <= {limit:.2f} ms)"
                     + (f"; slower in round {lost}, not timed further" if pruned else ""),
                     **figures)
        elif lost is not None:
            v.reject(Why.NOT_FASTER, f"not faster beyond noise ({v.median_ms:.2f} ms vs "
                     f"{base.name} {base.median_ms:.2f} ms overall, but not faster in round "
                     f"{lost}{', not timed further' if pruned else ''})", **figures)
        elif chosen is plain or v.median_ms < (chosen.median_ms or float("inf")):
            chosen = v
    for v in variants[1:]:
        if v.verified and v is not chosen and v.rejection is None:
            v.reject(Why.SLOWER, f"slower than {chosen.name}", than=chosen.name)
    base.speedup = 1.0
    return chosen
