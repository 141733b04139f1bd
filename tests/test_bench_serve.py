"""`specserve bench-serve`: vLLM's own client against the application, on prompts the demo pair never saw.
The arithmetic is pure; one slow test runs the real client against the shared application."""

import json

import pytest

from specserve.bench_serve import cpython_test_windows, pooled, report, requests_per_point, speed_ups


def write_test_files(directory, lengths):
    for index, length in enumerate(lengths):
        (directory / f"test_{index}.py").write_text("".join(f"line_{index}_{n} = {n}\n" for n in range(length)))
    (directory / "helper.py").write_text("not_a_test = 1\n" * 100)  # only test_*.py files are cut


def test_windows_are_12_to_30_lines_of_one_test_file_and_fixed_by_the_seed(tmp_path):
    write_test_files(tmp_path, [5, 40, 200])  # the 5-line file is too short for any window
    windows = cpython_test_windows(50, seed=3, test_dir=tmp_path)
    assert len(windows) == 50
    for window in windows:
        lines = window.splitlines()
        assert 12 <= len(lines) <= 30
        assert len({line.split("_")[1] for line in lines}) == 1  # consecutive lines of one file
        assert not window.startswith("not_a_test") and not window.startswith("line_0_")
    assert cpython_test_windows(50, seed=3, test_dir=tmp_path) == windows
    assert cpython_test_windows(50, seed=4, test_dir=tmp_path) != windows


def test_no_test_files_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no test_\\*.py under"):
        cpython_test_windows(3, seed=0, test_dir=tmp_path)


def test_the_running_python_ships_its_test_suite():
    """The default prompt source (the prompts are only unseen if they come from here)."""
    assert len(cpython_test_windows(5, seed=0)) == 5


def test_each_point_keeps_every_client_busy_four_times_over():
    assert [requests_per_point(c) for c in (1, 4, 16, 32)] == [16, 16, 64, 128]


def point(throughput, e2e_s):
    return {"output_throughput": throughput, "e2e_s": e2e_s, "failed": 0,
            "median_e2el_ms": 1000 * sorted(e2e_s)[len(e2e_s) // 2], "p95_e2el_ms": 1000 * max(e2e_s)}


def test_speed_ups_and_pooling_over_rounds():
    baseline = [point(100.0, [2.0] * 20), point(80.0, [2.5] * 20)]
    speculative = [point(200.0, [1.0] * 20), point(120.0, [1.5] * 19 + [5.0])]  # one slow request
    assert speed_ups(speculative[0], baseline[0]) == pytest.approx((2.0, 2.0, 2.0))
    both = pooled(speculative)
    assert both["output_throughput"] == pytest.approx(160.0)
    assert both["median_e2el_ms"] == pytest.approx(1250.0)  # percentiles over all 40 requests
    points = [{"temperature": 0.0, "concurrency": 4, "round": r, "baseline": b, "speculative": s}
              for r, (b, s) in enumerate(zip(baseline, speculative))]
    table = report(points, 128)
    assert table.splitlines()[-1] == "| 0 | 4 | 90.0 | 2.00 / 2.00 / 2.00; 1.50 / 1.67 / 0.50 | 1.78 / 1.80 / 1.67 | 0 |"


def test_an_application_that_answers_nothing_is_a_clear_error(tmp_path):
    """Nothing listens on port 9: the first point stops the command with the client's own error."""
    from specserve.cli import main

    with pytest.raises(SystemExit, match=r"no request to specserve-baseline at http://127.0.0.1:9 finished: .+"):
        main(["bench-serve", "--host", "http://127.0.0.1:9", "--concurrency", "1", "--temperatures", "0",
              "--rounds", "1", "--prompts", "2", "--out", str(tmp_path / "out.json")])


@pytest.mark.slow
def test_vllm_client_measures_both_models_on_the_application(serve_app, tmp_path):
    from specserve.cli import main

    out = tmp_path / "bench-serve.json"
    assert main(["bench-serve", "--host", serve_app, "--concurrency", "2", "--temperatures", "0", "--rounds", "1",
                 "--max-tokens", "8", "--prompts", "8", "--out", str(out)]) == 0
    [only] = json.loads(out.read_text())
    for role in ("baseline", "speculative"):
        assert only[role]["completed"] == 16 and only[role]["failed"] == 0
        assert only[role]["output_throughput"] > 0 and len(only[role]["e2e_s"]) == 16
    assert len(out.with_suffix(".prompts.jsonl").read_text().splitlines()) == 8
