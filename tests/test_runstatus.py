"""A deployment's launcher tells a run that did not finish from one that did (issue 51.1):
``flwr run --stream`` exits 0 either way; the run's status and dpfl's own error line decide.
The texts here are what Flower 1.39 prints (``flwr run``'s start line, ``flwr ls --format
json``'s fields, its log stream's ``ERROR :`` prefix)."""

from __future__ import annotations

import json

from dpfl.runstatus import main, run_id_of, status_of, why_not_finished

STREAM = ("\x1b[92mINFO \x1b[0m:   Successfully started run 4211\n"
          "INFO :   Starting logstream for run_id `4211`\n"
          "INFO :   [round 1/3] accuracy 0.61\n"
          "INFO :   waiting for nodes: 1 connected, 2 required\n"
          "ERROR :   the run stopped after round 1 of 3: waited 20 s (node-wait) for 2 "
          "connected nodes (min-train-nodes), 1 connected (/runs/x/stopped.json)\n"
          "ERROR :   error: waited 20 s (node-wait) for 2 connected nodes (min-train-nodes), "
          "1 connected\n")


def _ls(status: str, run_id: str = "4211") -> str:
    return json.dumps({"success": True, "runs": [
        {"run-id": run_id, "status": status, "status-details": "ServerApp failed with "
         "exception: waited 20 s"}]})


def test_the_run_id_and_status_are_read_from_flowers_output():
    assert run_id_of(STREAM) == "4211" and run_id_of("no run here") is None
    assert status_of(_ls("finished:failed"), "4211")[0] == "finished:failed"


def test_a_run_that_stopped_early_is_one_line_and_non_zero(tmp_path, capsys):
    why = why_not_finished(STREAM, "finished:failed", "x")
    assert why == ("the run did not finish (finished:failed): the run stopped after round 1 "
                   "of 3: waited 20 s (node-wait) for 2 connected nodes (min-train-nodes), 1 "
                   "connected (/runs/x/stopped.json)")
    (tmp_path / "stream.log").write_text(STREAM)
    (tmp_path / "ls.json").write_text(_ls("finished:failed"))
    assert main([str(tmp_path / "stream.log"), str(tmp_path / "ls.json")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: run 4211: the run did not finish")
    # a completed run: exit 0, nothing printed
    (tmp_path / "ls.json").write_text(_ls("finished:completed"))
    assert main([str(tmp_path / "stream.log"), str(tmp_path / "ls.json")]) == 0
    assert capsys.readouterr().err == ""
    # a status that does not list the run, or no run id: never 0
    (tmp_path / "ls.json").write_text(_ls("finished:completed", run_id="1"))
    assert main([str(tmp_path / "stream.log"), str(tmp_path / "ls.json")]) == 2
    (tmp_path / "stream.log").write_text("flwr: connection refused\n")
    assert main([str(tmp_path / "stream.log"), str(tmp_path / "ls.json")]) == 2
