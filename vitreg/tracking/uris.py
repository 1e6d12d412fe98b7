"""Tracking URIs as vitreg shows and checks them: credentials never printed, and usable for a health check.

The masking itself (:func:`redact`, :func:`scrub`) lives in :mod:`vitreg.console`, below every layer that
prints, and is named here for the tracking layer's modules: every tag and param vitreg stores goes through
:func:`scrub`, as every message it prints does. The reachability check sends the userinfo as a header
instead of in the URL (urllib refuses userinfo in a URL).
"""

from __future__ import annotations

import base64
import os
import sys
import urllib.parse

from vitreg.console import redact, scrub  # noqa: F401  (the tracking layer's modules mask through these names)


def tracking_uri() -> str:
    """This process's tracking URI as messages show it (MLflow's current one, credentials masked, a relative
    sqlite path made absolute: which file it is, from any folder).
    Before mlflow is imported nothing can have called ``mlflow.set_tracking_uri``, so a set MLFLOW_TRACKING_URI
    is the answer MLflow would give: a DDP rank prints it without importing mlflow."""
    return absolute_uri(redact(current_uri()))


def current_uri() -> str:
    """MLflow's current tracking URI as it is, credentials kept (for a request, never for a message), read
    without importing mlflow where nothing has imported it yet (see :func:`tracking_uri`)."""
    if "mlflow" not in sys.modules and os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    from vitreg.tracking.mlflow_on_first_use import mlflow

    return mlflow.get_tracking_uri()


def absolute_uri(uri: str) -> str:
    """``uri`` with a relative sqlite path made absolute (``sqlite:///ci.db`` -> ``sqlite:////here/ci.db``):
    the same store from any folder. Other URIs as they are."""
    if not uri.startswith("sqlite:///") or uri.startswith("sqlite:////") or uri.endswith(":memory:"):
        return uri
    return f"sqlite:///{os.path.abspath(uri[len('sqlite:///'):])}"


def has_credentials(uri: str) -> bool:
    """Whether ``uri`` carries any credential (userinfo, or a credential in its query string)."""
    return redact(uri) != uri


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
