"""Issue 41 item 2: no silence before the first line. Every check before the launch is bounded
(or refuses in one line), and the config is printed before the data and the model are built.

``experiment=gpt_tokens data.block_size=100000`` printed nothing for minutes: the check's probe
forward ran the GPT's attention over two windows of 100,000 tokens (``T^2``) before the config
was printed. Each extreme value a range check lets through either runs or is refused in one line
(exit 2, no job folder); the time to the first line is held against the same machine's time to
the first line of an immediate refusal, started the same way: under twice that plus 5 s (the
hang was minutes), a hang detector with generous margins, not a speed test. The table runs
forked from the suite's pre-imported server (:mod:`zygote`: what is timed is then the checks
themselves, without the ~2.5 s of imports each); the issue's own command also runs as a real
process, timed from the interpreter's start.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch
import zygote
from helpers import assert_no_orphans, cli_env

from ddp_exp.launch.build import PROBE_TOKENS, bounded_probe
from ddp_exp.train.gpt import GPT

MARGIN_S = 5.0
RUN = ("world_size=1", "trainer.epochs=1", "trainer.max_steps=1", "trainer.progress=off")
# (overrides, refused): refused ones exit 2 with one line on stderr and leave no folder; None:
# either outcome, each as it must be.
EXTREMES = [
    (("experiment=gpt_tokens", "data.block_size=100000"), True),  # the issue's command
    (("experiment=gpt_tokens", "data.block_size=100000", "model.block_size=1000"), True),
    (("data.batch_size=1000000000",), False),  # one batch of the whole set
    (("data.val_size=1000000000",), True),
    (("experiment=gpt_tokens", "data.val_size=1000000000"), True),
    (("data.test_size=1000000000",), True),
    (("data.num_workers=64",), False),
    (("model.hidden_sizes=[1000000,1000000]",), True),  # 4 TB of weights
    # every preset (gpt_tokens above), one step: it runs, or is refused in one line (None)
    (("experiment=digits_cnn_recipe",), None),
    (("experiment=digits_cnn_batch_sweep",), None),  # one job of the sweep
    (("experiment=image_folder_recipe",), True),  # data.path is required
    (("debug=default",), None),
]


def _first_line(tmp_path, *overrides: str, timeout: float = 120,
                real: bool = False) -> tuple[float, int, str, str]:
    """Start ``python -m ddp_exp`` in ``tmp_path`` (forked from the pre-imported server unless
    ``real``, or where it cannot be): (seconds to its first output on stdout or stderr, exit
    status, stdout, stderr)."""
    tag = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "ddp_exp", *overrides, f"hydra.run.dir={tmp_path / 'job'}"]
    start = time.monotonic()
    forked = None if real else zygote.popen(cmd, tmp_path, cli_env(tag))
    if forked is not None:
        try:
            out, err = forked.communicate(timeout=timeout)
        finally:
            if forked.poll() is None:
                forked.kill()
                forked.wait(30)
            assert_no_orphans(tag)
        first = forked.first_output
        return (first - start if first is not None else float("inf")), forked.returncode, out, err
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=cli_env(tag), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    first: list[float] = []
    outputs: dict[str, str] = {}

    def read(name: str, stream) -> None:
        lines = []
        for line in stream:
            if not first:
                first.append(time.monotonic() - start)
            lines.append(line)
        outputs[name] = "".join(lines)

    readers = [threading.Thread(target=read, args=(n, s))
               for n, s in (("out", proc.stdout), ("err", proc.stderr))]
    for reader in readers:
        reader.start()
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
        for reader in readers:
            reader.join(10)
        assert_no_orphans(tag)
    return (first[0] if first else float("inf")), proc.returncode, outputs["out"], outputs["err"]


def _refusal_s(tmp_path, real: bool = False) -> float:
    """This machine's time to the first line of a config refused at once (a range check)."""
    seconds, code, _, err = _first_line(tmp_path, "world_size=0", real=real)
    assert code == 2 and err.startswith("error: world_size"), err
    return seconds


@pytest.fixture(scope="module")
def startup_s(tmp_path_factory) -> float:
    """The time to an immediate refusal's first line, started as the table's runs are."""
    return _refusal_s(tmp_path_factory.mktemp("baseline"))


