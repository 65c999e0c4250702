"""`ftsup ckpt import-deepspeed`: the fp32 weights of a checkpoint DeepSpeed wrote (ZeRO stages 1-3, 2 ranks, gloo,
sizes that leave padding) in the Hub's layout, bitwise what DeepSpeed's own zero_to_fp32 consolidates; a torn tag
refused naming its file; at most the largest tensor plus 256 MiB held while converting."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from ftsup.store.errors import CheckpointError
from tests.procs import BIN, free_port, run

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.multiprocess, pytest.mark.long]


def deepspeed_checkpoint(out: Path, stage: int, *extra: str) -> Path:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}"]
    argv += [str(BIN / "deepspeed_default.py"), "--loss-log", os.devnull, "--save-dir", str(out)]
    argv += ["--stage", str(stage), "--steps", "2", "--save-every", "2", *extra]
    r = run(argv, env={"DS_ACCELERATOR": "cpu"}, timeout=240)
    assert r.returncode == 0, r.output[-3000:]
    return out


SMALL = ("--width", "63", "--depth", "2")  # two layers whose partitions over 2 ranks leave padding


@pytest.fixture(scope="module")
def stage_2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small ZeRO stage 2 checkpoint: converted by the test of stage 2, a copy of it torn by the torn tag's."""
    return deepspeed_checkpoint(tmp_path_factory.mktemp("stage-2") / "ds", 2, *SMALL)


# Stage 1 is stage 2's optimizer class (DeepSpeed's `stage_1_and_2.py`) and writes its layout: zero_to_fp32 and the
# conversion read both alike.
@pytest.mark.parametrize("stage", [2, 3])
def test_the_hub_weights_are_bitwise_what_zero_to_fp32_consolidates(request, tmp_path, stage):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    from ftsup.supervisor.cli.commands import main

    ckpt = request.getfixturevalue("stage_2") if stage == 2 else deepspeed_checkpoint(tmp_path / "ds", stage, *SMALL)
    assert main(["ckpt", "import-deepspeed", str(ckpt), str(tmp_path / "hf")]) == 0
    got = load_file(tmp_path / "hf" / "model.safetensors")
    want = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k].contiguous())] == []


def test_a_tag_with_a_rank_file_cut_short_is_refused_naming_it(stage_2, tmp_path):
    from ftsup.trainer.deepspeed.convert import import_deepspeed

    ckpt = Path(shutil.copytree(stage_2, tmp_path / "ds"))
    torn = ckpt / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    os.truncate(torn, torn.stat().st_size - 64)
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt: not a whole"):
        import_deepspeed(ckpt, tmp_path / "hf", tag="global_step2")
    assert not (tmp_path / "hf").exists()


PEAK = """
import resource, sys
from ftsup.supervisor.cli.commands import main
import ftsup.trainer.deepspeed.convert
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
code = main(["ckpt", "import-deepspeed", *sys.argv[1:]])
print("rss_kib", base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
sys.exit(code)
"""


def test_a_conversion_holds_at_most_the_largest_tensor_plus_256_mib(tmp_path):
    # 8 hidden layers of 2560 x 2560: 8 tensors of 25 MiB, 200 MiB of fp32 weights in all (zero_to_fp32 holds the
    # model states file's 200 MiB and the partitions concatenated, 200 MiB more).
    ckpt = deepspeed_checkpoint(tmp_path / "ds", 2, "--width", "2560", "--depth", "8")
    r = run([sys.executable, "-c", PEAK, str(ckpt), str(tmp_path / "hf")], timeout=240)
    assert r.returncode == 0, r.output[-3000:]
    base, peak = (int(n) * 1024 for n in r.output.rsplit("rss_kib ", 1)[1].split()[:2])
    assert (tmp_path / "hf" / "model.safetensors").stat().st_size > 8 * (25 << 20)
    assert peak - base <= (25 << 20) + (256 << 20), (peak - base) / 2**20
