"""README.md's code blocks, run as written.

The rules, by the block's info string:

- ```python: run as a script by the venv's Python in a fresh process (``runpy.run_path``), then
  every top-level ``test_*`` function it defines is called (the README shows tests a user would
  put in their suite).
- ```bash: run by ``bash -e -o pipefail`` with the venv's ``bin`` first on ``PATH`` (``fxopt``
  and ``python`` are the venv's), in a scratch directory where ``.venv`` links to the venv. The
  bash blocks share that directory and run in README order, so a later block may use a file an
  earlier one wrote. Skipped, by ``SKIP_BASH``: the set-up commands, which create the venv
  (``python3 -m venv``) or run the whole test suite (``pytest``).
- Untagged blocks are recorded output, not run; but every ``$ fxopt ...`` line in them must still
  parse with the CLI of today (``argparse``, nothing runs), so a transcript cannot name an option
  that is gone.

Code blocks of ``docs/*.md`` files the README links to follow the same rules.

The python blocks and the bash blocks run in two lanes at once (one torch thread each): the whole
file takes about a minute on two cores.
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
SKIP_BASH = {"python3 -m venv": "creates the venv (the set-up command)",
             "pytest": "runs the whole test suite (the set-up command)"}
MIN_BLOCKS_RUN = 7
TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.path.name}:{self.line}:{self.lang or 'output'}"


def code_blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file: its first line's number, info string and text."""
    blocks, lines = [], path.read_text().splitlines()
    index = 0
    while index < len(lines):
        opening = re.match(r"^```(\S*)\s*$", lines[index])
        if not opening:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
        blocks.append(Block(path, index + 1, opening.group(1),
                            "\n".join(lines[index + 1:end]) + "\n"))
        index = end + 1
    return blocks


def linked_docs() -> list[Path]:
    """The ``docs/*.md`` files README.md links to."""
    names = re.findall(r"\]\((docs/[^)#]+\.md)", (ROOT / "README.md").read_text())
    return sorted({ROOT / name for name in names})


def all_blocks() -> list[Block]:
    return [b for path in [ROOT / "README.md", *linked_docs()] for b in code_blocks(path)]


def skip_reason(block: Block) -> str | None:
    if block.lang == "bash":
        return next((why for word, why in SKIP_BASH.items() if word in block.text), None)
    return None if block.lang == "python" else "recorded output"


BLOCKS = all_blocks()
RUN = [b for b in BLOCKS if skip_reason(b) is None]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["OMP_NUM_THREADS"] = "1"  # two lanes on CI's two cores
    env["MPLBACKEND"] = "Agg"
    return env


def _run_python(block: Block, workdir: Path) -> subprocess.CompletedProcess:
    script = workdir / f"readme_{block.line}.py"
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


def test_the_rules_leave_enough_blocks_to_run():
    skipped = {b.id: skip_reason(b) for b in BLOCKS if b.lang == "bash" and skip_reason(b)}
    assert len(skipped) == 2, skipped  # the two set-up commands, and nothing else
    assert len(RUN) >= MIN_BLOCKS_RUN, [b.id for b in RUN]
    assert {b.lang for b in RUN} == {"python", "bash"}


@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_block_runs_as_written(block, results):
    process = results[block.id]
    assert process.returncode == 0, (
        f"{block.id} exited {process.returncode}\n--- block\n{block.text}--- stdout\n"
        f"{process.stdout[-3000:]}--- stderr\n{process.stderr[-3000:]}")
    assert "Traceback" not in process.stderr


def _transcript_commands() -> list[tuple[str, list[str]]]:
    """``(where, argv)`` of every ``$ fxopt ...`` line in the untagged blocks."""
    found = []
    for block in BLOCKS:
        for offset, line in enumerate(block.text.splitlines()):
            if line.startswith("$ fxopt "):
                command = line[2:].split(";")[0]
                found.append((f"{block.path.name}:{block.line + 1 + offset}",
                              shlex.split(command)[1:]))
    return found


def test_transcripts_name_only_options_that_exist(capsys):
    commands = _transcript_commands()
    assert len(commands) >= 5
    parser = cli.build_parser()
    for where, argv in commands:
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: fxopt {' '.join(argv)} no longer parses: "
                        f"{capsys.readouterr().err}")


def test_readme_quotes_what_the_shell_would_mangle_and_shows_what_errors_name():
    """``checkpoint{budget=0.5,profile=false}`` unquoted is brace-expanded by bash into two
    words: every pass spec with braces in a command must be quoted."""
    text = (ROOT / "README.md").read_text()
    for match in re.finditer(r"--passes[ =]([^\s`]+)", text):
        value = match.group(1)
        if "{" in value:
            assert value[0] in "'\"", f"unquoted --passes {value}"
    assert "../shared" not in text and "the issue" not in text
    # errors suggest fxopt.trace(): the README shows it, in a block that runs
    assert any("fxopt.trace(" in b.text for b in RUN if b.lang == "python")


def test_measure_is_documented_and_has_a_readable_form():
    import fxopt
    import models_zoo

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
