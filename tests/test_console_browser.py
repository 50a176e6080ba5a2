"""The web console in a real browser: Debian's chromium, driven by Selenium through
chromedriver, against a real ``aion-trio console`` subprocess over a real SQLite store that a
real ``aion-trio worker`` subprocess owns.

Every wait is bounded (WebDriverWait, a deadline on each subprocess line).  With
``AION_TRIO_CONSOLE_SCREENSHOTS=1`` the list and timeline tests save the screenshots that
docs/console.md shows (docs/console-list.png, docs/console-timeline.png).
"""

from __future__ import annotations

import http.client
import os
import selectors
import shutil
import subprocess
import sysconfig
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from selenium import webdriver
from selenium.common.exceptions import (
    NoAlertPresentException,
    NoSuchElementException,
    StaleElementReferenceException,
)
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.expected_conditions import staleness_of
from selenium.webdriver.support.ui import WebDriverWait

import aion_trio

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
APP = "tests.procs.console_app:app"
DOCS = ROOT / "docs"
WAIT = 30.0
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


def _script() -> str:
    return str(Path(sysconfig.get_path("scripts")) / "aion-trio")


def _screenshots() -> bool:
    return os.environ.get("AION_TRIO_CONSOLE_SCREENSHOTS", "") not in ("", "0")


@aion_trio.activity(name="debit", retry=aion_trio.RetryPolicy(max_attempts=1))
async def _broken_debit(amount: int) -> str:
    raise RuntimeError(f"card declined ({amount})")


async def _seed_failed(db: Path) -> None:
    """c-1 failed in ``debit`` (the seed's broken one: the worker's is fixed)."""
    from procs import console_app

    async with aion_trio.open_engine(
        f"sqlite:///{db}",
        workflows=console_app.workflows,
        activities=[console_app.greet, _broken_debit],
    ) as engine:
        c = await engine.start("charge", 5, workflow_id="c-1")
        with pytest.raises(aion_trio.WorkflowFailure):
            await c.result()


async def _seed(db: Path) -> None:
    """h-1 completed (region eu); o-1 (region us) and o-2 (region ap) past their retried
    activity, their timer and their child, waiting for the ``approve`` signal."""
    from procs import console_app

    async with aion_trio.open_engine(
        f"sqlite:///{db}", workflows=console_app.workflows, activities=console_app.activities
    ) as engine:
        h = await engine.start(
            "hello", "ann", workflow_id="h-1", search_attributes={"region": "eu", "amount": 100}
        )
        assert await h.result() == "hello ann"
        await engine.start("order", "book", workflow_id="o-1", search_attributes={"region": "us"})
        await engine.start("order", "pen", workflow_id="o-2", search_attributes={"region": "ap"})
        with trio.fail_after(WAIT):
            for workflow_id in ("o-1", "o-2"):
                # The run goes on in the engine's tasks: its history is what there is to watch.
                while not any(  # noqa: ASYNC110
                    isinstance(e.body, aion_trio.ChildWorkflowCompleted)
                    for e in await engine.history(workflow_id)
                ):
                    await trio.sleep(0.02)


def _read_line(proc: subprocess.Popen[str], what: str) -> str:
    """The subprocess's next stdout line, within WAIT seconds."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        if not selector.select(timeout=WAIT):
            pytest.fail(f"no {what} within {WAIT}s")
    line = proc.stdout.readline()
    if not line:
        pytest.fail(f"the process exited ({proc.wait(timeout=WAIT)}) before printing {what}")
    return line.strip()


def _wait_logged(log: Path, text: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + WAIT
    while text not in log.read_text(encoding="utf-8"):
        if proc.poll() is not None:
            pytest.fail(f"the worker exited ({proc.returncode}) before logging {text!r}")
        if time.monotonic() > deadline:
            pytest.fail(f"the worker did not log {text!r} within {WAIT}s")
        time.sleep(0.02)


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=WAIT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


@pytest.fixture(scope="module")
def store_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("console") / "console.db"
    trio.run(_seed, db)
    return db


@pytest.fixture(scope="module")
def console_url(store_db: Path) -> Iterator[str]:
    """The console's URL with its token; a worker owns the store meanwhile."""
    yield from _serve(store_db)


@pytest.fixture(scope="module")
def failed_console_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """As ``console_url``, over a store of its own holding the failed c-1."""
    db = tmp_path_factory.mktemp("console-reset") / "console.db"
    trio.run(_seed_failed, db)
    yield from _serve(db)


