"""The converted-model cache key follows the file's content, not its mtime (issue 26: every checkout installed the
same GGUF anew and converted it again into a new 1.3 GB folder)."""

from __future__ import annotations

import os
import shutil

from ferrylm.checkpoints.cache_folder import source_key


def test_same_content_elsewhere_and_touched_shares_the_key(tmp_path) -> None:
    a = tmp_path / "a.gguf"
    a.write_bytes(os.urandom(3 << 20))
    b = tmp_path / "other-checkout" / "a.gguf"
    b.parent.mkdir()
    shutil.copyfile(a, b)
    os.utime(b, ns=(1, 1))
    assert source_key(a) == source_key(b)
    assert source_key(a, "moe") != source_key(a)


def test_different_content_gets_a_new_key(tmp_path) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    data = bytearray(os.urandom(3 << 20))
    a.write_bytes(bytes(data))
    data[-10] ^= 0xFF    # the tail changed
    b.write_bytes(bytes(data))
    assert source_key(a) != source_key(b)
    b.write_bytes(bytes(data[:-1]))   # the size changed
    assert source_key(a) != source_key(b)
