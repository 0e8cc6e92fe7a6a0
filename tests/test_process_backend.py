"""The process backend (dpfl/runtime/process_backend.py): Flower's simulation runtime hands
messages to worker processes forked from the simulation instead of Ray actors.

Each scenario runs in a fresh interpreter (a fork needs a process with no other thread;
pytest's may have some), with real Flower Messages, Contexts and a real ClientApp: replies
and node state come back as Flower's Ray actor would return them, a ClientApp exception
becomes Flower's ClientAppException, a killed worker is dropped while the others go on, and
terminate reaps every worker."""

import subprocess
import sys
import textwrap

from dpfl.runtime import process_backend

SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading, time
    from flwr.app import ConfigRecord, Context, Message, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.clientapp.client_app import ClientAppException
    from flwr.supercore.task_identity import TaskIdentity
    from dpfl.runtime import process_backend as pb

    TaskIdentity.run_id = 1   # as in the simulation process, which builds the instructions
    TaskIdentity.node_id = 1
    TaskIdentity.task_id = 1
    app = ClientApp()

    @app.query()
    def query(msg, context):
        if msg.content["c"]["boom"]:
            raise ValueError("client says no")
        seen = int(context.state["s"]["seen"]) if "s" in context.state else 0
        context.state["s"] = ConfigRecord({"seen": seen + 1})
        return Message(RecordDict({"c": ConfigRecord({"pid": os.getpid(),
                                                      "x": msg.content["c"]["x"] * 2})}),
                       reply_to=msg)

    def message(x, boom=False):
        return Message(RecordDict({"c": ConfigRecord({"x": x, "boom": boom})}),
                       dst_node_id=1, message_type="query")

    def context():
        return Context(run_id=1, node_id=1, node_config={"partition-id": 0},
                       state=RecordDict(), run_config={})

    workers = pb.prefork_workers(2)
    assert len(workers) == 2 and all(w.pid != os.getpid() for w in workers)
    backend = pb.ProcessBackend({"client_resources": {"num_cpus": 1}}, workers)
    backend.build(lambda: app)
    assert backend.num_workers == 2 and backend.is_worker_idle()

    ctx = context()
    out, ctx = backend.process_message(message(21), ctx)
    out2, ctx = backend.process_message(message(5), ctx)
    assert out.content["c"]["x"] == 42 and out2.content["c"]["x"] == 10
    assert int(ctx.state["s"]["seen"]) == 2          # the node state travels both ways
    assert out.content["c"]["pid"] in {w.pid for w in workers}

    results = []
    threads = [threading.Thread(target=lambda i=i: results.append(
        backend.process_message(message(i), context())[0].content["c"]["x"])) for i in range(6)]
    for t in threads: t.start()
    for t in threads: t.join()
    assert sorted(results) == [0, 2, 4, 6, 8, 10], results

    try:
        backend.process_message(message(1, boom=True), context())
        raise AssertionError("no exception")
    except ClientAppException as exc:
        assert "client says no" in str(exc)
    assert backend.num_workers == 2                  # a ClientApp error keeps its worker

    os.kill(workers[0].pid, signal.SIGKILL)
    os.waitpid(workers[0].pid, 0)
    lost = 0
    for i in range(4):                               # the dead one is found, then dropped
        try:
            backend.process_message(message(i), context())
        except ClientAppException as exc:
            assert "ended" in str(exc)
            lost += 1
    assert lost <= 1 and backend.num_workers == 1, (lost, backend.num_workers)

    alive = workers[1].pid
    backend.terminate()
    assert backend.num_workers == 0
    try:
        os.kill(alive, 0)
        raise AssertionError("worker still running")
    except ProcessLookupError:
        pass
    print("OK")
""")


def _run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)


def test_workers_answer_like_flowers_actors_and_survive_what_they_should():
    done = _run(SCRIPT)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]
    assert "client says no" in done.stderr      # the worker logged the ClientApp's traceback


def test_prefork_refuses_a_process_with_threads():
    done = _run(textwrap.dedent("""
        import threading, time
        from dpfl.runtime import process_backend as pb
        threading.Thread(target=time.sleep, args=(2,), daemon=True).start()
        try:
            pb.prefork_workers(1)
        except RuntimeError as exc:
            print("refused:", exc)
    """))
    assert "refused: prefork_workers: the process already runs other threads" in done.stdout


def test_a_worker_exits_when_the_simulation_dies():
    """The simulation killed (no terminate): each worker sees its pipe close, or the kernel's
    parent-death signal, and exits."""
    script = textwrap.dedent("""
        import os, signal, sys, time
        r, w = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(r)
            from dpfl.runtime import process_backend as pb
            workers = pb.prefork_workers(2)
            os.write(w, (" ".join(str(x.pid) for x in workers) + "\\n").encode())
            time.sleep(60)
            os._exit(0)
        os.close(w)
        pids = [int(p) for p in os.fdopen(r).readline().split()]
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        deadline = time.time() + 10
        while time.time() < deadline:
            alive = []
            for pid in pids:
                try:
                    os.kill(pid, 0)
                    with open(f"/proc/{pid}/stat") as f:
                        if f.read().split()[2] != "Z":
                            alive.append(pid)
                except (ProcessLookupError, FileNotFoundError):
                    pass
            if not alive:
                print("GONE")
                break
            time.sleep(0.05)
    """)
    done = _run(script)
    assert done.stdout.strip() == "GONE", (done.stdout, done.stderr[-2000:])


def test_the_patch_is_for_the_pinned_flower():
    """The backend replaces Flower's only on the simulation runtime it was checked on."""
    assert process_backend.why_not_patchable() is None
