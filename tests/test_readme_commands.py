"""Every `hybridkv ...` and `python -m hybridkv...` command line in the code blocks of README.md and
the shipped model's card parses with the real argument parsers, so the documented flags cannot
drift from the code.

How a documented line becomes an argument list: `\\` continuations and indented (wrapped) lines
are joined to the line before; shell comments are dropped; optional syntax is taken as written in
full (`[--x N]` -> `--x N`, nested brackets too); `a|b|c` is its first alternative; `...` (more of
the same) is dropped; placeholders in capitals (MODEL_DIR, N, DIR, ...) become `1`, a value every
option type takes. The command's own parser then parses it (its `main`, stopped right after
`parse_args`), so unknown flags, missing required arguments, bad choices and bad numbers fail
here, and so does a deprecated spelling (its warning).

Not checked: that the paths exist and the values are sensible (a recipe name, a model directory),
commands outside code blocks (inline in prose), other programs (`make`, `python benchmarks/...`),
and flags only mentioned in prose.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ["README.md", "models/tiny-v4/README.md", "models/tiny-v41/README.md"]
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*")


def code_block_lines(text: str) -> list[str]:
    """The lines of the fenced code blocks that are not Python code, continuations joined."""
    out, block, lang = [], None, ""
    for line in text.splitlines():
        if line.startswith("```"):
            if block is None:
                block, lang = [], line[3:].strip()
            else:
                if lang in ("", "sh", "bash", "shell", "console"):
                    out.extend(_join(block))
                block = None
            continue
        if block is not None:
            block.append(line)
    return out


def _join(lines: list[str]) -> list[str]:
    """Lines ending in a backslash, and indented lines (a usage line wrapped), join the line before."""
    joined, open_ = [], False
    for line in lines:
        if joined and (open_ or (line[:1].isspace() and line.strip())):
            joined[-1] += " " + line.strip()
        else:
            joined.append(line)
        open_ = joined[-1].rstrip().endswith("\\")
        if open_:
            joined[-1] = joined[-1].rstrip()[:-1]
    return joined


def argv_of(line: str) -> tuple[str, list[str]] | None:
    """(module whose main parses it, its argv) for a hybridkv command line, else None."""
    tokens = shlex.split(line.replace('"..."', "TEXT"), comments=True)
    if tokens[:1] == ["hybridkv"]:
        module, rest = "hybridkv.cli", tokens[1:]
    elif len(tokens) >= 3 and tokens[0] in ("python", "python3") and tokens[1] == "-m" \
            and tokens[2].startswith("hybridkv"):
        module, rest = tokens[2], tokens[3:]
        if module == "hybridkv":
            module = "hybridkv.cli"
    else:
        return None
    argv = []
    for tok in rest:
        tok = tok.replace("[", "").replace("]", "")
        if not tok or tok == "...":
            continue
        if "|" in tok:
            tok = tok.split("|")[0]
        argv.append("1" if PLACEHOLDER.fullmatch(tok) else tok)
    return module, argv


def documented_commands() -> list[tuple[str, str]]:
    found = []
    for doc in DOCUMENTS:
        path = ROOT / doc
        if path.exists():
            found += [(doc, line.strip()) for line in code_block_lines(path.read_text()) if argv_of(line)]
    return found


class _Parsed(BaseException):
    """Raised in place of running the command once its arguments parsed (a BaseException, so no
    `except Exception` in the command catches it)."""

    def __init__(self, namespace):
        self.namespace = namespace


def parse_with_real_parser(module: str, argv: list[str], monkeypatch) -> argparse.Namespace:
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(real(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    main = importlib.import_module(module).main
    with pytest.raises(_Parsed) as parsed:
        main(argv)
    return parsed.value.namespace


def test_the_documents_have_commands():
    commands = documented_commands()
    assert len(commands) >= 20
    assert {"hybridkv serve", "hybridkv generate", "hybridkv eval", "hybridkv train"} <= \
        {" ".join(line.split()[:2]) for _, line in commands}


@pytest.mark.parametrize("doc,line", documented_commands(), ids=lambda v: v[:70] if isinstance(v, str) else v)
def test_documented_command_parses(doc, line, monkeypatch, capsys):
    module, argv = argv_of(line)
    try:
        parse_with_real_parser(module, argv, monkeypatch)
    except SystemExit:
        pytest.fail(f"{doc}: `{line}` does not parse as `{module} {' '.join(argv)}`:\n{capsys.readouterr().err}")
    assert "deprecated" not in capsys.readouterr().err, f"{doc}: `{line}` uses a deprecated spelling"


def test_the_extraction_itself():
    lines = code_block_lines("```\nhybridkv eval M --x 1 \\\n    [--y N [--z T]] --w a|b ... # note\n```\n"
                             "```python\nhybridkv not a command\n```\n")
    assert lines == ["hybridkv eval M --x 1  [--y N [--z T]] --w a|b ... # note"]
    assert argv_of(lines[0]) == ("hybridkv.cli", ["eval", "1", "--x", "1", "--y", "1", "--z", "1", "--w", "a"])
    assert argv_of("python -m hybridkv.train.average A B --weight 0.5") == \
        ("hybridkv.train.average", ["1", "1", "--weight", "0.5"])
    assert argv_of("make demo") is None
