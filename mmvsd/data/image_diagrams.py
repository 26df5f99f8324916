"""AI2D-style family: labelled science diagrams (life cycles with arrows, numbered plant parts,
numbered Earth layers) with four-option multiple-choice questions and letter answers.

The arrow direction of a life cycle and the numbering of parts are random, so answers have to be
read from the diagram; they are computed from the same ``stages`` / ``labels`` that are drawn.
"""

from __future__ import annotations

import math
import random
from typing import Any

from PIL import Image, ImageDraw

from mmvsd.data.image_families import (
    CANVAS_SIZE,
    DrawnItem,
    draw_arrow,
    draw_text,
    join_words,
    light_color,
    multiple_choice,
    new_canvas,
    text_width,
)
from mmvsd.errors import UserError

LIFE_CYCLES = {
    "frog": ["egg", "tadpole", "froglet", "adult frog"],
    "butterfly": ["egg", "caterpillar", "pupa", "butterfly"],
    "plant": ["seed", "sprout", "seedling", "adult plant"],
    "chicken": ["egg", "chick", "hen"],
    "mosquito": ["egg", "larva", "pupa", "adult"],
}
PLANT_PARTS = ("flower", "stem", "leaf", "roots")
EARTH_LAYERS = ("crust", "mantle", "outer core", "inner core")
EARTH_COLORS = [(120, 85, 60), (225, 115, 45), (245, 175, 50), (255, 232, 120)]
EARTH_RADII = [118, 108, 66, 34]  # outer radius of each layer, outermost first
BOX_COLORS = [(255, 240, 200), (215, 235, 255), (220, 245, 220), (245, 225, 245)]
INK = (30, 30, 30)


# ----------------------------------------------------------------------------- life cycles


def _stage_boxes(params: dict[str, Any]) -> list[tuple[float, float, float, float]]:
    """Centre and half-size of each stage box, placed around an ellipse in drawing order."""
    stages, count = params["stages"], len(params["stages"])
    step = 2 * math.pi / count * (1 if params["clockwise"] else -1)
    boxes = []
    for i, stage in enumerate(stages):
        angle = params["offset"] + i * step
        half_w, half_h = text_width(stage, 17) / 2 + 9, 16
        x = min(max(168 + 108 * math.cos(angle), half_w + 4), CANVAS_SIZE - half_w - 4)
        boxes.append((x, 192 + 102 * math.sin(angle), half_w, half_h))
    return boxes


def _outside(point: tuple[float, float], box: tuple[float, float, float, float], margin: float = 6) -> bool:
    x, y = point
    return abs(x - box[0]) > box[2] + margin or abs(y - box[1]) > box[3] + margin


def render_life_cycle(params: dict[str, Any]) -> Image.Image:
    """Stages in boxes around a loop, joined by curved arrows in the cycle's direction."""
    if len(params["stages"]) < 2:
        raise UserError("a life cycle needs at least two stages")
    image, draw = new_canvas(params["background"])
    draw_text(draw, (CANVAS_SIZE / 2, 24), params["title"], 21, INK, bold=True)
    boxes, count = _stage_boxes(params), len(params["stages"])
    step = 2 * math.pi / count * (1 if params["clockwise"] else -1)
    for i in range(count):
        start = params["offset"] + i * step
        arc = [(168 + 108 * math.cos(start + t * step / 80), 192 + 102 * math.sin(start + t * step / 80))
               for t in range(81)]
        arc = [p for p in arc if _outside(p, boxes[i]) and _outside(p, boxes[(i + 1) % count])]
        if len(arc) >= 2:
            draw_arrow(draw, arc, tuple(params["arrow_color"]), width=4, head=14)
    for (x, y, half_w, half_h), stage in zip(boxes, params["stages"]):
        draw.rounded_rectangle((x - half_w, y - half_h, x + half_w, y + half_h), radius=8,
                               fill=tuple(params["box_color"]), outline=INK, width=2)
        draw_text(draw, (x, y), stage, 17, INK)
    return image


