"""Issue 39, item 4: ``trainer.val_every_n_steps``: validation at global steps 25, 50, 75, 100
(TensorBoard and the log), the same values at world sizes 1 and 2 with the same global batch,
the same steps and values after a kill between two validations and a resume, ``best.pt``
holding the best validation step's weights, early stopping counted in validations.

One tiny GPT on the built-in corpus; SGD at a constant rate (cross-world runs compare at 1e-6
with SGD: AdamW amplifies float noise across world sizes), validation capped at 64 windows."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from helpers import QUIET, load_ckpt, rel_close, scalars, tensorboard_series, tests_on_path

from ddp_exp.data import tokens as tk
from ddp_exp.train.gpt import GPT

COMMON = ("experiment=gpt_tokens", "data.global_batch_size=32", "data.block_size=16",
          "optim=sgd", "scheduler.warmup_steps=0", "trainer.limit_val_batches=2",
          "trainer.val_every_n_steps=25",
          "trainer.max_steps=100", "trainer.sample_every_n_epochs=2", "launcher.max_restarts=0",
          QUIET)
STEPS = [25, 50, 75, 100]
# SGD at a constant 0.05 keeps world sizes within float noise (AdamW would not); at 0.3 the
# loss jumps about (a best validation before the last: best.pt's test)
STEADY = ("optim.lr=0.05", "scheduler.min_lr=0.05")
JUMPY = ("optim.lr=0.3", "scheduler.min_lr=0.3")


class StepKilledGPT(GPT):
    """``model=gpt`` whose rank 1 SIGKILLs itself at its training forward ``kill_at`` (0:
    never) once ``after_checkpoint`` holds a step checkpoint of global step ``after_step`` or
    later. The same modules and seeded weights as :class:`GPT`."""

    def __init__(self, input_shape, num_outputs, kill_at: int = 0,
                 after_checkpoint: str | None = None, after_step: int = 0, **gpt):
        super().__init__(input_shape, num_outputs, **gpt)
        self.kill_at, self.after_checkpoint, self.after_step = kill_at, after_checkpoint, after_step
        self.calls = 0

    def forward(self, idx):
        if self.training and "RANK" in os.environ:
            self.calls += 1
            if self.calls == self.kill_at and os.environ["RANK"] == "1":
                import time

                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    try:
                        if torch.load(self.after_checkpoint,
                                      weights_only=True)["global_step"] >= self.after_step:
                            break
                    except (OSError, RuntimeError, KeyError):
                        pass
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(idx)


def model_args(config_dir, **options) -> list[str]:
    """The overrides making the model a 1-layer, width-16 :class:`StepKilledGPT` (after
    ``experiment=gpt_tokens``, which chooses ``model=gpt``); ``config_dir`` is unused."""
    del config_dir
    return ["model._target_=test_val_every_n_steps.StepKilledGPT", "model.n_layer=1",
            "model.n_head=2", "model.n_embd=16",
            *(f"+model.{k}={v}" for k, v in options.items())]


def val_points(run) -> list[tuple[int, float]]:
    return scalars(run.job_dir, "val/loss")


@pytest.mark.slow
@pytest.mark.float_sensitive
@pytest.mark.timeout(1200)  # three short runs; on a loaded 2-core machine minutes each
def test_validation_every_n_steps_across_worlds_and_a_kill(run_cli, tmp_path):
    env = tests_on_path()
    one = run_cli(*COMMON, *model_args(tmp_path / "c1"), *STEADY, "world_size=1", job="ws1",
                  timeout=600, env=env).ok()
    a = val_points(one)
    assert [s for s, _ in a] == STEPS
    for step, value in a:  # the log says the same
        assert f"step {step} (epoch 1) | val/loss {value:.4f}" in one.stdout, one.stdout
    assert len(tensorboard_series(one.job_dir, "val/loss")) == 4  # none more at the epoch end
    # world_size 2 (the same global batch), killed between the validations of steps 50 and
    # 75 (step checkpoints every 10 steps) and resumed: the same validation steps and values
    # (the first two from the killed attempt's events) as the uninterrupted world of 1
    job = tmp_path / "killed"
    killed = run_cli(*COMMON, *model_args(tmp_path / "c3", kill_at=66, after_step=60,
                                 after_checkpoint=str(job / "checkpoints" / "last.pt")),
                     *STEADY, "world_size=2",
                     "trainer.checkpoint_every_n_steps=10", job="killed", env=env, timeout=600)
    assert killed.returncode != 0 and not (job / "metrics.json").exists()
    assert load_ckpt(job / "checkpoints" / "last.pt")["global_step"] == 60
    resumed = run_cli(*COMMON, *model_args(tmp_path / "c3"), *STEADY, "world_size=2",
                      "trainer.checkpoint_every_n_steps=10", "trainer.resume=auto",
                      job="killed", env=env, timeout=600).ok()
    got = tensorboard_series(resumed.job_dir, "val/loss")
    assert [s for s, _ in got] == STEPS
    for (_, x), (_, y) in zip(got, a, strict=True):
        assert rel_close(x, y, 1e-6), (got, a)
    assert "step 50 (epoch 1)" not in resumed.stdout and "step 75 (epoch 1)" in resumed.stdout
    assert resumed.metrics["best/step"] == one.metrics["best/step"]


@pytest.mark.slow
def test_early_stopping_counts_validations_and_best_pt_holds_the_best_step(run_cli, tmp_path):
    """Patience 1 with SGD at a rate that makes val/loss rise at some validation: the run
    stops right after the first validation without improvement, inside the epoch; best.pt
    holds the weights of the validation before (scored here on the same 64 windows)."""
    run = run_cli(*COMMON, *model_args(tmp_path / "c"), *JUMPY, "world_size=1",
                  "trainer.early_stopping_patience=1", env=tests_on_path(),
                  timeout=600).ok()
    points = val_points(run)
    worse = next(i for i in range(1, len(points)) if points[i][1] >= points[i - 1][1])
    assert [s for s, _ in points] == STEPS[:worse + 1]
    m = run.metrics
    assert m["stopped_early"] is True and m["global_step"] == STEPS[worse]
    assert "has not improved (min) for 1 validation(s)" in run.stdout
    a = points
    # best.pt: the best validation step's weights, scored here on the same 64 windows
    best_step, best_value = min(a, key=lambda p: p[1])
    assert m["best/step"] == best_step and rel_close(m["best/val/loss"], best_value, 1e-6)
    assert best_step != m["global_step"]  # not the last weights: the test means something
    state = load_ckpt(run.job_dir / "checkpoints" / "best.pt")
    assert state["global_step"] == best_step and state["resumable"] is False
    model = GPT((16,), 256, n_layer=1, n_head=2, n_embd=16)
    model.load_state_dict(state["model"])
    splits = tk.split_stream(tk.load_tokens(None, block_size=16), None, 0, seed=0)
    x, y = splits.val.batch(list(range(64)))
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(),
                                                 reduction="sum").double() / y.numel()
    assert rel_close(float(loss), best_value, 1e-5), (float(loss), best_value)


@pytest.mark.slow
def test_any_data_validates_by_steps(run_cli):
    """data=digits (the default job): validation at steps 10, 20, 30 across an epoch's end
    (47 steps per epoch at world_size 1), none more at the epoch's end."""
    run = run_cli("world_size=1", "trainer.max_steps=30", "trainer.val_every_n_steps=10",
                  QUIET).ok()
    assert [s for s, _ in scalars(run.job_dir, "val/accuracy")] == [10, 20, 30]
    assert run.metrics["global_step"] == 30 and run.metrics["best/step"] in (10, 20, 30)


def test_val_every_n_steps_is_positive_or_null():
    from ddp_exp.config.errors import ConfigError
    from ddp_exp.config.schema import TrainerConfig

    assert TrainerConfig(val_every_n_steps=None).val_every_n_steps is None
    with pytest.raises(ConfigError, match=r"trainer.val_every_n_steps=0 is invalid: null \(after "
                                          r"each epoch\) or a positive number of optimizer steps"):
        TrainerConfig(val_every_n_steps=0)
