"""Configuration: the schema (defaults, types), the checks across keys, ``_target_`` lookup,
Hydra registration. The bottom of the house (above :mod:`ddp_exp.compat`): every package may import
it;
it imports no other ddp_exp package.
"""
