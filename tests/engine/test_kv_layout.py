"""The KV pool's layout: which layers store K/V and what one token stores (engine/cache/kv_pool.KVLayout)."""

import torch

from ferrylm.config import ModelConfig
from ferrylm.engine.cache.kv_pool import KVLayout, KVPool


def _config(**over) -> ModelConfig:
    raw = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "vocab_size": 100, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    raw.update(over)
    return ModelConfig.from_dict(raw)


def test_standard_layout_counts_k_and_v_of_every_layer():
    layout = KVLayout.of(_config())
    assert layout.layers == (0, 1, 2)
    # 3 layers x (K + V) x 2 heads x 16 dims x 2 bytes
    assert layout.bytes_per_token(torch.bfloat16) == 3 * 2 * 2 * 16 * 2


def test_layers_without_kv_get_empty_tensors_and_cost_nothing():
    layout = KVLayout(num_layers=4, layers=(3,), k_heads=2, k_dim=8, v_heads=2, v_dim=8)
    pool = KVPool(layout=layout, num_pages=2, page_size=4, dtype=torch.float32, device="cpu")
    assert [t.numel() for t in pool.k] == [0, 0, 0, 8 * 2 * 8]
    assert pool.v[3].shape == (8, 2, 8)
    assert layout.bytes_per_token(torch.float32) == 1 * (16 + 16) * 4
    assert pool.k[0].dtype == torch.float32


def test_one_tensor_layout_has_no_v():
    # latent attention: one [1, 576] entry per token and layer, no V
    layout = KVLayout(num_layers=2, layers=(0, 1), k_heads=1, k_dim=576, v_heads=0, v_dim=0)
    pool = KVPool(layout=layout, num_pages=1, page_size=2, dtype=torch.bfloat16, device="cpu")
    assert pool.k[1].shape == (2, 1, 576) and pool.v[1].numel() == 0
    assert layout.bytes_per_token(torch.bfloat16) == 2 * 576 * 2


def test_host_pool_is_zero_without_writing_its_pages_at_boot():
    """A host KV pool reads as zeros but its memory is not written when it is made (the OS hands zero pages on first
    write): a GiB pool cost a third of a second of every CPU start."""
    import psutil

    proc = psutil.Process()
    layout = KVLayout(num_layers=2, layers=(0, 1), k_heads=4, k_dim=128, v_heads=4, v_dim=128)
    before = proc.memory_info().rss
    pool = KVPool(layout=layout, num_pages=8192, page_size=16, dtype=torch.float32, device="cpu")   # 512 MiB
    grew = proc.memory_info().rss - before
    assert pool.k[0].shape == (8192 * 16, 4, 128) and pool.v[1].dtype == torch.float32
    assert grew < 64 << 20, f"the pool wrote {grew >> 20} MiB at boot"
    slots = torch.tensor([0, 70_000, 131_071])
    assert not pool.keys(1, slots, torch.float32).any()
    pool.store(1, slots, torch.ones(3, 4, 128), torch.full((3, 4, 128), 2.0))
    assert (pool.keys(1, slots, torch.float32) == 1).all() and (pool.values(1, slots, torch.float32) == 2).all()


def test_a_model_that_stores_no_kv_boots_and_generates(tmp_path):
    """Every layer a Gated DeltaNet (a hybrid preset cut to its first layers, say): nothing per token in the KV pool,
    the memory plan still sizes it (it once divided by zero) and the engine decodes."""
    from ferrylm.config import EngineConfig
    from ferrylm.engine.boot import build_engine
    from ferrylm.engine.sampling_params import SamplingParams
    from tests.engine.test_prefix_cache import drain, tokens
    from tests.models.hf_checkpoints import build_checkpoint

    ckpt = build_checkpoint("qwen3_5_moe", tmp_path / "m", seed=3, num_hidden_layers=1)  # layer 0: linear
    assert KVLayout.of(ModelConfig.from_folder(ckpt.path)).bytes_per_token(torch.float32) == 0
    eng = build_engine(ckpt.path, EngineConfig(device="cpu", dtype="float32", page_size=16, max_prefill_length=64))
    eng.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    outs = drain(eng)["a"]
    assert all(o.error_code is None for o in outs) and len(tokens(outs)) == 4
