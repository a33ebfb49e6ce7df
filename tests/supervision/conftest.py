"""Fixtures for the supervision tests: the HTTP-layer fakes of tests/server, reused (no torch, no engine)."""

from __future__ import annotations

from tests.server.conftest import anyio_backend, codec, tiny_tokenizer_dir  # noqa: F401 - fixtures
