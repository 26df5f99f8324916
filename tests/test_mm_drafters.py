"""MSD and ViSpec drafters on a tiny random LLaVA: where ViSpec puts its image tokens and global
feature, incremental drafting equal to the full-sequence pass, training on conversations with images
(ce and vsd), lossless tree decoding with image prompts, and the image limit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import save_tiny_llava, write_sharegpt
from mmvsd.adapter_base import Prompt
from mmvsd.adapters import adapter_for
from mmvsd.cli import main
from mmvsd.decoding.decode import DecodeConfig, speculative_generate, vanilla_generate
from mmvsd.decoding.kv import sequence_block
from mmvsd.decoding.tree import TreeShape
from mmvsd.drafter_base import DraftInputs, PairMedia, drafter_class, load_drafter
from mmvsd.drafters.vispec import ViSpecConfig, ViSpecDrafter
from mmvsd.errors import UserError
from mmvsd.target_loader import load_target
from mmvsd.training.config import TrainConfig
from mmvsd.training.sources import curriculum_indices
from mmvsd.training.trainer import train

QUESTIONS = ["w5 w6 w7", "w8 w9", "w10 w11 w12"]


def make_vispec(target, num_q: int) -> ViSpecDrafter:
    base = drafter_class("vispec").from_target(target, seed=2)
    config = ViSpecConfig(**{**base.config.__dict__, "num_q": num_q})
    drafter = ViSpecDrafter(config, target.input_embeddings, target.model.get_output_embeddings())
    torch.manual_seed(3)
    drafter.reset_parameters()
    with torch.no_grad():  # a non-trivial img_fc, so the global feature changes the text inputs
        drafter.img_fc.weight.add_(0.3 * torch.randn_like(drafter.img_fc.weight))
    return drafter.eval()


def step0(drafter, features, next_ids, media, cache=None):
    """The drafter's first step over whole sequences, as training and the E-step run it."""
    batch, width = next_ids.shape
    cache = cache or drafter.new_cache(batch, "cpu")
    depths, causal = sequence_block(batch, width, "cpu")
    return drafter.read_target(features, next_ids, cache.positions(depths), cache.attention_mask(causal, torch.float32),
                               cache, media=media), cache


def reference_vispec_row(drafter: ViSpecDrafter, features, next_ids, embeds, spans: list[tuple[int, int]]):
    """ViSpec computed the paper's way for one row: compress each image span, run the layer causally
    over the compressed sequence at the original positions, and return outputs at the kept pairs."""
    size, num_tokens = drafter.config.hidden_size, drafter.config.num_q - 1
    g = torch.zeros(size)
    inputs, positions, globals_ = [], [], []
    boundaries = {first: last for first, last in spans}
    t = 0
    while t < len(next_ids):
        if t in boundaries:
            last = boundaries[t]
            adapted = drafter.imadpt(embeds[t : last + 1])
            inputs += list(adapted[:-1])
            positions += list(range(last + 1 - num_tokens, last + 1))
            g = adapted[-1]
            globals_ += [g] * num_tokens
            t = last + 1
            continue
        text_hidden = drafter.img_fc(torch.cat([features[t], g]))
        inputs.append(drafter.fc(torch.cat([drafter.embed_tokens(next_ids[t]), text_hidden])))
        positions.append(t)
        globals_.append(g)
        t += 1
    x = torch.stack(inputs)[None]
    n = x.shape[1]
    mask = torch.zeros(n, n).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
    out = drafter.layers[0](x, torch.tensor(positions)[None], mask[None, None], None)
    return out[0], positions, torch.stack(globals_)


