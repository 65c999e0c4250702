"""`ftsup ckpt export-hf` in the Hub's conventions: the reference trainer's checkpoint exported is what
huggingface_hub's own `save_torch_state_dict` writes (names, index, every byte), opens in safetensors with every
tensor bitwise the training one, loads with huggingface_hub's loader and, for a transformers model, with
`from_pretrained` (the same logits, in the dtype asked for); so does the HF Trainer example's checkpoint, exported
in shards; bad input (and a Trainer checkpoint whose weights lie) leaves nothing in OUT."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ftsup import GlobalBatchSchedule, TrainingState
from ftsup.store import hublayout, layout
from ftsup.supervisor.cli.commands import main
from ftsup.trainer.checkpoint import CheckpointCorruptError, CheckpointEngine, CheckpointError
from ftsup.trainer.examples.gpt import GPT
from ftsup.trainer.hf.export import export_hf
from tests.helpers import flip_byte
from tests.hubfiles import overlap, past_end, rewrite_header, with_two_tensors
from tests.procs import run

SHAPE = {"seq_len": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of the reference trainer after 2 steps, one process (each tensor one whole chunk)."""
    root = tmp_path_factory.mktemp("reference") / "ckpt"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SHAPE.items()]
    argv = [sys.executable, "-m", "ftsup.trainer.examples.gpt", "--steps", "2", "--ckpt-every", "2"]
    argv += ["--global-batch", "4", "--micro-batch", "2", "--corpus-bytes", "65536", "--ckpt-dir", str(root), *flags]
    r = run(argv, timeout=180)
    assert r.returncode == 0, r.output[-3000:]
    return root


