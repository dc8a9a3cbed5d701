"""Command lines that end bad input in one line: `UsageError`, and an argparse parser that
raises it instead of printing its usage and exiting (`--help` still prints and exits 0)."""
from __future__ import annotations

import argparse


class UsageError(ValueError):
    pass


class ArgumentParser(argparse.ArgumentParser):
    """argparse's own complaints (an unknown flag, a missing one, a value that is not a number) as a
    UsageError, so that they end in one line and exit 2 like every other."""

    def error(self, message: str):
        raise UsageError(message.replace("\n", "\\n"))

    def _get_values(self, action, arg_strings):
        if action.nargs is None and arg_strings == ["--"]:  # Python 3.11 reads "--lr=--" as an empty list
            self.error(f"argument {'/'.join(action.option_strings)}: expected one argument")
        return super()._get_values(action, arg_strings)


PROFILES_HELP = ("a JSON file of hardware profiles that override the shipped ones by name (default: "
                 "$ZEROFUNC_PROFILES, else $XDG_CONFIG_HOME/zerofunc/profiles.json, ~/.config/zerofunc/profiles.json "
                 "without it)")


def profiles_flag(argv: list[str] | None) -> str | None:
    """The --profiles FILE of a command line, read before the rest is parsed: the profiles it names
    are what a parser's help lists, and what every later step plans with."""
    pre = ArgumentParser(add_help=False, allow_abbrev=False)  # the parser proper reads an abbreviation
    pre.add_argument("--profiles", default=None)
    return pre.parse_known_args(argv)[0].profiles
