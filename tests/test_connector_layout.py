"""describe_layout: the scheduler and worker halves of one engine must name the same namespace.

vLLM hands workers a group of DeepSeek-V3.2's latent and indexer layers as one
UniformTypeKVCacheSpecs and the scheduler only its first spec (generate_scheduler_kv_cache_config).
Seen on GPU vLLM 0.26: the halves hashed different namespaces, so the scheduler's prefix lookups
missed every chunk its workers had saved (handoffs still worked: they only use the worker side).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # imports vLLM (in the tests, so that collecting this module does not)

LATENT = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
INDEXER = [f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(4)]


def _worker_config() -> Any:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec, UniformTypeKVCacheSpecs

    specs = {name: MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=656, dtype=torch.uint8,
                                    cache_dtype_str="fp8_ds_mla") for name in LATENT}
    specs |= {name: MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=132, dtype=torch.uint8)
              for name in INDEXER}
    group = KVCacheGroupSpec(layer_names=LATENT + INDEXER, kv_cache_spec=UniformTypeKVCacheSpecs(
        block_size=64, kv_cache_specs=specs))
    return KVCacheConfig(num_blocks=100, kv_cache_tensors=[], kv_cache_groups=[group])


def test_scheduler_and_worker_halves_share_one_namespace() -> None:
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    from pdserve.kvstore.connector.connector import describe_layout

    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(served_model_name="tiny-v32", model="/models/tiny-v32"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    worker = _worker_config()
    scheduler = generate_scheduler_kv_cache_config([worker])
    assert isinstance(worker.kv_cache_groups[0].kv_cache_spec, UniformTypeKVCacheSpecs)
    assert not isinstance(scheduler.kv_cache_groups[0].kv_cache_spec, UniformTypeKVCacheSpecs)
    (w_layout, w_mla), (s_layout, s_mla) = describe_layout(vllm_config, worker), describe_layout(vllm_config, scheduler)
    assert w_layout == s_layout and w_layout.namespace() == s_layout.namespace()
    assert w_mla and s_mla  # MLA: every TP rank holds the same bytes
    (group,) = w_layout.groups
    assert (group.dtype, group.bytes_per_token, group.block_size, group.num_layers) == ("fp8_ds_mla", 656, 64, 8)
