"""The job config: defaults, one-line errors naming the key path and the fix, path resolution, output."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from ftsup.supervisor.config.job import (
    CheckpointConfig,
    JobConfig,
    JobSection,
    LaunchConfig,
    MetricsConfig,
    load_config,
    parse_config,
    split_host_port,
)
from ftsup.supervisor.errors import ConfigError, SupervisorError

REPO = Path(__file__).resolve().parents[2]
HOST = "node-a"


@pytest.fixture(autouse=True)
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run each test in its own directory, so that `job.yaml` is the source named in messages."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def minimal(**sections: dict[str, Any]) -> dict[str, Any]:
    """The smallest valid config, with `sections`' keys added to (or replacing) its own."""
    raw: dict[str, Any] = {"job": {"command": ["python", "train.py"]}, "checkpoint": {"dir": "ckpts"}}
    for name, keys in sections.items():
        raw.setdefault(name, {}).update(keys)
    return raw


def write(content: dict[str, Any] | str, name: str = "job.yaml") -> Path:
    path = Path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    return path


def load(content: dict[str, Any] | str) -> JobConfig:
    return load_config(write(content), hostname=HOST)


def error_of(content: dict[str, Any] | str) -> str:
    with pytest.raises(ConfigError) as info:
        load(content)
    return str(info.value)


def default_run_id(config_file: Path) -> str:
    return "ftsup-" + hashlib.sha256(str(config_file).encode()).hexdigest()[:8]


# --------------------------------------------------------------------------- defaults


def test_a_minimal_config_gets_every_documented_default(in_tmp: Path) -> None:
    run_id = default_run_id(in_tmp / "job.yaml")
    expected = JobConfig(
        job=JobSection(
            command=("python", "train.py"),
            workdir=in_tmp,
            run_id=run_id,
            state_dir=in_tmp / ".ftsup" / HOST,
            env={},
        ),
        launch=LaunchConfig(node_id=HOST, rdzv_id=run_id),
        checkpoint=CheckpointConfig(dir=in_tmp / "ckpts"),
        source="job.yaml",
    )
    assert load(minimal()) == expected


def test_the_default_run_id_is_stable_for_one_file_and_differs_for_another() -> None:
    ids = [load_config(write(minimal(), name), hostname=HOST).job.run_id for name in ("a.yaml", "a.yaml", "b.yaml")]
    assert (ids[0] == ids[1], ids[0] == ids[2]) == (True, False)


def test_rdzv_id_and_state_dir_follow_an_explicit_run_id_and_node_id(in_tmp: Path) -> None:
    config = load(minimal(job={"run_id": "gpt-1"}, launch={"node_id": "n7"}))
    assert (config.launch.rdzv_id, config.job.state_dir) == ("gpt-1", in_tmp / ".ftsup" / "n7")


def test_the_node_id_defaults_to_the_hostname_given() -> None:
    assert load_config(write(minimal()), hostname="gpu-17.cluster").launch.node_id == "gpu-17.cluster"


def test_durations_given_as_integers_are_stored_as_floats() -> None:
    window = load(minimal(restart={"window_s": 120})).restart.window_s
    assert (window, type(window)) == (120.0, float)


def test_a_section_left_empty_takes_its_defaults() -> None:
    assert load(minimal() | {"metrics": None}).metrics == MetricsConfig()


# --------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize(
    ("section", "typo", "meant"),
    [
        ("job", "comand", "command"),
        ("launch", "nproc_per_nod", "nproc_per_node"),
        ("checkpoint", "verify-deep", "verify_deep"),
        ("heartbeat", "timeout", "timeout_s"),
        ("restart", "backof_initial_s", "backoff_initial_s"),
        ("eviction", "signal", "signals"),
        ("metrics", "listn", "listen"),
        ("logging", "levle", "level"),
    ],
)
def test_an_unknown_key_in_any_section_names_its_path_and_the_likely_key(section: str, typo: str, meant: str) -> None:
    assert error_of(minimal(**{section: {typo: 1}})) == (
        f"job.yaml: {section}.{typo}: unknown key (did you mean '{meant}'?)"
    )


