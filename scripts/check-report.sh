#!/usr/bin/env bash
# check-report.sh REPORT.html [SCREENSHOT.png]
# Renders an infergate HTML report (bench/plan --html) in headless Chromium,
# writes a screenshot (default: REPORT.png next to it) and checks that the
# rendered DOM holds the report's SVG charts with non-empty paths and no
# external resource references. Installs chromium with apt-get if missing.
set -euo pipefail
report=${1:?usage: check-report.sh REPORT.html [SCREENSHOT.png]}
shot=${2:-${report%.html}.png}
[ -f "$report" ] || { echo "no such file: $report" >&2; exit 2; }
abs=$(cd "$(dirname "$report")" && pwd)/$(basename "$report")
case $shot in /*) ;; *) shot=$PWD/$shot ;; esac

bin=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$bin" ]; then
	echo "chromium missing: installing with apt-get" >&2
	apt-get update
	DEBIAN_FRONTEND=noninteractive apt-get install -y chromium
	bin=$(command -v chromium)
fi

profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
flags=(--headless --no-sandbox --disable-gpu --disable-background-networking
	--disable-component-update --disable-sync --no-first-run
	--user-data-dir="$profile" --window-size=1400,3000)

"$bin" "${flags[@]}" --screenshot="$shot" "file://$abs" 2>/dev/null
[ -s "$shot" ] || { echo "FAIL: no screenshot" >&2; exit 1; }
dom=$("$bin" "${flags[@]}" --dump-dom "file://$abs" 2>/dev/null)

fail=0
svgs=$(grep -o '<svg' <<<"$dom" | wc -l)
paths=$(grep -oE '<path d="M[0-9]' <<<"$dom" | wc -l)
rows=$(grep -o '<tr>' <<<"$dom" | wc -l)
echo "rendered DOM: $svgs svg, $paths non-empty paths, $rows table rows; screenshot $shot"
[ "$svgs" -ge 2 ] || { echo "FAIL: fewer than 2 <svg> charts" >&2; fail=1; }
[ "$paths" -ge 1 ] || { echo "FAIL: no non-empty <path d=\"M...\">" >&2; fail=1; }
[ "$rows" -ge 2 ] || { echo "FAIL: summary table has no rows" >&2; fail=1; }
if grep -qiE '<(script|link|img|iframe)[^>]+(src|href)=|https?://' "$report"; then
	echo "FAIL: external resource reference in $report" >&2
	fail=1
fi
[ "$fail" = 0 ] && echo OK
exit "$fail"
