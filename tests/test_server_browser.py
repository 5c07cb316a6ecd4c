"""The web page in headless Chromium (Debian's chromium + chromium-driver, driven by selenium):
it loads, a message streams a reply, and the memory panel shows non-zero KV bytes."""

import os
import shutil
import subprocess
import tempfile
import time

import pytest

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
DRIVER = "/usr/bin/chromedriver"


def _find_browser():
    browser = next((p for p in CHROMIUM if os.path.exists(p)), None)
    return browser if browser and os.path.exists(DRIVER) else None


def _install() -> str | None:
    """apt-get install chromium chromium-driver when missing; the reason when impossible."""
    if _find_browser():
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "chromium and chromium-driver are missing and cannot be installed here (needs root and apt-get)"
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if r.returncode:
            return f"could not install chromium: {' '.join(cmd)} failed: {r.stderr.strip()[-300:]}"
    return None if _find_browser() else "chromium installed but not found at the expected paths"


@pytest.fixture(scope="module")
def browser():
    reason = _install()
    if reason:
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="hybridkv-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = _find_browser()
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1400,900"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=opts)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def wait_for(fn, timeout=30.0, what="condition"):
    """Poll fn until truthy. The page re-renders its memory table on every poll, so an element read
    mid-render can go stale: that counts as not yet."""
    from selenium.common.exceptions import StaleElementReferenceException
    deadline = time.time() + timeout
    while True:
        try:
            value = fn()
        except StaleElementReferenceException:
            value = None
        if value:
            return value
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_page_streams_a_reply_and_shows_memory(live_server, browser, tmp_path):
    from selenium.webdriver.common.by import By

    browser.get(live_server.url + "/")
    assert browser.title == "hybridkv"
    wait_for(lambda: browser.find_element(By.ID, "model").text == "tiny", what="the model name from /stats")
    capacity = wait_for(lambda: browser.find_element(By.ID, "kv-capacity-total").text not in ("–", ""),
                        what="the memory table")
    assert capacity
    # a message long enough to fill a KV block, so that it stays cached after the reply
    text = "Tell me about the quick brown fox. " * 20
    browser.find_element(By.ID, "max-tokens").clear()
    browser.find_element(By.ID, "max-tokens").send_keys("24")
    # greedy: at the page's default temperature the random model sometimes drew its EOS within a few tokens
    browser.find_element(By.ID, "temperature").clear()
    browser.find_element(By.ID, "temperature").send_keys("0")
    box = browser.find_element(By.ID, "input")
    browser.execute_script("arguments[0].value = arguments[1];", box, text)
    browser.find_element(By.ID, "send").click()
    reply = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".msg.assistant.done"), what="the reply")[0]
    assert "error" not in reply.get_attribute("class"), reply.text
    assert reply.find_element(By.CSS_SELECTOR, ".content").text.strip()
    assert "24 tokens" in reply.find_element(By.CSS_SELECTOR, ".meta").text
    cached = wait_for(lambda: int(browser.find_element(By.ID, "kv-cached-total").get_attribute("data-bytes") or 0),
                      what="non-zero cached KV bytes in the panel")
    assert cached > 0
    wait_for(lambda: any(r.text.startswith("device CSA main")
                         for r in browser.find_elements(By.CSS_SELECTOR, "#mem-table tbody tr")),
             what="the device CSA main row of the memory table")
    # the same conversation again: the panel's prefix hit rate goes above zero
    browser.find_element(By.ID, "clear").click()
    box = browser.find_element(By.ID, "input")
    browser.execute_script("arguments[0].value = arguments[1];", box, text)
    browser.find_element(By.ID, "send").click()
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".msg.assistant.done"), what="the second reply")
    wait_for(lambda: browser.find_element(By.ID, "hit-rate").text not in ("–", "0.0%"), what="a prefix hit rate")
    browser.save_screenshot(str(tmp_path / "page.png"))
    live_server.wait_idle()


def test_page_shows_the_lower_tiers(live_server, browser):
    """The tier table lists the host-DRAM tier of the prefix cache with the bytes it holds."""
    import httpx
    from selenium.webdriver.common.by import By

    prompt = list(range(2, 300))          # two complete blocks, written through to the DRAM tier
    assert httpx.post(live_server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2},
                      timeout=60).status_code == 200
    browser.get(live_server.url + "/")

    def dram_bytes():
        rows = [r for r in browser.find_elements(By.CSS_SELECTOR, "#tier-table tbody tr")
                if r.get_attribute("data-tier") == "dram"]
        return rows and int(rows[0].get_attribute("data-bytes") or 0)
    assert wait_for(dram_bytes, what="the DRAM tier's bytes in the tier table") > 0
    live_server.wait_idle()
