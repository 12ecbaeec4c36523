"""Greedy generation with onnxruntime-genai from a package folder, in a child process (a crash
or hang of the runtime must not take onnxmedic with it): a decoder's package or an
encoder-decoder's (Whisper, genai's ``whisper`` model type).

Run as ``python genai_child.py FOLDER SPEC_JSON``; SPEC_JSON: {"steps": N, and either
"prompts": [[ids]] (a decoder: each prompt's ids appended) or "features": [paths of .npy
input_features, one input each], "input": the encoder graph's input name, "start": the
decoder's start token (an encoder-decoder: each input's features set, then the start token);
"prepack": bool (optional, default true; false: the decoder's session packs no weights,
session.disable_prepacking - gen_verify.quantized_weights says when), "threads": n (optional:
the decoder session's intra-op threads, where the caller runs another process beside)}. Prints {"tokens":
[[ids]], "seconds": s, "generated": n, "version": v} as JSON on stdout.
Imports only onnxruntime_genai (and numpy for features; never torch or onnxmedic).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def main() -> None:
    import onnxruntime_genai as og

    folder, spec = sys.argv[1], json.loads(sys.argv[2])
    options: dict[str, Any] = {}  # the decoder session's, over its genai_config's
    if not spec.get("prepack", True):
        options["session.disable_prepacking"] = "1"
    if spec.get("threads") is not None:
        options["intra_op_num_threads"] = int(spec["threads"])
    if options:
        config = og.Config(folder)
        config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
    model = og.Model(config if options else folder)
    features = "features" in spec
    tokens, seconds, generated = [], 0.0, 0
    for item in spec["features"] if features else spec["prompts"]:
        ids = [spec["start"]] if features else item
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + spec["steps"], do_sample=False)
        gen = og.Generator(model, params)
        t = time.perf_counter()
        if features:
            import numpy as np

            inputs = og.NamedTensors()  # keyed by the encoder graph's input name
            inputs[spec["input"]] = og.Tensor(np.load(item))
            gen.set_inputs(inputs)
        gen.append_tokens(ids)
        out: list[int] = []
        while not gen.is_done() and len(out) < spec["steps"]:
            gen.generate_next_token()
            out.append(int(gen.get_next_tokens()[0]))
        seconds += time.perf_counter() - t
        generated += len(out)
        tokens.append(out)
    print(json.dumps({"tokens": tokens, "seconds": seconds, "generated": generated,
                      "version": getattr(og, "__version__", "?")}))


if __name__ == "__main__":
    main()
