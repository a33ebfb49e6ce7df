"""Tensor parallel (``--tensor-parallel-size``): flag validation, sharded models against TP=1, the rank group."""

from __future__ import annotations

import pytest

from ferrylm.cli import build_parser, engine_config_from_args
from ferrylm.config import EngineConfig, ModelConfig


def _mcfg(**over) -> ModelConfig:
    base = dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=2, vocab_size=128, intermediate_size=96, moe_intermediate_size=48, num_experts=4,
                num_experts_per_tok=2, mlp_only_layers=[0])
    return ModelConfig.from_dict({**base, **over})


def test_flag_and_alias_reach_the_engine_config():
    p = build_parser()
    for flag in ("--tensor-parallel-size", "--tp-size"):
        a = p.parse_args(["serve", "--model", "x", flag, "2"])
        assert engine_config_from_args(a).tensor_parallel_size == 2
    assert engine_config_from_args(p.parse_args(["serve", "--model", "x"])).tensor_parallel_size == 1


@pytest.mark.parametrize("n, ok", [(1, True), (2, True), (4, True), (3, False), (8, False)])
def test_heads_and_widths_must_divide(n, ok):
    cfg = EngineConfig(tensor_parallel_size=n).validate()
    if ok:
        cfg.check_model(_mcfg())   # n = 4 > 2 KV heads: replicated
    else:
        with pytest.raises(ValueError, match="--tensor-parallel-size"):
            cfg.check_model(_mcfg())


