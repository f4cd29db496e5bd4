#!/usr/bin/env bash
# check-report.sh REPORT.html [SCREENSHOT.png]
# Renders an infergate HTML report (bench/plan --html) in headless Chromium,
# writes a screenshot (default: REPORT.png next to it) and checks that the
# rendered DOM holds what produced the report (command, version, workload,
# clock) and its SVG charts with non-empty paths: for bench the ITL
# percentiles and the hit rate with its reference lines when the run has
# them, for plan one chart per SLO target with its threshold line; and that
# the file references no external resource. Installs chromium with apt-get
# if missing. e2e/reports_test.go checks the same on real runs, values
# included.
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
flags=(--headless --no-sandbox --disable-gpu --disable-quic --disable-background-networking
	--disable-component-update --disable-sync --no-first-run --disable-default-apps
	--disable-extensions --hide-scrollbars --user-data-dir="$profile" --window-size=1400,3000)

"$bin" "${flags[@]}" --screenshot="$shot" "file://$abs" 2>/dev/null
[ -s "$shot" ] || { echo "FAIL: no screenshot" >&2; exit 1; }
dom=$("$bin" "${flags[@]}" --dump-dom "file://$abs" 2>/dev/null)

fail=0
svgs=$(grep -o '<svg' <<<"$dom" | wc -l)
paths=$(grep -oE '<path d="M[0-9]' <<<"$dom" | wc -l)
rows=$(grep -oE '<tr[ >]' <<<"$dom" | wc -l)
echo "rendered DOM: $svgs svg, $paths non-empty paths, $rows table rows; screenshot $shot"
[ "$svgs" -ge 2 ] || { echo "FAIL: fewer than 2 <svg> charts" >&2; fail=1; }
[ "$paths" -ge 1 ] || { echo "FAIL: no non-empty <path d=\"M...\">" >&2; fail=1; }
[ "$rows" -ge 2 ] || { echo "FAIL: summary table has no rows" >&2; fail=1; }
need() { # need PATTERN WHAT
	grep -qE "$1" <<<"$dom" || { echo "FAIL: no $2" >&2; fail=1; }
}
for f in command version revision go host start clock workload lag; do
	[ "$f" = lag ] && grep -q '<h1>infergate plan' <<<"$dom" && continue
	need "<tr data-field=\"$f\">" "$f row (provenance)"
done
if grep -q '<h1>infergate plan' <<<"$dom"; then
	need '<figure data-chart="slo-' "chart per SLO target"
	need 'class="hline"[^>]*data-key="slo"' "SLO threshold line"
	need '<tr data-field="recommendation">' "recommendation row"
else
	need '<figure data-chart="itl-percentiles">' "ITL percentile chart"
	need '<figure data-chart="hit-rate">' "hit-rate chart"
	if grep -q 'data-field="fleet"' <<<"$dom"; then
		need 'data-key="pooled"' "pooled-cache reference line"
	fi
fi
# Resources, not text: a --target run names its URL in the page.
if grep -qiE '<(script|link|img|iframe|object|embed)[ >]|(src|href)=|url\(|@import' "$report"; then
	echo "FAIL: external resource reference in $report" >&2
	fail=1
fi
[ "$fail" = 0 ] && echo OK
exit "$fail"
