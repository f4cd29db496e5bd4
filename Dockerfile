# syntax=docker/dockerfile:1
# infergate as a container image: one static binary (no cgo), the embedded
# traces included, on an empty base, running as a non-root user.
#
#   docker build -t infergate --build-arg VERSION=$(git describe --always --dirty) .
#   docker run --rm -p 8080:8080 infergate                   # up: gateway + 4 simulated engines
#   docker run --rm -p 8080:8080 -v $PWD/config.yaml:/etc/infergate/config.yaml:ro \
#     infergate serve -c /etc/infergate/config.yaml          # in front of real engines
#
# The image listens on 0.0.0.0:8080 (a container's loopback is not reachable
# from outside it); set auth keys (gateway/README.md, "Security") before
# exposing it. cmd/infergate/dockerfile_test.go builds the binary exactly as
# the build stage does and checks it is static and that the image runs as
# non-root.

ARG GO_VERSION=1.26.8

FROM golang:${GO_VERSION}-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=""
# The go build line is the one dockerfile_test.go runs.
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -X main.version=${VERSION}" -o /out/infergate ./cmd/infergate
# An /etc/passwd with only the unprivileged user the image runs as.
RUN echo 'infergate:x:65532:65532:infergate:/home/infergate:/sbin/nologin' > /out/passwd \
 && echo 'infergate:x:65532:' > /out/group \
 && mkdir -p /out/home/infergate /out/tmp && chmod 1777 /out/tmp

FROM scratch
# CA roots for engines and hosted backends reached over TLS.
COPY --from=build /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=build /out/passwd /etc/passwd
COPY --from=build /out/group /etc/group
COPY --from=build --chown=65532:65532 /out/home/infergate /home/infergate
COPY --from=build /out/tmp /tmp
COPY --from=build /out/infergate /usr/local/bin/infergate
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/infergate"]
CMD ["up", "--listen", "0.0.0.0:8080"]
