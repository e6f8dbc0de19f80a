"""Where `pdserve up` puts its workers (defect: every worker on cuda:0, each claiming 90% of its
free memory). Pure assignment logic: no GPU needed."""

from __future__ import annotations

import argparse
import os

import pytest

from pdserve.config import add_arguments, resolve, to_args
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.kv_cache import parse_memory
from pdserve.launcher import Cluster
from pdserve.placement import (
    Placement,
    borrowed_threads,
    parse_devices,
    plan,
    shared_prefill_threads,
    threads_per_worker,
)
from pdserve.security import SecuritySettings
from pdserve.settings import ClusterSettings, RouterSettings, WorkerSettings

P2D2 = ["prefill", "prefill", "decode", "decode"]


def devices(placements: list[Placement]) -> list[str]:
    return [p.device for p in placements]


def test_one_worker_per_gpu_while_there_are_enough():
    placed = plan(P2D2, device="auto", kv_cache_memory="auto", num_gpus=4)
    assert devices(placed) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert all(p.kv_cache_memory == "auto" for p in placed)  # alone on its GPU: the usual 90% of free memory


@pytest.mark.parametrize(
    "num_gpus, expected, share",
    [
        (2, ["cuda:0", "cuda:1", "cuda:0", "cuda:1"], "0.45"),
        (1, ["cuda:0"] * 4, "0.225"),
    ],
)
def test_workers_sharing_a_gpu_split_its_memory(num_gpus, expected, share):
    placed = plan(P2D2, device="cuda", kv_cache_memory="auto", num_gpus=num_gpus)
    assert devices(placed) == expected
    assert {p.kv_cache_memory for p in placed} == {share}
    fractions = [parse_memory(p.kv_cache_memory)[1] for p in placed]  # what the engine reads: fractions of free memory
    for gpu in set(expected):
        assert sum(f for f, d in zip(fractions, expected) if d == gpu) == pytest.approx(0.9)


def test_explicit_devices_per_role_are_used_round_robin():
    placed = plan(
        P2D2,
        device="auto",
        kv_cache_memory="auto",
        num_gpus=8,
        role_devices={"prefill": ["cuda:0"], "decode": ["cuda:1", "cuda:2"]},
    )
    assert devices(placed) == ["cuda:0", "cuda:0", "cuda:1", "cuda:2"]
    assert [p.kv_cache_memory for p in placed] == ["0.45", "0.45", "auto", "auto"]


def test_a_list_for_one_role_only_leaves_the_other_to_round_robin():
    placed = plan(
        ["prefill", "decode", "decode"],
        device="auto",
        kv_cache_memory="auto",
        num_gpus=2,
        role_devices={"prefill": ["cuda:1"], "decode": []},
    )
    assert devices(placed) == ["cuda:1", "cuda:1", "cuda:0"]
    assert [p.kv_cache_memory for p in placed] == ["0.45", "0.45", "auto"]


def test_explicit_budgets_fractions_split_sizes_stay():
    for fraction in ("0.5", ".5", "00.5", "0.5e0", " 0.5 "):  # every spelling the engine reads as a fraction
        assert {p.kv_cache_memory for p in plan(P2D2, device="cuda", kv_cache_memory=fraction, num_gpus=2)} == {"0.25"}
    assert {p.kv_cache_memory for p in plan(P2D2, device="cuda", kv_cache_memory="1", num_gpus=2)} == {"1"}  # a byte
    assert {p.kv_cache_memory for p in plan(P2D2, device="cuda", kv_cache_memory="8GiB", num_gpus=2)} == {"8GiB"}


def test_cpu_and_a_single_named_device():
    assert plan(P2D2, device="cpu", kv_cache_memory="auto", num_gpus=4) == [Placement("cpu", "auto")] * 4
    assert (
        plan(P2D2, device="auto", kv_cache_memory="auto", num_gpus=0) == [Placement("auto", "auto")] * 4
    )  # no GPU here
    placed = plan(["prefill", "decode"], device="cuda:3", kv_cache_memory="auto", num_gpus=4)
    assert placed == [Placement("cuda:3", "0.45")] * 2  # the user chose one GPU for all: they share it


def test_device_lists_are_validated():
    assert parse_devices(" cuda, cuda:2 ,cpu", "decode_devices") == ["cuda:0", "cuda:2", "cpu"]
    with pytest.raises(ValueError, match="decode_devices: 'gpu1' is not a device"):
        parse_devices("cuda:0,gpu1", "decode_devices")
    with pytest.raises(ValueError, match="prefill_devices"):
        resolve(ClusterSettings, None, env={"PDSERVE_PREFILL_DEVICES": "tpu:0"})


def _flags(args: list[str]) -> dict[str, str]:
    """A worker command's ``--flag=value`` words, as a dict."""
    return dict(arg.split("=", 1) for arg in args if arg.startswith("--") and "=" in arg)


def _worker_flags(args: list[str]) -> dict[str, str]:
    return {flag: value for flag, value in _flags(args).items() if flag in ("--device", "--kv-cache-memory")}


