"""The YAML config loader: a typo in a site config must stop the site at once with file:line and field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from greenswarm.configuration import dump_yaml, load_config
from greenswarm.errors import ConfigError
from greenswarm.node.config import SiteConfig, load_site_config

REPO = Path(__file__).resolve().parents[1]

GOOD = """\
name: site-a
region: CAISO_NORTH
swarm:
  host_maddrs: [/ip4/127.0.0.1/tcp/0]
model:
  preset: tiny
train:
  lr: 3e-4
  batch_size: 16
  micro_batch_size: 8
scheduler:
  threshold: 120
  clock:
    kind: replay
    speedup: 360
averaging:
  sync_interval_s: 600
  outer: fedavg
"""


def write(tmp_path: Path, text: str, name: str = "site.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(path: Path | None, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_site_config(path, overrides)
    return str(info.value)


def test_good_config_loads(tmp_path: Path) -> None:
    """Every section reaches its dataclass with the right types (YAML's "3e-4" string becomes a float)."""
    cfg = load_site_config(write(tmp_path, GOOD))
    assert isinstance(cfg, SiteConfig)
    assert (cfg.name, cfg.region) == ("site-a", "CAISO_NORTH")
    assert cfg.swarm.host_maddrs == ["/ip4/127.0.0.1/tcp/0"]
    assert cfg.train.lr == pytest.approx(3e-4) and isinstance(cfg.train.lr, float)
    assert (cfg.train.batch_size, cfg.train.micro_batch_size) == (16, 8)
    assert cfg.scheduler.threshold == 120.0 and isinstance(cfg.scheduler.threshold, float)
    assert (cfg.scheduler.clock.kind, cfg.scheduler.clock.speedup) == ("replay", 360.0)
    assert cfg.averaging.outer == "fedavg"
    assert cfg.data.source == "stdlib"  # untouched sections keep their defaults


def test_minimal_config_is_name_and_region(tmp_path: Path) -> None:
    """The docs promise a three-line config: everything but name and region has a default."""
    cfg = load_site_config(write(tmp_path, "name: s\nregion: DE\n"))
    assert cfg.node.run_dir == "runs/site"


def test_unknown_field_names_file_line_and_suggests(tmp_path: Path) -> None:
    """A typo nested two levels deep points at its own line and offers the field the user meant."""
    path = write(tmp_path, GOOD.replace("    speedup: 360", "    speedupp: 360"))
    line = GOOD.splitlines().index("    speedup: 360") + 1
    message = error_of(path)
    assert f"{path}:{line}" in message
    assert "scheduler.clock.speedupp" in message
    assert "unknown field" in message and "did you mean 'speedup'" in message


def test_unknown_field_without_close_match_lists_known_fields(tmp_path: Path) -> None:
    """With nothing close to suggest, the message lists what the section accepts."""
    message = error_of(write(tmp_path, "name: s\nregion: DE\ntrain:\n  zzzzzz: 1\n"))
    assert ":4: train.zzzzzz: unknown field" in message
    assert "known fields:" in message and "micro_batch_size" in message


@pytest.mark.parametrize("missing", ["name", "region"])
def test_missing_required_field(tmp_path: Path, missing: str) -> None:
    """``name`` and ``region`` have no defaults; leaving one out names it and the file."""
    text = "".join(line + "\n" for line in GOOD.splitlines() if not line.startswith(f"{missing}:"))
    path = write(tmp_path, text)
    message = error_of(path)
    assert str(path) in message
    assert f"{missing}: missing required field" in message


@pytest.mark.parametrize(
    ("snippet", "field", "expected"),
    [
        ("train:\n  lr: fast\n", "train.lr", "expected a number, got str 'fast'"),
        ("train:\n  batch_size: 8.5\n", "train.batch_size", "expected an integer"),
        ("train:\n  batch_size: true\n", "train.batch_size", "expected an integer, got bool"),
        ("model:\n  tokenizer: [a, b]\n", "model.tokenizer", "expected a string, got list"),
        ("averaging:\n  nesterov: 'yes'\n", "averaging.nesterov", "expected true or false"),
        ("swarm:\n  host_maddrs: {a: 1}\n", "swarm.host_maddrs", "expected a list"),
        ("scheduler:\n  clock: wall\n", "scheduler.clock", "expected a mapping of fields"),
        ("scheduler:\n  threshold: .nan\n", "scheduler.threshold", "must be a number"),
    ],
)
def test_wrong_types(tmp_path: Path, snippet: str, field: str, expected: str) -> None:
    """Type errors name the dotted field, what was expected and what was found, at the field's line."""
    path = write(tmp_path, "name: s\nregion: DE\n" + snippet)
    message = error_of(path)
    assert f"{path}:" in message
    assert f"{field}: " in message
    assert expected in message


def test_value_check_of_nested_section_is_located(tmp_path: Path) -> None:
    """A dataclass's own validate() error still gets the full dotted path and the line of the field."""
    path = write(tmp_path, "name: s\nregion: DE\nscheduler:\n  clock:\n    speedup: -2\n")
    message = error_of(path)
    assert f"{path}:5: scheduler.clock.speedup: must be > 0" in message


def test_overrides_numbers_lists_and_nested(tmp_path: Path) -> None:
    """``--set`` values are read as YAML: numbers, lists, and sections created on the way."""
    cfg = load_site_config(
        write(tmp_path, GOOD),
        [
            "train.lr=1e-2",
            "train.warmup_steps=7",
            "scheduler.clock.speedup=1440",
            "swarm.host_maddrs=[/ip4/127.0.0.1/tcp/0, /ip4/127.0.0.1/tcp/5]",
            "energy.train_kw=0.5",  # a section the file does not have
            "region=NEM_SA",
        ],
    )
    assert cfg.train.lr == pytest.approx(1e-2)
    assert cfg.train.warmup_steps == 7
    assert cfg.scheduler.clock.speedup == 1440.0
    assert cfg.scheduler.clock.kind == "replay"  # siblings of an overridden field survive
    assert cfg.swarm.host_maddrs == ["/ip4/127.0.0.1/tcp/0", "/ip4/127.0.0.1/tcp/5"]
    assert cfg.energy.train_kw == 0.5
    assert cfg.region == "NEM_SA"


def test_overrides_alone_make_a_config() -> None:
    """No file at all: overrides can supply everything (what the demo and scripts do)."""
    cfg = load_site_config(None, ["name=x", "region=R", "train.device=cpu"])
    assert (cfg.name, cfg.region, cfg.train.device) == ("x", "R", "cpu")


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("scheduler.clock.speedup=-1", "must be > 0"),
        ("train.lr=fast", "expected a number"),
        ("train.lrr=1", "did you mean 'lr'"),
        ("data.num_shards=abc", "expected an integer"),
        ("swarm.initial_peers=[/ip4/1.2.3.4/tcp/1]", "no /p2p/PEER_ID part"),
    ],
)
def test_invalid_override_names_the_override(tmp_path: Path, override: str, expected: str) -> None:
    """An error caused by ``--set`` blames the override, not the (correct) file."""
    message = error_of(write(tmp_path, GOOD), [override])
    assert f"--set {override}" in message
    assert expected in message


