"""Greedy generation with onnxruntime-genai from a package folder, in a child process (a crash
or hang of the runtime must not take onnxmedic with it).

Run as ``python gen_genai_child.py FOLDER SPEC_JSON``; SPEC_JSON: {"prompts": [[ids]],
"steps": N, "prepack": bool (optional, default true; false: the decoder's session packs no
weights, session.disable_prepacking - gen_verify.quantized_weights says when)}. Prints
{"tokens": [[ids]], "seconds": s, "version": v} as JSON on stdout.
Imports only onnxruntime_genai (never torch or onnxmedic).
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    import onnxruntime_genai as og

    folder, spec = sys.argv[1], json.loads(sys.argv[2])
    if spec.get("prepack", True):
        model = og.Model(folder)
    else:
        config = og.Config(folder)
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "session.disable_prepacking": "1"}}}}))
        model = og.Model(config)
    tokens, t0, generated = [], 0.0, 0
    for ids in spec["prompts"]:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + spec["steps"], do_sample=False)
        gen = og.Generator(model, params)
        t = time.perf_counter()
        gen.append_tokens(ids)
        out = []
        while not gen.is_done() and len(out) < spec["steps"]:
            gen.generate_next_token()
            out.append(int(gen.get_next_tokens()[0]))
        t0 += time.perf_counter() - t
        generated += len(out)
        tokens.append(out)
    print(json.dumps({"tokens": tokens, "seconds": t0, "generated": generated,
                      "version": getattr(og, "__version__", "?")}))


if __name__ == "__main__":
    main()
