"""`pdserve model tiny`: write a tiny random-weight model folder (config.json + tokenizer).

vLLM serves such a folder with `--load-format dummy` (random weights, no checkpoint),
which is how every engine test runs on a 2-core CPU. The tokenizer is trained offline
(byte-level BPE on a built-in corpus) so nothing is downloaded, and its vocabulary is
exactly the config's `vocab_size`: random weights emit any id below vocab_size, and
each one must decode. The configs are embedded here so the command works anywhere.

The engine settings that serve it on a small CPU machine (`TINY_VLLM_ARGS`, `TINY_ENGINE_ENV`)
and the folder `pdserve up` generates it into (`tiny_model_dir`) live here too, so `pdserve up`,
the Ray config and the compose test read one definition.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger(__name__)

TINY_ARCH = "deepseek_v3"
TINY_SERVED_NAME = "tiny-deepseek-v3"
# Engine settings for the tiny model on a small CPU machine: random weights, short
# context, no graph capture, an explicit 256 MiB KV cache (vLLM's CPU default takes
# most of the RAM), one unpinned OpenMP thread per engine, so a prefill and a
# decode engine do not fight over the same core, and vLLM's queue readers spinning 0.05 s
# instead of 1 s after each message (kvstore/connector/idle_spin.py: engines sharing cores).
TINY_VLLM_ARGS: tuple[str, ...] = (
    "--load-format", "dummy", "--max-model-len", "4096", "--max-num-seqs", "8",
    "--kv-cache-memory-bytes", str(256 << 20), "--enforce-eager",
)
TINY_ENGINE_ENV: dict[str, str] = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
                                   "PDSERVE_VLLM_SPIN_S": "0.05"}

# Tiny DeepSeek-V3: MLA (512 latent + 64 rope = 576-wide KV), MoE with 8 routed experts.
# DeepSeek's own head dims (qk_nope 128, rope 64, v 128): sm90's MLA prefill kernels take only
# a few shapes and refuse smaller ones; the CPU engine serves these too. 64k positions, so GPU
# benchmarks can run 32k-token prompts (a CPU engine caps it with --max-model-len).
DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 128,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "moe_layer_freq": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 65536,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}

# Tiny DeepSeek-V3.2: the V3 model plus the lightning indexer, so vLLM runs sparse MLA, the
# only attention that takes the fp8_ds_mla KV cache (656-byte rows; GPU only: serve it with
# --kv-cache-dtype fp8_ds_mla). The indexer's shape is the real model's.
DEEPSEEK_V32: dict[str, Any] = {
    **DEEPSEEK_V3,
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_topk": 2048,
    "index_n_heads": 64,
    "index_head_dim": 128,
}

# Tiny Gemma-3 text: 3 sliding-window layers (window 64) + 1 full layer -> two KV cache groups.
GEMMA3: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "sliding_window": 64,
    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "query_pre_attn_scalar": 64,
    "hidden_activation": "gelu_pytorch_tanh",
    "torch_dtype": "bfloat16",
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
}

# Tiny DeepSeek-V4 for GPU users (vLLM 0.32's CPU kernels need AMX). Same shape rules as
# DeepSeek-V4-Flash where kernels care (64 heads / 1 KV head, head_dim 512 with 64 rope,
# window 128, indexer 64 x 128, fp8 block linears + fp4 experts), small everywhere else.
# Layers 0-1 window-only, 2 compressed 4x (with the indexer), 3 compressed 128x: all four
# KV cache groups of the real model. The trailing 0 is the MTP layer's ratio.
DEEPSEEK_V4: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 1024,
    "hidden_size": 512,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 256,
    "o_lora_rank": 256,
    "o_groups": 8,
    "sliding_window": 128,
    "compress_ratios": [0, 0, 4, 128, 0],
    "compress_rope_theta": 160000.0,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "num_hash_layers": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 65536,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "expert_dtype": "fp4",
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "scale_fmt": "ue8m0",
    },
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "deepseek_v3": DEEPSEEK_V3,
    "deepseek_v32": DEEPSEEK_V32,
    "gemma3": GEMMA3,
    "deepseek_v4": DEEPSEEK_V4,
}

# DeepSeek's special-token spelling (fullwidth bars, U+2581 for spaces), so chat prompts
# look like the real models' and tests exercise multi-byte tokens.
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}" + USER + "{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}" + ASSISTANT + "{{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('unsupported chat role: ' ~ message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)

# Training text: plain English, numbers, code and JSON, so common words become single tokens.
CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog. A serving stack splits each request in two: "
    "the prefill worker reads the whole prompt once and writes its key-value cache, and the decode "
    "worker loads that cache and streams the answer one token at a time.",
    "Hello! How are you today? I am fine, thank you. What is the capital of France? Paris is the "
    "capital of France. Tell me a story about a cat who lived in a library and read every book.",
    "Mixture-of-experts models route every token to a few experts out of many. Attention layers keep "
    "a cache of keys and values; multi-head latent attention stores one compressed latent per token.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 128 256 512 1024 2048 4096 8192 65536. "
    "Dates like 2024-01-31 and times like 12:30:45 appear in logs, as do versions like v0.32.0.",
    "def add(a: int, b: int) -> int:\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, i))\n",
    '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "stream": true}',
    "You are a helpful assistant. Answer briefly and clearly. If you do not know, say so. "
    "The weather is sunny, the sky is blue, and the river runs quietly past the old stone bridge.",
    "Router, prefill, decode, store, load, block, chunk, hash, token, prompt, request, response, "
    "latency, throughput, memory, kernel, tensor, layer, window, expert, shard, replica, cluster.",
)


def special_tokens(config: dict[str, Any]) -> list[str]:
    """Special tokens in id order, placed where the config's bos/eos/pad ids say."""
    by_id: dict[int, str] = {config["bos_token_id"]: BOS, config["eos_token_id"]: EOS}
    if config.get("pad_token_id") is not None:
        by_id[config["pad_token_id"]] = PAD
    rest = [t for t in (BOS, EOS, PAD, USER, ASSISTANT) if t not in by_id.values()]
    ordered: list[str] = []
    for idx in range(len(by_id) + len(rest)):
        ordered.append(by_id[idx] if idx in by_id else rest.pop(0))
    return ordered


