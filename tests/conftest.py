from __future__ import annotations

import logging

# torch.onnx logs a warning per torchvision op when torchvision is absent; it is noise here.
logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
