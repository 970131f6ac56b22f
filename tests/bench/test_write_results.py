"""benchmarks/common.write_results: a run without --out is appended to its results file, which holds earlier
sessions' runs; with --out it replaces that file (or writes into that directory)."""

from __future__ import annotations

import benchmarks.common as common


def test_without_out_a_run_is_appended_to_the_results_file(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path / "results"))
    first = common.write_results(["# run 1", "a"], None, "real_accept", "cpu")
    second = common.write_results(["# run 2", "b"], None, "real_accept", "cpu")
    assert first == second == str(tmp_path / "results" / "real_accept_cpu.md")
    assert open(first).read() == "# run 1\na\n\n# run 2\nb\n"


def test_with_out_the_file_is_replaced_or_the_directory_gets_the_default_name(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path / "results"))
    out = tmp_path / "mine.md"
    out.write_text("old\n")
    assert common.write_results(["new"], str(out), "serving", "h200") == str(out)
    assert out.read_text() == "new\n"
    assert common.write_results(["x"], str(tmp_path), "serving", "h200") == str(tmp_path / "serving_h200.md")
    assert (tmp_path / "serving_h200.md").read_text() == "x\n"
    assert not (tmp_path / "results").exists()  # the results file was never touched
