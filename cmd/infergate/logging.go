package main

import (
	"io"
	"log/slog"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/infergate/infergate/gateway"
)

// logFlags are --log-level and --log-format (serve, up, sim), the process
// log's level and format; serve's config keys log.level and log.format
// give them too, the flags win.
type logFlags struct{ level, format string }

func (lf *logFlags) register(f *pflag.FlagSet) {
	f.StringVar(&lf.level, "log-level", "info", "log level: debug, info, warn or error")
	f.StringVar(&lf.format, "log-format", gateway.LogFormatText,
		"log format: text (key=value lines) or json (one JSON object per line); the access log of serve and up follows it")
}

// newLogHandler is the one place the process's log handler is built: slog's
// text or JSON handler on w at level (gateway.ParseLogLevel and
// ParseLogFormat's values).
func newLogHandler(w io.Writer, level, format string) (slog.Handler, error) {
	lv, err := gateway.ParseLogLevel(level)
	if err != nil {
		return nil, err
	}
	f, err := gateway.ParseLogFormat(format)
	if err != nil {
		return nil, err
	}
	opts := &slog.HandlerOptions{Level: lv}
	if f == gateway.LogFormatJSON {
		// Durations as the text handler writes them ("1m30s"), not as
		// slog's JSON integer nanoseconds.
		opts.ReplaceAttr = func(_ []string, a slog.Attr) slog.Attr {
			if a.Value.Kind() == slog.KindDuration {
				return slog.String(a.Key, a.Value.Duration().String())
			}
			return a
		}
		return slog.NewJSONHandler(w, opts), nil
	}
	return slog.NewTextHandler(w, opts), nil
}

// commandLog returns the command's --log-level and --log-format, the
// defaults for a command without them.
func commandLog(cmd *cobra.Command) (level, format string) {
	level, format = "info", gateway.LogFormatText
	if f := cmd.Flags().Lookup("log-level"); f != nil {
		level = f.Value.String()
	}
	if f := cmd.Flags().Lookup("log-format"); f != nil {
		format = f.Value.String()
	}
	return level, format
}

// setupLogging builds the command's logger from its flags, sets it as
// slog's default (the gateway and the engines log through it) and returns
// it. cfg, when not nil, is the gateway's log configuration: a flag given
// on the command line overrides it, and it is updated to what is used (the
// access log follows its format; resolveLog).
func setupLogging(cmd *cobra.Command, cfg *gateway.LogConfig) (*slog.Logger, error) {
	level, format := commandLog(cmd)
	if cfg != nil {
		if err := resolveLog(cmd, cfg); err != nil {
			return nil, err
		}
		level, format = cfg.Level, cfg.Format
	}
	h, err := newLogHandler(cmd.ErrOrStderr(), level, format)
	if err != nil {
		return nil, err
	}
	log := slog.New(h)
	slog.SetDefault(log)
	return log, nil
}

// resolveLog sets cfg to the log level and format used: a flag given on
// the command line, else cfg's own, else the flag's default. serve's
// configuration loader applies it at start and at every reload, so that a
// reload compares like with like (log.* keep their start value).
func resolveLog(cmd *cobra.Command, cfg *gateway.LogConfig) error {
	level, format := commandLog(cmd)
	if !cmd.Flags().Changed("log-level") && cfg.Level != "" {
		level = cfg.Level
	}
	if !cmd.Flags().Changed("log-format") && cfg.Format != "" {
		format = cfg.Format
	}
	if _, err := gateway.ParseLogLevel(level); err != nil {
		return err
	}
	f, err := gateway.ParseLogFormat(format)
	if err != nil {
		return err
	}
	cfg.Level, cfg.Format = level, f
	return nil
}

// newLogger is the command's logger (its flags, validated at start).
func newLogger(cmd *cobra.Command) *slog.Logger {
	level, format := commandLog(cmd)
	h, err := newLogHandler(cmd.ErrOrStderr(), level, format)
	if err != nil {
		h = slog.NewTextHandler(cmd.ErrOrStderr(), nil)
	}
	return slog.New(h)
}

// accessLogFlag registers --access-log (serve, up): the access log is on
// unless the flag or the config says otherwise.
func accessLogFlag(f *pflag.FlagSet, on *bool) {
	f.BoolVar(on, "access-log", true, "write one access log line per API request (overrides access_log.enabled)")
}

// applyAccessLog sets cfg's access log from --access-log: the flag when
// given, else the config's access_log.enabled, else on.
func applyAccessLog(cmd *cobra.Command, cfg *gateway.AccessLogConfig, on bool) {
	if cmd.Flags().Changed("access-log") || cfg.Enabled == nil {
		cfg.Enabled = &on
	}
}
