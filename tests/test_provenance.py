"""Figures come from committed results files and say when they are stale (benchmarks/provenance.py): a figure
measured at a commit older than a later change to the code it measures is marked stale; a change elsewhere
(or one to comments and docstrings only) leaves it current; a file that names no commit is reported."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import provenance  # noqa: E402  (benchmarks/provenance.py)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def commit_all(repo: Path, message: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "--short", "HEAD")


def test_a_figure_is_stale_once_the_code_it_measures_changes(tmp_path):
    repo = tmp_path / "repo"
    (repo / "policies").mkdir(parents=True)
    (repo / "docs").mkdir()
    (repo / "policies" / "drafts.py").write_text("A = 1\n")
    git(repo, "init", "-q")
    measured = commit_all(repo, "the code as measured")
    results = json.loads((ROOT / "benchmarks/results/speculative/results.json").read_text())
    results["machine"]["commit"] = measured
    target = repo / "benchmarks/results/speculative/results.json"
    target.parent.mkdir(parents=True)
    target.write_text(json.dumps(results))
    commit_all(repo, "the results")

    text, problems = provenance.figures_markdown(repo)
    assert problems == [] and "status: current" in text
    assert "suffix drafts vs none, one stream" in text, "the headline comes from the file"
    (repo / "docs" / "page.md").write_text("words\n")
    commit_all(repo, "docs only")
    assert "status: current" in provenance.figures_markdown(repo)[0], "a change elsewhere keeps it current"
    (repo / "policies" / "drafts.py").write_text('"""What drafts."""\nA = 1  # one\n')
    commit_all(repo, "a docstring and a comment")
    assert "status: current" in provenance.figures_markdown(repo)[0], "words alone measure the same code"
    (repo / "policies" / "drafts.py").write_text("A = 2\n")
    changed = commit_all(repo, "the draft policy changes")
    text = provenance.figures_markdown(repo)[0]
    assert "**stale**: 1 later commit changed what it measures" in text and changed in text


def test_a_results_file_without_its_commit_is_a_problem_and_an_unknown_commit_says_so(tmp_path):
    repo = tmp_path / "repo"
    (repo / "benchmarks/results/speculative").mkdir(parents=True)
    git(repo, "init", "-q")
    src = json.loads((ROOT / "benchmarks/results/speculative/results.json").read_text())
    (repo / "benchmarks/results/speculative/results.json").write_text(json.dumps({**src, "machine": {}}))
    commit_all(repo, "results without a machine")
    assert provenance.figures_markdown(repo)[1] == [
        "benchmarks/results/speculative/results.json names no machine commit or start time"]
    src["machine"]["commit"] = "0123abc"
    (repo / "benchmarks/results/speculative/results.json").write_text(json.dumps(src))
    commit_all(repo, "a commit from another history")
    assert "**unknown**: commit 0123abc is not in this checkout's history" in provenance.figures_markdown(repo)[0]


def test_the_committed_results_all_have_a_headline():
    """Every committed results file renders on the docs' performance page (the docs build fails otherwise)."""
    assert shutil.which("git")
    text, problems = provenance.figures_markdown(ROOT)
    assert problems == [] and text.count("### ") == len(provenance.results_files(ROOT / "benchmarks" / "results"))
