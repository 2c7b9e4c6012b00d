"""The code blocks of README.md and of every ``docs/*.md`` page, run as written.

Every fenced block carries one of three info strings, and the rules follow it:

- ```python: run as a script by the venv's Python in a fresh process (``runpy.run_path``), then
  every top-level ``test_*`` function it defines is called (the docs show tests a user would put
  in their suite).
- ```bash: run by ``bash -e -o pipefail`` with the venv's ``bin`` first on ``PATH`` (``fxopt``
  and ``python`` are the venv's), in a scratch directory where ``.venv`` links to the venv. The
  bash blocks share that directory and run in order (README first, then the pages by name), so a
  later block may use a file an earlier one wrote.
- ```text: recorded output, a diagram or a table; not run. Every ``$ fxopt ...`` line in one must
  still parse with the CLI of today (``argparse``, nothing runs), so a transcript cannot name an
  option that is gone.

Two HTML comments, each on the line right before a fence, refine this:

- ``<!-- not run: WHY -->`` before a python or bash block: the block is not run. Only the
  set-up commands may say so (creating the venv, running this whole suite), and the test checks
  that such blocks stay that few and say why.
- ``<!-- output of the block above -->`` before a text block that follows a python or bash
  block: what that block printed, checked against what it prints now. A line ``...`` stands for
  any number of lines, ``...`` inside a line for any text (timings, which change from run to
  run); every other line must be printed as written, in that order.

The python blocks and the bash blocks run in two lanes at once (one torch thread each): the whole
file takes about two minutes on two cores.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from fxopt.cli import commands as cli

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGS = ("python", "bash", "text")
NOT_RUN = re.compile(r"^<!-- not run: (.+) -->$")
OUTPUT = "<!-- output of the block above -->"
MAX_NOT_RUN = 2  # the two set-up commands
MIN_BLOCKS_RUN = 12
README_MAX_LINES = 200
TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    path: Path
    line: int           # the opening fence's line number
    lang: str
    text: str
    marker: str = ""    # the HTML comment on the line before the fence, if any
    output_of: int = 0  # for a checked output: the line of the block it is the output of

    @property
    def id(self) -> str:
        return f"{self.path.name}:{self.line}:{self.lang or 'untagged'}"

    @property
    def not_run(self) -> str | None:
        """Why the block is not run, or None when it runs."""
        if self.lang not in ("python", "bash"):
            return "recorded output" if self.lang == "text" else "untagged"
        match = NOT_RUN.match(self.marker)
        return match.group(1) if match else None


def code_blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, with its marker and the block it is output of."""
    blocks: list[Block] = []
    lines = path.read_text().splitlines()
    index = 0
    while index < len(lines):
        opening = re.match(r"^```(\S*)\s*$", lines[index])
        if not opening:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
        marker = lines[index - 1].strip() if index and lines[index - 1].startswith("<!--") else ""
        output_of = 0
        if marker == OUTPUT and blocks:
            closing = blocks[-1].line + blocks[-1].text.count("\n")  # the previous block's end
            if not "".join(lines[closing + 1:index - 1]).strip():
                output_of = blocks[-1].line
        blocks.append(Block(path, index + 1, opening.group(1),
                            "\n".join(lines[index + 1:end]) + "\n", marker, output_of))
        index = end + 1
    return blocks


BLOCKS = [block for page in PAGES for block in code_blocks(page)]
RUN = [b for b in BLOCKS if b.not_run is None]
EXPECTED = {(b.path, b.output_of): b for b in BLOCKS if b.output_of}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["OMP_NUM_THREADS"] = "1"  # two lanes on CI's two cores
    env["MPLBACKEND"] = "Agg"
    return env


def _run_python(block: Block, workdir: Path) -> subprocess.CompletedProcess:
    script = workdir / f"{block.path.stem}_{block.line}.py"
    script.write_text(block.text)
    runner = ("import runpy, sys\n"
              "namespace = runpy.run_path(sys.argv[1], run_name='__main__')\n"
              "for name, value in namespace.items():\n"
              "    if name.startswith('test_') and callable(value):\n"
              "        value()\n")
    return subprocess.run([sys.executable, "-c", runner, str(script)], cwd=workdir, env=_env(),
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def _run_bash(block: Block, workdir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.text], cwd=workdir,
                          env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)


