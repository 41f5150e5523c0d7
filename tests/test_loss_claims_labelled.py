"""A held-out loss figure in a shipped config's comments, README or the docs pages says which corpus it was
measured on: corpus version 1's held-out set did not measure generalisation (docs/results.md), so its
figures are labelled so, and a claim on the comparison corpus carries its 95% interval."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# a loss figure: "+4.9% above", "-1.0% / -2.0% of AdamW", "+18.8% held-out loss"
PERCENT = r"[+-]?\d+(?:\.\d+)?%"
LOSS_FIGURE = re.compile(rf"{PERCENT}(?:\s*/\s*{PERCENT})*\s*(?:above|below|of AdamW(?:-DDP)?'s held-out|held-out)")
LABELLED = re.compile(r"corpus version 1|\[[+-]\d+(?:\.\d+)?%, [+-]\d+(?:\.\d+)?%\]")


def _comment_text(toml: Path) -> str:
    """The config's comments as one line of prose (a label may wrap over two comment lines)."""
    comments = [line.split("#", 1)[1] for line in toml.read_text().splitlines() if "#" in line]
    return " ".join(" ".join(comments).split())


def _paragraphs(markdown: Path) -> list[str]:
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", markdown.read_text())]


def unlabelled(texts: list[str]) -> list[str]:
    """The texts that quote a loss figure and name neither corpus version 1 nor an interval."""
    return [t for t in texts if LOSS_FIGURE.search(t) and not LABELLED.search(t)]


@pytest.mark.parametrize("toml", sorted((REPO / "train_configs").glob("*.toml")), ids=lambda p: p.name)
def test_a_shipped_configs_loss_figures_name_their_corpus(toml):
    assert unlabelled([_comment_text(toml)]) == [], f"{toml.name}: a loss figure with no corpus label"


# results.md says at its top that sections 1-10 are corpus version 1's; section 11 gives intervals
PAGES = ["README.md", "train_configs/README.md", "benchmarks/README.md"] + sorted(
    str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md") if p.name != "results.md")


@pytest.mark.parametrize("page", PAGES)
def test_a_pages_loss_figures_name_their_corpus(page):
    bad = unlabelled(_paragraphs(REPO / page))
    assert bad == [], f"{page}: paragraphs with a loss figure and no corpus label:\n" + "\n".join(b[:160] for b in bad)


def test_the_check_reads_figures_where_the_pages_quote_them():
    # not vacuous: README and docs/config.md quote corpus version 1's figures, labelled
    for page in ("README.md", "docs/config.md"):
        assert LOSS_FIGURE.search((REPO / page).read_text()), page


def test_the_check_sees_an_unlabelled_figure_and_a_labelled_one():
    assert unlabelled(["top-8 ends 1.6-2.6% above AdamW on two seeds"]) != []
    assert unlabelled(["dense diloco +10.1% above AdamW (corpus version 1, seed 1234)"]) == []
    assert unlabelled(["SparseLoCo +4.9% [+3.3%, +6.5%] above AdamW-DDP's held-out loss"]) == []
    assert unlabelled(["-1.0% / -2.0% of AdamW-DDP's held-out loss on two seeds"]) != []
