"""EngineConfig's fields are the one settings table: every setting is a server flag and a TOML key with
the dataclass's default, --help shows that default (or says what a None default means), and the
memory planner's flags are the server's."""
from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

from engine_fakes import fake_engine
from pyengine import plan
from pyengine.config import EngineConfig, engine_settings
from pyengine.engine_args import default_of, flag_name, value_types
from server import config_file
from server.cli import SERVER_ENGINE_SETTINGS, build_parser, engine_config

ROOT = pathlib.Path(__file__).resolve().parent.parent


def example_value(name: str):
    """A valid value of the setting other than its default."""
    s, default = engine_settings()[name], default_of(name)
    if s.choices is not None:
        return next(c for c in s.choices if c != default)
    if value_types(name) == (bool,):
        return not default
    if s.parse is not None:  # a size such as "64MiB", or the setting's own example
        return s.parse(s.example or "64MiB")
    kind = value_types(name)[0]
    if kind is str:
        return "example"
    return kind((default or 16) * 2)


def example_argv(name: str) -> list[str]:
    value = example_value(name)
    if isinstance(value, bool):
        argv = [flag_name(name) if value else "--no-" + flag_name(name)[2:]]
    else:
        argv = [flag_name(name), engine_settings()[name].example or str(value)]
    return argv + (["--device", "cuda"] if engine_settings()[name].cuda_only else [])


def help_entries(parser, monkeypatch) -> dict[str, str]:
    """--help as {option string: its help text on one line}."""
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping inside the help texts
    entries: dict[str, str] = {}
    current = None
    for line in parser.format_help().splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            entries[current] = line
        elif line.startswith("   ") and current is not None:
            entries[current] += " " + line.strip()
        else:
            current = None
    return {k: " ".join(v.split()) for k, v in entries.items()}


def test_the_server_takes_every_setting_as_a_flag_and_a_toml_key():
    names = list(engine_settings())
    assert [a.dest for a in build_parser()._actions if a.dest in names] == names  # --model: one or several
    assert list(config_file.ENGINE_KEYS) == [n for n in names if n != "model"]  # a table's model is its `path`


@pytest.mark.parametrize("name", SERVER_ENGINE_SETTINGS)
def test_every_setting_can_be_set_from_the_command_line(name):
    assert getattr(engine_config(build_parser().parse_args(example_argv(name))), name) == example_value(name)


def test_every_boolean_setting_takes_its_negative_flag():
    """server.ray writes a Serve config's `name: false` as --no-name."""
    for name in SERVER_ENGINE_SETTINGS:
        if value_types(name) == (bool,):
            assert getattr(build_parser().parse_args(["--no-" + flag_name(name)[2:]]), name) is False


def test_no_flags_give_the_dataclass_defaults():
    assert engine_config(build_parser().parse_args([])) == EngineConfig()


def test_every_setting_can_be_set_from_the_toml_file(tmp_path):
    tables = []
    for name in SERVER_ENGINE_SETTINGS:
        example = engine_settings()[name].example  # a parsed setting's text, else the value itself
        lines = ["[[models]]", f'name = "{name}"', f"{name} = {json.dumps(example or example_value(name))}"]
        if engine_settings()[name].cuda_only:
            lines.append('device = "cuda"')
        tables.append("\n".join(lines))
    path = tmp_path / "server.toml"
    path.write_text("\n\n".join(tables) + "\n")
    defaults = build_parser().parse_args([])
    for spec in config_file.load(str(path)).models:
        assert getattr(engine_config(defaults, spec.path, **spec.engine), spec.name) == example_value(spec.name)


def test_a_toml_size_may_be_written_with_units(tmp_path):
    path = tmp_path / "server.toml"
    path.write_text('[[models]]\nname = "m"\nkv_cache_memory = "64MiB"\nnum_threads = 1\n')
    assert config_file.load(str(path)).models[0].engine == {"kv_cache_memory": 64 << 20, "num_threads": 1}


def test_a_toml_boolean_is_not_taken_for_a_number(tmp_path):
    path = tmp_path / "server.toml"
    path.write_text('[[models]]\nname = "m"\nkv_cache_memory = true\n')  # would be the fraction 1.0
    with pytest.raises(config_file.ConfigError, match="kv_cache_memory = True has the wrong type"):
        config_file.load(str(path))


def test_help_shows_the_dataclass_defaults(monkeypatch):
    entries = help_entries(build_parser(), monkeypatch)
    for name in SERVER_ENGINE_SETTINGS:
        s, default = engine_settings()[name], default_of(name)
        shown = s.default_text if default is None else str(default)
        assert entries[flag_name(name)].endswith(f"(default: {shown})"), entries[flag_name(name)]


def test_help_shows_the_prefill_chunks_the_engine_takes_on_the_cpu(monkeypatch):
    """None means "decided at start-up": the text that says so names what the engine then picks."""
    entries = help_entries(build_parser(), monkeypatch)
    scheduler = fake_engine().scheduler
    assert f"(default: {scheduler.long_prefill_tokens} on cpu," in entries["--long-prefill-tokens"]
    assert f"(default: {scheduler.solo_prefill_tokens} on cpu," in entries["--solo-prefill-tokens"]


def test_the_planners_engine_flags_are_the_servers(monkeypatch):
    server = {a.dest: a for a in build_parser()._actions}
    planner = {a.dest: a for a in plan.build_parser()._actions if a.dest in engine_settings()}
    assert list(planner) == list(plan.PLAN_SETTINGS)
    assert planner["model"].default is None and "(default: the bundled default model)" in planner["model"].help
    del planner["model"]  # the server's --model names one or several models
    all_dtypes = planner.pop("kv_cache_dtype")
    assert all_dtypes.choices == [*server["kv_cache_dtype"].choices, "all"]
    for name, action in planner.items():
        theirs = server[name]
        assert (action.option_strings, action.default, action.type, action.choices, action.help) == \
               (theirs.option_strings, theirs.default, theirs.type, theirs.choices, theirs.help), name
    assert "(default: auto)" in help_entries(plan.build_parser(), monkeypatch)["--kv-cache-dtype"]


def test_the_planner_takes_the_weights_mode_as_the_engine_does():
    assert plan.build_parser().parse_args(["--weights", "dequantize"]).weights == "dequantize"


def test_a_setting_outside_its_choices_or_range_is_refused_by_name():
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, fp8 or int8, got 'fp4'"):
        EngineConfig(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1, got 0"):
        EngineConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="tensor_core_prefill needs device='cuda'"):
        EngineConfig(tensor_core_prefill=True)


def test_the_docs_settings_table_is_generated_from_the_dataclass():
    """docs/configuration.md lists every setting as tools/settings_table.py prints it from EngineConfig."""
    spec = importlib.util.spec_from_file_location("settings_table", ROOT / "tools" / "settings_table.py")
    settings_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(settings_table)
    page = settings_table.PAGE.read_text()
    assert settings_table.page_with_table(page) == page, "run: python tools/settings_table.py --write"
