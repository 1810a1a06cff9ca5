"""Regenerate ``docs/img/version-verdict.png``: the demo's version page in the MLflow UI, after ``make demo``.

Starts ``mlflow ui`` on the demo's store (``sqlite:///mlflow.db`` in the folder given, default the current
one) on a free port of 127.0.0.1, opens ``models:/digits-cnn/1`` in headless Chromium at 1280x1000
(Debian's ``chromium`` and ``chromium-driver``, as the browser test uses them) and saves the screenshot,
then stops the server it started.

    make demo && .venv/bin/python docs/img/version_verdict.py [STORE_FOLDER]
"""
from __future__ import annotations

import pathlib
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

OUT = pathlib.Path(__file__).resolve().parent / "version-verdict.png"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    store = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve() / "mlflow.db"
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", f"sqlite:///{store}",
                               "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"mlflow ui did not answer at {url}")
                time.sleep(0.5)
        options = webdriver.ChromeOptions()
        options.binary_location = "/usr/bin/chromium"
        for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                     "--window-size=1280,1000", f"--user-data-dir={tempfile.mkdtemp()}",
                     "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"):
            options.add_argument(flag)
        driver = webdriver.Chrome(service=Service(executable_path="/usr/bin/chromedriver"), options=options)
        try:
            driver.get(f"{url}/#/models/digits-cnn/versions/1")
            WebDriverWait(driver, 90).until(
                lambda d: "mlflow-di gate:" in d.execute_script("return document.body.innerText"))
            # the UI opens its assistant panel beside the page: close it, the description gets the width
            driver.execute_script("const b = [...document.querySelectorAll('button')].find(b => "
                                  "/close/i.test(b.getAttribute('aria-label') || '')); if (b) b.click();")
            time.sleep(1)  # the page settles
            driver.save_screenshot(str(OUT))
        finally:
            driver.quit()
    finally:
        server.terminate()
        server.wait(30)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
