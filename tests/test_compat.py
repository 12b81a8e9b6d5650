"""ddp_exp.compat: every borrowed internal (a private attribute, an upstream message's wording)
held to what it relies on, so that a test fails when upstream changes it (the contract tests),
and each one's fallback on a version it was not written for, faked by patching
``ddp_exp.compat.versions.installed`` (the fallback tests)."""

from __future__ import annotations

import errno
import inspect
import json
import logging
import os
import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path

import pytest

from ddp_exp.compat import versions


@pytest.fixture
def other_version(monkeypatch, caplog):
    """``other_version(dist)``: from now on ``dist`` reads as version 0.0.1 (and is "not
    installed" for ``python``), the compat log's "told once" memory is fresh, and ``caplog``
    records ddp_exp's INFO lines."""
    monkeypatch.setattr(versions, "_told", set())
    caplog.set_level(logging.INFO, logger="ddp_exp")
    real = versions.installed

    def fake(dists: set[str]) -> None:
        monkeypatch.setattr(versions, "installed",
                            lambda d: ("0.0.1" if d != "python" else None) if d in dists
                            else real(d))

    return lambda *dists: fake(set(dists))


def compat_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("ddp_exp.compat")]


# ------------------------------------------------------------------ the versions written for
def test_the_installed_versions_are_those_written_for():
    """The environment the suite runs in is the one every internal was read from: a failure
    here means an upgrade, and each module of ddp_exp.compat must be read again."""
    for dist in versions.WRITTEN_FOR:
        assert versions.installed(dist) is not None, dist
        assert versions.written_for(dist, f"test {dist}", "stock"), (dist,
                                                                     versions.installed(dist))


def test_pyproject_pins_the_torch_that_is_tested():
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '"torch>=2.13,<2.14"' in text
    assert versions.WRITTEN_FOR["torch"] == ("2.13",)


def test_another_version_is_logged_once_per_internal(other_version, caplog):
    other_version("torch")
    assert versions.series("2.13.0+cpu") == "2.13"
    assert not versions.written_for("torch", "thing", "the stock way")
    assert not versions.written_for("torch", "thing", "the stock way")
    assert compat_lines(caplog) == [
        "ddp_exp.compat: thing was written for torch 2.13.x, found 0.0.1: the stock way"]


# ------------------------------------------------------------------ torch's elastic agent
def test_contract_the_agent_starts_its_ranks_through_the_patched_methods():
    """start_ranks_safely wraps LocalElasticAgent._start_workers(self, worker_group), which
    sets self._pcontext from start_processes, whose start() forks in MultiprocessContext._start
    (self); rank_pids reads the context's pids()."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext, PContext

    assert list(inspect.signature(LocalElasticAgent._start_workers).parameters) == [
        "self", "worker_group"]
    assert list(inspect.signature(MultiprocessContext._start).parameters) == ["self"]
    start_workers = inspect.getsource(LocalElasticAgent._start_workers)
    assert "self._pcontext = start_processes(" in start_workers
    assert "self._start()" in inspect.getsource(PContext.start)
    assert list(inspect.signature(PContext.pids).parameters) == ["self"]


def test_on_another_torch_the_ranks_start_as_torch_starts_them(other_version, caplog):
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

    from ddp_exp.compat import elastic_agent

    stock = (LocalElasticAgent._start_workers, MultiprocessContext._start)
    with elastic_agent.start_ranks_safely(fork=True):  # written for: patched
        assert LocalElasticAgent._start_workers is not stock[0]
    other_version("torch")
    with elastic_agent.start_ranks_safely(fork=True):
        assert (LocalElasticAgent._start_workers, MultiprocessContext._start) == stock
        assert elastic_agent.FORK_GATE_ENV not in os.environ
    assert (LocalElasticAgent._start_workers, MultiprocessContext._start) == stock
    assert elastic_agent.rank_pids() == []
    assert len(compat_lines(caplog)) == 1 and "start_ranks_safely" in compat_lines(caplog)[0]


AGENT_RECORDS = textwrap.dedent("""
    import json, logging, os
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    from ddp_exp.compat import messages
    from ddp_exp.launch import rendezvous

    def work():
        import time
        if os.environ["RANK"] == "1":
            raise ValueError("rank failed on purpose")
        time.sleep(60)

    records = []
    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)
    for name in ("torch.distributed.elastic.multiprocessing.api",
                 "torch.multiprocessing.spawn"):
        logging.getLogger(name).addHandler(Keep())
        logging.getLogger(name).setLevel(logging.INFO)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="records",
                          rdzv_backend=rendezvous.BACKEND, rdzv_endpoint="127.0.0.1:0",
                          monitor_interval=0.05, start_method="fork")
    try:
        elastic_launch(config, work)()
    except ChildFailedError:
        pass
    print(json.dumps({
        "failures": [messages.agent_rank_failure(r) for r in records
                     if messages.agent_rank_failure(r) is not None],
        "closing": sum(messages.agent_closing_process(str(r.msg)) for r in records)}))
