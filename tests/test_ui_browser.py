"""The dashboard in a real browser: Debian's chromium through its chromedriver (Selenium, the
driver's path given explicitly, so Selenium Manager downloads nothing), against real uvicorn
processes and PostgreSQL. One browser for the module; each test its own instance.

Every page visited is checked with axe-core (injected through the driver's script execution:
the page's CSP forbids a foreign script tag) and saved as a screenshot, in var/screenshots/
or CRONLOCK_SCREENSHOTS (scripts/ui-screenshots refreshes docs/images/ with them). What the
pages say and refuse in detail is tests/test_ui.py's, in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from selenium import webdriver
from selenium.common.exceptions import (
    NoSuchElementException,
    StaleElementReferenceException,
    WebDriverException,
)
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.support import TEST_SECRET
from tests.support.binaries import SKIP_ENV, require_binary
from tests.support.cluster import Instance
from tests.support.ui import READ_TOKEN
from tests.util import seen_since

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# .ci/run installs it from the npm registry: npm install --prefix var/npm axe-core
AXE = Path(os.environ.get("AXE_CORE_JS", ROOT / "var/npm/node_modules/axe-core/axe.min.js"))
SHOTS = Path(os.environ.get("CRONLOCK_SCREENSHOTS", ROOT / "var/screenshots"))
WAIT = 15.0
ENV = {
    "CRON_JOBS": "cronlock.demo.digest,cronlock.housekeeping,tests.ui_jobs",
    "CRON_READ_TOKEN": READ_TOKEN,
    "UI_REFRESH_INTERVAL": "0.5",
}

# Hourly runs over the last day, as the ledger holds them: one failed, two slots missed.
HISTORY_SQL = """
INSERT INTO cronlock.runs (job, slot, status, trigger, source, instance, started_at,
                           finished_at, duration_ms, error)
SELECT 'hourly', s, CASE WHEN h = 9 THEN 'failed' ELSE 'succeeded' END, 'scheduled', 'http',
       'i' || (h % 2 + 1), s + interval '2 seconds', s + make_interval(secs => 2 + h % 5 * 7),
       (h % 5 * 7) * 1000.0 + 40, CASE WHEN h = 9 THEN 'connection reset by peer' END
FROM generate_series(30, 1, -1) AS h,
     LATERAL (SELECT date_trunc('hour', now()) - make_interval(hours => h) AS s) AS slot
WHERE h NOT IN (5, 6)
"""

AXE_RUN = """
const done = arguments[arguments.length - 1];
axe.run(document, {resultTypes: ["violations"]}).then(
  r => done(r.violations.map(v => ({id: v.id, impact: v.impact, help: v.help,
                                     nodes: v.nodes.map(n => n.target.join(" "))}))),
  e => done([{id: "axe-error", impact: "critical", help: String(e), nodes: []}]));
