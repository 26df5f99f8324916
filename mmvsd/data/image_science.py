"""ScienceQA-style family: multiple-choice science figures with letter answers.

Four figures: two bar magnets (attract or repel, from the facing poles), a balance with two blocks
(the heavier side hangs lower), a particle model (solid, liquid or gas) and a food chain whose
arrows point from the eaten to the eater. Block sizes and layout directions are random, so the
answer has to come from the physics or the arrows, never from position or size alone.
"""

from __future__ import annotations

import math
import random
from typing import Any

from PIL import Image, ImageDraw

from mmvsd.data.image_families import (
    CANVAS_SIZE,
    SHAPE_COLORS,
    DrawnItem,
    draw_arrow,
    draw_text,
    fit_font_size,
    light_color,
    multiple_choice,
    new_canvas,
    text_width,
)
from mmvsd.errors import UserError

INK = (30, 30, 30)
MAGNET_COLORS = [((210, 50, 50), (50, 90, 200)), ((120, 120, 120), (200, 160, 40)), ((60, 150, 90), (150, 80, 170))]
STATES = ("solid", "liquid", "gas")
FOOD_CHAINS = [
    ["grass", "grasshopper", "frog", "snake", "hawk"],
    ["phytoplankton", "krill", "penguin", "leopard seal"],
    ["seeds", "mouse", "snake", "owl"],
    ["grass", "rabbit", "fox"],
    ["leaves", "caterpillar", "sparrow", "hawk"],
    ["grass", "zebra", "lion"],
    ["algae", "tadpole", "fish", "heron"],
]
CONTAINER = (78, 86, 258, 306)  # left, top, right, bottom of the particle-model beaker


# ----------------------------------------------------------------------------- magnets


def _magnets_params(rng: random.Random) -> dict[str, Any]:
    north, south = rng.choice(MAGNET_COLORS)
    if rng.random() < 0.5:
        north, south = south, north
    return {"figure": "magnets", "left": rng.choice(["NS", "SN"]), "right": rng.choice(["NS", "SN"]),
            "length": rng.randint(104, 130), "height": rng.randint(44, 58), "gap": rng.randint(24, 60),
            "y": rng.randint(140, 220), "north_color": list(north), "south_color": list(south)}


def _draw_magnets(draw: ImageDraw.ImageDraw, params: dict[str, Any]) -> None:
    length, height, gap, y = params["length"], params["height"], params["gap"], params["y"]
    x = (CANVAS_SIZE - 2 * length - gap) / 2
    for poles in (params["left"], params["right"]):
        if poles not in ("NS", "SN"):
            raise UserError(f"magnet poles must be 'NS' or 'SN', got {poles!r}")
        for k, pole in enumerate(poles):
            x0 = x + k * length / 2
            color = tuple(params["north_color"] if pole == "N" else params["south_color"])
            draw.rectangle((x0, y - height / 2, x0 + length / 2, y + height / 2), fill=color, outline=INK, width=2)
            draw_text(draw, (x0 + length / 4, y), pole, 26, (255, 255, 255), bold=True)
        x += length + gap


def _magnets_facts(params: dict[str, Any]) -> tuple[str, tuple[str, ...], str, str]:
    facing = params["left"][1] + params["right"][0]
    correct = "repel" if facing[0] == facing[1] else "attract"
    description = (f"Two bar magnets side by side: the left one is {'-'.join(params['left'])} and the right one "
                   f"is {'-'.join(params['right'])} from left to right, so the facing poles are {facing[0]} and "
                   f"{facing[1]}.")
    return "Will these magnets attract or repel each other?", ("attract", "repel"), correct, description


# ----------------------------------------------------------------------------- balance


def _balance_params(rng: random.Random) -> dict[str, Any]:
    colors = rng.sample(sorted(SHAPE_COLORS), 2)
    return {"figure": "balance", "left_color": colors[0], "right_color": colors[1],
            "heavier": rng.choice(["left", "right"]), "tilt_degrees": rng.randint(8, 14),
            "left_size": rng.randint(32, 56), "right_size": rng.randint(32, 56), "pivot_y": rng.randint(120, 150)}


