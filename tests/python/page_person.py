"""The person at the person's page (issue 45): Debian's headless chromium, driven by PyPI selenium
through Debian's chromedriver. Opens URL, signs in at oidc-provider's development login as USER
(any password) when the page sends it there, and then:

  show     reads what the page shows (title, message, the call's fields);
  approve  reads the call's fields, then presses Approve and reads the answer;
  deny     the same with Deny;
  session  reads the session cookie and the CSRF token of the signed-in page (for the tests'
           crafted requests).

Env: CHROMEDRIVER (default /usr/bin/chromedriver); TRUST_SPKI (a test page's key, the only one
trusted besides the system's); THEN_URL: once URL is done, the same browser (signed in where URL
signed it in) opens THEN_URL, and the report is of that page. Prints one JSON object as its last
line.
"""
import json
import os
import sys

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait

url, user, action = sys.argv[1], sys.argv[2], sys.argv[3]

options = webdriver.ChromeOptions()
for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
    options.add_argument(arg)
# A page on HTTPS with a test CA's certificate: trust that one key only (base64 SHA-256 of its
# SubjectPublicKeyInfo), not every certificate.
if os.environ.get("TRUST_SPKI"):
    options.add_argument("--ignore-certificate-errors-spki-list=" + os.environ["TRUST_SPKI"])
service = Service(executable_path=os.environ.get("CHROMEDRIVER", "/usr/bin/chromedriver"))
driver = webdriver.Chrome(service=service, options=options)
wait = WebDriverWait(driver, 30)
report = {"steps": []}


def text_of(element_id):
    found = driver.find_elements(By.ID, element_id)
    return found[0].text if found else None


def visit(to):
    driver.get(to)
    # The front page offers a sign-in; a link sends a person without a session there itself.
    if driver.find_elements(By.ID, "sign-in"):
        driver.find_element(By.ID, "sign-in").click()
    # The page sends a person without a session to the identity provider's login.
    wait.until(lambda d: d.find_elements(By.NAME, "login") or d.find_elements(By.TAG_NAME, "h1"))
    consent = "//button[contains(., 'Continue')]"
    if driver.find_elements(By.NAME, "login") or driver.find_elements(By.XPATH, consent):
        if driver.find_elements(By.NAME, "login"):
            report["steps"].append("provider login: " + driver.current_url.split("?")[0])
            driver.find_element(By.NAME, "login").send_keys(user)
            driver.find_element(By.NAME, "password").send_keys("any password")
            driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        # Back on the page (a consent screen, if the provider shows one, is continued).
        def back(d):
            if d.find_elements(By.XPATH, consent):
                report["steps"].append("provider consent: " + d.current_url.split("?")[0])
                d.find_element(By.XPATH, consent).click()
                return False
            return d.find_elements(By.ID, "principal") or d.find_elements(By.ID, "message")
        wait.until(back)


try:
    visit(url)
    if os.environ.get("THEN_URL"):
        report["first_title"] = driver.find_element(By.TAG_NAME, "h1").text
        visit(os.environ["THEN_URL"])
    report["url"] = driver.current_url
    report["title"] = driver.find_element(By.TAG_NAME, "h1").text
    report["message"] = text_of("message")
    report["principal"] = text_of("principal")
    for field in ("tool", "arguments", "resource", "policy", "turn", "agent", "approval", "waiting"):
        report[field] = text_of(field)
    report["links"] = [a.get_attribute("href") for a in driver.find_elements(By.CSS_SELECTOR, "#waiting a")]
    if action in ("approve", "deny"):
        driver.find_element(By.ID, action).click()
        wait.until(ec.presence_of_element_located((By.ID, "message")))
        report["answer_title"] = driver.find_element(By.TAG_NAME, "h1").text
        report["answer"] = text_of("message")
    if action == "session":
        report["cookies"] = {c["name"]: c["value"] for c in driver.get_cookies()}
        csrf = driver.find_elements(By.NAME, "csrf")
        report["csrf"] = csrf[0].get_attribute("value") if csrf else None
finally:
    driver.quit()
print(json.dumps(report))
