"""The MLflow UI shows what the README promises: each run's model, image size and GPU in the runs list as
it opens, its results table on the run page, runs grouped by GPU, a compare view; and ``make ui``
prints links that open the runs.

Drives Debian's Chromium through Python Playwright (no ``playwright install``, no browser
download): start a tracking server, log two runs (gpu=a100, gpu=h200; the h200 one while processes this test
starts keep the host busy), named and described by the bench job, check the runs list before any click (the
busy run's ``busy host`` flag read from its row, then on screen once the Run Name column fits the names), open a
run, group the runs by the ``gpu`` param, open the compare view of the two runs and check what is on screen.

Screenshots go to ``$VITREG_UI_SHOTS`` (default: the test's tmp folder); with
``VITREG_UPDATE_DOC_SHOTS=1`` they are also copied to ``docs/img/`` for docs/tracking.md.
Set up a CI image with ``bash tracking/ci_ui.sh``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import migrated_store, premigrated, wait_until
from vitreg.deploy import server
from vitreg.tracking.naming import RunTitle, runs_page

pytestmark = [pytest.mark.slow, pytest.mark.ui]

REPO = Path(__file__).resolve().parents[1]
EXPERIMENT = "ui-check"
METRIC = "infer_throughput_img_per_s"
GPUS = ("a100", "h200")
BUSY = "h200"  # the run measured beside other jobs: its name carries the flag `busy host`
CHROMIUM = os.environ.get("VITREG_CHROMIUM", "/usr/bin/chromium")
# No sandbox: CI containers run as root. --disable-dev-shm-usage: a container's /dev/shm is often 64 MB,
# too small for the renderer's shared memory on a tall page (its renderer then dies: "Target crashed").
# The rest keeps Chromium off the network.
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
# The MLflow 3 UI opens in its GenAI layout with an assistant panel; ask for the classic
# "Model training" layout up front. (The URL also says workflowType=machine_learning, in
# case these private storage keys change.)
UI_PREFERENCES = """
    localStorage.setItem('mlflow.workflowType_v1', JSON.stringify('machine_learning'));
    localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false');
    localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');
"""


@pytest.fixture(autouse=True)
def _requirements() -> None:
    """Skip (before a server is started) when the browser side is missing."""
    if importlib.util.find_spec("playwright") is None:
        pytest.skip("playwright is not installed (pip install playwright; tracking/ci_ui.sh)")
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium; tracking/ci_ui.sh; "
                    "or set VITREG_CHROMIUM)")


def _log_runs(uri: str, monkeypatch) -> None:
    """Log the runs the UI check looks at into experiment ``ui-check``.

    Contract: at least one run per GPU label in ``GPUS``, each with the param ``gpu`` and the
    metric ``infer_throughput_img_per_s``, named and described by the bench job itself (:class:`RunTitle`
    with its throughput and flags, :func:`run_note`); the ``BUSY`` one measured while :func:`_busy_host`
    keeps other processes on the CPUs, so its figure is flagged ``busy host`` as a real run beside other
    jobs is (issue 38).
    """
    import mlflow
    import mlflow.tracking._tracking_service.utils as tracking_utils

    import vitreg

    # Real benchmarks on this CPU filed under two GPU labels (allow_gpu_mismatch=true tags them
    # gpu_mismatch=true), through the Python API in this process, as a notebook would: what this test checks is
    # the UI, and a process of their own would import torch, timm and mlflow again (~7 s of CPU).
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    # this process's MLflow may hold an earlier test's store, which outranks the variable: theirs again after
    monkeypatch.setattr(tracking_utils, "_tracking_uri", tracking_utils._tracking_uri)
    mlflow.set_tracking_uri(uri)
    for gpu in GPUS:
        with _busy_host() if gpu == BUSY else contextlib.nullcontext():
            vitreg.api.bench(experiment=EXPERIMENT, gpu=gpu, allow_gpu_mismatch=True, model="test_vit",
                             img_size=32, batch_size=2, task="infer", warmup=1, steps=2, repeats=2)


@contextlib.contextmanager
def _busy_host():
    """Other jobs on the host while the block runs: processes that each spin on a CPU, enough of them that the
    load beside a run passes :func:`vitreg.measure.energy.busy`'s threshold (half a CPU, or a tenth of the
    host's CPUs) with a CPU to spare; each is ended by its PID after the block."""
    from vitreg.measure import energy

    threshold = max(energy.BUSY_CPUS, energy.BUSY_SHARE * (os.cpu_count() or 1))
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(math.floor(threshold) + 1)]
    try:
        yield
    finally:
        for proc in burners:
            os.kill(proc.pid, signal.SIGKILL)
        for proc in burners:
            proc.wait(timeout=30)


