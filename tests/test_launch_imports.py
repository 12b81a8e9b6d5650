"""The launcher's start-up (issue 42 item 6): the pre-run check refuses a bad optimizer without
building one (building a torch optimizer imports ``torch._dynamo``, ~1.3 s), so the launching
process imports ``torch._dynamo`` only where the ranks inherit it (the preload before a fork,
:mod:`ddp_exp.compat.preload`), never for spawned ranks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ddp_exp.config.errors import ConfigError
from ddp_exp.config.view import rank_config
from ddp_exp.train.optimizer import build_optimizer, check_optimizer


def _view(compose, *overrides: str):
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(compose("world_size=1", *overrides), resolve=True,
                                   enum_to_str=True)
    return rank_config(plain)


@pytest.mark.parametrize("overrides", [
    ["optim.momentum=-1"],
    ["optim.nesterov=true", "optim.momentum=0"],
    ["+optim.betas=[0.9,0.99]"],  # a keyword SGD does not take
    ["optim=adamw", "optim.betas=[0.9]"],
    ["optim=adamw", "optim.eps=-1e-8"],
])
def test_the_check_refuses_what_building_refuses_in_the_same_line(compose, overrides):
    """Each bad option is refused by the check as building the optimizer refuses it: the same
    one line (computed by building it here)."""
    view = _view(compose, *overrides)
    with pytest.raises(ConfigError) as built:
        build_optimizer(view, [torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ConfigError) as checked:
        check_optimizer(view)
    assert str(checked.value) == str(built.value)


@pytest.mark.parametrize("overrides", [[], ["optim=adamw"], ["optim.nesterov=true"]])
def test_the_check_accepts_good_options(compose, overrides):
    check_optimizer(_view(compose, *overrides))


# Runs the real entry with the ranks' start replaced: prints whether torch._dynamo was imported
# before the preload for forked ranks and when the ranks would start, then ends the process.
_PROBE = """
import json, os, sys
import ddp_exp.launch.elastic as elastic
seen = {}
preload = elastic._preload_for_ranks
def probe_preload():
    seen["before_preload"] = "torch._dynamo" in sys.modules
    preload()
def probe_launch(*args, **kwargs):
    seen["before_ranks"] = "torch._dynamo" in sys.modules
    print("PROBE " + json.dumps(seen), flush=True)
    os._exit(0)
elastic._preload_for_ranks, elastic._elastic_launch = probe_preload, probe_launch
sys.argv = ["ddp_exp", *sys.argv[1:]]
from ddp_exp.cli.main import main
main()
"""


@pytest.mark.slow  # the launcher's whole start (imports, data, the checks), no rank
@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_the_launcher_imports_torch_dynamo_only_for_forked_ranks(tmp_path, start_method):
    """Up to the moment the ranks start, the launching process has not imported torch._dynamo
    for its checks (it did, building an SGD optimizer); spawned ranks import their own, so the
    launcher never does; before a fork it is imported on purpose, once, for the ranks to
    inherit (each rank's first DDP(model) imports it)."""
    proc = subprocess.run([sys.executable, "-c", _PROBE, "world_size=2", "trainer.epochs=1",
                           f"launcher.start_method={start_method}", "print_config=false",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")), None)
    assert line is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = json.loads(line.removeprefix("PROBE "))
    if start_method == "spawn":
        assert seen == {"before_ranks": False}
    else:
        assert seen == {"before_preload": False, "before_ranks": True}


@pytest.mark.slow  # starts the CLI
@pytest.mark.parametrize(("args", "printed"), [(["--cfg", "job"], "world_size: "),
                                               (["--help"], "== Config groups (group=option) ==")])
def test_help_and_cfg_job_import_no_torch(tmp_path, args, printed):
    """``--help`` and ``--cfg job`` print and run no job: the entry imports no torch for them
    (it spent 1.3-1.7 s of their 1.4-4 s on it), as ``-X importtime`` shows."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "ddp_exp", *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert printed in proc.stdout
    imported = {ln.rsplit("|", 1)[-1].strip() for ln in proc.stderr.splitlines()
                if ln.startswith("import time:")}
    assert "ddp_exp.cli.main" in imported  # the check reads the real imports
    assert not {"torch", "numpy"} & imported


def test_only_hydras_printing_flags_run_no_job():
    from ddp_exp.cli.usage import runs_no_job

    for argv in (["--help"], ["-h"], ["--cfg", "job"], ["-c", "all"], ["--info", "config"],
                 ["world_size=2", "--cfg=job"], ["--hydra-help"]):
        assert runs_no_job(argv), argv
    for argv in ([], ["world_size=2"], ["-m", "seed=1,2"], ["hydra.job.chdir=true"]):
        assert not runs_no_job(argv), argv