@pytest.mark.parametrize("override", ["novalue", "=3"])
def test_malformed_override(override: str) -> None:
    """An override without ``key=`` is refused before anything is built."""
    message = error_of(None, ["name=x", "region=R", override])
    assert "--set" in message and "key=value" in message


def test_override_into_a_scalar_is_refused(tmp_path: Path) -> None:
    """``--set name.x=1`` cannot make a section out of a string field."""
    message = error_of(write(tmp_path, GOOD), ["name.x=1"])
    assert "--set" in message and "'name' is not a section" in message


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    """A broken YAML file fails with the parser's line, not a yaml traceback."""
    path = write(tmp_path, "name: s\nregion: DE\ntrain:\n  lr: [1, 2\nnode:\n  run_dir: x\n")
    message = error_of(path)
    assert message.startswith(f"{path}:")
    assert "invalid YAML" in message
    line = int(message.split(":")[1])
    assert 4 <= line <= 6


def test_bad_indentation_is_a_syntax_error(tmp_path: Path) -> None:
    """Tab/indent mistakes are the most common YAML slip; they must also name file and line."""
    message = error_of(write(tmp_path, "name: s\n region: DE\n  bad: : :\n"))
    assert "invalid YAML" in message and "site.yaml:" in message


def test_missing_file_and_non_mapping(tmp_path: Path) -> None:
    """A missing file or a file that is a list instead of a mapping is named, not a traceback."""
    assert "config file not found" in error_of(tmp_path / "nope.yaml")
    message = error_of(write(tmp_path, "- a\n- b\n"))
    assert "top level must be a mapping" in message


