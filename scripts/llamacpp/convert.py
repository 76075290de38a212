#!/usr/bin/env python3
"""convert.py: writes a Qwen3 Hugging Face checkpoint as a GGUF file for llama.cpp.

llama.cpp's own convert_hf_to_gguf.py needs `transformers` for the vocabulary,
which is not installable on the benchmark machine; this converter does the same
with llama.cpp's gguf-py alone: arch `qwen3`, the hyperparameters the qwen3
loader reads, tensor names as convert_hf_to_gguf maps them, and the BPE
vocabulary and merges of tokenizer.json as a `gpt2` tokenizer with pre-tokenizer
`qwen2` (padded to vocab_size with [PAD<i>] UNUSED tokens, as convert_hf_to_gguf
pads). Norm weights stay float32 (as convert_hf_to_gguf writes them); matrices
are written as bf16 (the checkpoint's own bits) or f32. Q8_0 is made from the
bf16 file with llama-quantize.

Needs: numpy (Debian: python3-numpy) and llama.cpp's gguf-py (--gguf-py, default
/tmp/llama.cpp/gguf-py). Only a bf16 model.safetensors in one file is read.

Usage: python3 convert.py /tmp/qwen3-0.6b /tmp/qwen3-0.6b-bf16.gguf --outtype bf16
"""
import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np


def read_safetensors(path):
    """Yields (name, shape, raw uint16 bf16 bits) for every tensor in path."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    for name, info in sorted(header.items()):
        if name == "__metadata__":
            continue
        if info["dtype"] != "BF16":
            sys.exit(f"{name}: dtype {info['dtype']}, only BF16 is read")
        lo, hi = info["data_offsets"]
        yield name, info["shape"], data[lo:hi].view(np.uint16).reshape(info["shape"])


def gguf_name(hf):
    """Maps a Hugging Face Qwen3 tensor name to llama.cpp's GGUF name."""
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in fixed:
        return fixed[hf]
    per_layer = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    parts = hf.split(".")  # model.layers.N.<module...>.weight
    if parts[:2] == ["model", "layers"] and parts[-1] == "weight":
        module = ".".join(parts[3:-1])
        if module in per_layer:
            return f"blk.{parts[2]}.{per_layer[module]}.weight"
    sys.exit(f"no GGUF name for {hf}")


def add_vocab(w, gguf, model_dir, vocab_size):
    """Writes the gpt2/qwen2 BPE vocabulary, merges and special tokens of tokenizer.json."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = set()
    for t in tok.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
        if t.get("special"):
            special.add(t["id"])
    by_id = {i: s for s, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size).add_to_gguf(w)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--outtype", choices=["bf16", "f32"], default="bf16")
    p.add_argument("--gguf-py", default="/tmp/llama.cpp/gguf-py")
    args = p.parse_args()
    sys.path.insert(0, args.gguf_py)
    import gguf

    cfg = json.loads((args.model_dir / "config.json").read_text())
    if cfg["model_type"] != "qwen3":
        sys.exit(f"model_type {cfg['model_type']}, only qwen3 is converted")

    w = gguf.GGUFWriter(args.out, "qwen3")
    w.add_name(args.model_dir.name)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if args.outtype == "bf16" else gguf.LlamaFileType.ALL_F32)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    add_vocab(w, gguf, args.model_dir, cfg["vocab_size"])

    for name, shape, bits in read_safetensors(args.model_dir / "model.safetensors"):
        if len(shape) == 1 or args.outtype == "f32":
            # bf16 -> f32 is exact: the bf16 bits are the top half of the f32.
            w.add_tensor(gguf_name(name), (bits.astype(np.uint32) << 16).view(np.float32))
        else:
            w.add_tensor(gguf_name(name), bits, raw_dtype=gguf.GGMLQuantizationType.BF16)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
