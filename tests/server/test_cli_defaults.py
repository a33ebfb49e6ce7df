"""``ferry serve`` bounds every request's wait for its first step by default (issue 18: the queue timeout was off,
so a request could wait forever)."""

from __future__ import annotations

from ferrylm.cli import build_parser, engine_config_from_args


def test_serve_has_a_queue_timeout_by_default_and_0_turns_it_off():
    p = build_parser()
    assert engine_config_from_args(p.parse_args(["serve"])).queue_timeout == 600.0
    assert engine_config_from_args(p.parse_args(["serve", "--queue-timeout", "0"])).queue_timeout is None
    assert engine_config_from_args(p.parse_args(["serve", "--queue-timeout", "7.5"])).queue_timeout == 7.5
    assert engine_config_from_args(p.parse_args(["generate", "hi"])).queue_timeout is None


def test_serve_refuses_max_model_len_beyond_the_model_context(tmp_path, capsys):
    """``ferry serve --max-model-len`` larger than the checkpoint's ``max_position_embeddings`` is a boot error that
    names the flag and both numbers (fresh-user trial: 100000 on an 8192-token model was accepted and served)."""
    import socket

    from ferrylm import cli
    from tests.models.hf_checkpoints import build_checkpoint, copy_config
    from tests.server.family_like import BOS, DEEPSEEK_R1_TEMPLATE, EOS, build_wordlevel_tokenizer

    ckpt = build_checkpoint("qwen3_moe", tmp_path / "m", seed=1)
    copy_config(ckpt.path, ckpt.path, max_position_embeddings=512)
    build_wordlevel_tokenizer(ckpt.path, ckpt.vocab_size, [BOS, EOS], DEEPSEEK_R1_TEMPLATE, EOS, BOS)
    with socket.socket() as s:   # a free port: the pre-flight binds it before reading the model
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert cli.main(["serve", "--model", str(ckpt.path), "--max-model-len", "100000", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert "--max-model-len 100000" in err and "512" in err
