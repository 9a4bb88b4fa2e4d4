#!/usr/bin/env python3
"""Draws the performance guide's plots (docs/assets/*.svg) from the tables in bench/RESULTS.md.

    python3 scripts/plots.py           # (re)write the SVGs
    python3 scripts/plots.py --check   # exit 1 if an SVG differs from what RESULTS.md gives (CI)

Plain SVG written by hand (no plotting library), so that the docs build needs nothing but this
file and Python 3, and the output is byte-for-byte reproducible.
"""
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "RESULTS.md"
ASSETS = ROOT / "docs" / "assets"
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]


def table(text, heading, nth=0):
    """Rows (dicts by column name) of the nth markdown table under the section titled `heading`."""
    start = text.index(heading)
    nxt = re.search(r"^## ", text[start + len(heading):], re.M)
    section = text[start: start + len(heading) + (nxt.start() if nxt else len(text))]
    tables = re.findall(r"((?:^\|.*\|\n)+)", section + "\n", re.M)
    lines = [l.strip().strip("|").split("|") for l in tables[nth].strip().splitlines()]
    head = [h.strip() for h in lines[0]]
    return [dict(zip(head, (c.strip() for c in row))) for row in lines[2:]]


def num(cell):
    """`37.7 (39.1)` -> 37.7 (best time, median in brackets); empty -> None."""
    m = re.match(r"[-+]?[0-9.]+", cell)
    return float(m.group()) if m else None


class Svg:
    def __init__(self, w, h):
        self.w, self.h, self.parts = w, h, []

    def add(self, s):
        self.parts.append(s)

    def text(self, x, y, s, size=12, anchor="middle", weight="normal", rotate=None):
        rot = f' transform="rotate({rotate} {x:.1f} {y:.1f})"' if rotate is not None else ""
        s = s.replace("&", "&amp;").replace("<", "&lt;")
        self.add(f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
                 f'font-weight="{weight}"{rot}>{s}</text>')

    def line(self, x1, y1, x2, y2, color="#000", width=1, dash=None):
        d = f' stroke-dasharray="{dash}"' if dash else ""
        self.add(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{color}" '
                 f'stroke-width="{width}"{d}/>')

    def rect(self, x, y, w, h, color):
        self.add(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{color}"/>')

    def legend(self, x, y, names, styles=None):
        """Swatches: a square per name, or with styles [(color, dashed)] a line."""
        for i, name in enumerate(names):
            if styles:
                color, dashed = styles[i]
                self.line(x, y + 18 * i - 3, x + 14, y + 18 * i - 3, color, 2, "4,2" if dashed else None)
            else:
                self.rect(x, y + 18 * i - 9, 12, 12, COLORS[i])
            self.text(x + 20, y + 18 * i + 1, name, anchor="start")

    def render(self):
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.w}" height="{self.h}" '
                f'viewBox="0 0 {self.w} {self.h}" font-family="sans-serif">\n'
                f'<rect width="{self.w}" height="{self.h}" fill="#fff"/>\n' + "\n".join(self.parts) + "\n</svg>\n")


def bars(title, subtitle, groups, series, values, ylabel, ref=None):
    """Grouped vertical bars: values[g][s] (None = not measured), optional dashed line at `ref`."""
    w, h, left, right, top, bottom = 760, 420, 70, 190, 60, 90
    svg = Svg(w, h)
    svg.text(w / 2, 24, title, size=16, weight="bold")
    svg.text(w / 2, 44, subtitle, size=11)
    ymax = max(v for row in values for v in row if v is not None) * 1.15
    pw, ph = w - left - right, h - top - bottom
    y = lambda v: top + ph * (1 - v / ymax)
    step = 10 ** math.floor(math.log10(ymax / 2))
    ticks = [i * step for i in range(0, int(ymax / step) + 1)]
    if len(ticks) > 8:
        ticks = ticks[::2]
    for t in ticks:
        svg.line(left, y(t), left + pw, y(t), color="#ddd")
        svg.text(left - 6, y(t) + 4, f"{t:g}", anchor="end", size=11)
    svg.text(18, top + ph / 2, ylabel, rotate=-90)
    gw = pw / len(groups)
    bw = gw * 0.8 / len(series)
    for gi, g in enumerate(groups):
        x0 = left + gi * gw + gw * 0.1
        for si, v in enumerate(values[gi]):
            if v is not None:
                svg.rect(x0 + si * bw, y(v), bw - 2, y(0) - y(v), COLORS[si])
                svg.text(x0 + si * bw + bw / 2 - 1, y(v) - 3, f"{v:g}", size=9)
        for li, part in enumerate(g.split("\n")):
            svg.text(left + gi * gw + gw / 2, top + ph + 16 + 13 * li, part, size=11)
    if ref is not None:
        svg.line(left, y(ref), left + pw, y(ref), color="#333", dash="5,4")
    svg.line(left, top + ph, left + pw, top + ph)
    svg.line(left, top, left, top + ph)
    svg.legend(left + pw + 20, top + 10, series)
    return svg.render()


