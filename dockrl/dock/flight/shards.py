"""Dock shards over Arrow Flight (``dock.mode=distributed``; docs/design.md §2).

``DockShardServer`` serves one ``dockrl.dock.shard.service.ShardService`` (the shard's behaviour and
its requests are documented there); ``FlightTransport`` is the front end's side of it
(``dockrl.dock.client.dock_client.DockClient`` given ``grpc://`` locations builds one per shard). The
mapping onto Flight (action bodies and results UTF-8 JSON; the claim cycle's messages binary):

* ``do_action`` — every request of the service, by name (``ShardService.action``).
* ``do_put`` — payload in: descriptor command {iteration, ack?} as JSON, or the same in the
  binary put descriptor (``encode_put``, what ``FlightTransport`` sends); one record batch with
  an int64 ``row`` column (global row indexes) plus the data columns.
* ``do_get`` — payload out: ticket {iteration, columns, rows} (JSON) → the cells as a record
  batch stream, in the order of ``rows``; a binary claim ticket (``encode_claim``: a
  ``ClaimRequest``) claims and reads in one round trip: one record batch of the cells, the
  claim's result travelling as its ``app_metadata`` (``encode_claim_result``: pending, held and
  the rows as ascending runs; ``ShardService.claim_cells``).
* ``do_exchange`` — a put that carries the next claim (``ShardService.put_claim``): descriptor
  command ``encode_exchange`` of a put descriptor and a claim ticket, then the put's one record
  batch in; out, as a claim's ``do_get``: one record batch of the claimed cells with the claim's
  result as its ``app_metadata``, or, when the put landed and the claim failed, only
  ``app_metadata`` naming the claim's error (``encode_claim_failed``).

The binary messages carry ``WIRE_VERSION``; a shard refuses another version, and a claim
ticket in the JSON form of earlier releases, naming both versions.

``DockError`` and ``DockTimeoutError`` raised in the shard travel as ``FlightServerError``
whose message starts with ``dockrl.<type>:`` and whose ``extra_info`` is JSON {type, message};
``raise_dock_error`` turns them back into the same exception on the client side.

The parts: ``dockrl.dock.flight.wire`` (the binary messages, the errors' Flight form),
``dockrl.dock.flight.server`` (``DockShardServer``), ``dockrl.dock.flight.transport``
(``FlightTransport``); this module starts shards, in this process (``start_local_shards``) or
as one of their own (``serve_shard``).

Run one shard in its own process (prints its location as the first line of stdout)::

    DOCKRL_DOCK_TOKEN=secret python -m dockrl.dock.flight.shards --host 127.0.0.1 --port 0 --token-env DOCKRL_DOCK_TOKEN
"""

from __future__ import annotations

import argparse
import importlib
import ipaddress
import logging
import math
import os
import signal
import sys
import time

from dockrl.dock.flight.server import DockShardServer
from dockrl.dock.roles import StageRights
from dockrl.dock.schema import Schema
from dockrl.dock.shard.requests import Payload
from dockrl.dock.tls import CA_ENV, DockTLS
from dockrl.process.env import REPLICAS_ENV, replica
from dockrl.process.lifeline import driver_pid_from_env, watch_driver

logger = logging.getLogger(__name__)

STOP_POLL_S = 0.1
"""How often a shard process's main thread looks for a stop signal or its driver's end, seconds."""


def start_local_shards(
    n: int, schema: Schema, token: str | None = None, *, timeout_s: float = 600.0, lease_s: float = 300.0,
    payload: Payload = "memory",
) -> tuple[list[DockShardServer], list[str]]:
    """Start ``n`` shard servers in this process (gRPC threads) on free loopback ports.

    Returns the servers (call ``close()`` on each when done) and their locations.
    """
    servers = [
        DockShardServer(schema, "grpc://127.0.0.1:0", token=token, timeout_s=timeout_s, lease_s=lease_s, payload=payload)
        for _ in range(n)
    ]
    return servers, [s.location for s in servers]


def _load_schema(spec: str) -> Schema:
    module, _, attr = spec.partition(":")
    schema = getattr(importlib.import_module(module), attr or "GRPO_SCHEMA")
    if not isinstance(schema, Schema):
        raise SystemExit(f"--schema {spec!r}: expected 'module:attribute' naming a dockrl Schema, got {type(schema).__name__}")
    return schema


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def _member_port(parser: argparse.ArgumentParser, spec: str) -> int:
    """The port of this shard: ``spec`` itself, or of a comma-separated list (one per member of the
    shards' group) the one at this member's index (``process_env.replica``: ``DOCKRL_REPLICA``)."""
    try:
        ports = [int(p) for p in spec.split(",")]
    except ValueError:
        parser.error(f"--port {spec}: expected a port or comma-separated ports (one per shard)")
    if not all(0 <= p < 65536 for p in ports):
        parser.error(f"--port {spec}: expected ports 0-65535")
    if len(ports) == 1:
        return ports[0]
    index, size = replica()
    if size != len(ports):
        parser.error(f"--port {spec}: {len(ports)} ports for a group of {size} shards ({REPLICAS_ENV}); give one per shard")
    return ports[index]