def _check(tmp_path, seconds, code, out, err, *, startup, refused) -> None:
    """The first line came in time; the run either ran or was refused in one line, as
    ``refused`` (None: either) says; the config came first."""
    assert seconds < 2 * startup + MARGIN_S, (seconds, startup, out[-500:], err[-500:])
    if refused is None:
        refused = code != 0
    if refused:
        assert code == 2, (out[-2000:], err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), err
        assert not (tmp_path / "job").exists()
    else:
        assert code == 0, (out[-2000:], err[-2000:])
        assert (tmp_path / "job" / "metrics.json").exists()
    if out:  # the config comes first (a range check's refusal comes before it, alone)
        assert out.startswith("[") and "config:" in out.splitlines()[0], out[:300]


@pytest.mark.slow
@pytest.mark.parametrize("overrides, refused", EXTREMES,
                         ids=[" ".join(o) for o, _ in EXTREMES])
def test_an_extreme_value_runs_or_is_refused_after_a_prompt_first_line(
        tmp_path, startup_s, overrides, refused):
    _check(tmp_path, *_first_line(tmp_path, *RUN, *overrides), refused=refused,
           startup=startup_s)


@pytest.mark.slow
def test_the_issues_command_as_a_real_process_prints_its_line_in_time(tmp_path):
    """The issue's command, started as a user starts it (interpreter, imports and all), against
    a real process's immediate refusal."""
    (tmp_path / "baseline").mkdir()
    startup = _refusal_s(tmp_path / "baseline", real=True)
    run = tmp_path / "run"
    run.mkdir()
    _check(run, *_first_line(run, *RUN, *EXTREMES[0][0], real=True), refused=True,
           startup=startup)


def test_a_sequence_models_probe_is_cut_to_a_bounded_length():
    """The check's forward takes the first PROBE_TOKENS positions of a long window for a model
    whose context holds the window; a shorter context, floats or other shapes get it whole."""
    model = GPT((4096,), 256, n_layer=1, n_head=1, n_embd=8)
    x = torch.randint(0, 256, (2, 4096))
    y = torch.randint(0, 256, (2, 4096))
    px, py = bounded_probe(model, x, y)
    assert px.shape == py.shape == (2, PROBE_TOKENS)
    assert torch.equal(px, x[:, :PROBE_TOKENS]) and torch.equal(py, y[:, :PROBE_TOKENS])
    short = GPT((1000,), 256, n_layer=1, n_head=1, n_embd=8)
    assert bounded_probe(short, x, y)[0].shape == (2, 4096)  # refused by its own forward
    plain = torch.nn.Linear(4096, 3)
    assert bounded_probe(plain, x.float(), y[:, 0])[0].shape == (2, 4096)


def test_a_model_larger_than_the_machine_is_refused_before_it_is_built():
    """ddp_exp's own models are sized on the meta device: weights x (1 + 2 x CPU ranks) beyond
    the machine's memory is one line; on CUDA only the launcher's host copy counts; a user's
    _target_ is never built twice."""
    from ddp_exp.config.errors import ConfigError
    from ddp_exp.launch import model_size

    node = {"_target_": "ddp_exp.train.gpt.GPT", "n_layer": 2, "n_head": 4, "n_embd": 1024,
            "dropout": 0.0}
    # 2 blocks of 12 d^2 (+ biases, LayerNorms) + token and position embeddings, float32
    d, vocab, block = 1024, 256, 128
    floats = 2 * (12 * d * d + 13 * d) + vocab * d + block * d + 2 * d
    size = model_size.model_bytes(node, (block,), vocab)
    assert size == 4 * floats
    model_size.check_fits(node, (block,), vocab, 2, "cpu", memory=5 * size)
    with pytest.raises(ConfigError, match=r"^model._target_='ddp_exp.train.gpt.GPT': "
                       r"[\d,]+ float32 values \(0.1 GiB\) need at least 0.5 GiB \(2 CPU "
                       r"rank\(s\) x \(weights \+ gradients\) \+ the launcher's copy\), and this "
                       r"machine has 0.5 GiB: make the model smaller \(model.\* sizes\)$"):
        model_size.check_fits(node, (block,), vocab, 2, "cpu", memory=5 * size - 1)
    model_size.check_fits(node, (block,), vocab, 8, "cuda", memory=size)
    assert model_size.model_bytes({"_target_": "mymodels.Net"}, (1,), 1) is None