def test_an_unknown_section_names_the_likely_section() -> None:
    assert error_of(minimal() | {"heartbeats": {}}) == (
        "job.yaml: heartbeats: unknown section (did you mean 'heartbeat'?)"
    )


def test_an_unknown_key_with_no_close_match_lists_the_valid_keys() -> None:
    assert error_of(minimal(metrics={"zzz": 1})) == "job.yaml: metrics.zzz: unknown key (expected one of listen)"


def test_a_key_given_twice_is_refused_with_its_line() -> None:
    text = "job:\n  command: [python]\ncheckpoint:\n  dir: a\n  dir: b\n"
    assert error_of(text) == "job.yaml: line 5, column 3: invalid YAML: the key 'dir' is given twice; keep one"


# --------------------------------------------------------------------------- wrong types


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        (
            {"restart": {"max_restarts": "10"}},
            "restart.max_restarts: expected a whole number >= 0, got the string '10'; write it without quotes",
        ),
        (
            {"launch": {"min_world_size": True}},
            "launch.min_world_size: expected a whole number >= 1, got true (a boolean)",
        ),
        (
            {"launch": {"nproc_per_node": 2.5}},
            "launch.nproc_per_node: expected a whole number >= 1, got the number 2.5",
        ),
        (
            {"checkpoint": {"verify_deep": "yes"}},
            "checkpoint.verify_deep: expected true or false, got the string 'yes'",
        ),
        (
            {"heartbeat": {"interval_s": "1s"}},
            "heartbeat.interval_s: expected a number of seconds, got the string '1s'; "
            "write a plain number (every *_s key is in seconds)",
        ),
        ({"job": {"env": {"SEED": 1}}}, "job.env.SEED: expected a string, got the number 1; quote it"),
        (
            {"job": {"command": "python train.py"}},
            "job.command: expected a list of strings such as [python, train.py], got the string 'python train.py'; "
            "split it into a list (no shell runs it)",
        ),
        (
            {"eviction": {"signals": "SIGTERM"}},
            "eviction.signals: expected a list of signal names such as [SIGTERM, SIGUSR1], got the string 'SIGTERM'",
        ),
        (
            {"metrics": {"listen": 9400}},
            "metrics.listen: expected a quoted host:port such as 0.0.0.0:9400, got the number 9400",
        ),
        (
            {"logging": {"level": "warn"}},
            "logging.level: 'warn' is not one of debug, info, warning, error (did you mean 'warning'?)",
        ),
    ],
)
def test_a_wrong_type_names_the_key_and_what_it_expects(sections: dict[str, Any], expected: str) -> None:
    assert error_of(minimal(**sections)) == f"job.yaml: {expected}"


def test_a_number_in_job_command_must_be_quoted() -> None:
    text = "job:\n  command: [python, train.py, --steps, 200]\ncheckpoint:\n  dir: ckpts\n"
    assert error_of(text) == (
        'job.yaml: job.command[3]: the number 200 is not a string; quote it ("200") so the argument is passed '
        "exactly as written"
    )


def test_null_for_a_key_with_a_default_is_refused_naming_the_default() -> None:
    assert error_of("job: {command: [python]}\ncheckpoint: {dir: c}\nrestart:\n  window_s:\n") == (
        "job.yaml: restart.window_s: null is not allowed here; remove the key to use the default (3600.0)"
    )


def test_a_missing_required_key_says_what_to_set() -> None:
    assert error_of({"checkpoint": {"dir": "c"}}) == (
        "job.yaml: job.command: required; give the training command as a list, e.g. [python, train.py]"
    )


def test_on_one_node_the_checkpoint_store_defaults_to_ftsup_checkpoints_in_the_workdir(in_tmp: Path) -> None:
    (in_tmp / "w").mkdir()
    config = load({"job": {"command": ["python"], "workdir": "w"}})
    assert config.checkpoint.dir == in_tmp / "w" / ".ftsup" / "checkpoints"


