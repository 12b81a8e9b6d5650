"""Issue 26 item 1 (cases R02, R10): a resumed run's schedule is rebuilt from the new config
and continued over the new run's length (epochs, world size, batch size, accumulation) to the
end an uninterrupted run with the new settings reaches; a schedule that cannot is refused before
any rank starts, in one line.

Expected values come from elsewhere than the code under test: the cosine written out
(:func:`test_recipe.cosine_lr`), ``lr * gamma ** (steps // step_size)`` for the step decay,
torch's own ``OneCycleLR`` built over the new length, or an uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    QUIET,
    copy_job,
    cosine_lr,
    folder_files,
    load_ckpt,
    refused_before_ranks,
    shared_run,
    tensorboard_series,
)
from omegaconf import OmegaConf

LR = 0.05  # optim.lr of conf/optim/sgd.yaml, unscaled (lr_scaling: none)
PER_EPOCH = {1: 47, 2: 24}  # digits: 1500 training samples, data.batch_size=32, by world size
ONE_CYCLE = ("scheduler._target_=torch.optim.lr_scheduler.OneCycleLR", "+scheduler.max_lr=0.1")


def one_cycle_lrs(total: int) -> list[float]:
    """The lr of optimizer steps 1..total of torch's OneCycleLR(max_lr=0.1) over ``total``."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=total)
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


# ------------------------------------------------------------------ in process: every scheduler
def _plain(compose, world_size: int, *overrides: str) -> dict:
    plain = OmegaConf.to_container(compose(*overrides), resolve=True)
    plain["world_size"] = world_size
    return plain


def _params() -> torch.nn.ParameterList:
    return torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(2))])


def _loop(cfg: dict) -> SimpleNamespace:
    """What the rank's loop (ddp_exp.train.loop.Trainer) holds of the optimizer and the schedule,
    built as it builds them from ``cfg``, for :func:`ddp_exp.train.state.load_state_dict`."""
    from ddp_exp.config.view import rank_config
    from ddp_exp.train import schedule
    from ddp_exp.train.monitor import Monitor
    from ddp_exp.train.optimizer import build_optimizer

    per_epoch = PER_EPOCH[cfg["world_size"]]
    model = _params()
    view = rank_config(cfg)
    optimizer = build_optimizer(view, model.parameters())
    run_steps = schedule.total_steps(cfg["trainer"]["epochs"], cfg["trainer"]["max_steps"],
                                     per_epoch)
    scheduler, interval = schedule.build_scheduler(cfg["scheduler"], optimizer, run_steps,
                                                   per_epoch)
    return SimpleNamespace(
        cfg=view, model=model, optimizer=optimizer, scheduler=scheduler,
        step_scheduler=scheduler if interval == "step" else None, run_steps=run_steps,
        steps_per_epoch=per_epoch, scaler=None, monitor=Monitor(None, None, None), epoch=0,
        global_step=0, world=SimpleNamespace(world_size=cfg["world_size"], rank=0),
        device=torch.device("cpu"), step_lr=optimizer.param_groups[0]["lr"])


def _run_epochs(loop: SimpleNamespace, epochs: int, metric: float) -> list[float]:
    """Train ``epochs`` epochs of ``loop``'s steps (no gradients: the rate is what is looked
    at); returns the lr of every optimizer step (of every epoch for a per-epoch scheduler)."""
    from ddp_exp.train import schedule

    lrs = []
    for _ in range(epochs):
        if loop.scheduler is not None and loop.step_scheduler is None:
            lrs.append(loop.optimizer.param_groups[0]["lr"])
        for _ in range(loop.steps_per_epoch):
            if loop.global_step == loop.cfg.trainer.max_steps:
                return lrs
            if loop.step_scheduler is not None or loop.scheduler is None:
                lrs.append(loop.optimizer.param_groups[0]["lr"])
            loop.optimizer.step()
            loop.global_step += 1
            if loop.step_scheduler is not None:
                loop.step_scheduler.step()
        if loop.scheduler is not None and loop.step_scheduler is None:
            schedule.step_epoch(loop.scheduler, {"val/loss": metric}, "val/loss")
        loop.epoch += 1
    return lrs


