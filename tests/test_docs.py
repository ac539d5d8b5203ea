"""Every shell command, TOML block and SQL query of README.md and docs/ is checked, so the examples
cannot rot; each block is one test, named by its file and line (`docs/configs.md:42`).

What a block's check is comes from an HTML comment on the line before it (hidden on the site):
- TOML: no comment, a whole config that loads; `<!-- check: fragment -->`, tables that load added
  to a small config that lacks them; `<!-- check: error TEXT -->`, the same, but the loader refuses
  it with TEXT in its message.
- sh: `<!-- check: run -->`, each command runs and exits 0 (`run exit=N`: exits N; `run slow`: a
  slow test), in a scratch folder holding a results DB of every status; `<!-- check: dry-run -->`, each `codesign` command
  runs with `--dry-run` added; `<!-- check: parse REASON -->`, it cannot run here (a GPU, a
  cluster): it must be valid bash, every flag of its `codesign` commands one that command's
  --help lists, and every script it names must exist. An sh block without a check fails: every command is run or
  parsed on purpose.
- SQL: each query runs against that DB.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import sqlite3
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from codesign.config.loader import ACCEPTED_KEYS, load_config
from codesign.errors import ConfigError
from tests import report_db

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CHECK = re.compile(r"<!--\s*check:\s*(.*?)\s*-->")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
SHELLS = ("sh", "bash", "shell")
CODESIGN = (".venv/bin/codesign", "codesign")
# `codesign COMMAND`; anything else after the program (flags, or none) is `run`'s, as the CLI reads it.
COMMANDS = ("run", "search", "plan", "profile", "reprice", "report", "export", "hardware")
# A small config for TOML fragments: the tables a fragment lacks come from here.
BASE = {
    "training_spec": "[training_spec]\navg_batch_size_per_device = 16\nnum_iters = 6\n",
    "model": '[[model]]\nnum_features = 32\nemb_dim = 16\noutput_per_emb = 4\nnum_zhen_layers = 2\n'
             'tokens = ["ATTENTION", "LINEAR", "DOT", "CONVOLUTION"]\n',
    "cluster_spec": '[[cluster_spec]]\nnum_hosts = 1\nnum_devices_per_host = 2\ntransport = "NVLink"\n'
                    'platform = "cpu"\n',
    "parallel_spec": '[[parallel_spec]]\ndescription = "data parallel"\nnum_micro_batches = [1]\n'
                     '"(pp, dp, op)" = [1, 2, 1]\n',
}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    check: str  # the check comment's text, "" without one
    text: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page, each with the check comment on the line before it."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        before = CHECK.search(lines[i - 1]) if i else None
        indent = len(opening.group(1))
        text = "\n".join(line[indent:] for line in lines[i + 1:end]) + "\n"
        found.append(Block(page, i + 1, opening.group(2), before.group(1) if before else "", text))
        i = end + 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]


def _params(langs: tuple[str, ...]) -> list:
    """A block marked `slow` (`<!-- check: run slow -->`: it writes a report) is left out of -m "not slow"."""
    return [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if "slow" in b.check.split() else [])
            for b in ALL if b.lang in langs]


# ---- TOML ----

@pytest.mark.parametrize("block", _params(("toml",)))
def test_toml_block(block: Block, tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    if block.check == "fragment" or block.check.startswith("error "):
        missing = [text for name, text in BASE.items() if name not in tomllib.loads(block.text)]
        path.write_text(block.text + "\n" + "\n".join(missing))
    else:
        path.write_text(block.text)
    if block.check.startswith("error "):
        with pytest.raises(ConfigError) as refused:
            load_config(path)
        assert block.check.removeprefix("error ") in str(refused.value)
    else:
        assert block.check in ("", "fragment"), f"{block.id}: unknown check {block.check!r}"
        load_config(path)


# ---- shell ----

def commands(text: str) -> list[str]:
    """The block's command lines, continuations joined, comments and blank lines left out."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def codesign_call(words: list[str]) -> tuple[str, list[str]] | None:
    """(command, its arguments) of a codesign command line, None for another program."""
    if words[:3] in ([".venv/bin/python", "-m", "codesign"], ["python", "-m", "codesign"]):
        words = ["codesign", *words[3:]]
    if not words or words[0] not in CODESIGN:
        return None
    args = [w for w in words[1:] if w not in ("-v", "--verbose")]
    if args and args[0] in COMMANDS:
        return args[0], args[1:]
    return ("search" if "--search-model" in args else "run"), args


