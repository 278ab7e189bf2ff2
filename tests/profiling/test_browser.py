"""The HTML report as a person sees it: loaded in a real headless Chromium, it runs its
script without an error and shows the tables, the roofline and the graphs."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch
from torch import nn

import opweave

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Chromium is not installed: `make browser` installs it "
                             "(Debian's chromium package)")


def _chromium(*args: str) -> subprocess.CompletedProcess:
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
               "--disable-extensions", "--enable-logging=stderr", "--v=0", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 14 * 14, 10)).eval()
    x = torch.randn(1, 3, 16, 16)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = opweave.compile(model, (x,))
    prof = opweave.profile(compiled, [x], runs=2, warmup=1)
    return prof.write_html(tmp_path_factory.mktemp("report") / "report.html")


def test_the_report_loads_without_errors_and_shows_its_parts(report):
    done = _chromium("--dump-dom", report.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert 'data-ready="1"' in dom, "the page's script did not run to its end"
    errors = re.search(r'<pre id="errors">(.*?)</pre>', dom, re.S)
    assert errors is not None and errors.group(1).strip() == "", errors and errors.group(1)
    console = [line for line in done.stderr.splitlines()
               if "CONSOLE" in line and ("Uncaught" in line or "error" in line.lower())]
    assert not console, console
    for part in ('id="steps"', 'id="lines"', 'id="modules"', 'id="roofline"', "<circle",
                 'class="graph"', "Before rewriting", "fusion groups coloured"):
        assert part in dom, part
    rows = re.search(r'<table id="steps">.*?<tbody>(.*?)</tbody>', dom, re.S).group(1)
    assert rows.count("<tr>") >= 3


def test_the_report_renders_to_a_screenshot(report, tmp_path):
    shot = tmp_path / "report.png"
    done = _chromium("--window-size=1280,1600", f"--screenshot={shot}", report.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # not a blank page
