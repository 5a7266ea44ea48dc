"""Charts drawn server-side as inline SVG: no JavaScript, no CDN, readable without CSS.

Each function returns safe markup; every label goes through `escape`. Sizes are in SVG
user units and the SVG scales to its container (viewBox), so one drawing fits any screen.
"""
from django.utils.html import escape
from django.utils.safestring import mark_safe

PALETTE = ("#2563eb", "#16a34a", "#dc2626", "#9333ea", "#ea580c")


def line_chart(series: list[tuple[str, list[float]]], labels: list[str], *, title: str, unit: str = "",
               width: int = 720, height: int = 220) -> str:
    """Several series over the same x labels, one polyline each, with a legend and y scale."""
    pad_l, pad_r, pad_t, pad_b = 48, 12, 24, 28
    n = max((len(v) for _, v in series), default=0)
    top = max((max(v) for _, v in series if v), default=0) or 1.0
    w, h = width - pad_l - pad_r, height - pad_t - pad_b

    def xy(i, v):
        x = pad_l + (w * i / max(1, n - 1))
        y = pad_t + h - (h * v / top)
        return f"{x:.1f},{y:.1f}"

    parts = [f'<svg viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}" class="chart">',
             f'<title>{escape(title)}</title>',
             f'<line x1="{pad_l}" y1="{pad_t + h}" x2="{pad_l + w}" y2="{pad_t + h}" stroke="#999"/>',
             f'<text x="4" y="{pad_t + 4}" font-size="11">{top:.4g}{escape(unit)}</text>',
             f'<text x="4" y="{pad_t + h}" font-size="11">0</text>']
    for k, (name, values) in enumerate(series):
        color = PALETTE[k % len(PALETTE)]
        points = " ".join(xy(i, v) for i, v in enumerate(values))
        if points:
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{points}"/>')
        parts.append(f'<rect x="{pad_l + 150 * k}" y="6" width="10" height="10" fill="{color}"/>'
                     f'<text x="{pad_l + 150 * k + 14}" y="15" font-size="11">{escape(name)}</text>')
    if labels:
        parts.append(f'<text x="{pad_l}" y="{height - 8}" font-size="11">{escape(labels[0])}</text>')
        parts.append(f'<text x="{pad_l + w}" y="{height - 8}" font-size="11" text-anchor="end">'
                     f'{escape(labels[-1])}</text>')
    parts.append("</svg>")
    return mark_safe("".join(parts))


def bar_chart(rows: list[tuple[str, float]], *, title: str, unit: str = "", width: int = 720) -> str:
    """Horizontal bars, one per row, longest first as given."""
    bar, gap, label_w = 16, 6, 160
    height = max(1, len(rows)) * (bar + gap) + 8
    top = max((v for _, v in rows), default=0) or 1.0
    parts = [f'<svg viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}" class="chart">',
             f'<title>{escape(title)}</title>']
    for i, (name, value) in enumerate(rows):
        y = 4 + i * (bar + gap)
        length = (width - label_w - 90) * value / top
        parts.append(f'<text x="0" y="{y + 12}" font-size="11">{escape(name)}</text>'
                     f'<rect x="{label_w}" y="{y}" width="{length:.1f}" height="{bar}" fill="{PALETTE[0]}"/>'
                     f'<text x="{label_w + length + 4:.1f}" y="{y + 12}" font-size="11">{value:,.2f}{escape(unit)}'
                     f'</text>')
    parts.append("</svg>")
    return mark_safe("".join(parts))


def _heat(value: float | None) -> str:
    """0% -> pale blue, 100% -> deep red; no data -> grey."""
    if value is None:
        return "#e5e7eb"
    v = max(0.0, min(1.0, value / 100))
    r, g, b = int(219 + (185 - 219) * v), int(234 + (28 - 234) * v), int(254 + (28 - 254) * v)
    return f"#{r:02x}{g:02x}{b:02x}"


def heat_map(rows: list[tuple[str, list[float | None]]], *, title: str, cell: int = 10) -> str:
    """One row per node, one cell per GPU index, colored by utilization (percent)."""
    label_w = 120
    cols = max((len(v) for _, v in rows), default=0)
    width, height = label_w + cols * (cell + 1) + 4, len(rows) * (cell + 1) + 4
    parts = [f'<svg viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}" class="chart heat">',
             f'<title>{escape(title)}</title>']
    for i, (name, values) in enumerate(rows):
        y = 2 + i * (cell + 1)
        parts.append(f'<text x="0" y="{y + cell - 1}" font-size="{cell}">{escape(name)}</text>')
        for j, value in enumerate(values):
            parts.append(f'<rect x="{label_w + j * (cell + 1)}" y="{y}" width="{cell}" height="{cell}" '
                         f'fill="{_heat(value)}"/>')
    parts.append("</svg>")
    return mark_safe("".join(parts))
