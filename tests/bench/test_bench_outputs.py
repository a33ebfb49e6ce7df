"""Where ``ferry bench`` commands write: every output path is checked before any work (one line naming the flag,
exit 2), and ``ferry bench tables`` outside a checkout names the missing file and its flag (trial 43b, items 1-2)."""

from __future__ import annotations

import argparse
import json
import socket

import pytest

from ferrylm import cli
from ferrylm.bench import cli as bench_cli
from ferrylm.bench.report import OutputFlag, report

#: each bench command's output flags, and whether the flag names a folder it creates
OUTPUTS = {
    "serve": {"--output-json": False}, "suite": {"--out-dir": True, "--log-dir": True},
    "decode": {"--output-json": False}, "cpu-experts": {"--output-json": False}, "bw": {"--output-json": False},
    "peer": {"--output-json": False, "--log-dir": True}, "kernels": {"--output-json": False},
    "cache-policy": {"--json": False}, "accelerate": {"--output-json": False},
}
REQUIRED = {"accelerate": ["--model", "synthetic:qwen3-30b-a3b"]}


def _bench_parsers() -> dict[str, argparse.ArgumentParser]:
    top = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bench = next(a for a in top.choices["bench"]._actions if isinstance(a, argparse._SubParsersAction))
    return dict(bench.choices)


@pytest.fixture
def no_work(monkeypatch):
    """Any bench command that starts its work fails the test: the paths must be checked first."""
    def boom(*a, **k):
        raise AssertionError("the benchmark started before its output path was checked")

    monkeypatch.setattr(bench_cli.BENCH_MAINS, "get", boom)
    for name in ("_bench_serve", "_bench_multi_turn", "_hf"):
        monkeypatch.setattr(bench_cli, name, boom)


def test_every_output_flag_is_registered_for_the_check() -> None:
    found = {name: {o.flag: o.folder for o in p.get_default("output_flags") or ()}
             for name, p in _bench_parsers().items()}
    assert {k: v for k, v in found.items() if v} == OUTPUTS
    for name, p in _bench_parsers().items():   # no other option looks like an output path
        for a in p._actions:
            if any(s in a.dest for s in ("output_json", "out_dir", "log_dir")) or a.dest == "json":
                assert OutputFlag(a.option_strings[0], a.dest, OUTPUTS[name][a.option_strings[0]]) in \
                    p.get_default("output_flags"), (name, a.option_strings)


@pytest.mark.parametrize("command,flag", [(c, f) for c, flags in OUTPUTS.items() for f in flags])
def test_an_unwritable_output_path_is_one_line_before_any_work(command, flag, tmp_path, capsys, no_work) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    path = blocker / "sub" if OUTPUTS[command][flag] else tmp_path / "missing" / "x.json"
    rc = cli._main(["bench", command, *REQUIRED.get(command, []), flag, str(path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(f"ferry bench {command}: {flag} {path}: ") and err.count("\n") == 1, err
    assert ("is not a folder" if OUTPUTS[command][flag] else "does not exist") in err, err


def test_bench_serve_fails_on_its_output_path_before_sending_a_request(capsys) -> None:
    with socket.socket() as s:   # a port nobody listens on: before the fix, the run itself failed (exit 1)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = cli._main(["bench", "serve", "--port", str(port), "--num-prompts", "1",
                    "--output-json", "/nonexistent/dir/x.json"])
    err = capsys.readouterr().err
    assert rc == 2 and err == "ferry bench serve: --output-json /nonexistent/dir/x.json: folder /nonexistent/dir " \
                              "does not exist\n", err


@pytest.mark.parametrize("url", ["localhost:8000", "ftp://h/v1", "http://", "http://[::1", "http://h:99999/v1"])
def test_bench_serve_names_a_bad_base_url(url, capsys) -> None:
    rc = cli._main(["bench", "serve", "--base-url", url, "--num-prompts", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and err == f"ferry bench serve: --base-url must be an http:// or https:// URL with a host (and a " \
                              f"port in 1-65535), got {url!r}\n", err


def test_bench_serve_takes_base_url_or_host_and_port(capsys) -> None:
    rc = cli._main(["bench", "serve", "--base-url", "http://127.0.0.1:8001", "--port", "1234", "--num-prompts", "1"])
    assert rc == 2 and capsys.readouterr().err == "ferry bench serve: give --base-url or --host / --port, not both\n"


def test_bench_serve_gives_up_on_a_server_that_never_answers(monkeypatch, capsys) -> None:
    """A port that accepts and never answers: one line after the model list's time limit, not a hang."""
    from ferrylm.bench import serve

    monkeypatch.setattr(serve, "MODELS_TIMEOUT_S", 0.5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)   # the kernel accepts the connection; nobody reads or answers
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
        for extra in ([], ["--model", "m"]):   # naming the model skips nothing: the first contact is bounded
            rc = cli._main(["bench", "serve", "--base-url", url, "--num-prompts", "1", *extra])
            err = capsys.readouterr().err
            assert rc == 1 and err.endswith(": GET /v1/models: no answer within 0.5 s\n") and err.count("\n") == 1, \
                (extra, err)


def test_a_folder_flag_may_name_a_folder_still_to_create(tmp_path, capsys, no_work) -> None:
    from ferrylm.bench.report import check_outputs

    args = cli.parse_args(cli.build_parser(), ["bench", "suite", "--out-dir", str(tmp_path / "a" / "b")])
    assert check_outputs(args) is None
    args = cli.parse_args(cli.build_parser(), ["bench", "serve", "--output-json", str(tmp_path)])
    assert check_outputs(args) == f"--output-json {tmp_path}: {tmp_path} is a folder; give a file path"


def test_report_writes_the_whole_summary(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    report("the table", {"a": [1, 2]}, str(out))
    assert capsys.readouterr().out == "the table\n"
    assert json.loads(out.read_text()) == {"a": [1, 2]} and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_bench_tables_outside_a_checkout_names_what_is_missing(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli._main(["bench", "tables"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ferry bench tables: --doc docs/BENCHMARKS.md: no such file") and "give --doc PATH" in err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    doc = tmp_path / "B.md"
    doc.write_text("# Benchmarks\n")
    assert cli._main(["bench", "tables", "--doc", str(doc)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ferry bench tables: --bench-dir docs/bench: no such folder") and "--bench-dir DIR" in err
    (tmp_path / "bench").mkdir()
    assert cli._main(["bench", "tables", "--doc", str(doc), "--bench-dir", str(tmp_path / "bench")]) == 0
    assert "BEGIN generated" in doc.read_text()
