#!/usr/bin/env bash
# replicas-live.sh: issue 17's HA figures on live processes. Starts one
# simulated fleet of `infergate sim` engines running --time-scale SPEEDUP,
# a redis-server on loopback (shared runs only; no persistence, its files in
# a temp dir, as internal/redistest starts it), REPLICAS `infergate serve`
# processes in front of the fleet (with a `replicas` section: shared; without:
# unshared), and replays a workload with `infergate bench --target`, the
# requests dealt round robin per request over the replicas (an L4 front that
# balances per request and retries a refused connect on the next replica).
# With KILL=1 the replica at position 1 is sent SIGKILL just before the middle
# request is sent, and bench reports which requests failed and how. bench
# scrapes the engines' infergate_sim_step_lag_seconds after the replay: a run
# whose fleet lag p99 exceeds --max-lag (100 ms of engine time by default) is
# marked BEHIND and bench exits 1 (its latencies measure the host, not the
# modelled hardware).
#
#   REPLICAS=3 SHARED=1 KILL=0 SPEEDUP=2 scripts/replicas-live.sh --requests 1000
#   REPLICAS=1 scripts/replicas-live.sh --workload shared-prefix
#
# Environment (defaults): REPLICAS (3), SHARED (1), KILL (0), ENGINES (8),
# SPEEDUP (2), POLICY (cache-aware), KV_EVENTS (1 when POLICY reads the
# engines' KV events: precise-prefix, dynamo, tiered ones; else 0: every
# engine publishes vLLM's ZeroMQ KV events on a loopback port of its own,
# --kv-events-config, and each replica subscribes, kv_events.endpoint), SEED (1: routing.seed; a replica's seed is
# mixed with its id when shared, and SEED+i when unshared, as replicas
# configured alike but started apart would), LOAD_INTERVAL (200ms), STAGGER
# (true: replicas.stagger), SIM_CPUS and GW_CPUS (unset: a taskset
# --cpu-list for the engines, and for the replicas, redis and bench, to keep
# the fleet's steps off the cores the gateways contend for), INFERGATE
# (a built binary; default: go build into $WORK), OUT (a folder kept for the
# logs, records and JSON report; default: a temp dir removed at exit),
# SCRAPE_INTERVAL (unset: the gateway's scrape_interval, 1s),
# PROFILE (unset: seconds of CPU profile of every replica, taken with --pprof
# from 5 s into the replay, kept as gwI.cpu.pprof). After the replay the script
# prints each process's CPU seconds spent during it (utime + stime from
# /proc/PID/stat): every replica, redis-server and the engines together,
# and redis's bytes in and out over the run (INFO stats).
# Arguments are passed to `infergate bench` (workload, --requests, --records,
# --out, --max-lag ...).
set -euo pipefail

REPLICAS=${REPLICAS:-3}
SHARED=${SHARED:-1}
KILL=${KILL:-0}
ENGINES=${ENGINES:-8}
SPEEDUP=${SPEEDUP:-2}
POLICY=${POLICY:-cache-aware}
SEED=${SEED:-1}
LOAD_INTERVAL=${LOAD_INTERVAL:-200ms}
STAGGER=${STAGGER:-true}
MODEL=m
case $POLICY in
precise-prefix | dynamo | llm-d-tiered | dynamo-tiered | tiered-cost) KV_EVENTS=${KV_EVENTS:-1} ;;
*) KV_EVENTS=${KV_EVENTS:-0} ;;
esac
SIM_CPUS=${SIM_CPUS:-}
GW_CPUS=${GW_CPUS:-}
# Command prefixes pinning to SIM_CPUS / GW_CPUS when set (taskset execs
# the command: $! stays the process's own pid).
pin_sim=() pin_gw=()
if [[ -n $SIM_CPUS ]]; then pin_sim=(taskset --cpu-list "$SIM_CPUS"); fi
if [[ -n $GW_CPUS ]]; then pin_gw=(taskset --cpu-list "$GW_CPUS"); fi

