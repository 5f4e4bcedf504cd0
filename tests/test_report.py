"""The HTML report on the demo's index: structure, self-containment, one code path for the demo,
`score --report` and `moe-attrib report`, the table fallback without matplotlib, and a real
headless-browser render (skipped when no Chromium is installed)."""

import base64
import contextlib
import html
import io
import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from moe_attrib.app.demo import run_demo
from tests.test_build import ENV

SECTIONS = ("top-examples", "experts", "routing")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "demo"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run_demo(out, steps=20, projection_dim=8, progress=False)
    records = [json.loads(line) for line in (out / "scores.jsonl").read_text().splitlines()]
    return out, printed.getvalue(), records


def query_chunks(page: str) -> dict[int, str]:
    """Each query section's HTML, by query id."""
    parts = page.split("<section class='query'")[1:]
    return {int(re.search(r"data-query='(\d+)'", p)[1]): p.split("</section>")[0] for p in parts}


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "moe_attrib", *map(str, args)], capture_output=True, text=True, env=ENV, timeout=600
    )


def test_demo_writes_the_report_and_says_where(demo):
    out, printed, records = demo
    assert f"report: {(out / 'report.html').resolve()}" in printed
    assert len(records) == 40 and all(len(r["results"]) == 3 for r in records)


def test_report_structure_on_the_demo_index(demo):
    out, _, records = demo
    page = (out / "report.html").read_text()
    for external in ("http://", "https://", 'src="//', "src='//", "<script", "<link", "@import"):
        assert external not in page, external
    chunks = query_chunks(page)
    assert sorted(chunks) == sorted(r["query"] for r in records)
    for record in records:
        chunk = chunks[record["query"]]
        assert html.escape(record["query_text"]) in chunk
        for section in SECTIONS:
            assert chunk.count(f"class='section {section}'") == 1, (record["query"], section)
        assert "section tokens" not in chunk  # the demo's index has one row per example
        assert chunk.count("<tr class='hit'>") == len(record["results"])
        for hit in record["results"]:
            assert html.escape(hit["text"]) in chunk and f"{hit['score']:+.3e}" in chunk
        images = re.findall(r'src="data:image/png;base64,([^"]+)"', chunk)
        assert len(images) == 2  # score by layer x expert, routing
        assert all(base64.b64decode(img)[:8] == b"\x89PNG\r\n\x1a\n" for img in images)


def test_report_command_shares_the_demo_code_path(demo, tmp_path):
    out, _, records = demo
    res = cli("report", "--index", out / "index", out / "scores.jsonl", "--out", tmp_path / "r.html")
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "r.html").read_bytes() == (out / "report.html").read_bytes()
    bad = tmp_path / "bad.jsonl"
    records[0]["results"][0]["example"] = 10_000
    bad.write_text("".join(json.dumps(r) + "\n" for r in records))
    res = cli("report", "--index", out / "index", bad, "--out", tmp_path / "x.html")
    assert res.returncode == 2 and "examples [10000] are not in the index" in res.stderr


