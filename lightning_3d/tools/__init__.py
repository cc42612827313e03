"""Opt-in tools over the core: the pipeline timeline, the fail-fast watch and the data-parallel consistency check."""
