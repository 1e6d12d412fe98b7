"""Tracking URIs as vitreg shows and checks them: credentials never printed, and usable for a health check.

MLflow accepts ``http://user:password@host:port`` (it sends the userinfo as basic auth); vitreg's own
messages, tags and reports show such a URI with the password masked, and its reachability check sends
the credentials as a header instead of in the URL (urllib refuses userinfo in a URL).
"""

from __future__ import annotations

import base64
import urllib.parse


def redact(uri: str) -> str:
    """``scheme://user:secret@host/db`` -> ``scheme://user:***@host/db``; anything else unchanged."""
    try:
        parts = urllib.parse.urlsplit(uri)
        password = parts.password
    except ValueError:
        return uri
    if password is None:
        return uri
    userinfo, _, hostinfo = parts.netloc.rpartition("@")
    user = userinfo.split(":", 1)[0]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{hostinfo}"))


def has_password(uri: str) -> bool:
    try:
        return urllib.parse.urlsplit(uri).password is not None
    except ValueError:
        return False


def without_credentials(uri: str) -> tuple[str, dict[str, str]]:
    """``(uri without userinfo, headers)``: the userinfo, if any, as a basic ``Authorization`` header."""
    parts = urllib.parse.urlsplit(uri)
    if parts.username is None:
        return uri, {}
    hostinfo = parts.netloc.rpartition("@")[2]
    user = urllib.parse.unquote(parts.username)
    password = urllib.parse.unquote(parts.password or "")
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return urllib.parse.urlunsplit(parts._replace(netloc=hostinfo)), {"Authorization": f"Basic {token}"}
