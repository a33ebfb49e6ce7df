"""A CPU-only install (``make serve``: no Triton, which only the dev extra and GPU machines bring) serves with every
expert backend: nothing on a CPU path imports Triton. Each check runs in a fresh interpreter in which importing
``triton`` fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.models.hf_checkpoints import build_checkpoint

_SCRIPT = r"""
import importlib.abc, json, sys
class _NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError("No module named 'triton'", name=name)
sys.meta_path.insert(0, _NoTriton())
from ferrylm.config import EngineConfig
from ferrylm.engine.boot import build_engine
from ferrylm.engine.sampling_params import SamplingParams
eng = build_engine(sys.argv[1], EngineConfig(device="cpu", dtype="float32", page_size=16, max_prefill_length=64,
                                             moe_backend=sys.argv[2], moe_cache_size=3))
eng.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
out = []
while eng.has_work():
    for o in eng.step():
        assert o.error_code is None, o.error_message
        out += o.new_token_ids
print(json.dumps({"tokens": out, "triton": any(m.split(".")[0] == "triton" for m in sys.modules)}))
"""


@pytest.mark.parametrize("backend", ["offload", "hybrid", "cpu"])
def test_cpu_serving_never_imports_triton(tmp_path, backend):
    ckpt = build_checkpoint("mixtral", tmp_path / "m", seed=2)
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(ckpt.path), backend], capture_output=True, text=True,
                       timeout=300, cwd=root, env={"PYTHONPATH": str(root / "src"), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(got["tokens"]) == 3 and not got["triton"], got
