"""Step-time benchmark (issue: engine core). Same as `kvflow bench step`; see its --help."""

import argparse

from kvflow.bench.step import add_args, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="kvflow step time vs HF transformers")
    add_args(parser)
    raise SystemExit(main(parser.parse_args()))