def _lane(blocks: list[Block], workdir: Path) -> dict[str, subprocess.CompletedProcess]:
    run = {"python": _run_python, "bash": _run_bash}
    return {b.id: run[b.lang](b, workdir) for b in blocks}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every block that runs, run once: the python lane and the bash lane side by side."""
    lanes = []
    for lang in ("python", "bash"):
        workdir = tmp_path_factory.mktemp(f"readme_{lang}")
        (workdir / ".venv").symlink_to(VENV_BIN.parent)
        lanes.append(([b for b in RUN if b.lang == lang], workdir))
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(lambda lane: _lane(*lane), lanes))
    return {key: value for lane in done for key, value in lane.items()}


def output_pattern(expected: str) -> re.Pattern:
    """A recorded output as a regex: ``...`` alone on a line is any number of lines, ``...``
    inside a line any text; trailing spaces are ignored."""
    parts = []
    for line in expected.rstrip("\n").splitlines():
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*?".join(map(re.escape, line.rstrip().split("..."))) + r"[ \t]*\n")
    return re.compile("".join(parts), re.DOTALL)


def matches_output(expected: str, printed: str) -> bool:
    printed = "\n".join(line.rstrip() for line in printed.splitlines()).rstrip("\n") + "\n"
    return output_pattern(expected).fullmatch(printed) is not None


def test_every_block_is_tagged_and_few_are_not_run():
    untagged = [b.id for b in BLOCKS if b.lang not in LANGS]
    assert not untagged, f"tag these blocks python, bash or text: {untagged}"
    not_run = {b.id: b.not_run for b in BLOCKS if b.lang in ("python", "bash") and b.not_run}
    assert len(not_run) <= MAX_NOT_RUN, f"blocks marked not run: {not_run}"
    assert all(len(why.split()) >= 4 for why in not_run.values()), not_run
    assert all(b.path.name == "README.md" for b in BLOCKS if b.id in not_run), not_run
    stray = [b.id for b in BLOCKS if b.marker.startswith("<!-- not run") and b.lang == "text"]
    assert not stray, f"text blocks never run; the marker is for python and bash: {stray}"
    assert len(RUN) >= MIN_BLOCKS_RUN, [b.id for b in RUN]
    assert {b.lang for b in RUN} == {"python", "bash"}


def test_every_checked_output_follows_a_block_that_runs():
    marked = [b for b in BLOCKS if b.marker == OUTPUT]
    assert marked, "no recorded output is checked"
    for block in marked:
        assert block.lang == "text" and block.output_of, (
            f"{block.id}: {OUTPUT} must come right before a text block that follows a block")
        source = next(b for b in BLOCKS if b.path == block.path and b.line == block.output_of)
        assert source in RUN, f"{block.id} is the output of {source.id}, which does not run"
        assert not any(line.startswith("$ ") for line in block.text.splitlines()), (
            f"{block.id}: a checked output holds what was printed, not the commands")


def test_the_set_up_commands_are_what_ci_runs():
    """README's two set-up commands are the ones not run here: the test command is this suite,
    and ``.ci/run`` runs it verbatim after creating the venv the same way."""
    setup = [b for b in BLOCKS if b.lang == "bash" and b.not_run]
    ci = (ROOT / ".ci" / "run").read_text()
    venv, tests = (b.text.strip() for b in setup)
    assert venv.startswith("python3 -m venv .venv && .venv/bin/pip install -c constraints.txt")
    assert tests == ".venv/bin/python -m pytest -q -n auto --dist loadfile" and ci.rstrip().endswith(tests)
    install = venv.split(" && ")[1].replace("pip install ", "pip install -q ")
    assert install in ci, "the README and .ci/run install the venv differently"


@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_block_runs_as_written(block, results):
    process = results[block.id]
    assert process.returncode == 0, (
        f"{block.id} exited {process.returncode}\n--- block\n{block.text}--- stdout\n"
        f"{process.stdout[-3000:]}--- stderr\n{process.stderr[-3000:]}")
    assert "Traceback" not in process.stderr
    expected = EXPECTED.get((block.path, block.line))
    if expected is not None:
        assert matches_output(expected.text, process.stdout), (
            f"{expected.id} is not what {block.id} prints now; it printed:\n{process.stdout}")


def test_the_output_check_is_exact_where_it_should_be():
    printed = "fxopt report for Net\n  time: 1.23 s\n  a\n  b\npeak 36.2 MiB\n"
    assert matches_output("fxopt report for Net\n  time: ... s\n...\npeak 36.2 MiB\n", printed)
    assert not matches_output("fxopt report for Net\n  time: ... s\npeak 36.2 MiB\n", printed)
    assert not matches_output("fxopt report for Net\n...\npeak 36.3 MiB\n", printed)
    assert not matches_output("...\npeak 36.2 MiB\nmore\n", printed)


def _transcript_commands() -> list[tuple[str, list[str]]]:
    """``(where, argv)`` of every ``$ fxopt ...`` line in the text blocks."""
    found = []
    for block in BLOCKS:
        if block.lang != "text":
            continue
        for offset, line in enumerate(block.text.splitlines()):
            if line.startswith("$ fxopt "):
                command = line[2:].split(";")[0]
                found.append((f"{block.path.name}:{block.line + 1 + offset}",
                              shlex.split(command)[1:]))
    return found


def test_transcripts_name_only_options_that_exist(capsys):
    commands = _transcript_commands()
    assert commands, "no transcript found: the scan is broken"
    parser = cli.build_parser()
    for where, argv in commands:
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: fxopt {' '.join(argv)} no longer parses: "
                        f"{capsys.readouterr().err}")


def test_docs_quote_what_the_shell_would_mangle_and_show_what_errors_name():
    """``checkpoint{budget=0.5,profile=false}`` unquoted is brace-expanded by bash into two
    words: every pass spec with braces in a command must be quoted."""
    for page in PAGES:
        text = page.read_text()
        for match in re.finditer(r"--passes[ =]([^\s`]+)", text):
            value = match.group(1)
            if "{" in value:
                assert value[0] in "'\"", f"{page.name}: unquoted --passes {value}"
        assert "../shared" not in text and "the issue" not in text, page.name
    # errors suggest fxopt.trace(): the docs show it, in a block that runs
    assert any("fxopt.trace(" in b.text for b in RUN if b.lang == "python")


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move some to docs/"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def _links(page: Path) -> list[tuple[str, str]]:
    """``(target, anchor)`` of every relative Markdown link of ``page`` outside code blocks."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    found = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"[a-z]+:", target):
            path, _, anchor = target.partition("#")
            found.append((path, anchor))
    return found


