"""`mmvsd lab build-target smol-llava`: the lab's command, added to mmvsd's command line through the entry-point
group `mmvsd.commands` (studies/pyproject.toml). Light at import (outside `mmvsd_studies.lab`, whose entry module
loads torch): mmvsd builds its parser with it on every start."""

from __future__ import annotations

import argparse
from pathlib import Path

from mmvsd.errors import UserError


def add_lab_command(sub: argparse._SubParsersAction) -> None:
    """The `mmvsd.commands` entry point: add `lab` and its `build-target` subcommand, handled by `run_lab`."""
    p = sub.add_parser("lab", help="build the embedded CPU targets (smol-llava; the studies plugin)")
    lab = p.add_subparsers(dest="lab_command", required=True)
    b = lab.add_parser("build-target", help="train smol-llava's projector on the CPU and install it in the mmvsd cache",
                       description="Assemble smol-llava (EfficientNet-Lite0 + SmolLM2-135M) and train its projector "
                                   "within the time budget; --target smol-llava then uses it.")
    b.add_argument("name", choices=["smol-llava"])
    b.add_argument("--minutes", type=float, default=28.0, help="time budget of the whole build (default 28)")
    b.add_argument("--max-steps", type=int, default=0, help="stop after N steps instead of at the time budget")
    b.add_argument("--num-images", type=int, default=2400, help="generated training images (default 2400)")
    b.add_argument("--easy-vqa-images", type=int, default=4000,
                   help="easy-vqa train images among the training conversations (default 4000, all; 0: none)")
    b.add_argument("--plain-images", type=int, default=800,
                   help="images of one large shape on a plain background in the generator's colours (default 800)")
    b.add_argument("--align-steps", type=int, default=800, help="steps of the first stage (per-patch word targets)")
    b.add_argument("--lora-rank", type=int, default=8,
                   help="rank of the language model's low-rank adapters trained in the second stage "
                        "(0: projector only)")
    b.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                   help="second-stage compute type (auto: bf16 where this CPU measures it faster)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--output", help="projector folder (default: the mmvsd cache, which --target smol-llava uses)")
    p.set_defaults(handler=run_lab)


def run_lab(args: argparse.Namespace) -> None:
    """`mmvsd lab build-target smol-llava`: train the projector and say where it went."""
    from mmvsd.targets.smol_llava import built_projector_dir  # CLI start-up: torch only when it runs
    from mmvsd_studies.lab.projector_training import (  # CLI start-up: torch and timm only when it runs
        ProjectorTraining,
        build_projector,
    )

    counts = (args.max_steps, args.align_steps, args.lora_rank, args.easy_vqa_images, args.plain_images)
    if min(counts) < 0 or args.minutes <= 0 or args.num_images < 1:
        raise UserError("--minutes must be > 0, --num-images >= 1, --max-steps, --align-steps, --lora-rank, "
                        "--easy-vqa-images and --plain-images >= 0")
    settings = ProjectorTraining(minutes=args.minutes, max_steps=args.max_steps, num_images=args.num_images,
                                 easy_vqa_images=args.easy_vqa_images, plain_images=args.plain_images,
                                 align_steps=args.align_steps,
                                 lora_rank=args.lora_rank, precision=args.precision, seed=args.seed)
    output = Path(args.output) if args.output else built_projector_dir()
    build_projector(settings, output)
    print(f"smol-llava projector written to {output}"
          + ("; --target smol-llava now uses it" if not args.output else ""))
