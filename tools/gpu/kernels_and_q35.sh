#!/bin/bash
# The GPU tests of the DeltaNet scan and routing kernels, their A/B against the torch forms (ab_kernels.py), then
# the q35-bf16-32g scenario through `ferry serve` (~450 s). JSON and logs to $OUT. TAG names the variant.
source tools/gpu/env.sh
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_gated_delta_scan.py \
  tests/kernels/test_routing_kernel.py tests/gpu/test_routing_model_cuda.py tests/gpu/test_qwen3_next_cuda.py \
  tests/gpu/test_experts_cuda.py 2>&1 | tail -15
timeout 120 python3 tools/gpu/ab_kernels.py 2>&1 | tail -12
python3 -m ferrylm.cli bench suite --only q35-bf16-32g --tokenizer local/tok --date "$DATE-$CARD-${TAG:-main}" \
  --out-dir "$OUT" --log-dir "$OUT" 2>&1 | tail -25
