"""Drawing primitives shared by the synthetic image families, plus the shape-scene families.

Every family follows the same recipe so answers always match pixels:
``sample_*(rng) -> params`` (a JSON-serialisable dict, stored as the item's ``meta``),
``render_*(params) -> PIL image`` (pure: the same params always give the same pixels), and the
question / answer / description are computed from the same params. The shape scenes live here
(``vqav2`` shape questions and ``hallusion`` yes/no existence questions); charts, diagrams,
science figures, text scenes and real photos live in ``image_charts``, ``image_diagrams``,
``image_science``, ``image_text`` and ``image_photos``.

Shapes are drawn without anti-aliasing, so the pixel at a shape's centre is exactly its colour.
"""

from __future__ import annotations

import functools
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from mmvsd.errors import UserError

CANVAS_SIZE = 336  # pixels, square; text is at least 15 px so it stays legible at 224 px
LETTERS = "ABCDEFGH"

SHAPE_COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 38, 38),
    "green": (34, 150, 60),
    "blue": (37, 80, 220),
    "yellow": (240, 200, 20),
    "purple": (140, 60, 190),
    "orange": (245, 130, 20),
}
SHAPE_KINDS = ("circle", "square", "triangle")
GRID_CELLS = 4  # shape scenes place at most one shape per cell of a 4x4 grid
CELL_SIZE = CANVAS_SIZE // GRID_CELLS


@dataclass(frozen=True)
class DrawnItem:
    """What a family generator returns: the image and the facts computed from its parameters."""

    image: Image.Image
    question: str  # the bare question, without options or instructions
    answer: str  # lower-case canonical answer; for multiple choice the option letter ("a", "b", ...)
    description: str
    meta: dict[str, Any]
    options: tuple[str, ...] = field(default=())


# ----------------------------------------------------------------------------- text and canvas


@functools.lru_cache(maxsize=64)
def font(size: int, bold: bool = False) -> ImageFont.FreeTypeFont:
    """DejaVu Sans from matplotlib's bundled fonts: offline and identical on every machine."""
    import matplotlib  # imported lazily: only its data folder is needed

    name = "DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf"
    return ImageFont.truetype(str(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / name), size)


def text_width(text: str, size: int, bold: bool = False) -> float:
    """Rendered width of ``text`` in pixels."""
    return font(size, bold).getlength(text)


def fit_font_size(text: str, max_width: float, start: int, minimum: int = 15, bold: bool = True) -> int:
    """Largest size <= start at which ``text`` fits in ``max_width`` (never below ``minimum``)."""
    size = start
    while size > minimum and text_width(text, size, bold) > max_width:
        size -= 1
    return size


def draw_text(draw: ImageDraw.ImageDraw, xy: tuple[float, float], text: str, size: int,
              fill: tuple[int, int, int] = (0, 0, 0), bold: bool = False, anchor: str = "mm") -> None:
    """Draw ``text`` anchored at ``xy`` (default: centred)."""
    draw.text(xy, text, fill=fill, font=font(size, bold), anchor=anchor)


def new_canvas(background: list[int] | tuple[int, ...]) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    """A blank RGB canvas of the standard size and a drawing context on it."""
    image = Image.new("RGB", (CANVAS_SIZE, CANVAS_SIZE), tuple(background))
    return image, ImageDraw.Draw(image)


def light_color(rng: random.Random, low: int = 228) -> list[int]:
    """A random pale background colour (each channel in [low, 255])."""
    return [rng.randint(low, 255) for _ in range(3)]


def draw_arrow(draw: ImageDraw.ImageDraw, points: list[tuple[float, float]],
               fill: tuple[int, int, int], width: int = 3, head: float = 12.0) -> None:
    """A polyline ending in a filled triangular arrow head at its last point."""
    (x0, y0), (x1, y1) = points[-2], points[-1]
    angle = math.atan2(y1 - y0, x1 - x0)
    base = (x1 - head * math.cos(angle), y1 - head * math.sin(angle))
    draw.line([*points[:-1], base], fill=fill, width=width)
    left = (base[0] + head * 0.5 * math.sin(angle), base[1] - head * 0.5 * math.cos(angle))
    right = (base[0] - head * 0.5 * math.sin(angle), base[1] + head * 0.5 * math.cos(angle))
    draw.polygon([(x1, y1), left, right], fill=fill)


