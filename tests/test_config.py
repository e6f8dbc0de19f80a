"""One configuration schema: flag > environment > file > default, for every setting."""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.config import add_arguments, load_file, resolve, to_args
from pdserve.engine.engine_config import EngineConfig
from pdserve.settings import ClusterSettings, RouterSettings, WorkerSettings

ROOT = Path(__file__).resolve().parents[1]


def parse(cls, argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls)
    return parser.parse_args(argv)


def test_precedence_flag_over_env_over_file_over_default(tmp_path):
    file = tmp_path / "pdserve.yaml"
    file.write_text("block_size: 32\nmax_num_seqs: 8\nkv_cache_memory: 1GiB\nenable_prefix_caching: false\n")
    values = load_file(file)
    env = {"PDSERVE_BLOCK_SIZE": "64", "PDSERVE_MAX_NUM_SEQS": "12"}
    config = resolve(EngineConfig, parse(EngineConfig, ["--block-size", "128"]), env=env, file=values)
    assert config.block_size == 128  # flag
    assert config.max_num_seqs == 12  # env beats file
    assert config.kv_cache_memory == "1GiB" and config.enable_prefix_caching is False  # file
    assert config.max_num_batched_tokens == EngineConfig().max_num_batched_tokens  # default


def test_booleans_optionals_and_bad_values():
    assert (
        resolve(EngineConfig, parse(EngineConfig, ["--no-enable-chunked-prefill"]), env={}).enable_chunked_prefill
        is False
    )
    assert resolve(WorkerSettings, None, env={"PDSERVE_METRICS_PORT": "9400"}).metrics_port == 9400
    with pytest.raises(ValueError, match="PDSERVE_BLOCK_SIZE"):
        resolve(EngineConfig, None, env={"PDSERVE_BLOCK_SIZE": "lots"})
    with pytest.raises(ValueError, match="policy must be one of"):
        resolve(RouterSettings, None, env={"PDSERVE_POLICY": "random"})
    with pytest.raises(ValueError, match="block_size"):
        resolve(EngineConfig, None, env={}, file={"block_size": 0})