def lines(title, subtitle, xs, series, ylabel, xlabel):
    """One line per series over xs (log-log): series = [(name, [y...], color, dashed?)]."""
    w, h, left, right, top, bottom = 760, 420, 80, 220, 60, 60
    svg = Svg(w, h)
    svg.text(w / 2, 24, title, size=16, weight="bold")
    svg.text(w / 2, 44, subtitle, size=11)
    pw, ph = w - left - right, h - top - bottom
    ys = [v for _, vals, _, _ in series for v in vals]
    lo, hi = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
    x = lambda v: left + pw * (math.log2(v) - math.log2(xs[0])) / (math.log2(xs[-1]) - math.log2(xs[0]))
    y = lambda v: top + ph * (1 - (math.log10(v) - lo) / (hi - lo))
    for e in range(lo, hi + 1):
        for m in (1, 2, 5):
            v = m * 10 ** e
            if 10 ** lo <= v <= 10 ** hi:
                svg.line(left, y(v), left + pw, y(v), color="#ddd" if m == 1 else "#f0f0f0")
                svg.text(left - 6, y(v) + 4, f"{v:g}", anchor="end", size=11)
    for v in xs:
        svg.line(x(v), top, x(v), top + ph, color="#eee")
        svg.text(x(v), top + ph + 18, str(v), size=11)
    svg.text(left + pw / 2, h - 14, xlabel)
    svg.text(18, top + ph / 2, ylabel, rotate=-90)
    for name, vals, color, dashed in series:
        pts = " ".join(f"{x(a):.1f},{y(b):.1f}" for a, b in zip(xs, vals))
        d = ' stroke-dasharray="6,4"' if dashed else ""
        svg.add(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"{d}/>')
        for a, b in zip(xs, vals):
            svg.add(f'<circle cx="{x(a):.1f}" cy="{y(b):.1f}" r="3" fill="{color}"/>')
    svg.line(left, top + ph, left + pw, top + ph)
    svg.line(left, top, left, top + ph)
    svg.legend(left + pw + 20, top + 10, [s[0] for s in series], [(s[2], s[3]) for s in series])
    return svg.render()


def cpu_vs_xla(text):
    """One panel per mask: ours (solid) and XLA (dashed), forward and forward + backward."""
    rows = table(text, "## Host (CPU)\n")
    xs = sorted({int(r["S"]) for r in rows})
    out = {}
    for mask in ("none", "causal"):
        series = []
        for side, col in (("exla_rs", "ours ms"), ("XLA", "XLA ms")):
            for pi, p in enumerate(("fwd", "fwd+bwd")):
                pick = lambda s: next(r[col] for r in rows if int(r["S"]) == s and r["mask"] == mask and r["pass"] == p)
                series.append((f"{side} {p}", [num(pick(s)) for s in xs], COLORS[pi], side == "XLA"))
        out[f"cpu_vs_xla_{mask}.svg"] = lines(
            f"CPU: exla_rs vs XLA's attention ({'causal' if mask == 'causal' else 'no mask'})",
            "f32, B=1 H=8 D=64, best time; 2-core Xeon (AVX-512), 2026-11-21 (bench/RESULTS.md)",
            xs, series, "time (ms, log scale)", "sequence length S")
    return out


def cpu_vs_pytorch(text):
    rows = table(text, "## Host (CPU) against PyTorch", 0)
    groups = [f"D{r['D']} {r['dtype']}\n{r['mask']}" for r in rows]
    values = [[num(r["fwd ratio"]), num(r["fwd+bwd ratio"])] for r in rows]
    return bars(
        "CPU: PyTorch SDPA time / exla_rs time (above 1: exla_rs faster)",
        "S=2048 B=1 H=8, 2 threads; Xeon Sapphire Rapids (AMX for PyTorch bf16), 2026-11-25",
        groups, ["forward", "forward + backward"], values, "PyTorch time / ours", ref=1.0)


def gpu_h200(text):
    # The last GPU check's benchmark table (bench_cuda.py --quick), one shape of it.
    rows = table(text, "## GPU check on an NVIDIA H200, 2026-11-28", nth=2)
    rows = [r for r in rows if (r["D"], r["causal"], r["S"]) == ("128", "False", "4096")]
    short = {"exla_rs mma.sync (EXLA_RS_CUDA_PATH=mma)": "exla_rs\nmma.sync", "exla_rs sm90 (EXLA_RS_CUDA_PATH=sm90)": "exla_rs\nsm90",
             "cuDNN (jax)": "jax\ncuDNN", "PyTorch FLASH (FA2)": "PyTorch\nFA2", "PyTorch cuDNN": "PyTorch\ncuDNN"}
    groups = [short.get(r["implementation"], r["implementation"]) for r in rows]
    values = [[num(r["fwd TFLOP/s"]), num(r["bwd TFLOP/s"])] for r in rows]
    return bars(
        "GPU: attention throughput on an H200 (higher is better)",
        "bf16, B=4 S=4096 H=16 D=128, not causal; H200, 2026-11-28 (bench/RESULTS.md); sm90's backward is the mma.sync one",
        groups, ["forward", "backward"], values, "TFLOP/s")


def main():
    check = "--check" in sys.argv[1:]
    text = RESULTS.read_text()
    files = dict(cpu_vs_xla(text))
    files["cpu_vs_pytorch.svg"] = cpu_vs_pytorch(text)
    files["gpu_h200.svg"] = gpu_h200(text)
    stale = []
    for name, svg in files.items():
        path = ASSETS / name
        if check:
            if not path.exists() or path.read_text() != svg:
                stale.append(name)
        else:
            ASSETS.mkdir(parents=True, exist_ok=True)
            path.write_text(svg)
            print(f"wrote {path.relative_to(ROOT)}")
    if check:
        if stale:
            print(f"plots.py --check: {', '.join(stale)} differ from bench/RESULTS.md: run scripts/plots.py")
            sys.exit(1)
        print(f"1 passed, 0 failed ({len(files)} plots match bench/RESULTS.md)")


if __name__ == "__main__":
    main()