def training_tensors(ckpt_root: Path) -> dict[str, torch.Tensor]:
    """The model's tensors as the engine saved them, read with safetensors from its own shard (`fqn@0,0`)."""
    path = ckpt_root / layout.step_dirname(2) / "shard-00000.safetensors"
    with safe_open(str(path), framework="pt") as f:
        return {
            k.split("@")[0].removeprefix("train.model."): f.get_tensor(k)
            for k in f.keys()
            if k.startswith("train.model.")
        }


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def exported(out: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            tensors.update({k: st.get_tensor(k) for k in st.keys()})
    return tensors


def test_the_export_is_what_huggingface_hubs_save_torch_state_dict_writes_byte_for_byte(reference, tmp_path):
    from huggingface_hub import save_torch_state_dict

    assert main(["ckpt", "export-hf", str(reference), str(tmp_path / "ours"), "--max-shard-size", "40KB"]) == 0
    saved = training_tensors(reference)
    model_order = GPT(256, dropout=0.0, **SHAPE).state_dict()
    (tmp_path / "hub").mkdir()
    save_torch_state_dict({k: saved[k] for k in model_order}, tmp_path / "hub", max_shard_size="40KB")
    ours, hub = (
        sorted(p.name for p in (tmp_path / "ours").iterdir()),
        sorted(p.name for p in (tmp_path / "hub").iterdir()),
    )
    assert (ours, hublayout.INDEX_NAME in ours) == (hub, True)
    assert [(tmp_path / "ours" / n).read_bytes() == (tmp_path / "hub" / n).read_bytes() for n in ours] == [True] * len(
        ours
    )


def test_every_exported_tensor_is_bitwise_the_training_one_and_the_names_follow_the_hubs(reference, tmp_path):
    index = export_hf(reference, None, tmp_path / "hf", max_shard_bytes=40_000)
    files = sorted({*index["weight_map"].values()})
    n = len(files)
    on_disk = json.loads((tmp_path / "hf" / hublayout.INDEX_NAME).read_text())
    assert files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert (list(on_disk), on_disk["weight_map"], on_disk["metadata"]) == (
        ["metadata", "weight_map"],
        index["weight_map"],
        {"total_size": index["metadata"]["total_size"]},
    )
    saved, got = training_tensors(reference), exported(tmp_path / "hf")
    assert {k: (t.dtype, as_bytes(t)) for k, t in got.items()} == {k: (t.dtype, as_bytes(t)) for k, t in saved.items()}


def test_a_model_that_fits_one_shard_is_one_model_safetensors_without_an_index(reference, tmp_path):
    export_hf(reference, None, tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [hublayout.SINGLE_NAME]


def test_the_export_loads_with_huggingface_hubs_loader_for_sharded_checkpoints(reference, tmp_path):
    from huggingface_hub import load_torch_model

    export_hf(reference, None, tmp_path / "hf", max_shard_bytes=40_000)
    model = GPT(256, dropout=0.0, **SHAPE)
    result = load_torch_model(model, tmp_path / "hf", strict=True)
    saved = training_tensors(reference)
    assert (list(result.missing_keys), list(result.unexpected_keys)) == ([], [])
    assert {k: as_bytes(t) for k, t in model.state_dict().items()} == {
        k: as_bytes(saved[k]) for k in model.state_dict()
    }


def test_dtype_bf16_converts_the_floating_tensors_and_nothing_else(tmp_path):
    state = {
        "app": {
            "model": {
                "w": torch.randn(4, 4, dtype=torch.float64),
                "h": torch.randn(3),
                "i": torch.arange(5),
                "f8": torch.randn(4).to(torch.float8_e4m3fn),
            }
        }
    }
    with CheckpointEngine(tmp_path / "ckpt") as eng:
        eng.save(1, state, block=True)
    assert main(["ckpt", "export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--dtype", "bf16"]) == 0
    got = exported(tmp_path / "hf")
    model = state["app"]["model"]
    assert {k: (t.dtype, as_bytes(t)) for k, t in got.items()} == {
        "w": (torch.bfloat16, as_bytes(model["w"].to(torch.bfloat16))),
        "h": (torch.bfloat16, as_bytes(model["h"].to(torch.bfloat16))),
        "i": (torch.int64, as_bytes(model["i"])),
        "f8": (torch.float8_e4m3fn, as_bytes(model["f8"])),
    }


def gpt2_state(tmp_path: Path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainingState(model, optimizer, schedule=GlobalBatchSchedule(64, 4, 4, 1, 0, 0), config=config.to_dict())
    state.step, state.samples = 1, 4
    with CheckpointEngine(tmp_path / "ckpt") as eng:
        state.save(eng, kind="final", block=True)
    return model


def test_a_sharded_bf16_export_loads_with_from_pretrained_in_bf16_with_the_models_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    model = gpt2_state(tmp_path)
    args = ["ckpt", "export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--dtype", "bf16"]
    args += ["--max-shard-size", "30KB"]
    assert main(args) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 1
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.arange(16).unsqueeze(0) % 64
    with torch.no_grad():
        want = model.to(torch.bfloat16)(x).logits
        assert (loaded.dtype, torch.equal(loaded(x).logits, want)) == (torch.bfloat16, True)


def test_a_trainer_checkpoint_is_resharded_and_converted_with_from_pretrained_giving_its_logits(tmp_path):
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    from ftsup.trainer.hf import store as hf_store

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)).eval()
    model.save_pretrained(tmp_path / "checkpoint-3")  # what the Trainer writes into checkpoint-N/, weights first
    hf_store.commit_hf_checkpoint(
        tmp_path / "checkpoint-3", tmp_path / "store", 3, kind="final", world_size=1, metadata={"step": 3}
    )
    args = ["ckpt", "export-hf", str(tmp_path / "store"), str(tmp_path / "hf"), "--max-shard-size", "30KB"]
    assert main([*args, "--dtype", "fp16"]) == 0
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert (hublayout.INDEX_NAME in files, "generation_config.json" in files) == (True, True)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.arange(16).unsqueeze(0) % 64
    with torch.no_grad():
        want = model.to(torch.float16)(x).logits
        assert (loaded.dtype, torch.equal(loaded(x).logits, want)) == (torch.float16, True)


@pytest.fixture(scope="module")
def trainer_example(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The HF Trainer example (`ftsup.trainer.examples.hf_gpt2`) trained 4 steps in one process, its checkpoint
    exported in shards of 100KB: the store, the export, and the logits the trained model gave."""
    tmp = tmp_path_factory.mktemp("trainer-example")
    argv = [sys.executable, "-m", "ftsup.trainer.examples.hf_gpt2", "--steps", "4", "--save-every", "4"]
    argv += ["--eval-every", "100", "--output-dir", str(tmp / "store"), "--logits-out", str(tmp / "logits.pt")]
    r = run(argv, timeout=240)
    assert r.returncode == 0, r.output[-3000:]
    assert main(["ckpt", "export-hf", str(tmp / "store"), str(tmp / "hf"), "--max-shard-size", "100KB"]) == 0
    return {"store": tmp / "store", "hf": tmp / "hf", "logits": tmp / "logits.pt"}


def trainer_weights(store: Path) -> dict[str, torch.Tensor]:
    """The Trainer's own weights in its committed checkpoint (save_pretrained's model.safetensors)."""
    with safe_open(str(store / layout.step_dirname(4) / hublayout.SINGLE_NAME), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_the_trainer_examples_export_in_shards_opens_in_safe_open_with_every_tensor_bitwise_the_trained_one(
    trainer_example,
):
    got, want = exported(trainer_example["hf"]), trainer_weights(trainer_example["store"])
    assert len(list(trainer_example["hf"].glob("model-*-of-*.safetensors"))) > 2
    assert {k: (t.dtype, as_bytes(t)) for k, t in got.items()} == {k: (t.dtype, as_bytes(t)) for k, t in want.items()}


def test_the_trainer_examples_export_in_shards_loads_with_huggingface_hubs_sharded_loader_bitwise(trainer_example):
    from huggingface_hub import load_torch_model
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(trainer_example["hf"]))
    result = load_torch_model(model, trainer_example["hf"])
    want = trainer_weights(trainer_example["store"])
    want["lm_head.weight"] = want["transformer.wte.weight"]  # tied: save_pretrained writes it once
    assert (list(result.unexpected_keys), set(result.missing_keys) <= {"lm_head.weight"}) == ([], True)
    assert {k: as_bytes(t) for k, t in model.state_dict().items()} == {k: as_bytes(t) for k, t in want.items()}


def test_the_trainer_examples_export_in_shards_loads_with_from_pretrained_giving_the_trained_logits(trainer_example):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(trainer_example["hf"]).eval()
    trained = torch.load(trainer_example["logits"])
    with torch.no_grad():
        logits = model(torch.arange(trained.shape[1]).unsqueeze(0) % 256).logits
    assert torch.equal(logits, trained)


# --------------------------------------------------------------------------- bad input


def linear_checkpoint(tmp_path: Path) -> Path:
    with CheckpointEngine(tmp_path / "ckpt") as eng:
        res = eng.save(1, {"app": {"model": {"w": torch.randn(64, 512), "b": torch.randn(64)}}}, block=True)
    return Path(res.path)


def leftovers(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name != "ckpt")


def test_a_corrupt_tensor_met_midway_names_the_shard_and_the_tensor_and_leaves_nothing(tmp_path):
    ckpt = linear_checkpoint(tmp_path)
    # b (256 bytes at 4096) is written first and reads the first 64 KiB block; w's second block is corrupt
    flip_byte(ckpt / "shard-00000.safetensors", 100_000)
    with pytest.raises(
        CheckpointCorruptError, match=r"shard-00000\.safetensors: checksum mismatch .*reading app\.model\.w"
    ):
        export_hf(tmp_path / "ckpt", 1, tmp_path / "hf")
    assert leftovers(tmp_path) == []


def test_an_out_that_is_a_symbolic_link_is_refused_and_never_written_through(tmp_path):
    linear_checkpoint(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "hf").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        export_hf(tmp_path / "ckpt", 1, tmp_path / "hf")
    assert (list((tmp_path / "elsewhere").iterdir()), leftovers(tmp_path)) == ([], ["elsewhere", "hf"])


def test_an_empty_out_directory_is_replaced_by_the_export(tmp_path):
    linear_checkpoint(tmp_path)
    (tmp_path / "hf").mkdir()
    export_hf(tmp_path / "ckpt", 1, tmp_path / "hf")
    assert (sorted(p.name for p in (tmp_path / "hf").iterdir()), leftovers(tmp_path)) == (
        [hublayout.SINGLE_NAME],
        ["hf"],
    )


def test_both_shard_size_flags_are_a_usage_error(tmp_path, capsys):
    linear_checkpoint(tmp_path)
    args = ["ckpt", "export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--max-shard-size", "5GB"]
    code = main([*args, "--max-shard-gb", "5"])
    assert (code, "not allowed with argument" in capsys.readouterr().err, leftovers(tmp_path)) == (2, True, [])


def test_a_bad_shard_size_is_a_usage_error_that_says_why(tmp_path, capsys):
    code = main(["ckpt", "export-hf", str(tmp_path), str(tmp_path / "hf"), "--max-shard-size", "5Gb"])
    assert (code, "ambiguous" in capsys.readouterr().err) == (2, True)


def test_writing_holds_one_tensor_in_memory_at_a_time_whatever_the_shard_size(tmp_path):
    import weakref

    from ftsup.trainer.hf.write import OutTensor, write_model

    alive, peak = [0], [0]

    def reader(i: int):
        def read() -> torch.Tensor:
            t = torch.full((1000,), float(i))
            alive[0] += 1
            peak[0] = max(peak[0], alive[0])
            weakref.finalize(t, lambda: alive.__setitem__(0, alive[0] - 1))
            return t

        return read

    tensors = [OutTensor(f"t{i}", torch.bfloat16 if i % 2 else torch.float32, (1000,), reader(i)) for i in range(8)]
    (tmp_path / "out").mkdir()
    write_model(tmp_path / "out", tensors, max_shard_bytes=10**9)  # one shard holding them all
    got = exported(tmp_path / "out")
    assert (peak[0], alive[0], sorted(got)) == (1, 0, sorted(t.name for t in tensors))


def test_a_file_of_mixed_dtypes_is_byte_for_byte_what_safetensors_save_file_writes(tmp_path):
    from safetensors.torch import save_file

    from ftsup.trainer.hf.write import OutTensor, write_model

    g = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.randint(0, 256, (3, 8), dtype=torch.uint8, generator=g).view(dtype)
        for name, dtype in [
            ("z.w", torch.float32),
            ("a.w", torch.int32),
            ("m", torch.bfloat16),
            ("b", torch.float16),
            ("q", torch.float8_e4m3fn),
            ("c", torch.float64),
            ("u", torch.uint16),
            ("k", torch.bool),
        ]
    }
    tensors["k"] = tensors["k"].view(torch.uint8) % 2 == 1
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    (tmp_path / "out").mkdir()
    write_model(
        tmp_path / "out",
        [OutTensor(n, t.dtype, tuple(t.shape), lambda t=t: t) for n, t in tensors.items()],
        max_shard_bytes=10**9,
    )
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def trainer_store(tmp_path: Path, break_it) -> Path:
    """A store holding what FtsupCallback commits of a Trainer's checkpoint (a GPT-2 saved by save_pretrained in
    several shards), with its weights broken by `break_it(checkpoint dir)` before the commit: a manifest that
    verifies, over files that lie."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from ftsup.trainer.hf import store as hf_store

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    model.save_pretrained(tmp_path / "checkpoint-3", max_shard_size="30KB")
    break_it(tmp_path / "checkpoint-3")
    hf_store.commit_hf_checkpoint(
        tmp_path / "checkpoint-3", tmp_path / "store", 3, kind="final", world_size=1, metadata={"step": 3}
    )
    return tmp_path / "store"


