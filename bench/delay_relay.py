"""A TCP relay that delays every chunk by a random latency: `tc netem delay` in user space.

    python bench/delay_relay.py --listen 127.0.0.1:19092 --to 10.77.0.1:9092 \
        --delay-ms 100 --jitter-ms 50 [--seed 0] [--for-seconds 3600]

This machine's kernel has no ``sch_netem`` (``tc qdisc add ... netem`` answers "Specified
qdisc kind is unknown"), so bench/faults.py runs this relay inside a SuperNode's network
namespace and points the SuperNode at it (``deploy/netns.sh node-start ... --superlink
127.0.0.1:19092``). Each chunk read in either direction is written on after ``delay ±
jitter`` ms (uniform, like netem's default jitter), never before an earlier chunk of the same
direction (no reordering: TCP would hide it anyway). Both directions are delayed, so the
added round-trip time is about twice ``--delay-ms``. Packet loss is injected separately, at
the packet level (iptables ``statistic`` on the namespace's eth0), which this relay does not
model. The relay stops by itself after ``--for-seconds``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                delay: float, jitter: float, rng: random.Random) -> None:
    """Copy reader → writer, each chunk released ``delay ± jitter`` s after it was read."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def release() -> None:
        while True:
            due, chunk = await queue.get()
            if not chunk:
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            writer.write(chunk)
            await writer.drain()
        writer.close()

    sender = asyncio.create_task(release())
    last_due = 0.0
    try:
        while chunk := await reader.read(65536):
            last_due = max(last_due, time.monotonic() + delay + rng.uniform(-jitter, jitter))
            queue.put_nowait((last_due, chunk))
    except (ConnectionError, OSError):
        pass
    queue.put_nowait((last_due, b""))
    try:
        await sender
    except (ConnectionError, OSError):
        pass


async def _serve(listen: tuple[str, int], target: tuple[str, int], delay: float,
                 jitter: float, seed: int, seconds: float) -> None:
    rng = random.Random(seed)

    async def handle(down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*target)
        except OSError:
            down_w.close()
            return
        await asyncio.gather(_pipe(down_r, up_w, delay, jitter, rng),
                             _pipe(up_r, down_w, delay, jitter, rng))

    server = await asyncio.start_server(handle, *listen)
    async with server:
        await asyncio.sleep(seconds)


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", type=_address, required=True, help="HOST:PORT to accept on")
    ap.add_argument("--to", type=_address, required=True, help="HOST:PORT to relay to")
    ap.add_argument("--delay-ms", type=float, default=100.0)
    ap.add_argument("--jitter-ms", type=float, default=50.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--for-seconds", type=float, default=3600.0)
    args = ap.parse_args()
    if not 0 <= args.jitter_ms <= args.delay_ms:
        ap.error("--jitter-ms must be within 0..--delay-ms")
    asyncio.run(_serve(args.listen, args.to, args.delay_ms / 1e3, args.jitter_ms / 1e3,
                       args.seed, args.for_seconds))


if __name__ == "__main__":
    main()
