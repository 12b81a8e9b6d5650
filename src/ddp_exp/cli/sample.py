"""``ddp-exp sample RUN``: text from a trained run's model, decoded with the run's tokenizer.

Loads the run's resolved config (stored in its checkpoints; ``.hydra/config.yaml`` for
``model.pt``), rebuilds its data (memory-mapped: nothing is read but the vocabulary) and model,
loads the weights (``--checkpoint best`` | ``last`` | a path; default: ``best.pt``, else
``last.pt``, else ``model.pt``) and continues ``--prompt`` with ddp_exp's own sampling loop
(:mod:`ddp_exp.metrics.sampling`): the same text for the same ``--seed``.

May use: :mod:`ddp_exp.train.models`, :mod:`ddp_exp.metrics`, :mod:`ddp_exp.data`,
:mod:`ddp_exp.io.checkpoint`, :mod:`ddp_exp.config`, :mod:`ddp_exp.cli.one_line_parser`.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from ddp_exp.cli.one_line_parser import OneLineParser
from ddp_exp.config.errors import ConfigError, first_line


def parser() -> OneLineParser:
    """The command's options."""
    p = OneLineParser(prog="ddp-exp sample",
                                description="Continue a prompt with a trained run's model.")
    p.add_argument("run", metavar="RUN", help="the run's job folder")
    p.add_argument("--prompt", default=None,
                   help="the text to continue (default: the run's trainer.sample_prompt)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8,
                   help="divides the logits; 0 or less: greedy (finite)")
    p.add_argument("--top-k", type=int, default=None,
                   help="keep the k most likely tokens (0 or none: every token)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", default=None,
                   help="best | last | PATH (default: best.pt, else last.pt, else model.pt)")
    return p


def weights_file(run: str, which: str | None) -> str:
    """The weights to sample from (see the module docstring).

    Raises:
        ConfigError: no such run folder, or no checkpoint or ``model.pt`` in it.
    """
    if not os.path.isdir(run):
        raise ConfigError(f"{run}: no such run folder (a job folder of python -m ddp_exp)")
    ckpt = os.path.join(run, "checkpoints")
    named = {"best": os.path.join(ckpt, "best.pt"), "last": os.path.join(ckpt, "last.pt")}
    if which is not None:
        path = named.get(which, which)
        if not os.path.exists(path):
            raise ConfigError(f"--checkpoint={which}: no such file ({path}); best, last or a "
                              "checkpoint's path (a file, or a sharded checkpoint's folder)")
        return path
    for path in (named["best"], named["last"], os.path.join(run, "model.pt")):
        if os.path.isfile(path):
            return path
    raise ConfigError(f"{run}: no checkpoint to sample from (no checkpoints/best.pt, "
                      "checkpoints/last.pt or model.pt): train the run first, or give "
                      "--checkpoint PATH")


def load_run(run: str, which: str | None) -> tuple[dict[str, Any], dict[str, Any] | str]:
    """The run's resolved config and the model's weights (a ``state_dict``, or the folder of a
    sharded checkpoint: :mod:`ddp_exp.io.sharded`).

    Raises:
        ConfigError: no weights (:func:`weights_file`), an unreadable file, no config.
    """
    import torch
    from omegaconf import OmegaConf

    from ddp_exp.io import checkpoint

    path = weights_file(run, which)
    if os.path.basename(path) == "model.pt" and which is None:
        try:
            weights = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ConfigError(f"{path}: cannot load it ({type(e).__name__}: {e})") from None
        cfg_file = os.path.join(run, ".hydra", "config.yaml")
        if not os.path.isfile(cfg_file):
            raise ConfigError(f"{run}: model.pt without .hydra/config.yaml: give --checkpoint "
                              "with a checkpoint of the run")
        loaded = OmegaConf.load(cfg_file)
        try:
            cfg = OmegaConf.to_container(loaded, resolve=True)
        except Exception:  # a resolver of Hydra's: the model and data keys rarely use one
            cfg = OmegaConf.to_container(loaded, resolve=False)
        return cfg, weights
    state = checkpoint.load(path, key="--checkpoint")
    if not isinstance(state.get("config"), dict):
        raise ConfigError(f"{path}: the checkpoint holds no config")
    return state["config"], state.get("model", state.get("shards"))


def sample_text(argv: Sequence[str]) -> str:
    """The sample ``ddp-exp sample`` prints for ``argv`` (the words after ``sample``)."""
    import torch

    from ddp_exp import data as data_module
    from ddp_exp.metrics import lm
    from ddp_exp.metrics.sampling import context_length, sample_ids, seeded_generator
    from ddp_exp.train.models import build_model

    args = parser().parse_args(list(argv))
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens={args.max_new_tokens} is invalid: at least 1")
    if not math.isfinite(args.temperature):  # nan failed inside torch.multinomial
        raise ConfigError(f"--temperature={args.temperature} is invalid: a finite number "
                          "(0 or less: the most likely token each time)")
    if args.top_k is not None and args.top_k < 0:  # torch.topk's "index k out of range"
        raise ConfigError(f"--top-k={args.top_k} is invalid: 0 or more (0: every token)")
    cfg, weights = load_run(args.run, args.checkpoint)
    datasets = data_module.load(cfg["data"], cfg.get("seed", 0), 1)
    train = datasets.train
    if not lm.is_token_data(train):
        raise ConfigError(f"{args.run}: not a language-model run (data=tokens); ddp-exp sample "
                          "continues text")
    torch.manual_seed(cfg.get("seed", 0))
    model = build_model(cfg["model"], train.input_shape, train.num_outputs)
    try:
        if isinstance(weights, str):  # a sharded checkpoint's folder, read whole here
            from ddp_exp.io.sharded import load_model

            load_model(weights, model, no_dist=True)
        else:
            model.load_state_dict(weights)
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"{args.run}: the weights do not fit the run's model "
                          f"({first_line(e, default=type(e).__name__)})") from None
    tokenizer = lm.split_tokenizer(train)
    prompt_text = args.prompt if args.prompt is not None else (
        cfg.get("trainer", {}).get("sample_prompt") or "\n")
    if tokenizer is None:  # a bare token file: ids in, ids out
        try:
            prompt = [int(t) for t in prompt_text.split()]
        except ValueError:
            raise ConfigError(f"{args.run}: its token file has no tokenizer: give --prompt as "
                              "token ids separated by spaces") from None
    else:
        prompt = tokenizer.encode(prompt_text) or [tokenizer.end_of_text or 0]
    output_key = cfg.get("trainer", {}).get("output_key") or "logits"
    new = sample_ids(model, prompt, args.max_new_tokens, args.temperature, args.top_k,
                     seeded_generator(args.seed), context_length(model, train.stream.block_size),
                     output_key)
    if tokenizer is None:
        return " ".join(map(str, prompt + new))
    return tokenizer.decode(prompt + new)


def main(argv: Sequence[str]) -> int:
    """Print the sample; bad input raises :class:`ConfigError` (the entry's one line)."""
    text = sample_text(argv)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    return 0
