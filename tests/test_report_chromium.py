"""The HTML report rendered by a real headless Chromium: figures must show on screen."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from _training import train_mlp

import traintape
from traintape.analysis import write_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    url = str(root / "run")
    train_mlp(url, sizes=[16, 32, 32, 32, 4], act="tanh", steps=40, lr=0.1, full_every=10)
    out = root / "report.html"
    write_report(traintape.open_run(url), str(out))
    return url, out


def test_report_is_self_contained_and_escaped(tmp_path):
    url = str(tmp_path / "r")
    with traintape.Recorder(url, run_id='<script>alert("x")</script>&') as rec:
        for t in range(5):
            rec.record(t, "param", {"a/kernel": np.full((2, 2), t + 1.0, np.float32)})
            rec.record(t, "update", {"a/kernel": np.full((2, 2), 1.0, np.float32)})
            rec.record(t, "grad", {"a/kernel": np.full((2, 2), 0.5, np.float32)})
            rec.log(t, loss=1.0 / (t + 1))
    out = tmp_path / "r.html"
    write_report(traintape.open_run(url), str(out))
    text = out.read_text()
    assert "<script>alert" not in text
    # one script element, the report's own inline table sorting (no src: no network)
    assert text.count("<script") == 1 and "<script src" not in text
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;" in text
    assert 'src="http' not in text and "<link" not in text


def _saturated(img: np.ndarray) -> np.ndarray:
    rgb = img[..., :3].astype(np.float64)
    if rgb.max() > 1.0:
        rgb = rgb / 255.0
    mx, mn = rgb.max(axis=-1), rgb.min(axis=-1)
    return (mx - mn) > 0.25


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_report_renders_figures_in_chromium(report, tmp_path):
    import matplotlib.image as mpimg

    _, html_path = report
    shot = tmp_path / "shot.png"
    cmd = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1280,2000",
        "--hide-scrollbars", html_path.as_uri(),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=120, capture_output=True)
    img = mpimg.imread(str(shot))
    assert img.shape[0] == 2000 and img.shape[1] == 1280
    gray = img[..., :3].mean(axis=-1)
    assert gray.std() > 0.05, "the page rendered blank"
    sat = _saturated(img)
    # colour (figures: loss curve, viridis heatmaps, weight bands) covers a real area ...
    assert sat.mean() > 0.03, f"only {sat.mean():.4f} of the page is coloured: figures missing"
    # ... in several separate bands down the page (metrics, two heatmaps, weights)
    bands = sat.reshape(20, 100, -1).mean(axis=(1, 2))
    assert (bands > 0.02).sum() >= 4, bands
    # the heatmap is many distinct colours, not one flat block
    colours = {tuple(c) for c in (img[sat][:, :3] * 31).astype(int)}
    assert len(colours) > 50