@pytest.mark.parametrize(
    "cls, values, words",
    [
        (RouterSettings, {"port": 70000}, "port must be a TCP port"),
        (RouterSettings, {"http_port": -1}, "http_port must be a TCP port"),
        (WorkerSettings, {"metrics_port": 65536}, "metrics_port must be a TCP port"),
        (RouterSettings, {"port": 31412, "http_port": 31412}, "http_port: 31412 is port too"),
        (WorkerSettings, {"port": 31412, "kv_port": 31412}, "kv_port: 31412 is port too"),
        (WorkerSettings, {"port": 0, "kv_port": 31412, "metrics_port": 31412}, "metrics_port: 31412 is kv_port too"),
        (RouterSettings, {"request_timeout_s": float("nan")}, "request_timeout_s must be a finite"),
        (RouterSettings, {"worker_wait_s": float("inf")}, "worker_wait_s must be a finite"),
        (WorkerSettings, {"kv_lease_s": float("nan")}, "kv_lease_s must be a finite"),
        (ClusterSettings, {"startup_timeout_s": -5.0}, "startup_timeout_s must be a finite"),
        (ClusterSettings, {"max_worker_restarts": -1}, "max_worker_restarts must be >= 0"),
        # Engine settings a worker used to refuse only after loading its model:
        (EngineConfig, {"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1"),
        (EngineConfig, {"max_num_batched_tokens": -3}, "max_num_batched_tokens must be"),
        (EngineConfig, {"kv_cache_memory": "lots"}, "kv_cache_memory must look like"),
        (EngineConfig, {"kv_cache_memory": "1.5"}, "neither a fraction in .0, 1. nor a whole byte count"),
        (EngineConfig, {"swap_space": "0.5"}, "swap_space must be a size"),
        (EngineConfig, {"kv_cache_memory": "1e999"}, "kv_cache_memory is too large"),
        (EngineConfig, {"swap_space": "1e999GiB"}, "swap_space is too large"),
    ],
)
def test_settings_out_of_range_are_refused_by_name_before_anything_starts(cls, values, words):
    with pytest.raises(ValueError, match=words):
        cls(**values)


def test_yaml_null_is_unset_and_yaml_true_is_not_a_number(tmp_path):
    file = tmp_path / "pdserve.yaml"
    file.write_text("port: null\nblock_size: true\n")
    values = load_file(file)
    assert resolve(RouterSettings, None, env={}, file=values).port == RouterSettings().port
    with pytest.raises(ValueError, match="config file key block_size: 'true' is not a valid int"):
        resolve(EngineConfig, None, env={}, file=values)


def test_a_files_values_are_read_as_written_like_the_environments(tmp_path):
    """YAML would make an unquoted token 012345 the octal number 5349 and a name 1.10 the float
    1.1; a file's text is coerced to each setting's type as an environment variable's is."""
    from pdserve.security import SecuritySettings

    file = tmp_path / "pdserve.yaml"
    file.write_text(
        "api_token: 012345\nserved_model_name: 1.10\nport: 9100\nhttp_port: ~\n"
        "kv_cache_memory: 0.5\nenable_prefix_caching: off\ncpus: 0\n"
    )
    values = load_file(file)
    assert resolve(SecuritySettings, None, env={}, file=values).api_token == "012345"
    router = resolve(RouterSettings, None, env={}, file=values)
    assert (router.served_model_name, router.port, router.http_port) == ("1.10", 9100, None)
    engine = resolve(EngineConfig, None, env={}, file=values)
    assert engine.kv_cache_memory == "0.5" and engine.enable_prefix_caching is False
    assert resolve(WorkerSettings, None, env={}, file=values).cpus == "0"
    file.write_text("served_model_name: [smol, smol2]\n")
    with pytest.raises(ValueError, match="config file key served_model_name: expected one str, got a YAML list"):
        resolve(RouterSettings, None, env={}, file=load_file(file))


def test_config_files_that_cannot_be_read_are_clear_errors(tmp_path):
    (tmp_path / "bad.yaml").write_text("port: 1\na: [\n")
    with pytest.raises(ValueError) as e:
        load_file(tmp_path / "bad.yaml")
    assert str(e.value).startswith(f"config file {tmp_path / 'bad.yaml'} is not valid YAML, line 3, column 1: ")
    assert "\n" not in str(e.value)
    (tmp_path / "utf16.yaml").write_text("port: 1\n", encoding="utf-16")
    with pytest.raises(ValueError, match="utf16.yaml is not UTF-8 text"):
        load_file(tmp_path / "utf16.yaml")
    for text in ("[]\n", "0\n", "false\n", "- port: 1\n"):
        (tmp_path / "list.yaml").write_text(text)
        with pytest.raises(ValueError, match="must hold a mapping of settings"):
            load_file(tmp_path / "list.yaml")
    (tmp_path / "keys.yaml").write_text("null: 1\n")
    with pytest.raises(ValueError, match="None is not a setting name"):
        load_file(tmp_path / "keys.yaml")
    (tmp_path / "empty.yaml").write_text("# nothing set\n")
    assert load_file(tmp_path / "empty.yaml") == {}
    with pytest.raises(ValueError, match="Is a directory"):
        load_file(tmp_path)
    with pytest.raises(ValueError, match="No such file"):
        load_file(tmp_path / "missing.yaml")


def test_to_args_round_trips():
    original = EngineConfig(block_size=32, enable_prefix_caching=False, kv_cache_memory="512MiB")
    assert resolve(EngineConfig, parse(EngineConfig, to_args(original)), env={}) == original


@pytest.mark.e2e  # runs the pdserve command
def test_config_show_prints_the_effective_configuration_without_secrets(tmp_path):
    file = tmp_path / "c.yaml"
    file.write_text("dtype: bfloat16\nport: 6000\n")
    env = {
        "PDSERVE_BLOCK_SIZE": "48",
        "PDSERVE_API_TOKEN": "hunter2",
        "PDSERVE_MAX_NUM_BATCHED_TOKENS": "2048",  # a "token" in its name, no secret
        "PATH": "/usr/bin:/bin",
    }
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "config", "--show", "--config", str(file)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    shown = json.loads(out.stdout)  # by what reads each setting: a port is the router's and each worker's
    assert shown["engine"]["dtype"] == "bfloat16" and shown["engine"]["block_size"] == 48
    assert shown["router"]["port"] == 6000 and shown["worker"]["port"] == 6000
    assert shown["security"]["api_token"] == "***" and "hunter2" not in out.stdout
    assert shown["engine"]["max_num_batched_tokens"] == 2048
    bad = tmp_path / "bad.yaml"
    bad.write_text("no_such_setting: 1\n")
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "config", "--show", "--config", str(bad)], capture_output=True, text=True
    )
    assert result.returncode == 2 and "no_such_setting" in result.stderr


def test_log_level_is_checked_and_read_from_a_config_file_too(tmp_path, capsys, monkeypatch):
    from pdserve.cli import main

    monkeypatch.delenv("PDSERVE_LOG_LEVEL", raising=False)
    assert main(["config", "--log-level", "bogus"]) == 2
    assert "--log-level: 'bogus' is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL" in capsys.readouterr().err
    file = tmp_path / "pdserve.yaml"
    file.write_text("log_level: warning\nblock_size: 32\n")
    assert main(["config", "--config", str(file)]) == 0  # a known key, not a setting of any role
    assert json.loads(capsys.readouterr().out)["engine"]["block_size"] == 32
    assert main(["config", "--config", str(file), "--log-level", "info"]) == 0  # the flag wins; the key stays known
    file.write_text("log_level: 10\n")
    assert main(["config", "--config", str(file)]) == 2 and "'10' is not one of" in capsys.readouterr().err