def _draw_balance(draw: ImageDraw.ImageDraw, params: dict[str, Any]) -> None:
    cx, py, half = CANVAS_SIZE / 2, params["pivot_y"], 118
    down = math.radians(params["tilt_degrees"]) * (1 if params["heavier"] == "right" else -1)
    draw.rectangle((cx - 60, 312, cx + 60, 322), fill=(110, 90, 70))
    draw.line(((cx, py), (cx, 312)), fill=(110, 90, 70), width=8)
    ends = [(cx - half * math.cos(down), py - half * math.sin(down)), (cx + half * math.cos(down),
                                                                        py + half * math.sin(down))]
    draw.line(ends, fill=INK, width=6)
    draw.polygon([(cx, py - 4), (cx - 12, py + 16), (cx + 12, py + 16)], fill=INK)
    for (ex, ey), side in zip(ends, ("left", "right")):
        pan_y = ey + 70
        draw.line(((ex, ey), (ex - 38, pan_y)), fill=INK, width=2)
        draw.line(((ex, ey), (ex + 38, pan_y)), fill=INK, width=2)
        draw.line(((ex - 44, pan_y), (ex + 44, pan_y)), fill=INK, width=5)
        size = params[f"{side}_size"]
        draw.rectangle((ex - size / 2, pan_y - 2 - size, ex + size / 2, pan_y - 2),
                       fill=SHAPE_COLORS[params[f"{side}_color"]], outline=INK)


def _balance_facts(params: dict[str, Any]) -> tuple[str, tuple[str, ...], str, str]:
    heavy = params[f"{params['heavier']}_color"]
    options = (f"the {params['left_color']} block", f"the {params['right_color']} block")
    description = (f"A balance with a {params['left_color']} block on the left pan and a {params['right_color']} "
                   f"block on the right pan; the {params['heavier']} side hangs lower.")
    return "Which block is heavier?", options, f"the {heavy} block", description


# ----------------------------------------------------------------------------- particle models


def _particles_params(rng: random.Random) -> dict[str, Any]:
    state, radius = rng.choice(STATES), rng.randint(9, 11)
    left, top, right, bottom = CONTAINER
    points: list[list[int]] = []
    if state == "solid":  # touching particles in a regular block
        cols, rows, spacing = rng.randint(4, 6), rng.randint(3, 5), 2 * radius
        x0 = (left + right) / 2 - (cols - 1) * spacing / 2 + rng.randint(-20, 20)
        points = [[round(x0 + c * spacing), bottom - 4 - radius - r * spacing]
                  for r in range(rows) for c in range(cols)]
    else:  # random positions: a dense irregular band at the bottom (liquid) or far apart everywhere (gas)
        liquid = state == "liquid"
        low = bottom - 4 - radius - rng.randint(2, 3) * (2 * radius + 2) if liquid else top + radius + 6
        min_distance = 2 * radius + 1 if liquid else 3.5 * radius
        target = 60 if liquid else rng.randint(8, 12)
        for _ in range(1500):
            x = rng.randint(left + radius + 4, right - radius - 4)
            y = rng.randint(low, bottom - radius - 4)
            if all(math.dist((x, y), p) > min_distance for p in points):
                points.append([x, y])
            if len(points) == target:
                break
    return {"figure": "particles", "state": state, "radius": radius, "particles": points,
            "particle_color": list(rng.choice(list(SHAPE_COLORS.values())))}


def _draw_particles(draw: ImageDraw.ImageDraw, params: dict[str, Any]) -> None:
    left, top, right, bottom = CONTAINER
    draw.line(((left, top), (left, bottom), (right, bottom), (right, top)), fill=INK, width=4)
    r = params["radius"]
    for x, y in params["particles"]:
        draw.ellipse((x - r, y - r, x + r, y + r), fill=tuple(params["particle_color"]), outline=INK)


def _particles_facts(params: dict[str, Any]) -> tuple[str, tuple[str, ...], str, str]:
    arrangement = {"solid": "packed tightly in a regular grid", "liquid": "close together but in no fixed pattern",
                   "gas": "spread far apart through the container"}[params["state"]]
    description = f"A particle model of a container with {len(params['particles'])} particles {arrangement}."
    return "Which state of matter does this particle model show?", STATES, params["state"], description


# ----------------------------------------------------------------------------- food chains


