"""`rngd-pd kv-relay`: run the KV relay server of the tcp (and nixl-ucx) transports."""

from __future__ import annotations

import argparse
import logging
import sys

from rngd_pd.errors import ConfigError
from rngd_pd.kv.relay.server import RelayServer, config_from_env

HELP = "run the KV relay (tcp transport's blob store; nixl-ucx's descriptor store)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=7700, help="port (0 = any free one; printed at start)")
    p.add_argument("--max-mb", type=int, default=4096, help="memory cap for stored blobs (MiB)")
    p.add_argument("--max-blob-mb", type=int, default=1024, help="largest single blob (MiB)")
    p.add_argument("--ttl-s", type=float, default=None,
                   help="drop keys untouched this long (default $AIRM_KV_TCP_TTL_S or 300)")
    p.add_argument("--secret", default=None,
                   help="shared secret clients must prove (HMAC challenge); default $AIRM_KV_TCP_SECRET. "
                        "Controls who may push/pull; does not encrypt (no TLS)")
    p.add_argument("--log", action="store_true", help="log size and SHA-256 per blob (or AIRM_KV_TCP_LOG=1)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        cfg = config_from_env(
            max_bytes=args.max_mb << 20,
            max_blob_bytes=args.max_blob_mb << 20,
            ttl_s=args.ttl_s,
            secret=args.secret.encode() if args.secret else None,
            log_blobs=True if args.log else None,
        )
    except ConfigError as exc:
        print(f"rngd-pd kv-relay: {exc}", file=sys.stderr)
        return 2
    server = RelayServer(args.host, args.port, cfg)
    host, port = server.address
    auth = "secret required" if cfg.secret else "no secret"
    print(f"kv-relay listening on {host}:{port} (max {args.max_mb} MiB, ttl {cfg.ttl_s:g} s, {auth})",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        server.shutdown()
    return 0

