"""`kvflow simulate` over a cluster: replicas behind routers, disaggregated prefill and decode
with KV transfers, goodput, the sessions workload and the engine's kv_transferred hook."""

from __future__ import annotations

import json

import pytest

from kvflow.cli import make_parser
from kvflow.kv_manager.block_pool import BlockPool
from kvflow.orchestrator.engine import LLMEngine
from kvflow.orchestrator.options import EngineOptions
from kvflow.orchestrator.sampling.params import SamplingParams
from kvflow.sim.cluster import ClusterSpec, Link
from kvflow.sim.cost_model import FixedCostModel
from kvflow.sim.goodput import find_goodput, slo_attainment
from kvflow.sim.router import PrefixAwareRouter, prefix_block_hashes
from kvflow.sim.runner import SIM_EOS, SimClock, SimRunner, sim_engine_config
from kvflow.sim.simulator import simulate, simulate_cluster
from kvflow.workloads.specs import RequestSpec
from kvflow.workloads.synthetic import random_workload, sessions_workload


def make_options(**overrides) -> EngineOptions:
    return EngineOptions(**{"max_model_len": 512, "max_num_batched_tokens": 256,
                            "enable_chunked_prefill": True, **overrides})


def run_cluster(specs, cluster: ClusterSpec, prompts=None, step_s: float = 1.0,
                num_blocks: int = 256, **options):
    return simulate_cluster(specs, FixedCostModel(step_s), make_options(**options), num_blocks,
                            cluster, block_size=4, prompts=prompts)


def make_sessions(n: int = 48, seed: int = 0):
    lengths = [RequestSpec(0.0, p, o) for p, o in ((24, 6), (40, 4), (16, 8), (32, 5))]
    return sessions_workload(lengths, n, rate=2.0, seed=seed, turns_per_session=4,
                             think_time_s=30.0, system_prompt_tokens=8, max_prompt_tokens=300)


def run_cli(*argv: str) -> int:
    args = make_parser().parse_args(list(argv))
    return args.func(args)


# --- replicas and routers ----------------------------------------------------------------------

def test_one_replica_is_the_single_engine_simulator_step_for_step():
    specs = random_workload(40, 20, 8, rate=2.0, burstiness=1.0, seed=3, range_ratio=0.5)
    one = simulate(specs, FixedCostModel(1.0), make_options(), 256, block_size=4)
    cluster = run_cluster(specs, ClusterSpec())
    assert [t.token_times_s for t in cluster.timings] == [t.token_times_s for t in one.timings]
    assert cluster.duration_s == one.duration_s


def test_round_robin_spreads_requests_evenly_in_turn():
    specs = [RequestSpec(0.1 * i, 8, 2) for i in range(12)]
    result = run_cluster(specs, ClusterSpec(replicas=3))
    assert [r.instance for r in result.routes] == [0, 1, 2] * 4
    assert [s["requests"] for s in result.instances] == [4, 4, 4]
    assert all(t.ok and t.output_tokens == 2 for t in result.timings)


@pytest.mark.parametrize("mode", ["fair", "priority"])
def test_replicas_schedulers_receive_each_requests_tenant_and_priority(mode):
    """`kvflow simulate --replicas 2 --policy fair|priority`: each request reaches its
    replica's scheduler with its tenant and its priority (the cluster path once dropped both,
    so that fair and priority acted as fcfs), observed through the simulator's ``on_step``."""
    from kvflow.sim.cluster_run import make_cluster, simulate_workload
    from kvflow.sim.run_options import priorities_for

    args = make_parser().parse_args(["simulate", "--replicas", "2", "--policy", mode,
                                     "--num-priorities", "3", "--seed", "7",
                                     "--max-model-len", "512", "--no-progress"])
    tenants = ["light-0", "heavy", "light-1", "heavy", "light-0", "light-1"] * 2
    specs = [RequestSpec(0.05 * i, 8 + i, 3, tenant=tenant if mode == "fair" else None)
             for i, tenant in enumerate(tenants)]
    seen: dict[str, tuple[int, int, str | None]] = {}  # request id -> replica, priority, tenant

    def watch(replica: int, engine: LLMEngine) -> None:
        for r in engine.scheduler.requests.values():
            seen[r.request_id] = (replica, r.priority, r.tenant)

    cluster, _ = make_cluster(args)
    result = simulate_workload(specs, None, mode, FixedCostModel(0.1), args, 256, cluster,
                               on_step=watch)
    # Without priorities of its own, the workload gets random levels under `priority`.
    priorities = (priorities_for(len(specs), 3, 7) if mode == "priority"
                  else [0] * len(specs))
    assert mode == "fair" or len(set(priorities)) > 1
    assert seen == {str(i): (route.instance, priorities[i], specs[i].tenant)
                    for i, route in enumerate(result.routes)}
    assert {route.instance for route in result.routes} == {0, 1}