def test_a_job_that_may_span_nodes_must_name_its_checkpoint_store() -> None:
    assert error_of({"job": {"command": ["python"]}, "launch": {"nnodes": "1:2", "rdzv_endpoint": "n0:29400"}}) == (
        "job.yaml: checkpoint.dir: required; nnodes (1:2) allows more than one node, so set it to a directory every "
        "node shares"
    )


def test_config_error_is_a_supervisor_error() -> None:
    assert issubclass(ConfigError, SupervisorError)


# --------------------------------------------------------------------------- launch


def test_unquoted_min_max_nnodes_is_a_range_not_a_base_60_number() -> None:
    text = "job: {command: [python]}\ncheckpoint: {dir: c}\nlaunch:\n  nnodes: 1:2\n  rdzv_endpoint: node0:29400\n"
    launch = load(text).launch
    assert (launch.nnodes, launch.min_nodes, launch.max_nodes) == ("1:2", 1, 2)


def test_an_integer_nnodes_is_stored_in_torchrun_form() -> None:
    launch = load(minimal(launch={"nnodes": 2, "rdzv_endpoint": "node0:29400"})).launch
    assert (launch.nnodes, launch.min_nodes, launch.max_nodes) == ("2", 2, 2)


def test_nnodes_with_min_above_max_is_refused() -> None:
    assert (
        error_of(minimal(launch={"nnodes": "2:1"})) == "job.yaml: launch.nnodes: '2:1': MIN 2 is above MAX 1; write 1:2"
    )


def test_min_world_size_above_the_maximum_world_size_names_both_numbers() -> None:
    launch = {"nnodes": "1:2", "nproc_per_node": 2, "min_world_size": 5, "rdzv_endpoint": "node0:29400"}
    assert error_of(minimal(launch=launch)) == (
        "job.yaml: launch.min_world_size: 5 is above the maximum world size 4 (nnodes max 2 x nproc_per_node 2); "
        "lower min_world_size"
    )


def test_min_world_size_above_an_explicit_max_world_size_names_both_numbers() -> None:
    assert error_of(minimal(launch={"min_world_size": 3, "max_world_size": 2})) == (
        "job.yaml: launch.min_world_size: 3 is above launch.max_world_size 2; lower min_world_size"
    )


def test_rdzv_endpoint_is_required_when_more_than_one_node_is_allowed() -> None:
    assert error_of(minimal(launch={"nnodes": "1:2"})) == (
        "job.yaml: launch.rdzv_endpoint: required when nnodes (1:2) allows more than one node; "
        "set it to the rendezvous host:port, e.g. node0:29400"
    )


def test_an_rdzv_endpoint_without_a_port_is_refused() -> None:
    assert error_of(minimal(launch={"nnodes": 2, "rdzv_endpoint": "node0"})) == (
        "job.yaml: launch.rdzv_endpoint: 'node0' is not host:port, e.g. node0:29400"
    )


def test_a_global_batch_no_allowed_world_size_divides_is_refused() -> None:
    assert error_of(minimal(launch={"nproc_per_node": 4, "min_world_size": 2, "global_batch": 7})) == (
        "job.yaml: launch.global_batch: 7 cannot be split evenly at any world size from 2 to 4 "
        "(world_size must divide it); choose a global_batch with such a divisor or widen the world size range"
    )


def test_a_global_batch_that_is_not_a_multiple_of_micro_batch_is_refused() -> None:
    assert error_of(minimal(launch={"global_batch": 12, "micro_batch": 5})) == (
        "job.yaml: launch.global_batch: 12 is not a multiple of launch.micro_batch 5; change one of them"
    )


def test_torchrun_flags_that_ftsup_sets_are_refused_in_torchrun_args() -> None:
    assert error_of(minimal(launch={"torchrun_args": ["--local-addr=10.0.0.1", "--max_restarts=3"]})) == (
        "job.yaml: launch.torchrun_args[1]: '--max_restarts=3' is set by ftsup; remove it and use "
        "restart.max_restarts (restarts are ftsup's decision; torchrun always gets 0)"
    )