def test_pdserve_up_passes_each_worker_its_device_and_budget():
    cluster = Cluster(EngineConfig(), WorkerSettings(), RouterSettings(), ClusterSettings(prefill=1, decode=2))
    commands = cluster.worker_commands(num_gpus=2)
    assert [name for name, _ in commands] == ["prefill-0", "decode-0", "decode-1"]
    assert [_worker_flags(args) for _, args in commands] == [
        {"--device": "cuda:0", "--kv-cache-memory": "0.45"},
        {"--device": "cuda:1"},  # alone on its GPU: the default budget, so no flag
        {"--device": "cuda:0", "--kv-cache-memory": "0.45"},
    ]
    colocated = Cluster(
        EngineConfig(),
        WorkerSettings(),
        RouterSettings(),
        ClusterSettings(decode=2, colocated=True, decode_devices="cuda:1,cuda:0"),
    )
    assert [_worker_flags(args)["--device"] for _, args in colocated.worker_commands(num_gpus=2)] == [
        "cuda:1",
        "cuda:0",
    ]
    on_cpu = Cluster(EngineConfig(), WorkerSettings(), RouterSettings(), ClusterSettings())
    assert all(_worker_flags(args) == {} for _, args in on_cpu.worker_commands(num_gpus=0))


def test_up_s_children_take_their_settings_from_its_flags_not_from_its_environment(monkeypatch):
    """``PDSERVE_PORT=51110 pdserve up`` must not make every worker bind the router's port, nor
    ``PDSERVE_ENABLE_PREFIX_CACHING=false pdserve up --enable-prefix-caching`` turn caching off
    in workers that were told their default (left out of their flags)."""
    for name, value in (
        ("PDSERVE_PORT", "51110"),
        ("PDSERVE_ENABLE_PREFIX_CACHING", "false"),
        ("PDSERVE_KV_FAULTS", "x"),
    ):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PDSERVE_API_TOKEN", "secret")
    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig)
    engine = resolve(EngineConfig, parser.parse_args(["--enable-prefix-caching"]), env=dict(os.environ))
    cluster = Cluster(engine, WorkerSettings(), RouterSettings(), ClusterSettings(), SecuritySettings(api_token="t"))
    for _, args in cluster.worker_commands(num_gpus=0):
        assert not any(a.startswith("--port") or a.startswith("--enable-prefix-caching") for a in args)  # defaults
    worker_env, router_env = cluster.child_env(), cluster.child_env(router=True)
    for env in (worker_env, router_env):
        assert "PDSERVE_PORT" not in env and "PDSERVE_ENABLE_PREFIX_CACHING" not in env
        assert env["PDSERVE_KV_FAULTS"] == "x"  # not a setting: passed on
        assert env["PDSERVE_CLUSTER_TOKEN"] == cluster.security.cluster_token
    assert "PDSERVE_API_TOKEN" not in worker_env and router_env["PDSERVE_API_TOKEN"] == "t"
    assert to_args(RouterSettings(served_model_name="-my-model")) == ["--served-model-name=-my-model"]


def test_unpinned_cpu_workers_split_the_cores_evenly(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 64)  # the machine's; a taskset or cpuset gives this process 8
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8, 16)))
    assert [threads_per_worker(n) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
    cluster = Cluster(EngineConfig(), WorkerSettings(), RouterSettings(), ClusterSettings(prefill=1, decode=1))
    threads = [_flags(args)["--num-threads"] for _, args in cluster.worker_commands(num_gpus=0)]
    assert threads == ["8", "4"]  # the prefill worker shares every core (test below), the decode worker its half
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    pinned = Cluster(EngineConfig(), WorkerSettings(), RouterSettings(), ClusterSettings(pin_cores=True, decode=3))
    flags = [_flags(args) for _, args in pinned.worker_commands(num_gpus=0)]
    assert [f["--num-threads"] for f in flags] == ["2"] * 4  # its own cores, one thread each
    assert [f["--cpus"] for f in flags] == ["0,1", "2,3", "4,5", "6,7"]
    set_by_hand = Cluster(EngineConfig(num_threads=3), WorkerSettings(), RouterSettings(), ClusterSettings())
    assert {_flags(args)["--num-threads"] for _, args in set_by_hand.worker_commands(num_gpus=0)} == {"3"}


def cluster(engine=EngineConfig(), **settings) -> Cluster:
    return Cluster(engine, WorkerSettings(), RouterSettings(), ClusterSettings(**settings))


def test_unpinned_decode_workers_borrow_the_prefill_workers_cores(monkeypatch):
    """While no prefill computes for it, the one decode worker steps on the whole machine
    (engine/thread_budget.py); prefill workers, colocated and pinned workers, a pool of several
    decode workers (a prefill for one would not stop another from borrowing) and thread counts
    set by hand never borrow on their own."""
    monkeypatch.setattr("os.cpu_count", lambda: 64)  # the machine's; this process may use 8
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))

    def borrowed(cluster: Cluster) -> list[str | None]:
        return [_flags(args).get("--borrow-threads") for _, args in cluster.worker_commands(num_gpus=0)]

    assert borrowed(cluster(prefill=1, decode=1)) == [None, "8"]
    assert borrowed(cluster(prefill=2, decode=1)) == [None, None, "8"]
    assert borrowed(cluster(prefill=2, decode=2)) == [None] * 4
    assert borrowed(cluster(decode=2, colocated=True)) == [None, None]
    assert borrowed(cluster(pin_cores=True)) == [None, None]
    assert borrowed(cluster(EngineConfig(num_threads=2))) == [None, None]
    assert borrowed(cluster(EngineConfig(borrow_threads=6))) == [None, "6"]  # as given
    assert borrowed(cluster(EngineConfig(borrow_threads=6), prefill=2, decode=2)) == [None, None, "6", "6"]
    assert borrowed(cluster(EngineConfig(borrow_threads=6), pin_cores=True)) == [None, None]  # its cores only
    assert borrowed(cluster(EngineConfig(borrow_threads=6), colocated=True)) == [None]  # no prefill worker


