"""How a configuration dataclass's field is a command-line flag (``Flag``, in the field's metadata under ``"flag"``):
collect's flags are generated from ``CollectConfig``'s fields (collectors/trainer/config.py) and its known-workload
group from ``manifest.Workload``'s (collectors/command.py), so a flag is its field's name and its help the field's
words. Here, in core, because run.json's own schema (``Workload``) carries them; nothing here parses anything."""

from __future__ import annotations

from dataclasses import dataclass

FIELD_DEFAULT = object()  # ``Flag.default``: the flag's default is the field's own


@dataclass(frozen=True)
class Flag:
    """How a configuration field is a flag of ``traceana collect`` (in the field's metadata, ``"flag"``).

    The flag is ``--<field name>`` (underscores as dashes) unless ``spellings`` says otherwise (the first is the one
    the help shows; the field's own name stays accepted, hidden, where it is not the first, unless ``own`` is False:
    then only ``spellings``). ``shared``: the name of the traceana/commands/options.py function defining the flag
    collect and estimate share (its help and its command-line default are that function's, estimate's too); else
    ``help`` is the flag's help and ``default`` its default (``FIELD_DEFAULT``: the field's). ``dest``: the parsed
    argument, where it is named otherwise than the field. ``choices`` and ``action`` (``"append"``: repeatable,
    each value a string) are argparse's."""

    help: str = ""
    shared: str | None = None
    spellings: tuple[str, ...] = ()
    metavar: str | None = "N"
    dest: str | None = None
    own: bool = True
    default: object = FIELD_DEFAULT
    choices: tuple[str, ...] | None = None
    action: str | None = None

    def names(self, field_name: str) -> tuple[str, ...]:
        """Every spelling of the flag, the shown one first."""
        own = "--" + field_name.replace("_", "-")
        if not self.spellings:
            return (own,)
        return self.spellings + ((own,) if self.own and own not in self.spellings else ())


def flag(**kw) -> dict:
    """A field's metadata making it the flag ``Flag(**kw)``."""
    return {"flag": Flag(**kw)}
