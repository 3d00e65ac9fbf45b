"""Triton's entry point for kvflow: a thin shim over ``kvflow.triton_backend``.

The Python backend stub loads libpython through the dynamic loader and does not honour
PYTHONPATH, so the paths of the environment kvflow is installed in are added to ``sys.path``
here, before kvflow is imported. ``kvflow serve`` writes them, with the engine folder, into
``serve.json`` beside config.pbtxt (not into the config, which any client may read); a
hand-written repository may give them as the ``python_paths`` parameter instead.
"""

import json
import sys
from pathlib import Path

import triton_python_backend_utils as pb_utils


def _add_python_paths(args: dict) -> None:
    serve_file = Path(args.get("model_repository", "")) / "serve.json"
    if serve_file.is_file():
        paths = json.loads(serve_file.read_text()).get("python_paths", [])
    else:
        model_config = json.loads(args["model_config"])
        value = model_config.get("parameters", {}).get("python_paths", {}).get("string_value",
                                                                               "")
        paths = json.loads(value) if value and not value.startswith("${") else []
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)


class TritonPythonModel:
    def initialize(self, args):
        _add_python_paths(args)
        from kvflow.triton_backend.model import KvflowTritonModel

        self.impl = KvflowTritonModel(args, pb_utils)

    def execute(self, requests):
        return self.impl.execute(requests)

    def finalize(self):
        self.impl.finalize()