def test_empty_file_reports_the_missing_fields(tmp_path: Path) -> None:
    """An empty file is an empty mapping: the first missing required field is reported."""
    message = error_of(write(tmp_path, ""))
    assert "missing required field" in message


def test_dump_yaml_round_trip(tmp_path: Path) -> None:
    """``dump_yaml`` output loads back to an equal config (the demo writes configs this way)."""
    cfg = load_site_config(write(tmp_path, GOOD), ["scheduler.clock.start='2026-01-11T17:00:00Z'"])
    assert cfg.scheduler.clock.start == "2026-01-11T17:00:00Z"
    again = load_site_config(write(tmp_path, dump_yaml(cfg), "dumped.yaml"))
    assert again == cfg
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)


def test_unquoted_iso_time_is_accepted(tmp_path: Path) -> None:
    """A user naturally writes ``start: 2026-01-11T17:00:00Z`` unquoted; YAML makes it a datetime."""
    path = write(tmp_path, "name: s\nregion: DE\nscheduler:\n  clock:\n    start: 2026-01-11T17:00:00Z\n")
    cfg = load_site_config(path)
    assert cfg.scheduler.clock.start is not None


def test_load_config_with_base_and_generic_dataclass(tmp_path: Path) -> None:
    """``load_config`` works for any dataclass, with ``base`` values under the file's."""

    @dataclasses.dataclass
    class Small:
        a: int
        b: list[str] = dataclasses.field(default_factory=list)
        c: float | None = None

    path = write(tmp_path, "b: one\n", "small.yaml")  # a single item where a list is expected
    obj = load_config(Small, path, ["c=2"], base={"a": 1})
    assert obj == Small(a=1, b=["one"], c=2.0)


def example_configs() -> list[Path]:
    return sorted((REPO / "examples").glob("*.yaml"))


def test_examples_exist() -> None:
    """The repository ships example configs; an empty examples/ would make the next test vacuous."""
    assert example_configs(), f"no examples/*.yaml under {REPO}"


@pytest.mark.parametrize("path", example_configs(), ids=lambda p: p.name)
def test_every_shipped_example_loads(path: Path) -> None:
    """Every example a user may copy must load without error with the current dataclasses."""
    cfg = load_site_config(path)
    assert cfg.name and cfg.region


# --- the scheduler's trace-reading options and the energy source -------------------------------------


def test_scheduler_trace_options_reach_the_reader(tmp_path: Path) -> None:
    """What a site config says about its trace file is what load_trace gets (site.py passes these)."""
    from greenswarm.traces import load_trace

    trace_path = tmp_path / "moer.csv"
    trace_path.write_text("time,R\n0,1000\n300,2000\n")
    path = write(
        tmp_path,
        f"name: s\nregion: R\nscheduler:\n  trace: {trace_path}\n  units: lbs/MWh\n"
        "  start: 2026-01-11T17:00:00Z\n  interpolate: linear\n  grid_s: 150\n  max_gap_s: 600\n",
    )
    cfg = load_site_config(path)
    options = cfg.scheduler.trace_options()
    assert options == {
        "tz": None,
        "units": "lbs/MWh",
        "variant": "direct",
        "start": "2026-01-11T17:00:00Z",
        "max_gap_s": 600.0,
        "interpolate": "linear",
        "grid_s": 150.0,
    }
    trace = load_trace(cfg.scheduler.trace, **options)
    assert trace.start == 1768150800.0  # offsets counted from scheduler.start
    assert trace.series("R").tolist() == pytest.approx([453.592, 680.388, 907.184, 907.184])


