#!/usr/bin/env bash
# Gateway overhead vs nginx, on one machine (bench/README.md "Proxy overhead").
#
# Starts ENGINES simulated engines (infergate sim, time scale TIME_SCALE so
# the engine model costs ~nothing), then drives the same closed-loop load —
# CONCURRENCY streaming completions in flight, PROMPT_TOKENS token ids each,
# MAX_TOKENS output tokens — for DURATION against:
#   direct        the engines themselves (worker i → engine i mod N)
#   nginx         Debian nginx: least_conn upstream, HTTP/1.1 keep-alive to the
#                 engines, proxy_buffering off (config generated below)
#   round-robin   infergate serve --policy round-robin
#   prefix        infergate serve --policy prefix
#   cache-aware   infergate serve --policy cache-aware (the default)
#   go-reverseproxy  (opt-in) a plain Go reverse proxy: net/http server,
#                 httputil.ReverseProxy, http.Transport, round-robin — what
#                 Go costs before any gateway logic
# and prints req/s, end-to-end p50/p99 and the latency each proxy adds over
# direct, with ratios against nginx, and each proxy's CPU time per request.
# The targets run in turn ROUNDS times (default 3) and the table shows
# medians, so a burst of other load on the machine hits every target alike.
# Results: $OUT/results.jsonl, $OUT/proxy-cpu.txt, table in $OUT/table.md.
# PROFILE=1 also records a CPU profile of infergate (prefix, last round)
# under the load ($OUT/cpu-prefix.prof; infergate serve --pprof).
#
#   bench/overhead/run.sh
#   ENGINES=4 CONCURRENCY=32 DURATION=10s ROUNDS=5 PROFILE=1 OUT=/tmp/oh bench/overhead/run.sh
#
# Everything (engines, proxies, load generator) shares the machine's cores,
# so absolute numbers are a floor; compare rows of one run.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="/usr/local/go/bin:$PATH"

ENGINES="${ENGINES:-4}"
CONCURRENCY="${CONCURRENCY:-32}"
DURATION="${DURATION:-10s}"
WARMUP="${WARMUP:-3s}"
PROMPT_TOKENS="${PROMPT_TOKENS:-16}"
MAX_TOKENS="${MAX_TOKENS:-8}"
TIME_SCALE="${TIME_SCALE:-100000}"
BASE_PORT="${BASE_PORT:-18100}"
TARGETS="${TARGETS:-direct nginx round-robin prefix cache-aware}"
ROUNDS="${ROUNDS:-3}" # the targets in turn, ROUNDS times; the table shows medians
# BASELINE_BIN=/path/to/other/infergate adds the target "baseline": that
# binary with --policy $BASELINE_POLICY (to measure a change against the build before it).
BASELINE_BIN="${BASELINE_BIN:-}"
# BASELINE_POLICY is the baseline binary's --policy (default prefix); compare
# like with like (e.g. round-robin on both: the proxy's cost without routing).
BASELINE_POLICY="${BASELINE_POLICY:-prefix}"
if [ -n "$BASELINE_BIN" ] && [[ " $TARGETS " != *" baseline "* ]]; then TARGETS="$TARGETS baseline"; fi
PROFILE="${PROFILE:-0}"
# PROXY_ENV="K=V ..." is set for the infergate processes only (e.g. GOMAXPROCS=1).
NGINX="${NGINX:-$(command -v nginx || echo /usr/sbin/nginx)}"
OUT="${OUT:-$(mktemp -d /tmp/infergate-overhead.XXXXXX)}"
mkdir -p "$OUT"
WORK="$(mktemp -d /tmp/infergate-overhead-work.XXXXXX)"

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

echo "== build"
go build -o "$WORK/infergate" ./cmd/infergate
go build -o "$WORK/overhead" ./bench/overhead

# wait_http URL: poll until it answers 200 (10 s).
wait_http() {
  for _ in $(seq 100); do
    if curl -fsS -o /dev/null "$1" 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "no answer from $1" >&2
  return 1
}

echo "== $ENGINES engines (time scale $TIME_SCALE)"
engine_urls=()
endpoint_flags=()
upstreams=""
for i in $(seq 1 "$ENGINES"); do
  port=$((BASE_PORT + i))
  "$WORK/infergate" sim --listen "127.0.0.1:$port" --model m --time-scale "$TIME_SCALE" \
    >"$OUT/engine-$i.log" 2>&1 &
  pids+=($!)
  engine_urls+=("http://127.0.0.1:$port")
  endpoint_flags+=(--endpoint "http://127.0.0.1:$port=m")
  upstreams+="    server 127.0.0.1:$port;"$'\n'
done
for u in "${engine_urls[@]}"; do wait_http "$u/health"; done

# cpu_ticks PID...: user+system CPU clock ticks of the processes and their
# child processes (nginx workers).
cpu_ticks() {
  local total=0 p
  for p in "$@" $(pgrep -P "$1" 2>/dev/null || true); do
    [ -r "/proc/$p/stat" ] || continue
    total=$((total + $(awk '{print $14 + $15}' "/proc/$p/stat")))
  done
  echo "$total"
}

