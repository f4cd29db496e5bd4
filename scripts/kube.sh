#!/usr/bin/env bash
# Build (once) and locate kube-apiserver and etcd for the tests that run against a real Kubernetes API server (internal/kubetest).
#
#   scripts/kube.sh build   build both binaries into the cache if missing; print the directory
#   scripts/kube.sh path    print the cached directory (exit 1 if either binary is missing)
#
# The binaries live outside the repository, keyed by version:
#   ${INFERGATE_CACHE:-$HOME/.cache/infergate}/kube/<kube version>/kube-apiserver
#   ${INFERGATE_CACHE:-$HOME/.cache/infergate}/kube/<kube version>/etcd
#
# Environment:
#   INFERGATE_CACHE        cache root (default $HOME/.cache/infergate)
#   KUBE_VERSION           k8s.io/kubernetes module version (default v1.37.2)
#   ETCD_VERSION           go.etcd.io/etcd/server/v3 module version (default v3.7.3)
#
# How it builds (pure Go, CGO_ENABLED=0, -trimpath, GOTOOLCHAIN=local):
#   kube-apiserver: k8s.io/kubernetes's go.mod replaces its staging modules
#     (k8s.io/api, k8s.io/apiserver, ...) with ./staging/src/... paths that the
#     module zip does not hold, so a throwaway module in a temporary directory
#     requires k8s.io/kubernetes@<version> and replaces every staging module
#     that go.mod lists with the published k8s.io/<name>@v0.<minor>.<patch>
#     (v1.37.2 -> v0.37.2), then builds k8s.io/kubernetes/cmd/kube-apiserver.
#     v1.37.2's go.mod asks for go 1.26.0, so the installed Go 1.26.8 builds it.
#     The version the binary reports is set with -ldflags as Kubernetes'
#     hack/lib/version.sh does (k8s.io/component-base/version.gitVersion etc.).
#   etcd: the server module's root package is etcd's main (main.go calling
#     etcdmain.Main), so a throwaway module gets go.etcd.io/etcd/server/v3
#     and builds it. v3.7.x is the line k8s.io/kubernetes v1.37 itself
#     requires; Debian's etcd-server (3.4.23) is older than the external etcd
#     kubeadm v1.37 accepts (cmd/kubeadm/app/constants: MinExternalEtcdVersion
#     3.5.24-0).
#
# Cold build, measured with `GOCACHE=$(mktemp -d) /usr/bin/time -v scripts/kube.sh build`
# (empty build cache; the modules downloaded in the same run): 16.4 CPU-minutes
# (739 s user + 246 s system) and 40 min wall on 2 cores at load average 14-19
# (other engineers' builds and tests on the same cores); etcd's part took
# 116 s wall. Peak memory of one compiler or linker process: 2.3 GB. On 2 idle
# cores the CPU figure puts it at 8-9 min wall (not measured idle).
# The binaries: kube-apiserver 119 MB, etcd 25 MB.
# Each finished binary is renamed into place atomically, so a concurrent or
# interrupted build never leaves a half-written binary at the final path.
set -euo pipefail

KUBE_VERSION="${KUBE_VERSION:-v1.37.2}"
ETCD_VERSION="${ETCD_VERSION:-v3.7.3}"
CACHE_ROOT="${INFERGATE_CACHE:-${HOME:-/root}/.cache/infergate}"
DIR="$CACHE_ROOT/kube/$KUBE_VERSION"
APISERVER="$DIR/kube-apiserver"
ETCD="$DIR/etcd"
case ":$PATH:" in *:/usr/local/go/bin:*) ;; *) PATH="$PATH:/usr/local/go/bin" ;; esac

log() { printf 'kube.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

usage() {
  sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

need_cmd() { command -v "$1" >/dev/null 2>&1 || die "'$1' not found in PATH${2:+ ($2)}"; }

built() { [ -x "$APISERVER" ] && [ -x "$ETCD" ]; }

# staging_version v1.37.2 -> v0.37.2
staging_version() {
  local v="${1#v}"
  case "$v" in
    1.*) echo "v0.${v#1.}" ;;
    *) die "unexpected KUBE_VERSION '$1' (want v1.<minor>.<patch>)" ;;
  esac
}

