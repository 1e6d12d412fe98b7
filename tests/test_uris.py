"""Tracking URIs with credentials: masked wherever vitreg shows them, usable for the health check."""

import base64

import pytest

from vitreg.tracking.uris import has_credentials, redact, scrub, without_credentials


def test_redact_masks_the_whole_userinfo():
    assert redact("http://alice:s3cr%40t@host:5000/x") == "http://***@host:5000/x"
    assert redact("postgresql+psycopg://u:p@db:5432/mlflow") == "postgresql+psycopg://***@db:5432/mlflow"
    assert redact("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert redact("sqlite:////tmp/mlflow.db") == "sqlite:////tmp/mlflow.db"
    assert has_credentials("http://a:b@h") and not has_credentials("file:///x")


def test_redact_masks_every_kind_of_credential():
    assert redact("http://TOKEN@host:5000") == "http://***@host:5000"  # a token alone in the userinfo
    assert redact("https://host/api?token=abc&x=1") == "https://host/api?token=***&x=***"
    assert redact("https://h/p?password=pw&user=u") == "https://h/p?password=***&user=***"
    assert redact("s3://AKIA:sekr@bucket/p") == "s3://***@bucket/p"
    assert redact("https://b/k?X-Amz-Signature=beef&X-Amz-Credential=AK") == \
        "https://b/k?X-Amz-Signature=***&X-Amz-Credential=***"
    assert has_credentials("http://TOKEN@h") and has_credentials("http://h/?token=t")
    assert not has_credentials("http://127.0.0.1:5000")


# issue 31: a value under a name no list knows, and userinfo with an empty password, were printed
ANY_NAME_OR_FORM = [
    ("http://h:5000/?passwd=pw1234", "http://h:5000/?passwd=***"),
    ("http://h:5000/?accessToken=at1234", "http://h:5000/?accessToken=***"),
    ("http://TOKEN12:@h:5000", "http://***@h:5000"),  # an empty password: the token is the user
    ("http://onlyuser@h:5000/", "http://***@h:5000/"),
    ("HTTPS://H/?ACCESS_TOKEN=UP1234&Q=1", "https://H/?ACCESS_TOKEN=***&Q=***"),  # upper case
    ("http://h/p?monkey=ban4na&zz9=qq1234", "http://h/p?monkey=***&zz9=***"),  # names no list would hold
    ("http://h/p?pass%77ord=pc%2Fnt&x", "http://h/p?pass%77ord=***&***"),  # percent-encoded; a bare value
    ("http://h/p;v?a=b=c;d=e1234", "http://h/p;v?a=***;d=***"),  # ';' separators, '=' inside a value
    ("http://h/cb#access_token=fr4g&state=s", "http://h/cb#access_token=***&state=***"),  # a fragment
    ("http://us%40er:p%40ss@h/", "http://***@h/"),  # percent-encoded userinfo
    ("http://a@b:c@h/", "http://***@h/"),  # an '@' inside the userinfo
]


@pytest.mark.parametrize("uri, shown", ANY_NAME_OR_FORM)
def test_every_query_value_and_all_userinfo_are_masked_whatever_the_name(uri, shown):
    assert redact(uri) == shown
    assert scrub(f"failed: {uri} (refused)") == f"failed: {shown} (refused)"
    assert redact(shown) == shown  # masking twice changes nothing


def test_a_uri_at_the_end_of_a_sentence_keeps_the_punctuation_after_it():
    assert scrub("failed (at http://h/?token=abc).") == "failed (at http://h/?token=***)."
    assert scrub("see http://u:pw@h:5000/, then retry") == "see http://***@h:5000/, then retry"


def test_what_holds_no_credential_is_shown_as_it_is():
    for uri in ("http://127.0.0.1:5000/#/experiments/1/runs/abc",
                "http://127.0.0.1:5000/#/experiments/1/runs/abc?workflowType=machine_learning",  # a UI route
                "http://h/?a=", "file:///tmp/x/y.db",
                "models:/deit-tiny@champion", "runs:/0123/checkpoints/last"):
        assert redact(uri) == uri


def test_an_unparseable_uri_with_anything_after_its_host_is_shown_as_its_scheme():
    assert redact("http://[::1/x?token=abc") == "http://***"


@pytest.mark.parametrize("uri, literals", [("http://h:9/?passwd=Pw%2Bd1", ("Pw%2Bd1", "Pw+d1")),
                                           ("http://h:9/?sig=a+b+cd", ("a+b+cd", "a b cd")),
                                           ("http://T0KEN9:@h:9", ("T0KEN9",)),
                                           ("http://h/#access_token=fr4gm", ("fr4gm",))])
def test_a_tracking_uris_secret_is_masked_outside_its_uri_too(monkeypatch, uri, literals):
    """MLflow puts its API path after the tracking URI's query (``/?passwd=X/api/2.0/...``), and requests'
    errors quote that path without a scheme: the URI's literal values are masked, raw and decoded."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    for literal in literals:
        assert literal not in scrub(f"Max retries exceeded with url: /?x={literal}/api/2.0 ({literal})")


def test_scrub_masks_uris_in_text_and_the_tracking_uris_credentials(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://user:S3CRET%21@127.0.0.1:5000")
    text = scrub("API request to http://user:S3CRET%21@127.0.0.1:5000/api failed; password S3CRET! refused")
    assert "S3CRET" not in text and "http://***@127.0.0.1:5000/api" in text
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://TOKENXYZ@127.0.0.1:5000")
    assert scrub("sent TOKENXYZ") == "sent ***"


def test_credentials_travel_as_a_header():
    clean, headers = without_credentials("http://alice:s3cr%40t@127.0.0.1:5000")
    assert clean == "http://127.0.0.1:5000"
    assert base64.b64decode(headers["Authorization"].split()[1]).decode() == "alice:s3cr@t"
    assert without_credentials("http://127.0.0.1:5000") == ("http://127.0.0.1:5000", {})


def test_the_masked_console_scrubs_text_bytes_and_handlers_made_before_it(monkeypatch):
    import io
    import logging
    import sys

    from vitreg.console import MaskedStream, mask_console

    bare = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)
    monkeypatch.setattr(sys, "stderr", bare)
    monkeypatch.setattr(sys, "stdout", sys.stdout)  # restored after the test: mask_console wraps it too
    early = logging.StreamHandler()  # made before: holds the bare stream
    logger = logging.getLogger("vitreg-test-early-handler")
    logger.addHandler(early)
    try:
        mask_console()
        mask_console()  # a second call wraps nothing twice
        assert isinstance(sys.stderr, MaskedStream) and not isinstance(sys.stderr.stream, MaskedStream)
        logger.warning("to http://u:Secr3tPw@h/?k=Qval9")
        sys.stderr.write("text http://h/?passwd=Tval9\n")
        sys.stderr.buffer.write(b"bytes http://Btok9:@h/\n")
        with pytest.raises(TypeError):
            sys.stderr.write(b"")  # click tells a text stream from a binary one by this probe
    finally:
        logger.removeHandler(early)
    printed = bare.buffer.getvalue().decode()
    assert printed == "to http://***@h/?k=***\ntext http://h/?passwd=***\nbytes http://***@h/\n", printed