def _checkpoint(cfg: dict, epochs_done: int, metric: float = 1.0) -> dict:
    """What the loop's checkpoint holds of the model, optimizer and schedule after
    ``epochs_done`` epochs of the run ``cfg`` (a per-epoch scheduler stepped with ``metric``
    after each)."""
    loop = _loop(cfg)
    _run_epochs(loop, epochs_done, metric)
    return {"model": loop.model.state_dict(), "optimizer": loop.optimizer.state_dict(),
            "epoch": epochs_done - 1, "global_step": loop.global_step, "config": cfg,
            "monitor": None, "scheduler": None if loop.scheduler is None
            else loop.scheduler.state_dict()}


def _resumed_lrs(cfg: dict, state: dict, metric: float = 1.0) -> list[float]:
    """The lr of every optimizer step (per epoch: of every epoch) of the run ``cfg`` resumed
    from ``state`` as a rank resumes (:func:`ddp_exp.train.state.load_state_dict`)."""
    from ddp_exp.train import state as train_state

    loop = _loop(cfg)
    train_state.load_state_dict(loop, state, "last.pt")
    return _run_epochs(loop, cfg["trainer"]["epochs"] - loop.epoch, metric)


COSINE = ("scheduler=cosine", "scheduler.warmup_steps=5", "scheduler.min_lr=0.001")


@pytest.mark.parametrize(("before", "after"), [
    ((2, 2), (1, 4)),  # R10: 2 epochs at world_size=2, to 4 at world_size=1 (24 -> 47 a epoch)
    ((1, 2), (2, 3)),  # more ranks: fewer steps in all than the checkpoint has taken
    ((2, 4), (2, 3)),  # shorter: a 4-epoch run stopped after 2, resumed to 3
])
def test_cosine_continues_over_the_new_length_to_min_lr(compose, before, after):
    """The resumed steps are the last steps of the new length's cosine: it ends at min_lr."""
    (ws0, epochs0), (ws1, epochs1) = before, after
    state = _checkpoint(_plain(compose, ws0, *COSINE, f"trainer.epochs={epochs0}"), 2)
    lrs = _resumed_lrs(_plain(compose, ws1, *COSINE, f"trainer.epochs={epochs1}"), state)
    total = epochs1 * PER_EPOCH[ws1]
    start = 2 * PER_EPOCH[ws1]
    assert lrs == pytest.approx([cosine_lr(k, LR, 5, total, 0.001)
                                 for k in range(start + 1, total + 1)], rel=1e-12)
    assert lrs[-1] == pytest.approx(0.001, rel=1e-12)


def test_max_steps_after_a_world_change_ends_the_cosine_at_the_last_step(compose):
    """trainer.max_steps counts the run's steps, the checkpoint's 48 included: at
    world_size=1 with max_steps=100 the run takes 52 more, the new world's steps 95-146, and
    the cosine reaches min_lr at the last of them."""
    state = _checkpoint(_plain(compose, 2, *COSINE, "trainer.epochs=2"), 2)
    lrs = _resumed_lrs(_plain(compose, 1, *COSINE, "trainer.epochs=4", "trainer.max_steps=100"),
                       state)
    assert lrs == pytest.approx([cosine_lr(k, LR, 5, 146, 0.001) for k in range(95, 147)],
                                rel=1e-12)


def test_a_schedule_key_changed_on_resume_governs(compose):
    """warmup_steps and min_lr of the resumed config, not the checkpoint's."""
    state = _checkpoint(_plain(compose, 2, *COSINE, "trainer.epochs=4"), 1)
    cfg = _plain(compose, 2, "scheduler=cosine", "scheduler.warmup_steps=30",
                 "scheduler.min_lr=0.01", "trainer.epochs=4")
    lrs = _resumed_lrs(cfg, state)
    assert lrs == pytest.approx([cosine_lr(k, LR, 30, 96, 0.01) for k in range(25, 97)],
                                rel=1e-12)