def test_links_resolve_to_files_and_headings_that_exist():
    for page in PAGES:
        for path, anchor in _links(page):
            target = (page.parent / path).resolve() if path else page
            assert target.exists(), f"{page.name}: link to {path}, which does not exist"
            if anchor and target.suffix == ".md":
                assert anchor in _anchors(target), f"{page.name}: no heading #{anchor} in {path}"


def test_every_docs_page_is_two_clicks_from_the_readme():
    reached, frontier = {ROOT / "README.md"}, [ROOT / "README.md"]
    for _ in range(2):
        frontier = [target for page in frontier for path, _ in _links(page)
                    if path.endswith(".md") and (target := (page.parent / path).resolve())
                    not in reached]
        reached.update(frontier)
    assert not set(PAGES) - reached, f"not reachable from README.md: {set(PAGES) - reached}"
    linked = {(ROOT / path).resolve() for path, _ in _links(ROOT / "README.md")}
    assert set(PAGES[1:]) <= linked, "every docs page is linked from the README itself"


_REPO_PATH = re.compile(r"(?<![\w./-])((?:fxopt|passes|models_zoo|tests|benchmarks|docs|\.ci)/"
                        r"[\w./-]*\w)(?:::(\w+))?")


def _named_paths(text: str):
    """``(path, test)`` of every repository path ``text`` names (globs such as ``*_cuda.txt``
    and f-string templates left out)."""
    for match in _REPO_PATH.finditer(text):
        if not set(text[match.end():match.end() + 2]) & {"*", "{"}:
            yield match.groups()


def test_every_file_and_test_the_docs_and_docstrings_name_exists():
    """Paths from the repository root (``fxopt/planning/pad_plan.py``) and the test functions
    named after ``::`` (``tests/test_layers.py::test_layers_import_only_downwards``) exist. Pages
    are read outside their code blocks (which name files the blocks write); the project's Python
    files (tests aside) and pyproject.toml whole, so a docstring cannot point at a module that
    moved."""
    sources = {page: re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
               for page in PAGES}
    for folder in ("fxopt", "passes", "models_zoo", "benchmarks"):
        sources.update({path: path.read_text() for path in (ROOT / folder).rglob("*.py")})
    sources[ROOT / "pyproject.toml"] = (ROOT / "pyproject.toml").read_text()
    for source, text in sources.items():
        for path, test in _named_paths(text):
            where = source.relative_to(ROOT)
            assert (ROOT / path).exists(), f"{where} names {path}, which does not exist"
            if test:
                assert f"def {test}(" in (ROOT / path).read_text(), (
                    f"{where} names {path}::{test}, which does not exist")


def test_measure_is_documented_and_has_a_readable_form():
    import fxopt
    from fxopt import models_zoo

    doc = fxopt.measure.__doc__
    assert "Returns a ``MemoryReport``" in doc and "print(report)" in doc and "CUDA" in doc
    model, inputs = models_zoo.build("mlp", 2)
    report = fxopt.measure(model, inputs)
    text = str(report)
    assert text.startswith("measured on cpu by live-storage tracking (exact):")
    assert "train peak " in text and "inference peak " in text and "MiB" in text
    assert str(report.train) == report.train.format() and "parameters 1.1 MiB" in text
    assert isinstance(report.train.peak_bytes, int)  # the fields stay bytes
    assert report.as_dict()["train"]["peak_bytes"] == report.train.peak_bytes
