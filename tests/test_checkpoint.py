"""Checkpoint errors a user reads: a checkpoint of another model names the keys that differ."""

from __future__ import annotations

import pytest

from ddp_exp.checkpoint import model_mismatch
from ddp_exp.models import CNN, MLP


def test_a_checkpoint_of_another_model_names_the_keys_and_the_model():
    """The refusal quoted torch's first line only ("Error(s) in loading state_dict for CNN:"),
    which names no key. It now names the state-dict keys and the model._target_ of each."""
    mlp, cnn = MLP((1, 8, 8), 10), CNN((1, 8, 8), 10)
    state = {"model": mlp.state_dict(), "config": {"model": {"_target_": "ddp_exp.models.MLP"}}}
    with pytest.raises(RuntimeError) as caught:
        cnn.load_state_dict(state["model"])
    line = model_mismatch(caught.value, state, {"_target_": "ddp_exp.models.CNN"})
    assert "\n" not in line
    assert "Missing key(s) in state_dict" in line and "Unexpected key(s) in state_dict" in line
    first_mlp_key = next(iter(mlp.state_dict()))
    assert f'"{first_mlp_key}"' in line, line
    assert line.endswith("the checkpoint was written with model._target_=ddp_exp.models.MLP, "
                         "this run has model._target_=ddp_exp.models.CNN")


def test_a_checkpoint_with_other_shapes_names_the_parameter():
    small, large = MLP((1, 8, 8), 10, hidden_sizes=[16]), MLP((1, 8, 8), 10, hidden_sizes=[32])
    state = {"model": small.state_dict(), "config": {"model": {"_target_": "ddp_exp.models.MLP"}}}
    with pytest.raises(RuntimeError) as caught:
        large.load_state_dict(state["model"])
    line = model_mismatch(caught.value, state, {"_target_": "ddp_exp.models.MLP"})
    name = next(k for k, v in small.state_dict().items()
                if v.shape != large.state_dict()[k].shape)
    assert f"size mismatch for {name}" in line, line
    assert "model._target_" not in line  # the same model class: only the shapes differ
