#!/usr/bin/env bash
# Regenerate the Go code of the .proto files this repository keeps
# (autoscale/externalscaler: KEDA's external scaler interface) without protoc.
#
#   scripts/protogen.sh     build the tools into the cache if missing, then regenerate
#
# The tools live outside the repository, keyed by version:
#   ${INFERGATE_CACHE:-$HOME/.cache/infergate}/protogen/<versions>/
# protoc-gen-go (google.golang.org/protobuf, the version go.mod requires) and
# protoc-gen-go-grpc are the standard plugins; scripts/protogen/main.go stands in
# for protoc: it compiles the .proto with github.com/bufbuild/protocompile and
# hands the plugins protoc's CodeGeneratorRequest (so the generated headers
# read "protoc (unknown)").
set -euo pipefail
cd "$(dirname "$0")/.."
PB_VERSION="$(go list -m -f '{{.Version}}' google.golang.org/protobuf)"
GRPC_GEN_VERSION="${GRPC_GEN_VERSION:-v1.6.2}"
COMPILE_VERSION="${PROTOCOMPILE_VERSION:-v0.14.1}"
CACHE_ROOT="${INFERGATE_CACHE:-${HOME:-/root}/.cache/infergate}"
DIR="$CACHE_ROOT/protogen/pb-$PB_VERSION-grpc-$GRPC_GEN_VERSION-pc-$COMPILE_VERSION"
if [ ! -x "$DIR/protogen" ] || [ ! -x "$DIR/protoc-gen-go" ] || [ ! -x "$DIR/protoc-gen-go-grpc" ]; then
  TMP="$(mktemp -d)"; trap 'rm -rf "$TMP"' EXIT
  sed "/^\/\/go:build ignore$/d" scripts/protogen/main.go >"$TMP/main.go"
  (cd "$TMP" && go mod init protogen >/dev/null 2>&1 &&
    go get "github.com/bufbuild/protocompile@$COMPILE_VERSION" "google.golang.org/protobuf@$PB_VERSION" &&
    mkdir -p "$DIR" && CGO_ENABLED=0 go build -o "$DIR/protogen.tmp" . && mv "$DIR/protogen.tmp" "$DIR/protogen" &&
    GOBIN="$DIR" CGO_ENABLED=0 go install "google.golang.org/protobuf/cmd/protoc-gen-go@$PB_VERSION" &&
    GOBIN="$DIR" CGO_ENABLED=0 go install "google.golang.org/grpc/cmd/protoc-gen-go-grpc@$GRPC_GEN_VERSION")
fi
cd autoscale/externalscaler
"$DIR/protogen" -I . -out . -plugin "$DIR/protoc-gen-go=paths=source_relative" \
  -plugin "$DIR/protoc-gen-go-grpc=paths=source_relative" externalscaler.proto
