#!/usr/bin/env bash
# Build (once) and locate a CPU-only Ollama binary for the end-to-end tests.
#
#   scripts/ollama.sh build   build Ollama into the cache if missing; print its path
#   scripts/ollama.sh path    print the cached binary's path (exit 1 if not built)
#   scripts/ollama.sh up [N]  build if needed, generate the tiny model, start N (2)
#                             instances on loopback, print a gateway config for
#                             them on stdout; Ctrl-C stops them all
#
# The binary lives outside the repository, keyed by version and CPU flags:
#   ${INFERGATE_CACHE:-$HOME/.cache/infergate}/ollama/<version>-<march>/ollama
#
# Environment:
#   INFERGATE_CACHE        cache root (default $HOME/.cache/infergate)
#   OLLAMA_VERSION         Ollama module version (default v0.17.4)
#   OLLAMA_MARCH           -march level for cgo (default x86-64-v3; without SIMD
#                          flags llama.cpp prefill is 10-20x slower)
#
# How it builds: a throwaway Go module in a temporary directory runs
# `go get github.com/ollama/ollama@<version>` and `go build` with cgo. Go module
# zips drop llama.cpp's vendor/ folder, so the build needs Debian's
# nlohmann-json3-dev (nlohmann/json.hpp) and libstb-dev (stb/stb_image.h), plus a
# small stub for miniaudio/miniaudio.h that this script writes into the cache:
# only the ma_decoder* calls of tools/mtmd/mtmd-helper.cpp are declared, and they
# always fail (audio input is unsupported; text models are unaffected).
# The finished binary is renamed into place atomically, so a concurrent or
# interrupted build never leaves a half-written binary at the final path.
set -euo pipefail

VERSION="${OLLAMA_VERSION:-v0.17.4}"
MARCH="${OLLAMA_MARCH:-x86-64-v3}"
CACHE_ROOT="${INFERGATE_CACHE:-${HOME:-/root}/.cache/infergate}"
DIR="$CACHE_ROOT/ollama/$VERSION-$MARCH"
BIN="$DIR/ollama"
APT_PACKAGES=(nlohmann-json3-dev libstb-dev)
case ":$PATH:" in *:/usr/local/go/bin:*) ;; *) PATH="$PATH:/usr/local/go/bin" ;; esac

