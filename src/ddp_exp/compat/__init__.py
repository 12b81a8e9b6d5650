"""Everything that relies on another library's private attributes or message wording, each
behind the version it was written for.

Imports no ddp_exp package.
"""
