"""`mmvsd regenerate`: the target's own answers to a whole dataset, in resumable shards (training data).

    mmvsd regenerate --target smollm2-135m --data sharegpt --output ~/regen/smollm2-greedy --engine llama.cpp
    mmvsd train --target smollm2-135m --data ~/regen/smollm2-greedy ...

The work itself: `mmvsd.training.regenerate_shards`; the engines, by name: `mmvsd.decoding.engines` (mmvsd's own exact
loop, llama.cpp's server, a plugin's).
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from mmvsd.errors import UserError
from mmvsd.placement import add_placement_arguments, positive_int

SLOT_MARGIN = 32  # tokens of a llama.cpp slot past prompt + answer


def add_regenerate_command(sub: argparse._SubParsersAction) -> None:
    """`mmvsd regenerate` (entry point `mmvsd.commands`)."""
    p = sub.add_parser("regenerate", help="answer a dataset's prompts with the target (on-policy training data), "
                                          "in resumable shards",
                       description="Rewrite every assistant turn of a dataset with the target's own answer, into "
                                   "shard files under --output (a dataset for `mmvsd train --data`). Prints the "
                                   "estimated tokens, disk and time first; rerun the same command to resume.")
    p.add_argument("--target", required=True, help="built-in name, local folder, .gguf file or HF id")
    p.add_argument("--data", default="sharegpt", help="as for `mmvsd train --data` (default sharegpt)")
    p.add_argument("--image-root", default="", help="folder that relative image paths are under")
    p.add_argument("--adapter", default="", help="modality adapter that shows images to the target")
    p.add_argument("--output", required=True, help="folder of the shards and their manifest")
    p.add_argument("--num-conversations", type=int, default=0, help="the dataset's first N (0: all)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy answers; 1: samples")
    p.add_argument("--max-new-tokens", type=positive_int, default=448)
    p.add_argument("--max-length", type=int, default=512,
                   help="the training length: answers stop where a training example would be cut (0: no limit)")
    p.add_argument("--batch-size", type=positive_int, default=64, help="conversations in flight (mmvsd engine)")
    p.add_argument("--shard-size", type=positive_int, default=256, help="conversations per shard file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", default="mmvsd",
                   help="mmvsd: its exact decoding (images too); llama.cpp: llama-server on the target's GGUF file, "
                        "faster on a CPU, text only, not bit-identical at near-ties; or a plugin's engine")
    p.add_argument("--parallel", type=positive_int, default=8, help="llama.cpp slots decoding together")
    p.add_argument("--threads", type=int, default=0, help="llama.cpp threads (0: its default)")
    p.add_argument("--store", default="",
                   help="a shard store (a folder to commit: answers as compressed token ids): its shards are restored "
                        "into --output first, and every finished shard is packed into it")
    p.add_argument("--restore-only", action="store_true",
                   help="with --store: restore its shards into --output (and pack finished ones), answer nothing")
    p.add_argument("--estimate", action="store_true", help="print the estimate and stop; write nothing")
    add_placement_arguments(p)
    p.set_defaults(handler=run_regenerate_command)


def run_regenerate_command(args: argparse.Namespace) -> None:
    from mmvsd.data.conversations import load_conversations  # CLI start-up: loaded per command
    from mmvsd.decoding.engines import get_engine  # CLI start-up: loaded per command
    from mmvsd.training.dataset import data_specs  # CLI start-up: loaded per command
    from mmvsd.training.media import media_adapter  # CLI start-up: loaded per command
    from mmvsd.training.regenerate_shards import (  # CLI start-up: loaded per command
        RegenerateSettings,
        read_manifest,
        regenerate_dataset,
    )
    from mmvsd.training.shard_store import read_store_manifest  # CLI start-up: loaded per command

    if args.num_conversations < 0 or args.max_length < 0:
        raise UserError("--num-conversations and --max-length must be >= 0")
    if args.restore_only and not args.store:
        raise UserError("--restore-only restores from a --store; name one")
    engine = get_engine(args.engine)
    engine.check(args.target)  # e.g. llama.cpp's GGUF file: refused before the target loads
    if args.store:
        read_store_manifest(Path(args.store).expanduser())  # refused before the target loads
    read_manifest(Path(args.output).expanduser())
    settings = RegenerateSettings(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                                  max_prompt_tokens=args.max_length or None, batch_size=args.batch_size,
                                  shard_size=args.shard_size, seed=args.seed)
    conversations = [conv for spec in data_specs(args.data)  # a mixture SPEC+SPEC, as `mmvsd train` reads it
                     for conv in load_conversations(spec, limit=args.num_conversations or None,
                                                    image_root=args.image_root or None)]
    conversations = conversations[:args.num_conversations or None]
    images = any(conv.image for conv in conversations)
    if images and not engine.media:
        raise UserError(f"--engine {args.engine} answers text prompts only; regenerate image conversations with "
                        "--engine mmvsd")
    target = engine.load_target(args.target, args.dtype, args.device)  # another engine's only tokenizes
    adapter = media_adapter(target, args.adapter) if images else None
    longest = (settings.max_prompt_tokens or target.max_positions) + settings.max_new_tokens + SLOT_MARGIN
    answer = engine.answers(target, {"parallel": args.parallel, "threads": args.threads,
                                     "context_per_slot": min(longest, target.max_positions)})
    with contextlib.ExitStack() as stack:
        key = answer.engine if answer is not None else ""  # the cache key's engine: a restore starts no server
        if answer is not None and not args.restore_only:
            answer = stack.enter_context(answer)
        stats = regenerate_dataset(target, conversations, args.output, data=args.data, settings=settings,
                                   answer=answer, engine=key, adapter=adapter, estimate_only=args.estimate,
                                   store=args.store or None, restore_only=args.restore_only)
    if not args.estimate:
        print(stats.summary())
