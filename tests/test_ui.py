"""The live page (`/ui`) in a real headless Chromium (Debian's `chromium` and
`chromium-driver`), against a running controller whose mock agents talk over a real
Mosquitto: it refuses without a viewer token or with a wrong one, shows the numbers of a
known fleet, follows a budget cut made through the API, and keeps a screenshot
(`POWERD_UI_ARTIFACTS`, else the test's tmp_path; the path is printed)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs
from support.live_api import NODES, LiveApi, wait_until

from powerd.api.routers.history import bucketed
from powerd.api.routers.ui import TYPES, asset
from powerd.safety import TOL_W
from powerd.testing.mosquitto import LocalMosquitto

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


@pytest.fixture
def live_ui(tmp_path: Path, mosquitto: LocalMosquitto) -> Iterator[LiveApi]:
    api = LiveApi(tmp_path, broker_url=mosquitto.url).start()
    try:
        yield api
    finally:
        api.close()


@pytest.fixture
def browser() -> Iterator[Any]:
    if CHROMIUM is None or DRIVER is None:
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1100",
        "--no-first-run",
        "--disable-extensions",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def until(driver: Any, cond: Callable[[Any], Any], what: str, timeout_s: float = 20) -> Any:
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout_s, poll_frequency=0.1).until(cond)
    except TimeoutException:
        pytest.fail(f"the page did not show {what} within {timeout_s} s")


def text(driver: Any, css: str) -> str:
    from selenium.webdriver.common.by import By

    # textContent, not .text: what the element holds, shown or hidden.
    return str(driver.find_element(By.CSS_SELECTOR, css).get_attribute("textContent")).strip()


def shown(driver: Any, element_id: str) -> bool:
    from selenium.webdriver.common.by import By

    return bool(driver.find_element(By.ID, element_id).is_displayed())


# The page redraws every tick, so elements found one call ago may be gone: read the tree
# in one script, at one moment.
TREE_JS = """
const num = (v) => (v === undefined ? null : Number(v));
const out = {};
for (const el of document.querySelectorAll('[data-group]')) {
  const parent = el.parentElement.closest('[data-group]');
  out[el.dataset.group] = {
    level: el.dataset.level,
    parent: parent ? parent.dataset.group : null,
    budget_w: num(el.dataset.budgetW),
    committed_w: num(el.dataset.committedW),
    draw_w: num(el.dataset.drawW),
    over: el.dataset.over === 'true',
    nums: el.querySelector(':scope > .line .nums').textContent,
    gpus: [...el.querySelectorAll(':scope > .children > table tbody tr')].map((tr) => ({
      uuid: tr.dataset.uuid,
      class: tr.querySelector('.class').textContent,
      job: tr.querySelector('.job').textContent,
      state: tr.querySelector('.state').textContent,
    })),
  };
}
return out;
"""


def tree(driver: Any) -> dict[str, dict[str, Any]]:
    return dict(driver.execute_script(TREE_JS))


def test_page_files_are_public_and_carry_a_strict_policy(live_ui: LiveApi) -> None:
    with live_ui.client(None) as c:
        for path, name in (
            ("/ui", "index.html"),
            ("/ui/app.js", "app.js"),
            ("/ui/app.css", "app.css"),
        ):
            r = c.get(path)
            assert r.status_code == 200, path
            assert r.headers["content-type"] == TYPES[name]
            assert r.content == asset(name)
            csp = r.headers["content-security-policy"]
            assert "default-src 'none'" in csp and "script-src 'self'" in csp
            assert "frame-ancestors 'none'" in csp and r.headers["x-frame-options"] == "DENY"
        assert c.get("/ui/secrets.json").status_code == 422
        assert c.get("/ui/../openapi.json").status_code in (200, 404)  # normalised, not a file
        # The files hold no data; the data needs a token.
        assert c.get("/api/v1/history/facility").status_code == 401
        assert c.get("/api/v1/fleet").status_code == 401
    # Self-contained: nothing loaded from another host (the SVG namespace is a name, not a fetch).
    for name in TYPES:
        body = asset(name).decode()
        urls = set(re.findall(r"https?://[^\s'\")]+", body)) - {"http://www.w3.org/2000/svg"}
        assert not urls, f"{name} refers to {urls}"
    assert "innerHTML" not in asset("app.js").decode()  # fleet strings go in as text only


def test_page_refuses_without_a_token_and_with_a_wrong_one(live_ui: LiveApi, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    browser.get(f"{live_ui.url}/ui")
    until(browser, lambda d: shown(d, "signin"), "the sign-in form")
    assert not shown(browser, "app")

    browser.find_element(By.ID, "token").send_keys("pwd_" + "x" * 43)
    browser.find_element(By.CSS_SELECTOR, "#signin-form button").click()
    until(browser, lambda d: "refused" in text(d, "#signin-error"), "the refusal")
    assert not shown(browser, "app")
    assert text(browser, "#facility-budget") == "-"  # no data reached the page

    # A wrong token in the fragment: refused too, and out of the address bar.
    browser.get(f"{live_ui.url}/ui#token=pwd_wrong")
    until(browser, lambda d: "refused" in text(d, "#signin-error"), "the refusal")
    assert "token" not in browser.current_url and not shown(browser, "app")

    # The right one through the form.
    browser.find_element(By.ID, "token").send_keys(live_ui.tokens["viewer"])
    browser.find_element(By.CSS_SELECTOR, "#signin-form button").click()
    until(browser, lambda d: shown(d, "app") and not shown(d, "signin"), "the fleet")
    browser.find_element(By.ID, "sign-out").click()
    until(browser, lambda d: shown(d, "signin") and not shown(d, "app"), "the sign-in form")


def test_a_malformed_fragment_token_is_refused_and_leaves_the_address_bar(
    live_ui: LiveApi, browser: Any
) -> None:
    """`#token=%E0%A4%A` (a broken escape, a link cut short in a chat): decoding it threw,
    the page stopped before taking the token out of the address bar and never showed a
    sign-in form."""
    browser.get(f"{live_ui.url}/ui#token=pwd_%E0%A4%A")
    until(browser, lambda d: shown(d, "signin"), "the sign-in form")
    assert "token" not in browser.current_url and not shown(browser, "app")


def test_page_shows_the_fleet_and_follows_a_budget_cut(
    live_ui: LiveApi, browser: Any, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    viewer = live_ui.tokens["viewer"]
    with capture_logs() as logs:
        browser.get(f"{live_ui.url}/ui#token={viewer}")
        until(browser, lambda d: shown(d, "app"), "the fleet")
        assert viewer not in browser.current_url  # the fragment is dropped once read

        # The known fleet: 1 row, 2 racks of 2 nodes of 2 GPUs, under 4 kW (test_api.POLICY).
        until(browser, lambda d: text(d, "#facility-budget") == "4000 W", "the facility budget")
        assert text(browser, "#gpus-count") == "8" and text(browser, "#nodes-count") == "4"
        levels = {"site": 4000, "row-1": 3800, "rack-1": 2000, "rack-2": 2000}
        levels |= dict.fromkeys(NODES, 1500)
        t = tree(browser)
        assert {n: g["budget_w"] for n, g in t.items()} == levels
        for name, budget_w in levels.items():
            assert f"{budget_w} W budget" in t[name]["nums"], name
        assert {n: g["parent"] for n, g in t.items()} == {
            "site": None,
            "row-1": "site",
            "rack-1": "row-1",
            "rack-2": "row-1",
        } | {n: f"rack-{n[5]}" for n in NODES}
        assert [n for n, g in t.items() if g["level"] == "node"] == NODES  # policy order
        # What the page shows is what the API says, at the same tick.
        with live_ui.client("viewer") as c:

            def same_as_api(d: Any) -> bool:
                api = {g["name"]: g for g in c.get("/api/v1/groups").json()["items"]}
                page = tree(d)
                return all(
                    page[n]["committed_w"] == g["committed_w"] and page[n]["draw_w"] == g["draw_w"]
                    for n, g in api.items()
                )

            until(browser, same_as_api, "the API's committed caps and draw")

            # A node opens to its GPUs.
            browser.execute_script(
                "document.querySelector('[data-group=\"rack-2-n1\"] > .line').click()"
            )
            gpus = until(browser, lambda d: tree(d)["rack-2-n1"]["gpus"], "the node's GPUs")
            api_gpus = c.get("/api/v1/gpus", params={"node": "rack-2-n1"}).json()["items"]
            assert [g["uuid"] for g in gpus] == [g["uuid"] for g in api_gpus]
            for g, a in zip(gpus, api_gpus, strict=True):
                assert g["class"] == a["class"] and g["job"] == (a.get("job") or "-")
                assert g["state"].startswith(a["state"])
            until(
                browser,
                lambda d: int(d.find_element(By.ID, "chart").get_attribute("data-points") or 0),
                "the facility's history from the store",
            )
            # The start counted every GPU at its maximum (8 × 700 W + 400 W = 6 kW against
            # 4 kW): the chart keeps its scale at the budget's (5 kW) and marks that spike.
            hist = c.get("/api/v1/history/facility").json()["points"]
            peak = max(max(p["committed_w"] or 0, p["draw_max_w"] or 0) for p in hist)
            assert peak > 1.2 * 4000
            chart = until(
                browser,
                lambda d: (
                    int((e := d.find_element(By.ID, "chart")).get_attribute("data-off-scale")) and e
                ),
                "the start-up spike marked above the scale",
            )
            assert float(chart.get_attribute("data-top-w")) == 5000
            assert shown(browser, "chart-off-scale")
            assert text(browser, "#chart text.off-scale") == f"{peak:.0f} W"  # the highest

            def alarms_as_api(d: Any) -> bool:
                kinds = [a["kind"] for a in c.get("/api/v1/alarms").json()]
                shown = d.execute_script(
                    "return [...document.querySelectorAll('#alarms li')]"
                    ".map((e) => e.dataset.kind || e.textContent)"
                )
                return bool(shown == (kinds or ["none"]))

            until(browser, alarms_as_api, "the API's alarms")

        # A budget cut through the API: the page follows without a reload.
        marker = browser.execute_script("return window.performance.timeOrigin")
        with live_ui.client("operator") as c:
            r = c.put("/api/v1/budgets/site", json={"budget_w": 3000, "reason": "ui test"})
            assert r.status_code == 200, r.text
        until(browser, lambda d: text(d, "#facility-budget") == "3000 W", "the cut budget")
        until(
            browser,
            lambda d: (
                (site := tree(d)["site"])["budget_w"] == 3000
                and site["committed_w"] <= 3000 + TOL_W  # (caps filled to the budget: float sums)
                and not site["over"]
            ),
            "committed caps under the cut",
        )
        assert browser.execute_script("return window.performance.timeOrigin") == marker

        out = Path(os.environ.get("POWERD_UI_ARTIFACTS") or tmp_path)
        out.mkdir(parents=True, exist_ok=True)
        shot = out / "powerd-ui.png"
        browser.set_window_size(1400, 1300)
        assert browser.save_screenshot(str(shot))
        print(f"screenshot: {shot}")
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000

    # The token never reached a log line (it travels only in the Authorization header).
    assert not [e for e in logs if viewer in repr(e)]


def test_facility_history_endpoint(live_ui: LiveApi) -> None:
    with live_ui.client("viewer") as c:
        hist = wait_until(
            lambda: (
                (h := c.get("/api/v1/history/facility", params={"window_s": 600}).json())["points"]
                and h
            ),
            "stored ticks",
        )
        assert hist["source"] == "store" and hist["step_s"] == 600 / 360
        assert hist["until"] - hist["since"] == pytest.approx(600)
        ticks = c.get("/api/v1/ticks", params={"limit": 1000}).json()
        for p in hist["points"]:
            assert hist["since"] <= p["ts"] <= hist["until"] and p["ticks"] >= 1
            assert p["budget_w"] == 4000
            assert p["draw_w"] <= p["draw_max_w"]
        # Every stored tick in the window is counted once.
        in_window = [t for t in ticks if t["ts"] >= hist["since"]]
        assert 1 <= sum(p["ticks"] for p in hist["points"]) <= len(in_window)
        assert c.get("/api/v1/history/facility", params={"points": 5}).status_code == 422
        assert c.get("/api/v1/history/facility", params={"window_s": 1e9}).status_code == 422


def test_history_intervals_keep_cuts_and_peaks() -> None:
    inf = float("inf")
    rows = [
        # ts, budget, committed, draw
        (100.0, 4000.0, 3900.0, 3000.0),
        (105.0, 3000.0, 3950.0, 3600.0),  # a cut: the interval shows the lower budget
        (109.9, 3000.0, 2900.0, 2400.0),
        (110.0, inf, 2800.0, float("nan")),  # no budget; a missing reading
        (131.0, 3000.0, 2800.0, 2000.0),  # 120-130 empty: left out
    ]
    points = bucketed(rows, since=100.0, step_s=10.0)
    assert [(p.ts, p.ticks) for p in points] == [(109.9, 3), (110.0, 1), (131.0, 1)]
    first = points[0]
    assert (first.budget_w, first.committed_w, first.draw_max_w) == (3000.0, 3950.0, 3600.0)
    assert first.draw_w == pytest.approx(3000.0)
    assert points[1].budget_w is None and points[1].draw_w is None
    assert bucketed([], since=0.0, step_s=1.0) == []


@pytest.mark.process
def test_demo_serves_the_live_page(browser: Any, tmp_path: Path) -> None:
    """`powerd demo --ui 0` prints a sign-in link to the page, which shows the example site."""
    args = ["demo", "--nodes", "16", "--duration", "90", "--ui", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "powerd.cli", *args, "--db", f"sqlite:///{tmp_path / 'demo.db'}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        assert proc.stdout is not None
        link = ""
        for line in proc.stdout:
            if line.startswith("live page: "):
                link = line.removeprefix("live page: ").strip()
                break
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/ui#token=pwd_[\w-]+", link), link
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep it unblocked
        browser.get(link)
        until(browser, lambda d: text(d, "#facility-budget") == "250.0 kW", "the site's budget")
        t = until(browser, lambda d: len(tree(d)) > 16 and tree(d), "the tree", timeout_s=30)
        assert [n for n, g in t.items() if g["level"] == "node"] == [
            f"row-1-rack-{r}-node-{k:02d}" for r in (1, 2) for k in range(1, 9)
        ]
        assert text(browser, "#gpus-count") == "128"
        browser.execute_script(
            "document.querySelector('[data-group=\"row-1-rack-1-node-01\"] > .line').click()"
        )
        until(browser, lambda d: len(tree(d)["row-1-rack-1-node-01"]["gpus"]) == 8, "its GPUs")
        out = Path(os.environ.get("POWERD_UI_ARTIFACTS") or tmp_path)
        out.mkdir(parents=True, exist_ok=True)
        shot = out / "powerd-ui-demo.png"
        assert browser.save_screenshot(str(shot))
        print(f"screenshot: {shot}")

        # Racks closed (a large site's default): no node is shown or read until its rack
        # opens; then only that rack's nodes.
        browser.get("about:blank")
        browser.get(link + "&racks=closed")
        t = until(browser, lambda d: "row-1-rack-2" in (t := tree(d)) and t, "the racks")
        assert [g["level"] for g in t.values()] == ["facility", "row", "rack", "rack"]
        browser.execute_script(
            "document.querySelector('[data-group=\"row-1-rack-2\"] > .line').click()"
        )
        t = until(browser, lambda d: len(tree(d)) > 4 and tree(d), "the open rack's nodes")
        assert [n for n, g in t.items() if g["level"] == "node"] == [
            f"row-1-rack-2-node-{k:02d}" for k in range(1, 9)
        ]
        assert all(t[f"row-1-rack-2-node-{k:02d}"]["parent"] == "row-1-rack-2" for k in (1, 8))
    finally:
        proc.terminate()
        proc.wait(30)


def test_page_shows_the_scope_and_its_leader(tmp_path: Path, browser: Any) -> None:
    api = LiveApi(tmp_path, leadership=True).start()
    try:
        browser.get(f"{api.url}/ui#token={api.tokens['viewer']}")
        fields = until(
            browser,
            lambda d: d.execute_script(
                "return Object.fromEntries([...document.querySelectorAll("
                "'#leadership dd')].map((e) => [e.dataset.field, e.textContent]))"
            ),
            "the leadership",
        )
        with api.client("viewer") as c:
            lead = c.get("/api/v1/leadership").json()
        assert lead["scope"] == "site" and lead["role"] == "leader" and lead["epoch"] >= 1
        assert fields["scope"] == "site" and fields["mode"] == "alone"
        assert fields["this controller"] == f"{lead['controller']} (leader)"
        assert fields["leader"] == lead["leader"] and fields["epoch"] == str(lead["epoch"])
        assert fields["standbys"] == "none"
    finally:
        api.close()


def test_page_shows_an_alarm_and_its_clearing(live_ui: LiveApi, browser: Any) -> None:
    browser.get(f"{live_ui.url}/ui#token={live_ui.tokens['viewer']}")
    until(browser, lambda d: text(d, "#facility-budget") == "4000 W", "the fleet")
    alarms_js = "return [...document.querySelectorAll('#alarms li')].map((e) => e.dataset.kind)"
    with live_ui.client("operator") as c:
        # Below the device minimums (8 × 200 W) plus node overheads (4 × 100 W).
        r = c.put("/api/v1/budgets/site", json={"budget_w": 1500, "reason": "ui alarm test"})
        assert r.status_code == 200, r.text
        until(browser, lambda d: "infeasible_min" in d.execute_script(alarms_js), "the alarm")
        message = c.get("/api/v1/alarms").json()
        shown = text(browser, '#alarms li[data-kind="infeasible_min"]')
        assert shown == "infeasible_min" + next(
            a["message"] for a in message if a["kind"] == "infeasible_min"
        )
        assert text(browser, "#alarms-count") == str(len(message))
        assert c.delete("/api/v1/budgets/site", params={"reason": "over"}).status_code == 200
        until(browser, lambda d: "infeasible_min" not in d.execute_script(alarms_js), "clearing")
