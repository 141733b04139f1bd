"""The playground and charts pages, served by the application's ingress (plain HTML and JavaScript from
`deployment/playground/`; no key needed to load them, the page asks for one for /v1 when the application
has one).

- `/playground` (and `/`): a prompt races the speculative model against the baseline over the OpenAI
  route, both streamed; the speculative text coloured per step from its trace, with tokens per step,
  acceptance, the measured speed-up and the one the seeds' formula predicts.
- `/playground/charts`: the latest `specserve loadtest` report found in the configured reports
  directory (its table and PNG charts) and the demo pair's acceptance by prompt category from
  `specserve measure-pair --json <reports dir>/measure-pair.json`.
"""

import json
from pathlib import Path
from typing import Optional

from fastapi import HTTPException
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse

PAGES_DIR = Path(__file__).parent / "playground"
ASSET_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html", ".png": "image/png"}
MEASURE_PAIR_FILE = "measure-pair.json"

# Route of each PlaygroundRoutes method, for make_fastapi_ingress's endpoint map.
ENDPOINTS = {
    "home": lambda app: app.get("/", include_in_schema=False),
    "playground": lambda app: app.get("/playground", response_class=HTMLResponse),
    "playground_config": lambda app: app.get("/playground/config"),
    "playground_asset": lambda app: app.get("/playground/static/{name}"),
    "charts": lambda app: app.get("/playground/charts", response_class=HTMLResponse),
    "charts_data": lambda app: app.get("/playground/charts/data"),
    "chart_image": lambda app: app.get("/playground/charts/image/{name}"),
}


def latest_report(reports_dir: Path) -> Optional[Path]:
    """The most recently written load-test report under reports_dir: the directory itself or one of its
    subdirectories (any depth) holding a report.md, by that file's modification time."""
    if not reports_dir.is_dir():
        return None
    reports = sorted(reports_dir.glob("**/report.md"), key=lambda p: p.stat().st_mtime)
    return reports[-1].parent if reports else None


def read_charts(reports_dir: Path) -> dict:
    """What the charts page shows: the latest report (name, markdown, chart file names) and the pair's
    acceptance by prompt category, each None when absent."""
    report = latest_report(reports_dir)
    pair_file = reports_dir / MEASURE_PAIR_FILE
    pair = json.loads(pair_file.read_text()) if pair_file.is_file() else None
    return {
        "reports_dir": reports_dir.name,  # the name only: the pages need no key, and paths are the node's business
        "report": None if report is None else {
            "name": str(report.relative_to(reports_dir)) if report != reports_dir else report.name,
            "markdown": (report / "report.md").read_text(),
            "charts": sorted(p.name for p in report.glob("*.png")),
        },
        "measure_pair": pair,
    }


class PlaygroundRoutes:
    """The pages' routes, mixed into the ingress. `playground` holds what the page needs to know: the
    speculative and baseline model ids, whether an API key is required, how the race runs
    ("one_after_the_other" where both models share cores, "side_by_side" where each has its own
    accelerator) and the reports directory."""

    playground_settings: dict

    async def home(self) -> RedirectResponse:
        return RedirectResponse("/playground")

    async def playground(self) -> HTMLResponse:
        return HTMLResponse((PAGES_DIR / "index.html").read_text())

    async def charts(self) -> HTMLResponse:
        return HTMLResponse((PAGES_DIR / "charts.html").read_text())

    async def playground_config(self) -> dict:
        return {k: v for k, v in self.playground_settings.items() if k != "reports_dir"}

    async def playground_asset(self, name: str) -> FileResponse:
        return _file_in(PAGES_DIR, name)

    async def charts_data(self) -> JSONResponse:
        return JSONResponse(read_charts(Path(self.playground_settings["reports_dir"])))

    async def chart_image(self, name: str) -> FileResponse:
        report = latest_report(Path(self.playground_settings["reports_dir"]))
        if report is None:
            raise HTTPException(404, "no load-test report")
        return _file_in(report, name)


def _file_in(directory: Path, name: str) -> FileResponse:
    """A file directly inside directory, of a type the pages use; 404 for anything else (no paths)."""
    path = directory / name
    if "/" in name or name.startswith(".") or path.suffix not in ASSET_TYPES or not path.is_file():
        raise HTTPException(404, f"no such file: {name}")
    return FileResponse(path, media_type=ASSET_TYPES[path.suffix])
