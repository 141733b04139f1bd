"""The playground and charts pages in a real browser (headless Chromium, driven by Playwright) against the
session's Serve application of serve_config.yaml: a race streams both models, colours the speculative
text per step and fills the figures; bad input shows the API's message; the charts page shows the latest
load-test report and the pair's acceptance. Screenshots go to the test output directory. And, fast, the
pages' file lookups and settings."""

import json
import shutil
import uuid

import pytest

from deployment.defaults import REPO_ROOT

slow = pytest.mark.slow
RACE_TIMEOUT_MS = 180_000
FIGURES = ("fig-steps", "fig-tokens-per-step", "fig-acceptance", "fig-alpha", "fig-measured", "fig-c",
           "fig-predicted", "fig-optimal")


def test_latest_report_is_the_newest_report_md_at_any_depth(tmp_path):
    import os

    from deployment.playground import latest_report, read_charts

    assert latest_report(tmp_path / "missing") is None and latest_report(tmp_path) is None
    for name, written in {"old": 2000, "runs/new": 3000, "older": 1000}.items():
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "report.md").write_text(name)
        os.utime(tmp_path / name / "report.md", (written, written))
    (tmp_path / "runs/new/speedup.png").write_bytes(b"png")
    assert latest_report(tmp_path) == tmp_path / "runs/new"
    charts = read_charts(tmp_path)
    assert charts["report"] == {"name": "runs/new", "markdown": "runs/new", "charts": ["speedup.png"]}
    assert charts["measure_pair"] is None


def test_page_files_are_served_by_name_only(tmp_path):
    from fastapi import HTTPException

    from deployment.playground import PAGES_DIR, _file_in

    assert _file_in(PAGES_DIR, "playground.js").media_type == "text/javascript"
    (tmp_path / "notes.txt").write_text("x")
    for name in ("../app.py", "notes.txt", ".hidden.js", "missing.png"):
        with pytest.raises(HTTPException):
            _file_in(tmp_path if name == "notes.txt" else PAGES_DIR, name)


def test_race_runs_one_after_the_other_where_models_share_cores():
    from deployment.app import SpecServeArgs, playground_settings

    assert playground_settings(SpecServeArgs(), False)["race"] == "one_after_the_other"
    gpu = playground_settings(SpecServeArgs(accelerator="gpu"), True)
    assert gpu["race"] == "side_by_side" and gpu["api_key_required"]
    assert SpecServeArgs().reports_dir == str(REPO_ROOT / "reports")


@pytest.fixture
def page(browser, serve_app):
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.goto(serve_app + "/")  # redirects to /playground
    page.wait_for_selector("body[data-ready=true]")
    yield page
    page.close()


def race(page, prompt: str, max_tokens, temperature: float = 0.0) -> str:
    page.fill("#prompt", prompt)
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", str(temperature))
    page.click("#race")
    page.wait_for_selector("body[data-race=done], body[data-race=failed]", timeout=RACE_TIMEOUT_MS)
    return page.get_attribute("body", "data-race")


@slow
def test_race_colours_each_step_and_fills_the_figures(page, output_dir):
    assert "/playground" in page.url
    assert "one after the other" in page.inner_text("#race-note")  # two models, one machine's cores
    assert race(page, "class Stack:\n    def push(self, item):\n", 64) == "done", page.inner_text("#error")
    page.screenshot(path=str(output_dir / "playground.png"), full_page=True)

    steps = page.locator("#lane-speculative .step")
    assert steps.count() == int(page.inner_text("#fig-steps")) > 1
    kinds = {k: page.locator(f"#lane-speculative .tok.{k}").count() for k in ("accepted", "rejected", "recovered", "bonus", "target")}
    # One recovered, bonus or target-only token per step, except a last step that max tokens cut short.
    cut = page.locator("#lane-speculative .step[data-cut]").count()
    assert kinds["accepted"] > 0 and steps.count() - cut <= kinds["recovered"] + kinds["bonus"] + kinds["target"] <= steps.count(), kinds
    assert page.locator("#steps li").count() == steps.count()
    assert "K " in page.locator("#lane-speculative .tok.accepted").first.get_attribute("title")
    # The coloured spans less the rejected drafts read as the streamed text.
    emitted = page.eval_on_selector_all("#lane-speculative .tok:not(.rejected)", "els => els.map(e => e.textContent).join('')")
    assert emitted == page.get_attribute("#lane-speculative", "data-streamed-text")
    for lane in ("speculative", "baseline"):
        assert page.inner_text(f"#lane-{lane} .state").startswith("done")
        assert float(page.inner_text(f"#lane-{lane} .rate")) > 0
    figures = {f: page.inner_text(f"#{f}") for f in FIGURES}
    assert all(v and v != "–" for v in figures.values()), figures
    assert figures["fig-measured"].endswith("x") and figures["fig-optimal"].startswith("K ")
    assert 0 < float(figures["fig-acceptance"]) <= 1


@slow
@pytest.mark.parametrize("prompt, max_tokens, message", [
    ("", 16, "prompt"),
    ("def f():", 100_000, "max_tokens"),
    ("def f():", 0, "max_tokens"),
])
def test_bad_input_shows_the_api_error(page, prompt, max_tokens, message):
    assert race(page, prompt, max_tokens) == "failed"
    error = page.inner_text("#error")
    assert page.is_visible("#error") and "400" in error and message in error, error


@pytest.fixture
def reports(tmp_path):
    """A load-test report (as `specserve loadtest` writes it: report.md and PNG charts) and a measure-pair
    result in the application's reports directory, removed afterwards (a measure-pair.json already
    there is put back)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reports_dir = REPO_ROOT / "reports"
    report = reports_dir / f"test-playground-{uuid.uuid4().hex[:8]}"
    report.mkdir(parents=True)
    (report / "report.md").write_text("# Load test\n\n| concurrency | speed-up |\n|---|---|\n| 1 | **1.80x** |\n")
    plt.plot([1, 2, 4], [1.8, 1.5, 1.1])
    plt.savefig(report / "speedup.png")
    plt.close()
    pair_file = reports_dir / "measure-pair.json"
    kept = tmp_path / "measure-pair.json"
    if pair_file.exists():
        shutil.copy(pair_file, kept)
    pair_file.write_text(json.dumps({
        "agreement": {"function_body": {"alpha": 0.81, "greedy_match": 0.7, "positions": 640},
                      "overall": {"alpha": 0.78, "greedy_match": 0.66, "positions": 1920}},
        "target_vllm_step_ms": 12.0, "draft_torch_forward_ms": 1.1, "c": 10.9, "optimal_k": 5, "predicted_speedup": 2.6}))
    yield report
    shutil.rmtree(report)
    pair_file.unlink()
    if kept.exists():
        shutil.copy(kept, pair_file)


@slow
def test_charts_page_shows_the_latest_report_and_the_pair(browser, serve_app, reports, output_dir):
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.goto(serve_app + "/playground/charts")
    page.wait_for_selector("body[data-ready=true]")
    assert page.inner_text("#report-name") == reports.name
    image = page.locator("#report-charts img")
    assert image.count() == 1
    page.wait_for_function("() => document.querySelector('#report-charts img').naturalWidth > 0")
    assert "1.80x" in page.inner_text("#report-table table")
    assert "function_body" in page.inner_text("#pair-table") and "0.810" in page.inner_text("#pair-table")
    page.screenshot(path=str(output_dir / "charts.png"), full_page=True)
    page.close()
