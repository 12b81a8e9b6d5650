"""Your own ``_target_`` from the command line (issue 26 item 7): overriding a packaged option's
target drops the replaced class's arguments and keeps what the new one accepts or the user
typed; your own model trains; a data YAML extending ``dataset`` takes its own arguments."""

from __future__ import annotations

import logging

import pytest
import torch

from ddp_exp.config.checks import validate
from ddp_exp.launch import user_input

TINY_NET = """\
import math

import torch.nn as nn


class TinyNet(nn.Module):
    def __init__(self, input_shape, num_outputs, width=16):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width),
                                 nn.ReLU(), nn.Linear(width, num_outputs))

    def forward(self, x):
        return self.net(x)
"""

MY_DATA = """\
import torch
from torch.utils.data import TensorDataset


def make(size=100):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(size, 4, generator=g)
    return TensorDataset(x, (x.sum(1) > 0).long())
"""


# ----------------------------------------------------------- item 7: your own _target_
def test_a_target_override_drops_the_replaced_options_arguments(compose, tmp_path, monkeypatch,
                                                                caplog):
    """Regression (V02): ``model._target_=mymodel.TinyNet`` passed model=mlp's hidden_sizes
    and dropout to TinyNet ("unexpected keyword argument 'hidden_sizes'"), and
    ``~model.hidden_sizes`` is refused by the schema. A _target_ override drops the replaced
    option's arguments that the new target does not accept, for every group, and says so."""
    (tmp_path / "mymodel.py").write_text(TINY_NET)
    (tmp_path / "mydata.py").write_text(MY_DATA)
    monkeypatch.syspath_prepend(str(tmp_path))
    caplog.set_level(logging.INFO, logger="ddp_exp")
    cases = [
        (["model._target_=mymodel.TinyNet", "+model.width=8"], "model",
         {"_target_": "mymodel.TinyNet", "width": 8}, ["hidden_sizes", "dropout"]),
        (["optim._target_=torch.optim.Adam"], "optim",
         {"_target_": "torch.optim.Adam", "_partial_": True, "lr": 0.05, "lr_scaling": "none",
          "reference_batch_size": 64, "weight_decay": 0.0}, ["momentum", "nesterov"]),
        (["scheduler=cosine", "scheduler._target_=torch.optim.lr_scheduler.ExponentialLR",
          "+scheduler.gamma=0.9"], "scheduler",
         {"_target_": "torch.optim.lr_scheduler.ExponentialLR", "interval": "step",
          "gamma": 0.9}, ["warmup_steps", "min_lr"]),
        (["data=synthetic", "data._target_=mydata.make"], "data", None,
         ["num_samples", "num_features", "noise_std", "seed"]),  # num_classes: ddp_exp's too
    ]
    from omegaconf import OmegaConf

    for overrides, group, expected, gone in cases:
        caplog.clear()
        cfg = compose(*overrides)
        assert user_input.drop_replaced_keys(cfg) == {group: gone}
        validate(cfg)
        node = OmegaConf.to_container(cfg[group], resolve=True)
        if expected is not None:
            assert node == expected
        assert not set(gone) & set(node)
        assert "batch_size" in OmegaConf.to_container(cfg.data)  # ddp_exp's own keys stay
        lines = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
        assert len(lines) == 1 and ", ".join(gone) in lines[0], lines


def test_a_target_override_keeps_what_the_new_target_accepts_or_the_user_typed(compose,
                                                                               tmp_path,
                                                                               monkeypatch):
    """Keys the new target accepts stay (weight_decay for Adam); a key given on the command
    line stays (its error is the user's to see); a target that takes **kwargs or cannot be
    imported keeps every key; the packaged option itself loses nothing."""
    (tmp_path / "anymodel.py").write_text("def Net(**kwargs):\n    return kwargs\n\n\n"
                                          "def Plain(input_shape, num_outputs):\n    return 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert user_input.drop_replaced_keys(compose("optim._target_=torch.optim.AdamW")) == {
        "optim": ["momentum", "nesterov"]}
    typed = compose("model._target_=anymodel.Plain", "model.hidden_sizes=[4]")
    assert user_input.drop_replaced_keys(typed, {"model.hidden_sizes", "model._target_"}) == {
        "model": ["dropout"]}
    assert list(typed.model.hidden_sizes) == [4]
    (tmp_path / "mydata.py").write_text(MY_DATA)
    data = compose("data=file", "data.path=x.csv", "data._target_=mydata.make")
    assert user_input.drop_replaced_keys(data, {"data.path", "data._target_"}) == {}
    assert data.data.task == "auto"  # ddp_exp reads it (data.task), whatever the target takes
    for overrides in (["model._target_=anymodel.Net"], ["model._target_=nosuchmodule.Net"],
                      [], ["model=cnn"], ["scheduler=step"]):
        assert user_input.drop_replaced_keys(compose(*overrides)) == {}, overrides


def test_your_own_model_from_the_command_line_trains(run_cli, tmp_path):
    """Regression (V02): ``model._target_=mymodel.TinyNet +model.width=8`` as a user first
    types it trains to the end, the log naming the keys dropped."""
    (tmp_path / "mymodel.py").write_text(TINY_NET)
    run = run_cli("model._target_=mymodel.TinyNet", "+model.width=8", "trainer.epochs=1",
                  "world_size=1", "print_config=false").ok()
    assert "dropped model=mlp's hidden_sizes, dropout (not arguments of TinyNet)" in run.stdout
    state = torch.load(run.job_dir / "model.pt", weights_only=True)
    assert state["net.1.weight"].shape == (8, 64)


def test_a_data_yaml_that_extends_dataset_takes_its_own_arguments(compose, tmp_path):
    """Regression: a data YAML over /schema/data/dataset (or base) with its target's own
    argument failed with Hydra's "Key 'size' not in 'TorchDatasetConfig'" (4 lines); the
    schema's own keys stay typed."""
    import hydra
    from omegaconf.errors import ValidationError

    conf = tmp_path / "conf" / "data"
    conf.mkdir(parents=True)
    for name, schema in (("mine", "dataset"), ("mine_base", "base")):
        (conf / f"{name}.yaml").write_text(
            f"defaults:\n  - /schema/data/{schema}@_here_\n  - _self_\n\n"
            "_target_: mydata.make\nsize: 120\nval_size: 20\n")
    search = f"hydra.searchpath=[file://{tmp_path / 'conf'}]"
    for name in ("mine", "mine_base"):
        cfg = compose(search, f"data={name}")
        assert cfg.data.size == 120 and cfg.data.val_size == 20 and cfg.data.batch_size == 32
        validate(cfg)
    with pytest.raises(hydra.errors.ConfigCompositionException) as info:
        compose(search, "data=mine", "data.batch_size=x")
    assert isinstance(info.value.__cause__, ValidationError)
