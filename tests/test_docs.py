"""The docs are true as written: every ```python block of README.md and docs/*.md runs on a CPU, and
every repository path they name exists.

A block that cannot run as written says so in its fence: ```python gpu (needs a CUDA device) or
```python fragment (an excerpt: generated kernel text, one step of a loop, code every rank of a
process group runs; the runnable whole is named next to it). Each block runs in a fresh namespace,
except in the files of ``WALKTHROUGHS``, whose blocks build on each other and run in order in one.
"""
from __future__ import annotations

import pathlib
import re
import shlex
import textwrap

import pytest

from repo import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# docs/tracing.md introduces `torch`, `flexc` and `doc_mask` once and uses them in later blocks
WALKTHROUGHS = {"docs/tracing.md"}

# the words a fence may add after `python`, and why such a block is not run
SKIPPED = {"gpu": "needs a CUDA device", "fragment": "an excerpt, not a program"}

FENCE = re.compile(r"^(?P<indent>[ \t]*)```python(?P<info>[^\n]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   re.M | re.S)


def _blocks(doc: pathlib.Path) -> list[tuple[int, str, str]]:
    """``(line, info, source)`` of each python block, the line being the block's first line of code."""
    text = doc.read_text()
    return [(text.count("\n", 0, m.start("body")) + 1, m["info"].strip(), textwrap.dedent(m["body"]))
            for m in FENCE.finditer(text)]


def _cases() -> list:
    cases = []
    for doc in DOCS:
        name = doc.relative_to(ROOT).as_posix()
        blocks = _blocks(doc)
        if name in WALKTHROUGHS:
            cases.append(pytest.param(name, blocks, id=name))
        else:
            cases += [pytest.param(name, [block], id=f"{name}:{block[0]}") for block in blocks]
    return cases


@pytest.fixture()
def restored_kernel_cache_limit():
    """docs/kernels.md sets the kernel cache's limit; the rest of the suite keeps its own."""
    from flexc.backends.triton.cache import cache_limit
    previous = cache_limit()
    yield
    cache_limit(previous)


@pytest.mark.parametrize("name, blocks", _cases())
def test_python_blocks_of_the_docs_run_as_written(name, blocks, restored_kernel_cache_limit):
    namespace = {"__name__": "__doc__"}
    for line, info, source in blocks:
        unknown = set(info.split()) - set(SKIPPED)
        assert not unknown, (f"{name}:{line}: ```python {info}: unknown fence word(s) {sorted(unknown)}; "
                             f"the known ones are {SKIPPED}")
        if info:
            continue
        if name not in WALKTHROUGHS:
            namespace = {"__name__": "__doc__"}
        # padded so that a traceback names the doc's own line numbers
        exec(compile("\n" * (line - 1) + source, str(ROOT / name), "exec"), namespace)  # noqa: S102


def test_few_python_blocks_are_exempt():
    """Exempt blocks are exceptions: a doc whose examples mostly cannot run has stopped being checked."""
    exempt = [(doc.name, line) for doc in DOCS for line, info, _ in _blocks(doc) if info]
    assert len(exempt) <= 6, f"{len(exempt)} python blocks are marked gpu/fragment: {exempt}"


# a path into the repository: a file with an extension, or a folder ending in /
# (the lookbehind skips `../shared/docs/x.md` and `~/.cache/flexc/kernels`)
PATH = re.compile(r"(?<![\w./~-])(?:flexc|tests|bench|examples|docs)/[\w./*-]*")


def _named_paths(text: str) -> list[tuple[int, str]]:
    found = []
    for m in PATH.finditer(text):
        path = m.group().rstrip(".")
        last = path.rsplit("/", 1)[-1]
        if path.endswith("/") or "." in last:  # `flexc/torch` in a table is a ratio, not a path
            found.append((text.count("\n", 0, m.start()) + 1, path))
    return found


def test_every_repository_path_the_docs_name_exists():
    missing = [f"{doc.relative_to(ROOT).as_posix()}:{line}: {path}"
               for doc in DOCS for line, path in _named_paths(doc.read_text())
               if not (any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists())]
    assert not missing, "the docs name paths that do not exist:\n" + "\n".join(missing)


def test_the_path_check_sees_the_paths_the_docs_write():
    assert _named_paths("see `flexc/call/validate.py` and tests/tools/, not flexc/torch or ~/.cache/flexc/k.py") \
        == [(1, "flexc/call/validate.py"), (1, "tests/tools/")]


# a `flexc` command line in a code block: `flexc show examples/mods.py:alibi,causal --q-len 1  # comment`
CLI_LINE = re.compile(r"^[ \t]*(flexc (?:trace|show|draw) .*)$", re.M)


def test_the_cli_examples_of_the_docs_parse_and_name_files_that_exist():
    from flexc.tools.cli import build_parser
    parser = build_parser()
    lines = [(doc.relative_to(ROOT).as_posix(), line) for doc in DOCS for line in CLI_LINE.findall(doc.read_text())]
    assert len(lines) >= 10, lines  # README's and docs/kernels.md's at least
    for name, line in lines:
        argv = shlex.split(line, comments=True)[1:]
        parser.parse_args(argv)  # a misspelt flag exits here, naming it
        target = argv[1]
        path = target[:target.index(".py") + 3] if ".py" in target else target
        assert (ROOT / path).is_file(), f"{name}: `{line}` names {path}, which does not exist"
