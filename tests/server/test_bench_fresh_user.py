"""``ferry bench serve`` against a server that needs a key, its help, and ``ferry bench decode``'s table without a
GPU (issue 43 item 7)."""

from __future__ import annotations

import argparse

import httpx
import pytest

from ferrylm.bench.decode import DecodeResult, format_table
from ferrylm.bench.multi_turn import MultiTurnConfig, run_multi_turn
from ferrylm.bench.serve import BenchConfig, BenchError, _one
from ferrylm.cli import build_parser
from ferrylm.server.api.app import create_app

from .conftest import SERVED, FakeEngine

pytestmark = pytest.mark.anyio


async def test_a_keyed_server_is_named_with_the_flag_to_pass(codec) -> None:
    transport = httpx.ASGITransport(app=create_app(FakeEngine(codec), codec, SERVED, api_key="secret"))
    with pytest.raises(BenchError) as e:
        await run_multi_turn(MultiTurnConfig(base_url="http://test", model=None, num_conversations=1, num_turns=1,
                                             shared_prefix_len=4, input_len=4, output_len=2), transport=transport)
    assert "401" in str(e.value) and "--api-key" in str(e.value)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        res = await _one(client, BenchConfig("http://test", SERVED, 1, 1, 3, 2), SERVED, [1, 2, 3], 2)
    assert not res.ok and res.error.startswith("the server answered 401: ") and "--api-key" in res.error
    assert "b'" not in res.error and "b\"" not in res.error


def test_bench_serve_help_shows_every_default() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bench = next(a for a in sub.choices["bench"]._actions if isinstance(a, argparse._SubParsersAction))
    serve = bench.choices["serve"]
    text = " ".join(serve.format_help().split())
    for a in serve._actions:
        if a.option_strings and a.default is not argparse.SUPPRESS and a.dest != "help":
            shown = a.help % {"default": a.default} if "%(default)" in a.help else f"{a.help} (default: {a.default})"
            shown = " ".join(shown.split())
            assert shown in text and shown.count("(default:") == 1, a.option_strings


def test_decode_table_on_a_cpu_host_has_no_device_columns_and_aligned_rows() -> None:
    ok = DecodeResult("cpu", batch=1, tok_s=12.5, hit_rate=0.0, cpu_bytes_per_token=3e6, roofline_tok_s=20.0,
                      achieved_over_roofline=0.62, checksum="abc")
    bad = DecodeResult("resident", batch=16, error="needs a CUDA device")
    summary = {"model": "m", "device": "cpu", "dtype": "float32", "batch": [1, 16], "tokens": 8,
               "gpu_memory_limit_gib": None, "bandwidths": {"cpu_mem": 20e9},
               "results": [vars(ok), vars(bad)]}
    lines = format_table(summary).splitlines()
    header = next(ln for ln in lines if ln.lstrip().startswith("batch"))
    assert "PCIe" not in header and "slots" not in header and "exposed" not in header
    rows = lines[lines.index(header) + 1:]
    assert len(rows) == 2
    col = header.index("backend")
    assert all(r[col:].startswith(("cpu", "resident")) for r in rows)
    assert rows[1][header.index("tok/s"):].lstrip().startswith("-")


def test_decode_refuses_a_model_the_host_cannot_hold_before_loading(capsys) -> None:
    """A model larger than the host's memory: one line naming both sizes, exit 2, nothing loaded (it once grew until
    the kernel's OOM killer stopped it)."""
    from ferrylm.cli import main

    rc = main(["bench", "decode", "--model", "synthetic:deepseek-v3", "--moe-backend", "cpu", "--tokens", "2"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "does not fit in host memory" in err and "GiB available" in err and "Traceback" not in err
