"""LLaVA-1.5 at full size on one lent GPU, with random weights: the costs a CPU cannot measure.

    python benchmarks/gpu_fullsize_llava.py --images IMAGES --out $OUT/full     # a GPU machine, 13B
    python benchmarks/gpu_fullsize_llava.py --images IMAGES --out $OUT/fp32 --dtype fp32 --steps 0  # equality
    python benchmarks/gpu_fullsize_llava.py --images IMAGES --out $OUT/mem --objectives ce+vsd,ce --no-decode
    python benchmarks/gpu_fullsize_llava.py --images IMAGES --out /tmp/full --size tiny --device cpu  # dry check

The real weights are not reachable from the lent machines (nothing outside them is, and at most 64 MiB travels),
so the script builds LLaVA-1.5 from `mmvsd/configs/targets/llava-1.5-SIZE.json` with random bf16 weights: the real
architecture, sizes and 576 image tokens, CLIP's 336-pixel processor, and a character-level tokenizer with
LLaVA's vocabulary size and special ids. Acceptance on such a target means nothing; time, memory and token-for-
token equality do. Each step runs through the command line as a user runs it:

1. `mmvsd profile --drafter random`: a verify step's cost against the number of tree tokens, bf16;
2. `mmvsd train --config llava_vispec_paper --drafter vispec` (the paper's `ce+vsd`, S = 40, L = 7) for a few
   steps on IMAGES (a `llava_instruct.json` with its images): seconds per step and peak GPU memory (one
   drafter per `--objectives`: `ce+vsd,ce` shows what the VSD step adds);
3. `mmvsd generate` on image prompts with `--drafter none`, the drafter of step 2 and `ngram`: every answer
   must equal vanilla's in the same precision, token for token (at bf16 only up to near-ties of the logits;
   `first_mismatch` gives the first new token that differs, counting from 1). `mmvsd bench --suite mllm` would
   need lmms-eval, which the lent machines lack.
Writes `fullsize.json` into --out (and each step's log) and exits non-zero when a step fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from gpu_smoke import run

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}USER: {% if m['content'] is string %}"
            "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>\n"
            "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %} {% else %}ASSISTANT: {{ m['content'] }}"
            "</s>{% endif %}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def config(size: str):
    from transformers import LlavaConfig

    name = f"llava-1.5-{'13b' if size == 'tiny' else size}.json"
    raw = json.loads((ROOT / "mmvsd" / "configs" / "targets" / name).read_text())
    raw.pop("_comment", None)
    if size == "tiny":  # the same structure and image geometry, small widths: the dry check on a CPU
        raw["text_config"].update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=4)
        raw["vision_config"].update(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2)
    return LlavaConfig(**raw)


def tokenizer(vocab_size: int):
    """Characters as tokens, LLaVA's ids for <unk> <s> </s> <image> <pad>, the rest of the vocabulary unused."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "\t", "\n"] + [chr(code) for code in range(32, 32 + 32000 - 5)]
    vocab = {word: index for index, word in enumerate(words)} | {"<image>": 32000, "<pad>": 32001}
    assert len(vocab) <= vocab_size
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.add_special_tokens({"additional_special_tokens": ["<image>"]})
    fast.chat_template = TEMPLATE
    return fast


def build(folder: Path, size: str, device: str) -> dict:
    """A random-weight LLaVA-1.5 folder (config, bf16 safetensors, processor) as `--target` reads it."""
    from transformers import CLIPImageProcessor, LlavaForConditionalGeneration, LlavaProcessor

    start = time.perf_counter()
    cfg = config(size)
    with torch.random.fork_rng(devices=[] if device == "cpu" else None), torch.device(device):
        torch.manual_seed(0)
        model = LlavaForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16).eval()
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    del model
    image_processor = CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
                                         image_mean=[0.48145466, 0.4578275, 0.40821073],
                                         image_std=[0.26862954, 0.26130258, 0.27577711])
    LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer(cfg.text_config.vocab_size), patch_size=14,
                   vision_feature_select_strategy="default", image_token="<image>", num_additional_image_tokens=1,
                   chat_template=TEMPLATE).save_pretrained(folder)
    return {"ok": True, "parameters": params, "seconds": round(time.perf_counter() - start, 1)}


