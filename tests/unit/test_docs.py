"""The documentation: the site builds strict, README's links stay inside the repository, the generated
reference pages are what the code says now, and --help shows every flag in a group."""

import argparse
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from common import cli, flag_groups, settings
from common.launch import LaunchConfig
from router.config import RouterConfig
from scheduler.config import SchedulerConfig
from shard_worker.config import WorkerConfig
from tests.conftest import ROOT

LINK = re.compile(r"\]\(([^)\s]+)\)|href=\"([^\"]+)\"")


def gen_ref():
    spec = importlib.util.spec_from_file_location("gen_ref", ROOT / "docs" / "gen_ref.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_strict(tmp_path):
    """mkdocs.yml makes a broken link, a missing anchor and a page left out of nav warnings; strict
    makes a warning fail the build (-q would hide them from the count, so it is not passed)."""
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").exists()


def test_every_relative_link_in_readme_resolves_inside_the_repository():
    links = [a or b for a, b in LINK.findall((ROOT / "README.md").read_text())]
    relative = [link for link in links if not re.match(r"^[a-z]+:", link) and not link.startswith("#")]
    assert len(relative) >= 10
    for link in relative:
        target = (ROOT / link.split("#")[0]).resolve()
        assert target.is_relative_to(ROOT), f"README links outside the repository: {link}"
        assert target.exists(), f"README links to {link}, which does not exist"


def test_the_reference_pages_are_what_the_code_writes_now():
    module = gen_ref()
    for name, text in module.pages().items():
        page = ROOT / "docs" / "reference" / name
        assert page.exists() and page.read_text() == text, (
            f"docs/reference/{name} is stale: run `make docs` (python docs/gen_ref.py) and commit it"
        )


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_help_shows_every_flag_in_a_group_and_points_at_the_docs(command):
    parser = cli.build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    loose = [a.option_strings[0] for a in sub._optionals._group_actions if a.dest != "help"]
    assert not loose, f"add {loose} to a group in common/flag_groups.py"
    titles = [g.title for g in sub._action_groups]
    assert set(flag_groups.groups_of(command)) >= set(titles) - {"options", "positional arguments"}
    assert f"docs/reference/cli.md#tpserve-{command}" in sub.format_help()


def test_flag_tables_in_the_docs_state_the_declared_defaults():
    """The hand-written tables of docs/serving.md and docs/objectives.md explain flags; their defaults
    must be the ones the configs declare."""
    defaults = {}
    for cls in (SchedulerConfig, RouterConfig, WorkerConfig, LaunchConfig):
        for f in settings.walk(cls):
            defaults.setdefault(f.flag, f.default)

    def shown(value) -> str:
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, tuple):
            return ",".join(map(str, value))
        if isinstance(value, float) and value.is_integer():
            return str(int(value))
        return str(value)

    text = "".join((ROOT / "docs" / page).read_text() for page in ("serving.md", "objectives.md"))
    rows = re.findall(r"^\| `(--[a-z0-9-]+)`(?: / `(--[a-z0-9-]+)`)? \| ([^|]+) \|", text, re.M)
    assert len(rows) >= 10
    for first, second, values in rows:
        flags = [f for f in (first, second) if f]
        # Two flags in a row state two defaults, "a / b"; one flag's default may hold a slash (a path).
        stated = [v.strip() for v in values.split(" / ")] if second else [values.strip()]
        for flag, value in zip(flags, stated, strict=True):
            assert flag in defaults, f"the docs explain {flag}, which no config declares"
            if value == "unset":
                assert defaults[flag] is None, flag
                continue
            if value.startswith("model"):
                assert defaults[flag] == 0, flag  # "model's": 0 means the model's own
                continue
            assert value == shown(defaults[flag]), (
                f"the docs say {flag} defaults to {value}, the config {defaults[flag]}"
            )