def test_unpinned_prefill_workers_share_their_pools_split_of_the_cores(monkeypatch):
    """A prefill worker beside unpinned CPU decode workers runs on the prefill pool's split of
    every core with threads that sleep while they wait (--share-cores), so it takes the cores
    the decode workers leave idle; pinned, colocated, GPU workers and thread counts set by hand
    keep their share."""
    monkeypatch.setattr("os.cpu_count", lambda: 64)  # the machine's; this process may use 8
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))

    def threads_and_sharing(cluster: Cluster, num_gpus: int = 0) -> list[tuple[str, bool]]:
        return [
            (_flags(args)["--num-threads"], "--share-cores" in args)
            for _, args in cluster.worker_commands(num_gpus=num_gpus)
        ]

    assert threads_and_sharing(cluster(prefill=1, decode=1)) == [("8", True), ("4", False)]
    assert threads_and_sharing(cluster(prefill=2, decode=2)) == [("4", True)] * 2 + [("2", False)] * 2
    assert threads_and_sharing(cluster(prefill=4, decode=4)) == [("2", True)] * 4 + [("1", False)] * 4
    assert threads_and_sharing(cluster(prefill=3, decode=1)) == [("2", False)] * 4  # no more than the even split
    assert threads_and_sharing(cluster(decode=2, colocated=True)) == [("4", False)] * 2
    assert threads_and_sharing(cluster(pin_cores=True)) == [("4", False)] * 2
    assert threads_and_sharing(cluster(EngineConfig(num_threads=2))) == [("2", False)] * 2
    assert threads_and_sharing(cluster(EngineConfig(num_threads=2, share_cores=True))) == [("2", True)] * 2
    assert threads_and_sharing(cluster(EngineConfig(share_cores=False))) == [("4", False)] * 2  # opted out
    on_gpus = threads_and_sharing(cluster(EngineConfig(device="cuda")), num_gpus=2)
    assert on_gpus == [("4", False)] * 2


@pytest.mark.parametrize(
    "rule, settings, expected",
    [
        (borrowed_threads, dict(prefill=1, decode=1), 8),
        (borrowed_threads, dict(prefill=3, decode=1), 8),
        (borrowed_threads, dict(prefill=1, decode=2), None),
        (shared_prefill_threads, dict(prefill=1, decode=1), 8),
        (shared_prefill_threads, dict(prefill=2, decode=3), 4),
        (shared_prefill_threads, dict(prefill=0, decode=1), None),
    ]
    + [
        (rule, dict(prefill=1, decode=1, **unshared), None)
        for rule in (borrowed_threads, shared_prefill_threads)
        for unshared in (dict(colocated=True), dict(pinned=True), dict(by_hand=True))
    ],
)
def test_one_rule_each_for_borrowed_and_shared_threads(rule, settings, expected):
    """The launcher, the simulator and the profiler all ask these functions (8 cores)."""
    assert rule(8, **settings) == expected


@pytest.mark.parametrize(
    "cores, prefill, decode, expected", [(2, 1, 1, 2), (2, 2, 1, None), (2, 1, 2, 2), (8, 3, 1, None), (16, 3, 1, 5)]
)
def test_a_prefill_pool_shares_its_split_of_the_cores_only_when_that_is_more_than_the_even_one(
    cores, prefill, decode, expected
):
    assert shared_prefill_threads(cores, prefill=prefill, decode=decode) == expected


def test_share_cores_sets_the_passive_wait_policy_before_torch_loads(monkeypatch):
    """OpenMP reads its wait policy once, when torch loads it: the worker command sets it first."""
    import pdserve.cli as cli
    import pdserve.prefill_worker.main as prefill_main

    seen = {}

    async def serve(engine, worker, security):
        seen["policy"] = os.environ.get("OMP_WAIT_POLICY")
        seen["share_cores"] = engine.share_cores

    monkeypatch.setattr(prefill_main, "serve", serve)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert cli.main(["prefill", "--share-cores"]) == 0
    assert seen == {"policy": "PASSIVE", "share_cores": True}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert cli.main(["prefill"]) == 0
    assert seen == {"policy": "ACTIVE", "share_cores": None}
