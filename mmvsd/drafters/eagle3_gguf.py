"""The `gguf` layout of EAGLE-3 drafters: one GGUF file that llama.cpp loads with `--spec-type draft-eagle3`.

Written with the `gguf` package directly (no llama.cpp converter, no transformers 4): what llama.cpp's
`convert_hf_to_gguf.py --target-model-dir` writes for an EAGLE-3 draft, checked against its loader
(`src/models/eagle3.cpp`):
    general.architecture      "eagle3"
    eagle3.*                  the one draft layer's sizes (block_count 1), rope base, rms eps, context length
    eagle3.target_layers      [3] int32: our aux layer ids, which llama.cpp reads as the INPUT of those target
                              layers (HF `hidden_states[k]`), as we do
    eagle3.target_hidden_size, eagle3.norm_before_residual (false: our residual is the hidden state before
                              hidden_norm), eagle3.norm_before_fc (false)
    tokenizer.*               the target's tokenizer, copied from the GGUF file the target is read from (llama.cpp
                              runs the target from a GGUF file too)
Tensors (GGUF shapes are torch shapes reversed):
    fc.weight [H, 3H]; blk.0.attn_norm (input_layernorm), blk.0.attn_norm_2 (hidden_norm), blk.0.attn_{q,k,v}
    (input 2H; q and k rows permuted from HF's rotate-half RoPE to GGML's interleaved pairs), blk.0.attn_output,
    blk.0.ffn_norm (post_attention_layernorm), blk.0.ffn_{gate,up,down}, output_norm, output [Vd, H],
    d2t [Vd] int64 ABSOLUTE target ids (ours are offsets: target id = i + d2t[i]); t2d is not stored.
No token embeddings: llama.cpp takes the target's, as we do.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from mmvsd.drafters.eagle3 import Eagle3Config, Eagle3Drafter, check_one_layer
from mmvsd.errors import UserError
from mmvsd.layouts.base import Layout
from mmvsd.target_loader import target_gguf_file

ARCH = "eagle3"
FILE_NAME = "model.gguf"
OUT_TYPES = ("f16", "bf16", "f32", "q8_0")  # --outtype, as llama.cpp's converter names them
TENSOR_NAMES = {  # our state_dict key -> llama.cpp tensor name
    "fc.weight": "fc.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
SKIPPED = {"t2d", "d2t"}  # t2d is unused by llama.cpp; d2t is written as absolute ids


class Eagle3GGUFLayout(Layout):
    """EAGLE-3 drafters as one GGUF file for llama.cpp (`-md FILE --spec-type draft-eagle3`)."""

    name = "gguf"
    drafter_type = "eagle3"
    serving_note = "llama.cpp drafts from GGUF files with EAGLE-3 drafters or draft models"
    single_file = FILE_NAME

    def export(self, drafter: Eagle3Drafter, out_dir: Path) -> None:
        raise UserError("the gguf layout needs the drafter's target (its tokenizer goes into the file): "
                        "pass --target")

    def export_for(self, drafter: Eagle3Drafter, out_dir: Path, target, out_type: str = "f16") -> None:
        """Write `out_dir/model.gguf` for `drafter`, made for `target`."""
        write_eagle3_gguf(drafter, target, out_dir / FILE_NAME, out_type)

    def load(self, path: Path, target) -> Eagle3Drafter:
        raise UserError(f"{path}: mmvsd does not read GGUF drafters back; keep the drafter folder it was exported "
                        "from (or its eagle3 export)")

    def detect(self, config: dict, keys: set[str]) -> bool:
        return False  # a single file, never a drafter folder


def write_eagle3_gguf(drafter: Eagle3Drafter, target, path: Path, out_type: str = "f16") -> None:
    """Write the GGUF file llama.cpp's EAGLE-3 loader reads (hparams, the target's tokenizer, tensors)."""
    import gguf  # a core dependency (transformers reads GGUF targets with it); loaded only when exporting

    if out_type not in OUT_TYPES:
        raise UserError(f"--outtype {out_type!r}: choose one of {', '.join(OUT_TYPES)}")
    config = drafter.config
    check_one_layer(config, "llama.cpp's EAGLE-3 GGUF")
    if len(config.aux_layer_ids) != 3:
        raise UserError(f"llama.cpp's EAGLE-3 reads exactly 3 target layers; this drafter reads {config.aux_layer_ids}")
    writer = gguf.GGUFWriter(str(path), ARCH)
    write_hparams(writer, config, getattr(target, "max_positions", 0) or 0)
    write_tokenizer(writer, target)
    for name, tensor in gguf_tensors(drafter).items():
        add_tensor(writer, name, tensor, out_type)
    d2t = drafter.d2t.detach().cpu().long() + torch.arange(config.draft_vocab_size)
    writer.add_tensor("d2t", d2t.numpy().astype(np.int64), raw_dtype=gguf.GGMLQuantizationType.I64)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_hparams(writer, config: Eagle3Config, target_positions: int) -> None:
    """The `eagle3.*` and `general.*` keys: one Llama layer's sizes plus the EAGLE-3 facts."""
    writer.add_name(f"mmvsd EAGLE-3 drafter for {config.target_name or 'its target'}")
    writer.add_context_length(max(config.max_position_embeddings, target_positions if target_positions < 1 << 30
                                  else 0))
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(1)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_array(f"{ARCH}.target_layers", [int(i) for i in config.aux_layer_ids])
    writer.add_uint32(f"{ARCH}.target_hidden_size", config.target_hidden_size)
    writer.add_bool(f"{ARCH}.norm_before_residual", False)
    writer.add_bool(f"{ARCH}.norm_before_fc", False)


