"""The docs run as printed: every fenced Python block in README.md and docs/, and every `ttflow`
command in a `sh` block.

A block that is deliberately a fragment (an excerpt with `...` or names defined elsewhere) is
preceded by `<!-- fragment: why -->` and is skipped with that reason. A block preceded by
`<!-- continues -->` runs after the blocks before it in its file, as one script, so a page can
build one example over several blocks. A script that defines tests (`def test_...`, a
`...TestCase`) runs under pytest, as its reader would run it. Each script runs in a fresh
interpreter in an empty folder: nothing from the test session leaks in.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*(fragment|continues)\s*(?::\s*(.*?))?\s*-->")
TIMEOUT = 600


@attrs.frozen
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    marker: str | None  # "fragment" | "continues" | None
    reason: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """The fenced blocks of one Markdown page, each with the marker on the line before it."""
    found: list[Block] = []
    lines = page.read_text().splitlines()
    index = 0
    while index < len(lines):
        fence = re.match(r"^```(\S*)\s*$", lines[index])
        if fence is None:
            index += 1
            continue
        start = index
        index += 1
        while index < len(lines) and lines[index].rstrip() != "```":
            index += 1
        previous = next((text for text in reversed(lines[:start]) if text.strip()), "")
        marker = MARKER.fullmatch(previous.strip())
        found.append(Block(page, start + 1, fence.group(1), "\n".join(lines[start + 1:index]) + "\n",
                           marker.group(1) if marker else None,
                           (marker.group(2) or "") if marker else ""))
        index += 1
    return found


@attrs.frozen
class Script:
    """What one reader runs: a block, with the blocks it continues."""

    blocks: tuple[Block, ...]

    @property
    def name(self) -> str:
        return self.blocks[-1].name

    @property
    def code(self) -> str:
        return "\n".join(block.code for block in self.blocks)

    @property
    def is_test_file(self) -> bool:
        return re.search(r"^(def test_|Test\w+ = |class Test)", self.code, re.MULTILINE) is not None


def scripts_of(page: Path) -> list[Script | Block]:
    """Runnable Python scripts of a page, and its fragments (to be skipped with their reason).
    A block that others continue runs only as part of the longest script."""
    items: list[Script | Block] = []
    current: list[Block] = []
    for block in blocks_of(page):
        if block.language != "python":
            continue
        if block.marker == "fragment":
            items.append(block)
            continue
        if block.marker == "continues":
            assert current, f"{block.name}: '<!-- continues -->' with no block before it"
            current.append(block)
            items[-1] = Script(tuple(current))
            continue
        current = [block]
        items.append(Script(tuple(current)))
    return items


def run_script(script: Script, folder: Path) -> subprocess.CompletedProcess[str]:
    path = folder / ("test_docs_block.py" if script.is_test_file else "docs_block.py")
    path.write_text(script.code)
    command = ([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)]
               if script.is_test_file else [sys.executable, str(path)])
    return subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=TIMEOUT)


def needs_torch(code: str) -> bool:
    return re.search(r"^\s*(import torch|from torch)", code, re.MULTILINE) is not None


def has_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def needs_jax(code: str) -> bool:
    return re.search(r"^\s*(import jax|from jax|import ttflow\.jax)", code, re.MULTILINE) is not None


def has_jax() -> bool:
    import importlib.util

    return importlib.util.find_spec("jax") is not None and importlib.util.find_spec("jax_plugins.libtt") is not None


PYTHON = [item for page in PAGES for item in scripts_of(page)]


@pytest.mark.parametrize("item", PYTHON, ids=[item.name for item in PYTHON])
def test_python_block_runs_as_printed(item: Script | Block, tmp_path: Path) -> None:
    if isinstance(item, Block):
        pytest.skip(f"a fragment: {item.reason}")
    if needs_torch(item.code) and not has_torch():
        pytest.skip("needs the torch extra: pip install torch==2.13.0 --index-url "
                    "https://download.pytorch.org/whl/cpu")
    if needs_jax(item.code) and not has_jax():
        pytest.skip("needs the jax extra: pip install '.[jax]' (Python 3.11)")
    result = run_script(item, tmp_path)
    assert result.returncode == 0, (
        f"{item.name} failed as printed:\n{item.code}\n--- stdout\n{result.stdout[-3000:]}"
        f"\n--- stderr\n{result.stderr[-3000:]}")


def commands_of(page: Path) -> list[tuple[str, list[str]]]:
    """Each `ttflow ...` line of the page's `sh` blocks, with its arguments."""
    return [(f"{block.name}: {line.strip()}", shlex.split(line, comments=True)[1:])
            for block in blocks_of(page) if block.language == "sh"
            for line in block.code.splitlines() if line.strip().startswith("ttflow ")]


COMMANDS = [command for page in PAGES for command in commands_of(page)]


def ttflow_command() -> list[str]:
    installed = Path(sys.executable).parent / "ttflow"  # the console script pip installed
    return [str(installed)] if installed.exists() else [sys.executable, "-m", "ttflow.cli"]


@pytest.mark.parametrize("arguments", [args for _, args in COMMANDS], ids=[name for name, _ in COMMANDS])
def test_ttflow_command_runs(arguments: list[str], tmp_path: Path) -> None:
    if arguments[:2] == ["bench", "torch"] and not has_torch():
        pytest.skip("needs the torch extra")
    result = subprocess.run([*ttflow_command(), *arguments], cwd=tmp_path, capture_output=True,
                            text=True, timeout=TIMEOUT)
    assert result.returncode == 0, f"ttflow {shlex.join(arguments)}:\n{result.stderr[-3000:]}"
    if "--json" in arguments:
        json.loads(result.stdout)  # what it printed is JSON, as the flag says


