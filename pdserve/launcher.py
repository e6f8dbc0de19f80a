"""``pdserve up``: the whole topology as child processes of one launcher.

Workers start first on free ports and report their addresses on a ready line; the router
starts with those addresses. On shutdown the router gets SIGTERM first and drains, then the
workers (each SIGKILLed after a grace period). Every child is bound to the launcher's life
with PR_SET_PDEATHSIG, so even a killed launcher leaves no orphans.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from pdserve.config import env_names, to_args
from pdserve.engine.engine_config import EngineConfig
from pdserve.placement import (
    Placement,
    borrowed_threads,
    count_visible_gpus,
    plan,
    shared_prefill_threads,
    threads_per_worker,
    usable_cores,
)
from pdserve.process import parse_ready
from pdserve.security import SecuritySettings
from pdserve.settings import ClusterSettings, RouterSettings, WorkerSettings

log = logging.getLogger(__name__)
STOP_GRACE_S = 15.0


def _child_setup() -> None:
    """In a child before it runs: dies with the launcher, and has a process group of its own (a
    terminal's Ctrl-C reaches the launcher only, which stops the children in order)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    os.setpgid(0, 0)  # Popen's process_group does this from Python 3.11 only


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    ready: queue.Queue
    args: list[str]
    router: bool = False
    info: dict | None = None
    restarts: int = 0


class Cluster:
    def __init__(
        self,
        engine: EngineConfig,
        worker: WorkerSettings,
        router: RouterSettings,
        cluster: ClusterSettings,
        security: SecuritySettings | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.engine = engine
        self.env = dict(env or {})  # extra environment for every child (e.g. PDSERVE_LOG_LEVEL)
        self.worker = worker
        self.router = router
        self.cluster = cluster
        # Internal ports always require a cluster credential; make one up if none was given.
        security = security or SecuritySettings()
        if security.tls and not security.tls_ca:
            raise ValueError(
                "tls_cert: pdserve up needs tls_ca too (the router checks its workers' certificates with it)"
            )
        if security.tls_ca and not security.tls:
            raise ValueError("tls_ca: pdserve up needs tls_cert and tls_key too (its workers serve TLS with them)")
        self.security = dataclasses.replace(security, cluster_token=security.cluster_token or secrets.token_urlsafe(24))
        self.children: list[Child] = []
        self.router_info: dict = {}

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> str:
        """Starts every process; returns the router address once all are ready."""
        deadline = time.monotonic() + self.cluster.startup_timeout_s
        workers = [self._spawn(name, args) for name, args in self.worker_commands()]
        for child in workers:
            self._wait_ready(child, deadline)
        prefill = [c.info["grpc"] for c in workers if c.info["role"] == "prefill"]
        decode = [c.info["grpc"] for c in workers if c.info["role"] != "prefill"]
        router_settings = dataclasses.replace(
            self.router,
            prefill_workers=",".join(prefill),
            decode_workers=",".join(decode),
            model=self.engine.model,
            cache_dir=self.engine.cache_dir,
            max_model_len=self.engine.max_model_len,
            metrics_port=0 if self.cluster.metrics and self.router.metrics_port is None else self.router.metrics_port,
        )
        router = self._spawn("router", ["router", *to_args(router_settings), *self._tls_args()], router=True)
        self._wait_ready(router, deadline)
        self.router_info = router.info
        return router.info["grpc"]

    def describe(self) -> list[dict]:
        """Every process with its addresses (its ready line)."""
        return [{"name": c.name, "pid": c.process.pid, **(c.info or {})} for c in self.children]

    def wait(self) -> int | None:
        """Supervises until the router exits (returns its code) or the launcher is signalled.

        A worker that dies is restarted on the same ports, so the router's health checks bring
        it back into rotation; meanwhile the router routes around it (and migrates its requests).
        """
        while True:
            for i, child in enumerate(self.children):
                code = child.process.poll()
                if code is None:
                    continue
                if child.router or child.restarts >= self.cluster.max_worker_restarts:
                    log.error("%s exited with code %s; stopping the cluster", child.name, code)
                    return code or 1
                log.warning(
                    "%s exited with code %s; restarting it (restart %d of %d)",
                    child.name,
                    code,
                    child.restarts + 1,
                    self.cluster.max_worker_restarts,
                )
                self.children[i] = self._restart(child)
            time.sleep(0.5)

    def _restart(self, child: Child) -> Child:
        ports = {"--port": child.info["grpc"].rsplit(":", 1)[1]}
        if child.info.get("kv"):
            ports["--kv-port"] = child.info["kv"].rsplit(":", 1)[1]
        if child.info.get("metrics"):
            ports["--metrics-port"] = child.info["metrics"].rsplit(":", 1)[1]
        args = list(child.args)
        for flag, value in ports.items():
            args += [flag, value]
        fresh = self._spawn(child.name, args, register=False)
        fresh.args = child.args  # the first start's: the next restart adds its ports once, not again
        fresh.restarts = child.restarts + 1
        fresh.info = child.info  # same addresses; the ready line will confirm them
        return fresh

    def stop(self) -> None:
        # The router first, alone: it drains its streams (within its grace period) while the
        # workers they run on still serve them; then the workers, which have nothing left.
        for group in ([c for c in self.children if c.router], [c for c in self.children if not c.router]):
            for child in group:
                if child.process.poll() is None:
                    child.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for child in group:
                try:
                    child.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %.0f s; killing it", child.name, STOP_GRACE_S)
                    child.process.kill()
                    child.process.wait()

    def worker_commands(self, num_gpus: int | None = None) -> list[tuple[str, list[str]]]:
        """(name, pdserve arguments) of every worker; ``num_gpus``: the visible GPUs (found out
        when None and the device setting lets workers go to GPUs)."""
        roles = self._worker_roles()
        role_devices = self.cluster.role_devices()
        if num_gpus is None:
            wants_count = self.engine.device in ("auto", "cuda") and not all(role_devices[r] for r, _ in roles)
            num_gpus = count_visible_gpus() if wants_count else 0
        placements = plan(
            [role for role, _ in roles],
            device=self.engine.device,
            kv_cache_memory=self.engine.kv_cache_memory,
            num_gpus=num_gpus,
            role_devices=role_devices,
        )
        cpu_plan = self._cpu_plan(len(roles))
        return [
            (f"{role}-{i}", [role, *self._worker_args(role, cpu_plan[n], placements[n]), *self._tls_args()])
            for n, (role, i) in enumerate(roles)
        ]

    # -- internals ----------------------------------------------------------------------------
    def _worker_roles(self) -> list[tuple[str, int]]:
        if self.cluster.colocated:
            return [("decode", i) for i in range(self.cluster.decode)]
        return [("prefill", i) for i in range(self.cluster.prefill)] + [
            ("decode", i) for i in range(self.cluster.decode)
        ]

    def _cpu_plan(self, num_workers: int) -> list[str]:
        """Cores per worker: split the machine evenly when pinning, else no pinning."""
        if not self.cluster.pin_cores:
            return [""] * num_workers
        cores = sorted(os.sched_getaffinity(0))
        per = max(1, len(cores) // num_workers)
        return [",".join(str(cores[(n * per + k) % len(cores)]) for k in range(per)) for n in range(num_workers)]

    def _worker_args(self, role: str, cpus: str, placement: Placement) -> list[str]:
        pinned = len(cpus.split(",")) if cpus else 0
        threads = self.engine.num_threads or pinned or threads_per_worker(len(self._worker_roles()))
        borrow = None  # a decode worker beside unpinned prefill workers: their share too, while they idle
        share = self.engine.share_cores  # a prefill worker beside unpinned decode workers: every idle core
        if self._shares_cores(cpus, placement):
            pools = dict(
                prefill=self.cluster.prefill, decode=self.cluster.decode, by_hand=self.engine.num_threads is not None
            )
            if role == "decode":
                borrow = self.engine.borrow_threads or borrowed_threads(usable_cores(), **pools)
            elif share is not False and (shared := shared_prefill_threads(usable_cores(), **pools)):
                threads, share = shared, True
        tp, pp = self.cluster.role_parallelism(
            role, self.engine.tensor_parallel_size, self.engine.pipeline_parallel_size
        )
        engine = dataclasses.replace(
            self.engine,
            num_threads=threads,
            borrow_threads=borrow if borrow is not None and borrow > threads else None,
            share_cores=share,
            device=placement.device,
            kv_cache_memory=placement.kv_cache_memory,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            # Speculation is a decode-side setting: a prefill pool (parallel or not) runs without it.
            speculative="none" if role == "prefill" else self.engine.speculative,
        )
        worker = dataclasses.replace(
            self.worker,
            host=self.router.host,
            advertise_host=None,  # the router reaches its children where they bind
            port=0,
            kv_port=0,
            cpus=cpus,
            colocated=self.cluster.colocated and role == "decode",
            metrics_port=0 if self.cluster.metrics else None,
            # The router's profile and TPOT SLO also size the workers' prefill chunks.
            profile=self.worker.profile or self.router.profile,
            slo_tpot_ms=self.worker.slo_tpot_ms if self.worker.slo_tpot_ms is not None else self.router.slo_tpot_ms,
        )
        return [*to_args(engine), *to_args(worker)]

    def _shares_cores(self, cpus: str, placement: Placement) -> bool:
        """Whether this CPU worker shares its cores, unpinned, with the other pool's workers (how
        a decode worker borrows and a prefill worker yields: ``placement.borrowed_threads`` and
        ``placement.shared_prefill_threads``)."""
        return (
            not self.cluster.colocated and self.cluster.prefill > 0 and not cpus and placement.device in ("auto", "cpu")
        )

    def _tls_args(self) -> list[str]:
        """TLS settings travel as flags; tokens never do (argv is visible to every user)."""
        return to_args(dataclasses.replace(self.security, cluster_token=None, api_token=None))

    def child_env(self, router: bool = False) -> dict[str, str]:
        # Every setting was resolved here and travels as a flag (tokens below): a child reading
        # ours from the environment would override a flag left out for holding its default.
        settings = env_names(self.engine, self.worker, self.router, self.cluster, self.security)
        env = {
            **{name: value for name, value in os.environ.items() if name not in settings},
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            **self.env,
            "PDSERVE_CLUSTER_TOKEN": self.security.cluster_token,
        }
        if router and self.security.api_token:
            env["PDSERVE_API_TOKEN"] = self.security.api_token
        return env

    def _spawn(self, name: str, args: list[str], router: bool = False, register: bool = True) -> Child:
        cmd = [sys.executable, "-m", "pdserve.cli", *args]
        env = self.child_env(router)
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, preexec_fn=_child_setup)
        child = Child(name, process, queue.Queue(), args, router)
        threading.Thread(target=_pump, args=(child,), name=f"stdout-{name}", daemon=True).start()
        if register:
            self.children.append(child)
        return child

    def _wait_ready(self, child: Child, deadline: float) -> None:
        while child.info is None:
            try:
                child.info = child.ready.get(timeout=0.5)
            except queue.Empty:
                if child.process.poll() is not None:
                    raise RuntimeError(
                        f"{child.name} exited with code {child.process.returncode} before it was ready"
                    ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{child.name} was not ready within {self.cluster.startup_timeout_s:.0f} s (a first "
                        "start converts the model and builds the C++ kernels, see its log above; raise "
                        "--startup-timeout-s)"
                    ) from None


def _pump(child: Child) -> None:
    """Forwards a child's stdout, catching its ready line."""
    for line in child.process.stdout:
        info = parse_ready(line)
        if info is not None:
            child.ready.put(info)
        else:
            sys.stdout.write(f"[{child.name}] {line}")
