"""Real English prose from what every CPython install carries, split by source into a training part
and a held-out evaluation part: nothing is downloaded, nothing is written.

Sources, each one named and split as a whole:
- `topic:NAME`: a topic of the bundled documentation (`pydoc_data.topics`, what `help("assert")` shows);
- `doc:MODULE`: the docstrings of a standard-library module, in source order. Pure-Python modules
  are parsed with `ast` from their source (nothing is imported, so no module's import side effects
  run); compiled modules (math, itertools, ...) are imported and read with `inspect.getdoc`;
- `file:PATH`: prose files of the standard library (its LICENSE.txt, email/architecture.rst).

Left out: the parts that distributions often ship apart or that recent versions removed (test,
idlelib, tkinter, turtledemo, lib2to3, distutils, ensurepip, the PEP 594 modules), the codecs'
generated boilerplate (encodings), and anything outside the standard library directory
(site-packages).

Each source keeps its prose paragraphs only (no code, grammar, tables or headings), reflowed to one
line with reST markup (roles, backquotes, emphasis) removed. A source belongs to the evaluation part
when a hash of its name says so (`split_of`), so the split of a source never depends on which other
sources a machine has. The documentation repeats itself across topics and modules, so the
evaluation part also drops every paragraph that shares a sentence with the training part.

Python version dependency: the text is that of the running interpreter's standard library (the
docstrings and topics change between CPython releases). CPython 3.11.7 gives 0.83M characters of
training text (294 sources) and 0.21M of evaluation text (99 sources; about 78K tokens in the
shipped model's tokenizer). Two machines with the same CPython release and build give the same
text; `fingerprint(split)` names it (`describe` too), so that results from different machines can
be checked to share their haystacks; machines with different releases share the split of every
source name, not the text.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
import sysconfig
import textwrap
import warnings
from dataclasses import dataclass
from functools import cache
from pathlib import Path

SPLITS = ("train", "eval")
EVAL_SHARE = 4      # one source in EVAL_SHARE (by name hash) is held out for evaluation

# top-level names of the standard library left out (see the docstring)
_EXCLUDED = frozenset((
    "test", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "distutils", "ensurepip", "venv",
    "site-packages", "dist-packages", "pydoc_data", "antigravity", "this", "__phello__", "__hello__",
    "encodings", "readline", "curses", "_curses", "_curses_panel", "_tkinter", "msilib", "winreg", "winsound", "nt",
    "xxsubtype", "xxlimited",
    # PEP 594 (removed in 3.13) and the modules 3.12 removed
    "aifc", "audioop", "cgi", "cgitb", "chunk", "crypt", "imghdr", "mailcap", "nis", "nntplib", "ossaudiodev",
    "pipes", "sndhdr", "spwd", "sunau", "telnetlib", "uu", "xdrlib", "asynchat", "asyncore", "imp", "smtpd",
))
_PROSE_FILES = ("LICENSE.txt", "email/architecture.rst")


@dataclass(frozen=True)
class Source:
    name: str                       # "topic:assert", "doc:json.decoder", "file:LICENSE.txt"
    paragraphs: tuple[str, ...]     # prose paragraphs, each on one line

    @property
    def split(self) -> str:
        return split_of(self.name)


def split_of(name: str) -> str:
    """'eval' or 'train': the part a source of this name belongs to, from its name alone."""
    digest = hashlib.sha256(f"hybridkv-prose:{name}".encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") % EVAL_SHARE == 0 else "train"


# ----- prose paragraphs -----

_ROLE = re.compile(r":[a-zA-Z]+(?::[a-zA-Z]+)*:`~?([^`]+)`")
_MARKUP = re.compile(r"``([^`]+)``|`([^`]+)`_{0,2}|\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*")
_WORD = re.compile(r"[A-Za-z]{2,}")
_NOT_PROSE = (">>>", "...", "$ ", "|", "+-", "* ", "- ", "#", "[", "=")
_PROSE_PUNCTUATION = frozenset(" ,.;:!?'\"()-\u2019")


def _unmark(text: str) -> str:
    text = _ROLE.sub(r"\1", text)
    text = _MARKUP.sub(lambda m: next(g for g in m.groups() if g is not None), text)
    return re.sub(r"\s+", " ", text).strip()


def prose_paragraphs(text: str) -> list[str]:
    """The paragraphs of `text` (blank-line separated, each dedented) that read as prose: no lines
    indented within the paragraph or opening with a prompt, bullet or table rule (code, grammar,
    lists, tables), at least 8 words, mostly letters and sentence punctuation, starting with a
    capital and ending like a sentence; each reflowed to one line without reST markup."""
    out = []
    for block in re.split(r"\n[ \t]*\n", text):
        lines = [line.rstrip() for line in textwrap.dedent(block.strip("\n")).splitlines()]
        if not lines or any(line[:1] in (" ", "\t") or line.startswith(_NOT_PROSE) for line in lines):
            continue
        para = _unmark(" ".join(lines))
        if len(_WORD.findall(para)) < 8 or not para.endswith((".", "!", "?", ":")) or not para[0].isupper():
            continue
        if sum(c.isalpha() or c in _PROSE_PUNCTUATION for c in para) < 0.9 * len(para):
            continue
        out.append(para)
    return out


_SENTENCE_END = re.compile(r"(?<=[a-z0-9)\"'][.!?])\s+(?=[A-Z])")


def sentences(paragraph: str) -> list[str]:
    return [s for s in _SENTENCE_END.split(paragraph) if s]


# ----- the sources -----

def _stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _docstrings(tree: ast.AST) -> list[str]:
    """The docstrings of a module, its classes and functions, in source order."""
    out = []

    def visit(node):
        doc = ast.get_docstring(node, clean=True)
        if doc:
            out.append(doc)
        for child in node.body:
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child)

    visit(tree)
    return out


def _python_module_docs(root: Path) -> dict[str, list[str]]:
    docs = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in _EXCLUDED or rel.parts[0].removesuffix(".py") in _EXCLUDED:
            continue
        name = _module_name(rel)
        if not all(p.isidentifier() for p in name.split(".")):   # not importable (config-3.x-..., scripts)
            continue
        if any(p in ("test", "tests", "idle_test") or p.startswith("test_") for p in rel.parts):
            continue
        try:
            tree = ast.parse(path.read_bytes(), filename=str(rel))
        except (SyntaxError, ValueError, OSError):
            continue
        docs[name] = _docstrings(tree)
    return docs


def _compiled_module_docs(known: set[str]) -> dict[str, list[str]]:
    """Docstrings of the public compiled modules (and their public members defined there)."""
    docs = {}
    for name in sorted(getattr(sys, "stdlib_module_names", ())):
        if name.startswith("_") or name in _EXCLUDED or name in known:
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None or not (spec.origin == "built-in" or str(spec.origin).endswith((".so", ".pyd"))):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:       # a module this build cannot load (a missing system library)
            continue
        texts = [inspect.getdoc(module) or ""]
        for attr in sorted(vars(module)):
            # a hook a library may replace at run time (torch.distributed sets sys.excepthook): the
            # interpreter's original, so the text does not depend on what was imported before
            obj = getattr(module, f"__{attr}__", None) or getattr(module, attr)
            if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                continue
            texts.append(inspect.getdoc(obj) or "")
        docs[name] = [t for t in texts if t]
    return docs


@cache
def sources() -> tuple[Source, ...]:
    """Every source with at least one prose paragraph, sorted by name."""
    import pydoc_data.topics

    found: dict[str, list[str]] = {}
    for topic, text in pydoc_data.topics.topics.items():
        found[f"topic:{topic}"] = prose_paragraphs(text)
    root = _stdlib()
    python_docs = _python_module_docs(root)
    for module, docs in {**python_docs, **_compiled_module_docs(set(python_docs))}.items():
        found[f"doc:{module}"] = [p for d in docs for p in prose_paragraphs(d)]
    for rel in _PROSE_FILES:
        path = root / rel
        if path.is_file():
            found[f"file:{rel}"] = prose_paragraphs(path.read_text(encoding="utf-8", errors="replace"))
    return tuple(Source(name, tuple(paras)) for name, paras in sorted(found.items()) if paras)


def _check(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown prose split {split!r}; choose from {', '.join(SPLITS)}")


def split_sources(split: str) -> tuple[Source, ...]:
    _check(split)
    return tuple(s for s in sources() if s.split == split)


@cache
def pieces(split: str) -> tuple[str, ...]:
    """The split's text as sentences in reading order (sources by name, paragraphs in order), each
    with its leading separator (a newline opens a paragraph, a space goes on within one), so that
    consecutive pieces concatenate to the text. The evaluation part leaves out every paragraph that
    shares a sentence with the training part (the documentation repeats itself across topics and
    modules), so that no held-out sentence was trained on."""
    _check(split)
    seen = set()
    if split == "eval":
        seen = {s for src in split_sources("train") for p in src.paragraphs for s in sentences(p)}
    out = []
    for source in split_sources(split):
        for para in source.paragraphs:
            said = sentences(para)
            if seen.isdisjoint(said):
                out += [("\n" if i == 0 else " ") + s for i, s in enumerate(said)]
    if not out:
        raise RuntimeError(f"no {split} prose found in this Python's standard library ({_stdlib()})")
    return tuple(out)


def fingerprint(split: str) -> str:
    """A short hash of the split's text: equal on two machines iff their haystack text is."""
    return hashlib.sha256("".join(pieces(split)).encode()).hexdigest()[:16]


def describe(split: str) -> str:
    """One line naming the split's text: its sources, size, Python version and fingerprint."""
    srcs, text = split_sources(split), pieces(split)
    return (f"{split} prose: {len(srcs)} sources, {sum(map(len, text)) / 1e6:.2f}M characters, Python "
            f"{sys.version.split()[0]}, fingerprint {fingerprint(split)}")
