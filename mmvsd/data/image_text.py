"""TextVQA-style family: words and numbers rendered in simple scenes (a shop sign, a street sign,
a speed-limit sign, a sports jersey, a price tag, a house number), asked about by reading.

The answer is the lower-cased text that the renderer writes, taken from the same parameters.
"""

from __future__ import annotations

import random
from typing import Any

from PIL import Image, ImageDraw

from mmvsd.data.image_families import (
    CANVAS_SIZE,
    DrawnItem,
    draw_text,
    fit_font_size,
    light_color,
    new_canvas,
)
from mmvsd.errors import UserError

SHOP_WORDS = ["BAKERY", "PHARMACY", "CAFE", "BOOKS", "FLOWERS", "HOTEL", "MARKET", "PIZZA", "GARAGE", "BANK",
              "DINER", "TOYS", "SHOES", "MUSIC", "SUSHI", "TACOS", "LAUNDRY", "BARBER", "GIFTS", "DELI",
              "FLORIST", "BISTRO", "GROCERY", "CINEMA", "BUTCHER", "POST OFFICE"]
STREET_NAMES = ["OAK", "MAPLE", "PINE", "ELM", "CEDAR", "MAIN", "HIGH", "PARK", "LAKE", "RIVER", "HILL",
                "BIRCH", "CHURCH", "MILL", "WILLOW", "SUNSET", "BROAD", "KING"]
STREET_SUFFIXES = ["ST", "AVE", "RD", "LN", "BLVD", "DR"]
PLAYER_NAMES = ["SMITH", "JONES", "GARCIA", "LEE", "BROWN", "SILVA", "KIM", "MARTIN", "LOPEZ", "TAYLOR", "NOVAK"]
PRODUCTS = ["APPLES", "BREAD", "CHEESE", "COFFEE", "MILK", "EGGS", "HONEY", "RICE", "TEA", "JAM", "SOAP"]
STRONG_COLORS = [(180, 30, 40), (20, 60, 140), (20, 110, 60), (90, 40, 120), (30, 30, 30), (200, 110, 20),
                 (0, 120, 130), (120, 70, 40)]
SKY = (185, 215, 240)


def ink_for(color: list[int] | tuple[int, ...]) -> tuple[int, int, int]:
    """Black or white, whichever reads better on ``color``."""
    luminance = 0.299 * color[0] + 0.587 * color[1] + 0.114 * color[2]
    return (0, 0, 0) if luminance > 140 else (255, 255, 255)


def _fitted(draw: ImageDraw.ImageDraw, xy: tuple[float, float], text: str, width: float, start: int,
            color: tuple[int, ...]) -> None:
    draw_text(draw, xy, text, fit_font_size(text, width, start, minimum=18), color, bold=True)


def _draw_shop(draw: ImageDraw.ImageDraw, p: dict[str, Any]) -> None:
    dx, wall, board = p["dx"], tuple(p["wall_color"]), tuple(p["board_color"])
    draw.rectangle((0, 300, CANVAS_SIZE, CANVAS_SIZE), fill=(150, 150, 150))
    draw.rectangle((30 + dx, 110, 306 + dx, 300), fill=wall, outline=(60, 60, 60), width=2)
    draw.rectangle((40 + dx, 60, 296 + dx, 128), fill=board, outline=(40, 40, 40), width=3)
    _fitted(draw, (168 + dx, 94), p["text"], 236, 44, ink_for(board))
    draw.rectangle((140 + dx, 200, 196 + dx, 300), fill=(90, 60, 40))
    for x in (55 + dx, 221 + dx):
        draw.rectangle((x, 160, x + 60, 230), fill=(200, 230, 250), outline=(60, 60, 60), width=3)


def _draw_street(draw: ImageDraw.ImageDraw, p: dict[str, Any]) -> None:
    x, y = 168 + p["dx"], p["y"]
    draw.rectangle((0, 290, CANVAS_SIZE, CANVAS_SIZE), fill=(110, 160, 90))
    draw.rectangle((x - 6, y, x + 6, 320), fill=(120, 120, 120))
    draw.rectangle((x - 140, y - 34, x + 140, y + 34), fill=(0, 110, 60), outline=(255, 255, 255), width=4)
    _fitted(draw, (x, y), p["text"], 256, 40, (255, 255, 255))


def _draw_speed(draw: ImageDraw.ImageDraw, p: dict[str, Any]) -> None:
    x, y = 168 + p["dx"], p["y"]
    draw.rectangle((0, 290, CANVAS_SIZE, CANVAS_SIZE), fill=(110, 160, 90))
    draw.rectangle((x - 6, y + 90, x + 6, 330), fill=(120, 120, 120))
    draw.rectangle((x - 80, y - 100, x + 80, y + 100), fill=(255, 255, 255), outline=(0, 0, 0), width=5)
    draw_text(draw, (x, y - 68), "SPEED", 30, (0, 0, 0), bold=True)
    draw_text(draw, (x, y - 34), "LIMIT", 30, (0, 0, 0), bold=True)
    draw_text(draw, (x, y + 40), p["text"], 76, (0, 0, 0), bold=True)


def _draw_jersey(draw: ImageDraw.ImageDraw, p: dict[str, Any]) -> None:
    dx, shirt = p["dx"], tuple(p["shirt_color"])
    outline = [(138, 62), (90, 72), (38, 128), (66, 166), (98, 140), (98, 322), (238, 322), (238, 140),
               (270, 166), (298, 128), (246, 72), (198, 62), (168, 92)]
    draw.polygon([(x + dx, y) for x, y in outline], fill=shirt, outline=(40, 40, 40))
    if p["name"]:
        _fitted(draw, (168 + dx, 126), p["name"], 130, 28, ink_for(shirt))
    _fitted(draw, (168 + dx, 222), p["text"], 130, 100, ink_for(shirt))


