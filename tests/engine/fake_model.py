"""A tiny deterministic model that exercises the attention contract (writes/reads paged K/V) for engine tests."""

from __future__ import annotations

import torch

from ferrylm.config import ModelConfig
from ferrylm.models.capabilities import ModelCapabilities


def fake_config(vocab: int = 32, layers: int = 2, max_len: int = 512, eos: int = 0) -> ModelConfig:
    return ModelConfig(architecture="Fake", hidden_size=8, intermediate_size=8, num_layers=layers, num_heads=2,
                       num_kv_heads=1, head_dim=4, vocab_size=vocab, max_position_embeddings=max_len,
                       rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=False,
                       eos_token_ids=(eos,))


class FakeModel(torch.nn.Module):
    """Embedding → per-layer attention through the backend → linear head. Seeded random weights."""

    capabilities = ModelCapabilities()

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.cfg = cfg
        self.emb = torch.randn(cfg.vocab_size, 8, generator=g)
        self.wq = torch.randn(cfg.num_layers, 8, 8, generator=g) * 0.5
        self.wk = torch.randn(cfg.num_layers, 8, 4, generator=g) * 0.5
        self.wv = torch.randn(cfg.num_layers, 8, 4, generator=g) * 0.5
        self.head = torch.randn(8, cfg.vocab_size, generator=g)

    def forward(self, input_ids, positions, attn):
        h = self.emb[input_ids] + 0.01 * positions[:, None].float()
        for layer in range(self.cfg.num_layers):
            q = (h @ self.wq[layer]).view(-1, 2, 4)
            k = (h @ self.wk[layer]).view(-1, 1, 4)
            v = (h @ self.wv[layer]).view(-1, 1, 4)
            h = h + attn.attend(layer, q, k, v, 0.5).reshape(-1, 8)
        return h

    def compute_logits(self, hidden):
        return (hidden @ self.head).float()
