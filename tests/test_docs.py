"""The docs: README.md for the first ten minutes, docs/ for the rest, kept true by these tests.

- every generated table in docs/ is what its generator gives today (``ringbench.present.doc_tables``);
- every internal link of README.md and docs/*.md resolves: relative file links (images too) to a
  file or folder of the checkout, ``#anchors`` to a heading of the page they name, by GitHub's
  anchor slugs;
- every option of every command is documented somewhere in docs/;
- README.md stays short and gives the exact set-up command that ``.ci/run`` runs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ringbench.present import doc_tables

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = ("README.md", "getting-started.md", "scenarios.md", "operations.md", "variants-and-kernels.md", "verify.md",
         "matrix.md", "model-check.md", "methodology.md", "contracts.md", "development.md", "predict.md",
         "validation.md")

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_HTML_ID = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def markdown_files() -> list[Path]:
    """README.md and every page of docs/."""
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def prose_lines(text: str):
    """(line number, line) of every line outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: links reduced to their text, lower case, every character
    but letters, digits, ``_``, ``-`` and spaces dropped, spaces turned into ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a page defines: its headings' slugs (a repeated one as ``slug-1``, ``slug-2``...)
    and explicit ``<a id=...>`` names."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(text):
        found.update(_HTML_ID.findall(line))
        heading = _HEADING.match(line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """Every internal link of ``page`` that does not resolve, as ``page:line: target (why)``."""
    broken = []
    text = page.read_text(encoding="utf-8")
    for number, line in prose_lines(text):
        for target in _LINK.findall(_CODE_SPAN.sub("", line)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            where = f"{page.relative_to(root)}:{number}: {target}"
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text(encoding="utf-8")):
                broken.append(f"{where} (no heading in {file.name} has that anchor)")
    return broken


def test_docs_slug_follows_github():
    assert slug("Determinism: `verify --repeat`") == "determinism-verify---repeat"
    assert slug("Several nodes (Slurm)") == "several-nodes-slurm"
    assert slug("Where the time goes: `run --profile`") == "where-the-time-goes-run---profile"
    assert slug("1 × H200: flash-attn-4 and the lean engine (2026-12-01)") == "1--h200-flash-attn-4-and-the-lean-engine-2026-12-01"
    assert slug("Case fields (`ringbench/fields.py`) and CaseSpec") == "case-fields-ringbenchfieldspy-and-casespec"
    assert slug("The [matrix](matrix.md)") == "the-matrix"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n## B b\n") == {"a", "a-1", "b-b"}


def test_docs_link_check_finds_a_broken_file_and_a_broken_anchor(tmp_path):
    """The link check is not vacuous: it flags a missing file and a missing anchor, and passes the rest."""
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n[ok](other.md#a-section) [self](#page) [web](https://example.com/x.md)\n"
                    "[gone](missing.md) [bad anchor](other.md#no-such) `[in code](missing.md)`\n"
                    "```\n[in a fence](missing.md)\n```\n", encoding="utf-8")
    found = broken_links(page, root=tmp_path)
    assert found == ["page.md:4: missing.md (no such file)",
                     "page.md:4: other.md#no-such (no heading in other.md has that anchor)"], found


def test_docs_pages_are_all_there():
    missing = [p for p in PAGES if not (DOCS / p).is_file()]
    assert not missing, f"docs/ lacks {missing}"


def test_docs_internal_links_resolve():
    files = markdown_files()
    assert len(files) > len(PAGES), files
    broken = [b for f in files for b in broken_links(f)]
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("page,name", [(p, n) for p, tables in doc_tables.TABLES.items() for n, _ in tables])
def test_docs_generated_tables_are_fresh(page, name):
    generate = dict(doc_tables.TABLES[page])[name]
    text = (DOCS / page).read_text(encoding="utf-8")
    found = doc_tables.current(text, name)
    assert found is not None, f"docs/{page} lost its <!-- {name}:begin --> / <!-- {name}:end --> markers"
    assert found == generate(), (
        f"docs/{page}'s {name} table differs from what the registry gives now; regenerate it with "
        f"`{doc_tables.REGENERATE}` from the checkout's root")


def test_docs_generated_tables_cover_their_registries():
    """Every user-facing variant and every kernel has its row; no test-only variant has one."""
    from ringbench.variants import TESTING_VARIANTS, VARIANTS
    from ringbench.variants.kernels import KERNELS

    variants, kernels = doc_tables.variants_table(), doc_tables.kernels_table()
    assert all(f"| `{name}` |" in variants for name in VARIANTS)
    assert not [name for name in TESTING_VARIANTS if f"| `{name}` |" in variants]
    assert all(f"| `{name}` |" in kernels for name in KERNELS)
    assert len(variants.splitlines()) == len(VARIANTS) + 2 and len(kernels.splitlines()) == len(KERNELS) + 2


def test_docs_refresh_rewrites_only_between_the_markers():
    text = "before\n<!-- t:begin -->\nold\n<!-- t:end -->\nafter\n"
    assert doc_tables.refresh(text, "t", "| new |\n") == "before\n<!-- t:begin -->\n| new |\n<!-- t:end -->\nafter\n"
    with pytest.raises(ValueError, match="no <!-- u:begin -->"):
        doc_tables.refresh(text, "u", "x\n")


def test_docs_name_every_option_of_every_command():
    """Every option of run, verify, compare, variants and matrix (hidden ones and --help aside) is
    written somewhere in docs/: --ulysses-degree, --profile and --emulate among them."""
    import typer

    from ringbench.cli import app

    text = "\n".join(p.read_text(encoding="utf-8") for p in DOCS.glob("*.md"))
    group = typer.main.get_command(app)
    options = {}
    for name, command in group.commands.items():
        for param in command.params:
            if param.param_type_name == "option" and not param.hidden:  # typer may carry its own click
                for opt in (*param.opts, *param.secondary_opts):
                    if opt.startswith("--") and opt != "--help":
                        options.setdefault(opt, []).append(name)
    assert {"--ulysses-degree", "--profile", "--emulate", "--no-causal"} <= set(options), sorted(options)
    missing = {opt: names for opt, names in options.items()
               if not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", text)}
    assert not missing, f"options documented nowhere in docs/: {missing}"


def test_readme_is_short_and_gives_the_ci_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme) < 10_000, f"README.md has {len(readme)} characters; move detail to docs/"
    command = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pytest" in line]
    assert len(command) == 1 and command[0] in readme, command
    assert ("python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e . && "
            ".venv/bin/ringbench run --variant zigzag --seqlen 4k") in readme


def test_docs_example_outputs_land_in_the_ignored_results_folder():
    """The README's compare example wrote compare.png into the checkout's root, where git status shows it:
    every file an example command of README.md and docs/ writes (--plot, --markdown, --to-parquet, --out)
    goes under results/, which .gitignore leaves out (or is a placeholder such as FILE.png)."""
    ignored = (ROOT / ".gitignore").read_text(encoding="utf-8").splitlines()
    assert "/results/*" in ignored and "!/results/reference/" in ignored
    written = []
    for page in markdown_files():
        for match in re.finditer(r"--(?:plot|markdown|to-parquet|out) ([^\s`]+)", page.read_text(encoding="utf-8")):
            written.append((page.name, match.group(1)))
    assert any(path == "results/compare.png" for _, path in written), written  # never vacuous
    stray = [(page, path) for page, path in written
             if not path.startswith("results/") and not re.fullmatch(r"FILE(\.\w+)?", path)]
    assert not stray, f"example outputs outside results/: {stray}"
