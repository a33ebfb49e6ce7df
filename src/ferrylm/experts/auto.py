"""``--moe-backend auto``: resident when every expert fits the device budget; otherwise the offloading backend with
the lowest predicted decode step time from the measured bandwidths.

Prediction (batch ``B``, ``L`` MoE layers of ``E`` experts, top-``k``, ``N`` cache slots, ``S`` bytes per expert):
a layer needs ``d = E * (1 - (1 - k/E)^B)`` distinct experts (uniform routing); with the cache holding a uniform
share, a fraction ``h = min(1, N / (L * E))`` of them hits, so a step misses ``m = L * d * (1 - h)`` experts.
Then ``t_offload = m S / B_pcie``, ``t_cpu = m S / B_cpu`` and ``t_hybrid = m S / (B_pcie + B_cpu_eff)`` (both
sides busy until the end; see :mod:`ferrylm.experts.hybrid`). Skewed routing raises ``h`` for every backend alike.

The prediction is reported, not obeyed: measured, ``offload`` was fastest where the model ranked hybrid or cpu
first, and a noisy CPU probe could make two boots of one configuration pick differently (docs/BENCHMARKS.md, "The
figures behind choices in the code"). So ``auto`` picks ``offload`` whenever the slots hold one layer of a token's
experts (``top_k``), else ``cpu``: the same pick on every boot; ``--moe-backend hybrid`` / ``cpu`` stay
available."""

from __future__ import annotations

from dataclasses import dataclass

from ferrylm.experts.hybrid import cpu_effective_rate
from ferrylm.experts.options import Bandwidths

OFFLOADING = ("offload", "hybrid", "cpu")  # tie order: the simpler mechanism first


@dataclass(frozen=True)
class AutoChoice:
    """The decision: ``backend``, a one-line ``reason``, and ``predicted`` seconds per decode step by backend."""

    backend: str
    reason: str
    predicted: dict[str, float]


def expected_misses(*, num_layers: int, num_experts: int, top_k: int, slots: int, batch: int = 1) -> float:
    """``m`` of the module docstring: experts a decode step of ``batch`` tokens misses."""
    distinct = num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)
    hit = min(1.0, slots / float(num_layers * num_experts))
    return num_layers * distinct * (1.0 - hit)


def predict_step_times(misses: float, expert_bytes: int, bw: Bandwidths) -> dict[str, float]:
    """Seconds per step for each offloading backend (module docstring)."""
    b = misses * expert_bytes
    return {"offload": b / bw.pcie, "hybrid": b / (bw.pcie + cpu_effective_rate(bw)), "cpu": b / bw.cpu}


def choose_backend(*, expert_bytes_total: int, budget_bytes: int | None, expert_bytes: int, num_layers: int,
                   num_experts: int, top_k: int, stream_bytes: int, bandwidths, batch: int = 1) -> AutoChoice:
    """Pick the backend.

    Args:
        expert_bytes_total: all routed experts' bytes. budget_bytes: device bytes left for experts (None: no
            limit, everything fits). expert_bytes: one expert. stream_bytes: the prefill double buffer.
        bandwidths: a :class:`Bandwidths` or a zero-argument callable measuring them (only called when the
            experts do not fit).
    """
    if budget_bytes is None or expert_bytes_total <= budget_bytes:
        return AutoChoice("resident", "every routed expert fits in the device budget", {})
    bw = bandwidths() if callable(bandwidths) else bandwidths
    slots = max(0, (budget_bytes - stream_bytes) // expert_bytes)
    m = expected_misses(num_layers=num_layers, num_experts=num_experts, top_k=top_k, slots=slots, batch=batch)
    times = predict_step_times(m, expert_bytes, bw)
    # NOTE: measured, not predicted (module docstring): offload whenever the slots hold one layer of a token's
    # experts; cpu only below that (offload would run its layers in waves)
    best = "offload" if slots >= max(1, top_k) else "cpu"
    return AutoChoice(best, f"experts need {expert_bytes_total / 2**30:.1f} GiB, {budget_bytes / 2**30:.1f} GiB "
                            f"left: {slots} slots, ~{m:.0f} misses/step; predicted ms/step "
                      + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in times.items()), times)


def _attention_params(config) -> int:
    """Weights of one layer's attention: q/k/v/o of GQA, or multi-head latent attention's projections (DeepSeek-V3:
    ``kv_lora_rank`` in the config; q_a / q_b or q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj)."""
    raw, h, heads = config.raw, config.hidden_size, config.num_heads
    if raw.get("kv_lora_rank"):
        r, ql = int(raw["kv_lora_rank"]), raw.get("q_lora_rank")
        nope, rope, vd = int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"]), int(raw["v_head_dim"])
        q = h * heads * (nope + rope) if ql is None else int(ql) * (h + heads * (nope + rope))
        return q + h * (r + rope) + r * heads * (nope + vd) + heads * vd * h
    q, kv = heads * config.head_dim, config.num_kv_heads * config.head_dim
    return 2 * h * q + 2 * h * kv


def estimate_non_expert_bytes(config, moe_layers: tuple[int, ...], dtype_bytes: int) -> int:
    """Bytes of every weight except the routed experts, from a :class:`~ferrylm.config.ModelConfig`: embedding
    (and an untied ``lm_head``), attention projections, dense MLPs of non-MoE layers, routers and shared experts.
    Norms and biases are left out (under 0.1 %)."""
    h, v = config.hidden_size, config.vocab_size
    n = v * h * (1 if config.tie_word_embeddings else 2)
    n += config.num_layers * _attention_params(config)
    n += (config.num_layers - len(moe_layers)) * 3 * h * config.intermediate_size
    shared = int(config.raw.get("shared_expert_intermediate_size") or 0)  # Qwen2-MoE: with a [1, H] gate
    gate = h if shared else 0
    if not shared and config.raw.get("n_shared_experts"):  # GLM-4.5: n_shared_experts fused, no gate
        shared = int(config.raw["n_shared_experts"]) * config.moe_intermediate_size
    n += len(moe_layers) * (config.num_experts * h + 3 * h * shared + gate)
    return n * dtype_bytes