build_apiserver() {
  local work="$1" sv mod replaces=() name
  sv="$(staging_version "$KUBE_VERSION")"
  mkdir -p "$work/apiserver"
  cd "$work/apiserver"
  go mod init infergate.local/kubebuild >/dev/null 2>&1
  # The staging modules k8s.io/kubernetes's go.mod replaces with ./staging paths.
  mod="$(go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')"
  [ -f "$mod" ] || die "k8s.io/kubernetes@$KUBE_VERSION: go.mod not found"
  for name in $(sed -n 's#^[[:space:]]*\(k8s\.io/[a-z0-9-]*\) => \./staging/.*#\1#p' "$mod"); do
    replaces+=("-replace=$name=$name@$sv")
  done
  [ "${#replaces[@]}" -gt 0 ] || die "no staging replacements found in $mod"
  go mod edit -require="k8s.io/kubernetes@$KUBE_VERSION" "${replaces[@]}"
  go get "k8s.io/kubernetes/cmd/kube-apiserver@$KUBE_VERSION" >&2
  local v="${KUBE_VERSION#v}" major minor pkg ld=""
  major="${v%%.*}"; minor="${v#*.}"; minor="${minor%%.*}"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld="$ld -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
    ld="$ld -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  CGO_ENABLED=0 go build -trimpath -ldflags "-s -w $ld" \
    -o "$APISERVER.tmp.$$" k8s.io/kubernetes/cmd/kube-apiserver >&2
  "$APISERVER.tmp.$$" --version >/dev/null 2>&1 || die "'kube-apiserver --version' failed"
  mv -f "$APISERVER.tmp.$$" "$APISERVER"
}

build_etcd() {
  local work="$1"
  mkdir -p "$work/etcd"
  cd "$work/etcd"
  go mod init infergate.local/etcdbuild >/dev/null 2>&1
  go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >&2
  CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" \
    -o "$ETCD.tmp.$$" go.etcd.io/etcd/server/v3 >&2
  "$ETCD.tmp.$$" --version >/dev/null 2>&1 || die "'etcd --version' failed"
  mv -f "$ETCD.tmp.$$" "$ETCD"
}

build() {
  if built; then
    echo "$DIR"
    return 0
  fi
  need_cmd go "install Go (expected at /usr/local/go/bin)"
  mkdir -p "$DIR"

  # One builder at a time; others wait, then find the binaries in place.
  exec 9>"$DIR/.lock"
  if command -v flock >/dev/null 2>&1; then
    if ! flock -n 9; then
      log "another build holds $DIR/.lock; waiting"
      flock 9
    fi
  fi
  if built; then
    echo "$DIR"
    return 0
  fi

  local work start
  work="$(mktemp -d "${TMPDIR:-/tmp}/infergate-kube-build.XXXXXX")"
  # shellcheck disable=SC2064
  trap "chmod -R u+w '$work' 2>/dev/null; rm -rf '$work' '$APISERVER.tmp.$$' '$ETCD.tmp.$$'" EXIT
  export GOWORK=off GOFLAGS=-mod=mod GO111MODULE=on GOTOOLCHAIN=local
  start=$(date +%s)
  if [ ! -x "$ETCD" ]; then
    log "building etcd (go.etcd.io/etcd/server/v3@$ETCD_VERSION)"
    ( build_etcd "$work" ) || die "etcd build failed (see output above)"
    log "etcd built after $(( $(date +%s) - start ))s: $ETCD"
  fi
  if [ ! -x "$APISERVER" ]; then
    log "building kube-apiserver (k8s.io/kubernetes@$KUBE_VERSION); about 16 CPU-minutes cold (9-40 min on 2 shared cores)"
    ( build_apiserver "$work" ) || die "kube-apiserver build failed (see output above)"
    log "kube-apiserver built after $(( $(date +%s) - start ))s: $APISERVER"
  fi
  echo "$DIR"
}

case "${1:-}" in
  build) build ;;
  path)
    if built; then echo "$DIR"; else log "not built: $APISERVER, $ETCD (run: $0 build)"; exit 1; fi ;;
  -h|--help|help|"") usage ;;
  *) log "unknown command '$1'"; usage ;;
esac
