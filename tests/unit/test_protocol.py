"""What crosses the rank/supervisor boundary (`ftsup.protocol`): the heartbeat schema every message
is checked against, the control file's schema and version, the ranks' environment, the phases."""

from __future__ import annotations

import ast
import json
import random
import re
import time
from pathlib import Path

import pytest

from ftsup import procs, protocol
from ftsup.protocol import (
    BEAT_VERSION,
    CONTROL_VERSION,
    DATA_SKIPS_ENV,
    DROP_REASONS,
    ENV_NAMES,
    MAX_BEAT_BYTES,
    MAX_CONTROL_BYTES,
    MAX_FIGURES,
    MAX_REASON_CHARS,
    BadBeat,
    Beat,
    ControlVersionError,
    Phase,
    Request,
    RuntimeEnv,
    channel_env,
    check_data_skips,
    encode_beat,
    encode_control,
    encode_data_skips,
    parse_beat,
    parse_control,
    parse_data_skips,
)

REPO = Path(__file__).resolve().parents[2]
BASE = {
    "v": BEAT_VERSION,
    "attempt": 1,
    "rank": 0,
    "local_rank": 0,
    "pid": 4242,
    "step": 7,
    "phase": "train",
    "t": 1_700_000_000.5,
    "mono": 12.25,
}


def raw(**fields: object) -> bytes:
    """A beat on the wire, BASE with `fields` changed."""
    return json.dumps({**BASE, **fields}).encode()


def reason_of(message: bytes) -> str:
    with pytest.raises(BadBeat) as e:
        parse_beat(message)
    return e.value.reason


# ---------------------------------------------------------------------- the schema


def test_an_encoded_beat_parses_back_to_its_fields():
    message = encode_beat(
        attempt=3,
        rank=5,
        local_rank=1,
        pid=99,
        step=12,
        phase=Phase.SAVE,
        t=1.5,
        mono=2.5,
        figures={"loss": 2.25, "saved_step": 12},
    )
    assert parse_beat(message) == Beat(3, 5, 1, 99, 12, Phase.SAVE, 1.5, 2.5, (("loss", 2.25), ("saved_step", 12.0)))


def test_a_step_of_infinity_is_malformed():
    assert reason_of(raw().replace(b'"step": 7', b'"step": Infinity')) == "malformed"


def test_a_400_digit_integer_is_malformed():
    assert reason_of(raw().replace(b'"step": 7', b'"step": ' + b"9" * 400)) == "malformed"


def test_60_kb_of_nested_lists_is_refused_before_parsing_in_microseconds():
    message = b'{"v": 2, "step": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"
    t0 = time.perf_counter()
    assert reason_of(message) == "malformed"
    assert time.perf_counter() - t0 < 0.01


def test_a_message_longer_than_the_cap_is_malformed():
    assert reason_of(raw(note_s=1.0)[:-1] + b" " * MAX_BEAT_BYTES + b"}") == "malformed"


def test_a_beat_of_another_protocol_version_is_dropped_as_version():
    assert reason_of(raw(v=1)) == "version"


def test_a_phase_outside_the_set_is_malformed():
    assert reason_of(raw(phase="training")) == "malformed"


def test_a_boolean_is_not_an_integer():
    assert reason_of(raw(step=True)) == "malformed"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("pid", 0),
        ("pid", 2**22 + 1),
        ("step", -1),
        ("step", 10**13),
        ("local_rank", 2**16 + 1),
        ("attempt", -3),
        ("mono", -1.0),
    ],
)
def test_integers_and_times_out_of_range_are_malformed(field, value):
    assert reason_of(raw(**{field: value})) == "malformed"


def test_a_figure_that_was_not_finite_at_the_rank_arrives_as_nan():
    ((name, value),) = parse_beat(raw(loss=None)).figures
    assert (name, value != value) == ("loss", True)


@pytest.mark.parametrize(
    "figures",
    [
        {"bad-name": 1.0},
        {"x" * 65: 1.0},
        {"loss": "high"},
        {"loss": 1e999},
        {f"f{i}": 1.0 for i in range(MAX_FIGURES + 1)},
    ],
)
def test_figures_outside_the_schema_make_the_beat_malformed(figures):
    text = json.dumps({**BASE, **figures}).replace("Infinity", "1e999").encode()
    assert reason_of(text) == "malformed"


def test_a_key_given_twice_is_malformed():
    assert reason_of(raw()[:-1] + b', "step": 8}') == "malformed"