WORK=$(mktemp -d)
OUT=${OUT:-}
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
	for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
	if [[ -n $OUT ]]; then mkdir -p "$OUT" && cp -r "$WORK"/. "$OUT"/; fi
	rm -rf "$WORK"
}
trap cleanup EXIT

root=$(cd "$(dirname "$0")/.." && pwd)
bin=${INFERGATE:-}
if [[ -z $bin ]]; then
	bin=$WORK/infergate
	(cd "$root" && go build -o "$bin" ./cmd/infergate)
fi

# await LOG: the first http://host:port a process logs as addr=... (60 s).
await() {
	local log=$1 addr=""
	for _ in $(seq 600); do
		addr=$(grep -v 'pprof listening' "$log" 2>/dev/null | grep -o 'addr=http://[0-9.:]*' | head -1 | cut -d= -f2 || true)
		[[ -n $addr ]] && { echo "$addr"; return; }
		sleep 0.1
	done
	echo "no address in $log:" >&2
	cat "$log" >&2
	exit 1
}

freeport() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

engines=()
kvports=()
for i in $(seq 0 $((ENGINES - 1))); do
	kv=()
	if [[ $KV_EVENTS == 1 ]]; then
		kvports[$i]=$(freeport)
		kv=(--kv-events-config "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://127.0.0.1:${kvports[$i]}\",\"bind\":true}")
	fi
	"${pin_sim[@]}" "$bin" sim --listen 127.0.0.1:0 --time-scale "$SPEEDUP" --model "$MODEL" "${kv[@]}" \
		>"$WORK/sim$i.log" 2>&1 &
	pids+=($!)
done
for i in $(seq 0 $((ENGINES - 1))); do engines+=("$(await "$WORK/sim$i.log")"); done