def test_priority_orders_each_replicas_own_queue():
    # Three requests per replica wait at t=0 behind one batch slot: the priority-0 one (the
    # last to arrive) goes first on each replica.
    specs = [RequestSpec(0.0, 4, 2, priority=p) for p in (1, 1, 1, 1, 0, 0)]
    result = run_cluster(specs, ClusterSpec(replicas=2), policy="priority", max_num_seqs=1)
    for replica in (0, 1):
        mine = [i for i, r in enumerate(result.routes) if r.instance == replica]
        first = min(mine, key=lambda i: result.timings[i].token_times_s[0])
        assert specs[first].priority == 0


def test_least_loaded_avoids_the_replica_still_busy():
    # A (long) and B (short) start on replicas 0 and 1; when C comes, B is done: C joins
    # the idle replica 1, where round robin would queue it behind A on replica 0.
    specs = [RequestSpec(0.0, 8, 40), RequestSpec(0.0, 8, 2), RequestSpec(5.0, 8, 2)]
    loaded = run_cluster(specs, ClusterSpec(replicas=2, router="least_loaded"))
    rr = run_cluster(specs, ClusterSpec(replicas=2, router="round_robin"))
    assert [r.instance for r in loaded.routes] == [0, 1, 1]
    assert [r.instance for r in rr.routes] == [0, 1, 0]


def test_prefix_aware_cost_is_overlap_weight_times_uncached_blocks_plus_load():
    class Fake:
        def __init__(self, outstanding: int, cached: list[bytes]) -> None:
            self.outstanding_tokens = outstanding
            self.block_pool = BlockPool(16)
            for b, h in zip(self.block_pool.allocate(len(cached)), cached, strict=True):
                self.block_pool.cache_block(b, h)

    tokens = list(range(41))  # 11 blocks of 4, of which 10 may hit (the last token computes)
    hashes = prefix_block_hashes(tokens, 4)
    assert len(hashes) == 10
    holder, idle = Fake(outstanding=80, cached=hashes[:6]), Fake(outstanding=0, cached=[])
    gap = Fake(outstanding=0, cached=[hashes[1]])  # not a prefix: no overlap
    router = PrefixAwareRouter(4, overlap_weight=2.0)
    assert router.costs(tokens, [holder, idle, gap]) == [2.0 * (11 - 6) + 20, 22.0, 22.0]
    assert router.pick(tokens, [holder, idle, gap]) == 1  # ties rotate: idle first
    assert router.pick(tokens, [holder, idle, gap]) == 2
    assert PrefixAwareRouter(4, overlap_weight=5.0).pick(tokens, [holder, idle, gap]) == 0


def test_prefix_aware_keeps_each_session_on_one_replica_and_hits_more_than_round_robin():
    w = make_sessions()
    aware = run_cluster(w.specs, ClusterSpec(replicas=3, router="prefix_aware"), w.prompts,
                        step_s=0.05)
    rr = run_cluster(w.specs, ClusterSpec(replicas=3, router="round_robin"), w.prompts,
                     step_s=0.05)
    homes: dict[int, set[int | None]] = {}
    for session, route in zip(w.sessions, aware.routes, strict=True):
        homes.setdefault(session, set()).add(route.instance)
    assert all(len(h) == 1 for h in homes.values())
    assert len({next(iter(h)) for h in homes.values()}) == 3  # sessions spread over all three

    def hit_rate(result) -> float:
        hits = sum(s["prefix_cache_hits"] for s in result.instances)
        return hits / sum(s["prefix_cache_queries"] for s in result.instances)

    assert hit_rate(aware) > hit_rate(rr) + 0.2
    # A later turn finds its whole history cached on its replica: the previous turn's prompt
    # and output, in full blocks, less the last output token (sampled, never computed).
    last: dict[int, int] = {}
    for i, session in enumerate(w.sessions):
        if session in last:
            j = last[session]
            history = w.specs[j].prompt_tokens + w.specs[j].output_tokens - 1
            assert aware.routes[i].cached_tokens == history // 4 * 4
        last[session] = i