def _food_chain_params(rng: random.Random) -> dict[str, Any]:
    chain = rng.choice(FOOD_CHAINS)
    question_type = rng.choice(["producer", "eats", "eaten_by", "top"])
    target = None
    if question_type in ("eats", "eaten_by"):
        target = rng.choice(chain[1:] if question_type == "eats" else chain[:-1])
    return {"figure": "food_chain", "chain": chain, "direction": rng.choice(["up", "down"]),
            "box_color": list(light_color(rng, 200)), "dx": rng.randint(-30, 30),
            "question_type": question_type, "target": target}


def _draw_food_chain(draw: ImageDraw.ImageDraw, params: dict[str, Any]) -> None:
    chain, cx = params["chain"], CANVAS_SIZE / 2 + params["dx"]
    count = len(chain)
    ys = [70 + i * (240 / max(count - 1, 1)) for i in range(count)]
    if params["direction"] == "up":
        ys = ys[::-1]
    for i in range(count - 1):
        step = 1 if ys[i + 1] > ys[i] else -1
        draw_arrow(draw, [(cx, ys[i] + step * 19), (cx, ys[i + 1] - step * 19)], INK, width=4, head=12)
    for organism, y in zip(chain, ys):
        half = text_width(organism, 18) / 2 + 10
        draw.rounded_rectangle((cx - half, y - 16, cx + half, y + 16), radius=7,
                               fill=tuple(params["box_color"]), outline=INK, width=2)
        draw_text(draw, (cx, y), organism, 18, INK)


def _food_chain_facts(params: dict[str, Any]) -> tuple[str, tuple[str, ...], str, str]:
    chain, target, qtype = params["chain"], params["target"], params["question_type"]
    if qtype == "producer":
        question, correct = "Which organism is the producer in this food chain?", chain[0]
    elif qtype == "top":
        question, correct = "Which organism is at the top of this food chain?", chain[-1]
    elif qtype == "eats":
        question, correct = f"What does the {target} eat in this food chain?", chain[chain.index(target) - 1]
    else:
        question, correct = f"Which organism eats the {target} in this food chain?", chain[chain.index(target) + 1]
    description = f"A food chain with arrows pointing from food to eater: {' -> '.join(chain)}."
    return question, tuple(chain), correct, description


FIGURES = {"magnets": (_magnets_params, _draw_magnets, _magnets_facts),
           "balance": (_balance_params, _draw_balance, _balance_facts),
           "particles": (_particles_params, _draw_particles, _particles_facts),
           "food_chain": (_food_chain_params, _draw_food_chain, _food_chain_facts)}


def render_science_figure(params: dict[str, Any]) -> Image.Image:
    """Render a magnets, balance, particle-model or food-chain figure from its parameters."""
    if params.get("figure") not in FIGURES:
        raise UserError(f"unknown science figure {params.get('figure')!r}; choose one of {', '.join(FIGURES)}")
    image, draw = new_canvas(params["background"])
    if params.get("title"):
        draw_text(draw, (CANVAS_SIZE / 2, 26), params["title"], fit_font_size(params["title"], 320, 20), INK,
                  bold=True)
    FIGURES[params["figure"]][1](draw, params)
    return image


def scienceqa_item(rng: random.Random, index: int) -> DrawnItem:
    """A ScienceQA-style figure with a 2-4 option multiple-choice question and a letter answer."""
    figure = rng.choice(sorted(FIGURES))
    sample, _, facts = FIGURES[figure]
    params = sample(rng)
    params["background"] = light_color(rng, 235)
    params["title"] = {"food_chain": "A food chain", "particles": "Particle model"}.get(figure, "")
    question, choices, correct, description = facts(params)
    if figure == "food_chain":  # up to four organisms from the chain, padded with outsiders
        outsiders = sorted({o for chain in FOOD_CHAINS for o in chain} - set(choices))
        others = [c for c in choices if c != correct]
        picked = rng.sample(others, min(3, len(others)))
        options, answer = multiple_choice(rng, correct, picked + rng.sample(outsiders, 3 - len(picked)), 4)
    else:  # fixed option order, as in ScienceQA
        options, answer = choices, "abcd"[choices.index(correct)]
    return DrawnItem(render_science_figure(params), question, answer, description, params, tuple(options))