""")


@pytest.mark.slow  # starts worlds of processes: make test, not test-fast
def test_contract_the_agents_records_of_a_failed_rank_and_of_the_ranks_it_stops():
    """The elastic agent's log records that ddp_exp.launch.elastic's filter reads: a failed
    rank's ("failed (exitcode: %s) local_rank: %s ...", exit code and local rank first) and
    one per rank it stops ("Closing process %s via signal %s")."""
    proc = subprocess.run([sys.executable, "-c", AGENT_RECORDS], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [1, 1] in out["failures"], out  # exit code 1 (it raised), local rank 1
    assert out["closing"] >= 1, out


def test_on_another_torch_the_agents_records_are_left_as_torch_logs_them(other_version):
    from ddp_exp.compat import messages

    record = logging.LogRecord("x", logging.ERROR, "f", 1, "failed (exitcode: %s) local_rank: %s",
                               (1, 0), None)
    assert messages.agent_rank_failure(record) == (1, 0)
    assert messages.agent_closing_process("Closing process 12 via signal SIGTERM")
    other_version("torch")
    assert messages.agent_rank_failure(record) is None
    assert not messages.agent_closing_process("Closing process 12 via signal SIGTERM")


def test_contract_a_peer_that_went_away_reads_so():
    """gloo's "Connection closed by peer" is in torch's library as written; the C library's
    words for ECONNRESET and EPIPE are the other two."""
    import mmap

    import torch

    from ddp_exp.compat import messages

    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    with open(lib, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
        assert data.find(messages.PEER_GONE[0].encode()) >= 0
    assert os.strerror(errno.ECONNRESET) == messages.PEER_GONE[1]
    assert os.strerror(errno.EPIPE) == messages.PEER_GONE[2]


def test_on_another_torch_a_peers_failure_is_not_read_from_the_words(other_version):
    from ddp_exp.compat import messages
    from ddp_exp.rank.failures import is_peer_failure

    error = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]")
    assert is_peer_failure(error)
    other_version("torch")
    assert not messages.peer_went_away(str(error))
    assert not is_peer_failure(error)


class Unsafe:
    """An object ``torch.load(weights_only=True)`` refuses."""


def test_contract_torch_load_says_what_it_refused_and_that_a_file_is_cut(tmp_path):
    import torch

    from ddp_exp.compat import messages
    from ddp_exp.io.files import load_failure

    path = tmp_path / "a.pt"
    torch.save({"x": Unsafe()}, path)
    with pytest.raises(Exception) as refused:
        torch.load(path, weights_only=True)
    assert messages.torch_load_refused(str(refused.value)) == f"{__name__}.Unsafe"
    assert messages.torch_load_reason(str(refused.value)).startswith("Unsupported global")
    torch.save({"x": torch.ones(3)}, path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(Exception) as cut:
        torch.load(path, weights_only=True)
    assert messages.torch_load_broken(cut.value, str(cut.value)), str(cut.value)
    assert load_failure(cut.value) == "not a complete torch.save file: truncated or corrupt"


def test_any_file_that_is_no_torch_save_file_gets_the_same_line():
    """Text and binary files that are no torch.save file at all (a user's trainer.resume=
    /etc/passwd gave 'IndexError: list index out of range'): 300 seeded pieces of text, of a
    binary and of random bytes; torch.load raises IndexError, KeyError, EOFError,
    UnicodeDecodeError, UnpicklingError or 'Invalid magic number' on them, and every one is
    named as not a complete torch.save file."""
    import io
    import random

    import torch

    from ddp_exp.io.files import load_failure

    rng = random.Random(0)
    sources = [(b"root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/"
                b"nologin\n# comment\n127.0.0.1 localhost\n") * 20,
               Path(__file__).read_bytes(), Path(sys.executable).read_bytes()[:65536]]
    lines, kinds = set(), set()
    for _ in range(300):
        source = rng.choice(sources)
        start = rng.randrange(len(source))
        data = (source[start:start + rng.randrange(1, 3000)] if rng.random() < 0.7
                else bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the unpickler's pickle-protocol warning
            try:
                torch.load(io.BytesIO(data), weights_only=True)
                continue
            except Exception as exc:  # noqa: BLE001  (every kind is the claim)
                kinds.add(type(exc).__name__)
                lines.add(load_failure(exc))
    assert lines == {"not a complete torch.save file: truncated or corrupt"}, lines
    assert {"IndexError", "UnpicklingError"} <= kinds, kinds


def test_on_another_torch_a_file_that_does_not_load_is_named_by_its_first_sentence(
        tmp_path, other_version):
    import torch

    from ddp_exp.io.files import load_failure

    path = tmp_path / "a.pt"
    torch.save({"x": Unsafe()}, path)
    with pytest.raises(Exception) as refused:
        torch.load(path, weights_only=True)
    assert load_failure(refused.value).startswith("it holds a Python object (")
    other_version("torch")
    assert load_failure(refused.value) == "UnpicklingError: Weights only load failed"


DDP_IMPORTS = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist
    from ddp_exp.compat.preload import MODULES
    before = [m for m in MODULES if m in sys.modules]
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    print(before, [m for m in MODULES if m in sys.modules])
    dist.destroy_process_group()
""")