def test_report_without_matplotlib_draws_tables(demo, tmp_path):
    out, _, records = demo
    code = (
        "import sys; sys.modules['matplotlib'] = None; from moe_attrib.app.cli import main; "
        f"sys.exit(main(['report', '--index', {str(out / 'index')!r}, {str(out / 'scores.jsonl')!r}, "
        f"'--out', {str(tmp_path / 't.html')!r}, '--top', '2']))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    page = (tmp_path / "t.html").read_text()
    assert "<img" not in page and "pip install 'moe-attrib[plot]'" in page
    for record in records:
        chunk = query_chunks(page)[record["query"]]
        assert chunk.count("<tr class='hit'>") == 2
        experts, routing = chunk.split("class='section experts'")[1].split("class='section routing'")
        assert 'class="heat"' in experts and 'class="heat"' in routing
        # routing table: the query's row and one per hit, each cell one expert of one layer
        layers = len(json.loads((out / "index" / "manifest.json").read_text())["expert_layers"])
        assert re.findall(r"<tr><th>([^<]*)</th><td", routing) == ["query", "#1", "#2"]
        assert routing.count("<td title=") == 3 * layers * np.asarray(record["query_expert_counts"]).shape[1]


def browser() -> str | None:
    return next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


@pytest.mark.skipif(browser() is None, reason="no Chromium/Chrome on PATH (apt-get install chromium)")
def test_report_renders_in_a_headless_browser(demo, tmp_path):
    from PIL import Image

    out, _, records = demo
    shot = tmp_path / "report.png"
    base = [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'profile'}"]  # fmt: skip
    url = (out / "report.html").resolve().as_uri()
    res = subprocess.run([*base, f"--screenshot={shot}", "--window-size=1280,1400", url],
                         capture_output=True, text=True, timeout=180)  # fmt: skip
    assert res.returncode == 0 and shot.exists(), res.stderr[-2000:]
    image = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    assert image.shape == (1400, 1280, 3)
    r, g, b = image[..., 0], image[..., 1], image[..., 2]
    assert (image.sum(-1) < 720).mean() > 0.05  # not blank: some 5% of the page is not white
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 100  # text, bars and figures, not a flat fill
    assert ((r > g + 60) & (r > b + 60)).sum() > 1000  # red score bars / heat map cells
    assert ((g > r + 40) & (g > b + 40)).sum() > 1000  # the green routing figure of the first query
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=180).stdout
    assert dom.count('<section class="query"') == len(records)
    assert dom.count("<img") == 2 * len(records)


@pytest.mark.skipif(browser() is None, reason="no Chromium/Chrome on PATH (apt-get install chromium)")
def test_report_fits_1280_pixels_without_sideways_scroll(demo, tmp_path):
    """Long unbroken lines (an index path, a training text without spaces) wrap inside the page: at a
    1280 px window the document is no wider than the window. Measured by Chromium itself, through
    a copy of the page whose script writes `scrollWidth` into the DOM."""
    from moe_attrib.app.report import render_report
    from moe_attrib.indexing.index import load_index

    out, _, _ = demo
    deep = tmp_path / ("a-long-directory-name-" * 8)
    deep.symlink_to(out / "index")
    records = [json.loads(line) for line in (out / "scores.jsonl").read_text().splitlines()]  # as written
    records[0]["results"][0]["text"] = "unbroken" * 80
    page = render_report(records, load_index(deep))
    probe = (
        "<script>window.addEventListener('load', () => { const m = document.createElement('div'); "
        "m.id = 'scroll-width'; m.textContent = document.documentElement.scrollWidth; "
        "document.body.appendChild(m); });</script></body>"
    )
    (tmp_path / "probe.html").write_text(page.replace("</body>", probe), encoding="utf-8")
    res = subprocess.run(
        [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1280,900",
         f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000", "--dump-dom",
         (tmp_path / "probe.html").as_uri()],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    width = re.search(r'<div id="scroll-width">(\d+)</div>', res.stdout)
    assert width is not None, res.stderr[-2000:]
    assert int(width[1]) <= 1280, width[1]


def test_routing_figure_labels_its_expert_columns():
    """The routing map numbers the experts of each layer along the bottom and names the layers on top."""
    pytest.importorskip("matplotlib")
    from moe_attrib.app.report import routing_figure

    shares = np.random.default_rng(0).random((3, 2 * 8))
    fig = routing_figure(shares, ["query", "#1", "#2"], ["L0", "L1"], 8)
    ax = fig.axes[0]
    bottom = [(t.get_position()[0], t.get_text()) for t in ax.get_xticklabels()]
    assert bottom == [(g * 8 + i, str(i)) for g in range(2) for i in range(8)]
    top = next(a for a in ax.child_axes)  # the secondary axis
    assert [t.get_text() for t in top.get_xticklabels()] == ["L0", "L1"]
    wide = routing_figure(np.zeros((1, 48 * 128)), ["query"], [f"L{i}" for i in range(48)], 128)
    assert 0 < len(wide.axes[0].get_xticks()) <= 64 * 2  # a big model's axis stays readable
