"""README.md and docs/structure.md tell the current truth: every path they name exists, every link lands on a
file and heading, and the facts they state (the proposers, the default method and its K, the default draft,
the playground's colours, the benchmark figures) match the registry, config/default.yaml, the page's
stylesheet and the benchmark ledger."""

from __future__ import annotations

import colorsys
import re
from glob import glob
from pathlib import Path

import pytest
import yaml

from bench import ledger
from bench.report import between, latest_markdown
from server.speculation.registry import AUTO, BUILTIN, PLAIN

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text(encoding="utf-8")
STRUCTURE = (REPO / "docs" / "structure.md").read_text(encoding="utf-8")
DEFAULTS = yaml.safe_load((REPO / "config" / "default.yaml").read_text())
TOP = ("server/", "bench/", "docs/", "tests/", "config/", "deploy/", "compat/", ".ci/")


def _links(text: str) -> list[str]:
    """Relative targets of markdown links and images (no URLs, no in-page anchors)."""
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+://|#", t)]


def _code_paths(text: str) -> list[str]:
    """Code spans that name a repository path (start at a top-level folder; no spaces)."""
    return [s for s in re.findall(r"`([^`\s]+)`", text) if s.startswith(TOP)]


def _exists(path: str) -> bool:
    """A path, a folder, or a pattern with `<placeholder>`s (any match)."""
    pattern = re.sub(r"<[^>]+>", "*", path.split("#")[0].split("::")[0])
    return bool(glob(str(REPO / pattern)))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_path_and_link_in_readme_exists() -> None:
    named = _links(README) + _code_paths(README)
    assert named, "README names no paths?"
    missing = [p for p in named if not _exists(p)]
    assert not missing, f"README names paths that do not exist: {missing}"


def test_every_anchor_readme_links_to_is_a_heading() -> None:
    for target in _links(README):
        path, _, anchor = target.partition("#")
        if not anchor:
            continue
        headings = re.findall(r"^#+ (.+)$", (REPO / path).read_text(encoding="utf-8"), flags=re.M)
        assert anchor in {_slug(h) for h in headings}, f"{target}: no heading for #{anchor}"


def test_every_module_in_the_structure_map_exists() -> None:
    """A module of a `## folder/` table is in that folder; a path anywhere in the map exists."""
    missing = []
    folder = ""
    for line in STRUCTURE.splitlines():
        heading = re.match(r"^## (\S+/)", line)
        if heading:
            folder = heading.group(1)
        elif line.startswith("## "):
            folder = ""
        row = re.match(r"^\| `([^`]+)` \|", line)
        if row and row.group(1) not in ("module", "path"):
            name = row.group(1)
            path = name if folder == "" or name.startswith(TOP) else folder + name
            if not _exists(path):
                missing.append(path)
    missing += [p for p in _code_paths(STRUCTURE) + _links(STRUCTURE) if not _exists(p.removeprefix("../"))]
    assert not missing, f"docs/structure.md names paths that do not exist: {missing}"


def test_every_server_module_is_in_the_structure_map() -> None:
    """The map stays current: every module under server/ (but `__init__.py`) has a row."""
    rows = set(re.findall(r"^\| `([^`]+)` \|", STRUCTURE, flags=re.M))
    absent = [str(p.relative_to(REPO)) for p in sorted((REPO / "server").rglob("*.py"))
              if p.name != "__init__.py" and p.name not in rows and str(p.relative_to(REPO)) not in rows]
    assert not absent, f"modules missing from docs/structure.md: {absent}"


def test_readme_names_every_proposer_and_the_plain_and_auto_methods() -> None:
    listed = re.findall(r"^\* `(\w+)`: ", README.split("## ", 1)[0], flags=re.M)
    assert sorted(listed) == sorted(BUILTIN.proposers)
    for method in (PLAIN, AUTO):
        assert f"`{method}`" in README


def test_readme_states_the_default_method_and_its_k() -> None:
    from server.config import Settings

    found = re.search(r"`auto`, the default, picks the proposer and K \(up to (\d+); fixed methods draft (\d+)\)",
                      README.replace("\n", " "))
    assert found, "README no longer states the default method and its K in the expected sentence"
    settings = Settings.load()
    assert DEFAULTS["speculation"] == settings.speculation == AUTO
    assert int(found.group(1)) == DEFAULTS["auto_max_speculative_tokens"] == settings.auto_max_speculative_tokens
    assert int(found.group(2)) == DEFAULTS["num_speculative_tokens"] == settings.num_speculative_tokens


def test_the_default_draft_is_none_and_the_draft_head_ships() -> None:
    assert DEFAULTS["draft"] is None, "config/default.yaml ships a draft model: README and structure.md say none"
    assert "opt-in with `--draft`" in README
    assert "no draft model" in STRUCTURE and "bf16 draft" not in STRUCTURE
    assert DEFAULTS["draft_head"] == "auto"
    assert glob(str(REPO / "server" / "draft_head" / "weights" / "*" / "*.safetensors")), "no shipped draft head"


