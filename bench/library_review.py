"""What dpfl writes by hand that a library also does (issue 48): measurements behind the
"What we write by hand and why" section of docs/architecture.md.

    .venv/bin/python bench/library_review.py [calibration] [config] [supervision] [progress]
                                             [--quick]

- ``calibration``: sigma for a target epsilon under the PLD accountant, dpfl's own search
  (``calibrate_dpsgd_noise`` / ``calibrate_noise``, coarse-to-fine bisection, relative
  tolerance, memo on disk) against dp-accounting's ``mechanism_calibration.
  calibrate_dp_mechanism`` (Brent's method, absolute tolerance) on the same events; both
  answers judged by the same accounting function. ``--quick``: three cases.
- ``config``: import/build cost of a pydantic schema against the CLI's key check, and what a
  schema's error messages and coercions would be for typical mistakes.
- ``supervision``: stopping a process tree shaped like a simulation's (own sessions, an
  orphaned daemon, a worker ignoring SIGTERM) with dpfl's watchdog, psutil (Ray's vendored
  copy), process-group kills (supervisor's ``killasgroup``) and PR_SET_PDEATHSIG alone.
- ``progress``: dpfl's ``RoundProgress`` lines against ``rich.progress`` with stdout a pipe
  (logs, CI) and a pseudo-terminal.

Every process this script starts is stopped by its PID before it returns.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DELTA = 1e-5


def table(header: list[str], rows: list[list[object]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# 1. sigma calibration (PLD)

# (label, kind, sampling rate q, steps or rounds, target epsilon); delta = 1e-5
CASES = [
    ("sample", 0.01, 1000, 1.0), ("sample", 0.01, 1000, 4.0), ("sample", 0.01, 5000, 8.0),
    ("sample", 0.05, 500, 4.0), ("sample", 0.1, 100, 8.0), ("sample", 0.1, 2000, 4.0),
    ("sample", 0.3, 5000, 1.0), ("sample", 0.3, 5000, 8.0),
    ("client", 0.1, 20, 1.0), ("client", 0.1, 50, 4.0), ("client", 0.1, 100, 8.0),
    ("client", 0.1, 200, 4.0),
]
QUICK = [CASES[0], CASES[4], CASES[9]]


def _calibration_rows(quick, memo_root, A, clear_caches, fresh_pld, dp_event,
                      mechanism_calibration) -> tuple[list[list[object]], bool]:
    """One table row per case (see :func:`calibration`), and whether dp-accounting's
    accountant and dpfl's accounting function agreed bit for bit on every sigma."""
    rows, same_eps = [], True
    for n, (kind, q, count, target) in enumerate(QUICK if quick else CASES):
        os.environ["DPFL_CACHE_DIR"] = str(memo_root / str(n))

        def event_of(sigma: float, q: float = q, count: int = count):
            return dp_event.SelfComposedDpEvent(
                dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), count)

        if kind == "sample":
            rel_tol = 1e-3   # calibrate_dpsgd_noise's default

            def dpfl_sigma(q=q, count=count, target=target):
                return A.calibrate_dpsgd_noise(target, DELTA, q, count, accountant="pld")

            def dpfl_eps(sigma, q=q, count=count):
                return A.dpsgd_history_epsilon_detail([(sigma, q, count)], DELTA, "pld")
        else:
            rel_tol = 1e-4   # calibrate_noise's default

            def dpfl_sigma(q=q, count=count, target=target):
                return A.calibrate_noise(target, DELTA, count, sampling_rate=q,
                                         sampling="poisson", accountant="pld")

            def dpfl_eps(sigma, q=q, count=count):
                return A.gaussian_epsilon_detail(sigma, count, DELTA, q, "poisson", "pld")

        def lib_sigma(tol=None, event_of=event_of, target=target):
            return mechanism_calibration.calibrate_dp_mechanism(
                fresh_pld, event_of, target, DELTA, tol=tol)

        def timed(fn):
            clear_caches()
            t0 = time.perf_counter()
            value = fn()
            return value, time.perf_counter() - t0

        s_dpfl, t_dpfl = timed(dpfl_sigma)           # cold: empty memo, no lru hit
        s_hit, t_hit = timed(dpfl_sigma)             # the memo's hit (two PLD evaluations)
        assert s_hit == s_dpfl
        s_lib, t_lib = timed(lib_sigma)              # dp-accounting, its default tol 1e-6
        # dp-accounting with dpfl's tolerance (absolute, from the answer: its best case)
        s_lib_r, t_lib_r = timed(lambda: lib_sigma(tol=rel_tol * s_lib))
        clear_caches()
        line = []
        for s in (s_dpfl, s_lib, s_lib_r):
            eps, method = dpfl_eps(s)
            lib_eps = fresh_pld().compose(event_of(s)).get_epsilon(DELTA)
            same_eps &= lib_eps == eps and method == "pld(interval=1e-4)"
            minimal = dpfl_eps(s * (1 - rel_tol))[0] > target
            line.append((eps, eps <= target, minimal))
        label = (f"DP-SGD q={q} T={count} ε={target:g}" if kind == "sample"
                 else f"client q={q} R={count} ε={target:g}")

        def ok(r):
            return ("✓" if r[1] else "✗") + ("" if r[2] else " (not min.)")

        rows.append([label, f"{s_dpfl:.6f}", f"{s_lib:.6f}", f"{(s_dpfl / s_lib - 1):+.1e}",
                     f"{line[0][0]:.5f} {ok(line[0])}", f"{line[1][0]:.5f} {ok(line[1])}",
                     f"{t_dpfl:.1f}", f"{t_hit:.2f}", f"{t_lib:.1f}",
                     f"{s_lib_r:.6f} / {line[2][0]:.5f} {ok(line[2])} / {t_lib_r:.1f}"])
        print(f"  {label}: done", file=sys.stderr, flush=True)
    return rows, same_eps


