"""`ferry bench peer`: both engines on one tiny GGUF, alternately, through the `bench serve` client, into one JSON
with the ratio (llama-server played by tests/bench/fake_llama_server.py; ferry serve is the real one); the build
step on a tarball of a stand-in CMake project; the summary and round order; bad flags. A real llama.cpp build runs
only with FERRYLM_PEER_LLAMA_SRC set (minutes of CPU)."""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
import tarfile
from pathlib import Path

import pytest

from ferrylm.bench.peer import round_order, slot_context, summarize
from ferrylm.bench.suite import RunShape
from ferrylm.cli import main

FAKE = Path(__file__).with_name("fake_llama_server.py")


def _two_free_ports() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def _fake_binary(tmp_path: Path) -> Path:
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return binary


@pytest.fixture
def tiny_gguf(tmp_path):
    pytest.importorskip("gguf")
    from tests.models.test_gguf_file import _qwen3moe

    return _qwen3moe(tmp_path, {1: "Q6_K", 2: "Q6_K"})[1]


def test_peer_serves_both_engines_on_one_gguf_and_writes_the_ratio(tmp_path, tiny_gguf, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(tmp_path / "llama-argv.jsonl"))
    out, port = tmp_path / "out" / "peer.json", _two_free_ports()
    out.parent.mkdir()   # --output-json names a file in a folder that exists
    rc = main(["bench", "peer", "--llama-server", str(_fake_binary(tmp_path)), "--gguf", str(tiny_gguf),
               "--rounds", "1", "--port", str(port), "--threads", "2", "--ctx", "256", "--prefill-len", "24",
               "--prefill-prompts", "1", "--concurrency", "1,2", "--num-prompts", "2", "--input-len", "8",
               "--output-len", "3", "--ferry-args", "--max-model-len 256", "--output-json", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.err[-3000:]
    rec = json.loads(out.read_text())
    assert rec["kind"] == "ferry-bench-peer" and rec["gguf"] == str(tiny_gguf.resolve())
    assert [(r["round"], r["engine"]) for r in rec["rounds"]] == [(0, "llama"), (0, "ferry")]
    for r in rec["rounds"]:
        assert r["ready_s"] > 0 and r.get("error") is None, r
        assert set(r["runs"]) == {"prefill", "c1", "c2"}
        for name, s in r["runs"].items():
            assert s["failed"] == 0 and s["completed"] == (1 if name == "prefill" else 2), (r["engine"], name, s)
            assert s["total_output_tokens"] == (1 if name == "prefill" else 6)
    assert rec["rounds"][1]["command"][-2:] == ["--max-model-len", "256"]
    assert rec["rounds"][1]["runs"]["c1"]["server"]["moe_backend"]          # the real ferry serve answered
    argv = json.loads((tmp_path / "llama-argv.jsonl").read_text().splitlines()[0])
    assert argv[:2] == ["-m", str(tiny_gguf.resolve())] and argv[argv.index("-t") + 1] == "2"
    assert argv[argv.index("-np") + 1] == "2" and argv[argv.index("--port") + 1] == str(port)
    assert argv[argv.index("-c") + 1] == "512"     # --ctx is per slot: llama-server splits -c among -np slots
    for shape in ("prefill", "c1", "c2"):
        row = rec["summary"][shape]
        assert row["ferry_over_llama"]["output_tok_s"] == pytest.approx(
            row["ferry"]["output_tok_s"] / row["llama"]["output_tok_s"])
    assert rec["llama"]["version"] == "version: 0 (fake)" and rec["llama"]["build_s"] is None
    assert "ferry/llama" in printed.out and "c2" in printed.out


def test_round_order_alternates_and_summary_takes_medians():
    assert round_order(2) == [(0, "llama"), (0, "ferry"), (1, "ferry"), (1, "llama")]
    assert slot_context((RunShape("prefill", 1, 2, 512, 1), RunShape("c4", 4, 8, 64, 32))) == 768
    assert slot_context((RunShape("c1", 1, 2, 8, 4),)) == 256
    shapes = (RunShape("c1", 1, 2, 8, 4),)

    def run(engine, ttft, itl, tok_s, ready):
        return {"engine": engine, "ready_s": ready, "runs": {"c1": {
            "ttft_ms": {"p50": ttft}, "itl_ms": {"p50": itl}, "output_throughput": tok_s, "failed": 0}}}

    rounds = [run("llama", 100, 10, 50, 2), run("ferry", 300, 20, 10, 30), run("ferry", 500, 40, 20, 50),
              run("llama", 300, 30, 70, 4), run("ferry", 400, 30, 15, 40), run("llama", 200, 20, 60, 3)]
    s = summarize(rounds, shapes)
    assert s["c1"]["llama"] == {"ttft_p50_ms": 200, "itl_p50_ms": 20, "output_tok_s": 60, "failed": 0}
    assert s["c1"]["ferry"]["ttft_p50_ms"] == 400
    assert s["c1"]["ferry_over_llama"] == {"ttft_p50_ms": 2.0, "itl_p50_ms": 1.5, "output_tok_s": 0.25}
    assert s["ready_s"] == {"llama": 3, "ferry": 40, "ferry_over_llama": 40 / 3}
    assert summarize([rounds[0]], shapes)["c1"]["ferry_over_llama"]["output_tok_s"] is None   # ferry never ran


FAKE_PROJECT = {
    "CMakeLists.txt": "cmake_minimum_required(VERSION 3.10)\nproject(fakellama C)\n"
                      "set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)\n"
                      "add_executable(llama-server server.c)\nadd_executable(other broken.c)\n",
    "server.c": '#include <stdio.h>\nint main(void) { fprintf(stderr, "version: 1 (stand-in)\\n"); return 0; }\n',
    "broken.c": "this is not C; only the llama-server target may be built\n",
}


def test_build_from_a_tarball_builds_only_llama_server_once(tmp_path, capsys):
    if not __import__("shutil").which("cmake"):
        pytest.skip("no cmake")
    src = tmp_path / "fakellama"
    src.mkdir()
    for name, text in FAKE_PROJECT.items():
        (src / name).write_text(text)
    tar_path = tmp_path / "fakellama.tar.gz"
    with tarfile.open(tar_path, "w:gz") as tar:
        tar.add(src, arcname="fakellama")
    work = tmp_path / "work"
    args = ["bench", "peer", "--llama-src", str(tar_path), "--work-dir", str(work), "--build-only"]
    assert main(args) == 0, capsys.readouterr().err
    binary = Path(capsys.readouterr().out.split()[1])
    assert binary.is_file() and binary.name == "llama-server" and os.access(binary, os.X_OK)
    assert main(args) == 0     # unpacked and configured once; the second run only checks the build
    log = (work / "build.log").read_text()
    assert log.count("-S ") == 1 and log.count("--build ") == 2 and "-DGGML_NATIVE=ON" in log


@pytest.mark.parametrize("flags, message", [
    ([], "pass one of --llama-src PATH_OR_TARBALL (build) and --llama-server BINARY"),
    (["--llama-server", "x", "--llama-src", "y"], "pass one of"),
    (["--llama-server", "/nonexistent/llama-server", "--gguf", __file__], "not a readable GGUF"),
    (["--llama-server", __file__, "--gguf", "/nonexistent.gguf"], "--gguf /nonexistent.gguf: no such file"),
    (["--llama-src", __file__, "--build-only"], "not a source folder or a tarball"),
    (["--llama-server", __file__, "--ctx", "0"], "--ctx must be >= 1, got 0"),
])
def test_peer_bad_flags(flags, message, capsys):
    assert main(["bench", "peer", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(not os.environ.get("FERRYLM_PEER_LLAMA_SRC"),
                    reason="set FERRYLM_PEER_LLAMA_SRC to llama.cpp's source or tarball (a real build: minutes)")
def test_real_llama_cpp_build(tmp_path, capsys):
    work = Path(os.environ.get("FERRYLM_PEER_WORK_DIR") or tmp_path)
    assert main(["bench", "peer", "--llama-src", os.environ["FERRYLM_PEER_LLAMA_SRC"], "--work-dir", str(work),
                 "--build-only", "--build-jobs", str(os.cpu_count() or 2)]) == 0, capsys.readouterr().err


def test_an_engine_that_never_gets_ready_is_recorded_not_raised(tmp_path):
    from ferrylm.bench.peer import PeerConfig, run_engine

    dead = tmp_path / "dead-server"
    dead.write_text("#!/bin/sh\necho 'error: cannot load model' >&2\nexit 3\n")
    dead.chmod(dead.stat().st_mode | stat.S_IXUSR)
    cfg = PeerConfig(gguf=tmp_path / "x.gguf", shapes=(RunShape("c1"),), ready_timeout_s=30)
    rec = run_engine("llama", [str(dead)], _two_free_ports(), cfg, tmp_path / "dead.log", log=lambda line: None)
    assert rec["ready_s"] is None and rec["error"].startswith("not ready") and rec["exit_code"] == 3
    assert rec["log_tail"] == ["error: cannot load model"] and rec["runs"] == {}


def test_a_port_is_free_after_its_server_closed_but_not_while_one_listens():
    """A round's server closes its connections first, which leaves them in TIME_WAIT on its port; the next round on
    that port must not take that for a server still there."""
    from ferrylm.bench.peer import PeerError, _check_port_free

    port = _two_free_ports()
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen()
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    with pytest.raises(PeerError, match=f"port {port} is in use"):
        _check_port_free(port)
    conn.close()            # the server's side closes first: TIME_WAIT on the server's port
    srv.close()
    client.close()
    _check_port_free(port)
