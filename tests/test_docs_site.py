"""The documentation as its users read it (docs/mkdocs.yml, docs/pages/, README.md).

- The site builds with ``mkdocs build --strict``: no warning, every internal link and anchor
  resolves (and a broken one does fail the build).
- Every configuration key and every command-line flag has a description, and the generated
  reference lists each of them (docs/reference_hook.py).
- The README is short, starts with the two set-up commands, and its links resolve.
- Every command of the tutorial (docs/pages/tutorial.md, its ``console`` blocks) runs, in order,
  in an empty directory, and prints the lines the page shows.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from terascale.pipeline.spark_compat import parquet_encoding

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = DOCS / "pages"
TUTORIAL = PAGES / "tutorial.md"
README = ROOT / "README.md"
MKDOCS = Path(sys.executable).with_name("mkdocs")


def _hook():
    spec = importlib.util.spec_from_file_location("terascale_docs_reference_hook", DOCS / "reference_hook.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------------------------
# descriptions


def test_every_configuration_key_has_a_description_and_a_row_in_the_reference():
    hook = _hook()
    assert hook.undocumented_keys() == []
    keys = [k for k, _ in hook.config_params()]
    assert len(keys) > 80 and "train.l2" in keys and "train.inject.fail_shard" in keys
    page = hook.config_reference()
    missing = [k for k in keys if f"`{k}`{{#{k}}}" not in page]
    assert not missing, missing


def test_every_command_line_flag_has_a_description_and_a_row_in_the_reference():
    from terascale.jobs.cli import build_parser

    hook = _hook()
    assert hook.undocumented_flags() == []
    page = hook.cli_reference()
    parser = build_parser()
    for name, _, sub in hook._subparsers(parser):
        assert f"## {name}\n" in page
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in page.split(f"## {name}\n", 1)[1], (name, flag)


def test_the_description_checks_find_what_is_missing():
    p = argparse.ArgumentParser(prog="tool")
    p.add_argument("--documented", help="it has one")
    sub = p.add_subparsers(dest="command")
    s = sub.add_parser("run", help="run it")
    s.add_argument("--bare")
    s.add_argument("path")
    sub.add_parser("silent")
    assert _hook().undocumented_flags(p) == ["tool run --bare", "tool run path", "tool silent (the command itself)"]


def test_exit_codes_are_the_ones_the_cli_returns(tmp_path, capsys):
    from terascale.jobs.cli import EXIT_CODES, EXIT_OK, EXIT_USAGE, main

    assert sorted(EXIT_CODES) == [0, 1, 2]
    assert main(["config", "--set", "featurize.bits=40"]) == EXIT_USAGE
    assert main(["config"]) == EXIT_OK
    table = _hook().exit_codes()
    assert all(f"| {code} |" in table for code in EXIT_CODES)


# ---------------------------------------------------------------------------------------------
# the site


def _build(config: Path, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([str(MKDOCS), "build", "--strict", "-f", str(config), "-d", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)


def test_the_site_builds_strict_with_the_generated_reference(tmp_path):
    r = _build(DOCS / "mkdocs.yml", tmp_path / "site")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WARNING" not in r.stderr, r.stderr
    site = tmp_path / "site"
    for page in ("index.html", "tutorial.html", "how-to/cluster.html", "reference/configuration.html",
                 "reference/cli.html", "reference/exit-codes.html", "explanation/architecture.html"):
        assert (site / page).is_file(), page
    config = (site / "reference" / "configuration.html").read_text()
    assert 'id="train.l2"' in config and 'id="allreduce.cipher"' in config
    assert "<!-- terascale:" not in config  # every marker was replaced
    cli = (site / "reference" / "cli.html").read_text()
    assert "--init-model-if-exists" in cli and "--max-regression" in cli
    assert (site / "explanation" / "scaling.png").is_file()


def test_a_broken_link_or_anchor_fails_the_strict_build(tmp_path):
    copy = tmp_path / "docs"
    shutil.copytree(DOCS, copy, ignore=shutil.ignore_patterns("__pycache__"))
    page = copy / "pages" / "how-to" / "index.md"
    page.write_text(page.read_text() + "\n[a key](../reference/configuration.md#train.no_such_key)\n")
    r = _build(copy / "mkdocs.yml", tmp_path / "site")
    assert r.returncode != 0
    assert "does not contain an anchor '#train.no_such_key'" in r.stderr


# ---------------------------------------------------------------------------------------------
# the README


def _slug_markdown(title: str) -> str:
    """Python-Markdown's toc slug (what MkDocs gives a heading)."""
    text = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _slug_github(title: str) -> str:
    """GitHub's heading anchor (what a reader of the README on GitHub follows)."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def _headings(md: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    return [re.sub(r"`", "", h).strip() for h in re.findall(r"^#{1,6} (.+)$", text, re.M)]


def test_the_readme_is_short_starts_with_the_two_commands_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    assert text.startswith("# terascale\n\n```\nmake demo\nmake test\n```\n")
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [link for link in links if not re.match(r"\w+://", link)]
    assert len(local) > 20
    bad = []
    for link in local:
        path, _, anchor = link.partition("#")
        target = (ROOT / path).resolve()
        if not target.exists():
            bad.append(f"{link}: no such file")
        elif anchor:
            titles = _headings(target)
            if anchor not in {_slug_markdown(t) for t in titles} or anchor not in {_slug_github(t) for t in titles}:
                bad.append(f"{link}: no such heading (on the site and on GitHub)")
    assert not bad, bad


# ---------------------------------------------------------------------------------------------
# the tutorial

#: volatile parts of an output line: durations, rates, memory sizes
_VOLATILE = [(re.compile(r"\b\d[\d,]*(?:\.\d+)? rows/s\b"), "<rate>"),
             (re.compile(r"\b\d+(?:\.\d+)? ?(?:KiB|MiB|GiB)\b"), "<size>"),
             (re.compile(r"\b\d+(?:\.\d+)? s\b"), "<seconds>")]


def _normalize(line: str, volatile=_VOLATILE) -> str:
    for pattern, repl in volatile:
        line = pattern.sub(repl, line)
    return line.rstrip()


def tutorial_steps(text: str) -> list[tuple[str, list[str]]]:
    """(command, expected output lines) of every ``$ `` line of the page's ``console`` blocks; a
    command line ending in a backslash goes on on the next line."""
    steps: list[tuple[str, list[str]]] = []
    for block in re.findall(r"^```console\n(.*?)^```", text, re.M | re.S):
        continued = False
        for line in block.splitlines():
            if continued:  # a command's line ending in a backslash goes on here
                steps[-1] = (steps[-1][0][:-1].rstrip() + " " + line.strip(), [])
            elif line.startswith("$ "):
                steps.append((line[2:], []))
            else:
                assert steps, f"output before any command in a console block: {line!r}"
                steps[-1][1].append(line)
            continued = bool(steps) and not steps[-1][1] and steps[-1][0].endswith("\\")
    return steps


def output_matches(expected: list[str], actual: str, volatile=_VOLATILE) -> bool:
    """The whole output, line by line, ``volatile`` parts aside; a line ``...`` stands for any
    number of lines, and ``…`` within a line for any text."""
    pattern = ""
    for line in expected:
        if line == "...":
            pattern += r"(?:[^\n]*\n)*?"
        else:
            pattern += ".*".join(re.escape(part) for part in _normalize(line, volatile).split("…")) + r"\n"
    text = "".join(_normalize(line, volatile) + "\n" for line in actual.splitlines())
    return re.fullmatch(pattern, text) is not None


def test_the_output_matcher():
    out = "a 1.5 s, 3,000 rows/s\nb\nc /tmp/x/m\nd\n"
    assert output_matches(["a 9.1 s, 12 rows/s", "b", "c …/m", "d"], out)
    assert output_matches(["a 0 s, 1 rows/s", "...", "d"], out)
    assert not output_matches(["a 0 s, 1 rows/s", "d"], out)  # lines left out without "..."
    assert not output_matches(["a 0 s, 1 rows/s", "b", "c …/n", "d"], out)
    assert not output_matches(["a 0 s, 1 rows/s", "...", "e"], out)
    steps = tutorial_steps("x\n```console\n$ one \\\n  --flag\nout\n...\n$ two\n```\n```bash\n$ not this\n```\n")
    assert steps == [("one --flag", ["out", "..."]), ("two", [])]


_SHELL = re.compile(r"[|<>;&$`]")


@pytest.mark.spark
@pytest.mark.slow
def test_every_command_of_the_tutorial_prints_what_the_page_shows(spark, tmp_path, monkeypatch, capsys):
    """Commands run in order in an empty directory, ``terascale`` on the PATH. A ``terascale``
    command runs in this process through the console script's entry point (sharing the test
    session's Spark), fed on stdin by the program piped into it, which runs under bash as any
    other command does."""
    from terascale.jobs.cli import main

    steps = tutorial_steps(TUTORIAL.read_text())
    commands = [c for c, _ in steps]
    assert len(steps) >= 15 and any(c.startswith("terascale train ") for c in commands)
    for verb in ("generate", "featurize", "train", "evaluate", "predict", "score", "gate", "publish"):
        assert any(re.search(rf"\bterascale {verb}\b", c) for c in commands), verb
    work = tmp_path / "tutorial"
    work.mkdir()
    monkeypatch.chdir(work)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "LC_ALL": "C"}
    volatile = _VOLATILE
    if parquet_encoding("auto", spark.version) != "byte_stream_split":  # the page's byte counts are byte_stream_split's (Spark >= 4.3)
        volatile = [*_VOLATILE, (re.compile(r"(bytes written +)[\d,]+"), r"\1<bytes>")]
    failures = []
    for command, expected in steps:
        capsys.readouterr()
        source, _, tail = command.rpartition(" | ")
        if command.startswith("terascale ") and not _SHELL.search(command):
            rc = main(shlex.split(command)[1:])
            out = capsys.readouterr().out
        elif source and tail.startswith("terascale ") and not _SHELL.search(tail):  # PROGRAM | terascale ...
            fed = subprocess.run(["bash", "-c", source], cwd=work, env=env, capture_output=True, check=True,
                                 timeout=300).stdout
            monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(fed)))
            rc = main(shlex.split(tail)[1:])
            out = capsys.readouterr().out
        else:
            r = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True,
                               timeout=300)
            rc, out = r.returncode, r.stdout
        if rc != 0:
            failures.append(f"$ {command}\nexit code {rc}")
            break
        if not output_matches(expected, out, volatile):
            failures.append(f"$ {command}\n--- the page shows:\n" + "\n".join(expected) + "\n--- it printed:\n" + out)
    assert not failures, "\n\n".join(failures)