def test_sessions_share_their_history_as_a_true_prefix():
    w = make_sessions(n=30, seed=1)
    assert [s.arrival_s for s in w.specs] == sorted(s.arrival_s for s in w.specs)
    by_session: dict[int, list[int]] = {}
    for i, session in enumerate(w.sessions):
        by_session.setdefault(session, []).append(i)
    for turns in by_session.values():
        assert [w.turns[i] for i in turns] == list(range(len(turns)))
        for a, b in zip(turns[:-1], turns[1:], strict=True):
            history = w.prompts[a] + [0] * w.specs[a].output_tokens
            assert w.prompts[b][:len(history)] == history
            assert len(w.prompts[b]) > len(history)
    firsts = [w.prompts[t[0]] for t in by_session.values()]
    assert all(p[:8] == list(range(1, 9)) for p in firsts)  # the shared system prompt
    assert len({p[8] for p in firsts}) == len(firsts)  # then each session's own ids
    assert all(len(p) <= 300 for p in w.prompts)


# --- disaggregation ----------------------------------------------------------------------------

def test_disaggregated_request_is_prefilled_then_moved_then_decoded_elsewhere():
    # Steps take 1 s. Two 32-token prompts arrive at 0; one prefill step gives both first
    # tokens at 1.0. Each KV (32 x 1000 bytes) takes 0.5 s at 64 kB/s; the link is one FIFO
    # port, so the second waits 0.5 s. Decoding starts at the transfer's end.
    link = Link("test", bytes_per_s=64_000, latency_s=0.0)
    cluster = ClusterSpec(prefill=1, decode=1, link=link, kv_bytes_per_token_per_device=1000)
    specs = [RequestSpec(0.0, 32, 3), RequestSpec(0.0, 32, 3)]
    result = run_cluster(specs, cluster)
    a, b = result.timings
    assert a.token_times_s == [1.0, 2.5, 3.5]  # transfer 1.0-1.5, decode steps 1.5-2.5-3.5
    assert b.token_times_s == [1.0, 3.5, 4.5]  # transfer 1.5-2.0, joins at the step end 2.5
    assert a.ttft_s == 1.0 and a.output_tokens == 3
    assert [(r.instance, r.decode_instance) for r in result.routes] == [(0, 1), (0, 1)]
    assert [r.transfer_s for r in result.routes] == [0.5, 0.5]
    assert [r.transfer_wait_s for r in result.routes] == [0.0, 0.5]
    prefill, decode = result.instances
    assert (prefill["role"], prefill["requests"], prefill["output_tokens"]) == ("prefill", 2, 2)
    # The decode side computes only each request's last token (the first output), then decodes.
    assert (decode["role"], decode["requests"], decode["prefill_tokens"],
            decode["output_tokens"]) == ("decode", 2, 2, 4)


def test_a_transferred_request_waits_for_blocks_and_computes_only_its_last_token():
    options = make_options(enable_prefix_caching=True)
    clock = SimClock()
    runner = SimRunner(sim_engine_config(4, 512, 256, 256), 9, FixedCostModel(1.0), clock)
    engine = LLMEngine(runner, None, options, (SIM_EOS,), clock=clock)
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request(list(range(100, 124)), greedy, request_id="big")  # 6 of 8 blocks
    moved, _ = engine.add_request(list(range(200, 213)), greedy, request_id="moved",
                                  kv_transferred=True)  # 12 tokens of KV + 1: needs 4 blocks
    assert moved.num_transferred_tokens == 12
    engine.step()
    assert engine.step_stats[-1].scheduled == [("big", 24)]  # no room for "moved": it waits
    while "moved" not in {rid for rid, _ in engine.step_stats[-1].scheduled}:
        engine.step()
    assert ("moved", 1) in engine.step_stats[-1].scheduled
    assert moved.num_transferred_tokens == 0 and moved.num_computed_tokens == 13
    assert len(engine.kv.block_tables["moved"]) == 4
    assert engine.scheduler.prefix_cache_hits == 0  # transferred KV is no cache hit
    engine.scheduler.check_integrity()


# --- goodput -----------------------------------------------------------------------------------

def test_slo_attainment_needs_both_slos_together():
    from kvflow.reports.summary import RequestTiming

    timings = [RequestTiming(0.0, [0.1, 0.2, 0.3], 8, 3),  # TTFT 100 ms, TPOT 100 ms: good
               RequestTiming(0.0, [0.5, 0.6], 8, 2),  # TTFT 500 ms: misses TTFT
               RequestTiming(0.0, [0.1, 0.5], 8, 2),  # TPOT 400 ms: misses TPOT
               RequestTiming(0.0, [0.2], 8, 1),  # one token: no TPOT, TTFT good
               RequestTiming(0.0, [], 8, 0, ok=False)]
    assert slo_attainment(timings, ttft_ms=200, tpot_ms=150) == pytest.approx(2 / 5)
    assert slo_attainment(timings, ttft_ms=200, tpot_ms=None) == pytest.approx(3 / 5)