def gguf_tensors(drafter: Eagle3Drafter) -> dict[str, Tensor]:
    """The drafter's weights under llama.cpp's names, q/k rows permuted to GGML's RoPE pair order."""
    state = {k: v.detach().cpu().float() for k, v in drafter.state_dict().items()}
    unknown = sorted(set(state) - set(TENSOR_NAMES) - SKIPPED)
    if unknown:
        raise UserError(f"the gguf layout has no place for the drafter weights {', '.join(unknown)}")
    heads, kv_heads = drafter.config.num_attention_heads, drafter.config.num_key_value_heads
    out = {TENSOR_NAMES[k]: v for k, v in state.items() if k in TENSOR_NAMES}
    out["blk.0.attn_q.weight"] = rope_pairs(out["blk.0.attn_q.weight"], heads)
    out["blk.0.attn_k.weight"] = rope_pairs(out["blk.0.attn_k.weight"], kv_heads)
    return out


def rope_pairs(weight: Tensor, num_heads: int) -> Tensor:
    """Reorder each head's rows from rotate-half (dims i, i + d/2 rotate together) to adjacent pairs (2i, 2i+1),
    the order GGML's normal RoPE rotates; weight [heads * d, in]."""
    rows, cols = weight.shape
    return weight.reshape(num_heads, 2, rows // num_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def add_tensor(writer, name: str, tensor: Tensor, out_type: str) -> None:
    """One tensor: norms (1-D) in f32 as llama.cpp keeps them, matrices in `out_type`."""
    import gguf  # loaded only when exporting, as above

    data = tensor.numpy().astype(np.float32)
    if data.ndim == 1 or out_type == "f32":
        writer.add_tensor(name, data)
    elif out_type == "f16":
        writer.add_tensor(name, data.astype(np.float16))
    else:
        kind = {"bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[out_type]
        writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)  # byte rows: shape inferred


def write_tokenizer(writer, target) -> None:
    """The target's tokenizer keys, copied from the GGUF file the target is read from."""
    source = target_gguf_file(target.name)
    if source is None:
        raise UserError(f"target {target.name!r} is not read from a GGUF file, and llama.cpp needs one for the target "
                        "as well as its tokenizer in the draft: convert the target with llama.cpp's "
                        "convert_hf_to_gguf.py and pass --target FILE.gguf")
    copy_tokenizer_keys(writer, source)


def copy_tokenizer_keys(writer, source: Path) -> None:
    """Copy every `tokenizer.*` key of the GGUF file `source` (vocabulary, merges, special ids, chat template)."""
    import gguf  # loaded only when exporting, as above

    reader = gguf.GGUFReader(str(source))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), kind, sub_type=sub)