@torch.no_grad()
def test_vispec_compresses_each_image_span_as_the_paper_says(llava_target):
    drafter = make_vispec(llava_target, num_q=3)  # 2 image tokens + 1 global feature per image
    size = drafter.config.hidden_size
    torch.manual_seed(0)
    width = 40
    features = torch.randn(2, width, size)
    next_ids = torch.randint(5, 100, (2, width))
    embeds = torch.randn(2, width, size)
    span_ids = torch.full((2, width), -1)
    spans = [(3, 18), (19, 34)]  # two adjacent images in row 0; row 1 is text only
    for index, (first, last) in enumerate(spans):
        span_ids[0, first : last + 1] = index
    out, cache = step0(drafter, features, next_ids, PairMedia(embeds, span_ids))
    expected, kept, expected_globals = reference_vispec_row(drafter, features[0], next_ids[0], embeds[0], spans)
    assert kept[:5] == [0, 1, 2, 17, 18]  # the image tokens sit at the END of each span
    assert torch.allclose(out[0, kept, :size], expected, atol=1e-5)
    assert torch.allclose(out[0, kept, size:], expected_globals, atol=1e-6)  # state = [hidden ; g]
    assert torch.count_nonzero(out[0, :3, size:]) == 0  # before the first image, g = 0
    text_only, _ = reference_vispec_row(drafter, features[1], next_ids[1], embeds[1], [])[:2]
    assert torch.allclose(out[1, :, :size], text_only, atol=1e-5)
    cache.keep(*[torch.arange(width).expand(2, -1), torch.tensor([width, width])])
    dropped = torch.zeros(width, dtype=torch.bool)
    dropped[3:17], dropped[19:33] = True, True
    assert torch.equal(cache.hidden_slots[0], dropped) and not cache.hidden_slots[1].any()


@pytest.mark.parametrize("name", ["msd", "vispec"])
@torch.no_grad()
def test_incremental_drafting_equals_the_full_sequence_pass(llava_target, name):
    """Prefill in two chunks (hidden entries and the global feature carried by the cache) = one pass."""
    drafter = make_vispec(llava_target, 2) if name == "vispec" else drafter_class(name).from_target(llava_target).eval()
    size = drafter.config.hidden_size
    torch.manual_seed(1)
    features, next_ids, embeds = torch.randn(1, 30, size), torch.randint(5, 100, (1, 30)), torch.randn(1, 30, size)
    span_ids = torch.full((1, 30), -1)
    span_ids[0, 4:20] = 0
    media = PairMedia(embeds, span_ids)
    whole, _ = step0(drafter, features, next_ids, media)
    session = drafter.new_session(1)
    chunks = []
    for first, last in ((0, 23), (23, 30)):
        part = PairMedia(embeds[:, first:last], span_ids[:, first:last])
        session.advance(DraftInputs(features[:, first:last], next_ids[:, first:last], torch.tensor([last - first]),
                                    part))
        chunks.append(session.last_hidden)
    assert torch.allclose(chunks[0], whole[:, 22], atol=1e-5)
    assert torch.allclose(chunks[1], whole[:, 29], atol=1e-5)


def write_image_conversations(target, folder: Path, answers_from_target: bool) -> Path:
    """LLaVA-Instruct records over images of different sizes (+ two text-only ones) in `folder`."""
    rng = np.random.default_rng(5)
    adapter = adapter_for(target, "image")
    records = []
    for index in range(6):
        name = f"train-{index}.png"
        Image.fromarray((rng.random((24 + 8 * index, 40, 3)) * 255).astype("uint8")).save(folder / name)
        question = QUESTIONS[index % len(QUESTIONS)]
        if answers_from_target:
            prompt = adapter.encode(target, question, [folder / name])
            answer = target.decode(vanilla_generate(target, [prompt], DecodeConfig(24))[0].output_ids)
        else:
            answer = " ".join(f"w{j}" for j in rng.integers(5, 100, 12))
        records.append({"id": str(index), "image": name, "conversations": [
            {"from": "human", "value": f"<image>\n{question}"}, {"from": "gpt", "value": answer}]})
    for index in range(2):
        records.append({"id": f"text-{index}", "conversations": [
            {"from": "human", "value": "w13 w14"}, {"from": "gpt", "value": "w15 w16 w17 w18"}]})
    path = folder / "llava_instruct.json"
    path.write_text(json.dumps(records))
    return path