load() { # label base-urls [proxy-pid]
  local before=0
  [ -n "${3:-}" ] && before=$(cpu_ticks "$3")
  "$WORK/overhead" run --label "$1" --target "$2" --concurrency "$CONCURRENCY" --duration "$DURATION" \
    --warmup "$WARMUP" --prompt-tokens "$PROMPT_TOKENS" --max-tokens "$MAX_TOKENS" --out "$OUT/results.jsonl"
  if [ -n "${3:-}" ]; then # the proxy's CPU over the whole load, warm-up included
    local after; after=$(cpu_ticks "$3")
    echo "$1 $(awk -v t=$((after - before)) -v hz="$(getconf CLK_TCK)" 'BEGIN{print t/hz}')" >>"$OUT/proxy-cpu.txt"
  fi
}

stop_last() { # stop the most recently started proxy
  local p="${pids[-1]}"
  kill "$p" 2>/dev/null || true
  wait "$p" 2>/dev/null || true
  unset 'pids[-1]'
}

rm -f "$OUT/results.jsonl" "$OUT/proxy-cpu.txt"
proxy_port=$((BASE_PORT + 90))
for round in $(seq 1 "$ROUNDS"); do
for target in $TARGETS; do
  echo "== $target (round $round of $ROUNDS)"
  case "$target" in
  direct)
    load direct "$(IFS=,; echo "${engine_urls[*]}")"
    ;;
  nginx)
    mkdir -p "$WORK/nginx"
    cat >"$WORK/nginx/nginx.conf" <<EOF
daemon off;
master_process on;
worker_processes auto;
pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $WORK/nginx/body;
  proxy_temp_path $WORK/nginx/proxy;
  fastcgi_temp_path $WORK/nginx/fastcgi;
  uwsgi_temp_path $WORK/nginx/uwsgi;
  scgi_temp_path $WORK/nginx/scgi;
  upstream engines {
    least_conn;
$upstreams    keepalive 256;
  }
  server {
    listen 127.0.0.1:$proxy_port;
    keepalive_requests 100000;
    location / {
      proxy_pass http://engines;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_cache off;
    }
  }
}
EOF
    "$NGINX" -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" &
    pids+=($!)
    wait_http "http://127.0.0.1:$proxy_port/health"
    load nginx "http://127.0.0.1:$proxy_port" "${pids[-1]}"
    stop_last
    ;;
  go-reverseproxy)
    "$WORK/overhead" reverseproxy --listen "127.0.0.1:$proxy_port" \
      --endpoints "$(IFS=,; echo "${engine_urls[*]}")" >"$OUT/go-reverseproxy.log" 2>&1 &
    pids+=($!)
    wait_http "http://127.0.0.1:$proxy_port/health"
    load go-reverseproxy "http://127.0.0.1:$proxy_port" "${pids[-1]}"
    stop_last
    ;;
  *)
    bin="$WORK/infergate" policy="$target"
    if [ "$target" = baseline ]; then bin="$BASELINE_BIN" policy="$BASELINE_POLICY"; fi
    extra=()
    if [ "$PROFILE" = 1 ] && [ "$target" = prefix ] && [ "$round" = "$ROUNDS" ]; then
      extra=(--pprof "127.0.0.1:$((proxy_port + 1))")
    fi
    env ${PROXY_ENV:-} "$bin" serve --listen "127.0.0.1:$proxy_port" --policy "$policy" "${endpoint_flags[@]}" "${extra[@]}" \
      >"$OUT/infergate-$target.log" 2>&1 &
    pids+=($!)
    wait_http "http://127.0.0.1:$proxy_port/readyz"
    if [ ${#extra[@]} -gt 0 ]; then
      secs="${DURATION%s}"
      (sleep "${WARMUP%s}"; curl -fsS -o "$OUT/cpu-prefix.prof" \
        "http://127.0.0.1:$((proxy_port + 1))/debug/pprof/profile?seconds=$secs") &
      prof_pid=$!
      load "$target" "http://127.0.0.1:$proxy_port" "${pids[-1]}"
      wait "$prof_pid" || true
      cp "$WORK/infergate" "$OUT/infergate.bin" # for go tool pprof
    else
      load "$target" "http://127.0.0.1:$proxy_port" "${pids[-1]}"
    fi
    stop_last
    ;;
  esac
done
done

echo
echo "== $(nproc) cores, $ENGINES engines, concurrency $CONCURRENCY, $DURATION per target and round, $ROUNDS rounds," \
  "$PROMPT_TOKENS-token prompts, max_tokens $MAX_TOKENS (load generator, engines and proxy share the cores;" \
  "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg))"
"$WORK/overhead" table "$OUT/results.jsonl" "$OUT/proxy-cpu.txt" | tee "$OUT/table.md"
echo "results: $OUT"
