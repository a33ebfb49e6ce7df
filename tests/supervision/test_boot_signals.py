"""A SIGTERM at any point of ``ferry serve``'s start-up exits 0 with no child left (issue 18: a SIGTERM within
about a second of the start killed the process by the default handler, exit status -15)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from tests.e2e.conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

# From just after the interpreter started (its own ~50 ms of start-up cannot run a handler) through the model
# load, the tokenizer, the engine spawn and the engine's loading.
DELAYS_S = (0.15, 0.4, 0.8, 1.3, 2.0, 3.0)


def tagged(tag: str) -> list[psutil.Process]:
    """Processes whose environment carries ``tag`` (the server and everything it started)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("FERRYLM_TEST_TAG") == tag and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.mark.parametrize("delay", DELAYS_S)
def test_sigterm_during_boot_exits_zero_without_children(tmp_path, delay):
    tag = uuid.uuid4().hex
    env = {**os.environ, "FERRYLM_TEST_TAG": tag, "OMP_NUM_THREADS": "1"}
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "ferrylm.cli", "serve", "--model", "smollm2-135m",
                             "--num-tokens", "2048", "--port", str(free_port())], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        time.sleep(delay)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert rc == 0, f"exit status {rc} after a SIGTERM at {delay} s:\n{text[-2000:]}"
    assert "Traceback" not in text, text[-2000:]
    deadline = time.monotonic() + 5
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not tagged(tag), [p.cmdline() for p in tagged(tag)]


def test_cli_module_imports_without_torch():
    """``python -m ferrylm.cli`` runs the module's imports before ``main`` can install the boot handler: they stay
    light (no torch: seconds on a slow host, which a SIGTERM would land inside)."""
    code = "import sys\nimport ferrylm.cli\nassert 'torch' not in sys.modules, 'torch was imported'\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]


def test_serve_command_line_parses_without_torch():
    """Parsing ``ferry serve MODEL`` (every flag's choices: MoE backends, attention backends, tool parsers) imports
    no torch: the frontend process never needs it for a GGUF, and it costs seconds before the engine starts."""
    code = ("import sys\nimport ferrylm.cli as c\n"
            "a = c.parse_args(c.build_parser(), ['serve', 'm.gguf', '--moe-backend', 'cpu'])\n"
            "c.engine_config_from_args(a)\n"
            "assert a.model == 'm.gguf' and 'torch' not in sys.modules, 'torch was imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