def calibration(quick: bool) -> None:
    import dp_accounting
    from dp_accounting import dp_event, mechanism_calibration
    from dp_accounting.pld import pld_privacy_accountant

    memo_root = Path(tempfile.mkdtemp(prefix="dpfl-calib-memo-"))
    os.environ["DPFL_CACHE_DIR"] = str(memo_root)   # a fresh memo, read by dpfl.memo per call
    from dpfl.privacy.accounting import accountants as A

    def clear_caches() -> None:   # every in-process cache of dpfl's calibration/accounting
        for fn in (A.calibrate_dpsgd_noise, A.calibrate_noise, A._pld_compute,
                   A._sampled_gaussian_pld):
            fn.cache_clear()

    def fresh_pld():
        return pld_privacy_accountant.PLDAccountant(
            dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
            value_discretization_interval=A.PLD_INTERVALS[0])

    try:
        rows, same_eps = _calibration_rows(quick, memo_root, A, clear_caches, fresh_pld,
                                           dp_event, mechanism_calibration)
    finally:
        shutil.rmtree(memo_root, ignore_errors=True)
    print("## 1. sigma calibration, PLD accountant, delta = 1e-5\n")
    print("dpfl: calibrate_dpsgd_noise (DP-SGD, rel_tol 1e-3) / calibrate_noise (client "
          "level, Poisson, rel_tol 1e-4), accountant='pld'; lib: dp_accounting."
          "mechanism_calibration.calibrate_dp_mechanism(PLDAccountant(interval 1e-4), "
          "SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), T)), its "
          "default bracket [0, 1] grown and tol 1e-6. ε of every σ by dpfl's accounting "
          "function; ✓: ε ≤ target; '(not min.)': σ·(1 − rel_tol) would also meet it. "
          "Times in s (cold: no memo, caches cleared).\n")
    print(table(["case", "σ dpfl", "σ lib", "σ dpfl/lib − 1", "ε dpfl", "ε lib",
                 "t dpfl", "t dpfl memo hit", "t lib", "lib at tol = rel_tol·σ: σ / ε / t"],
                rows))
    print(f"\ndp-accounting's PLDAccountant gives bit-identical ε to dpfl's accounting "
          f"function at every σ above (grid 1e-4, no fallback): {same_eps}\n")


# ---------------------------------------------------------------------------------------
# 2. config validation: a schema library (pydantic)


def _child_seconds(code: str, repeats: int = 7) -> tuple[float, float]:
    """Median (in-process seconds of ``code``'s body, wall seconds of the interpreter) over
    ``repeats`` fresh interpreters; the body prints its own elapsed time."""
    inner, wall = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, cwd=ROOT)
        wall.append(time.perf_counter() - t0)
        inner.append(float(out.stdout.strip().splitlines()[-1]))
    return statistics.median(inner), statistics.median(wall)