def test_commands_name_the_flag_that_is_wrong(tmp_path):
    """Each a one-line error naming the setting, exit 2, no traceback (and a router whose HTTP
    port is taken stops its gRPC server instead of leaving it to the garbage collector)."""
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    profile = ROOT / "bench" / "profiles" / "smollm2-cpu-2vcpu-quiet.json"
    cases = [
        (["prefill", "--cpus", "9999"], "cpus: cannot run on cores '9999'"),
        (["prefill", "--device", "foo"], "device: 'foo' is not a torch device"),
        (
            ["plan", "--profile", str(profile), "--workload", "mixed", "--slo", "ttft:abc", "--devices", "2"],
            "--slo ttft",
        ),
        (
            ["router", "--port", "0", "--http-port", str(port), "--decode-workers", "127.0.0.1:1"],
            f"--http-port: could not bind 127.0.0.1:{port}: Address already in use",
        ),
        (
            ["router", "--port", str(port), "--http-port", str(port), "--decode-workers", "127.0.0.1:1"],
            f"http_port: {port} is port too",
        ),
    ]
    for argv, words in cases:
        done = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", *argv], capture_output=True, text=True, timeout=120, cwd=tmp_path
        )
        assert done.returncode == 2 and words in done.stderr, (argv, done.stderr[-2000:])
        assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr[-2000:]
    taken.close()


def test_up_exits_as_a_shell_would_when_a_child_is_killed(monkeypatch):
    from pdserve import cli, launcher
    from pdserve.security import SecuritySettings

    class KilledRouter:
        def __init__(self, *args, **kwargs) -> None:
            self.cluster, self.security, self.router_info = ClusterSettings(), SecuritySettings(), {}

        def start(self) -> str:
            return "127.0.0.1:1"

        def describe(self) -> list:
            return []

        def wait(self) -> int:
            return -9  # SIGKILL

        def stop(self) -> None:
            pass

    monkeypatch.setattr(launcher, "Cluster", KilledRouter)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # up sets its own
    try:
        assert cli.main(["up"]) == 137
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--seed", "99999999999999999999999"], "argument --seed: must be an integer in [0, 2**63)"),
        (["--seed", "-1"], "argument --seed: must be an integer in [0, 2**63)"),
        (["--timeout", "-1"], "argument --timeout: must be a positive number of seconds"),
        (["--timeout", "0"], "argument --timeout: must be a positive number of seconds"),
    ],
)
def test_generate_refuses_bad_flags_by_name_before_calling(capsys, flags, words):
    from pdserve.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["generate", "hi", "--addr", "127.0.0.1:1", *flags])
    assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_a_restarted_worker_gets_its_ports_once_however_often_it_restarts(monkeypatch):
    from pdserve import launcher
    from pdserve.settings import ClusterSettings, RouterSettings, WorkerSettings

    cluster = launcher.Cluster(EngineConfig(), WorkerSettings(), RouterSettings(), ClusterSettings())
    spawned = []

    def spawn(name, args, router=False, register=True):
        spawned.append(args)
        return launcher.Child(name, process=None, ready=None, args=args)

    monkeypatch.setattr(cluster, "_spawn", spawn)
    info = {"grpc": "127.0.0.1:4001", "kv": "127.0.0.1:4002", "metrics": "127.0.0.1:4003"}
    child = launcher.Child("decode-0", process=None, ready=None, args=["decode", "--port=0"], info=info)
    for _ in range(3):
        child = cluster._restart(child)
    assert child.restarts == 3
    assert spawned[-1] == ["decode", "--port=0", "--port", "4001", "--kv-port", "4002", "--metrics-port", "4003"]


def test_up_gives_its_workers_their_addresses_whatever_the_file_or_environment_says():
    """An advertise_host meant for a worker run by hand must not reach ``pdserve up``'s children:
    the router would look for them where they do not listen."""
    from pdserve import launcher

    worker = resolve(WorkerSettings, None, env={"PDSERVE_ADVERTISE_HOST": "127.0.0.2"})
    cluster = launcher.Cluster(EngineConfig(), worker, RouterSettings(), ClusterSettings())
    commands = cluster.worker_commands(num_gpus=0)
    assert commands and all(not any("advertise" in a for a in args) for _, args in commands)
