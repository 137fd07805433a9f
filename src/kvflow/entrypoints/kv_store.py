"""`kvflow kv-store`: the KV block store that prefill and decode engines on different hosts share.

    kvflow kv-store --host 0.0.0.0 --port 8600 --max-bytes 8589934592

Engines point at it with `--kv-transfer-config '{"kv_connector": "TCPStoreConnector", "kv_role":
"kv_producer", "kv_connector_extra_config": {"kv_store_url": "tcp://STORE_HOST:8600"}}'`. It
holds blocks in memory, evicting the least recently used past --max-bytes; it trusts its network
(no authentication: bind it to an interface only the engines reach).
"""

from __future__ import annotations

import argparse
import logging

from kvflow.kv_store.tcp_server import KVStoreServer
from kvflow.kv_transfer_config import DEFAULT_MAX_STORE_BYTES


def add_kv_store_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("kv-store", help="disaggregated serving across hosts: a KV block store server")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0: all)")
    p.add_argument("--port", type=int, default=8600)
    p.add_argument("--max-bytes", type=_positive_int, default=DEFAULT_MAX_STORE_BYTES,
                   help="memory the blocks may take; past it the least recently used are evicted")
    p.set_defaults(func=run_kv_store)
    return p


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of bytes; got {text}")
    return value


def run_kv_store(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    server = KVStoreServer(args.host, args.port, args.max_bytes)
    logging.getLogger(__name__).info("kvflow kv-store on %s, max %d bytes", server.url, args.max_bytes)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
