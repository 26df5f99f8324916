"""`mmvsd eval-drafter`: a drafter's exact T=0 acceptance on prompts, by replaying the target's greedy continuations
(mmvsd.eval.acceptance) instead of decoding."""

from __future__ import annotations

import argparse
import json
import time

from mmvsd.errors import UserError
from mmvsd.files import atomic_file
from mmvsd.placement import add_placement_arguments, positive_int
from mmvsd.tree_options import add_ngram_argument, add_tree_arguments, tree_for_prompts, tree_spec_from_args


def add_eval_drafter_command(sub: argparse._SubParsersAction) -> None:
    """`mmvsd eval-drafter` (entry point `mmvsd.commands`)."""
    p = sub.add_parser("eval-drafter", help="exact T=0 acceptance (tau) of a drafter on prompts, without a decode loop",
                       description="Replays the target's greedy continuation of each prompt (generated once, cached) "
                                   "with one target forward; tau equals `mmvsd generate`'s at T=0 with the same tree.")
    p.add_argument("--target", required=True, help="built-in name, local folder, .gguf file or HF id")
    p.add_argument("--drafter", help="as for generate (default: the target's shipped drafter)")
    p.add_argument("--prompt-file", required=True,
                   help="JSONL file ('prompt' or MT-Bench 'turns' per line), a built-in benchmark: mt_bench, "
                        "humaneval, gsm8k (first user turns), or an image task with its images, e.g. "
                        "vqav2_val_mini_long (an lmms-eval task or one of mmvsd's offline minis)")
    p.add_argument("--adapter", default="", help="modality adapter that feeds image tasks' images (default: the "
                                                 "first registered one that fits the target)")
    p.add_argument("--limit", type=int, default=0, help="first N prompts (0: all)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    add_tree_arguments(p, default="paper")
    add_ngram_argument(p, "n-gram branches in the trees, as for generate")
    p.add_argument("--batch-size", type=positive_int,
                   help="prompts replayed together (default 8; 1 with n-gram branches, whose statistics a batch's "
                        "rows share, so that tau is generate's at its default batch size 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cache", action="store_true", help="generate the greedy continuations again")
    p.add_argument("--json", help="write the report (per-prompt tau, acceptance by depth, ties) to this file")
    add_placement_arguments(p)
    p.set_defaults(handler=run_eval_drafter)


def check_eval_drafter_args(args: argparse.Namespace) -> tuple[str, str]:
    """The tree spec and the drafter spec, once every input is checked that can be without a target (UserError)."""
    from mmvsd.adapters import check_adapter  # CLI start-up: loaded per command
    from mmvsd.drafters.spec import check_drafter_spec  # CLI start-up: loaded per command
    from mmvsd.prompts import check_eval_prompts  # CLI start-up: loaded per command
    from mmvsd.shipped import implicit_drafter_spec  # CLI start-up: loaded per command

    tree = tree_spec_from_args(args)
    spec = args.drafter or implicit_drafter_spec(args.target)
    if spec == "none":
        raise UserError("--drafter none drafts nothing: there is no acceptance to measure")
    check_drafter_spec(spec, args.target, args.ngram)
    check_eval_prompts(args.prompt_file, args.limit)
    check_adapter(args.adapter)
    return tree, spec


def run_eval_drafter(args: argparse.Namespace) -> None:
    """`mmvsd eval-drafter`: greedy continuations (cached), then the replayed acceptance report."""
    from mmvsd.decoding.decode import make_shape  # CLI start-up: loaded per command
    from mmvsd.decoding.engines import DEFAULT_ENGINE, get_engine  # CLI start-up: loaded per command
    from mmvsd.decoding.tree import TreeShape  # CLI start-up: loaded per command
    from mmvsd.drafters.spec import drafter_from_spec  # CLI start-up: loaded per command
    from mmvsd.eval import acceptance  # CLI start-up: loaded per command
    from mmvsd.prompts import load_eval_prompts, prompt_domains  # CLI start-up: loaded per command

    tree, spec = check_eval_drafter_args(args)
    target = get_engine(DEFAULT_ENGINE).load_target(args.target, args.dtype, args.device)
    drafter = drafter_from_spec(spec, target, args.seed, ngram=args.ngram)
    prompts = load_eval_prompts(target, args.prompt_file, args.limit, args.adapter)
    # the trees auto plans from this machine's costs; its speed guard's plain steps are not replayed
    shape = make_shape(tree_for_prompts(tree, prompts), target, drafter)
    acceptance.check_eval_prompts(target, prompts, args.max_new_tokens, shape)
    start = time.perf_counter()
    make = acceptance.greedy_continuations if args.no_cache else acceptance.cached_greedy_continuations
    continuations = make(target, prompts, args.max_new_tokens, args.batch_size or 8)
    print(f"greedy continuations: {len(prompts)} prompts, {time.perf_counter() - start:.1f} s", flush=True)
    learns = drafter.proposes_from_context or not isinstance(shape, TreeShape)  # statistics shared by a batch
    batch_size = args.batch_size or (1 if learns else 8)
    report = acceptance.evaluate_acceptance(target, drafter, prompts, continuations, shape, batch_size, progress=True)
    domains = prompt_domains(args.prompt_file, args.limit)
    domains = domains if any(domains) else []  # figures per domain where the prompt file names them
    print(acceptance.format_report(report, domains))
    if args.json:
        with atomic_file(args.json) as handle:
            json.dump({"target": args.target, "drafter": spec, "prompt_file": args.prompt_file, "limit": args.limit,
                       "max_new_tokens": args.max_new_tokens, **report.to_dict(),
                       **({"by_domain": report.by_group(domains)} if domains else {})}, handle, indent=2)
