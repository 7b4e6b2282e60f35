"""Every script keeps each command-line flag's name and default (the interface researchers script against).

tests/cli_flags.json lists them; it was written from the scripts before their Args were regrouped, with
`python tests/test_cli_flags.py --write` (run it again only when a flag is meant to change)."""

import dataclasses
import importlib
import json
import sys
import warnings
from pathlib import Path

import pytest
import tyro

ROOT = Path(__file__).resolve().parent.parent
SNAPSHOT = Path(__file__).with_name("cli_flags.json")
SCRIPTS = ("grpo", "dapo", "ppo")


def leaf_defaults(obj) -> dict:
    """Field name -> default, through nested dataclasses (their fields are flags without a prefix)."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        out.update(leaf_defaults(value) if dataclasses.is_dataclass(value) else {f.name: value})
    return out


def cli_flags(script: str) -> dict:
    """`--flag` (or `--flag/--no-flag`) -> its default, as the command line sees them."""
    sys.path.insert(0, str(ROOT))
    module = importlib.import_module(script)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        parser = tyro.extras.get_parser(module.Args)
    option_names = {"/".join(a.option_strings) for a in parser._actions if a.option_strings != ["-h", "--help"]}
    defaults = leaf_defaults(tyro.cli(module.Args, args=[]))
    flags = {}
    for name, default in defaults.items():
        flag = "--" + name.replace("_", "-")
        spelled = f"{flag}/--no-{name.replace('_', '-')}" if isinstance(default, bool) else flag
        flags[spelled if spelled in option_names else flag] = default
    assert set(flags) == option_names, (set(flags) ^ option_names)
    return flags


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_keeps_its_name_and_default(script):
    expected = json.loads(SNAPSHOT.read_text())[script]
    assert cli_flags(script) == expected


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    SNAPSHOT.write_text(json.dumps({s: cli_flags(s) for s in SCRIPTS}, indent=1) + "\n")
