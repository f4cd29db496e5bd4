#!/usr/bin/env bash
# Build (once) and locate a Helm binary for the chart tests (deploy/helm).
#
#   scripts/helm.sh build   build Helm into the cache if missing; print its path
#   scripts/helm.sh path    print the cached binary's path (exit 1 if not built)
#
# The binary lives outside the repository, keyed by version:
#   ${INFERGATE_CACHE:-$HOME/.cache/infergate}/helm/<version>/helm
#
# Environment:
#   INFERGATE_CACHE        cache root (default $HOME/.cache/infergate)
#   HELM_VERSION           helm.sh/helm/v3 module version (default v3.22.0)
#
# How it builds: a throwaway Go module in a temporary directory runs
# `go get helm.sh/helm/v3@<version>` and `go build helm.sh/helm/v3/cmd/helm`
# (pure Go, CGO_ENABLED=0). v3.22.0's go.mod asks for go 1.26.0, so the
# installed Go 1.26.8 builds it without a toolchain download. The version
# string `helm version` prints is set with -ldflags as Helm's own Makefile does
# (internal/version.version). Cold build (empty GOCACHE, modules downloaded once
# into GOMODCACHE): about 4 CPU-minutes; 262 s wall on 2 cores at load average 2-12,
# 700 s at load average 14-22 (other jobs on the same cores). The finished binary is renamed into
# place atomically, so a concurrent or interrupted build never leaves a
# half-written binary at the final path.
set -euo pipefail

VERSION="${HELM_VERSION:-v3.22.0}"
MODULE="helm.sh/helm/v3"
CACHE_ROOT="${INFERGATE_CACHE:-${HOME:-/root}/.cache/infergate}"
DIR="$CACHE_ROOT/helm/$VERSION"
BIN="$DIR/helm"
case ":$PATH:" in *:/usr/local/go/bin:*) ;; *) PATH="$PATH:/usr/local/go/bin" ;; esac

log() { printf 'helm.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

usage() {
  sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

need_cmd() { command -v "$1" >/dev/null 2>&1 || die "'$1' not found in PATH${2:+ ($2)}"; }

build() {
  if [ -x "$BIN" ]; then
    echo "$BIN"
    return 0
  fi
  need_cmd go "install Go (expected at /usr/local/go/bin)"
  mkdir -p "$DIR"

  # One builder at a time; others wait, then find the binary in place.
  exec 9>"$DIR/.lock"
  if command -v flock >/dev/null 2>&1; then
    if ! flock -n 9; then
      log "another build holds $DIR/.lock; waiting"
      flock 9
    fi
  fi
  if [ -x "$BIN" ]; then
    echo "$BIN"
    return 0
  fi

  local work start
  work="$(mktemp -d "${TMPDIR:-/tmp}/infergate-helm-build.XXXXXX")"
  # shellcheck disable=SC2064
  trap "rm -rf '$work' '$BIN.tmp.$$'" EXIT
  start=$(date +%s)
  log "building $MODULE@$VERSION; about 4 CPU-minutes cold (4-12 min on 2 shared cores)"
  (
    cd "$work"
    export GOWORK=off GOFLAGS=-mod=mod GO111MODULE=on
    go mod init infergate.local/helmbuild >/dev/null 2>&1
    go get "$MODULE@$VERSION" >&2
    CGO_ENABLED=0 go build -trimpath \
      -ldflags "-s -w -X $MODULE/internal/version.version=$VERSION" \
      -o "$BIN.tmp.$$" "$MODULE/cmd/helm" >&2
  ) || die "build failed (see output above)"
  "$BIN.tmp.$$" version --short >/dev/null 2>&1 || die "'$BIN.tmp.$$ version' failed"
  mv -f "$BIN.tmp.$$" "$BIN"
  log "built in $(( $(date +%s) - start ))s: $BIN"
  echo "$BIN"
}

case "${1:-}" in
  build) build ;;
  path)
    if [ -x "$BIN" ]; then echo "$BIN"; else log "not built: $BIN (run: $0 build)"; exit 1; fi ;;
  -h|--help|help|"") usage ;;
  *) log "unknown command '$1'"; usage ;;
esac
