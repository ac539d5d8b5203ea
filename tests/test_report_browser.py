"""report.html in a real browser: headless Chromium renders it offline and it requests nothing.

Chromium is Debian's `chromium` package; .ci/run installs it. Outside CI the test is skipped
when it is missing; under CI=true it must run.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from matplotlib import image

from codesign.report.render import write_report
from tests.report_db import build

WINDOW = (1280, 1600)


@pytest.fixture(scope="module")
def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is not installed; .ci/run installs it (apt-get install chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium); CI runs this test")
    return path


def open_in_chromium(chromium: str, page: Path, tmp: Path) -> tuple[np.ndarray, list[str]]:
    """Screenshot of the page, and the URLs that the page (not the browser itself) requested.

    Names resolve nowhere (--host-resolver-rules), so even Chromium's own background requests
    (updates, time) cannot leave the machine. file: and data: loads never reach the net log."""
    shot, log = tmp / f"{page.stem}.png", tmp / f"{page.stem}.netlog.json"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp / 'profile'}", "--host-resolver-rules=MAP * ~NOTFOUND",
                    f"--window-size={WINDOW[0]},{WINDOW[1]}", f"--screenshot={shot}", f"--log-net-log={log}",
                    page.as_uri()], capture_output=True, timeout=120, check=True)
    return image.imread(shot), page_requests(json.loads(log.read_text()))


def page_requests(net_log: dict) -> list[str]:
    """URLs of the requests a document started: those with an initiator (the browser's own have none)."""
    start = net_log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    return [event["params"]["url"] for event in net_log["events"]
            if event["type"] == start and event.get("params", {}).get("initiator", "not an origin") != "not an origin"]


def test_report_renders_offline_in_chromium(chromium, tmp_path):
    build(tmp_path / "r.db")
    html = write_report(tmp_path / "r.db", tmp_path / "out").html
    pixels, requests = open_in_chromium(chromium, html, tmp_path)
    assert pixels.shape[:2] == (WINDOW[1], WINDOW[0])
    assert pixels[..., :3].std() > 0.05  # not a blank page
    assert len(np.unique(pixels[..., :3].reshape(-1, 3), axis=0)) > 50  # text, tables and a figure
    assert all(url.startswith(("file:", "data:")) for url in requests), requests

    # the same check sees a page that does fetch something
    leaky = tmp_path / "leaky.html"
    leaky.write_text('<html><body><h1>x</h1><img src="http://example.invalid/x.png"></body></html>')
    _, requests = open_in_chromium(chromium, leaky, tmp_path)
    assert requests == ["http://example.invalid/x.png"]
