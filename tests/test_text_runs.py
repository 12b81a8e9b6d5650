"""Issue 39 end to end (CLI): ``ddp-exp prepare`` a folder of text, train
``experiment=gpt_tokens data.path=DIR`` on it (learns: below the validation tokens' unigram
entropy; ``val/bits_per_byte``; samples in TensorBoard), the same validation at world sizes 1
and 3, ``ddp-exp sample`` (seeded, decoded; Chinese with no U+FFFD), a Hugging Face GPT-2 by
``_target_`` (F09), the subcommands' bad input as one line, exit 2, and a prepared-folder run
killed mid-epoch (kill -9) resuming bit for bit.

Models are tiny and runs short (the issue's budget: 90 s on a quiet machine)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import QUIET, Run, load_ckpt, run_tagged, tests_on_path
from text_corpus import write_corpus

from ddp_exp.data.example_text import write_chinese_corpus

RUN = ("experiment=gpt_tokens", "data.block_size=32", "optim.lr=0.01",
       "scheduler.warmup_steps=5", QUIET)
TINY = (*RUN, "model.n_layer=1", "model.n_embd=32", "model.n_head=2")


def ddp_exp(cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m ddp_exp ARGS`` in ``cwd``; no process outlives it."""
    proc, _ = run_tagged([sys.executable, "-m", "ddp_exp", *args], cwd, uuid.uuid4().hex,
                         timeout)
    return proc


def train(cwd: Path, job: str, *overrides: str, base: tuple[str, ...] = TINY) -> Run:
    proc = ddp_exp(cwd, *base, *overrides, f"hydra.run.dir={cwd / job}")
    return Run(proc.returncode, proc.stdout, proc.stderr, cwd / job, 0.0).ok()


