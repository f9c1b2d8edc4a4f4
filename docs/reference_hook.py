"""The reference pages, generated from the code when the site is built (an MkDocs hook).

A page holds a marker where generated text goes, ``<!-- terascale:NAME ARGUMENT -->`` (a block
alone on its line, a ``value`` inline); :func:`on_page_markdown` replaces each marker by
:data:`GENERATORS` ``[NAME](ARGUMENT)``:

- ``config``: every configuration key of the schema (``jobs/config.py``): its name, type,
  default, allowed values and description, one table per section, each key an anchor
  (``configuration.md#train.l2``);
- ``cli``: every command of the ``terascale`` parser (``jobs/cli.py``) and each of its flags;
- ``exit-codes``: ``terascale.jobs.cli.EXIT_CODES``;
- ``schema DOTTED``: the columns of a pyarrow schema;
- ``docstring DOTTED``: a module's or an object's docstring;
- ``spec-json``: the default feature specification as it is written into a manifest;
- ``value DOTTED``: one constant;
- ``include PATH``: a file of the repository (relative to it) as a code block.

So the reference cannot drift from the code: a key, a flag or a column that changes changes the
page. :func:`undocumented_keys` and :func:`undocumented_flags` list what has no description
(``tests/test_docs_site.py`` requires none). The module is also importable by itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!-- terascale:([\w-]+)(?: +(\S+))? -->")


def _cell(text: Any) -> str:
    """Text for one Markdown table cell: pipes escaped, on one line."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _sentence(text: str) -> str:
    """A help text as a table cell that reads as a sentence: a capital first, a full stop last."""
    text = _cell(text)
    return text[:1].upper() + text[1:] + ("" if text.endswith((".", ")", "?")) else ".")


def _code(text: str) -> str:
    """An inline code span holding ``text`` (backticks inside get a longer fence)."""
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


# ---------------------------------------------------------------------------------------------
# configuration


