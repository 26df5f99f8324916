"""The lmms-eval model `mmvsd`: answers lmms-eval `generate_until` requests with mmvsd's decoders
(tree speculative decoding with a drafter, or mmvsd's own autoregressive loop) and records tau per sample.

    python -m lmms_eval --model mmvsd --tasks chartqa_mini --include_path <mmvsd.eval.mini_task_dir()> \\
        --model_args target=smol-llava,drafter=random,records=tau.jsonl --predict_only --output_path out

model_args (lmms-eval's `key=value,key=value`; unknown keys are errors):
    target          mmvsd target: built-in name, local folder, .gguf file or cached HF id (required)
    drafter         a drafter folder, a shipped drafter name (`default`), `none` (plain autoregressive decoding)
                    or `random` (untrained EAGLE-3); default: the target's shipped drafter if it has one, else none
    temperature     default 0; max_new_tokens default 128. Both apply only where the task's generation
                    kwargs do not say; lmms-eval's `--gen_kwargs temperature=...` overrides the tasks.
    tree            auto (default: each step planned from this machine's measured costs and the acceptance
                    seen so far), paper or B/D/K, as `mmvsd generate --tree` (`mmvsd.tree_options`): parts left
                    unset (0) take the paper's value for the request, 60/5/8 with images, 60/7/10 without
    tree_budget / tree_depth / tree_topk   a fixed shape instead of `tree` (unset parts: as above)
    adapter         modality adapter for image prompts (default: the first registered one that fits)
    seed            sampling seed, the same for every request (results do not depend on request order)
    records         JSONL file rewritten after every batch of requests with one record per sample
    dtype, device   how to load the target: auto (bf16 on a GPU, fp32 on the CPU), fp32|float32, bf16|bfloat16,
                    fp16|float16; lmms-eval's --device sets device (default auto: a CUDA GPU when there is one)

Generation kwargs: `until` stop strings cut the decoded text (decoding itself stops at EOS or
max_new_tokens); temperature 0 is greedy, and `do_sample` is ignored as in lmms-eval's llava_hf.
top_p, top_k and beams are not supported: non-default values are ignored with one warning.

Records: task, split, doc_id, tau (`SequenceResult.tau`: kept new tokens / target forwards, bonus token
counted, the definition `mmvsd bench` and `mmvsd generate` use; 1.0 for drafter=none), new_tokens, target_forwards,
wall_seconds (decoding only, prompt encoding excluded). lmms-eval's samples log gets the prompt and
generated token counts (before `until` cuts the text) of every answer.

Registration: the entry point `mmvsd = "mmvsd.eval.lmms_plugin:lmms_manifests"` in the group
`lmms_eval.models`. lmms-eval imports every such entry point when `lmms_eval.models` is imported,
so this module imports transformers-backed mmvsd modules only when a model is built.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmms_eval.api.instance import GenerationResult, Instance, TokenCounts
from lmms_eval.api.model import lmms
from loguru import logger
from PIL import Image
from tqdm import tqdm

from mmvsd.adapter_base import ModalityAdapter, Prompt
from mmvsd.adapters import choose_adapter
from mmvsd.errors import UserError
from mmvsd.files import atomic_file
from mmvsd.shipped import has_default
from mmvsd.tree_options import tree_for_prompts, tree_spec

if TYPE_CHECKING:
    from lmms_eval.models.registry_v2 import ModelManifest

    from mmvsd.decoding.decode import DecodeConfig, SequenceResult

MODEL_NAME = "mmvsd"
IMAGE_PLACEHOLDER = "<image>"  # what lmms-eval tasks put in the context where a LLaVA prompt shows the image
TREE_ARGS = ("model_args tree", "tree_budget", "tree_depth", "tree_topk")  # the tree options' names here
UNSUPPORTED_GEN_KWARGS = {"top_p": (None, 1, 1.0), "top_k": (None, 0), "num_beams": (None, 1)}  # key: no-op values


def lmms_manifests() -> list[ModelManifest]:
    """The entry-point payload: `--model mmvsd` is `MmvsdLmms`.

    A callable, not a module constant: importing `lmms_eval.models` scans the entry points, so a
    module-level import of it here would re-enter this module half-initialised when it is imported first.
    """
    from lmms_eval.models.registry_v2 import ModelManifest  # import cycle: lmms_eval.models loads this entry point

    return [ModelManifest(model_id=MODEL_NAME, simple_class_path=f"{__name__}.{MmvsdLmms.__name__}")]


def stop_strings(gen_kwargs: dict[str, Any]) -> list[str]:
    """The task's `until` as a list of non-empty strings (None, a string or a list)."""
    until = gen_kwargs.get("until") or []
    if isinstance(until, str):
        until = [until]
    if not isinstance(until, (list, tuple)) or not all(isinstance(s, str) for s in until):
        raise UserError(f"generation kwarg 'until' must be a string or a list of strings, got {until!r}")
    return [s for s in until if s]


