"""Greedy generation with onnxruntime-genai from a Whisper package folder, in a child process
(a crash or hang of the runtime must not take onnxmedic with it).

Run as ``python seq2seq_genai_child.py FOLDER SPEC_JSON``; SPEC_JSON: {"features": [paths of
.npy input_features, one input each], "input": the encoder graph's input name, "start": decoder start token, "steps": N}. Prints
{"tokens": [[ids]], "seconds": s, "generated": n, "version": v} as JSON on stdout. Imports
only onnxruntime_genai and numpy (never torch or onnxmedic).
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    import numpy as np
    import onnxruntime_genai as og

    folder, spec = sys.argv[1], json.loads(sys.argv[2])
    model = og.Model(folder)
    tokens, seconds, generated = [], 0.0, 0
    for path in spec["features"]:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=1 + spec["steps"], do_sample=False)
        gen = og.Generator(model, params)
        t = time.perf_counter()
        inputs = og.NamedTensors()  # keyed by the graph's input name
        inputs[spec["input"]] = og.Tensor(np.load(path))
        gen.set_inputs(inputs)
        gen.append_tokens([spec["start"]])
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