def test_goodput_search_brackets_then_bisects_to_the_knee():
    def knee(rate: float) -> float:
        return 0.95 if rate <= 3.3 else 0.5

    rate, tried = find_goodput(knee, target=0.9, start_rate=1.0, iterations=8)
    assert rate is not None and 3.3 - 4.0 / 2 ** 8 <= rate <= 3.3
    assert {1.0, 2.0, 4.0} <= set(tried)
    rate, _ = find_goodput(knee, target=0.9, start_rate=20.0, iterations=8)
    assert rate is not None and 3.3 - 5.0 / 2 ** 8 <= rate <= 3.3
    assert find_goodput(lambda r: 0.0, 0.9, 1.0, max_steps=3)[0] is None


# --- the command line --------------------------------------------------------------------------

def test_simulate_replicas_writes_the_cluster_report(tmp_path):
    out = tmp_path / "cluster"
    assert run_cli("simulate", "--replicas", "2", "--router", "least_loaded", "--workload",
                   "random", "--num-prompts", "40", "--input-len", "200", "--output-len", "20",
                   "--request-rate", "20", "--policy", "chunked", "--max-model-len", "1024",
                   "--slo", "ttft_ms=500,tpot_ms=50", "--out", str(out), "--no-progress") == 0
    report = json.loads((out / "report.json").read_text())
    cluster = report["config"]["cluster"]
    assert cluster["roles"] == ["replica", "replica"] and cluster["router"] == "least_loaded"
    assert sum(s["requests"] for s in cluster["instances"]) == 40
    assert {r["instance"] for r in report["requests"]} == {0, 1}
    assert report["summary"]["completed"] == 40 and 0 <= cluster["slo_attainment"] <= 1
    for name in ("summary.md", "cluster.png", "latency_cdf.png"):
        assert (out / name).stat().st_size > 0, name
    assert "| instance | role |" in (out / "summary.md").read_text()


def test_simulate_disaggregated_goodput_writes_the_search(tmp_path):
    out = tmp_path / "goodput"
    assert run_cli("simulate", "--disaggregate", "1:1", "--link", "infiniband", "--workload",
                   "random", "--num-prompts", "30", "--input-len", "500", "--output-len", "16",
                   "--max-model-len", "1024", "--goodput", "--goodput-iterations", "1",
                   "--request-rate", "4", "--slo", "ttft_ms=300,tpot_ms=40", "--out",
                   str(out), "--no-progress") == 0
    result = json.loads((out / "goodput.json").read_text())
    assert result["cluster"]["roles"] == ["prefill", "decode"]
    assert result["cluster"]["link"].startswith("InfiniBand")
    assert len(result["points"]) >= 2 and (out / "goodput.png").stat().st_size > 0
    if result["goodput"] is not None:
        assert result["goodput_per_gpu"] == pytest.approx(result["goodput"] / 2)


@pytest.mark.parametrize(("argv", "message"), [
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--disaggregate", "2"], "--disaggregate must be P:D"),
    (["--disaggregate", "0:1"], "P >= 1 and D >= 1"),
    (["--disaggregate", "1:1", "--replicas", "2"], "drop --replicas"),
    (["--replicas", "2", "--router", "prefix_aware"], "add --prefix-caching"),
    (["--replicas", "2", "--overlap-weight", "-1"], "--overlap-weight must be >= 0"),
    (["--disaggregate", "1:1", "--link-gbps", "0"], "--link-gbps must be > 0"),
    (["--replicas", "2", "--goodput"], "--goodput needs --slo"),
    (["--replicas", "2", "--policy", "chunked,static"], "one --policy mode"),
    (["--workload", "sessions"], "--request-rate is required"),
])
def test_bad_cluster_arguments_name_the_flag(tmp_path, argv, message):
    with pytest.raises(ValueError, match=message):
        run_cli("simulate", "--workload", "random", "--num-prompts", "4", *argv,
                "--out", str(tmp_path), "--no-progress")


def test_unknown_router_or_link_is_refused_by_name(capsys):
    for argv in (["--router", "random"], ["--link", "carrier-pigeon"]):
        with pytest.raises(SystemExit):
            make_parser().parse_args(["simulate", *argv])
        assert argv[0] in capsys.readouterr().err
