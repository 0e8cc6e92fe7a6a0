"""Hostile nodes and an unauthenticated flooder for tests/e2e/test_hostile_nodes.py.

``node``: an authenticated SuperNode that misbehaves. It is Flower's own Fleet API client
(``flwr.client.grpc_rere_client.connection.grpc_request_response``: TLS, the SuperNode auth
interceptor signing every call with the node's registered key, heartbeats, the object
push/pull protocol), with dpfl's real ``train`` function computing an honest DP reply each
round; what it then pushes is chosen per round by ``--plan``:

- ``honest``: the honest reply;
- ``replay``: first the previous round's reply message again, as it was (a reply to the old
  instruction), then the previous round's reply content as the answer to this round's
  instruction (same bytes, same ``server-round``);
- ``claim=P``: the honest reply claiming partition P;
- ``oversize=S``: the honest reply with its first array replaced by S bytes of float32
  zeros.

This is the most real hostile node: a ClientApp cannot be swapped (the FAB is the
operator's), but whoever holds a registered key speaks the Fleet API directly, and nothing
in Flower constrains what it pushes. Every action and its outcome is a JSON line in
``--events``; the node exits after ``--lifetime`` seconds, or after a pull is refused 3
times in a row (e.g. its key was unregistered).

``beyond``: one PushObject of more than Flower's gRPC message limit (2 GiB - 1,
``flwr.supercore.grpc.GRPC_MAX_MESSAGE_LENGTH``), signed with a registered key, sent over a
channel without a send limit (Flower's own would refuse to send it); prints the outcome.

``probe``: the latency of authenticated ``SendNodeHeartbeat`` calls with a registered key.

``flood``: from an address without a key, a bounded loop of TLS handshakes and
unauthenticated Fleet calls (threads; stops by itself after ``--seconds``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import ssl
import sys
import threading
import time
from pathlib import Path

import grpc
from cryptography.hazmat.primitives.serialization import load_ssh_private_key

GRPC_LIMIT = 2_147_483_647  # flwr.supercore.grpc.GRPC_MAX_MESSAGE_LENGTH (checked below)


class Events:
    def __init__(self, path: str):
        self.path = path
        self.lock = threading.Lock()

    def __call__(self, kind: str, **fields) -> None:
        line = json.dumps({"t": time.time(), "event": kind, **fields}, default=str)
        with self.lock, open(self.path, "a") as out:
            out.write(line + "\n")


def _keys(path: str):
    key = load_ssh_private_key(Path(path).read_bytes(), None)
    return key, key.public_key()


def _rpc_error(exc: BaseException) -> dict:
    if isinstance(exc, grpc.RpcError):
        return {"code": str(exc.code()), "details": str(exc.details())[:300]}
    return {"error": f"{type(exc).__name__}: {exc}"[:300]}


# -- the hostile node ------------------------------------------------------------------------


def _raw_push_object(args, keys, node_id: int, run_id: int, size: int) -> dict:
    """A PushObject request of ``size`` payload bytes over a channel with no send limit
    (Flower's own channel would refuse to send it); the request is built as protobuf wire
    bytes, since protobuf itself cannot serialise a message of 2 GiB or more."""
    from flwr.client.grpc_rere_client.node_auth_client_interceptor import (
        NodeAuthClientInterceptor,
    )
    from flwr.proto.message_pb2 import PushObjectRequest as Req
    from flwr.proto.message_pb2 import PushObjectResponse
    from flwr.proto.node_pb2 import Node
    from flwr.supercore.grpc import create_channel
    from flwr.supercore.interceptors.runtime_version_interceptor import (
        RuntimeVersionClientInterceptor,
    )

    channel = create_channel(args.superlink, False, Path(args.ca).read_bytes(),
                             max_message_length=-1,
                             interceptors=[RuntimeVersionClientInterceptor("SuperNode"),
                                           NodeAuthClientInterceptor(*keys)])
    head = Req(node=Node(node_id=node_id), run_id=run_id, object_id="0" * 64).SerializeToString()
    field = Req.DESCRIPTOR.fields_by_name["object_content"].number
    varint, n = bytearray(), size
    while True:
        byte, n = n & 0x7F, n >> 7
        varint.append(byte | (0x80 if n else 0))
        if not n:
            break
    prefix = head + bytes([(field << 3) | 2]) + bytes(varint)
    body = prefix + bytes(size)          # one allocation of the payload, then the request
    call = channel.unary_unary("/flwr.proto.Fleet/PushObject",
                               request_serializer=lambda b: b,
                               response_deserializer=PushObjectResponse.FromString)
    start = time.monotonic()
    try:
        res = call(body, timeout=120)
        out = {"outcome": "accepted", "stored": bool(res.stored)}
    except grpc.RpcError as exc:
        out = {"outcome": "refused", **_rpc_error(exc)}
    finally:
        del body
        channel.close()
    out.update(bytes=size, seconds=round(time.monotonic() - start, 2))
    return out


def _push(reply, run_id: int, send, push_object) -> dict:
    """Push a reply Message and its objects as a SuperNode does; the outcome."""
    from flwr.supercore.inflatable.inflatable_object import (
        get_all_nested_objects,
        get_object_tree,
    )
    from flwr.supercore.inflatable.inflatable_utils import push_objects

    reply.metadata.__dict__["_message_id"] = reply.object_id
    tree = get_object_tree(reply)
    objects = get_all_nested_objects(reply)
    start = time.monotonic()
    try:
        ids, session = send(reply, tree, 0.0)
        push_objects(objects, lambda oid, content: push_object(run_id, session, oid, content),
                     object_ids_to_push=ids)
        return {"outcome": "pushed", "objects": len(ids),
                "seconds": round(time.monotonic() - start, 2)}
    except Exception as exc:  # noqa: BLE001 - the outcome is the point
        return {"outcome": "refused", **_rpc_error(exc)}


def _plan(text: str) -> dict[int, str]:
    out = {}
    for item in text.split(","):
        rnd, action = item.split(":", 1)
        out[int(rnd)] = action
    return out


def run_node(args) -> int:
    import torch
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.client.grpc_rere_client.connection import grpc_request_response
    from flwr.common.config import get_fused_config_from_fab
    from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
    from flwr.supercore.retry import make_simple_grpc_retry_invoker

    from dpfl.apps.client import train

    event = Events(args.events)
    plan = _plan(args.plan)
    keys = _keys(args.key)
    invoker = make_simple_grpc_retry_invoker()
    invoker.recoverable_exceptions = grpc.RpcError
    invoker.max_tries, invoker.max_time = 4, 30
    node_config = {"partition-id": args.partition, "num-partitions": args.partitions}
    context = None
    previous: tuple | None = None   # (instruction, reply) of the last train round
    refused = 0
    deadline = time.monotonic() + args.lifetime
    with grpc_request_response(args.superlink, False, invoker, root_certificates=args.ca,
                               authentication_keys=keys) as conn:
        node_id, receive, send, get_run, get_fab, pull_object, push_object, confirm = conn
        event("activated", node_id=node_id)
        while time.monotonic() < deadline:
            try:
                got = receive()
                refused = 0
            except Exception as exc:  # noqa: BLE001
                refused += 1
                event("pull-refused", **_rpc_error(exc))
                if refused >= 3:
                    break
                time.sleep(1.0)
                continue
            if got is None:
                time.sleep(0.3)
                continue
            msg, tree = got
            run_id = msg.metadata.run_id
            if context is None:
                run = get_run(run_id)
                fab = get_fab(run.fab_hash, run_id)
                context = Context(run_id=run_id, node_id=node_id, node_config=node_config,
                                  state=RecordDict(),
                                  run_config=get_fused_config_from_fab(fab.content, run))
            ins = pull_and_inflate_object_from_tree(
                tree, lambda oid: pull_object(run_id, oid), lambda oid: confirm(run_id, oid),
                return_type=Message)
            ins.metadata.__dict__["_message_id"] = tree.object_id
            if ins.metadata.message_type != "train":
                event("ignored", type=ins.metadata.message_type)
                continue
            config = ins.content["config"]
            rnd = int(config.get("server-round", 0))
            plan_keys = {k: config[k] for k in config if str(k).startswith("plan-")}
            honest = train(ins, context)
            action = plan.get(rnd, "honest")
            event("instruction", round=rnd, action=action, plan=plan_keys,
                  instruction=ins.metadata.message_id)
            if action == "honest":
                event("push", round=rnd, what="honest",
                      **_push(honest, run_id, send, push_object))
            elif action == "replay":
                old_ins, old_reply = previous
                again = Message(old_reply.content, reply_to=old_ins)
                event("push", round=rnd, what="old reply message again (old instruction)",
                      replies_to=old_ins.metadata.message_id,
                      **_push(again, run_id, send, push_object))
                event("push", round=rnd, what="old reply content to this instruction",
                      **_push(Message(old_reply.content, reply_to=ins), run_id, send,
                              push_object))
            elif action.startswith("claim="):
                content = honest.content
                metrics = dict(content["metrics"])
                metrics["partition-id"] = int(action.split("=", 1)[1])
                records = {k: content[k] for k in ("arrays", "privacy")}
                records["metrics"] = MetricRecord(metrics)
                event("push", round=rnd, what=f"claims partition {metrics['partition-id']}",
                      **_push(Message(RecordDict(records), reply_to=ins), run_id, send,
                              push_object))
            elif action.startswith("oversize="):
                size = int(action.split("=", 1)[1])
                content = honest.content
                arrays = content["arrays"].to_torch_state_dict()
                first = next(iter(arrays))
                arrays[first] = torch.zeros(size // 4, dtype=torch.float32)
                records = {"arrays": ArrayRecord(arrays), "metrics": content["metrics"],
                           "privacy": content["privacy"]}
                reply = Message(RecordDict(records), reply_to=ins)
                del arrays
                event("push", round=rnd, what=f"reply with a {size}-byte array",
                      **_push(reply, run_id, send, push_object))
                del reply, records
            previous = (ins, honest)
    event("exit")
    return 0


# -- probe and flood -------------------------------------------------------------------------


def run_beyond(args) -> int:
    from flwr.supercore.grpc import GRPC_MAX_MESSAGE_LENGTH

    assert GRPC_MAX_MESSAGE_LENGTH == GRPC_LIMIT, GRPC_MAX_MESSAGE_LENGTH
    print(json.dumps(_raw_push_object(args, _keys(args.key), args.node_id, args.run_id,
                                      GRPC_LIMIT + 4096)))
    return 0


def run_probe(args) -> int:
    """``--count`` authenticated heartbeats, one every ``--every`` s; latencies in ms."""
    from flwr.client.grpc_rere_client.node_auth_client_interceptor import (
        NodeAuthClientInterceptor,
    )
    from flwr.proto.fleet_pb2_grpc import FleetStub
    from flwr.proto.heartbeat_pb2 import SendNodeHeartbeatRequest
    from flwr.proto.node_pb2 import Node
    from flwr.supercore.grpc import create_channel
    from flwr.supercore.interceptors.runtime_version_interceptor import (
        RuntimeVersionClientInterceptor,
    )

    channel = create_channel(args.superlink, False, Path(args.ca).read_bytes(),
                             interceptors=[RuntimeVersionClientInterceptor("SuperNode"),
                                           NodeAuthClientInterceptor(*_keys(args.key))])
    stub = FleetStub(channel)
    out = []
    for _ in range(args.count):
        start = time.monotonic()
        try:
            ok = stub.SendNodeHeartbeat(SendNodeHeartbeatRequest(
                node=Node(node_id=args.node_id), heartbeat_interval=30.0), timeout=30).success
        except grpc.RpcError as exc:
            ok = str(exc.code())
        out.append({"ms": round((time.monotonic() - start) * 1000, 2), "ok": ok})
        time.sleep(args.every)
    channel.close()
    print(json.dumps(out))
    return 0


def run_flood(args) -> int:
    """TLS handshakes and unauthenticated gRPC calls for ``--seconds`` (bounded), or until
    SIGUSR1 (the test has measured what it needs)."""
    deadline = [time.monotonic() + args.seconds]   # the handler first, before the imports
    signal.signal(signal.SIGUSR1, lambda *_: deadline.__setitem__(0, time.monotonic()))
    from flwr.proto.fleet_pb2 import PullMessagesRequest
    from flwr.proto.fleet_pb2_grpc import FleetStub
    from flwr.proto.node_pb2 import Node
    from flwr.supercore.grpc import create_channel

    host, port = args.superlink.rsplit(":", 1)
    ca = Path(args.ca).read_bytes()
    counts: dict[str, int] = {}
    lock = threading.Lock()

    def count(key: str) -> None:
        with lock:
            counts[key] = counts.get(key, 0) + 1

    def handshakes() -> None:
        ctx = ssl.create_default_context(cadata=ca.decode())
        ctx.check_hostname = False
        ctx.set_alpn_protocols(["h2"])
        while time.monotonic() < deadline[0]:
            try:
                with socket.create_connection((host, int(port)), timeout=5) as raw:
                    with ctx.wrap_socket(raw, server_hostname=host):
                        count("tls-handshake-completed")
            except OSError as exc:
                count(f"tls-{type(exc).__name__}")

    def calls() -> None:
        while time.monotonic() < deadline[0]:   # a new channel (TCP + TLS) for every call
            channel = create_channel(args.superlink, False, ca)
            try:
                FleetStub(channel).PullMessages(PullMessagesRequest(node=Node(node_id=1)),
                                                timeout=5)
                count("grpc-ACCEPTED")
            except grpc.RpcError as exc:
                count(f"grpc-{exc.code().name}: {exc.details()}")
            finally:
                channel.close()

    threads = ([threading.Thread(target=handshakes) for _ in range(args.threads)]
               + [threading.Thread(target=calls) for _ in range(args.threads)])
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(counts))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("node", "beyond", "probe", "flood"):
        p = sub.add_parser(name)
        p.add_argument("--superlink", default="10.77.0.1:9092")
        p.add_argument("--ca", required=True)
        if name != "flood":
            p.add_argument("--key", required=True)
    node = sub.choices["node"]
    node.add_argument("--partition", type=int, required=True)
    node.add_argument("--partitions", type=int, required=True)
    node.add_argument("--plan", default="")
    node.add_argument("--events", required=True)
    node.add_argument("--lifetime", type=float, default=600.0)
    beyond = sub.choices["beyond"]
    beyond.add_argument("--node-id", type=int, required=True)
    beyond.add_argument("--run-id", type=int, default=0)
    probe = sub.choices["probe"]
    probe.add_argument("--node-id", type=int, required=True)
    probe.add_argument("--count", type=int, default=20)
    probe.add_argument("--every", type=float, default=0.2)
    flood = sub.choices["flood"]
    flood.add_argument("--seconds", type=float, default=20.0)
    flood.add_argument("--threads", type=int, default=4)
    args = parser.parse_args(argv)
    if args.command == "node" and not args.plan:
        args.plan = "0:honest"
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    commands = {"node": run_node, "beyond": run_beyond, "probe": run_probe, "flood": run_flood}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
