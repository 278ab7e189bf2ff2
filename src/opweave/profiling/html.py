"""The profile as one self-contained HTML file: no server, no network, no script from
elsewhere. Tables (sortable by a click on a column), the roofline plot and the graphs
are drawn here, in Python, as HTML and SVG; the page's own script only sorts tables and
reports any error it meets into the page (`#errors`), which the browser test reads."""
from __future__ import annotations

import colorsys
import html
import math
from pathlib import Path

from ..files import atomic_write
from ..ir import provenance
from ..ir.outline import OutlineNode, outline
from .record import KINDS
from .report import header

MAX_DRAWN = 1500  # graph nodes drawn; a larger graph is cut, and says so

STYLE = """
body{font:14px system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ccc}
table{border-collapse:collapse;margin:8px 0;font-size:13px}
th,td{padding:3px 8px;border-bottom:1px solid #eee;text-align:left;vertical-align:top}
th{cursor:pointer;background:#f4f4f4;position:sticky;top:0}td.n{text-align:right;
font-variant-numeric:tabular-nums}
.scroll{max-height:520px;overflow:auto;border:1px solid #ddd}
pre{background:#f8f8f8;padding:8px;overflow:auto;font-size:12px}
pre .hit{background:#ffe9a8}.muted{color:#777}.bar{background:#4a90d9;height:10px}
#errors{color:#b00}#errors:empty{display:none}svg text{font:11px monospace}
"""

SCRIPT = """
window.addEventListener('error', function (e) {
  var box = document.getElementById('errors');
  box.textContent += 'script error: ' + e.message + '\\n';
});
function sortTable(th) {
  var table = th.closest('table'), body = table.tBodies[0];
  var index = Array.prototype.indexOf.call(th.parentNode.children, th);
  var descending = th.dataset.order !== 'desc';
  th.dataset.order = descending ? 'desc' : 'asc';
  var rows = Array.prototype.slice.call(body.rows);
  rows.sort(function (a, b) {
    var x = a.cells[index].dataset.v || a.cells[index].textContent;
    var y = b.cells[index].dataset.v || b.cells[index].textContent;
    var nx = parseFloat(x), ny = parseFloat(y);
    var c = (!isNaN(nx) && !isNaN(ny)) ? nx - ny : x.localeCompare(y);
    return descending ? -c : c;
  });
  rows.forEach(function (r) { body.appendChild(r); });
}
document.querySelectorAll('th').forEach(function (th) {
  th.addEventListener('click', function () { sortTable(th); });
});
document.body.dataset.ready = '1';
"""


def _e(text) -> str:
    return html.escape(str(text))


