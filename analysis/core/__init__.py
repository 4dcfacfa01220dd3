"""The floor every other subpackage stands on: defaults (one owner per threshold), the result protocol, JSON and
file writing, small statistics, memory probes and package versions. Imports nothing else of the package."""
