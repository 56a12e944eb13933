"""lm_head and the embedding are vocabulary-parallel under TP (Shard(0) of the vocabulary): a vocabulary that does
not split over `dist.tp` fails the run's layout check with one line naming model.vocab_size, dist.tp and the
vocab_size that would divide, before any process group is built or anything is written."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hybridtron.cli import main as cli_main
from hybridtron.distributed.config import DistConfig
from hybridtron.distributed.mesh import check_run_layout

REASON = ("tp 2 does not divide vocab_size 1031 (the vocab-parallel embedding and lm_head): pad model.vocab_size to "
          "1032, a multiple of dist.tp 2")


def test_a_vocabulary_that_does_not_split_over_tp_is_one_line(small_config):
    with pytest.raises(ValueError) as error:
        check_run_layout(DistConfig(tp=2), small_config(vocab_size=1031), 2, batch_size=4, grad_accum=2, seq_len=32)
    message = str(error.value)
    assert message.startswith("dist layout ") and message.endswith(f" on 2 processes: {REASON}")
    assert "\n" not in message
    assert check_run_layout(DistConfig(tp=2), small_config(vocab_size=1032), 2, batch_size=4, grad_accum=2,
                            seq_len=32).tp == 2


def test_pretrain_rejects_it_before_building_a_process_group(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it
    out = tmp_path / "run"
    code = cli_main(["pretrain", "--preset", "tiny", "--out", str(out), "--set", "dist.tp=2",
                     "--set", "model.vocab_size=1031", "--quiet"])
    assert code == 2
    err = capsys.readouterr().err
    assert REASON in err and err.count("\n") == 1
    assert not out.exists() and not dist.is_initialized()
