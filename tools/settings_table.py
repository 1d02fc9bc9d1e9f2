"""docs/configuration.md's table of engine settings, generated from EngineConfig (pyengine/config.py).

    python tools/settings_table.py           # print the table
    python tools/settings_table.py --write   # rewrite it between the page's settings-table markers

tests/test_settings.py checks the page holds what this prints, so a new setting shows up in the docs."""
from __future__ import annotations

import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pyengine.engine_args import default_of, flag_name, value_types  # noqa: E402
from pyengine.config import engine_settings  # noqa: E402

PAGE = ROOT / "docs" / "configuration.md"
BEGIN, END = "<!-- settings-table:begin -->", "<!-- settings-table:end -->"


def table() -> str:
    """One row per EngineConfig field: its flag (and TOML key), default and help, grouped as --help is."""
    rows = ["| setting (TOML key) | flag | default | what it sets |", "|---|---|---|---|"]
    settings = engine_settings()
    for group in dict.fromkeys(s.group for s in settings.values()):
        for name, s in settings.items():
            if s.group != group:
                continue
            flag = flag_name(name)
            if value_types(name) == (bool,):
                flag += f" / --no-{flag[2:]}"
            default = s.default_text if default_of(name) is None else f"`{default_of(name)}`"
            choices = f" ({', '.join(map(str, s.choices))})" if s.choices else ""
            what = ("CUDA only: " if s.cuda_only else "") + s.help.replace("|", "\\|") + choices
            rows.append(f"| `{name}` | `{flag}` | {default} | {group}: {what} |")
    return "\n".join(rows)


def page_with_table(text: str) -> str:
    """The page's text with the block between the markers replaced by table()."""
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{PAGE} has no {BEGIN} ... {END} block")
    return pattern.sub(lambda _: f"{BEGIN}\n{table()}\n{END}", text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"rewrite the table in {PAGE.relative_to(ROOT)}")
    if ap.parse_args().write:
        PAGE.write_text(page_with_table(PAGE.read_text()))
    else:
        print(table())


if __name__ == "__main__":
    main()