def _life_cycle_item(rng: random.Random) -> DrawnItem:
    organism = rng.choice(sorted(LIFE_CYCLES))
    stages = LIFE_CYCLES[organism]
    params: dict[str, Any] = {
        "diagram": "life_cycle", "organism": organism, "stages": stages, "title": f"Life cycle of a {organism}",
        "clockwise": rng.random() < 0.5, "offset": round(rng.uniform(0, 2 * math.pi), 4),
        "box_color": list(rng.choice(BOX_COLORS)), "arrow_color": [rng.randint(0, 90) for _ in range(3)],
        "background": light_color(rng, 238), "question_type": rng.choice(["after", "before", "count"]),
    }
    extra = sorted({s for cycle in LIFE_CYCLES.values() for s in cycle} - set(stages))
    if params["question_type"] == "count":
        question = "How many stages are shown in this life cycle?"
        options, answer = multiple_choice(rng, str(len(stages)), [str(n) for n in range(2, 7)], 4)
    else:
        target = rng.choice(stages)
        shift = 1 if params["question_type"] == "after" else -1
        correct = stages[(stages.index(target) + shift) % len(stages)]
        params["target"] = target
        question = f"In this life cycle, which stage comes {params['question_type']} the {target}?"
        distractors = [s for s in stages if s != correct]
        options, answer = multiple_choice(rng, correct, distractors + rng.sample(extra, 4 - len(stages)), 4)
    arrows = " -> ".join(stages + stages[:1])
    description = (f"A diagram titled '{params['title']}' with {len(stages)} stages in boxes joined by "
                   f"{'clockwise' if params['clockwise'] else 'counter-clockwise'} arrows: {arrows}.")
    return DrawnItem(render_life_cycle(params), question, answer, description, params, options)


# ----------------------------------------------------------------------------- numbered parts


def _draw_label(draw: ImageDraw.ImageDraw, label_xy: tuple[float, float], anchor_xy: tuple[float, float],
                number: int) -> None:
    """A numbered circle at ``label_xy`` with a leader line to the labelled point."""
    draw.line((label_xy, anchor_xy), fill=INK, width=2)
    draw.ellipse((anchor_xy[0] - 4, anchor_xy[1] - 4, anchor_xy[0] + 4, anchor_xy[1] + 4), fill=INK)
    x, y = label_xy
    draw.ellipse((x - 15, y - 15, x + 15, y + 15), fill=(255, 255, 255), outline=INK, width=2)
    draw_text(draw, (x, y), str(number), 18, INK, bold=True)


def _plant_anchors(params: dict[str, Any]) -> dict[str, tuple[float, float, float]]:
    """(anchor x, anchor y, label x) of each plant part; ``side`` mirrors the layout."""
    s, cx, dy = params["side"], 168 + params["dx"], params["dy"]
    return {"flower": (cx + s * 26, 96 + dy, 168 + s * 135), "stem": (cx, 150 + dy, 168 - s * 135),
            "leaf": (cx + s * 40, 205 + dy, 168 + s * 135), "roots": (cx - s * 22, 276 + dy, 168 - s * 135)}


def _draw_plant(draw: ImageDraw.ImageDraw, params: dict[str, Any]) -> None:
    s, cx, dy = params["side"], 168 + params["dx"], params["dy"]
    ground = 248 + dy
    draw.rectangle((0, ground, CANVAS_SIZE, CANVAS_SIZE), fill=(150, 110, 70))
    for end in [(cx - 45, ground + 50), (cx, ground + 70), (cx + 40, ground + 48), (cx - s * 22, ground + 28)]:
        draw.line(((cx, ground), end), fill=(245, 232, 200), width=5)
    draw.line(((cx, ground), (cx, 96 + dy)), fill=(50, 140, 50), width=9)
    for leaf_x, leaf_y in [(cx - s * 40, 185 + dy), (cx + s * 40, 205 + dy)]:
        draw.ellipse((leaf_x - 36, leaf_y - 14, leaf_x + 36, leaf_y + 14), fill=(70, 170, 60))
    petal = tuple(params["petal_color"])
    for k in range(6):
        a = k * math.pi / 3
        px, py = cx + 21 * math.cos(a), 96 + dy + 21 * math.sin(a)
        draw.ellipse((px - 15, py - 15, px + 15, py + 15), fill=petal)
    draw.ellipse((cx - 11, 85 + dy, cx + 11, 107 + dy), fill=(250, 210, 40))