def test_scheduler_trace_option_defaults(tmp_path: Path) -> None:
    scheduler = load_site_config(write(tmp_path, "name: s\nregion: DE\n")).scheduler
    assert (scheduler.units, scheduler.variant, scheduler.start) == ("g/kWh", "direct", None)
    assert (scheduler.interpolate, scheduler.grid_s, scheduler.max_gap_s) == ("hold", 60.0, None)


@pytest.mark.parametrize(
    ("snippet", "field", "expected"),
    [
        ("units: tons", "scheduler.units", "must be one of g/kWh, kg/kWh, lbs/MWh, got 'tons'"),
        ("variant: scope3", "scheduler.variant", "must be one of direct, lca, got 'scope3'"),
        ("interpolate: cubic", "scheduler.interpolate", "must be one of hold, linear, got 'cubic'"),
        ("grid_s: 0", "scheduler.grid_s", "must be > 0"),
        ("grid_s: .inf", "scheduler.grid_s", "must be a number"),
        ("max_gap_s: -5", "scheduler.max_gap_s", "must be > 0"),
        ("start: soon", "scheduler.start", "cannot parse 'soon' as unix seconds or an ISO 8601 time"),
        ("start: .nan", "scheduler.start", "must be finite seconds or an ISO 8601 instant"),
        (
            "start: '2026-01-11T17:00:00'",
            "scheduler.start",
            "has no UTC offset; add Z or +HH:MM, or set timezone",
        ),
    ],
)
def test_scheduler_trace_option_errors(tmp_path: Path, snippet: str, field: str, expected: str) -> None:
    path = write(tmp_path, f"name: s\nregion: DE\nscheduler:\n  threshold: 90\n  {snippet}\n")
    message = error_of(path)
    assert message.startswith(f"{path}:5: {field}: "), message
    assert expected in message


def test_scheduler_trace_options_accept_their_spellings(tmp_path: Path) -> None:
    """Units and variants match case-insensitively, as the reader does; a naive start is fine with a
    timezone (the reader resolves it there); plain seconds are fine (``start: 0`` is unix time)."""
    text = (
        "name: s\nregion: DE\nscheduler:\n  units: KG/kwh\n  variant: LCA\n  interpolate: Linear\n"
        "  timezone: Europe/Berlin\n  start: '2026-01-11T17:00:00'\n"
    )
    cfg = load_site_config(write(tmp_path, text))
    assert cfg.scheduler.units == "KG/kwh"
    assert load_site_config(None, ["name=s", "region=DE", "scheduler.start=0"]).scheduler.start == "0"


def test_energy_source_and_overhead(tmp_path: Path) -> None:
    cfg = load_site_config(write(tmp_path, "name: s\nregion: DE\n"))
    assert (cfg.energy.source, cfg.energy.nvml_overhead) == ("auto", 1.0)
    cfg = load_site_config(
        write(tmp_path, "name: s\nregion: DE\nenergy:\n  source: nvml\n  nvml_overhead: 1.25\n")
    )
    assert (cfg.energy.source, cfg.energy.nvml_overhead) == ("nvml", 1.25)
    path = write(tmp_path, "name: s\nregion: DE\nenergy:\n  source: gpu\n")
    assert f"{path}:4: energy.source: must be one of auto, config, nvml, got 'gpu'" in error_of(path)
    path = write(tmp_path, "name: s\nregion: DE\nenergy:\n  train_kw: 2\n  nvml_overhead: 0.2\n")
    assert f"{path}:5: energy.nvml_overhead: must be >= 1, got 0.2" in error_of(path)
