"""Tracking URIs with credentials: masked wherever vitreg shows them, usable for the health check."""

import base64

from vitreg.tracking.uris import has_password, redact, without_credentials


def test_redact_masks_only_the_password():
    assert redact("http://alice:s3cr%40t@host:5000/x") == "http://alice:***@host:5000/x"
    assert redact("postgresql+psycopg://u:p@db:5432/mlflow") == "postgresql+psycopg://u:***@db:5432/mlflow"
    assert redact("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert redact("sqlite:////tmp/mlflow.db") == "sqlite:////tmp/mlflow.db"
    assert has_password("http://a:b@h") and not has_password("http://a@h") and not has_password("file:///x")


def test_credentials_travel_as_a_header():
    clean, headers = without_credentials("http://alice:s3cr%40t@127.0.0.1:5000")
    assert clean == "http://127.0.0.1:5000"
    assert base64.b64decode(headers["Authorization"].split()[1]).decode() == "alice:s3cr@t"
    assert without_credentials("http://127.0.0.1:5000") == ("http://127.0.0.1:5000", {})
