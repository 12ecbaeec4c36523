from onnxmedic.cli import entry

entry()
