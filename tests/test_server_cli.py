"""`hybridkv serve` on the command line: options parse, and a model without a tokenizer is refused
with a message that names the fix."""

from hybridkv.cli import build_parser, main


def test_serve_defaults_bind_loopback():
    a = build_parser().parse_args(["serve", "some/dir"])
    assert (a.host, a.port, a.api_key, a.max_num_seqs, a.max_queued) == ("127.0.0.1", 8000, None, 16, 64)
    assert (a.enable_prefix_caching, a.window_policy, a.dtype) == (None, "full", "auto")


def test_serve_without_tokenizer_fails_cleanly(fixtures, capsys):
    assert main(["serve", str(fixtures / "v4-tiny")]) == 2
    err = capsys.readouterr().err
    assert "tokenizer.json not found" in err and "--tokenizer" in err
