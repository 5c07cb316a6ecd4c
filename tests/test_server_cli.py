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


def test_the_command_line_builds_without_the_server_packages():
    """`hybridkv train`, `eval` and `generate` run where uvicorn and fastapi are not installed (a
    training machine): building the parser, which lists serve's options too, imports neither."""
    import subprocess
    import sys
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('uvicorn', 'fastapi', 'h11', 'starlette'):\n"
            "            raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "from hybridkv.cli import build_parser\n"
            "a = build_parser().parse_args(['train', '--recipe', 'smoke'])\n"
            "print(a.recipe)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "smoke"
