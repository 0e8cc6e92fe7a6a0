"""Warm ClientApps (dpfl/runtime/warm_clientapps.py,
`dpfl.runtime.supernode --warm-clientapps`): the forked ClientApp gets exactly the arguments
Flower's own SubprocessExecutor would give a new `flwr-clientapp` process; the SuperNode
starts dpfl's SuperExec in place of Flower's; a forked child loads the FAB's dpfl, not the
zygote's, and draws its own random numbers; the zygote reaps its children. (The whole path
runs in every network-namespace deployment test: tests/e2e/test_netns.py checks the forks in
a node's log.)"""

import json
import os
import subprocess
import sys
import time

import pytest
from flwr.supercore.constant import TaskType
from flwr.supercore.superexec.executor import subprocess_executor
from flwr.supercore.superexec.executor.types import ExecutionSpec

from dpfl.runtime import supernode, warm_clientapps


def _spec(**overrides) -> ExecutionSpec:
    fields = dict(task_type=TaskType.CLIENT_APP, runtime_api_address="127.0.0.1:9094",
                  token="tok-1", insecure=True, root_certificates_path=None,
                  runtime_dependency_install=False, parent_pid=None, suppress_output=False,
                  task_id=7)
    fields.update(overrides)
    return ExecutionSpec(**fields)


@pytest.mark.parametrize("overrides", [
    {},
    {"insecure": False, "root_certificates_path": "/certs/ca.crt"},
    {"insecure": False, "root_certificates_path": None},
    {"parent_pid": 4242},
    {"runtime_dependency_install": True, "parent_pid": 1},
    {"suppress_output": True, "insecure": False, "root_certificates_path": "/c.pem"},
])
def test_forked_clientapp_gets_flowers_own_arguments(monkeypatch, overrides):
    launched = []

    class Popen:
        def __init__(self, args, **kwargs):
            launched.append(list(args))

    monkeypatch.setattr(subprocess_executor.subprocess, "Popen", Popen)
    spec = _spec(**overrides)
    subprocess_executor.SubprocessExecutor().launch(spec)
    assert launched == [["flwr-clientapp", *warm_clientapps.clientapp_args(spec)]]


def test_executor_sends_clientapps_to_the_zygote_and_other_tasks_cold(monkeypatch):
    """A ClientApp task becomes one JSON line on the zygote's stdin; a ServerApp task (not
    the zygote's business) goes to Flower's SubprocessExecutor."""
    executor = warm_clientapps.WarmClientAppExecutor()
    cold = []
    monkeypatch.setattr(executor._cold, "launch", lambda spec: cold.append(spec) or "cold")

    class Pipe:
        lines: list[str] = []

        def write(self, text):
            self.lines.append(text)

        def flush(self):
            pass

        def close(self):
            pass

    class Zygote:
        stdin = Pipe()

        def poll(self):
            return None

        def wait(self, timeout=None):
            return 0

    executor._zygote = Zygote()
    spec = _spec(suppress_output=True)
    assert executor.launch(spec).status == "accepted"
    request = json.loads(Pipe.lines[0])
    assert request == {"program": "flwr-clientapp", "args": warm_clientapps.clientapp_args(spec),
                       "suppress-output": True}
    server = _spec(task_type=TaskType.SERVER_APP)
    assert executor.launch(server) == "cold" and cold == [server]
    assert executor.warm_launches == 1
    executor.close()


def test_a_dead_zygote_falls_back_to_a_cold_launch(monkeypatch):
    executor = warm_clientapps.WarmClientAppExecutor()
    cold = []
    monkeypatch.setattr(executor._cold, "launch", lambda spec: cold.append(spec) or "cold")

    def broken():
        raise BrokenPipeError("zygote gone")
    monkeypatch.setattr(executor, "start_zygote", broken)
    spec = _spec()
    assert executor.launch(spec) == "cold" and cold == [spec]
    assert executor.warm_launches == 0


def test_supernode_starts_dpfls_superexec_in_place_of_flowers(monkeypatch):
    from flwr.supernode import start_client_internal

    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda command, *a, **k: started.append(command))
    monkeypatch.setattr(start_client_internal, "subprocess", start_client_internal.subprocess)
    supernode.use_warm_clientapps()
    start_client_internal.subprocess.Popen(["flower-superexec", "--insecure",
                                            "--runtime-api-address", "127.0.0.1:9094"])
    start_client_internal.subprocess.Popen(["something-else", "--x"])
    assert started == [[sys.executable, "-m", "dpfl.runtime.warm_clientapps", "--insecure",
                        "--runtime-api-address", "127.0.0.1:9094"], ["something-else", "--x"]]
    assert start_client_internal.subprocess.DEVNULL == subprocess.DEVNULL