def build_tokenizer(config: dict[str, Any]):
    """Byte-level BPE trained on CORPUS, padded to exactly config['vocab_size'] entries.

    Byte-level keeps every id decodable to bytes; padding uses plain (non-special)
    added tokens so a random model that emits them still produces visible text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    vocab_size = int(config["vocab_size"])
    specials = special_tokens(config)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD if config.get("pad_token_id") is not None else None,
        additional_special_tokens=[USER, ASSISTANT],
        model_max_length=int(config["max_position_embeddings"]),
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    shortfall = vocab_size - len(fast)
    if shortfall > 0:
        fast.add_tokens([f"<｜reserved_{i}｜>" for i in range(shortfall)])
    if len(fast) != vocab_size:
        raise ValueError(f"tokenizer has {len(fast)} entries, config vocab_size is {vocab_size}")
    for name in ("bos", "eos"):
        token_id = fast.convert_tokens_to_ids(getattr(fast, f"{name}_token"))
        if token_id != config[f"{name}_token_id"]:
            raise ValueError(f"{name} token id {token_id} != config {name}_token_id {config[f'{name}_token_id']}")
    return fast


def write_tiny_model(arch: str, out: Path) -> Path:
    """Write config.json and the tokenizer files for `arch` into `out`; returns `out`."""
    if arch not in CONFIGS:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(CONFIGS)}")
    config = copy.deepcopy(CONFIGS[arch])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(config)
    tokenizer.save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    log.info("wrote tiny %s model to %s (vocab %d)", arch, out, config["vocab_size"])
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve model tiny",
        description="Write a tiny model folder (config.json + tokenizer) to serve with --load-format dummy.",
    )
    parser.add_argument("--arch", choices=sorted(CONFIGS), required=True, help="model architecture")
    parser.add_argument("--out", type=Path, required=True, help="output folder (created if missing)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    write_tiny_model(args.arch, args.out)
    print(args.out)
    return 0


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdserve"


def tiny_model_dir() -> Path:
    """The tiny DeepSeek-V3 folder, generated on first use."""
    out = cache_dir() / "models" / f"tiny-{TINY_ARCH}"
    if not (out / "config.json").exists():
        write_tiny_model(TINY_ARCH, out)
    return out