def train_config(llava_dir: Path, data: Path, out: Path, drafter: str, objective: str, steps: int) -> TrainConfig:
    config = TrainConfig(target=str(llava_dir), drafter=drafter, data=f"llava-instruct:{data}", output=str(out),
                         objective=objective, max_steps=steps, batch_size=4, learning_rate=3e-3, warmup_ratio=0.0,
                         validation_fraction=0.0, progress=False, save_every=1000, max_length=128)
    config.loss.ttt_steps, config.loss.num_samples, config.loss.path_length = 3, 4, 3
    return config


@pytest.fixture(scope="module")
def mild_llava(tmp_path_factory) -> tuple[Path, object]:
    """A tiny LLaVA whose image embeddings are ~8x the text ones (not the default ~60x), as drafters meet them
    in real LLaVAs; its image prompts still change every answer (tested below)."""
    folder = save_tiny_llava(tmp_path_factory.mktemp("mild-llava"), projector_scale=1.0)
    return folder, load_target(str(folder))


@pytest.fixture(scope="module")
def mm_data(mild_llava) -> Path:
    """Image conversations whose answers are the target's own greedy answers."""
    folder, target = mild_llava
    return write_image_conversations(target, folder, answers_from_target=True)


@pytest.fixture(scope="module")
def fitted(mild_llava, mm_data, tmp_path_factory):
    """MSD and ViSpec drafters trained (ce) on the target's own answers about the images."""
    folder, target = mild_llava
    out = tmp_path_factory.mktemp("mm-train")
    drafters = {}
    for name in ("msd", "vispec"):
        config = train_config(folder, mm_data, out / name, name, "ce", 150)
        config.learning_rate = 1e-2
        drafters[name] = load_drafter(train(config, target=target), target)
    return drafters


def image_prompts(target, folder: Path) -> list[Prompt]:
    adapter = adapter_for(target, "image")
    return [adapter.encode(target, QUESTIONS[0], [folder / "train-0.png"]),
            adapter.encode(target, QUESTIONS[1], [folder / "train-4.png"]),
            adapter.encode(target, QUESTIONS[2], [folder / "train-2.png"]),
            Prompt(target.encode_prompt("w13 w14"))]


def test_the_images_drive_the_answers(mild_llava, mm_data):
    _, target = mild_llava
    prompts = image_prompts(target, mm_data.parent)[:3]
    with_images = vanilla_generate(target, prompts, DecodeConfig(24))
    without = vanilla_generate(target, [p.token_ids for p in prompts], DecodeConfig(24))
    assert all(a.output_ids != b.output_ids for a, b in zip(with_images, without))