HOSTILE = [
    b"",
    b"\x00" * 100,
    b"\xff\xfe{",
    b"null",
    b"[]",
    b"{}",
    b'"beat"',
    b"1e999",
    b"{" * 5000,
    b"[" * 60_000,
    b'{"v": 2}',
    b'{"v": "2"}',
    b'{"v": 2.0}',
    b'{"v": NaN}',
    b'{"v": 2, "step": -Infinity}',
    raw().replace(b'"t": 1700000000.5', b'"t": NaN'),
    raw().replace(b"12.25", b"1" + b"0" * 400),
    raw(pid="4242"),
    raw(phase=None),
    raw(rank=[0]),
    raw(local_rank={"a": 1}),
    raw(attempt=2**31),
    raw(loss={"nested": 1}),
    raw(**{"": 1.0}),
    raw(**{"ü": 1.0}),
    raw()[:-1],
    raw() + b"}",
    raw() + b" trailing",
    raw().replace(b"train", b"tr\\u0000in"),
    raw().replace(b"train", b"\\ud800"),
    b'{"v": 2' + b", " * 2000 + b"}",
]


def test_every_hostile_payload_and_thousands_of_mutations_give_badbeat_and_nothing_else():
    rnd = random.Random(13)
    valid = raw(loss=2.5, save_s=0.25)
    payloads = list(HOSTILE)
    for _ in range(5000):  # flips, cuts, splices and repeats of a valid beat
        b = bytearray(valid)
        for _ in range(rnd.randint(1, 4)):
            op, i = rnd.randrange(4), rnd.randrange(len(b))
            if op == 0:
                b[i] = rnd.randrange(256)
            elif op == 1:
                del b[i : i + rnd.randint(1, 8)]
            elif op == 2:
                b[i:i] = rnd.choice([b"[", b"{", b"}", b'"', b"\\", b"9" * 30, b"Infinity", b"-", b"e999", b"\x80"])
            else:
                b[i:i] = b[i : i + 16] * rnd.randint(2, 50)
        payloads.append(bytes(b))
    outcomes = {"beat": 0, **dict.fromkeys(DROP_REASONS, 0)}
    for p in payloads:
        try:
            parse_beat(p)
            outcomes["beat"] += 1
        except BadBeat as e:
            outcomes[e.reason] += 1
    assert sum(outcomes.values()) == len(payloads) and outcomes["malformed"] > len(payloads) // 2


# ---------------------------------------------------------------------- phases


def test_a_phase_is_its_wire_name_in_text_and_in_comparisons():
    shown = (str(Phase.EVAL), f"{Phase.SAVE}", Phase.TRAIN == "train", "done" in {Phase.DONE})
    assert shown == ("eval", "save", True, True)


# ---------------------------------------------------------------------- the control file


def test_an_encoded_request_parses_back_to_itself():
    request = Request(7, stop=True, reason="aws: spot interruption", deadline_unix=1_700_000_120.5)
    assert parse_control(encode_control(request)) == request


def test_a_control_file_without_a_version_is_refused():
    with pytest.raises(ControlVersionError, match="no format version"):
        parse_control(b'{"seq": 1, "action": "save", "stop": true, "reason": "old supervisor"}')


@pytest.mark.parametrize("version", [CONTROL_VERSION + 1, 0, "1", 1.0, None, True])
def test_a_control_file_of_another_version_is_refused(version):
    body = {**json.loads(encode_control(Request(3, stop=True))), "v": version}
    with pytest.raises(ControlVersionError, match="format version"):
        parse_control(json.dumps(body).encode())


@pytest.mark.parametrize(
    "change",
    [
        {"action": "delete"},
        {"seq": -1},
        {"seq": True},
        {"seq": "5"},
        {"seq": 10**30},
        {"stop": "yes"},
        {"reason": 5},
        {"reason": "x" * (MAX_REASON_CHARS + 1)},
        {"deadline_unix": "soon"},
        {"deadline_unix": -1},
    ],
)
def test_a_control_file_outside_the_schema_is_not_a_request(change):
    body = {**json.loads(encode_control(Request(3))), **change}
    with pytest.raises(ValueError) as e:
        parse_control(json.dumps(body).encode())
    assert not isinstance(e.value, ControlVersionError)


@pytest.mark.parametrize(
    "text",
    [
        b"",
        b"[]",
        b"null",
        b'{"v": 1, "seq": NaN}',
        b"\xff",
        b"{" * 10_000,
        b"[" * 8000,
        b'{"v": 1, "seq": 1, "action": "save", "deadline_unix": Infinity}',
    ],
)
def test_garbage_in_the_control_file_is_not_a_request(text):
    with pytest.raises(ValueError):
        parse_control(text)


