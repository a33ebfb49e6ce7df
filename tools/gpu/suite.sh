#!/bin/bash
# Scenarios of `ferry bench suite` (ONLY=comma list; default: issue 39's Qwen3-30B rows at 24 GiB and no cap).
source tools/gpu/env.sh
python3 -m ferrylm.cli bench suite --only "${ONLY:-q30b-bf16-24g,q30b-bf16-nocap}" --tokenizer local/tok \
  --date "$DATE-$CARD-${TAG:-main}" --out-dir "$OUT" --log-dir "$OUT" 2>&1 | tail -30
