"""Hostile, authenticated nodes against the network-namespace deployment (TLS + SuperNode
auth), and a node whose key is revoked mid-run (issue 30, items 4 and 3).

One federation for the module: ``deploy/netns.sh up --nodes 3 --own-nodes 2``: SuperNodes 0
and 1 are Flower's ``flower-supernode`` with dpfl's ClientApp; node 2's key is registered and
mapped to partition 2 (node-partitions), but the node is ``hostile_node.py``: Flower's own
Fleet API client signing with that key, dpfl's real ``train`` computing an honest DP-SGD
reply each round, and a per-round choice of what it actually pushes (see its docstring).

- :func:`test_hostile_replies_and_a_revoked_key` (one 4-round DP-SGD MNIST run): round 2
  replays round 1's reply (its old message again, then its content as the answer to round
  2's instruction), round 3 claims partition 0, round 4 carries a 256 MiB array; after
  round 1 the operator unregisters SuperNode 1's key (``flwr supernode unregister``). Each
  hostile reply is refused with a logged reason, the run completes, every client is charged
  at no less than the plan the server sent, and SuperNode 1 is refused from then on.
- :func:`test_push_beyond_the_grpc_limit` (about 4 GiB of memory in the pushing process for
  a few seconds; deselect with ``-k 'not beyond'``): one PushObject of 2 GiB + 4 KiB with the
  hostile node's key is refused by gRPC; the SuperLink keeps serving.
- :func:`test_unauthenticated_flood`: from a namespace with no key, TLS handshakes and
  unauthenticated Fleet calls for 20 s; all refused, while an authenticated node's heartbeat
  and the operator's ``flwr list`` stay responsive (latencies before/during are printed).

They need root, iproute2 with network namespaces, openssl and ssh-keygen: without them a
test skips, or fails under CI=true (see ``tests/requirements.py``)."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from requirements import command_works, missing_requirements, require

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "netns.sh"
HOSTILE = Path(__file__).resolve().parent / "hostile_node.py"
VENV_BIN = Path(os.environ.get("DPFL_VENV_BIN", ROOT / ".venv" / "bin"))
PREFIX = "dpflh"  # test namespaces: dpflh-*
LINK = "10.77.0.1:9092"
FLOOD_IP = "10.77.0.200"
TOOLS = ("ip", "openssl", "ssh-keygen")
PROBES = {"ip netns": command_works("ip", "netns", "list")}
OVERSIZE = 256 * 2 ** 20       # the in-run oversized array: ~700x the model's update
ROUNDS = 4
RUN_CONFIG = ('dataset="mnist" model="mlp" train-subset=600 num-rounds=4 batch-size=32 '
              'target-epsilon=8.0 round-timeout=150.0 min-train-nodes=2 run-name="hostile"')


def _require() -> None:
    require(tools=TOOLS, root=True, probes=PROBES, what="the hostile-node test")


def _sh(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["nice", "-n", "10", str(SCRIPT), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, check=check)


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
            "PYTHONWARNINGS": "ignore",
            "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", **extra}


class Federation:
    def __init__(self, state: Path, work: Path):
        self.state, self.work = state, work
        self.certs = state / "certs"
        mapping = (state / "node-partitions").read_text().strip()
        self.node_of = {int(p): int(n) for n, p in (x.split(":") for x in mapping.split(","))}
        self.events = work / "hostile-events.jsonl"
        self.hostile: subprocess.Popen | None = None

    def in_ns(self, ns: str, *cmd: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", f"{PREFIX}-{ns}", *cmd], env=_env(**kw),
                              capture_output=True, text=True, timeout=timeout, cwd=self.work)

    def operator(self, *args: str) -> subprocess.CompletedProcess:
        return self.in_ns("link", str(VENV_BIN / "flwr"), *args,
                          FLWR_HOME=str(self.state / "flwr-home"))

    def start_hostile(self, plan: str) -> None:
        log = open(self.state / "hostile.log", "w")
        self.hostile = subprocess.Popen(
            ["ip", "netns", "exec", f"{PREFIX}-n2", "nice", "-n", "10", sys.executable,
             str(HOSTILE), "node", "--superlink", LINK, "--ca", str(self.certs / "ca.crt"),
             "--key", str(self.certs / "keys" / "supernode-2"), "--partition", "2",
             "--partitions", "3", "--plan", plan, "--events", str(self.events),
             "--lifetime", "600"], stdout=log, stderr=subprocess.STDOUT,
            env=_env(FLWR_HOME=str(self.state / "hostile-home")), start_new_session=True)
        (self.state / "extra-hostile.pid").write_text(f"{self.hostile.pid}\n")  # for `down`

    def read_events(self) -> list[dict]:
        if not self.events.exists():
            return []
        return [json.loads(line) for line in self.events.read_text().splitlines() if line]

    def superlink_pids(self) -> list[int]:
        from dpfl.runtime.watchdog import descendants

        root = int((self.state / "superlink.pid").read_text())
        # flower-superlink, run by deploy/netns.sh as `python -m dpfl.runtime.superlink ...`
        return [p for p in [root, *descendants(root)]
                if any(name in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
                       for name in ("flower-superlink", "dpfl.runtime.superlink"))]

    def superlink_peak_rss_mib(self) -> float:
        """VmHWM (peak resident memory) of the flower-superlink process, MiB."""
        for pid in self.superlink_pids():
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    def probe(self, partition: int = 0, count: int = 20) -> list[dict]:
        proc = self.in_ns(f"n{partition}", sys.executable, str(HOSTILE), "probe", "--superlink",
                          LINK, "--ca", str(self.certs / "ca.crt"), "--key",
                          str(self.certs / "keys" / f"supernode-{partition}"), "--node-id",
                          str(self.node_of[partition]), "--count", str(count))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def timed_list(self) -> float:
        start = time.monotonic()
        proc = self.operator("list", "netns")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return time.monotonic() - start


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    if missing_requirements(TOOLS, root=True, probes=PROBES):
        yield None
        return
    work = tmp_path_factory.mktemp("hostile")
    state = work / "fed"
    taken = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{PREFIX}-" not in taken, f"namespaces of prefix {PREFIX} exist already: {taken}"
    federation = None
    try:
        up = _sh("up", str(state), "--nodes", "3", "--prefix", PREFIX, "--own-nodes", "2",
                 check=False)
        assert up.returncode == 0 and "federation up" in up.stdout, up.stdout + up.stderr
        federation = Federation(state, work)
        yield federation
    finally:
        started = [int(p.read_text()) for p in state.glob("*.pid")] if state.exists() else []
        _sh("down", str(state), check=False)
        if federation is not None and federation.hostile is not None:
            federation.hostile.wait(timeout=30)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"{PREFIX}-" not in listed, listed
        alive = [p for p in started if Path(f"/proc/{p}").exists()
                 and "zombie" not in Path(f"/proc/{p}/status").read_text()]
        assert not alive, f"processes left after down: {alive}"


def _wait_for(path: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.5)
    raise AssertionError(f"{text!r} never appeared in {path}")


@pytest.mark.e2e
def test_hostile_replies_and_a_revoked_key(fed):
    """Replay, a claimed partition and a 256 MiB reply from an authenticated node, and a
    key unregistered after round 1: refused with reasons, the run completes with the
    honest node, every received reply is charged at no less than the plan."""
    _require()
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    fed.start_hostile(f"1:honest,2:replay,3:claim=0,4:oversize={OVERSIZE}")
    runs = fed.work / "runs"
    run_log = fed.work / "run.log"
    with open(run_log, "w") as out:
        run = subprocess.Popen(
            ["nice", "-n", "10", str(SCRIPT), "run", str(fed.state), "--run-config",
             f'{RUN_CONFIG} output-dir="{runs}"'], cwd=ROOT, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rounds_file = runs / "hostile" / "rounds.jsonl"
        _wait_for(rounds_file, '"round": 1', 400)
        revoked = fed.node_of[1]
        unreg = fed.operator("supernode", "unregister", str(revoked), "netns")
        assert unreg.returncode == 0, unreg.stdout + unreg.stderr
        assert run.wait(timeout=600) == 0, run_log.read_text()[-3000:]
    finally:
        if run.poll() is None:
            from dpfl.runtime.launch import stop_process_group
            stop_process_group(run, grace=5.0)
    log = run_log.read_text()
    rounds = [json.loads(line) for line in rounds_file.read_text().splitlines()]
    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1))
    events = fed.read_events()
    pushes = {(e["round"], e["what"]): e for e in events if e["event"] == "push"}
    link_log = (fed.state / "superlink.log").read_text()

    # 2: the old reply message again: the SuperLink refuses it (its instruction is gone)
    old = next(e for (r, w), e in pushes.items() if r == 2 and w.startswith("old reply message"))
    assert f"Failed to store Message reply: The message it replies to with message_id " \
           f"{old['replies_to']} does not exist" in link_log
    #    its content as the answer to round 2: the server refuses it (bound to round 1)
    assert "round 2: invalid from client-2 dropped: reply answers round 1, but the " \
           "instruction it replies to is of round 2" in log
    # 3: partition 0 claimed: refused, charged to its own partition (node-partitions)
    assert ("round 3: invalid from client-2 dropped: partition-id 0 differs from this "
            "node's 2 (node-partitions)") in log
    # 4: a 256 MiB array where the model has a (784 x 128) one: refused by shape
    big = pushes[(4, f"reply with a {OVERSIZE}-byte array")]
    assert big["outcome"] == "pushed", big
    assert "round 4: invalid from client-2 dropped: update: " in log
    assert f"has shape ({OVERSIZE // 4},)" in log
    for r in (2, 3, 4):
        assert rounds[r - 1]["clients"]["client-2"]["status"] == "invalid", rounds[r - 1]

    # revocation: SuperNode 1 is refused from the next round on; the others go on
    for r in rounds[2:]:   # from round 3 on (round 2 may have started before the revocation)
        assert revoked not in r["sampled-nodes"], r["sampled-nodes"]
        assert r["clients"]["client-0"]["status"] == "accepted", r["clients"]
    node1_tail = (fed.state / "supernode-1.log").read_text().splitlines()[-5:]
    print("\nSuperNode 1 after its key was unregistered:", node1_tail)
    listed = json.loads(fed.operator("supernode", "list", "netns", "--format", "json").stdout)
    assert str(revoked) not in {n["node-id"] for n in listed["nodes"]
                                if n.get("status") != "unregistered"}

    # the ledger: every reply the server received charged, no event below the plan
    ledger = json.loads((runs / "hostile" / "ledger.json").read_text())
    plans = {e["round"]: e["plan"] for e in events if e["event"] == "instruction"}
    plan = plans[1]
    assert all(p == plan for p in plans.values()), plans   # equal partitions: one plan
    received: dict[str, set[int]] = {}
    for r in rounds:
        for c in r.get("charges", []):
            received.setdefault(c["client"], set()).add(c["round"])
    summary = []
    for client, entry in ledger["clients"].items():
        assert set(entry["rounds"]) >= received.get(client, set()), (client, entry)
        for ev in entry["events"]:
            assert ev["mechanism"] == "dpsgd" and ev["sigma"] <= plan["plan-sigma"] + 1e-12
            assert ev["rate"] >= plan["plan-rate"] - 1e-12
            assert ev["steps"] >= plan["plan-steps"]
        # the plan's epsilon for as many rounds, by dp-accounting's PLD accountant
        acc = pld_privacy_accountant.PLDAccountant()
        step = dp_accounting.PoissonSampledDpEvent(
            plan["plan-rate"], dp_accounting.GaussianDpEvent(plan["plan-sigma"]))
        acc.compose(step, int(plan["plan-steps"]) * len(entry["events"]))
        planned = acc.get_epsilon(ledger["delta"])
        assert entry["epsilon"] >= planned * (1 - 1e-3), (client, entry["epsilon"], planned)
        summary.append(f"{client}: rounds {entry['rounds']}, epsilon {entry['epsilon']:.4f} "
                       f"(plan for {len(entry['events'])} rounds {planned:.4f})")
    assert set(ledger["clients"]["client-2"]["rounds"]) == {1, 2, 3, 4}
    assert ledger["over-budget"] == []
    assert fed.superlink_pids(), "the SuperLink is gone"
    print("\nhostile run:", "; ".join(summary))
    print("refusals:", [e for e in events if e["event"] == "push"])
    print("SuperLink peak RSS (MiB):", round(fed.superlink_peak_rss_mib(), 1))


@pytest.mark.e2e
def test_push_beyond_the_grpc_limit(fed):
    """One PushObject of 2 GiB + 4 KiB signed with a registered key: gRPC refuses it
    (RESOURCE_EXHAUSTED), the SuperLink keeps serving nodes and the operator."""
    _require()
    before = fed.superlink_peak_rss_mib()
    proc = fed.in_ns("n2", "nice", "-n", "10", sys.executable, str(HOSTILE), "beyond",
                     "--superlink", LINK, "--ca", str(fed.certs / "ca.crt"), "--key",
                     str(fed.certs / "keys" / "supernode-2"), "--node-id",
                     str(fed.node_of[2]), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["outcome"] == "refused" and result["code"] == "StatusCode.RESOURCE_EXHAUSTED"
    assert "Received message larger than max" in result["details"], result
    assert fed.superlink_pids(), "the SuperLink is gone"
    assert all(p["ok"] is True for p in fed.probe(0, count=5))
    fed.timed_list()
    print(f"\nbeyond the limit: {result}; SuperLink peak RSS {before:.0f} -> "
          f"{fed.superlink_peak_rss_mib():.0f} MiB")


@pytest.mark.e2e
def test_unauthenticated_flood(fed):
    """From a namespace without a key: TLS handshakes and unauthenticated Fleet calls
    (bounded by 20 s; stopped with SIGUSR1 once the measurements during it are taken). Every
    call is refused; an authenticated heartbeat and the operator's `flwr list` keep working,
    their latencies measured before and during the flood."""
    _require()
    hub, ns = f"{PREFIX}-hub", f"{PREFIX}-x"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    for cmd in (["ip", "-n", ns, "link", "set", "lo", "up"],
                ["ip", "link", "add", f"{PREFIX}xa", "type", "veth", "peer", "name",
                 f"{PREFIX}xb"],
                ["ip", "link", "set", f"{PREFIX}xa", "netns", ns],
                ["ip", "link", "set", f"{PREFIX}xb", "netns", hub],
                ["ip", "-n", ns, "addr", "add", f"{FLOOD_IP}/24", "dev", f"{PREFIX}xa"],
                ["ip", "-n", ns, "link", "set", f"{PREFIX}xa", "up"],
                ["ip", "-n", hub, "link", "set", f"{PREFIX}xb", "master", "br0"],
                ["ip", "-n", hub, "link", "set", f"{PREFIX}xb", "up"]):
        subprocess.run(cmd, check=True)
    before_hb = [p["ms"] for p in fed.probe(0)]
    before_list = [fed.timed_list() for _ in range(3)]
    flood = subprocess.Popen(
        ["ip", "netns", "exec", ns, "nice", "-n", "10", sys.executable, str(HOSTILE), "flood",
         "--superlink", LINK, "--ca", str(fed.certs / "ca.crt"), "--seconds", "20",
         "--threads", "4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=_env(), start_new_session=True)
    try:
        time.sleep(3)
        during = fed.probe(0)
        during_list = [fed.timed_list() for _ in range(3)]
        if flood.poll() is None:   # measured: the rest of the flood would only burn CPU
            flood.send_signal(signal.SIGUSR1)
        out, err = flood.communicate(timeout=60)
    finally:
        if flood.poll() is None:
            from dpfl.runtime.launch import stop_process_group
            stop_process_group(flood, grace=5.0)
    assert flood.returncode == 0, err[-2000:]
    counts = json.loads(out.strip().splitlines()[-1])
    handshakes = counts.get("tls-handshake-completed", 0)
    calls = {k: v for k, v in counts.items() if k.startswith("grpc-")}
    assert handshakes > 50, counts
    assert sum(calls.values()) > 20 and "grpc-ACCEPTED" not in calls, counts
    assert all(k.startswith("grpc-UNAUTHENTICATED") for k in calls), counts
    assert all(p["ok"] is True for p in during), during
    during_hb = [p["ms"] for p in during]
    med_before, med_during = statistics.median(before_hb), statistics.median(during_hb)
    assert med_during < 2000, (med_before, med_during)
    assert max(during_list) < 30, during_list
    assert fed.superlink_pids(), "the SuperLink is gone"
    print(f"\nflood: {counts}\nheartbeat ms median before {med_before:.1f} (max "
          f"{max(before_hb):.1f}), during {med_during:.1f} (max {max(during_hb):.1f}); "
          f"flwr list s before {statistics.median(before_list):.2f}, during "
          f"{statistics.median(during_list):.2f}")
