"""smol-llava's lab: the training loss against transformers' own forward, the `lab build-target` command, and the
shipped target answering generated and easy-vqa test questions by name (its projector files and drafters:
tests/test_smol_llava_target.py)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoProcessor

from mmvsd.cli import main
from mmvsd.data.image_families import SHAPE_COLORS
from mmvsd.data.images import answer_sentence, generate_item
from mmvsd.targets import smol_llava
from mmvsd.targets.efficientnet import IMAGE_SIZE, pixel_values_from_image
from mmvsd.targets.smol_llava import (
    IMAGE_TOKEN,
    PROJECTOR_MANIFEST,
    load_projector,
)
from mmvsd_studies.lab import easy_vqa
from mmvsd_studies.lab import projector_training as training
from mmvsd_studies.lab.projector_questions import (
    ALIGN_WORDS,
    BACKGROUND_WORD,
    SIDE_WORDS,
    patch_side,
    patch_words,
    word_vectors,
)
from mmvsd_studies.lab.short_answers import is_right, short_answers


@pytest.fixture(scope="module")
def fresh_smol_llava():
    return smol_llava.new_smol_llava()


@pytest.mark.smollm2
def test_training_loss_equals_transformers_forward(fresh_smol_llava):
    """The cached-prefix, precomputed-feature loss over every answer of multi-turn examples is the loss of
    the stock LLaVA forward on the processor's inputs."""
    model, processor = fresh_smol_llava
    settings = training.ProjectorTraining(num_images=6, family_weights={"vqav2": 1, "chartqa": 1},
                                          easy_vqa_images=2, plain_images=2, caption_share=0.3,
                                          long_share=0.3, seed=1)
    items, _ = training.training_items(settings)
    assert [item.family for item in items[-4:]] == ["plain", "plain", "easy-vqa", "easy-vqa"]
    prefix_ids, examples = training.make_examples(processor, items, settings)
    assert len({len(e.token_ids) for e in examples}) > 1  # padding is exercised
    assert any(len(e.turns) > 1 for e in examples) and {e.kind for e in examples} == {"questions", "caption", "long"}
    long = next(e for e in examples if e.kind == "long")
    item = items[long.image_index]
    assert long.turns == ((item.long_prompt, f"{item.description} {answer_sentence(item)}"),)
    features = training.image_features(model, processor, items)
    cache = training.prefix_cache(model, prefix_ids)
    image_token_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    with torch.no_grad():
        loss = training.batch_loss(model, features, examples, cache, image_token_id)
        # with adapters training, the prefix is run every step (its cache changes with the weights)
        assert training.batch_loss(model, features, examples, prefix_ids, image_token_id).item() == \
            pytest.approx(loss.item(), rel=1e-5)
        total, count = 0.0, 0
        for example in examples:
            text = processor.apply_chat_template(training.chat_messages(example.turns)).removesuffix("\n")
            inputs = processor(images=items[example.image_index].image, text=text, return_tensors="pt")
            assert inputs["input_ids"][0].tolist() == prefix_ids + example.token_ids
            is_answer = torch.tensor([False] * len(prefix_ids) + example.is_answer)
            labels = torch.where(is_answer, inputs["input_ids"][0], -100)[None]
            answers = processor.tokenizer.decode(inputs["input_ids"][0][is_answer])
            assert answers == "".join(answer + "<|im_end|>" for _, answer in example.turns)
            out = model(**inputs, labels=labels)
            total, count = total + out.loss.item() * int(is_answer.sum()), count + int(is_answer.sum())
    assert loss.item() == pytest.approx(total / count, rel=1e-4)


@pytest.mark.smollm2
def test_processor_gives_49_image_tokens_and_tower_pixels(fresh_smol_llava):
    _, processor = fresh_smol_llava
    item = generate_item("vqav2", "validation", 0)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}], add_generation_prompt=True)
    inputs = processor(images=item.image, text=text, return_tensors="pt")
    assert (inputs["input_ids"] == processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)).sum() == 49
    assert torch.allclose(inputs["pixel_values"], pixel_values_from_image(item.image), atol=0.02)


@pytest.mark.smollm2
def test_build_target_cli(tmp_path, capsys):
    out = tmp_path / "projector"
    code = main(["lab", "build-target", "smol-llava", "--max-steps", "2", "--num-images", "8", "--align-steps", "3",
                 "--easy-vqa-images", "3", "--plain-images", "2", "--precision", "bf16", "--output", str(out)])
    assert code == 0
    manifest = json.loads((out / PROJECTOR_MANIFEST).read_text())
    assert manifest["training"]["steps"] == 2
    assert manifest["training"]["examples"] == {"generated": 8, "plain shapes": 2, "easy-vqa": 3,
                                                "easy-vqa unreadable, skipped": 0}
    assert manifest["training"]["precision"] == "bf16"
    load_projector(out, hidden_size=576)
    assert "projector written to" in capsys.readouterr().out


def test_build_target_bad_name_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["lab", "build-target", "big-llava"])
    assert exit_info.value.code == 2
    assert "smol-llava" in capsys.readouterr().err