def test_contract_ddp_imports_what_the_launcher_preloads(tmp_path):
    """The launcher's preload (ddp_exp.compat.preload) is what a rank's first DDP(model)
    imports anyway: torch._dynamo."""
    proc = subprocess.run([sys.executable, "-c", DDP_IMPORTS, str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-2] == "[] ['torch._dynamo']", proc.stdout


def test_on_another_torch_nothing_is_preloaded(other_version, monkeypatch):
    import importlib

    from ddp_exp.compat import preload

    imported = []
    monkeypatch.setattr(importlib, "import_module", imported.append)
    preload.preload_for_forked_ranks()
    assert imported == ["torch._dynamo"]
    other_version("torch")
    preload.preload_for_forked_ranks()
    assert imported == ["torch._dynamo"]


def test_contract_foreach_norm_and_the_compiled_modules_original():
    import torch

    from ddp_exp.compat.tensors import compiled_original, tensor_norms

    grads = [torch.randn(64, 32), torch.randn(32), torch.randn(10, 64)]
    fused = torch._foreach_norm(grads)
    assert [float(n) for n in fused] == [float(torch.linalg.vector_norm(g)) for g in grads]
    assert [float(n) for n in tensor_norms(grads)] == [float(n) for n in fused]
    net = torch.nn.Linear(2, 2)
    compiled = torch.compile(net)
    assert compiled._orig_mod is net and compiled_original(compiled) is net
    assert compiled_original(net) is net


def test_on_another_torch_the_public_paths_are_taken(other_version):
    import torch

    from ddp_exp.compat.tensors import compiled_original, tensor_norms
    from ddp_exp.data import batches
    from ddp_exp.train.optimizer import grad_norm

    class NoMask(torch.nn.Module):
        def forward(self, x):
            return x

    compiled = torch.compile(NoMask())
    batches._MASK_TAKERS.clear()
    assert not batches._takes_mask(compiled)  # its forward takes no attention_mask
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]
    for p in params:
        p.grad = torch.randn_like(p)
    fused = grad_norm(params)
    other_version("torch")
    batches._MASK_TAKERS.clear()
    assert compiled_original(compiled) is compiled
    assert batches._takes_mask(compiled)  # the wrapper's (*args, **kwargs)
    batches._MASK_TAKERS.clear()
    assert torch.equal(grad_norm(params), fused)
    assert len(tensor_norms([p.grad for p in params])) == 2


class BadItems(list):
    """A map-style dataset whose items raise, in a DataLoader worker."""

    def __getitem__(self, index):
        raise ValueError("item 3 is broken")


