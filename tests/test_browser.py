"""The MLflow UI shows what mlflow-di recorded: headless Chromium on a fuzz run's Artifacts tab lists
``fuzz/trigger_grid.png`` and ``fuzz/report.html`` and the grid image loads; a registered version's
page shows the gate's verdict in its description and leads to its LoggedModel, which shows the
coverage metrics with the data they were measured on. Screenshots go to test-artifacts/screenshots/.

Needs Debian's ``chromium`` and ``chromium-driver`` (``apt-get install -y chromium chromium-driver``)
and ``selenium``; skips without them. Selenium is pointed at /usr/bin/chromedriver and
/usr/bin/chromium, so Selenium Manager never downloads a browser, and Chromium resolves no host
but 127.0.0.1.
"""
import pathlib
import uuid

import numpy as np
import pytest

from mlflow_server import mlflow_server, record_run, use_server  # noqa: F401  (fixtures)

pytestmark = pytest.mark.slow

CHROMIUM = pathlib.Path("/usr/bin/chromium")
CHROMEDRIVER = pathlib.Path("/usr/bin/chromedriver")
GRID_COLUMNS, GRID_ROWS, TILE = 3, 2, 32  # the trigger grid made below is 96 x 64 pixels
WAIT = 90  # seconds for the single-page app to render on a busy machine
TREE_NODE = '[data-testid="artifact-tree-node"]'  # one file or folder in the Artifacts tab's tree


@pytest.fixture()
def browser(tmp_path):
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip(f"needs {CHROMIUM} and {CHROMEDRIVER}: apt-get install -y chromium chromium-driver")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install selenium)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,1000",
                 "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",  # nothing but the local server
                 f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()


#: Where the browser tests leave their screenshots (ignored by git; CI keeps the folder as its artifacts).
SCREENSHOTS = pathlib.Path(__file__).resolve().parents[1] / "test-artifacts" / "screenshots"


def screenshot(driver, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(SCREENSHOTS / f"{name}.png"))


