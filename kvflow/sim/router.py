"""Routers: which engine of a cluster serves a request. Pure Python.

A router scores every candidate instance and picks the lowest cost; ties go to the first
candidate at or after the one past the last pick, so that equal costs rotate (round robin is
the router whose costs are all equal). One small class per policy, chosen by name from
:data:`ROUTERS`.

* ``round_robin``: in turn.
* ``least_loaded``: the fewest outstanding tokens (prompt + output of the requests routed to
  it and not finished), what a load balancer that counts its own in-flight work knows.
* ``prefix_aware``: Dynamo's KV router: ``overlap_weight * (prompt blocks the instance's
  prefix cache lacks) + outstanding blocks``. The overlap is read from each instance's real
  prefix cache, by the block-hash chain kvflow's KV manager indexes blocks with.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

from kvflow.kv_manager.block_pool import BlockHash, BlockPool, hash_block


class Routable(Protocol):
    """What a router reads of an instance."""

    outstanding_tokens: int

    @property
    def block_pool(self) -> BlockPool: ...


def prefix_block_hashes(token_ids: Sequence[int], block_size: int,
                        salt: bytes = b"") -> list[BlockHash]:
    """The hashes a prefix cache would look ``token_ids`` up by: one per full block that may
    hit (a prompt cached whole still computes its last token, so its last block never does),
    chained exactly as :meth:`kvflow.kv_manager.KVCacheManager.block_hashes` chains them."""
    hashes: list[BlockHash] = []
    parent = None
    for i in range((len(token_ids) - 1) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], salt)
        hashes.append(parent)
    return hashes


def cached_prefix_blocks(pool: BlockPool, hashes: Sequence[BlockHash]) -> int:
    """How many leading blocks of ``hashes`` the pool's prefix cache holds (free but still
    cached blocks included: a hit revives them)."""
    n = 0
    for h in hashes:
        if pool.lookup(h) is None:
            break
        n += 1
    return n


class Router(ABC):
    """Picks the lowest-cost instance; equal costs rotate."""

    name = ""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._next = 0

    @abstractmethod
    def costs(self, token_ids: Sequence[int], instances: Sequence[Routable]) -> list[float]:
        """Each instance's cost of serving a request of ``token_ids``."""

    def pick(self, token_ids: Sequence[int], instances: Sequence[Routable]) -> int:
        """The index (into ``instances``) of the instance to serve the request."""
        costs = self.costs(token_ids, instances)
        best, n = min(costs), len(costs)
        pick = next(i for k in range(n) if costs[i := (self._next + k) % n] == best)
        self._next = (pick + 1) % n
        return pick


class RoundRobinRouter(Router):
    """Every instance in turn."""

    name = "round_robin"

    def costs(self, token_ids: Sequence[int], instances: Sequence[Routable]) -> list[float]:
        return [0.0] * len(instances)


class LeastLoadedRouter(Router):
    """The fewest outstanding tokens."""

    name = "least_loaded"

    def costs(self, token_ids: Sequence[int], instances: Sequence[Routable]) -> list[float]:
        return [float(x.outstanding_tokens) for x in instances]


class PrefixAwareRouter(Router):
    """Dynamo's KV router: ``overlap_weight * uncached prompt blocks + outstanding blocks``.

    The first term is the prefill the instance would do (what its prefix cache lacks of the
    prompt), the second its load; ``overlap_weight`` (1.0 by default, as Dynamo's) trades
    cache hits against balance: 0 is least-loaded by blocks, a large weight follows the cache
    whatever the queue. The request's block hashes are computed once, then looked up in each
    instance's pool: O(prompt blocks x instances) per request, not O(cluster KV).
    """

    name = "prefix_aware"

    def __init__(self, block_size: int, overlap_weight: float = 1.0) -> None:
        super().__init__(block_size)
        if not overlap_weight >= 0:
            raise ValueError(f"overlap_weight must be >= 0, got {overlap_weight}")
        self.overlap_weight = overlap_weight

    def costs(self, token_ids: Sequence[int], instances: Sequence[Routable]) -> list[float]:
        hashes = prefix_block_hashes(token_ids, self.block_size)
        prompt_blocks = -(-len(token_ids) // self.block_size)
        return [self.overlap_weight * (prompt_blocks - cached_prefix_blocks(x.block_pool, hashes))
                + x.outstanding_tokens / self.block_size for x in instances]


ROUTERS: dict[str, type[Router]] = {r.name: r for r in (RoundRobinRouter, LeastLoadedRouter,
                                                       PrefixAwareRouter)}


def make_router(name: str, block_size: int, overlap_weight: float = 1.0) -> Router:
    """The router registered as ``name``."""
    if name not in ROUTERS:
        raise ValueError(f"router must be one of {sorted(ROUTERS)}, got {name!r}")
    if name == PrefixAwareRouter.name:
        return PrefixAwareRouter(block_size, overlap_weight)
    return ROUTERS[name](block_size)