log() { printf 'ollama.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

usage() {
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

need_cmd() { command -v "$1" >/dev/null 2>&1 || die "'$1' not found in PATH${2:+ ($2)}"; }

check_cpu() {
  case "$MARCH" in
    x86-64-v3)
      local f
      for f in avx2 fma bmi2 f16c; do
        grep -qw "$f" /proc/cpuinfo 2>/dev/null ||
          die "this CPU lacks '$f', required by -march=$MARCH; set OLLAMA_MARCH=x86-64-v2 (slower)"
      done ;;
  esac
}

pkg_installed() {
  dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'
}

ensure_apt_packages() {
  local missing=() p
  for p in "${APT_PACKAGES[@]}"; do pkg_installed "$p" || missing+=("$p"); done
  [ "${#missing[@]}" -eq 0 ] && return 0
  need_cmd apt-get "install ${missing[*]} by hand"
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || die "missing packages ${missing[*]} and not root (no sudo)"
    sudo=(sudo)
  fi
  log "installing apt packages: ${missing[*]}"
  if ! DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q "${missing[@]}" >&2; then
    log "apt-get install failed; running apt-get update and retrying"
    "${sudo[@]}" apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q "${missing[@]}" >&2 ||
      die "could not install ${missing[*]}"
  fi
}

write_miniaudio_stub() {
  local inc="$1/miniaudio"
  mkdir -p "$inc"
  cat >"$inc/miniaudio.h.tmp.$$" <<'EOF'
/* Stub of miniaudio.h for building Ollama from the Go module zip, which drops
 * llama.cpp's vendor/ folder. Written by infergate's scripts/ollama.sh.
 * Declares only what tools/mtmd/mtmd-helper.cpp uses (ma_decoder_*); every
 * decode fails, so audio inputs are rejected. Text models are unaffected. */
#ifndef INFERGATE_MINIAUDIO_STUB_H
#define INFERGATE_MINIAUDIO_STUB_H
#include <stddef.h>
#include <stdint.h>

typedef int ma_result;
typedef uint32_t ma_uint32;
typedef uint64_t ma_uint64;

#define MA_SUCCESS 0
#define MA_ERROR (-1)
#define MA_NOT_IMPLEMENTED (-29)

typedef enum {
  ma_format_unknown = 0,
  ma_format_u8 = 1,
  ma_format_s16 = 2,
  ma_format_s24 = 3,
  ma_format_s32 = 4,
  ma_format_f32 = 5
} ma_format;

typedef struct {
  ma_format format;
  ma_uint32 channels;
  ma_uint32 sampleRate;
} ma_decoder_config;

typedef struct {
  int unused;
} ma_decoder;

static inline ma_decoder_config ma_decoder_config_init(ma_format f, ma_uint32 ch, ma_uint32 rate) {
  ma_decoder_config c;
  c.format = f;
  c.channels = ch;
  c.sampleRate = rate;
  return c;
}
static inline ma_result ma_decoder_init_memory(const void *data, size_t size,
                                               const ma_decoder_config *cfg, ma_decoder *dec) {
  (void)data; (void)size; (void)cfg;
  if (dec) dec->unused = 0;
  return MA_NOT_IMPLEMENTED;
}
static inline ma_result ma_decoder_get_length_in_pcm_frames(ma_decoder *dec, ma_uint64 *n) {
  (void)dec;
  if (n) *n = 0;
  return MA_NOT_IMPLEMENTED;
}
static inline ma_result ma_decoder_read_pcm_frames(ma_decoder *dec, void *out, ma_uint64 n, ma_uint64 *read) {
  (void)dec; (void)out; (void)n;
  if (read) *read = 0;
  return MA_NOT_IMPLEMENTED;
}
static inline ma_result ma_decoder_uninit(ma_decoder *dec) {
  (void)dec;
  return MA_SUCCESS;
}
#endif
EOF
  mv -f "$inc/miniaudio.h.tmp.$$" "$inc/miniaudio.h"
}

build() {
  if [ -x "$BIN" ]; then
    echo "$BIN"
    return 0
  fi
  need_cmd go "install Go (expected at /usr/local/go/bin)"
  need_cmd gcc "cgo needs a C compiler"
  need_cmd g++ "cgo needs a C++ compiler"
  check_cpu
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

  ensure_apt_packages
  write_miniaudio_stub "$DIR/include"

  local work start
  work="$(mktemp -d "${TMPDIR:-/tmp}/infergate-ollama-build.XXXXXX")"
  # shellcheck disable=SC2064
  trap "rm -rf '$work' '$BIN.tmp.$$'" EXIT
  start=$(date +%s)
  log "building github.com/ollama/ollama@$VERSION (-O3 -march=$MARCH); takes ~5 min cold on 2 cores"
  (
    cd "$work"
    export GOWORK=off GOFLAGS=-mod=mod GO111MODULE=on
    go mod init infergate.local/ollamabuild >/dev/null 2>&1
    go get "github.com/ollama/ollama@$VERSION" >&2
    CGO_ENABLED=1 \
    CGO_CPPFLAGS="-I$DIR/include" \
    CGO_CFLAGS="-O3 -march=$MARCH" \
    CGO_CXXFLAGS="-O3 -march=$MARCH" \
      go build -trimpath -o "$BIN.tmp.$$" github.com/ollama/ollama >&2
  ) || die "build failed (see output above)"
  "$BIN.tmp.$$" --version >/dev/null 2>&1 || log "warning: '$BIN.tmp.$$ --version' failed"
  mv -f "$BIN.tmp.$$" "$BIN"
  log "built in $(( $(date +%s) - start ))s: $BIN"
  echo "$BIN"
}

case "${1:-}" in
  build) build ;;
  path)
    if [ -x "$BIN" ]; then echo "$BIN"; else log "not built: $BIN (run: $0 build)"; exit 1; fi ;;
  up)
    build >/dev/null
    cd "$(dirname "$0")/.."
    INFERGATE_OLLAMA="$BIN" exec go run ./scripts/ollama-up -n "${2:-2}" ;;
  -h|--help|help|"") usage ;;
  *) log "unknown command '$1'"; usage ;;
esac