def trigger_grid(path: pathlib.Path) -> None:
    """A PNG grid of six digits scaled 4x, standing in for the fuzz command's trigger grid."""
    from PIL import Image

    from mlflow_di.data import load_images

    digits = load_images("digits[0:6]").images[..., 0]
    tiles = [np.kron(d, np.ones((TILE // 8, TILE // 8), dtype=np.uint8)) for d in digits]
    rows = [np.hstack(tiles[r * GRID_COLUMNS:(r + 1) * GRID_COLUMNS]) for r in range(GRID_ROWS)]
    Image.fromarray(np.vstack(rows)).save(path)


def test_fuzz_run_page_lists_the_report_and_shows_the_trigger_grid(mlflow_server, use_server, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ready
    from selenium.webdriver.support.ui import WebDriverWait

    client = use_server(mlflow_server)
    experiment = client.create_experiment(f"browser-{uuid.uuid4().hex[:8]}")
    run_id = record_run(client, experiment, "fuzz", metrics={"success_rate": 0.5, "triggers": 6},
                        tags={"mlflow.runName": "fuzz digits"})
    artifacts = tmp_path / "fuzz"
    artifacts.mkdir()
    trigger_grid(artifacts / "trigger_grid.png")
    (artifacts / "report.html").write_text("<html><body><h1>DFlare campaign</h1></body></html>")
    client.log_artifacts(run_id, str(artifacts), "fuzz")

    browser.get(f"{mlflow_server.url}/#/experiments/{experiment}/runs/{run_id}/artifacts")
    wait = WebDriverWait(browser, WAIT)
    node = TREE_NODE + '[artifact-name="{}"]'
    wait.until(ready.element_to_be_clickable((By.CSS_SELECTOR, node.format("fuzz")))).click()

    def listed(driver) -> set:
        return {e.get_attribute("artifact-name") for e in driver.find_elements(By.CSS_SELECTOR, TREE_NODE)}

    wait.until(lambda d: {"report.html", "trigger_grid.png"} <= listed(d))
    screenshot(browser, "fuzz-run-artifacts")
    assert listed(browser) == {"fuzz", "report.html", "trigger_grid.png"}
    wait.until(ready.element_to_be_clickable((By.CSS_SELECTOR, node.format("trigger_grid.png")))).click()
    size = wait.until(lambda d: d.execute_script(
        "const img = document.querySelector('img[alt=\"fuzz/trigger_grid.png\"]');"
        "return img && img.complete ? [img.naturalWidth, img.naturalHeight] : null;"))
    assert size == [GRID_COLUMNS * TILE, GRID_ROWS * TILE]


def test_a_version_page_leads_to_its_model_page_with_the_metrics_and_datasets(mlflow_server, use_server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ready
    from selenium.webdriver.support.ui import WebDriverWait

    from mlflow_di.cli import main
    from mlflow_di.mlflow_edge import models as edge_models, runs
    from mlflow_di.models import zoo
    from mlflow_di.models.torch_model import TorchModel

    use_server(mlflow_server)
    name = f"cnn-{uuid.uuid4().hex[:8]}"
    model = TorchModel(zoo.build("digits-cnn", seed=0), zoo.architecture("digits-cnn").preprocessing, name=name,
                       metadata={"arch": "digits-cnn"})
    with runs.tracked_run("train"):
        edge_models.log_torch_model(model, registered_model_name=name)
    assert main(["coverage", "--model-uri", f"models:/{name}/1", "--train-data", "digits[0:200]",
                 "--test-data", "digits[600:700]", "--criteria", "idc", "--top-m", "3"]) == 0

    # two checks: one reads "<=", and the realism check (ERROR: no campaign at all) names its budget, ">= 0.9"
    assert main(["gate", "--model-uri", f"models:/{name}/1", "--min-idc", "0", "--max-realistic-success-rate",
                 "1"]) == 2

    def page(driver) -> str:
        return driver.execute_script("return document.body.innerText")

    browser.set_window_size(1280, 1000)
    browser.get(f"{mlflow_server.url}/#/models/{name}/versions/1")
    wait = WebDriverWait(browser, WAIT)
    # the verdict, in the version's description, where a person looks first, rendered as written
    wait.until(lambda d: f"mlflow-di gate: ERROR for models:/{name}/1" in page(d))
    screenshot(browser, "version-page-verdict")
    text = page(browser)
    assert "SSIM >= 0.9" in text and "\\>" not in text and "\\<" not in text and "&gt;" not in text, text[:3000]
    cells = browser.execute_script(
        "return [...document.querySelectorAll('td')].map(c => [c.innerText, c.scrollWidth <= c.clientWidth + 1])")
    assert cells and all(fits for _, fits in cells), cells  # no cell clipped at 1280 px
    assert any(cell.strip() == "idc" for cell, _ in cells)  # a cell holds its own text, not its neighbour's
    link = browser.find_element(By.CSS_SELECTOR, 'a[href^="#/experiments/"]')  # relative: any host, any port
    run_id = link.get_attribute("href").rsplit("/", 1)[1]
    link.click()
    wait.until(lambda d: d.current_url.endswith(f"/runs/{run_id}") and "Overview" in page(d)
               and "Run ID" in page(d) and run_id in page(d))  # the run's own page opened
    browser.get(f"{mlflow_server.url}/#/models/{name}/versions/1")
    wait.until(lambda d: f"mlflow-di gate: ERROR for models:/{name}/1" in page(d))
    wait.until(ready.element_to_be_clickable((By.CSS_SELECTOR, 'a[href*="/models/m-"]'))).click()

    # the metrics table renders after the datasets panel: wait for both before reading the page
    wait.until(lambda d: "Datasets used" in page(d) and "digits[600:700]" in page(d) and "\nidc\n" in page(d))
    text = page(browser)
    assert "\nidc\n" in text and "coverage " in text  # the metric, from the coverage run


def test_the_parent_fuzz_report_fits_the_mlflow_uis_preview_pane_at_1280_pixels(registered_cnn, mlflow_server,
                                                                               use_server, browser, tmp_path, capsys):
    """The report a reviewer opens first (the parent run of one call fuzzing two exports), opened where a reviewer
    opens it: the MLflow UI's artifact preview, a window 1280 px wide (the preview pane is 515 px there with the
    UI's assistant open). The same NOISE box as each campaign's own report; inside the pane no table scrolls
    sideways, no cell is clipped, and the page itself is no wider than the pane."""
    import mlflow
    from selenium.webdriver.support.ui import WebDriverWait

    from mlflow_di.cli import main

    assert main(["compress", "--model-uri", registered_cnn, "--method", "int8-dynamic,prune-l1", "--amount", "0.5",
                 "--eval-data", "digits[1300:1400]", "--no-benefit"]) == 0, capsys.readouterr().err
    assert main(["fuzz", "--original", registered_cnn, "--compressed", "models:/cnn-int8-dynamic/1",
                 "--compressed", "models:/cnn-prune-l1/1", "--seed-data", "digits[1300:1320]",
                 "--max-queries", "100"]) == 0
    parent = next(run for run in mlflow.search_runs(search_all_experiments=True, output_format="list")
                  if run.data.tags.get("mlflow_di.command") == "fuzz" and "mlflow.parentRunId" not in run.data.tags
                  and "," in run.data.params.get("compressed", ""))
    report = pathlib.Path(mlflow.artifacts.download_artifacts(run_id=parent.info.run_id,
                                                              artifact_path="fuzz/report.html", dst_path=str(tmp_path)))
    client = use_server(mlflow_server)  # the same page in the UI's preview
    experiment = client.create_experiment(f"preview-{uuid.uuid4().hex[:8]}")
    run_id = record_run(client, experiment, "fuzz", tags={"mlflow.runName": "fuzz two exports"})
    client.log_artifact(run_id, str(report), "fuzz")
    browser.set_window_size(1280, 1000)
    browser.get(f"{mlflow_server.url}/#/experiments/{experiment}/runs/{run_id}/artifacts/fuzz/report.html")
    frame = WebDriverWait(browser, WAIT).until(lambda d: (d.find_elements("css selector", "iframe") or [None])[0])
    pane = frame.size["width"]
    assert pane < 1280
    browser.switch_to.frame(frame)
    WebDriverWait(browser, WAIT).until(lambda d: "Side by side" in d.execute_script("return document.body.innerText"))
    text = browser.execute_script("return document.body.innerText")
    assert "NOISE" in text and "How realistic the triggers are" in text
    assert "#1 models:/cnn-int8-dynamic/1" in text and "#2 models:/cnn-prune-l1/1" in text
    browser.switch_to.default_content()
    screenshot(browser, "fuzz-parent-report-preview-1280")
    browser.switch_to.frame(frame)
    overflowing = browser.execute_script(
        "const wide = [...document.querySelectorAll('.table-wrap')].filter(w => w.scrollWidth > w.clientWidth + 1);"
        "const cut = [...document.querySelectorAll('th, td')].filter(c => c.scrollWidth > c.clientWidth + 1);"
        "return [wide.map(w => w.previousElementSibling && w.previousElementSibling.innerText), "
        "cut.map(c => c.innerText), document.documentElement.scrollWidth, document.documentElement.clientWidth];")
    assert overflowing[:2] == [[], []] and overflowing[2] <= overflowing[3] <= pane, overflowing
