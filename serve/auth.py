"""API keys: `Authorization: Bearer <key>` on every /v1/* call when any key is configured."""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Mapping

from lorafleet.serve.errors import ApiError

ENV_API_KEYS = "LORAFLEET_API_KEYS"


def load_api_keys(configured: Iterable[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """Keys from the fleet config plus LORAFLEET_API_KEYS (comma-separated); blanks are ignored."""
    env = os.environ if environ is None else environ
    keys = [k.strip() for k in configured if k.strip()]
    keys += [k.strip() for k in env.get(ENV_API_KEYS, "").split(",") if k.strip()]
    return list(dict.fromkeys(keys))


class ApiKeys:
    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = [k.encode() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> None:
        """Raise 401 (no key) or 403 (wrong key); return when the key is one of ours or auth is off."""
        if not self._keys:
            return
        if not authorization:
            raise ApiError(401, "missing_api_key", "send an API key as 'Authorization: Bearer <key>'",
                           {"WWW-Authenticate": 'Bearer realm="lorafleet"'})
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise ApiError(401, "missing_api_key", "the Authorization header must look like 'Bearer <key>'",
                           {"WWW-Authenticate": 'Bearer realm="lorafleet", error="invalid_request"'})
        given = token.encode()
        # Compare against every key (no early exit) so timing does not reveal which key is close.
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(given, key)
        if not ok:
            raise ApiError(403, "invalid_api_key", "the API key is not valid for this gateway")