def test_max_world_size_for_caps_an_explicit_maximum_by_the_slots() -> None:
    launch = LaunchConfig(node_id=HOST, rdzv_id="r", nnodes="1:2", max_world_size=6)
    assert (launch.max_world_size_for(2), launch.max_world_size_for(4)) == (4, 6)


def test_split_host_port_strips_ipv6_brackets() -> None:
    assert split_host_port("[::1]:9400") == ("::1", 9400)


# --------------------------------------------------------------------------- durations and bounds


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"heartbeat": {"startup_timeout_s": 0}}, "heartbeat.startup_timeout_s: must be above 0 seconds, got 0"),
        ({"restart": {"window_s": -5}}, "restart.window_s: must be above 0 seconds, got -5"),
        ({"eviction": {"poll_interval_s": 0.0}}, "eviction.poll_interval_s: must be above 0 seconds, got 0.0"),
        ({"restart": {"backoff_initial_s": -1}}, "restart.backoff_initial_s: must be at least 0 seconds, got -1"),
        (
            {"heartbeat": {"timeout_s": -1}},
            "heartbeat.timeout_s: must be above 0 seconds, got -1; "
            "leave it out (or null) to learn it from observed step times",
        ),
        (
            {"heartbeat": {"save_timeout_s": float("inf")}},
            "heartbeat.save_timeout_s: inf is not a finite number; write a finite value",
        ),
    ],
)
def test_a_zero_negative_or_infinite_duration_is_refused(sections: dict[str, Any], expected: str) -> None:
    assert error_of(minimal(**sections)) == f"job.yaml: {expected}"


def test_a_zero_backoff_is_allowed() -> None:
    assert load(minimal(restart={"backoff_initial_s": 0})).restart.backoff_initial_s == 0.0


def test_a_number_in_e_notation_is_a_number() -> None:
    assert load("job: {command: [python]}\ncheckpoint: {dir: c}\nrestart: {window_s: 1e3}\n").restart.window_s == 1000.0


def test_backoff_max_below_backoff_initial_is_refused() -> None:
    assert error_of(minimal(restart={"backoff_initial_s": 30, "backoff_max_s": 10})) == (
        "job.yaml: restart.backoff_max_s: 10 is below restart.backoff_initial_s 30; "
        "raise backoff_max_s or lower backoff_initial_s"
    )


def test_a_heartbeat_timeout_not_above_the_beat_interval_is_refused() -> None:
    assert error_of(minimal(heartbeat={"timeout_s": 0.5})) == (
        "job.yaml: heartbeat.timeout_s: 0.5 is not above heartbeat.interval_s 0.5; ranks beat only every "
        "interval_s, so raise timeout_s or lower interval_s"
    )


def test_a_save_margin_as_long_as_the_default_deadline_is_refused() -> None:
    assert error_of(minimal(eviction={"save_margin_s": 30})) == (
        "job.yaml: eviction.save_margin_s: 30 leaves no time to save within eviction.default_deadline_s 30; "
        "lower save_margin_s or raise default_deadline_s"
    )


# --------------------------------------------------------------------------- eviction


def test_signal_names_are_normalised_and_deduplicated() -> None:
    config = load(minimal(eviction={"signals": ["USR1", "sigterm", "SIGUSR1", "pwr"]}))
    assert config.eviction.signals == ("SIGUSR1", "SIGTERM", "SIGPWR")


def test_an_unknown_signal_is_refused_with_the_likely_name() -> None:
    assert error_of(minimal(eviction={"signals": ["SIGTERM", "SIGUSER1"]})) == (
        "job.yaml: eviction.signals[1]: 'SIGUSER1' is not a signal on this system (did you mean 'SIGUSR1'?)"
    )


def test_sigkill_is_refused_because_it_cannot_be_caught() -> None:
    assert error_of(minimal(eviction={"signals": ["KILL"]})) == (
        "job.yaml: eviction.signals[0]: SIGKILL cannot be caught, so it cannot serve as an eviction notice; use "
        "SIGTERM, SIGUSR1 or SIGUSR2"
    )