PYDANTIC_SCHEMA = '''
from typing import Literal
import dataclasses
from pydantic import ConfigDict, Field, create_model
from dpfl.config import KEY_CHOICES, MAX_ROUNDS, METHOD_NAMES, MODEL_NAMES, RunConfig
KINDS = {"bool": bool, "int": int, "float": float, "str": str}
CHOICES = {**KEY_CHOICES, "model": MODEL_NAMES}
RANGES = {"num-rounds": dict(ge=1, le=MAX_ROUNDS), "delta": dict(ge=1e-12, le=0.1)}
def schema(strict):
    fields = {}
    for f in dataclasses.fields(RunConfig):
        if f.name == "params":
            continue
        key = f.name.replace("_", "-")
        kind = Literal[CHOICES[key]] if key in CHOICES else KINDS[str(f.type)]
        fields[f.name] = (kind, Field(f.default, alias=key, **RANGES.get(key, {})))
    return create_model("RunConfig", __config__=ConfigDict(
        extra="forbid", allow_inf_nan=False, strict=strict), **fields)
'''

# (key, value) of typical mistakes and edge cases, as Flower's run-config parser hands them
CONFIG_CASES = [("num-round", 3), ("num-rounds", 0), ("num-rounds", "3"), ("num-rounds", True),
                ("num-rounds", 3.0), ("num-rounds", 3.5), ("lr", float("nan")), ("lr", True),
                ("reproducible", 1), ("reproducible", "yes"), ("reproducible", "TRUE"),
                ("dataset", "mnits")]


def config() -> None:
    print("## 2. config validation: pydantic instead of dpfl/config.py's checks\n")
    import importlib.metadata as md

    requirer = [d.metadata["Name"] for d in md.distributions()
                if any(re.split(r"[\s<>=!~;\[(]", r, maxsplit=1)[0].lower() == "pydantic"
                       for r in (d.requires or []) if "extra ==" not in r)]
    print(f"pydantic {md.version('pydantic')} is installed (required by: "
          f"{', '.join(sorted(set(requirer)))}; flwr 1.39 requires fastapi).\n")
    timer = "import time; t0 = time.perf_counter()\n{body}\nprint(time.perf_counter() - t0)"
    arms = {
        "python -c pass": "pass",
        "import dpfl.config": "import dpfl.config",
        "import pydantic (lazy package)": "import pydantic",
        "from pydantic import BaseModel": "from pydantic import BaseModel",
        "pydantic schema of RunConfig built + defaults validated":
            PYDANTIC_SCHEMA + "schema(False).model_validate({})",
    }
    rows = []
    for name, body in arms.items():
        inner, wall = _child_seconds(timer.format(body=body))
        rows.append([name, f"{inner * 1000:.0f}", f"{wall * 1000:.0f}"])
    walls = []
    for _ in range(7):
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "dpfl", "simulate", "num-round=3"],
                              capture_output=True, text=True, cwd=ROOT)
        walls.append(time.perf_counter() - t0)
    rows.append(["`dpfl simulate num-round=3` (whole CLI, exit "
                 f"{done.returncode})", "", f"{statistics.median(walls) * 1000:.0f}"])
    print(table(["median of 7 fresh interpreters", "in-process ms", "wall ms"], rows))
    print(f"\nthe CLI's refusal: {done.stderr.strip()}\n")

    from pydantic import ValidationError

    from dpfl.config import ConfigError, parse_global

    namespace: dict = {"__name__": "pydantic_schema"}
    exec(PYDANTIC_SCHEMA, namespace)   # noqa: S102 - the schema above, built here too
    lax, strict = namespace["schema"](False), namespace["schema"](True)

    def dpfl_says(key, value):
        try:
            parse_global({key: value})
            return "accepted"
        except ConfigError as exc:
            return f"refused: {exc}"

    def pydantic_says(model, key, value):
        try:
            got = getattr(model.model_validate({key: value}), key.replace("-", "_"))
            return f"accepted ({got!r})"
        except ValidationError as exc:
            text = str(exc).splitlines()
            return f"refused in {len(text)} lines: {' / '.join(t.strip() for t in text[1:3])}"

    rows = [[f"`{k} = {v!r}`", dpfl_says(k, v), pydantic_says(lax, k, v),
             pydantic_says(strict, k, v)] for k, v in CONFIG_CASES]
    print(table(["input", "dpfl (parse_global)", "pydantic (lax)", "pydantic (strict)"], rows))
    print()


