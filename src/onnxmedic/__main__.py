import sys

from onnxmedic.cli import main

sys.exit(main())
