"""The floor every other subpackage stands on: defaults (one owner per threshold), the result protocol, JSON and
file writing, small statistics, memory probes and package versions, and the command line's light half (``options``,
``paths``, ``checks``, ``lazy``: parsed and checked before torch loads). Imports nothing else of the package."""
