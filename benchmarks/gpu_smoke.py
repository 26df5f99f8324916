"""One command for a lent GPU: is decoding lossless there, does training run with 1 and 2 processes, how fast.

    python benchmarks/gpu_smoke.py --out $OUT/smoke            # on a GPU machine (the `device` tool's $OUT)
    python benchmarks/gpu_smoke.py --device cpu --out /tmp/smoke  # the same steps on a CPU (a dry check)

Steps, each through the command line as a user runs it (SmolLM2-135M, its shipped drafter):
1. `mmvsd bench --suite text --limit 2 --methods vanilla,tree` in bf16: every tree output must equal vanilla's,
   token for token (bf16 against bf16 vanilla; bf16 is not fp32's output, docs/gpu-llava.md);
2. `mmvsd train` for a few bf16 steps in one process, then `accelerate launch --multi_gpu --num_processes 2` with
   half the batch each (skipped with fewer than 2 GPUs; on a CPU, 2 gloo processes); the two drafters must agree
   to bf16 training's tolerance, as one global batch.
Writes `smoke.json` (device, versions, timings, verdicts) into --out and exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

TRAIN = ["--target", "smollm2-135m", "--data", "sharegpt", "num_conversations=64", "max_length=512", "max_steps=6",
         "save_every=6", "progress=false", "validation_fraction=0", "precision=bf16", "target_dtype=bf16",
         "learning_rate=1e-4", "warmup_ratio=0"]


def run(command: list[str], env: dict | None = None) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})}, check=False)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
    return time.perf_counter() - start, done


def decoding(out: Path, device: str) -> dict:
    seconds, done = run([sys.executable, "-m", "mmvsd", "bench", "--no-progress", "--target", "smollm2-135m",
                         "--suite", "text", "--limit", "2", "--max-new-tokens", "96", "--methods", "vanilla,tree",
                         "--device", device, "--dtype", "bf16", "--out", str(out / "bench")])
    if done.returncode != 0:
        return {"ok": False, "seconds": seconds, "error": done.stderr[-2000:]}
    results = json.loads((out / "bench" / "results.json").read_text())
    keys = ("benchmark", "method", "tokens_per_second", "sr", "tau")
    rows = [{k: row.get(k) for k in keys} for row in results["rows"]]
    return {"ok": not results["mismatches"], "seconds": round(seconds, 1), "mismatches": results["mismatches"],
            "rows": rows}


def training(out: Path, device: str, processes: int) -> dict:
    folder = out / f"train-{processes}"
    per_process = 4 // processes
    args = ["train", *TRAIN, f"batch_size={per_process}", "--output", str(folder)]
    env = {"ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"} if device == "cpu" else {}
    if processes == 1:
        command = [sys.executable, "-m", "mmvsd", *args]
    else:
        command = [str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu", "--num_processes",
                   str(processes), "--num_machines", "1", "--mixed_precision", "bf16", "--dynamo_backend", "no",
                   "-m", "mmvsd", *args]
    seconds, done = run(command, env)
    return {"ok": done.returncode == 0, "seconds": round(seconds, 1), "folder": str(folder)}


def same_drafter(one: Path, two: Path) -> dict:
    a, b = load_file(str(one / "model.safetensors")), load_file(str(two / "model.safetensors"))
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    return {"ok": worst < 2e-2, "max_abs_difference": worst}  # bf16 autocast: reductions differ in order


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count() if args.device != "cpu" else 0
    report = {"device": torch.cuda.get_device_name(0) if gpus else platform.processor() or "cpu", "gpus": gpus,
              "torch": torch.__version__, "cuda": torch.version.cuda, "decoding": decoding(args.out, args.device)}
    report["train_1"] = training(args.out, args.device, 1)
    if gpus >= 2 or args.device == "cpu":
        report["train_2"] = training(args.out, args.device, 2)
        if report["train_1"]["ok"] and report["train_2"]["ok"]:
            report["same_drafter"] = same_drafter(Path(report["train_1"]["folder"]), Path(report["train_2"]["folder"]))
    else:
        report["train_2"] = {"ok": True, "skipped": f"{gpus} GPU(s): 2 processes need 2"}
    checks = [value["ok"] for value in report.values() if isinstance(value, dict) and "ok" in value]
    report["ok"] = all(checks)
    (args.out / "smoke.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "decoding"}, indent=2))
    print("decoding:", json.dumps(report["decoding"].get("rows"), indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