def test_step_decay_follows_the_new_steps_per_epoch(compose):
    """scheduler=step per optimizer step: its step size is step_size_epochs x the new world's
    steps per epoch (47), not the checkpoint's (24): the rate halves once per epoch."""
    step = ("scheduler=step", "scheduler.step_size_epochs=1", "scheduler.gamma=0.5",
            "scheduler.interval=step")
    state = _checkpoint(_plain(compose, 2, *step, "trainer.epochs=2"), 2)
    lrs = _resumed_lrs(_plain(compose, 1, *step, "trainer.epochs=4"), state)
    assert lrs == pytest.approx([LR * 0.5 ** ((k - 1) // 47) for k in range(95, 189)],
                                rel=1e-12)


def test_step_size_changed_on_resume_governs(compose):
    """scheduler.step_size_epochs=3 on resume (the checkpoint's run had 1): epoch e (0-based)
    runs at lr * 0.5 ** (e // 3)."""
    state = _checkpoint(_plain(compose, 2, "scheduler=step", "scheduler.step_size_epochs=1",
                               "scheduler.gamma=0.5", "trainer.epochs=2"), 2)
    lrs = _resumed_lrs(_plain(compose, 2, "scheduler=step", "scheduler.step_size_epochs=3",
                              "scheduler.gamma=0.5", "trainer.epochs=5"), state)
    assert lrs == pytest.approx([LR * 0.5 ** (e // 3) for e in range(2, 5)], rel=1e-12)


@pytest.mark.parametrize(("before", "after"), [((2, 2), (2, 4)), ((2, 4), (2, 3)),
                                               ((2, 2), (1, 4))])
def test_one_cycle_is_rebuilt_over_the_new_length(compose, before, after):
    """R02: OneCycleLR's total_steps is the resumed run's, longer or shorter or on another
    world: its steps are torch's OneCycleLR over the new length, from the epoch boundary."""
    (ws0, epochs0), (ws1, epochs1) = before, after
    state = _checkpoint(_plain(compose, ws0, *ONE_CYCLE, f"trainer.epochs={epochs0}"), 2)
    lrs = _resumed_lrs(_plain(compose, ws1, *ONE_CYCLE, f"trainer.epochs={epochs1}"), state)
    want = one_cycle_lrs(epochs1 * PER_EPOCH[ws1])[2 * PER_EPOCH[ws1]:]
    assert lrs == pytest.approx(want, rel=1e-12)


def test_plateau_keeps_its_progress_under_the_new_keys(compose):
    """ReduceLROnPlateau: the rate it reduced to and its bad epochs continue; a factor changed
    on resume is the one that reduces next."""
    plateau = ("scheduler._target_=torch.optim.lr_scheduler.ReduceLROnPlateau",
               "scheduler.interval=epoch", "+scheduler.patience=0")
    # val/loss 1.0 each epoch: epoch 1 sets best, epoch 2 is bad -> lr * 0.5
    state = _checkpoint(_plain(compose, 2, *plateau, "+scheduler.factor=0.5",
                               "trainer.epochs=2"), 2)
    assert state["optimizer"]["param_groups"][0]["lr"] == pytest.approx(LR * 0.5)
    lrs = _resumed_lrs(_plain(compose, 1, *plateau, "+scheduler.factor=0.1", "trainer.epochs=4"),
                       state)
    assert lrs == pytest.approx([LR * 0.5, LR * 0.5 * 0.1], rel=1e-12)


def test_plateau_rate_follows_the_new_worlds_scaling(compose):
    """optim.lr_scaling=linear, 2 ranks to 1: the rate ReduceLROnPlateau had reduced to (half
    of 0.05) is rescaled to the new world's base (0.025): 0.0125."""
    plateau = ("scheduler._target_=torch.optim.lr_scheduler.ReduceLROnPlateau",
               "scheduler.interval=epoch", "+scheduler.patience=0", "+scheduler.factor=0.5",
               "optim.lr_scaling=linear")
    state = _checkpoint(_plain(compose, 2, *plateau, "trainer.epochs=2"), 2)
    lrs = _resumed_lrs(_plain(compose, 1, *plateau, "trainer.epochs=3"), state)
    assert lrs == pytest.approx([LR / 2 * 0.5], rel=1e-12)


def test_the_learning_rate_is_the_new_configs(compose):
    """scheduler=none: optim.lr_scaling=linear on a world of another size, and an optim.lr
    changed on resume, give the new config's rate (the checkpoint's is the old world's)."""
    state = _checkpoint(_plain(compose, 2, "optim.lr_scaling=linear", "trainer.epochs=2"), 2)
    assert state["optimizer"]["param_groups"][0]["lr"] == pytest.approx(LR)  # 64 = reference
    lrs = _resumed_lrs(_plain(compose, 1, "optim.lr_scaling=linear", "trainer.epochs=3"), state)
    assert lrs == pytest.approx([LR / 2] * 47, rel=1e-12)
    lrs = _resumed_lrs(_plain(compose, 2, "optim.lr=0.01", "trainer.epochs=3"), state)
    assert lrs == pytest.approx([0.01] * 24, rel=1e-12)


def test_a_total_steps_shorter_than_the_run_is_refused_before_ranks(compose, tmp_path):
    """OneCycleLR with its own scheduler.total_steps=48 on a 96-step run: one line naming the
    key, before any rank (torch raised 'Tried to step 49 times' inside every rank)."""
    cfg = compose("world_size=2", "trainer.epochs=4", *ONE_CYCLE, "+scheduler.total_steps=48")
    message = refused_before_ranks(cfg, tmp_path / "run")
    assert "scheduler.total_steps=48" in message and "96 optimizer step(s)" in message, message


# ------------------------------------------------------------------------- the CLI, end to end
def _lrs_after(job_dir: Path, step: int) -> list[tuple[int, float]]:
    """``train/lr`` of the resumed steps (after global step ``step``), as TensorBoard shows."""
    return [(s, v) for s, v in tensorboard_series(job_dir, "train/lr") if s > step]


def assert_curve(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> None:
    """The same steps, the same values to float32 (TensorBoard's scalars) precision."""
    assert [s for s, _ in got] == [s for s, _ in want]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)


@pytest.mark.slow
def test_r10_cosine_resumed_on_one_rank_ends_at_min_lr(run_cli):
    """R10: 2 epochs at world_size=2, then 4 at world_size=1: the last lr is min_lr and the
    resumed steps follow the 188-step cosine of a world_size=1 run from its step 94; the
    launcher says where the schedule continues."""
    common = (QUIET, "scheduler=cosine", "scheduler.min_lr=0.001", "trainer.log_every_n_steps=1")
    run_cli("world_size=2", "trainer.epochs=2", *common).ok()
    resumed = run_cli("world_size=1", "trainer.epochs=4", "trainer.resume=auto", *common).ok()
    lrs = _lrs_after(resumed.job_dir, 48)
    assert [s for s, _ in lrs] == list(range(49, 143))
    for s, v in lrs:  # global step s is step s + 46 of the new run's 188
        assert v == pytest.approx(cosine_lr(s + 46, LR, 0, 188, 0.001), rel=1e-6), s
    assert lrs[-1][1] == pytest.approx(0.001, rel=1e-6)
    assert "continued at step 94 of 188" in resumed.stderr + resumed.stdout


@pytest.mark.slow
def test_step_schedule_resumed_follows_the_new_world_and_keys(run_cli, tmp_path):
    """scheduler=step per optimizer step, 2 epochs at world_size=2: resumed at world_size=1 the
    rate halves at each epoch boundary of 47 steps (not every 24); resumed with
    scheduler.step_size_epochs=2 it halves every 2 epochs (the checkpoint's 1 does not
    return)."""
    step = (QUIET, "scheduler=step", "scheduler.gamma=0.5", "scheduler.interval=step",
            "trainer.log_every_n_steps=1")
    base = run_cli("world_size=2", "trainer.epochs=2", "scheduler.step_size_epochs=1", *step,
                   job="base").ok()
    other = tmp_path / "other"
    copy_job(base, tmp_path)
    (tmp_path / "run").rename(other)
    copy_job(base, tmp_path)
    one_rank = run_cli("world_size=1", "trainer.epochs=4", "trainer.resume=auto",
                       "scheduler.step_size_epochs=1", *step).ok()
    assert_curve(_lrs_after(one_rank.job_dir, 48),
                 [(s, LR * 0.5 ** ((s + 46 - 1) // 47)) for s in range(49, 143)])
    wider = run_cli("world_size=2", "trainer.epochs=4", "trainer.resume=auto",
                    "scheduler.step_size_epochs=2", *step, job="other").ok()
    assert_curve(_lrs_after(wider.job_dir, 48),
                 [(s, LR * 0.5 ** ((s - 1) // 48)) for s in range(49, 97)])


@pytest.fixture(scope="module")
def one_cycle_4_epochs(tmp_path_factory):
    """OneCycleLR at world_size=2 for 4 epochs in one go, every epoch's checkpoint kept."""
    return shared_run(tmp_path_factory, "world_size=2", "trainer.epochs=4",
                      *ONE_CYCLE, QUIET, "trainer.log_every_n_steps=1",
                      "trainer.checkpoint_every_n_epochs=1", "trainer.keep_checkpoints=4")


@pytest.fixture(scope="module")
def one_cycle_2_epochs(tmp_path_factory):
    """The same for 2 epochs."""
    return shared_run(tmp_path_factory, "world_size=2", "trainer.epochs=2",
                      *ONE_CYCLE, QUIET, "trainer.log_every_n_steps=1")


@pytest.mark.slow
def test_r02_one_cycle_resumed_longer_equals_the_uninterrupted_run(
        run_cli, tmp_path, one_cycle_2_epochs, one_cycle_4_epochs):
    """R02: 2 epochs of OneCycleLR (a 48-step cycle), resumed with trainer.epochs=4, trains
    (was: exit 1 in the ranks, 'Tried to step 49 times') and its steps 49-96 run at the lr of
    the 4-epoch run in one go, the second half of torch's 96-step cycle."""
    copy_job(one_cycle_2_epochs, tmp_path)
    resumed = run_cli("world_size=2", "trainer.epochs=4", "trainer.resume=auto", *ONE_CYCLE,
                      QUIET, "trainer.log_every_n_steps=1").ok()
    want = _lrs_after(one_cycle_4_epochs.job_dir, 48)
    assert_curve(_lrs_after(resumed.job_dir, 48), want)
    assert_curve(want, [(s, v) for s, v in enumerate(one_cycle_lrs(96), start=1) if s > 48])
    assert resumed.metrics["global_step"] == 96


@pytest.mark.slow
def test_r02_one_cycle_resumed_shorter_ends_its_cycle(run_cli, one_cycle_4_epochs):
    """From epoch 2 of the 4-epoch run, to 3 epochs: the cycle is rebuilt over 72 steps and
    ends where torch's 72-step OneCycleLR ends (was: the 96-step cycle, cut at step 72)."""
    source = one_cycle_4_epochs.job_dir / "checkpoints" / "epoch_0001.pt"
    assert load_ckpt(source)["global_step"] == 48
    resumed = run_cli("world_size=2", "trainer.epochs=3", f"trainer.resume={source}",
                      *ONE_CYCLE, QUIET, "trainer.log_every_n_steps=1").ok()
    want = one_cycle_lrs(72)
    assert_curve(_lrs_after(resumed.job_dir, 48), [(s, want[s - 1]) for s in range(49, 73)])


@pytest.mark.slow
def test_resume_that_cannot_continue_is_refused_or_done(run_cli, tmp_path, one_cycle_2_epochs):
    """A scheduler.total_steps too short for the resumed run: one line, exit 2, the folder as
    it was. A trainer.max_steps the checkpoint has reached: nothing left to train, exit 0,
    the folder as it was (was: one more step and a partial epoch)."""
    job = copy_job(one_cycle_2_epochs, tmp_path)
    before = folder_files(job)
    refused = run_cli("world_size=2", "trainer.epochs=4", "trainer.resume=auto", *ONE_CYCLE,
                      "+scheduler.total_steps=48", QUIET)
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "scheduler.total_steps=48" in lines[0], refused.stderr
    assert folder_files(job) == before
    done = run_cli("world_size=2", "trainer.epochs=4", "trainer.resume=auto", *ONE_CYCLE,
                   "trainer.max_steps=40", QUIET)
    assert done.returncode == 0 and "nothing left to train" in done.stderr, done.stderr
    assert "trainer.max_steps=40" in done.stderr
    assert folder_files(job) == before

