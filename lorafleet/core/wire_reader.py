"""The one strict reader of lorafleet's MessagePack bodies, and the errors it raises.

Every wire type (wire.py, task_params.py) packs with `pack` and decodes with `read_body`: a missing
field, a field of the wrong type or an unknown version is a `WireError` that names the field, whichever
body it is.
"""

from __future__ import annotations

from typing import Any

import msgpack

WIRE_VERSION = 1


class WireError(ValueError):
    """A body that is not a valid lorafleet message; the message names what is wrong."""


class MalformedTask(WireError):
    """A task body that cannot be decoded into a Task; it is terminated and dead-lettered."""


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=True)


NUMBER = (int, float)
REQUIRED = object()


def read_body(data: bytes, what: str, spec: dict[str, tuple[Any, Any]], error: type[WireError] = WireError
              ) -> dict[str, Any]:
    """The fields of a versioned MessagePack map, checked against `spec` = {key: (types, default)}.

    A default of `REQUIRED` makes the key mandatory; a default of None also admits None. bool is
    not accepted where a number is expected (MessagePack keeps them apart; Python does not).
    """
    try:
        d = unpack(data)
    except Exception as exc:  # msgpack raises several unrelated types
        raise error(f"{what} is not MessagePack: {type(exc).__name__}: {exc}") from exc
    if not isinstance(d, dict):
        raise error(f"{what} body is not a map")
    if d.get("v") != WIRE_VERSION:
        raise error(f"{what} has unsupported wire version {d.get('v')!r} (this side speaks {WIRE_VERSION})")
    return read_fields(d, what, spec, error)


def read_fields(d: dict[Any, Any], what: str, spec: dict[str, tuple[Any, Any]],
                error: type[WireError] = WireError) -> dict[str, Any]:
    """The checked fields of an already unpacked map (a body, or a map nested in one)."""
    out: dict[str, Any] = {}
    for key, (types, default) in spec.items():
        if key not in d:
            if default is REQUIRED:
                raise error(f"{what} is missing field {key!r}")
            out[key] = default
            continue
        value = d[key]
        if value is None and default is None:
            out[key] = None
        elif isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
            raise error(f"{what} field {key!r} has the wrong type: bool")
        elif not isinstance(value, types):
            raise error(f"{what} field {key!r} has the wrong type: {type(value).__name__}")
        else:
            out[key] = value
    return out