def test_providers_auto_may_be_a_plain_string() -> None:
    assert load(minimal(eviction={"providers": "auto"})).eviction.providers == ("auto",)


def test_an_unknown_provider_is_refused_with_the_likely_name() -> None:
    assert error_of(minimal(eviction={"providers": ["aws", "gpc"]})) == (
        "job.yaml: eviction.providers[1]: 'gpc' is not a provider (did you mean 'gcp'?)"
    )


def test_the_endpoint_must_be_an_http_url() -> None:
    assert error_of(minimal(eviction={"endpoint": "127.0.0.1:8080"})) == (
        "job.yaml: eviction.endpoint: '127.0.0.1:8080' is not an http(s) URL such as http://127.0.0.1:8080"
    )


# --------------------------------------------------------------------------- paths


def test_relative_paths_resolve_against_the_config_files_directory(in_tmp: Path) -> None:
    raw = minimal(
        job={"workdir": "run", "state_dir": "state"},
        checkpoint={"dir": "../shared/ckpts"},
        eviction={"file": "evict-notice"},
        logging={"dir": "logs"},
    )
    config = load_config(write(raw, "conf/job.yaml"), hostname=HOST)
    conf = in_tmp / "conf"
    assert (
        config.job.workdir,
        config.job.state_dir,
        config.checkpoint.dir,
        config.eviction.file,
        config.logging.dir,
    ) == (
        conf / "run",
        conf / "state",
        in_tmp / "shared" / "ckpts",
        conf / "evict-notice",
        conf / "logs",
    )


def test_an_absolute_path_is_kept(in_tmp: Path) -> None:
    assert load(minimal(checkpoint={"dir": "/data/ckpts"})).checkpoint.dir == Path("/data/ckpts")


def test_a_home_relative_path_is_refused_because_nothing_is_expanded() -> None:
    assert error_of(minimal(checkpoint={"dir": "~/ckpts"})) == (
        "job.yaml: checkpoint.dir: '~/ckpts': '~' is not expanded here; write the full path"
    )


def test_an_environment_variable_in_a_path_is_refused_because_nothing_is_expanded() -> None:
    assert error_of(minimal(checkpoint={"dir": "${SCRATCH}/ckpts"})) == (
        "job.yaml: checkpoint.dir: '${SCRATCH}/ckpts': environment variables are not expanded in the config; "
        "write the value itself"
    )


def test_parse_config_resolves_relative_paths_against_base_dir(in_tmp: Path) -> None:
    config = parse_config(minimal(), base_dir=in_tmp / "elsewhere", hostname=HOST)
    assert config.checkpoint.dir == in_tmp / "elsewhere" / "ckpts"


# --------------------------------------------------------------------------- bad files


def test_a_yaml_syntax_error_is_one_line_with_the_line_number() -> None:
    text = "job:\n  command: [python, train.py\ncheckpoint:\n  dir: ckpts\n"
    assert error_of(text) == (
        "job.yaml: line 3, column 11: invalid YAML: expected ',' or ']', but got ':' "
        "(while parsing a flow sequence at line 2)"
    )


def test_an_empty_file_is_refused() -> None:
    assert error_of("# only a comment\n") == (
        "job.yaml: the file is empty (or only comments); a job config needs at least job.command "
        "(example: deploy/examples/job.yaml)"
    )


def test_a_top_level_list_is_refused() -> None:
    assert error_of("- job\n") == (
        "job.yaml: expected a mapping of sections (job, launch, checkpoint, heartbeat, restart, eviction, metrics, "
        "logging, anomaly, forensics) at the top level, got a list"
    )


def test_a_missing_file_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        load_config("nowhere.yaml")
    assert (
        str(info.value)
        == "nowhere.yaml: no such file; pass the path of a job config (example: deploy/examples/job.yaml)"
    )


# --------------------------------------------------------------------------- output


def test_to_dict_survives_a_json_round_trip() -> None:
    as_dict = load(minimal(job={"env": {"A": "1"}}, launch={"health_command": ["probe"]})).to_dict()
    assert json.loads(json.dumps(as_dict)) == as_dict
