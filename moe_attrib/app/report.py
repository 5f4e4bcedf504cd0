"""Reading score results: the terminal view (`moe-attrib show`) and the static HTML report
(`moe-attrib report`, `score --report`).

The report is one self-contained file (no URL, no script): per query, the top training examples
with score bars, the score split by layer and by expert, the routing of the query and its hits
and, for a token index, each token's share of the score. Figures come from matplotlib (the `plot`
extra) as inline PNG; without matplotlib the same matrices are drawn as coloured HTML tables.
"""

from __future__ import annotations

import base64
import html
import io
import re
import shutil
from pathlib import Path

import numpy as np

from moe_attrib.app.info import format_summary, summarize
from moe_attrib.indexing.index import Index
from moe_attrib.outputs import write_text

_EXPERT_KEY = re.compile(r"^(?P<layer>.+)\.expert_(?P<i>\d+)$")
_BLOCKS = " ▏▎▍▌▋▊▉█"


def short_name(name: str) -> str:
    """`model.layers.3.mlp.experts.expert_5` -> `L3.e5`; names outside numbered layers are kept."""
    m = re.search(r"layers\.(\d+)", name)
    if not m:
        return name
    e = re.search(r"expert_(\d+)$", name)
    return f"L{m[1]}" + (f".e{e[1]}" if e else "")