# Whether ``needle``'s characters inside the element are on screen: not cut off by an ancestor that
# clips (the runs list cuts long names with an ellipsis, which takes about the last 12 px of a text that overflows;
# a collapsed description shows its first line), nor outside the window.
_SHOWN_IN_FULL = """(el, needle) => {
    const walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
        const at = node.data.indexOf(needle);
        if (at < 0) continue;
        const range = document.createRange();
        range.setStart(node, at);
        range.setEnd(node, at + needle.length);
        const box = range.getBoundingClientRect();
        let right = window.innerWidth, left = 0, top = 0, bottom = window.innerHeight;
        for (let up = node.parentElement; up; up = up.parentElement) {
            const style = getComputedStyle(up);
            const r = up.getBoundingClientRect();
            if (style.overflowX !== 'visible' || style.textOverflow === 'ellipsis') {
                right = Math.min(right, r.right - (style.textOverflow === 'ellipsis' && up.scrollWidth > up.clientWidth ? 12 : 0));
                left = Math.max(left, r.left);
            }
            if (style.overflowY !== 'visible') {
                top = Math.max(top, r.top);
                bottom = Math.min(bottom, r.bottom);
            }
        }
        return box.width > 0 && box.left >= left && box.right <= right && box.top >= top - 1 && box.bottom <= bottom + 1;
    }
    return false;
}"""


# The left and right edges of an element's visible characters: not of its box, nor of the (no-break)
# spaces around them.
_TEXT_BOX = """(el) => {
    let left = Infinity, right = -Infinity;
    const walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
        const start = node.data.search(/\\S/);
        if (start < 0) continue;
        const range = document.createRange();
        range.setStart(node, start);
        range.setEnd(node, node.data.search(/\\s*$/));
        const box = range.getBoundingClientRect();
        left = Math.min(left, box.left);
        right = Math.max(right, box.right);
    }
    return [left, right];
}"""


def _shown_in_full(locator, needle: str) -> bool:
    return locator.first.evaluate(_SHOWN_IN_FULL, needle)


def _in_chromium(pw, shots: Path, steps, *, viewport: dict, init_script: str | None = None) -> None:
    """Run ``steps(page)`` in a fresh headless Chromium page.

    A renderer that dies ("Target crashed") says nothing about the MLflow UI: the steps run once more,
    from the start, in a new browser, and a second crash fails the test. Any other failure saves
    ``failure.png`` (when the page can still take it) and is raised as it happened.
    """
    from playwright.sync_api import expect

    for attempt in (1, 2):
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        crashed = []
        try:
            context = browser.new_context(viewport=viewport)
            if init_script:
                context.add_init_script(init_script)
            page = context.new_page()
            page.on("crash", lambda _page, seen=crashed: seen.append(True))
            page.set_default_timeout(30_000)
            expect.set_options(timeout=30_000)
            try:
                steps(page)
                return
            except Exception as exc:  # an expect() on a dead page fails as an AssertionError
                if (crashed or "Target crashed" in str(exc)) and attempt == 1:
                    print(f"test_ui: Chromium's renderer crashed ({str(exc).splitlines()[0]}); "
                          "running the steps again in a new browser", file=sys.stderr)
                    continue
                _failure_shot(page, shots)
                raise
        finally:
            browser.close()


def _failure_shot(page, shots: Path) -> None:
    """Save what the page showed when a step failed; never hide that failure behind a second one."""
    from playwright.sync_api import Error

    try:
        page.screenshot(path=shots / "failure.png", timeout=10_000)
    except Error as exc:
        print(f"test_ui: no failure.png ({exc.message.splitlines()[0]})", file=sys.stderr)