def nvidia_smi_index(device: str) -> str:
    """nvidia-smi's index of torch's `device` (cuda:N), which counts only the GPUs CUDA_VISIBLE_DEVICES shows
    (the two orders agree with CUDA_DEVICE_ORDER=PCI_BUS_ID, or on a machine of one GPU model)."""
    index = torch.device(device).index or 0
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[index] if index < len(visible) else str(index)


class PeakMemory:
    """The GPU's used memory, polled by nvidia-smi while a child process runs (its own allocator is out of reach)."""

    def __init__(self, device: str):
        self.peak_mib, self.on = 0, device != "cpu"
        self.gpu = nvidia_smi_index(device) if self.on else ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(0.25):
            query = ["nvidia-smi", "-i", self.gpu, "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
            out = subprocess.run(query, capture_output=True, text=True, check=False).stdout.split()
            if out and out[0].isdigit():  # not "No devices were found"
                self.peak_mib = max(self.peak_mib, int(out[0]))

    def __enter__(self):
        if self.on:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.on:
            self._thread.join()


def save(report: dict, out: Path) -> None:
    """fullsize.json as it stands: a step that runs out of time leaves the earlier ones' results."""
    (out / "fullsize.json").write_text(json.dumps(report, indent=2) + "\n")


def step(name: str, argv: list[str], out: Path, device: str) -> dict:
    with PeakMemory(device) as memory:
        seconds, done = run([sys.executable, "-m", "mmvsd", *argv])
    (out / f"{name}.log").write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
    report = {"ok": done.returncode == 0, "seconds": round(seconds, 1), "exit": done.returncode}
    if memory.on:
        report["peak_gpu_mib"] = memory.peak_mib
    print(name, json.dumps(report), flush=True)
    return report


def train_steps(drafter: Path) -> dict:
    """Seconds per optimizer step (the median after the first), tokens per step and the peak of allocated GPU
    memory, from the training log."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(drafter / "logs" / "train"))
    events.Reload()
    walls = [event.wall_time for event in events.Scalars("train/loss")]
    seen = [event.value for event in events.Scalars("train/tokens_seen")]
    gaps = sorted(b - a for a, b in zip(walls, walls[1:]))
    peaks = [event.value for event in events.Scalars("train/gpu_peak_gib")] if "train/gpu_peak_gib" in \
        events.Tags()["scalars"] else []  # PyTorch's allocated peak per step, on a GPU
    return {"steps": len(walls), "step_seconds": round(gaps[len(gaps) // 2], 2) if gaps else None,
            "tokens_per_step": round(seen[-1] / len(seen)) if seen else None,
            "peak_allocated_gib": round(max(peaks), 1) if peaks else None}


def first_mismatch(output: list[int], vanilla: list[int]) -> int | None:
    """The first new token (counting from 1) where `output` leaves `vanilla`; None when they are equal."""
    if output == vanilla:
        return None
    return next((i + 1 for i, (a, b) in enumerate(zip(output, vanilla)) if a != b), min(len(output), len(vanilla)) + 1)


def cost_tables(log: str) -> dict:
    """The cost table `mmvsd profile` measured, read from the cache file its log names (batch 1): verify ms by
    tree tokens, drafter expand ms by frontier width."""
    from mmvsd.decoding.costs import CostTable

    marker = "profile cached in "
    path = next(line.split(marker, 1)[1].strip() for line in log.splitlines() if marker in line)
    table = CostTable.from_json(json.loads(Path(path).read_text()))
    return {"verify_ms": {n: round(table.target_step(n) * 1000, 2) for n in table.target_tokens},
            "expand_ms": {w: round(table.draft_expand(w) * 1000, 2) for w in table.draft_widths}}


def generate(target: Path, drafter: str, args, device_args: list[str]) -> dict:
    """The same image prompts decoded without a drafter, with the trained one and with prompt lookup: one image
    (`--image` goes with every prompt of a file), the questions of the last --prompts records."""
    records = json.loads((args.images / "llava_instruct.json").read_text())[-args.prompts:]
    prompts = args.work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": r["conversations"][0]["value"].replace("<image>", "").strip()})
                               + "\n" for r in records))
    report = {}
    for name, spec in (("none", "none"), ("drafter", drafter), ("ngram", "ngram")):
        out = args.work / f"generate-{name}.json"
        row = step(f"generate-{name}", ["generate", "--target", str(target), "--drafter", spec, "--prompt-file",
                                        str(prompts), "--image", str(args.images / records[-1]["image"]),
                                        "--max-new-tokens", "128", "--json", str(out), *device_args],
                   args.out, args.device)
        results = json.loads(out.read_text())["results"] if row["ok"] else []
        row.update(outputs=[r["output_ids"] for r in results], tau=[r["tau"] for r in results],
                   tokens_per_second=[round(r["tokens_per_second"], 1) for r in results])
        report[name] = row
    for name in ("drafter", "ngram"):
        pairs = list(zip(report[name]["outputs"], report["none"]["outputs"]))
        same = [a == b for a, b in pairs]
        report[name].update(equal_to_vanilla=same, first_mismatch=[first_mismatch(a, b) for a, b in pairs],
                            ok=report[name]["ok"] and len(same) == args.prompts and all(same))
    for row in report.values():
        row.pop("outputs")
    report["ok"] = all(row["ok"] for row in report.values())
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--images", required=True, type=Path, help="a folder with llava_instruct.json and its images")
    parser.add_argument("--size", default="13b", choices=("7b", "13b", "tiny"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--work", default=Path("/tmp/fullsize-llava"), type=Path, help="target and drafter folders")
    parser.add_argument("--steps", type=int, default=6, help="training steps (0: no training; decode with an "
                        "untrained drafter, `--drafter random`)")
    parser.add_argument("--objectives", default="ce+vsd", help="train one drafter per objective (comma-separated; "
                        "the first decodes): `ce+vsd,ce` sets the VSD step's memory beside CE's")
    parser.add_argument("--no-decode", dest="decode", action="store_false",
                        help="train only: no profile and no generate")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"),
                        help="profile and decode in this precision (fp32: token-for-token equality is exact)")
    parser.add_argument("--prompts", type=int, default=3, help="image prompts decoded (the last of IMAGES)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    target, drafter = args.work / "target", args.work / "drafter"
    gpu = args.device != "cpu"
    report = {"device": torch.cuda.get_device_name(0) if gpu else "cpu", "size": args.size, "dtype": args.dtype,
              "torch": torch.__version__, "cuda": torch.version.cuda}
    device_args = ["--device", args.device, "--dtype", args.dtype]
    report["build"] = build(target, args.size, args.device)
    print("build", json.dumps(report["build"]), flush=True)
    save(report, args.out)
    if args.decode:
        report["profile"] = step("profile", ["profile", "--target", str(target), "--drafter", "random", "--refresh",
                                             *device_args], args.out, args.device)
        if report["profile"]["ok"]:
            report["profile"].update(cost_tables((args.out / "profile.log").read_text()))
        save(report, args.out)
    objectives, drafters = args.objectives.split(",") if args.steps else [], []
    for objective in objectives:
        drafter = args.work / f"drafter-{objective.replace('+', '-')}"
        train = ["train", "--config", "llava_vispec_paper", "--target", str(target), "--init", "none",
                 "--data", f"llava-instruct:{args.images / 'llava_instruct.json'}", "--output", str(drafter),
                 "num_conversations=64", f"max_steps={args.steps}", "validation_fraction=0", "log_every=1",
                 f"save_every={args.steps}", "progress=false", "warmup_ratio=0", f"objective={objective}"]
        if not gpu:
            train += ["batch_size=2", "precision=fp32"]
        row = report[f"train:{objective}"] = step(f"train-{objective}", train, args.out, args.device)
        if row["ok"]:
            row.update(train_steps(drafter))
            drafters.append(drafter)
        save(report, args.out)
    if args.decode and len(drafters) == len(objectives):  # every drafter trained (none asked for: a random one)
        report["generate"] = generate(target, str(drafters[0]) if drafters else "random", args, device_args)
    report["ok"] = all(value["ok"] for value in report.values() if isinstance(value, dict))
    save(report, args.out)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
