"""vitreg.deploy.server with an S3-compatible artifact destination (moto standing in for MinIO).

A real ``mlflow server`` (SQLite store, ``--artifacts-destination s3://...``) talks to a local
moto S3 server; a client process without AWS variables, and unable to import boto3, logs a run
with an artifact through the server's proxy. The object must land in the bucket.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import premigrated
from test_server import CLIENT, free_port
from vitreg.deploy import server
from vitreg.deploy.server import ServerConfig

BUCKET = "vitreg-artifacts"
PREFIX = "mlflow"
REGION = "us-east-1"
# moto accepts any keys; these are the server's, never the client's.
KEYS = {"AWS_ACCESS_KEY_ID": "vitreg-test-key", "AWS_SECRET_ACCESS_KEY": "vitreg-test-secret"}

# The client refuses boto3/botocore: proxied artifacts must not need them on a GPU box.
NO_BOTO_CLIENT = "import sys\nsys.modules.update(boto3=None, botocore=None)\n" + CLIENT


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """No VITREG_* / MLFLOW_* / AWS_* settings from the developer's shell leak into the test."""
    for name in list(os.environ):
        if name.startswith(("VITREG_", "MLFLOW_", "AWS_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")


@pytest.fixture
def s3_endpoint():
    """A moto S3 server on a free loopback port with an empty bucket; yields (url, boto3 client)."""
    pytest.importorskip("boto3", reason="the S3 test needs boto3 (pip install boto3)",
                        exc_type=ImportError)
    moto_server = pytest.importorskip(
        "moto.server", reason="the S3 test needs moto's server (pip install 'moto[server]')",
        exc_type=ImportError)
    import boto3

    port = free_port()
    motos = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    motos.start()
    try:
        url = f"http://127.0.0.1:{port}"
        s3 = boto3.client("s3", endpoint_url=url, region_name=REGION,
                          aws_access_key_id=KEYS["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"])
        s3.create_bucket(Bucket=BUCKET)
        yield url, s3
    finally:
        motos.stop()


@pytest.mark.slow
def test_artifacts_land_in_an_s3_bucket_through_the_proxy(tmp_path, s3_endpoint):
    endpoint, s3 = s3_endpoint
    cfg = ServerConfig(port=free_port(), data_dir=premigrated(tmp_path / "data"),
                       artifacts_destination=f"s3://{BUCKET}/{PREFIX}")
    assert cfg.artifacts_destination == f"s3://{BUCKET}/{PREFIX}"

    # start() hands os.environ (via child_env) to the server; the S3 settings are there only
    # while it starts, so the client below inherits none of them.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_S3_ENDPOINT_URL", endpoint)
        mp.setenv("AWS_DEFAULT_REGION", REGION)
        for name, value in KEYS.items():
            mp.setenv(name, value)
        proc = server.start(cfg, timeout=60, quiet=True)
    try:
        client_cwd = tmp_path / "gpu-box"
        client_cwd.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "AWS_"))}
        env.update(MLFLOW_TRACKING_URI=cfg.url, MLFLOW_DISABLE_TELEMETRY="true")
        done = subprocess.run([sys.executable, "-c", NO_BOTO_CLIENT, "s3-check"], cwd=client_cwd,
                              env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        info = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        server.stop(proc)

    assert info["artifact_uri"].startswith("mlflow-artifacts:/"), info
    key = f"{PREFIX}/{info['experiment_id']}/{info['run_id']}/artifacts/check/hello.txt"
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{PREFIX}/")
    assert [obj["Key"] for obj in listed.get("Contents", [])] == [key]
    assert s3.get_object(Bucket=BUCKET, Key=key)["Body"].read() == b"hello from the client"

    leftovers = sorted(p.name for p in client_cwd.iterdir())
    assert leftovers == [], f"the client wrote into its working directory: {leftovers}"
    # Nothing local stands in for the bucket: no artifacts/ folder, no 's3:' folder in the data dir.
    assert sorted(p.name for p in cfg.data_dir.iterdir()) == ["mlflow.db", "server.log"]
