import pytest
import torch
from safetensors.torch import load_file, save_file

from flotilla.engine.model import (
    ModelConfig,
    allocate_kv_cache,
    copy_blocks,
    kv_pool_tensor,
    load_model,
    num_blocks_for_budget,
)
from flotilla.engine.model.kv_cache import cache_rows, layer_dims, token_major

from .helpers import PagedDriver, hf_logits, make_checkpoint, random_tokens

CPU = torch.device("cpu")
CONFIG = ModelConfig.from_dict({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
})


def test_allocate_one_pool_with_per_layer_views():
    caches = allocate_kv_cache(CONFIG, num_blocks=5, block_size=4, dtype=torch.float32, device=CPU)
    assert len(caches) == 3 and caches[0].shape == (2, 5, 2, 4, 4)  # [K/V, blocks, KV heads, block size, D]
    pool = kv_pool_tensor(caches)
    assert pool.shape == (3, 2, 5, 2, 4, 4) and pool.is_contiguous()
    caches[2][1, 4, 1, 3, 3] = 7.0
    assert pool[2, 1, 4, 1, 3, 3] == 7.0 and pool.sum() == 7.0
    assert token_major(caches[2])[1, 4, 3, 1, 3] == 7.0  # V, block 4, token 3, KV head 1


def test_layer_dims_and_token_major_view_name_the_same_element():
    caches = allocate_kv_cache(CONFIG, num_blocks=5, block_size=4, dtype=torch.float32, device=CPU)
    assert layer_dims(caches[0]) == (5, 2, 4, 4)  # blocks, KV heads, block size, head dim
    values = torch.arange(caches[0].numel(), dtype=torch.float32).view(caches[0].shape)
    # a KV head's rows of one block are one contiguous run, token after token
    run = values[0, 3, 1].reshape(-1)
    assert torch.equal(run, token_major(values)[0, 3, :, 1].reshape(-1))
    assert run[-1] - run[0] == run.numel() - 1


def test_cache_rows_address_each_new_tokens_heads_at_its_slot():
    cache = allocate_kv_cache(CONFIG, num_blocks=5, block_size=4, dtype=torch.float32, device=CPU)[0]
    slots = torch.tensor([17, 2, 8])  # block 4 offset 1, block 0 offset 2, block 2 offset 0
    new_k = torch.randn(3, 2, 4)  # [tokens, KV heads, head dim]
    cache[0].view(-1, 4).index_copy_(0, cache_rows(slots, cache), new_k.reshape(-1, 4))
    by_token = token_major(cache)[0].reshape(-1, 2, 4)  # [slots, KV heads, head dim]
    assert torch.equal(by_token[slots], new_k)
    assert cache.count_nonzero() == new_k.count_nonzero()  # nothing else written


def test_kv_pool_tensor_rejects_separate_tensors():
    with pytest.raises(ValueError, match="one pool"):
        kv_pool_tensor([torch.zeros(2, 3), torch.zeros(2, 3)])


def test_copy_blocks_copies_k_and_v_of_every_layer():
    caches = allocate_kv_cache(CONFIG, num_blocks=6, block_size=2, dtype=torch.float32, device=CPU)
    for layer, cache in enumerate(caches):
        for block in range(6):
            cache[:, block] = torch.arange(2).view(2, 1, 1, 1) + 10 * block + 100 * layer
    before = [cache.clone() for cache in caches]
    copy_blocks(caches, [(1, 4), (4, 5)])  # simultaneous: 5 gets the old 4, not the new one
    for layer, cache in enumerate(caches):
        assert torch.equal(cache[:, 4], before[layer][:, 1])
        assert torch.equal(cache[:, 5], before[layer][:, 4])
        for block in (0, 1, 2, 3):
            assert torch.equal(cache[:, block], before[layer][:, block])


def test_num_blocks_for_budget():
    per_block = 4 * CONFIG.kv_bytes_per_token(torch.bfloat16)
    assert num_blocks_for_budget(CONFIG, 4, torch.bfloat16, 10 * per_block + per_block - 1) == 10
    assert num_blocks_for_budget(CONFIG, 4, torch.bfloat16, per_block - 1) == 0


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("loader")
    hf = make_checkpoint(directory, "llama_gqa")
    return directory, hf


def test_missing_tensor_raises(saved, tmp_path):
    directory, _ = saved
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_bytes((directory / "config.json").read_bytes())
    with pytest.raises(ValueError, match=r"lacks tensors for \['model.layers.1.self_attn.qkv_proj.weight'\]"):
        load_model(tmp_path, torch.float32, CPU)