def serve_shard(argv: list[str] | None = None) -> int:
    """Run one dock shard in this process until SIGINT/SIGTERM; print its location first.

    Returns the process exit code.
    """
    parser = argparse.ArgumentParser(prog="dockrl dock-shard", description="Run one transfer dock shard.")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    parser.add_argument("--port", default="0", help="port; 0 picks a free one (printed on stdout); or one port per "
                        "shard of the group, comma-separated: this member's is the one at its index (DOCKRL_REPLICA)")
    parser.add_argument("--token-env", default=None, help="environment variable holding the driver's bearer token (every right)")
    parser.add_argument("--stage-rights", action="append", default=[], metavar="JSON",
                        help="a stage process's token and rights (repeatable; dockrl.dock.roles.StageRights.to_arg: "
                        "{stage, token_env, consumers, reads, writes, drop}); needs --token-env for the driver's token")
    parser.add_argument("--tls", action="store_true",
                        help="mutual TLS with the run's certificates from the environment (dockrl.dock.tls: CA, server cert and key)")
    parser.add_argument("--snapshot-place", action="append", default=[], metavar="PATH_OR_S3_URI",
                        help="a folder or s3:// prefix snapshots may go to (repeatable; none: anywhere)")
    parser.add_argument("--schema", default="dockrl.dock.schema:GRPO_SCHEMA", help="module:attribute of the Schema")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="default claim timeout, seconds")
    parser.add_argument("--payload", choices=("memory", "store"), default="memory",
                        help="memory: cells in this shard; store: metadata only, cells in the run's warehouse")
    parser.add_argument("--lease-s", type=float, default=300.0, help="default lease term of a claim, seconds")
    parser.add_argument("--driver-timeout-s", type=float, default=0.0,
                        help="stop when the run's driver has not renewed its lease for this long, seconds (0: never)")
    args = parser.parse_args(argv)
    port = _member_port(parser, args.port)
    if not 0 < args.lease_s < math.inf:
        parser.error(f"--lease-s {args.lease_s}: expected a finite number of seconds > 0")
    token = None
    if args.token_env:
        token = os.environ.get(args.token_env)
        if not token:
            parser.error(f"--token-env {args.token_env}: the environment variable is unset or empty; export the shard token")
    stages: list[tuple[str, StageRights]] = []
    for text in args.stage_rights:
        try:
            env, rights = StageRights.from_arg(text)
        except ValueError as e:
            parser.error(str(e))
        stage_token = os.environ.get(env)
        if not stage_token or token is None:
            parser.error(f"--stage-rights of {rights.stage}: its token_env {env} is unset or empty, or no --token-env for the driver's token")
        stages.append((stage_token, rights))
    try:
        tls = DockTLS.from_env(os.environ, "server") if args.tls else None
    except ValueError as e:
        parser.error(f"--tls: {e}")
    if args.tls and tls is None:
        parser.error(f"--tls: {CA_ENV} is unset or empty; the launcher sets the run's certificates")
    if token is None and not is_loopback(args.host):
        parser.error(f"--host {args.host}: a shard reachable from other machines must require a bearer token; "
                     "pass --token-env DOCKRL_DOCK_TOKEN (with the token in that variable), or bind --host 127.0.0.1")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        server = DockShardServer(
            _load_schema(args.schema), f"grpc://{args.host}:{port}", token=token, timeout_s=args.timeout_s,
            payload=args.payload, lease_s=args.lease_s, stages=stages, snapshot_places=args.snapshot_place, tls=tls,
        )
    except ValueError as e:  # rights naming a column the schema lacks
        parser.error(str(e))
    # gRPC threads serve already; the main thread only waits for a signal. Not server.serve():
    # on a signal it shuts gRPC down first, which waits for claims blocked in the shard (up to
    # their timeout), and only then runs Python's handler; close() wakes them first.
    # The handlers only append to lists and the main thread polls them: a handler that set a
    # threading.Event could run while the main thread holds that Event's lock in its wait (woken
    # by the driver watch's thread a moment before the parent death signal) and never return.
    stop_signals: list[int] = []
    driver_gone: list[str] = []

    def stop(signum: int, frame: object) -> None:
        stop_signals.append(signum)

    watch_driver(driver_pid=driver_pid_from_env(), lease_quiet=server.driver_quiet_s if args.driver_timeout_s > 0 else None,
                 timeout_s=args.driver_timeout_s or 60.0, what=f"dock shard at {server.location}", on_gone=driver_gone.append)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(server.location, flush=True)  # after the handlers: whoever reads it may stop the shard at once
    try:
        while not (stop_signals or driver_gone):
            time.sleep(STOP_POLL_S)
        if driver_gone:
            logger.error("%s; stopping", driver_gone[0])
        logger.info("dock shard at %s stopping", server.location)
    finally:
        server.close()
    return 1 if driver_gone else 0


if __name__ == "__main__":
    sys.exit(serve_shard())
