#!/usr/bin/env bash
# Run the policy × workload table of sched/README.md ("Evaluation against the peers") in virtual time, one
# `infergate plan` per workload, seed and policy, unattended and resumable: a result already on disk is kept.
#
#   scripts/policy-table.sh OUTDIR POLICIES [CONFIG]
#
#   OUTDIR     results: OUTDIR/<workload>-s<seed>-<policy>.json (plan --out), failures in OUTDIR/errors.log
#   POLICIES   comma-separated policies (built-in names or profiles of CONFIG), e.g.
#              cache-aware,cache-aware-ttft,least-request,llm-d,sglang,dynamo
#   CONFIG     optional gateway config (-c) whose routing section defines or tunes the profiles
#
# Environment:
#   INFERGATE  the binary (default: built once into OUTDIR/.bin from this checkout)
#   SEEDS      routing and engine seeds (default "0 1 2")
#   WORKLOADS  (default "mooncake azure shared-prefix chat agentic rag long-tail")
#   ENGINES    engines of the fleet (default 8; the table's size: another size belongs in another OUTDIR)
#
# 8 engines of the default profile, 2,000 requests of mooncake, azure (2,048-token system prompt, half the
# requests continuing a session), agentic, rag and long-tail, the whole of shared-prefix and chat; the SLO
# only decides plan's exit status, which is ignored here. Virtual time: the numbers do not depend on the
# host's load. About 2-30 s per run on 2 shared cores; run several at once with disjoint SEEDS.
#
# `infergate plan judge` reads OUTDIR and prints every workload-seed cell where a candidate misses issue 19's
# targets against the peers and least-request (plan/README.md, "Judging policies"), e.g.
#   infergate plan judge --incumbent base/cache-aware base/cache-aware lof=lof/cache-aware
set -euo pipefail
out=${1:?usage: scripts/policy-table.sh OUTDIR POLICIES [CONFIG]}
policies=${2:?usage: scripts/policy-table.sh OUTDIR POLICIES [CONFIG]}
config=${3:-}
mkdir -p "$out"
bin=${INFERGATE:-}
if [[ -z $bin ]]; then
	bin=$out/.bin/infergate
	if [[ ! -x $bin ]]; then
		mkdir -p "$out/.bin"
		go build -o "$bin" "$(dirname "$0")/../cmd/infergate"
	fi
fi
for seed in ${SEEDS:-0 1 2}; do
	for w in ${WORKLOADS:-mooncake azure shared-prefix chat agentic rag long-tail}; do
		for p in ${policies//,/ }; do
			f=$out/$w-s$seed-$p.json
			[[ -s $f ]] && continue
			args=(plan --engines "${ENGINES:-8}" --policy "$p" --slo ttft_p90=8s --seed "$seed" --workload "$w")
			case $w in
			mooncake | agentic | rag | long-tail) args+=(--requests 2000) ;;
			azure) args+=(--requests 2000 --azure-system-tokens 2048 --azure-session-prob 0.5) ;;
			esac
			[[ -n $config ]] && args+=(-c "$config")
			"$bin" "${args[@]}" --out "$f.tmp" >/dev/null 2>>"$out/errors.log" || true
			if [[ -s $f.tmp ]]; then
				mv "$f.tmp" "$f"
			else
				rm -f "$f.tmp"
				echo "policy-table: $w seed $seed $p failed (see $out/errors.log)" >&2
			fi
		done
	done
done
