"""llama.cpp with an EAGLE-3 drafter, alone and behind an n-gram lookup: tokens/s on held-out prompts (not the
bench's), to see whether a lookup in front of the drafter pays where users decode.

Rows, one `llama-server` each, all alive at once, every prompt sent to every row in a rotating order after one
warm-up request per row: `vanilla` (plain decoding), `pld` (llama.cpp's n-gram lookup alone, its defaults), `chain`
(the drafter's chain `--chain N/PMIN`) and one `chain+lookup N/M` per `--lookup` setting (`ngram-simple` first, the
drafter where it finds nothing: `with_lookup`). Per row: the median over prompts of
its tokens/s over vanilla's on the same prompt (wall time per request, prompt processing included, as the bench
times it), llama.cpp's accepted / drafted tokens, and how many answers equal vanilla's token for token.

    python -m mmvsd_studies.heldout_prompts --chat 20 --math 20 --code 20 --out h60.jsonl
    python benchmarks/bench_llamacpp_lookup.py --prompt-file h60.jsonl --every 2 \\
        --lookup 2/4,2/8,3/4,3/8,4/4,4/8 --out lookup.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from contextlib import ExitStack
from pathlib import Path

import torch

from mmvsd.decoding.decode import DecodeConfig
from mmvsd.drafters.export_spec import drafter_folder
from mmvsd.engines.llamacpp_bench import NGRAM_ARGS, EngineResult, ServerGenerate, chain_args
from mmvsd.engines.llamacpp_server import LlamaServer
from mmvsd.layouts.export import export_drafter
from mmvsd.prompts import load_eval_prompts, prompt_domains
from mmvsd.target_loader import load_target, target_gguf_file


def with_lookup(draft: list[str], lookup: str) -> list[str]:
    """A drafter row's server arguments `draft` (`-md FILE --spec-type TYPE ...`) with llama.cpp's n-gram lookup
    ahead of its drafter, for `lookup` = N/M: `ngram-simple` finds the latest earlier occurrence of the last N tokens
    and drafts the M that followed it; llama.cpp runs a draftless type first and the drafter where it finds nothing."""
    n, _, m = lookup.partition("/")
    if not (n.isdigit() and m.isdigit() and int(n) >= 1 and int(m) >= 1):
        raise SystemExit(f"--lookup {lookup!r}: give N/M, N >= 1 tokens looked up and M >= 1 drafted")
    args = list(draft)
    spec = args.index("--spec-type") + 1
    args[spec] = f"ngram-simple,{args[spec]}"
    return [*args, "--spec-ngram-simple-size-n", n, "--spec-ngram-simple-size-m", m]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--drafter", default="eagle3-accept", help="an EAGLE-3 drafter folder or shipped name")
    p.add_argument("--prompt-file", required=True, help="held-out prompts (JSONL, with `domain` for rows per domain)")
    p.add_argument("--every", type=int, default=1, help="take every k-th prompt of the file")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--chain", default="1/0.7", help="the drafter's chain, N/PMIN (as `mmvsd bench --chain`)")
    p.add_argument("--lookup", default="2/4,2/8,3/4,3/8,4/4,4/8", help="N/M settings, comma-separated")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", default="bench-lookup", help="folder for the exported GGUF drafter")
    p.add_argument("--out", default="")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    target = load_target(args.target, torch.float32, "cpu")  # tokenizes and exports: no decoding here
    prompts = load_eval_prompts(target, args.prompt_file)[:: args.every]
    domains = prompt_domains(args.prompt_file)[:: args.every]
    domains = domains if any(domains) else []  # rows per domain where the prompt file names them
    gguf = Path(args.work) / f"{Path(args.drafter).name}.gguf"
    if not gguf.is_file():
        export_drafter(drafter_folder(args.drafter, args.target), "gguf", gguf, target=target)
    draft = ["-md", str(gguf), "--spec-type", "draft-eagle3", *chain_args(args.chain)]
    rows = {"vanilla": [], "pld": list(NGRAM_ARGS), "chain": draft}
    rows |= {f"chain+lookup {lookup}": with_lookup(draft, lookup) for lookup in args.lookup.split(",")}
    model = target_gguf_file(args.target)
    records: dict[str, list[EngineResult]] = {name: [] for name in rows}
    config = DecodeConfig(max_new_tokens=args.max_new_tokens)
    with ExitStack() as stack:
        servers = {name: ServerGenerate(stack.enter_context(LlamaServer(model, extra, threads=args.threads)))
                   for name, extra in rows.items()}
        for server in servers.values():  # warm-up: not counted
            server.one(prompts[0].token_ids, DecodeConfig(max_new_tokens=16))
        names = list(rows)
        for index, prompt in enumerate(prompts):
            for name in names[index % len(names):] + names[: index % len(names)]:  # rotate who goes first
                records[name].append(servers[name].one(prompt.token_ids, config))
            print(f"prompt {index + 1}/{len(prompts)}" + (f" ({domains[index]})" if domains else ""), flush=True)
    summary = summarise(records, domains)
    for name, row in summary.items():
        print(f"{name:22s} " + "  ".join(f"{scope} {cells['speedup']:.2f}x" for scope, cells in row.items())
              + f"  (vanilla {row['all']['vanilla_tokens_per_s']:.1f} tok/s; accepted {row['all']['accepted']} of "
              f"{row['all']['drafted']}; equal to vanilla {row['all']['equal']}/{row['all']['prompts']})")
    if args.out:
        result = {"settings": vars(args), "machine": platform.processor() or platform.machine(),
                  "domains": domains, "summary": summary,
                  "records": {name: [{"seconds": r.wall_seconds, "drafted": r.num_drafted, "accepted":
                                      r.num_draft_accepted, "num_tokens": len(r.output_ids)} for r in rs]
                              for name, rs in records.items()}}
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def summarise(records: dict[str, list[EngineResult]], domains: list[str]) -> dict[str, dict[str, dict]]:
    """Per row and scope ("all" and each domain of `domains`, [] for none): the median over prompts of the row's
    tokens/s over vanilla's, vanilla's median tokens/s, the drafts, and how many answers equal vanilla's."""
    base = records["vanilla"]
    scopes = {"all": list(range(len(base)))}
    scopes |= {d: [i for i, dd in enumerate(domains) if dd == d] for d in sorted(set(domains))}
    out = {}
    for name, rows in records.items():
        out[name] = {}
        for scope, keep in scopes.items():
            rates = [rows[i].tokens_per_second for i in keep]
            base_rates = [base[i].tokens_per_second for i in keep]
            out[name][scope] = {
                "speedup": statistics.median(r / b for r, b in zip(rates, base_rates)),
                "tokens_per_s": statistics.median(rates), "vanilla_tokens_per_s": statistics.median(base_rates),
                "drafted": sum(rows[i].num_drafted for i in keep),
                "accepted": sum(rows[i].num_draft_accepted for i in keep),
                "equal": sum(rows[i].output_ids == base[i].output_ids for i in keep), "prompts": len(keep)}
    return out


if __name__ == "__main__":
    main()