# ---------------------------------------------------------------------------------------
# 3. process supervision

LIFE = 60   # every process of the test tree exits by itself after this many seconds
TREE = textwrap.dedent('''
    import json, os, signal, subprocess, sys, time
    LIFE, stubborn = {life}, sys.argv[2] == "stubborn"
    sleeper = [sys.executable, "-c", f"import time; time.sleep({{LIFE}})"]
    pids = {{"root": os.getpid()}}
    pids["worker-1"] = subprocess.Popen(sleeper).pid
    pids["worker-2"] = subprocess.Popen(sleeper).pid
    # its own session with a child (Ray's raylet/GCS, Flower's SuperExec)
    own = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                            f"p = subprocess.Popen({{sleeper!r}}); print(p.pid, flush=True); "
                            f"time.sleep({{LIFE}})"], start_new_session=True,
                           stdout=subprocess.PIPE, text=True)
    pids["own-session"], pids["own-session-child"] = own.pid, int(own.stdout.readline())
    # a daemon: started in a new session by a process that then exits (orphaned)
    d = subprocess.Popen([sys.executable, "-c", "import subprocess; p = subprocess.Popen("
                          f"{{sleeper!r}}, start_new_session=True); print(p.pid, flush=True)"],
                         stdout=subprocess.PIPE, text=True)
    pids["orphaned-daemon"] = int(d.stdout.readline())
    d.wait()
    if stubborn:   # a worker that ignores SIGTERM (a wedged actor)
        s = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal("
                              "signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); "
                              f"time.sleep({{LIFE}})"], stdout=subprocess.PIPE, text=True)
        s.stdout.readline()
        pids["ignores-sigterm"] = s.pid
    tmp = sys.argv[1] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(pids, f)
    os.replace(tmp, sys.argv[1])
    time.sleep(LIFE)
''').format(life=LIFE)

GRACE = 2.0
REPEATS = 3
# every pid this script started (pid -> its start time, so a reused pid is never signalled):
# what is left of them is killed by PID after each scenario
_started: dict[int, str | None] = {}


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _track(*pids: int) -> None:
    for pid in pids:
        _started.setdefault(pid, _start_time(pid))