def test_contract_a_dataloader_workers_error_carries_the_original_traceback():
    import torch

    from ddp_exp.compat import messages
    from ddp_exp.rank.failures import failure_detail

    loader = torch.utils.data.DataLoader(BadItems(range(4)), num_workers=1)
    with pytest.raises(ValueError) as info:
        next(iter(loader))
    text = f"ValueError: {info.value}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    assert lines[0].startswith("ValueError: Caught ValueError in DataLoader worker process 0")
    assert messages.carries_traceback(lines), text
    assert failure_detail(text) == "ValueError: item 3 is broken"


def test_on_another_torch_a_workers_error_is_named_by_its_first_line(other_version):
    from ddp_exp.rank.failures import failure_detail

    text = ("ValueError: Caught ValueError in DataLoader worker process 0.\n"
            "Original Traceback (most recent call last):\n  File \"x.py\", line 1\n"
            "ValueError: item 3 is broken")
    assert failure_detail(text) == "ValueError: item 3 is broken"
    other_version("torch")
    assert failure_detail(text) == "ValueError: Caught ValueError in DataLoader worker process 0."


# ------------------------------------------------------------------ Hydra's and OmegaConf's words
@pytest.mark.parametrize("override,group", [("+data=synthetic", "data"),
                                            ("+hydra/launcher=basic", "hydra/launcher")])
def test_contract_hydra_says_a_group_was_given_twice(compose, override, group):
    from hydra.errors import HydraException

    from ddp_exp.compat import messages

    with pytest.raises(HydraException) as info:
        compose(override)
    assert messages.hydra_group_given_twice(str(info.value)) == group, str(info.value)


def test_contract_hydra_names_the_config_that_asked_for_a_missing_option(compose):
    from hydra.errors import MissingConfigException

    from ddp_exp.compat import messages

    with pytest.raises(MissingConfigException) as info:
        compose("data=digitz")
    assert messages.hydra_asking_config(str(info.value)) == "config", str(info.value)


def test_contract_hydra_refuses_a_null_group(compose):
    from ddp_exp.compat import messages

    with pytest.raises(ValueError) as info:
        compose("scheduler=null")
    assert messages.hydra_null_group(info.value), str(info.value)


def test_contract_omegaconf_refuses_to_delete_a_typed_key(compose):
    from hydra.errors import HydraException

    from ddp_exp.compat import messages

    with pytest.raises(HydraException) as info:
        compose("~model.hidden_sizes")
    assert messages.omegaconf_no_deletion(str(info.value.__cause__)), str(info.value.__cause__)


def test_on_another_hydra_or_omegaconf_their_own_report_stays(compose, other_version):
    """The entry point's one-line readers give None: its caller prints Hydra's report."""
    from hydra.errors import HydraException, MissingConfigException

    from ddp_exp.cli.errors import _one_line, _plus_on_a_default, _unknown_option_line
    from ddp_exp.compat import messages
    from ddp_exp.config.compose import null_group_line

    with pytest.raises(HydraException) as twice:
        compose("+data=synthetic")
    with pytest.raises(MissingConfigException) as missing:
        compose("data=digitz")
    with pytest.raises(ValueError) as null:
        compose("scheduler=null")
    with pytest.raises(HydraException) as deleted:
        compose("~model.hidden_sizes")
    assert _plus_on_a_default(twice.value, ["+data=synthetic"]) is not None
    assert null_group_line(null.value, ["scheduler=null"]) is not None
    assert "no need to delete it" in _one_line(deleted.value)
    other_version("hydra-core", "omegaconf")
    assert _plus_on_a_default(twice.value, ["+data=synthetic"]) is None
    assert messages.hydra_asking_config(str(missing.value)) is None
    assert _unknown_option_line(missing.value, []).startswith("data=digitz: no such option")
    assert null_group_line(null.value, ["scheduler=null"]) is None
    assert "no need to delete it" not in _one_line(deleted.value)