def _bar(fraction: float, width: int) -> str:
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    return ("█" * (eighths // 8) + (_BLOCKS[eighths % 8] if eighths % 8 else "")).ljust(width)


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _one_line(text: str | None) -> str:
    """Text on one terminal line: whitespace runs become one space, and control characters (terminal
    escape sequences in training text) are shown as `\\xNN` instead of acting on the terminal."""
    flat = " ".join((text or "(no text: pretokenized)").split())
    return _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}", flat)


def show_text(records: list[dict], top: int = 5, experts: int = 3, width: int | None = None) -> str:
    """Each query with its top training examples: rank, score, a bar scaled to the query's best
    |score|, example id and text; with per-module parts, the hit's largest per-expert parts."""
    width = width or shutil.get_terminal_size((120, 20)).columns
    out = []
    for record in records:
        qid = f" [{record['query_id']}]" if "query_id" in record else ""
        out.append(f"query {record['query']}{qid}: {_one_line(record['query_text'])}"[:width])
        hits = record["results"][:top]
        scale = max((abs(h["score"]) for h in hits), default=0.0) or 1.0
        for hit in hits:
            ident = f"[{hit['id']}] " if "id" in hit else ""
            token = f" token {hit['token']}" if "token" in hit else ""
            head = f"  {hit['rank']:>3}  {hit['score']:+.3e}  {_bar(abs(hit['score']) / scale, 10)}  "
            head += f"#{hit['example']}{token} {ident}"
            out.append((head + _one_line(hit.get("text")))[:width])
            parts = (hit.get("per_module") or {}).get("experts") or {}
            if parts and experts:
                largest = sorted(parts.items(), key=lambda kv: -abs(kv[1]))[:experts]
                out.append(" " * 18 + "experts: " + ", ".join(f"{short_name(k)} {v:+.2e}" for k, v in largest))
        out.append("")
    return "\n".join(out)


# -- HTML ------------------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,sans-serif;margin:24px auto;padding:0 16px;color:#222;max-width:1200px}
h1{font-size:22px} h2{font-size:17px;margin-top:32px;border-top:1px solid #ccc;padding-top:12px;overflow-wrap:anywhere}
h3{font-size:14px;margin:14px 0 6px}
pre.summary{background:#f6f6f6;padding:8px;font-size:12px;white-space:pre-wrap;overflow-wrap:anywhere}
table.hits{border-collapse:collapse;width:100%;font-size:13px;table-layout:fixed} .hits td,.hits th{padding:3px 6px;
border-bottom:1px solid #eee;vertical-align:top;text-align:left} .num{font-family:monospace;white-space:nowrap}
.hits col.rank{width:3em} .hits col.score{width:7.5em} .hits col.bar{width:160px}
.bar{height:12px;min-width:1px} .pos{background:#d6604d} .neg{background:#4393c3}
.text{max-height:5em;overflow:auto;overflow-wrap:anywhere} .meta{color:#777;font-size:11px;overflow-wrap:anywhere}
.wide{overflow-x:auto;max-width:100%}
table.heat{border-collapse:collapse;font-size:10px} .heat td{width:18px;height:14px;text-align:center}
.heat th{font-weight:normal;padding:0 4px;white-space:nowrap} .note{color:#777;font-style:italic;font-size:12px}
.tok{border-radius:2px} .tok.hit{outline:2px solid #000} p.example{overflow-wrap:anywhere}
nav{display:flex;flex-wrap:wrap;gap:4px 8px} nav a{font-size:12px}
img{max-width:100%;height:auto}
"""


def _plotting() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _png(fig) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=72)
    return f'<img alt="figure" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def _colour(value: float, scale: float, signed: bool) -> str:
    a = 0.0 if scale == 0 else min(1.0, abs(value) / scale)
    rgb = "214,96,77" if value >= 0 or not signed else "67,147,195"
    return f"rgba({rgb},{a:.3f})"


def _table(matrix: np.ndarray, rows: list[str], cols: list[str], signed: bool) -> str:
    """A matrix as an HTML table of coloured cells (the figure when matplotlib is missing)."""
    scale = float(np.abs(matrix).max()) if matrix.size else 0.0
    head = "<tr><th></th>" + "".join(f"<th>{html.escape(c)}</th>" for c in cols) + "</tr>"
    body = "".join(
        f"<tr><th>{html.escape(r)}</th>"
        + "".join(f'<td title="{v:+.3e}" style="background:{_colour(v, scale, signed)}"></td>' for v in row)
        + "</tr>"
        for r, row in zip(rows, matrix, strict=True)
    )
    return f'<div class="wide"><table class="heat">{head}{body}</table></div>'


def _expert_matrix(hits: list[dict], layers: list[str]) -> tuple[np.ndarray, dict[str, float]]:
    """Per-expert parts summed over the hits `[layers, E]`, and per-layer totals (any module)."""
    cells: dict[tuple[str, int], float] = {}
    totals: dict[str, float] = {}
    for hit in hits:
        for key, value in hit["per_module"]["experts"].items():
            m = _EXPERT_KEY.match(key)
            if m:
                cells[m["layer"], int(m["i"])] = cells.get((m["layer"], int(m["i"])), 0.0) + value
        for key, value in hit["per_module"]["layers"].items():
            totals[key] = totals.get(key, 0.0) + value
    names = layers or sorted({layer for layer, _ in cells})
    width = max((i for _, i in cells), default=-1) + 1
    matrix = np.zeros((len(names), width))
    for (layer, i), value in cells.items():
        if layer in names:
            matrix[names.index(layer), i] = value
    return matrix, totals


def _experts_section(hits: list[dict], layers: list[str], plots: bool) -> str:
    if not hits or not all("per_module" in h for h in hits):
        return "<p class='note'>No per-module parts in these results: score with --per_module for this view.</p>"
    matrix, totals = _expert_matrix(hits, layers)
    names = [short_name(n) for n in (layers or [])] or [f"layer {i}" for i in range(matrix.shape[0])]
    total_labels = [short_name(k) for k in totals]
    if not plots:
        parts = _table(matrix, names, [str(i) for i in range(matrix.shape[1])], True) if matrix.size else ""
        return parts + _table(np.array([[v] for v in totals.values()]), total_labels, ["total"], True)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 0.45 * max(len(names), len(totals) * 0.6, 4) + 1), layout="constrained")
    ax, bx = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    if matrix.size:
        lim = float(np.abs(matrix).max()) or 1.0
        im = ax.imshow(matrix, cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest")
        ax.set_yticks(range(len(names)), names)
        ax.set_xlabel("expert")
        ax.set_title(f"experts' parts of the score (top {len(hits)} summed)", fontsize=10)
        fig.colorbar(im, ax=ax, fraction=0.05)
    else:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no per-expert blocks in this index", ha="center")
    values = list(totals.values())
    bx.barh(range(len(values)), values, color=["#d6604d" if v >= 0 else "#4393c3" for v in values])
    bx.set_yticks(range(len(values)), total_labels, fontsize=8)
    bx.invert_yaxis()
    bx.axvline(0, color="#444", lw=0.5)
    bx.set_title("by layer / module", fontsize=10)
    return _png(fig)


def _routing_section(record: dict, hits: list[dict], index: Index, plots: bool) -> str:
    layers = index.manifest.get("expert_layers") or []
    if not layers:
        return "<p class='note'>This index records no routing (built without --track_moe_experts).</p>"
    position = {int(e): p for p, e in enumerate(index.manifest["example_ids"])}
    rows, labels = [], []
    if "query_expert_counts" in record:
        rows.append(np.asarray(record["query_expert_counts"], dtype=np.float64))
        labels.append("query")
    for hit in hits:
        rows.append(np.asarray(index.expert_counts[position[hit["example"]]], dtype=np.float64))
        labels.append(f"#{hit['rank']}")
    counts = np.stack(rows)  # [rows, layers, E]
    share = counts / np.maximum(counts.sum(-1, keepdims=True), 1e-30)
    flat = share.reshape(len(rows), -1)
    num_e = counts.shape[2]
    note = "" if "query_expert_counts" in record else "<p class='note'>The results carry no query routing.</p>"
    caption = "<p class='meta'>share of each layer's routed tokens that go to each expert</p>"
    if not plots:
        cols = [f"{short_name(layer)}.e{i}" for layer in layers for i in range(num_e)]
        return note + caption + _table(flat, labels, cols, False)
    return note + _png(routing_figure(flat, labels, [short_name(n) for n in layers], num_e))


def routing_figure(shares: np.ndarray, rows: list[str], layers: list[str], num_experts: int):
    """The routing map: `shares` `[rows, layers * num_experts]`, one row per query / hit (`rows`), the
    experts of each layer side by side; the bottom axis numbers the experts (every one up to 64
    columns in all, else every k-th: some 64 numbers, at least one per layer), the top axis names the layers."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 0.3 * len(rows) + 1.6), layout="constrained")
    ax = fig.subplots()
    im = ax.imshow(shares, cmap="Greens", vmin=0, aspect="auto", interpolation="nearest")
    ax.set_yticks(range(len(rows)), rows)
    step = max(1, -(-num_experts * len(layers) // 64))
    experts = [i for i in range(num_experts) if i % step == 0]
    ax.set_xticks([g * num_experts + i for g in range(len(layers)) for i in experts],
                  [str(i) for _ in layers for i in experts], fontsize=7)  # fmt: skip
    ax.set_xlabel("expert (within each layer)", fontsize=8)
    top = ax.secondary_xaxis("top")
    top.set_xticks([g * num_experts + (num_experts - 1) / 2 for g in range(len(layers))], layers)
    top.tick_params(length=0, labelsize=8)
    for i in range(1, len(layers)):
        ax.axvline(i * num_experts - 0.5, color="#333", lw=0.8)
    ax.set_title("routing: share of each layer's tokens per expert", fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.03)
    return fig


def _token_spans(hit: dict, marked: set[int]) -> str:
    scores = np.asarray(hit["token_scores"], dtype=np.float64)
    scale = float(np.abs(scores).max()) or 1.0
    total = float(np.abs(scores).sum()) or 1.0
    spans = []
    for t, (piece, value) in enumerate(zip(hit["tokens"], scores, strict=True)):
        cls = "tok hit" if t in marked else "tok"
        spans.append(
            f'<span class="{cls}" title="token {t}: {value:+.3e} ({value / total:+.1%})" '
            f'style="background:{_colour(value, scale, True)}">{html.escape(piece)}</span>'
        )
    return "".join(spans)


def _tokens_section(hits: list[dict]) -> str:
    marked: dict[int, set[int]] = {}
    first: dict[int, dict] = {}
    for hit in hits:
        if "token_scores" in hit:
            first.setdefault(hit["example"], hit)
            marked.setdefault(hit["example"], set()).add(hit.get("token"))
    if not first:
        return "<p class='note'>These results carry no token scores: score the token index with `moe-attrib score`.</p>"
    out = [
        f"<p class='example'><span class='meta'>example #{ex} (hit tokens {sorted(marked[ex] - {None})})</span><br>"
        f"{_token_spans(hit, marked[ex])}</p>"
        for ex, hit in first.items()
    ]
    legend = "<p class='meta'>red: the token's share raises the score, blue: lowers it; outlined: the hit token</p>"
    return legend + "".join(out)


def _hits_table(hits: list[dict]) -> str:
    scale = max((abs(h["score"]) for h in hits), default=0.0) or 1.0
    rows = []
    for hit in hits:
        fields = {"id": hit["id"]} if "id" in hit else hit.get("fields") or {}
        ident = ", ".join(f"{k}={v}" for k, v in fields.items())
        token = f" token {hit['token']}" if "token" in hit else ""
        bar = f'<div class="bar {"pos" if hit["score"] >= 0 else "neg"}" style="width:{abs(hit["score"]) / scale:.1%}">'
        rows.append(
            f"<tr class='hit'><td class='num'>{hit['rank']}</td><td class='num'>{hit['score']:+.3e}</td>"
            f"<td>{bar}</div></td>"
            f"<td><div class='meta'>example #{hit['example']}{token} {html.escape(str(ident))}</div>"
            f"<div class='text'>{html.escape(hit.get('text') or '(no text: pretokenized)')}</div></td></tr>"
        )
    cols = "<colgroup><col class='rank'><col class='score'><col class='bar'><col></colgroup>"
    head = "<tr><th>rank</th><th>score</th><th></th><th>training example</th></tr>"
    return f"<table class='hits'>{cols}{head}{''.join(rows)}</table>"


def render_report(records: list[dict], index: Index, *, top: int | None = None, title: str | None = None) -> str:
    """The HTML text of the report for `records` (from `score_records` or `read_results`) over `index`."""
    plots = _plotting()
    layers = index.manifest.get("expert_layers") or []
    token_index = index.token_offsets is not None
    title = title or f"moe-attrib report: {len(records)} queries"
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>",
        f"<pre class='summary'>{html.escape(format_summary(summarize(index.path)))}</pre>",
    ]
    if not plots:
        parts.append("<p class='note'>matplotlib is not installed (pip install 'moe-attrib[plot]'): tables instead "
                     "of figures.</p>")  # fmt: skip
    parts.append("<nav>" + "".join(f"<a href='#q{r['query']}'>query {r['query']}</a>" for r in records) + "</nav>")
    for record in records:
        hits = record["results"][:top] if top else record["results"]
        qid = f" [{html.escape(str(record['query_id']))}]" if "query_id" in record else ""
        fields = ", ".join(f"{k}={v}" for k, v in (record.get("query_fields") or {}).items())
        parts.append(
            f"<section class='query' id='q{record['query']}' data-query='{record['query']}'>"
            f"<h2>Query {record['query']}{qid}: {html.escape(record['query_text'] or '(pretokenized)')}</h2>"
            + (f"<div class='meta'>{html.escape(fields)}</div>" if fields else "")
            + f"<div class='section top-examples'><h3>Top {len(hits)} training examples</h3>{_hits_table(hits)}</div>"
            + f"<div class='section experts'><h3>Score by layer and expert</h3>{_experts_section(hits, layers, plots)}"
            + "</div>"
            + f"<div class='section routing'><h3>Routing</h3>{_routing_section(record, hits, index, plots)}</div>"
        )
        if token_index:
            parts.append(f"<div class='section tokens'><h3>Token shares of the score</h3>{_tokens_section(hits)}</div>")
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(
    records: list[dict], index: Index, out: str | Path, *, top: int | None = None, title: str | None = None
) -> Path:
    """Write the self-contained HTML report (complete or not at all: `moe_attrib.outputs`); `score --report`
    and `moe-attrib report` both call this."""
    return write_text(out, render_report(records, index, top=top, title=title))
