"""``kvflow dynamo-worker``'s own flags (its engine options are those of ``kvflow serve``).

Apart from :mod:`.worker`, which imports Dynamo's runtime at the top (its engine subclasses
Dynamo's ``LLMEngine``): the command line builds its parser from these flags without Dynamo,
and the worker parses its ``argv`` with them (``KvflowDynamoEngine.from_args``).
"""

from __future__ import annotations

import argparse


def add_worker_args(p: argparse.ArgumentParser) -> None:
    """``kvflow dynamo-worker``'s own flags; the engine options are those of ``kvflow serve``."""
    p.add_argument("--engine", required=True, help="engine folder (kvflow build-engine)")
    p.add_argument("--model-name", default=None,
                   help="the name clients ask for (default: the engine folder's name)")
    p.add_argument("--namespace", default="kvflow",
                   help="Dynamo namespace; the frontend's --namespace must match")
    p.add_argument("--component", default="backend")
    p.add_argument("--discovery-backend", default="etcd", choices=["etcd", "file", "mem"],
                   help="where workers are found (etcd: $ETCD_ENDPOINTS, default localhost)")
    p.add_argument("--request-plane", default="tcp", choices=["tcp", "nats"])
    p.add_argument("--event-plane", default=None, choices=["nats", "zmq"],
                   help="how KV events reach the router (default: Dynamo's, as the "
                        "frontend's; nats: $NATS_SERVER); the frontend's must be the same")
    p.add_argument("--no-kv-events", dest="kv_events", action="store_false",
                   help="publish no KV events (run the frontend with --no-router-kv-events, "
                        "so that its KV router predicts the caches from its own routing)")
