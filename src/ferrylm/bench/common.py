"""What the benches share, so that they measure the same thing: the prompt ids, the token checksum, a device sync.
"""

from __future__ import annotations

import hashlib
import json

import torch


def bench_prompts(vocab_size: int, batch: int, prompt_tokens: int, seed: int,
                  num_warm: int = 1) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts every bench uses for ``seed``: ``batch`` prompts of ``prompt_tokens`` ids in ``[1, min(V, 1000))``,
    then ``num_warm`` warm-up prompts, drawn in that order from one ``torch.Generator(seed)`` (so the timed prompts
    do not depend on ``num_warm``). Returns ``(prompts, warm)`` as lists of ``[prompt_tokens]`` id lists."""
    g = torch.Generator().manual_seed(seed)
    upper = min(vocab_size, 1000)
    draw = [torch.randint(1, upper, (prompt_tokens,), generator=g).tolist() for _ in range(batch + num_warm)]
    return draw[:batch], draw[batch:]


def token_checksum(token_ids) -> str:
    """12 hex digits of the SHA-256 of the JSON of ``token_ids`` (nested lists of ints): equal checksums, identical
    tokens."""
    return hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()[:12]


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
