"""`dpfl simulate --ray-address`: the address is checked before anything starts (one line,
exit 2), the simulation's environment names the cluster, and without the option the
simulation's Ray is private (``RAY_ADDRESS=local``) whatever the caller's environment says.
The run on a real two-node cluster is tests/e2e/test_ray_cluster.py."""

from __future__ import annotations

import math
import os
import socket
from contextlib import contextmanager
from pathlib import Path

import pytest

from dpfl.cli import main
from dpfl.errors import UserError
from dpfl.runtime import launch
from dpfl.runtime.launch import federation_config
from dpfl.runtime.preflight import (
    check_cpus_per_client,
    check_parallel_clients,
    check_ray_address,
)

ROOT = Path(__file__).resolve().parents[1]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("address,says", [
    ("nope", "expected HOST:PORT"),
    ("10.0.0.1", "expected HOST:PORT"),
    (":6379", "expected HOST:PORT"),
    ("10.0.0.1:", "expected HOST:PORT"),
    ("10.0.0.1:http", "expected HOST:PORT"),
    ("10.0.0.1:0", "expected HOST:PORT"),
    ("10.0.0.1:65536", "expected HOST:PORT"),
    ("ray://10.0.0.1:10001", "not a URL"),
])
def test_malformed_addresses_are_refused_naming_them(address, says):
    with pytest.raises(UserError, match=says) as info:
        check_ray_address(address, timeout=0.1)
    assert address in str(info.value) and "\n" not in str(info.value)


def test_an_address_where_nothing_listens_is_refused():
    port = _closed_port()
    with pytest.raises(UserError, match=f"127.0.0.1:{port}: no Ray head answers there"):
        check_ray_address(f"127.0.0.1:{port}", timeout=2.0)


def test_a_listening_address_is_accepted():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert check_ray_address(f" 127.0.0.1:{port} ") == f"127.0.0.1:{port}"


def test_cpus_per_client_is_capped_by_this_machine_only_without_a_cluster():
    more = (os.cpu_count() or 1) + 1
    with pytest.raises(UserError, match="the CPUs of this machine"):
        check_cpus_per_client(more)
    check_cpus_per_client(more, cluster=True)   # another node may have them
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(UserError, match="--cpus-per-client"):
            check_cpus_per_client(bad, cluster=True)


def test_parallel_clients_sizes_the_private_ray_in_whole_cpus():
    """Flower starts one ClientApp actor per client's CPUs of the Ray it starts: N parallel
    clients of c CPUs each is a Ray of N*c CPUs (whole: Ray's num_cpus is an integer)."""
    assert federation_config(5, 1.0, None) == "num-supernodes=5 client-resources-num-cpus=1"
    assert federation_config(5, 1.0, 1) == ("num-supernodes=5 client-resources-num-cpus=1 "
                                             "init-args-num-cpus=1")
    assert federation_config(5, 0.5, 4).endswith("client-resources-num-cpus=0.5 "
                                                 "init-args-num-cpus=2")
    check_parallel_clients(None, 1.0, cluster=True)
    check_parallel_clients(3, 2.0)
    for parallel, cpus, says in [(0, 1.0, "at least 1"), (-2, 1.0, "at least 1"),
                                 (3, 0.5, "whole number of CPUs")]:
        with pytest.raises(UserError, match=says) as info:
            check_parallel_clients(parallel, cpus)
        assert "--parallel-clients" in str(info.value)
    with pytest.raises(UserError, match="--ray-address"):
        check_parallel_clients(2, 1.0, cluster=True)


def test_cli_refuses_zero_parallel_clients_before_anything_starts(tmp_path, capsys):
    code = main(["simulate", "--clients", "2", "--output-dir", str(tmp_path),
                 "--parallel-clients", "0", "dataset=digits", "num-rounds=1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--parallel-clients must be at least 1" in err
    assert not any(tmp_path.iterdir())


def test_cli_refuses_a_bad_address_in_one_line_before_anything_starts(tmp_path, capsys):
    port = _closed_port()
    code = main(["simulate", "--clients", "2", "--output-dir", str(tmp_path),
                 "--ray-address", f"127.0.0.1:{port}", "dataset=digits", "num-rounds=1"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and f"--ray-address 127.0.0.1:{port}" in err, err
    assert not any(tmp_path.iterdir())   # no run folder left behind


@pytest.mark.parametrize("given,expected", [(None, "local"), ("10.0.0.1:6379", "10.0.0.1:6379")])
def test_the_simulation_environment_names_the_cluster_or_a_private_ray(
        tmp_path, monkeypatch, given, expected):
    """The SuperLink (and so flwr-simulation, whose ray.init() reads RAY_ADDRESS) and
    `flwr run` get RAY_ADDRESS = the given cluster, else "local": never the caller's."""
    monkeypatch.setenv("RAY_ADDRESS", "192.0.2.99:6379")   # e.g. left in the user's shell
    seen: dict[str, dict] = {}

    @contextmanager
    def superlink(flwr_home, env, while_starting=None, before_stop=None, run_ended=None):
        seen["superlink"] = dict(env)
        if while_starting is not None:
            while_starting()
        yield "127.0.0.1:1"

    class FlwrRun:
        pid = 999999
        stdout = stderr = None

        def __init__(self, cmd, env, **kwargs):
            seen["flwr run"] = dict(env)
            import io

            self.stdout = io.BytesIO() if kwargs.get("stdout") is launch.subprocess.PIPE \
                else None
            self.stderr = io.BytesIO()
            self.stdin = io.BytesIO()

        def poll(self):
            return 0

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(launch, "simulation_superlink", superlink)
    monkeypatch.setattr(launch.subprocess, "Popen", FlwrRun)
    with pytest.raises(launch.RunFailed):   # no ServerApp ran: no status
        launch._launch(ROOT, 2, {}, tmp_path, tmp_path / "run", tmp_path / ".flwr", 1.0,
                       None, True, ray_address=given)
    assert seen["superlink"]["RAY_ADDRESS"] == expected
    assert seen["flwr run"]["RAY_ADDRESS"] == expected
