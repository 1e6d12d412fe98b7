"""Tracking URIs as vitreg shows and checks them: credentials never printed, and usable for a health check.

The one place that turns any URI (or any text holding URIs) into its printable form. A URI carries
credentials in its userinfo (``http://user:password@host``, a token alone ``http://TOKEN@host``,
``postgresql://user:pw@db``, ``s3://KEY:SECRET@bucket``) or in its query string (``?token=``,
``?password=``, a presigned ``X-Amz-Signature=``). :func:`redact` masks every one of them; :func:`scrub`
does it for every URI inside a message, and also masks the literal credentials of this process's tracking
URI wherever they appear (an MLflow error may quote them out of their URI). Every message vitreg prints
(:mod:`vitreg.console`, the CLI's ``error:`` line) and every tag and param it stores goes through
:func:`scrub`. The reachability check sends the userinfo as a header instead of in the URL (urllib
refuses userinfo in a URL).
"""

from __future__ import annotations

import base64
import os
import re
import sys
import urllib.parse

MASK = "***"
# query keys whose value is a credential (case-insensitive, as a whole word of the key)
_SECRET_KEY = re.compile(r"(pass(word)?|pwd|secret|token|key|auth|credential|signature|sig|session|apikey)",
                         re.IGNORECASE)
_URI_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")


def _mask_query(query: str) -> str:
    if not query:
        return query
    pairs = []
    for part in query.split("&"):
        key, eq, value = part.partition("=")
        secret = eq and value and any(_SECRET_KEY.fullmatch(word) for word in re.split(r"[-_.]", key) if word)
        pairs.append(f"{key}={MASK}" if secret else part)
    return "&".join(pairs)


def redact(uri: str) -> str:
    """``scheme://user:secret@host/db?token=t`` -> ``scheme://user:***@host/db?token=***``; a token alone
    in the userinfo (``http://TOKEN@host``) -> ``http://***@host``; a URI without credentials unchanged."""
    try:
        parts = urllib.parse.urlsplit(uri)
    except ValueError:
        return MASK if "@" in uri else uri
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostinfo = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:{MASK}@{hostinfo}" if colon else f"{MASK}@{hostinfo}"
    query = _mask_query(parts.query)
    if netloc == parts.netloc and query == parts.query:
        return uri
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))


def _secrets_of(uri: str) -> set[str]:
    """The literal credentials a URI carries (raw and percent-decoded), at least 4 characters long (shorter
    ones would mask common words)."""
    try:
        parts = urllib.parse.urlsplit(uri)
    except ValueError:
        return set()
    found = set()
    if "@" in parts.netloc:
        userinfo = parts.netloc.rpartition("@")[0]
        user, colon, password = userinfo.partition(":")
        found.add(password if colon else user)
    for key, _, value in (p.partition("=") for p in parts.query.split("&") if p):
        if value and _mask_query(f"{key}={value}") != f"{key}={value}":
            found.add(value)
    found |= {urllib.parse.unquote(s) for s in found}
    return {s for s in found if len(s) >= 4}


def known_secrets() -> set[str]:
    """The credentials of this process's tracking and registry URIs (from the environment: a rank that never
    imports mlflow knows them too)."""
    found = set()
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        found |= _secrets_of(os.environ.get(name, ""))
    for name in ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        if len(os.environ.get(name, "")) >= 4:
            found.add(os.environ[name])
    return found


def scrub(text: str) -> str:
    """``text`` with every URI in it redacted and every known credential masked: what vitreg prints or stores."""
    if not text:
        return text
    text = _URI_IN_TEXT.sub(lambda m: redact(m.group(0)), text)
    for secret in sorted(known_secrets(), key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


def tracking_uri() -> str:
    """This process's tracking URI as messages show it (MLflow's current one, credentials masked).
    Before mlflow is imported nothing can have called ``mlflow.set_tracking_uri``, so a set MLFLOW_TRACKING_URI
    is the answer MLflow would give: a DDP rank prints it without importing mlflow."""
    if "mlflow" not in sys.modules and os.environ.get("MLFLOW_TRACKING_URI"):
        return redact(os.environ["MLFLOW_TRACKING_URI"])
    from vitreg.tracking.mlflow_on_first_use import mlflow

    return redact(mlflow.get_tracking_uri())


def has_credentials(uri: str) -> bool:
    """Whether ``uri`` carries any credential (userinfo, or a credential in its query string)."""
    return redact(uri) != uri


def has_password(uri: str) -> bool:  # the name older callers use
    return has_credentials(uri)


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
