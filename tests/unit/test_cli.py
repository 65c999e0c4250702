"""`ftsup` in-process: ckpt list/verify output and exit statuses, bench delegation, commands built when asked."""

from __future__ import annotations

import argparse
import json
import re
import sys
import types
from pathlib import Path

import pytest

from ftsup.store import checksums, layout
from ftsup.store.errors import CheckpointSaveError
from ftsup.supervisor.cli.commands import main
from tests.helpers import default_files, flip_byte, make_fake_checkpoint


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def store(tmp_path: Path) -> Path:
    """Steps 100 (periodic, 2 ranks) and 200 (emergency, 4 ranks), both good."""
    root = tmp_path / "ckpts"
    make_fake_checkpoint(root, 100, default_files(1), created_unix=1000.5)
    make_fake_checkpoint(root, 200, default_files(2), kind="emergency", world_size=4)
    return root


# --------------------------------------------------------------------------- ckpt list


def test_list_json_prints_the_contract_fields_oldest_first(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "ckpt", "list", str(store), "--json")
    contract = ("step", "kind", "world_size", "created_unix", "consistent", "path")
    rows = [{k: c[k] for k in contract} for c in json.loads(out)["checkpoints"]]
    assert (code, rows) == (
        0,
        [
            {
                "step": 100,
                "kind": "periodic",
                "world_size": 2,
                "created_unix": 1000.5,
                "consistent": True,
                "path": str(store / "step-000000100"),
            },
            {
                "step": 200,
                "kind": "emergency",
                "world_size": 4,
                "created_unix": 1_700_000_000.0,
                "consistent": True,
                "path": str(store / "step-000000200"),
            },
        ],
    )


def test_list_json_of_an_empty_directory_is_an_empty_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "ckpt", "list", str(tmp_path), "--json")
    assert (code, json.loads(out)) == (0, {"checkpoints": []})