def _draw_earth(draw: ImageDraw.ImageDraw, params: dict[str, Any]) -> dict[str, tuple[float, float, float]]:
    cx, cy, s = 168, 190, params["side"]
    for radius, color in zip(EARTH_RADII, EARTH_COLORS):
        draw.ellipse((cx - radius, cy - radius, cx + radius, cy + radius), fill=color, outline=INK)
    # (distance from the centre, angle in degrees, side) per layer; labels on one side are >= 60 px apart
    spots = [(113, -40, -s), (88, -31, s), (50, 30, -s), (23, 60, s)]
    return {layer: (cx + side * r * math.cos(math.radians(a)), cy + r * math.sin(math.radians(a)), 168 + side * 146)
            for layer, (r, a, side) in zip(EARTH_LAYERS, spots)}


def render_labelled_diagram(params: dict[str, Any]) -> Image.Image:
    """A plant or the Earth's layers with numbered labels and leader lines."""
    image, draw = new_canvas(params["background"])
    draw_text(draw, (CANVAS_SIZE / 2, 24), params["title"], 21, INK, bold=True)
    if params["diagram"] == "plant":
        _draw_plant(draw, params)
        anchors = _plant_anchors(params)
    elif params["diagram"] == "earth":
        anchors = _draw_earth(draw, params)
    else:
        raise UserError(f"unknown labelled diagram {params['diagram']!r}; choose 'plant' or 'earth'")
    for part, number in params["labels"].items():
        x, y, label_x = anchors[part]
        _draw_label(draw, (label_x, y), (x, y), number)
    return image


def _labelled_item(rng: random.Random) -> DrawnItem:
    diagram = rng.choice(["plant", "earth"])
    parts = PLANT_PARTS if diagram == "plant" else EARTH_LAYERS
    numbers = rng.sample(range(1, 5), 4)
    params: dict[str, Any] = {
        "diagram": diagram, "title": "Parts of a plant" if diagram == "plant" else "Layers of the Earth",
        "labels": dict(zip(parts, numbers)), "side": rng.choice([-1, 1]), "dx": rng.randint(-8, 8),
        "dy": rng.randint(-6, 6), "petal_color": list(rng.choice([(230, 80, 120), (200, 60, 200), (240, 120, 40)])),
        "background": light_color(rng, 238), "question_type": rng.choice(["part_of_number", "number_of_part"]),
    }
    noun = "part of the plant" if diagram == "plant" else "layer of the Earth"
    target = rng.choice(parts)
    params["target"] = target
    if params["question_type"] == "part_of_number":
        question = f"Which {noun} is labelled {params['labels'][target]}?"
        options, answer = multiple_choice(rng, target, list(parts), 4)
    else:
        question = f"Which number labels the {target}?"
        options, answer = multiple_choice(rng, str(params["labels"][target]), ["1", "2", "3", "4"], 4)
    pairs = [f"{number} = {part}" for part, number in sorted(params["labels"].items(), key=lambda kv: kv[1])]
    description = f"A diagram titled '{params['title']}' with numbered labels: {join_words(pairs)}."
    return DrawnItem(render_labelled_diagram(params), question, answer, description, params, options)


def render_ai2d(params: dict[str, Any]) -> Image.Image:
    """Render any AI2D-style diagram from its parameters."""
    return render_life_cycle(params) if params.get("diagram") == "life_cycle" else render_labelled_diagram(params)


def ai2d_item(rng: random.Random, index: int) -> DrawnItem:
    """An AI2D-style diagram question: half life cycles, half numbered-part diagrams."""
    return _life_cycle_item(rng) if rng.random() < 0.5 else _labelled_item(rng)
