"""README's flag tables state the defaults the configs declare (a default is declared once, in the field;
this keeps the documentation from drifting away from it)."""

import re

from common import settings
from common.launch import LaunchConfig
from router.config import RouterConfig
from scheduler.config import SchedulerConfig
from shard_worker.config import WorkerConfig
from tests.conftest import ROOT


def declared_defaults() -> dict[str, object]:
    out = {}
    for cls in (SchedulerConfig, RouterConfig, WorkerConfig, LaunchConfig):
        for f in settings.walk(cls):
            out.setdefault(f.flag, f.default)
    return out


def shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def test_every_flag_row_in_readme_states_the_declared_default():
    defaults = declared_defaults()
    rows = re.findall(
        r"^\| `(--[a-z0-9-]+)`(?: / `(--[a-z0-9-]+)`)? \| ([^|]+) \|", (ROOT / "README.md").read_text(), re.M
    )
    assert len(rows) >= 10
    for first, second, values in rows:
        flags = [f for f in (first, second) if f]
        # Two flags in a row state two defaults, "a / b"; one flag's default may hold a slash (a path).
        stated = [v.strip() for v in values.split(" / ")] if second else [values.strip()]
        for flag, value in zip(flags, stated, strict=True):
            assert flag in defaults, f"README documents {flag}, which no config declares"
            if value.startswith("model"):
                assert defaults[flag] == 0, flag  # "model's": 0 means the model's own
                continue
            assert value == shown(defaults[flag]), (
                f"README says {flag} defaults to {value}, the config {defaults[flag]}"
            )
