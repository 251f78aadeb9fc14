"""``mlxfleet fleet init | token | join | show``: TLS between the nodes of a fleet.

``init`` makes the fleet's CA, this node's certificate and the fleet key, and prints
the command that joins another Mac; ``join`` runs that command there (it asks the
node that ran ``init`` over the network, checking the pinned CA hash); ``token``
makes another join token; ``show`` says what this machine holds. The work is in
``fleet_tls``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from .units import parse_duration


def add_fleet_commands(sub: Any) -> None:
    f = sub.add_parser("fleet", help="TLS between the nodes of a fleet: init, token, join, "
                       "show", description="Make a fleet's CA and node certificates "
                       "(mutual TLS between nodes, docs/fleet.md).")
    fs = f.add_subparsers(dest="fleet_command", required=True)
    i = fs.add_parser("init", help="make the fleet (on its first node): CA, this node's "
                      "certificate, the fleet key, a join token")
    i.add_argument("node", help="this machine's node name (its kind: Node manifest)")
    t = fs.add_parser("token", help="a new join token (on the node that ran init)")
    j = fs.add_parser("join", help="join a fleet: mlxfleet fleet join URL NODE --token T "
                      "--ca-hash H (what init printed)")
    j.add_argument("url", help="the gateway URL of the node that ran init")
    j.add_argument("node", help="this machine's node name (its kind: Node manifest)")
    j.add_argument("--token", required=True)
    j.add_argument("--ca-hash", required=True, help="sha256:... (what init printed)")
    s = fs.add_parser("show", help="what this machine holds of a fleet")
    for p in (i, t):
        p.add_argument("--ttl", default="24h", help="how long the join token is good (24h)")
    for p in (i, t, j, s):
        p.add_argument("--fleet-dir", default=None, help="the fleet folder (default: "
                       "STATE_DIR/fleet)")
        p.add_argument("--state-dir", default=None)


def run_fleet(args: Any) -> int:
    from .fleet_tls import FleetTLSError, describe, init, new_token
    from .settings import load_settings

    folder = load_settings(state_dir=args.state_dir, fleet_dir=args.fleet_dir).fleet_folder
    try:
        if args.fleet_command == "init":
            token, pin = init(folder, args.node, parse_duration(args.ttl))
            print(f"fleet made in {folder}: CA {pin}, node {args.node}'s certificate.\n"
                  f"Give each Node manifest an https:// url (its port is where nodes reach "
                  "it), start this node with --node, then on each other Mac:\n\n"
                  f"  mlxfleet fleet join http://THIS-HOST:PORT NODE --token {token} "
                  f"--ca-hash {pin}\n\n(the token is good for {args.ttl}; "
                  "`mlxfleet fleet token` makes another)")
        elif args.fleet_command == "token":
            print(new_token(folder, parse_duration(args.ttl)))
        elif args.fleet_command == "join":
            _join(folder, args)
            print(f"node {args.node} joined the fleet: certificate and key in {folder}. "
                  f"Start it with: mlxfleet serve --node {args.node} ...")
        else:
            print(json.dumps(describe(folder), indent=2))
    except FleetTLSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _join(folder: Any, args: Any) -> None:
    import httpx

    from .fleet_tls import JOIN_ROUTE, FleetTLSError, finish_join, join_request

    sent, key = join_request(args.token, args.node)
    try:  # the answer is checked by its MAC and the pinned CA, not by this connection
        r = httpx.post(args.url.rstrip("/") + JOIN_ROUTE, json=sent, timeout=30,
                       verify=False)
    except httpx.HTTPError as e:
        raise FleetTLSError(f"{args.url} does not answer: {e or type(e).__name__}") from None
    if r.status_code != 200:
        try:
            why = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            why = r.text[:300]
        raise FleetTLSError(f"{args.url} answered {r.status_code}: {why}")
    try:
        answer = r.json()
    except ValueError:
        raise FleetTLSError(f"{args.url} answered something that is not JSON") from None
    finish_join(folder, args.token, args.ca_hash, sent, key, answer)
