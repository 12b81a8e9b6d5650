"""Everything that relies on another library's private attributes or message wording, each
behind the version it was written for (:mod:`~ddp_exp.compat.versions`: torch 2.13, Hydra 1.3,
OmegaConf 2.3, submitit 1.5, CPython 3.10-3.13), falling back to the library's stock behaviour,
with one log line, on any other:

* :mod:`~ddp_exp.compat.elastic_agent`: the elastic agent's start of its ranks (torch).
* :mod:`~ddp_exp.compat.interpreter`: the exit without the interpreter's teardown (atexit).
* :mod:`~ddp_exp.compat.messages`: the readers of Hydra's, OmegaConf's, submitit's and torch's
  message wording.
* :mod:`~ddp_exp.compat.omegaconf`: the schema's open sections (``DictConfig._get_node``).
* :mod:`~ddp_exp.compat.preload`: ``torch._dynamo`` imported before the ranks are forked.
* :mod:`~ddp_exp.compat.submitit`: submitit's local job table and node-list parser.
* :mod:`~ddp_exp.compat.tensors`: ``torch._foreach_norm`` and a compiled module's original.

A borrowing stays only where it prevents a hang, a wrong result or a traceback users would
see, or saves time that counts (each module's docstring says which, with its measure); one
that bought milliseconds was dropped (issue 27 item 3). ``tests/test_compat.py`` holds each
to what it relies on and tests each fallback.

Imports no ddp_exp package.
"""