def _draw_price_tag(draw: ImageDraw.ImageDraw, p: dict[str, Any]) -> None:
    dx, y, tag = p["dx"], p["y"], tuple(p["tag_color"])
    draw.polygon([(20 + dx, y), (70 + dx, y - 80), (316 + dx, y - 80), (316 + dx, y + 80), (70 + dx, y + 80)],
                 fill=tag, outline=(40, 40, 40))
    draw.ellipse((48 + dx, y - 10, 68 + dx, y + 10), fill=tuple(p["background"]), outline=(40, 40, 40))
    _fitted(draw, (190 + dx, y - 38), p["name"], 220, 34, ink_for(tag))
    _fitted(draw, (190 + dx, y + 28), p["text"], 220, 56, ink_for(tag))


def _draw_house(draw: ImageDraw.ImageDraw, p: dict[str, Any]) -> None:
    dx, plaque = p["dx"], tuple(p["plaque_color"])
    draw.rectangle((0, 0, CANVAS_SIZE, CANVAS_SIZE), fill=tuple(p["wall_color"]))
    draw.rectangle((40 + dx, 120, 150 + dx, 336), fill=(100, 60, 35), outline=(50, 30, 20), width=3)
    draw.ellipse((128 + dx, 226, 140 + dx, 238), fill=(220, 190, 60))
    draw.rounded_rectangle((170 + dx, 100, 320 + dx, 190), radius=10, fill=plaque, outline=(40, 40, 40), width=3)
    _fitted(draw, (245 + dx, 145), p["text"], 130, 64, ink_for(plaque))


SCENES = {
    "shop_sign": (_draw_shop, "What word is written on the sign?", "A shop front with a sign that reads '{text}'."),
    "street_sign": (_draw_street, "What is the name of the street on the sign?",
                    "A green street sign on a pole that reads '{text}'."),
    "speed_limit": (_draw_speed, "What is the speed limit shown on the sign?",
                    "A white speed limit sign on a pole showing {text}."),
    "jersey": (_draw_jersey, "What number is on the jersey?", "A sports jersey with the number {text}{name_part}."),
    "price_tag": (_draw_price_tag, "What is the price on the tag?", "A price tag for {name} that reads {text}."),
    "house_number": (_draw_house, "What is the house number?", "A front door next to a plaque with the number {text}."),
}


def sample_text_scene(rng: random.Random) -> dict[str, Any]:
    """Random scene parameters: which scene, the text it shows and its colours and offsets."""
    scene = rng.choice(sorted(SCENES))
    params: dict[str, Any] = {"scene": scene, "dx": rng.randint(-12, 12), "y": rng.randint(150, 190),
                              "background": light_color(rng, 210) if scene in ("jersey", "price_tag") else list(SKY),
                              "name": "", "ask": "text"}
    if scene == "shop_sign":
        params.update(text=rng.choice(SHOP_WORDS), wall_color=light_color(rng, 170),
                      board_color=list(rng.choice(STRONG_COLORS)))
    elif scene == "street_sign":
        params["text"] = f"{rng.choice(STREET_NAMES)} {rng.choice(STREET_SUFFIXES)}"
    elif scene == "speed_limit":
        params["text"] = str(5 * rng.randint(3, 15))
    elif scene == "jersey":
        params.update(text=str(rng.randint(1, 99)), shirt_color=list(rng.choice(STRONG_COLORS + [(240, 240, 240)])),
                      name=rng.choice(PLAYER_NAMES) if rng.random() < 0.5 else "")
        params["ask"] = "name" if params["name"] and rng.random() < 0.5 else "text"
    elif scene == "price_tag":
        params.update(text=f"${rng.randint(1, 19)}.{rng.randint(0, 99):02d}", name=rng.choice(PRODUCTS),
                      tag_color=light_color(rng, 200), ask=rng.choice(["text", "name"]))
    else:
        params.update(text=str(rng.randint(1, 999)), wall_color=light_color(rng, 190),
                      plaque_color=list(rng.choice(STRONG_COLORS)))
    return params


def text_question(params: dict[str, Any]) -> str:
    """The question for a scene: about its main text, or about the name where ``ask`` says so."""
    if params["ask"] == "name":
        return "What name is on the jersey?" if params["scene"] == "jersey" else "What product is the price tag for?"
    return SCENES[params["scene"]][1]


def text_answer(params: dict[str, Any]) -> str:
    """The lower-cased text written in the image that answers the question."""
    return (params["name"] if params["ask"] == "name" else params["text"]).lower()


def render_text_scene(params: dict[str, Any]) -> Image.Image:
    """Render a text scene from its parameters; UserError for an unknown scene or empty text."""
    if params.get("scene") not in SCENES:
        raise UserError(f"unknown text scene {params.get('scene')!r}; choose one of {', '.join(SCENES)}")
    if not str(params.get("text", "")).strip():
        raise UserError("a text scene needs non-empty text to write")
    image, draw = new_canvas(params["background"])
    SCENES[params["scene"]][0](draw, params)
    return image


def textvqa_item(rng: random.Random, index: int) -> DrawnItem:
    """A TextVQA-style question answered by reading a word or number in the scene."""
    params = sample_text_scene(rng)
    name_part = f" and the name {params['name']}" if params["name"] else ""
    description = SCENES[params["scene"]][2].format(text=params["text"], name=params["name"], name_part=name_part)
    return DrawnItem(render_text_scene(params), text_question(params), text_answer(params), description, params)