def _wait_pids(pidfile: Path, timeout: float = 20.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while not pidfile.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the test tree did not start")
        time.sleep(0.02)
    pids = json.loads(pidfile.read_text())
    _track(*pids.values())
    return pids


def _alive(pid: int) -> bool:
    from dpfl.runtime.watchdog import alive

    return alive(pid)


def _until_gone(pids: dict[str, int], t0: float, limit: float = 15.0) -> tuple[float, list]:
    """(seconds from t0 until the last process that goes is gone, the names still alive
    after ``limit`` seconds)."""
    left = [n for n, p in pids.items() if _alive(p)]
    last = time.monotonic() - t0 if len(left) < len(pids) else 0.0   # (a synchronous stop)
    while left and time.monotonic() - t0 < limit:
        time.sleep(0.01)
        now = [n for n in left if _alive(pids[n])]
        if len(now) < len(left):
            last = time.monotonic() - t0
        left = now
    return last, left


def _kill_leftovers() -> None:
    for pid, started in list(_started.items()):
        if started is not None and _alive(pid) and _start_time(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _tree_cmd(pidfile: Path, variant: str) -> list[str]:
    return [sys.executable, "-c", TREE, str(pidfile), variant]


def _watched(pidfile: Path, variant: str, parent: int) -> list[str]:
    return [sys.executable, "-m", "dpfl.runtime.watchdog", "--parent", str(parent), "--grace",
            str(GRACE), "--", *_tree_cmd(pidfile, variant)]


def _reap(proc: subprocess.Popen) -> None:
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _launcher(inner: str, pidfile: Path, variant: str) -> tuple[subprocess.Popen, dict]:
    """A stand-in launcher process that starts the tree its way and then sleeps; killed
    with SIGKILL by the caller."""
    code = textwrap.dedent(f'''
        import os, subprocess, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from dpfl.runtime.watchdog import die_with_parent
        tree = [sys.executable, "-c", {TREE!r}, {str(pidfile)!r}, {variant!r}]
        if {inner!r} == "watchdog":
            cmd = [sys.executable, "-m", "dpfl.runtime.watchdog", "--parent", str(os.getpid()),
                   "--grace", "{GRACE}", "--", *tree]
            subprocess.Popen(cmd, start_new_session=True, cwd={str(ROOT)!r})
        else:
            subprocess.Popen(tree, preexec_fn=die_with_parent)
        time.sleep({LIFE})
    ''')
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    _track(launcher.pid)
    return launcher, _wait_pids(pidfile)


def _scenario(name: str, variant: str, work: Path) -> tuple[float, list[str]]:
    """Start the tree one way, stop it that way; (seconds until all gone, leftovers)."""
    pidfile = work / f"tree-{len(list(work.iterdir()))}.json"
    if name == "dpfl watchdog: launcher's stop_process_group":
        from dpfl.runtime.launch import stop_process_group

        proc = subprocess.Popen(_watched(pidfile, variant, os.getpid()), cwd=ROOT,
                                start_new_session=True)
        _track(proc.pid)
        pids = _wait_pids(pidfile)
        t0 = time.monotonic()
        stop_process_group(proc, grace=GRACE)
        return _until_gone(pids | {"watchdog": proc.pid}, t0)
    if name in ("dpfl watchdog: launcher SIGKILLed", "PR_SET_PDEATHSIG only: launcher SIGKILLed"):
        inner = "watchdog" if name.startswith("dpfl") else "pdeathsig"
        launcher, pids = _launcher(inner, pidfile, variant)
        t0 = time.monotonic()
        launcher.kill()
        launcher.wait()
        return _until_gone(pids, t0, limit=GRACE + 8.0)
    proc = subprocess.Popen(_tree_cmd(pidfile, variant), start_new_session=True)
    _track(proc.pid)
    pids = _wait_pids(pidfile)
    t0 = time.monotonic()
    if name == "psutil: children(recursive) + terminate/wait_procs/kill":
        import psutil

        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)]
        for p in procs:
            p.terminate()
        _, alive = psutil.wait_procs(procs, timeout=GRACE)
        for p in alive:
            p.kill()
        psutil.wait_procs(alive, timeout=5)
    else:   # supervisor's stopasgroup/killasgroup: the group, TERM then KILL
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=GRACE)
        except subprocess.TimeoutExpired:
            pass
        os.killpg(proc.pid, signal.SIGKILL)
    _reap(proc)
    return _until_gone(pids, t0, limit=GRACE + 3.0)


def supervision() -> None:
    print("## 3. process supervision: stopping a federation-shaped process tree\n")
    ray_vendor = next(Path(p) for p in sys.path if p.endswith("site-packages")) / \
        "ray" / "thirdparty_files"
    sys.path.append(str(ray_vendor))   # psutil: vendored by Ray, not a dpfl dependency
    import psutil

    print(f"psutil {psutil.__version__} from {ray_vendor} (Ray's vendored copy: present only "
          "with the simulation extra); supervisor, circus: not installed; systemd-run: "
          + subprocess.run(["systemd-run", "--user", "--scope", "true"], capture_output=True,
                           text=True).stderr.strip().splitlines()[-1] + "\n")
    print(f"tree: root, 2 workers, a child in its own session with a child, an orphaned "
          f"daemon in its own session; 'stubborn' adds a worker ignoring SIGTERM. Grace "
          f"{GRACE:g} s. Median over {REPEATS} trees of the time from the stop (or the "
          "launcher's SIGKILL) until the last process it stops is gone; 'left running': "
          "still alive 3-8 s after the grace period (then killed by PID here).\n")
    scenarios = ["dpfl watchdog: launcher's stop_process_group",
                 "dpfl watchdog: launcher SIGKILLed",
                 "psutil: children(recursive) + terminate/wait_procs/kill",
                 "process group (supervisor killasgroup): killpg TERM, KILL",
                 "PR_SET_PDEATHSIG only: launcher SIGKILLed"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="dpfl-tree-") as tmp:
        try:
            for name in scenarios:
                for variant in ("cooperative", "stubborn"):
                    times, left = [], set()
                    for _ in range(REPEATS):
                        seconds, names = _scenario(name, variant, Path(tmp))
                        times.append(seconds)
                        left.update(names)
                        _kill_leftovers()
                    rows.append([name, variant, f"{statistics.median(times):.2f}",
                                 ", ".join(sorted(left)) or "none"])
        finally:
            _kill_leftovers()
    print(table(["how", "tree", "s until the last stopped one is gone", "left running"],
                rows))
    from dpfl.runtime.watchdog import descendants

    sys.path.insert(0, str(ROOT / "bench"))
    from timing import best_times

    me = psutil.Process()
    best = best_times({"dpfl.runtime.watchdog.descendants": lambda: descendants(os.getpid()),
                       "psutil children(recursive=True)": lambda: me.children(recursive=True)},
                      repeats=20)
    count = sum(1 for e in os.listdir("/proc") if e.isdigit())
    print(f"\none scan of the process table ({count} processes): " + ", ".join(
        f"{k} {v * 1000:.2f} ms" for k, v in best.items()) + "\n")


