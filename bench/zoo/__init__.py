"""Model zoos for `onnxmedic sweep`: each module exposes ``ZOO``, a dict name -> factory."""