# ------------------------------------------------------------------ OmegaConf's _get_node
def test_contract_an_open_node_keeps_its_types_and_takes_new_keys():
    """open_node copies each field's typed node (DictConfig._get_node): a value of the wrong
    type is refused, a key of the user's own is taken."""
    from omegaconf import DictConfig, OmegaConf, ValidationError

    from ddp_exp.compat.omegaconf import open_node
    from ddp_exp.config.schema import DataConfig

    assert list(inspect.signature(DictConfig._get_node).parameters)[:2] == ["self", "key"]
    node = open_node(DataConfig)
    assert isinstance(node, DictConfig) and OmegaConf.get_type(node) is dict
    with pytest.raises(ValidationError):
        node.batch_size = "two"
    node.size = 100
    assert node.size == 100 and node.batch_size == DataConfig.batch_size


def test_on_another_omegaconf_the_schema_node_is_omegaconfs_own(other_version, caplog):
    from ddp_exp.compat.omegaconf import open_node
    from ddp_exp.config.schema import DataConfig

    other_version("omegaconf")
    assert open_node(DataConfig) is DataConfig
    assert "open_node" in compat_lines(caplog)[0]


# ------------------------------------------------------------------ submitit
def test_contract_submitits_local_job_table_and_node_list_parser():
    import submitit.local.local as local
    from submitit.slurm.slurm import _parse_node_list

    from ddp_exp.compat.submitit import local_job_processes, parse_node_list

    assert isinstance(local._PROCESSES, dict)
    source = inspect.getsource(local.LocalJob)
    assert "_PROCESSES[self.job_id] = self._process" in source  # the job's Popen, by job id
    assert local_job_processes() == list(local._PROCESSES.values())
    assert list(inspect.signature(_parse_node_list).parameters) == ["node_list"]
    assert parse_node_list("gpu[07-08,10],cpu3") == ["gpu07", "gpu08", "gpu10", "cpu3"]
    assert parse_node_list("rack1-[1-2]") == ["rack1-1", "rack1-2"]


def test_contract_submitit_says_so_when_there_is_no_srun(tmp_path, monkeypatch):
    import submitit

    from ddp_exp.cli.errors import _no_slurm_here
    from ddp_exp.compat import messages

    monkeypatch.setenv("PATH", str(tmp_path))  # no srun here
    with pytest.raises(RuntimeError) as info:
        submitit.SlurmExecutor(folder=tmp_path / "jobs")
    assert messages.submitit_no_srun(info.value), str(info.value)
    assert _no_slurm_here(info.value).startswith("launcher=slurm submits to SLURM")


def test_on_another_submitit_its_internals_are_left_alone(other_version, monkeypatch, caplog):
    from ddp_exp.compat import messages
    from ddp_exp.compat.submitit import local_job_processes, parse_node_list
    from ddp_exp.config.errors import ConfigError
    from ddp_exp.launch.cluster import slurm_hostnames

    # imported before submitit.local.local is faked below: submitit's own import of it would
    # fail then, and parse_node_list would return None without its line (as in a worker where
    # no earlier test had imported submitit)
    pytest.importorskip("submitit.slurm.slurm")
    job = types.SimpleNamespace(wait=lambda timeout: None)
    monkeypatch.setitem(sys.modules, "submitit.local.local",
                        types.SimpleNamespace(_PROCESSES={"1": job}))
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol
    assert local_job_processes() == [job]
    other_version("submitit")
    assert local_job_processes() == []
    assert parse_node_list("gpu[07-08]") is None
    assert slurm_hostnames("a1,b2") == ["a1", "b2"]
    with pytest.raises(ConfigError, match="cannot expand SLURM_JOB_NODELIST"):
        slurm_hostnames("gpu[07-08]")
    assert not messages.submitit_no_srun(
        RuntimeError('Could not detect "srun", are you indeed on a slurm cluster?'))
    assert len(compat_lines(caplog)) == 3


# ------------------------------------------------------------------ CPython's atexit
EXIT_HANDLERS = textwrap.dedent("""
    import atexit, sys
    from ddp_exp.compat.interpreter import exit_handlers
    atexit.register(lambda: print("first", flush=True))
    atexit.register(lambda: print("second", flush=True))
    run = exit_handlers()
    run()
    print("after", flush=True)
""")


