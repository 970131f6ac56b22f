"""benchmarks.common.git_commit names the code that ran: HEAD for a clean hyperdraft/, and for a changed one also the
tree its files make, which is the hyperdraft/ tree of the commit that later holds them (a GPU machine's .git may be
older than the files it runs)."""

from __future__ import annotations

import subprocess

from benchmarks.common import git_commit


def _git(root, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def test_a_changed_tree_is_named_by_the_commit_that_holds_it(tmp_path):
    root = str(tmp_path)
    _git(root, "init", "-q")
    _git(root, "config", "user.email", "t@example.com")
    _git(root, "config", "user.name", "t")
    (tmp_path / "hyperdraft").mkdir()
    (tmp_path / "hyperdraft" / "a.py").write_text("x = 1\n")
    (tmp_path / "notes.txt").write_text("outside hyperdraft/\n")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "first")
    first = _git(root, "rev-parse", "--short", "HEAD")
    assert git_commit(root) == first
    (tmp_path / "notes.txt").write_text("changed, but not code\n")
    assert git_commit(root) == first
    (tmp_path / "hyperdraft" / "a.py").write_text("x = 2\n")
    (tmp_path / "hyperdraft" / "b.py").write_text("y = 3\n")  # untracked files count too
    named = git_commit(root)
    assert named.startswith(first + " (plus uncommitted changes under hyperdraft/: its tree ")
    assert _git(root, "diff", "--cached", "--name-only") == ""  # the checkout's own index is left alone
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "second")
    tree = _git(root, "rev-parse", "HEAD:hyperdraft")[:10]
    assert named.endswith(f"its tree {tree})"), (named, tree)
