"""Make the ``tensorrt-stubs`` wheel readable by mypy.

Its ``tensorrt_bindings/tensorrt.pyi`` (every release from 10.8 to 10.13) has two kinds of
syntax error: plugin methods with a parameter named ``in`` (a keyword), and ``add_scale_nd``
with a default before a parameter without one. Neither touches the API kvflow uses; both stop
mypy from reading the file at all.

    python .ci/patch_tensorrt_stubs.py STUBS_DIR
"""

import re
import sys
from pathlib import Path

path = Path(sys.argv[1]) / "tensorrt_bindings" / "tensorrt.pyi"
text = path.read_text()
text = re.sub(r"(\(self[^)]*?, )in: ", r"\1in_: ", text)
text = text.replace("power: Weights = None, channel_axis: int)",
                    "power: Weights = None, channel_axis: int = ...)")
path.write_text(text)
print(f"patched {path}")
