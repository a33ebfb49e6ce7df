"""A truncated or corrupt safetensors file is found by its header before anything loads it, and ``ferry serve``
refuses it with one line naming the file, exit 2 (issue 18: boot failed after 4 s with the library's message
"incomplete metadata, file not fully covered", no file named, exit 1)."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import save_file

from ferrylm.errors import ModelLoadError
from ferrylm.checkpoints.verify import verify_checkpoint, verify_safetensors
from tests.e2e.conftest import free_port
from tests.server.conftest import build_tiny_tokenizer


def _file(tmp_path, name="model.safetensors"):
    p = tmp_path / name
    save_file({"a": np.arange(64, dtype=np.float32).reshape(8, 8), "b": np.ones(16, dtype=np.int64)}, str(p))
    return p


def test_a_complete_file_passes(tmp_path):
    verify_safetensors(_file(tmp_path))
    assert verify_checkpoint(tmp_path) == 1


@pytest.mark.parametrize("cut", [1, 100, 300])
def test_truncated_file_names_itself_and_the_missing_bytes(tmp_path, cut):
    p = _file(tmp_path)
    os.truncate(p, p.stat().st_size - cut)
    with pytest.raises(ModelLoadError) as e:
        verify_checkpoint(tmp_path)
    msg = e.value.message
    assert msg.startswith(str(p)) and ("truncated" in msg or "corrupt" in msg) and "\n" not in msg, msg


def test_trailing_bytes_and_a_bad_header_are_corrupt(tmp_path):
    p = _file(tmp_path)
    with open(p, "ab") as f:
        f.write(b"\0" * 10)
    with pytest.raises(ModelLoadError, match="10 bytes after the last tensor"):
        verify_safetensors(p)
    p.write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(ModelLoadError, match="corrupt safetensors header"):
        verify_safetensors(p)
    p.write_bytes(b"\1\2")
    with pytest.raises(ModelLoadError, match="shorter than its 8-byte header"):
        verify_safetensors(p)
    p.write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(ModelLoadError, match="header claims"):
        verify_safetensors(p)


def test_a_missing_shard_is_named(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-00001-of-00002.safetensors"}}')
    with pytest.raises(ModelLoadError, match="model-00001-of-00002.safetensors: missing"):
        verify_checkpoint(tmp_path)


@pytest.mark.timeout(120)
def test_serve_refuses_a_truncated_checkpoint_in_one_line_exit_2(checkpoints, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(checkpoints("llama").path, folder)
    build_tiny_tokenizer(folder)
    weights = folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 1024)
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "ferrylm.cli", "serve", "--model", str(folder), "--port", str(free_port())],
                         capture_output=True, text=True, timeout=100)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2, res.stderr
    assert lines[0].startswith("loading "), res.stderr   # the start line, then the one error line
    lines = lines[1:]
    assert len(lines) == 1 and str(weights) in lines[0] and "truncated" in lines[0], res.stderr
    assert time.monotonic() - t0 < 30   # nothing was loaded


@pytest.mark.timeout(120)
def test_serve_exits_2_when_the_tokenizer_fails_while_the_engine_loads(checkpoints, tmp_path):
    """The engine starts loading while the frontend builds the tokenizer; a tokenizer that does not load is one
    line naming the folder, exit 2, and the engine it started is gone."""
    import uuid

    from tests.supervision.test_boot_signals import tagged

    folder = tmp_path / "m"
    shutil.copytree(checkpoints("llama").path, folder)
    build_tiny_tokenizer(folder)
    (folder / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    tag = uuid.uuid4().hex
    res = subprocess.run([sys.executable, "-m", "ferrylm.cli", "serve", "--model", str(folder), "--port",
                          str(free_port())], capture_output=True, text=True, timeout=100,
                         env={**os.environ, "FERRYLM_TEST_TAG": tag})
    assert res.returncode == 2, res.stderr
    assert "engine process" in res.stderr, res.stderr   # started before the tokenizer failed
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("ferry serve: ")]
    assert len(errors) == 1 and "cannot load a tokenizer" in errors[0] and str(folder) in errors[0], res.stderr
    assert not tagged(tag), [p.cmdline() for p in tagged(tag)]
