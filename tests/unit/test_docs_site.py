"""The documentation site builds strictly (mkdocs.yml, docs/): any warning fails it, a broken
link or anchor, a missing page or a page left out of the navigation; and each page says whom it
is for. The build is ProperDocs' (`make docs` runs the same command), offline, in seconds."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "mkdocs.yml"
DOCS = ROOT / "docs"
BUILD_TIMEOUT = 120


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """`properdocs build --strict` of `config` into `site`, from the top of the repository (where
    the snippets' base path, for SECURITY.md, is)."""
    command = [sys.executable, "-m", "properdocs", "build", "--strict", "-f", str(config)]
    return subprocess.run(
        [*command, "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
    )


def warnings(built: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in (built.stdout + built.stderr).splitlines() if "WARNING" in line]


def test_the_site_builds_strictly_without_a_warning(tmp_path: Path) -> None:
    built = build(CONFIG, tmp_path / "site")
    assert built.returncode == 0 and not warnings(built), built.stdout + built.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    # SECURITY.md stays at the top of the repository and is included whole into its page.
    security = (tmp_path / "site" / "operating" / "security" / "index.html").read_text()
    assert "Reporting a vulnerability" in security


def test_the_strict_build_fails_on_each_kind_of_broken_page(tmp_path: Path) -> None:
    """mkdocs.yml's own settings, on a small site with one of each fault: a page left out of
    the navigation, a link to a page that does not exist, a link to a missing anchor, and a
    link that leaves the site (as one to a file outside docs/ would)."""
    config = yaml.safe_load(CONFIG.read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(
        "# Home\n\n[missing](nope.md), [anchor](other.md#nowhere), [outside](../../README.md)\n"
    )
    (docs / "other.md").write_text("# Other\n\n## There\n")
    (docs / "orphan.md").write_text("# Orphan\n")
    config.update(docs_dir=str(docs), nav=["index.md", "other.md"])
    config.pop("watch")  # paths relative to the config file, which is elsewhere here
    broken = tmp_path / "mkdocs.yml"
    broken.write_text(yaml.safe_dump(config))
    built = build(broken, tmp_path / "site")
    assert built.returncode != 0
    found = built.stdout + built.stderr
    assert len(warnings(built)) == 4, found  # the orphan's warning names it on the next line
    for fault in ("orphan.md", "'nope.md'", "'#nowhere'", "'../../README.md'"):
        assert fault in found, (fault, found)


def page_opening(text: str) -> str:
    """The first paragraph after a page's title."""
    body = text.split("\n", 1)[1] if text.startswith("# ") else text
    return body.strip().split("\n\n", 1)[0]


PAGES = sorted(DOCS.rglob("*.md"))
SNIPPET = re.compile(r'^--8<-- "(.+)"$')


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_each_page_starts_by_saying_whom_it_is_for(page: Path) -> None:
    text = page.read_text()
    included = SNIPPET.match(text.strip())
    if included:  # a page that is a file of the repository, included whole
        text = (ROOT / included.group(1)).read_text()
    assert text.startswith("# ")
    assert page_opening(text).startswith("For "), page_opening(text)[:120]


def test_every_page_is_in_the_navigation() -> None:
    """The strict build says so too (omitted_files); this names the page in one line."""
    listed: set[str] = set()

    def walk(entries: list[object]) -> None:
        for entry in entries:
            if isinstance(entry, str):
                listed.add(entry)
            elif isinstance(entry, dict):
                for value in entry.values():
                    walk(value if isinstance(value, list) else [value])

    walk(yaml.safe_load(CONFIG.read_text())["nav"])
    assert {str(page.relative_to(DOCS)) for page in PAGES} == listed


def test_the_readmes_links_reach_files_that_exist() -> None:
    """The README is read on its own (a repository's front page), outside the site's build."""
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [target for target in targets if not re.match(r"^[a-z]+://", target)]
    assert local, "the README links into docs/"
    assert [target for target in local if not (ROOT / target).exists()] == []
