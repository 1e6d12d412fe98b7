"""Tracking URIs with credentials: masked wherever vitreg shows them, usable for the health check."""

import base64

from vitreg.tracking.uris import has_credentials, has_password, redact, scrub, without_credentials


def test_redact_masks_only_the_password():
    assert redact("http://alice:s3cr%40t@host:5000/x") == "http://alice:***@host:5000/x"
    assert redact("postgresql+psycopg://u:p@db:5432/mlflow") == "postgresql+psycopg://u:***@db:5432/mlflow"
    assert redact("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert redact("sqlite:////tmp/mlflow.db") == "sqlite:////tmp/mlflow.db"
    assert has_password("http://a:b@h") and not has_password("file:///x")


def test_redact_masks_every_kind_of_credential():
    assert redact("http://TOKEN@host:5000") == "http://***@host:5000"  # a token alone in the userinfo
    assert redact("https://host/api?token=abc&x=1") == "https://host/api?token=***&x=1"
    assert redact("https://h/p?password=pw&user=u") == "https://h/p?password=***&user=u"
    assert redact("s3://AKIA:sekr@bucket/p") == "s3://AKIA:***@bucket/p"
    assert redact("https://b/k?X-Amz-Signature=beef&X-Amz-Credential=AK") == \
        "https://b/k?X-Amz-Signature=***&X-Amz-Credential=***"
    assert redact("file:///x?monkey=1") == "file:///x?monkey=1"  # 'key' inside a word is no credential
    assert has_credentials("http://TOKEN@h") and has_credentials("http://h/?token=t")
    assert not has_credentials("http://127.0.0.1:5000")


def test_scrub_masks_uris_in_text_and_the_tracking_uris_credentials(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://user:S3CRET%21@127.0.0.1:5000")
    text = scrub("API request to http://user:S3CRET%21@127.0.0.1:5000/api failed; password S3CRET! refused")
    assert "S3CRET" not in text and "http://user:***@127.0.0.1:5000/api" in text
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://TOKENXYZ@127.0.0.1:5000")
    assert scrub("sent TOKENXYZ") == "sent ***"


def test_credentials_travel_as_a_header():
    clean, headers = without_credentials("http://alice:s3cr%40t@127.0.0.1:5000")
    assert clean == "http://127.0.0.1:5000"
    assert base64.b64decode(headers["Authorization"].split()[1]).decode() == "alice:s3cr@t"
    assert without_credentials("http://127.0.0.1:5000") == ("http://127.0.0.1:5000", {})
