"""Mixtral (Jiang et al. 2024, "Mixtral of Experts"): the Llama decoder with a sparse MoE block in every layer.

Router softmax over ``num_local_experts``, top ``num_experts_per_tok``, always renormalised. Checkpoints name the
block ``block_sparse_moe`` (original layout) or ``mlp`` (transformers v5 fused layout); both map onto ``mlp``.
"""

from __future__ import annotations

from ferrylm.models.llama import SparseLlamaForCausalLM


class MixtralForCausalLM(SparseLlamaForCausalLM):
    """Mixtral causal LM; same API as :class:`~ferrylm.models.llama.LlamaForCausalLM` (the sparse decoder of
    :class:`~ferrylm.models.llama.SparseLlamaForCausalLM`; a configured sliding window is logged as ignored).

    Raises:
        ModelLoadError: the config has no experts; ValueError: no executor given.
    """

    arch_name = "MixtralForCausalLM"
    hf_renames = ((".block_sparse_moe.", ".mlp."),)
    ignores_sliding_window = True
