#!/usr/bin/env bash
# Prepare tests/test_ui.py (Debian/Ubuntu CI images; run as root for apt-get):
#
#   PYTHON=.venv/bin/python bash tracking/ci_ui.sh
#
# Installs Debian's `chromium` (the test drives /usr/bin/chromium; Playwright's own browser
# download, `playwright install`, is never used) and pip-installs `playwright` into $PYTHON
# (default: `python`, else `python3`); the wheel carries Playwright's driver. Safe to run again.
# It never fails the build: what it cannot do it reports as "ci_ui: skipped: <why>", exits 0,
# and the UI test then skips with its own reason.
set -u

PY=${PYTHON:-$(command -v python || command -v python3)}
LOG=${TMPDIR:-/tmp}/vitreg-ci-ui.log
status=0

say() { echo "ci_ui: $*"; }
: >"$LOG"

if [ -x /usr/bin/chromium ]; then
    say "chromium present: $(/usr/bin/chromium --version 2>/dev/null | head -1)"
elif [ "$(id -u)" != 0 ]; then
    say "skipped: chromium is not installed and installing it needs root (apt-get install chromium)"; status=1
elif ! command -v apt-get >/dev/null; then
    say "skipped: chromium is not installed and there is no apt-get"; status=1
else
    say "installing the Debian chromium package"
    export DEBIAN_FRONTEND=noninteractive
    if apt-get install -y -qq chromium >>"$LOG" 2>&1 \
        || { apt-get update -qq >>"$LOG" 2>&1 \
             && apt-get install -y -qq chromium >>"$LOG" 2>&1; }; then
        say "chromium installed: $(/usr/bin/chromium --version 2>/dev/null | head -1)"
    else
        say "skipped: apt-get install chromium failed (see $LOG)"; status=1
    fi
fi

if [ -z "$PY" ]; then
    say "skipped: no python found; set PYTHON=/path/to/python"; status=1
elif "$PY" -c "import playwright.sync_api" 2>/dev/null; then
    say "playwright present in $PY"
else
    say "installing playwright into $PY"
    if "$PY" -m pip install -q playwright >>"$LOG" 2>&1; then
        say "playwright installed"
    else
        say "skipped: pip install playwright failed (see $LOG)"; status=1
    fi
fi

[ "$status" = 0 ] && say "ready"
exit 0
