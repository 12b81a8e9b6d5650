"""Where make bench keeps its numbers (issue 42 item 4): a group's results file keeps the latest
rows of each variant, and docs/benchmarks.md's table of targets is what benchmarks/results/
says, row by row, with the command that measures each."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    return (importlib.import_module("benchmarks.harness.results"),
            importlib.import_module("benchmarks.registry"))


def row(variant: str, repeat: int, sps: float, when: str) -> dict:
    return {"measured": when, "commit": "abc1234", "group": "g", "variant": variant,
            "impl": variant.rsplit("/", 1)[-1], "workload": "digits", "world_size": 2,
            "batch_size": 32, "epochs": 1, "repeat": repeat, "rc": 0, "status": "ok",
            "samples_per_sec": sps, "note": ""}


def test_a_run_replaces_the_rows_of_its_variants_and_keeps_the_others(bench, tmp_path):
    results, _ = bench
    old = [row("g/ws2/a", r, 100.0 + r, "2026-12-01 10:00") for r in range(3)]
    old += [row("g/ws2/b", r, 200.0, "2026-12-01 10:00") for r in range(3)]
    results.merge_group_csv("g", old, str(tmp_path))
    new = [row("g/ws2/a", r, 300.0, "2026-12-05 08:00") for r in range(2)]
    path = results.merge_group_csv("g", new, str(tmp_path))
    assert Path(path).name == "g.csv"
    rows = results.load_rows("g", str(tmp_path))
    assert [(r["variant"], r["repeat"], r["samples_per_sec"], r["measured"]) for r in rows] == [
        ("g/ws2/b", 0, 200.0, "2026-12-01 10:00"), ("g/ws2/b", 1, 200.0, "2026-12-01 10:00"),
        ("g/ws2/b", 2, 200.0, "2026-12-01 10:00"),
        ("g/ws2/a", 0, 300.0, "2026-12-05 08:00"), ("g/ws2/a", 1, 300.0, "2026-12-05 08:00")]
    assert rows[0]["world_size"] == 2 and rows[0]["note"] == "" and rows[0]["train_s"] is None


def test_the_docs_table_replaces_and_adds_rows_and_leaves_the_rest(bench, tmp_path):
    results, _ = bench
    page = tmp_path / "page.md"
    page.write_text(f"# B\n\ntext\n\n{results.BEGIN}\n" + "\n".join(results.TABLE_HEAD)
                    + "\n| `a.one` | old |\n| `b.two` | kept |\n" + f"{results.END}\n\nafter\n")
    assert results.update_docs_table({"a.one": "| `a.one` | new |", "c.new": "| `c.new` | x |"},
                                     str(page)) == ["a.one", "c.new"]
    assert page.read_text() == (f"# B\n\ntext\n\n{results.BEGIN}\n" + "\n".join(results.TABLE_HEAD)
                                + "\n| `a.one` | new |\n| `b.two` | kept |\n| `c.new` | x |\n"
                                + f"{results.END}\n\nafter\n")
    page.write_text("no markers\n")
    with pytest.raises(ValueError, match="targets: begin"):
        results.update_docs_table({"a.one": "x"}, str(page))


def test_the_docs_table_is_what_the_results_say(bench):
    """Every target that benchmarks/results/ can compute has its row in docs/benchmarks.md, equal
    to the row computed from the results (`python -m benchmarks --table` writes them), and every
    row names a make command that measures it."""
    results, registry = bench
    page = (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
    table = page[page.index(results.BEGIN) + 1:page.index(results.END)]
    rows = {line.split("`")[1]: line for line in table if line.startswith("| `")}
    computed = 0
    for name, group in registry.GROUPS.items():
        data = results.load_rows(name)
        for t in group.targets():
            t.evaluate(data)
            if t.ratio is None:
                continue
            computed += 1
            when, runs = results.when_measured(data, t)
            assert rows.get(t.name) == results.target_row(t, when, runs, group.command()), t.name
    assert computed >= 20
    for key, line in rows.items():
        assert '`make bench ARGS="--only ' in line, key
        group = line.rsplit('--only ', 1)[1].split('"')[0].split()[0]
        assert group in registry.GROUPS, key


def test_a_full_run_writes_its_group_and_its_targets_rows_and_a_quick_one_neither(
        bench, tmp_path, monkeypatch):
    """The runner's path after the runs, with the runs faked: a full run of ``perf`` replaces
    that group's rows in its results file and its target's row in the docs' table; ``--quick``
    writes outputs/bench/quick.csv and the report only."""
    results, _ = bench
    main = importlib.import_module("benchmarks.__main__")
    folder, docs = tmp_path / "results", tmp_path / "benchmarks.md"
    folder.mkdir()
    docs.write_text(f"{results.BEGIN}\n" + "\n".join(results.TABLE_HEAD)
                    + "\n| `perf_metrics.on_vs_off` | old |\n| `lm.ws1.vs_nanogpt` | kept |\n"
                    + f"{results.END}\n")
    monkeypatch.setattr(results, "RESULTS", str(folder))
    monkeypatch.setattr(results, "DOCS", str(docs))
    monkeypatch.setattr(main, "OUT", str(tmp_path / "out"))
    monkeypatch.setattr(main, "warm_up", lambda timeout_s: None)

    def fake_runs(groups, repeats, timeout_s, keep, log=print, repeats_of=None):
        sps = {"perf/ws2/perf-true/ddp_exp": [990.0, 1000.0, 1010.0],
               "perf/ws2/perf-false/ddp_exp": [1000.0, 1000.0, 1000.0]}
        rows = [dict(row(v.key, r, sps[v.key][r], ""), group=v.group, impl=v.impl)
                for r in range(3) for v in groups["perf"]]
        return rows, {"load": {"perf": [0.0, 0.0]}}

    monkeypatch.setattr(main, "run_groups", fake_runs)
    report = tmp_path / "report.md"
    assert main.main(["--only", "perf", "--markdown", str(report)]) == 0
    saved = results.load_rows("perf", str(folder))
    assert len(saved) == 6 and all(r["measured"] and r["commit"] for r in saved)
    table = docs.read_text().splitlines()
    assert table[3].startswith("| `perf_metrics.on_vs_off` | digits, ws=2: ddp_exp perf_metrics "
                               "on / off, samples/s | 1.000 | >= 0.98 | PASS | ")
    assert table[3].endswith(', 3 runs each | `make bench ARGS="--only perf"` |')
    assert table[4] == "| `lm.ws1.vs_nanogpt` | kept |"
    assert "`perf_metrics.on_vs_off` | digits" in report.read_text()

    before = (folder / "perf.csv").read_text(), docs.read_text()
    assert main.main(["--only", "perf", "--quick", "--markdown", str(report)]) == 0
    assert ((folder / "perf.csv").read_text(), docs.read_text()) == before
    assert len(results.read_csv(str(tmp_path / "out" / "quick.csv"))) == 6


def test_absolute_and_two_sided_targets(bench):
    """A target without ``den`` is ``num``'s median against the bound, in its unit; ``within``
    holds the ratio to 1 +- bound; ``<`` is strict."""
    _, _ = bench
    stats = importlib.import_module("benchmarks.harness.stats")
    rows = [row("g/ws1/a", r, v, "") for r, v in enumerate([2.0, 2.5, 4.0])]
    rows += [row("g/ws1/b", r, v, "") for r, v in enumerate([2.0, 2.0, 2.0])]
    t = stats.Target("g.a", "a, s", "g/ws1/a", None, "samples_per_sec", "<", 3.0)
    t.evaluate(rows)
    assert (t.ratio, t.verdict, t.bound_text, t.keys) == (2.5, "PASS", "< 3", {"g/ws1/a"})
    t = stats.Target("g.a", "a, s", "g/ws1/a", None, "samples_per_sec", "<", 2.5)
    t.evaluate(rows)
    assert t.verdict == "MISS by 0.0%"  # equal is not below
    t = stats.Target("g.ab", "a / b", "g/ws1/a", "g/ws1/b", "samples_per_sec", "within", 0.1)
    t.evaluate(rows)
    assert t.ratio == 1.25 and t.verdict == "MISS by 15.0%" and t.bound_text == "1 +- 0.1"
    t.evaluate([dict(r, samples_per_sec=1.9) if r["variant"] == "g/ws1/a" else r
                for r in rows])
    assert t.ratio == pytest.approx(0.95) and t.verdict == "PASS"


def test_a_probe_groups_rows_land_in_its_results_and_its_target_in_the_docs(
        bench, tmp_path, monkeypatch):
    """A group measured by a ``probe`` (no interleaved runs): its rows go into its results file
    and its target's row into the docs' table, as a group of runs'; a failed probe fails the
    run and writes nothing."""
    results, registry = bench
    main = importlib.import_module("benchmarks.__main__")
    group = importlib.import_module("benchmarks.harness.group")
    folder, docs = tmp_path / "results", tmp_path / "benchmarks.md"
    folder.mkdir()
    docs.write_text(f"{results.BEGIN}\n" + "\n".join(results.TABLE_HEAD) + f"\n{results.END}\n")
    monkeypatch.setattr(results, "RESULTS", str(folder))
    monkeypatch.setattr(results, "DOCS", str(docs))
    monkeypatch.setattr(main, "OUT", str(tmp_path / "out"))
    monkeypatch.setattr(main, "warm_up", lambda timeout_s: None)
    seen = {}

    def probe(quick, repeats, timeout_s):
        seen.update(quick=quick, repeats=repeats)
        return [group.probe_row("first_line", label, r, first_line_s=s)
                for r in range(repeats) for label, s in (("help", 0.5 + r), ("slowest", 1.0 + r))]

    monkeypatch.setitem(registry.GROUPS, "first_line", dataclasses.replace(
        registry.GROUPS["first_line"], probe=probe))
    report = tmp_path / "report.md"
    assert main.main(["--only", "first_line", "--repeats", "3", "--markdown", str(report)]) == 0
    assert seen == {"quick": False, "repeats": 3}
    saved = results.load_rows("first_line", str(folder))
    assert [(r["variant"], r["first_line_s"]) for r in saved][:2] == [
        ("first_line/ws1/help/probe", 0.5), ("first_line/ws1/slowest/probe", 1.0)]
    assert len(saved) == 6 and all(r["measured"] and r["status"] == "ok" for r in saved)
    line = [ln for ln in docs.read_text().splitlines() if ln.startswith("| `first_line")]
    assert line and line[0].startswith("| `first_line.slowest` |") and "| 2.000 | < 3 | PASS |" \
        in line[0] and line[0].endswith('3 runs each | `make bench ARGS="--only first_line"` |')
    assert "first_line/ws1/help/probe" in report.read_text()

    def broken(quick, repeats, timeout_s):
        raise group.ProbeFailed("benchmarks.probes.first_line: exit 1")

    monkeypatch.setitem(registry.GROUPS, "first_line", dataclasses.replace(
        registry.GROUPS["first_line"], probe=broken))
    before = (folder / "first_line.csv").read_text()
    assert main.main(["--only", "first_line", "--markdown", str(report)]) == 1
    assert (folder / "first_line.csv").read_text() == before


def test_a_results_file_does_not_make_the_stamp_dirty(bench, tmp_path, monkeypatch):
    """A run's stamp says ``+dirty`` where the code that measured differs from the commit, not
    where an earlier group's results file is not committed yet (one ``make bench`` of several
    groups writes several)."""
    import subprocess

    results, _ = bench

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    (tmp_path / "src").mkdir()
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "src" / "a.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", "src")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    monkeypatch.setattr(results.common, "ROOT", str(tmp_path))
    (tmp_path / "benchmarks" / "results" / "g.csv").write_text("measured\n")
    assert not results.stamp()["commit"].endswith("+dirty")
    (tmp_path / "src" / "a.py").write_text("x = 2\n")
    assert results.stamp()["commit"].endswith("+dirty")
