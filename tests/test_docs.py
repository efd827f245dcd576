"""The README and docs/ cannot drift from the code.

Every setting the code reads (from its one reader, ``smemguard.facts.settings``) and every command, flag and choice
the ``smemguard`` parser defines (walked from the parser itself) is in the README, and nothing the README names is
missing from the code; every relative link of README.md and docs/ resolves, anchors included; the README's test
command is the one CI runs."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from smemguard import examples
from smemguard.cli.commands import build_parser
from smemguard.facts import settings

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def _commands() -> dict[str, argparse.ArgumentParser]:
    [subparsers] = [action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction)]
    return dict(subparsers.choices)


def _spelled(parser: argparse.ArgumentParser) -> set[str]:
    """The flags (every option string) and the choices of the positional arguments a user types, those of a
    command's own subcommands (``pin add``) included."""
    words = set()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        words.update(action.option_strings)
        if not action.option_strings and action.choices:
            words.update(action.choices)
        if isinstance(action, argparse._SubParsersAction):
            words.update(word for subcommand in action.choices.values() for word in _spelled(subcommand))
    return words


def _section(title: str) -> str:
    """The README's section under ``## title``, up to the next one."""
    return README.read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _command_rows() -> dict[str, str]:
    """The Commands section's table: the first cell of each row naming a command, by command."""
    rows = {}
    for line in _section("Commands").splitlines():
        found = re.match(r"\| `smemguard ([a-z]+)[ `]", line)
        if found:
            rows[found.group(1)] = line.split(" | ")[0]
    return rows


def _settings_rows() -> list[str]:
    return re.findall(r"^\| `(SMEMGUARD[A-Z_]*)` \|", _section("Settings"), flags=re.MULTILINE)


def test_every_setting_the_code_reads_has_a_row_in_the_readme_and_no_other():
    assert sorted(_settings_rows()) == sorted(settings.KNOWN)


def test_every_smemguard_name_the_readme_uses_is_a_setting_or_the_preflight_declaration():
    # SMEMGUARD_PREFLIGHT is no environment variable: a dict a module declares for `smemguard check`
    declarations = {name for name in vars(examples) if name.startswith("SMEMGUARD")}
    named = set(re.findall(r"\bSMEMGUARD(?:_[A-Z]+)*\b", README.read_text()))
    assert named - set(settings.KNOWN) - declarations == set()
    assert declarations == {"SMEMGUARD_PREFLIGHT"}


def test_every_command_has_a_row_naming_each_of_its_flags_and_choices():
    rows = _command_rows()
    commands = _commands()
    assert set(rows) == set(commands), "the commands table and the parser name different commands"
    missing = {name: sorted(word for word in _spelled(parser) if word not in rows[name])
               for name, parser in commands.items()}
    assert {name: words for name, words in missing.items() if words} == {}


def test_the_readme_names_no_flag_a_command_does_not_define():
    commands = _commands()
    text = README.read_text()
    wrong = set()
    # a command's row, and every inline use: `smemguard check --examples --gpu L4`
    uses = [(name, row) for name, row in _command_rows().items()]
    uses += re.findall(r"`smemguard ([a-z]+)((?: [^`]*)?)`", text)
    for name, rest in uses:
        if name not in commands:
            wrong.add(name)
            continue
        flags = re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", rest.split(" -- ")[0])
        wrong.update(f"{name} {flag}" for flag in flags if flag not in _spelled(commands[name]) | {"--help"})
    main_flags = {flag for action in build_parser()._actions for flag in action.option_strings}
    assert {"--version", "--help"} <= main_flags and "`smemguard --version`" in text
    assert wrong == set()


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")


def _prose(page: Path) -> str:
    """The page without its code blocks and inline code, where brackets are code, not links."""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL))


def _anchors(page: Path) -> set[str]:
    anchors, seen = set(), {}
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.MULTILINE):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_resolves(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page)):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(target)
    assert broken == []


def test_the_readme_stays_short_and_the_benchmarks_page_names_no_tracker_numbers():
    assert len(README.read_text().splitlines()) <= 400
    benchmarks = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert len(benchmarks.splitlines()) <= 500
    assert re.findall(r"\bissues? \d+", benchmarks, flags=re.IGNORECASE) == []


def test_ci_runs_the_readmes_test_command():
    [command] = [line for line in README.read_text().splitlines() if "-m pytest" in line and line.startswith("python3")]
    pytest_command = command[command.index(".venv/bin/python -m pytest"):]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert f"{pytest_command}  # the README's test command" in ci


def test_the_living_benchmarks_are_at_most_14_scripts_on_the_harness_each_with_its_section():
    scripts = sorted(path for path in (ROOT / "benchmarks").glob("*.py") if path.name != "harness.py")
    assert (ROOT / "benchmarks" / "harness.py").is_file() and len(scripts) <= 14
    assert [path.name for path in scripts if not re.search(r"^(import harness|from harness import)", path.read_text(),
                                                           flags=re.MULTILINE)] == []
    benchmarks = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert [path.name for path in scripts if f"benchmarks/{path.name}" not in benchmarks] == []
