package gateway

import (
	"fmt"
	"log/slog"
	"net/url"
	"strings"
)

// ObservabilityConfig is the part of Config about what the gateway tells
// its operator besides the metrics: the log's level and format, the access
// log, the response header naming the endpoint that served, and
// OpenTelemetry traces (README "Observability"). Config embeds it, so its
// keys are top-level YAML keys.
type ObservabilityConfig struct {
	// Log is the process log's level and format (`infergate serve` builds
	// its logger from it; the access log follows its format).
	Log LogConfig `yaml:"log"`
	// AccessLog writes one line per API request (accesslog.go).
	AccessLog AccessLogConfig `yaml:"access_log"`
	// ResponseHeaders are optional headers the gateway adds to answers.
	ResponseHeaders ResponseHeadersConfig `yaml:"response_headers"`
	// Tracing exports OpenTelemetry traces of the inference requests
	// (tracing.go); off unless an OTLP endpoint is set.
	Tracing TracingConfig `yaml:"tracing"`
}

// LogConfig is the process log's level and format.
type LogConfig struct {
	// Level is the least severe level logged: debug, info (default), warn
	// or error. The gateway itself logs through log/slog's default logger;
	// `infergate serve` sets that logger from this key (--log-level
	// overrides it).
	Level string `yaml:"level"`
	// Format is text (default: slog's key=value lines) or json (one JSON
	// object per line, slog's JSONHandler). The access log is written in
	// the same format.
	Format string `yaml:"format"`
}

// Log formats (LogConfig.Format).
const (
	LogFormatText = "text"
	LogFormatJSON = "json"
)

// ParseLogLevel parses a log.level value: debug, info, warn or error (any
// case; "" is info).
func ParseLogLevel(s string) (slog.Level, error) {
	switch strings.ToLower(s) {
	case "debug":
		return slog.LevelDebug, nil
	case "", "info":
		return slog.LevelInfo, nil
	case "warn", "warning":
		return slog.LevelWarn, nil
	case "error":
		return slog.LevelError, nil
	}
	return 0, fmt.Errorf("log level %q: want debug, info, warn or error", s)
}

// ParseLogFormat parses a log.format value: text or json (any case; "" is
// text).
func ParseLogFormat(s string) (string, error) {
	switch strings.ToLower(s) {
	case "", LogFormatText:
		return LogFormatText, nil
	case LogFormatJSON:
		return LogFormatJSON, nil
	}
	return "", fmt.Errorf("log format %q: want text or json", s)
}

// AccessLogConfig configures the access log: one structured line per API
// request (README "Observability").
type AccessLogConfig struct {
	// Enabled turns the access log on. Absent: off for a gateway embedded
	// with gateway.New, on for `infergate serve` and `infergate up`
	// (--access-log=false turns it off there).
	Enabled *bool `yaml:"enabled"`
	// Path is where the lines go: "" or "stderr" (default, with the
	// process log), "stdout", or a file, appended to (created with mode
	// 0640).
	Path string `yaml:"path"`
}

// On reports whether the access log is enabled.
func (a AccessLogConfig) On() bool { return a.Enabled != nil && *a.Enabled }

// ResponseHeadersConfig selects optional response headers.
type ResponseHeadersConfig struct {
	// Endpoint sets EndpointHeader (X-Infergate-Endpoint) on every answer
	// that came from an endpoint: the name (normalized base URL) of the
	// last endpoint tried. Off by default: it tells clients the fleet's
	// internal addresses.
	Endpoint bool `yaml:"endpoint"`
}

// TracingConfig configures OpenTelemetry traces (OTLP over HTTP, protobuf).
type TracingConfig struct {
	// OTLPEndpoint is the collector's OTLP/HTTP URL, e.g.
	// "http://otel-collector:4318" (/v1/traces is appended when the URL
	// has no path; https uses the system's roots). Empty (default):
	// tracing is off and costs nothing. The exporter's other settings
	// (headers, timeout, compression) come from the standard
	// OTEL_EXPORTER_OTLP_* environment variables.
	OTLPEndpoint string `yaml:"otlp_endpoint"`
	// SampleRatio is the share of new traces recorded, 0 to 1 (default 1);
	// a request that carries a traceparent follows its sampled flag.
	SampleRatio *float64 `yaml:"sample_ratio"`
	// ServiceName is the service.name resource attribute. Empty: the
	// OTEL_SERVICE_NAME environment variable, else "infergate"
	// (OTEL_RESOURCE_ATTRIBUTES is read too; this key wins over both).
	ServiceName string `yaml:"service_name"`
}

// DefaultServiceName is tracing.service_name's default.
const DefaultServiceName = "infergate"

// withDefaults fills zero fields.
func (o ObservabilityConfig) withDefaults() ObservabilityConfig {
	if f, err := ParseLogFormat(o.Log.Format); err == nil {
		o.Log.Format = f
	}
	if o.Tracing.SampleRatio == nil {
		one := 1.0
		o.Tracing.SampleRatio = &one
	}
	return o
}

// validate reports the observability settings' errors.
func (o ObservabilityConfig) validate() []error {
	var errs []error
	if _, err := ParseLogLevel(o.Log.Level); err != nil {
		errs = append(errs, fmt.Errorf("log.level: %w", err))
	}
	if _, err := ParseLogFormat(o.Log.Format); err != nil {
		errs = append(errs, fmt.Errorf("log.format: %w", err))
	}
	if t := o.Tracing; t.OTLPEndpoint != "" {
		if _, err := otlpTracesURL(t.OTLPEndpoint); err != nil {
			errs = append(errs, fmt.Errorf("tracing.otlp_endpoint: %w", err))
		}
	}
	if r := o.Tracing.SampleRatio; r != nil && !(*r >= 0 && *r <= 1) {
		errs = append(errs, fmt.Errorf("tracing.sample_ratio %v: want 0 to 1", *r))
	}
	return errs
}

// otlpTracesURL is the OTLP/HTTP traces URL for an otlp_endpoint: the URL
// as given when it has a path, else with /v1/traces (the base-URL reading
// of OTEL_EXPORTER_OTLP_ENDPOINT).
func otlpTracesURL(raw string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return "", err
	}
	switch {
	case u.Scheme != "http" && u.Scheme != "https":
		return "", fmt.Errorf("%q: scheme must be http or https", raw)
	case u.Host == "":
		return "", fmt.Errorf("%q: no host", raw)
	case u.User != nil:
		return "", fmt.Errorf("%q: credentials in the URL are not supported (use OTEL_EXPORTER_OTLP_HEADERS)", raw)
	}
	if u.Path == "" || u.Path == "/" {
		u.Path = "/v1/traces"
	}
	return u.String(), nil
}