redis=""
if [[ $SHARED == 1 && $REPLICAS -gt 1 ]]; then
	port=$(freeport)
	"${pin_gw[@]}" redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$WORK" \
		--daemonize no --logfile "$WORK/redis.log" &
	pids+=($!)
	for _ in $(seq 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
	redis=redis://127.0.0.1:$port
fi

targets=()
gwpids=()
pports=()
for i in $(seq 0 $((REPLICAS - 1))); do
	seed=$SEED
	[[ -z $redis ]] && seed=$((SEED + i))
	cfg=$WORK/gw$i.yaml
	{
		echo "listen: 127.0.0.1:0"
		# As bench --compare's gateway: no active probes of a loopback fleet
		# (a probe timing out measures the host's load), a long connect.
		echo "health_check_path: \"-\""
		echo "connect_timeout: 1m"
		[[ -n ${SCRAPE_INTERVAL:-} ]] && echo "scrape_interval: $SCRAPE_INTERVAL"
		echo "routing: {policy: $POLICY, seed: $seed, prefix: {block_size: 16}}"
		[[ -n $redis ]] && echo "replicas: {redis_url: \"$redis\", stream: live, id: gw-$i, load_interval: $LOAD_INTERVAL, stagger: $STAGGER}"
		echo "endpoints:"
		for k in "${!engines[@]}"; do
			if [[ $KV_EVENTS == 1 ]]; then
				echo "  - {url: \"${engines[$k]}\", model: $MODEL, kind: sim, kv_events: {endpoint: \"tcp://127.0.0.1:${kvports[$k]}\"}}"
			else
				echo "  - {url: \"${engines[$k]}\", model: $MODEL, kind: sim}"
			fi
		done
	} >"$cfg"
	pprof=()
	if [[ -n ${PROFILE:-} ]]; then
		pports[$i]=$(freeport)
		pprof=(--pprof "127.0.0.1:${pports[$i]}")
	fi
	"${pin_gw[@]}" "$bin" serve -c "$cfg" --access-log=false "${pprof[@]}" >"$WORK/gw$i.log" 2>&1 &
	pids+=($!)
	gwpids+=($!)
done
for i in $(seq 0 $((REPLICAS - 1))); do targets+=("$(await "$WORK/gw$i.log")"); done

if [[ -n $redis ]]; then
	# Every replica hears the others before the replay (30 s).
	for t in "${targets[@]}"; do
		for _ in $(seq 300); do
			n=$(curl -s "$t/metrics" | awk '/^infergate_replica_peers /{print $2}')
			[[ ${n:-0} == "$((REPLICAS - 1))" ]] && break
			sleep 0.1
		done
	done
fi

args=(bench --target "$(IFS=,; echo "${targets[*]}")" --time-scale "$SPEEDUP" --speedup "$SPEEDUP"
	--model "$MODEL" --fleet "$(IFS=,; echo "${engines[*]}")")
if [[ $KILL == 1 ]]; then
	[[ $REPLICAS -ge 2 ]] || { echo "KILL=1 needs REPLICAS >= 2" >&2; exit 2; }
	args+=(--kill-pid "${gwpids[1]}" --kill-target 1)
fi
echo "replicas=$REPLICAS shared=$SHARED kill=$KILL engines=$ENGINES speedup=$SPEEDUP policy=$POLICY kv_events=$KV_EVENTS seed=$SEED; load: $(uptime | sed 's/.*load average: //')"
# cpu PID: its CPU seconds so far (utime + stime, /proc/PID/stat fields 14
# and 15, in clock ticks); 0 for a process gone.
tck=$(getconf CLK_TCK)
cpu() { awk -v t="$tck" '{sub(/^.*\) /, ""); printf "%.2f", ($12 + $13) / t}' "/proc/$1/stat" 2>/dev/null || echo 0; }
cpu0=()
for p in "${pids[@]}"; do cpu0+=("$(cpu "$p")"); done
profpids=()
if [[ -n ${PROFILE:-} ]]; then
	for i in "${!pports[@]}"; do
		(sleep 5 && curl -s --max-time $((PROFILE + 30)) -o "$WORK/gw$i.cpu.pprof" \
			"http://127.0.0.1:${pports[$i]}/debug/pprof/profile?seconds=$PROFILE") &
		profpids+=($!)
	done
fi
rc=0
"${pin_gw[@]}" "$bin" "${args[@]}" "$@" || rc=$?
for p in "${profpids[@]}"; do wait "$p" || true; done
sims=0
for k in "${!pids[@]}"; do
	d=$(awk -v a="${cpu0[$k]}" -v b="$(cpu "${pids[$k]}")" 'BEGIN{printf "%.2f", b - a}')
	if [[ $k -lt $ENGINES ]]; then sims=$(awk -v a="$sims" -v b="$d" 'BEGIN{printf "%.2f", a + b}'); continue; fi
	name=redis
	for g in "${!gwpids[@]}"; do [[ ${gwpids[$g]} == "${pids[$k]}" ]] && name=replica$g; done
	echo "cpu seconds during the replay: $name $d"
done
echo "cpu seconds during the replay: engines $sims"
if [[ -n $redis ]]; then
	# The stream's traffic over the whole run (XADDs in, XREADs out) and
	# its entries: bytes per request = in / requests.
	redis-cli -p "$port" info stats | tr -d '\r' | awk -F: '/^total_net_(input|output)_bytes/{printf "redis %s %s\n", $1, $2}'
	echo "redis stream entries: $(redis-cli -p "$port" xlen live | tr -d '\r')"
fi
# The replicas' own metrics (the exchange, the stagger's waits), kept with
# OUT: a killed replica has none.
for i in "${!targets[@]}"; do curl -s --max-time 10 "${targets[$i]}/metrics" >"$WORK/gw$i.metrics" || true; done
if [[ -n $redis ]]; then
	for i in "${!targets[@]}"; do
		awk -v i="$i" '/^infergate_replica_stagger_seconds_(sum|count)/{printf "replica %s %s %s\n", i, $1, $2}' "$WORK/gw$i.metrics"
	done
fi
echo "load after: $(uptime | sed 's/.*load average: //')"
exit $rc