def cut_at_stop(text: str, stops: list[str]) -> str:
    """`text` up to the earliest occurrence of any stop string."""
    cut = min((text.find(s) for s in stops if s in text), default=len(text))
    return text[:cut]


def flat_visuals(visuals: Any) -> list:
    """doc_to_visual's result as a flat list (None for text-only tasks, a single item, nested lists)."""
    if visuals is None:
        return []
    if not isinstance(visuals, (list, tuple)):
        return [visuals]
    return [item for entry in visuals for item in flat_visuals(entry)]


def sample_record(task: str, split: str, doc_id: int, result: SequenceResult) -> dict[str, Any]:
    """What is kept of one request's decoding."""
    return {
        "task": task,
        "split": split,
        "doc_id": doc_id,
        "tau": float(result.tau),
        "new_tokens": len(result.output_ids),
        "target_forwards": result.num_target_forwards,
        "wall_seconds": result.wall_seconds,
    }


class MmvsdLmms(lmms):
    """lmms-eval model over an mmvsd target and drafter; `records` holds one dict per answered request."""

    def __init__(
        self,
        target: str = "",
        drafter: str = "",
        temperature: float = 0.0,
        max_new_tokens: int = 128,
        tree: str = "",
        tree_budget: int = 0,
        tree_depth: int = 0,
        tree_topk: int = 0,
        adapter: str = "",
        seed: int = 0,
        records: str = "",
        dtype: str = "auto",
        device: str | None = None,
        batch_size: int | str = 1,
        max_batch_size: int | None = None,
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:
            raise UserError(f"unknown model_args for --model {MODEL_NAME}: {', '.join(sorted(unknown))}")
        if not target:
            raise UserError(f"--model {MODEL_NAME} needs model_args target=NAME_OR_FOLDER")
        if str(batch_size) != "1":
            raise UserError(f"--model {MODEL_NAME} decodes one request at a time (tau and wall time are per "
                            f"sample): use batch_size 1, not {batch_size}")
        from mmvsd.decoding.engines import DEFAULT_ENGINE, get_engine  # likewise
        from mmvsd.drafters.spec import drafter_from_spec  # transformers-backed: see the module docstring
        from mmvsd.eval.bench import TreeGenerate  # likewise

        self.temperature = float(temperature)
        self.max_new_tokens = int(max_new_tokens)
        self.seed = int(seed)
        self.records_path = Path(records) if records else None
        self.records: list[dict[str, Any]] = []
        parts = (int(value) or None for value in (tree_budget, tree_depth, tree_topk))  # 0: not given
        self.tree = tree_spec(str(tree) or None, *parts, names=TREE_ARGS)  # resolved per request's kind
        self.target = get_engine(DEFAULT_ENGINE).load_target(str(target), dtype, device or "auto")
        drafter = str(drafter) or ("default" if has_default(str(target)) else "none")
        self.drafter = drafter_from_spec(drafter, self.target, self.seed)
        # speculative decoding that learns the auto shape's acceptance across requests, per temperature
        self.tree_generate = None if self.drafter is None else TreeGenerate(self.target, self.drafter)
        self.adapter_name = str(adapter)
        self._image_adapter: ModalityAdapter | None = None
        self._warned_keys: set[str] = set()
        if self.adapter_name:
            self.image_adapter()  # a wrong name or an adapter that cannot feed the target fails here

    def image_adapter(self) -> ModalityAdapter:
        """The adapter that turns text + image files into prompts (chosen once, on first use)."""
        if self._image_adapter is None:
            self._image_adapter = choose_adapter(self.target, self.adapter_name, "image")
        return self._image_adapter

    def encode(self, context: str, visuals: list) -> Prompt:
        """The prompt for a context string and its images (PIL images or image file paths)."""
        text = context.replace(IMAGE_PLACEHOLDER, "").strip()
        if not visuals:
            return Prompt(self.target.encode_prompt(text))
        with tempfile.TemporaryDirectory(prefix="mmvsd-lmms-") as folder:
            paths = []
            for index, visual in enumerate(visuals):
                if isinstance(visual, Image.Image):
                    paths.append(Path(folder) / f"{index}.png")  # PNG: the adapter reads the same pixels back
                    visual.convert("RGB").save(paths[-1])
                elif isinstance(visual, (str, Path)):
                    paths.append(Path(visual))
                else:
                    raise UserError(f"--model {MODEL_NAME} takes images (PIL or file paths), "
                                    f"got {type(visual).__name__}")
            return self.image_adapter().encode(self.target, text, paths)

    def decode_config(self, gen_kwargs: dict[str, Any], prompt: Prompt) -> DecodeConfig:
        """mmvsd's DecodeConfig for one request: the task's kwargs where given, else the model_args; the tree
        for the prompt's kind (with or without images)."""
        from mmvsd.decoding.decode import DecodeConfig  # transformers-backed: see the module docstring

        for key, no_op_values in UNSUPPORTED_GEN_KWARGS.items():
            if gen_kwargs.get(key) not in no_op_values and key not in self._warned_keys:
                self._warned_keys.add(key)
                logger.warning(f"--model {MODEL_NAME} ignores generation kwarg {key}={gen_kwargs[key]!r}")
        max_new_tokens = gen_kwargs.get("max_new_tokens") or self.max_new_tokens
        temperature = gen_kwargs.get("temperature")
        temperature = self.temperature if temperature is None else temperature
        return DecodeConfig(int(max_new_tokens), float(temperature), tree_for_prompts(self.tree, [prompt]),
                            self.seed)

    def generate_one(self, prompt: Prompt, gen_kwargs: dict[str, Any]) -> SequenceResult:
        """Decode one prompt with the drafter (speculative) or without one (autoregressive)."""
        from mmvsd.decoding.decode import vanilla_generate  # transformers-backed: see the module docstring

        config = self.decode_config(gen_kwargs, prompt)
        if self.drafter is None:
            return vanilla_generate(self.target, [prompt], config)[0]
        return self.tree_generate([prompt], config)[0]

    def generate_until(self, requests: list[Instance]) -> list[GenerationResult]:
        """One answer (text and token counts) per request, in request order; appends a record per request
        to `self.records`."""
        answers = []
        for request in tqdm(requests, disable=self.rank != 0, desc="mmvsd decoding"):
            context, gen_kwargs, doc_to_visual, doc_id, task, split = request.args
            gen_kwargs = gen_kwargs or {}
            visuals = flat_visuals(doc_to_visual(self.task_dict[task][split][doc_id])) if doc_to_visual else []
            result = self.generate_one(self.encode(context, visuals), gen_kwargs)
            answer = cut_at_stop(self.target.decode(result.output_ids), stop_strings(gen_kwargs))
            counts = TokenCounts(input_tokens=len(result.prompt_ids), output_tokens=len(result.output_ids))
            answers.append(GenerationResult(answer, counts))
            self.records.append(sample_record(task, split, doc_id, result))
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), answer)
        self.write_records()
        return answers

    def write_records(self) -> None:
        """Rewrite the records file (when model_args give one) with every record so far."""
        if self.records_path is None:
            return
        with atomic_file(self.records_path) as handle:
            handle.writelines(json.dumps(record) + "\n" for record in self.records)

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        raise NotImplementedError(f"--model {MODEL_NAME} only generates (speculative decoding): loglikelihood "
                                  "tasks (multiple choice scored by likelihood) are not supported")

    def generate_until_multi_round(self, requests: list[Instance]) -> list[str]:
        raise NotImplementedError(f"--model {MODEL_NAME} answers single-turn generate_until tasks only: "
                                  "multi-round generation is not supported")