def _colour_name(hex_colour: str) -> str:
    """The everyday name of a CSS colour's hue (the playground's backgrounds are light and saturated)."""
    r, g, b = (int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5))
    hue = colorsys.rgb_to_hsv(r, g, b)[0] * 360
    for limit, name in ((15, "red"), (40, "orange"), (65, "yellow"), (160, "green"), (195, "teal"), (250, "blue"),
                        (290, "purple"), (330, "pink"), (361, "red")):
        if hue < limit:
            return name
    raise AssertionError(hue)


def _playground_colours() -> dict[str, str]:
    css = (REPO / "server" / "api" / "static" / "playground.css").read_text()
    return {name: _colour_name(value) for name, value in re.findall(r"--([\w-]+):\s*(#[0-9a-fA-F]{6})", css)}


def test_colour_names() -> None:
    assert [_colour_name(c) for c in ("#8fe0a0", "#9cc6ff", "#d3b2ff", "#86ddd8", "#ffbf80", "#ffe066")] == [
        "green", "blue", "purple", "teal", "orange", "yellow"]


def test_readme_gives_the_playground_s_colours() -> None:
    colours = _playground_colours()
    text = README.replace("\n", " ")
    for proposer in BUILTIN.proposers:
        assert f"accepted-{proposer}" in colours, f"the playground has no colour for {proposer}"
        assert f"{colours[f'accepted-{proposer}']} for `{proposer}`" in text, proposer
    assert f"recovered at a rejection ({colours['recovered']})" in text
    assert f"all drafts were accepted ({colours['bonus']})" in text


def test_readme_s_figures_are_latest_md_s_and_latest_md_is_the_ledger_s() -> None:
    results = REPO / "bench" / "results"
    latest = (results / ledger.LATEST_MD).read_text(encoding="utf-8")
    assert latest == latest_markdown(ledger.read(results)), (
        "bench/results/LATEST.md is not what the ledger renders: run `python -m bench.report --readme`")
    assert between(README) == between(latest), (
        "README's current figures differ from bench/results/LATEST.md: run `python -m bench.report --readme`")
    assert re.search(r"\| 20\d\d-\d\d-\d\d, `[0-9a-f]{7,}`", between(README)), "a figure without date and commit"


def test_the_results_folder_stays_small_and_every_ledger_line_is_complete() -> None:
    results = REPO / "bench" / "results"
    assert len(list(results.iterdir())) <= 8, sorted(p.name for p in results.iterdir())
    for entry in ledger.read(results):
        for key in ("date", "commit", "machine", "device", "command", "suite", "cells"):
            assert key in entry, (key, entry.get("date"))
        for cell in entry["cells"]:
            for key in ("workload", "method", "baseline", "clients", "temperature", "ratio"):
                assert key in cell, (key, entry["date"], cell)
    newest = {e["suite"] for e in ledger.read(results) if e.get("files")}
    for suite in newest:  # the newest run of each suite that kept files keeps them in latest/<suite>/
        assert any((results / ledger.LATEST_DIR / suite).iterdir()), suite


def test_readme_is_short_and_gives_the_commands() -> None:
    assert len(README.splitlines()) <= 120
    makefile = (REPO / "Makefile").read_text()
    for target in ("serve", "test", "test-fast", "soak", "compat", "bench-llamacpp"):
        assert f"make {target}" in README, target
        assert re.search(rf"^{re.escape(target)}:", makefile, flags=re.M), target


def _normalised(text: str) -> str:
    """Text with comment markers and line breaks folded into single spaces."""
    return re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)


def _section_references() -> list[tuple[str, str, str]]:
    """(file, doc, section) for every `docs/bench.md, "Section"`-style reference in code and docs."""
    found = []
    files = [*REPO.glob("server/**/*.py"), *REPO.glob("bench/*.py"), *REPO.glob("docs/*.md"), REPO / "README.md"]
    for path in files:
        text = _normalised(path.read_text(encoding="utf-8"))
        for doc, name in re.findall(r"(bench(?:-journal)?\.md)[,:]?\s*\(?\"([^\"]{4,120})\"", text):
            found.append((str(path.relative_to(REPO)), doc, name))
    return found


@pytest.mark.parametrize("where,doc,name", _section_references())
def test_a_section_named_in_the_code_or_docs_exists(where: str, doc: str, name: str) -> None:
    text = _normalised((REPO / "docs" / doc).read_text(encoding="utf-8"))
    assert name.rstrip(".,;") in text, f'{where} cites {doc} "{name}", which it does not contain'
