"""The search space of ``hydra/sweeper=ddp_optuna``: Hydra's sweep grammar as Optuna
distributions, the sampler, and a trial's values written back as overrides a job receives
exactly as they were drawn."""

from __future__ import annotations

from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser

from hydra_plugins.ddp_optuna_sweeper.checks import SweepRefused

SAMPLERS = ("tpe", "random", "grid")


def distributions(params: dict[str, str], arguments: list[str]) -> tuple[dict, list[str]]:
    """Optuna distributions of the swept keys and the fixed overrides of every trial:
    ``interval`` is a float range (``tag(log, ...)``: log scale; ``tag(int, ...)``: integers),
    ``choice`` and ``range`` are categorical.

    Args:
        params: ``hydra.sweeper.params`` (key -> a value in Hydra's sweep grammar).
        arguments: the command line's overrides (a sweep there joins ``params``).

    Returns:
        ``({key: optuna distribution}, [fixed "key=value" overrides])``.

    Raises:
        SweepRefused: a sweep the sampler cannot take (``range`` of floats is a choice).
    """
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    parser = OverridesParser.create()
    overrides = parser.parse_overrides([f"{k}={v}" for k, v in params.items()] + arguments)
    dists, fixed = {}, []
    for o in overrides:
        key = o.get_key_element()
        if not o.is_sweep_override():
            fixed.append(o.input_line)
            continue
        value = o.value()
        if isinstance(value, IntervalSweep):
            log_scale = "log" in value.tags
            kind = IntDistribution if "int" in value.tags else FloatDistribution
            cast = int if kind is IntDistribution else float  # Hydra's interval is float
            try:
                dists[key] = kind(cast(value.start), cast(value.end), log=log_scale)
            except ValueError as exc:  # low > high, or a log scale that reaches 0
                raise SweepRefused(f"{o.input_line}: {exc}") from None
        elif isinstance(value, (ChoiceSweep, RangeSweep)):
            dists[key] = CategoricalDistribution(list(o.sweep_iterator()))
        else:
            raise SweepRefused(f"{key}={o.get_value_element_as_str()}: not a sweep the "
                               "ddp_optuna sweeper takes (choice, range, interval)")
    return dists, fixed


def _grid_sampler_class() -> type:
    import optuna

    class AskTellGridSampler(optuna.samplers.GridSampler):
        """Optuna's GridSampler without its ``study.stop()`` once the grid is exhausted:
        ``Study.stop`` works only inside ``Study.optimize`` and raises under ask-and-tell
        ("Study.stop is supposed to be invoked inside an objective function", optuna #5141,
        seen with Optuna 5.1). The sweeper counts the grid's points itself
        (:func:`hydra_plugins.ddp_optuna_sweeper.trials.grid_points_left`) and stops asking."""

        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            return None

    return AskTellGridSampler


def build_sampler(spec: dict[str, Any], dists: dict[str, Any]) -> Any:
    """The Optuna sampler of ``hydra.sweeper.sampler`` (``name``, ``seed``).

    Raises:
        SweepRefused: an unknown name, or ``grid`` over an ``interval`` (no points to list).
    """
    import optuna

    name, seed = spec.get("name") or "tpe", spec.get("seed")
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        if not all(hasattr(d, "choices") for d in dists.values()):
            raise SweepRefused("hydra.sweeper.sampler.name=grid takes choice(...) and "
                               "range(...) params only, not interval(...)")
        return _grid_sampler_class()({k: list(d.choices) for k, d in dists.items()},
                                     seed=seed)
    raise SweepRefused(f"hydra.sweeper.sampler.name={name!r} is invalid: one of "
                       f"{', '.join(SAMPLERS)}")


def quoted(text: str) -> str:
    """``text`` as a single-quoted string of Hydra's override grammar, which the job's config
    reads back exactly: Hydra's own ``QuotedString.with_quotes`` (quotes escaped, and the
    backslashes before a quote or the closing quote doubled, as the grammar's rules say)."""
    from hydra.core.override_parser.types import Quote, QuotedString

    return QuotedString(text=text, quote=Quote.single).with_quotes()


def override_of(key: str, value: Any) -> str:
    """``key=value`` as an override that gives the job ``value`` exactly (hydra #2612): a
    string quoted (:func:`quoted`: commas, ``=``, ``:``, quotes, backslashes and leading or
    trailing spaces kept; ``'32'`` or ``'true'`` stays a string), None as ``null``, a bool as
    ``true``/``false``, a float as its ``repr`` (round-trips), an int as written."""
    if isinstance(value, str):
        return f"{key}={quoted(value)}"
    if value is None:
        return f"{key}=null"
    if isinstance(value, bool):
        return f"{key}={str(value).lower()}"
    return f"{key}={value!r}" if isinstance(value, float) else f"{key}={value}"
