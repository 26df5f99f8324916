"""Slot KV layers (in-place buffers) and the in-place grouped-query attention of the target."""

from __future__ import annotations

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa
from test_kv import random_tree
from test_kv import test_tree_forward_and_keep_equal_recompute as check_tree_keep_equals_recompute

from conftest import make_tiny_llama, random_prompts
from mmvsd.decoding.decode import _prefill, as_prompts
from mmvsd.decoding.kv import SlotLayer
from mmvsd.target import GQA_SDPA, Target


def test_growing_buffers_keep_equal_recompute(monkeypatch):
    """Capacity 2 at first: every forward regrows the buffers, and the results still equal recompute."""
    monkeypatch.setattr(SlotLayer, "min_capacity", 2)
    check_tree_keep_equals_recompute("sdpa")


def test_block_and_keep_write_in_place():
    target = Target(make_tiny_llama(seed=4), None, "tiny")
    cache, _, _, _, _ = _prefill(target, as_prompts(random_prompts(2, seed=1)), need_aux=False)
    layer = cache.kv.layers[0]
    buffer = layer.buffer
    tree = random_tree(2, 6, target.vocab_size, seed=0)
    target.forward(cache, tree.token_ids, tree.depths, tree.ancestor_mask(), need_aux=False)
    assert cache.block_len() == 6
    paths = tree.path_to(tree.leaves().float().argmax(1))
    cache.keep(paths.clamp(min=0), torch.tensor([2, 1]))
    target.forward(cache, tree.token_ids, tree.depths, tree.ancestor_mask(), need_aux=False)
    cache.drop_block()
    assert layer.buffer is buffer  # no reallocation below the capacity
    assert layer.keys.data_ptr() == buffer.data_ptr() and layer.keys.shape[2] == cache.committed_len
    cache.select_rows(torch.tensor([1]))
    assert layer.keys.shape[:3] == (1, buffer.shape[2], cache.committed_len)


@pytest.mark.parametrize("num_new", [1, 5])
def test_gqa_attention_equals_transformers_sdpa_without_copies(monkeypatch, num_new):
    target = Target(make_tiny_llama(seed=5), None, "tiny")
    assert target.model.config._attn_implementation == GQA_SDPA
    prompts = as_prompts(random_prompts(2, seed=3))
    tree = random_tree(2, num_new, target.vocab_size, seed=1)

    def tree_logits() -> torch.Tensor:
        cache, _, _, _, _ = _prefill(target, prompts, need_aux=False)
        return target.forward(cache, tree.token_ids, tree.depths, tree.ancestor_mask(), need_aux=False).logits

    copies = []
    original_repeat = hf_sdpa.repeat_kv
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda x, n: copies.append(n) or original_repeat(x, n))
    ours = tree_logits()
    target.model.config._attn_implementation = "sdpa"
    stock = tree_logits()
    torch.testing.assert_close(ours, stock, atol=1e-6, rtol=1e-6)
    # only the stock path copies KV heads: keys and values of 4 layers in its masked prefill, and in
    # its tree forward unless that has a single query (which transformers packs instead)
    assert len(copies) == 2 * 4 * (2 if num_new > 1 else 1)
