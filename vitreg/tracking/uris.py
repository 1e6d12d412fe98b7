"""Tracking URIs as vitreg shows and checks them: credentials never printed (the masking lives in
:mod:`vitreg.console`; every tag and param vitreg stores goes through :func:`scrub`), usable for a health check.
"""

from __future__ import annotations

import base64
import os
import sys
import urllib.parse

from vitreg.console import redact, scrub  # noqa: F401  (the tracking layer's modules mask through these names)


def tracking_uri() -> str:
    """This process's tracking URI as messages show it: masked, a relative sqlite path made absolute."""
    return absolute_uri(redact(current_uri()))


def current_uri() -> str:
    """MLflow's current tracking URI, credentials kept (for a request, never for a message). Before mlflow is
    imported nothing can have called ``mlflow.set_tracking_uri``: a DDP rank, `vitreg runs`, read it without importing
    mlflow (unset: MLflow's default, ./mlflow.db, where no ./mlruns may hold a store of files)."""
    if "mlflow" not in sys.modules and (os.environ.get("MLFLOW_TRACKING_URI") or not os.path.exists("mlruns")):
        return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.abspath('mlflow.db')}"
    from vitreg.tracking.mlflow_on_first_use import mlflow

    return mlflow.get_tracking_uri()


def absolute_uri(uri: str) -> str:
    """``sqlite:///ci.db`` -> ``sqlite:////here/ci.db``: the same store from any folder; other URIs as they are."""
    if not uri.startswith("sqlite:///") or uri.startswith("sqlite:////") or uri.endswith(":memory:"):
        return uri
    return f"sqlite:///{os.path.abspath(uri[len('sqlite:///'):])}"


def has_credentials(uri: str) -> bool:
    return redact(uri) != uri


def without_credentials(uri: str) -> tuple[str, dict[str, str]]:
    """``(uri without userinfo, headers)``: the userinfo as a basic ``Authorization`` header (urllib refuses it)."""
    parts = urllib.parse.urlsplit(uri)
    if parts.username is None:
        return uri, {}
    hostinfo = parts.netloc.rpartition("@")[2]
    user = urllib.parse.unquote(parts.username)
    password = urllib.parse.unquote(parts.password or "")
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return urllib.parse.urlunsplit(parts._replace(netloc=hostinfo)), {"Authorization": f"Basic {token}"}