def test_contract_atexit_runs_every_handler_once_last_registered_first():
    """exit_now relies on atexit._run_exitfuncs running every handler, newest first, and
    clearing them (the process's own exit then runs none again)."""
    proc = subprocess.run([sys.executable, "-c", EXIT_HANDLERS], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["second", "first", "after"]


ANOTHER_PYTHON = textwrap.dedent("""
    import logging, sys
    from ddp_exp.compat import versions
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    versions.installed = lambda dist: None if dist == "python" else "9.9.9"
    from ddp_exp.cli.signals import exit_now
    exit_now(3)  # returns: Python's own exit follows
    print("returned", flush=True)
""")


def test_on_another_python_the_process_exits_as_python_does():
    proc = subprocess.run([sys.executable, "-c", ANOTHER_PYTHON], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-2:] == [
        "ddp_exp.compat: atexit._run_exitfuncs was written for python 3.10.x / 3.11.x / 3.12.x "
        "/ 3.13.x, found none: the process ends through the interpreter's own exit and "
        "teardown", "returned"]


# ------------------------------------------------------------------ public routes instead
def test_a_ranks_error_file_is_written_through_torchs_documented_variable(tmp_path, monkeypatch):
    """rank.failures writes errors/rank<R>.json with torch's ErrorHandler by pointing
    TORCHELASTIC_ERROR_FILE at it for the call (no override of ErrorHandler's private
    _get_error_file_path); torchrun's own value is put back."""
    from ddp_exp.rank.failures import _record_error_file

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "torchrun.json"))
    try:
        raise ValueError("bad batch")
    except ValueError as exc:
        _record_error_file(str(tmp_path / "rank1.json"), exc)
    record = json.loads((tmp_path / "rank1.json").read_text())
    assert record["message"]["message"] == "ValueError: bad batch"
    assert "py_callstack" in record["message"]["extraInfo"]
    assert os.environ["TORCHELASTIC_ERROR_FILE"] == str(tmp_path / "torchrun.json")
    assert not (tmp_path / "torchrun.json").exists()


# ------------------------------------------------------------------ no private name outside compat
# Another library's private names read outside ddp_exp.compat, each with why it stays there.
PRIVATE_NAMES_ALLOWED = {
    # os._exit is public (documented), underscored by name only.
    ("*", "_exit"),
    # torch's own SyncBatchNorm extends _BatchNorm too; DDP refuses that public class on CPU.
    # Held by test_contract_cpu_sync_batchnorm_builds_on_torchs_batchnorm_base.
    ("ddp_exp/distributed/sync_batchnorm.py", "_BatchNorm"),
}


def private_names_outside_compat() -> list[str]:
    """``path:line name`` for each ``x._name`` (x not ``self``/``cls``) and each ``from lib
    import _name`` (lib not ours) in src/ outside ddp_exp/compat, read with :mod:`ast`."""
    import ast

    src = Path(__file__).resolve().parents[1] / "src"
    found = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        if rel.startswith("ddp_exp/compat/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and not (
                    node.module or "").startswith(("ddp_exp", "hydra_plugins.ddp_")):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.Attribute) and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names = [node.attr]
            for name in names:
                private = name.startswith("_") and not name.endswith("_")  # not _target_
                if private and not {(rel, name), ("*", name)} & PRIVATE_NAMES_ALLOWED:
                    found.append(f"{rel}:{node.lineno} {name}")
    return found


def test_no_private_name_of_another_library_is_read_outside_compat():
    """Issue 27 item 3: a borrowed internal lives in ddp_exp.compat behind its version (or is
    replaced by public API). The sweeper read Optuna's trial._trial_id and study._storage."""
    assert private_names_outside_compat() == []