def _plain(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    return v


def _yaml_value(key: str, v: Any) -> str:
    """A default as a YAML file writes it (``spark.conf`` is a mapping, frozen to pairs)."""
    plain = dict(v) if key == "spark.conf" else _plain(v)
    text = yaml.safe_dump(plain, default_flow_style=True, width=10**6).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _type_name(key: str, f: dataclasses.Field) -> str:
    from terascale.solvers.constraints import AutoOr

    c = f.metadata.get("constraint")
    if isinstance(c, AutoOr):
        return f"'{c.word}' or {'int' if c.inner.integer else 'float'}"
    if key == "spark.conf":
        return "mapping"
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return {"tuple": "list"}.get(t, t)


def config_params() -> list[tuple[str, dataclasses.Field]]:
    """Every leaf key of the configuration schema with its field, in schema order."""
    from terascale.jobs.config import iter_params

    return list(iter_params())


def undocumented_keys() -> list[str]:
    """The configuration keys whose help text is missing or blank."""
    return [k for k, f in config_params() if not str(f.metadata.get("help") or "").strip()]


def _sections() -> dict[str, str]:
    """Section prefix -> its help text (``train.inject`` included)."""
    from terascale.jobs.config import Config, _field_type, _is_section

    out: dict[str, str] = {}

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            if _is_section(f):
                out[prefix + f.name] = f.metadata["help"]
                walk(_field_type(cls, f), prefix + f.name + ".")

    walk(Config, "")
    return out


def config_reference(_: str | None = None) -> str:
    from terascale.jobs.config import _default

    if missing := undocumented_keys():
        raise ValueError("terascale docs: configuration keys without a description: " + ", ".join(missing))
    helps = _sections()
    by_section: dict[str, list[tuple[str, dataclasses.Field]]] = {}
    for key, f in config_params():
        by_section.setdefault(key.rsplit(".", 1)[0], []).append((key, f))
    out = []
    for name, params in by_section.items():
        out += [f"## {name}", "", f"{helps[name][0].upper()}{helps[name][1:]}.", "",
                "| key | default | description |", "|---|---|---|"]
        for key, f in params:
            c = f.metadata.get("constraint")
            allowed = _cell(c.describe()) if c is not None else "any value of its type"
            out.append(f"| {_code(key)}{{#{key}}}<br>*{_cell(_type_name(key, f))}* | "
                       f"{_code(_cell(_yaml_value(key, _default(f))))} | {_sentence(f.metadata['help'])}<br>"
                       f"*Allowed:* {allowed} |")
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# command line


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of every subcommand, in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            return [(name, helps.get(name) or "", p) for name, p in action.choices.items()]
    return []


def _documented_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def undocumented_flags(parser: argparse.ArgumentParser | None = None) -> list[str]:
    """``command flag`` for every argument of the parser (and its subcommands) without help text,
    and every subcommand without a one-line help."""
    if parser is None:
        from terascale.jobs.cli import build_parser

        parser = build_parser()
    missing = []
    for name, where in [("", parser)] + [(n, p) for n, _, p in _subparsers(parser)]:
        for a in _documented_actions(where):
            if a.help is None or a.help == argparse.SUPPRESS or not str(a.help).strip():
                flag = "/".join(a.option_strings) or a.dest
                missing.append(f"{where.prog.split()[0]} {name} {flag}".replace("  ", " ").strip())
    missing += [f"{parser.prog} {name} (the command itself)" for name, helps, _ in _subparsers(parser)
                if not helps.strip()]
    return missing


def _usage(p: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(p.prog, width=96, max_help_position=40)
    formatter.add_usage(p.usage, p._actions, p._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _flag_row(a: argparse.Action) -> str:
    names = ", ".join(_code(s) for s in a.option_strings) or _code(a.metavar or a.dest)
    if a.nargs == 0:
        value = "—"
    else:
        metavar = a.metavar or (a.dest.upper() if a.option_strings else a.dest)
        if a.choices:
            metavar = "{" + ",".join(map(str, a.choices)) + "}"
        value = _code(f"{metavar} ..." if a.nargs in ("+", "*") else metavar)
    if not a.option_strings or a.required:
        default = "required"
    elif a.nargs == 0 or a.default in (None, [], argparse.SUPPRESS):
        default = "—"
    else:
        default = _code(str(a.default))
    repeat = " (repeatable)" if isinstance(a, argparse._AppendAction) and "repeatable" not in a.help else ""
    return f"| {names} | {value} | {default} | {_sentence(a.help + repeat)} |"


def cli_reference(_: str | None = None) -> str:
    from terascale.jobs.cli import build_parser

    parser = build_parser()
    if missing := undocumented_flags(parser):
        raise ValueError("terascale docs: command-line flags without a description: " + ", ".join(missing))
    out = [f"`{parser.prog}` — {parser.description}", "", "```", _usage(parser), "```", "",
           "| flag | value | default | description |", "|---|---|---|---|"]
    out += [_flag_row(a) for a in _documented_actions(parser)] + [""]
    out += ["| command | what it does |", "|---|---|"]
    out += [f"| [`{name}`](#{name}) | {_cell(helps)} |" for name, helps, _ in _subparsers(parser)] + [""]
    for name, helps, p in _subparsers(parser):
        out += [f"## {name}", "", f"{helps[0].upper()}{helps[1:]}.", "", "```", _usage(p), "```", "",
                "| flag | value | default | description |", "|---|---|---|---|"]
        out += [_flag_row(a) for a in _documented_actions(p)]
        out.append("")
    return "\n".join(out)


def exit_codes(_: str | None = None) -> str:
    from terascale.jobs.cli import EXIT_CODES

    rows = ["| code | meaning |", "|---|---|"]
    rows += [f"| {code} | {_cell(text)} |" for code, text in sorted(EXIT_CODES.items())]
    return "\n".join(rows) + "\n"


# ---------------------------------------------------------------------------------------------
# objects of the code


def _resolve(dotted: str) -> Any:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(f"terascale docs: nothing importable at {dotted}")


def schema_table(dotted: str) -> str:
    schema = _resolve(dotted)
    rows = ["| column | type | nullable |", "|---|---|---|"]
    rows += [f"| `{f.name}` | `{f.type}` | {'yes' if f.nullable else 'no'} |" for f in schema]
    return "\n".join(rows) + "\n"


def docstring(dotted: str) -> str:
    return inspect.cleandoc(_resolve(dotted).__doc__ or "").strip() + "\n"


def value(dotted: str) -> str:
    return _code(repr(_resolve(dotted)))


def spec_json(_: str | None = None) -> str:
    from terascale.jobs.config import Config, feature_spec

    return "```json\n" + json.dumps(feature_spec(Config()).to_json(), indent=2) + "\n```\n"


def include(path: str) -> str:
    file = (ROOT / path).resolve()
    if ROOT not in file.parents:
        raise ValueError(f"terascale docs: include {path}: outside the repository")
    lang = {".py": "python", ".yaml": "yaml", ".yml": "yaml", ".sh": "bash"}.get(file.suffix, "")
    return f"```{lang}\n{file.read_text(encoding='utf-8').rstrip()}\n```\n"


GENERATORS = {
    "config": config_reference,
    "cli": cli_reference,
    "exit-codes": exit_codes,
    "schema": schema_table,
    "docstring": docstring,
    "value": value,
    "spec-json": spec_json,
    "include": include,
}


def render(markdown: str) -> str:
    """``markdown`` with every marker replaced by its generated text (an unknown one raises)."""

    def one(m: re.Match) -> str:
        name, arg = m.group(1), m.group(2)
        if name not in GENERATORS:
            raise ValueError(f"terascale docs: unknown marker {m.group(0)}")
        return GENERATORS[name](arg).rstrip("\n")

    return MARKER.sub(one, markdown)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:  # MkDocs hook
    return render(markdown)