def _api(base: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{base}/api/2.0/mlflow/{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.load(resp)


def _runs_by_gpu(base: str) -> tuple[str, dict[str, str]]:
    """(experiment id, {gpu: run name}) as the server has them, one run per GPU."""
    query = urllib.parse.urlencode({"experiment_name": EXPERIMENT})
    experiment_id = _api(base, f"experiments/get-by-name?{query}")["experiment"]["experiment_id"]
    found = _api(base, "runs/search", {"experiment_ids": [experiment_id], "max_results": 100})
    names: dict[str, str] = {}
    for run in found.get("runs", []):
        params = {p["key"]: p["value"] for p in run["data"].get("params", [])}
        names.setdefault(params.get("gpu"), run["info"]["run_name"])
    missing = [gpu for gpu in GPUS if gpu not in names]
    assert not missing, f"no run with param gpu={missing} in {EXPERIMENT}"
    return experiment_id, {gpu: names[gpu] for gpu in GPUS}


@pytest.fixture
def shots(tmp_path) -> Path:
    folder = Path(os.environ.get("VITREG_UI_SHOTS") or tmp_path / "shots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def tracking_server(tmp_path, monkeypatch):
    for name in list(os.environ):
        if name.startswith("MLFLOW_"):  # the config below is explicit; VITREG_UI_* must stay
            monkeypatch.delenv(name)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = server.ServerConfig(port=port, data_dir=premigrated(tmp_path / "server"))
    proc = server.start(cfg, timeout=90, quiet=True)
    try:
        yield cfg
    finally:
        server.stop(proc)


def test_group_by_gpu_and_compare(tracking_server, shots, monkeypatch):
    from playwright.sync_api import expect, sync_playwright

    base = tracking_server.url
    _log_runs(base, monkeypatch)
    experiment_id, run_names = _runs_by_gpu(base)

    def steps(page) -> None:
        # 1. The experiment's runs table: each run's GPU and img/s in view before any click, then the workload.
        page.goto(f"{base}/{runs_page(experiment_id)}")
        for gpu, name in run_names.items():
            expect(page.get_by_text(name, exact=True)).to_be_visible()
            shown = re.match(rf"{gpu}(≠\S+)? · [\d.,]+ img/s", name)  # ≠cpu: filed under a GPU, ran on the CPU
            assert shown and " · test_vit img32 · " in name, name
            assert _shown_in_full(page.get_by_text(name, exact=True), shown.group(0)), name
        # 1a. The run measured beside other jobs is flagged in the runs table: its row found by GPU, the flag read
        # from the text the browser drew there (not from the store, nor from the name asked for above)
        busy_row = page.get_by_role("row").filter(has_text=f"{BUSY}").filter(has_text=" img/s infer · test_vit img32")
        expect(busy_row).to_have_count(1)
        busy_name = next(line for line in busy_row.inner_text().splitlines() if line.startswith(BUSY))
        assert "busy host" in busy_name.split(" · "), busy_name
        page.screenshot(path=shots / "mlflow-ui-runs-list.png")
        # As it opens the list cuts the name before its flags (the GPU and the figure lead): double-click the Run Name
        # column's edge, as a reader would, and the column fits the names, flag on screen
        page.get_by_role("columnheader").filter(has_text="Run Name").locator(".ag-header-cell-resize").dblclick()
        busy_cell = busy_row.get_by_text(busy_name, exact=True)
        for _ in range(50):  # the grid draws the fitted column after the click
            if _shown_in_full(busy_cell, "busy host"):
                break
            page.wait_for_timeout(100)
        else:
            raise AssertionError(f"the busy host flag of {busy_name!r} is not on screen in the fitted Run Name column")
        page.screenshot(path=shots / "mlflow-ui-runs-flagged.png")
        close_assistant = page.get_by_role("button", name="Close")
        if close_assistant.count() and close_assistant.first.is_visible():
            close_assistant.first.click()

        # 1b. A run's page: its description is the results table.
        page.get_by_text(run_names["h200"], exact=True).click()
        headline = re.search(r"[\d,.]+ img/s", run_names["h200"]).group(0)
        expect(page.get_by_text(headline, exact=True).first).to_be_visible()  # the note's first line
        expect(page.get_by_text("img/s median (min-max)").first).to_be_attached()  # its table
        expect(page.get_by_text("MISLABELLED").first).to_be_visible()  # CPU runs filed as GPUs
        more = page.get_by_text("Show more", exact=True)
        if more.count():
            more.first.click()
        # a table whose cells stand apart: MLflow draws it without padding, the no-break spaces keep them apart
        heads = page.locator("table").filter(has_text="img/s median (min-max)").first.locator("th")
        boxes = [heads.nth(i).evaluate(_TEXT_BOX) for i in range(heads.count())]
        assert len(boxes) >= 8 and all(right + 4 <= left for (_, right), (left, _) in zip(boxes, boxes[1:])), boxes
        page.screenshot(path=shots / "mlflow-ui-run-note.png")
        page.go_back()
        expect(page.get_by_text(run_names["a100"], exact=True)).to_be_visible()

        # 2. Show the metric as a column, drop the columns a benchmark does not use.
        page.get_by_role("button", name="Columns").click()
        page.get_by_text(METRIC, exact=True).click()
        for column in ("Dataset", "Source", "Models"):
            page.get_by_role("dialog").get_by_text(column, exact=True).click()
        page.keyboard.press("Escape")

        # 2b. One workload in view, with the README's search: another image size hides the runs, theirs shows them.
        search = page.get_by_placeholder(re.compile(r"metrics\.rmse"))
        for img, shown in (("224", 0), ("32", 1)):
            search.fill(f"params.model = 'test_vit' and tags.img_size = '{img}'")
            search.press("Enter")
            for name in run_names.values():
                expect(page.get_by_text(name, exact=True)).to_have_count(shown)

        # 3. Group by the gpu param (the menu lists Tags, then Params; both hold "gpu").
        page.get_by_role("button", name="Group by").click()
        page.get_by_role("menuitemcheckbox", name="gpu").last.click()
        page.keyboard.press("Escape")
        expect(page.get_by_role("button", name="Group by: gpu")).to_be_visible()
        for gpu in GPUS:
            expect(page.get_by_text(f"Group: {gpu}", exact=True)).to_be_visible()
        page.screenshot(path=shots / "mlflow-ui-group-by-gpu.png")

        # 4. Select the two runs and open the compare view.
        for name in run_names.values():
            page.get_by_role("row").filter(has_text=name).get_by_role("checkbox").first.check()
        page.get_by_role("button", name="Compare", exact=True).click()
        expect(page.get_by_text("Comparing 2 Runs from 1 Experiment")).to_be_visible()
        page.wait_for_url("**/compare-runs?**")
        # Tall enough for plot, run details, params, metrics and tags in one picture (the
        # page scrolls inside a panel, so a full-page screenshot would not help).
        page.set_viewport_size({"width": 1400, "height": 1900})
        rows = page.get_by_role("row")
        names_row = rows.filter(has_text="Run Name")
        for name in run_names.values():
            expect(names_row.get_by_text(name, exact=True)).to_be_in_viewport()
        # The gpu row of the Parameters table (and of Tags, when the runs carry the tag).
        gpu_rows = rows.filter(has=page.get_by_text("gpu", exact=True))
        expect(gpu_rows.first).to_be_in_viewport()
        for gpu in GPUS:  # run names lead with the GPU and the figures now: wider columns, may need a scroll
            cell = gpu_rows.first.get_by_text(gpu, exact=True)
            cell.scroll_into_view_if_needed()
            expect(cell).to_be_in_viewport()
        # Let the parallel-coordinates plot finish drawing before the picture.
        page.wait_for_timeout(1000)
        page.screenshot(path=shots / "mlflow-ui-compare.png")
        # The metric's row of the Metrics table (its name links to the metric's chart). A bench run
        # has dozens of metrics (and system/* ones), so the row sits below the fold: scroll to it
        # (after the picture: the table is virtualised and mid-scroll pictures misalign its rows).
        metric_link = page.get_by_role("link", name=METRIC, exact=True)
        metric_link.scroll_into_view_if_needed()
        expect(metric_link).to_be_in_viewport()

    with sync_playwright() as pw:
        _in_chromium(pw, shots, steps, viewport={"width": 1400, "height": 1300}, init_script=UI_PREFERENCES)

    if os.environ.get("VITREG_UPDATE_DOC_SHOTS") == "1":
        docs = REPO / "docs" / "img"
        docs.mkdir(parents=True, exist_ok=True)
        for shot in ("mlflow-ui-compare.png", "mlflow-ui-group-by-gpu.png", "mlflow-ui-runs-list.png",
                     "mlflow-ui-run-note.png"):
            shutil.copyfile(shots / shot, docs / shot)


def _fake_venv(folder: Path) -> Path:
    """A VENV for make whose python and mlflow are this interpreter's (and whose install stamp is fresh,
    so make installs nothing)."""
    (folder / "bin").mkdir(parents=True)
    for name, command in (("python", f'exec "{sys.executable}" "$@"'), ("mlflow", f'exec "{sys.executable}" -m mlflow "$@"')):
        script = folder / "bin" / name
        script.write_text(f"#!/bin/sh\n{command}\n")
        script.chmod(0o755)
    (folder / ".vitreg-installed").touch()
    return folder


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(url: str, proc, timeout: float = 120) -> None:
    def answers() -> bool:
        assert proc.poll() is None, "make ui exited early"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return True
        except OSError:
            return False

    wait_until(answers, timeout, f"a UI answering at {url}")


def test_make_ui_prints_links_that_open_the_runs(tmp_path, shots, monkeypatch):
    """`make ui` says where each experiment's runs are, and that link opens them, with no browser state set before,
    answering "which GPU?": each run's GPU and img/s in its name's first characters, the cross-GPU table `vitreg
    compare` keeps in the experiment's description (issue 47)."""
    import mlflow.tracking._tracking_service.utils as tracking_utils
    from mlflow.tracking import MlflowClient
    from playwright.sync_api import expect, sync_playwright

    from vitreg.compare import run_compare

    for name in list(os.environ):
        if name.startswith("MLFLOW_"):
            monkeypatch.delenv(name)
    store = migrated_store(tmp_path)
    client = MlflowClient(store)
    exp = client.create_experiment("make-ui", artifact_location=str(tmp_path / "artifacts"))
    names = {}
    for gpu, values in (("a100", (4321.0, 4310.5, 4330.2)), ("h200", (8635.2, 8640.1, 8620.7))):
        for value in values:
            names[gpu] = RunTitle(gpu, "vit_base_patch16_224", "bf16", "default", img_size=224).name(
                256, throughputs={"infer": value})
            rid = client.create_run(exp, run_name=names[gpu], tags={"gpu": gpu, "vitreg_job": "bench"}).info.run_id
            for key, param in {"gpu": gpu, "model": "vit_base_patch16_224", "task": "infer", "amp": "bf16",
                               "compile": "default", "batch_size": "256"}.items():
                client.log_param(rid, key, param)
            client.log_metric(rid, METRIC, value)
            client.set_terminated(rid, "FINISHED")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setattr(tracking_utils, "_tracking_uri", store)  # this process's MLflow: theirs again after
    run_compare("make-ui", baseline="a100")  # what `vitreg compare --experiment make-ui --baseline a100` does
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    port = _free_port()
    proc = subprocess.Popen(["make", "-s", "-C", str(REPO), "ui", f"VENV={_fake_venv(tmp_path / 'venv')}",
                             f"UI_STORE={store}", f"UI_PORT={port}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"})
    try:
        lines = [proc.stdout.readline() for _ in range(3)]  # the UI, then a line per experiment
        assert lines[0].startswith(f"MLflow UI on http://127.0.0.1:{port} (store {store})"), lines
        link = f"http://127.0.0.1:{port}/{runs_page(exp)}"
        assert f"make-ui (6 runs): {link}" in [line.strip() for line in lines[1:]], lines
        _wait_for(f"http://127.0.0.1:{port}", proc)

        def steps(page) -> None:
            page.goto(link)  # as printed: no workflow preference set, no click
            # the runs list of the "Model training" layout, not the GenAI home ("Training runs", "Evaluations")
            expect(page.get_by_role("heading", name="Runs", exact=True)).to_be_visible()
            expect(page.get_by_text("Evaluation runs", exact=True)).to_have_count(0)
            for gpu, name in names.items():
                expect(page.get_by_text(name, exact=True)).to_be_visible()
                figure = name.split(" · ")[1].split()[0]  # `8,635`: the run's img/s
                assert _shown_in_full(page.get_by_text(name, exact=True), f"{gpu} · {figure} img/s"), name
                # the check can fail: the end of a long name is cut off (why the GPU and the figure come first)
                assert not _shown_in_full(page.get_by_text(name, exact=True), "bs256 · compile"), name
            # the experiment's description, on screen as the page opens (one line until opened): which GPU is
            # best and by how much, from the cross-GPU comparison `vitreg compare` keeps there
            headline = page.get_by_text(re.compile(r"^best gpu: h200 in 1 of 1 configuration; geomean h200 2\.00x a100"))
            expect(headline).to_be_visible()
            for words in ("best gpu", "h200", "in 1 of 1 configuration; geomean", "2.00x", "a100"):  # text nodes
                assert _shown_in_full(headline, words), words
            # the check can fail: the table below the headline waits for a click on the description
            assert not _shown_in_full(page.get_by_text(re.compile(r"\bfaster\b")).first, "faster")
            page.screenshot(path=shots / "make-ui-runs.png")

        with sync_playwright() as pw:
            _in_chromium(pw, shots, steps, viewport={"width": 1400, "height": 900})
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