# ------------------------------------------------------------------ Optuna: public API only
@pytest.mark.parametrize("kind", ["journal", "sqlite"])
def test_contract_the_sweepers_trial_ids_and_requeue_go_through_the_public_storage(
        tmp_path, kind):
    """The sweeper hands a job its trial's id read through the storage's public methods
    (pruning.trial_id), and the job's optuna.trial.Trial(study, id) reports into that trial;
    an interrupted trial is marked FAIL and "interrupted" through the same storage, and
    requeued (it read Optuna's private trial._trial_id and study._storage)."""
    optuna = pytest.importorskip("optuna")
    from ddp_exp.job import pruning
    from hydra_plugins.ddp_optuna_sweeper.trials import requeue_interrupted

    url = (str(tmp_path / "journal.log") if kind == "journal"
           else f"sqlite:///{tmp_path / 'study.db'}")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = pruning.storage_of(url)
    assert isinstance(storage, optuna.storages.BaseStorage)
    study = optuna.create_study(study_name="s", storage=storage)
    study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    running = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    job_side = optuna.load_study(study_name="s", storage=pruning.storage_of(url))
    optuna.trial.Trial(job_side, pruning.trial_id(storage, "s", running.number)).report(0.5, 1)
    assert study.get_trials()[1].intermediate_values == {1: 0.5}
    assert study.get_trials()[0].intermediate_values == {}
    study.tell(0, 1.0)
    requeue_interrupted(study, storage)
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL", "WAITING"]
    assert trials[1].user_attrs == {"interrupted": True}
    assert trials[2].user_attrs == {"requeue_of": 1}
    assert study.ask({"x": optuna.distributions.FloatDistribution(0, 1)}).params == running.params


# ------------------------------------------------------------------ torch's _BatchNorm
def test_contract_cpu_sync_batchnorm_builds_on_torchs_batchnorm_base():
    """CPUSyncBatchNorm extends torch's private _BatchNorm (as torch's own SyncBatchNorm does:
    DDP refuses that public class on CPU, so it cannot be the base), takes its constructor's
    arguments in order, keeps its parameters and buffers (the state-dict keys of BatchNorm),
    replaces its forward and implements the input check that forward calls; convert finds
    every torch BatchNorm through it."""
    import torch
    from torch import nn
    from torch.nn.modules.batchnorm import _BatchNorm, _NormBase

    from ddp_exp.distributed.sync_batchnorm import CPUSyncBatchNorm, convert_sync_batchnorm

    assert list(inspect.signature(_BatchNorm.__init__).parameters)[:6] == [
        "self", "num_features", "eps", "momentum", "affine", "track_running_stats"]
    assert list(inspect.signature(_NormBase._check_input_dim).parameters) == ["self", "input"]
    assert "self._check_input_dim(input)" in inspect.getsource(_BatchNorm.forward)
    assert "SyncBatchNorm layers only work with GPU modules" in inspect.getsource(
        nn.parallel.DistributedDataParallel)
    assert all(issubclass(c, _BatchNorm) for c in (nn.BatchNorm1d, nn.BatchNorm2d,
                                                   nn.BatchNorm3d, nn.SyncBatchNorm))
    synced = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm3d(3)), "cpu")
    assert [type(m) for m in synced] == [CPUSyncBatchNorm, CPUSyncBatchNorm]
    bn = CPUSyncBatchNorm(3, 1e-3, None, True, True)
    assert (bn.eps, bn.momentum, bn.affine, bn.track_running_stats) == (1e-3, None, True, True)
    assert set(bn.state_dict()) == set(nn.BatchNorm2d(3).state_dict()) == {
        "weight", "bias", "running_mean", "running_var", "num_batches_tracked"}
    nn.BatchNorm2d(3).load_state_dict(bn.state_dict())
    with pytest.raises(ValueError, match="expected at least 2D input"):
        bn._check_input_dim(torch.ones(3))


# ------------------------------------------------------------------ load_state_dict's words
def test_contract_load_state_dict_names_the_keys_after_its_header():
    import torch

    from ddp_exp.compat import messages

    small, large = torch.nn.Linear(2, 3), torch.nn.Sequential(torch.nn.Linear(2, 4))
    with pytest.raises(RuntimeError) as other_keys:
        large.load_state_dict(small.state_dict())
    assert str(other_keys.value).startswith(messages.STATE_DICT_HEADER + "Sequential:")
    assert messages.torch_state_dict_details(str(other_keys.value)) == [
        'Missing key(s) in state_dict: "0.weight", "0.bias".',
        'Unexpected key(s) in state_dict: "weight", "bias".']
    with pytest.raises(RuntimeError) as other_shapes:
        torch.nn.Linear(2, 4).load_state_dict(small.state_dict())
    details = messages.torch_state_dict_details(str(other_shapes.value))
    assert [d.split(":")[0] for d in details] == ["size mismatch for weight",
                                                  "size mismatch for bias"], details
    assert messages.torch_state_dict_details("'model'") is None  # a KeyError's text