# ---------------------------------------------------------------------------------------
# 4. progress

ROUNDS, ROUND_SECONDS = 5, 0.4
PROGRESS = {
    "dpfl RoundProgress": textwrap.dedent(f'''
        import sys, tempfile, time
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        from dpfl.experiments.common import RoundProgress
        with tempfile.TemporaryDirectory() as tmp:
            run = Path(tmp)
            with RoundProgress(run, {ROUNDS}, every=0.1):
                for r in range({ROUNDS}):
                    time.sleep({ROUND_SECONDS})
                    with open(run / "rounds.jsonl", "a") as f:
                        f.write("{{}}\\n")
                time.sleep(0.3)
    '''),
    "rich.progress.Progress": textwrap.dedent(f'''
        import time
        from rich.progress import Progress
        with Progress() as progress:
            task = progress.add_task("run", total={ROUNDS})
            for r in range({ROUNDS}):
                time.sleep({ROUND_SECONDS})
                progress.advance(task)
            time.sleep(0.3)
    '''),
}


def _capture(code: str, tty: bool, env: dict) -> tuple[list[tuple[float, bytes]], float]:
    """The child's stdout chunks with their arrival times, and its exit time (s)."""
    if tty:
        master, slave = pty.openpty()
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=slave, env=env)
        os.close(slave)
        fd = master
    else:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env)
        fd = proc.stdout.fileno()
    t0, chunks = time.monotonic(), []
    while True:
        ready, _, _ = select.select([fd], [], [], 0.05)
        if ready:
            try:
                data = os.read(fd, 65536)
            except OSError:   # the pty's other end closed
                data = b""
            if not data:
                break
            chunks.append((time.monotonic() - t0, data))
        elif proc.poll() is not None:
            break
    proc.wait()
    end = time.monotonic() - t0
    if tty:
        os.close(master)
    else:
        proc.stdout.close()
    return chunks, end


def progress() -> None:
    print("## 4. progress lines: dpfl's RoundProgress against rich.progress\n")
    print(f"a {ROUNDS}-round run, one round every {ROUND_SECONDS} s; 'during the run': bytes "
          "that reached the reader more than 0.25 s before the process ended.\n")
    rows = []
    env = {k: v for k, v in os.environ.items()
           if k not in ("FORCE_COLOR", "TTY_INTERACTIVE", "TTY_COMPATIBLE", "NO_COLOR")}
    for name, code in PROGRESS.items():
        for mode, tty, extra in (("pipe (log, CI)", False, {}),
                                 ("pipe, CI=true GITHUB_ACTIONS=true", False,
                                  {"CI": "true", "GITHUB_ACTIONS": "true"}),
                                 ("pseudo-terminal", True, {})):
            chunks, end = _capture(code, tty, env | extra)
            data = b"".join(c for _, c in chunks)
            during = sum(len(c) for t, c in chunks if t < end - 0.25)
            text = data.decode(errors="replace")
            lines = [ln for ln in text.replace("\r", "\n").split("\n") if ln.strip()]
            rows.append([name, mode, len(data), during, text.count("\x1b"),
                         len([ln for ln in text.split("\n") if ln.strip()]),
                         repr(lines[-1][:48]) if lines else ""])
    print(table(["progress", "stdout", "bytes", "bytes during the run", "escape sequences",
                 "lines", "last line"], rows))
    print()


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    chosen = [a for a in argv if not a.startswith("--")] or [
        "calibration", "config", "supervision", "progress"]
    sections = {"calibration": lambda: calibration(quick), "config": config,
                "supervision": supervision, "progress": progress}
    unknown = [c for c in chosen if c not in sections]
    if unknown:
        print(f"unknown section(s) {unknown}; known: {list(sections)}", file=sys.stderr)
        return 2
    for name in chosen:
        sections[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
