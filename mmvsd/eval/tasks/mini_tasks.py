"""doc_to_visual / doc_to_text / process_results of the offline mini tasks (see the YAMLs here).

lmms-eval loads this file by path for every `!function mini_tasks.<name>` entry, so it imports
nothing relative. A doc is one parquet row written by `mmvsd.eval.make_mini_tasks`: item_id,
question (options already lettered in for multiple choice), answer (lower case; the option letter
for multiple choice), long_prompt, options, family and image (decoded to a PIL image by datasets).

Scoring reuses lmms-eval's own pieces where they work offline:
    chartqa     relaxed_correctness of lmms-eval's chartqa task (5% numeric tolerance, else exact).
    vqav2, textvqa  EvalAIAnswerProcessor normalisation, then exact match against the one answer
                (the real tasks' 10-annotator leave-one-out average is 1 when all answers agree).
    ai2d        ai2d's MultiChoiceRegexFilter (a leading "B." becomes "B"), then lmms-eval's
                exact_match with ignore_case and ignore_punctuation, as in ai2d.yaml.
    scienceqa   sqa_process_results of lmms-eval's scienceqa task (letter, or "B. ..." prefix).
    hallusion   lmms-eval's hallusion_bench judges answers with GPT; here the first word of the
                EvalAI-normalised answer must be the yes / no ground truth (per-question aAcc).
"""

from __future__ import annotations

from typing import Any

from lmms_eval.api.metrics import exact_match_hf_evaluate
from lmms_eval.tasks._task_utils.vqa_eval_metric import EvalAIAnswerProcessor
from lmms_eval.tasks.ai2d.utils import MultiChoiceRegexFilter
from lmms_eval.tasks.chartqa.utils import relaxed_correctness
from lmms_eval.tasks.scienceqa.utils import sqa_process_results
from PIL import Image

from mmvsd.data.image_families import LETTERS
from mmvsd.errors import UserError

PROMPT_FIELDS = {"short": "question", "long": "long_prompt"}  # lmms_eval_specific_kwargs "prompt" -> doc field
_EVALAI = EvalAIAnswerProcessor()
_LETTER_FILTER = MultiChoiceRegexFilter(regex_pattern=r"([A-Z])\.", group_select=0, ignore_case=True,
                                        ignore_punctuation=True)

Doc = dict[str, Any]


def doc_to_visual(doc: Doc) -> list[Image.Image]:
    """The doc's image as a one-element list of RGB images."""
    return [doc["image"].convert("RGB")]


def doc_to_text(doc: Doc, lmms_eval_specific_kwargs: dict[str, Any] | None = None) -> str:
    """pre_prompt + the short question or the long prompt (kwarg "prompt": short | long) + post_prompt."""
    kwargs = lmms_eval_specific_kwargs or {}
    prompt = kwargs.get("prompt", "short")
    if prompt not in PROMPT_FIELDS:
        raise UserError(f"unknown prompt kind {prompt!r} in lmms_eval_specific_kwargs; choose short or long")
    return f"{kwargs.get('pre_prompt', '')}{doc[PROMPT_FIELDS[prompt]]}{kwargs.get('post_prompt', '')}"


def option_letter(doc: Doc) -> str:
    """The ground-truth option letter in upper case ("B")."""
    return doc["answer"].upper()


def chartqa_process_results(doc: Doc, results: list[str]) -> dict[str, float]:
    """Relaxed accuracy of lmms-eval's chartqa task."""
    return {"relaxed_overall": float(relaxed_correctness(results[0].strip(), doc["answer"]))}


def vqa_process_results(doc: Doc, results: list[str]) -> dict[str, float]:
    """Exact match after EvalAI answer normalisation (vqav2, textvqa)."""
    return {"exact_match": float(_EVALAI(results[0]) == _EVALAI(doc["answer"]))}


def ai2d_process_results(doc: Doc, results: list[str]) -> dict[str, float]:
    """ai2d's letter filter, then case- and punctuation-insensitive exact match with the option letter."""
    prediction = _LETTER_FILTER.apply([[results[0]]], [doc])[0]
    score = exact_match_hf_evaluate([prediction], [option_letter(doc)], ignore_case=True, ignore_punctuation=True)
    return {"exact_match": float(score["exact_match"])}


def scienceqa_process_results(doc: Doc, results: list[str]) -> dict[str, float]:
    """lmms-eval's scienceqa scoring, fed a doc in its format (choices, answer index)."""
    sqa_doc = {"choices": list(doc["options"]), "answer": LETTERS.lower().index(doc["answer"])}
    return {"exact_match": float(sqa_process_results(sqa_doc, results)["exact_match"])}


def hallusion_process_results(doc: Doc, results: list[str]) -> dict[str, float]:
    """Yes / no accuracy: the first word of the normalised answer against the ground truth."""
    words = _EVALAI(results[0]).split()
    return {"aAcc": float(bool(words) and words[0] == doc["answer"])}