def test_unexpected_and_misshapen_tensors_raise(saved, tmp_path):
    directory, _ = saved
    (tmp_path / "config.json").write_bytes((directory / "config.json").read_bytes())
    tensors = load_file(directory / "model.safetensors")
    save_file({**tensors, "model.layers.0.mlp.extra.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.mlp.extra.weight'"):
        load_model(tmp_path, torch.float32, CPU)
    tensors["model.norm.weight"] = torch.zeros(3)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.norm.weight.*shape"):
        load_model(tmp_path, torch.float32, CPU)


def test_sharded_checkpoint_loads_and_missing_lm_head_ties(saved, tmp_path):
    directory, hf = saved
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = load_model(tmp_path, torch.float32, CPU)
    tokens = random_tokens(12, seed=50)
    torch.testing.assert_close(PagedDriver(model).all_logits("a", tokens), hf_logits(hf, tokens), atol=1e-4, rtol=0)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    # without lm_head.weight the loader ties it to the embeddings
    tensors = load_file(directory / "model.safetensors")
    del tensors["lm_head.weight"]
    single = tmp_path / "single"
    single.mkdir()
    save_file(tensors, single / "model.safetensors")
    (single / "config.json").write_bytes((directory / "config.json").read_bytes())
    tied = load_model(single, torch.float32, CPU)
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()


def test_tied_checkpoint_shares_embedding(checkpoint_factory):
    model = checkpoint_factory("qwen2_tied").model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    assert model.model.layers[0].self_attn.o_proj.bias is None


def test_check_checkpoint_reads_names_only_and_says_what_is_wrong(saved, tmp_path):
    from flotilla.engine.model.loader import check_checkpoint

    directory, _ = saved
    assert check_checkpoint(directory).architecture == "LlamaForCausalLM"
    (tmp_path / "config.json").write_bytes((directory / "config.json").read_bytes())
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file({**tensors, "model.layers.0.mlp.extra.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError) as error:
        check_checkpoint(tmp_path)
    assert str(error.value) == (f"{tmp_path}: LlamaForCausalLM: checkpoint lacks tensors for model.norm.weight; "
                                "has tensors it cannot place: model.layers.0.mlp.extra.weight")


@pytest.mark.parametrize("kind", ["gemma2", "gemma3_tied"])
def test_gemma_checkpoints_check_and_load_as_gemma(checkpoint_factory, kind):
    from flotilla.engine.model import GemmaForCausalLM
    from flotilla.engine.model.loader import check_checkpoint

    ckpt = checkpoint_factory(kind)
    assert check_checkpoint(ckpt.directory).is_gemma
    model = ckpt.model
    assert isinstance(model, GemmaForCausalLM)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == (kind == "gemma3_tied")
    assert model.model.layers[0].post_feedforward_layernorm.weight.abs().sum() > 0  # loaded, not the zero init


class _FakeCudart:
    """Stands in for torch.cuda.cudart() on a CPU: records what is registered and unregistered."""

    def __init__(self, status=0):
        self.status, self.registered, self.unregistered = status, [], []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - CUDA's name
        self.registered.append((ptr, size, flags))
        return self.status

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.unregistered.append(ptr)
        return 0


def test_a_pinned_host_pool_is_locked_at_its_size_until_its_last_view_goes(monkeypatch):
    """cudaHostRegister of exactly the pool's bytes (torch's pinned allocator would round them up to a power of
    two), held while any layer view lives."""
    import gc

    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    caches = allocate_kv_cache(CONFIG, num_blocks=5, block_size=4, dtype=torch.float32, device=CPU, pin_memory=True)
    pool = kv_pool_tensor(caches)
    [(ptr, size, _)] = cudart.registered
    assert (ptr, size) == (pool.data_ptr(), pool.numel() * 4) and size & (size - 1)  # not a power of two
    assert pool.abs().sum() == 0
    del pool
    last = caches.pop()
    del caches
    gc.collect()
    assert cudart.unregistered == []  # one view still holds it
    del last
    gc.collect()
    assert cudart.unregistered == [ptr]


def test_pinning_is_for_host_pools_only():
    with pytest.raises(ValueError, match="host pool"):
        allocate_kv_cache(CONFIG, 5, 4, torch.float32, torch.device("meta"), pin_memory=True)
