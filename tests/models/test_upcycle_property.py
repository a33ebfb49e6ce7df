"""Property: our upcycled built-in MoE (8 identical experts, renormalised top-2) computes what our dense model
computes, for any prompt — in the same dtype (weights bf16, math float32)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferrylm.checkpoints import builtin
from ferrylm.models.reference_attention import DenseCausalAttention
from ferrylm.checkpoints.loader import load_model


@pytest.fixture(scope="module")
def models():
    try:
        dense_dir = builtin.ensure_builtin("smollm2-135m", progress=False)
        moe_dir = builtin.ensure_builtin("smollm2-moe", progress=False)
    except Exception as e:  # the model package is missing
        pytest.skip(str(e))
    dense = load_model(dense_dir, dtype=torch.bfloat16).model.float()  # same bf16-rounded weights as the MoE
    moe = load_model(moe_dir, dtype=torch.float32).model  # stored in bf16: widening is exact
    return dense, moe


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        t = torch.tensor(ids)
        return model.compute_logits(model(t, torch.arange(len(ids)), DenseCausalAttention()))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 49151), min_size=1, max_size=24))
def test_upcycled_moe_equals_dense(models, ids):
    dense, moe = models
    a, b = logits(dense, ids), logits(moe, ids)
    # identical experts, weights summing to 1 within float32 rounding (test_builtin's budget: ~1e-7 relative per op
    # through 30 residual layers); arbitrary id sequences drift further than its one prompt (1.22e-3 seen on
    # logits of ~15), still 50x below what rounding the weights to bf16 moves (0.28)
    assert (a - b).abs().max().item() <= 5e-3
    assert torch.equal(a.argmax(-1), b.argmax(-1))
