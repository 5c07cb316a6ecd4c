"""`hybridkv serve` on the command line: options parse, and a model without a tokenizer is refused
with a message that names the fix."""

from hybridkv.cli import build_parser, main
from hybridkv.server.serve import prefix_cache_options


def test_serve_defaults_bind_loopback():
    a = build_parser().parse_args(["serve", "some/dir"])
    assert (a.host, a.port, a.api_key, a.prefix_cache, a.max_concurrency) == ("127.0.0.1", 8000, None, "full", 16)
    assert prefix_cache_options("off") == {"enable_prefix_caching": False}
    assert prefix_cache_options("checkpoint(1024)") == {"enable_prefix_caching": True, "window_policy": "checkpoint(1024)"}


def test_serve_without_tokenizer_fails_cleanly(fixtures, capsys):
    assert main(["serve", str(fixtures / "v4-tiny")]) == 2
    err = capsys.readouterr().err
    assert "tokenizer.json not found" in err and "--tokenizer" in err