def test_the_docs_have_blocks_to_run() -> None:
    """The collector finds what is there (a parser that found nothing would pass everything)."""
    scripts = [item for item in PYTHON if isinstance(item, Script)]
    assert len(scripts) >= 5 and len(COMMANDS) >= 7, (len(scripts), len(COMMANDS))
    assert any(len(script.blocks) > 1 for script in scripts)  # continuation is exercised
    assert any(script.is_test_file for script in scripts)


def test_fragments_say_why() -> None:
    fragments = [item for item in PYTHON if isinstance(item, Block)]
    for fragment in fragments:
        assert fragment.reason, f"{fragment.name}: a fragment marker needs a reason"


def test_a_broken_block_fails(tmp_path: Path) -> None:
    """The runner reports a block that does not run (the planted break), and runs a good one."""
    page = tmp_path / "page.md"
    page.write_text("Text.\n\n```python\nimport ttflow as tt\nprint(tt.__version__)\n```\n\n"
                    "<!-- continues -->\n```python\nundefined_name + 1\n```\n\n"
                    "```python\nx = 1\n```\n")
    broken, good = scripts_of(page)
    assert isinstance(broken, Script) and isinstance(good, Script)
    assert len(broken.blocks) == 2
    failed = run_script(broken, tmp_path)
    assert failed.returncode != 0 and "NameError" in failed.stderr
    assert run_script(good, tmp_path).returncode == 0


# --- sentences that quote the code: each checked against the one place it comes from ---


def test_the_kernel_figures_quote_the_default_repeats() -> None:
    import inspect

    from ttflow._bench import kernels

    repeats = inspect.signature(kernels.run).parameters["repeats"].default
    kernels_section = (ROOT / "docs" / "performance.md").read_text().split("## Kernels", 1)[1]
    assert f"best of {repeats} (the default `--repeats`)" in kernels_section.split("##", 1)[0]


def test_the_eviction_policies_are_named_alike_everywhere() -> None:
    import ttflow as tt
    from ttflow import cli
    from ttflow._sched import EVICTION_POLICIES

    assert tuple(cli.EVICTION_POLICY_SUMMARIES) == EVICTION_POLICIES
    help_text = " ".join(cli._parser()._subparsers._group_actions[0].choices["demo"].format_help().split())
    memory_page = (ROOT / "docs" / "memory.md").read_text()
    for name in EVICTION_POLICIES:
        assert f"{name}{' (the default)' if name == EVICTION_POLICIES[0] else ''}:" in help_text
        assert f'`"{name}"`' in memory_page, f"docs/memory.md does not describe {name!r}"
    async def default_policy() -> str:
        async with tt.open_device(tt.DeviceSpec.small()) as device:
            return device.eviction

    import anyio

    assert anyio.run(default_policy) == EVICTION_POLICIES[0]


def test_api_reference_lists_every_counter() -> None:
    import ttflow as tt

    api = (ROOT / "docs" / "api.md").read_text()
    statistics = api[api.index("`device.stats -> tt.DeviceStatistics`"):]
    statistics = statistics[:statistics.index("\n- ")]
    for field in attrs.fields(tt.DeviceStatistics):
        assert f"`{field.name}`" in statistics, f"docs/api.md's stats list lacks {field.name}"


def test_every_benchmark_says_what_it_measures() -> None:
    from ttflow import cli

    pages = "\n".join(page.read_text() for page in PAGES)
    for name, (_module, about) in cli.BENCHMARKS.items():
        assert about, name
        assert f"ttflow bench {name}" in pages, f"no page shows `ttflow bench {name}`"


# What the docs say of the current binary format: the version `save` writes and the versions
# `load` reads. (A sentence saying which version added something, "since format version 8",
# stays true when the format moves on, and is not checked.)
FORMAT_CLAIMS = {"writes": re.compile(r"writes\s+format\s+version\s+(\d+)"),
                 "reads": re.compile(r"reads\s+versions\s+1\s+to\s+(\d+)")}
NOT_OURS: dict[str, str] = {}  # a page known to be stale, with why (strict: it fails once mended)


def format_claims(page: Path) -> list[tuple[str, int]]:
    text = page.read_text()
    return [(what, int(m.group(1))) for what, pattern in FORMAT_CLAIMS.items() for m in pattern.finditer(text)]


CLAIMING = [page for page in PAGES if format_claims(page)]


@pytest.mark.parametrize("page", [
    pytest.param(page, marks=pytest.mark.xfail(reason=NOT_OURS[page.name], strict=True))
    if page.name in NOT_OURS else page for page in CLAIMING], ids=[page.name for page in CLAIMING])
def test_the_docs_quote_the_binary_format_version(page: Path) -> None:
    from ttflow._ir.binary import _READS, _VERSION

    assert format_claims(page) and all(
        version == (_VERSION if what == "writes" else _READS[-1]) for what, version in format_claims(page)
    ), (page.name, format_claims(page), _VERSION)


def test_the_api_reference_says_which_format_version_save_writes() -> None:
    assert {what for what, _ in format_claims(ROOT / "docs" / "api.md")} == {"writes", "reads"}


def test_the_readme_lists_every_command() -> None:
    from ttflow import cli

    readme = (ROOT / "README.md").read_text()
    commands = cli._parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    listed = set(re.findall(r"^- `ttflow (\w+)", readme, re.MULTILINE))
    assert set(commands) - {"demo"} <= listed, sorted(set(commands) - {"demo"} - listed)  # demo: the first line
    assert "ttflow demo" in readme.split("```", 1)[0]