def test_on_another_torch_a_model_mismatch_quotes_torchs_text_whole(other_version, caplog):
    import torch

    from ddp_exp.io.checkpoint import model_mismatch

    small, large = torch.nn.Linear(2, 3), torch.nn.Sequential(torch.nn.Linear(2, 4))
    with pytest.raises(RuntimeError) as caught:
        large.load_state_dict(small.state_dict())
    state = {"model": small.state_dict()}
    assert model_mismatch(caught.value, state, {}).startswith('Missing key(s) in state_dict: "0.')
    assert model_mismatch(KeyError("model"), {}, {}) == "'model'"
    other_version("torch")
    line = model_mismatch(caught.value, state, {})
    assert line.startswith("Error(s) in loading state_dict for Sequential:; Missing key(s)"), line
    assert "\n" not in line
    assert model_mismatch(KeyError("model"), {}, {}) == "'model'"
    assert "load_state_dict" in compat_lines(caplog)[0]


# ------------------------------------------------------------------ Hydra's "Could not find"
def test_contract_hydra_names_the_config_path_it_could_not_find(compose):
    from hydra.errors import MissingConfigException

    from ddp_exp.compat import messages

    with pytest.raises(MissingConfigException) as info:
        compose("data=digitz")
    assert messages.hydra_missing_configs(str(info.value)) == [info.value.missing_cfg_file] == [
        "data/digitz"], str(info.value)


def test_on_another_hydra_no_install_hint_is_read_from_its_words(other_version, monkeypatch):
    """The hint for a missing plugin is read from Hydra's words only on Hydra 1.3; the entry
    point's own line (_unknown_option_line's) names the config path on any Hydra."""
    import importlib.util

    from hydra.errors import MissingConfigException

    from ddp_exp.cli.errors import _unknown_option_line, missing_plugin_hint

    hydras = "In 'launcher/slurm': Could not find 'hydra/launcher/submitit_slurm'"
    ours = _unknown_option_line(MissingConfigException(hydras, "hydra/launcher/submitit_slurm",
                                                       ["basic"]), ["launcher=slurm"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if "submitit" in name else real(name, *a))
    hint = "hint: this needs Hydra's submitit plugin: pip install -e '.[slurm]'"
    assert missing_plugin_hint(hydras) == missing_plugin_hint(ours) == hint
    assert missing_plugin_hint("hydra/launcher=submitit_slurm: no such option in config group "
                               "hydra/launcher; valid options: basic") == hint
    other_version("hydra-core")
    assert missing_plugin_hint(hydras) is None
    assert missing_plugin_hint(ours) == hint


def _backward_with_end_callbacks() -> list[str]:
    """A backward over two parameters whose gradient hooks each note ``hook`` and queue
    ``end`` on ``compat.tensors.backward_end_queue()``: the order they were noted in."""
    import torch

    from ddp_exp.compat.tensors import backward_end_queue

    seen: list[str] = []

    def hook(param):
        seen.append("hook")
        backward_end_queue()(lambda: seen.append("end"))

    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))]
    for p in params:
        p.register_post_accumulate_grad_hook(hook)
    (params[0] * 2 + params[1] * 3).sum().backward()
    return seen


def test_contract_autograd_runs_a_queued_callback_after_the_backward():
    """``compat.tensors.backward_end_queue()`` called from each parameter's gradient hook runs after
    every hook of the backward (autograd's queue), not at the hook that called it."""
    assert _backward_with_end_callbacks() == ["hook", "hook", "end", "end"]


def test_on_another_torch_the_backward_end_is_the_hooks_moment(other_version, caplog):
    other_version("torch")
    assert _backward_with_end_callbacks() == ["hook", "end", "hook", "end"]
    assert any("queue_callback" in line for line in compat_lines(caplog))


def test_contract_hydras_group_options_take_what_the_help_memo_passes():
    """compat.hydra_help calls ``ConfigLoaderImpl.get_group_options(self, group_name,
    results_filter, config_name, overrides)`` by position, with ``ObjectType.CONFIG`` as the
    default filter."""
    import inspect

    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.object_type import ObjectType

    params = inspect.signature(ConfigLoaderImpl.get_group_options).parameters
    assert list(params) == ["self", "group_name", "results_filter", "config_name", "overrides"]
    assert params["results_filter"].default is ObjectType.CONFIG
