"""`mmvsd draft-vocab`: a trained drafter that drafts through the target's LM head (MSD, ViSpec), narrowed to the
tokens most frequent in a dataset's answers. Its weights are unchanged; on a CPU the head's rows are most of a draft
step's bytes (smol-llava: 49,152 x 576 against 5 M weights in the layer), so 8k rows make drafting several times
cheaper, at the price of the answers' tokens outside them (the coverage it prints).

    mmvsd draft-vocab --target smol-llava --drafter vispec-ce --data ~/regen/smol-llava-greedy --size 8192 --out DIR
"""

from __future__ import annotations

import argparse

from mmvsd.errors import UserError
from mmvsd.placement import positive_int


def add_draft_vocab_command(sub: argparse._SubParsersAction) -> None:
    """`mmvsd draft-vocab` (entry point `mmvsd.commands`)."""
    p = sub.add_parser("draft-vocab", help="narrow a drafter that drafts through the target's head to a dataset's "
                                           "most frequent answer tokens",
                       description="Counts the answer (loss) tokens of --data as `mmvsd train` renders them, keeps "
                                   "the --size most frequent as the draft vocabulary, prints their coverage and "
                                   "writes the drafter, weights unchanged, to --out.")
    p.add_argument("--target", required=True, help="built-in name, local folder, .gguf file or HF id")
    p.add_argument("--drafter", required=True, help="a drafter folder or a shipped drafter's name")
    p.add_argument("--data", required=True, help="as for `mmvsd train --data` (e.g. the target's regenerated answers)")
    p.add_argument("--size", type=positive_int, default=8192, help="draft vocabulary size (default 8192)")
    p.add_argument("--out", required=True, help="folder to write the narrowed drafter to")
    p.add_argument("--num-conversations", type=int, default=0, help="the dataset's first N (0: all)")
    p.add_argument("--max-length", type=positive_int, default=2048, help="tokens per rendered conversation")
    p.add_argument("--image-root", default="", help="folder that relative image paths are under")
    p.add_argument("--adapter", default="", help="modality adapter that shows images to the target")
    p.set_defaults(handler=run_draft_vocab)


def check_draft_vocab_args(args: argparse.Namespace) -> dict[str, tuple]:
    """What the dataset files hold (read once), after every input is checked that can be without a target."""
    from mmvsd.adapters import check_adapter  # CLI start-up: loaded per command
    from mmvsd.drafters.spec import check_drafter_spec, proposer_spec  # CLI start-up: loaded per command
    from mmvsd.training.trainer import check_dataset_exists  # CLI start-up: loaded per command

    if args.num_conversations < 0:
        raise UserError("--num-conversations must be >= 0")
    if proposer_spec(args.drafter) is not None:
        raise UserError(f"--drafter {args.drafter} is not a neural drafter")
    check_drafter_spec(args.drafter, args.target)
    check_adapter(args.adapter)
    return check_dataset_exists(args.data, args.image_root, args.num_conversations)


def run_draft_vocab(args: argparse.Namespace) -> None:
    """`mmvsd draft-vocab`: count the answers' tokens, keep the most frequent, write the narrowed drafter."""
    import torch  # CLI start-up: loaded per command

    from mmvsd.drafter_base import not_narrowable  # CLI start-up: loaded per command
    from mmvsd.drafters.spec import neural_drafter_from_spec  # CLI start-up: loaded per command
    from mmvsd.target_loader import load_target  # CLI start-up: loaded per command
    from mmvsd.training.dataset import draft_vocab_from_counts, load_examples, token_frequencies  # CLI start-up

    read = check_draft_vocab_args(args)
    target = load_target(args.target, dtype=torch.float32)
    if args.size > target.vocab_size:
        raise UserError(f"--size {args.size} exceeds {target.name}'s vocabulary of {target.vocab_size} tokens")
    drafter = neural_drafter_from_spec(args.drafter, target)
    if drafter is None:
        raise UserError(f"--drafter {args.drafter} is not a neural drafter")
    if not drafter.narrowable:  # before counting the data
        raise UserError(not_narrowable(drafter))
    split = load_examples(target, args.data, num_conversations=args.num_conversations, max_length=args.max_length,
                          validation_fraction=0.0, seed=0, adapter=args.adapter, image_root=args.image_root,
                          read=read)
    counts = token_frequencies(split.train, target.vocab_size)
    ids = draft_vocab_from_counts(counts, args.size)
    narrowed = drafter.restricted(ids)
    narrowed.save_pretrained(args.out)
    covered = float(counts[ids].sum()) / max(1, int(counts.sum()))
    print(f"{args.out}: a {drafter.drafter_type} drafter over {args.size} of {target.vocab_size} tokens, "
          f"{covered:.1%} of the {int(counts.sum()):,} answer tokens of {len(split.train)} conversations")
