"""Triton's entry point for kvflow: a thin shim over ``kvflow.triton_backend``.

The Python backend stub loads libpython through the dynamic loader and does not honour
PYTHONPATH, so the paths of the environment kvflow is installed in (written into config.pbtxt by
``kvflow serve`` as the ``python_paths`` parameter) are added to ``sys.path`` here, before kvflow
is imported.
"""

import json
import sys

import triton_python_backend_utils as pb_utils


def _add_python_paths(model_config: dict) -> None:
    value = model_config.get("parameters", {}).get("python_paths", {}).get("string_value", "")
    if not value or value.startswith("${"):
        return
    for path in reversed(json.loads(value)):
        if path not in sys.path:
            sys.path.insert(0, path)


class TritonPythonModel:
    def initialize(self, args):
        _add_python_paths(json.loads(args["model_config"]))
        from kvflow.triton_backend.model import KvflowTritonModel

        self.impl = KvflowTritonModel(args, pb_utils)

    def execute(self, requests):
        return self.impl.execute(requests)

    def finalize(self):
        self.impl.finalize()
