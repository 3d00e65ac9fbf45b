"""kvflow on NVIDIA Dynamo: the worker (``kvflow dynamo-worker``), its KV events, and
``kvflow cluster up`` (etcd, NATS, workers and Dynamo's frontend with the KV router)."""