@pytest.mark.parametrize("name", ["msd", "vispec"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_tree_decoding_with_images_is_lossless(fitted, mild_llava, mm_data, name, batch_size):
    _, target = mild_llava
    prompts = image_prompts(target, mm_data.parent)
    config = DecodeConfig(24, tree=TreeShape(12, 4, 3))
    expected = [r.output_ids for r in vanilla_generate(target, prompts, config)]
    results = []
    for start in range(0, len(prompts), batch_size):
        results += speculative_generate(target, fitted[name], prompts[start:start + batch_size], config)
    assert [r.output_ids for r in results] == expected
    accepted = [length for r in results[:3] for length in r.accept_lengths]
    assert sum(accepted) / len(accepted) > 1.3  # the drafter really drafts: the check is not vacuous


@pytest.mark.parametrize("name", ["msd", "vispec"])
def test_sampled_tree_decoding_with_images_runs(fitted, mild_llava, mm_data, name):
    _, target = mild_llava
    prompts = image_prompts(target, mm_data.parent)
    config = DecodeConfig(16, temperature=1.0, seed=4, tree=TreeShape(12, 4, 3))
    results = speculative_generate(target, fitted[name], prompts, config)
    assert all(len(r.output_ids) > 0 for r in results)


@pytest.mark.parametrize("objective", ["ce", "vsd", "vsd-kl", "accept", "vsd-rloo"])
@pytest.mark.parametrize("name", ["msd", "vispec"])
def test_drafters_train_on_image_conversations(llava_dir, llava_target, tmp_path, name, objective):
    data = write_image_conversations(llava_target, tmp_path, answers_from_target=False)
    out = train(train_config(llava_dir, data, tmp_path / "out", name, objective, 3), target=llava_target)
    drafter = load_drafter(out, llava_target)
    assert drafter.drafter_type == name
    fresh = drafter_class(name).from_target(llava_target)
    assert not torch.equal(drafter.fc.weight, fresh.fc.weight.to(drafter.fc.weight.dtype))


@torch.no_grad()
def test_saved_drafters_reload_with_identical_draft_logits(fitted, mild_llava, tmp_path):
    _, target = mild_llava
    for name, drafter in fitted.items():
        drafter.save_pretrained(tmp_path / name)
        again = load_drafter(tmp_path / name, target)
        size = drafter.config.hidden_size
        features, next_ids = torch.randn(1, 20, size), torch.randint(5, 100, (1, 20))
        span_ids = torch.full((1, 20), -1)
        span_ids[0, 2:18] = 0
        media = PairMedia(torch.randn(1, 20, size), span_ids)
        before = drafter.draft_logprobs(step0(drafter, features, next_ids, media)[0])
        after = again.draft_logprobs(step0(again, features, next_ids, media)[0])
        assert torch.equal(before, after)


@pytest.mark.parametrize("name", ["msd", "vispec"])
def test_a_narrowed_drafter_drafts_over_its_answers_tokens_and_stays_lossless(fitted, mild_llava, mm_data, tmp_path,
                                                                              capsys, name):
    folder, target = mild_llava
    fitted[name].save_pretrained(tmp_path / "full")
    code = main(["draft-vocab", "--target", str(folder), "--drafter", str(tmp_path / "full"), "--data",
                 f"llava-instruct:{mm_data}", "--size", "48", "--out", str(tmp_path / "narrow")])
    assert code == 0
    assert "drafter over 48 of 128 tokens" in capsys.readouterr().out
    full, narrow = fitted[name], load_drafter(tmp_path / "narrow", target)
    ids = narrow.draft_vocab_target_ids()
    assert ids.tolist() == sorted(set(ids.tolist())) and ids.numel() == 48
    answers = [t for conv in json.loads(mm_data.read_text()) for t in target.tokenizer.encode(
        conv["conversations"][1]["value"], add_special_tokens=False)]
    counts = torch.bincount(torch.tensor(answers), minlength=target.vocab_size)
    assert set(torch.sort(-counts, stable=True).indices[:20].tolist()) <= set(ids.tolist())  # the most frequent kept
    with torch.no_grad():  # the same weights: log-softmax of the full logits over the kept rows
        hidden = torch.randn(3, full.config.hidden_size * (2 if name == "vispec" else 1))
        expected = torch.log_softmax(full.draft_logits(hidden).float()[:, ids], dim=-1)
        torch.testing.assert_close(narrow.draft_logprobs(hidden), expected)
    assert torch.equal(narrow.draft_to_target(torch.tensor([0, 47])), ids[[0, 47]])
    prompts = image_prompts(target, mm_data.parent)
    config = DecodeConfig(24, tree=TreeShape(12, 4, 3))
    expected_ids = [r.output_ids for r in vanilla_generate(target, prompts, config)]
    results = speculative_generate(target, narrow, prompts, config)
    assert [r.output_ids for r in results] == expected_ids
    accepted = [length for r in results[:3] for length in r.accept_lengths]
    assert sum(accepted) / len(accepted) > 1.3


def test_draft_vocab_refuses_a_drafter_with_a_head_of_its_own(llava_dir, llava_target, tmp_path, capsys):
    drafter_class("eagle3").from_target(llava_target, draft_vocab_size=64).save_pretrained(tmp_path / "e3")
    data = write_sharegpt(tmp_path / "chats.json", num=2)  # checked before the target loads: it must be there
    args = ["draft-vocab", "--target", str(llava_dir), "--data", str(data), "--out", str(tmp_path / "o")]
    assert main(args + ["--drafter", str(tmp_path / "e3"), "--size", "32"]) == 2
    assert "head of its own" in capsys.readouterr().err  # said before the data is counted
    assert main(args + ["--drafter", str(tmp_path / "e3"), "--size", "1000"]) == 2
    assert "exceeds" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_msd_takes_one_image_per_prompt(fitted, mild_llava, llava_dir):
    _, target = mild_llava
    two_images = adapter_for(target, "image").encode(target, "w5", [llava_dir / "a.png", llava_dir / "b.png"])
    with pytest.raises(UserError, match="2 images in one prompt, but this MSD drafter takes at most 1"):
        speculative_generate(target, fitted["msd"], [two_images], DecodeConfig(4))
    speculative_generate(target, fitted["vispec"], [two_images], DecodeConfig(4))  # ViSpec takes any number


def test_msd_reads_image_embeddings_at_its_media_rms(llava_target):
    drafter = drafter_class("msd").from_target(llava_target, seed=2).eval()
    assert drafter.config.media_rms == 1.0
    torch.manual_seed(0)
    size = llava_target.hidden_size
    features, next_ids = torch.randn(1, 6, size), torch.randint(0, 50, (1, 6))
    span_ids = torch.tensor([[-1, 0, 0, 0, -1, -1]])
    embeds = torch.randn(1, 6, size)

    def out(scale):
        with torch.no_grad():
            return step0(drafter, features, next_ids, PairMedia(embeds * scale, span_ids))[0]

    assert torch.allclose(out(1.0), out(50.0), atol=1e-5)  # the scale of the projector's output is taken out
    drafter.config.media_rms = None  # MSD as released: the raw embeddings, whose scale the layer sees
    assert not torch.allclose(out(1.0), out(50.0), atol=1e-3)


def test_training_examples_carry_the_projected_image(llava_target, tmp_path):
    from mmvsd.training.dataset import load_examples
    from mmvsd.training.features import collate
    from mmvsd.training.media import embed_batch, media_adapter

    data = write_image_conversations(llava_target, tmp_path, answers_from_target=False)
    split = load_examples(llava_target, f"llava-instruct:{data}", num_conversations=0, max_length=128,
                          validation_fraction=0.0, seed=0, progress=False)
    example = next(ex for ex in split.train if ex.media)
    image_id = llava_target.model.config.image_token_id
    positions = [i for i, token in enumerate(example.input_ids) if token == image_id]
    assert len(positions) == 16 and positions == list(range(positions[0], positions[0] + 16))
    assert not any(example.loss_mask[i] for i in positions) and any(example.loss_mask)
    tokens = embed_batch(llava_target, media_adapter(llava_target), collate([example]), [example])
    processor, model = llava_target.processor, llava_target.model
    pixels = processor.image_processor(Image.open(example.media[0]).convert("RGB"), return_tensors="pt")
    with torch.no_grad():
        expected = model.model.get_image_features(
            pixel_values=pixels["pixel_values"], vision_feature_layer=model.config.vision_feature_layer,
            vision_feature_select_strategy=model.config.vision_feature_select_strategy).pooler_output[0]
    assert torch.allclose(tokens.inputs_embeds[0, positions], expected, atol=1e-6)
    assert tokens.span_ids[0, positions].eq(0).all() and (tokens.span_ids[0] >= 0).sum() == 16


def test_msd_curriculum_is_text_first_then_media():
    is_media = [False] * 10 + [True] * 10
    batches = [curriculum_indices(is_media, 4, 0, step, 100) for step in range(100)]
    assert all(not is_media[i] for batch in batches[:50] for i in batch)
    assert all(is_media[i] for i in batches[-1])
    late = sum(is_media[i] for batch in batches[75:] for i in batch) / 100
    assert 0.6 < late < 0.95  # the media share rises linearly over the second half
    assert batches == [curriculum_indices(is_media, 4, 0, step, 100) for step in range(100)]  # resumable


def test_cli_trains_vispec_on_images_and_decodes_with_an_image(llava_dir, llava_target, tmp_path, capsys):
    data = write_image_conversations(llava_target, tmp_path, answers_from_target=False)
    out = tmp_path / "vispec"
    code = main(["train", "--target", str(llava_dir), "--drafter", "vispec", "--data", f"llava-instruct:{data}",
                 "--output", str(out), "max_steps=2", "batch_size=2", "progress=false", "validation_fraction=0",
                 "loss.ttt_steps=2"])
    assert code == 0
    code = main(["generate", "--target", str(llava_dir), "--drafter", str(out), "--image",
                 str(tmp_path / "train-1.png"), "--prompt", "w5 w6", "--max-new-tokens", "8"])
    assert code == 0


def test_cli_refuses_more_images_than_the_drafter_takes(fitted, mild_llava, llava_dir, tmp_path, capsys):
    fitted["msd"].save_pretrained(tmp_path / "msd")
    code = main(["generate", "--target", str(mild_llava[0]), "--drafter", str(tmp_path / "msd"), "--image",
                 str(llava_dir / "a.png"), "--image", str(llava_dir / "b.png"), "--prompt", "w5",
                 "--max-new-tokens", "4"])
    assert code == 2
    assert "takes at most 1" in capsys.readouterr().err


def test_text_and_image_datasets_mix(llava_target, tmp_path):
    from mmvsd.training.dataset import load_examples

    images = write_image_conversations(llava_target, tmp_path, answers_from_target=False)
    text = tmp_path / "sharegpt.json"
    text.write_text(json.dumps([{"id": "s0", "conversations": [{"from": "human", "value": "w20 w21"},
                                                                 {"from": "gpt", "value": "w22 w23 w24"}]}]))
    split = load_examples(llava_target, f"sharegpt:{text}+llava-instruct:{images}", num_conversations=3,
                          max_length=128, validation_fraction=0.0, seed=0, progress=False)
    assert len(split.train) == 4 and sum(bool(ex.media) for ex in split.train) == 3  # 3 per dataset of the mixture
    with pytest.raises(UserError, match="empty dataset in the mixture"):
        load_examples(llava_target, f"sharegpt:{text}+", num_conversations=0, max_length=128,
                      validation_fraction=0.0, seed=0, progress=False)


def test_shipped_mllm_config_is_the_papers():
    from mmvsd.training.config import load_train_config

    config = load_train_config("llava_vispec_paper", {"target": "llava-1.5-13b", "init": "vispec", "output": "o"}, [])
    assert (config.drafter, config.objective, config.num_conversations, config.epochs) == (
        "vispec", "ce+vsd", 68000, 40)
    assert (config.learning_rate, config.loss.num_samples, config.loss.path_length) == (5e-6, 40, 7)


def test_regeneration_answers_each_image_conversation_seeing_its_image(mild_llava, mm_data, tmp_path):
    """On-policy data for MLLM drafters: regeneration shows the target the image, so its answers equal those
    of decoding the same question with the image (mm_data's answers), and the cache key names the adapter."""
    from mmvsd.data.conversations import load_conversations
    from mmvsd.training.media import media_adapter
    from mmvsd.training.regenerate import read_cache, regenerate_conversations

    _, target = mild_llava
    convs = load_conversations(f"llava-instruct:{mm_data}")
    cache = tmp_path / "regen.jsonl"
    rebuilt = regenerate_conversations(target, convs, cache_path=cache, max_new_tokens=24, batch_size=3,
                                       progress=False, adapter=media_adapter(target))
    expected = {str(r["id"]): r["conversations"][1]["value"] for r in json.loads(mm_data.read_text())}
    with_image = [conv for conv in rebuilt if conv.image]
    assert len(with_image) == 6 and all(conv.turns[-1].text == expected[conv.conv_id] for conv in with_image)
    keys = {json.dumps(line["key"]) for line in map(json.loads, cache.read_text().splitlines())}
    assert len(keys) == 1 and json.loads(keys.pop())["adapter"] == media_adapter(target).name
    assert len(read_cache(cache, json.loads(cache.read_text().splitlines()[0])["key"])) == len(convs)


def test_a_mixed_dataset_regenerates_into_shards_and_resumes(mild_llava, mm_data, tmp_path):
    """Text-only shards of a dataset with images share its cache key (they failed to resume with another)."""
    from mmvsd.data.conversations import Conversation, Turn, load_conversations
    from mmvsd.training.media import media_adapter
    from mmvsd.training.regenerate_shards import RegenerateSettings, regenerate_dataset

    _, target = mild_llava
    text = [Conversation(f"t{i}", [Turn("user", f"w{i + 3} w{i + 4}"), Turn("assistant", "w9")]) for i in range(2)]
    convs = text + load_conversations(f"llava-instruct:{mm_data}")[:2]
    settings = RegenerateSettings(max_new_tokens=8, max_prompt_tokens=None, batch_size=2, shard_size=2)
    run = dict(data="mixed", settings=settings, adapter=media_adapter(target), progress=False)
    first = regenerate_dataset(target, convs, tmp_path / "regen", **run)
    again = regenerate_dataset(target, convs, tmp_path / "regen", **run)
    assert first.num_regenerated == 4 and again.num_regenerated == 0  # finished shards are skipped
    assert [c.conv_id for c in load_conversations(str(tmp_path / "regen"))] == [c.conv_id for c in convs]


@pytest.mark.parametrize("name", ["msd", "vispec"])
def test_drafters_run_against_a_bf16_target(llava_dir, name):
    """A bf16 target (training's target_dtype=bf16, whose validation tau replays with it) lends its bf16 LM
    head to an fp32 drafter: drafting casts, so evaluation and decoding run (they raised a dtype error)."""
    from mmvsd.eval.acceptance import evaluate_acceptance, greedy_continuations

    target = load_target(str(llava_dir), dtype=torch.bfloat16)
    adapter = adapter_for(target, "image")
    prompts = [adapter.encode(target, "w5 w6", [llava_dir / "a.png"]), Prompt(target.encode_prompt("w7 w8"))]
    drafter = drafter_class(name).from_target(target, seed=1).eval()
    report = evaluate_acceptance(target, drafter, prompts, greedy_continuations(target, prompts, 8), TreeShape(6, 3, 2))
    assert [p.new_tokens for p in report.prompts] == [8, 8]
    decoded = speculative_generate(target, drafter, prompts, DecodeConfig(8, tree=TreeShape(6, 3, 2)))
    assert all(len(r.output_ids) == 8 for r in decoded)


def test_a_time_budget_with_the_media_curriculum_is_warned(llava_dir, llava_target, tmp_path, caplog):
    """MSD's curriculum shows media only in the second half of max_steps; a max_minutes budget can end the run
    before that, so the run says so at the start (and not when media_curriculum=off)."""
    import logging

    data = write_image_conversations(llava_target, tmp_path, answers_from_target=False)
    config = train_config(llava_dir, data, tmp_path / "msd", "msd", "ce", 2)
    config.max_minutes = 30.0
    with caplog.at_level(logging.WARNING, logger="mmvsd.training.trainer"):
        train(config, target=llava_target)
    assert "media curriculum shows no media before step 1 of 2" in caplog.text
    caplog.clear()
    config.media_curriculum, config.output = "off", str(tmp_path / "mixed")
    with caplog.at_level(logging.WARNING, logger="mmvsd.training.trainer"):
        train(config, target=llava_target)
    assert "media curriculum" not in caplog.text