@functools.cache
def help_text(command: str) -> str:
    done = subprocess.run([sys.executable, "-m", "codesign", command, "--help"], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def check_parses(line: str) -> None:
    words = shlex.split(line, comments=True)
    words = words[:next((i for i, w in enumerate(words) if w in (">", "|", "&&", ";")), len(words))]
    call = codesign_call(words)
    if call:
        command, args = call
        text = help_text(command)
        for flag in (a.split("=")[0] for a in args if a.startswith("-")):
            assert re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", text), \
                f"`codesign {command}` has no flag {flag} ({line!r})"
    for word in words:
        if word.endswith((".py", ".sh", ".toml")) and "/" in word and not word.startswith(("my", "/")):
            assert (REPO / word.removeprefix("./")).exists(), f"{word} does not exist ({line!r})"


def scratch(folder: Path) -> dict[str, str]:
    """A folder that looks like a checkout with its .venv (the checkout's code, this Python) and a
    results DB of every status; the environment to run a page's commands in it."""
    for name in ("codesign", "bench", "scripts", "run.sh", "export_all.sh", "export_succeeded.sh"):
        (folder / name).symlink_to(REPO / name)
    venv = folder / ".venv" / "bin"
    venv.mkdir(parents=True)
    for name, command in (("python", ""), ("codesign", " -m codesign")):  # scripts: a link would lose the venv
        (venv / name).write_text(f'#!/bin/sh\nexec "{sys.executable}"{command} "$@"\n')
        (venv / name).chmod(0o755)
    report_db.build(folder / "results.db")
    return {**os.environ, "PYTHONPATH": str(folder), "PATH": f"{venv}:{os.environ['PATH']}"}


@pytest.mark.parametrize("block", _params(SHELLS))
def test_shell_block(block: Block, tmp_path: Path) -> None:
    check = block.check.split()
    assert check and check[0] in ("run", "dry-run", "parse"), \
        f"{block.id}: mark the block <!-- check: run | dry-run | parse REASON -->, got {block.check!r}"
    lines = commands(block.text)
    for line in lines:
        check_parses(line)
    if check[0] == "parse":
        assert len(check) > 1, f"{block.id}: say why it cannot run here: <!-- check: parse REASON -->"
        syntax = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True)
        assert syntax.returncode == 0, f"{block.id}: {syntax.stderr}"
        return
    expected = next((int(word.removeprefix("exit=")) for word in check if word.startswith("exit=")), 0)
    env = scratch(tmp_path)
    for line in lines:
        if check[0] == "dry-run":
            call = codesign_call(shlex.split(line, comments=True))
            assert call and call[0] == "run", f"{block.id}: only `codesign run` has --dry-run ({line!r})"
            line = f"{line.split(' #')[0]} --dry-run"
        done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == expected, f"{line!r} exited {done.returncode}:\n{done.stderr[-2000:]}"


# ---- SQL ----

@pytest.mark.parametrize("block", _params(("sql",)))
def test_sql_block(block: Block, tmp_path: Path) -> None:
    report_db.build(tmp_path / "results.db")
    with sqlite3.connect(tmp_path / "results.db") as db:
        for query in filter(str.strip, block.text.split(";")):
            db.execute(query).fetchall()


# ---- the config reference ----

def documented_keys(page: Path) -> dict[str, set[str]]:
    """Per `<!-- keys: TABLE -->` comment, the backquoted names in the first column of the table after it."""
    keys: dict[str, set[str]] = {}
    table = None
    for line in page.read_text().splitlines():
        marker = re.match(r"<!--\s*keys:\s*(.+?)\s*-->", line)
        if marker:
            table = keys.setdefault(marker.group(1), set())
        elif table is not None and line.startswith("|"):
            first = line.split("|")[1]
            table.update(name.strip('"') for name in re.findall(r"`([^`]+)`", first))
        elif table is not None and table and not line.startswith("|"):
            table = None
    return keys


def test_config_reference_lists_every_accepted_key() -> None:
    """docs/configs.md has a table for every TOML table the loader reads, naming exactly its keys."""
    documented = documented_keys(REPO / "docs" / "configs.md")
    assert set(documented) == set(ACCEPTED_KEYS)
    for table, accepted in ACCEPTED_KEYS.items():
        assert documented[table] == set(accepted), f"docs/configs.md, table {table}"


def test_every_page_has_checked_blocks() -> None:
    """The docs hold examples at all (a parser that found none would pass every test above)."""
    counted = {lang: sum(b.lang in lang for b in ALL) for lang in (("toml",), SHELLS)}
    assert all(n >= 5 for n in counted.values()), counted


def test_readme_is_short_and_timeless() -> None:
    """A newcomer's two minutes: no dates, commit hashes, issue numbers or links outside the repository."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text)
    assert not re.search(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", text)
    assert not re.search(r"\bissues? #?\d+", text, re.IGNORECASE)
    assert "../shared" not in text