@pytest.mark.smollm2
def test_smol_llava_by_name_reads_colours_that_its_language_model_cannot_guess():
    """The shipped target, loaded by name, answers colour questions on held-out generated images far more
    often with the image than the same language model answers them without it."""
    from mmvsd.target_loader import load_target, resolve_target_folder

    target = load_target("smol-llava")
    processor = AutoProcessor.from_pretrained(resolve_target_folder("smol-llava"))
    items = [generate_item("vqav2", "validation", i) for i in range(80)]
    items = [item for item in items if item.meta.get("question_type") == "color"][:12]
    right = {"image": 0, "no image": 0}
    for item in items:
        for mode in right:
            parts = [{"type": "text", "text": training.user_text(item.question)}]
            if mode == "image":
                parts.insert(0, {"type": "image"})
            text = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
            inputs = processor(images=item.image if mode == "image" else None, text=text, return_tensors="pt")
            output = target.model.generate(**inputs, max_new_tokens=5, do_sample=False)
            reply = processor.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
            right[mode] += reply.strip().lower().startswith(item.answer)
    assert len(items) == 12
    assert right["image"] >= 3 and right["image"] >= right["no image"] + 3, right


@pytest.mark.smollm2
def test_shipped_smol_llava_answers_held_out_easy_vqa_questions():
    """64 easy-vqa test questions (a fixed seeded sample): the shipped target answers them as the issue asks
    (at least 85%), far above what the question alone gives (the train split's most common answer to the
    same question text is right for 67% of the benchmark's 2,000-question sample; the majority answer 37%)."""
    from mmvsd.target_loader import load_target, resolve_target_folder

    target = load_target("smol-llava")
    processor = AutoProcessor.from_pretrained(resolve_target_folder("smol-llava"))
    data = easy_vqa.read_split("test")
    questions = random.Random(0).sample(list(data.questions), 64)
    images, skipped = easy_vqa.load_images(data, sorted({q.image_id for q in questions}), IMAGE_SIZE)
    assert not skipped
    replies = short_answers(target.model, processor, [(images[q.image_id], q.question) for q in questions])
    right = sum(is_right(reply, q.answer) for reply, q in zip(replies, questions))
    assert right >= 56, list(zip(replies, [q.answer for q in questions]))


def test_folded_standardisation_reads_raw_features():
    """The projector trains on standardised features; folded, it gives the same outputs on raw ones."""
    generator = torch.Generator().manual_seed(0)
    raw = torch.randn(3, 5, 8, generator=generator) * torch.tensor([8.0, 6, 0.5, 1, 2, 3, 0.7, 1e-6]) + 4
    standard, mean, scale = training.standardise(raw)
    assert standard.float().flatten(0, 1).mean(0)[:7].abs().max() < 1e-2
    layer = torch.nn.Linear(8, 4)
    before = layer(standard.float())
    training.fold_standardisation(layer, mean, scale)
    torch.testing.assert_close(layer(raw), before, rtol=1e-3, atol=1e-2)


@pytest.mark.smollm2
def test_alignment_makes_shape_patches_read_as_their_colour_and_side_words(fresh_smol_llava):
    """The first stage on real tower features of a few shape scenes: afterwards a patch that shows a shape is
    nearer to its own colour word than to any other colour, and to its own side word than to the other."""
    model, processor = fresh_smol_llava
    settings = training.ProjectorTraining(num_images=40, family_weights={"vqav2": 1}, easy_vqa_images=0,
                                          plain_images=0, align_steps=120)
    items = [item for item in training.training_items(settings)[0] if "shapes" in item.meta]
    features, _, _ = training.standardise(training.image_features(model, processor, items))
    saved = {k: v.clone() for k, v in smol_llava.projector(model).state_dict().items()}
    try:
        training.align_projector(model, processor, items, features, settings)
        with torch.no_grad():
            projected = smol_llava.projector(model)(features.float())  # [N, 49, H]
    finally:
        smol_llava.projector(model).load_state_dict(saved)
    vectors = word_vectors(model.get_input_embeddings().weight.detach(), processor.tokenizer, set(ALIGN_WORDS))

    def nearest(token: torch.Tensor, words) -> str:
        return max(words, key=lambda w: float(torch.cosine_similarity(token, vectors[w], dim=0)))

    right = {"colour": [], "side": []}
    for item, tokens in zip(items, projected):
        for index, words in enumerate(patch_words(item.meta["shapes"])):
            if words == (BACKGROUND_WORD,):
                continue
            right["colour"].append(nearest(tokens[index], SHAPE_COLORS) == words[0])
            if patch_side(index):
                right["side"].append(nearest(tokens[index], SIDE_WORDS) == patch_side(index)[0])
    assert len(right["colour"]) > 100 and len(right["side"]) > 50
    assert sum(right["colour"]) / len(right["colour"]) > 0.8, right
    assert sum(right["side"]) / len(right["side"]) > 0.8, right


@pytest.mark.parametrize("fp32_seconds, bf16_seconds, expected", [(2.0, 1.0, True), (1.0, 0.9, False)])
def test_auto_precision_follows_the_measured_matmul_speed(monkeypatch, fp32_seconds, bf16_seconds, expected):
    """Both branches of precision=auto, with the timings injected: bf16 where a bf16 product is >= 1.5x faster
    (CPUs with AMX or AVX-512-bf16), fp32 where it is not (AVX2-only CPUs emulate bf16)."""
    timings = {torch.float32: fp32_seconds, torch.bfloat16: bf16_seconds}
    monkeypatch.setattr(training, "timed", lambda device, product: timings[product.args[0].dtype])
    assert training.use_bf16("auto", size=8) is expected
    assert training.use_bf16("bf16") is True and training.use_bf16("fp32") is False
    with pytest.raises(ValueError):
        training.use_bf16("fp16")