@pytest.mark.parametrize("argv,warm,rest", [
    (["--warm-clientapps", "--insecure"], True, ["--insecure"]),
    (["--insecure"], False, ["--insecure"]),
])
def test_split_warm(argv, warm, rest):
    assert supernode.split_warm(argv) == (warm, rest)


@pytest.mark.parametrize("argv", [["--warm-clientapps", "--isolation", "process"],
                                  ["--warm-clientapps", "--isolation=process"],
                                  ["--warm-clientapps=1"]])
def test_warm_clientapps_refuses_what_it_cannot_do_in_one_line(argv):
    proc = subprocess.run([sys.executable, "-m", "dpfl.runtime.supernode", *argv, "--insecure"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dpfl.runtime.supernode: --warm-clientapps"), \
        proc.stderr


CHILD = """
import json, os, sys
import numpy, torch
# the libraries' thread pools work after the fork: torch's OpenMP matmul on 2 threads and
# NumPy's OpenBLAS, each checked against a single-threaded result
torch.set_num_threads(2)
a = torch.randn(300, 300, dtype=torch.float64)
assert torch.allclose(a @ a, torch.from_numpy(a.numpy() @ a.numpy()))
# one write(2) per report: under PYTHONUNBUFFERED, print() writes the text and its newline
# in two calls, and siblings' reports interleave ("{...}{...}\\n\\n")
report = json.dumps({"pid": os.getpid(), "dpfl": sorted(m for m in sys.modules
                     if m == "dpfl" or m.startswith("dpfl.")),
                     "numpy": int(numpy.random.randint(2**31)),
                     "torch": int(torch.randint(2**31, (1,)))})
os.write(1, (report + "\\n").encode())
"""


def test_zygote_children_forget_dpfl_reseed_and_are_reaped(tmp_path):
    """The zygote's loop (its real preload) with Flower's entry point replaced by a probe:
    each forked child multiplies matrices on torch's and NumPy's thread pools, reports which
    dpfl modules it still sees (none), and NumPy and torch draws that differ between
    siblings; the zygote leaves no zombie and exits at the end of its input."""
    probe = tmp_path / "probe.py"
    probe.write_text(CHILD)
    script = f"""
import sys
from dpfl.runtime import warm_clientapps as w
def fake_clientapp():
    exec(open({str(probe)!r}).read(), {{"__name__": "probe"}})
import flwr.supernode.cli as cli
cli.flwr_clientapp = fake_clientapp
w.serve(sys.stdin)
"""
    zygote = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        request = json.dumps({"args": ["--insecure"]}) + "\n"
        zygote.stdin.write(request * 3 + "not json\n")
        zygote.stdin.flush()
        reports = [json.loads(line) for line in _lines_within(zygote.stdout, 3, 300)]
        assert all(r["dpfl"] == [] for r in reports)  # the FAB's dpfl would load afresh
        assert len({r["pid"] for r in reports}) == 3
        assert len({r["numpy"] for r in reports}) == 3
        assert len({r["torch"] for r in reports}) == 3
        # reaped by the kernel while their zygote lives: none is left, not even a zombie
        # (checked before the zygote exits: an orphan would be init's to reap)
        deadline = time.monotonic() + 30
        while (any(os.path.exists(f"/proc/{r['pid']}") for r in reports)
               and time.monotonic() < deadline):
            time.sleep(0.1)
        left = [r["pid"] for r in reports if os.path.exists(f"/proc/{r['pid']}")]
        assert not left, [open(f"/proc/{p}/stat").read() for p in left]
        zygote.stdin.close()
        assert zygote.wait(timeout=60) == 0
        err = zygote.stderr.read()
        assert err.count("forked (pid") == 3 and "bad request skipped" in err, err
    finally:
        if zygote.poll() is None:
            zygote.kill()
            zygote.wait()


def _lines_within(stream, count: int, seconds: float) -> list[str]:
    """The next ``count`` lines of the pipe ``stream``, read from its file descriptor (a
    text wrapper's buffer would hide lines from select), failing after ``seconds``."""
    import select

    newline = b"\n"
    data, deadline = b"", time.monotonic() + seconds
    while data.count(newline) < count:
        ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        got = data.count(newline)
        assert ready, f"{got} of {count} lines within {seconds} s"
        chunk = os.read(stream.fileno(), 65536)
        assert chunk, f"end of output after {got} of {count} lines"
        data += chunk
    return data.decode().splitlines()[:count]


def test_a_simulation_executor_forks_simulations_and_launches_clientapps_cold(monkeypatch):
    """The SuperLink's SuperExec (``--warm simulation``): a simulation task becomes a JSON
    line for the simulation zygote, with Flower's own flwr-simulation arguments; a ClientApp
    task is not its business (cold)."""
    from flwr.supercore.superexec.executor import subprocess_executor

    launched = []

    class Popen:
        def __init__(self, args, **kwargs):
            launched.append(list(args))

    monkeypatch.setattr(subprocess_executor.subprocess, "Popen", Popen)
    sim = _spec(task_type=TaskType.SIMULATION, parent_pid=77)
    subprocess_executor.SubprocessExecutor().launch(sim)
    assert launched == [["flwr-simulation", *warm_clientapps.clientapp_args(sim)]]

    executor = warm_clientapps.WarmClientAppExecutor("simulation")
    cold = []
    monkeypatch.setattr(executor._cold, "launch", lambda spec: cold.append(spec) or "cold")
    lines = []

    class Zygote:
        class stdin:
            write = staticmethod(lines.append)
            flush = close = staticmethod(lambda: None)

        def poll(self):
            return None

        def wait(self, timeout=None):
            return 0

    executor._zygote = Zygote()
    assert executor.launch(sim).status == "accepted"
    assert json.loads(lines[0]) == {"program": "flwr-simulation",
                                    "args": warm_clientapps.clientapp_args(sim),
                                    "suppress-output": False}
    # one simulation per launcher's SuperLink: the zygote is let go once it forked it
    assert executor._zygote is None
    clientapp = _spec()
    assert executor.launch(clientapp) == "cold" and cold == [clientapp]
    executor.close()


def test_the_launcher_puts_a_warm_superexec_first_on_the_superlinks_path(tmp_path, monkeypatch):
    """`dpfl simulate`: Flower 1.39's SuperLink starts `flower-superexec` by name; the
    launcher's comes first on its PATH and runs dpfl.runtime.warm_clientapps --warm simulation with
    the SuperLink's arguments; DPFL_WARM_SIMULATION=0 leaves Flower's own."""
    from dpfl.runtime import launch

    folder = launch.warm_simulation_bin(tmp_path)
    script = folder / "flower-superexec"
    assert os.access(script, os.X_OK)
    out = subprocess.run(["sh", "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    text = script.read_text()
    assert f'"{sys.executable}" -m dpfl.runtime.warm_clientapps --warm simulation "$@"' in text
    monkeypatch.setenv("DPFL_WARM_SIMULATION", "0")
    assert launch.warm_simulation_bin(tmp_path / "cold") is None


def test_an_unknown_kind_is_refused():
    with pytest.raises(SystemExit, match="unknown kind 'gpu'"):
        warm_clientapps.main(["--warm", "gpu", "--insecure"])


def test_an_early_zygote_leaves_no_folder_behind(tmp_path):
    """The early zygote's FIFO folder goes when the SuperExec has opened it, and when the
    zygote is stopped before that (a launcher killed: its watchdog sends SIGTERM)."""
    import signal as signals

    folder = tmp_path / "z"
    folder.mkdir()
    fifo = folder / "tasks"
    os.mkfifo(fifo)
    zygote = subprocess.Popen([sys.executable, "-m", "dpfl.runtime.warm_clientapps",
                               warm_clientapps.ZYGOTE_FLAG, "simulation",
                               warm_clientapps.FIFO_FLAG, str(fifo)])
    time.sleep(1.0)
    zygote.send_signal(signals.SIGTERM)
    assert zygote.wait(timeout=60) == 143
    assert not folder.exists()

    folder.mkdir()
    os.mkfifo(fifo)
    zygote = subprocess.Popen([sys.executable, "-m", "dpfl.runtime.warm_clientapps",
                               warm_clientapps.ZYGOTE_FLAG, "simulation",
                               warm_clientapps.FIFO_FLAG, str(fifo)])
    with open(fifo, "w"):          # the SuperExec's end: no task, then end of file
        deadline = time.monotonic() + 120
        while folder.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not folder.exists()   # removed once both ends were open
    assert zygote.wait(timeout=60) == 0
