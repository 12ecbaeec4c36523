"""Transforms of a generation package (any backend's: read through onnxmedic/genpackage.py),
each verified before its folder is written: ONNX Runtime's fusions with GroupQueryAttention
(fuse_decoder.py, gqa.py), int4 judged by the task budget (int4_package.py, over
optimize/int4_search.py's candidates), and ``onnxmedic optimize PACKAGE hf:CHECKPOINT``
(package_cli.py). hf/ imports optimize's generic passes here, and optimize imports nothing of
hf (tests/test_architecture.py)."""