def test_each_width_is_named():
    cfg = EngineConfig(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        cfg.check_model(_mcfg(moe_intermediate_size=47))
    with pytest.raises(ValueError, match="intermediate_size \\(95\\)"):
        cfg.check_model(_mcfg(intermediate_size=95))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        EngineConfig(tensor_parallel_size=4).check_model(_mcfg(num_attention_heads=12, num_key_value_heads=3))


def test_out_of_range_and_device_index_refused():
    with pytest.raises(ValueError, match="--tensor-parallel-size must be >= 1"):
        EngineConfig(tensor_parallel_size=0).validate()
    with pytest.raises(ValueError, match="cuda:r"):
        EngineConfig(tensor_parallel_size=2, device="cuda:1").validate()


# --- sharded models against TP = 1 (two CPU processes over gloo) ----------------------------------------------

import multiprocessing as mp  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402

# the first prompt is longer than a prefill chunk (16): chunks beside running decodes
PROMPTS = [[5, 9, 17, 33, 3, 40, 41, 7] * 3 + [1, 2, 3], [11, 12, 13], [60, 3, 3, 3, 3, 21]]
MAX_TOKENS = 6
TP_CASES = ["llama_tied_bias", "qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe"]


def _engine_config(tp: int, **over):
    # float32 on the CPU, a pool of explicit size (no plan variance), no prefix caching: runs are comparable
    return EngineConfig(**{**dict(device="cpu", dtype="float32", num_pages=64, page_size=4, max_running_requests=4,
                                  max_prefill_length=16, tensor_parallel_size=tp, enable_prefix_caching=False,
                                  check_invariants=True), **over})


def _greedy(engine) -> tuple[dict[str, list[int]], list]:
    """Run PROMPTS greedily (chunked prefill of 16 tokens a step, batched decode); every logits tensor computed."""
    import torch

    from ferrylm.engine.sampling_params import SamplingParams

    seen: list = []
    model = engine.model
    inner = model.compute_logits

    def recording(hidden):
        out = inner(hidden)
        seen.append(out.detach().clone())
        return out

    model.compute_logits = recording
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    with torch.inference_mode():
        while engine.has_work():
            for out in engine.step():
                assert out.error_code is None, out.error_message
                tokens[out.request_id] += out.new_token_ids
    return tokens, seen


def _rank_main(rank: int, path: str, rdv: str, q, over: dict, presets: dict | None = None) -> None:
    import torch

    if presets:   # synthetic presets a test registered (this process is a fresh interpreter)
        from ferrylm.synthetic.presets import PRESETS, SyntheticPreset

        for name, (source, cfg) in presets.items():
            PRESETS[name] = SyntheticPreset(name, source, cfg)

    from ferrylm.engine.parallel.group import init_group
    from ferrylm.engine.parallel.step_sync import SHUTDOWN
    from ferrylm.models.tensor_parallel import TPShard

    try:
        group = init_group(TPShard(rank, 2), torch.device("cpu"), rdv)
        if rank == 0:
            from ferrylm.engine.boot import build_engine
            from ferrylm.engine.parallel.step_sync import StepBroadcaster

            engine = build_engine(path, _engine_config(2, **over), tp=StepBroadcaster(group))
            tokens, logits = _greedy(engine)
            kv_heads = engine.pool.k[0].shape[1]
            assert engine.tp.send_final(SHUTDOWN)
            q.put(("ok", tokens, [t.numpy() for t in logits], kv_heads))
        else:
            from ferrylm.engine.parallel.follower_runner import build_follower

            runner = build_follower(path, _engine_config(2, **over), group)
            assert runner.serve() == SHUTDOWN
            q.put(("follower", runner.steps, runner.pool.k[0].shape[1]))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback

        q.put(("error", rank, f"{e!r}\n{traceback.format_exc()}"))


def _run_tp2(path: Path, tmp: Path, over: dict, presets: dict | None = None):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    rdv = str(tmp / f"rdv-{zlib.crc32(str(path).encode())}")
    procs = [ctx.Process(target=_rank_main, args=(r, str(path), rdv, q, over, presets), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in range(2):
            results.append(q.get(timeout=240))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [r for r in results if r[0] == "error"]
    assert not errors, errors[0][2]
    return next(r for r in results if r[0] == "ok"), next(r for r in results if r[0] == "follower")


@pytest.mark.parametrize("case", TP_CASES)
def test_tp2_matches_tp1(case, tmp_path, over: dict | None = None):
    import numpy as np

    from ferrylm.engine.boot import build_engine
    from tests.models.hf_checkpoints import build_checkpoint

    path = tmp_path / case
    build_checkpoint(case, path, seed=zlib.crc32(case.encode()) % 1000 + 1)
    over = over or {}
    want_tokens, want_logits = _greedy(build_engine(path, _engine_config(1, **over)))
    (_, tokens, logits, kv_heads), (_, follower_steps, follower_kv_heads) = _run_tp2(path, tmp_path, over)
    assert tokens == want_tokens
    assert len(logits) == len(want_logits)
    for got, want in zip(logits, want_logits):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-4)
    full_kv = ModelConfig.from_folder(path).num_kv_heads
    assert kv_heads == follower_kv_heads == max(1, full_kv // 2)   # each rank's pool holds its heads only
    assert follower_steps >= MAX_TOKENS   # the warmup's steps and every served step ran on the follower too


# --- end to end: `ferry serve --tensor-parallel-size 2`, a follower SIGKILLed mid-stream --------------------------

import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

def _shared_dir() -> Path:
    """``../shared`` beside the checkout, or beside the main checkout when this one is a git worktree."""
    root = Path(__file__).resolve().parents[2]
    dot_git = root / ".git"
    if dot_git.is_file():   # a worktree: "gitdir: <main>/.git/worktrees/<name>"
        gitdir = Path(dot_git.read_text().split("gitdir:", 1)[1].strip())
        main = gitdir.parents[2] if gitdir.parent.name == "worktrees" else root
        if (main.parent / "shared").is_dir():
            return main.parent / "shared"
    return root.parent / "shared"


TOKENIZER_DIR = _shared_dir() / "data" / "qwen3-tokenizer"
MSGS = [{"role": "user", "content": "Count to a thousand."}]


def _tiny_qwen3_moe(folder: Path) -> Path:
    """Qwen3-MoE with the real Qwen3 vocabulary and chat template, everything else tiny; 2 query heads over 1 KV
    head, so TP = 2 replicates the KV head."""
    import torch
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=151936, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=4096, bos_token_id=151643, eos_token_id=151645,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, folder / name)
    return folder


class _Stream(threading.Thread):
    """One SSE chat stream; ``events``: (monotonic time, payload) of every data line."""

    def __init__(self, base_url: str):
        super().__init__(daemon=True)
        self.base_url = base_url
        self.events: list[tuple[float, str]] = []
        self.exc: BaseException | None = None

    def run(self) -> None:
        import httpx

        body = {"messages": MSGS, "max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", f"{self.base_url}/v1/chat/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append((time.monotonic(), line[len("data: "):]))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.exc = e


def _health(base_url: str) -> tuple[int, dict]:
    import httpx

    r = httpx.get(f"{base_url}/health", timeout=5)
    return r.status_code, r.json()


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def _ready_pids(base_url: str) -> list[int]:
    def ready() -> bool:
        try:
            return _health(base_url)[0] == 200
        except Exception:  # noqa: BLE001 - restarting
            return False

    _wait(ready, 120, "/health 200")
    return _health(base_url)[1]["tensor_parallel_pids"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_serve_tp2_follower_killed_mid_stream(tmp_path):
    import httpx
    import psutil

    from tests.e2e.conftest import start_server, stop_server

    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        pytest.skip(f"the real Qwen3 tokenizer is absent: {TOKENIZER_DIR}")
    folder = _tiny_qwen3_moe(tmp_path / "tiny-qwen3-moe")
    srv = start_server(tmp_path, "--model", str(folder), "--device", "cpu", "--num-tokens", "4096",
                       "--tensor-parallel-size", "2", "--max-engine-restarts", "4", "--watchdog-timeout", "6")
    seen: set[int] = set()
    try:
        rank0, rank1 = _ready_pids(srv.base_url)
        seen |= {rank0, rank1}
        server = psutil.Process(srv.proc.pid)
        assert {rank0, rank1} <= {c.pid for c in server.children()}   # both ranks are the frontend's children
        assert "ferrylm-engine-tp1" in " ".join(psutil.Process(rank1).cmdline()) or \
            psutil.Process(rank1).name().startswith("ferrylm-engine")

        # 1. a follower SIGKILLed mid-stream: the stream ends with an error event, the group restarts
        stream = _Stream(srv.base_url)
        stream.start()
        _wait(lambda: len(stream.events) >= 5 or not stream.is_alive(), 60, "the stream to start")
        t_kill = time.monotonic()
        os.kill(rank1, signal.SIGKILL)
        stream.join(30)
        assert not stream.is_alive() and stream.exc is None, stream.exc
        errors = [(t, json.loads(p)["error"]) for t, p in stream.events if p != "[DONE]" and "error" in p]
        assert errors, stream.events[-3:]
        t_err, err = errors[0]
        assert err["code"] == "engine_unavailable" and "rank 1" in err["message"], err
        assert t_err - t_kill < 2.0
        assert stream.events[-1][1] == "[DONE]"
        _wait(lambda: not psutil.pid_exists(rank0) or psutil.Process(rank0).status() == psutil.STATUS_ZOMBIE, 10,
              "rank 0 of the failed group to go")

        # 2. the restarted group answers
        new0, new1 = _ready_pids(srv.base_url)
        seen |= {new0, new1}
        assert {new0, new1}.isdisjoint({rank0, rank1})
        r = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=60,
                       json={"messages": MSGS, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        assert _health(srv.base_url)[1]["restarts"] == 1

        # 3. rank 0 killed: its follower goes with it, the group restarts again
        os.kill(new0, signal.SIGKILL)
        _wait(lambda: not psutil.pid_exists(new1) or psutil.Process(new1).status() == psutil.STATUS_ZOMBIE, 10,
              "the follower of a dead rank 0 to exit")
        seen |= set(_ready_pids(srv.base_url))

        # 4. a follower stopped (SIGSTOP) mid-stream: rank 0 waits in a collective, its ticks stop, the watchdog
        #    answers the stream and restarts the group (the stopped follower is killed too)
        stuck0, stuck1 = _ready_pids(srv.base_url)
        seen |= {stuck0, stuck1}
        stream = _Stream(srv.base_url)
        stream.start()
        _wait(lambda: len(stream.events) >= 5 or not stream.is_alive(), 60, "the second stream to start")
        t_stop = time.monotonic()
        os.kill(stuck1, signal.SIGSTOP)
        stream.join(40)
        assert not stream.is_alive() and stream.exc is None, stream.exc
        errors = [(t, json.loads(p)["error"]) for t, p in stream.events if p != "[DONE]" and "error" in p]
        assert errors and errors[0][1]["code"] == "engine_stalled", stream.events[-3:]
        assert errors[0][0] - t_stop < 30
        _wait(lambda: not psutil.pid_exists(stuck1) or psutil.Process(stuck1).status() == psutil.STATUS_ZOMBIE, 10,
              "the stopped follower to be killed")
        seen |= set(_ready_pids(srv.base_url))

        # 5. the frontend SIGKILLed: no rank outlives it
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(10)
        procs = []
        for pid in seen:
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=10)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, alive
    finally:
        stop_server(srv)


# --- what tensor parallel refuses, and TP = 1 untouched -----------------------------------------------------------


def test_whole_projection_qk_norm_refused_before_loading(tmp_path):
    from ferrylm.errors import ModelLoadError
    from ferrylm.checkpoints.loader import load_model
    from ferrylm.models.tensor_parallel import TPShard
    from tests.models.hf_checkpoints import build_checkpoint

    build_checkpoint("olmoe", tmp_path / "olmoe", seed=1)
    with pytest.raises(ModelLoadError, match="--tensor-parallel-size 2.*whole projection"):
        load_model(tmp_path / "olmoe", tp=TPShard(0, 2))


def test_offline_engine_refuses_tp_without_a_group(tmp_path):
    from ferrylm.engine.boot import build_engine
    from tests.models.hf_checkpoints import build_checkpoint

    build_checkpoint("llama", tmp_path / "llama", seed=1)
    with pytest.raises(ValueError, match="ferry serve"):
        build_engine(tmp_path / "llama", _engine_config(2))


def test_tp1_is_the_unsplit_model(tmp_path):
    import torch

    from ferrylm.checkpoints.loader import load_model
    from ferrylm.models.llama import DecoderLayer
    from ferrylm.models.tensor_parallel import TPShard
    from tests.models.hf_checkpoints import build_checkpoint

    build_checkpoint("qwen3_moe", tmp_path / "m", seed=1)
    plain, one = load_model(tmp_path / "m"), load_model(tmp_path / "m", tp=TPShard(0, 1))
    assert plain.config == one.config
    for (k, a), (_, b) in zip(plain.model.state_dict().items(), one.model.state_dict().items()):
        assert torch.equal(a, b), k
    assert all(m.tp_reduce is None for m in plain.model.modules() if isinstance(m, DecoderLayer))


def test_shards_tile_the_full_tensors(tmp_path):
    """Concatenating the ranks' column-parallel rows / row-parallel columns gives back the full weights."""
    import torch

    from ferrylm.checkpoints.loader import load_model
    from ferrylm.models.tensor_parallel import TPShard
    from tests.models.hf_checkpoints import build_checkpoint

    build_checkpoint("mixtral", tmp_path / "m", seed=1)
    full = load_model(tmp_path / "m")
    parts = [load_model(tmp_path / "m", tp=TPShard(r, 2)) for r in range(2)]
    layer = lambda lm: lm.model.model.layers[0]  # noqa: E731
    q = torch.cat([layer(p).self_attn.q_proj.weight for p in parts])
    assert torch.equal(q, layer(full).self_attn.q_proj.weight)
    o = torch.cat([layer(p).self_attn.o_proj.weight for p in parts], dim=1)
    assert torch.equal(o, layer(full).self_attn.o_proj.weight)
    ex = [p.executor.layers[0] for p in parts]
    assert torch.equal(torch.cat([e.gate for e in ex], dim=1), full.executor.layers[0].gate)
    assert torch.equal(torch.cat([e.down for e in ex], dim=2), full.executor.layers[0].down)
    assert ex[0].gate.shape[1] * 2 == full.executor.layers[0].gate.shape[1]   # a rank holds half of each expert


def test_tp2_replicated_kv_head_matches_tp1(tmp_path, monkeypatch):
    """One KV head over two ranks: each rank holds a copy of it (and its pool a copy of its K/V)."""
    from tests.models import hf_checkpoints

    monkeypatch.setitem(hf_checkpoints.CASES, "llama_mqa", ("llama", dict(
        vocab_size=160, intermediate_size=128, num_key_value_heads=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})))
    test_tp2_matches_tp1("llama_mqa", tmp_path)


def test_more_ranks_than_gpus_refused_at_the_cli(monkeypatch):
    from ferrylm.server.process.launch import check_tp_devices, visible_gpus

    assert check_tp_devices(EngineConfig(tensor_parallel_size=2, device="cuda"), gpus=2) is None
    err = check_tp_devices(EngineConfig(tensor_parallel_size=4, device="cuda"), gpus=2)
    assert err and "--tensor-parallel-size 4 needs 4 GPUs" in err and "2 visible" in err
    assert check_tp_devices(EngineConfig(tensor_parallel_size=4, device="auto"), gpus=0) is None   # CPU ranks
    assert check_tp_devices(EngineConfig(tensor_parallel_size=4, device="cpu"), gpus=1) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,-1,3")
    assert visible_gpus() == 2


def test_tp2_offloaded_experts_match_tp1(tmp_path):
    """The offload backend over each rank's shard: host banks of half-width experts, a small slot cache reserved on
    the follower from rank 0's budget (the header's), misses every step."""
    test_tp2_matches_tp1("qwen3_moe", tmp_path, over=dict(moe_backend="offload", moe_cache_size=3))


def test_tp2_fp8_kv_matches_tp1(tmp_path):
    """``--kv-cache-dtype fp8`` over two ranks: the follower builds its pool in fp8 too, and per-head scales make each
    rank's quantized K/V those heads' of the unsplit pool, so the logits match TP 1's."""
    test_tp2_matches_tp1("qwen3_moe", tmp_path, over=dict(kv_cache_dtype="fp8"))


# a Qwen3-MoE of published proportions, tiny: 4 query heads over 2 KV heads, a dense layer, 8 experts of width 32
TINY_PRESET = ("tests/tiny", {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False, "head_dim": 16,
    "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "max_position_embeddings": 512, "mlp_only_layers": [0], "decoder_sparse_step": 1, "norm_topk_prob": True,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2,
    "num_hidden_layers": 3, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "vocab_size": 160, "eos_token_id": 2, "bos_token_id": 1})


@pytest.fixture
def tiny_synthetic(tmp_path, monkeypatch):
    from ferrylm.synthetic import spec as synthetic
    from ferrylm.synthetic.presets import PRESETS, SyntheticPreset

    monkeypatch.setitem(PRESETS, "tp-tiny", SyntheticPreset("tp-tiny", *TINY_PRESET))
    return synthetic.materialize(synthetic.parse_synthetic_spec("synthetic:tp-tiny:layers=3"), tmp_path / "syn")


def test_synthetic_shards_are_cut_from_the_whole_model(tiny_synthetic):
    import torch

    from ferrylm.checkpoints.loader import load_model
    from ferrylm.models.tensor_parallel import TPShard

    full = load_model(tiny_synthetic, dtype=torch.float32)
    parts = [load_model(tiny_synthetic, dtype=torch.float32, tp=TPShard(r, 2)) for r in range(2)]
    sd = [p.model.state_dict() for p in parts]
    for name, t in full.model.state_dict().items():
        if "q_proj" in name or "gate_proj" in name or "up_proj" in name:
            assert torch.equal(torch.cat([d[name] for d in sd]), t), name
        elif "o_proj" in name or "down_proj" in name:
            assert torch.equal(torch.cat([d[name] for d in sd], dim=1), t), name
        elif "k_proj" not in name and "v_proj" not in name:
            assert all(torch.equal(d[name], t) for d in sd), name   # replicated
    layer = 1   # a MoE layer
    assert torch.equal(torch.cat([p.executor.layers[layer].up for p in parts], dim=1), full.executor.layers[layer].up)
    assert torch.equal(torch.cat([p.executor.layers[layer].down for p in parts], dim=2),
                       full.executor.layers[layer].down)


def test_tp2_synthetic_matches_tp1(tiny_synthetic, tmp_path):
    """A synthetic model (routing model choosing the experts) under TP = 2 computes what TP = 1 does."""
    import numpy as np

    from ferrylm.engine.boot import build_engine

    over = dict(dtype="float32")
    want_tokens, want_logits = _greedy(build_engine(tiny_synthetic, _engine_config(1, **over)))
    (_, tokens, logits, _), _ = _run_tp2(tiny_synthetic, tmp_path, over, presets={"tp-tiny": TINY_PRESET})
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits, strict=True):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-4)


def test_an_oom_inside_a_tp_step_is_not_retryable():
    """The OOM guard retries what ``is_oom`` matches; a retry while the followers wait in the step's collectives
    would mismatch them, so the TP error must not read as an allocation failure."""
    from ferrylm.engine.parallel.group import TensorParallelError, oom_inside_step
    from ferrylm.memory.guard import is_oom

    err = oom_inside_step("OutOfMemoryError")
    assert isinstance(err, TensorParallelError) and not is_oom(err)


def test_the_frontend_starts_followers_without_importing_torch():
    import subprocess
    import sys

    code = ("import sys\n"
            "import ferrylm.server.process.supervisor, ferrylm.engine.parallel.follower, ferrylm.server.process.launch\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_generate_refuses_tp(capsys):
    from ferrylm.cli import _main

    with pytest.raises(SystemExit) as e:   # _main: the CLI without main()'s process-wide signal handlers
        _main(["generate", "--model", "x", "--tensor-parallel-size", "2"])
    assert e.value.code == 2 and "use `ferry serve`" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_next"])
def test_latent_and_linear_attention_models_are_refused_over_two_ranks(family, tmp_path):
    """Latent attention (DeepSeek-V3) and Gated DeltaNet layers (Qwen3-Next) are not split yet: refused by name
    before anything loads, instead of a wrong forward."""
    from ferrylm.errors import ModelLoadError
    from ferrylm.models.registry import get_model_class
    from ferrylm.models.tensor_parallel import TPShard, check_shardable
    from tests.models.hf_checkpoints import build_checkpoint

    build_checkpoint(family, tmp_path)
    cfg = ModelConfig.from_folder(tmp_path)
    with pytest.raises(ModelLoadError, match="tensor-parallel-size 2"):
        check_shardable(get_model_class(cfg.architecture), cfg, TPShard(rank=0, size=2))
    check_shardable(get_model_class(cfg.architecture), cfg, TPShard(rank=0, size=1))