def unsupported_dtype(d: Path) -> None:
    """c_attn.bias (96 F32 values, 384 bytes) said to be 512 six-bit floats: a dtype of safetensors' torch lacks."""
    name = "transformer.h.0.attn.c_attn.bias"
    shard = json.loads((d / hublayout.INDEX_NAME).read_text())["weight_map"][name]

    def change(header: dict) -> None:
        header[name] = {**header[name], "dtype": "F6_E2M3", "shape": [512]}

    rewrite_header(d / shard, change)


@pytest.mark.parametrize(
    ("break_it", "says"),
    [
        (
            lambda d: next(d.glob("model-00002-*.safetensors")).unlink(),
            r"model\.safetensors\.index\.json: names model-00002-of-\d{5}\.safetensors "
            r"\(for tensor '[^']+'\), which is missing",
        ),
        (
            lambda d: rewrite_header(with_two_tensors(d), overlap),
            r"model-\d{5}-of-\d{5}\.safetensors: tensor '[^']+' overlaps tensor '[^']+'",
        ),
        (
            lambda d: rewrite_header(with_two_tensors(d), past_end),
            r"model-\d{5}-of-\d{5}\.safetensors: tensor '[^']+': its bytes \[\d+, \d+\) run past the end of the file",
        ),
        (
            unsupported_dtype,
            r"model-\d{5}-of-\d{5}\.safetensors: tensor 'transformer\.h\.0\.attn\.c_attn\.bias' has "
            "dtype F6_E2M3, which torch has no dtype for",
        ),
    ],
    ids=["missing-shard", "overlapping-header", "header-past-the-end", "unsupported-dtype"],
)
def test_a_trainer_checkpoint_whose_weights_lie_names_the_file_and_the_tensor_and_leaves_nothing_in_out(
    tmp_path, break_it, says
):
    store = trainer_store(tmp_path, break_it)
    with pytest.raises(CheckpointError, match=says):
        export_hf(store, None, tmp_path / "hf", max_shard_bytes=30_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def test_chunks_of_whole_rows_that_tile_a_tensor_are_passed_on_in_row_order_and_nothing_else_is():
    from ftsup.trainer.hf.export import _slabs

    size = (10, 4)
    assert _slabs([((6, 0), (4, 4)), ((0, 0), (6, 4))], size) == [1, 0]  # two ranks' rows, listed out of order
    assert _slabs([((0, 0), (10, 2)), ((0, 2), (10, 2))], size) is None  # split on dim 1: assembled
    assert _slabs([((0, 0), (5, 4)), ((6, 0), (4, 4))], size) is None  # a row missing
    assert _slabs([((0, 0), (6, 4)), ((5, 0), (5, 4))], size) is None  # overlapping rows
    assert _slabs([], ()) is None  # 0-dimensional