def _table(table_id: str, columns: list[str], rows: list[list], numeric: set[int]) -> str:
    head = "".join(f"<th>{_e(c)}</th>" for c in columns)
    body = []
    for row in rows:
        cells = []
        for i, value in enumerate(row):
            if i in numeric:
                cells.append(f'<td class="n" data-v="{value:.9g}">{value:.3f}</td>'
                             if isinstance(value, float) else f'<td class="n">{_e(value)}</td>')
            else:
                cells.append(f"<td>{_e(value)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (f'<div class="scroll"><table id="{table_id}"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>')


def _site_table(prof) -> str:
    rows = []
    by_label = {s.label: s for s in prof.recording.sites}
    for row in prof.levels.sites:
        site = by_label[row.key]
        roof = prof.roofs.get(site.index)
        lines = sorted({provenance.parse(n.source).location for n in site.nodes} - {""})
        rows.append([row.seconds * 1e3, row.share * 100, KINDS[site.kind], row.key,
                     roof.bound if roof and roof.bound else "-",
                     roof.achieved * 100 if roof and roof.bound else 0.0,
                     roof.gflops if roof else 0.0, roof.gbytes if roof else 0.0,
                     ", ".join(lines[:4]) + (" ..." if len(lines) > 4 else "")])
    return _table("steps", ["ms/call", "%", "kind", "step", "bound", "% of roof", "GFLOP/s",
                            "GB/s", "source lines"], rows, {0, 1, 5, 6, 7})


def _level_table(table_id: str, title: str, rows) -> str:
    return _table(table_id, ["ms/call", "%", title, "steps"],
                  [[r.seconds * 1e3, r.share * 100, r.key, r.sites] for r in rows], {0, 1, 3})


def _roofline_svg(prof) -> str:
    """Achieved GFLOP/s against arithmetic intensity, log-log, under the machine's roof;
    a dot per step that does arithmetic, its area by its share of the time."""
    m = prof.machine
    points = []
    by_index = {s.index: s for s in prof.recording.sites}
    for index, roof in prof.roofs.items():
        if roof.flops > 0 and roof.bytes > 0 and roof.seconds > 0:
            points.append((roof.flops / roof.bytes, roof.gflops, roof, by_index[index]))
    w, h, pad = 640, 380, 50
    x_lo, x_hi, y_lo = 1e-2, 1e3, 1e-2
    y_hi = m.flops / 1e9 * 2

    def sx(ai):
        return pad + (math.log10(max(ai, x_lo)) - math.log10(x_lo)) / \
            (math.log10(x_hi) - math.log10(x_lo)) * (w - 2 * pad)

    def sy(g):
        return h - pad - (math.log10(max(g, y_lo)) - math.log10(y_lo)) / \
            (math.log10(y_hi) - math.log10(y_lo)) * (h - 2 * pad)

    parts = [f'<svg id="roofline" width="{w}" height="{h}" xmlns="http://www.w3.org/2000/svg">',
             f'<rect x="{pad}" y="{pad}" width="{w - 2 * pad}" height="{h - 2 * pad}" '
             f'fill="none" stroke="#999"/>']
    ridge = m.flops / m.bandwidth
    roof = [(x_lo, x_lo * m.bandwidth / 1e9), (ridge, m.flops / 1e9), (x_hi, m.flops / 1e9)]
    parts.append('<polyline fill="none" stroke="#c33" stroke-width="2" points="' +
                 " ".join(f"{sx(a):.1f},{sy(g):.1f}" for a, g in roof) + '"/>')
    for decade in range(-2, 4):
        x = sx(10.0 ** decade)
        parts.append(f'<text x="{x:.0f}" y="{h - pad + 16}" text-anchor="middle">1e{decade}</text>')
    for decade in range(-2, int(math.log10(y_hi)) + 1):
        y = sy(10.0 ** decade)
        parts.append(f'<text x="{pad - 6}" y="{y:.0f}" text-anchor="end">1e{decade}</text>')
    parts.append(f'<text x="{w / 2}" y="{h - 8}" text-anchor="middle">FLOP per byte moved</text>')
    parts.append(f'<text x="14" y="{h / 2}" transform="rotate(-90 14 {h / 2})" '
                 f'text-anchor="middle">GFLOP/s</text>')
    total = prof.levels.total or 1.0
    for ai, gflops, roof_, site in points:
        r = 2 + 14 * math.sqrt(roof_.seconds / total)
        parts.append(f'<circle cx="{sx(ai):.1f}" cy="{sy(gflops):.1f}" r="{r:.1f}" '
                     f'fill="#4a90d9" fill-opacity="0.6"><title>{_e(site.label)}: '
                     f'{gflops:.1f} GFLOP/s, {ai:.2f} FLOP/B, {roof_.seconds * 1e3:.3f} ms'
                     f'</title></circle>')
    parts.append("</svg>")
    return "".join(parts)


def _layers(nodes: list[OutlineNode]) -> dict[str, tuple[int, int]]:
    """(layer, column) per node: the layer is the longest path from an input (a node
    reading only weights sits just above its first reader); columns follow the mean
    column of the node's producers, so chains stay straight."""
    depth: dict[str, int] = {}
    floating = {n.name for n in nodes if not n.inputs and n.op != "input"}
    for n in nodes:
        depth[n.name] = 1 + max((depth[i] for i in n.inputs if i in depth and i not in floating),
                                default=-1)
    readers: dict[str, list[int]] = {}
    for n in nodes:
        for i in n.inputs:
            readers.setdefault(i, []).append(depth[n.name])
    for name in floating:
        depth[name] = max(0, min(readers.get(name, [1])) - 1)
    by_layer: dict[int, list[OutlineNode]] = {}
    for n in nodes:
        by_layer.setdefault(depth[n.name], []).append(n)
    where: dict[str, tuple[int, int]] = {}
    for layer in sorted(by_layer):
        members = by_layer[layer]
        wish = {n.name: sum(where[i][1] for i in n.inputs if i in where) /
                max(1, sum(1 for i in n.inputs if i in where)) for n in members}
        for column, n in enumerate(sorted(members, key=lambda n: wish[n.name])):
            where[n.name] = (layer, column)
    return where


def _graph_svg(svg_id: str, nodes: list[OutlineNode], colour: dict[str, str]) -> str:
    cut = len(nodes) > MAX_DRAWN
    nodes = nodes[:MAX_DRAWN]
    where = _layers(nodes)
    bw, bh, gx, gy = 150, 22, 16, 44
    width = (max((c for _, c in where.values()), default=0) + 1) * (bw + gx) + gx
    height = (max((r for r, _ in where.values()), default=0) + 1) * gy + gy

    def box(name):
        layer, column = where[name]
        return gx + column * (bw + gx), gy / 2 + layer * gy

    parts = [f'<svg id="{svg_id}" class="graph" width="{width}" height="{height}" '
             f'xmlns="http://www.w3.org/2000/svg">']
    for n in nodes:
        x, y = box(n.name)
        for i in n.inputs:
            if i in where:
                px, py = box(i)
                parts.append(f'<line x1="{px + bw / 2:.0f}" y1="{py + bh:.0f}" '
                             f'x2="{x + bw / 2:.0f}" y2="{y:.0f}" stroke="#bbb"/>')
    for n in nodes:
        x, y = box(n.name)
        where_from = provenance.parse(n.source)
        tip = f"%{n.name} = {n.op}: {n.type}" + (f"\n{where_from.location}" if where_from.location else "") \
            + (f"\nmodule {where_from.module}" if where_from.module else "")
        parts.append(f'<g><title>{_e(tip)}</title><rect x="{x:.0f}" y="{y:.0f}" width="{bw}" '
                     f'height="{bh}" rx="4" fill="{colour.get(n.name, "#eee")}" stroke="#666"/>'
                     f'<text x="{x + 6:.0f}" y="{y + 15:.0f}">{_e(n.op[:20])}</text></g>')
    parts.append("</svg>")
    note = f'<p class="muted">the first {MAX_DRAWN} nodes are drawn</p>' if cut else ""
    return note + '<div class="scroll">' + "".join(parts) + "</div>"


def _group_colours(prof, graph_name: str) -> dict[str, str]:
    """A colour per fused group (a step computing several nodes); single ops grey."""
    colours: dict[str, str] = {}
    groups = [s for s in prof.recording.sites if s.graph == graph_name and len(s.nodes) > 1]
    for k, site in enumerate(groups):
        r, g, b = colorsys.hls_to_rgb((k * 0.618034) % 1.0, 0.78, 0.65)
        colour = f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"
        for n in site.nodes:
            colours[n.outputs[0].name] = colour
    return colours


def _schedule(prof, graph_name: str) -> str:
    """The graph's steps in the order they run, each with its share of a call."""
    rows = []
    total = prof.levels.total or 1.0
    for site in prof.recording.sites:
        if site.graph != graph_name or site.kind == "runtime":
            continue
        seconds = prof.recording.site_seconds(site)
        bar = f'<div class="bar" style="width:{max(1, 300 * seconds / total):.0f}px"></div>'
        rows.append(f'<tr><td class="n">{site.index}</td><td>{_e(KINDS[site.kind])}</td>'
                    f'<td>{_e(site.name)}</td><td class="n" data-v="{seconds:.9g}">'
                    f'{seconds * 1e3:.3f}</td><td>{bar}</td></tr>')
    return ('<div class="scroll"><table class="schedule"><thead><tr><th>order</th><th>kind</th>'
            '<th>step</th><th>ms/call</th><th>share</th></tr></thead><tbody>' + "".join(rows) +
            "</tbody></table></div>")


def _alone(compiled) -> str:
    """Every node that runs as a step of its own, and why fusion left it alone."""
    lowered = getattr(compiled.executor, "lowered", None)
    part = getattr(lowered, "partition", None)
    if part is None:
        return '<p class="muted">fusion is off for this graph: every op runs alone</p>'
    rows = [[f"%{s.nodes[0].outputs[0].name}", s.nodes[0].op, part.why_alone(s.nodes[0])]
            for s in lowered.steps if len(s.nodes) == 1 and s.kind == "op"]
    return _table(f"alone-{compiled.graph.name}", ["value", "op", "why it runs alone"], rows, set())


def _kernels(prof, graph_name: str) -> str:
    out = []
    for site in prof.recording.sites:
        src = site.kernel
        if site.graph != graph_name or src is None:
            continue
        lines = src.body.splitlines()
        hits = {line: n for n, line in getattr(src, "node_lines", {}).items() if line}
        text = []
        for i, line in enumerate(lines, 1):
            node = hits.get(i)
            if node is not None:
                where = provenance.parse(node.source)
                note = f"  // %{node.outputs[0].name} = {node.op}" + \
                       (f" <- {where.location}" if where.location else "")
                text.append(f'<span class="hit">{_e(line)}{_e(note)}</span>')
            else:
                text.append(_e(line))
        seconds = prof.recording.site_seconds(site)
        out.append(f"<details><summary>{_e(site.label)}: {seconds * 1e3:.3f} ms/call</summary>"
                   f"<pre>{chr(10).join(text)}</pre></details>")
    return "".join(out) or '<p class="muted">no generated kernels in this graph</p>'


def render(prof) -> str:
    lv = prof.levels
    body = [f"<h1>opweave profile: {_e(prof.name)}</h1>", '<pre id="errors"></pre>',
            "<p>" + "<br>".join(_e(line) for line in header(prof)) + "</p>",
            "<p>Each level's rows add up to the measured total. A step that computes several "
            "IR nodes splits its time over them by their share of its FLOPs (of its bytes "
            "where it does no arithmetic); the runtime between steps is a row of its own.</p>",
            "<h2>Steps</h2>", _site_table(prof),
            "<h2>Source lines</h2>", _level_table("lines", "source line", lv.lines),
            "<h2>Modules</h2>", _level_table("modules", "module", lv.modules),
            "<h2>Frontend nodes</h2>", _level_table("frontend", "ATen / ONNX node", lv.frontend),
            "<h2>IR nodes</h2>", _level_table("nodes", "IR node", lv.nodes),
            "<h2>Roofline</h2>",
            "<p>Each dot is a step that does arithmetic; its area is its share of the call. "
            "The red line is the machine's roof.</p>", _roofline_svg(prof)]
    for compiled in prof.recording.graphs:
        name = compiled.graph.name
        after = outline(compiled.graph)
        body += [f"<h2>Graph {_e(name)}</h2>",
                 f"<h3>Before rewriting ({len(compiled.input_outline)} nodes)</h3>",
                 _graph_svg(f"before-{name}", compiled.input_outline, {}),
                 f"<h3>After rewriting, fusion groups coloured ({len(after)} nodes)</h3>",
                 _graph_svg(f"after-{name}", after, _group_colours(prof, name)),
                 "<h3>Schedule</h3>", _schedule(prof, name),
                 "<h3>Nodes fusion left alone</h3>", _alone(compiled),
                 "<h3>Generated kernels</h3>", _kernels(prof, name)]
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>opweave profile: "
            f"{_e(prof.name)}</title><style>{STYLE}</style></head><body>" + "\n".join(body) +
            f"<script>{SCRIPT}</script></body></html>")


def write_html(prof, path: Path) -> Path:
    text = render(prof)
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return path
