"""``scripts/release``: the CI gate (``--check-all``) on temporary git repositories holding a copy
of the workspace, the release checks that run before a build, and a dry run that builds and
checks one package (without the fresh-venv torch install, which ``.ci/run`` leaves to the
release itself)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
IDENTITY = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.com",
}


class Repo:
    """A git repository holding ``scripts/release``, the root pyproject and a copy of packages."""

    def __init__(self, path: Path, packages: tuple[str, ...]) -> None:
        self.path = path
        (path / "scripts").mkdir(parents=True)
        shutil.copy2(ROOT / "scripts" / "release", path / "scripts" / "release")
        for name in ("pyproject.toml", ".gitignore"):
            shutil.copy2(ROOT / name, path / name)
        skip = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
        for name in packages:
            shutil.copytree(ROOT / "packages" / name, path / "packages" / name, ignore=skip)
        self.git("init", "-q", "-b", "main")
        self.commit("the workspace as it is")

    def git(self, *args: str) -> str:
        env = {**os.environ, **IDENTITY}
        proc = subprocess.run(
            ["git", *args], cwd=self.path, env=env, capture_output=True, text=True, check=True
        )
        return proc.stdout

    def commit(self, message: str) -> None:
        self.git("add", "-A")
        self.git("commit", "-q", "-m", message)

    def release(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(self.path / "scripts" / "release"), *args],
            cwd=self.path,
            capture_output=True,
            text=True,
        )

    def edit(self, rel: str, old: str, new: str) -> None:
        path = self.path / rel
        text = path.read_text()
        assert old in text, (rel, old)
        path.write_text(text.replace(old, new, 1))

    def append(self, rel: str, text: str) -> None:
        with (self.path / rel).open("a") as f:
            f.write(text)


TAGS_SRC = "packages/ap-tags/src/ap_tags/graph.py"
TAGS_VERSION = "packages/ap-tags/src/ap_tags/_version.py"
TAGS_CHANGELOG = "packages/ap-tags/CHANGELOG.md"


@pytest.fixture
def tags_repo(tmp_path: Path) -> Repo:
    """ap-tags and the private test kit (which the gate skips)."""
    return Repo(tmp_path / "repo", ("ap-tags", "ap-testing"))


def _gate(repo: Repo) -> tuple[int, str]:
    proc = repo.release("--check-all")
    return proc.returncode, proc.stdout + proc.stderr


def test_the_gate_accepts_unreleased_packages_with_a_changelog_section(tags_repo: Repo) -> None:
    rc, out = _gate(tags_repo)
    assert rc == 0, out
    assert "ap-tags 0.1.0: unreleased" in out and "ap-testing" not in out
    tags_repo.edit(TAGS_CHANGELOG, "## [0.1.0] - Unreleased", "## [0.0.9] - Unreleased")
    rc, out = _gate(tags_repo)
    assert rc == 1 and "has no section for 0.1.0" in out, out


def test_a_source_change_without_a_version_bump_and_changelog_fails_the_gate(
    tags_repo: Repo,
) -> None:
    tags_repo.git("tag", "ap-tags-v0.1.0")
    rc, out = _gate(tags_repo)
    assert rc == 0 and "released as ap-tags-v0.1.0, unchanged since" in out, out

    tags_repo.append("packages/ap-tags/README.md", "\nnot shipped code\n")
    tags_repo.append("packages/ap-tags/tests/test_accessors.py", "\n# a test edit\n")
    tags_repo.commit("docs and tests only")
    assert _gate(tags_repo)[0] == 0, "a README/tests change needs no release"

    tags_repo.append(TAGS_SRC, "\n# a change to ap-tags' code\n")
    rc, out = _gate(tags_repo)  # uncommitted
    assert rc == 1 and TAGS_SRC in out and "since ap-tags-v0.1.0" in out, out
    tags_repo.commit("change ap-tags without a release")
    rc, out = _gate(tags_repo)
    assert rc == 1 and TAGS_SRC in out and "the version is still 0.1.0" in out, out

    tags_repo.edit(TAGS_VERSION, '"0.1.0"', '"0.1.1"')
    rc, out = _gate(tags_repo)  # bumped, but no changelog section for it
    assert rc == 1 and "no section for 0.1.1" in out, out
    tags_repo.edit(
        TAGS_CHANGELOG, "## [0.1.0]", "## [0.1.1] - Unreleased\n\n### Changed\n\n- x\n\n## [0.1.0]"
    )
    tags_repo.commit("release ap-tags 0.1.1")
    rc, out = _gate(tags_repo)
    assert rc == 0 and "ap-tags 0.1.1: new version after ap-tags-v0.1.0" in out, out

    tags_repo.edit(TAGS_VERSION, '"0.1.1"', '"0.0.1"')
    rc, out = _gate(tags_repo)
    assert rc == 1 and "lower than the released ap-tags-v0.1.0" in out, out


def test_the_gate_refuses_a_shallow_clone(tags_repo: Repo, tmp_path: Path) -> None:
    shallow = tmp_path / "shallow"
    subprocess.run(
        ["git", "clone", "-q", "--depth", "1", f"file://{tags_repo.path}", str(shallow)],
        check=True,
    )
    proc = subprocess.run(
        [sys.executable, str(shallow / "scripts" / "release"), "--check-all"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and "shallow clone" in proc.stderr, proc.stdout + proc.stderr


def test_a_release_needs_a_new_version_and_a_dated_section(tags_repo: Repo) -> None:
    proc = tags_repo.release("ap-tags", "--offline", "--skip-install")
    assert proc.returncode == 1 and "write the release date" in proc.stderr, proc.stderr
    tags_repo.git("tag", "ap-tags-v0.1.0")
    proc = tags_repo.release("ap-tags", "--dry-run", "--offline", "--skip-install")
    assert proc.returncode == 1 and "already released (ap-tags-v0.1.0)" in proc.stderr
    proc = tags_repo.release("ap-testing", "--dry-run")
    assert proc.returncode == 1 and "not a published package" in proc.stderr


def test_requirement_rules(release_script: ModuleType) -> None:
    rules = release_script.requirement_problems
    assert rules("ap-partitioner", ["torch>=2.13", "ap-tags>=0.1,<0.2"]) == []
    assert rules("ap-partitioner", ["torch>=2.13", "ap-tags~=0.1.0"]) == []
    (capped,) = rules("ap-bucketing", ["torch>=2.13,<2.16"])
    assert "caps torch" in capped
    (bare,) = rules("ap-epchunk", ["torch>=2.13", "ap-tags"])
    assert "compatible-release range" in bare
    (stale,) = rules("ap-epchunk", ["torch>=2.13", "ap-tags>=0.2,<0.3"])
    assert "does not admit the workspace's ap-tags" in stale
    assert release_script.torch_floor(["numpy", "torch>=2.13"]) == "2.13"


@pytest.mark.slow
def test_a_dry_run_builds_and_checks_one_package(tmp_path: Path) -> None:
    repo = Repo(tmp_path / "repo", ("ap-bucketing", "ap-testing"))
    proc = repo.release("ap-bucketing", "--dry-run", "--offline", "--skip-install")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "built ap_bucketing-0.1.0.tar.gz and ap_bucketing-0.1.0-py3-none-any.whl" in out
    assert "twine check --strict; Requires-Dist: torch>=2.11" in out
    assert "would tag ap-bucketing-v0.1.0" in out and "git push origin ap-bucketing-v0.1.0" in out
    assert repo.git("tag", "--list") == ""  # a dry run tags nothing

    repo.edit("packages/ap-bucketing/pyproject.toml", '"torch>=2.11"', '"torch>=2.11,<2.16"')
    proc = repo.release("ap-bucketing", "--dry-run", "--offline", "--skip-install")
    assert proc.returncode == 1 and "caps torch" in proc.stderr, proc.stdout + proc.stderr


@pytest.mark.slow
def test_the_release_workflow_builds_what_the_tag_names(tmp_path: Path) -> None:
    repo = Repo(tmp_path / "repo", ("ap-bucketing", "ap-testing"))
    changelog = "packages/ap-bucketing/CHANGELOG.md"
    repo.edit(changelog, "## [0.1.0] - Unreleased", "## [0.1.0] - 2026-01-31")
    repo.commit("date ap-bucketing 0.1.0")
    out = tmp_path / "dist"
    args = ("--out-dir", str(out), "--offline", "--skip-install")
    proc = repo.release("ap-bucketing", "--for-tag", "ap-bucketing-v0.1.0", *args)
    assert proc.returncode == 1 and "not HEAD" not in proc.stderr  # the tag does not exist yet
    repo.git("tag", "ap-bucketing-v0.1.0")
    proc = repo.release("ap-bucketing", "--for-tag", "ap-bucketing-v0.1.1", *args)
    assert proc.returncode == 1 and "does not name ap-bucketing's version" in proc.stderr
    proc = repo.release("ap-bucketing", "--for-tag", "ap-bucketing-v0.1.0", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "ap_bucketing-0.1.0-py3-none-any.whl",
        "ap_bucketing-0.1.0.tar.gz",
    ]