def text_samples(job_dir: Path) -> list[str]:
    """The TensorBoard text samples, without the markdown's 4-space code indent."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(job_dir / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    texts = [e.tensor_proto.string_val[0].decode("utf-8")
             for e in acc.Tensors("samples/text_summary")]
    return ["\n".join(line[4:] for line in text.split("\n")) for text in texts]


def unigram_entropy(ids: np.ndarray) -> float:
    """Nats per token of the best unigram model of ``ids`` themselves."""
    p = np.bincount(ids).astype(float)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum())


@pytest.mark.slow
def test_prepare_train_and_sample_a_folder_of_text(tmp_path):
    write_corpus(tmp_path / "corpus", documents=70)
    proc = ddp_exp(tmp_path, "prepare", "corpus", "--out", "prepared", "--tokenizer", "bpe",
                   "--vocab-size", "2000")
    assert proc.returncode == 0, proc.stderr
    assert "train with python -m ddp_exp experiment=gpt_tokens data.path=prepared" in proc.stdout
    meta = json.loads((tmp_path / "prepared" / "meta.json").read_text())
    run = train(tmp_path, "run", "data.path=prepared", "trainer.epochs=1", "world_size=1")
    m = run.metrics
    val = np.fromfile(tmp_path / "prepared" / "val.bin", dtype=meta["dtype"])
    assert m["val/loss"] < unigram_entropy(val) - 0.5
    assert m["val/num_samples"] == (len(val) - 1) // 32 * 32
    assert 0 < m["val/bits_per_byte"] < m["val/loss"] / math.log(2)  # tokens hold > 1 byte
    samples = text_samples(run.job_dir)
    assert samples and "\ufffd" not in samples[0]
    # ddp-exp sample: seeded, decoded with the run's tokenizer, the prompt first
    first = ddp_exp(tmp_path, "sample", "run", "--seed", "1", "--prompt", "the quick",
                    "--max-new-tokens", "30")
    again = ddp_exp(tmp_path, "sample", "run", "--seed", "1", "--prompt", "the quick",
                    "--max-new-tokens", "30")
    other = ddp_exp(tmp_path, "sample", "run", "--seed", "2", "--prompt", "the quick",
                    "--max-new-tokens", "30", "--checkpoint", "last")
    assert first.returncode == again.returncode == other.returncode == 0, first.stderr
    assert first.stdout == again.stdout and first.stdout.startswith("the quick")
    assert other.stdout != first.stdout
    # world_size 3 with the same global batch: the same windows, the same validation
    one = train(tmp_path, "ws1", "data.path=prepared", "trainer.max_steps=6", "world_size=1",
                "data.batch_size=12", "optim=sgd", "optim.lr=0.5", "trainer.save_last=false",
                "trainer.sample_every_n_epochs=0")
    three = train(tmp_path, "ws3", "data.path=prepared", "trainer.max_steps=6", "world_size=3",
                  "data.batch_size=4", "optim=sgd", "optim.lr=0.5", "trainer.save_last=false",
                  "trainer.sample_every_n_epochs=0")
    for key in ("val/loss", "val/bits_per_byte", "train/epoch_loss"):
        assert one.metrics[key] == pytest.approx(three.metrics[key], rel=1e-6), key
    assert one.metrics["val/num_samples"] == three.metrics["val/num_samples"]
    # kill -9 of the world of 3 mid-epoch, once the step-4 checkpoint is on disk (a step
    # checkpoint lands during the next step), resumed:
    # the uninterrupted world's weights, bit for bit
    killed_job = tmp_path / "killed"
    common = (*TINY, "data.path=prepared", "trainer.max_steps=6", "world_size=3",
              "data.batch_size=4", "optim=sgd", "optim.lr=0.5", "trainer.save_last=false",
              "trainer.sample_every_n_epochs=0", "trainer.checkpoint_every_n_steps=2",
              "launcher.max_restarts=0", "model._target_=test_val_every_n_steps.StepKilledGPT",
              f"hydra.run.dir={killed_job}")
    kill = ("+model.kill_at=6", "+model.after_step=4",  # step 4 lands during step 5
            f"+model.after_checkpoint={killed_job / 'checkpoints' / 'last.pt'}")
    killed, _ = run_tagged([sys.executable, "-m", "ddp_exp", *common, *kill], tmp_path,
                           uuid.uuid4().hex, 240, tests_on_path())
    assert killed.returncode != 0 and not (killed_job / "metrics.json").exists(), killed.stdout
    resumed, _ = run_tagged([sys.executable, "-m", "ddp_exp", *common, "trainer.resume=auto"],
                            tmp_path, uuid.uuid4().hex, 240, tests_on_path())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ": step 4, inside epoch 1" in resumed.stdout, resumed.stdout
    got, want = (load_ckpt(d / "model.pt") for d in (killed_job, three.job_dir))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_chinese_bytes_sample_decodes_with_no_replacement_character(tmp_path):
    """A barely trained byte-level model writes ill-formed UTF-8; the sample still decodes
    to valid text with no U+FFFD, in TensorBoard and from ddp-exp sample."""
    write_chinese_corpus(str(tmp_path / "zh"), documents=60)
    assert ddp_exp(tmp_path, "prepare", "zh", "--out", "zh_bytes", "--tokenizer",
                   "bytes").returncode == 0
    run = train(tmp_path, "run", "data.path=zh_bytes", "trainer.max_steps=15", "world_size=1",
                "trainer.limit_val_batches=2", "trainer.sample_prompt='今天'")
    samples = text_samples(run.job_dir)
    assert samples and "\ufffd" not in samples[0] and "今天" in samples[0]
    proc = ddp_exp(tmp_path, "sample", "run", "--seed", "1", "--prompt", "我们",
                   "--max-new-tokens", "200", "--temperature", "1.5")
    assert proc.returncode == 0, proc.stderr
    proc.stdout.encode("utf-8")  # valid UTF-8
    assert proc.stdout.startswith("我们") and "\ufffd" not in proc.stdout


@pytest.mark.slow
def test_a_hugging_face_gpt2_trains_samples_and_is_sampled(tmp_path):
    """F09: transformers' GPT2LMHeadModel by _target_: the per-epoch sample (our loop over its
    logits, not its own generate) is in TensorBoard, the run ends with model.pt, and
    ddp-exp sample works on it."""
    pytest.importorskip("transformers")
    run = train(tmp_path, "run", "world_size=1", "trainer.max_steps=8",
                "trainer.limit_val_batches=2", "model._target_=transformers.GPT2LMHeadModel",
                "+model.config._target_=transformers.GPT2Config", "+model.config.n_layer=1",
                "+model.config.n_head=2", "+model.config.n_embd=32",
                "+model.config.vocab_size=256", "+model.config.n_positions=32", base=RUN)
    assert (run.job_dir / "model.pt").is_file() and "no text sample" not in run.stderr
    assert text_samples(run.job_dir)[0].startswith("The ")
    proc = ddp_exp(tmp_path, "sample", "run", "--seed", "3", "--max-new-tokens", "20",
                   "--top-k", "5")
    assert proc.returncode == 0 and proc.stdout.startswith("The "), proc.stderr


@pytest.mark.slow
def test_subcommands_refuse_bad_input_in_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    (tmp_path / "blob.txt").write_bytes(bytes(range(256)))
    (tmp_path / "run").mkdir()
    cases = {
        ("prepare", "empty", "--out", "o", "--tokenizer", "bytes"): "no text (empty sources)",
        ("prepare", "blob.txt", "--out", "o"): "blob.txt: a binary file",
        ("prepare", "blob.txt", "--out", "o", "--vocab-size", "300"):
            "--vocab-size=300 is invalid",
        ("sample", "run"): "run: no checkpoint to sample from",
        # checked before the run is read (they failed inside torch: a traceback, exit 1)
        ("sample", "run", "--top-k", "-1"): "--top-k=-1 is invalid: 0 or more",
        ("sample", "run", "--temperature", "nan"): "--temperature=nan is invalid: a finite",
        # a mistyped command (Hydra's three lines about a missing '=')
        ("prepar", "empty"): "'prepar' is no command and no override: ddp-exp takes one of "
                             "prepare, rerun, runs, sample, or Hydra overrides key=value",
        ("prepare", "empty"): "ddp-exp prepare: the following arguments are required: --out",
        (*TINY, "data.path=empty", f"hydra.run.dir={tmp_path / 'job'}"):
            "/empty is a folder without meta.json",
    }
    for args, line in cases.items():
        proc = ddp_exp(tmp_path, *args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.startswith("error: ") and line in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "o").exists()
