"""A whole federation in this process: dpfl's ServerApp run loop and ClientApp over Flower's
real in-memory LinkState and InMemoryGrid, with one thread in place of Ray's actors.

The thread does what Flower's simulation worker does (flwr/server/superlink/fleet/vce/
vce_api.py, ``worker``): take each node's pending instruction from the LinkState, run the
ClientApp (``dpfl.apps.client.app``, its mods included) with the node's Context
(``partition-id``/``num-partitions`` in its node config, its state kept between messages),
store the reply (a raised exception as an error reply). Fast enough to run every method
twice in the unit suite (cohort nodes against one node per client).
"""

from __future__ import annotations

import threading
import time
import traceback
from pathlib import Path
from typing import Any
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode

from dpfl.server.node_index import simulation_state

RUN_ID = 1   # tests/conftest.py's TaskIdentity.run_id


class InProcessNodes:
    """Serve every node's instructions in a background thread until :meth:`stop`."""

    def __init__(self, state: Any, node_ids: list[int], run_config: dict[str, Any]) -> None:
        from dpfl.apps.client import app

        self.app = app
        self.state = state
        self.contexts = {
            node: Context(run_id=RUN_ID, node_id=node,
                          node_config={"partition-id": i, "num-partitions": len(node_ids)},
                          state=RecordDict(), run_config=dict(run_config))
            for i, node in enumerate(node_ids)}
        self.handled = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="nodes")
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            busy = False
            for node, context in self.contexts.items():
                for msg in self.state.get_message_ins(node_id=node, limit=1):
                    busy = True
                    try:
                        reply = self.app(msg, context)
                    except Exception as exc:  # noqa: BLE001 - as Flower's worker reports it
                        traceback.print_exc()
                        reply = Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                              f"{type(exc)}:<'{exc}'>"), reply_to=msg)
                    reply.metadata.__dict__["_message_id"] = str(uuid4())
                    self.state.store_message_res(reply)
                    self.handled += 1
            if not busy:
                time.sleep(0.005)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def run_federation(run_config: dict[str, Any], num_nodes: int, output_dir: Path,
                   run_name: str) -> tuple[Path, int]:
    """Run the federation of ``run_config`` (run-config keys) on ``num_nodes`` simulated
    nodes; (its run directory, the messages the nodes handled)."""
    from dpfl.apps.server import run
    from dpfl.methods import parse_run_config

    keys = {**run_config, "output-dir": str(output_dir), "run-name": run_name,
            "plots": False}
    state, grids, node_ids = simulation_state(num_nodes, run_ids=(RUN_ID,))
    nodes = InProcessNodes(state, node_ids, keys)
    try:
        run(grids[RUN_ID], parse_run_config(keys))
    finally:
        nodes.stop()
    return output_dir / run_name, nodes.handled
