"""KV hand-off: handle and wire format, the Transport protocol, the registry and the transports.

`load_transport(name, **options)` is the entry point; nothing here imports a transport (or a vendor
SDK) until its name is asked for.
"""

from __future__ import annotations

from rngd_pd.kv.protocol import CopyTransport, Transport
from rngd_pd.kv.registry import known_names, load_transport

__all__ = ["CopyTransport", "Transport", "known_names", "load_transport"]
