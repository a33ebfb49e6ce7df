"""``ferry bench hf``: the same prompts as ``ferry bench serve`` through transformers' ``generate`` (the
reference implementation), for a side-by-side output tok/s on the same machine.

Prompts: :func:`ferrylm.bench.serve.make_prompts` with the same seed, so token ids match the serve benchmark.
Generation is greedy with ``min_new_tokens = max_new_tokens`` (the equivalent of ``ignore_eos``), in batches of
``--batch`` prompts of equal length (no padding).
"""

from __future__ import annotations

import time

from ferrylm.bench.serve import BenchConfig, make_prompts


def run_hf_baseline(model_path: str, cfg: BenchConfig, batch: int, dtype: str = "float32") -> dict:
    """Returns ``{"batch", "num_prompts", "output_tokens", "duration_s", "output_throughput"}`` (tok/s)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    prompts = make_prompts(cfg)
    out_tokens = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            chunk = prompts[i: i + batch]
            ids = torch.tensor([p for p, _ in chunk])
            n = chunk[0][1]
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n, pad_token_id=0)
            out_tokens += (out.shape[1] - ids.shape[1]) * out.shape[0]
    dt = time.perf_counter() - t0
    return {"batch": batch, "num_prompts": len(prompts), "output_tokens": out_tokens, "duration_s": dt,
            "output_throughput": out_tokens / dt}
