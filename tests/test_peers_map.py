"""docs/peers.md maps every flag of the three scripts to TRL and verl: it must name each flag in the
`here` column of its table, name no flag that no script has, and keep each row's scripts and defaults
equal to the scripts' `Args`. Imports the scripts (cheap: nothing loads or trains)."""

import dataclasses
import re
from pathlib import Path

import pytest

import dapo
import grpo
import ppo

DOC = Path(__file__).resolve().parents[1] / "docs" / "peers.md"
SCRIPTS = {"grpo": grpo, "dapo": dapo, "ppo": ppo}
CODE_SPAN = re.compile(r"`([^`]*)`")
FLAG = re.compile(r"(?<![\w-])--([A-Za-z0-9][A-Za-z0-9_-]*)")
NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w.])")


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")  # tyro's default spelling


def leaf_fields(cls) -> list[dataclasses.Field]:
    """The fields that are flags: Args's own, and those of its shared sections (flags without a prefix)."""
    out = []
    for field in dataclasses.fields(cls):
        section = field.default_factory if field.default_factory is not dataclasses.MISSING else None
        out += leaf_fields(section) if dataclasses.is_dataclass(section) else [field]
    return out


def script_flags() -> dict[str, dict[str, dataclasses.Field]]:
    """flag -> {script: its Args field}."""
    flags: dict[str, dict[str, dataclasses.Field]] = {}
    for script, module in SCRIPTS.items():
        for field in leaf_fields(module.Args):
            flags.setdefault(flag_name(field.name), {})[script] = field
    return flags


def default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()  # type: ignore[misc]


def flags_in(text: str) -> list[str]:
    """Every `--flag` inside a backtick code span of `text`, as written."""
    return ["--" + m for span in CODE_SPAN.findall(text) for m in FLAG.findall(span)]


def map_rows() -> list[dict[str, str]]:
    """The rows of the table whose header starts with `here`, as {column: cell}."""
    lines = DOC.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells and cells[0] == "here":
            header = cells
            break
    else:
        pytest.fail(f"{DOC}: no table whose first column is `here`")
    rows = []
    for line in lines[i + 2:]:  # after the header and its |---| line
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == len(header), f"{DOC}: a row with {len(cells)} cells, not {len(header)}: {line}"
        rows.append(dict(zip(header, cells)))
    assert rows, f"{DOC}: the flag table has no rows"
    return rows


def test_every_flag_has_a_row():
    named = {flag for row in map_rows() for flag in flags_in(row["here"])}
    missing = sorted(set(script_flags()) - named)
    assert not missing, f"flags without a row (in the `here` column) in docs/peers.md: {missing}"


def test_no_row_names_a_flag_that_no_script_has():
    flags = script_flags()
    negations = {"--no-" + f[2:] for f, fields in flags.items() if any(x.type in (bool,
                                                                                  "bool") for x in fields.values())}
    unknown = sorted(set(flags_in(DOC.read_text(encoding="utf-8"))) - set(flags) - negations)
    assert not unknown, f"docs/peers.md names flags that no script has: {unknown}"


def test_each_row_lists_the_scripts_that_have_its_flags():
    flags = script_flags()
    seen: dict[str, set[str]] = {}
    for row in map_rows():
        row_flags = flags_in(row["here"])
        if not row_flags:
            continue  # a row about something without a flag (the advantage estimator, eq. 10's std, ...)
        listed = set(re.findall(r"\w+", row["scripts"]))
        assert listed and listed <= set(SCRIPTS), f"row {row['here']}: scripts {row['scripts']!r}"
        for flag in row_flags:
            have = set(flags.get(flag, {}))
            assert listed <= have, f"row {row['here']}: lists {sorted(listed - have)}, which have no {flag}"
            seen.setdefault(flag, set()).update(listed)
    for flag, have in flags.items():
        assert seen.get(flag, set()) == set(have), (
            f"{flag}: the rows list {sorted(seen.get(flag, set()))}, but the scripts that have it are {sorted(have)}")


def _shows(cell: str, value) -> bool:
    """Whether a `default here` cell states `value` (lenient: anywhere in the cell)."""
    if isinstance(value, bool):
        return re.search(r"\b" + ("on" if value else "off") + r"\b", cell) is not None
    if isinstance(value, (int, float)):
        return any(float(n) == float(value) for n in NUMBER.findall(cell))
    if value == "":
        return '""' in cell
    return str(value) in cell


def test_each_row_states_the_defaults():
    flags = script_flags()
    for row in map_rows():
        listed = set(re.findall(r"\w+", row["scripts"]))
        for flag in flags_in(row["here"]):
            for script, field in flags.get(flag, {}).items():
                if script in listed:
                    assert _shows(row["default here"], default(field)), (
                        f"row {row['here']}: `default here` ({row['default here']!r}) does not show {script}.py's "
                        f"default {flag}={default(field)!r}")
