"""The control messages two KV-cache endpoints exchange (two-sided sends, JSON-encoded).

Every message names its sender by ``peer`` (a random id per endpoint) because a received
message carries no source address. Bulk data never goes here: pages and the context travel by
one-sided writes whose immediates the decoder counts.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from ..errors import InvalidArgumentError

HELLO = "hello"  # join: my address, role, layout and descriptors (answered by WELCOME)
WELCOME = "welcome"
HEARTBEAT = "heartbeat"
BYE = "bye"  # leaving: fail what is pending with me
REQUEST = "request"  # decoder -> prefiller: where one request's pages and context go
CANCEL = "cancel"  # decoder -> prefiller: stop writing, then confirm with CANCELLED
CANCELLED = "cancelled"  # prefiller -> decoder: nothing more lands; how many writes were issued

KINDS = {HELLO, WELCOME, HEARTBEAT, BYE, REQUEST, CANCEL, CANCELLED}
MAGIC = b"KV1"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def encode(kind: str, peer: str, **fields: Any) -> bytes:
    if kind not in KINDS:
        raise InvalidArgumentError(f"unknown KV message kind {kind!r}")
    return MAGIC + json.dumps({"kind": kind, "peer": peer, **fields}, separators=(",", ":")).encode()


def decode(data: bytes) -> dict[str, Any] | None:
    """The message, or None if ``data`` is not a KV message (other users of the engine)."""
    if not data.startswith(MAGIC):
        return None
    try:
        msg = json.loads(data[len(MAGIC) :])
    except ValueError:
        return None
    if not isinstance(msg, dict) or msg.get("kind") not in KINDS or not isinstance(msg.get("peer"), str):
        return None
    return msg
