"""ChartQA-style family: bar, line and pie charts with labelled values, drawn with PIL.

Values are printed on the chart (above bars and points, inside slices and in the pie legend), so
every question is answerable by reading; answers are computed from the same ``categories`` and
``values`` that are drawn.
"""

from __future__ import annotations

import math
import random
from typing import Any

from PIL import Image, ImageDraw

from mmvsd.data.image_families import (
    CANVAS_SIZE,
    DrawnItem,
    draw_text,
    fit_font_size,
    font,
    join_words,
    light_color,
    new_canvas,
    text_width,
)
from mmvsd.errors import UserError

CHART_TYPES = ("bar", "line", "pie")
MAX_CATEGORIES = 8
CHART_COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40),
                (148, 103, 189), (140, 86, 75), (227, 119, 194), (23, 160, 180)]
AXIS_COLOR, GRID_COLOR = (40, 40, 40), (205, 205, 205)

# (noun, title, categories, ordered): ordered categories keep their order on the axis.
BAR_THEMES = [
    ("day", "Visitors per day", ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"], True),
    ("fruit", "Fruit sold at the market", ["apples", "bananas", "cherries", "grapes", "lemons", "mangoes",
                                           "oranges", "pears"], False),
    ("pet", "Favorite pets in the class", ["cats", "dogs", "birds", "fish", "rabbits", "hamsters"], False),
    ("sport", "Favorite sports", ["soccer", "tennis", "swimming", "hockey", "cycling", "golf"], False),
    ("city", "Rainy days per year", ["Paris", "London", "Tokyo", "Cairo", "Lima", "Oslo", "Delhi"], False),
    ("year", "Cars sold (thousands)", [str(y) for y in range(2016, 2024)], True),
]
LINE_TITLES = ["Company revenue (million $)", "Students enrolled", "Average rainfall (mm)",
               "Tickets sold (thousands)", "Website visitors (thousands)"]
PIE_THEMES = [
    ("fruit", "Fruit sales by type", BAR_THEMES[1][2], False),
    ("pet", "Favorite pets in the class", BAR_THEMES[2][2], False),
    ("sport", "Favorite sports", BAR_THEMES[3][2], False),
    ("city", "Tourists by destination", BAR_THEMES[4][2], False),
    ("way", "How students get to school", ["bus", "car", "bike", "walking", "train"], False),
]


# ----------------------------------------------------------------------------- sampling


def _pie_percentages(rng: random.Random, count: int) -> list[int]:
    """Distinct integer percentages, each >= 5, summing to exactly 100 (largest remainder)."""
    while True:
        weights = [rng.randint(5, 40) for _ in range(count)]
        shares = [100 * w / sum(weights) for w in weights]
        values = [math.floor(s) for s in shares]
        by_remainder = sorted(range(count), key=lambda i: (values[i] - shares[i], i))
        for i in by_remainder[:100 - sum(values)]:
            values[i] += 1
        if len(set(values)) == count and min(values) >= 5:
            return values


def sample_chart(rng: random.Random) -> dict[str, Any]:
    """Random chart parameters plus the question asked about it."""
    chart_type = rng.choice(CHART_TYPES)
    if chart_type == "line":
        count = rng.randint(4, 6)
        start = rng.randint(2005, 2018)
        noun, title, categories = "year", rng.choice(LINE_TITLES), [str(start + i) for i in range(count)]
        values = rng.sample(range(5, 96), count)
    else:
        noun, title, pool, ordered = rng.choice(PIE_THEMES if chart_type == "pie" else BAR_THEMES)
        count = rng.randint(3, 5) if chart_type == "pie" else rng.randint(3, min(6, len(pool)))
        picked = sorted(rng.sample(range(len(pool)), count))
        categories = [pool[i] for i in picked]
        if not ordered:
            rng.shuffle(categories)
        values = _pie_percentages(rng, count) if chart_type == "pie" else rng.sample(range(5, 96), count)
    params: dict[str, Any] = {"chart_type": chart_type, "title": title, "noun": noun, "categories": categories,
                              "values": values, "background": light_color(rng, 240)}
    if chart_type == "bar":
        params["orientation"] = rng.choice(["vertical", "horizontal"])
        if not _vertical_labels_fit(categories):
            params["orientation"] = "horizontal"
        params["colors"] = [list(rng.choice(CHART_COLORS))]
    else:
        params["colors"] = [list(c) for c in rng.sample(CHART_COLORS, len(CHART_COLORS))][:max(count, 1)]
    second = "sum" if chart_type == "pie" else "diff"
    params["question_type"] = rng.choice(["value", "max", "min", second])
    num_targets = {"value": 1, "max": 0, "min": 0}.get(params["question_type"], 2)
    params["targets"] = rng.sample(categories, num_targets)
    return params


# ----------------------------------------------------------------------------- questions and answers


def format_number(value: float) -> str:
    """'35' for whole numbers, '2.5' otherwise."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def chart_question(params: dict[str, Any]) -> str:
    """The question text for a chart's question type and targets."""
    kind, noun, targets = params["chart_type"], params["noun"], params["targets"]
    qtype = params["question_type"]
    if qtype in ("max", "min"):
        words = ("largest share", "smallest share") if kind == "pie" else ("highest value", "lowest value")
        return f"Which {noun} has the {words[0] if qtype == 'max' else words[1]}?"
    if qtype == "value":
        return {"bar": f"What is the value of the {targets[0]} bar?", "line": f"What was the value in {targets[0]}?",
                "pie": f"What percentage does {targets[0]} account for?"}[kind]
    if qtype == "sum":
        return f"What is the combined percentage of {targets[0]} and {targets[1]}?"
    preposition = "in" if kind == "line" else "of"
    return f"What is the difference between the values {preposition} {targets[0]} and {targets[1]}?"


def chart_answer(params: dict[str, Any]) -> str:
    """The lower-case answer, computed from the drawn categories and values."""
    value_of = dict(zip(params["categories"], params["values"]))
    qtype, targets = params["question_type"], params["targets"]
    if qtype in ("max", "min"):
        pick = max if qtype == "max" else min
        return pick(params["categories"], key=value_of.__getitem__).lower()
    if qtype == "value":
        return format_number(value_of[targets[0]])
    if qtype == "sum":
        return format_number(value_of[targets[0]] + value_of[targets[1]])
    return format_number(abs(value_of[targets[0]] - value_of[targets[1]]))


def describe_chart(params: dict[str, Any]) -> str:
    """One or two sentences naming the chart, its title and every labelled value."""
    unit = "%" if params["chart_type"] == "pie" else ""
    pairs = [f"{c} {format_number(v)}{unit}" for c, v in zip(params["categories"], params["values"])]
    kind = {"bar": f"{params.get('orientation', 'vertical')} bar chart", "line": "line chart", "pie": "pie chart"}
    return f"A {kind[params['chart_type']]} titled '{params['title']}'. It shows {join_words(pairs)}."


# ----------------------------------------------------------------------------- rendering


def _vertical_labels_fit(categories: list[str]) -> bool:
    slot = (CANVAS_SIZE - 56) / max(len(categories), 1)
    return max(text_width(c, 16) for c in categories) <= slot - 4


def _nice_axis_max(value: float) -> float:
    """Smallest 4 * step >= value with step in {1, 2, 2.5, 5} x 10^k."""
    raw = max(value, 1e-9) / 4
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(f * magnitude for f in (1, 2, 2.5, 5, 10) if f * magnitude >= raw)
    return 4 * step


def check_chart_params(params: dict[str, Any]) -> None:
    """Raise UserError for chart parameters that cannot be drawn."""
    categories, values = params.get("categories", []), params.get("values", [])
    if params.get("chart_type") not in CHART_TYPES:
        raise UserError(f"unknown chart type {params.get('chart_type')!r}; choose one of {', '.join(CHART_TYPES)}")
    if not categories:
        raise UserError("a chart needs at least one category")
    if len(categories) > MAX_CATEGORIES:
        raise UserError(f"a chart fits at most {MAX_CATEGORIES} categories, got {len(categories)}")
    if len(values) != len(categories):
        raise UserError(f"got {len(values)} values for {len(categories)} categories")
    if any(not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or math.isnan(v) for v in values):
        raise UserError(f"chart values must be non-negative numbers, got {values}")
    if params["chart_type"] == "pie" and sum(values) <= 0:
        raise UserError("a pie chart needs at least one positive value")
    if params["chart_type"] == "bar" and params.get("orientation", "vertical") not in ("vertical", "horizontal"):
        raise UserError(f"bar orientation must be 'vertical' or 'horizontal', got {params.get('orientation')!r}")


def _labelled(draw: ImageDraw.ImageDraw, xy: tuple[float, float], text: str, anchor: str,
              background: tuple[int, ...]) -> None:
    """Bold value label on a small box of the background colour, so lines never cross it."""
    box = draw.textbbox(xy, text, font=font(16, True), anchor=anchor)
    draw.rectangle((box[0] - 2, box[1] - 2, box[2] + 2, box[3] + 2), fill=background)
    draw_text(draw, xy, text, 16, (0, 0, 0), bold=True, anchor=anchor)


def _draw_value_axis(draw: ImageDraw.ImageDraw, box: tuple[int, int, int, int], axis_max: float) -> None:
    left, top, right, bottom = box
    for i in range(5):
        y = bottom - i * (bottom - top) / 4
        draw.line((left, y, right, y), fill=GRID_COLOR, width=1)
        draw_text(draw, (left - 5, y), format_number(axis_max * i / 4), 15, AXIS_COLOR, anchor="rm")
    draw.line((left, top, left, bottom), fill=AXIS_COLOR, width=2)
    draw.line((left, bottom, right, bottom), fill=AXIS_COLOR, width=2)


def _draw_bar(draw: ImageDraw.ImageDraw, params: dict[str, Any], background: tuple[int, ...]) -> None:
    categories, values, color = params["categories"], params["values"], tuple(params["colors"][0])
    axis_max = _nice_axis_max(max(values))
    if params.get("orientation", "vertical") == "vertical":
        left, top, right, bottom = 48, 60, CANVAS_SIZE - 10, 290
        _draw_value_axis(draw, (left, top, right, bottom), axis_max)
        slot = (right - left) / len(categories)
        for i, (category, value) in enumerate(zip(categories, values)):
            cx, y = left + (i + 0.5) * slot, bottom - value / axis_max * (bottom - top)
            draw.rectangle((cx - slot * 0.3, y, cx + slot * 0.3, bottom - 1), fill=color)
            _labelled(draw, (cx, y - 3), format_number(value), "md", background)
            draw_text(draw, (cx, bottom + 7), category, 16, AXIS_COLOR, anchor="mt")
        return
    label_width = max(text_width(c, 16) for c in categories)
    left, top, right, bottom = int(label_width) + 18, 52, CANVAS_SIZE - 46, CANVAS_SIZE - 12
    slot = (bottom - top) / len(categories)
    for i, (category, value) in enumerate(zip(categories, values)):
        cy, x = top + (i + 0.5) * slot, left + value / max(values + [1e-9]) * (right - left)
        half = min(slot * 0.3, 18)
        draw.rectangle((left, cy - half, x, cy + half), fill=color)
        _labelled(draw, (x + 6, cy), format_number(value), "lm", background)
        draw_text(draw, (left - 8, cy), category, 16, AXIS_COLOR, anchor="rm")
    draw.line((left, top, left, bottom), fill=AXIS_COLOR, width=2)


def _draw_line(draw: ImageDraw.ImageDraw, params: dict[str, Any], background: tuple[int, ...]) -> None:
    categories, values, color = params["categories"], params["values"], tuple(params["colors"][0])
    left, top, right, bottom = 48, 66, CANVAS_SIZE - 10, 290
    axis_max = _nice_axis_max(max(values))
    _draw_value_axis(draw, (left, top, right, bottom), axis_max)
    slot = (right - left) / len(categories)
    points = [(left + (i + 0.5) * slot, bottom - v / axis_max * (bottom - top)) for i, v in enumerate(values)]
    if len(points) > 1:
        draw.line(points, fill=color, width=3)
    for (x, y), category, value in zip(points, categories, values):
        draw.ellipse((x - 5, y - 5, x + 5, y + 5), fill=color)
        _labelled(draw, (x, y - 9), format_number(value), "md", background)
        draw_text(draw, (x, bottom + 7), category, 15, AXIS_COLOR, anchor="mt")


def _draw_pie(draw: ImageDraw.ImageDraw, params: dict[str, Any]) -> None:
    categories, values, colors = params["categories"], params["values"], params["colors"]
    total, (cx, cy), radius = sum(values), (CANVAS_SIZE / 2, 146), 92
    start = -90.0
    for i, value in enumerate(values):
        extent = value / total * 360
        color = tuple(colors[i % len(colors)])
        draw.pieslice((cx - radius, cy - radius, cx + radius, cy + radius), start, start + extent,
                      fill=color, outline=(255, 255, 255), width=2)
        if value / total >= 0.08:
            middle = math.radians(start + extent / 2)
            xy = (cx + 0.62 * radius * math.cos(middle), cy + 0.62 * radius * math.sin(middle))
            draw_text(draw, xy, f"{format_number(round(100 * value / total, 1))}%", 16, (255, 255, 255), bold=True)
        start += extent
    for i, (category, value) in enumerate(zip(categories, values)):
        x, y = 16 + (i % 2) * 162, 256 + (i // 2) * 25
        draw.rectangle((x, y - 7, x + 14, y + 7), fill=tuple(colors[i % len(colors)]))
        draw_text(draw, (x + 20, y), f"{category} {format_number(round(100 * value / total, 1))}%", 15,
                  AXIS_COLOR, anchor="lm")


def render_chart(params: dict[str, Any]) -> Image.Image:
    """Render a bar, line or pie chart from its parameters; UserError if they cannot be drawn."""
    check_chart_params(params)
    background = tuple(params.get("background", (255, 255, 255)))
    image, draw = new_canvas(background)
    title_size = fit_font_size(params["title"], CANVAS_SIZE - 16, 20)
    draw_text(draw, (CANVAS_SIZE / 2, 22), params["title"], title_size, (0, 0, 0), bold=True)
    if params["chart_type"] == "bar":
        _draw_bar(draw, params, background)
    elif params["chart_type"] == "line":
        _draw_line(draw, params, background)
    else:
        _draw_pie(draw, params)
    return image


def chartqa_item(rng: random.Random, index: int) -> DrawnItem:
    """A ChartQA-style chart with a value, extreme, difference or sum question."""
    params = sample_chart(rng)
    return DrawnItem(render_chart(params), chart_question(params), chart_answer(params),
                     describe_chart(params), params)