def test_list_json_leaves_partials_out(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_fake_checkpoint(store, 300, default_files(3), partial=True)
    _, out, _ = run(capsys, "ckpt", "list", str(store), "--json")
    assert [c["step"] for c in json.loads(out)["checkpoints"]] == [100, 200]


def test_list_deep_marks_a_flipped_byte_inconsistent(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flip_byte(store / "step-000000200" / "shard-00000.safetensors")
    _, fast, _ = run(capsys, "ckpt", "list", str(store), "--json")
    _, deep, _ = run(capsys, "ckpt", "list", str(store), "--json", "--deep")
    flags = [[c["consistent"] for c in json.loads(o)["checkpoints"]] for o in (fast, deep)]
    assert flags == [[True, True], [True, False]]


def test_list_human_shows_one_row_per_checkpoint_and_the_problem_under_it(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (store / "step-000000200" / "rank-00000" / "state.json").unlink()
    code, out, _ = run(capsys, "ckpt", "list", str(store))
    lines = out.splitlines()
    assert (code, [line.split()[:2] for line in lines[:4]]) == (
        0,
        [
            ["STEP", "KIND"],
            ["100", "periodic"],
            ["200", "emergency"],
            ["rank-00000/state.json:", "missing"],
        ],
    )


def test_list_human_mentions_a_torn_partial(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_fake_checkpoint(store, 300, default_files(3), partial=True, manifest=False)
    _, out, _ = run(capsys, "ckpt", "list", str(store))
    assert out.splitlines()[-1] == ("not committed: step-000000300.partial (a save in progress or torn by a crash)")


def test_list_of_a_missing_directory_is_one_error_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "ckpt", "list", str(tmp_path / "nope"))
    assert (code, out, err) == (
        2,
        "",
        f"ftsup: error: checkpoint directory {tmp_path / 'nope'} does not exist\n",
    )


def test_list_of_a_file_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "f").write_text("")
    code, _, err = run(capsys, "ckpt", "list", str(tmp_path / "f"))
    assert (code, err) == (2, f"ftsup: error: {tmp_path / 'f'} is not a directory\n")


# --------------------------------------------------------------------------- ckpt verify


def test_verify_of_a_good_checkpoint_exits_0(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "ckpt", "verify", str(store), "--deep")
    assert (code, out.split(":")[0]) == (0, "step-000000200")


def test_verify_without_step_checks_the_newest_even_when_an_older_one_is_fine(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_fake_checkpoint(store, 300, default_files(3), manifest=False)
    code, out, _ = run(capsys, "ckpt", "verify", str(store))
    assert (code, out.splitlines()[0]) == (1, "step-000000300: NOT consistent (1 problem(s)):")


def test_verify_names_the_file_with_a_flipped_byte_when_deep(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = store / "step-000000200"
    shard = ckpt / "shard-00001.safetensors"
    recorded = layout.read_manifest(ckpt).files["shard-00001.safetensors"].checksum
    flip_byte(shard, offset=10)
    code, out, _ = run(capsys, "ckpt", "verify", str(store), "--step", "200", "--deep")
    assert (code, out.splitlines()[1]) == (
        1,
        f"  shard-00001.safetensors: checksum {checksums.file_checksum(shard)} != recorded {recorded}",
    )


def test_verify_fast_does_not_read_contents(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flip_byte(store / "step-000000200" / "shard-00001.safetensors")
    code, _, _ = run(capsys, "ckpt", "verify", str(store))
    assert code == 0


def test_verify_an_older_step_by_number(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (store / "step-000000200" / "shard-00001.safetensors").unlink()
    code, out, _ = run(capsys, "ckpt", "verify", str(store), "--step", "100", "--json")
    assert (code, json.loads(out)["step"]) == (0, 100)


def test_verify_json_prints_one_object_with_the_problems(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (store / "step-000000200" / "shard-00001.safetensors").unlink()
    code, out, _ = run(capsys, "ckpt", "verify", str(store), "--json")
    report = json.loads(out)
    contract = ("path", "step", "consistent", "deep", "problems", "kind", "world_size")
    assert (code, {k: report[k] for k in contract}) == (
        1,
        {
            "path": str(store / "step-000000200"),
            "step": 200,
            "consistent": False,
            "deep": False,
            "problems": [{"file": "shard-00001.safetensors", "reason": "missing"}],
            "kind": "emergency",
            "world_size": 4,
        },
    )


def test_verify_json_of_a_good_checkpoint_has_no_problems(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "ckpt", "verify", str(store), "--deep", "--json")
    report = json.loads(out)
    assert (code, report["consistent"], report["deep"], report["problems"]) == (0, True, True, [])


def test_verify_of_an_absent_step_is_exit_2_and_says_what_is_there(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_fake_checkpoint(store, 300, default_files(3), partial=True)
    code, out, err = run(capsys, "ckpt", "verify", str(store), "--step", "300")
    assert (code, out, err) == (
        2,
        "",
        f"ftsup: error: no committed checkpoint for step 300 under {store} "
        "(found step-000000300.partial: not committed)\n",
    )


def test_verify_of_an_empty_directory_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "ckpt", "verify", str(tmp_path))
    assert (code, err) == (2, f"ftsup: error: no committed checkpoint under {tmp_path}\n")


@pytest.mark.parametrize("step", ["-1", "ten"])
def test_verify_refuses_a_bad_step_number(store: Path, step: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "ckpt", "verify", str(store), "--step", step)
    assert (code, "argument --step" in err) == (2, True)


# --------------------------------------------------------------------------- usage


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys)
    assert (code, "required: COMMAND" in err) == (2, True)


def test_help_exits_0_and_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--help")
    assert (code, "ckpt" in out, "bench" in out) == (0, True, True)


# --------------------------------------------------------------------------- bench


class FakeBench(types.ModuleType):
    """Stands in for `ftsup.tools.bench.checkpoint` (which needs torch) with the same two entry points."""

    def __init__(self, result: int | Exception = 0) -> None:
        super().__init__("ftsup.tools.bench.checkpoint.command")
        self.result = result
        self.ran_with: list[argparse.Namespace] = []
        self.parsers_built = 0

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        self.parsers_built += 1
        parser.add_argument("--size-mb", type=int, required=True)

    def run(self, args: argparse.Namespace) -> int:
        self.ran_with.append(args)
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def test_bench_checkpoint_delegates_parsing_and_running_to_trainer_bench(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeBench(result=0)
    monkeypatch.setitem(sys.modules, "ftsup.tools.bench.checkpoint.command", fake)
    code, _, _ = run(capsys, "bench", "checkpoint", "--size-mb", "256")
    assert (code, [a.size_mb for a in fake.ran_with]) == (0, [256])


def test_bench_checkpoint_exit_status_is_the_benchmarks(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "ftsup.tools.bench.checkpoint.command", FakeBench(result=1))
    code, _, _ = run(capsys, "bench", "checkpoint", "--size-mb", "1")
    assert code == 1


def test_checkpoint_error_becomes_one_stderr_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeBench(result=CheckpointSaveError("disk full while writing shard 3; free space"))
    monkeypatch.setitem(sys.modules, "ftsup.tools.bench.checkpoint.command", fake)
    code, _, err = run(capsys, "bench", "checkpoint", "--size-mb", "1")
    assert (code, err) == (2, "ftsup: error: disk full while writing shard 3; free space\n")


def test_bench_without_trainer_bench_is_one_error_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "ftsup.tools.bench.checkpoint.command", None)  # makes the import fail
    code, _, err = run(capsys, "bench", "checkpoint", "--size-mb", "1")
    assert (code, err.startswith("ftsup: error: "), err.count("\n")) == (2, True, 1)


def test_ckpt_commands_do_not_load_the_benchmark(
    store: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeBench()
    monkeypatch.setitem(sys.modules, "ftsup.tools.bench.checkpoint.command", fake)
    code, _, _ = run(capsys, "ckpt", "list", str(store))
    assert (code, fake.parsers_built) == (0, 0)


# --------------------------------------------------------------------------- commands listed, built when asked for


def listed(help_text: str) -> list[str]:
    """The subcommands a --help lists (argparse indents each by 4 spaces under the metavar)."""
    return [m.group(1) for m in re.finditer(r"^ {4}(\S+)", help_text, re.MULTILINE)]


def test_help_lists_every_command_in_order(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--help")
    assert (code, listed(out)) == (
        0,
        ["run", "status", "config", "ckpt", "rollback", "incidents", "nodes", "bench", "demo", "chaos"],
    )


def test_bench_help_lists_every_benchmark_without_loading_the_checkpoint_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeBench()
    monkeypatch.setitem(sys.modules, "ftsup.tools.bench.checkpoint.command", fake)
    code, out, _ = run(capsys, "bench", "--help")
    benchmarks = ["recovery", "eviction", "checkpoint", "scale", "anomaly", "goodput", "node-loss", "forensics"]
    benchmarks.append("instrument")
    assert (code, listed(out), fake.parsers_built) == (0, benchmarks, 0)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["demo"], "--steps"),
        (["bench", "recovery"], "--hang-repeats"),
        (["bench", "eviction"], "--evictions"),
        (["bench", "anomaly"], "--clean-steps"),
        (["bench", "goodput"], "--mean-interval-s"),
        (["bench", "node-loss"], "--replace-s"),
        (["bench", "forensics"], "--ranks"),
    ],
)
def test_a_tooling_command_asked_for_has_its_flags(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, *argv, "--help")
    assert (code, flag in out) == (0, True)
