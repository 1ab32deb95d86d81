"""Profiles and their schema, in-process (no torch, no subprocess)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from conftest import write_profile

from gpu_console import schema
from gpu_console.profile import (
    BUILTIN_DIR,
    SECTIONS,
    CheckpointConfig,
    DataConfig,
    DistributedConfig,
    HardwareConfig,
    Profile,
    ProfileError,
    TrainConfig,
    find_profile,
    list_profiles,
    load_profile,
    parse_override,
    resolve,
)
from gpu_console.tasks import BUILTIN
from gpu_console.tasks.configs import MLPConfig, TransformerConfig

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

BUILTIN_NAMES = sorted(p.stem for p in BUILTIN_DIR.glob("*.toml"))


def test_the_package_ships_quickstart_and_transformer():
    assert {"quickstart", "transformer"} <= set(BUILTIN_NAMES)


@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_every_builtin_profile_loads(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./profiles here: the built-in is used
    path = BUILTIN_DIR / f"{name}.toml"
    prof = load_profile(name)
    assert prof.profile.name == name
    assert prof.profile.description, "a built-in profile needs a description"
    raw = tomllib.loads(path.read_text())
    assert prof.task_kind == raw["task"]["kind"]
    assert isinstance(prof.task, BUILTIN[prof.task_kind][1])
    # What the file says is what was loaded.
    for section, table in raw.items():
        for key, value in table.items():
            if section == "task":
                got = prof.task_kind if key == "kind" else getattr(prof.task, key)
            else:
                got = getattr(getattr(prof, section), key)
            assert got == value, f"{section}.{key}"


def test_defaults_are_filled(tmp_path):
    path = write_profile(tmp_path / "tiny.toml", "[train]\nmax_steps = 7\n")
    prof = load_profile(str(path))
    assert prof.train.max_steps == 7
    assert prof.profile.name == "tiny", "the name defaults to the file name"
    assert prof.task_kind == "mlp" and prof.task == MLPConfig()
    assert prof.data == DataConfig()
    assert prof.distributed == DistributedConfig()
    assert prof.checkpoint == CheckpointConfig()
    assert prof.hardware == HardwareConfig()
    assert dataclasses.replace(prof.train, max_steps=300) == TrainConfig()
    # Every key of every section is written out, defaults included.
    written = tomllib.loads(prof.to_toml())
    for section, cls in SECTIONS.items():
        assert set(written[section]) == {f.name for f in dataclasses.fields(cls)}, section
    assert set(written["task"]) == {"kind"} | {f.name for f in dataclasses.fields(MLPConfig)}


def test_a_float_written_as_integer_is_a_float_and_vice_versa(tmp_path):
    path = write_profile(tmp_path / "p.toml", "[train]\nlr = 1\nmax_steps = 20.0\n")
    prof = load_profile(str(path))
    assert prof.train.lr == 1.0 and isinstance(prof.train.lr, float)
    assert prof.train.max_steps == 20 and isinstance(prof.train.max_steps, int)


def _round_trip(prof: Profile, tmp_path: Path) -> Profile:
    out = tmp_path / "run.toml"
    out.write_text(prof.to_toml())
    return load_profile(str(out))


@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_to_toml_round_trips_builtins(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    prof = load_profile(name)
    again = _round_trip(prof, tmp_path)
    assert again == prof
    assert again.to_toml() == prof.to_toml()


@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_to_toml_round_trips_with_overrides(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sets = [
        "train.lr=3e-4",
        "train.schedule=linear",
        "data.pin_memory=false",
        "hardware.devices=cpu:2",
        "distributed.bucket_cap_mb=1",
        "profile.description=with overrides",
    ]
    # A task key of each built-in (lm, hf and moe read a text and cvrp makes instances as it
    # goes: none of them has train_samples).
    own = {"lm": ("seq_len", 32), "cvrp20": ("epoch_instances", 512),
           "cvrp50": ("epoch_instances", 512), "hf": ("seq_len", 32),
           "moe": ("seq_len", 32), "moe_mnist": ("d_model", 32)}  # fmt: skip
    task_key, value = own.get(name, ("train_samples", 512))
    prof = load_profile(name, [*sets, f"task.{task_key}={value}"])
    assert prof.train.lr == 3e-4
    assert prof.train.schedule == "linear"
    assert prof.data.pin_memory is False
    assert prof.hardware.devices == "cpu:2"
    assert prof.distributed.bucket_cap_mb == 1.0
    assert getattr(prof.task, task_key) == value
    assert prof.profile.description == "with overrides"
    assert prof != load_profile(name)
    assert _round_trip(prof, tmp_path) == prof


def test_overrides_do_not_change_the_parsed_file(tmp_path):
    path = write_profile(tmp_path / "p.toml", "[train]\nlr = 0.5\n")
    assert load_profile(str(path), ["train.lr=0.25"]).train.lr == 0.25
    assert load_profile(str(path)).train.lr == 0.5


@pytest.mark.parametrize(
    "text, expected",
    [
        ("train.lr=3e-4", ("train", "lr", 3e-4)),
        ("train.max_steps=100", ("train", "max_steps", 100)),
        ("data.pin_memory=true", ("data", "pin_memory", True)),
        ("data.pin_memory=false", ("data", "pin_memory", False)),
        ("hardware.devices=cpu:2", ("hardware", "devices", "cpu:2")),
        ('hardware.devices="0,1"', ("hardware", "devices", "0,1")),
        ("hardware.devices=0,1", ("hardware", "devices", "0,1")),
        (" train.lr = 0.5 ", ("train", "lr", 0.5)),
        ('profile.description="a=b"', ("profile", "description", "a=b")),
        # A plain-string key keeps the text as typed, as --devices 0 does.
        ("hardware.devices=0", ("hardware", "devices", "0")),
        ("profile.description=true", ("profile", "description", "true")),
        ("profile.name=2024", ("profile", "name", "2024")),
    ],
)
def test_set_values_parse_as_toml(text, expected):
    got = parse_override(text)
    assert got == expected
    assert type(got[2]) is type(expected[2])


@pytest.mark.parametrize("text", ["train.lr", "lr=3", "=3", ".lr=3", "train.=3"])
def test_set_syntax_errors(text):
    with pytest.raises(ProfileError) as info:
        parse_override(text)
    (problem,) = info.value.problems
    assert problem.startswith("--set: ") and "SECTION.KEY=VALUE" in problem


def test_set_problems_are_blamed_on_set_and_file_problems_on_the_file(tmp_path):
    path = write_profile(tmp_path / "p.toml", "[data]\nbatch_size = 0\n")
    with pytest.raises(ProfileError) as info:
        load_profile(str(path), ["train.lr=-1", "trian.lr=1"])
    assert sorted(info.value.problems) == sorted(
        [
            f"{path}: data.batch_size: must be at least 1 (got 0)",
            "--set: train.lr: must be greater than 0.0 (got -1)",
            "--set: trian: unknown section; did you mean [train]?",
        ]
    )


def test_every_problem_is_reported_at_once():
    data = {
        "train": {"lr": "x", "lrr": 1, "schedule": "exp"},
        "data": {"batch_size": 0},
        "hardware": {"memory_fraction": 2.0, "devices": "gpu0"},
        "task": {"kind": "mlp", "hidden": 3},
        "extra": {},
    }
    with pytest.raises(ProfileError) as info:
        resolve(data, "f.toml")
    keys = {p.split(": ")[1] for p in info.value.problems}
    assert keys == {
        "train.lr",
        "train.lrr",
        "train.schedule",
        "data.batch_size",
        "hardware.memory_fraction",
        "hardware.devices",
        "task.hidden",
        "extra",
    }
    assert all(p.startswith("f.toml: ") and "\n" not in p for p in info.value.problems)


def test_unknown_task_kind_and_import_path():
    with pytest.raises(ProfileError) as info:
        resolve({"task": {"kind": "cnn"}}, "f.toml")
    assert info.value.problems[0].startswith("f.toml: task.kind: unknown task")
    # An import path is accepted here; its keys are checked once its class is known.
    prof = resolve({"task": {"kind": "pkg.mod:MyTask", "width": 3}}, "f.toml")
    assert prof.task_kind == "pkg.mod:MyTask" and prof.task == {"width": 3}


# -- finding and listing profiles -------------------------------------------------------------


def test_find_profile_prefers_local_over_builtin(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert find_profile("quickstart") == BUILTIN_DIR / "quickstart.toml"
    local = write_profile(tmp_path / "profiles" / "quickstart.toml", "[train]\nmax_steps = 5\n")
    assert find_profile("quickstart").resolve() == local.resolve()
    assert load_profile("quickstart").train.max_steps == 5


def test_find_profile_by_path_and_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_profile(tmp_path / "elsewhere" / "mine.toml", "")
    assert find_profile(str(path)) == path
    assert find_profile("elsewhere/mine.toml") == Path("elsewhere/mine.toml")
    with pytest.raises(ProfileError, match="no such profile file"):
        find_profile(str(tmp_path / "missing.toml"))
    with pytest.raises(ProfileError) as info:
        find_profile("nosuch")
    (problem,) = info.value.problems
    assert problem.startswith("nosuch: no such profile") and "quickstart" in problem


def test_list_profiles_builtins_quickstart_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    listed = list_profiles()
    assert listed[0] == (BUILTIN_DIR / "quickstart.toml", "built-in")
    assert {p.stem for p, _ in listed} == set(BUILTIN_NAMES)
    assert {origin for _, origin in listed} == {"built-in"}


def test_list_profiles_local_before_builtin_and_shadowing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for stem in ("alpha", "quickstart", "zeta"):
        write_profile(tmp_path / "profiles" / f"{stem}.toml", "")
    listed = [(p.stem, origin) for p, origin in list_profiles()]
    assert listed[:3] == [("quickstart", "local"), ("alpha", "local"), ("zeta", "local")]
    assert ("quickstart", "built-in") not in listed, "a local profile shadows the built-in"
    rest = listed[3:]
    assert rest and all(origin == "built-in" for _, origin in rest)
    assert [stem for stem, _ in rest] == sorted(stem for stem, _ in rest)


def test_list_profiles_local_without_quickstart(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_profile(tmp_path / "profiles" / "mine.toml", "")
    listed = [(p.stem, origin) for p, origin in list_profiles()]
    assert listed[0] == ("mine", "local")
    assert listed[1] == ("quickstart", "built-in")


# -- the schema -------------------------------------------------------------------------------

ALL_SECTIONS = {**SECTIONS, "task(mlp)": MLPConfig, "task(transformer)": TransformerConfig}


@pytest.mark.parametrize("cls", list(ALL_SECTIONS.values()), ids=list(ALL_SECTIONS))
def test_every_key_has_a_documented_meaning(cls):
    rows = schema.describe(cls)
    assert [r[0] for r in rows] == [f.name for f in dataclasses.fields(cls)]
    instance = cls()
    for key, type_name, default, meaning in rows:
        assert isinstance(meaning, str) and len(meaning.strip()) >= 8, key
        assert "\n" not in meaning, f"{key}: the meaning is one line"
        assert type_name and not type_name.startswith("<"), key
        assert default == getattr(instance, key), key


@pytest.mark.parametrize(
    "tp, value, ok",
    [
        (int, 3, 3),
        (int, 3.0, 3),
        (int, 3.5, None),
        (int, True, None),
        (int, "3", None),
        (float, 2, 2.0),
        (float, False, None),
        (bool, True, True),
        (bool, 1, None),
        (str, "x", "x"),
        (str, ["x"], None),
        (list[int], [1, 2], [1, 2]),
        (list[int], [1, "2"], None),
    ],
)
def test_coerce(tp, value, ok):
    got, problem = schema.coerce(tp, value)
    if ok is None:
        assert got is None and problem and problem.startswith("expected ")
    else:
        assert problem is None and got == ok and type(got) is type(ok)


def test_near_miss_hint_only_for_close_names():
    errors: list[str] = []
    schema.build(TrainConfig, {"lrr": 1, "zzzzzz": 2}, "train", errors)
    assert errors == [
        "train.lrr: unknown key; did you mean 'lr'? (got 1)",
        "train.zzzzzz: unknown key (got 2)",
    ]


def test_show_renders_values_as_typed():
    assert schema.show(True) == "true"
    assert schema.show("a") == "'a'"
    assert schema.show(1.5) == "1.5"
    assert schema.show([1, "a"]) == "[1, 'a']"


def test_a_shorter_run_clamps_the_profiles_warmup_and_says_so(tmp_path):
    # docs/commands.md shortens a run with --set train.max_steps: the profile's warmup gives
    # way, and run.toml holds what the schedule uses.
    path = write_profile(tmp_path / "p.toml", "[train]\nmax_steps = 300\nwarmup_steps = 20\n")
    prof = load_profile(str(path), ["train.max_steps=10"])
    assert prof.train.warmup_steps == 10 and prof.train.max_steps == 10
    assert prof.notes == [
        "--set train.max_steps=10: train.warmup_steps 20 → 10 (the profile's warmup is longer "
        "than this run; the lr rises to its peak over the whole run)"
    ]
    assert tomllib.loads(prof.to_toml())["train"]["warmup_steps"] == 10
    # A warmup that fits is left as it is, without a note.
    fits = load_profile(str(path), ["train.max_steps=20"])
    assert fits.train.warmup_steps == 20 and fits.notes == []


@pytest.mark.parametrize(
    "text, sets, blamed",
    [
        # Both asked for on the command line: a contradiction the user just typed.
        ("[train]\nwarmup_steps = 20\n", ["train.max_steps=10", "train.warmup_steps=50"], "--set"),
        # A warmup typed on the command line that the profile's run cannot hold.
        ("[train]\nmax_steps = 10\n", ["train.warmup_steps=50"], "--set"),
        # Both in the file: its author's contradiction.
        ("[train]\nmax_steps = 10\nwarmup_steps = 50\n", [], "FILE"),
    ],
)
def test_a_warmup_asked_for_beyond_the_run_is_refused(tmp_path, text, sets, blamed):
    path = write_profile(tmp_path / "p.toml", text)
    with pytest.raises(ProfileError) as err:
        load_profile(str(path), sets)
    origin = str(path) if blamed == "FILE" else blamed
    assert err.value.problems == [
        f"{origin}: train.warmup_steps: must not exceed train.max_steps=10 (got 50)"
    ]