def test_a_control_file_longer_than_the_cap_is_refused_before_parsing():
    with pytest.raises(ValueError, match="more than"):
        parse_control(encode_control(Request(1))[:-1] + b" " * MAX_CONTROL_BYTES + b"}")


def test_the_longest_reason_is_cut_and_still_fits_the_cap():
    written = encode_control(Request(2**62, stop=True, reason="\u2028" * (3 * MAX_REASON_CHARS), deadline_unix=1e12))
    assert (len(written) <= MAX_CONTROL_BYTES, len(parse_control(written).reason)) == (True, MAX_REASON_CHARS)


# ---------------------------------------------------------------------- the ranks' environment


def test_the_channel_the_supervisor_exports_is_what_a_rank_reads():
    env = channel_env(
        heartbeat_socket="/run/ftsup/j/heartbeat.sock",
        interval_s=0.25,
        control_file="/run/ftsup/j/control.json",
        checkpoint_dir="/ckpt",
        resume_step=1200,
    )
    got = RuntimeEnv.from_environ(
        {**env, protocol.RESUME_BOUND_ENV: "1200", **procs.Mark("run-1", "node-0", 3).environ()}
    )
    assert got == RuntimeEnv(
        heartbeat_socket="/run/ftsup/j/heartbeat.sock",
        heartbeat_interval_s=0.25,
        control_file="/run/ftsup/j/control.json",
        checkpoint_dir="/ckpt",
        resume_step=1200,
        resume_bound=1200,
        attempt=3,
        run_id="run-1",
        node_id="node-0",
    )


def test_no_resume_step_travels_as_empty_and_reads_as_none():
    env = channel_env(heartbeat_socket="s", interval_s=1.0, control_file="c", checkpoint_dir="d", resume_step=None)
    got = RuntimeEnv.from_environ(env)
    assert (got.resume_step, got.resume_bound) == (None, None)


def test_the_data_skips_the_supervisor_exports_are_what_a_rank_reads():
    skips = ((0, 12), (12, 30), (2**53 - 1, 2**53))
    assert RuntimeEnv.from_environ({DATA_SKIPS_ENV: encode_data_skips(skips)}).data_skips == skips


def test_no_data_skips_read_as_none():
    assert (RuntimeEnv.from_environ({}).data_skips, RuntimeEnv.from_environ({DATA_SKIPS_ENV: " "}).data_skips) == (
        (),
        (),
    )


@pytest.mark.parametrize(
    "value",
    [
        "3",
        "3:",
        ":3",
        "3:3",
        "5:3",
        "-1:3",
        "1:3,",
        "1:3,,4:5",
        "1 :3",
        "1:3;4:5",
        "4:6,1:3",
        "1:5,4:6",
        "0x1:3",
        "\u0661:\u0663",
        "1:" + str(2**53 + 1),
        "1:" + "9" * 17,
        ",".join(f"{2 * i}:{2 * i + 1}" for i in range(65)),
    ],
)
def test_data_skips_that_are_not_sorted_ranges_of_positions_are_refused_naming_the_variable(value):
    with pytest.raises(ValueError, match=f"environment variable {DATA_SKIPS_ENV}"):
        RuntimeEnv.from_environ({DATA_SKIPS_ENV: value})


def test_data_skips_longer_than_64_ranges_need_are_refused_before_parsing():
    with pytest.raises(ValueError, match="characters long"):
        parse_data_skips("1" * 100_000 + ":2")


@pytest.mark.parametrize("value", [[[1, 2.0]], [[True, 2]], [[1, 2, 3]], [1, 2], {"1": 2}, [["1", "2"]], [[2, 1]]])
def test_data_skips_read_from_json_are_checked_as_strictly(value):
    with pytest.raises(ValueError, match="the skips"):
        check_data_skips(value, "the skips")


def _string_constants(path: Path) -> list[str]:
    return [
        n.value
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


def test_every_ftsup_variable_is_named_in_the_protocol_and_nowhere_else_in_the_product():
    named_elsewhere = {
        f"{path.relative_to(REPO)}: {value}"
        for folder in ("ftsup", "supervisor", "trainer")
        for path in sorted((REPO / folder).rglob("*.py"))
        if path.relative_to(REPO).as_posix() not in ("ftsup/protocol.py", "ftsup/guard.py")
        for value in _string_constants(path)
        if re.fullmatch(r"FTSUP_[A-Z0-9_]+", value)
    }
    assert (named_elsewhere, all(n.startswith("FTSUP_") for n in ENV_NAMES)) == (set(), True)