def multiple_choice(rng: random.Random, correct: str, distractors: list[str],
                    num_options: int) -> tuple[tuple[str, ...], str]:
    """Shuffle ``correct`` among distinct distractors; return (options, lower-case answer letter)."""
    pool = [d for d in dict.fromkeys(distractors) if d != correct]
    options = [correct, *rng.sample(pool, min(num_options - 1, len(pool)))]
    rng.shuffle(options)
    return tuple(options), LETTERS[options.index(correct)].lower()


def plural(noun: str, count: int) -> str:
    """``noun`` with a simple English plural when count != 1."""
    if count == 1:
        return noun
    return noun + ("es" if noun.endswith(("s", "sh", "ch", "x")) else "s")


def article(word: str) -> str:
    """'an' before a vowel, else 'a'."""
    return "an" if word[:1].lower() in "aeiou" else "a"


def join_words(words: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


# ----------------------------------------------------------------------------- shape scenes


def draw_shape(draw: ImageDraw.ImageDraw, kind: str, x: float, y: float, size: float,
               fill: tuple[int, int, int]) -> None:
    """Draw one single-colour shape of width ``size`` centred on (x, y); (x, y) is inside it."""
    r = size / 2
    if kind == "circle":
        draw.ellipse((x - r, y - r, x + r, y + r), fill=fill)
    elif kind == "square":
        draw.rectangle((x - r, y - r, x + r, y + r), fill=fill)
    elif kind == "triangle":
        draw.polygon([(x, y - r), (x + r, y + r), (x - r, y + r)], fill=fill)
    else:
        raise UserError(f"unknown shape kind {kind!r}; choose one of {', '.join(SHAPE_KINDS)}")


def render_shape_scene(params: dict[str, Any]) -> Image.Image:
    """Render a scene of coloured shapes from its parameters (background, shapes)."""
    image, draw = new_canvas(params["background"])
    for shape in params["shapes"]:
        if shape["color"] not in SHAPE_COLORS:
            raise UserError(f"unknown shape color {shape['color']!r}; choose one of {', '.join(SHAPE_COLORS)}")
        if not 8 <= shape["size"] <= CANVAS_SIZE:
            raise UserError(f"shape size {shape['size']} is outside [8, {CANVAS_SIZE}] pixels")
        draw_shape(draw, shape["kind"], shape["x"], shape["y"], shape["size"], SHAPE_COLORS[shape["color"]])
    return image


def place_shapes(rng: random.Random, specs: list[tuple[str, str]], cells: list[int] | None = None) -> list[dict]:
    """Put (color, kind) specs in distinct grid cells, jittered; ``cells`` fixes the cells."""
    if cells is None:
        cells = rng.sample(range(GRID_CELLS * GRID_CELLS), len(specs))
    shapes = []
    for (color, kind), cell in zip(specs, cells):
        size = rng.randint(44, 60)
        slack = (CELL_SIZE - size) // 2 - 3
        x = (cell % GRID_CELLS) * CELL_SIZE + CELL_SIZE // 2 + rng.randint(-slack, slack)
        y = (cell // GRID_CELLS) * CELL_SIZE + CELL_SIZE // 2 + rng.randint(-slack, slack)
        shapes.append({"kind": kind, "color": color, "x": x, "y": y, "size": size})
    return shapes


def random_specs(rng: random.Random, count: int, exclude: set[tuple[str, str]] = frozenset()) -> list[tuple[str, str]]:
    """``count`` random (color, kind) pairs, none of them in ``exclude``."""
    choices = [(c, k) for c in SHAPE_COLORS for k in SHAPE_KINDS if (c, k) not in exclude]
    return [rng.choice(choices) for _ in range(count)]


def describe_shapes(shapes: list[dict]) -> str:
    """One sentence listing the shapes by colour and kind, e.g. '2 red circles and a blue square'."""
    counts = Counter((s["color"], s["kind"]) for s in shapes)
    parts = [f"{article(color) if n == 1 else n} {color} {plural(kind, n)}"
             for (color, kind), n in sorted(counts.items())]
    return f"{len(shapes)} {plural('shape', len(shapes))} on a plain background: {join_words(parts)}."


def _vqav2_count(rng: random.Random) -> tuple[list[dict], str, str, dict]:
    target = random_specs(rng, 1)[0]
    num_target = rng.randint(1, 4)
    specs = [target] * num_target + random_specs(rng, rng.randint(1, 4), exclude={target})
    color, kind = target
    return place_shapes(rng, specs), f"How many {color} {plural(kind, 2)} are there?", str(num_target), \
        {"color": color, "kind": kind}


def _vqav2_count_all(rng: random.Random) -> tuple[list[dict], str, str, dict]:
    shapes = place_shapes(rng, random_specs(rng, rng.randint(2, 8)))
    return shapes, "How many shapes are there?", str(len(shapes)), {}


def _vqav2_color(rng: random.Random) -> tuple[list[dict], str, str, dict]:
    kind = rng.choice(SHAPE_KINDS)
    color = rng.choice(list(SHAPE_COLORS))
    others = random_specs(rng, rng.randint(1, 5), exclude={(c, kind) for c in SHAPE_COLORS})
    specs = [(color, kind), *others]
    rng.shuffle(specs)
    return place_shapes(rng, specs), f"What color is the {kind}?", color, {"kind": kind}


def _vqav2_side(rng: random.Random) -> tuple[list[dict], str, str, dict]:
    left_kind, right_kind = rng.sample(SHAPE_KINDS, 2)
    colors = [rng.choice(list(SHAPE_COLORS)) for _ in range(2)]
    row = rng.randrange(GRID_CELLS)
    cells = [row * GRID_CELLS + rng.randrange(2), row * GRID_CELLS + 2 + rng.randrange(2)]
    shapes = place_shapes(rng, [(colors[0], left_kind), (colors[1], right_kind)], cells)
    side = rng.choice(["left", "right"])
    return shapes, f"What shape is on the {side}?", left_kind if side == "left" else right_kind, {"side": side}


VQAV2_SHAPE_QUESTIONS = {"count": _vqav2_count, "count_all": _vqav2_count_all,
                         "color": _vqav2_color, "side": _vqav2_side}


def vqav2_shapes_item(rng: random.Random) -> DrawnItem:
    """A VQAv2-style shape-scene question: counting, colour or left/right shape."""
    question_type = rng.choice(sorted(VQAV2_SHAPE_QUESTIONS))
    shapes, question, answer, target = VQAV2_SHAPE_QUESTIONS[question_type](rng)
    meta = {"source": "shapes", "background": light_color(rng), "shapes": shapes,
            "question_type": question_type, "target": target}
    return DrawnItem(render_shape_scene(meta), question, answer, "An image of " + describe_shapes(shapes), meta)


def _hallusion_query(rng: random.Random, shapes: list[dict], present: bool) -> dict:
    """Pick a (color, kind) query that is present, or absent but close to a present shape."""
    in_scene = {(s["color"], s["kind"]) for s in shapes}
    kinds_in_scene = {s["kind"] for s in shapes}
    if rng.random() < 0.25:  # kind-only question ("Is there a triangle?")
        pool = sorted(kinds_in_scene) if present else sorted(set(SHAPE_KINDS) - kinds_in_scene)
        if pool:
            return {"color": None, "kind": rng.choice(pool)}
    if present:
        color, kind = rng.choice(sorted(in_scene))
        return {"color": color, "kind": kind}
    anchor = rng.choice(shapes)  # absent but plausible: shares the colour or the kind of a real shape
    near = [(anchor["color"], k) for k in SHAPE_KINDS] + [(c, anchor["kind"]) for c in SHAPE_COLORS]
    color, kind = rng.choice(sorted(set(near) - in_scene))
    return {"color": color, "kind": kind}


def hallusion_item(rng: random.Random, index: int) -> DrawnItem:
    """A yes/no existence question; even indices ask about present objects, odd about absent ones."""
    present = index % 2 == 0
    num_kinds = rng.choice([1, 2, 2, 3])
    kinds = rng.sample(SHAPE_KINDS, num_kinds)
    specs = [(rng.choice(list(SHAPE_COLORS)), rng.choice(kinds)) for _ in range(rng.randint(2, 6))]
    shapes = place_shapes(rng, specs)
    query = _hallusion_query(rng, shapes, present)
    noun = query["kind"] if query["color"] is None else f"{query['color']} {query['kind']}"
    meta = {"source": "shapes", "background": light_color(rng), "shapes": shapes, "query": query}
    return DrawnItem(render_shape_scene(meta), f"Is there {article(noun)} {noun} in the image?",
                     "yes" if present else "no", "An image of " + describe_shapes(shapes), meta)
