"""The contract between the experts and their callers (``experts/executor.ExpertExecutor``): every backend answers
it the same way, code outside ``experts/`` never probes an executor with getattr / hasattr, and the model's
routers reach the executor when the model is built."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import transformers
from tests.experts.helpers import options

import ferrylm
from ferrylm.checkpoints.loader import load_model
from ferrylm.experts import build_executor
from ferrylm.experts.executor import ExpertLayout
from ferrylm.experts.executor import ExpertExecutor, LayerExperts
from ferrylm.experts.stats import ExpertReport
from ferrylm.faults import NO_FAULTS
from ferrylm.memory.guard import NoElasticCache, elastic_cache_of
from ferrylm.models.moe import SparseMoeBlock

BACKENDS = ("resident", "offload", "cpu", "hybrid")
E, H, I, K = 6, 32, 16, 2
SRC = Path(ferrylm.__file__).parent


def executor_probes(root: Path) -> list[str]:
    """``file:line`` of every getattr / hasattr under ``root`` outside ``experts/`` whose object names an executor or
    experts (``self.executor``, ``expert_executor``, ``ex`` ...) or that asks a module for its ``"executor"``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "experts":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2):
                continue
            obj, attr = ast.unparse(node.args[0]).lower(), node.args[1]
            asks_executor = isinstance(attr, ast.Constant) and attr.value == "executor"
            if "executor" in obj or "experts" in obj or obj == "ex" or asks_executor:
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_code_outside_experts_probes_an_executor():
    assert executor_probes(SRC) == []


def test_the_probe_scan_finds_probes(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "experts").mkdir()
    (tmp_path / "engine" / "a.py").write_text("x = getattr(self.executor, 'begin_step', None)\n"
                                              "y = hasattr(layer.mlp, 'executor')\nz = getattr(cfg, 'name')\n")
    (tmp_path / "experts" / "b.py").write_text("x = getattr(self.executor, 'cache', None)\n")
    assert [p.split(":")[0:2] for p in executor_probes(tmp_path)] == [["engine/a.py", "1"], ["engine/a.py", "2"]]


def _layers(n_layers: int = 3) -> dict[int, LayerExperts]:
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    return {i: LayerExperts(gate=r(E, I, H), up=r(E, I, H), down=r(E, H, I)) for i in range(n_layers)}


def _step(t: int = 3):
    g = torch.Generator().manual_seed(7)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    return torch.randn(t, H, generator=g), ids, torch.rand(t, K, generator=g)


@pytest.fixture(params=BACKENDS)
def executor(request):
    ex = build_executor(options(request.param, 4), _layers(), "cpu")
    yield ex
    ex.close()


def test_identity_faults_and_step_hooks(executor):
    assert isinstance(executor, ExpertExecutor) and executor.name == executor.stats().backend
    assert executor.name in BACKENDS and executor.faults is NO_FAULTS
    row = _layers()[0].expert_bytes if executor.name == "resident" else ExpertLayout.of(_layers()[0]).nbytes
    assert executor.expert_bytes == row
    assert not executor.graph_safe  # CPU: no whole-step graphs
    executor.begin_step(3)
    executor.count_replayed_step(3)
    executor.sync_stats()


def test_run_and_stats_report(executor):
    x, ids, w = _step()
    ref = build_executor("resident", _layers(), "cpu").run(1, x, ids, w)
    torch.testing.assert_close(executor.run(1, x, ids, w), ref, rtol=1e-5, atol=1e-5)
    report = executor.stats()
    assert isinstance(report, ExpertReport)
    assert report.totals.needed == report.totals.hits + report.totals.misses > 0
    assert report.layers == [0, 1, 2] and len(report.layer_hits) == len(report.layer_misses) == 3
    if executor.name != "resident":  # per-layer figures come from the slot cache
        assert sum(report.layer_hits) + sum(report.layer_misses) == report.totals.needed
    d = report.as_dict()
    assert d["backend"] == executor.name and d["needed"] == report.totals.needed and "last_step" in d
    assert ("expert_bytes" in d) == (executor.name != "resident")
    assert ("cpu_share" in d) == (executor.name == "hybrid")


def test_device_memory(executor):
    needs = executor.slot_needs()
    if executor.name == "resident":  # the experts are weights: nothing to size, nothing to give back
        assert needs is None and executor.reserve(10**9) == 0 and executor.num_slots == 0
        assert executor.slot_bytes == 0 and executor.shrink_slots(1) == 0 and executor.grow_slots(1) == 0
        assert isinstance(elastic_cache_of(executor), NoElasticCache)
        return
    per = executor.expert_bytes
    assert (needs.slot_bytes, needs.total_experts, needs.min_slots, needs.backend) == (
        per, 3 * E, executor.min_slots, executor.name)
    assert executor.reserve(needs.bytes_for(4)) == 4 == executor.num_slots and executor.slot_bytes == per
    executor.block_slots = 1
    executor.reserve(needs.bytes_for(4))
    cache = elastic_cache_of(executor)
    assert (cache.num_slots, cache.slot_bytes, cache.min_slots) == (4, per, executor.min_slots)
    assert cache.shrink(2) == 2 * per and executor.num_slots == 2
    assert cache.grow(1) == 1 and executor.num_slots == 3


def test_stage_layout(executor):
    layout = executor.stage_layout
    if executor.name in ("offload", "hybrid"):
        assert layout is not None and layout.nbytes == executor.expert_bytes
    else:
        assert layout is None


def test_routers_are_handed_over_once(executor):
    def route(hidden):
        return torch.zeros(hidden.shape[0], K, dtype=torch.int64)

    assert executor.next_layer_predictor(0, 1) is None  # no routers yet
    executor.use_routers({0: route, 1: route, 2: route})
    predictor = executor.next_layer_predictor(0, 1)
    assert predictor is (None if executor.name in ("resident", "cpu") else route)  # cpu: prefetch off by default
    assert executor.next_layer_predictor(2, 1) is None  # the last MoE layer has no successor
    executor.use_routers({})
    assert executor.next_layer_predictor(0, 1) is None


def _needs(config_class: str) -> pytest.MarkDecorator:
    """Skip unless the installed transformers has ``config_class`` (the reference checkpoint is built with it)."""
    return pytest.mark.skipif(not hasattr(transformers, config_class), reason=f"transformers has no {config_class}")


# one case per decoder stack that builds MoE blocks: llama.py's (mixtral), deepseek_v3's, qwen3_next's hybrid stack,
# and the hyper-connection stacks of qwen4_exp and deepseek_v4
STACKS = [("mixtral", "offload"), ("mixtral", "hybrid"), ("deepseek_v3", "offload"), ("qwen3_next", "offload"),
          pytest.param("qwen4_exp", "offload", marks=_needs("Qwen4ExpTextConfig")),
          pytest.param("deepseek_v4", "offload", marks=_needs("DeepseekV4Config"))]


@pytest.mark.parametrize(("case", "backend"), STACKS)
def test_the_model_hands_its_routers_when_built(expert_checkpoints, case, backend):
    """Building the model hands every MoE block's router to the executor (``models/moe.hand_routers``): the first
    MoE layer's predictor is the second's ``predict_experts``."""
    loaded = load_model(expert_checkpoints(case).path, moe_backend=options(backend, 4))
    try:
        blocks = [layer.mlp for layer in loaded.model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
        first, second = blocks[0], blocks[1]
        assert loaded.executor.next_layer_predictor(first.layer_idx, 1) == second.predict_experts
    finally:
        loaded.executor.close()