"""


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    require_binary("chromium")
    require_binary("chromedriver")
    if not AXE.exists():
        reason = f"axe-core is not installed at {AXE} (npm install --prefix var/npm axe-core)"
        if os.environ.get(SKIP_ENV) == "1":
            pytest.skip(reason)
        pytest.fail(f"{reason}; set {SKIP_ENV}=1 to skip these tests")
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager, were it asked, must not download
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,900",
        "--no-first-run",
        "--disable-extensions",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # CSP reports land there
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def ui(browser: WebDriver) -> Iterator[WebDriver]:
    """The browser with no cookies (they are per host, not per port), scripts on after."""
    browser.execute_cdp_cmd("Network.clearBrowserCookies", {})
    try:
        yield browser
    finally:  # a test may have turned scripts off
        browser.execute_cdp_cmd("Emulation.setScriptExecutionDisabled", {"value": False})


def wait(driver: WebDriver, check: Callable[[WebDriver], Any], what: str) -> Any:
    # The page swaps its live parts while open: an element found a moment ago may be gone.
    return WebDriverWait(
        driver, WAIT, poll_frequency=0.1, ignored_exceptions=[StaleElementReferenceException]
    ).until(check, what)


def click(driver: WebDriver, css: str) -> None:
    """Click what `css` finds, again if the page swapped it in between."""

    def clicked(d: WebDriver) -> bool:
        d.find_element(By.CSS_SELECTOR, css).click()
        return True

    WebDriverWait(
        driver,
        WAIT,
        poll_frequency=0.1,
        ignored_exceptions=[StaleElementReferenceException, NoSuchElementException],
    ).until(clicked, f"a click on {css}")


def text(driver: WebDriver) -> str:
    try:
        return str(driver.find_element(By.TAG_NAME, "body").text)
    except StaleElementReferenceException:
        raise  # a WebDriverException too: already what `wait` retries
    except WebDriverException as exc:
        # chromedriver's words for a body a navigation replaced between the find and the read
        # (seen after a login's redirect): stale, as `wait` expects, not an error.
        if "does not belong to the document" in str(exc):
            raise StaleElementReferenceException(str(exc)) from exc
        raise


def audit(driver: WebDriver, name: str) -> None:
    """axe-core on the page as it is now: no serious or critical violation; nothing the CSP
    refused (the console would say); and a screenshot."""
    console: list[dict[str, Any]] = driver.get_log("browser")  # type: ignore[no-untyped-call]
    refused = [e["message"] for e in console if "Content Security" in e["message"]]
    assert refused == [], f"{name}: {refused}"
    driver.execute_script(AXE.read_text())
    violations = driver.execute_async_script(AXE_RUN)
    bad = [v for v in violations if v["impact"] in ("serious", "critical")]
    assert bad == [], f"{name}: {bad}"
    SHOTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(SHOTS / f"ui-{name}.png"))


def log_in(driver: WebDriver, base: str, token: str) -> None:
    driver.get(f"{base}/ui/login")
    driver.find_element(By.ID, "token").send_keys(token)
    driver.find_element(By.CSS_SELECTOR, "form.login button").click()


def curl(base: str, path: str, header_file: Path, body: str | None = None) -> str:
    """A trigger as a scheduler sends one: curl, the secret in a header file."""
    data = ["-H", "Content-Type: application/json", "-d", body] if body is not None else []
    done = subprocess.run(
        ["curl", "-s", "-X", "POST", "-H", f"@{header_file}", *data, f"{base}{path}"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done.stdout


def header_file(tmp_path: Path) -> Path:
    path = tmp_path / "auth_header"
    path.write_text(f"Authorization: Bearer {TEST_SECRET}\n")
    return path


def forged_post(driver: WebDriver, action: str, csrf: str | None) -> None:
    """A form submitted from the page by a script, as a forged one would be."""
    driver.execute_script(
        """
        const f = document.createElement("form");
        f.method = "post"; f.action = arguments[0];
        if (arguments[1] !== null) {
          const i = document.createElement("input");
          i.type = "hidden"; i.name = "csrf"; i.value = arguments[1]; f.appendChild(i);
        }
        document.body.appendChild(f); f.submit();
        """,
        action,
        csrf,
    )


def test_login_with_each_token_and_a_wrong_one(
    ui: WebDriver, start_instance: Callable[..., Instance], db: asyncpg.Connection
) -> None:
    base = start_instance("i1", env=ENV).url
    log_in(ui, base, "not-the-token-" + "x" * 30)
    wait(ui, lambda d: "not one this service accepts" in text(d), "the refusal")
    audit(ui, "login")

    log_in(ui, base, READ_TOKEN)
    wait(ui, lambda d: "read token: view only" in text(d), "the read session")
    assert ui.find_elements(By.CSS_SELECTOR, "[data-action]") == []  # no action to offer
    # The read token cannot act, even with its session's own CSRF token.
    csrf = ui.find_element(By.NAME, "csrf").get_attribute("value")
    forged_post(ui, f"{base}/ui/jobs/refresh-cache/run", csrf)
    wait(ui, lambda d: "the read token can see, not act" in text(d), "the read refusal")
    ui.get(f"{base}/ui/")
    click(ui, "header form button")  # log out
    wait(ui, lambda d: d.current_url.endswith("/ui/login"), "the login page")

    log_in(ui, base, TEST_SECRET)
    wait(ui, lambda d: "secret: can act" in text(d), "the secret's session")
    # A forged post without the CSRF token is refused.
    forged_post(ui, f"{base}/ui/jobs/refresh-cache/run", None)
    wait(ui, lambda d: "CSRF token is missing or wrong" in text(d), "the CSRF refusal")


async def test_trigger_run_now_and_cancel(
    ui: WebDriver,
    start_instance: Callable[..., Instance],
    db: asyncpg.Connection,
    tmp_path: Path,
) -> None:
    base = start_instance("i1", env=ENV).url
    header = header_file(tmp_path)
    log_in(ui, base, TEST_SECRET)
    wait(ui, lambda d: "secret: can act" in text(d), "the jobs page")
    audit(ui, "jobs")

    # A trigger from curl appears on the open page without a reload: the marker set on this
    # document survives.
    ui.execute_script("window.__stillHere = true")
    assert "run_id" in json.loads(curl(base, "/cron/refresh-cache", header))
    row = '[data-job="refresh-cache"] .last-run'
    wait(ui, lambda d: "succeeded" in d.find_element(By.CSS_SELECTOR, row).text, "the run")
    assert ui.execute_script("return window.__stillHere === true")

    # Run now, from the button: the run page, recorded with source ui.
    click(ui, '[data-job="refresh-cache"] [data-action="run"]')
    wait(ui, lambda d: "/ui/runs/" in d.current_url, "the run page")
    wait(ui, lambda d: "succeeded" in text(d), "the run to finish")
    run_id = int(ui.current_url.rsplit("/", 1)[1])
    source = "SELECT source FROM cronlock.runs WHERE id = $1"
    assert await db.fetchval(source, run_id) == "ui"
    audit(ui, "run")

    # Cancel a running job: a long statement, started by curl, cancelled from the page.
    started = curl(base, "/cron/long-export?wait=false", header, '{"seconds": 20}')
    long_id = json.loads(started)["run_id"]
    ui.get(f"{base}/ui/locks")
    wait(ui, lambda d: "long-export" in text(d), "its lock")
    audit(ui, "locks")
    ui.get(f"{base}/ui/")
    cancel = '[data-job="long-export"] [data-action="cancel"]'
    wait(ui, lambda d: d.find_elements(By.CSS_SELECTOR, cancel), "the cancel button")
    click(ui, cancel)
    landed = f"/ui/runs/{long_id}?notice=cancel-sent"
    wait(ui, lambda d: d.current_url.endswith(landed), "the run")
    wait(ui, lambda d: "cancelled" in text(d), "the cancelled run")
    status = "SELECT status FROM cronlock.runs WHERE id = $1"
    assert await db.fetchval(status, long_id) == "cancelled"

    ui.get(f"{base}/ui/jobs/refresh-cache")
    wait(ui, lambda d: d.find_elements(By.CSS_SELECTOR, "figure.timeline svg"), "the timeline")
    assert len(ui.find_elements(By.CSS_SELECTOR, "svg rect.mark")) == 2
    # A scheduled job's history: a day of hourly runs, one failed, two slots missed (deployed
    # long before: its history starts before the window).
    await seen_since(db, "hourly")
    await db.execute(HISTORY_SQL)
    ui.get(f"{base}/ui/jobs/hourly")
    wait(ui, lambda d: d.find_elements(By.CSS_SELECTOR, "svg circle.missed"), "the gaps")
    assert len(ui.find_elements(By.CSS_SELECTOR, "svg circle.missed")) >= 2
    assert len(ui.find_elements(By.CSS_SELECTOR, "svg rect.mark.status-failed")) == 1
    audit(ui, "job")

    # Every job's runs and the newest failures: the page the navigation opens.
    click(ui, 'nav a[href$="/ui/runs"]')
    wait(ui, lambda d: "Recent failures" in text(d), "the runs page")
    assert ui.find_elements(By.CSS_SELECTOR, f'table.all-runs [data-run="{long_id}"]')
    audit(ui, "runs")

    # A scheduled job's forced run asks first, on a page of its own; confirmed, it runs.
    ui.get(f"{base}/ui/jobs/hourly")
    click(ui, '[data-action="run"]')
    wait(ui, lambda d: "Run hourly now?" in text(d), "the confirmation page")
    audit(ui, "confirm")
    click(ui, '[data-action="confirm-run"]')
    wait(ui, lambda d: "/ui/runs/" in d.current_url, "the confirmed run")
    confirmed = int(ui.current_url.rsplit("/", 1)[1])
    trigger = "SELECT job, trigger, source FROM cronlock.runs WHERE id = $1"
    recorded = await db.fetchrow(trigger, confirmed)
    assert recorded is not None
    assert tuple(recorded) == ("hourly", "manual", "ui")

    # With JavaScript off, the forms still work: run now, plainly posted, and its question.
    ui.execute_cdp_cmd("Emulation.setScriptExecutionDisabled", {"value": True})
    ui.get(f"{base}/ui/")
    click(ui, '[data-job="refresh-cache"] [data-action="run"]')
    wait(ui, lambda d: "/ui/runs/" in d.current_url, "the run page without scripts")
    assert int(ui.current_url.rsplit("/", 1)[1]) > confirmed
    ui.get(f"{base}/ui/jobs/hourly")
    click(ui, '[data-action="run"]')
    wait(ui, lambda d: "Run hourly now?" in text(d), "the confirmation page without scripts")
    click(ui, '[data-action="confirm-run"]')
    wait(ui, lambda d: "/ui/runs/" in d.current_url, "the confirmed run without scripts")
    assert int(ui.current_url.rsplit("/", 1)[1]) > confirmed


async def test_requeue_a_dead_email(
    ui: WebDriver, start_instance: Callable[..., Instance], db: asyncpg.Connection
) -> None:
    base = start_instance("i1", env=ENV).url
    email_id = await db.fetchval(
        "INSERT INTO cronlock.email_outbox (job, sender, recipient, subject, body, status,"
        " attempts, last_error) VALUES ('daily-digest', 'a@example.com', 'ann@example.com',"
        " 'Your digest', 'body', 'dead', 12, '422 the provider refused the address')"
        " RETURNING id"
    )
    log_in(ui, base, TEST_SECRET)
    wait(ui, lambda d: "secret: can act" in text(d), "the jobs page")
    ui.find_element(By.LINK_TEXT, "Outbox").click()
    wait(ui, lambda d: "ann@example.com" in text(d), "the dead letter")
    audit(ui, "outbox")
    click(ui, f'[data-email="{email_id}"] a')
    wait(ui, lambda d: "the provider refused" in text(d), "the email's attempts")
    audit(ui, "email")
    click(ui, '[data-action="requeue"]')
    wait(ui, lambda d: "Requeued." in text(d), "the notice")
    status = "SELECT status FROM cronlock.email_outbox WHERE id = $1"
    assert await db.fetchval(status, email_id) == "pending"


def test_pause_and_resume(
    ui: WebDriver, start_instance: Callable[..., Instance], tmp_path: Path
) -> None:
    base = start_instance("i1", env=ENV).url
    header = header_file(tmp_path)
    log_in(ui, base, TEST_SECRET)
    wait(ui, lambda d: "secret: can act" in text(d), "the jobs page")
    ui.get(f"{base}/ui/jobs/refresh-cache")
    click(ui, "details.pause summary")
    ui.find_element(By.NAME, "note").send_keys("maintenance")
    click(ui, '[data-action="pause"]')
    wait(ui, lambda d: "paused" in text(d), "the paused badge")
    assert "paused" in curl(base, "/cron/refresh-cache", header)
    click(ui, '[data-action="resume"]')
    wait(ui, lambda d: "Resumed." in text(d), "the resume")
    assert '"run_id"' in curl(base, "/cron/refresh-cache", header)


def test_the_driver_is_the_system_one(browser: WebDriver) -> None:
    """Nothing downloaded: the session runs Debian's chromium through /usr/bin/chromedriver."""
    caps = browser.capabilities
    assert caps["browserName"] in ("chrome", "chromium")
    try:
        version = subprocess.run(
            [CHROMEDRIVER, "--version"], capture_output=True, text=True, check=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError, WebDriverException) as exc:
        pytest.fail(f"chromedriver: {exc}")
    assert caps["chrome"]["chromedriverVersion"].split()[0] in version
