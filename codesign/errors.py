"""Typed errors for what a user can cause; the CLI maps them to exit codes in one place."""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix: reported in one line, exit code 2, nothing written."""


class ConfigError(UserError):
    def __init__(self, path: str, table: str, field: str | None, problem: str):
        where = f"{path}: {table}" + (f" field {field!r}" if field else "")
        super().__init__(f"{where}: {problem}")
        self.path, self.table, self.field, self.problem = path, table, field, problem


class StoreError(UserError):
    """The results DB cannot be opened or is of an unknown schema."""


class PlanError(Exception):
    """A job matches its cluster but cannot run as asked; recorded as `invalid`, never fatal."""
