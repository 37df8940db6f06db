"""API and admin keys: who may use the API, and who may load and unload models.

A key is offered as `Authorization: Bearer KEY` (what the openai client sends), `x-api-key: KEY` or, as TabbyAPI
clients send admin keys, `x-admin-key: KEY`. The rules:

- `api_keys` empty: the API needs no key; else every `/v1` route needs one of `api_keys` or `admin_keys`.
- Loading and unloading models need one of `admin_keys`. With no admin key configured they are open to everyone
  when `api_keys` is empty too (local, single-user use) and disabled (403) otherwise.
"""
from __future__ import annotations

import secrets
from typing import Optional
from urllib.parse import urlsplit

from fastapi import Request

from exl2.config import ServerConfig
from exl2.server.errors import APIError

MISSING = "Missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'."
WRONG = "Incorrect API key provided."


def offered_keys(request: Request) -> list[str]:
    offered = []
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        offered.append(token.strip())
    for header in ("x-api-key", "x-admin-key"):
        if request.headers.get(header, "").strip():
            offered.append(request.headers[header].strip())
    return offered


def _matches(offered: list[str], keys: tuple[str, ...]) -> bool:
    # Compare against every key without stopping early, so timing does not tell which key nearly matched.
    ok = [secrets.compare_digest(o.encode(), k.encode()) for o in offered for k in keys]
    return any(ok)


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def permission(request: Request, config: ServerConfig) -> Optional[str]:
    """"admin", "api" or None (no valid key) for the keys the request offers. Without any key configured every
    request is "admin"; without API keys a request with no admin key is "api"."""
    if not config.api_keys and not config.admin_keys:
        return "admin"
    offered = offered_keys(request)
    if offered and _matches(offered, config.admin_keys):
        return "admin"
    if not config.api_keys or (offered and _matches(offered, config.api_keys)):
        return "api"
    return None


def api_key_check(config: ServerConfig):
    """A dependency that lets a request through with an API or admin key (or any request without API keys)."""

    async def check(request: Request) -> None:
        if permission(request, config) is None:
            raise _unauthorized(WRONG if offered_keys(request) else MISSING)

    return check


def _same_or_allowed_origin(request: Request, config: ServerConfig) -> bool:
    """Whether a browser request may act: no Origin header (not a browser), the server's own origin, or one
    --cors-origin allows."""
    origin = request.headers.get("origin")
    if origin is None or "*" in config.cors_origins or origin in config.cors_origins:
        return True
    return urlsplit(origin).netloc.lower() == request.headers.get("host", "").lower()


def admin_key_check(config: ServerConfig):
    """A dependency for loading and unloading models: see the module's rules."""

    async def check(request: Request) -> None:
        if not config.api_keys and not config.admin_keys:
            # No keys: any web page the user visits could otherwise unload the model with a simple form POST.
            if not _same_or_allowed_origin(request, config):
                raise APIError(403, "Model management from this web page's origin is not allowed; allow the "
                                    "origin with --cors-origin.", code="origin_not_allowed")
            return
        offered = offered_keys(request)
        if offered and _matches(offered, config.admin_keys):
            return
        if not config.admin_keys:
            if permission(request, config) is None:
                raise _unauthorized(WRONG if offered else MISSING)
            raise APIError(403, "Loading and unloading models is disabled because the server has API keys but no "
                                "admin key; start it with --admin-key KEY.", code="admin_disabled")
        if not offered:
            raise _unauthorized("Missing admin key: send 'Authorization: Bearer KEY', 'x-api-key: KEY' or "
                                "'x-admin-key: KEY' with an admin key.")
        if config.api_keys and _matches(offered, config.api_keys):
            raise APIError(403, "This key may not load or unload models; send an admin key.",
                           code="admin_key_required")
        raise _unauthorized(WRONG)

    return check