def _serve(db: Path) -> Iterator[str]:
    log = db.parent / "worker.log"
    with log.open("w", encoding="utf-8") as stderr:
        worker = subprocess.Popen(
            [_script(), "worker", APP, "--store", str(db)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            text=True,
        )
    try:
        _wait_logged(log, "ready: serving", worker)
        console = subprocess.Popen(
            [_script(), "console", "--store", str(db), "--module", APP, "--port", "0", "--refresh", "0.2"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            line = _read_line(console, "the console's URL")
            assert line.startswith("aion-trio console on http://127.0.0.1:"), line
            yield line.rsplit(" ", 1)[1]
        finally:
            _stop(console)
    finally:
        _stop(worker)


@pytest.fixture(scope="module")
def driver() -> Iterator[WebDriver]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    browser = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    browser.set_page_load_timeout(WAIT)
    try:
        yield browser
    finally:
        browser.quit()


def _base(url: str) -> str:
    return url.split("/?token=", 1)[0]


#: Every workflow of the seeded store.
ALL = ["o-2-shipping", "o-1-shipping", "o-2", "o-1", "h-1"]


def _wait(driver: WebDriver) -> WebDriverWait[WebDriver]:
    # The live part may be replaced between finding an element and reading it: look again.
    return WebDriverWait(
        driver, WAIT, ignored_exceptions=(NoSuchElementException, StaleElementReferenceException)
    )


def _login(driver: WebDriver, url: str) -> None:
    driver.get(url)
    _wait(driver).until(lambda d: d.current_url.rstrip("/") == _base(url))


# Read in one script: the live part may be replaced between two WebDriver calls.
def _ids(driver: WebDriver) -> list[str]:
    ids: list[str] = driver.execute_script(
        "return Array.from(document.querySelectorAll('table.list tbody tr'), r => r.dataset.id)"
    )
    return ids


def _statuses(driver: WebDriver) -> dict[str, str]:
    statuses: dict[str, str] = driver.execute_script(
        "return Object.fromEntries(Array.from(document.querySelectorAll('table.list tbody tr'),"
        " r => [r.dataset.id, r.querySelector('.status').textContent]))"
    )
    return statuses


def _counts(driver: WebDriver) -> dict[str, int]:
    texts: list[str] = driver.execute_script(
        "return Array.from(document.querySelectorAll('.count'), c => c.textContent)"
    )
    return {text.split()[0]: int(text.split()[1]) for text in texts}


def _until_ids(driver: WebDriver, expected: list[str]) -> None:
    _wait(driver).until(lambda d: sorted(_ids(d)) == sorted(expected), f"rows {expected}")


def test_a_wrong_or_missing_token_is_refused(driver: WebDriver, console_url: str) -> None:
    base = _base(console_url)
    driver.delete_all_cookies()
    driver.get(base + "/?token=not-the-token")
    assert "needs the token" in driver.find_element(By.ID, "message").text
    assert driver.find_elements(By.CSS_SELECTOR, "table.list") == []
    driver.get(base + "/workflows/o-1")
    assert "needs the token" in driver.find_element(By.ID, "message").text
    _login(driver, console_url)  # the right token: the list, and the token gone from the address
    assert "token" not in driver.current_url
    _until_ids(driver, ALL)


def _filter(driver: WebDriver, base: str, *, type_: str = "", status: str = "", attr: str = "") -> None:
    driver.get(base + "/")
    if type_:
        driver.find_element(By.ID, "f-type").send_keys(type_)
    if status:
        driver.find_element(By.CSS_SELECTOR, f"input[name=status][value={status}]").click()
    if attr:
        driver.find_element(By.ID, "f-attr-0").send_keys(attr)
    driver.find_element(By.ID, "apply").click()


def test_the_list_filters_as_aion_trio_list_does(driver: WebDriver, console_url: str) -> None:
    _login(driver, console_url)
    base = _base(console_url)
    _until_ids(driver, ALL)
    # o-1 runs until the signal test completes it: read its status, whichever ran first.
    statuses = _statuses(driver)
    assert statuses["h-1"] == statuses["o-1-shipping"] == "completed"
    counts = _counts(driver)
    assert counts == {s.value: list(statuses.values()).count(s.value) for s in aion_trio.WorkflowStatus}
    if _screenshots():
        driver.save_screenshot(str(DOCS / "console-list.png"))
    _filter(driver, base, type_="hello")
    _until_ids(driver, ["h-1"])
    assert "type=hello" in driver.current_url
    _filter(driver, base, status=statuses["o-1"])
    _until_ids(driver, [wid for wid, status in statuses.items() if status == statuses["o-1"]])
    _filter(driver, base, status="failed")
    _wait(driver).until(lambda d: d.find_element(By.CSS_SELECTOR, "p.empty"))
    _filter(driver, base, attr="region=eu")
    _until_ids(driver, ["h-1"])
    _filter(driver, base, attr="region~u")
    _until_ids(driver, ["h-1", "o-1"])
    _filter(driver, base, attr="region")  # what 'aion-trio list --attr region' refuses, refused alike
    error = _wait(driver).until(lambda d: d.find_element(By.ID, "filter-error")).text
    assert "is not KEY=VALUE, KEY>VALUE, KEY<VALUE or KEY~TEXT" in error


def test_the_workflow_page_draws_retries_the_timer_and_the_child(driver: WebDriver, console_url: str) -> None:
    _login(driver, console_url)
    driver.get(_base(console_url) + "/workflows/o-1")
    lanes = {
        lane.get_attribute("data-label"): lane
        for lane in driver.find_elements(By.CSS_SELECTOR, "#timeline g.lane")
    }
    activity = lanes["activity:0 flaky"]
    kinds = [bar.get_attribute("class") for bar in activity.find_elements(By.CSS_SELECTOR, "rect.bar")]
    assert kinds == ["bar retrying", "bar retrying", "bar completed"]
    titles = [t.get_attribute("textContent") for t in activity.find_elements(By.TAG_NAME, "title")]
    assert "warehouse busy (attempt 2)" in titles[1]
    assert any(label.startswith("timer ") for label in lanes)
    child = lanes["child o-1-shipping (shipping)"]
    assert child.find_elements(By.CSS_SELECTOR, "rect.bar.child")
    history = driver.find_element(By.CSS_SELECTOR, "table.history").text
    assert '"activity_type": "flaky"' in history  # payloads pretty-printed
    if _screenshots():
        driver.save_screenshot(str(DOCS / "console-timeline.png"))
    child.find_element(By.TAG_NAME, "a").click()
    _wait(driver).until(lambda d: d.find_element(By.CSS_SELECTOR, "h1 .wid").text == "o-1-shipping")
    parent = driver.find_element(By.LINK_TEXT, "o-1")  # the parent, linked back
    assert parent.get_attribute("href").endswith("/workflows/o-1")


def _accept_confirm(driver: WebDriver) -> str:
    def alert(d: WebDriver) -> object:
        try:
            return d.switch_to.alert
        except NoAlertPresentException:
            return False

    box = _wait(driver).until(alert)
    text: str = box.text  # type: ignore[attr-defined]
    box.accept()  # type: ignore[attr-defined]
    return text


def test_a_signal_sent_from_the_page_completes_the_waiting_workflow(
    driver: WebDriver, console_url: str
) -> None:
    _login(driver, console_url)
    base = _base(console_url)
    driver.get(base + "/?type=order")  # the list stays open in a tab of its own
    _until_ids(driver, ["o-2", "o-1"])
    assert _statuses(driver)["o-1"] == "running"
    listing = driver.current_window_handle
    driver.switch_to.new_window("tab")
    driver.get(base + "/workflows/o-1")
    assert driver.find_element(By.ID, "status").text == "running"
    driver.find_element(By.ID, "signal-name").send_keys("approve")
    payload = driver.find_element(By.ID, "signal-payload")
    payload.clear()
    payload.send_keys('{"ok": tru')  # not JSON: the editor says so and holds the button
    assert "not JSON" in driver.find_element(By.ID, "signal-json-error").text
    assert not driver.find_element(By.ID, "do-signal").is_enabled()
    payload.send_keys("e}")
    assert driver.find_element(By.ID, "do-signal").is_enabled()
    driver.find_element(By.ID, "do-signal").click()
    assert "Send this signal to workflow o-1?" in _accept_confirm(driver)
    outcome = _wait(driver).until(lambda d: d.find_element(By.ID, "outcome"))
    assert "applied by the worker" in outcome.text, outcome.text
    assert "signal 'approve'" in outcome.text
    # The page is live: the worker's completion shows without a reload.
    _wait(driver).until(lambda d: d.find_element(By.ID, "status").text == "completed")
    result = driver.find_element(By.ID, "result").text
    assert '"decision": {' in result
    assert '"ok": true' in result
    driver.close()
    driver.switch_to.window(listing)  # the list, never reloaded, shows it too
    _wait(driver).until(lambda d: _statuses(d)["o-1"] == "completed")
    assert _counts(driver)["completed"] == 1


def _act(driver: WebDriver, action: str, *, reason: str = "") -> str:
    """Press the action's button, confirm, and return the outcome the page shows."""
    form = driver.find_element(By.ID, f"do-{action}").find_element(By.XPATH, "./..")
    if reason:
        form.find_element(By.NAME, "reason").send_keys(reason)
    page = driver.find_element(By.TAG_NAME, "html")
    form.find_element(By.ID, f"do-{action}").click()
    question = _accept_confirm(driver)
    assert question.endswith("workflow o-2?"), question
    _wait(driver).until(staleness_of(page))  # the outcome's page, not the one before
    outcome: str = _wait(driver).until(lambda d: d.find_element(By.ID, "outcome")).text
    return outcome


def test_terminate_reopen_and_cancel_from_the_page(driver: WebDriver, console_url: str) -> None:
    _login(driver, console_url)
    driver.get(_base(console_url) + "/workflows/o-2")
    assert driver.find_element(By.ID, "status").text == "running"
    outcome = _act(driver, "terminate", reason="wrong pen")
    assert outcome == "applied by the worker" + outcome.split("applied by the worker", 1)[1]
    assert "terminated" in outcome
    _wait(driver).until(lambda d: d.find_element(By.ID, "status").text == "cancelled")
    history = driver.find_element(By.CSS_SELECTOR, "table.history").text
    assert '"reason": "wrong pen"' in history
    outcome = _act(driver, "reopen")
    assert "reopened workflow 'o-2'" in outcome, outcome
    _wait(driver).until(lambda d: d.find_element(By.ID, "status").text == "running")
    outcome = _act(driver, "cancel", reason="not needed")
    assert "cancellation requested" in outcome, outcome
    _wait(driver).until(lambda d: d.find_element(By.ID, "status").text == "cancelled")
    _act(driver, "reopen")
    _wait(driver).until(lambda d: d.find_element(By.ID, "status").text == "running")
    refused = _act(driver, "reopen")  # a running workflow: the worker's refusal, shown as such
    assert refused.startswith("reopen failed: "), refused
    assert "bad" in (driver.find_element(By.ID, "outcome").get_attribute("class") or "")


def test_a_failed_workflow_reset_from_the_page_completes_in_its_new_run(
    driver: WebDriver, failed_console_url: str
) -> None:
    _login(driver, failed_console_url)
    driver.get(_base(failed_console_url) + "/workflows/c-1")
    assert driver.find_element(By.ID, "status").text == "failed"
    old_run = driver.find_element(By.XPATH, "//dt[text()='Run']/following-sibling::dd[1]").text
    chosen = driver.find_element(By.ID, "reset-to-seq")
    options = chosen.find_elements(By.TAG_NAME, "option")
    selected = [o for o in options if o.is_selected()]
    assert len(selected) == 1, [o.text for o in options]
    assert "(last step)" in selected[0].text, [o.text for o in options]
    assert "ActivityCompleted" in selected[0].text  # after greet: debit runs again
    form = driver.find_element(By.ID, "do-reset").find_element(By.XPATH, "./..")
    form.find_element(By.NAME, "reason").send_keys("card fixed")
    page = driver.find_element(By.TAG_NAME, "html")
    form.find_element(By.ID, "do-reset").click()
    assert _accept_confirm(driver) == "Reset workflow c-1?"
    _wait(driver).until(staleness_of(page))
    outcome = _wait(driver).until(lambda d: d.find_element(By.ID, "outcome")).text
    assert "applied by the worker" in outcome, outcome
    assert "reset workflow 'c-1': new run" in outcome, outcome
    new_run = outcome.rsplit("new run ", 1)[1].split()[0].rstrip(")")
    # The worker runs the new run with the fixed debit: the live page shows it complete.
    _wait(driver).until(lambda d: d.find_element(By.ID, "status").text == "completed")
    assert driver.find_element(By.ID, "result").text == '"hello payer: debited 5"'
    back = driver.find_element(By.ID, "reset-from")  # the new run links back to the old one
    back_text = back.text
    assert back_text, old_run
    assert old_run.startswith(back_text), (back_text, old_run)
    back.click()
    _wait(driver).until(lambda d: d.find_elements(By.ID, "older-run"))
    ahead = driver.find_element(By.ID, "reset-to")
    assert new_run.startswith(ahead.text), (ahead.text, new_run)
    history = driver.find_element(By.CSS_SELECTOR, "table.history").text
    assert "WorkflowReset" in history
    assert '"reason": "card fixed"' in history
    # In the history, the old run's WorkflowReset links to the new run and the new run's
    # WorkflowStarted back to the old one.
    links = [a.text for a in driver.find_elements(By.CSS_SELECTOR, "table.history a.run-link")]
    assert links == [f"to the new run {new_run[:8]}", f"from run {back_text}"], links
    driver.find_element(By.LINK_TEXT, links[0]).click()
    _wait(driver).until(lambda d: d.find_elements(By.ID, "reset-from"))
    assert not driver.find_elements(By.ID, "older-run")  # the latest run's page


# --------------------------------------------------------------------------
# The token and the CSRF check, over plain HTTP
# --------------------------------------------------------------------------


def _http(
    url: str, path: str, *, method: str = "GET", cookie: str = "", body: str = "", origin: str = ""
) -> tuple[int, dict[str, str], str]:
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=WAIT)
    headers = {"Content-Type": "application/x-www-form-urlencoded"} if method == "POST" else {}
    if cookie:
        headers["Cookie"] = cookie
    if origin:
        headers["Origin"] = origin
    try:
        connection.request(method, path, body=body or None, headers=headers)
        response = connection.getresponse()
        text = (
            ""
            if response.getheader("content-type", "").startswith("text/event-stream")
            else response.read().decode()
        )
        return response.status, {k.lower(): v for k, v in response.getheaders()}, text
    finally:
        connection.close()


def _cookie(url: str) -> str:
    status, headers, _ = _http(url, "/?token=" + url.split("?token=", 1)[1])
    assert status == 303, status
    return headers["set-cookie"].split(";", 1)[0]


def test_every_request_needs_the_token_and_every_post_the_csrf_field(console_url: str) -> None:
    token = console_url.split("?token=", 1)[1]
    for path in ("/", "/workflows/o-1", "/static/console.js", "/live/list", "/?token=" + token[:-1] + "x"):
        status, _, text = _http(console_url, path)
        assert (status, "needs the token" in text) == (403, True), path
    status, headers, _ = _http(console_url, f"/workflows/o-1?token={token}&run=x")
    assert status == 303
    assert headers["location"] == "/workflows/o-1?run=x"  # the token leaves the address
    cookie_header = headers["set-cookie"]
    assert "HttpOnly" in cookie_header
    assert "SameSite=strict" in cookie_header or "SameSite=Strict" in cookie_header
    cookie = cookie_header.split(";", 1)[0]
    status, _, page = _http(console_url, "/workflows/h-1", cookie=cookie)
    assert status == 200
    csrf = page.split('name="csrf" value="', 1)[1].split('"', 1)[0]
    form = urllib.parse.urlencode({"workflow_id": "h-1", "csrf": csrf})
    for action in ("reopen", "reset"):
        path = f"/actions/{action}"
        refused = [
            _http(console_url, path, method="POST", body=form),  # no cookie
            _http(console_url, path, method="POST", cookie=cookie, body="workflow_id=h-1"),  # no field
            _http(console_url, path, method="POST", cookie=cookie, body=form + "x"),  # a wrong one
            _http(console_url, path, method="POST", cookie=cookie, body=form, origin="http://evil.example"),
        ]
        assert [status for status, _, _ in refused] == [403, 403, 403, 403], action
        assert "CSRF check failed" in refused[1][2]
    status, headers, _ = _http(console_url, "/live/list", cookie=cookie)
    assert (status, headers["content-type"].split(";")[0]) == (200, "text/event-stream")


def test_a_read_only_console_shows_no_actions_and_takes_none(store_db: Path) -> None:
    console = subprocess.Popen(
        [_script(), "console", "--store", str(store_db), "--module", APP, "--port", "0", "--read-only"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        url = _read_line(console, "the console's URL").rsplit(" ", 1)[1]
        cookie = _cookie(url)
        status, _, page = _http(url, "/workflows/h-1", cookie=cookie)
        assert status == 200
        assert "actions are disabled" in page
        assert 'name="csrf"' not in page
        assert "read-only" in page
        assert 'id="do-reset"' not in page
        for action in ("reopen", "reset"):
            status, _, text = _http(
                url, f"/actions/{action}", method="POST", cookie=cookie, body="workflow_id=h-1&csrf=anything"
            )
            assert (status, "runs with --read-only" in text) == (403, True), action
    finally:
        _stop(console)
