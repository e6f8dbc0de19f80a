"""The ``pdserve`` command: up, generate, router, prefill, decode, config, bench, profile, simulate, plan."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import json
import logging
import os
import signal
import sys

from pdserve.client import DEFAULT_ADDRESS
from pdserve.config import add_arguments, load_file, resolve, unknown_file_keys
from pdserve.engine.engine_config import EngineConfig
from pdserve.process import raise_open_file_limit, setup_logging
from pdserve.security import SECRET_SETTINGS, SecuritySettings, add_client_tls_arguments
from pdserve.settings import ClusterSettings, RouterSettings, WorkerSettings

log = logging.getLogger("pdserve")
PLANNER_COMMANDS = {
    "profile": "profile_cli",
    "simulate": "simulate_cli",
    "plan": "plan_cli",
}  # command -> pdserve.planner module

# Set by the launcher (addresses, roles) or shared with the router's flag of the same name (profile, SLO).
UP_WORKER_FIELDS = (
    "host",
    "port",
    "advertise_host",
    "kv_port",
    "colocated",
    "cpus",
    "metrics_port",
    "profile",
    "slo_tpot_ms",
)


def _seed(text: str) -> int:
    from pdserve.request_rules import MAX_SEED

    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**63), got {text}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start router, prefill and decode pools locally; print 'ready'; run until Ctrl-C")
    add_arguments(up, RouterSettings, skip=("prefill_workers", "decode_workers", "model", "cache_dir", "max_model_len"))
    add_arguments(up, ClusterSettings)
    add_arguments(up, EngineConfig)
    add_arguments(up, WorkerSettings, skip=UP_WORKER_FIELDS)
    add_arguments(up, SecuritySettings)

    gen = sub.add_parser("generate", help="stream a completion from a running router")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--addr", default=DEFAULT_ADDRESS, help="router address (default: %(default)s)")
    gen.add_argument("--max-tokens", type=int, default=None)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=_seed, default=None)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--json", action="store_true", help="print one JSON object per streamed message")
    gen.add_argument("--timeout", type=_seconds, default=None, help="deadline in seconds")
    add_client_tls_arguments(gen)
    gen.add_argument(
        "--api-token", default=os.environ.get("PDSERVE_API_TOKEN"), help="bearer token (env PDSERVE_API_TOKEN)"
    )

    router = sub.add_parser("router", help="run the router alone")
    add_arguments(router, RouterSettings)
    add_arguments(router, SecuritySettings)

    for role in ("prefill", "decode"):
        worker = sub.add_parser(role, help=f"run one {role} worker")
        add_arguments(worker, EngineConfig)
        add_arguments(worker, WorkerSettings)
        add_arguments(worker, SecuritySettings, skip=("api_token",))

    health = sub.add_parser("health", help="exit 0 if a pdserve server reports SERVING (for healthchecks)")
    health.add_argument("--addr", default=DEFAULT_ADDRESS, help="server address (default: %(default)s)")
    health.add_argument(
        "--service", default="", help="a service name, e.g. pdserve.v1.DecodeWorker (default: the server)"
    )
    health.add_argument("--timeout", type=_seconds, default=3.0)
    add_client_tls_arguments(health)

    sub.add_parser("bench", add_help=False, help="TTFT/ITL serving benchmark (pdserve bench --help)")
    sub.add_parser("profile", add_help=False, help="measure the model on this machine for the simulator and planner")
    sub.add_parser("simulate", add_help=False, help="the serving benchmark, simulated from a profile")
    sub.add_parser("plan", add_help=False, help="prefill/decode worker counts for a workload, SLOs and a device budget")

    show = sub.add_parser("config", help="print the effective configuration")
    show.add_argument("--show", action="store_true", help="print it (the default action)")
    for p in (up, router, show, *[sub.choices[r] for r in ("prefill", "decode")]):
        p.add_argument("--config", default=None, help="YAML file with settings (flags > env > file > defaults)")
        p.add_argument(
            "--log-level",
            default=None,
            help="DEBUG, INFO (default), WARNING, ERROR or CRITICAL (env PDSERVE_LOG_LEVEL; YAML log_level)",
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the benchmark owns its flags
        from pdserve.bench.serve import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] and argv[0] in PLANNER_COMMANDS:  # the planner's commands own their flags too
        return importlib.import_module(f"pdserve.planner.{PLANNER_COMMANDS[argv[0]]}").main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "generate":
        from pdserve.generate_cli import run_generate

        return run_generate(args)
    if args.command == "health":
        from pdserve.probe import run_health

        return run_health(args)
    try:
        file = load_file(args.config)
        # Not a setting of any role: flag > env > file, like the settings, and passed on to up's children.
        in_file = file.pop("log_level", None)
        args.log_level = args.log_level or os.environ.get("PDSERVE_LOG_LEVEL") or in_file
        setup_logging(args.log_level)
        raise_open_file_limit()
        return _run(args, file)
    except (ValueError, OSError, TimeoutError, RuntimeError) as e:  # OSError: a port in use, a missing file
        print(f"pdserve {args.command}: error: {e}", file=sys.stderr)
        return 2


# What each part of a deployment reads (a setting of the same name may mean different things in two of them).
SETTINGS = {
    "engine": EngineConfig,
    "worker": WorkerSettings,
    "router": RouterSettings,
    "cluster": ClusterSettings,
    "security": SecuritySettings,
}


def _run(args: argparse.Namespace, file: dict) -> int:
    unknown = unknown_file_keys(file, *SETTINGS.values())  # one file serves every role: a typo is a typo anywhere
    if unknown:
        raise ValueError(f"unknown settings in {args.config}: {', '.join(unknown)}")
    if args.command == "config":
        shown = {
            name: {
                k: ("***" if k in SECRET_SETTINGS and v else v)
                for k, v in dataclasses.asdict(resolve(cls, None, file=file)).items()
            }
            for name, cls in SETTINGS.items()
        }  # never print secrets
        print(json.dumps(shown, indent=2))
        return 0
    if args.command == "router":
        from pdserve.router.main import serve

        settings = resolve(RouterSettings, args, file=file)
        asyncio.run(serve(settings, resolve(SecuritySettings, args, file=file)))
        return 0
    if args.command in ("prefill", "decode"):
        engine = resolve(EngineConfig, args, file=file)
        worker = resolve(WorkerSettings, args, file=file)
        if engine.share_cores:  # before torch loads: OpenMP reads its wait policy once, at load
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        from pdserve.engine.parallel.rank_main import follow_launcher

        if (code := follow_launcher(engine)) is not None:  # a rank above 0 that torchrun started
            return code
        if worker.cpu_set():
            try:
                os.sched_setaffinity(0, worker.cpu_set())
            except OSError as e:
                raise ValueError(f"cpus: cannot run on cores {worker.cpus!r} ({e.strerror})") from None
        if args.command == "prefill":
            from pdserve.prefill_worker.main import serve
        else:
            from pdserve.decode_worker.main import serve
        asyncio.run(serve(engine, worker, resolve(SecuritySettings, args, file=file, api_token=None)))
        return 0
    return _up(args, file)


def cluster_of(args: argparse.Namespace, file: dict):
    """The ``pdserve up`` cluster the settings describe (ValueError for settings that cannot run)."""
    from pdserve.launcher import Cluster

    pools = resolve(ClusterSettings, args, file=file)
    # Where both pools set their own size, the engine's is nobody's: it is not checked against the
    # other settings (speculation, swap), which each pool's own size is, as it starts.
    unused = {"tensor_parallel_size": 1} if pools.prefill_tp and pools.decode_tp else {}
    unused |= {"pipeline_parallel_size": 1} if pools.prefill_pp and pools.decode_pp else {}
    return Cluster(
        resolve(EngineConfig, args, file=file, **unused),
        resolve(WorkerSettings, args, file=file),
        resolve(RouterSettings, args, file=file),
        pools,
        resolve(SecuritySettings, args, file=file),
        env={"PDSERVE_LOG_LEVEL": args.log_level} if args.log_level else None,
    )


def _up(args: argparse.Namespace, file: dict) -> int:
    cluster = cluster_of(args, file)
    stop = {"signal": None}

    def on_signal(signum, frame):  # noqa: ARG001
        stop["signal"] = signal.Signals(signum).name
        raise KeyboardInterrupt

    # Set both explicitly: a shell starts background jobs with SIGINT ignored.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        address = cluster.start()
        mode = "colocated" if cluster.cluster.colocated else f"{cluster.cluster.prefill}P{cluster.cluster.decode}D"
        print(f"pdserve cluster: {json.dumps(cluster.describe())}", flush=True)
        http = cluster.router_info.get("http")
        scheme = "https" if cluster.security.tls else "http"
        print(
            f"pdserve ready: router on {address}{f', OpenAI API on {scheme}://{http}/v1' if http else ''} ({mode})",
            flush=True,
        )
        code = cluster.wait()
    except KeyboardInterrupt:
        code = 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        cluster.stop()
        log.info("all processes stopped")
    return 128 - code if code and code < 0 else code or 0  # a child killed by signal N: 128 + N, as a shell says


if __name__ == "__main__":
    sys.exit(main())
